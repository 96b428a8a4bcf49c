"""``tiered-kv rekey``: move a store's records to a new master key (and to keyed names).

::

    tiered-kv rekey --store "zarr+s3://kv/v4?endpoint=https://..." --key-file /etc/tiered-kv/key-2026 \\
        --old-key-file /etc/tiered-kv/key-2025 --tenant acme
    tiered-kv rekey --store lmdb:///var/cache/kv --key-file /etc/tiered-kv/key-2026 --tenant acme   # migrate

Rotation: serving nodes open the store with ``key_files=[new, old]`` (they read both and
seal under the new one); ``rekey`` then rewrites every record still sealed under an old
key (``--old-key-file``, repeatable) under the new one (``--key-file``) and moves it to
the new key's keyed name, for the ``--tenant`` given (required: no default; a tenant key
file names its own). ``--drop-old`` deletes the records under the old keys instead of
rewriting them: use it when an old key was compromised (a record that authenticates only
under it may be a forgery, and rewriting it would launder it). Records under the new key
are skipped without being decrypted, so the command is resumable: stopped at any point
(kill -9 included), it is run again and finishes.

Migration: a store sealed by an earlier version of tiered_kv names its records by their
unkeyed prefix hashes, which a reader of the store can test guessed prompts against; it
cannot be served as it is (opening it says so). ``rekey`` with the store's key (no
``--old-key-file`` needed) moves every such record to a keyed name in the current format.
The store is marked sealed at once, so serving may resume meanwhile; records not moved
yet are misses.

It loses no record, wherever it is stopped. Each batch of ``--batch`` records is read,
authenticated, decrypted and sealed under the new key; the new envelopes are written to
the rekey journal and fsynced before the old records are removed and the new ones
written (a write-once store has no overwrite); then the journal is deleted. A run
killed mid-batch leaves the batch in the journal; the next run puts back whatever the
store lacks (``restored``; each journaled envelope authenticated first) before going on,
and for a local store so does any process that opens it with a key. The journal of a
local store (LMDB, Zarr directory) is ``rekey-journal`` in its directory; an object
store's is a local file, ``--journal PATH``, by default
``$XDG_CACHE_HOME/tiered_kv/rekey/<hash of the URL>.journal`` (so rerun an interrupted
rekey of a bucket on the same machine, or with the same ``--journal``). It holds only
ciphertext under the new key, mode 0600. One rekey per store at a time (exit 5 otherwise).

What rekey cannot erase: the old ciphertext stays on the media until it is reclaimed:
in an LMDB store's segment files until ``gc`` (or ``verify --repair``) punches the
removed records' ranges, and in a bucket with object versioning as noncurrent versions
until a lifecycle rule expires them; an old key that was compromised still opens those
bytes. Retire the old key only after a run that reports records moved (below).

Records under no key given (another tenant, another key) are left alone and counted
(``foreign``); records that fail their tag under a key given, or are not envelopes, are
removed (``failed``). A progress bar is drawn on stderr when it is a terminal.

JSON: ``{"store", "model", "tenant_given", "key_id", "old_key_ids", "journal", "drop_old",
"checked", "rekeyed", "migrated", "dropped", "current", "foreign", "failed", "absent",
"unchecked", "restored", "lost", "opened_old", "wall_s"}`` (``lost``: records of a left
journal that failed their checksum or tag, 0 unless something damaged it; ``opened_old``:
records found under an old key or of an earlier version).

Exit codes: 0 records under the old keys were moved (or dropped), or every record read is
under the new key already (a finished rotation); 1 no record opened under an old key and
some are not under the new one (the keys or the tenant given are not theirs: the old key
must not be retired on this run's word), records failed authentication, or a left
journal had damaged records; 2 bad arguments or key files; 3 no store at ``--store``; 4
the store holds another layout; 5 the store is locked, or another rekey of it is running.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from . import _common, _keys
from ._common import CommandFailed, Progress
from .main import ExitCode, UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "rekey",
        help="move a store's records sealed under old master keys (or by an earlier version) to a new key "
             "and its keyed names (resumable, loses nothing)",
        description="Rewrite every record sealed under an --old-key-file (or by an earlier version, with "
                    "unkeyed names) under --key-file, for one --tenant. Resumable: records under the new key "
                    "are skipped. Crash-safe: the batch in flight is journaled first, and a rerun puts back "
                    "what a killed run left out.",
        epilog="exit codes: 0 ok, 1 nothing opened under an old key (wrong keys or tenant?) or records failed "
               "authentication, 2 bad arguments, 3 store missing, 4 foreign-layout store, 5 store locked "
               "(or another rekey of it running)",
    )
    _common.add_store_arg(p)
    _common.add_layout_args(p)
    _keys.add_key_args(p)
    p.add_argument("--drop-old", action="store_true",
                   help="delete the records under the old keys instead of rewriting them (the old key was "
                        "compromised: what only it authenticates may be forged)")
    p.add_argument("--batch", type=_common.positive_int, default=16, metavar="N",
                   help="records read and rewritten together (default %(default)s)")
    p.add_argument("--journal", default=None, metavar="PATH",
                   help="object stores: the local file that keeps the batch in flight, so that a killed run "
                        "loses nothing (default: under $XDG_CACHE_HOME/tiered_kv/rekey/, by the store URL's "
                        "hash); a local store keeps it in its own directory")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    from ..storage import RecordKind

    layout = _common.layout_from_args(args)
    loc = _common.parse_store(args.store)
    if args.drop_old and not args.old_key_file:
        raise UsageError("--drop-old: expected --old-key-file: the keys whose records to delete")
    encryption = _keys.encryption_from_args(args, require_tenant="to move")
    if encryption is None:
        raise UsageError(f"--key-file: expected the new master key (or ${_keys.ENV_KEY_FILE})")
    t0 = time.perf_counter()
    progress = Progress(1, enabled=None if not args.json else False)

    def show(done: int, total: int, report: Any) -> None:
        progress.total = max(total, 1)
        progress.update(done, f"{done}/{total} records, {report.rekeyed} rekeyed, {report.current} current")

    try:
        with _common.open_cli_store(loc, layout, encryption=encryption, migrate=True) as store:
            ids = store.keyring.key_ids  # type: ignore[attr-defined]
            if args.old_key_file and len(ids) < 2:
                raise UsageError("--old-key-file: expected a key other than --key-file (the same key was given)")
            try:
                journal = store.rekey_journal(args.journal)  # type: ignore[attr-defined]
            except ValueError as exc:
                raise UsageError(f"--journal: {exc}") from None
            try:
                report = store.rekey({RecordKind.BLOCK: layout.block_bytes,  # type: ignore[attr-defined]
                                      RecordKind.SNAPSHOT: layout.snapshot_bytes}, batch=args.batch,
                                     journal=args.journal, drop_old=args.drop_old, progress=show)
            except Exception as exc:  # (mapped to an exit code below; first say where the batch is)
                for note in getattr(exc, "__notes__", ()):
                    print(f"tiered-kv rekey: {note}", file=sys.stderr)
                raise
    finally:
        progress.close()
    out = {"store": loc.url, "model": layout.name, "tenant_given": args.tenant is not None,
           "key_id": ids[0], "old_key_ids": ids[1:], "journal": str(journal.path), "drop_old": args.drop_old,
           **report.as_dict(), "wall_s": time.perf_counter() - t0}
    if args.json:
        _common.print_json(out)
    else:
        print(f"{loc.url}: {out['checked']} records checked: {out['rekeyed']} rewritten under {ids[0]}, "
              f"{out['migrated']} migrated from an earlier version, {out['dropped']} under an old key deleted, "
              f"{out['current']} were under {ids[0]} already, {out['foreign']} under no key given (left alone), "
              f"{out['failed']} failed authentication (removed), {out['absent']} gone meanwhile")
        if out["restored"] or out["lost"]:
            print(f"  {out['restored']} records put back from the journal of an interrupted run ({journal.path})"
                  + (f"; {out['lost']} were damaged there and are misses" if out["lost"] else ""))
    finished = out["checked"] > 0 and out["current"] == out["checked"]  # (nothing foreign, nothing failed)
    if not out["opened_old"] and not finished:
        old = ", ".join(ids[1:]) or "none given"
        raise CommandFailed(ExitCode.FAILURE,
                            f"no record opened under the old key(s) ({old}) nor of an earlier version: "
                            f"{out['foreign']} of {out['checked']} records are under no key given and "
                            f"{out['current']} under {ids[0]}; check --tenant and --old-key-file, and do not "
                            f"retire the old key on this run's word")
    if out["failed"]:
        raise CommandFailed(ExitCode.FAILURE, f"{out['failed']} records failed authentication under a key given "
                                              f"and were removed; the others were rewritten")
    if out["lost"]:
        raise CommandFailed(ExitCode.FAILURE, f"{out['lost']} records in the journal of an interrupted run "
                                              f"({journal.path}) failed their checksum (a damaged disk) and were "
                                              f"not put back: misses later; the others were rewritten")
    return ExitCode.OK
