"""The replay's accounting of a resume shorter than its lookup said, and the admission report.

Between a request's lookup and its open's reads a record can go: the store evicts it (for
a put of the disk writer, or ``gc``), or it is damaged. Each case is made to happen on a
second node over the store a first node filled (its GPU is empty, so the resume reads the
disk), never timed:

* a record the store drops between the lookup and the read (the read is a plain miss,
  ``disk_read_failures`` moves and ``store_corrupt`` does not) is **evicted from disk**,
  not corrupt (it was counted corrupt);
* the store evicting the path before the open asks for it (nothing is read: no counter
  moves) is **evicted from disk** too (it was an AssertionError);
* a record really corrupt (a flipped byte: the store counts it corrupt) is still **corrupt**;
* a shortfall with every record still held and nothing failed stays an AssertionError;
* the text report prints the admission filter's counters beside the disk bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tiered_kv.lookup import Tier
from tiered_kv.replay import Capacity, ReplayConfig, replay
from tiered_kv.replay.node import Node
from tiered_kv.replay.trace import Trace, TraceRequest
from tiered_kv.storage import RecordKey
from tiered_kv.storage.lmdb import unpack_entry
from tiered_kv.storage.lmdb.segments import segment_name

BT = 512
IDS = tuple(range(1, 9))  # 8 full blocks, then a partial one of the request's own
FIRST = TraceRequest(timestamp_ms=0, input_length=8 * BT + 100, output_length=1, hash_ids=(*IDS, 99))
SECOND = TraceRequest(timestamp_ms=1, input_length=8 * BT + 100, output_length=1, hash_ids=(*IDS, 77))


def config(tmp_path: Path, **kw: Any) -> ReplayConfig:
    """GPU and disk only (reads straight into the pools), a snapshot at every boundary, the
    store at a known path (so that a second node opens the first one's records)."""
    return ReplayConfig(hbm=Capacity.of_tokens(100_000), disk=Capacity.of_tokens(1_000_000),
                        disk_url=f"lmdb://{tmp_path / 'disk'}", snapshot_policy="interval:1", verify_every=1,
                        sync_disk=True, **kw)


def second_serve(tmp_path: Path, meddle: Callable[[Node], None], **kw: Any) -> Node:
    """Node ``first`` serves FIRST (its 8 blocks and snapshots land on disk); a fresh node
    on that store looks SECOND up (8 blocks resumable, all on disk), then ``meddle(node)``,
    then the node serves it. The node is returned open (the caller closes it)."""
    cfg = config(tmp_path, **kw)
    with Node(cfg, BT, name="first") as a:
        a.serve(0, FIRST)
        a.finish()
    b = Node(cfg, BT, name="second")
    try:
        look = b.prepare(1, SECOND)
        assert look.blocks() == 8 and set(look.block_tiers) == {Tier.DISK}
        meddle(b)
        b.serve(1, SECOND)
    except BaseException:
        b.close()
        raise
    return b


def block_key(node: Node, i: int) -> RecordKey:
    """The store key of block ``i`` of SECOND (its hashes are the cache's own)."""
    tokens = node.tokens.prompt_array(1, SECOND)
    return RecordKey.block(node.cache.hasher.block_hashes(tokens[:8 * BT])[i])


def before_reading(node: Node, key: RecordKey, act: Callable[[Any, RecordKey], None]) -> list[RecordKey]:
    """Run ``act(store, key)`` once, just before the first read of the node's store that
    asks for ``key`` (``get_rows`` or ``get_many``: the block reads of a resume; the index
    lookup has not run). Returns a list ``key`` is appended to when it ran."""
    store = node.cache.disk.store
    ran: list[RecordKey] = []
    for name in ("get_rows", "get_many"):
        real = getattr(store, name)

        def hooked(keys: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if not ran and key in list(keys):
                ran.append(key)
                act(store, key)
            return _real(keys, *args, **kwargs)

        setattr(store, name, hooked)
    return ran


def evict(store: Any, key: RecordKey) -> None:
    """The store drops the record, as its eviction does (unindexed, its bytes punched)."""
    assert store.delete(key)


def corrupt(store: Any, key: RecordKey) -> None:
    """Flip one payload byte of the record in its segment file (the index keeps its
    checksum), as a bad disk would."""
    loc, _ = unpack_entry(store._reads.lookup([key.to_bytes()])[0])
    with open(store.path / "segments" / segment_name(loc.segment), "r+b") as f:
        f.seek(loc.offset + loc.length // 2)
        byte = f.read(1)
        f.seek(loc.offset + loc.length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_block_evicted_between_the_lookup_and_the_read_is_evicted_from_disk(tmp_path: Path) -> None:
    """Block 4 dropped just before the resume reads it: blocks 0-3 resume (the snapshot
    at 4 is on disk), blocks 4-7 are evicted from disk, none corrupt."""
    hooks: list[list[RecordKey]] = []
    with second_serve(tmp_path, lambda n: hooks.append(before_reading(n, block_key(n, 4), evict))) as node:
        assert hooks[0]  # the drop ran, in a read of the resume
        t, stats = node.tally, node.cache.stats()
        t.check()
        assert stats["disk_read_failures"] == 1 and stats["store_corrupt"] == 0  # a plain miss
        assert t.hit_tokens["disk"] == 4 * BT
        assert t.miss_tokens["evicted_disk"] == 4 * BT and t.miss_tokens["corrupt"] == 0


def test_a_snapshot_evicted_between_the_lookup_and_the_read_is_evicted_from_disk(tmp_path: Path) -> None:
    """The snapshot at 8 dropped just before it is read: the resume ends at 7 (its
    snapshot is on disk), the one block short is evicted from disk."""
    def meddle(n: Node) -> None:
        tokens = n.tokens.prompt_array(1, SECOND)
        h = n.cache.hasher.block_hashes(tokens[:8 * BT])[7]
        hooks.append(before_reading(n, RecordKey.snapshot(h), evict))

    hooks: list[list[RecordKey]] = []
    with second_serve(tmp_path, meddle) as node:
        assert hooks[0]
        t, stats = node.tally, node.cache.stats()
        t.check()
        assert stats["disk_read_failures"] == 1 and stats["store_corrupt"] == 0
        assert t.hit_tokens["disk"] == 7 * BT
        assert t.miss_tokens["evicted_disk"] == BT and t.miss_tokens["corrupt"] == 0


def test_the_store_evicting_the_path_before_the_open_is_evicted_from_disk(tmp_path: Path) -> None:
    """``gc`` to nothing between the lookup and the open: the open finds the first block
    gone and reads nothing (no counter moves): all 8 blocks are evicted from disk (this
    was the AssertionError "no read failed")."""
    with second_serve(tmp_path, lambda n: n.cache.disk.store.gc(0) and None) as node:
        t, stats = node.tally, node.cache.stats()
        t.check()
        assert stats["disk_read_failures"] == 0 and stats["store_evictions"] > 0
        assert t.hits == 0 and t.miss_tokens["evicted_disk"] == 8 * BT and t.miss_tokens["corrupt"] == 0


def test_a_record_corrupt_on_disk_still_counts_corrupt(tmp_path: Path) -> None:
    """The same race, but block 4's record damaged instead of dropped: the store counts
    it corrupt, and so does the replay (blocks 4-7)."""
    hooks: list[list[RecordKey]] = []
    with second_serve(tmp_path, lambda n: hooks.append(before_reading(n, block_key(n, 4), corrupt))) as node:
        assert hooks[0]
        t, stats = node.tally, node.cache.stats()
        t.check()
        assert stats["store_corrupt"] == 1 and stats["disk_read_failures"] == 1
        assert t.hit_tokens["disk"] == 4 * BT
        assert t.miss_tokens["corrupt"] == 4 * BT and t.miss_tokens["evicted_disk"] == 0


def test_a_shortfall_nothing_explains_is_a_broken_invariant(tmp_path: Path) -> None:
    """Every record still held and nothing failed, yet the open resumed less (made so:
    ``max_cached_tokens=0``): the replay stops, as it must for a broken invariant."""
    def meddle(n: Node) -> None:
        real = n.cache.open
        n.cache.open = lambda tokens, **kw: real(tokens, max_cached_tokens=0)  # type: ignore[method-assign]

    with pytest.raises(AssertionError, match="every record of the difference is still held"):
        second_serve(tmp_path, meddle)


# ------------------------------------------------------------------------------ the report
def test_the_report_shows_the_admission_counters_beside_the_disk_bytes() -> None:
    """Two passes over 6 prompts of 4 blocks under ``seen-twice``, through a GPU of 8
    blocks: the first pass publishes each snapshot once (held back: rejects), the second
    computes them again (each admitted with its blocks); the text and the JSON report
    the counters as the disk tier has them."""
    reqs = [TraceRequest(timestamp_ms=i, input_length=4 * BT + 10, output_length=1,
                         hash_ids=tuple(range(10 * p, 10 * p + 5))) for i, p in enumerate([*range(6), *range(6)])]
    trace = Trace("two-passes", tuple(reqs), BT)
    cfg = ReplayConfig(hbm=Capacity.of_tokens(100_000), gpu_blocks=8, gpu_snapshots=2,
                       disk=Capacity.of_tokens(1_000_000), admission_policy="seen-twice", snapshot_policy="interval:2",
                       verify_every=0, sync_disk=True)
    report = replay(trace, cfg)
    adm, io = report.admission(), report.store_bytes()
    stats = report.nodes[0].stats
    assert adm == {"rejected": stats["admission_rejects"], "admitted": stats["admission_admitted"],
                   "expired": stats["admission_expired"]}
    assert adm["rejected"] > 0 and adm["admitted"] > 0 and adm["expired"] == 0
    # every record on disk was admitted later (the second pass's blocks and snapshots: a
    # snapshot seen twice counts as one admitted on a hit does)
    assert stats["disk_writes"] == adm["admitted"]
    assert io is not None and io["written"] > 0
    from tiered_kv.planner import format_bytes

    text = report.text()
    assert (f"disk written {format_bytes(io['written'])}, read {format_bytes(io['read'])}" in text)
    assert (f"admission seen-twice: {adm['rejected']:,} records held back at seal / publish, "
            f"{adm['admitted']:,} admitted later" in text)
    d = report.to_dict()
    assert d["admission_counters"] == adm and d["store_bytes"] == io


def test_a_report_without_a_store_has_no_admission_line() -> None:
    trace = Trace("one", (FIRST,), BT)
    report = replay(trace, ReplayConfig(hbm=Capacity.of_tokens(100_000), verify_every=0))
    assert report.admission() is None and report.store_bytes() is None
    assert "admission all:" not in report.text() and report.to_dict()["admission_counters"] is None


def test_cli_policy_table_has_the_admission_counters(capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_kv.cli.main import ExitCode, main

    code = main(["replay", "--trace", "bundled:conversation", "--limit", "40", "--hbm-tokens", "500K",
                 "--disk-tokens", "1M", "--admission", "all", "--admission", "seen-twice"])
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    assert "admission all: 0 records held back" in out and "admission seen-twice: " in out
    table = out[out.index("snapshot policy   "):].splitlines()
    head = table[0].split()
    assert head[-3:] == ["rejects", "admitted", "expired"]
    rows = {line.split()[2]: line.split() for line in table[1:]}
    assert rows["all"][-3:] == ["0", "0", "0"] and int(rows["seen-twice"][-3]) > 0
