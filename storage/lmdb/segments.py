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

Reads: records whose pages are in the page cache (``cachestat``, Linux >= 6.5) are read
straight into the caller's buffers and hashed as they are read
(:mod:`~tiered_kv.storage.os.fastread`). Natively (:meth:`SegmentFiles.batch_read`) each
record is handed, as soon as the store has prepared it, to helper threads of the native
module that check it is cached, read it in 128 KiB runs, hash each run at once and check
it, with no GIL and no Python per record on their side; the calling thread joins them
once it has handed over the batch. Otherwise (the Python fallback; records 3/4 or more
cached; one ``cachestat`` per segment when all of the span read is cached) one ``preadv``
each, in shards of >= 1 MiB drained by one thread per CPU: copies and hashing release the
GIL, so they run in parallel. Other extents (records
adjacent in one segment) are read with ``O_DIRECT`` into an aligned bounce buffer
(parallel, several extents in flight), or with buffered ``preadv`` after
``POSIX_FADV_WILLNEED`` when direct I/O is off.
Deleting or evicting a record punches a hole over it (``fallocate(PUNCH_HOLE)``), so the
disk space follows the live records without rewriting segments.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..errors import StoreError
from ..os import fastread, libc
from ..os import threads as os_threads
from ..os.files import fsync_dir, mkdir_private
from ..os.libc import ALIGN, align_down, align_up, aligned_buffer, allocate_blocks, punch_hole
from ..os.preadv import preadv_all
from ..os.threads import started_pool
from ..format.rows import RowScatter

__all__ = ["ALIGN", "Location", "Reclaimable", "Reclaimed", "SegmentFiles", "allocate_blocks", "punch_hole"]

T = TypeVar("T")

#: A batch is written in pwrites of about this size, each sent as soon as it is staged.
_CHUNK = 2 << 20
#: Extents of one read: adjacent records closer than this are read in one transfer...
_MERGE_GAP = 64 << 10
#: ...up to this many bytes (a batch of Flash blocks: several extents, read in parallel;
#: 1 MiB against 2 MiB: 1.21-1.24 against 1.07 GB/s cold for batches of 16 Flash blocks here,
#: each thread verifies one extent while the others' reads are in flight).
_MAX_EXTENT = 1 << 20
#: Read-ahead asked of the kernel per POSIX_FADV_WILLNEED call (it reads at most its window per call).
_WILLNEED_BYTES = 4 << 20
#: Row reads (read_rows) are handed to their threads in runs of records of about this many bytes...
_ROWS_CHUNK = 2 << 20
#: ...and, from a cold disk, read with O_DIRECT in extents of at most this many bytes (as
#: get_many's; each thread's bounce buffer is faulted in once per process).
_MAX_EXTENT_ROWS = _MAX_EXTENT
#: Records the page cache holds are spread over threads in shards of at least this many bytes.
_MIN_SHARD = 1 << 20
SEGMENT_SUFFIX = ".seg"
#: How often a reader closes its cached fds of segments that gc (of any process) unlinked.
_SWEEP_S = 10.0

def segment_name(seg_id: int) -> str:
    return f"{seg_id:08x}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    if not name.endswith(SEGMENT_SUFFIX) or len(name) != 8 + len(SEGMENT_SUFFIX):
        return None
    try:
        return int(name[:8], 16)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Location:
    """Where one record lies: segment id, byte offset, record bytes."""

    segment: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(slots=True)
class ReadTask:
    """One record to read: its location and where its parts go.

    ``header``: ``[HEADER_BYTES] uint8``; ``payload``: the caller's out buffer as a list of
    1-D uint8 views filled in order (a scatter list; often one); ``tail``:
    ``[CHECKSUM_BYTES] uint8``. Filled in by the read: ``ok`` (False: the bytes could not
    be read, e.g. the segment is gone) and ``digest``, the canonical xxh3-128 of header +
    payload as read (what ``tail`` must equal), or, for a task with ``expect`` read by
    the native batch read, ``verified``. ``result``: the reader's verdict.
    """

    index: int
    loc: Location
    header: np.ndarray
    payload: list[np.ndarray]
    tail: np.ndarray
    ok: bool = False
    digest: bytes | None = None
    result: Any = None
    #: what the native batch read checks the record against (PartsVerifier.expectation);
    #: None: only read and hashed
    expect: bytes | None = None
    #: set by a native batch read that checked it (then ``then`` is not called for it)
    verified: bool | None = None


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


