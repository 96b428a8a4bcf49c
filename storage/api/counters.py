"""Counters of one object in this process: named integers that several threads add to.

One type for every such set: a store's (:class:`StoreStats`), an
encrypted level's, the vLLM tier's Prometheus series and the SGLang backend's page
counters::

    c = Counters(("hits", "misses"))      # a fixed set, listed in this order
    c.add(hits=3, misses=1)
    c.as_dict()                           # {"hits": 3, "misses": 1}

    series = Counters()                   # any key, e.g. (metric name, label values)
    series.add_to(("vllm:..._job_errors", ("full",)))
    series.take()                         # what was added since the last take, then reset

A store that persists its counters across processes takes what changed since it last
did with :meth:`take_deltas` (and gives it back with :meth:`restore_deltas` when the
write failed).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

__all__ = ["Counters", "StoreStats"]


class Counters:
    """Integer counters, safe to add to from several threads.

    ``names``: the counters, each 0 until added to, listed in this order; adding to
    another name is a ``KeyError``. None: any hashable key, which exists once a non-zero
    count was added to it (so :meth:`take` returns only what moved).
    """

    def __init__(self, names: Sequence[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._names = None if names is None else tuple(names)
        self._values: dict[Hashable, int] = {} if names is None else dict.fromkeys(names, 0)
        self._flushed: dict[Hashable, int] = {}

    def add(self, **counts: int) -> None:
        """Add ``counts`` (name=n) to the named counters."""
        with self._lock:
            for name, n in counts.items():
                self._add(name, n)

    def add_to(self, key: Hashable, n: int = 1) -> None:
        """Add ``n`` to the counter ``key`` (e.g. a ``(name, labels)`` pair)."""
        with self._lock:
            self._add(key, n)

    def _add(self, key: Hashable, n: int) -> None:
        if key in self._values:
            self._values[key] += n
        elif self._names is not None:
            raise KeyError(f"{key!r}: not a counter here; expected one of {list(self._names)}")
        elif n:
            self._values[key] = n

    def as_dict(self) -> dict[Hashable, int]:
        """Every counter's value now."""
        with self._lock:
            return dict(self._values)

    def take(self) -> dict[Hashable, int]:
        """Every counter's value now, then all back to 0 (an open set: emptied)."""
        with self._lock:
            values = self._values
            self._values = {} if self._names is None else dict.fromkeys(self._names, 0)
            self._flushed = {}
            return values

    def take_deltas(self) -> dict[Hashable, int]:
        """What each counter gained since the last call (the counters keep their values)."""
        with self._lock:
            now = dict(self._values)
            delta = {k: v - self._flushed.get(k, 0) for k, v in now.items()}
            self._flushed = now
            return delta

    def restore_deltas(self, delta: dict[Hashable, int]) -> None:
        """Undo :meth:`take_deltas` (the write that would have persisted ``delta`` failed)."""
        with self._lock:
            for k, v in delta.items():
                self._flushed[k] = self._flushed.get(k, 0) - v


class StoreStats(Counters):
    """Counters of one open store object (this process, since it was opened)::

        hits       reads that returned the record
        misses     every read that returned None, corrupt ones included
        corrupt    records that failed a check and were removed
        evictions  records evicted (by a put or gc)
        puts       records written (put_many results that were True)
        put_bytes  record bytes written
    """

    #: the counters, in the order a store persists them
    NAMES = ("hits", "misses", "corrupt", "evictions", "puts", "put_bytes")

    def __init__(self) -> None:
        super().__init__(self.NAMES)
