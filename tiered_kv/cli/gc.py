"""``tiered-kv gc``: evict least recently used records until the store fits a byte bound.

::

    tiered-kv gc --store .demo/store --max-bytes 512k
    tiered-kv gc --store lmdb:///var/cache/kv --max-bytes 200G --json

``SIZE`` takes binary suffixes (``k``/``K``/``M``/``G``/``T``, ``KiB``...). Records are
evicted oldest access first (:meth:`tiered_kv.storage.BlockStore.gc`); bytes count whole
records (header + payload + checksum). No layout option is needed (``--model`` only checks
the store's). A repeated ``--store`` names a chain: its level 0 is collected (a shared
level is collected by running ``gc`` on its own URL, once for the fleet). Records the
store's upload journal (``upload-journal.mdb`` in a chain's local store) still owes a
farther level are kept, so ``gc`` never drops an upload: the store may stay above the
bound by them. The bound applies to this run only: to keep a
store under it, give the same bound to the processes that write (``warm-start
--max-bytes``, ``TieredKVCache(store_options={"max_bytes": ...})``).

Encrypted stores: ``gc`` needs no key, but the upload journal of an encrypted level 0 owes
its uploads by record key while the store evicts by keyed name: with uploads journaled
there, give ``--key-file`` (see :mod:`._keys`) so that ``gc`` can tell which names to
keep; without it such a run is refused (exit 2).

JSON: ``{"store", "model", "max_bytes", "evicted", "freed_bytes", "bytes", "records",
"journaled_uploads"}`` (``bytes``/``records``: what is left; ``journaled_uploads``: uploads
the store's journal still owes, whose records were kept).

Exit codes: 0 ok, 2 bad arguments, 3 no store at ``--store``, 4 the store holds another
layout, 5 the store is locked.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..planner import format_bytes
from . import _common, _keys
from .main import ExitCode, UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "gc",
        help="evict least recently used records down to a byte bound",
        description="Evict the least recently used records of a prefix-cache store until its "
                    "records take at most SIZE bytes.",
        epilog="exit codes: 0 ok, 2 bad arguments, 3 store missing, 4 foreign-layout store, 5 store locked",
    )
    _common.add_store_arg(p, chain=True)
    p.add_argument("--max-bytes", required=True, type=_common.size_arg, metavar="SIZE",
                   help="bytes the records may take afterwards, e.g. 200G, 512M or 1048576 (binary units)")
    _common.add_layout_args(p, optional=True)
    _keys.add_key_args(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    from ..storage import StoreChain
    from ..storage.chain.journal import keep_owed_uploads

    layout = _common.layout_option(args)
    locs = [_common.parse_store(text) for text in args.store]
    encryption = _keys.encryption_from_args(args)
    with _common.open_cli_store(locs, layout, encryption=encryption) as store:
        level0 = store.levels()[0] if isinstance(store, StoreChain) else store
        _common.report_index_rebuild(locs[0], level0)
        with keep_owed_uploads(level0) as held:
            if held and encryption is None and level0.sealing is not None:
                raise UsageError(f"--key-file: {locs[0].path} is an encrypted level whose upload journal owes "
                                 f"{held} uploads by record key, and its records are under keyed names: give its "
                                 f"--key-file (and --tenant) so that gc keeps them")
            result = dict(store.gc(args.max_bytes))
        model = _common.model_of(layout, store.layout_fingerprint)
    out = {"store": _common.store_url(locs), "model": model, "max_bytes": args.max_bytes, **result,
           "journaled_uploads": held}
    if args.json:
        _common.print_json(out)
    else:
        print(f"{locs[0].url}: evicted {out['evicted']} records, freed {out['freed_bytes']} bytes "
              f"({format_bytes(out['freed_bytes'])}); {out['records']} records, {out['bytes']} bytes "
              f"({format_bytes(out['bytes'])}) left, bound {format_bytes(args.max_bytes)}"
              + (f"; {held} uploads still journaled: their records were kept" if held else ""))
    return ExitCode.OK
