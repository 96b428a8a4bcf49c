"""A store chain's writes: to level 0 at once, journaled (when level 0 has a directory) and
queued for every farther level; and the eviction guard that keeps level 0 from evicting
what a far level still needs.

The queue holds keys, not payloads: an upload reads the record back from level 0
(:mod:`.scheduler`), so the queue's memory is small and an upload always sends what level 0
verified. ``put_many`` adds its keys to the journal (:mod:`.journal`) in one fsynced
transaction per call, committed on a helper thread while level 0 writes the records, and
queues them once both are durable.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import lmdb

from ..api.store import BlockStore, PutItem, check_open
from ..errors import StoreError
from ..format.record import RecordKey, RecordKind
from ..os.faults import Faults
from .journal import UploadJournal
from .levels import SKIPPED, ChainHealth, ChainPoint, Level, Pending, where_of

__all__ = ["ChainWrites", "open_journal", "wait_quietly"]

log = logging.getLogger(__name__)


class ChainWrites(ChainHealth):
    """put_many, the upload queues and journal, resync (see the module docstring)."""

    faults: Faults
    where: str
    max_pending_uploads: int
    last_journal_error: str | None
    journal_path: Any
    _journal_io: ThreadPoolExecutor

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
                self._journal_add, [level.journal_name for level in self._far], list(zip(keys, sizes)))
            try:
                results = self._near.put_many(items)
            except BaseException:
                if journaled is not None:  # journaled, maybe not written: the journal pass sorts them out
                    wait_quietly(journaled)
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

    def _journal_add(self, levels: list[str], entries: list[tuple[RecordKey, int]]) -> None:
        """Journal ``entries`` (key, payload bytes) as owed to ``levels`` (one commit)."""
        assert self._journal is not None
        self.faults.hit(ChainPoint.JOURNAL_ADD, entries)
        self._journal.add(levels, entries)

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

    def _rescan(self, level: Level) -> None:
        """Have the background thread read ``level``'s journal (again): it holds entries
        not in memory. Caller holds the condition."""
        if level.scan_more:
            level.scan_again = True
        else:
            level.scan_more, level.scan_after = True, None
        self._cond.notify_all()

    def _enqueue(self, level: Level, key: RecordKey, nbytes: int) -> None:
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
        level.pending[key] = Pending(nbytes)
        self._cond.notify_all()

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
            # a far level's listing is of its stored names (an encrypted level's are keyed):
            # the local keys are compared by the names that level gives them
            listed = self._call_far(level, "list", lambda s: (s, set(s.names())))
            if listed is SKIPPED:
                out["levels_skipped"] += 1
                continue
            far, names = listed
            missing = [key for key in local if far.name_of(key) not in names]
            out["present"] += len(local) - len(missing)
            sizes = ([payload_bytes[key.kind] for key in missing] if payload_bytes is not None
                     else self._near.payload_sizes(missing))
            owed = [(key, n) for key, n in zip(missing, sizes) if n is not None]  # (None: gone meanwhile)
            out["queued"] += len(owed)
            if self._journal is not None:
                self._journal_add([level.journal_name], owed)
            with self._cond:
                for key, n in owed:
                    self._enqueue(level, key, n)
        return out



def wait_quietly(future: Future[Any]) -> None:
    """Wait for ``future``; its exception is not this caller's to raise."""
    try:
        future.result()
    except Exception:  # the caller raises its own error; this one is secondary
        log.debug("secondary failure while handling a level-0 write error", exc_info=True)


def open_journal(near: BlockStore, journal: bool | str | os.PathLike[str] | None) -> UploadJournal | None:
    """The upload journal ``journal`` asks for (see :class:`StoreChain`)."""
    if journal is False:
        return None
    if journal is None or journal is True:
        path = near.path
        usable = isinstance(path, os.PathLike) and os.path.isdir(path) and not near.readonly
        if not usable:
            if journal is True:
                raise ValueError(f"journal=True: level 0 ({where_of(near)}) has no local directory to hold the "
                                 f"upload journal; pass a directory or journal=False")
            return None
        return UploadJournal(path)
    if isinstance(journal, (str, os.PathLike)):
        return UploadJournal(journal)
    raise TypeError(f"journal: expected None, a bool or a directory, got {type(journal).__name__}")
