"""Read descriptors of segment files, shared by the threads of one store (an LRU cache)."""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from .schema import segment_name

__all__ = ["DEFAULT_MAX_OPEN_SEGMENTS", "DirectUnsupported", "OpenFd", "OpenSegments"]


class DirectUnsupported(Exception):
    """The filesystem refuses ``O_DIRECT`` for this file (EINVAL at open)."""


#: Read descriptors of segment files kept open at most (idle ones; see OpenSegments).
DEFAULT_MAX_OPEN_SEGMENTS = 128


class OpenFd:
    """One open descriptor: its users now, and whether it may still be handed out."""

    __slots__ = ("fd", "users", "alive")

    def __init__(self, fd: int) -> None:
        self.fd, self.users, self.alive = fd, 0, True


class OpenSegments:
    """Read descriptors of segment files, shared by the threads of one store: at most
    ``limit`` kept open, the least recently used idle one closed first (a 2 TiB store of
    256 MiB segments would otherwise hold about 16,000 descriptors, two per segment).

    A descriptor is closed only once no caller uses it: a number closed under a reader
    could be handed to another file meanwhile. So the bound is exceeded only while more
    than ``limit`` descriptors are in use at once (a read holds one per extent in flight:
    at most its I/O threads)."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder = folder
        self.limit = limit
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[int, bool], OpenFd] = OrderedDict()  # (segment, O_DIRECT) -> fd

    @contextmanager
    def use(self, seg: int, *, direct: bool) -> Iterator[int]:
        """A read fd of segment ``seg`` for the ``with`` block (FileNotFoundError once gc
        unlinked it; DirectUnsupported where the filesystem refuses O_DIRECT)."""
        entry = self.acquire(seg, direct)
        try:
            yield entry.fd
        finally:
            self.release(entry)

    @contextmanager
    def use_many(self, segs: Sequence[int]) -> Iterator[dict[int, int]]:
        """Buffered read fds of the segments ``segs`` for the ``with`` block, as
        ``{segment: fd}``; a segment that cannot be opened (gc unlinked it, no descriptor
        to spare) is left out, so its records are misses."""
        entries: dict[int, OpenFd] = {}
        try:
            for seg in segs:
                try:
                    entries[seg] = self.acquire(seg, False)
                except OSError:
                    continue
            yield {seg: e.fd for seg, e in entries.items()}
        finally:
            for e in entries.values():
                self.release(e)

    def __len__(self) -> int:
        return len(self._lru)

    def acquire(self, seg: int, direct: bool) -> OpenFd:
        """A descriptor of segment ``seg`` in use until :meth:`release` (see :meth:`use`)."""
        key = (seg, direct)
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:
                entry.users += 1
                self._lru.move_to_end(key)
                return entry
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(self.folder / segment_name(seg), flags)
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                raise DirectUnsupported() from e
            raise
        if not direct:  # twice the kernel's read-ahead window for runs read in order (cold reads)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass  # a hint only
        with self._lock:
            entry = self._lru.get(key)
            if entry is not None:  # another thread opened it meanwhile
                os.close(fd)
            else:
                entry = self._lru[key] = OpenFd(fd)
                self._trim()
            entry.users += 1
            self._lru.move_to_end(key)
            return entry

    def release(self, entry: OpenFd) -> None:
        with self._lock:
            entry.users -= 1
            if entry.users == 0:
                if not entry.alive:
                    os.close(entry.fd)
                elif len(self._lru) > self.limit:
                    self._trim()

    def _trim(self) -> None:
        """Close idle descriptors, least recently used first, down to the limit (under
        the lock)."""
        over = len(self._lru) - self.limit
        for key in [k for k, e in self._lru.items() if e.users == 0][:max(over, 0)]:
            os.close(self._lru.pop(key).fd)

    def forget_removed(self) -> None:
        """Close the descriptors of segments that were unlinked (by gc in any process),
        so that their disk space is released (those in use: when the last user is done)."""
        with self._lock:
            for key, entry in list(self._lru.items()):
                if os.fstat(entry.fd).st_nlink == 0:
                    self._drop(key)

    def close(self) -> None:
        with self._lock:
            for key in list(self._lru):
                self._drop(key)

    def _drop(self, key: tuple[int, bool]) -> None:
        entry = self._lru.pop(key)
        entry.alive = False
        if entry.users == 0:
            os.close(entry.fd)
