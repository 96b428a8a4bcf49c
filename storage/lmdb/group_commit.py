"""Group commit: concurrent writers of one process share one segment sync and one index commit.

Threads of one process that call ``put_many`` on one store at the same time each write
their own records first, in parallel, into a range of the segment reserved for them (see
:meth:`~tiered_kv.storage.segments.SegmentFiles.append_records`); then each hands its
written batch to a :class:`GroupCommit` and waits. One of them, the *leader*, takes every
batch queued so far (the *group*), syncs the segment once, commits the index once, and
wakes the others (*followers*) with their own results. A ``put_many`` still returns only
after its records are synced and indexed: durability is unchanged, only the syncs are
shared. Two stages, so that neither the disk nor the index waits for the other::

    writer A  [ stage + write A ]─┐
    writer B  [ stage + write B ]─┴ group 1: [ fdatasync ][ index txn ] -> wake A, B
    writer C        [ stage + write C ]───── group 2:     [ fdatasync ][ index txn ] -> wake C

A leader that synced its group takes the index stage before it hands the leadership on,
so the next leader syncs the next group while this one commits the index, and groups
commit in the order they were synced.

Errors go to the writers they belong to:

- a writer's own append fails (disk full, a payload that cannot be encoded): only that
  writer sees it, before it queues anything;
- each stage reports an outcome per batch (``sync`` and ``index`` of
  :class:`GroupCommit`): its result, its own error (an index transaction that fails for
  the group is retried batch by batch), :data:`REWRITE` (appended to a segment that a
  failed sync gave up: the writer appends it again), or the error of a failed sync for
  every batch it covered;
- :meth:`GroupCommit.close` fails the queued batches with the store's "closed" error and
  waits for the groups being committed.

Fault injection: each :class:`FaultPoint` of a write is a point of the store's
:class:`~tiered_kv.storage.os.faults.Faults` (``store.faults``), so tests kill or pause a
process at an exact step of a group (tests/storage/test_group_commit.py) instead of
sleeping and hoping.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..os.faults import Faults

__all__ = ["REWRITE", "SYNCED", "FaultPoint", "GroupCommit"]

W = TypeVar("W")   # one writer's batch (the store's type)


class FaultPoint(enum.Enum):
    """The steps of an LMDB store's writes where its faults are hit (``store.faults``)."""

    RESERVE = "reserve"    # segment space about to be reserved for a batch (info: bytes)
    STAGED = "staged"      # one record of a writer's batch staged (info: its index in the batch)
    APPENDED = "appended"  # a writer's records are written to the segment, not synced (info: batch)
    ENQUEUED = "enqueued"  # a writer queued its written batch for a commit (info: batch)
    LEAD = "lead"          # a writer leads the next commit, before it takes the queue
    SYNCED = "synced"      # the group's segments synced, the index not committed (info: group size)
    INDEXING = "indexing"  # the group's index stage begins (info: its batches)
    INDEX_TXN = "index-txn"      # an index transaction indexes batches (info: them); in the transaction
    INDEX_BATCH = "index-batch"  # one batch's records are indexed (info: their key bytes); in the transaction
    INDEXED = "indexed"    # the index committed, the followers not woken (info: group size)
    CLOSING = "closing"    # close() failed the queued batches; it waits for the group in commit


class _Rewrite:
    def __repr__(self) -> str:
        return "REWRITE"


#: A commit outcome: the batch was not stored; its writer appends it again and resubmits.
REWRITE: Any = _Rewrite()


class _Synced:
    def __repr__(self) -> str:
        return "SYNCED"


