"""A chain of block stores, nearest first: a node's local store in front of a shared one.

:class:`StoreChain` is assembled from one part per concern: :mod:`.levels` (the levels and
their health), :mod:`.writes` (writes, the upload queues and their journal), :mod:`.reads`
(reads and promotions), :mod:`.scheduler` (the background thread: uploads, probes,
resuming the journal), :mod:`.stats`.

    chain = open_store(["lmdb:///var/cache/kv", "zarr+s3://kv-cache/v4?endpoint=https://..."],
                       layout_fingerprint=layout.fingerprint, timeout_s=2.0)

::

    request path                                      background threads
    ------------                                      ------------------
    put_many ──> level 0 (sync) ──> queue key ──┐     uploads, per far level, FIFO:
                                                └──>  read record back from level 0,
    get_many ──> level 0 ──miss──> level 1 ...        put_many into the level;
                 (far calls: worker thread,           failed -> requeued, level down;
                  abandoned after timeout_s)          down level -> probe when its
                 far hit ──> caller's buffer          backoff expires
                         └─> promotion queue ──────>  promotions: put into level 0,
                                                      queue for the levels in between

**Reads** (``get_many``, ``contains``) ask the levels nearest first. A record found in a
farther level is read into a buffer of the chain's own and copied into the caller's
buffer; then it is *promoted*: written into level 0 and queued for the levels in between,
by a background thread (write-behind, like the cache's own disk writes), so a far hit
costs the request the fetch only. Past ``max_pending_promotions`` records waiting, a
promotion is written on the request path instead (back-pressure, never dropped).

**Writes** (``put_many``) go to level 0 at once; the result is level 0's. Every item is
queued for each farther level (deduplicated by key); one background thread uploads them
in batches. The queue holds keys, not payloads: an upload reads the record back from level
0, so the queue's memory is small and an upload always sends what level 0 verified.

**No upload is lost to eviction.** Level 0 (LMDB or Zarr: ``supports_eviction_guard``)
gets an eviction guard from the chain: a record whose upload is queued, in flight or
journaled (by any process: the journal is shared) is not evicted, neither by a put nor by
``gc``, until a far level has it. A level 0 full of such records refuses new puts
(:class:`StoreFullError`, counted by the cache as a write error; the data stays in the
GPU and host tiers) until uploads free it, so a far level that is down for long makes
level 0 stop taking new records rather than drop owed ones. A record gone from level 0
anyway (deleted, ``gc`` run on level 0 alone, a level 0 without the guard) is skipped
(``uploads_skipped``).

**Far levels fail without harming the request path.**

- Every request-path call into a far level runs on a worker thread and is abandoned after
  ``timeout_s``: the caller gets a miss. A late answer lands in the chain's private buffer
  and is dropped, never in the caller's buffer.
- A failed or timed-out call marks the level *down*; requests skip it (counted
  ``level_unavailable``) and uploads wait. When its backoff expires (``backoff_initial_s``,
  doubling per consecutive failure up to ``backoff_max_s``) the background thread probes it
  (``contains`` of an absent key: one HEAD on S3); a good probe brings it back, so no request
  ever pays for finding a level still down.
- A failed upload batch is requeued in order. A queued upload is never dropped silently:
  past ``max_pending_uploads`` per level a new one waits in the journal (below) or, without
  one, is not queued (``dropped_uploads``; the record stays in level 0), and an item that failed ``max_upload_attempts`` times for a
  reason other than an unreachable store (``ConnectionError``), refused credentials
  (``PermissionError``) or a timeout is given up (``failed_uploads``).
- A far level that cannot be reached when the chain is opened (a ``ConnectionError`` such as
  :class:`~tiered_kv.storage.s3.ObjectStoreUnavailable`) is passed as a
  :class:`DeferredLevel` and opened by the background thread later. Wrong credentials, a
  missing bucket or another layout's bucket raise at open: they are configuration errors.

**Pending uploads are journaled** (:mod:`~.journal`) when level 0 is a local directory
(an LMDB or local Zarr store; ``journal=False`` turns it off): ``put_many`` adds its keys
to ``<level 0 dir>/upload-journal.mdb`` in one fsynced transaction per call (per batch,
not per record), committed on a helper thread while level 0 writes the records (so the
call takes the longer of the two, not their sum), and queues them once both are durable;
an upload removes its keys once the far level has the record. (A journal commit that
fails, e.g. on a full disk, leaves the uploads queued in memory only: ``journal_errors``.)
So a queued upload survives kill -9 and power loss: the next process that opens a chain
on the same level 0 resumes the journal in the background (``uploads_resumed``), in
chunks, never holding more than ``max_pending_uploads`` keys per level in memory; an entry
whose level-0 record is gone (evicted, deleted) is dropped and counted (``uploads_skipped``). Past ``max_pending_uploads`` a journaled upload is not lost
but deferred (``deferred_uploads``) and read back from the journal when the queue has room.
Two processes resuming one journal may both send a record: far puts are create-only, so
the second finds it present (``uploads_existing``) and nothing is overwritten. Without a
journal, pending uploads live in memory only (past the bound: ``dropped_uploads``).

What the chain guarantees:

- ``put_many`` returned: the records are durable in level 0 and, with a journal, their
  uploads are durable in the journal.
- :meth:`StoreChain.flush` returned True: promotions are written into level 0 too; with
  ``uploads=True`` every queued and journaled upload is in the far levels (or given up:
  ``failed_uploads``) — False if ``timeout_s`` passed first (e.g. a level is down).
- :meth:`StoreChain.close`: writes the pending promotions, keeps uploading for up to
  ``close_timeout_s`` (a level that is down is not waited for) and logs what was left
  (``abandoned_uploads``): with a journal the next process resumes those, without one
  :meth:`StoreChain.resync` (``tiered-kv sync``) queues them again.
- A chain still open when the interpreter exits is closed then, as :meth:`StoreChain.close`
  does, before Python's thread pools stop accepting work (:mod:`~.os.at_exit`): a script that
  never calls ``close()`` loses no promotion and no journaled upload, and prints no
  traceback.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..api.store import BlockStore, check_open
from ..errors import LayoutMismatchError, StoreError
from ..format.record import RecordKey
from ..os.at_exit import close_at_exit
from ..os.faults import Faults
from .levels import DEFAULT_TIMEOUT_S, ChainPoint, DeferredLevel, Level, where_of
from .reads import ChainReads
from .scheduler import ChainScheduler
from .stats import ChainStats
from .writes import open_journal

__all__ = ["DEFAULT_TIMEOUT_S", "ChainPoint", "DeferredLevel", "StoreChain"]

log = logging.getLogger(__name__)


class StoreChain(ChainReads, ChainScheduler, ChainStats, BlockStore):
    """Block stores ``[near, ..., far]`` of one layout, used as one (see the module docstring).

    Args:
        levels: level 0 (an open store, written synchronously), then the farther levels:
            open stores or :class:`DeferredLevel`.
        timeout_s: bound on every request-path call into a far level.
        max_pending_uploads: queued uploads per far level before new ones are refused.
        upload_batch: records per background ``put_many``.
        backoff_initial_s, backoff_max_s: how long a failed far level is left alone.
        max_upload_attempts: item-level failures before an upload is given up.
        close_timeout_s: how long :meth:`close` keeps uploading.
        max_pending_promotions: far hits waiting to be written into level 0 before a
            promotion is written on the request path.
        owned: which levels :meth:`close` closes (default: all).
        journal: where pending uploads are journaled: None (default) = level 0's directory
            when it has one (LMDB, local Zarr), else none; False = none (in memory only);
            a directory; True = level 0's directory, ValueError if it has none.
    """

    supports_mmap_reads = False

    def __init__(self, levels: Sequence[BlockStore | DeferredLevel], *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_pending_uploads: int = 100_000, upload_batch: int = 8, backoff_initial_s: float = 0.5,
                 backoff_max_s: float = 60.0, max_upload_attempts: int = 5, close_timeout_s: float = 10.0,
                 max_pending_promotions: int = 64, owned: Sequence[bool] | None = None,
                 journal: bool | str | os.PathLike[str] | None = None) -> None:
        levels = list(levels)
        owned = _check_args(levels, owned, seconds=dict(
            timeout_s=timeout_s, backoff_initial_s=backoff_initial_s, backoff_max_s=backoff_max_s,
            close_timeout_s=close_timeout_s), counts=dict(
            max_pending_uploads=max_pending_uploads, upload_batch=upload_batch,
            max_upload_attempts=max_upload_attempts, max_pending_promotions=max_pending_promotions))
        near = levels[0]
        self.layout_fingerprint = near.layout_fingerprint
        self.maintenance = near.maintenance  # (level 0 refuses puts then)
        for i, lvl in enumerate(levels):
            if isinstance(lvl, BlockStore) and lvl.layout_fingerprint != self.layout_fingerprint:
                raise LayoutMismatchError(f"levels[{i}] ({where_of(lvl)})", lvl.layout_fingerprint,
                                          self.layout_fingerprint)
        self.max_bytes = near.max_bytes
        self.supports_multiprocess = near.supports_multiprocess
        self.supports_shared_writers = near.supports_shared_writers
        self.supports_scatter_reads = near.supports_scatter_reads
        self.timeout_s = float(timeout_s)
        self.max_pending_uploads = max_pending_uploads
        self.upload_batch = upload_batch
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_upload_attempts = max_upload_attempts
        self.close_timeout_s = float(close_timeout_s)
        self.max_pending_promotions = max_pending_promotions
        self._levels = [_level(i, lvl, o) for i, (lvl, o) in enumerate(zip(levels, owned))]
        self._near: BlockStore = near
        self._far = self._levels[1:]
        self.where = " -> ".join(level.where for level in self._levels)
        self._start(journal)

    def _start(self, journal: bool | str | os.PathLike[str] | None) -> None:
        """The chain's state, journal and threads; level 0 given the eviction guard."""
        near = self._near
        self._cond = threading.Condition()
        self._counters = dict.fromkeys(("hits", "misses", "far_hits", "promotions", "promotion_failures",
                                        "journal_errors"), 0)
        self.last_journal_error: str | None = None
        #: the fault points of its journal (:class:`ChainPoint`): a test seam
        self.faults = Faults()
        self._writing: dict[RecordKey, int] = {}  # keys in a put_many / promotion of this process
        self._closing = False
        self._close_deadline = 0.0
        self._pool = ThreadPoolExecutor(max_workers=max(1, 4 * len(self._far)),
                                        thread_name_prefix="tiered_kv.chain.far")
        self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered_kv.chain.promote")
        self._pending_promotions = 0
        self._journal = open_journal(near, journal) if self._far else None
        self.journal_path = None if self._journal is None else self._journal.path
        self._journal_io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tiered_kv.chain.journal")
        for level in self._far:
            level.scan_more = self._journal is not None  # resume what an earlier process left
        self._worker = threading.Thread(target=self._run_background, name="tiered_kv.chain.uploads", daemon=True)
        self._closed = False
        self._guarded = bool(self._far) and near.supports_eviction_guard and near.eviction_guard is None
        if self._guarded:
            near.eviction_guard = self._uploads_pending
        self._worker.start()
        self._at_exit = close_at_exit(self.close)

    # ------------------------------------------------------------------ admin
    def delete(self, key: RecordKey) -> bool:
        """Delete ``key`` from every level (and its queued uploads). An admin operation:
        far levels are called directly, and one that is not open raises StoreError. An
        upload of ``key`` already in flight is waited for first: landing after the far
        levels' deletes it would bring the record back (and one that fails is requeued,
        so it is dropped from the queue again once it ended)."""
        check_open(self._closed, self.where)
        with self._cond:
            for level in self._far:
                level.pending.pop(key, None)
            self._cond.wait_for(lambda: not any(key in level.inflight_keys for level in self._far))
            for level in self._far:
                level.pending.pop(key, None)
        if self._journal is not None:
            for level in self._far:
                self._journal.remove(level.journal_name, [key])
        found = self._near.delete(key)
        for level in self._far:
            found = self._open_store(level, "delete").delete(key) or found
        return found

    def _open_store(self, level: Level, what: str) -> BlockStore:
        if level.store is None:
            raise StoreError(f"{what}: store level {level.index} ({level.where}) is not open yet "
                             f"({level.last_error})")
        return level.store

    def __iter__(self) -> Iterator[RecordKey]:
        """Every key of every level (far levels: listed directly, one request per 1000 on S3)."""
        check_open(self._closed, self.where)
        seen: dict[RecordKey, None] = dict.fromkeys(self._near)
        for level in self._far:
            seen.update(dict.fromkeys(self._open_store(level, "iter")))
        return iter(list(seen))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def wait_uploads(self, timeout_s: float | None = None) -> bool:
        """Wait until no promotion and no upload is queued, journaled or in flight; False if
        ``timeout_s`` passed first (e.g. a far level is down)."""
        check_open(self._closed, self.where)
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending_promotions and not any(
                level.pending or level.inflight or level.scan_more for level in self._far), timeout=timeout_s)

    def flush(self, *, uploads: bool = False, timeout_s: float | None = None) -> bool:
        """Wait for the chain's write-behind work.

        Level-0 writes are synchronous (durable when ``put_many`` returns) and so are
        journal entries; ``flush()`` waits for the promotions (far hits being written
        into level 0). ``uploads=True`` also waits until every queued or journaled upload
        has reached its far level (or been given up, counted ``failed_uploads``), as
        :meth:`wait_uploads`. Returns False if ``timeout_s`` passed first.
        """
        check_open(self._closed, self.where)
        if uploads:
            return self.wait_uploads(timeout_s)
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending_promotions, timeout=timeout_s)

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        """Level 0's answer, and for the keys it lacks each farther level's in turn (far
        levels are asked directly, an admin call: one not open raises StoreError)."""
        check_open(self._closed, self.where)
        sizes = self._near.payload_sizes(keys)
        for level in self._far:
            todo = [i for i, n in enumerate(sizes) if n is None]
            if not todo:
                break
            for i, n in zip(todo, self._open_store(level, "payload_sizes").payload_sizes([keys[i] for i in todo])):
                sizes[i] = n
        return sizes

    def levels(self) -> list[BlockStore | None]:
        """The levels' stores, nearest first (None: a deferred level not opened yet)."""
        return [level.store for level in self._levels]

    # ------------------------------------------------------------------ maintenance
    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """:meth:`BlockStore.verify` of every open level; the totals, and ``levels``: each
        level's result (``{"unavailable": True}`` for one not open)."""
        check_open(self._closed, self.where)
        results: list[dict[str, Any]] = []
        for level in self._levels:
            results.append({"unavailable": True} if level.store is None else level.store.verify(repair=repair))
        keys: dict[str, None] = {}
        for r in results:
            keys.update(dict.fromkeys(r.get("corrupt_keys", ())))
        return {"checked": sum(r.get("checked", 0) for r in results),
                "corrupt": sum(r.get("corrupt", 0) for r in results),
                "removed": sum(r.get("removed", 0) for r in results),
                "corrupt_keys": list(keys), "levels": results}

    def gc(self, max_bytes: int) -> dict[str, Any]:
        """:meth:`BlockStore.gc` of level 0, the node's own bound (a shared level is
        collected by running ``gc`` on its own URL, once for the fleet)."""
        check_open(self._closed, self.where)
        return {**self._near.gc(max_bytes), "level": 0}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Keep uploading for up to ``close_timeout_s`` (levels that are down are not
        waited for), then stop and close the owned levels. Idempotent."""
        if self._closed:
            return
        self._at_exit.cancel()
        self._promoter.shutdown(wait=True)  # promotions land in level 0 (and queue their uploads)
        with self._cond:
            self._closing = True
            self._close_deadline = time.monotonic() + self.close_timeout_s
            self._cond.notify_all()
        # An upload in flight is bounded by its store's own timeouts; one that hangs past
        # them (a stalled link) is abandoned: it stays journaled, the thread is a daemon.
        self._worker.join(timeout=self.close_timeout_s + self.timeout_s)
        if self._worker.is_alive():
            log.warning("store chain %s: an upload still in flight after close_timeout_s=%g s is abandoned",
                        self.where, self.close_timeout_s)
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._journal_io.shutdown(wait=True)
        abandoned = sum(len(level.pending) for level in self._far)
        if self._journal is not None:
            abandoned = sum(self._journal.count(level.journal_name) for level in self._far)
            self._journal.close()
        if abandoned:
            log.warning("store chain closed with %d uploads not done (their records stay in level 0 %s; %s): %s",
                        abandoned, self._levels[0].where,
                        "the next chain opened on it resumes them" if self.journal_path is not None
                        else "`tiered-kv sync` re-sends them",
                        "; ".join(f"level {lv.index}: {len(lv.pending)} ({lv.last_error})"
                                  for lv in self._far if lv.pending))
        self.abandoned_uploads = abandoned
        if self._guarded:
            self._near.eviction_guard = None
        errors: list[BaseException] = []
        for level in reversed(self._levels):
            if level.owned and level.store is not None:
                try:
                    level.store.close()
                except Exception as e:  # close every level, then raise the first failure
                    errors.append(e)
        if errors:
            raise errors[0]

    def __repr__(self) -> str:
        return f"StoreChain({self.where!r}, {'closed' if self._closed else 'open'})"


def _check_args(levels: list[BlockStore | DeferredLevel], owned: Sequence[bool] | None, *,
                seconds: dict[str, float], counts: dict[str, int]) -> list[bool]:
    """ValueError / TypeError naming the first bad argument of a StoreChain; the owned flags."""
    if not levels:
        raise ValueError("levels: expected at least one store")
    if not isinstance(levels[0], BlockStore):
        raise TypeError(f"levels[0]: expected an open BlockStore (the local level), got "
                        f"{type(levels[0]).__name__}")
    for i, lvl in enumerate(levels):
        if not isinstance(lvl, (BlockStore, DeferredLevel)):
            raise TypeError(f"levels[{i}]: expected a BlockStore or DeferredLevel, got {type(lvl).__name__}")
    for name, value in seconds.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if owned is None:
        owned = [True] * len(levels)
    owned = list(owned)
    if len(owned) != len(levels):
        raise ValueError(f"owned: expected one flag per level ({len(levels)}), got {len(owned)}")
    return owned


def _level(i: int, lvl: BlockStore | DeferredLevel, owned: bool) -> Level:
    """Level ``i`` of a new chain: an open store, or one to open later."""
    if isinstance(lvl, DeferredLevel):
        return Level(index=i, where=lvl.where, store=None, opener=lvl.opener, owned=owned, up=False,
                     last_error=lvl.error or None)
    return Level(index=i, where=where_of(lvl), store=lvl, opener=None, owned=owned, up=True, last_error=None)
