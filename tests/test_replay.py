"""``tiered_kv.replay``: Mooncake traces through the real tiers.

* the bundled traces are the published files (sha256), malformed lines are named;
* tokens from hash ids: the same id gives the same tokens, tails are the request's own;
* the stand-in layouts keep the block : snapshot byte ratio exactly;
* the exactness test: the replay's HBM-only hit rate at 512-token blocks equals a plain LRU
  prefix simulation over the same hash ids, written here;
* every tier at once: the tokens add up, each tier serves and is verified byte-exact;
* a corrupt disk record is a miss counted as ``corrupt``, never wrong bytes;
* the CLI: table, JSON, a sweep, a policy comparison.
"""

from __future__ import annotations

import collections
import hashlib
import json
import lzma
from importlib import resources
from pathlib import Path

import pytest

from tiered_kv import presets
from tiered_kv.cli.main import ExitCode, main
from tiered_kv.lookup import Tier
from tiered_kv.replay import Capacity, ReplayConfig, TokenMaker, load_trace, replay, stand_in
from tiered_kv.replay.node import Node
from tiered_kv.replay.trace import Trace, TraceRequest

BT = 512


@pytest.fixture(scope="module")
def conversation() -> Trace:
    return load_trace("bundled:conversation", limit=400)


# ------------------------------------------------------------------------------ the traces
@pytest.mark.parametrize("name,requests,tokens,sha256", [
    ("conversation", 12_031, 144_793_823, "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"),
    ("synthetic", 3_993, 61_194_628, "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"),
])
def test_bundled_traces_are_the_published_files(name: str, requests: int, tokens: int, sha256: str) -> None:
    data = resources.files("tiered_kv.replay").joinpath("data", f"{name}_trace.jsonl.xz").read_bytes()
    assert hashlib.sha256(lzma.decompress(data)).hexdigest() == sha256
    trace = load_trace(f"bundled:{name}")
    assert (len(trace), trace.prompt_tokens) == (requests, tokens)
    notice = resources.files("tiered_kv.replay").joinpath("data", "NOTICE.md").read_text()
    assert "Apache License, Version 2.0" in notice and "kvcache-ai/Mooncake" in notice
    assert "Apache License" in resources.files("tiered_kv.replay").joinpath("data", "LICENSE-APACHE").read_text()


