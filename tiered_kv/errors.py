"""Exceptions of the cache facade."""

from __future__ import annotations

__all__ = ["CacheFullError", "CacheShutdownError"]


class CacheFullError(RuntimeError):
    """A pool has no room left for what a request needs (blocks or a state slot).

    Expected under load: a serving loop catches it, preempts or queues a request, and
    retries after others close.
    """


class CacheShutdownError(RuntimeError):
    """The cache was shut down (:meth:`TieredKVCache.shutdown`): its disk tier is closed, so
    it opens, closes and writes no more requests. Create a new cache to go on."""
