"""Sequential read-ahead of the segment files: the disk kept busy between calls.

A cold ``get_many`` is one call among many: a restore reads a prompt's blocks batch after
batch, and they lie one after another in the segment they were written to. Read call by
call, the disk idles while each call looks its keys up and prepares its records, and it
gets at most one batch of requests at a time (the swing of bench/disk.py's cold rounds:
see docs/disk-reads.md). Like the kernel's own read-ahead of a file read in order, a
:class:`ReadAhead` notices reads that continue where the last read of their segment
ended and asks the disk for the bytes that follow (``POSIX_FADV_WILLNEED``: the kernel
reads them into the page cache asynchronously, in requests as large as the device
takes), so that the next call finds its records in the page cache, already read or on
their way (a buffered read of a page under I/O waits for it), and reads them on its hot
path.

Only a read that continues a stream asks ahead: random reads never do, and a stream
asks at most :data:`AHEAD_MAX` bytes past the end of what it read. It is a hint: the
page cache stays coherent (the records read from it are verified like any other) and a
failed ``fadvise`` changes nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from .open_files import OpenSegments
from .read_tasks import MERGE_GAP

__all__ = ["AHEAD_MAX", "AHEAD_MIN", "ReadAhead"]

#: A stream asks for at least this much past what it read (one request of the device's
#: largest size: max_sectors_kb is 4 MiB on most block devices)...
AHEAD_MIN = 4 << 20
#: ...at most this much (two or three batches of 16 Flash blocks).
AHEAD_MAX = 16 << 20
#: Asked per fadvise call (the kernel reads at most its read-ahead window per call).
_PIECE = 4 << 20
#: Streams remembered (segments read in order at once).
_STREAMS = 8


class _Stream:
    __slots__ = ("asked", "end")

    def __init__(self, end: int) -> None:
        self.end = end      # where the last read of the segment ended
        self.asked = end    # how far the disk was asked for


class ReadAhead:
    """Streams of reads in segment order, and what was asked of the disk for each.

    :meth:`note` is told, after each read call, the span of each segment it read
    (``(segment, first byte, end)``) and whether any of it came from the disk; a span
    that starts where its segment's last read ended (within ``MERGE_GAP``), or inside what
    was already asked for, continues that segment's stream, and the stream is kept about
    twice the span ahead (between :data:`AHEAD_MIN` and :data:`AHEAD_MAX`)."""

    def __init__(self, files: OpenSegments) -> None:
        self._files = files
        self._lock = threading.Lock()
        self._streams: OrderedDict[int, _Stream] = OrderedDict()
        #: fadvise calls made and bytes asked for (what the bench traces)
        self.calls = 0
        self.asked_bytes = 0
        self.seconds = 0.0
        self._thread: ThreadPoolExecutor | None = None  # made at the first ask
        self._closed = False

    def note(self, spans: Iterable[tuple[int, int, int, int]], cold: bool) -> None:
        """Segments' spans just read, ``(segment, first byte, end, bytes of records read
        there)``; ``cold``: some of it was read from the disk. A stream starts at a cold
        read whose records fill most of their span (a run read in order, not a few
        records scattered over the segment); a cached read may keep a stream going."""
        asks: list[tuple[int, int, int]] = []
        with self._lock:
            for seg, first, end, nbytes in spans:
                st = self._streams.get(seg)
                if st is None or not (st.end - MERGE_GAP <= first <= max(st.end, st.asked) + MERGE_GAP):
                    if not cold or 4 * nbytes < 3 * (end - first) or end - first < AHEAD_MIN // 4:
                        continue
                    st = self._streams[seg] = _Stream(end)  # a run read cold: the next bytes, too
                    while len(self._streams) > _STREAMS:
                        self._streams.popitem(last=False)
                self._streams.move_to_end(seg)
                st.end = max(st.end, end)
                want = st.end + min(AHEAD_MAX, max(AHEAD_MIN, 2 * (end - first)))
                if want - st.asked >= AHEAD_MIN or st.asked < st.end:
                    start = max(st.asked, st.end)
                    asks.append((seg, start, want))
                    st.asked = want
        for seg, start, want in asks:
            self._ask(seg, start, want)

    def _ask(self, seg: int, start: int, end: int) -> None:
        """``POSIX_FADV_WILLNEED`` for ``[start, end)`` of ``seg``, in pieces, on the
        read-ahead's own thread: the kernel allocates the pages and submits the reads there
        (about 1 ms per 4 MiB on this machine, not the caller's time), one stream's asks
        in order."""
        def ask() -> None:
            t = time.perf_counter()
            try:
                with self._files.use(seg, direct=False) as fd:
                    for at in range(start, end, _PIECE):
                        os.posix_fadvise(fd, at, min(_PIECE, end - at), os.POSIX_FADV_WILLNEED)
                        self.calls += 1
                        self.asked_bytes += min(_PIECE, end - at)
            except OSError:
                pass  # a hint only (the segment is gone, or no descriptor to spare)
            self.seconds += time.perf_counter() - t

        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="tkv-ahead")
            self._thread.submit(ask)

    def close(self) -> None:
        """Wait for the asks in flight; no more are made."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)

    def covers(self, seg: int, first: int, end: int) -> bool:
        """Whether ``[first, end)`` of segment ``seg`` lies within what a stream asked the
        disk for: its pages are in the page cache or on their way (read it buffered; a
        direct read would only read the same bytes again)."""
        st = self._streams.get(seg)
        return st is not None and st.end - MERGE_GAP <= first and end <= st.asked

    @property
    def active(self) -> bool:
        """Whether any stream is being followed (else a hot read has nothing to tell)."""
        return bool(self._streams)

    def forget(self) -> None:
        with self._lock:
            self._streams.clear()
