"""The disk tier through TieredKVCache: cross-process resume, corruption, full store,
foreign layouts, tenants."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tiered_kv import TieredKVCache, presets
from tiered_kv.storage import LayoutMismatchError, RecordKey, open_store

from _util import FLASH_MINI, lmdb_raw_read, lmdb_raw_write, random_tokens

HERE = Path(__file__).parent


def worker(url: str, phase: str, n: int = 300) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    out = subprocess.run([sys.executable, str(HERE / "_disk_worker.py"), url, phase, str(n)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scheme", ["lmdb", "zarr"])
def test_process_b_resumes_what_process_a_computed(tmp_path: Path, scheme: str) -> None:
    url = f"{scheme}://{tmp_path / 'store'}"
    a = worker(url, "a")
    # 2 blocks + the snapshot at the prompt's last boundary (the default policy, branch+interval:32)
    assert a["disk_writes"] == 3 and a["disk_write_errors"] == 0
    b = worker(url, "b")
    assert b["cached"] == 256 and b["blocks_from_disk"] == 2 and b["snapshots_from_disk"] == 1
    assert b["err"] < 1e-4


def _fill(cache, model, tokens):
    req = cache.open(tokens)
    model.forward(cache, req, tokens[req.num_cached_tokens:])
    cache.close(req)
    cache.flush()


def test_corrupt_block_on_disk_is_a_counted_miss_never_data(tmp_path: Path, tiny_layout, tiny_model) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    tokens = random_tokens(300, seed=8)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, snapshot_interval=1) as cache:
        _fill(cache, tiny_model, tokens)
        hashes = cache.hasher.block_hashes(tokens)
    store = open_store(url, layout_fingerprint=tiny_layout.fingerprint)
    assert store.contains(RecordKey.block(hashes[1]))
    store.close()
    _flip_lmdb_record(tmp_path / "s", RecordKey.block(hashes[1]).to_bytes())
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url) as cache:
        req = cache.open(tokens + [1, 2])
        # block 1 is unusable: resume at block 1's start (its snapshot), never from bad bytes
        assert req.num_cached_tokens == 128
        got = tiny_model.forward(cache, req, (tokens + [1, 2])[128:])
        want = tiny_model.naive_logits(tokens + [1, 2])[128:]
        assert (got - want).abs().max().item() < 1e-4
        s = cache.stats()
        assert s["disk_read_failures"] == 1 and s["store_corrupt"] == 1
        cache.close(req)


def _flip_lmdb_record(path: Path, key: bytes) -> None:
    rec = bytearray(lmdb_raw_read(path, key))
    rec[len(rec) // 2] ^= 0x01  # one payload bit, in the segment file
    lmdb_raw_write(path, key, bytes(rec))


def test_full_store_keeps_the_cache_serving(tmp_path: Path, tiny_layout, tiny_model) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    opts = {"max_bytes": 64 << 10, "map_size": 96 << 10, "initial_map_size": 96 << 10}
    tokens = random_tokens(1300, seed=9)
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, store_options=opts) as cache:
        req = cache.open(tokens)
        got = tiny_model.forward(cache, req, tokens)
        cache.close(req)
        cache.flush()
        s = cache.stats()
        assert (got - tiny_model.naive_logits(tokens)).abs().max().item() < 1e-4
        # the bound holds, by eviction or by refused writes, and nothing raised
        assert s["store_bytes"] <= opts["max_bytes"]
        assert s["store_evictions"] > 0 or s["disk_write_errors"] > 0
        again = cache.open(tokens)
        assert again.num_cached_tokens > 0  # the GPU tier still serves
        cache.close(again)


def test_foreign_layout_store_is_refused(tmp_path: Path, tiny_layout) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    TieredKVCache(tiny_layout, store=url).shutdown()
    other = presets.tiny(top_k=4)
    with pytest.raises(LayoutMismatchError, match=other.fingerprint):
        TieredKVCache(other, store=url)


def test_tenants_do_not_share_disk_records(tmp_path: Path, tiny_layout, tiny_model) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    tokens = random_tokens(300, seed=10)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, salt="a") as cache:
        _fill(cache, tiny_model, tokens)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, salt="b") as cache:
        req = cache.open(tokens)
        assert req.num_cached_tokens == 0
        cache.close(req)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, salt="a") as cache:
        req = cache.open(tokens)
        assert req.num_cached_tokens == 256
        cache.close(req)


def test_hisparse_loads_disk_blocks_into_the_host_mirror(tmp_path: Path, tiny_layout, tiny_model) -> None:
    from tiered_kv.hisparse import HiSparseConfig

    url = f"lmdb://{tmp_path / 's'}"
    tokens = random_tokens(450, seed=12)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url) as cache:
        _fill(cache, tiny_model, tokens[:400])
    plain = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1)
    r = plain.open(tokens)
    want = tiny_model.forward(plain, r, tokens)[384:]
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, host_bytes=1 << 20,
                       hisparse=HiSparseConfig(device_buffer_entries=16)) as cache:
        req = cache.open(tokens)
        assert req.num_cached_tokens == 384
        got = tiny_model.forward(cache, req, tokens[384:])
        assert torch.equal(got, want)  # bit-identical, via disk -> host mirror -> swap-in
        assert cache.stats()["blocks_from_disk"] == 3
        cache.close(req)


def test_fp8_flash_entries_through_every_tier_are_bit_identical(tmp_path: Path) -> None:
    """DeepSeek's fp8_ds_mla bytes: GPU -> LMDB, then a new cache resumes through disk ->
    host mirror -> HiSparse swap-in, and gives exactly the logits of a run without tiers."""
    from tiered_kv.hisparse import HiSparseConfig
    from tiered_kv.reference import ReferenceModel

    model = ReferenceModel(FLASH_MINI, seed=2)
    tokens = random_tokens(300, seed=13)
    plain = TieredKVCache(FLASH_MINI, num_blocks=4, num_state_slots=1)
    r = plain.open(tokens)
    want = model.forward(plain, r, tokens)[256:]
    url = f"lmdb://{tmp_path / 's'}"
    with TieredKVCache(FLASH_MINI, num_blocks=4, num_state_slots=1, store=url) as cache:
        _fill(cache, model, tokens[:290])
    with TieredKVCache(FLASH_MINI, num_blocks=4, num_state_slots=1, store=url, host_bytes=1 << 20,
                       hisparse=HiSparseConfig(device_buffer_entries=16)) as cache:
        req = cache.open(tokens)
        assert req.num_cached_tokens == 256 and cache.stats()["blocks_from_disk"] == 2
        got = model.forward(cache, req, tokens[256:])
        assert torch.equal(got, want)
        assert cache.stats()["hisparse_misses"] > 0
        cache.close(req)


def test_queued_disk_writes_go_in_batches_and_failures_count_per_record(tmp_path: Path) -> None:
    """Writes queued while the writer thread is busy are put in one batch (one store sync);
    a batch that fails is written again record by record, so only the bad record counts."""
    from tiered_kv.disk import DiskTier
    from tiered_kv.storage import LmdbStore

    layout = presets.tiny()
    store = LmdbStore(tmp_path / "s", layout_fingerprint=layout.fingerprint)
    real_put = store.put_many
    calls: list[int] = []
    gate = threading.Event()
    refuse = {"batches": False, "key": None}

    def put_many(items):
        gate.wait()
        calls.append(len(items))
        if refuse["batches"] and len(items) > 1:
            raise OSError("batch refused")
        if any(item.key == refuse["key"] for item in items):
            raise OSError("this record cannot be written")
        return real_put(items)

    store.put_many = put_many  # type: ignore[method-assign]
    tier = DiskTier(store, layout)
    failed: list[RecordKey] = []
    tier.on_write_failed = failed.append
    keys = [RecordKey.block(bytes([i]) * 32) for i in range(12)]
    payload = torch.zeros(64, dtype=torch.uint8)
    for k in keys[:6]:  # the writer thread holds the first batch at the gate; the rest queue
        tier.submit(k, b"\0" * 32, b"\0" * 32, payload)
    gate.set()
    tier.flush()
    assert sum(calls) == 6 and len(calls) <= 2 and tier.writes == 6  # (2: the first batch was taken alone)
    calls.clear()
    gate.clear()
    refuse.update(batches=True, key=keys[8])
    for k in keys[6:]:
        tier.submit(k, b"\0" * 32, b"\0" * 32, payload)
    gate.set()
    tier.flush()
    assert tier.writes == 11 and tier.write_errors == 1 and failed == [keys[8]]
    assert [store.contains(k) for k in keys] == [k != keys[8] for k in keys]
    tier.close()
    store.close()


def test_the_store_s_evictions_reach_the_cache_s_thread_through_a_queue(tmp_path: Path) -> None:
    """The disk tier listens to an LMDB store's evictions (reported on its writer thread)
    and hands them out on the caller's: take_evicted() gives each key the store evicted
    once, leaves out what is stored again, and remembers the rest until submitted again.
    close() stops listening."""
    from tiered_kv.disk import DiskTier
    from tiered_kv.storage import LmdbStore, record_size

    layout = presets.tiny()
    store = LmdbStore(tmp_path / "s", layout_fingerprint=layout.fingerprint, max_bytes=3 * record_size(64))
    tier = DiskTier(store, layout)
    assert store.on_evict is not None
    keys = [RecordKey.block(bytes([i + 1]) * 32) for i in range(5)]
    payload = torch.zeros(64, dtype=torch.uint8)
    for k in keys:  # five roots, one leaf each: the two oldest go
        tier.submit(k, b"\0" * 32, b"\0" * 32, payload)
        tier.flush()
    assert tier.take_evicted() == keys[:2] and tier.take_evicted() == []
    assert tier.evicted_from_store(keys[0]) and tier.evicted_from_store(keys[1])
    tier.submit(keys[0], b"\0" * 32, b"\0" * 32, payload)  # written again: no longer gone
    tier.flush()
    assert not tier.evicted_from_store(keys[0]) and tier.evicted_from_store(keys[1])
    assert tier.take_evicted() == [keys[2]]  # (keys[0]'s write evicted the oldest left)
    tier.close()
    assert store.on_evict is None
    store.close()
