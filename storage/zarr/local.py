"""Records of a ZarrStore as files under a local directory (the key scheme of zarr's LocalStore).

A record is written to a private temporary file next to its final name
(``.<name>.<pid>.<rand>.partial``, 0o600), fsynced, then hard-linked to the final name
(``link`` never replaces: two writers of one record never tear or overwrite each other);
the directories written are fsynced by :meth:`LocalObjects.sync`. Reads stream the payload
straight into the caller's buffer (``preadv``) and verify it there. The last access of a
record is its file's atime, set explicitly.
"""

from __future__ import annotations

import errno
import os
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..os.files import create_private_file, fsync_dir, mkdir_private
from ..errors import CorruptRecordError, RecordCheck, StoreError, StoreFullError
from ..format.record import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    RecordKey,
    RecordMeta,
    decode_record,
    parse_header,
    record_size,
    verify_record_parts,
)
from .objects import DIR_KINDS, META_KEY, IoPool, Objects, key_of, raise_first

__all__ = ["LocalObjects"]

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
#: Linux: a read that leaves the file's access time as it was (0 where there is no such flag)
_O_NOATIME = getattr(os, "O_NOATIME", 0)


def _raise_full(root: object, e: OSError) -> None:
    if e.errno in _FULL_ERRNOS:
        raise StoreFullError(f"{root}: disk full ({e.strerror}); records already stored are intact") from e


class LocalObjects(Objects):
    """Records as files under a directory (the key scheme of zarr's LocalStore)."""

    local = True
    reads_headers = True

    def __init__(self, root: Path, *, stale_partial_s: float, io: IoPool) -> None:
        self.root = root
        self._root_str = os.fspath(root)
        self.io = io
        self.stale_partial_s = stale_partial_s
        self._known_dirs: set[str] = set()
        self._dirty_dirs: set[Path] = set()
        self._lock = threading.Lock()
        mkdir_private(root)

    # -- writing
    def _ensure_dir(self, parent: str) -> Path:
        d = self.root / parent
        if parent not in self._known_dirs:
            kind_dir = d.parent
            if mkdir_private(kind_dir):
                with self._lock:
                    self._dirty_dirs.add(self.root)
            if mkdir_private(d):
                with self._lock:
                    self._dirty_dirs.add(kind_dir)
            self._known_dirs.add(parent)
        return d

    def _create(self, path: Path, parts: Sequence[Any]) -> bool:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
        fd = create_private_file(tmp)
        if fd is None:  # a random name taken: only by another writer of this very record
            raise StoreError(f"{tmp}: temporary name already exists")
        try:
            try:
                _write_all(fd, parts)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            with self._lock:
                self._dirty_dirs.add(path.parent)
            return True
        except OSError as e:
            _raise_full(self.root, e)
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def create_meta(self, data: bytes) -> None:
        self._create(self.root / META_KEY, [data])
        self.sync()

    def replace_meta(self, data: bytes) -> None:
        """Written whole to a temporary, fsynced, renamed over ``zarr.json``."""
        path = self.root / META_KEY
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
        fd = create_private_file(tmp)
        if fd is None:
            raise StoreError(f"{tmp}: temporary name already exists")
        try:
            try:
                _write_all(fd, [data])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(self.root)
        finally:
            tmp.unlink(missing_ok=True)

    def write_new(self, name: str, parts: Sequence[Any]) -> bool:
        parent, _, base = name.rpartition("/")
        try:
            d = self._ensure_dir(parent)
        except OSError as e:
            _raise_full(self.root, e)
            raise
        return self._create(d / base, parts)

    def sync(self) -> None:
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        # Concurrently: each directory fsync is a device flush, concurrent ones merge.
        raise_first(self.io.map(fsync_dir, sorted(dirs)))

    # -- reading
    def read_meta(self) -> bytes | None:
        try:
            return (self.root / META_KEY).read_bytes()
        except FileNotFoundError:
            return None

    def read_whole(self, name: str) -> np.ndarray | None:
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            size = os.fstat(fd).st_size
            buf = np.empty(size, dtype=np.uint8)
            n = _pread_into(fd, [buf], 0)
            return buf[:n]
        finally:
            os.close(fd)

    def read_into(self, name: str, key: RecordKey, fingerprint: str, digest: bytes | None,
                  out: np.ndarray) -> RecordMeta | None:
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            size = os.fstat(fd).st_size
            if size != record_size(out.nbytes):
                # Corrupt, or the caller's buffer has the wrong size: decide on the whole record.
                whole = np.empty(size, dtype=np.uint8)
                _pread_into(fd, [whole], 0)
                decode_record(whole, expect_key=key, expect_fingerprint=fingerprint, expect_token_digest=digest)
                raise ValueError(f"out: expected {size - record_size(0)} bytes (the stored payload of "
                                 f"{key!r}), got {out.nbytes}")
            # One read straight into the caller's buffer, then verify it there.
            header, checksum = bytearray(HEADER_BYTES), bytearray(CHECKSUM_BYTES)
            n = _pread_into(fd, [header, out, checksum], 0)
            if n != size:
                raise CorruptRecordError(RecordCheck.TRUNCATED, f"short read: {n} of {size} bytes")
            parsed = parse_header(header, size)
            return verify_record_parts(header, out, checksum, parsed=parsed, expect_key=key,
                                       expect_fingerprint=fingerprint, expect_token_digest=digest)
        finally:
            os.close(fd)

    def read_header(self, name: str) -> bytes | None:
        """One ``pread`` of the header, opened ``O_NOATIME`` (the access time, which is the
        record's place in the LRU, stays put); where the kernel refuses that flag (a file
        this user does not own: EPERM) opened without it, so under ``strictatime`` that
        read may move the atime."""
        path = os.path.join(self._root_str, name)  # (a str join: a Path's costs more than the read)
        try:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_NOATIME)
            except PermissionError:
                if not _O_NOATIME:
                    raise
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            header = os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
        return header if len(header) == HEADER_BYTES else None

    def exists(self, name: str) -> bool:
        return (self.root / name).is_file()

    def size_of(self, name: str) -> int | None:
        try:
            return os.stat(self.root / name).st_size
        except FileNotFoundError:
            return None

    def remove(self, name: str) -> bool:
        try:
            os.unlink(self.root / name)
            return True
        except FileNotFoundError:
            return False

    def touch(self, name: str, ns: int) -> None:
        try:
            os.utime(self.root / name, ns=(ns, ns))
        except FileNotFoundError:
            pass  # evicted or deleted by another process meanwhile

    def scan(self) -> list[tuple[RecordKey, int, int]]:
        found: list[tuple[RecordKey, int, int]] = []
        stale_before = time.time() - self.stale_partial_s
        for kind_dir in DIR_KINDS:
            for shard in _scandir(self.root / kind_dir):
                if not shard.is_dir(follow_symlinks=False):
                    continue
                for entry in _scandir(Path(shard.path)):
                    key = key_of(kind_dir, shard.name, entry.name)
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if key is not None:
                        found.append((key, st.st_size, st.st_atime_ns))
                    elif entry.name.endswith(".partial") and st.st_mtime < stale_before:
                        Path(entry.path).unlink(missing_ok=True)  # left by a killed writer
        return found


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _write_all(fd: int, parts: Sequence[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(memoryview(p).cast("B"))]
    while views:
        n = os.writev(fd, views)
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


def _pread_into(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Fill ``bufs`` from ``offset``; returns the bytes read (less only at end of file)."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    done = 0
    while views:
        n = os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0
    return done

