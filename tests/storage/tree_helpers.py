"""Helpers of the prefix-tree tests (test_lmdb_tree.py, test_zarr_tree.py): paths of
blocks chained by their parent hash (``b0 -> b1 -> b2``), snapshots keyed by the hash of
the block they were taken at, every record ``N`` payload bytes (``ONE`` stored)."""

from __future__ import annotations

import hashlib
from collections.abc import Collection

from storage_helpers import digest_for, payload_for
from tiered_kv.storage import PutItem, RecordKey, record_size

N = 64
ONE = record_size(N)
ROOT = hashlib.sha256(b"namespace").digest()


def chain(name: str, n: int, parent: bytes = ROOT) -> list[bytes]:
    """``n`` block hashes of one path below ``parent``."""
    out = []
    for i in range(n):
        parent = hashlib.sha256(parent + f"{name}{i}".encode()).digest()
        out.append(parent)
    return out


def block(h: bytes, parent: bytes) -> PutItem:
    key = RecordKey.block(h)
    return PutItem(key, parent_hash=parent, token_digest=digest_for(key), payload=payload_for(key, N))


def snap(h: bytes, parent: bytes) -> PutItem:
    key = RecordKey.snapshot(h)
    return PutItem(key, parent_hash=parent, token_digest=digest_for(key), payload=payload_for(key, N))


def path_items(hashes: list[bytes], snaps_at: Collection[int], parent: bytes = ROOT) -> list[PutItem]:
    """The blocks of a path root first, each followed by its snapshot where asked."""
    items = []
    for i, h in enumerate(hashes):
        p = parent if i == 0 else hashes[i - 1]
        items.append(block(h, p))
        if i in snaps_at:
            items.append(snap(h, p))
    return items
