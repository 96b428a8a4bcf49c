"""The threads and buffers of an encrypted level: (de)cryption spread over a pool and the
calling thread, and per-thread arenas that envelopes are sealed and read into.

The bulk AES-GCM releases the GIL where storage/encrypted/gcm.py chose libcrypto (ctypes; a
system OpenSSL not older than ``cryptography``'s; ``cryptography`` 50's AESGCM, chosen
elsewhere, holds it), so the envelopes of one call are sealed and opened on several threads; the arenas are reused from call to call (up to the chunk bound:
a larger call gets buffers of its own), so a hot read allocates nothing.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

__all__ = ["CHUNK_BYTES", "Workers", "drain", "wait_all"]

T = TypeVar("T")
J = TypeVar("J")

#: Envelopes read per backend call (and the bound of a kept per-thread arena): reads are
#: pipelined chunk by chunk, so a chunk is small enough to overlap with the next one.
CHUNK_BYTES = 8 << 20
#: Below this many bytes in a call, (de)crypt on the calling thread only.
_PARALLEL_MIN_BYTES = 1 << 20


class Workers:
    """``threads`` (de)crypting threads, the calling thread one of them (None: up to 8,
    one per CPU), and each thread's arenas."""

    def __init__(self, threads: int | None) -> None:
        self.threads = threads or max(1, min(8, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()

    def parallel(self, fn: Callable[[J], T], jobs: Sequence[J], nbytes: int) -> list[T]:
        """``[fn(job) for job in jobs]``, spread over the pool and the calling thread when
        the work is large enough to gain from it."""
        if self.threads == 1 or len(jobs) < 2 or nbytes < _PARALLEL_MIN_BYTES:
            return [fn(j) for j in jobs]
        pool = self.pool()
        out: list[Any] = [None] * len(jobs)
        todo = deque(range(len(jobs)))  # taken one by one (popleft is atomic): a thread slowed
                                        # by the machine's other work takes fewer, none waits idle

        def run() -> None:
            while True:
                try:
                    i = todo.popleft()
                except IndexError:
                    return
                out[i] = fn(jobs[i])

        futures = [pool.submit(run) for _ in range(1, min(self.threads, len(jobs)))]
        try:
            run()
        except BaseException:
            todo.clear()  # (the others stop after the job they are in)
            raise
        finally:
            wait_all(futures)
        return out

    def stream(self, fn: Callable[[J], T], batches: Iterator[Sequence[J]], nbytes: int) -> list[T]:
        """``fn`` of every job of every batch, in order, as the batches come: the pool
        starts on the first batch while this thread makes the next ones (``batches`` runs
        on this thread), then this thread takes jobs too (all on this thread when the
        work, about ``nbytes``, is too small to gain from it). An exception (of ``fn`` or
        of ``batches``) is raised once every job already started has finished."""
        if self.threads == 1 or nbytes < _PARALLEL_MIN_BYTES:
            return [fn(j) for batch in batches for j in batch]
        jobs: list[J] = []
        out: list[Any] = []
        todo: deque[int] = deque()
        cond = threading.Condition()
        done = False

        def run(wait: bool) -> None:
            while True:
                with cond:
                    while not todo and wait and not done:
                        cond.wait()
                    if not todo:
                        return
                    i = todo.popleft()
                out[i] = fn(jobs[i])

        pool = self.pool()
        futures = [pool.submit(run, True) for _ in range(self.threads - 1)]
        try:
            for batch in batches:
                with cond:
                    start = len(jobs)
                    jobs.extend(batch)
                    out.extend([None] * len(batch))
                    todo.extend(range(start, len(jobs)))
                    cond.notify_all()
            with cond:
                done = True
                cond.notify_all()
            run(False)
        except BaseException:
            with cond:
                done = True
                todo.clear()  # (the others stop after the job they are in)
                cond.notify_all()
            drain(futures)
            raise
        wait_all(futures)
        return out

    def submit(self, fn: Callable[[J], T], jobs: Sequence[J]) -> list[Future[list[T]]]:
        """``fn`` over ``jobs`` on the pool only (the calling thread goes on reading):
        futures of interleaved groups, one per pool thread."""
        if not jobs:
            return []
        if self.threads == 1:
            f: Future[list[T]] = Future()
            f.set_result([fn(j) for j in jobs])
            return [f]
        pool = self.pool()
        groups = min(self.threads - 1, len(jobs))
        return [pool.submit(lambda g=g: [fn(jobs[i]) for i in range(g, len(jobs), groups)]) for g in range(groups)]

    @staticmethod
    def gather(futures: list[Future[list[T]]]) -> list[T]:
        out: list[T] = []
        for f in futures:
            out += f.result()
        return out

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="tiered_kv.crypto")
            return self._pool

    def arena(self, name: str, nbytes: int) -> np.ndarray:
        """A per-thread reusable buffer of at least ``nbytes`` (grown as needed, kept
        while at most the chunk bound; a larger one is allocated for this call only)."""
        buf = getattr(self._local, name, None)
        if buf is not None and buf.nbytes >= nbytes:
            return buf
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        if nbytes <= CHUNK_BYTES:
            setattr(self._local, name, buf)
        return buf

    @staticmethod
    def chunks(sizes: list[int]) -> Iterator[list[int]]:
        """Indices of ``sizes`` in runs whose total stays within the chunk bound."""
        run: list[int] = []
        total = 0
        for i, n in enumerate(sizes):
            if run and total + n > CHUNK_BYTES:
                yield run
                run, total = [], 0
            run.append(i)
            total += n
        if run:
            yield run

    def close(self) -> None:
        """Stop the pool (waiting for its work)."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def drain(futures: Sequence[Future[Any]]) -> None:
    """Wait for every future, their exceptions dropped (one is being raised already)."""
    for f in futures:
        try:
            f.result()
        except BaseException:  # noqa: BLE001,S110
            pass


def wait_all(futures: Sequence[Future[Any]]) -> None:
    """Wait for every future, then raise the first exception among them (if any)."""
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001  (re-raised below, after the others finished)
            first = first or e
    if first is not None:
        raise first
