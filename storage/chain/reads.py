"""A store chain's reads: nearest level first; a record found in a farther level is read
into a buffer of the chain's own, copied into the caller's, and *promoted*: written into
level 0 and queued for the levels in between, by a background thread (write-behind), so a
far hit costs the request the fetch only. Past ``max_pending_promotions`` records waiting,
a promotion is written on the request path instead (back-pressure, never dropped)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..api.store import BlockStore, PutItem, check_open
from ..errors import StoreError
from ..format.record import RecordKey, RecordKind, RecordMeta, write_segments
from .levels import SKIPPED, Level
from .writes import ChainWrites

__all__ = ["ChainReads", "get_many_of"]

log = logging.getLogger(__name__)


class ChainReads(ChainWrites):
    """get_many, contains and promotions (see the module docstring)."""

    max_pending_promotions: int
    _pending_promotions: int
    _promoter: ThreadPoolExecutor

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
            got = self._call_far(level, "get", functools.partial(get_many_of, keys=want, outs=bufs,
                                                                 token_digests=want_digests))
            if got is SKIPPED:
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

    def _promote(self, source: Level, found: list[tuple[int, RecordMeta, np.ndarray]]) -> None:
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

    def _write_promotions(self, source: Level, items: list[PutItem]) -> None:
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
                    self._journal_add, [level.journal_name for level in between],
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
            if answer is SKIPPED:
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
        return None if answer is SKIPPED else [bool(f) for f in answer]



def get_many_of(store: BlockStore, *, keys: list[RecordKey], outs: list[np.ndarray],
              token_digests: list[bytes | None]) -> list[RecordMeta | None]:
    return store.get_many(keys, outs, token_digests=token_digests)
