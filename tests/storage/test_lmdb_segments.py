"""The LMDB store's segment files: what the conformance suite cannot see from the API.

Damage is done straight to the files (a bad disk, a crashed writer), then the store is
reopened and must answer misses, never data, and give the space back on ``gc``.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest

from storage_helpers import FP, item_for, make_key, payload_for, verify_all
from tiered_kv.storage import LmdbStore, StoreError, StoreFullError, record_size
from tiered_kv.storage.lmdb import unpack_entry
from tiered_kv.storage.lmdb.group_commit import FaultPoint
from tiered_kv.storage.format.record import HEADER_BYTES
from tiered_kv.storage.lmdb.segments import ALIGN, punch_hole, segment_name

N = 100_000
ONE = record_size(N)
FORK = mp.get_context("fork")


def _locate(path: Path, key) -> tuple[Path, int, int]:
    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            loc, _ = unpack_entry(txn.get(key.to_bytes(), db=env.open_db(b"records", txn=txn, create=False)))
    finally:
        env.close()
    return path / "segments" / segment_name(loc.segment), loc.offset, loc.length


def _segments(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.seg"))


def test_layout_and_owner_only_files(tmp_path: Path) -> None:
    where = tmp_path / "s"
    old = os.umask(0)
    try:
        with LmdbStore(where, layout_fingerprint=FP) as store:
            assert store.put_many([item_for(make_key(i), N) for i in range(3)]) == [True] * 3
            s = store.stats()
            assert s["segments"] == 1 and s["segment_disk_bytes"] >= 3 * ONE
    finally:
        os.umask(old)
    seg = _segments(where)
    assert [p.name for p in seg] == [segment_name(1)]
    for p in [where, where / "segments", *seg, where / "data.mdb", where / "lock.mdb"]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p
    # records lie back to back, each one the record format unchanged
    f, off, n = _locate(where, make_key(1))
    assert (off, n) == (ONE, ONE)
    raw = f.read_bytes()[off:off + n]
    assert raw[:4] == b"TKVR" and raw[HEADER_BYTES:HEADER_BYTES + N] == payload_for(make_key(1), N).tobytes()
    assert f.stat().st_size % ALIGN == 0


def test_corrupt_payload_in_a_segment_is_a_miss_and_neighbours_survive(tmp_path: Path) -> None:
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(3)]
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(k, N) for k in keys])
    f, off, _ = _locate(where, keys[1])
    with open(f, "r+b") as fh:  # one bit of the middle record's payload
        fh.seek(off + HEADER_BYTES + N // 2)
        b = fh.read(1)
        fh.seek(off + HEADER_BYTES + N // 2)
        fh.write(bytes([b[0] ^ 0x04]))
    with LmdbStore(where, layout_fingerprint=FP) as store:
        out = np.empty(N, np.uint8)
        metas = store.get_many(keys, [np.empty(N, np.uint8), out, np.empty(N, np.uint8)])
        assert [m is not None for m in metas] == [True, False, True]
        s = store.stats()
        assert (s["hits"], s["misses"], s["corrupt"]) == (2, 1, 1)
        assert not store.contains(keys[1]) and s["bytes"] == 2 * ONE
        assert store.put_many([item_for(keys[1], N)]) == [True]  # rewritten into a new segment
        assert verify_all(store, sizes={k: N for k in keys}) == 3


def test_torn_segment_tail_is_a_miss(tmp_path: Path) -> None:
    """A segment cut short (lost tail): the records past the end are misses, not data."""
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(4)]
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(k, N) for k in keys])
    f, off, _ = _locate(where, keys[2])
    os.truncate(f, off + HEADER_BYTES + 100)  # mid-payload of record 2; record 3 gone
    for direct in (True, False):  # both the O_DIRECT and the buffered read paths
        with LmdbStore(where, layout_fingerprint=FP, direct_io=direct, readonly=True) as store:
            outs = [np.empty(N, np.uint8) for _ in keys]
            metas = store.get_many(keys, outs)
            assert [m is not None for m in metas] == [True, True, False, False]
            np.testing.assert_array_equal(outs[1], payload_for(keys[1], N))
            assert store.stats()["corrupt"] == 2
    with LmdbStore(where, layout_fingerprint=FP) as store:
        r = store.verify(repair=True)
        assert (r["checked"], r["corrupt"], r["removed"]) == (4, 2, 2)
        assert set(store) == set(keys[:2]) and store.stats()["bytes"] == 2 * ONE


def _write_then_die(where: Path, ready) -> None:
    """Append a batch to the segment, then die before the index transaction commits."""
    store = LmdbStore(where, layout_fingerprint=FP)

    def die(point: FaultPoint, info: object) -> None:
        if point is FaultPoint.INDEX_BATCH:  # the step after the durable segment append
            ready.set()
            os.kill(os.getpid(), signal.SIGKILL)

    store.faults.hook = die
    store.put_many([item_for(make_key(100 + i), N) for i in range(8)])


def _leave_unindexed_tail(where: Path) -> Path:
    """Two indexed records, then a writer killed (-9) after appending 8 more records
    (keys 100..107, back to back from offset 0 of its own segment) and before their
    index commit. Returns the dead writer's segment."""
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(i), N) for i in range(2)])
    ready = FORK.Event()
    proc = FORK.Process(target=_write_then_die, args=(where, ready))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL and ready.is_set()
    segs = _segments(where)
    assert len(segs) == 2 and segs[1].stat().st_size >= 8 * ONE  # the dead writer's segment
    return segs[1]