class _DirectUnsupported(Exception):
    pass


#: Read descriptors of segment files kept open at most (idle ones; see _OpenSegments).
DEFAULT_MAX_OPEN_SEGMENTS = 128


class _OpenFd:
    __slots__ = ("fd", "users", "alive")

    def __init__(self, fd: int) -> None:
        self.fd, self.users, self.alive = fd, 0, True


class _OpenSegments:
    """Read descriptors of segment files, shared by the threads of one store: at most
    ``limit`` kept open, the least recently used idle one closed first (a 2 TiB store of
    256 MiB segments would otherwise hold about 16,000 descriptors, two per segment).

    A descriptor is closed only once no caller uses it: a number closed under a reader
    could be handed to another file meanwhile. So the bound is exceeded only while more
    than ``limit`` descriptors are in use at once (a read holds one per extent in flight:
    at most its I/O threads)."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder = folder
        self.limit = limit
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[int, bool], _OpenFd] = OrderedDict()  # (segment, O_DIRECT) -> fd

    @contextmanager
    def use(self, seg: int, *, direct: bool) -> Iterator[int]:
        """A read fd of segment ``seg`` for the ``with`` block (FileNotFoundError once gc
        unlinked it; _DirectUnsupported where the filesystem refuses O_DIRECT)."""
        entry = self._acquire(seg, direct)
        try:
            yield entry.fd
        finally:
            self._release(entry)

    @contextmanager
    def use_many(self, segs: Sequence[int]) -> Iterator[dict[int, int]]:
        """Buffered read fds of the segments ``segs`` for the ``with`` block, as
        ``{segment: fd}``; a segment that cannot be opened (gc unlinked it, no descriptor
        to spare) is left out, so its records are misses."""
        entries: dict[int, _OpenFd] = {}
        try:
            for seg in segs:
                try:
                    entries[seg] = self._acquire(seg, False)
                except OSError:
                    continue
            yield {seg: e.fd for seg, e in entries.items()}
        finally:
            for e in entries.values():
                self._release(e)

    def __len__(self) -> int:
        return len(self._lru)

    def _acquire(self, seg: int, direct: bool) -> _OpenFd:
        key = (seg, direct)
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                entry.users += 1
                self._lru.move_to_end(key)
                return entry
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(self.folder / segment_name(seg), flags)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise _DirectUnsupported() from e
            raise
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:  # another thread opened it meanwhile
                os.close(fd)
            else:
                entry = self._lru[key] = _OpenFd(fd)
                self._trim()
            entry.users += 1
            self._lru.move_to_end(key)
            return entry

    def _release(self, entry: _OpenFd) -> None:
        with self._lock:
            entry.users -= 1
            if entry.users == 0:
                if not entry.alive:
                    os.close(entry.fd)
                elif len(self._lru) > self.limit:
                    self._trim()

    def _trim(self) -> None:
        """Close idle descriptors, least recently used first, down to the limit (under
        the lock)."""
        over = len(self._lru) - self.limit
        for key in [k for k, e in self._lru.items() if e.users == 0][:max(over, 0)]:
            os.close(self._lru.pop(key).fd)

    def forget_removed(self) -> None:
        """Close the descriptors of segments that were unlinked (by gc in any process),
        so that their disk space is released (those in use: when the last user is done)."""
        with self._lock:
            for key, entry in list(self._lru.items()):
                if os.fstat(entry.fd).st_nlink == 0:
                    self._drop(key)

    def close(self) -> None:
        with self._lock:
            for key in list(self._lru):
                self._drop(key)

    def _drop(self, key: tuple[int, bool]) -> None:
        entry = self._lru.pop(key)
        entry.alive = False
        if entry.users == 0:
            os.close(entry.fd)


class SegmentFiles:
    """The segment directory of one open store: this process's active segment and the
    read side (an fd cache, the I/O thread pool).

    ``new_segment_id``: allocates a fresh id (a write transaction on the index).
    ``direct_io``: True / False, or None to use O_DIRECT where the filesystem accepts it.
    """

    def __init__(self, path: Path, *, new_segment_id: Callable[[], int], segment_bytes: int,
                 direct_io: bool | None, io_threads: int, readonly: bool,
                 max_open_segments: int = DEFAULT_MAX_OPEN_SEGMENTS) -> None:
        self.path = path
        self._new_id = new_segment_id
        self.segment_bytes = segment_bytes
        self.direct_io = direct_io
        self.io_threads = io_threads
        self.readonly = readonly
        if not readonly:
            mkdir_private(path)
        self._lock = threading.Lock()          # the I/O pool
        self._write_lock = threading.Lock()    # the segments this process writes (their state)
        self._write_cond = threading.Condition(self._write_lock)
        self._open_lock = threading.Lock()     # one writer at a time opens a new segment
        self._closing = False
        self._files = _OpenSegments(path, max_open_segments)  # read fds, LRU-bounded
        self._active: _Writing | None = None    # where the next batch is appended
        self._writing: dict[int, _Writing] = {}  # the active one + retired ones with syncs pending
        # (started now, not on the first read: see tiered_kv.storage.os.threads)
        self._pool: ThreadPoolExecutor | None = started_pool(io_threads, "tkv-seg") if io_threads > 1 else None
        self._local = threading.local()
        self._swept = time.monotonic()
        self._can_reserve = True

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
        if not self._can_reserve:
            return
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            self._can_reserve = False  # the filesystem cannot: ENOSPC comes from the writes

    # ------------------------------------------------------------------ reads
    def read(self, tasks: list[ReadTask], then: Callable[[ReadTask], None] | None = None) -> None:
        """Read every task's record parts (sets ``task.ok``), then call ``then(task)`` on
        each one read (in the reading thread, while its bytes are in the CPU cache).

        Records the page cache holds are read one ``preadv`` each (header, the caller's
        buffers, checksum: a memory copy, hashed in the same call) in shards of about equal
        bytes, drained by :attr:`hot_threads` threads, the calling thread one of them: the
        copies and the hashing release the GIL, so they run in parallel. Cold extents are
        read on the I/O threads meanwhile."""
        if time.monotonic() - self._swept > _SWEEP_S:
            self._swept = time.monotonic()
            self.forget_removed()
        hot, cold = self._hot_and_cold(tasks)
        jobs: list[Callable[[], None]] = [functools.partial(self._read_cold, ext, then) for ext in cold]
        if hot and fastread.read_verify_many is not None and all(t.expect is not None for t in hot):
            jobs.insert(0, functools.partial(self._read_checked, hot))  # one native call: threads of its own
        elif shards := deque(self._shards(hot)):
            # Readers take the next shard as they finish one: a thread that runs late (a
            # busy CPU) holds up the call by one shard, not by a fixed share.
            drain = functools.partial(self._drain, shards, then)
            jobs = [drain] * min(self.hot_threads, len(shards)) + jobs
        if len(jobs) <= 1 or self.io_threads <= 1:
            for job in jobs:
                job()
            return
        pool = self.pool()
        futures = [pool.submit(job) for job in jobs[1:]]
        try:
            jobs[0]()
        finally:
            for f in futures:
                f.result()

    def batch_read(self, capacity: int, nbytes: int, then: Callable[[ReadTask], None] | None = None) -> BatchRead:
        """A read of up to ``capacity`` tasks (about ``nbytes`` of payload) handed over one
        at a time (:meth:`BatchRead.add`), then :meth:`BatchRead.finish`: the same
        results as :meth:`read` of them all. Natively, a task with ``expect`` whose record
        the page cache holds is read and checked by helper threads as soon as it is added
        (see :class:`BatchRead`)."""
        if time.monotonic() - self._swept > _SWEEP_S:
            self._swept = time.monotonic()
            self.forget_removed()
        return BatchRead(self, capacity, self.hot_threads if nbytes >= 2 * _MIN_SHARD else 1, then)

    def _hot_and_cold(self, tasks: list[ReadTask]) -> tuple[list[ReadTask], list[list[ReadTask]]]:
        """The records of ``tasks`` the page cache holds (file order), and the extents
        (runs of nearby records, see :func:`_extents`) it does not. One ``cachestat`` per
        segment when all of the span read there is cached (the common hot case: then no
        extents are formed), else one per extent. Records of a segment that is gone are
        left out (misses)."""
        by_seg: dict[int, list[ReadTask]] = {}
        for t in tasks:
            by_seg.setdefault(t.loc.segment, []).append(t)
        hot: list[ReadTask] = []
        cold: list[list[ReadTask]] = []
        for seg in sorted(by_seg):
            group = by_seg[seg]
            group.sort(key=_offset)
            try:
                with self._files.use(seg, direct=False) as fd:
                    first, end = group[0].loc.offset, group[-1].loc.end
                    whole = libc.cached_pages(fd, first, end - first)
                    if whole is None or whole[0] >= whole[1]:  # (unknown: read buffered)
                        hot.extend(group)
                        continue
                    for ext in _extents(group):
                        if self._cached(fd, ext[0].loc.offset, ext[-1].loc.end - ext[0].loc.offset):
                            hot.extend(ext)
                        else:
                            cold.append(ext)
            except OSError:
                continue  # reclaimed by gc (or unreadable): every record of it is a miss
        return hot, cold

    @property
    def hot_threads(self) -> int:
        """Threads that copy and check records the page cache holds: the I/O threads,
        at most one per CPU this process may run on (more only take turns)."""
        return max(1, min(self.io_threads, os_threads.usable_cpus()))

    def _shards(self, hot: list[ReadTask]) -> list[list[ReadTask]]:
        """``hot`` in file order, cut into runs of about equal bytes: two per
        :attr:`hot_threads` when there are several (one when there is one), each at least
        ``_MIN_SHARD`` (a smaller one costs more to hand to a thread than it saves)."""
        if not hot:
            return []
        total = sum(t.loc.length for t in hot)
        per_thread = 2 if self.hot_threads > 1 else 1
        n = max(1, min(per_thread * self.hot_threads, len(hot), total // _MIN_SHARD))
        if n == 1:
            return [hot]
        shards: list[list[ReadTask]] = [[] for _ in range(n)]
        done = 0
        for t in hot:
            shards[min(n - 1, done * n // total)].append(t)
            done += t.loc.length
        return [s for s in shards if s]

    def _drain(self, shards: deque[list[ReadTask]], then: Callable[[ReadTask], None] | None) -> None:
        """Read shards from ``shards`` until none is left (several threads drain one deque)."""
        while True:
            try:
                shard = shards.popleft()
            except IndexError:
                return
            self._read_records(shard, then)

    def _read_records(self, tasks: list[ReadTask], then: Callable[[ReadTask], None] | None) -> None:
        """Read each of ``tasks`` (file order) from the page cache, segment by segment: one
        :func:`~tiered_kv.storage.os.fastread.read_and_hash` each (sets ``ok`` and ``digest``),
        then ``then(task)``; or, natively when every task has ``expect``, read and check a
        segment's tasks in one :func:`~tiered_kv.storage.os.fastread.read_verify_many` call
        (sets ``ok`` and ``verified``; ``then`` is not called). An error (EIO; a segment gc
        unlinked; no descriptor to spare) is a miss of the records not read."""
        i = 0
        while i < len(tasks):
            seg = tasks[i].loc.segment
            j = i + 1
            while j < len(tasks) and tasks[j].loc.segment == seg:
                j += 1
            group, i = tasks[i:j], j
            try:
                with self._files.use(seg, direct=False) as fd:
                    _read_group(fd, group, then)
            except OSError:
                continue

    def _read_checked(self, tasks: list[ReadTask]) -> None:
        """Read and check ``tasks`` (file order, each with ``expect``) from the page cache
        in one native :func:`~tiered_kv.storage.os.fastread.read_verify_many` call for the
        whole batch (sets ``ok`` and ``verified``): the GIL is released once, and a batch
        of at least two shards' bytes is spread over :attr:`hot_threads` threads that the
        call starts itself, each taking the next record as it finishes one. Segments are
        taken at most ``max_open_segments`` at a time (the fd bound); a segment that cannot
        be opened is a miss of its records."""
        many = fastread.read_verify_many
        assert many is not None
        segs = list(dict.fromkeys(t.loc.segment for t in tasks))  # (file order: grouped by segment)
        limit = max(1, self._files.limit)
        for a in range(0, len(segs), limit):
            with self._files.use_many(segs[a:a + limit]) as fds:
                group = [t for t in tasks if t.loc.segment in fds] if len(segs) > 1 else (tasks if fds else [])
                if not group:
                    continue
                total = sum(t.loc.length for t in group)
                n_threads = self.hot_threads if total >= 2 * _MIN_SHARD else 1
                statuses = many([(fds[t.loc.segment], t.loc.offset, [t.header, *t.payload, t.tail], t.expect)
                                 for t in group], n_threads)
            for t, status in zip(group, statuses):
                t.ok = status != fastread.SHORT
                t.verified = status == fastread.VERIFIED

    def _read_cold(self, ext: list[ReadTask], then: Callable[[ReadTask], None] | None) -> None:
        """Read an extent the page cache does not hold: ``O_DIRECT`` into a bounce buffer
        (then copied into the parts), or buffered after ``POSIX_FADV_WILLNEED`` when
        direct I/O is off."""
        first, end = ext[0].loc.offset, ext[-1].loc.end
        try:
            if self.direct_io is not False:  # None: try it (EINVAL turns it off)
                try:
                    self._read_direct(ext, first, end, then)
                    return
                except _DirectUnsupported:
                    self.direct_io = False
                except FileNotFoundError:
                    return
            if len(ext) > 1:
                with self._files.use(ext[0].loc.segment, direct=False) as fd:
                    os.posix_fadvise(fd, first, end - first, os.POSIX_FADV_WILLNEED)
        except OSError:
            # EIO, the segment was unlinked by gc (only records no longer indexed lived
            # there), or no descriptor to spare (EMFILE): what was not read is a miss
            return
        self._read_records(ext, then)

    def holds(self, loc: Location) -> bool:
        """Whether ``loc`` lies within its segment file as it is now (False: the file is
        gone, or an index entry claims bytes past its end, e.g. an absurd length)."""
        if loc.offset < 0 or loc.length < 0:
            return False
        try:
            with self._files.use(loc.segment, direct=False) as fd:
                return loc.end <= os.fstat(fd).st_size
        except OSError:
            return False

    def _cached(self, fd: int, offset: int, length: int) -> bool:
        """Whether the page cache holds (at least 3/4 of) the range: then a buffered read
        beats O_DIRECT. Unknown (no cachestat): True, read buffered."""
        got = libc.cached_pages(fd, offset, length)
        return got is None or 4 * got[0] >= 3 * got[1]

    def _bounce(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.bounce = aligned_buffer(max(nbytes, _MAX_EXTENT + 2 * ALIGN))
        return buf

    def _read_direct(self, ext: list[ReadTask], first: int, end: int,
                     then: Callable[[ReadTask], None] | None) -> None:
        lo, hi = align_down(first), align_up(end)
        buf = self._bounce(hi - lo)
        with self._files.use(ext[0].loc.segment, direct=True) as fd:
            got = preadv_all(fd, [buf[:hi - lo]], lo)
        for t in ext:
            a = t.loc.offset - lo
            if a + t.loc.length > got:
                continue  # past the end of the file: torn, a miss
            h = t.header.nbytes
            t.header[:] = buf[a:a + h]
            a += h
            for seg in t.payload:  # the scatter list, piece by piece
                np.copyto(seg, buf[a:a + seg.nbytes])
                a += seg.nbytes
            t.tail[:] = buf[a:t.loc.offset - lo + t.loc.length]
            start = t.loc.offset - lo  # header + payload, contiguous here: one call, GIL released
            t.digest = fastread.digest_parts([buf[start:a]])
            t.ok = True
            if then is not None:
                then(t)

    def read_rows(self, locs: Sequence[Location], rows: RowScatter, expects: np.ndarray) -> np.ndarray:
        """Read and verify record k at ``locs[k]`` into the pieces ``rows`` gives record k,
        natively (:data:`~tiered_kv.storage.os.fastread.read_verify_rows`; only where it is
        bound); ``expects``: ``[n, E] uint8``, each record's
        :meth:`~tiered_kv.storage.record.PartsVerifier.expectation`. Returns ``[n] uint8``
        statuses (VERIFIED, SHORT, FAILED); the records of a segment that is gone are SHORT.

        The records, in file order, are cut into runs of about ``_ROWS_CHUNK`` bytes that
        :attr:`hot_threads` threads (the calling thread one of them) take in turn, each
        run one native call with the GIL released.
        Where the page cache does not hold them all, extents are read with ``O_DIRECT``
        by the I/O threads (:meth:`_read_rows_direct`: no page cache to fill, each record
        checked in the bounce buffer and then copied once); where the filesystem refuses ``O_DIRECT``, the
        disk is first asked for every extent (``POSIX_FADV_WILLNEED``, in file order, in
        pieces the kernel takes whole) and the threads read as the pages arrive."""
        read = fastread.read_verify_rows
        assert read is not None, "read_rows: the native read_verify_rows is not bound"
        n = len(locs)
        status = np.full(n, fastread.SHORT, np.uint8)
        with ExitStack() as held:
            fds: dict[int, int] = {}
            for seg in sorted({loc.segment for loc in locs}):
                try:
                    fds[seg] = held.enter_context(self._files.use(seg, direct=False))
                except OSError:
                    continue  # gone (gc) or unreadable: its records stay SHORT
            order = sorted((i for i in range(n) if locs[i].segment in fds),
                           key=lambda i: (locs[i].segment, locs[i].offset))
            if not order:
                return status
            # Span by span (runs of nearby records), as get_many decides extent by extent:
            # a few evicted pages send their span to the disk, not the whole batch.
            spans = _spans([locs[i] for i in order])
            cold = [sp for sp in spans if not self._cached(fds[sp[0]], sp[1], sp[2] - sp[1])]
            if cold and fastread.verify_rows is not None and self.direct_io is not False:
                direct = [p for *_, a, b in cold for p in range(a, b)]  # positions in order
                done = True
                try:
                    self._read_rows_direct([locs[order[p]] for p in direct],
                                           np.array([order[p] for p in direct], np.int64), rows, expects, status)
                except _DirectUnsupported:
                    self.direct_io = done = False  # nothing was read: buffered below, with the others
                except OSError:
                    pass  # the segment is gone (gc) or unreadable: those records stay misses
                if done:
                    taken = set(direct)
                    order, cold = [i for p, i in enumerate(order) if p not in taken], []
                    if not order:
                        return status
            where = np.array([(fds[locs[i].segment], locs[i].offset) for i in order], np.int64)
            # (the kernel allocates and queues the pages in the fadvise call: on its own
            # thread, so that the readers start on the first extent meanwhile)
            futures = [self.pool().submit(self._ask_disk, cold, fds)] if cold else []
            idx = np.array(order, np.int64)
            per = max(1, _ROWS_CHUNK // max(1, locs[order[0]].length))
            chunks = deque((a, min(a + per, len(idx))) for a in range(0, len(idx), per))

            def drain() -> None:
                """Read chunks (runs of records in file order) until none is left: a
                thread that runs late (a busy CPU) takes fewer, none waits on another."""
                while True:
                    try:
                        a, b = chunks.popleft()
                    except IndexError:
                        return
                    mine = idx[a:b]
                    got = read(rows.dests, rows.dest_of, rows.lengths, np.ascontiguousarray(rows.offsets[mine]),
                               where[a:b], np.ascontiguousarray(expects[mine]))
                    status[mine] = np.frombuffer(got, np.uint8)

            futures += [self.pool().submit(drain) for _ in range(min(self.hot_threads, len(chunks)) - 1)]
            try:
                drain()
            finally:
                for f in futures:
                    f.result()
        return status

    def _read_rows_direct(self, locs: list[Location], idx: np.ndarray, rows: RowScatter, expects: np.ndarray,
                          status: np.ndarray) -> None:
        """:meth:`read_rows` of records the page cache does not hold: extents of nearby
        records (file order, up to ``_MAX_EXTENT_ROWS``) read with ``O_DIRECT`` into each
        thread's bounce buffer by :attr:`io_threads` threads at once (the disk's queue
        stays full, the page cache is not filled), each record then verified and copied
        into its pieces natively (:data:`~tiered_kv.storage.os.fastread.verify_rows`).
        ``locs[p]`` is record ``idx[p]``'s; statuses go to ``status[idx[p]]``."""
        verify = fastread.verify_rows
        assert verify is not None
        extents: deque[tuple[int, int]] = deque()  # [a, b) of locs
        a = 0
        for b in range(1, len(locs) + 1):
            if b == len(locs) or not (locs[b].segment == locs[a].segment
                                      and 0 <= locs[b].offset - locs[b - 1].end <= _MERGE_GAP
                                      and locs[b].end - locs[a].offset <= _MAX_EXTENT_ROWS):
                extents.append((a, b))
                a = b

        def drain() -> None:
            while True:
                try:
                    a, b = extents.popleft()
                except IndexError:
                    return
                first, end = locs[a].offset, locs[b - 1].end
                lo, hi = align_down(first), align_up(end)
                buf = self._bounce(hi - lo)
                with self._files.use(locs[a].segment, direct=True) as fd:
                    got = preadv_all(fd, [buf[:hi - lo]], lo)
                mine = idx[a:b]
                at = np.array([loc.offset - lo for loc in locs[a:b]], np.int64)
                status[mine] = np.frombuffer(verify(buf[:got], at, rows.dests, rows.dest_of, rows.lengths,
                                                    np.ascontiguousarray(rows.offsets[mine]),
                                                    np.ascontiguousarray(expects[mine])), np.uint8)

        futures = [self.pool().submit(drain) for _ in range(min(self.io_threads, len(extents)) - 1)]
        try:
            drain()
        finally:
            for f in futures:
                f.result()

    @staticmethod
    def _ask_disk(spans: list[tuple[int, int, int, int, int]], fds: dict[int, int]) -> None:
        """Ask the disk for every ``(segment, start, end, ...)`` span, in order:
        ``POSIX_FADV_WILLNEED`` per piece of at most :data:`_WILLNEED_BYTES` (the kernel
        reads at most its read-ahead window per call; pages it holds are skipped)."""
        for seg, start, end, _, _ in spans:
            for at in range(start, end, _WILLNEED_BYTES):
                try:
                    os.posix_fadvise(fds[seg], at, min(_WILLNEED_BYTES, end - at), os.POSIX_FADV_WILLNEED)
                except OSError:
                    return  # a hint only: the reads themselves report what fails

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


