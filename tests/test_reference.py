"""The oracle: cached reference-model logits equal the naive full recompute."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import TieredKVCache, presets
from tiered_kv.reference import ReferenceModel
from tiered_kv.reference.ops import select_topk

from _util import FLASH_MINI, random_tokens

TOL = 1e-4


def run_chunks(model, cache, req, tokens, chunks, decode_from):
    """Prefill ``tokens[num_cached:decode_from]`` in the given chunk sizes, then decode one by one."""
    out = []
    pos = req.num_tokens
    sizes = iter(chunks)
    while pos < decode_from:
        n = min(next(sizes, decode_from - pos), decode_from - pos)
        out.append(model.forward(cache, req, tokens[pos:pos + n]))
        pos += n
    for i in range(pos, len(tokens)):
        out.append(model.forward(cache, req, tokens[i:i + 1]))
    return torch.cat(out)


LAYOUTS = {
    "flash-mini-fp8": FLASH_MINI,
    "tiny-fp32": presets.tiny(),
    "tiny-bf16": presets.tiny(entry_format="bf16"),
    "tiny-window32": presets.tiny(window=32),
    "tiny-block256": presets.tiny(block_tokens=256),
}


#: the model and the cache on the same device; CUDA runs where there is a GPU
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_prefill_and_decode_match_naive(name: str, device: str) -> None:
    layout = LAYOUTS[name]
    model = ReferenceModel(layout, seed=3, device=device)
    tokens = random_tokens(4 * layout.block_tokens // 128 * 100 + 13, seed=5)  # crosses several blocks
    T = len(tokens)
    naive = model.naive_logits(tokens)
    assert naive.shape == (T, 256)
    cache = TieredKVCache(layout, num_blocks=12, num_state_slots=2, device=device)
    req = cache.open(tokens)
    assert req.num_cached_tokens == 0
    got = run_chunks(model, cache, req, tokens, [1, 37, 129, 5, 64, 3, 200], decode_from=T - 24)
    assert got.shape == naive.shape
    assert (got - naive).abs().max().item() < TOL
    cache.close(req)


def test_resumed_request_gives_the_uninterrupted_logits(tiny_layout, tiny_model) -> None:
    tokens = random_tokens(420, seed=11)
    naive = tiny_model.naive_logits(tokens)
    cache = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=2)
    a = cache.open(tokens[:300])
    run_chunks(tiny_model, cache, a, tokens[:300], [300], decode_from=300)
    cache.close(a)
    b = cache.open(tokens)
    assert b.num_cached_tokens == 256  # last resume point of the 300-token prefix
    got = run_chunks(tiny_model, cache, b, tokens, [17, 100], decode_from=len(tokens) - 8)
    assert (got - naive[256:]).abs().max().item() < TOL
    assert cache.stats()["snapshot_hits"] == 1
    cache.close(b)


def test_topk_is_exercised_and_ties_go_to_lowest_id() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    chosen = select_topk(scores, torch.tensor([5]), 2)
    assert chosen.tolist() == [[False, True, True, False, False]]
    chosen = select_topk(scores, torch.tensor([2]), 4)  # fewer valid than k
    assert chosen.tolist() == [[True, True, False, False, False]]
    L = presets.tiny()
    assert L.top_k < 300 // L.csa_ratio  # the sequences above select among more than top-k


def test_oracle_detects_a_corrupted_block(tiny_layout, tiny_model) -> None:
    """The comparison can fail: a flipped byte in a cached block changes the logits."""
    tokens = random_tokens(300, seed=2)
    naive = tiny_model.naive_logits(tokens)
    cache = TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=2)
    a = cache.open(tokens[:260])
    tiny_model.forward(cache, a, tokens[:260])
    cache.close(a)
    b0 = cache.blocks.lookup(cache.hasher.block_hashes(tokens)[0])
    cache.classical.hca_kv[0, b0, 0, 2] ^= 0x40  # flip a mantissa bit of layer 2's HCA entry 0
    b = cache.open(tokens)
    got = tiny_model.forward(cache, b, tokens[b.num_cached_tokens:])
    diff = (got - naive[b.num_cached_tokens:]).abs().max().item()
    assert diff > TOL, diff


def test_bf16_rounding_is_applied_in_both_paths() -> None:
    tokens = random_tokens(200, seed=9)
    fp32 = ReferenceModel(presets.tiny(), seed=1).naive_logits(tokens)
    bf16 = ReferenceModel(presets.tiny(entry_format="bf16"), seed=1).naive_logits(tokens)
    assert (fp32 - bf16).abs().max().item() > 1e-6  # the storage rounding is visible


def test_reference_model_rejects_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="indexer key"):
        ReferenceModel(presets.tiny(indexer_bytes=33))
    model = ReferenceModel(presets.tiny(), vocab_size=16)
    with pytest.raises(ValueError, match="token_ids"):
        model.naive_logits([3, 99])


def test_weights_are_a_function_of_the_seed(tiny_layout) -> None:
    tokens = random_tokens(40, seed=1)
    a = ReferenceModel(tiny_layout, seed=7).naive_logits(tokens)
    b = ReferenceModel(tiny_layout, seed=7).naive_logits(tokens)
    c = ReferenceModel(tiny_layout, seed=8).naive_logits(tokens)
    assert torch.equal(a, b) and not torch.equal(a, c)
