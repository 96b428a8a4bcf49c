"""A chain of block stores, nearest first: a node's local store in front of a shared one.

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
  does, before Python's thread pools stop accepting work (:mod:`~.at_exit`): a script that
  never calls ``close()`` loses no promotion and no journaled upload, and prints no
  traceback.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np

from .at_exit import close_at_exit
from .base import BlockStore, PutItem, check_open
from .errors import LayoutMismatchError, StoreError
from .journal import UploadJournal, level_name
from .record import RecordKey, RecordKind, RecordMeta, write_segments

__all__ = ["DEFAULT_TIMEOUT_S", "DeferredLevel", "StoreChain"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
#: A key no record has (the probe of a down level asks for it).
_PROBE_KEY = RecordKey(RecordKind.BLOCK, hashlib.sha256(b"tiered_kv.chain: probe, never stored").digest())
#: What a far level raises when it fails (as opposed to bad input, which propagates).
_LEVEL_ERRORS = (StoreError, OSError)
#: Failures of the level as a whole, not of an item: they do not use up an item's attempts.
_TRANSIENT = (ConnectionError, PermissionError, TimeoutError)
_SKIPPED = object()
#: Journal entries read into a level's memory queue per background step.
_RESUME_CHUNK = 256


@dataclass(frozen=True, slots=True)
class DeferredLevel:
    """A far level to be opened later by the chain's background thread.

    ``opener()`` returns the open store (and raises while it cannot); ``where`` names it in
    stats and messages (no credentials); ``error``: why it could not be opened yet.
    """

    where: str
    opener: Callable[[], BlockStore]
    error: str = ""


@dataclass(slots=True)
class _Pending:
    nbytes: int
    attempts: int = 0       # failures of this item while its level was up
    failed: bool = False    # failed at least once (its next try counts as a retry)


_LEVEL_COUNTERS = ("hits", "misses", "timeouts", "errors", "auth_errors", "unavailable", "uploads",
                   "uploads_existing", "upload_failures", "upload_retries", "dropped_uploads",
                   "failed_uploads", "uploads_skipped", "promotions_in", "recoveries", "uploads_resumed",
                   "deferred_uploads")


@dataclass(eq=False)
class _Level:
    """One level's store and health (guarded by the chain's condition)."""

    index: int
    where: str
    store: BlockStore | None
    opener: Callable[[], BlockStore] | None
    owned: bool
    up: bool
    down_until: float = 0.0
    failures: int = 0                       # consecutive
    last_error: str | None = None
    pending: OrderedDict[RecordKey, _Pending] = field(default_factory=OrderedDict)
    inflight: int = 0
    inflight_keys: set[RecordKey] = field(default_factory=set)
    # The journal pass that loads this level's entries into ``pending`` (see _resume):
    scan_more: bool = False                 # a pass is due or under way
    scan_again: bool = False                # start another pass after this one
    scan_after: RecordKey | None = None     # where the pass stands (key order)

    @property
    def journal_name(self) -> str:
        return level_name(self.where)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_LEVEL_COUNTERS, 0))


class StoreChain(BlockStore):
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
        if not levels:
            raise ValueError("levels: expected at least one store")
        if not isinstance(levels[0], BlockStore):
            raise TypeError(f"levels[0]: expected an open BlockStore (the local level), got "
                            f"{type(levels[0]).__name__}")
        for i, lvl in enumerate(levels):
            if not isinstance(lvl, (BlockStore, DeferredLevel)):
                raise TypeError(f"levels[{i}]: expected a BlockStore or DeferredLevel, got {type(lvl).__name__}")
        for name, value in (("timeout_s", timeout_s), ("backoff_initial_s", backoff_initial_s),
                            ("backoff_max_s", backoff_max_s), ("close_timeout_s", close_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        for name, value in (("max_pending_uploads", max_pending_uploads), ("upload_batch", upload_batch),
                            ("max_upload_attempts", max_upload_attempts),
                            ("max_pending_promotions", max_pending_promotions)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if owned is None:
            owned = [True] * len(levels)
        owned = list(owned)
        if len(owned) != len(levels):
            raise ValueError(f"owned: expected one flag per level ({len(levels)}), got {len(owned)}")
        near = levels[0]
        self.layout_fingerprint = near.layout_fingerprint
        self.maintenance = near.maintenance  # (level 0 refuses puts then)
        for i, lvl in enumerate(levels):
            if isinstance(lvl, BlockStore) and lvl.layout_fingerprint != self.layout_fingerprint:
                raise LayoutMismatchError(f"levels[{i}] ({_where(lvl)})", lvl.layout_fingerprint,
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
        self._levels = [
            _Level(index=i, where=lvl.where if isinstance(lvl, DeferredLevel) else _where(lvl),
                   store=None if isinstance(lvl, DeferredLevel) else lvl,
                   opener=lvl.opener if isinstance(lvl, DeferredLevel) else None, owned=o,
                   up=not isinstance(lvl, DeferredLevel),
                   last_error=lvl.error or None if isinstance(lvl, DeferredLevel) else None)
            for i, (lvl, o) in enumerate(zip(levels, owned))]
        self._near: BlockStore = near
        self._far = self._levels[1:]
        self.where = " -> ".join(level.where for level in self._levels)
        self._cond = threading.Condition()
        self._counters = dict.fromkeys(("hits", "misses", "far_hits", "promotions", "promotion_failures",
                                        "journal_errors"), 0)
        self.last_journal_error: str | None = None
        self._writing: dict[RecordKey, int] = {}  # keys in a put_many / promotion of this process
        self._closing = False
        self._close_deadline = 0.0
        self._pool = ThreadPoolExecutor(max_workers=max(1, 4 * len(self._far)),
                                        thread_name_prefix="tiered_kv.chain.far")
        self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered_kv.chain.promote")
        self._pending_promotions = 0
        self._journal = _open_journal(near, journal) if self._far else None
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

    # ------------------------------------------------------------------ health
    def _usable(self, level: _Level) -> bool:
        return level.up and level.store is not None

    def _failed(self, level: _Level, what: str, exc: BaseException | None = None, *, timeout: bool = False) -> None:
        """Mark ``level`` down after a failed call; it is probed again after its backoff."""
        message = f"{what} timed out after {self.timeout_s:g} s" if timeout else f"{what}: {type(exc).__name__}: {exc}"
        with self._cond:
            was_up = level.up
            level.up = False
            level.failures += 1
            backoff = min(self.backoff_max_s, self.backoff_initial_s * 2 ** min(level.failures - 1, 30))
            level.down_until = time.monotonic() + backoff
            level.last_error = message
            c = level.counters
            c["timeouts" if timeout else "errors"] += 1
            if isinstance(exc, PermissionError):
                c["auth_errors"] += 1
            self._cond.notify_all()
        if was_up:
            log.warning("store level %d (%s) unavailable, serving from nearer levels; retrying in %.1f s: %s",
                        level.index, level.where, backoff, message)

    def _call_far(self, level: _Level, what: str, fn: Callable[[BlockStore], Any]) -> Any:
        """``fn(level's store)`` on a worker thread, bounded by ``timeout_s``; ``_SKIPPED``
        when the level is down, failed or too slow (and then marked down)."""
        with self._cond:
            if not self._usable(level):
                level.counters["unavailable"] += 1
                return _SKIPPED
            store = level.store
        assert store is not None
        future = self._pool.submit(fn, store)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            if not future.done():
                future.cancel()
                self._failed(level, what, timeout=True)
                return _SKIPPED
            exc = future.exception()  # the store itself raised a TimeoutError
            self._failed(level, what, exc)
        except _LEVEL_ERRORS as e:
            self._failed(level, what, e)
        return _SKIPPED

    def _uploads_pending(self, keys: Sequence[RecordKey]) -> set[RecordKey]:
        """Level 0's eviction guard: which of ``keys`` a far level still needs (queued, in
        flight, being written and queued by this process, or journaled by any process)."""
        with self._cond:
            held = {key for key in keys if key in self._writing
                    or any(key in level.pending or key in level.inflight_keys for level in self._far)}
        if self._journal is not None and not self._closed:
            rest = [key for key in keys if key not in held]
            try:
                held |= self._journal.pending_among([level.journal_name for level in self._far], rest)
            except (StoreError, lmdb.Error) as e:  # unreadable journal: hold them all, never lose one
                log.warning("upload journal %s: could not be read for level 0's eviction (%s); "
                            "nothing is evicted meanwhile", self._journal.path, e)
                return set(keys)
        return held

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """Write to level 0 (its result is returned; its errors raise) and queue every item
        for the farther levels."""
        check_open(self._closed, self.where)
        items = self._check_put_items(items)
        if not self._far:
            return self._near.put_many(items)
        sizes = [item.payload_bytes for item in items]
        keys = [item.key for item in items]
        with self._writing_keys(keys):
            # The journal's commit (its fsync) runs beside level 0's write, not after it: the
            # request path pays the longer of the two. Both are done before anything is queued.
            journaled = None if self._journal is None else self._journal_io.submit(
                self._journal.add, [level.journal_name for level in self._far], list(zip(keys, sizes)))
            try:
                results = self._near.put_many(items)
            except BaseException:
                if journaled is not None:  # journaled, maybe not written: the journal pass sorts them out
                    _wait_quietly(journaled)
                    with self._cond:
                        for level in self._far:
                            self._rescan(level)
                raise
            if journaled is not None:
                self._journal_done(journaled, len(items))
            with self._cond:
                for level in self._far:
                    for key, n in zip(keys, sizes):
                        self._enqueue(level, key, n)
        return results

    @contextlib.contextmanager
    def _writing_keys(self, keys: list[RecordKey]) -> Iterator[None]:
        """Mark ``keys`` as being written and queued by this process: their journal entries
        may exist before their level-0 records do, so the journal pass leaves them alone."""
        with self._cond:
            for key in keys:
                self._writing[key] = self._writing.get(key, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                for key in keys:
                    left = self._writing.pop(key) - 1
                    if left:
                        self._writing[key] = left

    def _journal_done(self, journaled: Future[None], n: int) -> None:
        """Wait for a journal commit. Its failure (e.g. a full disk) does not undo level 0's
        write: the uploads are queued in memory only, counted as ``journal_errors``."""
        try:
            journaled.result()
        except (StoreError, OSError, lmdb.Error) as e:
            with self._cond:
                first = not self._counters["journal_errors"]
                self._counters["journal_errors"] += n
                self.last_journal_error = f"{type(e).__name__}: {e}"
            if first:
                log.warning("upload journal %s: could not journal %d uploads (queued in memory only; "
                            "counted as journal_errors): %s", self.journal_path, n, e)

    def _rescan(self, level: _Level) -> None:
        """Have the background thread read ``level``'s journal (again): it holds entries
        not in memory. Caller holds the condition."""
        if level.scan_more:
            level.scan_again = True
        else:
            level.scan_more, level.scan_after = True, None
        self._cond.notify_all()

    def _enqueue(self, level: _Level, key: RecordKey, nbytes: int) -> None:
        """Queue ``key`` for upload to ``level`` (caller holds the condition)."""
        if key in level.pending:
            return
        if len(level.pending) >= self.max_pending_uploads:
            if self._journal is not None:  # journaled: read back when the queue has room
                level.counters["deferred_uploads"] += 1
                self._rescan(level)
                return
            level.counters["dropped_uploads"] += 1
            if level.counters["dropped_uploads"] == 1:
                log.warning("store level %d (%s): %d uploads pending, not queueing more (records stay in "
                            "level 0; counted as dropped_uploads)", level.index, level.where, len(level.pending))
            return
        level.pending[key] = _Pending(nbytes)
        self._cond.notify_all()

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, self.where)
        keys, dsts, digests = self._check_get_args(keys, outs, token_digests, scatter=True)
        # (scatter lists go down as they are: level 0 reads into the pieces when it can)
        metas = self._near.get_many(keys, [d[0] if len(d) == 1 else d for d in dsts], token_digests=digests)
        missing = [i for i, m in enumerate(metas) if m is None]
        for level in self._far:
            if not missing:
                break
            bufs = [np.empty(dsts[i].nbytes, dtype=np.uint8) for i in missing]  # private: see _call_far
            want = [keys[i] for i in missing]
            want_digests = [digests[i] for i in missing]
            # Bound now: a call abandoned after the timeout may run after this loop moved on.
            got = self._call_far(level, "get", functools.partial(_get_many, keys=want, outs=bufs,
                                                                 token_digests=want_digests))
            if got is _SKIPPED:
                continue
            found = [(i, meta, buf) for i, meta, buf in zip(missing, got, bufs) if meta is not None]
            with self._cond:
                level.counters["hits"] += len(found)
                level.counters["misses"] += len(missing) - len(found)
            for i, meta, buf in found:
                write_segments(dsts[i], buf)
                metas[i] = meta
            if found:
                self._promote(level, found)
            missing = [i for i in missing if metas[i] is None]
        with self._cond:
            self._counters["hits"] += len(keys) - len(missing)
            self._counters["misses"] += len(missing)
        return metas

    def _promote(self, source: _Level, found: list[tuple[int, RecordMeta, np.ndarray]]) -> None:
        """Have records found in ``source`` written into level 0 and queued for the levels
        between: in the background, or here when too many are waiting already."""
        items = [PutItem(meta.key, meta.parent_hash, meta.token_digest, buf) for _, meta, buf in found]
        with self._cond:
            self._counters["far_hits"] += len(items)
            behind = self._pending_promotions + len(items) <= self.max_pending_promotions
            if behind:
                self._pending_promotions += len(items)
        if not behind:
            self._write_promotions(source, items)
            return

        def write() -> None:
            try:
                self._write_promotions(source, items)
            except Exception:  # a bug, not a store failure: surface it, keep serving
                log.exception("promotion into store level 0 (%s) failed", self._levels[0].where)
                with self._cond:
                    self._counters["promotion_failures"] += len(items)
            finally:
                with self._cond:
                    self._pending_promotions -= len(items)
                    self._cond.notify_all()

        self._promoter.submit(write)

    def _write_promotions(self, source: _Level, items: list[PutItem]) -> None:
        try:
            self._near.put_many(items)
        except StoreError as e:  # level 0 full: the records were served anyway
            with self._cond:
                self._counters["promotion_failures"] += len(items)
            log.warning("promotion into store level 0 (%s) failed: %s", self._levels[0].where, e)
            return
        between = self._far[:source.index - 1]
        with self._writing_keys([item.key for item in items]):
            if self._journal is not None and between:
                self._journal_done(self._journal_io.submit(
                    self._journal.add, [level.journal_name for level in between],
                    [(item.key, item.payload_bytes) for item in items]), len(items))
            with self._cond:
                self._counters["promotions"] += len(items)
                self._levels[0].counters["promotions_in"] += len(items)
                for level in between:
                    for item in items:
                        self._enqueue(level, item.key, item.payload_bytes)

    def contains(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        if self._near.contains(key):
            return True
        return any(self._call_far(level, "contains", lambda s: s.contains(key)) is True for level in self._far)

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        """Nearest level first; the keys it lacks go to each farther level in one batch,
        bounded by ``timeout_s`` per level (a level that is down answers False)."""
        check_open(self._closed, self.where)
        found = self._near.contains_many(keys)
        for level in self._far:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            answer = self._call_far(level, "contains", lambda s: s.contains_many([keys[i] for i in todo]))
            if answer is _SKIPPED:
                continue
            for i, f in zip(todo, answer):
                found[i] = bool(f)
        return found

    def contains_at(self, level: int, kind: RecordKind, hashes: Sequence[bytes]) -> list[bool] | None:
        """Which records of ``kind`` under ``hashes`` level ``level`` alone holds (0 =
        nearest; :meth:`BlockStore.contains_hashes`), for callers that need to know where
        a record is (a router's lookup). A far level is asked as the request path asks it:
        bounded by ``timeout_s``; None when it is down, not open yet or did not answer in
        time (and then marked down)."""
        check_open(self._closed, self.where)
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < len(self._levels):
            raise ValueError(f"level: expected an int in [0, {len(self._levels)}), got {level!r}")
        if level == 0:
            return [bool(f) for f in self._near.contains_hashes(kind, hashes)]
        if not hashes:
            return []
        answer = self._call_far(self._levels[level], "contains", lambda s: s.contains_hashes(kind, list(hashes)))
        return None if answer is _SKIPPED else [bool(f) for f in answer]

    # ------------------------------------------------------------------ admin
    def delete(self, key: RecordKey) -> bool:
        """Delete ``key`` from every level (and its queued uploads). An admin operation:
        far levels are called directly, and one that is not open raises StoreError."""
        check_open(self._closed, self.where)
        with self._cond:
            for level in self._far:
                level.pending.pop(key, None)
        if self._journal is not None:
            for level in self._far:
                self._journal.remove(level.journal_name, [key])
        found = self._near.delete(key)
        for level in self._far:
            found = self._open_store(level, "delete").delete(key) or found
        return found

    def _open_store(self, level: _Level, what: str) -> BlockStore:
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

    def resync(self, payload_bytes: dict[RecordKind, int] | None = None) -> dict[str, int]:
        """Queue for upload every level-0 record that a farther level lacks.

        ``payload_bytes``: the payload size of each record kind, when the layout is known
        (``{BLOCK: layout.block_bytes, SNAPSHOT: layout.snapshot_bytes}``); None (default):
        each record's own size, from level 0's index (:meth:`BlockStore.payload_sizes`), so
        a store of any layout (an engine's pages of several sizes) resyncs. An upload reads
        the record back from level 0 into a buffer of that size.

        With a journal (see the module docstring) uploads pending when a process stopped are
        resumed by the next one; this is for the rest: records written before the journal,
        by a chain without one, or lost with a journal that was removed. Each far level is listed once
        (one request per 1000 keys on S3) and level 0 once; the uploads then run in the
        background like any other (:meth:`wait_uploads` waits for them). A level that is
        down is skipped and counted in ``levels_skipped``.
        """
        check_open(self._closed, self.where)
        local = list(self._near)
        out = {"local_records": len(local), "queued": 0, "present": 0, "levels_skipped": 0}
        for level in self._far:
            listed = self._call_far(level, "list", lambda s: set(s))
            if listed is _SKIPPED:
                out["levels_skipped"] += 1
                continue
            missing = [key for key in local if key not in listed]
            out["present"] += len(local) - len(missing)
            sizes = ([payload_bytes[key.kind] for key in missing] if payload_bytes is not None
                     else self._near.payload_sizes(missing))
            owed = [(key, n) for key, n in zip(missing, sizes) if n is not None]  # (None: gone meanwhile)
            out["queued"] += len(owed)
            if self._journal is not None:
                self._journal.add([level.journal_name], owed)
            with self._cond:
                for key, n in owed:
                    self._enqueue(level, key, n)
        return out

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

    def stats(self) -> dict[str, Any]:
        """Level 0's figures (records, bytes, max_bytes, evictions, puts, access times), the
        chain's read counters (hits / misses of the chain as a whole, far_hits, promotions,
        promotion_failures, pending_promotions), ``corrupt`` and ``auth_failures`` summed over the
        levels (an encrypted level's records that failed authentication), the upload counters summed over far levels (uploads,
        uploads_existing, upload_failures, upload_retries, pending_uploads, dropped_uploads,
        failed_uploads, uploads_skipped; journaled_uploads: entries in the journal,
        uploads_resumed: read back from it, deferred_uploads: journaled past the memory
        bound; journal_errors: uploads that could not be journaled), ``journal``: its path
        or None, the health counters (level_unavailable: calls that
        skipped a down level; timeouts; level_errors; auth_errors; levels_down), every
        numeric figure of level ``i`` as ``level{i}_<name>``, and ``levels``: one dict per
        level (where, up, last_error, retry_in_s, encrypted, key_ids when encrypted, ...)."""
        check_open(self._closed, self.where)
        near = self._near.stats()
        out: dict[str, Any] = {
            "backend": "chain", "path": self.where, "layout_fingerprint": self.layout_fingerprint,
            "writer": near.get("writer"),
            **{k: near.get(k) for k in ("records", "bytes", "max_bytes", "evictions", "puts", "put_bytes",
                                          "oldest_access_ns", "newest_access_ns")},
        }
        per_level: list[dict[str, Any]] = []
        journaled = {} if self._journal is None else {
            level.index: self._journal.count(level.journal_name) for level in self._far}
        corrupt = auth_failures = 0
        now = time.monotonic()
        for level in self._levels:
            store_stats: dict[str, Any] = near if level.index == 0 else {}
            stats_error = None
            if level.index > 0 and level.store is not None:
                try:
                    store_stats = level.store.stats()
                except _LEVEL_ERRORS as e:
                    stats_error = f"{type(e).__name__}: {e}"
            corrupt += int(store_stats.get("corrupt") or 0)
            auth_failures += int(store_stats.get("auth_failures") or 0)
            with self._cond:
                if level.index == 0:  # written and read synchronously: no health to report
                    info: dict[str, Any] = {"where": level.where, "promotions_in": level.counters["promotions_in"]}
                else:
                    info = {"where": level.where, "up": level.up and level.store is not None,
                            "open": level.store is not None, "last_error": level.last_error,
                            "retry_in_s": None if level.up else round(max(0.0, level.down_until - now), 3),
                            "consecutive_failures": level.failures, "pending_uploads": len(level.pending),
                            "journaled_uploads": journaled.get(level.index, 0), **level.counters}
                if stats_error is not None:
                    info["stats_error"] = stats_error
                info["writer"] = store_stats.get("writer")
                info["records"] = store_stats.get("records")
                info["encrypted"] = bool(store_stats.get("encrypted"))  # (a level not open yet: False)
                if info["encrypted"]:
                    info["key_ids"] = store_stats.get("key_ids")
            per_level.append(info)
            for k, v in {**store_stats, **info}.items():
                if isinstance(v, (int, float)):  # bools as 0 / 1
                    out[f"level{level.index}_{k}"] = int(v) if isinstance(v, bool) else v
        with self._cond:
            out.update(self._counters)
            out["pending_promotions"] = self._pending_promotions
        far = per_level[1:]
        out["corrupt"] = corrupt
        out["auth_failures"] = auth_failures
        out["journal"] = None if self.journal_path is None else str(self.journal_path)
        for name in ("uploads", "uploads_existing", "upload_failures", "upload_retries", "pending_uploads",
                     "dropped_uploads", "failed_uploads", "uploads_skipped", "timeouts", "auth_errors",
                     "journaled_uploads", "uploads_resumed", "deferred_uploads"):
            out[name] = sum(info[name] for info in far)
        out["level_unavailable"] = sum(info["unavailable"] for info in far)
        out["level_errors"] = sum(info["errors"] for info in far)
        out["levels_down"] = sum(not info["up"] for info in far)
        out["levels"] = per_level
        return out

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

    # ------------------------------------------------------------------ background
    def _next_job(self) -> tuple[_Level | None, str, float | None]:
        """(level, "probe" | "resume" | "upload", None) or (None, "", seconds to wait; None:
        until notified). Caller holds the condition."""
        now = time.monotonic()
        wait: float | None = None
        for level in self._far:
            if not level.up:
                if level.down_until <= now:
                    return level, "probe", None
                wait = level.down_until - now if wait is None else min(wait, level.down_until - now)
            elif level.scan_more and len(level.pending) < min(_RESUME_CHUNK, self.max_pending_uploads):
                return level, "resume", None
            elif level.pending:
                return level, "upload", None
        return None, "", wait

    def _done_closing(self) -> bool:
        if time.monotonic() >= self._close_deadline:
            return True
        return not any(level.up and (level.pending or level.scan_more) for level in self._far)

    def _run_background(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closing and self._done_closing():
                        return
                    level, job, wait = self._next_job()
                    if level is not None:
                        break
                    if self._closing:
                        left = self._close_deadline - time.monotonic()
                        wait = left if wait is None else min(wait, left)
                    self._cond.wait(timeout=wait)
            try:
                if job == "probe":
                    self._probe(level)
                elif job == "resume":
                    self._resume(level)
                else:
                    self._upload_batch(level)
            except Exception as e:  # a bug, not a store failure: keep the thread, surface it
                log.exception("store level %d (%s): background %s failed", level.index, level.where, job)
                self._failed(level, f"background {job}", e)

    def _probe(self, level: _Level) -> None:
        try:
            if level.store is None:
                assert level.opener is not None
                store = level.opener()
                if store.layout_fingerprint != self.layout_fingerprint:
                    store.close()
                    raise LayoutMismatchError(level.where, store.layout_fingerprint, self.layout_fingerprint)
                with self._cond:
                    level.store = store
            else:
                level.store.contains(_PROBE_KEY)
        except _LEVEL_ERRORS as e:
            self._failed(level, "probe" if level.store is not None else "open", e)
            return
        with self._cond:
            level.up = True
            level.failures = 0
            level.counters["recoveries"] += 1
            pending = len(level.pending)
            self._cond.notify_all()
        log.warning("store level %d (%s) available again; %d uploads pending", level.index, level.where, pending)

    def _resume(self, level: _Level) -> None:
        """Read the next chunk of ``level``'s journal entries into its queue (those not
        queued or in flight already); at the end of the pass, start another if asked."""
        assert self._journal is not None
        with self._cond:
            after = level.scan_after
            room = min(_RESUME_CHUNK, self.max_pending_uploads - len(level.pending))
        entries = self._journal.scan(level.journal_name, after=after, limit=max(1, room))
        with self._cond:
            for key, nbytes in entries:
                if key not in level.pending and key not in level.inflight_keys and key not in self._writing:
                    level.pending[key] = _Pending(nbytes)
                    level.counters["uploads_resumed"] += 1
            if len(entries) < max(1, room):
                level.scan_more, level.scan_again, level.scan_after = level.scan_again, False, None
            else:
                level.scan_after = entries[-1][0]
            self._cond.notify_all()

    def _upload_batch(self, level: _Level) -> None:
        with self._cond:
            batch: list[tuple[RecordKey, _Pending]] = []
            while level.pending and len(batch) < self.upload_batch:
                batch.append(level.pending.popitem(last=False))
            level.inflight += len(batch)
            level.inflight_keys.update(key for key, _ in batch)
            store = level.store
        assert store is not None
        done: list[RecordKey] = []  # sent or gone from level 0: out of the journal
        try:
            items, gone = self._read_back(batch)
            done += gone
            try:
                results = store.put_many(items) if items else []
            except _LEVEL_ERRORS as e:
                done += self._requeue(level, batch, e)
                self._failed(level, "upload", e)
                return
            done += [item.key for item in items]
            with self._cond:
                c = level.counters
                c["uploads"] += sum(results)
                c["uploads_existing"] += len(results) - sum(results)
                c["uploads_skipped"] += len(gone)
                c["upload_retries"] += sum(p.failed for _, p in batch)
                level.failures = 0
        finally:
            self._unjournal(level, done)
            with self._cond:
                level.inflight -= len(batch)
                level.inflight_keys.difference_update(key for key, _ in batch)
                self._cond.notify_all()

    def _unjournal(self, level: _Level, keys: list[RecordKey]) -> None:
        """Remove ``keys`` from ``level``'s journal entries. A failure only means they are
        sent again later (create-only: found present), so it is logged, not raised."""
        if self._journal is None or not keys or self._closed:  # closed: an abandoned upload ended late
            return
        try:
            self._journal.remove(level.journal_name, keys)
        except (StoreError, OSError, lmdb.Error) as e:
            log.warning("upload journal %s: could not remove %d entries (they will be re-sent): %s",
                        self._journal.path, len(keys), e)

    def _read_back(self, batch: list[tuple[RecordKey, _Pending]]) -> tuple[list[PutItem], list[RecordKey]]:
        """The batch's records as read from level 0; the keys gone from it."""
        bufs = [np.empty(p.nbytes, dtype=np.uint8) for _, p in batch]
        keys = [k for k, _ in batch]
        try:
            metas = self._near.get_many(keys, bufs)
        except ValueError:  # a record of another size under a key: read one by one, skip those
            metas = []
            for key, buf in zip(keys, bufs):
                try:
                    metas.append(self._near.get(key, buf))
                except ValueError:
                    metas.append(None)
        items = [PutItem(m.key, m.parent_hash, m.token_digest, buf) for m, buf in zip(metas, bufs) if m is not None]
        return items, [key for key, m in zip(keys, metas) if m is None]

    def _requeue(self, level: _Level, batch: list[tuple[RecordKey, _Pending]],
                 exc: BaseException) -> list[RecordKey]:
        """Put a failed batch back at the front of the queue, in order; the keys given up."""
        transient = isinstance(exc, _TRANSIENT)
        given_up: list[RecordKey] = []
        with self._cond:
            level.counters["upload_failures"] += len(batch)
            for key, p in reversed(batch):
                p.failed = True
                if not transient:
                    p.attempts += 1
                    if p.attempts >= self.max_upload_attempts:
                        level.counters["failed_uploads"] += 1
                        log.warning("store level %d (%s): giving up upload of %r after %d attempts: %s",
                                    level.index, level.where, key, p.attempts, exc)
                        given_up.append(key)
                        continue
                level.pending[key] = level.pending.pop(key, p)
                level.pending.move_to_end(key, last=False)
        return given_up

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


