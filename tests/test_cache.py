"""The cache facade: prefix matching, snapshots, eviction, errors, counters."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import CacheFullError, TieredKVCache
from tiered_kv.layout import LayerKind

from _util import random_tokens


def fill(model, cache, tokens, n=None):
    """Open, run the prompt (or its first n tokens) and close; returns the request."""
    n = len(tokens) if n is None else n
    req = cache.open(tokens[:n])
    model.forward(cache, req, tokens[req.num_cached_tokens:n])
    cache.close(req)
    return req


def test_open_on_empty_cache_and_prefix_reuse(tiny_layout, tiny_model) -> None:
    # interval:8 (the original policy) publishes the prompt's last two boundaries
    cache = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=2, snapshot_policy="interval:8")
    tokens = random_tokens(400)
    req = cache.open(tokens)
    assert req.num_cached_tokens == 0 and req.num_tokens == 0 and req.block_ids == []
    tiny_model.forward(cache, req, tokens)
    assert len(req.block_ids) == 4 and req.num_sealed_blocks == 3
    cache.close(req)
    # The same prompt: 3 full blocks cached, the last resume point is 384 (< 400)
    again = cache.open(tokens)
    assert again.num_cached_tokens == 384
    assert again.block_ids == req.block_ids[:3]
    cache.close(again)
    # A prompt of exactly 384 tokens leaves one token to compute: resume at 256
    exact = cache.open(tokens[:384])
    assert exact.num_cached_tokens == 256
    cache.close(exact)
    assert cache.open(tokens, max_cached_tokens=300).num_cached_tokens == 256


def test_divergent_prompt_shares_only_the_common_blocks(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=2, snapshot_interval=1)
    a = random_tokens(400, seed=1)
    fill(tiny_model, cache, a)
    b = a[:200] + random_tokens(200, seed=2)  # diverges inside block 1
    req = cache.open(b)
    assert req.num_cached_tokens == 128
    cache.close(req)


def test_snapshot_interval_makes_long_prompts_resumable_midway(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=2, snapshot_interval=2)
    a = random_tokens(5 * 128 + 10, seed=3)
    fill(tiny_model, cache, a)
    # snapshots at blocks 2, 4 (interval) and 5 (end of the committed prefix)
    assert cache.stats()["snapshots_cached"] == 3
    whole = cache.open(a)
    assert whole.num_cached_tokens == 5 * 128
    cache.close(whole)
    b = a[:3 * 128 + 50] + random_tokens(100, seed=4)
    req = cache.open(b)
    assert req.num_cached_tokens == 2 * 128  # block 3 is cached but has no snapshot
    cache.close(req)


def test_tenants_with_different_salts_never_share(tiny_layout, tiny_model) -> None:
    tokens = random_tokens(300)
    a = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, salt="tenant-a")
    b = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, salt="tenant-b")
    assert a.hasher.block_hashes(tokens) != b.hasher.block_hashes(tokens)
    assert a.hasher.block_hashes(tokens) == TieredKVCache(tiny_layout, salt="tenant-a").hasher.block_hashes(tokens)


def test_lru_eviction_takes_the_oldest_prefix_tail_first(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=6, num_state_slots=1, num_snapshots=8, snapshot_interval=1)
    p1, p2 = random_tokens(257, seed=1), random_tokens(257, seed=2)
    fill(tiny_model, cache, p1)  # blocks 0, 1 cached (+ block 2 partial, freed)
    fill(tiny_model, cache, p2)
    assert cache.stats()["blocks_evicted"] == 0
    b1 = [cache.blocks.lookup(h) for h in cache.hasher.block_hashes(p1)]
    b2 = [cache.blocks.lookup(h) for h in cache.hasher.block_hashes(p2)]
    assert None not in b1 + b2
    # evictable order: p1's tail, p1's head, p2's tail, p2's head
    assert cache.blocks.evictable() == [b1[1], b1[0], b2[1], b2[0]]
    p3 = random_tokens(3 * 128 + 1, seed=3)
    fill(tiny_model, cache, p3)  # 4 blocks: the 2 free ones, then p1's, tail first
    assert cache.stats()["blocks_evicted"] == 2
    assert cache.open(p1).num_cached_tokens == 0
    assert cache.stats()["live_requests"] == 1


def test_full_pools_raise_clear_errors(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=2, num_state_slots=1)
    req = cache.open([1, 2, 3])
    with pytest.raises(CacheFullError, match="no free state slot"):
        cache.open([1, 2, 3])
    tiny_model.forward(cache, req, random_tokens(256))
    with pytest.raises(CacheFullError, match="needs 1 more blocks, 0 available"):
        tiny_model.forward(cache, req, [1])
    cache.close(req)
    assert cache.stats()["blocks_used"] == 0


def test_request_misuse_raises(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=4, num_state_slots=2)
    other = TieredKVCache(tiny_layout, num_blocks=4, num_state_slots=2)
    req = cache.open([1, 2])
    foreign = other.open([1, 2])
    with pytest.raises(ValueError, match="unknown"):
        cache.close(foreign)
    cache.close(req)
    with pytest.raises(ValueError, match="double close"):
        cache.close(req)
    with pytest.raises(ValueError, match="closed"):
        tiny_model.forward(cache, req, [1])
    with pytest.raises(ValueError, match="token_ids"):
        cache.open([1.5])
    with pytest.raises(ValueError, match="token_ids"):
        cache.open([-1])


def test_engine_interface_validates_inputs(tiny_layout) -> None:
    L = tiny_layout
    cache = TieredKVCache(L, num_blocks=4, num_state_slots=2)
    req = cache.open([0] * 10)
    cache.reserve(req, 8)
    csa, hca = L.csa_layers[0], L.hca_layers[0]
    ids = torch.arange(2)
    kv = torch.zeros(2, L.entry_bytes, dtype=torch.uint8)
    keys = torch.zeros(2, L.indexer_bytes, dtype=torch.uint8)
    cache.write_csa(req, csa, ids, kv, keys)
    with pytest.raises(ValueError, match="expected dtype torch.uint8, got torch.float32"):
        cache.write_csa(req, csa, ids, kv.float(), keys)
    with pytest.raises(ValueError, match=r"expected shape \[2, 64\], got \[2, 63\]"):
        cache.write_csa(req, csa, ids, kv[:, :63], keys)
    with pytest.raises(ValueError, match="expected a csa layer, got hca"):
        cache.write_csa(req, hca, ids, kv, keys)
    with pytest.raises(ValueError, match="expected device"):
        cache.write_hca(req, hca, torch.arange(1), torch.zeros(1, L.entry_bytes, dtype=torch.uint8, device="meta"))
    with pytest.raises(ValueError, match=r"expected ids in \[0, 32\)"):
        cache.write_csa(req, csa, torch.tensor([32, 33]), kv, keys)
    fresh = cache.open([0])
    with pytest.raises(ValueError, match="call reserve"):
        cache.advance(fresh, [0] * 5)
    cache.reserve(req, 200)
    with pytest.raises(ValueError, match="cross the block boundary at 128"):
        cache.advance(req, [0] * 129)
    cache.advance(req, [0] * 128)
    with pytest.raises(ValueError, match="sealed"):
        cache.write_csa(req, csa, ids, kv, keys)
    assert LayerKind.SWA_ONLY in L.layer_kinds


def test_invalid_construction(tiny_layout) -> None:
    with pytest.raises(ValueError, match="num_snapshots"):
        TieredKVCache(tiny_layout, num_state_slots=4, num_snapshots=4)
    with pytest.raises(ValueError, match="CUDA is not available|cuda"):
        if not torch.cuda.is_available():
            TieredKVCache(tiny_layout, device="cuda")
        else:
            raise ValueError("cuda")
    with pytest.raises(TypeError, match="KVLayout"):
        TieredKVCache("tiny")  # type: ignore[arg-type]


def test_concurrent_requests_share_sealed_blocks(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=3, snapshot_interval=1)
    tokens = random_tokens(300)
    a = cache.open(tokens)
    tiny_model.forward(cache, a, tokens)
    b = cache.open(tokens)  # a is still live: its interval snapshots are shared
    assert b.num_cached_tokens == 256 and b.block_ids == a.block_ids[:2]
    assert cache.blocks.refcount(a.block_ids[0]) == 2
    cache.close(a)
    cache.close(b)
    s = cache.stats()
    assert s["blocks_used"] == 0 and s["live_requests"] == 0 and s["state_slots_free"] == 3
    cache.blocks.check_invariants()


@pytest.mark.parametrize("reserve_whole_prompt", [False, True])
def test_a_prompt_reserved_at_once_snapshots_only_what_close_can_publish(tiny_layout, tiny_model,
                                                                          reserve_whole_prompt) -> None:
    """An engine that reserves a whole prefill chunk up front skips the State copies of
    boundaries two or more blocks short of the chunk's end (they would be recycled
    unpublished); interval boundaries and the last two are still snapshotted, so the same
    resume points exist and the resumed logits equal a full recompute."""
    cache = TieredKVCache(tiny_layout, num_blocks=32, num_state_slots=2, snapshot_interval=4)
    tokens = random_tokens(9 * 128 + 5, seed=11)
    req = cache.open(tokens)
    if reserve_whole_prompt:
        cache.reserve(req, len(tokens))
    tiny_model.forward(cache, req, tokens)
    cache.close(req)
    s = cache.stats()
    # boundaries 1..9: 4 and 8 are interval points; 8 and 9 are the last two
    assert s["snapshots_taken"] == (3 if reserve_whole_prompt else 9)
    assert s["snapshots_elided"] == (6 if reserve_whole_prompt else 0)
    assert s["snapshots_cached"] == 3  # 4, 8 and 9 either way
    again = cache.open(tokens + [7, 8])
    assert again.num_cached_tokens == 9 * 128
    logits = tiny_model.forward(cache, again, tokens[9 * 128:] + [7, 8])
    naive = tiny_model.naive_logits(tokens + [7, 8])[9 * 128:]
    assert (logits - naive).abs().max().item() < 1e-9
    cache.close(again)
    exact = cache.open(tokens[:9 * 128])  # exactly 9 blocks: one token is recomputed, resume at 8
    assert exact.num_cached_tokens == 8 * 128
