"""HiSparse: CSA entries of sealed blocks on the host, top-k swapped into a device buffer.

The oracle here is stronger than 1e-4: logits must be *bit-identical* to the same run
without HiSparse, because swap-in must return the very bytes the GPU tier holds.
"""

from __future__ import annotations

import pytest
import torch

from tiered_kv import CacheFullError, TieredKVCache
from tiered_kv.hisparse import HiSparseConfig

from _util import random_tokens

HOST = 1 << 20  # ample for the tiny layout (6272 B per block)


def run(model, cache, tokens, prefill, decode_steps):
    req = cache.open(tokens[:prefill])
    out = [model.forward(cache, req, tokens[req.num_cached_tokens:prefill])]
    for i in range(prefill, prefill + decode_steps):
        out.append(model.forward(cache, req, tokens[i:i + 1]))
    cache.close(req)
    return torch.cat(out)


@pytest.mark.parametrize("mult", [1, 2, 8])
def test_logits_bit_identical_to_no_hisparse(tiny_layout, tiny_model, mult: int) -> None:
    tokens = random_tokens(620, seed=21)
    plain = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1)
    want = run(tiny_model, plain, tokens, 580, 40)
    cfg = HiSparseConfig(device_buffer_entries=mult * tiny_layout.top_k)
    cache = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, host_bytes=HOST, hisparse=cfg)
    got = run(tiny_model, cache, tokens, 580, 40)
    assert torch.equal(got, want)
    s = cache.stats()
    assert s["hisparse_hits"] + s["hisparse_misses"] > 0
    assert s["hisparse_bytes_moved"] >= s["hisparse_misses"] * tiny_layout.entry_bytes
    if mult == 1:  # eviction-heavy: the buffer holds exactly one step's top-k
        assert s["hisparse_misses"] > 8 * cfg.device_buffer_entries
    # the GPU keeps one open CSA block per State slot, not one per block
    assert cache.classical.csa_kv.shape[1] == 1


def test_resume_with_hisparse_is_bit_identical(tiny_layout, tiny_model) -> None:
    tokens = random_tokens(400, seed=22)
    plain = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1)
    want = run(tiny_model, plain, tokens, 380, 20)
    cache = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, host_bytes=HOST,
                          hisparse=HiSparseConfig(device_buffer_entries=16))
    run(tiny_model, cache, tokens, 300, 0)
    got = run(tiny_model, cache, tokens, 380, 20)  # resumes at 256 from the cached prefix
    assert cache.stats()["cached_tokens"] == 256
    assert torch.equal(got, want[256:])


def test_swap_in_lru_hits_misses_and_victims(tiny_layout, tiny_model) -> None:
    L = tiny_layout
    cache = TieredKVCache(L, num_blocks=8, num_state_slots=1, host_bytes=HOST,
                          hisparse=HiSparseConfig(device_buffer_entries=L.top_k))
    tokens = random_tokens(300, seed=23)
    req = cache.open(tokens)
    tiny_model.forward(cache, req, tokens[:260])  # 2 sealed blocks = 64 CSA entries per layer
    layer = L.csa_layers[1]
    c = L.part_index(layer)
    hs = cache.hisparse
    before = (hs.hits, hs.misses)
    first = torch.arange(8)
    slots = cache.swap_in(req, layer, first)
    assert sorted(slots.tolist()) == list(range(8))
    # the bytes in the buffer are the host mirror's bytes of those entries
    host_rows = cache.host.csa_rows()
    b0 = cache._host_of_block[req.block_ids[0]]
    assert torch.equal(hs.buffer[req.slot, c, slots], host_rows[b0, c * 32 + first])
    again = cache.swap_in(req, layer, torch.tensor([3, 40]))  # 3 hits, 40 misses
    assert again[0] == slots[3]
    victim = int(again[1])
    # the victim is the least recently used slot not used this step: entry 0's slot (step 1,
    # lowest slot among the oldest)
    assert victim == int(slots[0])
    assert (hs.hits - before[0], hs.misses - before[1]) == (1, 9)
    with pytest.raises(ValueError, match="at most device_buffer_entries"):
        cache.swap_in(req, layer, torch.arange(9))
    with pytest.raises(ValueError, match=r"expected ids in \[0, 64\)"):
        cache.swap_in(req, layer, torch.tensor([64]))  # the open block is not swapped
    cache.close(req)


def test_hisparse_configuration_errors(tiny_layout) -> None:
    with pytest.raises(ValueError, match="host_bytes"):
        TieredKVCache(tiny_layout, hisparse=HiSparseConfig(device_buffer_entries=8))
    with pytest.raises(ValueError, match="top_k = 8"):
        TieredKVCache(tiny_layout, host_bytes=HOST, hisparse=HiSparseConfig(device_buffer_entries=4))
    plain = TieredKVCache(tiny_layout, num_blocks=2, num_state_slots=1)
    req = plain.open([1])
    with pytest.raises(ValueError, match="not enabled"):
        plain.swap_in(req, tiny_layout.csa_layers[0], torch.tensor([0]))


def test_full_host_tier_is_a_clear_error(tiny_layout, tiny_model) -> None:
    L = tiny_layout
    # room for exactly 2 records: the third sealed block of a live request has nowhere to go
    cache = TieredKVCache(L, num_blocks=8, num_state_slots=1, host_bytes=2 * L.block_bytes,
                          hisparse=HiSparseConfig(device_buffer_entries=8))
    assert cache.host.num_blocks == 2
    req = cache.open(random_tokens(400))
    with pytest.raises(CacheFullError, match="host tier"):
        tiny_model.forward(cache, req, random_tokens(400))
