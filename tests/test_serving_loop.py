"""Churn through every tier: hundreds of requests with shared prefixes, aborts and
preemption under a GPU block budget small enough to force evictions to host and disk.

At the end no block has leaked, sampled requests' logits equal the naive run, and the
store verifies clean. ``bench/serving.py`` runs a longer variant.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv import TieredKVCache
from tiered_kv.debug import SyncDetector
from tiered_kv.hisparse import HiSparseConfig
from tiered_kv.reference.serving import ServeRequest, ServingLoop, Status, make_workload
from tiered_kv.storage import open_store

from _util import cache_tensors, random_tokens


def check_no_leak(cache: TieredKVCache) -> None:
    s = cache.stats()
    assert s["live_requests"] == 0
    assert s["blocks_used"] == 0, "GPU blocks still referenced"
    assert s["blocks_free"] + s["blocks_cached_evictable"] == s["blocks_total"]
    assert s["state_slots_free"] == cache.states.num_slots
    assert cache.snapshots.ids.num_used == 0
    cache.blocks.check_invariants()
    cache.snapshots.ids.check_invariants()
    if cache.host is not None:
        # HiSparse: each cached GPU block holds one reference on its host record
        refs = sum(cache.host.blocks.refcount(i) for i in range(cache.host.num_blocks))
        assert refs == len(cache._host_of_block)
        assert all(cache.blocks.refcount(b) == 0 for b in cache._host_of_block)
        while cache.blocks.evict_lru() is not None:  # drain the GPU tier: every host ref goes
            pass
        assert cache.host.blocks.num_used == 0, "host records still referenced"
        cache.host.blocks.check_invariants()
    assert not cache._host_of_block


@pytest.mark.parametrize("hisparse", [False, True], ids=["plain", "hisparse"])
def test_serving_loop_churn(tmp_path: Path, tiny_layout, tiny_model, hisparse: bool) -> None:
    url = f"lmdb://{tmp_path / 'store'}"
    extra = {"hisparse": HiSparseConfig(device_buffer_entries=2 * tiny_layout.top_k)} if hisparse else {}
    L = tiny_layout
    # HiSparse pins the host records of every sealed block a live request holds
    host_records = 6 if hisparse else 3
    cache = TieredKVCache(L, num_blocks=8, num_state_slots=3, num_snapshots=8, snapshot_interval=2,
                          host_bytes=host_records * L.block_bytes + 2 * L.snapshot_bytes, store=url, **extra)
    num_requests = 120 if hisparse else 200
    requests = make_workload(num_requests, seed=7 + hisparse, num_prefixes=10, prefix_tokens=(100, 300),
                             suffix_tokens=(1, 40), new_tokens=(1, 4), record_every=12)
    loop = ServingLoop(tiny_model, cache, prefill_chunk=128)
    for r in requests:
        loop.submit(r)
    done = loop.run()
    cache.flush()
    assert len(done) == num_requests
    assert {r.status for r in done} == {Status.DONE, Status.ABORTED}
    s = cache.stats()
    # the budget forced traffic through every tier
    assert s["blocks_evicted"] > 0 and s["host_blocks_evicted"] + s["blocks_from_host"] > 0
    assert s["blocks_from_disk"] > 0 and s["cached_tokens"] > 0
    assert s["disk_write_errors"] == 0
    check_no_leak(cache)
    # sampled requests: every recorded position equals the naive run
    checked = 0
    for r in done:
        if r.record and r.logits:
            naive = tiny_model.naive_logits(r.tokens)
            for pos, row in r.logits.items():
                assert (row - naive[pos]).abs().max().item() < 1e-4, (r.rid, pos)
            checked += 1
    assert checked >= num_requests // 20
    cache.shutdown()
    with open_store(url, layout_fingerprint=tiny_layout.fingerprint) as store:
        keys = list(store)
        assert keys
        from tiered_kv.storage import RecordKind
        for key in keys:
            size = tiny_layout.block_bytes if key.kind is RecordKind.BLOCK else tiny_layout.snapshot_bytes
            assert store.get(key, bytearray(size)) is not None  # every record verifies
        assert store.stats()["corrupt"] == 0


#: the cache calls a decode step of the serving loop makes (through the reference model)
CACHE_CALLS = ("reserve", "write_csa", "write_hca", "read_indexer_keys", "read_csa", "swap_in", "read_hca",
               "advance", "state")


def watch_cache_calls(cache: TieredKVCache, owned: list) -> list[str]:
    """Run every call into ``cache`` under a :class:`SyncDetector` (the reference model's own
    compute outside them stays unwatched: it is the oracle, not the hot path). Returns the
    names of the calls made; a host sync inside one raises."""
    calls: list[str] = []
    depth = [0]
    for name in CACHE_CALLS:
        def wrapper(*args, _orig=getattr(cache, name), _name=name, **kwargs):
            if depth[0]:  # a call inside a watched call (read_csa -> swap_in) is already watched
                return _orig(*args, **kwargs)
            calls.append(_name)
            depth[0] += 1
            try:
                with SyncDetector(cache.device, owned=owned):
                    return _orig(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(cache, name, wrapper)
    return calls


@pytest.mark.parametrize("hisparse", [False, True], ids=["plain", "hisparse"])
def test_a_decode_step_makes_no_host_sync_in_the_cache(tiny_layout, tiny_model, hisparse: bool) -> None:
    """One full decode step of the serving loop (3 requests, one crossing a block boundary
    so it seals), with every cache call under the sync detector."""
    L = tiny_layout
    extra = {"hisparse": HiSparseConfig(device_buffer_entries=2 * L.top_k)} if hisparse else {}
    cache = TieredKVCache(L, num_blocks=16, num_state_slots=3, host_bytes=12 * L.block_bytes + 2 * L.snapshot_bytes,
                          **extra)
    loop = ServingLoop(tiny_model, cache, prefill_chunk=512)
    prompts = [random_tokens(n, seed=20 + n) for n in (300, 2 * L.block_tokens - 1, 200)]  # #2 seals next step
    for i, p in enumerate(prompts):
        loop.submit(ServeRequest(rid=i, prompt=p, max_new_tokens=3))
    loop.step()  # admit + prefill everything
    assert all(r._req.num_tokens == len(r.prompt) for r in loop.running)
    calls = watch_cache_calls(cache, cache_tensors(cache))
    sealed = cache.stats()["blocks_sealed"]
    loop.step()  # one decode token for each request
    assert all(len(r.generated) == 1 for r in loop.running)
    assert cache.stats()["blocks_sealed"] == sealed + 1  # the step sealed a block (hash, publish, mirror)
    assert {"reserve", "write_csa", "read_indexer_keys", "read_csa", "advance"} <= set(calls)
    if hisparse:
        assert cache.hisparse.hits + cache.hisparse.misses > 0