def _get_many(store: BlockStore, *, keys: list[RecordKey], outs: list[np.ndarray],
              token_digests: list[bytes | None]) -> list[RecordMeta | None]:
    return store.get_many(keys, outs, token_digests=token_digests)


def _wait_quietly(future: Future[Any]) -> None:
    """Wait for ``future``; its exception is not this caller's to raise."""
    try:
        future.result()
    except Exception:  # the caller raises its own error; this one is secondary
        log.debug("secondary failure while handling a level-0 write error", exc_info=True)


def _open_journal(near: BlockStore, journal: bool | str | os.PathLike[str] | None) -> UploadJournal | None:
    """The upload journal ``journal`` asks for (see :class:`StoreChain`)."""
    if journal is False:
        return None
    if journal is None or journal is True:
        path = getattr(near, "path", None)
        usable = isinstance(path, os.PathLike) and os.path.isdir(path) and not getattr(near, "readonly", False)
        if not usable:
            if journal is True:
                raise ValueError(f"journal=True: level 0 ({_where(near)}) has no local directory to hold the "
                                 f"upload journal; pass a directory or journal=False")
            return None
        return UploadJournal(path)
    if isinstance(journal, (str, os.PathLike)):
        return UploadJournal(journal)
    raise TypeError(f"journal: expected None, a bool or a directory, got {type(journal).__name__}")


def _where(store: BlockStore) -> str:
    return str(getattr(store, "where", None) or getattr(store, "path", None) or repr(store))
