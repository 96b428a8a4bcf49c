"""Eviction policies (tiered_kv.policy.eviction): leaves first strands nothing, serves
the same bytes, and every policy pair keeps the oracle's logits."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from pathlib import Path

import pytest

from tiered_kv import TieredKVCache
from tiered_kv.policy import eviction_policy
from tiered_kv.replay import Capacity, ReplayConfig, load_trace, replay

from _util import random_tokens, serve_once

TOL = 1e-4


def test_names_parse() -> None:
    assert eviction_policy("leaf-lru").leaf_first and not eviction_policy("lru").leaf_first
    s3 = eviction_policy("leaf-s3fifo")
    assert s3.leaf_first and s3.coherent_snapshots and s3.small_fraction == 0.1
    assert eviction_policy("leaf-s3fifo:25").small_fraction == 0.25 and eviction_policy("leaf-s3fifo:25").label == "leaf-s3fifo:25"
    for bad in ("arc", "leaf-s3fifo:0", "leaf-s3fifo:100", "leaf-s3fifo:x", "lru:3"):
        with pytest.raises(ValueError, match="eviction"):
            eviction_policy(bad)


def test_the_defaults_are_branch_points_and_leaves_first(tiny_layout) -> None:
    """Issue 22: the cache's defaults, declared once (tiered_kv.policy) and used by the
    cache, the replay's config and its CLI; ``snapshot_interval`` alone keeps its meaning."""
    from tiered_kv.policy import DEFAULT_EVICTION, DEFAULT_SNAPSHOT_POLICY
    from tiered_kv.replay import Capacity, ReplayConfig

    assert (DEFAULT_SNAPSHOT_POLICY, DEFAULT_EVICTION) == ("branch+interval:32", "leaf-lru")
    cache = TieredKVCache(tiny_layout, num_blocks=4, num_state_slots=1, host_bytes=1 << 20)
    assert cache.snapshot_policy.label == "branch+interval:32" and cache.snapshot_interval == 32
    assert cache.eviction.label == "leaf-lru" and cache.blocks.leaf_first and cache.host.blocks.leaf_first
    assert TieredKVCache(tiny_layout, num_blocks=4, num_state_slots=1, snapshot_interval=8).snapshot_policy.label == "interval:8"
    cfg = ReplayConfig(hbm=Capacity.of_tokens(100_000))
    assert (cfg.snapshot().label, cfg.eviction().label) == ("branch+interval:32", "leaf-lru")


def test_default_policies_resume_exactly_on_every_tier(tmp_path: Path, tiny_layout, tiny_model) -> None:
    """Exactness with the defaults: a prefix tree through a small GPU pool, the host tier
    and the disk, each request's logits against a full recompute; then a fresh cache
    resumes every prompt from the disk alone, exactly."""
    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 'disk'}"
    opts: dict = {"num_blocks": 9, "num_state_slots": 1, "num_snapshots": 4, "store": url,
                  "host_bytes": 12 * tiny_layout.block_bytes + 4 * tiny_layout.snapshot_bytes,
                  "host_snapshot_fraction": 0.4}
    prompts = _prompts(bt, 12, seed=17)
    seen: set[str] = set()
    with TieredKVCache(tiny_layout, **opts) as cache:
        for tokens in prompts:
            req = cache.open(tokens)
            P = req.num_cached_tokens
            got = tiny_model.forward(cache, req, tokens[P:])
            cache.close(req)
            assert (got - tiny_model.naive_logits(tokens)[P:]).abs().max().item() < TOL
        s = cache.stats()
        seen |= {t for t, k in (("host", "blocks_from_host"), ("branch", "snapshots_branch")) if s[k]}
    with TieredKVCache(tiny_layout, num_blocks=14, num_state_slots=1, store=url) as cache:
        resumed = _resume_each_exactly(cache, tiny_model, prompts)
        assert resumed > 0 and cache.stats()["blocks_from_disk"] > 0
    assert seen == {"host", "branch"}  # the host tier served, and branch-point snapshots were published


