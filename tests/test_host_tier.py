"""The host tier as L2: blocks and snapshots evicted from the GPU load from host."""

from __future__ import annotations

import torch

from tiered_kv import TieredKVCache

from _util import random_tokens


def test_evicted_blocks_and_snapshots_come_back_from_host(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=3, num_state_slots=1, num_snapshots=2,
                          snapshot_interval=1, host_bytes=1 << 20)
    a, b = random_tokens(300, seed=31), random_tokens(300, seed=32)
    for p in (a, b):  # b's blocks evict a's from the GPU pool
        req = cache.open(p)
        tiny_model.forward(cache, req, p)
        cache.close(req)
    s = cache.stats()
    assert s["blocks_evicted"] >= 2 and s["blocks_offloaded"] >= 2 and s["host_blocks_cached"] >= 2
    assert cache.blocks.lookup(cache.hasher.block_hashes(a)[0]) is None
    cont = a + random_tokens(30, seed=33)
    req = cache.open(cont)
    assert req.num_cached_tokens == 256
    got = tiny_model.forward(cache, req, cont[256:])
    cache.close(req)
    s = cache.stats()
    assert s["blocks_from_host"] == 2 and s["snapshots_from_host"] == 1
    want = tiny_model.naive_logits(cont)[256:]
    assert (got - want).abs().max().item() < 1e-4


def test_host_tier_capacity_bounds_and_lru(tiny_layout) -> None:
    from tiered_kv.host import HostTier

    L = tiny_layout
    host = HostTier(L, 10 * L.block_bytes + 2 * L.snapshot_bytes, torch.device("cpu"), snapshot_fraction=0.5)
    assert host.num_snapshots >= 1 and host.nbytes <= host.host_bytes
    assert host.csa_rows().shape == (host.num_blocks, L.num_csa_layers * 32, L.entry_bytes)
    data = torch.arange(L.snapshot_bytes, dtype=torch.int64).to(torch.uint8)
    assert host.put_snapshot(b"h" * 32, data)
    assert torch.equal(host.lookup_snapshot(b"h" * 32), data)
    assert host.lookup_snapshot(b"x" * 32) is None