class BatchRead:
    """Tasks read as they are handed over (made by :meth:`SegmentFiles.batch_read`).

    Natively (:data:`~tiered_kv.storage.os.fastread.VerifyBatch`), each task with ``expect``
    goes straight to a native batch whose helper threads (``threads - 1`` of them; the
    caller joins in :meth:`finish`) check that the page cache holds the record, read it and
    check it, while the caller prepares the next task: the Python work of a batch overlaps
    its reads. :meth:`finish` sets ``ok`` and ``verified`` of those, and reads the rest
    (records not all in the page cache, tasks without ``expect``, everything when the
    native helper is not in use) through :meth:`SegmentFiles.read`. At most
    ``max_open_segments`` descriptors are held: a batch spanning more segments is finished
    and a new one started. A segment that cannot be opened is a miss of its records.
    """

    def __init__(self, files: SegmentFiles, capacity: int, threads: int,
                 then: Callable[[ReadTask], None] | None) -> None:
        self._files = files
        self._left = capacity
        self._threads = threads
        self._then = then
        self._native: Any = None          # the native batch in flight, if any
        self._sent: list[ReadTask] = []   # its tasks, in order
        self._fds: dict[int, _OpenFd] = {}
        self._missing: set[int] = set()   # segments that could not be opened
        self._later: list[ReadTask] = []  # read in finish(), through SegmentFiles.read

    def add(self, task: ReadTask) -> None:
        self._left -= 1
        make = fastread.VerifyBatch
        if make is None or task.expect is None:
            self._later.append(task)
            return
        seg = task.loc.segment
        entry = self._fds.get(seg)
        if entry is None:
            if seg in self._missing:
                return  # (ok stays False: a miss)
            if len(self._fds) >= self._files._files.limit:
                self._flush()
            try:
                entry = self._fds[seg] = self._files._files._acquire(seg, False)
            except OSError:
                self._missing.add(seg)
                return
        if self._native is None:
            self._native = make(self._left + 1, self._threads, True)
        self._native.add(entry.fd, task.loc.offset, [task.header, *task.payload, task.tail], task.expect)
        self._sent.append(task)

    def _flush(self) -> None:
        """Finish the native batch in flight (its verdicts into its tasks; those the page
        cache lacked to ``_later``) and let go of its descriptors."""
        try:
            if self._native is not None:
                statuses = self._native.finish()
                for t, status in zip(self._sent, statuses):
                    if status == fastread.UNCACHED:
                        self._later.append(t)
                    else:
                        t.ok = status != fastread.SHORT
                        t.verified = status == fastread.VERIFIED
        finally:
            self._native, self._sent = None, []
            for entry in self._fds.values():
                self._files._files._release(entry)
            self._fds = {}

    def finish(self) -> None:
        """Wait for every task added: read, and checked natively or by ``then``."""
        self._flush()
        if self._later:
            later, self._later = self._later, []
            self._files.read(later, self._then)