def test_malformed_trace_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "hash_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: hash_ids: 3 ids of 512 tokens for a prompt of 600"):
        load_trace(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1: expected a JSON object"):
        load_trace(path)
    with pytest.raises(ValueError, match="bundled:NAME with NAME one of conversation, synthetic"):
        load_trace("bundled:nope")


def test_tokens_follow_the_hash_ids() -> None:
    maker = TokenMaker(BT)
    a = TraceRequest(timestamp_ms=0, input_length=3 * BT, output_length=1, hash_ids=(7, 8, 9))
    b = TraceRequest(timestamp_ms=0, input_length=2 * BT + 100, output_length=1, hash_ids=(7, 8, 10))
    ta, tb = maker.prompt(0, a), maker.prompt(1, b)
    assert ta[:2 * BT] == tb[:2 * BT] and ta[2 * BT:2 * BT + 100] != tb[2 * BT:]
    assert maker.prompt(5, a) == ta  # the same ids, the same tokens, whichever request
    assert tb[2 * BT:] == maker.block(10).tolist()[:100]  # a partial block: its id's first tokens
    # tokens past the ids are the request's own
    c = TraceRequest(timestamp_ms=0, input_length=BT + 50, output_length=1, hash_ids=(7,))
    tc0, tc1 = maker.prompt(0, c), maker.prompt(1, c)
    assert tc0[:BT] == tc1[:BT] == ta[:BT] and tc0[BT:] != tc1[BT:]
    assert all(t >= 2**31 for t in tc0[BT:]) and all(t < 2**31 for t in ta)


@pytest.mark.parametrize("preset,scale", [(presets.deepseek_v4_flash, 128), (presets.deepseek_v4_pro, 326)])
def test_stand_in_keeps_block_and_snapshot_bytes_up_to_one_factor(preset, scale: int) -> None:
    s = stand_in(preset(block_tokens=BT))
    assert s.exact and s.scale == scale and s.layout.block_tokens == BT
    assert s.layout.block_bytes * scale == s.model.block_bytes
    assert s.layout.snapshot_bytes * scale == s.model.snapshot_bytes


# ------------------------------------------------------------------------------ exactness
def lru_prefix_simulation(trace: Trace, capacity: int) -> int:
    """Hit tokens of a plain LRU prefix cache of ``capacity`` 512-token blocks over the
    trace's hash ids: a prompt resumes its longest cached prefix of full blocks (one token
    always computed), holds a block per 512 tokens while it runs (from the free ones, else
    evicting the least recently released), caches its new full blocks, and releases its
    blocks last first (a prefix's end becomes older than its start)."""
    evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
    cached: set[int] = set()
    free, hits = capacity, 0
    for r in trace:
        n, ids = r.input_length, r.hash_ids
        full, blocks, limit = n // BT, -(-n // BT), (n - 1) // BT
        k = 0
        while k < min(full, limit) and ids[k] in cached:
            k += 1
        hits += k * BT
        for x in ids[:k]:
            del evictable[x]  # in use
        need = blocks - k
        taken = min(free, need)
        free -= taken
        for _ in range(need - taken):
            cached.discard(evictable.popitem(last=False)[0])
        mine = set()
        for x in ids[k:full]:
            if x not in cached:  # (else a private duplicate)
                cached.add(x)
                mine.add(x)
        for pos in reversed(range(blocks)):
            if pos < k or (pos < full and ids[pos] in mine):
                evictable[ids[pos]] = None
            else:
                free += 1
    return hits


def test_hbm_only_hit_rate_equals_a_plain_lru_prefix_simulation(conversation: Trace) -> None:
    # every boundary snapshotted and a snapshot pool that never evicts: resumable = cached
    capacity = 700
    cfg = ReplayConfig(hbm=Capacity.of_tokens(capacity * BT), gpu_blocks=capacity, gpu_snapshots=12_000,
                       snapshot_policy="interval:1", verify_every=25)
    report = replay(conversation, cfg)
    t = report.total
    expected = lru_prefix_simulation(conversation, capacity)
    assert t.hit_tokens["gpu"] == expected
    assert t.hits == expected and t.miss_tokens["no_snapshot"] == 0
    assert t.miss_tokens["evicted_gpu"] > 0  # the capacity binds
    assert t.max_tokens == lru_prefix_simulation(conversation, 10**9)  # the unbounded cache
    assert t.verified_blocks > 0


# ------------------------------------------------------------------------------ every tier
def test_every_tier_serves_and_the_tokens_add_up(conversation: Trace) -> None:
    # 1.5M disk tokens: the disk evicts ~67 blocks that are asked for again (at 2M it was 10,
    # and one full-suite CI run counted none: the writer thread's timing moved it; with
    # sync_disk every write lands before each lookup, so the disk figures do not depend on it)
    cfg = ReplayConfig(hbm=Capacity.of_tokens(400_000), host=Capacity.of_tokens(1_000_000),
                       disk=Capacity.of_tokens(1_500_000), verify_every=3, sync_disk=True)
    report = replay(conversation.head(220), cfg)
    t = report.total
    t.check()
    assert t.prompt_tokens == conversation.head(220).prompt_tokens
    assert all(t.hit_tokens[k] > 0 for k in ("gpu", "host", "disk")) and t.hit_tokens["shared"] == 0
    assert all(t.verified_by_tier[k] > 0 for k in ("gpu", "host", "disk"))
    assert t.miss_tokens["evicted_disk"] > 0 and t.miss_tokens["never_seen"] > 0
    assert t.miss_tokens["evicted_gpu"] == t.miss_tokens["evicted_host"] == 0  # with a disk, data is lost there
    assert t.miss_tokens["corrupt"] == t.miss_tokens["unavailable"] == 0
    assert t.hits <= t.resident_tokens <= t.max_tokens
    res, moved = report.resident(), report.moved()
    assert set(res) == {"gpu", "host", "disk"} and res["disk"]["blocks"] > 0 and res["disk"]["snapshots"] > 0
    model = report.nodes[0].plan.standin.model
    assert res["gpu"]["blocks"] % model.block_bytes == 0 and res["gpu"]["snapshots"] % model.snapshot_bytes == 0
    assert moved["gpu->host"]["blocks"] > 0 and moved["disk->memory"]["blocks"] == \
        report.nodes[0].stats["blocks_from_disk"] * model.block_bytes
    d = report.to_dict()
    assert d["total"]["hit_rate"] == pytest.approx(t.hits / t.prompt_tokens)
    assert d["standin"] == {**d["standin"], "scale": 128, "exact": True}
    text = report.text()
    assert "if every block boundary were resumable" in text and "evicted from disk" in text


def test_an_evicting_disk_strands_nothing(conversation: Trace) -> None:
    """Issue 22 item 2 on the disk: the LMDB store evicts leaves first (storage/lmdb/tree.py),
    so at the end nothing it holds lacks a block before it or a snapshot at or after it.
    Here the store evicts ~8,600 records; with its former plain LRU this replay ended
    with 19 MiB of disk blocks behind a missing one and 7 MiB of snapshots stranded."""
    cfg = ReplayConfig(hbm=Capacity.of_tokens(200_000), host=Capacity.of_tokens(400_000),
                       disk=Capacity.of_tokens(1_000_000), verify_every=3)
    report = replay(conversation, cfg)
    t = report.total
    t.check()
    assert report.nodes[0].stats["store_evictions"] > 1000 and t.hit_tokens["disk"] > 0
    assert t.miss_tokens["evicted_disk"] > 0 and t.miss_tokens["corrupt"] == 0
    assert report.stranded()["disk"] == {"unreachable": 0, "no_snapshot": 0, "unknown": 0,
                                         "snapshots_unreachable": 0}
    assert report.resident()["disk"]["blocks"] > 0 and t.verified_by_tier["disk"] > 0


@pytest.mark.parametrize(("admission", "disk_tokens"), [("seen-twice", 300_000), ("survived:8", 3_000_000)])
def test_an_evicting_disk_behind_an_admission_filter_strands_nothing(conversation: Trace, admission: str,
                                                                     disk_tokens: int) -> None:
    """Issue 22 item 2 under the disk admission filters: a filter writes a block only along
    with an admitted snapshot at or after it (a path segment, coherently), and a memory
    tier prunes the blocks that led only to a snapshot it dropped and the disk does not
    hold; a block known on disk that the store evicted since is written again ahead of
    the snapshot. Before, under ``seen-twice`` this replay ended with 187 MB (model bytes)
    of disk blocks and 53 MB of host blocks with no snapshot at or after them, and under
    ``survived:8`` with 32 MB of disk blocks and 7 MB of snapshots behind a missing block."""
    cfg = ReplayConfig(hbm=Capacity.of_tokens(200_000), host=Capacity.of_tokens(400_000),
                       disk=Capacity.of_tokens(disk_tokens), verify_every=3, admission_policy=admission,
                       sync_disk=True)
    report = replay(conversation, cfg)
    t = report.total
    t.check()
    stats = report.nodes[0].stats
    assert stats["store_evictions"] > 0 and stats["admission_rejects"] > 0 and t.miss_tokens["corrupt"] == 0
    zero = {"unreachable": 0, "no_snapshot": 0, "unknown": 0, "snapshots_unreachable": 0}
    assert report.stranded() == {"gpu": zero, "host": zero, "disk": zero}
    assert report.resident()["disk"]["blocks"] > 0 and report.resident()["disk"]["snapshots"] > 0


def test_a_disk_far_smaller_than_the_host_strands_nothing_in_memory(conversation: Trace) -> None:
    """Issue 22 item 2, the store's evictions reported to the cache: with a disk much
    smaller than the host the store evicts snapshots whose blocks only a memory tier
    still holds. The LMDB store reports the keys it evicts (after the commit, on the
    writer thread), the disk tier queues them, and the cache prunes, at its next open /
    close / flush, the memory blocks that led only to them. Before, this replay ended
    with 53 MB (model bytes) of host blocks with no snapshot at or after them in any
    tier, under ``all`` (the filters' case at this size:
    test_an_evicting_disk_behind_an_admission_filter_strands_nothing)."""
    cfg = ReplayConfig(hbm=Capacity.of_tokens(200_000), host=Capacity.of_tokens(400_000),
                       disk=Capacity.of_tokens(300_000), verify_every=3, sync_disk=True)
    report = replay(conversation, cfg)
    t = report.total
    t.check()
    stats = report.nodes[0].stats
    assert stats["store_evictions"] > 0 and t.miss_tokens["corrupt"] == 0
    zero = {"unreachable": 0, "no_snapshot": 0, "unknown": 0, "snapshots_unreachable": 0}
    assert report.stranded() == {"gpu": zero, "host": zero, "disk": zero}
    assert report.resident()["host"]["blocks"] > 0 and report.resident()["disk"]["snapshots"] > 0


@pytest.mark.parametrize(("disk_tokens", "before"), [(1_000_000, "19.7 MB of disk blocks behind a missing one and "
                                                                  "7.3 MB of snapshots"),
                                                     (300_000, "53.2 MB of host blocks with no snapshot after them")])
def test_an_evicting_zarr_disk_strands_nothing(conversation: Trace, tmp_path: Path, disk_tokens: int,
                                               before: str) -> None:
    """Issue 22 item 2 on a Zarr disk: the Zarr store evicts leaves first over its
    in-memory tree (storage/zarr/tree.py) and reports what it evicts (``on_evict``), so
    neither the disk nor a memory tier ends with bytes no resume can use. With the
    store's former plain LRU and no reports, these replays ended with ``before``
    stranded (model bytes; 1M: on the disk, 300K: in the host tier)."""
    cfg = ReplayConfig(hbm=Capacity.of_tokens(200_000), host=Capacity.of_tokens(400_000),
                       disk=Capacity.of_tokens(disk_tokens), verify_every=3, sync_disk=True,
                       disk_url=f"zarr://{tmp_path / 'disk'}")
    report = replay(conversation, cfg)
    t = report.total
    t.check()
    assert report.nodes[0].stats["store_evictions"] > 1000 and t.miss_tokens["corrupt"] == 0
    zero = {"unreachable": 0, "no_snapshot": 0, "unknown": 0, "snapshots_unreachable": 0}
    assert report.stranded() == {"gpu": zero, "host": zero, "disk": zero}
    assert report.resident()["disk"]["blocks"] > 0 and report.resident()["host"]["blocks"] > 0


def test_host_only_evictions_are_attributed_to_the_tier_that_lost_them(conversation: Trace) -> None:
    cfg = ReplayConfig(hbm=Capacity.of_tokens(300_000), host=Capacity.of_tokens(1_000_000), verify_every=0)
    t = replay(conversation.head(250), cfg).total
    t.check()
    assert t.miss_tokens["evicted_host"] > 0 and t.hit_tokens["host"] > 0


def test_a_corrupt_disk_record_is_a_counted_miss(tmp_path: Path, conversation: Trace) -> None:
    store = tmp_path / "disk"
    cfg = ReplayConfig(hbm=Capacity.of_tokens(2_000_000), disk=Capacity.of_tokens(4_000_000),
                       disk_url=f"lmdb://{store}", verify_every=4)
    head = list(enumerate(conversation.requests[:60]))
    with Node(cfg, BT, name="first") as node:
        node.run(head)
        node.finish()
    # flip a payload byte of every stored block record in its segment file, as a bad disk
    # would (the index keeps the record's checksum)
    import lmdb

    from tiered_kv.storage.lmdb.schema import segment_name, unpack_entry

    env = lmdb.open(str(store), max_dbs=4, readonly=True, lock=False)
    with env.begin() as txn:
        locs = [unpack_entry(v)[0] for k, v in txn.cursor(db=env.open_db(b"records", txn=txn, create=False))
                if bytes(k)[0] == 1]
    env.close()
    for loc in locs:
        with open(store / "segments" / segment_name(loc.segment), "r+b") as f:
            f.seek(loc.offset + loc.length // 2)
            byte = f.read(1)
            f.seek(loc.offset + loc.length // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    # a fresh node on the same store: its GPU is empty, so resumes must read the disk
    with Node(cfg, BT, name="second") as node:
        node.run(enumerate(conversation.requests[:60]))
        result = node.finish()
    t = result.tally
    t.check()
    assert t.miss_tokens["corrupt"] > 0
    assert result.stats["store_corrupt"] > 0
    assert t.hit_tokens["disk"] == 0  # every block record was bad: nothing served from disk


# ------------------------------------------------------------------------------ the CLI
def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_replay_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "r.png"
    code, out, err = run_cli(capsys, "replay", "--trace", "bundled:synthetic", "--limit", "60", "--hbm", "4G",
                             "--host", "16G", "--json", "--png", str(png), "--no-progress")
    assert code == ExitCode.OK, err
    d = json.loads(out)
    assert d["requests"] == 60 and d["tiers"] == "hbm+host" and d["standin"]["scale"] == 128
    assert d["total"]["hits"] == sum(d["total"]["hit_tokens"].values())
    assert set(d["cost_model"]["sources"]) == {"prefill_tokens_per_s", "host_gbps", "disk_gbps", "shared_gbps"}
    assert png.stat().st_size > 10_000


def test_cli_replay_compares_policies_and_sweeps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "replay", "--trace", "bundled:conversation", "--limit", "80", "--hbm-tokens",
                             "1M", "--snapshot-policy", "interval:1", "--snapshot-policy", "interval:8")
    assert code == ExitCode.OK, err
    table = out[out.index("snapshot policy   "):]
    assert "interval:1" in table and "interval:8" in table
    code, out, err = run_cli(capsys, "replay", "--trace", "bundled:conversation", "--limit", "60", "--sweep",
                             "hbm-tokens=256K,1M", "--host-tokens", "2M", "--json", "--png", str(tmp_path / "s.png"))
    assert code == ExitCode.OK, err
    assert (tmp_path / "s.png").stat().st_size > 10_000  # with Mooncake's published range at 3M tokens
    rows = json.loads(out)["rows"]
    assert [(r["capacity_tokens"], r["variant"]) for r in rows] == [
        (256_000, "hbm"), (256_000, "hbm+host"), (1_000_000, "hbm"), (1_000_000, "hbm+host")]
    assert rows[0]["capacity_gb"]["dense-320KB"] == pytest.approx(256_000 * 327_680 / 1e9)


def test_cli_replay_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "replay", "--trace", "bundled:conversation", "--hbm-tokens", "50K")
    assert code == ExitCode.USAGE and "longest prompt" in err
    code, _, err = run_cli(capsys, "replay", "--trace", "bundled:conversation", "--snapshot-policy", "every")
    assert code == ExitCode.USAGE and "expected one of branch, branch+interval, interval" in err
    code, _, err = run_cli(capsys, "replay", "--trace", "bundled:conversation", "--disk-store", "lmdb:///tmp/x")
    assert code == ExitCode.USAGE and "give the disk tier's capacity" in err


def test_lookup_tiers_are_nearest_first() -> None:
    assert sorted(Tier) == [Tier.GPU, Tier.HOST, Tier.DISK, Tier.SHARED]


# ------------------------------------------------------------------------------ a fleet
def multi_turn_trace(conversations: int = 8, turns: int = 4) -> Trace:
    """Conversations whose turn t repeats turn t-1's prompt and adds 3 blocks, turns
    interleaved: each later turn resumes what an earlier one computed, on whichever node."""
    requests, next_id = [], 1
    history: list[list[int]] = [[] for _ in range(conversations)]
    for t in range(turns):
        for c in range(conversations):
            history[c] = history[c] + list(range(next_id, next_id + 3))
            next_id += 3
            ids = history[c]
            requests.append(TraceRequest(timestamp_ms=len(requests), input_length=len(ids) * BT - 100,
                                         output_length=1, hash_ids=tuple(ids)))
            history[c] = ids[:-1] + [next_id]  # the next turn replaces the partial last block
            next_id += 1
    return Trace(name="multi-turn", requests=tuple(requests))


@pytest.mark.s3
def test_fleet_shares_one_level_on_seaweedfs(seaweedfs, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered_kv.cli.replay import fleet_table
    from tiered_kv.replay.fleet import fleet_replay

    seaweedfs.make_bucket("tkv-replay")
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)  # the node processes inherit the credentials
    trace = multi_turn_trace()
    cfg = ReplayConfig(hbm=Capacity.of_tokens(1_000_000), shared_url=seaweedfs.url("tkv-replay", "fleet"),
                       snapshot_policy="interval:1", verify_every=1)
    # random routing: a conversation's turns land on either node
    report = fleet_replay(trace, cfg, nodes=2, route="random", seed=1)
    t = report.total
    t.check()
    assert sum(n.tally.requests for n in report.nodes) == 32 and min(n.tally.requests for n in report.nodes) > 8
    assert t.hit_tokens["shared"] > 0 and t.verified_by_tier["shared"] > 0  # one node's blocks served the other
    assert t.hits <= report.fleet_max_tokens and report.resident()["shared"]["blocks"] > 0
    assert "random   yes" in fleet_table([report])


def test_an_upload_landing_between_lookup_and_open_is_a_shared_hit(tmp_path: Path) -> None:
    """A fleet's race, made to happen: node b's lookup runs before node a's blocks land on
    the level they share, b's open after; b resumes more than its lookup said, and that is
    counted (late tokens, shared hits), not taken for a broken invariant."""
    ids = tuple(range(1, 9))
    first = TraceRequest(timestamp_ms=0, input_length=8 * BT, output_length=1, hash_ids=ids)
    second = TraceRequest(timestamp_ms=1, input_length=8 * BT + 100, output_length=1, hash_ids=(*ids, 99))
    cfg = ReplayConfig(hbm=Capacity.of_tokens(100_000), shared_url=f"zarr://{tmp_path / 'shared'}",
                       snapshot_policy="interval:1", verify_every=1)
    with Node(cfg, BT, name="a", shared_url=cfg.shared_url) as a, \
            Node(cfg, BT, name="b", shared_url=cfg.shared_url) as b:
        assert b.prepare(1, second).blocks() == 0  # nothing on the shared level yet
        a.serve(0, first)
        a.cache.flush()  # a's write-through to the shared level lands
        served = b.serve(1, second)
        assert served.resumable_tokens == 0 and served.hit_tokens == 8 * BT
        t = b.tally
        t.check()
        assert t.late_tokens == 8 * BT and t.late_requests == 1
        assert t.hit_tokens["shared"] == 8 * BT and t.snapshot_hits["shared"] == 1
        assert t.verified_by_tier["shared"] == 8  # read back byte-exact from the shared level


def test_stranded_blocks_and_snapshots() -> None:
    from tiered_kv.replay.stranded import stranded

    # a -> b -> c and a -> d -> e; x is from before the replay (no parent known)
    parent = {b"a": None, b"b": b"a", b"c": b"b", b"d": b"a", b"e": b"d"}
    blocks = {"gpu": {b"a", b"b"}, "disk": {b"c", b"e", b"x"}}  # d is gone: e cannot be reached
    snaps = {"gpu": {b"c"}, "disk": {b"e"}}
    out = stranded(parent, blocks, snaps)
    assert out["gpu"] == {"unreachable": 0, "no_snapshot": 0, "unknown": 0, "snapshots_unreachable": 0}
    assert out["disk"] == {"unreachable": 1, "no_snapshot": 0, "unknown": 1, "snapshots_unreachable": 1}
    # without c's snapshot, a, b and c serve no resume
    out = stranded(parent, blocks, {"gpu": set(), "disk": {b"e"}})
    assert out["gpu"]["no_snapshot"] == 2 and out["disk"]["no_snapshot"] == 1


def test_tiers_are_sized_in_model_bytes() -> None:
    from tiered_kv.replay import plan_tiers
    from tiered_kv.storage import record_size

    cfg = ReplayConfig(hbm=Capacity.of_bytes(40 << 30), host=Capacity.of_bytes(512 << 30),
                       disk=Capacity.of_bytes(4 << 40))
    p = plan_tiers(cfg, BT)
    B, S = 1_971_328, 3_644_416  # V4-Flash at 512-token blocks
    assert (p.standin.model.block_bytes, p.standin.model.snapshot_bytes) == (B, S)
    assert p.gpu_snapshots == int((40 << 30) * 0.25) // S and p.gpu_blocks == ((40 << 30) - p.gpu_snapshots * S) // B
    assert (p.gpu_blocks, p.gpu_snapshots, p.host_blocks, p.host_snapshots) == (16_340, 2_946, 209_157, 37_712)
    assert p.disk_max_bytes == (4 << 40) * record_size(15_401) // record_size(B)
    # tokens: that many tokens of blocks plus the snapshot share, in bytes; the pool holds what fits
    p = plan_tiers(ReplayConfig(hbm=Capacity.of_tokens(3_000_000)), BT)
    assert p.model_bytes["gpu"] == -(-5_860 * B * 4 // 3) and (p.gpu_blocks, p.gpu_snapshots) == (5_861, 1_056)
