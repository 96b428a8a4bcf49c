"""What the ``os`` module lacks: ``fallocate`` (punch holes, allocate blocks), ``cachestat``
(which pages of a file the page cache holds), and page-aligned buffers for ``O_DIRECT``.

``fallocate`` and ``cachestat(2)`` (Linux >= 6.5) are called through ctypes; where a call
is not available the functions say so (False, an errno, None) instead of raising.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np

__all__ = ["ALIGN", "align_down", "align_up", "aligned_buffer", "allocate_blocks", "cached_pages", "punch_hole",
           "read_ahead_bytes"]

#: Alignment of ``O_DIRECT`` transfers (and of the batches of a segment file).
ALIGN = 4096

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_SYS_CACHESTAT = 451  # x86_64 and aarch64 (generic table)


def align_down(x: int) -> int:
    return x & ~(ALIGN - 1)


def align_up(x: int) -> int:
    return (x + ALIGN - 1) & ~(ALIGN - 1)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


class _Libc:
    """fallocate(PUNCH_HOLE) and cachestat(2) through ctypes (not in the os module)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(None, use_errno=True)
        self.lib.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        self.lib.syscall.restype = ctypes.c_long
        self.cachestat_ok = os.uname().machine in ("x86_64", "aarch64")

    def punch(self, fd: int, offset: int, length: int) -> bool:
        if length <= 0:
            return True
        rc = self.lib.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)
        return rc == 0

    def cached_pages(self, fd: int, offset: int, length: int) -> tuple[int, int] | None:
        """(pages in the page cache, pages in the range) of ``[offset, offset+length)``, or
        None where cachestat is not available."""
        if not self.cachestat_ok:
            return None
        first = align_down(offset)
        rng, st = _CachestatRange(first, align_up(offset + length) - first), _Cachestat()
        rc = self.lib.syscall(_SYS_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st),
                              ctypes.c_uint(0))
        if rc != 0:
            if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
                self.cachestat_ok = False
            return None
        return st.cache, rng.len // mmap.PAGESIZE


_LIBC = _Libc()


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the disk blocks of ``[offset, offset+length)`` (the bytes read back as zeros);
    False where the filesystem cannot."""
    return _LIBC.punch(fd, offset, length)


def allocate_blocks(fd: int, offset: int, length: int) -> int:
    """Allocate the disk blocks of ``[offset, offset+length)`` without changing the file's
    size (``fallocate(FALLOC_FL_KEEP_SIZE)``): a later write there, or a file grown over
    them, needs no new block. Returns 0, or the errno (ENOSPC: no room; EOPNOTSUPP: the
    filesystem cannot)."""
    if _LIBC.lib.fallocate(fd, _FALLOC_FL_KEEP_SIZE, offset, length) == 0:
        return 0
    return ctypes.get_errno()


def cached_pages(fd: int, offset: int, length: int) -> tuple[int, int] | None:
    """``(pages the page cache holds, pages)`` of bytes ``[offset, offset+length)`` of the
    file open as ``fd``; None where ``cachestat`` is not available (an older kernel)."""
    return _LIBC.cached_pages(fd, offset, length)


#: Transparent huge pages (x86-64, aarch64 with 4 KiB pages).
HUGE_PAGE = 2 << 20


#: ``TIERED_KV_DIRECT_BUFFERS=shared`` maps the O_DIRECT buffers as shared memory again
#: (Python's default anonymous mmap, which THP does not back): a diagnostic, to compare
#: the two in one session (bench/disk.py, tests_integrations/sglang/bench_backend.py).
SHARED_BUFFERS = os.environ.get("TIERED_KV_DIRECT_BUFFERS", "private") == "shared"


def _anonymous(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory (zeroed, page-aligned): private, unless
    :data:`SHARED_BUFFERS`."""
    if SHARED_BUFFERS:
        return mmap.mmap(-1, size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned ``[nbytes] uint8`` array (anonymous mmap), for O_DIRECT transfers.

    One of at least a huge page is asked to be backed by transparent huge pages
    (``MADV_HUGEPAGE``, 2 MiB-aligned): a block device takes a bounded number of pieces of
    memory per request (virtio-blk: 254), so an O_DIRECT transfer into scattered 4 KiB
    pages is cut into requests of at most ~1 MiB, into huge pages into requests as large as
    the device takes (docs/disk-reads.md). Where THP is off it is an ordinary buffer.

    The mapping is private (``MAP_PRIVATE``): Python's default anonymous mmap is shared
    memory, which THP backs only where ``shmem_enabled`` allows it (``never`` by default),
    so ``MADV_HUGEPAGE`` on it would do nothing. Nothing shares these buffers with a child
    process: each is one thread's bounce or staging buffer."""
    size = max(ALIGN, align_up(nbytes))
    if size < HUGE_PAGE // 2 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.frombuffer(_anonymous(size), np.uint8)
    mm = _anonymous(size + HUGE_PAGE)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # (THP unavailable: 4 KiB pages)
    whole = np.frombuffer(mm, np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE
    return whole[start:start + size]


def read_ahead_bytes(path: str | os.PathLike[str]) -> int | None:
    """The kernel's read-ahead window of the block device holding ``path`` (its queue's
    ``read_ahead_kb``, or the whole disk's for a partition), in bytes; None where sysfs
    does not say (not a block device: tmpfs, overlay, a network filesystem)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for where in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(where) as f:
                return int(f.read().strip()) << 10
        except (OSError, ValueError):
            continue
    return None
