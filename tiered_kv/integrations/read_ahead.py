"""Read ahead the chunks a lookup found, while the engine schedules their load.

An engine's offloading manager asks a storage tier whether it holds a chunk (a lookup),
and loads it one scheduler step later: vLLM's tiering manager answers the lookup on a
background thread during one step, starts the promotion in the next step (a primary row
is allotted then) and submits the load job at that step's end. A tier that only starts
reading at the job leaves the disk idle for that whole step. :class:`ReadAhead` starts
the verified read when the lookup finds the chunk, into a staging row of its own; the
load job then copies the staged bytes into the row the engine allotted (a memory copy),
or reads from the store whatever was not staged::

    lookup thread:  contains_many(keys) ──> hits ──> start(hits): get_many into staging rows
    engine step:    ... promotion allotted, job submitted ...
    load job:       take(keys): staged ──> deliver(row): wait the read, copy   (one memcpy)
                               not staged ──> store.get_many straight into the rows

Staged bytes are the verified payload of a write-once record (a record key names its
content), so they stay valid for that key whatever happens to the record later. A staged
read that found no good record (absent, corrupt, foreign) is that load's miss, as the
load's own read would have been, counted once by the store; one that raised (store
down) or never started leaves the chunk to the load's own read.

Memory: at most ``capacity`` staging rows of ``chunk_bytes`` (allocated at the first
read-ahead, touched as used). When they are all taken, the oldest finished entries no
load took are dropped (counted); a lookup that still finds no room is not read ahead.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from ..storage import BlockStore, RecordKey, RecordMeta

__all__ = ["ReadAhead", "ReadAheadStats", "Staged"]

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class ReadAheadStats:
    """Chunks read ahead, delivered to a load from staging, and dropped unused (evicted
    for newer lookups, or their staged read failed)."""

    started: int = 0
    delivered: int = 0
    dropped: int = 0


@dataclass(eq=False, slots=True)
class Staged:
    """One chunk read ahead: staging row ``slot``, entry ``index`` of the batched read
    ``future`` (which returns the store's metas, one per key of the batch)."""

    slot: int
    index: int
    future: concurrent.futures.Future[list[RecordMeta | None]] = field(repr=False)


class ReadAhead(Generic[K]):
    """Verified reads of looked-up chunks into bounded staging rows (module docstring).

    ``record(key) -> (record key, token digest)``: where the engine's chunk ``key`` lies in
    ``store``. ``chunk_bytes``: every chunk's payload size; ``capacity``: staging rows
    (>= 1). Thread-safe: lookups, load jobs and :meth:`close` may run on any threads.
    """

    def __init__(self, store: BlockStore, *, chunk_bytes: int, capacity: int,
                 record: Callable[[K], tuple[RecordKey, bytes]]) -> None:
        if chunk_bytes <= 0 or capacity <= 0:
            raise ValueError(f"ReadAhead: expected chunk_bytes >= 1 and capacity >= 1, got "
                             f"{chunk_bytes} and {capacity}")
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.capacity = capacity
        self._record = record
        self._lock = threading.Lock()
        #: ``[capacity, chunk_bytes] uint8`` staging rows, allocated at the first read-ahead
        self._rows: np.ndarray | None = None
        self._free: list[int] = list(range(capacity))
        self._staged: OrderedDict[K, Staged] = OrderedDict()   # oldest first
        self._stats = ReadAheadStats()
        # One reader: the store spreads each batched read over its own I/O threads.
        self._reader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered_kv_read_ahead")
        self._closed = False

    # ------------------------------------------------------------- lookup side
    def start(self, keys: Sequence[K]) -> int:
        """Start one batched read of the ``keys`` not already staged, into free staging
        rows (dropping the oldest finished entries no load took, when needed). A key whose
        staged read found no good record is read again (it may have been stored since).
        Returns how many were started; keys that find no room are left to their load."""
        with self._lock:
            if self._closed:
                return 0
            for k in keys:   # a staged read that found no good record: read again (it may be stored now)
                if (s := self._staged.get(k)) is not None and s.future.done() and not self._verdict(s):
                    self._free.append(self._staged.pop(k).slot)
                    self._stats.dropped += 1
            todo = list(dict.fromkeys(k for k in keys if k not in self._staged))
            self._make_room(len(todo))
            todo = todo[:len(self._free)]
            if not todo:
                return 0
            if self._rows is None:
                self._rows = np.empty((self.capacity, self.chunk_bytes), np.uint8)
            slots = [self._free.pop() for _ in todo]
            future = self._reader.submit(self._read, todo, slots)
            for i, (key, slot) in enumerate(zip(todo, slots)):
                self._staged[key] = Staged(slot, i, future)
            self._stats.started += len(todo)
            return len(todo)

    def _make_room(self, want: int) -> None:
        """Drop the oldest finished, untaken entries until ``want`` rows are free (or none is
        left to drop). Under the lock."""
        if len(self._free) >= want:
            return
        for key in [k for k, s in self._staged.items() if s.future.done()]:
            self._free.append(self._staged.pop(key).slot)
            self._stats.dropped += 1
            if len(self._free) >= want:
                return

    def _read(self, keys: list[K], slots: list[int]) -> list[RecordMeta | None]:
        rows = self._rows
        assert rows is not None
        records = [self._record(k) for k in keys]
        return self.store.get_many([r for r, _ in records], [rows[s] for s in slots],
                                   token_digests=[d for _, d in records])

    # ------------------------------------------------------------- load side
    def take(self, keys: Sequence[K]) -> dict[K, Staged]:
        """The staged entries of ``keys``, now owned by the caller, who must hand each to
        :meth:`deliver` (which gives its staging row back)."""
        with self._lock:
            return {k: s for k in keys if (s := self._staged.pop(k, None)) is not None}

    def deliver(self, staged: Staged, out: np.ndarray) -> bool | None:
        """Copy ``staged``'s verified bytes into ``out`` (``[chunk_bytes] uint8``): True.
        False: its read found no good record (absent, corrupt, foreign: the load's miss,
        as a read by the load would have found). None: not read (the read raised, or had
        not started: it is cancelled, and with it the read of the other chunks of its
        lookup's batch, which their loads then read themselves); the caller reads the chunk
        itself. Waits for a read in progress. Gives the staging row back."""
        verdict = self._verdict(staged)
        rows = self._rows   # (None once closed)
        if verdict and rows is not None:
            np.copyto(out, rows[staged.slot])
        elif verdict:
            verdict = None
        self._give_back(staged, delivered=bool(verdict))
        return verdict

    def discard(self, staged: Staged) -> None:
        """Give back a taken entry without delivering it (counted as dropped)."""
        self._verdict(staged)
        self._give_back(staged, delivered=False)

    @staticmethod
    def _verdict(staged: Staged) -> bool | None:
        """Whether ``staged``'s read verified its chunk (True) or found none (False); None
        where it was not read: it raised, or had not started (cancelled here). Waits for
        a read in progress."""
        if staged.future.cancel():
            return None
        try:
            metas = staged.future.result()
        except Exception:  # a store that failed the read: the load reads the chunk itself
            return None
        return metas[staged.index] is not None

    def _give_back(self, staged: Staged, *, delivered: bool) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(staged.slot)
            if delivered:
                self._stats.delivered += 1
            else:
                self._stats.dropped += 1

    # ------------------------------------------------------------- the rest
    def stats(self) -> ReadAheadStats:
        """The counts since the last call (then reset)."""
        with self._lock:
            taken, self._stats = self._stats, ReadAheadStats()
            return taken

    def close(self) -> None:
        """Stop reading ahead: wait for the reads in flight (they use the store), drop every
        staged entry and the staging rows. Idempotent."""
        with self._lock:
            self._closed = True
        self._reader.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._stats.dropped += len(self._staged)
            self._staged.clear()
            self._free = list(range(self.capacity))
            self._rows = None
