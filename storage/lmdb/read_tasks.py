"""What the read engine (:mod:`.reads`) and its strategies (:mod:`.read_strategies`) share:
one record to read (:class:`ReadTask`), and the three things written once: which records
form a run (:func:`extents`), how a native verdict maps onto a task
(:func:`apply_statuses`), and how threads share the work (:func:`drain` over a queue,
:func:`run_jobs` on the caller and the I/O pool)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from ..os import fastread
from .open_files import OpenSegments
from .schema import Location

__all__ = ["MAX_EXTENT", "MERGE_GAP", "MIN_SHARD", "Engine", "ReadTask", "apply_statuses", "cut_shards", "drain",
           "extents", "run_jobs"]

T = TypeVar("T")

#: Extents of one read: adjacent records closer than this are read in one transfer...
MERGE_GAP = 64 << 10
#: ...up to this many bytes (a batch of Flash blocks: several extents, read in parallel;
#: 1 MiB against 2 MiB: 1.21-1.24 against 1.07 GB/s cold for batches of 16 Flash blocks here,
#: each thread verifies one extent while the others' reads are in flight).
MAX_EXTENT = 1 << 20
#: Records the page cache holds are spread over threads in shards of at least this many bytes.
MIN_SHARD = 1 << 20


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


def extents(locs: Sequence[Location], max_bytes: int | None = MAX_EXTENT) -> list[tuple[int, int]]:
    """The runs of nearby records among ``locs`` (in file order), as ``[a, b)`` ranges of
    indices: records of one segment, each starting at most :data:`MERGE_GAP` after the
    previous one ends (never before it), the run spanning at most ``max_bytes`` (None:
    any span, e.g. to ask the page cache about it)."""
    out: list[tuple[int, int]] = []
    a = 0
    for b in range(1, len(locs) + 1):
        if b < len(locs):
            head, prev, loc = locs[a], locs[b - 1], locs[b]
            if (loc.segment == prev.segment and 0 <= loc.offset - prev.end <= MERGE_GAP
                    and (max_bytes is None or loc.end - head.offset <= max_bytes)):
                continue
        out.append((a, b))
        a = b
    return out


def apply_statuses(tasks: Sequence[ReadTask], statuses: Sequence[int]) -> list[ReadTask]:
    """Set each task's ``ok`` (read whole) and ``verified`` from its native read verdict;
    returns the tasks the read left alone (``UNCACHED``: not all in the page cache)."""
    unread = []
    for t, status in zip(tasks, statuses):
        if status == fastread.UNCACHED:
            unread.append(t)
            continue
        t.ok = status != fastread.SHORT
        t.verified = status == fastread.VERIFIED
    return unread


def drain(queue: deque[T], work: Callable[[T], None]) -> None:
    """``work`` on items taken from ``queue`` until none is left. Several threads drain one
    queue: a thread that runs late (a busy CPU) takes fewer items, and none waits for
    another, so the call is held up by one item at most, not by a fixed share."""
    while True:
        try:
            item = queue.popleft()
        except IndexError:
            return
        work(item)


def run_jobs(jobs: Sequence[Callable[[], None]], pool: ThreadPoolExecutor | None) -> None:
    """Run ``jobs``: the first on the calling thread, the others on ``pool`` meanwhile
    (None, or a single job: all on the calling thread, in order); returns once all are
    done, raising the first failure."""
    if pool is None or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    futures = [pool.submit(job) for job in jobs[1:]]
    try:
        jobs[0]()
    finally:
        for f in futures:
            f.result()


def cut_shards(tasks: list[ReadTask], threads: int) -> list[list[ReadTask]]:
    """``tasks`` in file order, cut into runs of about equal bytes: two per thread when
    there are several (one when there is one), each at least :data:`MIN_SHARD` (a smaller
    one costs more to hand to a thread than it saves)."""
    if not tasks:
        return []
    total = sum(t.loc.length for t in tasks)
    per_thread = 2 if threads > 1 else 1
    n = max(1, min(per_thread * threads, len(tasks), total // MIN_SHARD))
    if n == 1:
        return [tasks]
    shards: list[list[ReadTask]] = [[] for _ in range(n)]
    done = 0
    for t in tasks:
        shards[min(n - 1, done * n // total)].append(t)
        done += t.loc.length
    return [s for s in shards if s]



class Engine(Protocol):
    """What a strategy uses of the engine that runs it (:class:`~.reads.ReadEngine`)."""

    files: OpenSegments
    io_threads: int
    direct_io: bool | None
    #: cold runs read with O_DIRECT (``direct_io=True``), else through the page cache
    cold_direct: bool
    #: records read per path (``hot``, ``direct``, ``buffered``): a trace, not a guarantee
    paths: dict[str, int]

    @property
    def hot_threads(self) -> int: ...

    def pool(self) -> ThreadPoolExecutor: ...

    def bounce(self, nbytes: int) -> np.ndarray: ...

    def read_hashed(self, tasks: list[ReadTask], then: Callable[[ReadTask], None] | None) -> None:
        """Read ``tasks`` the page cache holds, hashing each (the buffered path)."""