def test_an_evicting_disk_keeps_whole_paths_and_resumes_exactly(tmp_path: Path, tiny_layout, tiny_model) -> None:
    """The store itself evicts (``max_bytes`` of about a third of the tree): it takes
    leaves first (storage/lmdb/tree.py), so every block it still holds has its whole path
    before it there, and every snapshot its blocks. A fresh cache then resumes each
    prompt from the disk alone with the full-recompute logits."""
    from tiered_kv.storage import RecordKey, RecordKind, record_size

    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 'disk'}"
    max_bytes = 16 * record_size(tiny_layout.block_bytes) + 6 * record_size(tiny_layout.snapshot_bytes)
    opts: dict = {"num_blocks": 9, "num_state_slots": 1, "num_snapshots": 4, "store": url,
                  "store_options": {"max_bytes": max_bytes}, "snapshot_policy": "interval:2"}
    prompts = _prompts(bt, 12, seed=23)
    with TieredKVCache(tiny_layout, **opts) as cache:
        parent: dict[bytes, bytes | None] = {}
        for tokens in prompts:
            hashes = cache.hasher.block_hashes(tokens)
            parent.update(zip(hashes, [None, *hashes[:-1]]))
            req = cache.open(tokens)
            P = req.num_cached_tokens
            got = tiny_model.forward(cache, req, tokens[P:])
            cache.close(req)
            assert (got - tiny_model.naive_logits(tokens)[P:]).abs().max().item() < TOL
        cache.flush()
        store = cache.disk.store
        assert store.stats()["evictions"] > 10
        held = list(store)
        blocks = {k.block_hash for k in held if k.kind == RecordKind.BLOCK}
        snaps = {k.block_hash for k in held if k.kind == RecordKind.SNAPSHOT}
        for h in blocks | snaps:  # every record's whole path is on disk
            x = parent[h] if h in blocks else h
            while x is not None:
                assert x in blocks, f"{RecordKey.block(x)!r} missing before {h.hex()[:8]}"
                x = parent[x]
        useful: set[bytes] = set()  # the blocks at or before a snapshot on disk
        for h in snaps:
            x: bytes | None = h
            while x is not None and x not in useful:
                useful.add(x)
                x = parent[x]
        assert blocks == useful, "blocks on disk with no snapshot at or after them"
        assert len(snaps) >= 3
    with TieredKVCache(tiny_layout, num_blocks=14, num_state_slots=1, store=url,
                       store_options={"max_bytes": max_bytes}) as cache:
        resumed = _resume_each_exactly(cache, tiny_model, reversed(prompts))  # the most recent first: what the disk kept
        assert resumed > 0 and cache.stats()["blocks_from_disk"] > 0


@pytest.fixture(scope="module")
def head():
    return load_trace("bundled:conversation").head(150)


@pytest.mark.parametrize(("hbm", "host"), [(1_000_000, None), (600_000, 1_000_000)], ids=["gpu-only", "gpu+host"])
def test_leaf_lru_strands_nothing_where_lru_does(head, hbm: int, host: int | None) -> None:
    def run(eviction: str):
        cfg = ReplayConfig(hbm=Capacity.of_tokens(hbm), host=None if host is None else Capacity.of_tokens(host), snapshot_policy="branch",
                           eviction_policy=eviction, verify_every=4)
        return replay(head, cfg)

    lru, leaf = run("lru"), run("leaf-lru")
    lost = {r.config.eviction().label: sum(sum(v.values()) for v in r.stranded().values()) for r in (lru, leaf)}
    assert lost["lru"] > 0 and lost["leaf-lru"] == 0
    assert leaf.total.hits >= lru.total.hits  # nothing useful was given up for it
    assert leaf.total.verified_blocks > 0  # and what it served was read back byte-exact


def _resume_each_exactly(cache: TieredKVCache, model, prompts: Iterable[list[int]]) -> int:
    """Open each prompt plus one token, run the reference model from where the cache
    resumed, and assert its logits equal a full recompute; returns the tokens resumed."""
    resumed = 0
    for tokens in prompts:
        req = cache.open(tokens + [3])
        P = req.num_cached_tokens
        resumed += P
        got = model.forward(cache, req, (tokens + [3])[P:])
        cache.close(req)
        assert (got - model.naive_logits(tokens + [3])[P:]).abs().max().item() < TOL
    return resumed


def _prompts(bt: int, n: int, seed: int) -> list[list[int]]:
    """Prompts on a small prefix tree: a few roots, branches at random boundaries."""
    rng = random.Random(seed)
    roots = [random_tokens(4 * bt, seed=seed * 100 + i) for i in range(3)]
    out = []
    for i in range(n):
        root = rng.choice(roots)
        cut = rng.randint(2, 4) * bt
        out.append(root[:cut] + random_tokens(rng.randint(1, 3) * bt + rng.randint(1, bt - 1), seed=seed * 1000 + i))
    return out


