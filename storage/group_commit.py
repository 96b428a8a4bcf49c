"""Group commit: concurrent writers of one process share one segment sync and one index commit.

Threads of one process that call ``put_many`` on one store at the same time each write
their own records first, in parallel, into a range of the segment reserved for them (see
:meth:`~tiered_kv.storage.segments.SegmentFiles.append_records`); then each hands its
written batch to a :class:`GroupCommit` and waits. One of them, the *leader*, takes every
batch queued so far (the *group*), syncs the segment once, commits the index once, and
wakes the others (*followers*) with their own results. A ``put_many`` still returns only
after its records are synced and indexed: durability is unchanged, only the syncs are
shared. While a leader syncs, the next writers are already writing::

    writer A   [ stage + write A ]─┐
    writer B   [ stage + write B ]─┴─ group 1: [ fdatasync + index txn ] -> wake A, B
    writer C         [ stage + write C ]──────── group 2:                 [ sync + index ] -> wake C

Errors go to the writers they belong to:

- a writer's own append fails (disk full, a payload that cannot be encoded): only that
  writer sees it, before it queues anything;
- the commit reports an outcome per batch (see ``commit`` of :class:`GroupCommit`): its
  result, its own error (an index transaction that fails for the group is retried batch
  by batch), :data:`REWRITE` (appended to a segment that a failed sync gave up: the
  writer appends it again), or the group's error (a failed sync) for every member;
- :meth:`GroupCommit.close` fails the queued batches with the store's "closed" error and
  waits for the group being committed.

Fault injection: :attr:`GroupCommit.fault` (None in production) is called at each
:class:`FaultPoint`, so tests kill or pause a process at an exact step of a group
(tests/storage/test_group_commit.py) instead of sleeping and hoping.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["REWRITE", "FaultPoint", "GroupCommit"]

W = TypeVar("W")   # one writer's batch (the store's type)


class FaultPoint(enum.Enum):
    """The steps of a write where :attr:`GroupCommit.fault` is called."""

    STAGED = "staged"      # one record of a writer's batch staged (info: its index in the batch)
    APPENDED = "appended"  # a writer's records are written to the segment, not synced (info: batch)
    ENQUEUED = "enqueued"  # a writer queued its written batch for a commit (info: batch)
    LEAD = "lead"          # a writer leads the next commit, before it takes the queue
    SYNCED = "synced"      # the group's segments synced, the index not committed (info: group size)
    INDEXED = "indexed"    # the index committed, the followers not woken (info: group size)
    CLOSING = "closing"    # close() failed the queued batches; it waits for the group in commit


class _Rewrite:
    def __repr__(self) -> str:
        return "REWRITE"


#: A commit outcome: the batch was not stored; its writer appends it again and resubmits.
REWRITE: Any = _Rewrite()


class _State(enum.Enum):
    QUEUED = 1
    TAKEN = 2
    DONE = 3


@dataclass(eq=False, slots=True)
class _Queued(Generic[W]):
    batch: W
    state: _State = _State.QUEUED
    result: Any = None
    error: BaseException | None = None


class GroupCommit(Generic[W]):
    """Leader/follower commit queue.

    ``commit(batches) -> outcomes``: syncs and indexes a group; one outcome per batch:
    its result, an exception (raised to that writer only) or :data:`REWRITE`; if it
    raises, every batch of the group gets that exception. ``closed_error()``: the
    exception of a write to a closed store.
    """

    def __init__(self, *, commit: Callable[[list[W]], Sequence[Any]],
                 closed_error: Callable[[], BaseException]) -> None:
        self._commit = commit
        self._closed_error = closed_error
        self._cond = threading.Condition()
        self._queue: deque[_Queued[W]] = deque()
        self._leading = False
        self._closed = False
        #: fault-injection hook ``fault(point, info)``; None in production
        self.fault: Callable[[FaultPoint, Any], None] | None = None
        #: groups committed and the batches in them (lifetime of this object)
        self.groups = 0
        self.batches = 0

    def hook(self, point: FaultPoint, info: Any = None) -> None:
        """Call the fault hook, if any, at ``point``."""
        if self.fault is not None:
            self.fault(point, info)

    def queued(self) -> int:
        """Batches waiting for a leader (tests: wait until a group can be formed)."""
        with self._cond:
            return len(self._queue)

    def submit(self, batch: W) -> Any:
        """Queue ``batch`` (its records already written) and return its outcome once a
        group committed it, leading that group if no commit is under way; raises its
        error, or the closed error if the store closed before its turn."""
        q = _Queued(batch)
        with self._cond:
            if self._closed:
                raise self._closed_error()
            self._queue.append(q)
        self.hook(FaultPoint.ENQUEUED, batch)
        with self._cond:
            while True:
                while q.state is not _State.DONE and (self._leading or q.state is not _State.QUEUED):
                    self._cond.wait()
                if q.state is _State.DONE:
                    break
                self._leading = True
                self._cond.release()
                try:
                    self._lead()
                finally:
                    self._cond.acquire()
        if q.error is not None:
            raise q.error
        return q.result

    def _lead(self) -> None:
        """Commit every queued batch as one group (the caller holds the leadership)."""
        group: list[_Queued[W]] = []
        outcomes: list[Any] = []
        try:
            self.hook(FaultPoint.LEAD)
            with self._cond:
                group = list(self._queue)
                self._queue.clear()
                for q in group:
                    q.state = _State.TAKEN
            if group:
                try:
                    outcomes = list(self._commit([q.batch for q in group]))
                except BaseException as e:  # the whole group's failure (e.g. its sync)
                    outcomes = [e] * len(group)
        finally:
            with self._cond:
                if len(outcomes) != len(group):  # a broken commit callback, or the hook raised
                    err = RuntimeError(f"group commit: {len(outcomes)} outcomes for {len(group)} batches")
                    outcomes = [err] * len(group)
                for q, outcome in zip(group, outcomes):
                    if isinstance(outcome, BaseException):
                        q.error = outcome
                    else:
                        q.result = outcome
                    q.state = _State.DONE
                if group:
                    self.groups += 1
                    self.batches += len(group)
                self._leading = False
                self._cond.notify_all()

    def close(self) -> None:
        """Refuse new batches, fail the queued ones with the closed error, and wait for
        the group being committed. Idempotent."""
        with self._cond:
            self._closed = True
            while self._queue:
                q = self._queue.popleft()
                q.error, q.state = self._closed_error(), _State.DONE
            self._cond.notify_all()
        self.hook(FaultPoint.CLOSING)
        with self._cond:
            while self._leading:
                self._cond.wait()
