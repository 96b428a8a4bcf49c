"""The read engine of the segment files: which records are read how, and on which threads.

A read is a list of :class:`ReadTask` (one record each: its location, where its header,
payload pieces and checksum go, and, for a native check, what it must hold) or a batch
of rows (:meth:`ReadEngine.read_rows`: payloads straight into a
:class:`~tiered_kv.storage.format.rows.RowScatter`). The engine sorts them by where they
lie, asks the page cache which runs of records it holds (``cachestat``), and hands each
group to a strategy (:mod:`.read_strategies`, one small object each)::

    records the page cache holds      PageCacheVerified   one native call, its own threads
                                      PageCacheHashed     preadv + xxh3 per record (Python path)
    runs of records it does not hold  ColdExtent          buffered, read ahead by the kernel
                                                          (large requests, across calls), or
                                                          O_DIRECT into a bounce buffer, checked
                                                          and copied natively (direct_io=True,
                                                          or a small kernel read-ahead window)
    rows the page cache holds         RowsPageCache       native read_verify_rows, in chunks
    rows it does not hold             RowsDirect          O_DIRECT extents, native verify_rows
    records handed over one by one    BatchRead           native VerifyBatch: helper threads
                                                          read while the caller prepares

Three things are written once (:mod:`.read_tasks`): which records form a run
(``extents``), how a native verdict maps onto a task (``apply_statuses``), and how threads
share the work (``drain`` over a queue, ``run_jobs`` on the caller and the I/O pool).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import numpy as np

from ..format.rows import RowScatter
from ..os import fastread, libc
from ..os import threads as os_threads
from ..os.libc import ALIGN, aligned_buffer
from .open_files import DirectUnsupported, OpenFd, OpenSegments
from .read_strategies import ColdExtent, PageCacheHashed, PageCacheVerified, RowsDirect, RowsPageCache
from .read_tasks import MAX_EXTENT, MIN_SHARD, ReadTask, apply_statuses, cut_shards, drain, extents, run_jobs
from .schema import Location

__all__ = ["KERNEL_READ_AHEAD_MIN", "BatchRead", "ReadEngine", "ReadTask"]

#: How often a reader closes its cached fds of segments that gc (of any process) unlinked.
_SWEEP_S = 10.0
#: Cold runs are read through the page cache where the kernel reads ahead at least this
#: much (``read_ahead_kb``; twice it with POSIX_FADV_SEQUENTIAL): then its read-ahead keeps
#: the device busy across calls with large requests. With the usual 128 KiB window they are
#: read with O_DIRECT, 1 MiB extents several at once.
KERNEL_READ_AHEAD_MIN = 2 << 20


def _reads_ahead(folder: Path) -> bool:
    while not folder.exists() and folder.parent != folder:  # (a store being made: its filesystem)
        folder = folder.parent
    got = libc.read_ahead_bytes(folder)
    return got is not None and got >= KERNEL_READ_AHEAD_MIN


# ------------------------------------------------------------------ the engine
class ReadEngine:
    """Reads the records of one store's segment files (see the module docstring).

    ``files``: the read descriptors; ``io_threads``: transfers of one call in flight;
    ``direct_io``: True / False, or None to use ``O_DIRECT`` where the filesystem accepts
    it (a refusal turns it off); ``pool()``: the store's I/O thread pool.
    """

    def __init__(self, files: OpenSegments, *, io_threads: int, direct_io: bool | None,
                 pool: Callable[[], ThreadPoolExecutor]) -> None:
        self.files = files
        self.io_threads = io_threads
        self.direct_io = direct_io
        self.pool = pool
        self._swept = time.monotonic()
        self._local = threading.local()  # each thread's bounce buffer
        self.verified = PageCacheVerified(self)
        self.hashed = PageCacheHashed(self)
        self.cold = ColdExtent(self)
        self.rows = RowsPageCache(self)
        self.rows_direct = RowsDirect(self)
        #: cold runs read with O_DIRECT: where ``direct_io=True`` was asked for, or (None)
        #: where the kernel reads ahead less than :data:`KERNEL_READ_AHEAD_MIN`; else
        #: through the page cache, read ahead by the kernel (see :class:`ColdExtent`)
        self.cold_direct = direct_io is True or (direct_io is None and not _reads_ahead(files.folder))
        #: records read per path since the engine was made (what bench/disk.py traces):
        #: ``hot`` from the page cache, ``direct`` with O_DIRECT, ``buffered`` cold but buffered
        self.paths = {"hot": 0, "direct": 0, "buffered": 0}

    @property
    def hot_threads(self) -> int:
        """Threads that copy and check records the page cache holds: the I/O threads,
        at most one per CPU this process may run on (more only take turns)."""
        return max(1, min(self.io_threads, os_threads.usable_cpus()))

    def _sweep(self) -> None:
        if time.monotonic() - self._swept > _SWEEP_S:
            self._swept = time.monotonic()
            self.files.forget_removed()

    def release_buffers(self) -> None:
        """Drop every thread's bounce buffer (at least ``MAX_EXTENT``, 1 MiB, each):
        the store closed. A thread-local buffer otherwise lives as long as this engine,
        which a closed store's owner may keep referenced. A read still in flight keeps the
        buffer it holds until it returns."""
        self._local = threading.local()

    def bounce(self, nbytes: int) -> np.ndarray:
        """This thread's page-aligned bounce buffer for ``O_DIRECT``, at least ``nbytes``."""
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._local.bounce = aligned_buffer(max(nbytes, MAX_EXTENT + 2 * ALIGN))
        return buf

    def read_hashed(self, tasks: list[ReadTask], then: Callable[[ReadTask], None] | None) -> None:
        self.hashed.read(tasks, then)

    def cached(self, fd: int, offset: int, length: int) -> bool:
        """Whether the page cache holds (at least 3/4 of) the range: then a buffered read
        beats O_DIRECT. Unknown (no cachestat): True, read buffered."""
        got = libc.cached_pages(fd, offset, length)
        return got is None or 4 * got[0] >= 3 * got[1]

    def holds(self, loc: Location) -> bool:
        """Whether ``loc`` lies within its segment file as it is now (False: the file is
        gone, or an index entry claims bytes past its end, e.g. an absurd length)."""
        if loc.offset < 0 or loc.length < 0:
            return False
        try:
            with self.files.use(loc.segment, direct=False) as fd:
                return loc.end <= os.fstat(fd).st_size
        except OSError:
            return False

    # ------------------------------------------------------------------ records
    def read(self, tasks: list[ReadTask], then: Callable[[ReadTask], None] | None = None) -> None:
        """Read every task's record parts (sets ``task.ok``), then call ``then(task)`` on
        each one read (in the reading thread, while its bytes are in the CPU cache).

        Records the page cache holds are read one ``preadv`` each (header, the caller's
        buffers, checksum: a memory copy, hashed in the same call) in shards of about equal
        bytes, drained by :attr:`hot_threads` threads, the calling thread one of them: the
        copies and the hashing release the GIL, so they run in parallel; natively, when
        every task has ``expect``, in one call for them all. Cold extents are read on the
        I/O threads meanwhile."""
        self._sweep()
        hot, cold = self._hot_and_cold(tasks)
        self.paths["hot"] += len(hot)
        jobs: list[Callable[[], None]] = [functools.partial(self.cold.read, ext, then) for ext in cold]
        if hot and fastread.read_verify_many is not None and all(t.expect is not None for t in hot):
            jobs.insert(0, functools.partial(self.verified.read, hot))  # one native call: threads of its own
        elif shards := deque(cut_shards(hot, self.hot_threads)):
            work = functools.partial(drain, shards, lambda shard: self.hashed.read(shard, then))
            jobs = [work] * min(self.hot_threads, len(shards)) + jobs
        run_jobs(jobs, self.pool() if len(jobs) > 1 and self.io_threads > 1 else None)

    def batch_read(self, capacity: int, nbytes: int, then: Callable[[ReadTask], None] | None = None) -> BatchRead:
        """A read of up to ``capacity`` tasks (about ``nbytes`` of payload) handed over one
        at a time (:meth:`BatchRead.add`), then :meth:`BatchRead.finish`: the same
        results as :meth:`read` of them all. Natively, a task with ``expect`` whose record
        the page cache holds is read and checked by helper threads as soon as it is added
        (see :class:`BatchRead`)."""
        self._sweep()
        return BatchRead(self, capacity, self.hot_threads if nbytes >= 2 * MIN_SHARD else 1, then)

    def _hot_and_cold(self, tasks: list[ReadTask]) -> tuple[list[ReadTask], list[list[ReadTask]]]:
        """The records of ``tasks`` the page cache holds (file order), and the extents
        (:func:`extents`) it does not. One ``cachestat`` per segment when all of the span
        read there is cached (the common hot case: then no extents are formed), else one
        per extent. Records of a segment that is gone are left out (misses)."""
        by_seg: dict[int, list[ReadTask]] = {}
        for t in tasks:
            by_seg.setdefault(t.loc.segment, []).append(t)
        hot: list[ReadTask] = []
        cold: list[list[ReadTask]] = []
        for seg in sorted(by_seg):
            group = by_seg[seg]
            group.sort(key=_offset)
            try:
                with self.files.use(seg, direct=False) as fd:
                    first, end = group[0].loc.offset, group[-1].loc.end
                    whole = libc.cached_pages(fd, first, end - first)
                    if whole is None or whole[0] >= whole[1]:  # (unknown: read buffered)
                        hot.extend(group)
                        continue
                    for a, b in extents([t.loc for t in group]):
                        ext = group[a:b]
                        if self.cached(fd, ext[0].loc.offset, ext[-1].loc.end - ext[0].loc.offset):
                            hot.extend(ext)
                        else:
                            cold.append(ext)
            except OSError:
                continue  # reclaimed by gc (or unreadable): every record of it is a miss
        return hot, cold

    # ------------------------------------------------------------------ rows
    def read_rows(self, locs: Sequence[Location], rows: RowScatter, expects: np.ndarray) -> np.ndarray:
        """Read and verify record k at ``locs[k]`` into the pieces ``rows`` gives record k,
        natively (:data:`~tiered_kv.storage.os.fastread.read_verify_rows`; only where it is
        bound); ``expects``: ``[n, E] uint8``, each record's
        :meth:`~tiered_kv.storage.format.record.PartsVerifier.expectation`. Returns ``[n] uint8``
        statuses (VERIFIED, SHORT, FAILED); the records of a segment that is gone are SHORT.

        Run by run of nearby records (:func:`extents`), as :meth:`read` decides extent by
        extent (a few evicted pages send their run to the disk, not the whole batch): the
        runs the page cache does not hold are read with ``O_DIRECT`` by the I/O threads
        (:class:`~.read_strategies.RowsDirect`: no page cache to fill, each record checked
        in the bounce buffer and then copied once); where the filesystem refuses
        ``O_DIRECT``, the disk is first asked for every run (``POSIX_FADV_WILLNEED``) and
        the threads read as the pages arrive. The rest is cut into chunks that
        :attr:`hot_threads` threads (the calling thread one of them) take in turn
        (:class:`~.read_strategies.RowsPageCache`)."""
        assert fastread.read_verify_rows is not None, "read_rows: the native read_verify_rows is not bound"
        n = len(locs)
        status = np.full(n, fastread.SHORT, np.uint8)
        with ExitStack() as held:
            fds: dict[int, int] = {}
            for seg in sorted({loc.segment for loc in locs}):
                try:
                    fds[seg] = held.enter_context(self.files.use(seg, direct=False))
                except OSError:
                    continue  # gone (gc) or unreadable: its records stay SHORT
            order = sorted((i for i in range(n) if locs[i].segment in fds),
                           key=lambda i: (locs[i].segment, locs[i].offset))
            ordered = [locs[i] for i in order]
            spans = [(ordered[a].segment, ordered[a].offset, max(loc.end for loc in ordered[a:b]), a, b)
                     for a, b in extents(ordered, None)]
            cold = [sp for sp in spans if not self.cached(fds[sp[0]], sp[1], sp[2] - sp[1])]
            if cold and fastread.verify_rows is not None and self.direct_io is not False:
                order, cold = self._rows_direct(order, locs, cold, rows, expects, status)
            if order:
                self.rows.read(order, locs, fds, cold, rows, expects, status)
        return status

    def _rows_direct(self, order: list[int], locs: Sequence[Location], cold: list[tuple[int, int, int, int, int]],
                     rows: RowScatter, expects: np.ndarray, status: np.ndarray
                     ) -> tuple[list[int], list[tuple[int, int, int, int, int]]]:
        """The ``cold`` runs read with ``O_DIRECT``; returns what is left for the page-cache
        path: the other records, and the runs still cold (all of them when the filesystem
        refused ``O_DIRECT``: then nothing was read)."""
        direct = [p for *_, a, b in cold for p in range(a, b)]  # positions in order
        try:
            self.rows_direct.read([locs[order[p]] for p in direct], np.array([order[p] for p in direct], np.int64),
                                  rows, expects, status)
        except DirectUnsupported:
            self.direct_io = False  # nothing was read: buffered, with the others
            return order, cold
        except OSError:
            pass  # the segment is gone (gc) or unreadable: those records stay misses
        taken = set(direct)
        return [i for p, i in enumerate(order) if p not in taken], []


