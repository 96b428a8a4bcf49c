"""How the read engine (:mod:`.reads`) reads one group of records: one small object each.

Each strategy reads a group the engine chose for it (records the page cache holds, a run
of records it does not, a batch of rows) and reports per record, on the task (``ok``,
``digest``, ``verified``; ``then(task)`` for a record it read without checking) or in a
status array. A record it cannot read (EIO, a segment gc unlinked, no descriptor to
spare) is a miss, never an exception; ``O_DIRECT`` refused by the filesystem raises
:class:`~.open_files.DirectUnsupported` before anything is read, so the caller can read
the same records another way.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from ..format.rows import RowScatter
from ..os import fastread
from ..os.libc import align_down, align_up
from ..os.preadv import preadv_all
from .open_files import DirectUnsupported
from .read_tasks import MAX_EXTENT, MIN_SHARD, Engine, ReadTask, apply_statuses, drain, extents, run_jobs
from .schema import Location

__all__ = ["ColdExtent", "PageCacheHashed", "PageCacheVerified", "RowsDirect", "RowsPageCache"]

Then = Callable[[ReadTask], None] | None

#: Read-ahead asked of the kernel per POSIX_FADV_WILLNEED call (it reads at most its window per call).
_WILLNEED_BYTES = 4 << 20
#: Row reads are handed to their threads in runs of records of about this many bytes...
_ROWS_CHUNK = 2 << 20


class PageCacheVerified:
    """Records the page cache holds, each with an ``expect``: read and checked in one native
    ``read_verify_many`` call for the whole group, the GIL released once; a group of at
    least two shards' bytes is spread over the engine's hot threads, which the call starts
    itself, each taking the next record as it finishes one. Segments are taken at most
    ``max_open_segments`` at a time (the fd bound)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def read(self, tasks: list[ReadTask]) -> None:
        many = fastread.read_verify_many
        assert many is not None
        files = self.engine.files
        segs = list(dict.fromkeys(t.loc.segment for t in tasks))  # (file order: grouped by segment)
        limit = max(1, files.limit)
        for a in range(0, len(segs), limit):
            with files.use_many(segs[a:a + limit]) as fds:
                group = [t for t in tasks if t.loc.segment in fds] if len(segs) > 1 else (tasks if fds else [])
                if not group:
                    continue
                total = sum(t.loc.length for t in group)
                n_threads = self.engine.hot_threads if total >= 2 * MIN_SHARD else 1
                statuses = many([(fds[t.loc.segment], t.loc.offset, [t.header, *t.payload, t.tail], t.expect)
                                 for t in group], n_threads)
            apply_statuses(group, statuses)


class PageCacheHashed:
    """Records the page cache holds (file order), segment by segment: each one read and
    hashed by one ``read_and_hash`` (sets ``ok`` and ``digest``), then ``then(task)``; or,
    natively when every task of a segment has ``expect``, read and checked in one
    ``read_verify_many`` call (sets ``ok`` and ``verified``; ``then`` is not called)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def read(self, tasks: list[ReadTask], then: Then) -> None:
        i = 0
        while i < len(tasks):
            seg = tasks[i].loc.segment
            j = i + 1
            while j < len(tasks) and tasks[j].loc.segment == seg:
                j += 1
            group, i = tasks[i:j], j
            try:
                with self.engine.files.use(seg, direct=False) as fd:
                    self.read_open(fd, group, then)
            except OSError:
                continue

    @staticmethod
    def read_open(fd: int, tasks: list[ReadTask], then: Then) -> None:
        """:meth:`read` of tasks of the segment open as ``fd``."""
        many = fastread.read_verify_many
        if many is not None and all(t.expect is not None for t in tasks):
            apply_statuses(tasks, many([(fd, t.loc.offset, [t.header, *t.payload, t.tail], t.expect) for t in tasks]))
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


class ColdExtent:
    """A run of records the page cache does not hold.

    By default read through the page cache (:class:`PageCacheHashed`): the first buffered
    read of a run starts the kernel's read-ahead of the file, which then keeps ahead of the
    reads of the next calls as well (it follows the sequential reads of a restore across
    ``get_many`` calls) and reads in large folios, so the device gets requests of several
    MiB. A block device takes at most ``max_segments`` pieces of memory per request (254 on
    virtio-blk here); the pages ``POSIX_FADV_WILLNEED`` allocates are single 4 KiB pages,
    so asking ahead with it cuts the reads into requests of at most ~1 MiB, and so do
    ``O_DIRECT`` transfers into buffers of scattered pages: the rounds of small requests
    were the slow rounds of bench/disk.py's cold reads (docs/disk-reads.md).

    Where the store was opened with ``direct_io=True``: one ``O_DIRECT`` transfer into the
    thread's bounce buffer (the page cache is not filled), each record then checked and
    copied into its parts natively (``verify_copy_many``), or, without the native helper,
    copied and hashed there."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def read(self, ext: list[ReadTask], then: Then) -> None:
        engine = self.engine
        first, end = ext[0].loc.offset, ext[-1].loc.end
        if engine.cold_direct and engine.direct_io is not False:
            try:
                self._read_direct(ext, first, end, then)
                engine.paths["direct"] += len(ext)
                return
            except DirectUnsupported:
                engine.direct_io = False
            except OSError:
                # EIO, the segment was unlinked by gc (only records no longer indexed lived
                # there), or no descriptor to spare (EMFILE): what was not read is a miss
                return
        engine.paths["buffered"] += len(ext)
        engine.read_hashed(ext, then)

    def _read_direct(self, ext: list[ReadTask], first: int, end: int, then: Then) -> None:
        lo, hi = align_down(first), align_up(end)
        buf = self.engine.bounce(hi - lo)
        with self.engine.files.use(ext[0].loc.segment, direct=True) as fd:
            got = preadv_all(fd, [buf[:hi - lo]], lo)
        copy = fastread.verify_copy_many
        if copy is not None and all(t.expect is not None for t in ext):  # checked and copied natively
            apply_statuses(ext, copy(buf[:got], [(t.loc.offset - lo, [t.header, *t.payload, t.tail], t.expect)
                                                 for t in ext]))
            return
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


