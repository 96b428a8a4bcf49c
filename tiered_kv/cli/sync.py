"""``tiered-kv sync``: send a node's local records that the shared store lacks.

::

    tiered-kv sync --store lmdb:///var/cache/kv --shared "zarr+s3://kv-cache/v4?endpoint=https://..."

No layout option is needed: the local store's layout is used (``--model`` only checks it),
and a shared store created here gets it and the local store's writer record. Records of
any layout are sent at their own size, so stores written by the vLLM or SGLang adapter sync
too. A cache with a store chain uploads behind the request. Uploads still owed when its
process stopped are journaled in the local store and resumed by the next process that
opens the chain; ``sync`` is for the records no journal holds (written with no journal,
or before journals existed). ``sync`` lists both
stores, queues every local record the shared one lacks
(:meth:`tiered_kv.storage.StoreChain.resync`) and waits up to ``--timeout`` seconds for
the uploads. Records already in the shared store are left alone (write-once).

Encrypted levels: with ``--key-file`` (see :mod:`._keys`) the shared store's records are
sealed for ``--tenant`` (uploads are sealed as they go); ``--encrypt-local`` says the
local store is sealed too (its records are opened on the way).

JSON: ``{"store", "shared", "local_records", "queued", "present", "uploaded", "pending",
"failed", "levels_skipped", "done"}``.

Exit codes: 0 everything is in the shared store; 1 uploads still pending or failed at the
timeout, or the shared store unreachable; 2 bad arguments; 3 no local store at
``--store``; 4 a store holds another layout; 5 the local store is locked.
"""

from __future__ import annotations

import argparse
from typing import Any

from . import _common, _keys
from .main import ExitCode

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "sync",
        help="upload the local records a shared store lacks",
        description="List a local store and a shared store, and upload every local record the "
                    "shared one lacks (uploads lost when a serving process stopped).",
        epilog="exit codes: 0 all uploaded, 1 uploads pending or failed, 2 bad arguments, "
               "3 store missing, 4 foreign-layout store, 5 store locked",
    )
    _common.add_store_arg(p)
    p.add_argument("--shared", required=True, metavar="URL",
                   help="the shared store: zarr+s3://bucket/prefix?endpoint=..., or any store URL")
    p.add_argument("--timeout", type=_common.seconds_arg, default=600.0, metavar="S",
                   help="seconds to wait for the uploads (default 600)")
    _common.add_layout_args(p, optional=True)
    _keys.add_key_args(p, what="the shared store")
    p.add_argument("--encrypt-local", action="store_true",
                   help="the local store is sealed under the same keys too")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    from ..storage import StoreChain, StoreWriter, open_store

    layout = _common.layout_option(args)
    loc = _common.parse_store(args.store)
    shared = _common.parse_store(args.shared)
    local_options, shared_options = _level_options(args)
    if not loc.exists():
        raise _common.missing_store(loc)
    with _common.store_errors(loc, layout):  # (no layout given: the local store's, a maintenance open)
        local = open_store(loc.url, layout_fingerprint=None if layout is None else layout.fingerprint,
                           **local_options)
    try:
        # the shared store must hold the local one's layout; one created here records its writer
        writer = StoreWriter.from_dict(local.stats().get("writer"))
        with _common.store_errors(shared, layout, expected=f"the layout of {loc.path}"):
            far = open_store(shared.url, layout_fingerprint=local.layout_fingerprint, writer=writer,
                             **shared_options)
    except BaseException:
        local.close()
        raise
    with _common.store_errors(loc, layout):
        chain = StoreChain([local, far])
        try:
            result = chain.resync()  # each record's own size, from the local index: any layout
            done = chain.wait_uploads(args.timeout)
            s = chain.stats()
        finally:
            chain.close()
    uploaded = s.get("level1_uploads", 0) + s.get("level1_uploads_existing", 0)
    out = {"store": loc.url, "shared": shared.url, **result, "uploaded": uploaded,
           "pending": s.get("pending_uploads", 0), "failed": s.get("level1_failed_uploads", 0),
           "done": bool(done and not result["levels_skipped"])}
    if args.json:
        _common.print_json(out)
    else:
        print(f"{loc.url} -> {shared.url}: {out['local_records']} local records, {out['present']} already "
              f"shared, {out['queued']} queued, {out['uploaded']} uploaded, {out['pending']} pending")
    return ExitCode.OK if out["done"] and not out["failed"] else ExitCode.FAILURE


def _level_options(args: argparse.Namespace) -> list[dict[str, Any]]:
    """``level_options`` of the (local, shared) chain: the shared level sealed when a key
    is given, the local one too with ``--encrypt-local``."""
    encryption = _keys.encryption_from_args(args)
    if encryption is None:
        if args.encrypt_local:
            raise _common.UsageError(f"--encrypt-local: expected --key-file (or ${_keys.ENV_KEY_FILE}) too")
        return [{}, {}]
    return [{"encryption": encryption} if args.encrypt_local else {}, {"encryption": encryption}]
