"""An encrypted level passes its backend's eviction reports on, as keys (``on_evict``).

The backend (LMDB, Zarr) evicts records it knows by their keyed names only; the wrapper
maps each name back to a key with no read, under every master key given, so the cache
behind a disk tier learns what an encrypted disk evicted and prunes what led only to it,
as it does for a plain one (test_lmdb_tree.py, test_zarr_tree.py, test_disk_tier.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from encryption_helpers import key_files
from storage_helpers import FP
from tiered_kv.storage import PutItem, RecordKey, open_store, record_size
from tiered_kv.storage.encrypted.crypto import ENVELOPE_OVERHEAD

N = 64
#: room for three sealed records of N payload bytes
ROOM = 3 * record_size(N + ENVELOPE_OVERHEAD)


def _put(store, key: RecordKey) -> None:
    assert store.put_many([PutItem(key, b"\0" * 32, b"\0" * 32, np.full(N, key.block_hash[0], np.uint8))]) == [True]


@pytest.mark.parametrize("scheme", ["lmdb", "zarr"])
def test_the_backend_s_evictions_are_told_as_keys(tmp_path: Path, scheme: str) -> None:
    files = key_files(tmp_path, "now", "before")  # a rotation in progress: two keys given
    store = open_store(f"{scheme}://{tmp_path / 's'}", layout_fingerprint=FP, max_bytes=ROOM,
                       encryption={"key_files": files, "tenant": "acme"})
    try:
        assert store.on_evict is None
        told: list[RecordKey] = []
        store.on_evict = told.extend
        keys = [RecordKey.block(bytes([i + 1]) * 32) for i in range(5)]
        for k in keys:  # five roots, one leaf each: the two oldest go
            _put(store, k)
        held = set(store)
        assert held == set(keys[2:])
        # each evicted name is told under both keys given: its own key is among them, the
        # other is a random key no one holds
        assert len(told) == 2 * 2 and set(keys[:2]) <= set(told)
        assert not set(told) & held
        store.on_evict = None
        _put(store, RecordKey.block(b"\x09" * 32))
        assert len(told) == 4  # no longer told
    finally:
        store.close()


def test_a_disk_tier_on_an_encrypted_store_learns_its_evictions(tmp_path: Path) -> None:
    import torch

    from tiered_kv import presets
    from tiered_kv.disk import DiskTier

    layout = presets.tiny()
    store = open_store(f"lmdb://{tmp_path / 's'}", layout_fingerprint=layout.fingerprint, max_bytes=ROOM,
                       encryption={"key_files": key_files(tmp_path, "k"), "tenant": "acme"})
    tier = DiskTier(store, layout)
    assert store.on_evict is not None
    keys = [RecordKey.block(bytes([i + 1]) * 32) for i in range(5)]
    for k in keys:
        tier.submit(k, b"\0" * 32, b"\0" * 32, torch.zeros(N, dtype=torch.uint8))
        tier.flush()
    assert tier.take_evicted() == keys[:2]
    assert tier.evicted_from_store(keys[0]) and not tier.evicted_from_store(keys[4])
    tier.close()
    assert store.on_evict is None
    store.close()
