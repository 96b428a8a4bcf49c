"""``gc`` racing writers and recoveries of the LMDB store: nothing acknowledged is lost.

``gc`` reads the index's live ranges once (its snapshot), then walks the segments and
gives back what no entry covers in each one it can lock. Everything that may index a
record into a segment holds that segment's lock while it commits (its writer until its
last batch is indexed, a recovery scan while it indexes the tail), so the races are:
a segment indexed into after the snapshot and unlocked before gc reaches it; a tail
no recovery could index yet; two gcs, or a gc and a writer opening a segment, on one
file. Each one is ordered by events at the exact step (gc held between its snapshot and
its walk over the segments, the group commit's fault hook), never by sleeping.
"""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from storage_helpers import FP, item_for, make_key, verify_all
from tiered_kv.storage import LmdbStore, StoreFullError, record_size
from tiered_kv.storage.lmdb.group_commit import FaultPoint
from tiered_kv.storage.lmdb.recovery import Recovery
from tiered_kv.storage.lmdb.segments import ALIGN, segment_name

FORK = mp.get_context("fork")
REC = 10_000  # payload bytes
PADDED = -(-record_size(REC) // ALIGN) * ALIGN  # one record's batch in its segment
WAIT_S = 60  # a bound for every wait, so a broken test fails instead of hanging


def _segments(where: Path) -> list[Path]:
    return sorted((where / "segments").glob("*.seg"))


def _lock(path: Path) -> int:
    """An fd holding ``path``'s exclusive flock (what a writer or a recovery holds)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _unlocked(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _gc_with_meanwhile(store: LmdbStore, meanwhile: Callable[[], None]) -> dict[str, Any]:
    """``store.gc(1 << 40)`` in a thread, held after it read the index (the snapshot is
    what ``SegmentFiles.reclaim`` is given) and before it walks the segments, while
    ``meanwhile()`` runs in this thread; returns gc's result."""
    reached, go = threading.Event(), threading.Event()
    real = store._segments.reclaim

    def held(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        assert go.wait(WAIT_S), "the test never let gc go on"
        return real(*args, **kwargs)

    store._segments.reclaim = held  # type: ignore[method-assign]
    try:
        with ThreadPoolExecutor(1) as pool:
            gc = pool.submit(store.gc, 1 << 40)
            try:
                assert reached.wait(WAIT_S), "gc never reached its walk over the segments"
                meanwhile()
            finally:
                go.set()
            return gc.result(WAIT_S)
    finally:
        del store._segments.reclaim


@pytest.mark.parametrize("before", [1, 0], ids=["gaps-punched", "segment-unlinked"])
def test_gc_never_gives_back_a_batch_indexed_after_its_snapshot(tmp_path: Path, before: int) -> None:
    """Segment 1 takes two batches. ``before`` of them are indexed before gc reads the
    index, the others after, and then a third batch rolls the writer over to segment 2:
    segment 1 is sealed (unlocked) when gc reaches it. Its records indexed after the
    snapshot were acknowledged; gc must not punch them (or unlink the segment)."""
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(3)]
    with LmdbStore(where, layout_fingerprint=FP, segment_bytes=2 * PADDED) as store:
        for k in keys[:before]:
            assert store.put_many([item_for(k, REC)]) == [True]

        def write() -> None:
            for k in keys[before:]:
                assert store.put_many([item_for(k, REC)]) == [True]  # acknowledged
            first, second = _segments(where)
            assert first.name == segment_name(1) and first.stat().st_size == 2 * PADDED
            assert _unlocked(first) and not _unlocked(second)  # sealed / the writer's active one

        got = _gc_with_meanwhile(store, write)
        assert got["segments_removed"] == 0
        assert verify_all(store, sizes={k: REC for k in keys}) == 3
        assert store.stats()["corrupt"] == 0
        got = store.gc(1 << 40)  # no writer meanwhile: nothing of theirs is given back either
        assert got["segments_removed"] == 0 and verify_all(store, sizes={k: REC for k in keys}) == 3


def _write_then_die(where: Path, ready: Any) -> None:
    store = LmdbStore(where, layout_fingerprint=FP)

    def die(point: FaultPoint, info: Any) -> None:
        if point is FaultPoint.INDEX_BATCH:  # the step after the synced append
            ready.set()
            os.kill(os.getpid(), signal.SIGKILL)

    store.faults.hook = die
    store.put_many([item_for(make_key(100 + i), REC) for i in range(8)])


DEAD_KEYS = [make_key(100 + i) for i in range(8)]
ALL_KEYS = [make_key(0), make_key(1), *DEAD_KEYS]


def _dead_writer_tail(where: Path) -> Path:
    """Keys 0 and 1 indexed in segment 1, then a writer killed (-9) after its batch of
    :data:`DEAD_KEYS` was synced into segment 2 and before its index commit (what an OS
    crash that took the index commit with it leaves too: an acknowledged batch past the
    segment's indexed end). Returns segment 2."""
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(i), REC) for i in range(2)])
    ready = FORK.Event()
    proc = FORK.Process(target=_write_then_die, args=(where, ready))
    proc.start()
    proc.join(WAIT_S)
    assert proc.exitcode == -signal.SIGKILL and ready.is_set()
    segs = _segments(where)
    assert len(segs) == 2 and segs[1].stat().st_size >= 8 * record_size(REC)
    return segs[1]


