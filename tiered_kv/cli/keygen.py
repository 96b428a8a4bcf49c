"""``tiered-kv keygen PATH``: write a new master key file, or one tenant's key file, for encrypted stores.

::

    tiered-kv keygen /etc/tiered-kv/key-2026                                   # a master key
    tiered-kv keygen --tenant acme --from /etc/tiered-kv/key-2026 /etc/tiered-kv/acme-2026.key

A master key: 32 random bytes (``os.urandom``). Every tenant's keys derive from it, so a
node holding it can read and seal every tenant's records. A *tenant key file*
(``--tenant T --from MASTER``) holds tenant T's secret, derived from the master key, and
the tenant's name, not the master key: a node given it (``--key-file`` /
``TIERED_KV_KEY_FILE`` / the ``encryption`` option's ``key_files``) serves tenant T and
cannot derive any other tenant's keys; its tenant is taken from the file. Keep the master
key with whoever rotates keys; hand nodes tenant key files.

Either file is written new, mode 0o600, never overwriting one, fsynced with its
directory; the command prints the (master) key's id, the name stats and verify show for
it (it reveals nothing of the key). Distribute the files by your secret-management tool.

Exit codes: 0 written, 1 the file exists or cannot be written, 2 bad arguments (a bad
``--from`` key file, ``--tenant`` without ``--from``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .main import ExitCode, UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "keygen",
        help="write a new master key file (32 random bytes, mode 0600), or a tenant's key file derived from one",
        description="Write a new master key file for tenant-encrypted stores and print its key id; with "
                    "--tenant and --from, a tenant key file: that tenant's keys only, derived from the master.",
        epilog="exit codes: 0 written, 1 the file exists or cannot be written, 2 bad arguments",
    )
    p.add_argument("path", metavar="PATH", help="the key file to create (never overwritten)")
    p.add_argument("--tenant", default=None, metavar="NAME",
                   help="write tenant NAME's key file (its keys only), derived from --from")
    p.add_argument("--from", dest="master", default=None, metavar="MASTER",
                   help="the master key file a --tenant key file is derived from")
    return p


def run(args: argparse.Namespace) -> int:
    from ..storage.encrypted.crypto import KeyFileError, write_key_file, write_tenant_key_file

    if (args.tenant is None) != (args.master is None):
        raise UsageError("--tenant and --from: expected both (a tenant key file is derived from a master key) "
                         "or neither (a new master key)")
    try:
        if args.tenant is None:
            key_id = write_key_file(args.path)
        else:
            key_id = write_tenant_key_file(args.path, args.master, args.tenant)
    except KeyFileError as exc:
        raise UsageError(f"--from: {exc}") from None
    except ValueError as exc:  # a tenant name too long
        raise UsageError(f"--tenant: {exc}") from None
    except FileExistsError:
        print(f"tiered-kv keygen: error: {args.path} exists; a key file is never overwritten", file=sys.stderr)
        return ExitCode.FAILURE
    except OSError as exc:
        print(f"tiered-kv keygen: error: cannot write {args.path}: {exc.strerror}", file=sys.stderr)
        return ExitCode.FAILURE
    if args.tenant is None:
        print(f"{args.path}: key id {key_id}")
    else:
        print(f"{args.path}: tenant {args.tenant!r} key file of master key {key_id}")
    return ExitCode.OK
