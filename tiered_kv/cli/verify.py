"""``tiered-kv verify``: check every record of a store; ``--repair`` removes the bad ones.

::

    tiered-kv verify --store .demo/store
    tiered-kv verify --store lmdb:///var/cache/kv --repair --json
    tiered-kv verify --store lmdb:///var/cache/kv --store "zarr+s3://kv/v4?endpoint=..."   # a chain: every level

No layout option is needed (the store is checked against the fingerprint it holds);
``--model`` and the overrides only check that it holds that layout (exit 4 if not).

Every record's checksum, layout fingerprint and key are checked
(:meth:`tiered_kv.storage.BlockStore.verify`); on an LMDB store the index is checked whole
first (every page of every sub-database, then every entry of ``meta``, ``atime`` and
``lru``). Without ``--repair`` nothing is changed and the store is opened read-only, so
this works on a read-only mount: a bad record is reported and stays (a cache never serves
it: every read verifies, and a failed read is a miss); a damaged index is reported with
the command that fixes it. With ``--repair`` the bad records are removed, so the next
``warm-start`` writes them again, bad index entries are fixed, and a damaged index
(truncated, zeroed, empty or deleted ``data.mdb``) is rebuilt from the segment files,
which hold every record (the damaged file is moved into ``damaged-index-<time>/``).

With ``--key-file`` (see :mod:`._keys`) every record's AES-GCM tag is checked too: it
must open under one of the keys given for ``--tenant``. ``--repair`` then also removes
the records whose tag fails under a key given (nobody holding that key can read them);
records under keys not given are reported (``foreign``), never removed.

JSON: ``{"store", "model", "repair", "checked", "corrupt", "removed", "corrupt_keys"}``
(keys as ``"block:<hash hex>"`` / ``"snapshot:<hash hex>"``), plus what the backend adds
(LMDB: ``accounted_bytes``, ``actual_bytes``, ``index_problems`` (one line per kind of bad
index entry), ``index_rebuilt`` (``{"records", "bytes", "segments", "moved_to",
"problem"}`` when this run rebuilt the index, else null)), and with keys
``authenticated``, ``auth_failures``, ``auth_failed_keys``, ``foreign``, ``auth_removed``,
``key_records`` (records per key id).

Exit codes: 0 every record and the index are good, or ``--repair`` fixed what was not;
1 corrupt records or bad index entries found and left in place (no ``--repair``), a
damaged index (no ``--repair``), or, with keys, records failing authentication; 2 bad
arguments; 3 no store at ``--store``; 4 the store holds another layout; 5 the store is
locked (``--repair`` of a damaged index needs every other process to have closed the
store).
"""

from __future__ import annotations

import argparse
from typing import Any

from . import _common, _keys
from .main import ExitCode

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="check the index and every record's checksum; --repair removes the bad ones",
        description="Check every record of a prefix-cache store (checksum, layout, key) and, for "
                    "LMDB, its index. Nothing is changed unless --repair is given, which removes the "
                    "records that fail, fixes bad index entries and rebuilds a damaged index.",
        epilog="exit codes: 0 all good (or repaired), 1 corrupt records, bad index entries or a damaged "
               "index found (no --repair), 2 bad arguments, 3 store missing, 4 foreign-layout store, "
               "5 store locked",
    )
    _common.add_store_arg(p, chain=True)
    _common.add_layout_args(p, optional=True)
    _keys.add_key_args(p)
    p.add_argument("--repair", action="store_true",
                   help="remove the records that fail a check, fix bad index entries, rebuild a damaged "
                        "index from the segment files")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    layout = _common.layout_option(args)
    locs = [_common.parse_store(text) for text in args.store]
    encryption = _keys.encryption_from_args(args)
    # Without --repair nothing may be written: read-only (a read-only mount works). With it,
    # a writable open first rebuilds a damaged LMDB index from the segment files.
    with _common.open_cli_store(locs, layout, readonly=not args.repair, encryption=encryption) as store:
        sizing = layout or _common.preset_layout(store.layout_fingerprint)
        if encryption is not None and sizing is not None:  # tags are checked at the layout's sizes
            from ..storage import RecordKind

            result = dict(store.verify(repair=args.repair, payload_bytes={  # type: ignore[call-arg]
                RecordKind.BLOCK: sizing.block_bytes, RecordKind.SNAPSHOT: sizing.snapshot_bytes}))
        else:  # (sealed, of an engine's layout: the records this handle has not read stay `unchecked`)
            result = dict(store.verify(repair=args.repair))
        model = _common.model_of(layout, store.layout_fingerprint)
    bad = [_key_name(k) for k in result.get("corrupt_keys", [])]
    out = {"store": _common.store_url(locs), "model": model, "repair": args.repair, **result, "corrupt_keys": bad}
    if encryption is not None:
        out["auth_failed_keys"] = [_key_name(k) for k in result["auth_failed_keys"]]
    found = out["corrupt"]
    problems: list[str] = out.get("index_problems") or []
    unauthentic = out.get("auth_failures", 0) - out.get("auth_removed", 0)
    if args.json:
        _common.print_json(out)
    else:
        where = " -> ".join(loc.url for loc in locs)
        rebuilt = out.get("index_rebuilt")
        if rebuilt:
            print(f"{locs[0].url}: the index was damaged ({rebuilt['problem']}); rebuilt it from "
                  f"{rebuilt['segments']} segment files: {rebuilt['records']} records"
                  + (f"; the damaged index is kept at {rebuilt['moved_to']}" if rebuilt["moved_to"] else ""))
        print(f"{where}: checked {out['checked']} records, {found} corrupt, {out['removed']} removed"
              + (f"; {len(problems)} kinds of bad index entries{' fixed' if args.repair else ''}" if problems else ""))
        for name in bad:
            print(f"  corrupt  {name}")
        for line in problems:
            print(f"  index    {line}")
        if encryption is not None:
            keys = ", ".join(f"{n} under {k}" for k, n in out["key_records"].items()) or "none"
            print(f"  authenticated {out['authenticated']} ({keys}); {out['auth_failures']} failed authentication "
                  f"({out['foreign']} under no key given or not sealed, {out['auth_removed']} removed)")
            for name in out["auth_failed_keys"]:
                print(f"  unauthentic  {name}")
            if out["foreign"] and not out["authenticated"]:
                print("  no record opened under the keys given: check --tenant (default '') and --key-file")
        if found and not args.repair:
            print(f"{found} corrupt record{'s' if found != 1 else ''} left in place (a cache reads "
                  f"{'them' if found != 1 else 'it'} as a miss); run again with --repair to remove "
                  f"{'them' if found != 1 else 'it'}")
        if problems and not args.repair:
            print("bad index entries left in place; run again with --repair to fix them")
    # With --repair every bad record is gone: removed, or replaced meanwhile by another
    # process with a good one (the backend checks each again before deleting it).
    return ExitCode.FAILURE if ((found or problems) and not args.repair) or unauthentic else ExitCode.OK


def _key_name(key: object) -> str:
    """A corrupt key (``RecordKey.to_bytes().hex()``) -> ``"block:<hash hex>"`` or
    ``"snapshot:<hash hex>"``; a stored key that is no RecordKey -> ``"raw:<hex>"``."""
    from ..storage import RecordKey

    if isinstance(key, RecordKey):
        return f"{key.kind.name.lower()}:{key.block_hash.hex()}"
    text = str(key)
    try:
        rk = RecordKey.from_bytes(bytes.fromhex(text))
    except ValueError:
        return f"raw:{text}"
    return f"{rk.kind.name.lower()}:{rk.block_hash.hex()}"
