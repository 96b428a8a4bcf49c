"""``preadv`` until every buffer is full or the file ends, whatever the number of buffers."""

from __future__ import annotations

import os

import numpy as np

__all__ = ["IOV_MAX", "preadv_all"]

#: Buffers one ``preadv`` takes at most (the kernel's UIO_MAXIOV).
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def preadv_all(fd: int, bufs: list[np.ndarray], offset: int, want: int | None = None) -> int:
    """preadv until every buffer is full or end of file; returns the bytes read. More than
    :data:`IOV_MAX` buffers are read ``IOV_MAX`` at a time. ``want``: the buffers' total
    size when the caller knows it."""
    if len(bufs) > IOV_MAX:
        got = 0
        for i in range(0, len(bufs), IOV_MAX):
            group = bufs[i:i + IOV_MAX]
            want = sum(b.nbytes for b in group)
            n = _preadv_one(fd, group, offset + got)
            got += n
            if n < want:
                break
        return got
    return _preadv_one(fd, bufs, offset, want)


def _preadv_one(fd: int, bufs: list[np.ndarray], offset: int, want: int | None = None) -> int:
    if want is None:
        want = sum(b.nbytes for b in bufs)
    got = os.preadv(fd, bufs, offset)  # the common case: all of it at once
    if got == want or got <= 0:
        return max(got, 0)
    views = [memoryview(b).cast("B") for b in bufs if b.nbytes]
    n = got
    while views and n >= views[0].nbytes:
        n -= views[0].nbytes
        views.pop(0)
    if views and n:
        views[0] = views[0][n:]
    while views:
        n = os.preadv(fd, views, offset + got)
        if n <= 0:
            break
        got += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return min(got, want)
