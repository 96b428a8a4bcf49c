"""Issue 22 item 5: nothing lost, nothing wrong served, with every new policy on.

The crash (kill -9 after ``flush()``), the fault tests (a corrupt disk record, a full
store) and the exactness oracle (reference-model logits against a full recompute) run
under each pair of (snapshot policy, eviction policy) in :data:`POLICIES`, and the
crash and the corrupt record under each disk admission filter (:data:`FILTERS`). And a policy
that is wrong about its own state (a leaf-first pool's child counts forgotten or made
up) evicts in another order, so some requests miss and recompute, but no request is
served wrong bytes: the prefix lookup walks the path and verifies, the order only
decides what is kept.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tiered_kv import TieredKVCache
from tiered_kv.storage import RecordKey

from _util import lmdb_raw_read, lmdb_raw_write, random_tokens

HERE = Path(__file__).parent
TOL = 1e-4
POLICIES = list(itertools.product(["interval:8", "branch+interval:32"], ["lru", "leaf-lru"]))
IDS = [f"{s}-{e}" for s, e in POLICIES]


def _worker(url: str, phase: str, snapshots: str, eviction: str, *, rc: int = 0, admission: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    extra = [] if admission is None else [admission]
    out = subprocess.run([sys.executable, str(HERE / "_disk_worker.py"), url, phase, "300", snapshots, eviction,
                          *extra], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == rc, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _flip_block_1_and_resume_exactly(tmp_path: Path, opts: dict, tokens: list[int], hashes: list,
                                     at: int, tiny_layout, tiny_model) -> None:
    """Flip one bit (``1/at`` into the record) of block 1 on disk, then resume a longer
    prompt in a fresh cache: never past block 1, the full-recompute logits, one counted
    corrupt record."""
    key = RecordKey.block(hashes[1]).to_bytes()
    rec = bytearray(lmdb_raw_read(tmp_path / "s", key))
    rec[len(rec) // at] ^= 0x01
    lmdb_raw_write(tmp_path / "s", key, bytes(rec))
    longer = tokens + [1, 2]
    with TieredKVCache(tiny_layout, **opts) as cache:
        req = cache.open(longer)
        P = req.num_cached_tokens
        assert P < 256  # block 1 is unusable: never resumed past it
        got = tiny_model.forward(cache, req, longer[P:])
        cache.close(req)
        assert (got - tiny_model.naive_logits(longer)[P:]).abs().max().item() < TOL
        s = cache.stats()
        assert s["disk_read_failures"] >= 1 and s["store_corrupt"] == 1


@pytest.mark.parametrize(("snapshots", "eviction"), POLICIES, ids=IDS)
def test_killed_after_flush_the_next_process_resumes_exactly(tmp_path: Path, snapshots: str, eviction: str) -> None:
    """A process killed with SIGKILL right after ``flush()`` lost nothing it flushed: the
    next process, with the same policies, resumes from the disk and matches a full
    recompute."""
    url = f"lmdb://{tmp_path / 'store'}"
    a = _worker(url, "kill", snapshots, eviction, rc=-signal.SIGKILL)
    # 300 tokens: 2 blocks; interval:8 publishes the last two boundaries (2 snapshots),
    # branch+interval:32 the last boundary only (the prompt does not end on one)
    assert a["disk_writes"] == (4 if snapshots == "interval:8" else 3) and a["disk_write_errors"] == 0
    b = _worker(url, "b", snapshots, eviction)
    assert b["cached"] == 256 and b["blocks_from_disk"] == 2 and b["snapshots_from_disk"] == 1
    assert b["err"] < TOL


@pytest.mark.parametrize(("snapshots", "eviction"), POLICIES, ids=IDS)
def test_corrupt_disk_block_is_a_counted_miss_under_every_policy(tmp_path: Path, snapshots: str, eviction: str,
                                                                  tiny_layout, tiny_model) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    opts = {"num_blocks": 8, "num_state_slots": 1, "store": url, "snapshot_policy": snapshots, "eviction": eviction}
    tokens = random_tokens(300, seed=8)
    with TieredKVCache(tiny_layout, **opts) as cache:
        req = cache.open(tokens)
        tiny_model.forward(cache, req, tokens)
        cache.close(req)
        cache.flush()
        hashes = cache.hasher.block_hashes(tokens)
    _flip_block_1_and_resume_exactly(tmp_path, opts, tokens, hashes, 2, tiny_layout, tiny_model)


@pytest.mark.parametrize(("snapshots", "eviction"), POLICIES, ids=IDS)
def test_full_store_keeps_serving_exactly_under_every_policy(tmp_path: Path, snapshots: str, eviction: str,
                                                             tiny_layout, tiny_model) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    store_opts = {"max_bytes": 64 << 10, "map_size": 96 << 10, "initial_map_size": 96 << 10}
    tokens = random_tokens(1300, seed=9)
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, store_options=store_opts,
                       snapshot_policy=snapshots, eviction=eviction) as cache:
        req = cache.open(tokens)
        got = tiny_model.forward(cache, req, tokens)
        cache.close(req)
        cache.flush()
        assert (got - tiny_model.naive_logits(tokens)).abs().max().item() < TOL
        s = cache.stats()
        assert s["store_bytes"] <= store_opts["max_bytes"]
        assert s["store_evictions"] > 0 or s["disk_write_errors"] > 0
        again = cache.open(tokens)
        P = again.num_cached_tokens
        assert P > 0
        got = tiny_model.forward(cache, again, tokens[P:] + [5])
        cache.close(again)
        assert (got - tiny_model.naive_logits(tokens + [5])[P:]).abs().max().item() < TOL


#: the disk admission filters, under the cache's default policies
FILTERS = ["second-hit", "seen-twice", "retraced", "survived:1"]


@pytest.mark.parametrize("admission", FILTERS)
def test_killed_after_flush_under_a_filter_loses_nothing_admitted(tmp_path: Path, admission: str) -> None:
    """Under each filter the prefix served twice (a hit; survived:1: it lived a request)
    is admitted; a process killed right after ``flush()`` lost none of it: the next one
    resumes it from the disk with the full-recompute logits."""
    url = f"lmdb://{tmp_path / 'store'}"
    a = _worker(url, "kill", "branch+interval:32", "leaf-lru", rc=-signal.SIGKILL, admission=admission)
    assert a["disk_writes"] == 3 and a["admission_admitted"] == 3 and a["disk_write_errors"] == 0  # 2 blocks + snapshot
    b = _worker(url, "b", "branch+interval:32", "leaf-lru")
    assert b["cached"] == 256 and b["blocks_from_disk"] == 2 and b["snapshots_from_disk"] == 1
    assert b["err"] < TOL


@pytest.mark.parametrize("admission", FILTERS)
def test_corrupt_admitted_block_is_a_counted_miss_under_a_filter(tmp_path: Path, admission: str, tiny_layout,
                                                                 tiny_model) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    opts = {"num_blocks": 8, "num_state_slots": 1, "store": url, "admission": admission}
    tokens = random_tokens(300, seed=18)
    with TieredKVCache(tiny_layout, **opts) as cache:
        for _ in range(2):  # the second time a hit: admitted by every filter
            req = cache.open(tokens)
            tiny_model.forward(cache, req, tokens[req.num_cached_tokens:])
            cache.close(req)
        cache.flush()
        assert cache.stats()["admission_admitted"] == 3
        hashes = cache.hasher.block_hashes(tokens)
    _flip_block_1_and_resume_exactly(tmp_path, opts, tokens, hashes, 3, tiny_layout, tiny_model)


def _tree(bt: int, n: int, seed: int) -> list[list[int]]:
    """Prompts on a small prefix tree: 3 roots of 4 blocks, cut at 2-4 blocks, each
    followed by 1-3 blocks and a partial block of its own."""
    import random

    rng = random.Random(seed)
    roots = [random_tokens(4 * bt, seed=seed * 100 + i) for i in range(3)]
    return [rng.choice(roots)[:rng.randint(2, 4) * bt]
            + random_tokens(rng.randint(1, 3) * bt + rng.randint(1, bt - 1), seed=seed * 1000 + i) for i in range(n)]


@pytest.mark.parametrize("eviction", ["leaf-lru", "leaf-s3fifo:25"])
@pytest.mark.parametrize("wrong", ["forgotten", "made-up"])
@pytest.mark.parametrize("tiers", ["gpu", "host"], ids=["hbm", "hbm+host"])
def test_a_policy_wrong_about_its_state_misses_never_serves_wrong_bytes(wrong: str, tiers: str, eviction: str,
                                                                       tiny_layout, tiny_model) -> None:
    """A ``leaf-lru`` pool whose child counts are wrong: ``forgotten`` (every parked or
    interior block's count dropped, so it is evicted while its children stay: they are
    stranded) or ``made-up`` (every leaf counted as having children, so it is parked and
    interior blocks go first). Either way the requests after it resume no further than
    their path is held and snapshotted (a miss, recomputed) and give the full-recompute
    logits; the pool's own check names the broken bookkeeping."""
    bt = tiny_layout.block_tokens
    opts: dict = {"num_blocks": 14, "num_state_slots": 1, "num_snapshots": 4, "snapshot_policy": "branch+interval:2",
                  "eviction": eviction}
    if tiers == "host":
        opts["host_bytes"] = 12 * tiny_layout.block_bytes + 4 * tiny_layout.snapshot_bytes
        opts["host_snapshot_fraction"] = 0.4
    prompts = _tree(bt, 12, seed=11)
    resumed = broken_at = 0
    with TieredKVCache(tiny_layout, **opts) as cache:
        pools = [cache.blocks] + ([cache.host.blocks] if cache.host is not None else [])
        for i, tokens in enumerate(prompts):
            if i == 4:  # the tree is cached and the pools full: break the policy's state
                broken_at = sum(pool.evictions for pool in pools)
                for pool in pools:
                    if wrong == "forgotten":
                        pool._children.clear()
                    else:
                        for h in list(pool.cached):
                            pool._children[h] = pool._children.get(h, 0) + 3
                    with pytest.raises(AssertionError, match="child counts"):
                        pool.check_invariants()
            req = cache.open(tokens)
            P = req.num_cached_tokens
            resumed += P if i >= 4 else 0
            got = tiny_model.forward(cache, req, tokens[P:])
            cache.close(req)
            assert (got - tiny_model.naive_logits(tokens)[P:]).abs().max().item() < TOL, f"request {i}"
        evictions = sum(pool.evictions for pool in pools) - broken_at
    assert resumed > 0 and evictions > 0  # resumes and evictions happened on the broken state