def test_crash_between_segment_write_and_index_commit(tmp_path: Path) -> None:
    """kill -9 after the segment bytes are written (the segment is the write-ahead log)
    but before the index commit: a writable reopen scans the dead writer's tail,
    verifies every record and indexes it; a readonly open sees misses."""
    where = tmp_path / "s"
    _leave_unindexed_tail(where)
    keys = [make_key(100 + i) for i in range(8)]
    with LmdbStore(where, layout_fingerprint=FP, readonly=True) as store:  # readonly: no recovery
        assert store.get_many(keys, [np.empty(N, np.uint8) for _ in keys]) == [None] * 8
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 8
        assert store.stats()["bytes"] == 10 * ONE and len(store) == 10
        assert verify_all(store, sizes={make_key(i): N for i in [0, 1, *range(100, 108)]}) == 10
        r = store.gc(1 << 40)
        assert r["evicted"] == 0 and r["segments_removed"] == 0
    with LmdbStore(where, layout_fingerprint=FP) as store:  # scanned once: nothing more to do
        assert store.stats()["recovered_records"] == 0 and len(store) == 10


def test_recovery_never_indexes_a_torn_tail(tmp_path: Path) -> None:
    """The dead writer's segment cut mid-record (a torn write): the records before the cut
    are indexed, the torn one and those after it are not."""
    where = tmp_path / "s"
    seg = _leave_unindexed_tail(where)
    os.truncate(seg, 5 * ONE + HEADER_BYTES + 100)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 5
        assert set(store) == {make_key(i) for i in [0, 1, *range(100, 105)]}
        assert verify_all(store, sizes={make_key(i): N for i in [0, 1, *range(100, 105)]}) == 7
        assert store.stats()["corrupt"] == 0


def test_recovery_never_indexes_a_record_with_a_bad_checksum(tmp_path: Path) -> None:
    """One payload byte of an unindexed record flipped: that record is skipped, its
    neighbours (before and after it in the same batch) are indexed."""
    where = tmp_path / "s"
    seg = _leave_unindexed_tail(where)
    with open(seg, "r+b") as f:
        f.seek(3 * ONE + HEADER_BYTES + 1234)
        byte = f.read(1)
        f.seek(3 * ONE + HEADER_BYTES + 1234)
        f.write(bytes([byte[0] ^ 0x40]))
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 7
        kept = [0, 1, *(100 + i for i in range(8) if i != 3)]
        assert set(store) == {make_key(i) for i in kept}
        assert verify_all(store, sizes={make_key(i): N for i in kept}) == 9


def test_index_transactions_lost_to_an_os_crash_are_recovered_from_the_segment(tmp_path: Path) -> None:
    """What MDB_NOMETASYNC may lose in an OS crash (the last index transactions), put back
    as it would be: the index file reverted to an earlier commit while the segment kept
    the synced batch. The reopen scans past that commit's segment_end and indexes it."""
    where = tmp_path / "s"
    first = [make_key(i) for i in range(3)]
    last = [make_key(10 + i) for i in range(4)]
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(k, N) for k in first])
        earlier = (where / "data.mdb").read_bytes()  # the index as committed after `first`
        assert store.put_many([item_for(k, N) for k in last]) == [True] * 4  # durable: returned
    (where / "data.mdb").write_bytes(earlier)
    _check_recovered(where, first, last)


def test_a_lost_segment_allocation_is_scanned_from_its_start(tmp_path: Path) -> None:
    """The index reverted to before a writer allocated its segment (more than MDB_NOMETASYNC
    can lose, checked anyway): that segment's id is past the index's counter, so it is
    scanned from offset 0 and a later writer never reuses its id."""
    where = tmp_path / "s"
    first = [make_key(i) for i in range(3)]
    last = [make_key(10 + i) for i in range(4)]
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(k, N) for k in first])
    earlier = (where / "data.mdb").read_bytes()
    with LmdbStore(where, layout_fingerprint=FP) as store:  # a second writer: a second segment
        assert store.put_many([item_for(k, N) for k in last]) == [True] * 4
    (where / "data.mdb").write_bytes(earlier)
    _check_recovered(where, first, last)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(20), N)])
        assert len(_segments(where)) == 3
        assert verify_all(store, sizes={k: N for k in [*first, *last, make_key(20)]}) == 8


