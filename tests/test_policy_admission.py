"""The disk admission filter (tiered_kv.policy.admission): what reaches the disk, exactly.

A record held back is not on disk (a later miss, recomputed), never wrong bytes; a
snapshot is admitted only with every block before it. The oracle: a fresh cache on the
store a filtered run left resumes from disk with the full-recompute logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv import TieredKVCache
from tiered_kv.policy import AdmissionFilter, AdmissionPolicy, admission_policy
from tiered_kv.storage import RecordKind

from _util import random_tokens, serve_once

TOL = 1e-4



def _on_disk(cache: TieredKVCache) -> tuple[set[bytes], set[bytes]]:
    assert cache.disk is not None
    keys = list(cache.disk.store)
    return ({k.block_hash for k in keys if k.kind is RecordKind.BLOCK},
            {k.block_hash for k in keys if k.kind is RecordKind.SNAPSHOT})


def test_names_parse_to_policies() -> None:
    assert admission_policy("all") == AdmissionPolicy(hits=0) and admission_policy("all").write_through
    assert admission_policy("second-hit").hits == 1 and admission_policy("second-hit").label == "second-hit"
    assert admission_policy("hits:3").label == "hits:3"
    assert admission_policy("retraced").label == "retraced" and admission_policy("retraced").seen_twice
    with pytest.raises(ValueError, match="retrace needs seen_twice"):
        AdmissionPolicy(hits=1, retrace=True)
    for bad in ("hits:0", "hits:x", "hits", "first-hit"):
        with pytest.raises(ValueError, match="admission"):
            admission_policy(bad)
    with pytest.raises(TypeError, match="admission"):
        admission_policy(1)  # type: ignore[arg-type]


def test_filter_counts_rejects_and_admits_after_n_hits_once() -> None:
    f = AdmissionFilter(admission_policy("hits:2"), max_tracked=4)
    assert not f.at_write("block", b"a") and f.rejects == 1
    assert not f.hit("block", b"a")  # one hit of two
    assert f.hit("block", b"a") and f.known_on_disk("block", b"a") and f.admitted == 1
    assert not f.hit("block", b"a")  # on disk now: never again
    f.on_disk("snapshot", b"a")  # read from disk: known there, kinds apart
    assert not f.hit("snapshot", b"a") and not f.known_on_disk("block", b"b")
    for i in range(8):  # bounded: the oldest "on disk" is forgotten (at worst written once more)
        f.on_disk("block", bytes([i]))
    assert not f.known_on_disk("block", b"a") and f.known_on_disk("block", bytes([7]))
    twice = AdmissionFilter(admission_policy("seen-twice"))
    # a block is never admitted alone (it goes with an admitted snapshot after it) ...
    assert not twice.at_write("block", b"x") and not twice.at_write("block", b"x")
    # ... a snapshot computed again is (the caller writes its blocks ahead of it)
    assert not twice.at_write("snapshot", b"y") and twice.at_write("snapshot", b"y") and twice.rejects == 3
    assert twice.admitted == 1  # (counted as a snapshot admitted on a hit is)
    assert twice.known_on_disk("snapshot", b"y") and not twice.at_write("snapshot", b"y")  # (on disk: never twice)
    retraced = AdmissionFilter(admission_policy("retraced"))
    assert not retraced.retraces(b"s")  # nothing held back at s yet
    assert not retraced.at_write("snapshot", b"s") and retraced.retraces(b"s")  # held back: sealing it again retraces
    assert not twice.retraces(b"zz") and not twice.at_write("snapshot", b"t", retraced=True)  # (seen-twice ignores it)
    # a snapshot of the request that retraced s is written at once (its blocks with it) ...
    assert retraced.at_write("snapshot", b"t", retraced=True) and retraced.admitted == 1
    assert not retraced.at_write("snapshot", b"t", retraced=True)  # ... once: it is on disk now
    retraced.on_disk("snapshot", b"s")
    assert not retraced.retraces(b"s")  # on disk: a resume reads it, nothing to retrace
    everything = AdmissionFilter(admission_policy("all"))
    assert everything.at_write("block", b"a") and everything.rejects == 0 and not everything.hit("block", b"a")


def test_second_hit_writes_on_the_hit_and_a_fresh_cache_resumes_exactly(tmp_path: Path, tiny_layout,
                                                                          tiny_model) -> None:
    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 's'}"
    once = random_tokens(3 * bt + 9, seed=21)  # sealed, never hit: held back
    twice = random_tokens(5 * bt + 7, seed=22)
    opts: dict = {"num_blocks": 32, "num_state_slots": 1, "store": url, "admission": "second-hit"}
    with TieredKVCache(tiny_layout, **opts) as cache:
        serve_once(tiny_model, cache, once)
        serve_once(tiny_model, cache, twice)
        cache.flush()
        s = cache.stats()
        assert s["disk_writes"] == 0 and s["admission_rejects"] > 0
        rejects = s["admission_rejects"]
        P, _ = serve_once(tiny_model, cache, twice + [3])  # a GPU hit: the prefix and its snapshot go to disk
        assert P == 5 * bt
        cache.flush()
        s = cache.stats()
        assert s["admission_admitted"] == 6 and s["disk_writes"] == 6  # 5 blocks + the snapshot at 5
        assert s["admission_rejects"] == rejects  # nothing new sealed or published: no new reject
        m = cache.metrics()
        assert m.get("tiered_kv_disk_admission_rejects_total") == s["admission_rejects"]
        assert "tiered_kv_disk_admission_rejects_total " in m.to_prometheus()
        blocks, snaps = _on_disk(cache)
        hashes = cache.hasher.block_hashes(twice[:5 * bt])
        assert blocks == set(hashes) and snaps == {hashes[-1]}
        assert not set(cache.hasher.block_hashes(once[:3 * bt])) & blocks
    with TieredKVCache(tiny_layout, **opts) as cache:  # a fresh process: only the disk
        longer = twice + [3, 4, 5]
        P, got = serve_once(tiny_model, cache, longer)
        assert P == 5 * bt and cache.stats()["blocks_from_disk"] == 5
        assert (got - tiny_model.naive_logits(longer)[P:]).abs().max().item() < TOL
        P, got = serve_once(tiny_model, cache, once)  # never admitted: a miss, recomputed
        assert P == 0 and (got - tiny_model.naive_logits(once)).abs().max().item() < TOL
        # read from disk: known there, not written again when hit from the GPU next
        before = cache.stats()["disk_writes"]
        serve_once(tiny_model, cache, longer)
        cache.flush()
        assert cache.stats()["disk_writes"] == before


@pytest.mark.parametrize("admission", ["hits:2", "seen-twice", "retraced", "survived:3"])
def test_snapshot_never_on_disk_without_its_blocks(admission: str, tmp_path: Path, tiny_layout, tiny_model) -> None:
    """hits:2 (and seen-twice: written when computed again) on a prefix tree whose prompts share starts of different lengths: blocks
    are hit more often than the snapshots past them, and a snapshot admitted takes every
    block before it along (and a block goes to disk only so: none is there without a
    snapshot at or after it); served through a small GPU pool and the host tier (hits from
    both). Then a fresh cache resumes every prompt from disk exactly."""
    import random

    bt = tiny_layout.block_tokens
    rng = random.Random(5)
    roots = [random_tokens(4 * bt, seed=50 + i) for i in range(2)]
    prompts = [rng.choice(roots)[:rng.randint(1, 4) * bt] + random_tokens(rng.randint(1, 2) * bt + 3, seed=60 + i)
               for i in range(8)]
    url = f"lmdb://{tmp_path / 's'}"
    opts: dict = {"num_blocks": 10, "num_state_slots": 1, "num_snapshots": 3, "store": url, "admission": admission,
                  "snapshot_policy": "interval:1", "host_bytes": 8 * tiny_layout.block_bytes
                  + 4 * tiny_layout.snapshot_bytes, "host_snapshot_fraction": 0.4}
    with TieredKVCache(tiny_layout, **opts) as cache:
        for _ in range(3):
            for t in prompts:
                serve_once(tiny_model, cache, t)
        cache.flush()
        s = cache.stats()
        assert s["blocks_from_host"] > 0 and s["admission_admitted"] > 0 and s["admission_rejects"] > 0
        blocks, snaps = _on_disk(cache)
        assert snaps
        for t in prompts:
            hashes = cache.hasher.block_hashes(t[:len(t) - len(t) % bt])
            for k, h in enumerate(hashes):
                if h in snaps:
                    assert set(hashes[:k + 1]) <= blocks, f"snapshot at block {k + 1} lacks a block before it"
        # and no block on disk is dead weight: each has a snapshot at or after it there
        live: set[bytes] = set()
        for t in prompts:
            hashes = cache.hasher.block_hashes(t[:len(t) - len(t) % bt])
            live.update(h for k, h in enumerate(hashes) if any(x in snaps for x in hashes[k:]))
        assert blocks <= live, f"{len(blocks - live)} blocks on disk with no snapshot at or after them"
    opts.update(host_bytes=None)
    del opts["host_snapshot_fraction"]
    with TieredKVCache(tiny_layout, **opts) as cache:
        resumed = 0
        for t in prompts:
            P, got = serve_once(tiny_model, cache, t + [7])
            resumed += P
            assert (got - tiny_model.naive_logits(t + [7])[P:]).abs().max().item() < TOL
        assert resumed > 0 and cache.stats()["blocks_from_disk"] > 0


@pytest.mark.parametrize("admission", ["seen-twice", "retraced"])
def test_retraced_writes_the_next_turn_of_a_path_recomputed_and_a_fresh_cache_resumes_it(
        admission: str, tmp_path: Path, tiny_layout, tiny_model) -> None:
    """A conversation's turns: the first turn's snapshot (at its prompt's end) is held
    back, the GPU pool drops the turn, and the next turn (the first one's prompt and
    more) recomputes it. It seals the block where that snapshot was held back: it
    retraced the path, so under ``retraced`` its own snapshot goes to disk with its whole
    path, and a fresh cache resumes a third turn from there with the full-recompute
    logits. ``seen-twice`` writes nothing: no snapshot was published twice."""
    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 's'}"
    turn1 = random_tokens(3 * bt + 5, seed=31)
    turn2 = turn1 + random_tokens(2 * bt + 1, seed=32)
    opts: dict = {"num_blocks": 8, "num_state_slots": 1, "num_snapshots": 2, "store": url, "admission": admission}
    with TieredKVCache(tiny_layout, **opts) as cache:
        assert serve_once(tiny_model, cache, turn1)[0] == 0
        for i in range(3):  # other prompts push the first turn out of the GPU pool
            serve_once(tiny_model, cache, random_tokens(3 * bt + 5, seed=40 + i))
        P, got = serve_once(tiny_model, cache, turn2)
        assert P == 0 and (got - tiny_model.naive_logits(turn2)).abs().max().item() < TOL  # recomputed
        cache.flush()
        blocks, snaps = _on_disk(cache)
        hashes = cache.hasher.block_hashes(turn2[:5 * bt])
        if admission == "seen-twice":
            assert not blocks and not snaps and cache.stats()["disk_writes"] == 0
            return
        assert snaps == {hashes[-1]} and blocks == set(hashes)  # the turn's path, up to its snapshot
        assert cache.stats()["admission_admitted"] == 6
    with TieredKVCache(tiny_layout, **opts) as cache:  # a fresh process: only the disk
        turn3 = turn2 + [5, 6, 7]
        P, got = serve_once(tiny_model, cache, turn3)
        assert P == 5 * bt and cache.stats()["blocks_from_disk"] == 5 and cache.stats()["snapshots_from_disk"] == 1
        assert (got - tiny_model.naive_logits(turn3)[P:]).abs().max().item() < TOL


def test_admission_is_validated_without_a_disk(tiny_layout) -> None:
    with pytest.raises(ValueError, match="admission"):
        TieredKVCache(tiny_layout, num_blocks=4, num_state_slots=1, admission="sometimes")


def test_replay_counts_rejects_and_writes_fewer_disk_bytes() -> None:
    from tiered_kv.replay import Capacity, ReplayConfig, load_trace, replay

    trace = load_trace("bundled:conversation", limit=120)
    base = ReplayConfig(hbm=Capacity.of_tokens(400_000), host=Capacity.of_tokens(1_000_000),
                        disk=Capacity.of_tokens(2_000_000), verify_every=4)
    runs = {}
    for name in ("all", "second-hit"):
        import dataclasses

        report = replay(trace, dataclasses.replace(base, admission_policy=name))
        report.total.check()
        s = report.nodes[0].stats
        runs[name] = (report, s)
    (a, sa), (b, sb) = runs["all"], runs["second-hit"]
    assert sa["admission_rejects"] == 0 and sb["admission_rejects"] > 0 and sb["admission_admitted"] > 0
    assert sb["disk_write_bytes"] < sa["disk_write_bytes"]
    assert b.moved()["gpu->disk"]["blocks"] < a.moved()["gpu->disk"]["blocks"]
    assert b.to_dict()["policies"]["admission"] == "second-hit"
    assert b.total.verified_blocks > 0  # the hits it served were read back byte for byte


def test_survived_filter_defers_records_and_hands_them_back_when_due() -> None:
    f = AdmissionFilter(admission_policy("survived:2"), max_tracked=3)
    assert f.policy.label == "survived:2" and f.policy.hits == 1
    assert not f.at_write("block", b"a") and not f.at_write("snapshot", b"s") and f.rejects == 2
    f.defer(b"s", b"root", b"ds", [(b"a", b"root", b"da")])  # with its block not on disk
    assert f.tick() == [] and f.clock == 1  # lived 1 request of 2
    due = f.tick()
    assert [(d.kind, d.h, d.parent, d.digest, d.before) for d in due] == [
        ("snapshot", b"s", b"root", b"ds", ((b"a", b"root", b"da"),))]
    f.defer(b"t", b"root", b"dt")
    assert f.hit("snapshot", b"t")  # hit first: admitted (second-hit) and known on disk ...
    assert f.tick() == [] and f.tick() == []  # ... so not handed back when due
    for i in range(5):  # bounded: the oldest deferred are forgotten (never written)
        f.defer(bytes([i]), b"root", b"d")
    assert len(f._deferred) == 3
    for bad in ("survived:0", "survived", "survived:x"):
        with pytest.raises(ValueError, match="admission"):
            admission_policy(bad)
    with pytest.raises(ValueError, match="survive needs hits"):
        AdmissionPolicy(hits=0, survive=3)


def test_survived_writes_what_lives_n_requests_and_a_fresh_cache_resumes_exactly(tmp_path: Path, tiny_layout,
                                                                                 tiny_model) -> None:
    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 's'}"
    a = random_tokens(3 * bt + 5, seed=31)
    b = random_tokens(2 * bt + 5, seed=32)
    opts: dict = {"num_blocks": 32, "num_state_slots": 1, "store": url, "admission": "survived:2"}
    with TieredKVCache(tiny_layout, **opts) as cache:
        serve_once(tiny_model, cache, a)
        cache.flush()
        assert cache.stats()["disk_writes"] == 0  # lived 1 request of 2
        serve_once(tiny_model, cache, b)  # a's 3 blocks and its snapshot survived 2 requests in the GPU
        cache.flush()
        s = cache.stats()
        assert s["disk_writes"] == 4 and s["admission_admitted"] == 4 and s["admission_expired"] == 0
        blocks, snaps = _on_disk(cache)
        ha = cache.hasher.block_hashes(a[:3 * bt])
        assert blocks == set(ha) and snaps == {ha[-1]}
    with TieredKVCache(tiny_layout, **opts) as cache:
        P, got = serve_once(tiny_model, cache, a + [9])
        assert P == 3 * bt and cache.stats()["blocks_from_disk"] == 3
        assert (got - tiny_model.naive_logits(a + [9])[P:]).abs().max().item() < TOL
        P, got = serve_once(tiny_model, cache, b)  # held back, then the process ended: a miss
        assert P == 0 and (got - tiny_model.naive_logits(b)).abs().max().item() < TOL


def test_survived_never_writes_what_was_evicted_sooner(tmp_path: Path, tiny_layout, tiny_model) -> None:
    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 's'}"
    opts: dict = {"num_blocks": 4, "num_state_slots": 1, "store": url, "admission": "survived:2"}
    with TieredKVCache(tiny_layout, **opts) as cache:
        first = random_tokens(3 * bt + 5, seed=41)
        serve_once(tiny_model, cache, first)
        serve_once(tiny_model, cache, random_tokens(3 * bt + 5, seed=42))  # evicts first's blocks
        cache.flush()
        s = cache.stats()
        # first's snapshot expired (its blocks were held back with it: never counted apart)
        assert s["admission_expired"] == 1 and s["admission_admitted"] == 0
        m = cache.metrics()
        assert m.get("tiered_kv_disk_admission_expired_total") == s["admission_expired"]
        assert f"tiered_kv_disk_admission_expired_total {s['admission_expired']}" in m.to_prometheus()
        blocks, snaps = _on_disk(cache)
        assert not blocks & set(cache.hasher.block_hashes(first[:3 * bt])) and not snaps


def test_hisparse_write_on_hit_takes_the_full_record_from_the_host_mirror(tmp_path: Path, tiny_layout,
                                                                          tiny_model) -> None:
    """With HiSparse a GPU block holds no CSA part: the block admitted on a hit is written
    from its host mirror (the whole record). A fresh cache without HiSparse resumes it from
    the disk with the full-recompute logits."""
    from tiered_kv.hisparse import HiSparseConfig

    bt = tiny_layout.block_tokens
    url = f"lmdb://{tmp_path / 's'}"
    tokens = random_tokens(3 * bt + 11, seed=51)
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, admission="second-hit",
                       host_bytes=1 << 20, hisparse=HiSparseConfig(device_buffer_entries=16)) as cache:
        serve_once(tiny_model, cache, tokens)
        cache.flush()
        assert cache.stats()["disk_writes"] == 0
        P, got = serve_once(tiny_model, cache, tokens + [4])  # a GPU hit: written from the host mirror
        assert P == 3 * bt and (got - tiny_model.naive_logits(tokens + [4])[P:]).abs().max().item() < TOL
        cache.flush()
        assert cache.stats()["admission_admitted"] == 4 and cache.stats()["disk_writes"] == 4
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url) as cache:
        longer = tokens + [4, 5]
        P, got = serve_once(tiny_model, cache, longer)
        assert P == 3 * bt and cache.stats()["blocks_from_disk"] == 3
        assert (got - tiny_model.naive_logits(longer)[P:]).abs().max().item() < TOL