def test_gc_never_gives_back_what_another_process_indexed_after_its_snapshot(tmp_path: Path) -> None:
    """A dead writer's segment is locked (by a recovery elsewhere) while this store opens
    and while gc runs its own recovery; then, after gc read the index, another process
    opens the store (its recovery indexes the 8 records), writes a batch into a segment
    of its own and closes (that segment is sealed). gc must keep all of them."""
    where = tmp_path / "s"
    seg = _dead_writer_tail(where)
    held = [_lock(seg)]
    try:
        with LmdbStore(where, layout_fingerprint=FP) as store:
            assert store.stats()["recovered_records"] == 0  # (it could not lock the segment)

            def recover_elsewhere() -> None:
                os.close(held.pop())
                code = ("import sys; sys.path.insert(0, sys.argv[2]); from tiered_kv.storage import LmdbStore\n"
                        "from storage_helpers import FP, item_for, make_key\n"
                        "with LmdbStore(sys.argv[1], layout_fingerprint=FP) as s:\n"
                        "    assert s.stats()['recovered_records'] == 8, s.stats()\n"
                        f"    assert s.put_many([item_for(make_key(200), {REC})]) == [True]\n")
                subprocess.run([sys.executable, "-c", code, str(where), str(Path(__file__).parent)], check=True,
                               timeout=120)
                assert len(_segments(where)) == 3 and all(_unlocked(p) for p in _segments(where))

            got = _gc_with_meanwhile(store, recover_elsewhere)
            assert got["segments_removed"] == 0 and seg.exists()
            assert verify_all(store, sizes={k: REC for k in [*ALL_KEYS, make_key(200)]}) == 11
    finally:
        for fd in held:  # (not closed if the test failed before its step)
            os.close(fd)