def _check_recovered(where: Path, first: list, last: list) -> None:
    with LmdbStore(where, layout_fingerprint=FP, readonly=True) as store:
        assert set(store) == set(first)  # the lost commit: `last` is not indexed
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 4 and store.stats()["bytes"] == 7 * ONE
        assert verify_all(store, sizes={k: N for k in first + last}) == 7


def test_index_commits_flush_pages_but_not_the_meta_page(tmp_path: Path) -> None:
    """MDB_NOMETASYNC (integrity kept after an OS crash, the last transaction recoverable
    from the segments), never MDB_NOSYNC (an OS crash could corrupt the index)."""
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        flags = store._index.env.flags()
        assert flags["sync"] is True and flags["metasync"] is False and flags["writemap"] is False


def test_a_failed_segment_sync_indexes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment fdatasync fails (EIO): put_many raises, nothing of the batch is
    indexed (the index only ever points at synced bytes), its bytes are cut back, and
    the next batch is stored."""
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(0), N)])

        def eio(fd: int) -> None:
            raise OSError(errno.EIO, "injected fdatasync failure")

        monkeypatch.setattr(os, "fdatasync", eio)
        with pytest.raises(OSError, match="injected"):
            store.put_many([item_for(make_key(i), N) for i in (1, 2)])
        monkeypatch.undo()
        assert set(store) == {make_key(0)} and store.stats()["bytes"] == ONE
        assert store.put_many([item_for(make_key(i), N) for i in (1, 2)]) == [True, True]
        padded = [-(-n // ALIGN) * ALIGN for n in (ONE, 2 * ONE)]  # two batches, each 4 KiB-aligned
        assert len(_segments(where)) == 1 and _segments(where)[0].stat().st_size == sum(padded)
        assert verify_all(store, sizes={make_key(i): N for i in range(3)}) == 3
    with LmdbStore(where, layout_fingerprint=FP) as store:  # not resurrected by the recovery scan
        assert store.stats()["recovered_records"] == 0 and len(store) == 3


def test_evicted_and_deleted_records_give_their_disk_space_back(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(4 * ALIGN))
    with open(probe, "r+b") as f:
        if not punch_hole(f.fileno(), 0, 4 * ALIGN):
            pytest.skip("this filesystem cannot punch holes")
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=4 * ONE) as store:
        store.put_many([item_for(make_key(i), N) for i in range(4)])
        full = store.stats()["segment_disk_bytes"]
        store.put_many([item_for(make_key(i), N) for i in range(4, 8)])  # evicts 0..3
        s = store.stats()
        assert s["evictions"] == 4 and s["bytes"] == 4 * ONE
        assert s["segment_disk_bytes"] <= full + 4 * ALIGN  # holes where 0..3 were
        assert store.delete(make_key(5))
        assert store.stats()["segment_disk_bytes"] <= full - ONE + 4 * ALIGN
        assert verify_all(store, sizes={make_key(i): N for i in range(8)}) == 3


def test_writers_roll_over_segments_and_gc_unlinks_empty_ones(tmp_path: Path) -> None:
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP, segment_bytes=3 * ONE) as store:
        for i in range(6):
            store.put_many([item_for(make_key(i), N)])
        assert store.stats()["segments"] == 3
        for i in range(4):
            store.delete(make_key(i))
        r = store.gc(1 << 40)
        assert r["segments_removed"] == 2 and store.stats()["segments"] == 1  # the active one stays
        assert verify_all(store, sizes={make_key(i): N for i in range(6)}) == 2


def test_a_second_process_never_appends_to_a_live_writers_segment(tmp_path: Path) -> None:
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP) as a:
        a.put_many([item_for(make_key(0), N)])
        code = ("import sys, numpy as np; sys.path.insert(0, sys.argv[2]); "
                "from storage_helpers import FP, item_for, make_key; "
                "from tiered_kv.storage import LmdbStore\n"
                "with LmdbStore(sys.argv[1], layout_fingerprint=FP) as b:\n"
                f"    assert b.put_many([item_for(make_key(1), {N})]) == [True]\n"
                "    assert b.gc(1 << 40)['segments_removed'] == 0\n")
        subprocess.run([sys.executable, "-c", code, str(where), str(Path(__file__).parent)], check=True,
                       timeout=120)
        assert len(_segments(where)) == 2  # its own segment; ours was skipped by its gc
        assert a.put_many([item_for(make_key(2), N)]) == [True]
        assert verify_all(a, sizes={make_key(i): N for i in range(3)}) == 3


def test_direct_io_off_reads_and_writes_the_same(tmp_path: Path) -> None:
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(5)]
    with LmdbStore(where, layout_fingerprint=FP, direct_io=False) as store:
        store.put_many([item_for(k, N) for k in keys])
        assert store.stats()["direct_io"] is False
    with LmdbStore(where, layout_fingerprint=FP, direct_io=True) as store:
        assert verify_all(store, sizes={k: N for k in keys}) == 5


def test_format_1_store_is_refused_with_what_to_do(tmp_path: Path) -> None:
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP):
        pass
    env = lmdb.open(str(where), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"format_version", (1).to_bytes(2, "little"), db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(StoreError, match="format version 1.*remove this directory"):
        LmdbStore(where, layout_fingerprint=FP)


def test_a_refused_batch_gives_its_segment_bytes_back(tmp_path: Path) -> None:
    """The index map full after the batch went to a fresh segment: that segment is cut
    back to empty, nothing of the batch is indexed, and the store keeps working."""
    where = tmp_path / "s"
    sizes = {make_key(i): 10 for i in range(5000)}
    with LmdbStore(where, layout_fingerprint=FP, map_size=256 << 10, segment_bytes=1) as store:
        stored: list = []
        with pytest.raises(StoreFullError, match="map full"):
            for start in range(0, 5000, 50):  # every batch starts a new segment
                keys = [make_key(i) for i in range(start, start + 50)]
                store.put_many([item_for(k, 10) for k in keys])
                stored.extend(keys)
        assert _segments(where)[-1].stat().st_size == 0
        assert set(store) == set(stored) and verify_all(store, sizes=sizes) == len(stored)


def _rewrite_entry(path: Path, key, **change: int) -> None:
    """Replace fields of ``key``'s index entry (segment, offset, length) in place."""
    from dataclasses import replace

    from tiered_kv.storage.lmdb import pack_entry

    env = lmdb.open(str(path), max_dbs=4, lock=False)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"records", txn=txn, create=False)
            loc, checksum = unpack_entry(txn.get(key.to_bytes(), db=db))
            txn.put(key.to_bytes(), pack_entry(replace(loc, **change), checksum), db=db)
    finally:
        env.close()


