"""The cache's public API refuses bad input with an error that says what was expected
(issue 16, item 6): overlapping ids in one batched write, non-integer counts, negative
entry counts; integer-likes (numpy / torch scalars) are accepted where an int is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv import TieredKVCache, presets

LAYOUT = presets.tiny()
CSA = LAYOUT.csa_layers[0]
HCA = LAYOUT.hca_layers[0]


@pytest.fixture()
def cache_and_request() -> tuple[TieredKVCache, object]:
    cache = TieredKVCache(LAYOUT, num_blocks=8, num_state_slots=2)
    req = cache.open(list(range(10)))
    cache.reserve(req, 3 * LAYOUT.block_tokens)
    return cache, req


def csa_bytes(*lead: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 256, (*lead, LAYOUT.entry_bytes), dtype=torch.uint8),
            torch.randint(0, 256, (*lead, LAYOUT.indexer_bytes), dtype=torch.uint8))


def test_overlapping_ids_across_the_requests_of_one_write_raise(cache_and_request) -> None:
    cache, r = cache_and_request
    kv, keys = csa_bytes(1, 2, 3)
    with pytest.raises(ValueError, match=r"expected each entry at most once per write, got entry 2 in rows 0 "
                                         r"and 1 \(request \d+ twice\)"):
        cache.write_csa([r, r], [CSA], [[0, 1, 2], [2, 3, 4]], kv, keys)
    with pytest.raises(ValueError, match=r"at most once per write, got entry 1 in row 0 .* columns 1 and 2"):
        cache.write_csa([r], [CSA], [[0, 1, 1]], *csa_bytes(1, 1, 3))
    with pytest.raises(ValueError, match="at most once per write"):
        cache.write_hca([r, r], HCA, [[0, -1], [0, -1]], torch.zeros(2, 2, LAYOUT.entry_bytes, dtype=torch.uint8))
    # the same request twice with disjoint ids, and padding repeated, are fine
    cache.write_csa([r, r], [CSA], [[0, 1, -1], [2, 3, -1]], kv, keys)
    assert torch.equal(cache.read_csa(r, CSA, torch.tensor([0, 1, 2, 3])),
                       torch.cat([kv[0, 0, :2], kv[0, 1, :2]]))


def test_counts_must_be_integers() -> None:
    for name, value in (("num_state_slots", 2.5), ("num_blocks", 0), ("num_blocks", True),
                        ("num_snapshots", 1), ("snapshot_interval", "8")):
        with pytest.raises(ValueError, match=f"^{name}: expected .*int.*, got"):
            TieredKVCache(LAYOUT, **{name: value})
    cache = TieredKVCache(LAYOUT, num_blocks=np.int64(4), num_state_slots=np.int32(1))  # integer-likes
    assert cache.stats()["blocks_total"] == 4 and cache.states.num_slots == 1


def test_negative_and_non_integer_entry_counts_raise(cache_and_request) -> None:
    cache, r = cache_and_request
    with pytest.raises(ValueError, match=r"^num_entries: expected an int >= 0, got -1$"):
        cache.read_hca(r, HCA, -1)
    with pytest.raises(ValueError, match=r"^num_entries: expected an int >= 0, got float 1.5$"):
        cache.read_indexer_keys(r, CSA, 1.5)
    assert cache.read_hca(r, HCA, 0).shape == (0, LAYOUT.entry_bytes)


@pytest.mark.parametrize("as_layer", [np.int64, np.int32, torch.tensor], ids=["np.int64", "np.int32", "tensor"])
def test_integer_like_layers_are_accepted(cache_and_request, as_layer) -> None:
    cache, r = cache_and_request
    kv, keys = csa_bytes(2)
    cache.write_csa(r, as_layer(CSA), [0, 1], kv, keys)
    assert torch.equal(cache.read_csa(r, as_layer(CSA), torch.tensor([0, 1])), kv)
    kv2, keys2 = csa_bytes(1, 2)
    cache.write_csa(r, np.array([CSA]), [2, 3], kv2, keys2)  # a 1-D array of layers
    assert torch.equal(cache.read_indexer_keys(r, as_layer(CSA), 4)[2:], keys2[0])


@pytest.mark.parametrize("layer, message", [
    (2.0, r"^layers?: expected an int .*, got float 2.0$"),
    (True, r"^layers?: expected an int .*, got True$"),
    ("2", r"^layers?: expected an int .*, got str '2'$"),
    (99, r"^layer: expected an int in \[0, \d+\), got 99$"),
])
def test_bad_layers_say_what_was_expected(cache_and_request, layer, message) -> None:
    cache, r = cache_and_request
    with pytest.raises(ValueError, match=message):
        cache.read_csa(r, layer, torch.tensor([0]))
    with pytest.raises(ValueError, match=message):
        cache.write_csa(r, layer, [0], *csa_bytes(1))
