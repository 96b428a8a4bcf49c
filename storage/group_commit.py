"""Group commit: concurrent writers of one process share one segment sync and one index commit.

Threads of one process that call ``put_many`` on one store at the same time each hand
their batch to a :class:`GroupCommit` and wait. One of them, the *leader*, takes every
batch queued so far (the *group*), appends all their records to the segment at once,
syncs the segment once, commits the index once, then wakes the others (*followers*) with
their own results. A ``put_many`` still returns only after its records are synced and
indexed: durability is unchanged, only the syncs are shared.

Two stages, so that the disk never waits for a sync to be written to::

    group 1   [ append: stage + write ] [ commit: fdatasync + index txn ] -> wake
    group 2                             [ append: stage + write ]  [ commit ... ] -> wake
                                          ^ the next leader appends while group 1 syncs

The append stage is held by one leader at a time; a leader takes the commit stage before
it lets the next leader append, so groups commit in the order they were appended (the
index's ``segment_end`` only ever moves past bytes that are indexed or given up).

Errors go to the writers they belong to:

- the append of a group of several batches fails (disk full, a payload that cannot be
  encoded): nothing of it is kept, and each batch is queued again on its own (*solo*),
  so only the batches that fail alone see an error;
- the commit stage reports an outcome per batch (see ``commit`` of :class:`GroupCommit`):
  a result, the error of that batch, or :data:`REQUEUE` (appended to a segment that a
  failed sync gave up: written again, later);
- :meth:`GroupCommit.close` fails the queued batches with the store's "closed" error and
  waits for the groups already taken.

Fault injection: :attr:`GroupCommit.fault` (None in production) is called at each
:class:`FaultPoint`, so tests kill or pause a writer at an exact step of a group (see
tests/storage/test_group_commit.py) instead of sleeping and hoping.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["REQUEUE", "FaultPoint", "GroupCommit", "Queued"]

W = TypeVar("W")   # one writer's batch (the store's type)
A = TypeVar("A")   # what the append stage hands to the commit stage


class FaultPoint(enum.Enum):
    """The steps of a group where :attr:`GroupCommit.fault` is called."""

    ENQUEUED = "enqueued"  # a writer queued its batch (in its own thread)
    LEAD = "lead"          # a writer leads the next group, before it takes the queue
    STAGED = "staged"      # one record of the group staged (info: its index in the group)
    APPENDED = "appended"  # every record of the group written to the segment, not synced
    SYNCED = "synced"      # the segment synced, the index not committed
    INDEXED = "indexed"    # the index committed, the followers not woken
    CLOSING = "closing"    # close() failed the queued batches; it waits for the groups taken


class _Requeue:
    def __repr__(self) -> str:
        return "REQUEUE"


#: A commit outcome: the batch was not stored and goes back to the queue (alone).
REQUEUE: Any = _Requeue()


class _State(enum.Enum):
    QUEUED = 1
    TAKEN = 2
    DONE = 3


@dataclass(eq=False, slots=True)
class Queued(Generic[W]):
    """One writer's batch in the queue, and then its outcome."""

    batch: W
    nbytes: int
    solo: bool = False
    state: _State = _State.QUEUED
    result: Any = None
    error: BaseException | None = None
    #: groups led while this batch waited (tests and stats: how often it was shared)
    group_size: int = field(default=0)


