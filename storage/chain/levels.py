"""The levels of a store chain and their health: a far level that fails is marked down,
skipped by requests, and probed again when its backoff expires.

Every request-path call into a far level runs on a worker thread and is abandoned after
``timeout_s``: the caller gets a miss, and a late answer lands in the chain's private
buffer, never in the caller's. A failed or timed-out call marks the level *down*; requests
skip it (counted ``level_unavailable``) and uploads wait. When its backoff expires
(``backoff_initial_s``, doubling per consecutive failure up to ``backoff_max_s``) the
background thread probes it (:mod:`.scheduler`); a good probe brings it back.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from ..api.store import BlockStore
from ..errors import StoreError
from ..format.record import RecordKey, RecordKind
from .journal import UploadJournal, level_name

__all__ = ["DEFAULT_TIMEOUT_S", "LEVEL_COUNTERS", "LEVEL_ERRORS", "PROBE_KEY", "RESUME_CHUNK", "SKIPPED", "TRANSIENT",
           "ChainHealth", "ChainPoint", "DeferredLevel", "Level", "Pending", "where_of"]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
#: A key no record has (the probe of a down level asks for it).
PROBE_KEY = RecordKey(RecordKind.BLOCK, hashlib.sha256(b"tiered_kv.chain: probe, never stored").digest())
#: What a far level raises when it fails (as opposed to bad input, which propagates).
LEVEL_ERRORS = (StoreError, OSError)
#: Failures of the level as a whole, not of an item: they do not use up an item's attempts.
TRANSIENT = (ConnectionError, PermissionError, TimeoutError)
SKIPPED = object()
#: Journal entries read into a level's memory queue per background step.
RESUME_CHUNK = 256


class ChainPoint(enum.Enum):
    """The steps of a chain where its faults are hit (``chain.faults``)."""

    JOURNAL_ADD = "journal-add"  # uploads about to be journaled (info: their (key, bytes) entries)


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
class Pending:
    nbytes: int
    attempts: int = 0       # failures of this item while its level was up
    failed: bool = False    # failed at least once (its next try counts as a retry)


LEVEL_COUNTERS = ("hits", "misses", "timeouts", "errors", "auth_errors", "unavailable", "uploads",
                   "uploads_existing", "upload_failures", "upload_retries", "dropped_uploads",
                   "failed_uploads", "uploads_skipped", "promotions_in", "recoveries", "uploads_resumed",
                   "deferred_uploads")


@dataclass(eq=False)
class Level:
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
    pending: OrderedDict[RecordKey, Pending] = field(default_factory=OrderedDict)
    inflight: int = 0
    inflight_keys: set[RecordKey] = field(default_factory=set)
    # The journal pass that loads this level's entries into ``pending`` (see _resume):
    scan_more: bool = False                 # a pass is due or under way
    scan_again: bool = False                # start another pass after this one
    scan_after: RecordKey | None = None     # where the pass stands (key order)

    @property
    def journal_name(self) -> str:
        return level_name(self.where)
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVEL_COUNTERS, 0))


def where_of(store: BlockStore) -> str:
    """How a level is named in stats and messages."""
    return store.where


class ChainHealth:
    """The state a chain's parts share (set by :class:`~.store.StoreChain`), and the
    health of its levels."""

    _cond: threading.Condition
    _levels: list[Level]
    _far: list[Level]
    _near: BlockStore
    _pool: ThreadPoolExecutor
    _journal: UploadJournal | None
    _counters: dict[str, int]
    _writing: dict[RecordKey, int]
    _closed: bool
    timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float

    def _usable(self, level: Level) -> bool:
        return level.up and level.store is not None

    def _failed(self, level: Level, what: str, exc: BaseException | None = None, *, timeout: bool = False) -> None:
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

    def _call_far(self, level: Level, what: str, fn: Callable[[BlockStore], Any]) -> Any:
        """``fn(level's store)`` on a worker thread, bounded by ``timeout_s``; ``SKIPPED``
        when the level is down, failed or too slow (and then marked down)."""
        with self._cond:
            if not self._usable(level):
                level.counters["unavailable"] += 1
                return SKIPPED
            store = level.store
        assert store is not None
        future = self._pool.submit(fn, store)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            if not future.done():
                future.cancel()
                self._failed(level, what, timeout=True)
                return SKIPPED
            exc = future.exception()  # the store itself raised a TimeoutError
            self._failed(level, what, exc)
        except LEVEL_ERRORS as e:
            self._failed(level, what, e)
        return SKIPPED
