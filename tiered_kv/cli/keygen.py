"""``tiered-kv keygen PATH``: write a new master key file for encrypted stores.

::

    tiered-kv keygen /etc/tiered-kv/key-2026
    export TIERED_KV_KEY_FILE=/etc/tiered-kv/key-2026

Writes 32 random bytes (``os.urandom``) to a new file, mode 0o600, never overwriting
one; prints the key's id, the name stats and verify show for it (it reveals nothing of
the key). Distribute the file to the nodes of one fleet by your secret-management tool;
every node reads it with ``--key-file`` / ``TIERED_KV_KEY_FILE`` or the ``encryption``
option of a store.

Exit codes: 0 written, 1 the file exists or cannot be written, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .main import ExitCode

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "keygen",
        help="write a new master key file (32 random bytes, mode 0600) for encrypted stores",
        description="Write a new master key file for tenant-encrypted stores and print its key id.",
        epilog="exit codes: 0 written, 1 the file exists or cannot be written, 2 bad arguments",
    )
    p.add_argument("path", metavar="PATH", help="the key file to create (never overwritten)")
    return p


def run(args: argparse.Namespace) -> int:
    from ..storage.crypto import write_key_file

    try:
        key_id = write_key_file(args.path)
    except FileExistsError:
        print(f"tiered-kv keygen: error: {args.path} exists; a key file is never overwritten", file=sys.stderr)
        return ExitCode.FAILURE
    except OSError as exc:
        print(f"tiered-kv keygen: error: cannot write {args.path}: {exc.strerror}", file=sys.stderr)
        return ExitCode.FAILURE
    print(f"{args.path}: key id {key_id}")
    return ExitCode.OK