class GroupCommit(Generic[W, A]):
    """Leader/follower group commit over two callbacks of the store.

    ``append(batches) -> A``: the append stage of a group (records staged and written,
    not synced); raises if nothing of it may be kept (having undone its writes).
    ``commit(appended, batches) -> outcomes``: the commit stage (sync, index commit); one
    outcome per batch: its result, an exception (raised to that writer only) or
    :data:`REQUEUE`. ``closed_error()``: the exception of a write to a closed store.
    ``max_group_bytes``: a leader takes batches up to about this many bytes (always one).
    """

    def __init__(self, *, append: Callable[[list[W]], A],
                 commit: Callable[[A, list[W]], Sequence[Any]],
                 closed_error: Callable[[], BaseException], max_group_bytes: int) -> None:
        self._append = append
        self._commit = commit
        self._closed_error = closed_error
        self.max_group_bytes = max_group_bytes
        self._cond = threading.Condition()
        self._queue: deque[Queued[W]] = deque()
        self._appending = False            # a leader holds the append stage
        self._taken = 0                    # groups taken and not finished
        self._commit_stage = threading.Lock()
        self._closed = False
        #: fault-injection hook ``fault(point, info)``; None in production
        self.fault: Callable[[FaultPoint, Any], None] | None = None
        #: groups committed and batches in them (lifetime of this object)
        self.groups = 0
        self.batches = 0

    # ------------------------------------------------------------------ writers
    def submit(self, batch: W, nbytes: int) -> Any:
        """Queue ``batch`` (``nbytes`` to append) and return its result once it is
        committed, leading groups while it waits; raises its own error."""
        q = Queued(batch, nbytes)
        with self._cond:
            if self._closed:
                raise self._closed_error()
            self._queue.append(q)
        self._hook(FaultPoint.ENQUEUED, batch)
        while True:
            with self._cond:
                while q.state is not _State.DONE and (self._appending or q.state is not _State.QUEUED):
                    self._cond.wait()
                if q.state is _State.DONE:
                    break
                self._appending = True
                self._taken += 1
            self._lead()
        if q.error is not None:
            raise q.error
        return q.result

    def _hook(self, point: FaultPoint, info: Any = None) -> None:
        if self.fault is not None:
            self.fault(point, info)

    def hook(self, point: FaultPoint, info: Any = None) -> None:
        """Call the fault hook at ``point`` (for the stages the callbacks run)."""
        self._hook(point, info)

    def queued(self) -> int:
        """Batches waiting for a leader (tests: wait until a group can be formed)."""
        with self._cond:
            return len(self._queue)

    # ------------------------------------------------------------------ the leader
    def _take(self) -> list[Queued[W]]:
        """The next group, from the front of the queue (under the lock): one solo batch,
        or batches up to ``max_group_bytes`` (at least one)."""
        group: list[Queued[W]] = []
        nbytes = 0
        while self._queue:
            q = self._queue[0]
            if group and (q.solo or nbytes + q.nbytes > self.max_group_bytes):
                break
            self._queue.popleft()
            q.state = _State.TAKEN
            group.append(q)
            nbytes += q.nbytes
            if q.solo:
                break
        return group

    def _lead(self) -> None:
        """Lead one group through both stages (holding the append stage on entry)."""
        group: list[Queued[W]] = []
        outcomes: list[Any] = []
        try:
            group, failed, appended = self._append_stage()
            if failed is not None:
                outcomes = failed
            else:  # appended: this leader holds the commit stage
                try:
                    outcomes = self._commit_stage_of(appended, group)
                finally:
                    self._commit_stage.release()
        finally:
            self._finish(group, outcomes)

    def _append_stage(self) -> tuple[list[Queued[W]], list[Any] | None, Any]:
        """Take a group and append it. Returns ``(group, outcomes, None)`` when it is done
        already (nothing to append, or the append failed), else ``(group, None,
        appended)`` holding the commit stage. Releases the append stage."""
        try:
            self._hook(FaultPoint.LEAD)
            with self._cond:
                group = self._take()
            if not group:
                return group, [], None
            try:
                appended = self._append([q.batch for q in group])
            except BaseException as e:
                if len(group) == 1:
                    return group, [e], None
                for q in group:  # maybe one batch's fault: each tries again alone
                    q.solo = True
                return group, [REQUEUE] * len(group), None
            self._commit_stage.acquire()  # before the next leader may append: commits stay in order
            return group, None, appended
        finally:
            with self._cond:
                self._appending = False
                self._cond.notify_all()

    def _commit_stage_of(self, appended: Any, group: list[Queued[W]]) -> list[Any]:
        try:
            outcomes = list(self._commit(appended, [q.batch for q in group]))
        except BaseException as e:  # a failure of the whole group (e.g. the sync)
            return [e] * len(group)
        if len(outcomes) != len(group):
            err = AssertionError(f"commit returned {len(outcomes)} outcomes for {len(group)} batches")
            return [err] * len(group)
        return outcomes

    def _finish(self, group: list[Queued[W]], outcomes: list[Any]) -> None:
        """Hand each batch its outcome (or queue it again), wake every writer."""
        with self._cond:
            requeue = []
            if len(outcomes) != len(group):  # the leader itself failed (e.g. a fault hook raised)
                outcomes = [RuntimeError("group commit: the leader failed before this batch's outcome")] * len(group)
            for q, outcome in zip(group, outcomes):
                q.group_size = len(group)
                if outcome is REQUEUE:
                    if self._closed:
                        q.error, q.state = self._closed_error(), _State.DONE
                    else:
                        q.state = _State.QUEUED
                        requeue.append(q)
                elif isinstance(outcome, BaseException):
                    q.error, q.state = outcome, _State.DONE
                else:
                    q.result, q.state = outcome, _State.DONE
            self._queue.extendleft(reversed(requeue))  # first in line again, in their order
            if group:
                self.groups += 1
                self.batches += len(group)
            self._taken -= 1
            self._cond.notify_all()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Refuse new batches, fail the queued ones with the closed error, and wait for
        the groups already taken to finish. Idempotent."""
        with self._cond:
            self._closed = True
            while self._queue:
                q = self._queue.popleft()
                q.error, q.state = self._closed_error(), _State.DONE
            self._cond.notify_all()
        self._hook(FaultPoint.CLOSING)
        with self._cond:
            while self._taken or self._appending:
                self._cond.wait()
