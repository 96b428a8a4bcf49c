"""Classical and State pools: shapes, block records, byte-exact snapshot / restore."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.classical_pool import ClassicalPool
from tiered_kv.presets import deepseek_v4_flash, tiny
from tiered_kv.state_pool import StatePool


def _fill_random(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    if t.dtype == torch.uint8:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    else:
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))


def test_classical_shapes_match_layout() -> None:
    L = tiny()
    pool = ClassicalPool(L, 5, torch.device("cpu"))
    assert pool.csa_kv.shape == (2, 5, 32, 64) and pool.indexer.shape == (2, 5, 32, 32)
    assert pool.hca_kv.shape == (2, 5, 1, 64)
    assert pool.nbytes == 5 * L.block_bytes


def test_block_record_round_trip() -> None:
    L = tiny()
    pool = ClassicalPool(L, 4, torch.device("cpu"))
    for i, p in enumerate(pool.parts):
        _fill_random(p, i)
    rec = pool.read_block(2)
    assert rec.shape == (L.block_bytes,)
    # record order: csa_kv, indexer, hca_kv, each layer-major
    assert torch.equal(rec[:64], pool.csa_kv[0, 2, 0])
    other = ClassicalPool(L, 4, torch.device("cpu"))
    other.write_block(1, rec)
    assert torch.equal(other.read_block(1), rec)
    with pytest.raises(ValueError, match="expected uint8"):
        other.write_block(1, rec[:-1])


def test_state_shapes_flash() -> None:
    L = deepseek_v4_flash()
    pool = StatePool(L, 1, torch.device("cpu"))
    per_slot = sum(t[0].numel() * t.element_size() for t in (pool.swa, pool.csa_tail, pool.idx_tail, pool.hca_tail))
    assert per_slot == L.state_bytes


def test_snapshot_restore_round_trips_byte_exactly() -> None:
    L = tiny()
    pool = StatePool(L, 3, torch.device("cpu"))
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1)
    view = pool.view(a)
    for i, t in enumerate((view.swa, view.csa_tail, view.idx_tail, view.hca_tail)):
        _fill_random(t, 10 + i)
    snap = pool.snapshot(a)
    assert snap.shape == (L.snapshot_bytes,) and snap.dtype == torch.uint8
    pool.restore(b, snap)
    assert torch.equal(pool.snapshot(b), snap)
    vb = pool.view(b)
    r = L.csa_ratio
    assert torch.equal(vb.swa, view.swa)
    assert torch.equal(vb.csa_tail[:, :, :r, :L.head_dim], view.csa_tail[:, :, :r, :L.head_dim])
    # what a resume point does not need is zero after restore
    assert not vb.hca_tail.any() and not vb.csa_tail[:, :, r:].any() and not vb.csa_tail[..., L.head_dim:].any()


def test_state_pool_errors() -> None:
    L = tiny()
    pool = StatePool(L, 1, torch.device("cpu"))
    s = pool.allocate()
    assert pool.allocate() is None
    with pytest.raises(ValueError, match="uint8"):
        pool.restore(s, torch.zeros(L.snapshot_bytes, dtype=torch.float32))
    with pytest.raises(ValueError, match=str(L.snapshot_bytes)):
        pool.restore(s, torch.zeros(3, dtype=torch.uint8))
    pool.free(s)
    with pytest.raises(ValueError, match="double free"):
        pool.free(s)
    with pytest.raises(ValueError, match="allocated"):
        pool.view(s)
