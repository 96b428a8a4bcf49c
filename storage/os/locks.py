"""Locks of one process: a shared/exclusive lock, and the store directories open here."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import StoreLockedError

__all__ = ["OpenRegistry", "SharedExclusiveLock"]


class SharedExclusiveLock:
    """Many holders in ``shared()`` or one in ``exclusive()`` (e.g. LMDB map resizing)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            self._cond.wait_for(lambda: self._shared == 0)
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class OpenRegistry:
    """The store directories open in this process, by (st_dev, st_ino)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: set[tuple[int, int]] = set()

    def claim(self, path: Path) -> tuple[int, int]:
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino)
        with self._lock:
            if ident in self._open:
                raise StoreLockedError(f"{path}: this store is already open in this process; "
                                       f"share the open store object instead of opening it twice")
            self._open.add(ident)
        return ident

    def release(self, ident: tuple[int, int]) -> None:
        with self._lock:
            self._open.discard(ident)