class BatchRead:
    """Tasks read as they are handed over (made by :meth:`ReadEngine.batch_read`).

    Natively (:data:`~tiered_kv.storage.os.fastread.VerifyBatch`), each task with ``expect``
    goes straight to a native batch whose helper threads (``threads - 1`` of them; the
    caller joins in :meth:`finish`) check that the page cache holds the record, read it and
    check it, while the caller prepares the next task: the Python work of a batch overlaps
    its reads. :meth:`finish` sets ``ok`` and ``verified`` of those, and reads the rest
    (records not all in the page cache, tasks without ``expect``, everything when the
    native helper is not in use) through :meth:`ReadEngine.read`. At most
    ``max_open_segments`` descriptors are held: a batch spanning more segments is finished
    and a new one started. A segment that cannot be opened is a miss of its records.
    """

    def __init__(self, engine: ReadEngine, capacity: int, threads: int,
                 then: Callable[[ReadTask], None] | None) -> None:
        self._engine = engine
        self._left = capacity
        self._threads = threads
        self._then = then
        self._native: Any = None          # the native batch in flight, if any
        self._sent: list[ReadTask] = []   # its tasks, in order
        self._fds: dict[int, OpenFd] = {}
        self._missing: set[int] = set()   # segments that could not be opened
        self._later: list[ReadTask] = []  # read in finish(), through ReadEngine.read

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
            files = self._engine.files
            if len(self._fds) >= files.limit:
                self._flush()
            try:
                entry = self._fds[seg] = files.acquire(seg, False)
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
                uncached = apply_statuses(self._sent, self._native.finish())
                self._engine.paths["hot"] += len(self._sent) - len(uncached)
                self._later += uncached
        finally:
            self._native, self._sent = None, []
            for entry in self._fds.values():
                self._engine.files.release(entry)
            self._fds = {}

    def finish(self) -> None:
        """Wait for every task added: read, and checked natively or by ``then``."""
        self._flush()
        if self._later:
            later, self._later = self._later, []
            self._engine.read(later, self._then)


def _offset(t: ReadTask) -> int:
    return t.loc.offset
