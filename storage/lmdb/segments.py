"""Append-only segment files: where the LMDB store keeps its records (WiscKey-style).

LMDB holds the index (key -> segment, offset, length, checksum); the records themselves
(record.py format, unchanged) are appended to segment files, one writer process per
segment::

    <store>/segments/00000001.seg   0o600, append-only, written in 4 KiB-aligned batches
                     00000002.seg   ...

A writer process owns its *active* segment: it created it (ids come from a counter in the
index, so a segment is never reused) and holds an exclusive ``flock`` on it until it rolls
over to a new one or closes, and past that until every batch it appended there is indexed
or given up. A segment nobody holds is sealed: nothing is ever appended to it again, so
:meth:`SegmentFiles.reclaim` (the store's ``gc``) may punch holes into its unindexed ranges
or unlink it when nothing in it is indexed. The lock is what makes that safe: an index
entry into a segment is only ever committed by whoever holds its lock (its writer, or a
recovery scan), so what gc reads of the index while it holds the lock stays true until it
lets go (see :meth:`SegmentFiles.reclaim`).

Writes: each ``put_many`` is one batch (records packed back to back, padded to 4 KiB) in
a range of the active segment reserved for it, so the threads of one process write their
batches concurrently (see :meth:`SegmentFiles.append_records`): staged in the thread's
page-aligned buffer, space reserved with ``posix_fallocate`` (a full disk is ENOSPC here,
before anything is written), written with parallel ``pwrite``s (``O_DIRECT`` where the
filesystem takes it: no page-cache copy and writeback). The store's group commit then
``fdatasync``s the segment once for every batch written meanwhile, and only then commits
their index entries (group_commit.py). A range that will not be indexed (a failed write,
sync or index commit) is cut off the segment's end, or punched when others follow it.
The segment is the store's write-ahead log: records are self-describing (header, xxh3-128
checksum), so the bytes a dead writer appended past what the index covers can be scanned,
verified and indexed (the store's recovery, under :meth:`SegmentFiles.sealed`); what does
not verify stays unindexed and ``gc`` gives it back.

Reads go through the read engine (:mod:`.reads`), which shares this directory's descriptor
cache and I/O threads: :attr:`SegmentFiles.reads`.
Deleting or evicting a record punches a hole over it (``fallocate(PUNCH_HOLE)``), so the
disk space follows the live records without rewriting segments.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import StoreError
from ..os.faults import Faults
from ..os.files import fsync_dir, mkdir_private
from ..os.libc import ALIGN, align_down, align_up, aligned_buffer, allocate_blocks, punch_hole
from ..os.threads import started_pool
from .group_commit import FaultPoint
from .open_files import DEFAULT_MAX_OPEN_SEGMENTS, OpenSegments
from .reads import ReadEngine
from .schema import SEGMENT_SUFFIX, Location, parse_segment_name, segment_name

__all__ = ["ALIGN", "Location", "Reclaimable", "Reclaimed", "SegmentFiles", "allocate_blocks", "punch_hole",
           "segment_name"]

#: A batch is written in pwrites of about this size, each sent as soon as it is staged.
_CHUNK = 2 << 20

#: A batch is written in pwrites of about this size, each sent as soon as it is staged.
_CHUNK = 2 << 20
@dataclass(eq=False, slots=True)
class _Writing:
    """A segment this process appends to: its write fd (flock'ed) and its batches."""

    seg: int
    fd: int
    end: int = 0           # bytes reserved so far: the next batch starts here
    pending: set[Appended] = field(default_factory=set)  # reserved, not yet released or given up
    retired: bool = False  # takes no more appends; closed once nothing is pending
    failed: bool = False   # a sync failed with batches after it: they must be written again


@dataclass(eq=False, slots=True)
class Appended:
    """One writer's batch in a segment (:meth:`SegmentFiles.append_records`): ``[start,
    end)`` of the segment (4 KiB-aligned), one location per record once written."""

    segment: _Writing
    start: int
    end: int
    locations: list[Location]


@dataclass(frozen=True, slots=True)
class Reclaimable:
    """What ``gc`` may give back of one segment, as the index says while gc holds the
    segment's lock (see :meth:`SegmentFiles.reclaim`).

    ``live``: sorted ``(offset, end)`` of the records indexed in it. ``indexed_end``: the
    segment's bytes from here on have not been scanned by a recovery yet (a dead
    writer's batches, possibly acknowledged before an OS crash took their index commit):
    they are kept; None: no such bound (a store written before segment ends were kept).
    """

    live: Sequence[tuple[int, int]]
    indexed_end: int | None


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """What :meth:`SegmentFiles.reclaim` gave back: the segments it unlinked, the bytes
    it punched."""

    removed: list[int]
    punched: int


#: Times a writer tries to create its next segment when a gc keeps taking the new file.
_OPEN_TRIES = 16


class SegmentFiles:
    """The segment directory of one open store: this process's active segment, the read
    descriptors of every segment, the I/O thread pool, and the read engine over them
    (:attr:`reads`).

    ``new_segment_id``: allocates a fresh id (a write transaction on the index).
    ``direct_io``: True / False, or None to use O_DIRECT where the filesystem accepts it.
    ``faults``: the store's fault points (:data:`FaultPoint.RESERVE` is hit here).
    """

    def __init__(self, path: Path, *, new_segment_id: Callable[[], int], segment_bytes: int,
                 direct_io: bool | None, io_threads: int, readonly: bool,
                 max_open_segments: int = DEFAULT_MAX_OPEN_SEGMENTS, faults: Faults | None = None) -> None:
        self.path = path
        self.faults = Faults() if faults is None else faults
        self._new_id = new_segment_id
        self.segment_bytes = segment_bytes
        self.io_threads = io_threads
        self.readonly = readonly
        if not readonly:
            mkdir_private(path)
        self._lock = threading.Lock()          # the I/O pool
        self._write_lock = threading.Lock()    # the segments this process writes (their state)
        self._write_cond = threading.Condition(self._write_lock)
        self._open_lock = threading.Lock()     # one writer at a time opens a new segment
        self._closing = False
        self._files = OpenSegments(path, max_open_segments)  # read fds, LRU-bounded
        self._active: _Writing | None = None    # where the next batch is appended
        self._writing: dict[int, _Writing] = {}  # the active one + retired ones with syncs pending
        # (started now, not on the first read: see tiered_kv.storage.os.threads)
        self._pool: ThreadPoolExecutor | None = started_pool(io_threads, "tkv-seg") if io_threads > 1 else None
        self._local = threading.local()  # each thread's staging buffer
        self._can_reserve = True
        #: the reads of these segments (:mod:`.reads`)
        self.reads = ReadEngine(self._files, io_threads=io_threads, direct_io=direct_io, pool=self.pool)

    @property
    def direct_io(self) -> bool | None:
        """Whether segment writes and cold reads use ``O_DIRECT`` (None: not known yet; the
        first segment created, or the first cold read, finds out)."""
        return self.reads.direct_io

    @direct_io.setter
    def direct_io(self, value: bool | None) -> None:
        self.reads.direct_io = value

    # ------------------------------------------------------------------ plumbing
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="tkv-seg")
        return self._pool

    def file(self, seg: int) -> Path:
        return self.path / segment_name(seg)

    def segment_ids(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(i for i in map(parse_segment_name, names) if i is not None)

    def forget_removed(self) -> None:
        """Close cached fds of segments that were unlinked (by gc in any process), so that
        their disk space is released."""
        self._files.forget_removed()

    @property
    def open_files(self) -> int:
        """Read descriptors of segment files open now."""
        return len(self._files)

    # ------------------------------------------------------------------ writes
    def _open_segment(self) -> _Writing:
        """A fresh segment of this writer: created under a temporary name, flock'ed, then
        renamed (a gc never sees it under its own name unlocked), its name made durable.

        A gc removes the temporary files it can lock (a writer that died between create
        and rename leaves one): it may take this one between its create and its lock.
        Then the lock or the rename fails, and this writer starts again with a new id."""
        for _ in range(_OPEN_TRIES):
            seg = self._new_id()
            while self.file(seg).exists():  # an id whose allocation an OS crash undid: never reuse it
                seg = self._new_id()
            fd = self._create_locked(seg)
            if fd >= 0:
                break
        else:
            raise StoreError(f"{self.path}: could not create a segment file: a gc removed each of the "
                             f"{_OPEN_TRIES} new ones before this writer could lock it")
        writing = _Writing(seg, fd)
        with self._write_lock:
            self._writing[seg] = writing
        return writing

    def _create_locked(self, seg: int) -> int:
        """Create segment ``seg`` (see _open_segment): its write fd, flock'ed and under its
        name, or -1 when a gc took the temporary file first."""
        path = self.file(seg)
        tmp = path.with_name(path.name + ".new")
        direct = self.direct_io is not False
        while True:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
            try:
                fd = os.open(tmp, flags, 0o600)
                break
            except OSError as e:
                if direct and self.direct_io is None and e.errno == errno.EINVAL:
                    direct = False  # the filesystem refuses O_DIRECT: buffered + fdatasync
                    continue
                raise
        try:
            os.fchmod(fd, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(tmp, path)
            except (BlockingIOError, FileNotFoundError):
                os.close(fd)  # a gc holds it (it unlinks it) or unlinked it already
                return -1
            fsync_dir(self.path)  # the new file's name is durable before records point into it
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        if self.direct_io is None:
            self.direct_io = direct
        return fd

    def _retire(self, w: _Writing) -> None:
        """No more appends to ``w``; its fd closes (the flock goes: the segment is sealed)
        once no batch in it waits for its commit. Under ``_write_lock``.

        A batch leaves ``pending`` only once its index transaction committed
        (:meth:`release`) or it will never be indexed (:meth:`give_up`), so the lock is
        held across every index commit into the segment: a gc that locks it afterwards
        reads an index that holds them all."""
        w.retired = True
        if self._active is w:
            self._active = None
        if not w.pending and w.fd >= 0:
            os.close(w.fd)
            w.fd = -1
            self._writing.pop(w.seg, None)
            self._write_cond.notify_all()

    def _staging(self, nbytes: int) -> np.ndarray:
        """This thread's aligned staging buffer, at least ``nbytes`` (writers stage their
        batches concurrently, each in its own)."""
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.staging = aligned_buffer(max(nbytes, 8 << 20))
        return buf

    def _usable(self, w: _Writing | None, padded: int) -> bool:
        return w is not None and not w.failed and not w.retired and \
            not (w.end and w.end + padded > self.segment_bytes)

    def _reserve_range(self, padded: int) -> Appended:
        """A range of ``padded`` bytes at the end of the active segment, for one writer
        (rolling over to a new segment when the active one is full or failed)."""
        with self._write_lock:
            if self._closing:
                raise StoreError(f"{self.path}: store is closed")
            if self._usable(self._active, padded):
                return self._take_range(self._active, padded)
        with self._open_lock:  # one writer opens the next segment; the others then use it
            with self._write_lock:
                if self._usable(self._active, padded):
                    return self._take_range(self._active, padded)
                if self._active is not None:
                    self._retire(self._active)
            w = self._open_segment()
            with self._write_lock:
                self._active = w
                return self._take_range(w, padded)

    def _take_range(self, w: _Writing, padded: int) -> Appended:
        batch = Appended(w, w.end, w.end + padded, [])
        w.end += padded
        w.pending.add(batch)
        return batch

    def append_records(self, lengths: Sequence[int], fill: Callable[[int, np.ndarray], None]) -> Appended:
        """Append records of ``lengths`` bytes, back to back, as one 4 KiB-aligned batch in
        a range of the active segment reserved for this caller: written, not yet synced
        (see :meth:`sync`); then :meth:`release` it once indexed, or :meth:`give_up`.
        Threads append concurrently, each into its own range.

        ``fill(j, dst)`` writes record ``j`` into ``dst`` (a slice of this thread's staging
        buffer). Records are staged in order and each 4 KiB-aligned chunk is written
        (parallel ``pwrite``, ``O_DIRECT`` where the filesystem takes it) as soon as it is
        complete, while the next records are staged. Raises OSError (ENOSPC from the space
        reservation: nothing written) or what ``fill`` raised; then the range is given
        back (cut off the segment's end, or punched when others appended after it)."""
        total = sum(lengths)
        padded = align_up(total)
        staged = self._staging(padded)
        batch = self._reserve_range(padded)
        fd, start = batch.segment.fd, batch.start
        view = memoryview(staged)

        def write(off: int, end: int) -> None:
            done = off
            while done < end:
                done += os.pwrite(fd, view[done:end], start + done)

        pending = []
        pool = self.pool()
        try:
            self._reserve(fd, start, padded)  # ENOSPC here: nothing written
            pos = sent = 0
            for j, n in enumerate(lengths):
                fill(j, staged[pos:pos + n])
                pos += n
                ready = align_down(pos)
                if ready - sent >= _CHUNK:
                    pending.append(pool.submit(write, sent, ready))
                    sent = ready
            staged[total:padded] = 0
            if padded > sent:
                write(sent, padded)
            for f in pending:
                f.result()
        except BaseException:
            for f in pending:
                f.exception()  # wait: no write may land after the range is given back
            self.give_up([batch])
            raise
        off = start
        for n in lengths:
            batch.locations.append(Location(batch.segment.seg, off, n))
            off += n
        return batch

    def sync(self, batches: Sequence[Appended]) -> None:
        """``fdatasync`` each segment ``batches`` lie in (once each): their records are
        durable once this returns. Raises OSError."""
        for w in {id(b.segment): b.segment for b in batches}.values():
            os.fdatasync(w.fd)

    def indexed_ends(self, batches: Sequence[Appended]) -> dict[int, int]:
        """For each segment of ``batches``: the offset below which everything is indexed
        or given up once ``batches`` are indexed (the ``segment_end`` a recovery scan
        starts from): the start of the lowest range still being written or waiting for
        its commit, else the segment's end."""
        ends: dict[int, int] = {}
        mine = {id(b) for b in batches}
        with self._write_lock:
            for w in {id(b.segment): b.segment for b in batches}.values():
                others = [b.start for b in w.pending if id(b) not in mine]
                ends[w.seg] = min(others) if others else w.end
        return ends

    def give_up(self, batches: Sequence[Appended], *, sync_failed: bool = False) -> None:
        """``batches`` will not be indexed: give their bytes back, cutting a segment back
        when nothing was appended after them, else punching holes.

        ``sync_failed``: their sync failed. Batches other writers appended to the same
        segment may have had pages in the failed writeback, so that segment takes no
        more appends, and its ``failed`` flag tells their commit to have them rewritten."""
        with self._write_lock:
            for b in sorted(batches, key=lambda b: -b.start):  # from the end: cuts cascade
                w = b.segment
                w.pending.discard(b)
                if w.fd < 0:
                    continue
                if w.end == b.end and not w.retired:
                    try:
                        os.ftruncate(w.fd, b.start)
                        w.end = b.start
                    except OSError:
                        self._retire(w)  # a fresh segment next time; the tail is garbage for gc
                else:
                    punch_hole(w.fd, b.start, b.end - b.start)
                if sync_failed and w.pending:
                    w.failed = True
                    self._retire(w)
                elif w.retired:
                    self._retire(w)  # closes it once nothing is pending
            self._write_cond.notify_all()

    def release(self, batches: Sequence[Appended]) -> None:
        """``batches`` are indexed (or their records given up one by one)."""
        with self._write_lock:
            for b in batches:
                b.segment.pending.discard(b)
                if b.segment.retired:
                    self._retire(b.segment)
            self._write_cond.notify_all()

    def drain(self) -> None:
        """Refuse new appends and wait until every appended batch is released or given
        up (before closing: writers may still be writing, or holding a closed error)."""
        with self._write_lock:
            self._closing = True
            while any(w.pending for w in self._writing.values()):
                self._write_cond.wait()

    @contextmanager
    def sealed(self, seg: int) -> Iterator[int | None]:
        """Segment ``seg`` held sealed (an exclusive ``flock``: no writer appends to it or
        indexes into it, no gc reclaims it meanwhile): yields a read fd, or None when this
        process writes to it, another writer (or a recovery, or a gc) holds it, or it is
        gone."""
        if seg in self._writing:
            yield None
            return
        try:
            fd = os.open(self.file(seg), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            yield None
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield None
                return
            if os.fstat(fd).st_nlink == 0:
                yield None  # a gc unlinked it after this open: nothing to scan or index
                return
            yield fd
        finally:
            os.close(fd)

    def _reserve(self, fd: int, offset: int, length: int) -> None:
        self.faults.hit(FaultPoint.RESERVE, length)
        if not self._can_reserve:
            return
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self._can_reserve = False  # the filesystem cannot: ENOSPC comes from the writes

    # ------------------------------------------------------------------ maintenance
    def punch(self, locs: Sequence[Location]) -> None:
        """Free the disk space of records that are no longer indexed."""
        by_seg: dict[int, list[Location]] = {}
        for loc in locs:
            by_seg.setdefault(loc.segment, []).append(loc)
        for seg, group in by_seg.items():
            try:
                fd = os.open(self.file(seg), os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:  # adjacent records in one call: the blocks they share are freed too
                group.sort(key=lambda loc: loc.offset)
                start, end = group[0].offset, group[0].end
                for loc in group[1:]:
                    if loc.offset > end:
                        punch_hole(fd, start, end - start)
                        start = loc.offset
                    end = max(end, loc.end)
                punch_hole(fd, start, end - start)
            finally:
                os.close(fd)

    def reclaim(self, reclaimable: Callable[[int], Reclaimable | None]) -> Reclaimed:
        """Give back the space of sealed segments that no index entry covers: unlink a
        segment with nothing indexed in it, punch the gaps of the others.

        Each segment is locked (an exclusive ``flock``, taken without waiting: a segment a
        writer, a recovery or another gc holds is skipped), then ``reclaimable(seg)`` says,
        from the index as it is *now*, what is live in it (None: leave it). The invariant:
        gc only gives back bytes that no committed index entry covers at the moment it
        holds the segment's lock, and no index entry into that segment can be committed
        while it holds it (only the holder of a segment's lock indexes into it: its writer
        until its last batch there is indexed or given up, see ``_retire``; a recovery
        scan). Bytes at or past the segment's ``indexed_end`` (not scanned by a recovery
        yet) are kept. Returns what was given back."""
        removed: list[int] = []
        punched = 0
        for seg in self.segment_ids():
            if seg in self._writing:
                continue  # (a shortcut: the lock below is what decides)
            try:
                fd = os.open(self.file(seg), os.O_WRONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer's segment, or a recovery / another gc at work on it
                st = os.fstat(fd)
                if st.st_nlink == 0:
                    continue  # another gc unlinked it after this open
                plan = reclaimable(seg)
                if plan is None:
                    continue
                end = st.st_size if plan.indexed_end is None else min(st.st_size, plan.indexed_end)
                if not plan.live and end >= st.st_size:
                    os.unlink(self.file(seg))
                    removed.append(seg)
                    continue
                punched += _punch_gaps(fd, plan.live, end)
            finally:
                os.close(fd)
        for name in os.listdir(self.path):  # segments a writer died creating
            if name.endswith(SEGMENT_SUFFIX + ".new"):
                try:
                    fd = os.open(self.path / name, os.O_WRONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.unlink(self.path / name)  # (a writer that finds it gone starts another)
                except (BlockingIOError, FileNotFoundError):
                    pass  # its writer holds it / it is gone already
                finally:
                    os.close(fd)
        if removed:
            fsync_dir(self.path)
        self.forget_removed()
        return Reclaimed(removed, punched)

    def disk_bytes(self) -> int:
        """Bytes the segment files occupy on disk (holes excluded)."""
        total = 0
        for seg in self.segment_ids():
            try:
                total += os.stat(self.file(seg)).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        with self._write_lock:
            self._closing = True
            for w in list(self._writing.values()):
                w.pending.clear()  # (the store drained its writers first)
                self._retire(w)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._files.close()
        # Each writing thread's staging buffer (>= 8 MiB) and each reading thread's bounce
        # buffer would otherwise live as long as this object, which the closed store's owner
        # may keep: drop them with the store.
        self._local = threading.local()
        self.reads.release_buffers()


def _punch_gaps(fd: int, live: Sequence[tuple[int, int]], end: int) -> int:
    """Punch the bytes of ``[0, end)`` that no range of ``live`` (sorted ``(offset,
    end)``) covers; returns the bytes punched."""
    punched = pos = 0
    for a, b in [*live, (end, end)]:
        a = min(a, end)
        if a > pos and punch_hole(fd, pos, a - pos):
            punched += a - pos
        pos = max(pos, b)
        if pos >= end:
            break
    return punched
