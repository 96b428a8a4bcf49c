"""``tiered-kv stats``: what a prefix-cache store holds.

::

    tiered-kv stats --store .demo/store
    tiered-kv stats --store lmdb:///var/cache/kv --json
    tiered-kv stats --store lmdb:///var/cache/kv --store "zarr+s3://kv/v4?endpoint=..."   # a chain

Records (blocks and snapshots) and their payload bytes by kind (snapshot bytes against
block bytes: what the snapshot placement policy costs on this store), bytes against the
bound, the least and most recent access, the store's layout fingerprint and writer (who created it: the tiered_kv cache,
the vLLM adapter or the SGLang adapter; the model; a hash of the tenant, never the tenant)
and its hit / miss / corrupt / eviction counters. No layout option is needed: the store
is opened for whatever layout it holds; ``--model`` (and the overrides) only check that it
holds that one (exit 4 if not). A repeated ``--store`` opens a chain and adds one line per
level. An LMDB store keeps
lifetime counters, summed over every process that used it (each flushes its counts with
its access times and at close), and the table shows those; other backends count only
for the open store object, so a fresh ``tiered-kv stats`` shows zeros there (a serving
process reports its own through ``cache.metrics()``). An LMDB store is opened read-only.

The cache's policy counters (misses by reason, stranding evictions, snapshots published,
snapshot bytes per memory tier) belong to a serving process's GPU and host tiers, which a
store does not see: they are in ``cache.metrics()`` and its Prometheus export, and
``stats`` shows the store's share of them, its block and snapshot bytes.

Encryption: the ``encrypted`` row says whether the store's records are sealed (the level
records it; an older store: a sample). With ``--key-file`` (see :mod:`._keys`) it shows
the current key id and every key accepted, the reads that failed authentication, and how
many of a sample of stored records open under each key (a rotation's progress), are
under no key given, or are of an earlier version (``rekey`` migrates them); without one,
how many of a sample are sealed envelopes and how many plain records.

Exit codes: 0 ok, 2 bad arguments, 3 no store at ``--store``, 4 the store holds another
layout (the message names both fingerprints), 5 the store is locked.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..planner import format_bytes
from . import _common, _keys
from .main import ExitCode

__all__ = ["add_parser", "run", "store_summary"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "stats",
        help="records, bytes, counters and access times of a store",
        description="Records (blocks, snapshots), bytes, the hit / miss / corrupt / eviction "
                    "counters and the oldest and newest access of a prefix-cache store.",
        epilog="exit codes: 0 ok, 2 bad arguments, 3 store missing, 4 foreign-layout store, 5 store locked",
    )
    _common.add_store_arg(p, chain=True)
    _common.add_layout_args(p, optional=True)
    _keys.add_key_args(p)
    p.add_argument("--json", action="store_true", help="print the stats as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    layout = _common.layout_option(args)
    locs = [_common.parse_store(text) for text in args.store]
    encryption = _keys.encryption_from_args(args)
    with _common.open_cli_store(locs, layout, readonly=True, encryption=encryption) as store:
        summary = store_summary(store)
        # a chain: each level says whether it is sealed (its line); a store: a sample says
        summary["encryption"] = None if len(locs) > 1 else _keys.describe_encryption(store)
    summary = {"store": _common.store_url(locs), "model": _common.model_of(layout, store.layout_fingerprint),
               **summary}
    if args.json:
        _common.print_json(summary)
    else:
        print(format_table(summary))
    return ExitCode.OK


def store_summary(store: Any) -> dict[str, Any]:
    """``store.stats()`` plus record counts and payload bytes by kind, and ISO-8601 access times.

    ``block_bytes`` / ``snapshot_bytes``: payload bytes of the block and snapshot records
    the store holds (from its index or object sizes, not read), the store's side of the
    cache's ``tiered_kv_snapshot_bytes{tier}``; ``snapshot_block_ratio`` their ratio (the
    replay's *snap/blk* of the disk). None where the store cannot size records without
    reading them. The other policy counters (misses by reason, stranding evictions,
    snapshots published) are counted by a serving process's memory tiers: a store holds
    none of them (``cache.metrics()`` exports them).
    """
    from ..storage import RecordKind

    keys = list(store)  # first: on an object store this lists the bucket
    stats = dict(store.stats())
    stats["blocks"] = sum(k.kind is RecordKind.BLOCK for k in keys)
    stats["snapshots"] = sum(k.kind is RecordKind.SNAPSHOT for k in keys)
    stats.update(_bytes_by_kind(store, keys))
    stats["oldest_access"] = _common.iso_time(stats.get("oldest_access_ns"))
    stats["newest_access"] = _common.iso_time(stats.get("newest_access_ns"))
    return stats


def _bytes_by_kind(store: Any, keys: list[Any]) -> dict[str, Any]:
    """``block_bytes``, ``snapshot_bytes`` and ``snapshot_block_ratio`` of ``keys`` (None
    each where ``store`` cannot size its records without reading them, or sizes none of
    them); a record evicted since it was listed counts 0."""
    from ..storage import RecordKind

    try:
        sizes = store.payload_sizes(keys) if keys else []
    except NotImplementedError:
        sizes = []
    if keys and all(n is None for n in sizes):  # (e.g. sealed records, no key given to size them)
        return {"block_bytes": None, "snapshot_bytes": None, "snapshot_block_ratio": None}
    by_kind = {RecordKind.BLOCK: 0, RecordKind.SNAPSHOT: 0}
    for key, n in zip(keys, sizes):
        if n is not None and key.kind in by_kind:
            by_kind[key.kind] += n
    blocks, snaps = by_kind[RecordKind.BLOCK], by_kind[RecordKind.SNAPSHOT]
    return {"block_bytes": blocks, "snapshot_bytes": snaps,
            "snapshot_block_ratio": round(snaps / blocks, 4) if blocks else None}


def format_table(s: dict[str, Any]) -> str:
    max_bytes = s.get("max_bytes")
    fingerprint = str(s.get("layout_fingerprint"))
    store = s["store"] if isinstance(s["store"], str) else " -> ".join(s["store"])
    rows: list[tuple[str, str, str]] = [
        ("store", store, ""),
        ("layout_fingerprint", fingerprint, _common.layout_hint(fingerprint, s.get("writer"))),
        ("writer", _common.describe_writer(s.get("writer")), ""),
        ("records", str(s["records"]), f"{s['blocks']} blocks, {s['snapshots']} snapshots"),
        ("bytes", str(s["bytes"]), format_bytes(s["bytes"])),
        *_kind_bytes_rows(s),
        ("max_bytes", str(max_bytes) if max_bytes is not None else "none",
         format_bytes(max_bytes) if max_bytes is not None else "unbounded"),
        ("oldest_access", s["oldest_access"] or "-", "least recently used record (evicted first)"),
        ("newest_access", s["newest_access"] or "-", ""),
        *(_encryption_rows(s["encryption"]) if s.get("encryption") is not None else []),
    ]
    # LMDB persists counters across processes (a chain: its level 0's)
    lifetime = next((p for p in ("lifetime_", "level0_lifetime_") if f"{p}hits" in s), None)
    note = "since the store was created, all processes" if lifetime else "since this process opened the store"
    if "auth_failures" in s:
        rows.append(("auth_failures", str(s["auth_failures"]), "reads that failed authentication (misses)"))
    for name in ("hits", "misses", "corrupt", "evictions"):
        key = f"{lifetime}{name}" if lifetime else name
        if key in s:
            rows.append((name, str(s[key]), note))
            note = ""
    for i, level in enumerate(s.get("levels") or []):  # a chain: one line per level
        records = level.get("records")
        extra = level["where"]
        if level.get("encrypted"):
            extra += f" (encrypted, keys {', '.join(level.get('key_ids') or [])})"
        if i:
            state = "up" if level.get("up") else f"down: {level.get('last_error')}"
            extra += f" ({state}); writer: {_common.describe_writer(level.get('writer'))}"
        rows.append((f"level{i}", str(records) if records is not None else "-", extra))
    name_w = max(len(r[0]) for r in rows)
    num_w = max(len(r[1]) for r in rows if r[1].isdigit())
    lines = []
    for name, value, extra in rows:
        cell = value.rjust(num_w) if value.isdigit() else value.ljust(num_w)
        lines.append(f"{name.ljust(name_w)}  {cell}  {extra}".rstrip())
    return "\n".join(lines)


def _kind_bytes_rows(s: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The ``block_bytes`` / ``snapshot_bytes`` rows (payload bytes by record kind)."""
    if s.get("block_bytes") is None:
        return []
    ratio = s.get("snapshot_block_ratio")
    share = f"{ratio:.3f} of the block bytes" if ratio is not None else "no block bytes"
    return [("block_bytes", str(s["block_bytes"]), f"{format_bytes(s['block_bytes'])} payload of block records"),
            ("snapshot_bytes", str(s["snapshot_bytes"]), f"{format_bytes(s['snapshot_bytes'])}: {share}")]


def _encryption_rows(e: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The ``encrypted`` row: yes with the key ids (keys given), or what a sample shows."""
    if "key_id" in e:
        by_key = ", ".join(f"{n} under {k}" for k, n in e["sampled_by_key"].items()) or "none"
        rest = [f"{e[k]} {what}" for k, what in (("sampled_foreign", "under no key given"),
                                                ("sampled_unauthentic", "not authentic"),
                                                ("sampled_legacy", "of an earlier version (run rekey)")) if e.get(k)]
        return [("encrypted", "yes", f"xaes-256-gcm, keyed names; key {e['key_id']} "
                                     f"(accepted: {', '.join(e['key_ids'])})"),
                ("", "", f"of {e['sampled']} records sampled: {', '.join([by_key, *rest])}")]
    state = {True: "yes", False: "no", None: "unknown"}[e.get("encrypted")]
    marked = "the level records that it is sealed; " if e.get("sealing") else ""
    note = (f"{marked}of {e.get('sampled', 0)} records sampled: {e.get('sampled_sealed', 0)} sealed, "
            f"{e.get('sampled_plain', 0)} plain" + ("; pass --key-file to check them" if e.get("encrypted") else ""))
    return [("encrypted", state, note)]