@pytest.mark.parametrize("length", [2**56, ONE + 2 * ALIGN, 10])
def test_index_entry_with_an_absurd_length_is_a_counted_miss(tmp_path: Path, length: int) -> None:
    """A corrupt index entry claiming 64 PiB (or just past the segment's end, or less than
    a header) is a miss counted as corrupt: nothing of that size is allocated."""
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(2)]
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(k, N) for k in keys])
    _rewrite_entry(where, keys[1], length=length)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        for out in (np.empty(N, np.uint8), [np.empty(N // 2, np.uint8), np.empty(N - N // 2, np.uint8)]):
            if store.contains(keys[1]):
                assert store.get(keys[1], out) is None
        s = store.stats()
        assert (s["misses"], s["corrupt"]) == (1, 1) and not store.contains(keys[1])
        assert store.put_many([item_for(keys[1], N)]) == [True]
        assert verify_all(store, sizes={k: N for k in keys}) == 2


def test_verify_counts_an_absurd_index_entry(tmp_path: Path) -> None:
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(i), N) for i in range(2)])
    _rewrite_entry(where, make_key(0), length=2**56)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        got = store.verify(repair=True)
        assert (got["checked"], got["corrupt"], got["removed"]) == (2, 1, 1)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_scatter_reads_of_cold_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    """The cold paths (O_DIRECT into the bounce buffer, then piece by piece; buffered
    preadv after WILLNEED) fill scatter lists exactly and catch a bad payload."""
    from tiered_kv.storage.lmdb.reads import ReadEngine

    monkeypatch.setattr(ReadEngine, "cached", lambda self, fd, offset, length: False)
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(4)]
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(k, N) for k in keys])
    f, off, _ = _locate(where, keys[2])
    with open(f, "r+b") as fh:  # one bit of record 2's payload
        fh.seek(off + HEADER_BYTES + N - 3)
        b = fh.read(1)
        fh.seek(off + HEADER_BYTES + N - 3)
        fh.write(bytes([b[0] ^ 0x01]))
    with LmdbStore(where, layout_fingerprint=FP, direct_io=direct) as store:
        outs = [[np.empty(n, np.uint8) for n in (7, 0, N - 1007, 1000)] for _ in keys]
        metas = store.get_many(keys, outs)
        assert [m is not None for m in metas] == [True, True, False, True]
        for k, out, m in zip(keys, outs, metas):
            if m is not None:
                np.testing.assert_array_equal(np.concatenate(out), payload_for(k, N))
        assert store.stats()["corrupt"] == 1
