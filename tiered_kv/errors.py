"""Exceptions of the cache facade."""

from __future__ import annotations

__all__ = ["CacheFullError"]


class CacheFullError(RuntimeError):
    """A pool has no room left for what a request needs (blocks or a state slot).

    Expected under load: a serving loop catches it, preempts or queues a request, and
    retries after others close.
    """