#: A sync-stage outcome: the batch is synced and goes on to the index stage.
SYNCED: Any = _Synced()


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
    """Leader/follower commit queue with two stages.

    ``sync(batches) -> outcomes``: makes a group durable; one outcome per batch:
    :data:`SYNCED` (on to ``index``), an exception (raised to that writer only) or
    :data:`REWRITE`. ``index(batches) -> outcomes``: commits the synced batches of a
    group, in group order; one outcome per batch: its result or an exception. If a stage
    raises, every batch it was given gets that exception. ``closed_error()``: the
    exception of a write to a closed store. ``faults``: where its points are hit (the
    store's).
    """

    def __init__(self, *, sync: Callable[[list[W]], Sequence[Any]], index: Callable[[list[W]], Sequence[Any]],
                 closed_error: Callable[[], BaseException], faults: Faults | None = None) -> None:
        self._sync = sync
        self._index = index
        self._closed_error = closed_error
        self._cond = threading.Condition()
        self._queue: deque[_Queued[W]] = deque()
        self._leading = False               # a leader takes and syncs the next group
        self._indexing = 0                  # groups in (or waiting for) the index stage
        self._index_stage = threading.Lock()
        self._closed = False
        self.faults = Faults() if faults is None else faults
        #: groups committed and the batches in them (lifetime of this object)
        self.groups = 0
        self.batches = 0

    def hook(self, point: FaultPoint, info: Any = None) -> None:
        """``point`` is reached (see :class:`~tiered_kv.storage.os.faults.Faults`)."""
        self.faults.hit(point, info)

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
        """Take every queued batch as one group and commit it (the caller holds the
        leadership; it hands it on once the group is synced and in the index stage)."""
        group: list[_Queued[W]] = []
        outcomes: list[Any] = []
        handed_on = False
        try:
            self.hook(FaultPoint.LEAD)
            with self._cond:
                group = list(self._queue)
                self._queue.clear()
                for q in group:
                    q.state = _State.TAKEN
            if group:
                outcomes = self._stage(self._sync, group)
                synced = [j for j, outcome in enumerate(outcomes) if outcome is SYNCED]
                if synced:
                    with self._cond:
                        self._indexing += 1
                    self._index_stage.acquire()  # before the next leader may sync: commits stay in order
                    try:
                        with self._cond:
                            self._leading, handed_on = False, True
                            self._cond.notify_all()
                        for j, outcome in zip(synced, self._stage(self._index, [group[j] for j in synced])):
                            outcomes[j] = outcome
                    finally:
                        self._index_stage.release()
                        with self._cond:
                            self._indexing -= 1
        finally:
            self._finish(group, outcomes, leading=not handed_on)

    @staticmethod
    def _stage(fn: Callable[[list[W]], Sequence[Any]], group: list[_Queued[W]]) -> list[Any]:
        try:
            outcomes = list(fn([q.batch for q in group]))
        except BaseException as e:  # the whole group's failure (e.g. its sync)
            return [e] * len(group)
        if len(outcomes) != len(group):
            return [AssertionError(f"{len(outcomes)} outcomes for {len(group)} batches")] * len(group)
        return outcomes

    def _finish(self, group: list[_Queued[W]], outcomes: list[Any], *, leading: bool) -> None:
        """Hand each batch its outcome and wake every writer (``leading``: give up the
        leadership too)."""
        with self._cond:
            if len(outcomes) != len(group):  # the fault hook raised before the group's outcomes
                outcomes = [RuntimeError("group commit: the leader failed before this batch's outcome")] * len(group)
            for q, outcome in zip(group, outcomes):
                if isinstance(outcome, BaseException):
                    q.error = outcome
                elif outcome is SYNCED:  # (never left so: index outcomes replace it)
                    q.error = AssertionError("group commit: a synced batch was not indexed")
                else:
                    q.result = outcome
                q.state = _State.DONE
            if group:
                self.groups += 1
                self.batches += len(group)
            if leading:
                self._leading = False
            self._cond.notify_all()

    def close(self) -> None:
        """Refuse new batches, fail the queued ones with the closed error, and wait for
        the groups being committed. Idempotent."""
        with self._cond:
            self._closed = True
            while self._queue:
                q = self._queue.popleft()
                q.error, q.state = self._closed_error(), _State.DONE
            self._cond.notify_all()
        self.hook(FaultPoint.CLOSING)
        with self._cond:
            while self._leading or self._indexing:
                self._cond.wait()
