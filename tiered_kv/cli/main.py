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
* ``run(args: argparse.Namespace) -> int`` — do the work, return an :class:`ExitCode`,

and give it a line in :data:`COMMANDS`: its name, its module and its one-line help.
Only the module of the command that runs is imported (``tiered-kv --help`` imports
none), so ``tiered-kv --help`` lists the help of :data:`COMMANDS`, a copy of the one
each module's ``add_parser`` gives (``tests/test_cli.py`` checks that they agree and
that every public module of this package is listed). Keep module-level imports light
(import torch and the stores inside ``run``): ``stats``, ``verify``, ``gc`` and the other
commands that compute no KV import no torch at all. A ``run`` that rejects a value
raises :class:`UsageError`; it is printed as ``tiered-kv <command>: error: ...`` and
exits 2.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType

__all__ = ["COMMANDS", "Command", "ExitCode", "UsageError", "build_parser", "command_modules", "main"]

PROG = "tiered-kv"


@dataclass(frozen=True, slots=True)
class Command:
    """One command: its module (``tiered_kv.cli.<module>``) and its one-line help."""

    module: str
    help: str


#: Every command by its name on the command line. Only the module of the command that
#: runs is imported; ``help`` is what ``tiered-kv --help`` lists (a copy of the help the
#: module's ``add_parser`` gives, checked by tests/test_cli.py).
COMMANDS: dict[str, Command] = {
    "gc": Command("gc", "evict least recently used records down to a byte bound"),
    "keygen": Command("keygen", "write a new master key file (32 random bytes, mode 0600), or a tenant's key "
                              "file derived from one"),
    "lookup": Command("lookup", "tokens of each prompt a store (or chain) could resume, per level, reading no record"),
    "ls": Command("ls", "the resume points each prompt would hit in a store"),
    "plan": Command("plan", "bytes per request and requests per GPU for a model preset"),
    "prefetch": Command("prefetch", "copy the records a prompt set would hit (or the most recent ones) from a "
                                    "shared store"),
    "rekey": Command("rekey", "move a store's records sealed under old master keys (or by an earlier version) "
                              "to a new key and its keyed names (resumable, loses nothing)"),
    "replay": Command("replay", "replay a Mooncake request trace through the real tiers: hits per tier, miss reasons"),
    "serve-reference": Command("serve_reference", "serve the reference model over an OpenAI-compatible "
                                                  "completions endpoint"),
    "stats": Command("stats", "records, bytes, counters and access times of a store"),
    "sync": Command("sync", "upload the local records a shared store lacks"),
    "verify": Command("verify", "check the index and every record's checksum; --repair removes the bad ones"),
    "warm-start": Command("warm_start", "prefill prompts with the reference model and persist their KV to a store"),
}


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


def command_module(name: str) -> ModuleType:
    """The module of command ``name`` (a key of :data:`COMMANDS`), imported now."""
    module = importlib.import_module(f"{__package__ or 'tiered_kv.cli'}.{COMMANDS[name].module}")
    for attr in ("add_parser", "run"):
        if not callable(getattr(module, attr, None)):
            raise TypeError(
                f"{module.__name__}: a command module must define add_parser(subparsers) "
                f"and run(args); missing {attr} (prefix helper modules with '_')"
            )
    return module


def command_modules() -> list[ModuleType]:
    """Every command module of ``tiered_kv.cli``, sorted by module name (imports them all)."""
    return [command_module(name) for name in sorted(COMMANDS, key=lambda n: COMMANDS[n].module)]


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``tiered-kv`` parser: the full sub-parser of each command in ``commands``
    (None: every command, importing every command module), a stand-in that only names the
    command and its help for the others (what ``tiered-kv --help`` shows)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Tiered KV-cache memory for DeepSeek-V4-style attention.",
        epilog="exit codes: 0 ok, 1 problem found, 2 bad arguments, 3 store missing, "
               "4 foreign-layout store, 5 store locked, 6 endpoint unreachable",
    )
    parser.add_argument("--version", action=_Version)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    full = set(COMMANDS) if commands is None else set(commands)
    for name, command in COMMANDS.items():
        if name in full:
            module = command_module(name)
            sub = module.add_parser(subparsers)
            sub.set_defaults(_run=module.run, _parser=sub)
        else:
            subparsers.add_parser(name, help=command.help, add_help=False)
    return parser


class _Version(argparse.Action):
    """``--version``, as argparse's own action prints it, with the installed version looked
    up only when asked (importlib.metadata costs more than the rest of ``--help``)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str = "show program's version number and exit") -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(f"{parser.prog} {_version()}")
        parser.exit()


def _command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first argument that is not an option (the
    top-level options, ``--help`` and ``--version``, take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    """Run ``tiered-kv`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser([name] if (name := _command_named(argv)) in COMMANDS else [])
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
