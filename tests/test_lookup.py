"""``TieredKVCache.lookup``: per tier, how far a prompt would resume, with no side effect.

Random traffic of prompts sharing prefixes goes through a cache with small GPU, host,
disk and shared (a chain's far level, a local Zarr directory here) tiers, so that blocks
and snapshots are spread over every tier. Before each open, the lookup must (a) leave the
pools exactly as they were (LRU order, refcounts, store access counters), (b) predict the
open's num_cached_tokens exactly, and (c) answer the same from the prompt or its hashes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tiered_kv import TieredKVCache, presets
from tiered_kv.lookup import ResumeIndex, Tier

BT = 128


def _prompt(rng: random.Random, bases: list[list[int]]) -> list[int]:
    base = rng.choice(bases)
    cut = rng.randrange(1, len(base) + 1)
    tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 3 * BT))]
    return base[:cut] + tail


def _state(cache: TieredKVCache) -> tuple:
    pools = [cache.blocks, cache.snapshots.ids]
    if cache.host is not None:
        pools += [cache.host.blocks] + ([cache.host.snapshots] if cache.host.snapshots is not None else [])
    return tuple((p.evictable(), [p.refcount(i) for i in range(p.num_blocks)]) for p in pools)


def _write(cache: TieredKVCache, tokens: list[int]) -> None:
    req = cache.open(tokens)
    cache.reserve(req, len(tokens) - req.num_tokens)
    for k in range(req.num_tokens // BT, -(-len(tokens) // BT)):
        cache.advance(req, tokens[k * BT:(k + 1) * BT])
    cache.close(req)


@pytest.fixture
def tiered(tmp_path: Path) -> TieredKVCache:
    layout = presets.tiny()
    host = 16 * layout.block_bytes + 6 * layout.snapshot_bytes
    store = [f"lmdb://{tmp_path / 'disk'}", f"zarr://{tmp_path / 'shared'}"]
    # a small level 0: records are evicted there while the far level keeps them
    options = {"level_options": [{"max_bytes": 90 * (layout.block_bytes + layout.snapshot_bytes)}, {}]}
    cache = TieredKVCache(layout, num_blocks=24, num_state_slots=2, num_snapshots=6, snapshot_interval=2,
                          host_bytes=host, store=store, store_options=options)
    yield cache
    cache.shutdown()


def test_lookup_predicts_open_and_changes_nothing(tiered: TieredKVCache) -> None:
    rng = random.Random(0)
    bases = [[rng.randrange(0, 1000) for _ in range(rng.randrange(2, 12) * BT)] for _ in range(6)]
    seen = {t: 0 for t in Tier}
    for i in range(120):
        tokens = _prompt(rng, bases)
        if i % 10 == 0:
            tiered.flush(uploads=True, timeout_s=30)  # so the far level holds what level 0 evicts
        # nothing in flight while the lookups and the open run: the last request's writes
        # through to level 0 land (on a loaded machine the writer thread lags), and so do
        # the far hits of the last open, promoted into level 0 behind it (the chain's flush)
        tiered.flush()
        before = _state(tiered)
        look = tiered.lookup(tokens)
        assert _state(tiered) == before, "lookup changed a pool"
        full = len(tokens) // BT
        hashes = tiered.hasher.block_hashes(tokens[:full * BT])
        assert tiered.lookup(block_hashes=hashes, num_tokens=len(tokens)) == look
        counts = [look.tokens(t) for t in look.tiers]
        assert counts == sorted(counts) and look.tiers == (Tier.GPU, Tier.HOST, Tier.DISK, Tier.SHARED)
        assert look.resident_tokens() >= look.tokens()
        req = tiered.open(tokens)
        assert req.num_cached_tokens == look.tokens(), f"request {i}"
        for t in look.block_tiers[:look.blocks()]:
            seen[t] += 1
        tiered.close(req)
        _write(tiered, tokens)
    assert all(seen[t] > 0 for t in Tier), seen  # every tier served some block


def test_lookup_of_hashes_alone_may_resume_every_block(tiered: TieredKVCache) -> None:
    tokens = list(range(4 * BT))
    _write(tiered, tokens)
    hashes = tiered.hasher.block_hashes(tokens)
    assert tiered.lookup(tokens).blocks() == 3  # one token is always recomputed
    assert tiered.lookup(block_hashes=hashes).blocks() == 4  # the prompt goes on past the hashes
    assert tiered.lookup(block_hashes=hashes[:2], num_tokens=2 * BT + 1).blocks() == 2
    with pytest.raises(ValueError, match="expected num_tokens >= that"):
        tiered.lookup(block_hashes=hashes, num_tokens=BT)
    with pytest.raises(ValueError, match="token_ids or block_hashes"):
        tiered.lookup()
    with pytest.raises(TypeError, match=r"block_hashes\[0\]: expected bytes"):
        tiered.lookup(block_hashes=["ab"])  # type: ignore[list-item]


def test_a_store_alone_is_the_disk_and_a_chain_adds_shared(tiered: TieredKVCache) -> None:
    tokens = list(range(3 * BT + 5))
    _write(tiered, tokens)
    tiered.flush(uploads=True, timeout_s=30)
    hashes = tiered.hasher.block_hashes(tokens[:3 * BT])
    chain = tiered.disk.store
    look = ResumeIndex.of_store(chain, BT).lookup(hashes, num_tokens=len(tokens))
    assert look.tiers == (Tier.DISK, Tier.SHARED) and look.blocks() == 3
    assert look.to_dict()["tokens"] == {"disk": 3 * BT, "shared": 3 * BT}
    far = chain.levels()[1]
    look = ResumeIndex.of_store(far, BT).lookup(hashes, num_tokens=len(tokens))
    assert look.tiers == (Tier.DISK,) and look.tokens() == 3 * BT


def test_cli_lookup_of_prompts_and_of_hashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_kv.cli.main import ExitCode, main

    store = tmp_path / "store"
    layout = presets.tiny()
    with TieredKVCache(layout, num_blocks=16, num_state_slots=1, store=f"lmdb://{store}") as cache:
        prompt = list(range(5 * BT + 3))
        _write(cache, prompt)
        hashes = cache.hasher.block_hashes(prompt[:5 * BT])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "tokens": prompt}) + "\n"
                       + json.dumps({"id": "b", "tokens": prompt[:2 * BT] + [9] * 300}) + "\n")
    assert main(["lookup", "--store", str(store), "--prompts", str(prompts), "--json"]) == ExitCode.OK
    rows = {r["id"]: r for r in json.loads(capsys.readouterr().out)["prompts"]}
    assert rows["a"]["resumable_tokens"] == {"disk": 5 * BT} and rows["a"]["resident_tokens"] == {"disk": 5 * BT}
    # b shares 2 blocks with a, but a left snapshots only at its last two boundaries (4, 5)
    assert rows["b"]["resident_tokens"] == {"disk": 2 * BT} and rows["b"]["resumable_tokens"]["disk"] < 2 * BT
    hfile = tmp_path / "h.jsonl"
    hfile.write_text(json.dumps({"id": "a", "hashes": [h.hex() for h in hashes[:4]]}) + "\n")
    assert main(["lookup", "--store", str(store), "--hashes", str(hfile)]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "resume disk" in out and f"{4 * BT}" in out.splitlines()[-1]
    hfile.write_text('{"id": "x", "hashes": ["zz"]}\n')
    assert main(["lookup", "--store", str(store), "--hashes", str(hfile)]) == ExitCode.USAGE
