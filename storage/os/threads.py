"""Thread pools whose threads are started ahead of their first use; the CPUs this process may use.

A ``ThreadPoolExecutor`` starts a thread per ``submit`` until it has ``max_workers``:
on a cold ``open()`` that puts thread creation (about 1 ms each on a busy 2-core
machine, and each new thread then takes the GIL) between the first disk reads, when the
disk's queue should fill at once. :func:`started_pool` asks for every thread when the pool
is made (the store's or the disk tier's construction) and does not wait for them: they
start while the caller goes on.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["started_pool", "usable_cpus"]

#: How long a starting thread waits for its siblings (only a pool shut down at once, or
#: a machine stalled for this long, gets there; the pool then starts the rest on demand).
_START_TIMEOUT_S = 10.0


def started_pool(workers: int, prefix: str) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``prefix``, all of them asked
    for now: ``workers`` jobs that each wait until all have begun, so that no thread is
    idle when the next is asked for and the pool makes every one."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
    if workers > 1:
        barrier = threading.Barrier(workers)

        def meet() -> None:
            try:
                barrier.wait(_START_TIMEOUT_S)
            except threading.BrokenBarrierError:
                pass  # (a late start only costs the first call the time to make its threads)

        for _ in range(workers):
            pool.submit(meet)
    return pool


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; the CPU count where the
    platform has none): more threads copying or hashing at once only take turns."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