POLICIES = list(itertools.product(["interval:2", "branch+interval:2"], ["lru", "leaf-lru", "leaf-s3fifo:25"]))


@pytest.mark.parametrize("tiers", ["gpu", "host", "disk"], ids=["hbm", "hbm+host", "hbm+host+disk"])
@pytest.mark.parametrize(("snapshots", "eviction"), POLICIES)
def test_every_policy_serves_the_full_recompute_logits(snapshots: str, eviction: str, tiers: str, tmp_path: Path,
                                                        tiny_layout, tiny_model) -> None:
    bt = tiny_layout.block_tokens
    opts: dict = {"num_blocks": 14, "num_state_slots": 1, "num_snapshots": 4, "snapshot_policy": snapshots,
                  "eviction": eviction}
    if tiers != "gpu":
        opts["host_bytes"] = 12 * tiny_layout.block_bytes + 4 * tiny_layout.snapshot_bytes
        opts["host_snapshot_fraction"] = 0.4
    if tiers == "disk":
        opts["store"] = f"lmdb://{tmp_path / 'disk'}"
    resumed = 0
    with TieredKVCache(tiny_layout, **opts) as cache:
        for tokens in _prompts(bt, 8, seed=7):
            req = cache.open(tokens)
            P = req.num_cached_tokens
            resumed += P
            got = tiny_model.forward(cache, req, tokens[P:])
            cache.close(req)
            assert (got - tiny_model.naive_logits(tokens)[P:]).abs().max().item() < TOL
            cache.blocks.check_invariants()
            if cache.host is not None:
                cache.host.blocks.check_invariants()
    assert resumed > 0  # the tree was resumed from, under eviction pressure


def test_written_through_a_path_the_store_evicted_is_written_again_ahead_of_what_extends_it(
        tmp_path: Path, tiny_layout, tiny_model) -> None:
    """Issue 22 item 2 under ``all``: a prefix the GPU pool still holds that the (far
    smaller) store evicted. The next request that extends it writes the evicted blocks
    again, in path order, ahead of its own, so nothing lands on disk behind a missing
    block (before: its new blocks and snapshot, stranded there until evicted in turn;
    the whole synthetic trace at host 3M / disk 4M tokens ended with 5.4 MB so)."""
    from tiered_kv.storage import RecordKind, record_size

    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 'disk'}"
    max_bytes = 6 * record_size(tiny_layout.block_bytes) + 2 * record_size(tiny_layout.snapshot_bytes)
    opts: dict = {"num_blocks": 40, "num_state_slots": 1, "num_snapshots": 8, "store": url, "admission": "all",
                  "store_options": {"max_bytes": max_bytes}}
    a = random_tokens(4 * bt + 3, seed=71)
    with TieredKVCache(tiny_layout, **opts) as cache:
        store = cache.disk.store
        serve_once(tiny_model, cache, a)
        for i in range(2):  # two more prompts of the same size: the store evicts all of a's
            serve_once(tiny_model, cache, random_tokens(4 * bt + 3, seed=72 + i))
        cache.flush()
        a_hashes = cache.hasher.block_hashes(a[:4 * bt])
        blocks = {k.block_hash for k in store if k.kind is RecordKind.BLOCK}
        assert not blocks & set(a_hashes)  # (the case: gone from disk, still in the GPU pool)
        longer = a + random_tokens(2 * bt + 1, seed=75)
        P, got = serve_once(tiny_model, cache, longer)
        assert P == 4 * bt and (got - tiny_model.naive_logits(longer)[P:]).abs().max().item() < TOL
        cache.flush()
        hashes = cache.hasher.block_hashes(longer[:6 * bt])
        held = list(store)
        blocks = {k.block_hash for k in held if k.kind is RecordKind.BLOCK}
        snaps = {k.block_hash for k in held if k.kind is RecordKind.SNAPSHOT}
        assert set(hashes) <= blocks and hashes[-1] in snaps  # the whole path, up to its snapshot
        assert cache.stats()["disk_blocks_rewritten"] == 4
    with TieredKVCache(tiny_layout, num_blocks=14, num_state_slots=1, store=url) as cache:  # the disk alone
        P, got = serve_once(tiny_model, cache, longer + [9])
        assert P == 6 * bt and cache.stats()["blocks_from_disk"] == 6
        assert (got - tiny_model.naive_logits(longer + [9])[P:]).abs().max().item() < TOL
