"""A store chain's background thread: it uploads what far levels are owed, in batches and in
order; probes a level that is down once its backoff expires; opens a level that could not
be reached when the chain was opened; and resumes the journal an earlier process left.

A failed upload batch is requeued in order. A queued upload is never dropped silently: an
item that failed ``max_upload_attempts`` times for a reason other than an unreachable
store (``ConnectionError``), refused credentials (``PermissionError``) or a timeout is given
up (``failed_uploads``). Far puts are create-only, so two processes resuming one journal
may both send a record and nothing is overwritten (``uploads_existing``).
"""

from __future__ import annotations

import logging
import time

import lmdb
import numpy as np

from ..api.store import PutItem
from ..errors import LayoutMismatchError, StoreError
from ..format.record import RecordKey
from .levels import LEVEL_ERRORS, PROBE_KEY, RESUME_CHUNK, TRANSIENT, Level, Pending
from .writes import ChainWrites

__all__ = ["ChainScheduler"]

log = logging.getLogger(__name__)


class ChainScheduler(ChainWrites):
    """The background thread's work (see the module docstring)."""

    upload_batch: int
    max_upload_attempts: int
    _closing: bool
    _close_deadline: float

    def _next_job(self) -> tuple[Level | None, str, float | None]:
        """(level, "probe" | "resume" | "upload", None) or (None, "", seconds to wait; None:
        until notified). Caller holds the condition."""
        now = time.monotonic()
        wait: float | None = None
        for level in self._far:
            if not level.up:
                if level.down_until <= now:
                    return level, "probe", None
                wait = level.down_until - now if wait is None else min(wait, level.down_until - now)
            elif level.scan_more and len(level.pending) < min(RESUME_CHUNK, self.max_pending_uploads):
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

    def _probe(self, level: Level) -> None:
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
                level.store.contains(PROBE_KEY)
        except LEVEL_ERRORS as e:
            self._failed(level, "probe" if level.store is not None else "open", e)
            return
        with self._cond:
            level.up = True
            level.failures = 0
            level.counters["recoveries"] += 1
            pending = len(level.pending)
            self._cond.notify_all()
        log.warning("store level %d (%s) available again; %d uploads pending", level.index, level.where, pending)

    def _resume(self, level: Level) -> None:
        """Read the next chunk of ``level``'s journal entries into its queue (those not
        queued or in flight already); at the end of the pass, start another if asked."""
        assert self._journal is not None
        with self._cond:
            after = level.scan_after
            room = min(RESUME_CHUNK, self.max_pending_uploads - len(level.pending))
        entries = self._journal.scan(level.journal_name, after=after, limit=max(1, room))
        with self._cond:
            for key, nbytes in entries:
                if key not in level.pending and key not in level.inflight_keys and key not in self._writing:
                    level.pending[key] = Pending(nbytes)
                    level.counters["uploads_resumed"] += 1
            if len(entries) < max(1, room):
                level.scan_more, level.scan_again, level.scan_after = level.scan_again, False, None
            else:
                level.scan_after = entries[-1][0]
            self._cond.notify_all()

    def _upload_batch(self, level: Level) -> None:
        with self._cond:
            batch: list[tuple[RecordKey, Pending]] = []
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
            except LEVEL_ERRORS as e:
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

    def _unjournal(self, level: Level, keys: list[RecordKey]) -> None:
        """Remove ``keys`` from ``level``'s journal entries. A failure only means they are
        sent again later (create-only: found present), so it is logged, not raised."""
        if self._journal is None or not keys or self._closed:  # closed: an abandoned upload ended late
            return
        try:
            self._journal.remove(level.journal_name, keys)
        except (StoreError, OSError, lmdb.Error) as e:
            log.warning("upload journal %s: could not remove %d entries (they will be re-sent): %s",
                        self._journal.path, len(keys), e)

    def _read_back(self, batch: list[tuple[RecordKey, Pending]]) -> tuple[list[PutItem], list[RecordKey]]:
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

    def _requeue(self, level: Level, batch: list[tuple[RecordKey, Pending]],
                 exc: BaseException) -> list[RecordKey]:
        """Put a failed batch back at the front of the queue, in order; the keys given up."""
        transient = isinstance(exc, TRANSIENT)
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
