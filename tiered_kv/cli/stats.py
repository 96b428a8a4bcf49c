"""``tiered-kv stats``: what a prefix-cache store holds.

::

    tiered-kv stats --store .demo/store
    tiered-kv stats --store lmdb:///var/cache/kv --model deepseek-v4-flash --json

Records (blocks and snapshots), bytes against the bound, the least and most recent
access, and the store's hit / miss / corrupt / eviction counters. An LMDB store keeps
lifetime counters, summed over every process that used it (each flushes its counts with
its access times and at close), and the table shows those; other backends count only
for the open store object, so a fresh ``tiered-kv stats`` shows zeros there (a serving
process reports its own through ``cache.metrics()``). An LMDB store is opened read-only.

Encryption: the ``encrypted`` row says whether the store's records are sealed. With
``--key-file`` (see :mod:`._keys`) it shows the current key id and every key accepted,
the reads that failed authentication, and how many of a sample of records open under
each key (a rotation's progress); without one, how many of a sample are sealed envelopes
and how many plain records.

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
    _common.add_store_arg(p)
    _common.add_layout_args(p)
    _keys.add_key_args(p)
    p.add_argument("--json", action="store_true", help="print the stats as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    layout = _common.layout_from_args(args)
    loc = _common.parse_store(args.store)
    encryption = _keys.encryption_from_args(args)
    with _common.open_cli_store(loc, layout, readonly=True, encryption=encryption) as store:
        summary = store_summary(store)
        summary["encryption"] = _keys.describe_encryption(store, layout)
    summary = {"store": loc.url, "model": layout.name, **summary}
    if args.json:
        _common.print_json(summary)
    else:
        print(format_table(summary))
    return ExitCode.OK


def store_summary(store: Any) -> dict[str, Any]:
    """``store.stats()`` plus record counts by kind and ISO-8601 access times."""
    from ..storage import RecordKind

    kinds = [key.kind for key in store]  # first: on an object store this lists the bucket
    stats = dict(store.stats())
    stats["blocks"] = sum(k is RecordKind.BLOCK for k in kinds)
    stats["snapshots"] = sum(k is RecordKind.SNAPSHOT for k in kinds)
    stats["oldest_access"] = _common.iso_time(stats.get("oldest_access_ns"))
    stats["newest_access"] = _common.iso_time(stats.get("newest_access_ns"))
    return stats


def format_table(s: dict[str, Any]) -> str:
    max_bytes = s.get("max_bytes")
    rows: list[tuple[str, str, str]] = [
        ("store", s["store"], ""),
        ("layout_fingerprint", str(s.get("layout_fingerprint")), f"--model {s['model']}"),
        ("records", str(s["records"]), f"{s['blocks']} blocks, {s['snapshots']} snapshots"),
        ("bytes", str(s["bytes"]), format_bytes(s["bytes"])),
        ("max_bytes", str(max_bytes) if max_bytes is not None else "none",
         format_bytes(max_bytes) if max_bytes is not None else "unbounded"),
        ("oldest_access", s["oldest_access"] or "-", "least recently used record (evicted first)"),
        ("newest_access", s["newest_access"] or "-", ""),
        *_encryption_rows(s.get("encryption") or {}),
    ]
    lifetime = "lifetime_hits" in s  # LMDB persists counters across processes
    note = "since the store was created, all processes" if lifetime else "since this process opened the store"
    if "auth_failures" in s:
        rows.append(("auth_failures", str(s["auth_failures"]), "reads that failed authentication (misses)"))
    for name in ("hits", "misses", "corrupt", "evictions"):
        key = f"lifetime_{name}" if lifetime else name
        if key in s:
            rows.append((name, str(s[key]), note))
            note = ""
    name_w = max(len(r[0]) for r in rows)
    num_w = max(len(r[1]) for r in rows if r[1].isdigit())
    lines = []
    for name, value, extra in rows:
        cell = value.rjust(num_w) if value.isdigit() else value.ljust(num_w)
        lines.append(f"{name.ljust(name_w)}  {cell}  {extra}".rstrip())
    return "\n".join(lines)


def _encryption_rows(e: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The ``encrypted`` row: yes with the key ids (keys given), or what a sample shows."""
    if "key_id" in e:
        by_key = ", ".join(f"{n} under {k}" for k, n in e["sampled_by_key"].items()) or "empty"
        return [("encrypted", "yes", f"aes-256-gcm; key {e['key_id']} (accepted: {', '.join(e['key_ids'])})"),
                ("", "", f"of {e['sampled']} records sampled: {by_key}")]
    state = {True: "yes", False: "no", None: "unknown"}[e.get("encrypted")]
    note = (f"of {e.get('sampled', 0)} records sampled: {e.get('sampled_sealed', 0)} sealed, "
            f"{e.get('sampled_plain', 0)} plain" + ("; pass --key-file to check them" if e.get("encrypted") else ""))
    return [("encrypted", state, note)]
