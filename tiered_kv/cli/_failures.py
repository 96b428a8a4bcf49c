"""How a store command fails: :class:`CommandFailed` (an exit code and a message) and
:func:`run_guarded`, which prints it as ``<prog>: error: ...`` and returns the code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from .main import ExitCode

__all__ = ["CommandFailed", "run_guarded"]


class CommandFailed(Exception):
    """A store command cannot go on; ``code`` is its :class:`ExitCode`."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_guarded(args: argparse.Namespace, body: Callable[[argparse.Namespace], int]) -> int:
    """Run ``body(args)``; a :class:`CommandFailed` is printed as ``<prog>: error: ...``
    and becomes its exit code (a :class:`UsageError` goes on to ``main``: exit 2)."""
    try:
        return int(body(args))
    except BrokenPipeError:  # stdout closed early (``tiered-kv stats | head``): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail
        return int(ExitCode.FAILURE)
    except CommandFailed as exc:
        parser = getattr(args, "_parser", None)
        prog = parser.prog if parser is not None else "tiered-kv"
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return int(exc.code)