def test_gc_keeps_a_tail_no_recovery_could_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovery cannot index the dead writer's batch (the disk is full: no page for the
    index transaction). Those bytes are the write-ahead log of records that may have
    been acknowledged (an OS crash loses the index commit, not the synced segment): gc
    keeps them, and the next gc with room indexes them."""
    where = tmp_path / "s"
    seg = _dead_writer_tail(where)

    def full(*args: Any, **kwargs: Any) -> Any:
        raise StoreFullError("injected: no room for the index transaction")

    with monkeypatch.context() as m:
        m.setattr(Recovery, "index_records", full)
        with LmdbStore(where, layout_fingerprint=FP) as store:  # (its open's recovery fails too)
            got = store.gc(1 << 40)
            assert got["segments_removed"] == 0 and got["punched_bytes"] < PADDED and seg.exists()
            assert set(store) == {make_key(0), make_key(1)}
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 8
        assert verify_all(store, sizes={k: REC for k in ALL_KEYS}) == 10


def test_a_writer_keeps_its_segment_locked_until_its_last_batch_is_indexed(tmp_path: Path) -> None:
    """Writer A's batch is synced but not yet indexed when writer B rolls the store over
    to a new segment (A's segment is retired). A's segment stays locked until A's index
    commit is done, so a gc meanwhile leaves it alone; then both are stored."""
    where = tmp_path / "s"
    a_keys, b_keys = [make_key(1)], [make_key(2)]
    synced, go = threading.Event(), threading.Event()
    appended = threading.Event()

    def hook(point: FaultPoint, info: Any) -> None:
        if point is FaultPoint.SYNCED and not synced.is_set():
            synced.set()
            assert go.wait(WAIT_S)
        elif point is FaultPoint.ENQUEUED and synced.is_set():
            appended.set()

    with LmdbStore(where, layout_fingerprint=FP, segment_bytes=PADDED) as store:
        store.faults.hook = hook
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(store.put_many, [item_for(k, REC) for k in a_keys])
            assert synced.wait(WAIT_S)
            b = pool.submit(store.put_many, [item_for(k, REC) for k in b_keys])
            try:
                assert appended.wait(WAIT_S)  # B wrote into segment 2: segment 1 is retired
                first, second = _segments(where)
                assert not _unlocked(first), "a retired segment was unlocked before its batch was indexed"
                got = store.gc(1 << 40)
                assert got["segments_removed"] == 0 and first.stat().st_size == PADDED
            finally:
                go.set()
            assert a.result(WAIT_S) == [True] and b.result(WAIT_S) == [True]
        assert _unlocked(first)  # A's batch indexed: segment 1 sealed
        store.gc(1 << 40)
        assert verify_all(store, sizes={k: REC for k in a_keys + b_keys}) == 2


def test_a_writer_whose_new_segment_gc_removed_opens_another(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer creates its next segment under a temporary name and locks it; a gc in
    between (it removes the unlocked temporary files that dead writers leave) takes it
    away. The writer must open another segment, not fail the put."""
    where = tmp_path / "s"
    real_open = os.open
    raced = []

    with LmdbStore(where, layout_fingerprint=FP) as store:
        def open_then_gc(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, flags, *args, **kwargs)
            if str(path).endswith(".seg.new") and flags & os.O_EXCL and not raced:
                raced.append(path)
                store.gc(1 << 40)  # (another process's gc, between the create and the lock)
            return fd

        monkeypatch.setattr(os, "open", open_then_gc)
        assert store.put_many([item_for(make_key(0), REC)]) == [True]
        monkeypatch.undo()
        assert raced and not Path(raced[0]).exists()
        assert verify_all(store, sizes={make_key(0): REC}) == 1


def test_two_gcs_unlinking_one_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another gc unlinks an empty segment after this gc opened it and before it locked
    it: this gc skips the file that is gone, without an error."""
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP, segment_bytes=PADDED) as store:
        store.put_many([item_for(make_key(0), REC)])
        store.put_many([item_for(make_key(1), REC)])  # segment 1 sealed
        store.delete(make_key(0))  # segment 1: nothing indexed
        first = _segments(where)[0]
        real_open = os.open

        def open_then_unlink(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            fd = real_open(path, flags, *args, **kwargs)
            if Path(path) == first and first.exists() and flags & (os.O_WRONLY | os.O_RDWR):
                os.unlink(first)  # the other gc
            return fd

        monkeypatch.setattr(os, "open", open_then_unlink)
        got = store.gc(1 << 40)
        monkeypatch.undo()
        assert got["segments_removed"] == 0 and not first.exists()
        assert verify_all(store, sizes={make_key(1): REC}) == 1


def test_gc_drops_the_index_entries_of_the_segments_it_unlinks(tmp_path: Path) -> None:
    """Each segment has a few ``meta`` entries (its indexed end, its generation); gc drops
    them with the segment (ids are never reused), so the index does not grow with every
    segment a store ever had."""
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP, segment_bytes=PADDED) as store:
        for i in range(3):
            store.put_many([item_for(make_key(i), REC)])
        for i in range(2):
            store.delete(make_key(i))

        def segments_in_meta() -> set[int]:
            def read(txn: Any) -> set[int]:
                keys = [bytes(k) for k in txn.cursor(db=store._index.dbs.meta).iternext(keys=True, values=False)]
                return {int.from_bytes(k[-4:], "big") for k in keys if k.startswith((b"segment_end:", b"segment_gen:"))}
            return store._index.run(read, write=False)

        assert segments_in_meta() == {1, 2, 3}
        assert store.gc(1 << 40)["segments_removed"] == 2
        assert segments_in_meta() == {3} and [p.name for p in _segments(where)] == [segment_name(3)]
        assert verify_all(store, sizes={make_key(2): REC}) == 1