class RowsPageCache:
    """A batch of rows read through the page cache: the records, in file order, cut into
    chunks of about ``_ROWS_CHUNK`` bytes that the engine's hot threads (the calling
    thread one of them) take in turn, each chunk one native ``read_verify_rows`` call with
    the GIL released. Runs the page cache does not hold are asked of the disk first
    (``POSIX_FADV_WILLNEED``, on a thread of their own, in file order, in pieces the kernel
    takes whole), so that the readers start on the first run meanwhile."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def read(self, order: list[int], locs: Sequence[Location], fds: dict[int, int],
             cold: list[tuple[int, int, int, int, int]], rows: RowScatter, expects: np.ndarray,
             status: np.ndarray) -> None:
        """Records ``order`` (indices into ``locs``, in file order) into ``rows``; their
        statuses into ``status``; ``cold``: the runs (segment, start, end, ...) to ask the
        disk for."""
        read = fastread.read_verify_rows
        assert read is not None
        where = np.array([(fds[locs[i].segment], locs[i].offset) for i in order], np.int64)
        idx = np.array(order, np.int64)
        per = max(1, _ROWS_CHUNK // max(1, locs[order[0]].length))
        chunks = deque((a, min(a + per, len(idx))) for a in range(0, len(idx), per))

        def chunk(span: tuple[int, int]) -> None:
            a, b = span
            mine = idx[a:b]
            got = read(rows.dests, rows.dest_of, rows.lengths, np.ascontiguousarray(rows.offsets[mine]),
                       where[a:b], np.ascontiguousarray(expects[mine]))
            status[mine] = np.frombuffer(got, np.uint8)

        def work() -> None:
            drain(chunks, chunk)

        ask = [lambda: self._ask_disk(cold, fds)] if cold else []
        run_jobs([work, *ask, *[work] * (min(self.engine.hot_threads, len(chunks)) - 1)], self.engine.pool())

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


class RowsDirect:
    """Rows of records the page cache does not hold: runs of nearby records (file order,
    up to ``MAX_EXTENT`` bytes) read with ``O_DIRECT`` into each thread's bounce buffer by
    the engine's I/O threads at once (the disk's queue stays full, the page cache is not
    filled), each record then verified and copied into its pieces natively
    (``verify_rows``)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def read(self, locs: list[Location], idx: np.ndarray, rows: RowScatter, expects: np.ndarray,
             status: np.ndarray) -> None:
        """``locs[p]`` is record ``idx[p]``'s; statuses go to ``status[idx[p]]``."""
        verify = fastread.verify_rows
        assert verify is not None
        runs = deque(extents(locs, MAX_EXTENT))

        def extent(span: tuple[int, int]) -> None:
            a, b = span
            first, end = locs[a].offset, locs[b - 1].end
            lo, hi = align_down(first), align_up(end)
            buf = self.engine.bounce(hi - lo)
            with self.engine.files.use(locs[a].segment, direct=True) as fd:
                got = preadv_all(fd, [buf[:hi - lo]], lo)
            mine = idx[a:b]
            at = np.array([loc.offset - lo for loc in locs[a:b]], np.int64)
            status[mine] = np.frombuffer(verify(buf[:got], at, rows.dests, rows.dest_of, rows.lengths,
                                                np.ascontiguousarray(rows.offsets[mine]),
                                                np.ascontiguousarray(expects[mine])), np.uint8)

        def work() -> None:
            drain(runs, extent)

        run_jobs([work] * max(1, min(self.engine.io_threads, len(runs))), self.engine.pool())
