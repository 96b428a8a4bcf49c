"""bench/hisparse.py: trace recording and the LRU replay, on tiny traces (not a timing test)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hb():
    """bench/hisparse.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_hisparse", ROOT / "bench" / "hisparse.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_synthetic_trace_keeps_exactly_p_of_the_previous_step(hb) -> None:
    trace = hb.synthetic_trace(p=0.75, num_entries=4096, top_k=32, steps=20, warmup_steps=4, seed=1)
    assert trace.steps == 20 and len(trace.calls) == 24
    sets = [set(c.ids.tolist()) for c in trace.calls]
    for prev, cur in zip(sets, sets[1:]):
        assert len(cur) == 32
        assert len(prev & cur) == 24  # round(0.75 * 32): the rest is drawn outside prev
    assert all(0 <= i < 4096 for s in sets for i in s)
    assert all(bool((c.ids[1:] > c.ids[:-1]).all()) for c in trace.calls)  # sorted, unique


@pytest.mark.parametrize("draw", ["uniform", "zipf"])
def test_replay_of_a_tiny_synthetic_trace(hb, draw: str) -> None:
    k, p = 32, 0.8
    trace = hb.synthetic_trace(p=p, draw=draw, num_entries=4096, top_k=k, steps=40,
                               warmup_steps=hb.fill_warmup_steps(p, k, 8), seed=2)
    rows = {r.multiple: r for r in hb.replay(trace, (1, 2, 4, 8))}
    keep = round(p * k)
    for m, r in rows.items():
        assert r.buffer_entries == m * k
        assert r.steps == 40 and r.csa_layers == 1
        assert r.ids == 40 * k
        assert r.hits + r.misses == r.ids
        assert r.bytes_moved == r.misses * r.replay_entry_bytes == r.misses * 8
        assert r.flash_bytes_per_step == pytest.approx(r.misses / 40 * 584)
        assert r.baseline_flash_bytes_per_step == pytest.approx(k * 584)
        assert r.misses_per_step_max <= k
        assert r.matches_cache is None  # synthetic: no cache to compare with
    # 1x: the buffer holds exactly the previous step, so the hits are exactly the kept ids
    assert rows[1].hits == 40 * keep
    # a larger LRU buffer holds the smaller one's recent entries (up to ties within a step),
    # so on the same trace it does not hit less
    assert rows[1].hit_rate <= rows[2].hit_rate <= rows[4].hit_rate <= rows[8].hit_rate
    if draw == "zipf":  # hot entries recur beyond one step: the larger buffer catches them
        assert rows[8].hit_rate > rows[1].hit_rate


def test_model_trace_replay_reproduces_the_cache(hb) -> None:
    trace = hb.record_model_trace(top_k=8, prefill=300, decode=10, warmup_steps=2, seed=3, run_multiple=2)
    assert trace.kind == "model" and trace.num_csa_layers == 2 and trace.steps == 10
    assert trace.check is not None and trace.check.buffer_entries == 16
    measured = [c for c in trace.calls if c.step != hb.WARMUP]
    assert {c.part for c in measured} == {0, 1}
    assert all(c.ids.numel() <= 8 for c in measured)  # one query's top-k, sealed entries only
    rows = {r.multiple: r for r in hb.replay(trace, (1, 2, 8))}
    # the replay at the run's own N equals the cache's hisparse counters over the steps
    assert rows[2].matches_cache is True
    assert (rows[2].hits, rows[2].misses) == (trace.check.hits, trace.check.misses)
    assert rows[1].matches_cache is None and rows[8].matches_cache is None
    assert rows[1].hit_rate <= rows[2].hit_rate <= rows[8].hit_rate
    for r in rows.values():
        assert r.ids == sum(c.ids.numel() for c in measured)
        assert r.bytes_moved == r.misses * r.replay_entry_bytes


def test_replay_mirror_rows_hold_their_ids(hb) -> None:
    trace = hb.synthetic_trace(p=0.5, num_entries=100, top_k=8, steps=1, warmup_steps=0)
    layout = hb.replay_layout(trace)
    mirror = hb.replay_mirror(layout, 100)
    E = layout.csa_entries_per_block
    assert mirror.shape == (-(-100 // E), E, 8) and mirror.dtype == torch.uint8
    ids = torch.tensor([0, 5, 31, 32, 99])
    rows = mirror.reshape(-1, 8)[ids].contiguous().view(torch.int64).flatten()
    assert rows.tolist() == ids.tolist()


def test_main_writes_json_and_png(hb, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny_model = dict(top_k=8, prefill=300, decode=6, warmup_steps=2)
    monkeypatch.setattr(hb, "build_traces", lambda quick, seed: [
        hb.record_model_trace(seed=seed, **tiny_model),
        hb.synthetic_trace(p=0.8, num_entries=2048, top_k=16, steps=8, warmup_steps=2, seed=seed),
    ])
    hb.main(["--quick", "--out", str(tmp_path)])
    meta = json.loads((tmp_path / "hisparse.json").read_text())
    assert meta["benchmark"] == "hisparse" and meta["flash_entry_bytes"] == 584
    assert len(meta["rows"]) == 2 * len(hb.MULTIPLES)
    for row in meta["rows"]:
        assert row["bytes_moved"] == row["misses"] * row["replay_entry_bytes"]
        assert row["flash_bytes_per_step_layer"] == pytest.approx(row["misses_per_step_layer"] * 584)
    assert (tmp_path / "hisparse.png").stat().st_size > 0
