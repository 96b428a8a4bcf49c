"""``tiered-kv``: the command line of tiered_kv.

Usage: ``tiered-kv COMMAND [options]`` (or ``python -m tiered_kv.cli COMMAND ...``);
``tiered-kv COMMAND --help`` describes each command.

Exit codes (:class:`ExitCode`)::

    0  ok
    1  the command ran and found a problem (reserved, e.g. ``verify`` finding bad records)
    2  bad arguments or option values (argparse errors and rejected values alike)
    3  store missing: no prefix-cache store at the given path           (reserved)
    4  foreign layout: the store was written for another KV layout      (reserved)
    5  store locked: another process holds the store's writer lock      (reserved)
    6  endpoint unreachable: no connection to a server's URL (``warm-start --endpoint``)

Adding a command: create one module ``tiered_kv/cli/<name>.py`` that defines

* ``add_parser(subparsers) -> argparse.ArgumentParser`` — add its sub-parser to the
  ``subparsers`` action this module passes in, and
* ``run(args: argparse.Namespace) -> int`` — do the work, return an :class:`ExitCode`.

Every public module of this package (no leading underscore; not ``main``) is a command
and is found on start, so nothing else needs editing. Keep module-level imports light
(import torch and the stores inside ``run``): every command's module is imported for
every invocation. A ``run`` that rejects a value raises :class:`UsageError`; it is
printed as ``tiered-kv <command>: error: ...`` and exits 2.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import pkgutil
import sys
from collections.abc import Callable
from types import ModuleType

__all__ = ["ExitCode", "UsageError", "build_parser", "command_modules", "main"]

PROG = "tiered-kv"
#: Modules of this package that are not commands.
_NOT_COMMANDS = frozenset({"main"})


class ExitCode(enum.IntEnum):
    """Process exit codes of every ``tiered-kv`` command (see the module docstring)."""

    OK = 0
    FAILURE = 1
    USAGE = 2
    STORE_MISSING = 3
    FOREIGN_LAYOUT = 4
    STORE_LOCKED = 5
    ENDPOINT_UNREACHABLE = 6


class UsageError(Exception):
    """A command-line value was rejected; the message names what was expected."""


def command_modules() -> list[ModuleType]:
    """Every command module of ``tiered_kv.cli``, sorted by module name."""
    package = importlib.import_module(__package__ or "tiered_kv.cli")
    modules = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.name in _NOT_COMMANDS:
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for attr in ("add_parser", "run"):
            if not callable(getattr(module, attr, None)):
                raise TypeError(
                    f"{module.__name__}: a command module must define add_parser(subparsers) "
                    f"and run(args); missing {attr} (prefix helper modules with '_')"
                )
        modules.append(module)
    return modules


def build_parser() -> argparse.ArgumentParser:
    """The ``tiered-kv`` parser with every command's sub-parser."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tiered KV-cache memory for DeepSeek-V4-style attention.",
        epilog="exit codes: 0 ok, 1 problem found, 2 bad arguments, 3 store missing, "
               "4 foreign-layout store, 5 store locked, 6 endpoint unreachable",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in command_modules():
        sub = module.add_parser(subparsers)
        sub.set_defaults(_run=module.run, _parser=sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``tiered-kv`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad arguments, 0 on --help/--version
        return _exit_code(exc.code)
    run: Callable[[argparse.Namespace], int] = args._run
    try:
        return int(run(args))
    except UsageError as exc:
        print(f"{args._parser.prog}: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE


def _exit_code(code: object) -> int:
    if code is None:
        return ExitCode.OK
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return ExitCode.FAILURE


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiered-kv")
    except PackageNotFoundError:
        return "unknown"
