"""What bench/disk.py and its peer drivers share: the workload's bytes, the page cache, the
destination of a read, and the line protocol between the bench and a driver process.

Standard library and numpy only: each peer driver runs this module in its peer's own venv
(``.venv-vllm``, ``.venv-lmcache``), where tiered_kv need not be installed.

Protocol. The bench starts ``<venv>/bin/python bench/peers/<driver>.py --records N
--payload-bytes P --batch B --dir D``. The driver writes one JSON object per line on its
standard output: first ``{"ready": {...}}`` (the peer's name, version, durability and
settings) or ``{"error": "..."}``; then, for each ``round`` line read from its standard input,
one round's figures ``{"round": {...}}`` (or ``{"error": ...}``); it exits at ``quit`` or
end of input. The libraries' own prints go to standard error, never into the protocol.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

#: one 128-token DeepSeek-V4-Flash fp8 block: 21*32*584 + 21*32*132 + 20*1*584
FLASH_BLOCK_BYTES = 492_832
#: every process draws the workload from this seed: the same bytes for every contender
SEED = 0
#: a hot pass after which less than this fraction of the files is cached is measured again
HOT_CACHED = 0.99
HOT_TRIES = 5


# ------------------------------------------------------------------ workload
def payloads(records: int, payload_bytes: int, seed: int = SEED) -> np.ndarray:
    """``[records, payload_bytes] uint8``: the workload's blocks, random bytes from ``seed``."""
    if records <= 0 or payload_bytes <= 0:
        raise ValueError(f"payloads: expected positive records and payload_bytes, got {records}, {payload_bytes}")
    return np.random.default_rng(seed).integers(0, 256, (records, payload_bytes), dtype=np.uint8)


def batches(n: int, batch: int) -> list[range]:
    """``range(n)`` cut into consecutive ranges of ``batch`` (the last may be shorter)."""
    return [range(a, min(a + batch, n)) for a in range(0, n, batch)]


def destination(shape: tuple[int, ...]) -> np.ndarray:
    """A zeroed ``uint8`` array of ``shape`` whose pages are already faulted in: a read lands
    in memory the size of the data (as a restore's does), never in a few buffers that stay in
    the CPU's cache, and no contender pays the first touch inside its timed pass."""
    out = np.empty(shape, np.uint8)
    out.fill(0)
    return out


