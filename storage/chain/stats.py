"""What a store chain's ``stats()`` reports: level 0's figures, the chain's own counters, and
each level's health and counters."""

from __future__ import annotations

import time
from typing import Any

from ..api.store import check_open
from .levels import LEVEL_ERRORS, ChainHealth, Level

__all__ = ["ChainStats"]


class ChainStats(ChainHealth):
    """:meth:`stats` (see its docstring)."""

    where: str
    layout_fingerprint: str
    journal_path: Any
    _pending_promotions: int

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
            store_stats, info = self._level_stats(level, near, journaled, now)
            corrupt += int(store_stats.get("corrupt") or 0)
            auth_failures += int(store_stats.get("auth_failures") or 0)
            per_level.append(info)
            for k, v in {**store_stats, **info}.items():
                if isinstance(v, (int, float)):  # bools as 0 / 1
                    out[f"level{level.index}_{k}"] = int(v) if isinstance(v, bool) else v
        with self._cond:
            out.update(self._counters)
            out["pending_promotions"] = self._pending_promotions
        out["corrupt"] = corrupt
        out["auth_failures"] = auth_failures
        out["journal"] = None if self.journal_path is None else str(self.journal_path)
        out.update(_far_totals(per_level[1:]))
        out["levels"] = per_level
        return out

    def _level_stats(self, level: Level, near: dict[str, Any], journaled: dict[int, int], now: float
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(the level's store's stats, what stats() reports of the level)``."""
        store_stats: dict[str, Any] = near if level.index == 0 else {}
        stats_error = None
        if level.index > 0 and level.store is not None:
            try:
                store_stats = level.store.stats()
            except LEVEL_ERRORS as e:
                stats_error = f"{type(e).__name__}: {e}"
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
        return store_stats, info


def _far_totals(far: list[dict[str, Any]]) -> dict[str, int]:
    """The upload and health counters summed over the far levels' reports."""
    out = {name: sum(info[name] for info in far)
           for name in ("uploads", "uploads_existing", "upload_failures", "upload_retries", "pending_uploads",
                        "dropped_uploads", "failed_uploads", "uploads_skipped", "timeouts", "auth_errors",
                        "journaled_uploads", "uploads_resumed", "deferred_uploads")}
    out["level_unavailable"] = sum(info["unavailable"] for info in far)
    out["level_errors"] = sum(info["errors"] for info in far)
    out["levels_down"] = sum(not info["up"] for info in far)
    return out
