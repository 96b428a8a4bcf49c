"""Access times and the eviction order of an LMDB store, and its lifetime counters.

Eviction is leaf-first LRU over the store's prefix tree (:mod:`.tree`): least recently
accessed first among the records with no resident child (``lru``); a block whose last
child goes, goes with it (it has no snapshot and no block after it). Access times are ``time.time_ns()`` (made strictly increasing within a process) so that they
agree between processes. ``atime`` and ``lru`` are kept together in the same write
transactions as the index, so eviction order survives restarts and is shared by every
process. Reads do not write: a hit queues its access time in memory and the queue is
applied by the next write transaction of this process (every ``put_many`` applies it before
evicting, so in-process LRU order is exact), or on its own when it is older than
``access_flush_s`` or larger than 4096 entries, and at ``close()``. A crash loses at most
those queued hints, never a record. The same flush adds this handle's counter deltas to
the lifetime counters every process shares (``meta`` b"counters").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lmdb

from ..api.counters import StoreStats
from ..api.eviction import EvictionGuard, evict_leaves_first, tell_evicted
from ..errors import StoreError, StoreFullError
from ..format.record import RecordKey
from .environment import Index
from .schema import ATIME, LRU_NS, M_COUNTERS, M_TOTAL, U64, Location, unpack_entry
from .tree import Tree

__all__ = ["ACCESS_QUEUE_MAX", "AccessTimes"]

#: queued access times that make the queue due for a flush
ACCESS_QUEUE_MAX = 4096


class AccessTimes:
    """The access bookkeeping of one open store: the queue of access times not yet
    written, and the index operations that keep ``atime``, the order tables (``lru``,
    ``parked``), the prefix tree (:attr:`tree`) and the accounted total in step with
    ``records`` (every record indexed goes through :meth:`touch` with its size and
    :meth:`link`, every removal through :meth:`remove`).

    ``guard()``: the store's eviction guard now (a chain sets it on its level 0).
    """

    def __init__(self, index: Index, stats: StoreStats, *, max_bytes: int, flush_s: float,
                 guard: Callable[[], EvictionGuard | None]) -> None:
        self.index = index
        self.stats = stats
        self.max_bytes = max_bytes
        self.flush_s = flush_s
        self.guard = guard
        self.tree = Tree(index)
        #: called with the RecordKeys each eviction of this handle took, after its
        #: transaction committed, on the thread that evicted (None: nobody listens)
        self.on_evict: Callable[[list[RecordKey]], None] | None = None
        self.lock = threading.Lock()
        self._queue: dict[bytes, int] = {}
        self._since = time.monotonic()
        self._last_ns = 0

    def now_ns(self) -> int:
        """``time.time_ns()``, strictly increasing within this process."""
        with self.lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    # ------------------------------------------------------------------ in a write transaction
    def touch(self, txn: lmdb.Transaction, kb: bytes, ns: int, size: int | None = None) -> None:
        """Set ``kb``'s last access to ``ns`` (``size``: its record bytes when just written)."""
        dbs = self.index.dbs
        assert dbs is not None
        old = txn.get(kb, db=dbs.atime)
        if old is not None:
            old_ns, old_size = self.index.field(ATIME, old, "an access-time entry")
            self._unorder(txn, LRU_NS.pack(old_ns) + kb)
            if size is None:
                size = old_size
        elif size is None:
            return  # the record is gone (deleted or evicted meanwhile): nothing to touch
        txn.put(kb, ATIME.pack(ns, size), db=dbs.atime)
        txn.put(LRU_NS.pack(ns) + kb, b"", db=self.tree.order_db(txn, kb))

    def link(self, txn: lmdb.Transaction, kb: bytes, parent_kb: bytes) -> None:
        """Record just-indexed ``kb``'s parent (call after :meth:`touch`): see :mod:`.tree`."""
        self.tree.link(txn, kb, parent_kb)

    def _unorder(self, txn: lmdb.Transaction, okey: bytes) -> None:
        """Delete an order entry from whichever order table holds it."""
        dbs = self.index.dbs
        assert dbs is not None
        if not txn.delete(okey, db=dbs.lru) and dbs.parked is not None:
            txn.delete(okey, db=dbs.parked)

    def remove(self, txn: lmdb.Transaction, kb: bytes, freed: list[Location],
               released: list[bytes] | None = None) -> int:
        """Unindex record ``kb``, its access entries and its link (its location is
        appended to ``freed``, to punch once the transaction committed); returns its
        accounted bytes. A resident parent left without a child becomes a leaf and is
        appended to ``released``."""
        dbs = self.index.dbs
        assert dbs is not None
        found = unpack_entry(txn.get(kb, db=dbs.records))
        if found is not None:
            freed.append(found[0])
        size = 0
        old = txn.get(kb, db=dbs.atime)
        if old is not None:
            old_ns, size = self.index.field(ATIME, old, "an access-time entry")
            self._unorder(txn, LRU_NS.pack(old_ns) + kb)
            txn.delete(kb, db=dbs.atime)
        txn.delete(kb, db=dbs.records)
        parent = self.tree.unlink(txn, kb)
        if parent is not None and released is not None:
            released.append(parent)
        return size

    def evict_for(self, txn: lmdb.Transaction, total: int, need: int, freed: list[Location], *,
                  limit: int | None = None, max_records: int | None = None,
                  gone: list[bytes] | None = None) -> tuple[int, int]:
        """Evict records until ``need`` more bytes fit in ``limit`` (default
        ``max_bytes``), or ``max_records`` were evicted: leaves least recently accessed
        first, each with the blocks that led only to it (see :mod:`.tree`); records the
        eviction guard holds are skipped. Returns (bytes left, records evicted); the key
        bytes of each record evicted are appended to ``gone`` (reported by the caller once
        the transaction committed: :meth:`report_evicted`).

        Raises StoreFullError when a put (``need > 0``) cannot make room because the
        guard holds the rest; ``gc`` (``need == 0``) then stops short of its bound."""
        bound = self.max_bytes if limit is None else limit
        if total + need <= bound:
            return total, 0
        guard = self.guard()
        dbs = self.index.dbs
        assert dbs is not None

        def remove(kb: bytes, released: list[bytes]) -> int | None:
            if txn.get(kb, db=dbs.records) is None:
                return None
            return self.remove(txn, kb, freed, released)

        orders = [lambda db=db: self._walk(txn, db, guard is not None)  # leaves; only then the rest
                  for db in (dbs.lru, dbs.parked) if db is not None]
        taken, got, kept = evict_leaves_first(orders, total + need - bound, remove, guard, key_of=_record_key,
                                              max_records=max_records)
        total -= got
        evicted = len(taken)
        if gone is not None:
            gone.extend(taken)
        if total + need > bound and (max_records is None or evicted < max_records):
            where = self.index.path
            if kept and need:
                raise StoreFullError(
                    f"{where}: no room for {need} bytes: records take {total} of {bound} bytes and the "
                    f"{kept} least recently used that could go are held by the store's eviction guard "
                    f"(uploads to a farther level still pending); nothing was written by this call")
            if not kept:
                raise StoreError(f"{where}: accounting broken: {total} bytes recorded but no "
                                 f"record left to evict")
        return total, evicted

    def _walk(self, txn: lmdb.Transaction, db: Any, guarded: bool) -> Iterator[tuple[bytes, RecordKey | None, int]]:
        """One order table's records, oldest access first: (key bytes, its RecordKey when
        an eviction guard is set, accounted bytes)."""
        dbs = self.index.dbs
        assert dbs is not None
        cur = txn.cursor(db=db)
        ok = cur.first()
        while ok:
            kb = bytes(cur.key()[LRU_NS.size:])
            raw = txn.get(kb, db=dbs.atime)
            yield kb, _record_key(kb) if guarded else None, ATIME.unpack(raw)[1] if raw is not None else 0
            ok = cur.next()

    def report_evicted(self, gone: Sequence[bytes]) -> None:
        """Hand the keys an eviction took (``gone``, from a committed transaction) to
        :attr:`on_evict`, when set, on the calling thread. A listener that raises is logged,
        never the store's error: the records are gone either way."""
        if self.on_evict is not None and gone:
            tell_evicted(self.on_evict, [k for k in (_record_key(kb) for kb in gone) if k is not None])

    def put_total(self, txn: lmdb.Transaction, total: int) -> None:
        """Record the accounted bytes (``meta`` record_bytes)."""
        assert self.index.dbs is not None
        txn.put(M_TOTAL, U64.pack(total), db=self.index.dbs.meta)

    # ------------------------------------------------------------------ the queue
    def queue_hits(self, kbs: Sequence[bytes], hits: Sequence[Any]) -> None:
        """Queue an access now for each ``kbs[i]`` whose ``hits[i]`` is true, and flush
        the queue if it is due."""
        ns = self.now_ns()
        with self.lock:
            for kb, hit in zip(kbs, hits):
                if hit:
                    self._queue[kb] = ns
        self.maybe_flush()

    def forget(self, kb: bytes) -> None:
        """Drop ``kb``'s queued access (its record is being deleted)."""
        with self.lock:
            self._queue.pop(kb, None)

    def take(self) -> dict[bytes, int]:
        with self.lock:
            taken, self._queue = self._queue, {}
            self._since = time.monotonic()
            return taken

    def restore(self, taken: dict[bytes, int]) -> None:
        """Queue again what :meth:`take` took (its write failed), newer accesses kept."""
        with self.lock:
            for kb, ns in taken.items():
                if self._queue.get(kb, 0) < ns:
                    self._queue[kb] = ns

    def apply(self, txn: lmdb.Transaction, taken: dict[bytes, int]) -> None:
        for kb, ns in taken.items():
            self.touch(txn, kb, ns)

    def flush(self) -> None:
        """Write the queued access times and this handle's counter deltas into the lifetime
        counters (one transaction). Raises StoreFullError."""
        taken = self.take()
        delta = self.stats.take_deltas()
        if not taken and not any(delta.values()):
            return

        def write(txn: lmdb.Transaction) -> None:
            self.apply(txn, taken)
            if any(delta.values()):
                assert self.index.dbs is not None
                totals = self.lifetime(txn)
                txn.put(M_COUNTERS, b"".join(U64.pack(max(0, totals[k] + delta[k])) for k in StoreStats.NAMES),
                        db=self.index.dbs.meta)

        try:
            self.index.run(write, write=True)
        except BaseException:
            self.restore(taken)
            self.stats.restore_deltas(delta)
            raise

    def lifetime(self, txn: lmdb.Transaction) -> dict[str, int]:
        """The lifetime counters every process added to (zeros where they are unreadable)."""
        assert self.index.dbs is not None
        raw = txn.get(M_COUNTERS, db=self.index.dbs.meta)
        if raw is None or len(raw) != 8 * len(StoreStats.NAMES):
            return dict.fromkeys(StoreStats.NAMES, 0)
        return {k: U64.unpack_from(raw, 8 * i)[0] for i, k in enumerate(StoreStats.NAMES)}

    def maybe_flush(self) -> None:
        """:meth:`flush` when the queue is due (see the module docstring)."""
        with self.lock:
            due = (len(self._queue) >= ACCESS_QUEUE_MAX
                   or (self._queue and time.monotonic() - self._since >= self.flush_s))
        if due:
            self.flush_quietly()

    def flush_quietly(self) -> None:
        """:meth:`flush`, but on a full disk the hints stay queued (one entry per key at
        most) and reads go on: they are LRU hints; the next put or flush writes them."""
        try:
            self.flush()
        except StoreFullError:
            pass


def _record_key(kb: bytes) -> RecordKey | None:
    """``kb`` as a RecordKey; None if it is not one (nothing can hold it)."""
    try:
        return RecordKey.from_bytes(kb)
    except ValueError:
        return None