def _read_group(fd: int, tasks: list[ReadTask], then: Callable[[ReadTask], None] | None) -> None:
    """Read ``tasks`` of the segment open as ``fd`` (see SegmentFiles._read_records)."""
    many = fastread.read_verify_many
    if many is not None and all(t.expect is not None for t in tasks):
        statuses = many([(fd, t.loc.offset, [t.header, *t.payload, t.tail], t.expect) for t in tasks])
        for t, status in zip(tasks, statuses):
            t.ok = status != fastread.SHORT
            t.verified = status == fastread.VERIFIED
        return
    read = fastread.read_and_hash
    for t in tasks:
        try:
            got, t.digest = read(fd, t.loc.offset, [t.header, *t.payload, t.tail])
        except OSError:
            continue
        t.ok = got == t.loc.length
        if t.ok and then is not None:
            then(t)


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


def _spans(locs: list[Location]) -> list[tuple[int, int, int, int, int]]:
    """``(segment, start, end, a, b)`` of the runs of nearby records among ``locs`` (file
    order): bytes ``[start, end)`` of the segment hold ``locs[a:b]``."""
    spans: list[tuple[int, int, int, int, int]] = []
    for p, loc in enumerate(locs):
        if spans and spans[-1][0] == loc.segment and 0 <= loc.offset - spans[-1][2] <= _MERGE_GAP:
            seg, start, end, a, _ = spans[-1]
            spans[-1] = (seg, start, max(end, loc.end), a, p + 1)
        else:
            spans.append((loc.segment, loc.offset, loc.end, p, p + 1))
    return spans


def _offset(t: ReadTask) -> int:
    return t.loc.offset


def _extents(tasks: list[ReadTask]) -> list[list[ReadTask]]:
    """Tasks grouped into runs of nearby records of one segment, in file order."""
    out: list[list[ReadTask]] = []
    for t in sorted(tasks, key=lambda t: (t.loc.segment, t.loc.offset)):
        if out:
            last = out[-1]
            head, prev = last[0].loc, last[-1].loc
            if (prev.segment == t.loc.segment and 0 <= t.loc.offset - prev.end <= _MERGE_GAP
                    and t.loc.end - head.offset <= _MAX_EXTENT):
                last.append(t)
                continue
        out.append([t])
    return out