def aligned_destination(nbytes: int) -> np.ndarray:
    """A page-aligned, zeroed ``uint8`` array of ``nbytes`` rounded up to whole pages
    (anonymous mmap, faulted in): O_DIRECT moves whole pages from and to aligned memory."""
    out = np.frombuffer(mmap.mmap(-1, max(1, -(-nbytes // mmap.PAGESIZE)) * mmap.PAGESIZE), np.uint8)
    out.fill(0)
    return out


def check_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Raise unless ``got`` holds exactly ``want``: a pass that did not read is no figure."""
    if got.shape != want.shape or not np.array_equal(got, want):
        raise RuntimeError(f"{what}: the bytes read back differ from the bytes written")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ------------------------------------------------------------------ page cache
_SYS_CACHESTAT = 451  # x86_64 and aarch64 (generic syscall table), Linux >= 6.5


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.syscall.restype = ctypes.c_long


def files_under(path: Path) -> list[Path]:
    """``path`` itself if it is a file, else every file below it (sorted)."""
    if path.is_file():
        return [path]
    return sorted(Path(d) / f for d, _, fs in os.walk(path) for f in fs)


def _cached_pages(fd: int, size: int) -> tuple[int, int] | None:
    """(pages cached, pages) of the file, or None where cachestat(2) is unavailable."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        return None
    rng, st = _CachestatRange(0, max(size, 1)), _Cachestat()
    if _LIBC.syscall(_SYS_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st), ctypes.c_uint(0)):
        return None
    return st.cache, -(-max(size, 1) // mmap.PAGESIZE)


def cached_fraction(path: Path) -> float | None:
    """Fraction of the pages of the files under ``path`` in the page cache; None: unknown."""
    cached = total = 0
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            got = _cached_pages(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if got is None:
            return None
        cached, total = cached + got[0], total + got[1]
    return cached / total if total else 1.0


def drop_cache(path: Path) -> None:
    """Evict the files under ``path`` from the page cache: write back their dirty pages
    (a peer that does not fsync leaves some), then posix_fadvise(DONTNEED)."""
    for f in files_under(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(path: Path) -> None:
    """Read every file under ``path`` once (plain 128 KiB reads): its pages are then cached."""
    buf = bytearray(128 << 10)
    for f in files_under(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def _disk_stat(path: Path) -> list[int] | None:
    """The counters of the block device holding ``path`` (/sys/dev/block/M:m/stat: reads,
    merges, sectors, ticks, ..., in flight, busy ms, weighted ms), or None."""
    try:
        st = os.stat(path)
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None


def disk_trace(before: list[int] | None, after: list[int] | None, seconds: float) -> dict[str, float] | None:
    """What the device did during a pass of ``seconds`` (from two :func:`_disk_stat`):
    read requests, KiB per request (after the block layer merged them), the fraction of
    the time a request was in flight (busy), the mean queue depth; the whole device's
    (other processes' reads count too)."""
    if before is None or after is None or seconds <= 0 or len(before) < 11:
        return None
    d = [b - a for a, b in zip(before, after)]
    return {"requests": d[0], "kib_per_request": d[2] * 512 / 1024 / max(1, d[0]),
            "busy": d[9] / 1000 / seconds, "queue_depth": d[10] / 1000 / seconds}


def cold_pass(path: Path, timed_pass: Callable[[], float]) -> tuple[float, float | None, dict[str, float] | None]:
    """(seconds of ``timed_pass`` after the files under ``path`` left the page cache, the
    fraction still cached when it started, what the disk did meanwhile: :func:`disk_trace`)."""
    drop_cache(path)
    before = cached_fraction(path)
    d0 = _disk_stat(path)
    seconds = timed_pass()
    return seconds, before, disk_trace(d0, _disk_stat(path), seconds)


def hot_pass(path: Path, timed_pass: Callable[[], float]) -> tuple[float, int]:
    """(seconds of ``timed_pass`` with the files under ``path`` in the page cache, passes
    taken). Other sessions on a shared machine drop the page cache now and then: a pass
    after which less than HOT_CACHED of the files is still cached is measured again, up to
    HOT_TRIES times (the fastest then counts)."""
    best = None
    for tries in range(1, HOT_TRIES + 1):
        warm_cache(path)
        before = cached_fraction(path)
        seconds = timed_pass()
        after = cached_fraction(path)
        if before is None or after is None or min(before, after) >= HOT_CACHED:
            return seconds, tries
        best = seconds if best is None else min(best, seconds)
    assert best is not None
    return best, HOT_TRIES


def round_figures(total_bytes: int, write_s: float, cold: tuple[float, float | None, dict[str, float] | None],
                  hot: tuple[float, int]) -> dict[str, Any]:
    """One round of a contender: GB/s of payload for write, cold and hot read (and what
    the disk did during the cold read)."""
    return {"write_gbps": gbps(total_bytes, write_s), "cold_read_gbps": gbps(total_bytes, cold[0]),
            "hot_read_gbps": gbps(total_bytes, hot[0]), "cold_cached_before": cold[1], "hot_passes": hot[1],
            "cold_disk": cold[2]}


# ------------------------------------------------------------------ driver side
class PeerRun(Protocol):
    """One peer, set up over the workload: what the driver serves."""

    #: name, version, what a write guarantees, settings: sent in the ready line
    info: dict[str, Any]

    def round(self) -> dict[str, Any]:
        """Write every block, read them all back cold, then hot: :func:`round_figures`."""

    def close(self) -> None:
        """Release the peer (threads, files, memory)."""


def serve(build: Callable[[argparse.Namespace, np.ndarray, Path], PeerRun],
          argv: list[str] | None = None) -> int:
    """A driver's main: parse the bench's arguments, build the peer over the workload, then
    answer ``round`` lines until ``quit``. Errors are sent as ``{"error": ...}`` lines."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, required=True)
    ap.add_argument("--payload-bytes", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--dir", type=Path, required=True, help="an empty directory on the filesystem to measure")
    args = ap.parse_args(argv)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries that print to stdout write to stderr: the protocol stays clean
    sys.stdout = sys.stderr

    def send(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    try:
        peer = build(args, payloads(args.records, args.payload_bytes), args.dir)
    except Exception as exc:  # noqa: BLE001 - reported to the bench, which prints "not run: ..."
        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send({"ready": peer.info})
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd != "round":
                send({"error": f"unknown command {cmd!r}: expected 'round' or 'quit'"})
                return 1
            try:
                send({"round": peer.round()})
            except Exception as exc:  # noqa: BLE001 - reported to the bench
                traceback.print_exc()
                send({"error": f"{type(exc).__name__}: {exc}"})
                return 1
    finally:
        peer.close()
    return 0


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
