"""Disk-tier throughput: our stores, plain-file baselines and the peers' disk tiers, all in
the same run, over the same bytes.

The workload: ``--records`` random blocks (default 512 DeepSeek-V4-Flash fp8 blocks,
``deepseek_v4_flash().block_bytes`` = 492,832 B, 252 MB) drawn from one seed, so that every
process, ours and the peers', holds the same bytes. Each round, every contender writes every
block (fresh store or directory), then reads them all back cold and hot; the figure is the
median over ``--repeats`` rounds (after one untimed warm-up round), in GB/s of payload.
Rounds are interleaved across the contenders, so that drifts of the disk hit all alike.

Every read lands in a destination the size of the data (one row per block, its pages
faulted in beforehand, zeroed before each pass and compared with the bytes written after
it), as a restore's does: never in a few buffers that stay in the CPU's cache.

    raw              the plain way: one file per block, write() + fsync() each, then an
                     fsync of the directory; reads: open() + readv() into the block's row
    ceiling          what the disk gives: the data as one file, written and read cold by
                     every raw method below, each round; the ceiling is the write method and
                     the cold-read method with the highest median (each method's figures are
                     printed too); hot: parallel buffered preads into the destination
                       write: O_DIRECT pwrites (4 threads, 4 MiB) from 4 KiB pages, the same
                       from 2 MiB-aligned transparent huge pages, buffered 8 MiB write()s;
                       each ends with one fdatasync
                       cold read: O_DIRECT preads (4 threads, 4 MiB) into 4 KiB pages, the
                       same into huge pages (a request then is not cut at the device's 254
                       pieces of memory: 4 MiB, not ~1 MiB), buffered preads with
                       POSIX_FADV_SEQUENTIAL (the kernel's read-ahead, read_ahead_kb) from
                       1 thread of 32 MiB and from 4 threads of 4 MiB
    <store> files    the store's own files read with parallel buffered preads (4 threads,
                     4 MiB) into a destination of their size: the page cache's speed for them
    lmdb, zarr       tiered_kv: ``put_many(batch)`` into a fresh store (fsync-durable when it
                     returns), ``get_many(batch)`` into the destination's rows (every record
                     verified: checksum, key, layout fingerprint), a fresh handle per pass
    vLLM FS tier     vLLM 0.33's ``fs`` offloading tier, driven by bench/peers/vllm_fs.py in
                     .venv-vllm (``make venv-vllm``)
    LMCache disk     LMCache 0.5.6's ``LocalDiskBackend``, driven by bench/peers/lmcache_disk.py
                     in .venv-lmcache (``make venv-lmcache``)

Each peer runs in its own venv's Python process and measures itself with the same code
(bench/peers/peer_common.py: workload, page cache, timing); a peer whose venv is missing or whose
driver fails is reported as "not run: <why>", never with a figure. The drivers' docstrings
say which of the peer's calls they make and what its writes guarantee.

    cold read        the files' pages written back and dropped first (posix_fadvise DONTNEED)
    hot read         every file read once (plain reads, untimed) before the pass; a pass after
                     which less than 99 % of the files is still cached (cachestat; other jobs
                     on a shared machine drop the page cache) is measured again, up to 5 times

Printed after the medians: every round's write and cold-read figure per contender; for each
cold pass what the block device did (/sys/dev/block/M:m/stat: KiB per request after merging,
mean queue depth, the fraction of the pass a request was in flight), for the peers too;
which path the LMDB store's records took (page cache after the kernel's read-ahead, cold
buffered, O_DIRECT); and issue 25's same-run targets (cold >= 1.0x vLLM and >= 0.95x the
ceiling, every cold round >= 0.9x vLLM's slowest; write >= 0.95x the ceiling and >= 1.3x
vLLM). docs/disk-reads.md explains the swing these traces show.

    python bench/disk.py --quick     # 128 blocks, 2 rounds; writes bench/results/disk.json
    python bench/disk.py             # 512 blocks, 5 rounds; also bench/results/disk.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # allow `python bench/disk.py` from a checkout
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

from peer_common import (  # noqa: E402  (bench/peers/peer_common.py: shared with the peer drivers)
    FLASH_BLOCK_BYTES,
    aligned_destination,
    batches,
    check_equal,
    cold_pass,
    destination,
    files_under,
    gbps,
    hot_pass,
    payloads,
    round_figures,
    timed,
)
from peer_launch import PEERS, PeerProcess  # noqa: E402

from tiered_kv.storage import BlockStore, LmdbStore, PutItem, RecordKey, ZarrStore, record_size  # noqa: E402

METRICS = ("write_gbps", "cold_read_gbps", "hot_read_gbps")
FINGERPRINT = "kvl1-bench-flash-fp8"
BACKENDS: dict[str, Callable[[Path, int], BlockStore]] = {
    "lmdb": lambda path, max_bytes: LmdbStore(path, layout_fingerprint=FINGERPRINT, max_bytes=max_bytes),
    "zarr": lambda path, max_bytes: ZarrStore(path, layout_fingerprint=FINGERPRINT, max_bytes=max_bytes),
}
LABELS = {
    "raw": "raw file per block (write+fsync / readv)",
    "ceiling": "disk ceiling (fastest raw method)",
    "lmdb": "tiered_kv LMDB + segments",
    "zarr": "tiered_kv Zarr",
}
DURABILITY = {
    "raw": "fsync per file, no checksum",
    "ceiling": "one fdatasync, no checksum",
    "files": "plain reads, nothing verified",
    "store": "fsync-durable when put_many returns, every read verified",
}
THREADS = 4
PIECE = 4 << 20


def flash_block_bytes() -> int:
    from tiered_kv.presets import deepseek_v4_flash

    return deepseek_v4_flash().block_bytes


class Workload:
    """The blocks (``payloads``: ``[records, payload_bytes] uint8``, bench/peers/peer_common.py's
    seed), their store keys, and the destination every read of ours lands in."""

    def __init__(self, records: int, batch: int, payload_bytes: int) -> None:
        self.payloads = payloads(records, payload_bytes)
        self.records, self.batch, self.payload_bytes = records, batch, payload_bytes
        self.total = records * payload_bytes
        hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(records)]
        self.items = [PutItem(RecordKey.block(h), parent_hash=bytes(32), token_digest=hashlib.sha256(h).digest(),
                              payload=p) for h, p in zip(hashes, self.payloads)]
        self.keys = [it.key for it in self.items]
        #: ``[records, payload_bytes] uint8``: where every read of ours lands
        self.dest = destination(self.payloads.shape)

    def batches(self) -> list[range]:
        return batches(self.records, self.batch)


def parallel_pread(pieces: list[tuple[int, int, int, int]], out: np.ndarray, threads: int = THREADS) -> None:
    """``os.preadv`` each (fd, file offset, destination offset, length) piece into ``out``,
    ``threads`` at a time (the GIL is released while each reads)."""
    view = memoryview(out)

    def read(piece: tuple[int, int, int, int]) -> None:
        fd, off, at, n = piece
        while n:
            got = os.preadv(fd, [view[at:at + n]], off)
            if got <= 0:
                raise RuntimeError("a parallel read came back short")
            off, at, n = off + got, at + got, n - got

    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(read, pieces))


# ------------------------------------------------------------------ raw baseline
def raw_run(w: Workload, workdir: Path) -> dict[str, Any]:
    path = workdir / "raw"
    path.mkdir()
    names = [path / f"{i:06d}.blk" for i in range(w.records)]

    def write_all() -> None:
        for name, p in zip(names, w.payloads):
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(p)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        dfd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def read_all() -> float:
        w.dest.fill(0)
        t = timed(lambda: [_readv_file(name, row) for name, row in zip(names, w.dest)])
        check_equal(w.dest, w.payloads, "raw")
        return t

    write_s = timed(write_all)
    figures = round_figures(w.total, write_s, cold_pass(path, read_all), hot_pass(path, read_all))
    shutil.rmtree(path)
    return figures


def _readv_file(name: Path, row: np.ndarray) -> None:
    fd = os.open(name, os.O_RDONLY)
    try:
        if os.readv(fd, [row]) != row.nbytes:
            raise RuntimeError(f"raw: {name} came back short")
    finally:
        os.close(fd)


# ------------------------------------------------------------------ disk ceiling
def huge_buffer(nbytes: int) -> np.ndarray:
    """A 2 MiB-aligned ``[nbytes rounded up to pages] uint8`` array asked to be backed by
    transparent huge pages, zeroed (faulted in): an O_DIRECT transfer into it is not cut at
    254 x 4 KiB pieces (docs/disk-reads.md). Private anonymous memory: THP does not back
    Python's default (shared) anonymous mmap where ``shmem_enabled`` is ``never``."""
    huge = 2 << 20
    size = -(-max(1, nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
    mm = mmap.mmap(-1, size + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass  # (no THP here: 4 KiB pages; the bench prints how much THP backs)
    whole = np.frombuffer(mm, np.uint8)
    start = (-whole.ctypes.data) % huge
    out = whole[start:start + size]
    out.fill(0)
    return out


def huge_fraction(buf: np.ndarray) -> float | None:
    """Fraction of ``buf``'s mapping backed by transparent huge pages (/proc/self/smaps
    AnonHugePages of the mapping holding it), or None where smaps does not say."""
    addr = buf.ctypes.data
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "AnonHugePages:":
                    return min(1.0, int(line.split()[1]) * 1024 / max(1, buf.nbytes))
    except (OSError, ValueError):
        return None
    return None


#: the raw ways to write the workload's bytes as one file, fsync-durable (fdatasync) when done
CEILING_WRITES = {
    "O_DIRECT, 4 KiB pages": "4 threads of 4 MiB O_DIRECT pwrites from a buffer of 4 KiB pages",
    "O_DIRECT, huge pages": "4 threads of 4 MiB O_DIRECT pwrites from a 2 MiB-aligned THP buffer",
    "buffered, sequential": "one thread of 8 MiB write()s through the page cache, then fdatasync",
}
#: the raw ways to read that file back cold (its pages dropped from the page cache first)
CEILING_READS = {
    "O_DIRECT, 4 KiB pages": "4 threads of 4 MiB O_DIRECT preads into a buffer of 4 KiB pages",
    "O_DIRECT, huge pages": "4 threads of 4 MiB O_DIRECT preads into a 2 MiB-aligned THP buffer",
    "buffered, 1 thread": "one thread of 32 MiB preads, POSIX_FADV_SEQUENTIAL: the kernel's read-ahead",
    "buffered, 4 threads": "4 threads of 4 MiB preads, POSIX_FADV_SEQUENTIAL",
}


class Ceiling:
    """What this disk gives for the workload's bytes as one file: every raw method of
    CEILING_WRITES and CEILING_READS measured each round (in a rotating order); the
    ceiling is the method with the highest median (see :func:`ceiling_row`), each
    method's figures are printed beside it. Buffers built once: ``src`` / ``dest`` of
    4 KiB pages (``[total rounded up to pages] uint8``), ``src_huge`` / ``dest_huge``
    2 MiB-aligned and THP-backed where the kernel allows."""

    def __init__(self, w: Workload) -> None:
        self.total = w.total
        self.src = aligned_destination(w.total)
        self.src[:w.total] = w.payloads.reshape(-1)
        self.dest = aligned_destination(w.total)
        self.src_huge = huge_buffer(len(self.src))
        self.src_huge[:] = self.src
        self.dest_huge = huge_buffer(len(self.src))
        self.huge = {"src": huge_fraction(self.src_huge), "dest": huge_fraction(self.dest_huge)}
        self.pieces = [(o, min(PIECE, len(self.src) - o)) for o in range(0, len(self.src), PIECE)]
        self.rounds = 0

    def _write(self, path: Path, method: str) -> float:
        direct = method.startswith("O_DIRECT")
        src = memoryview(self.src_huge if method.endswith("huge pages") else self.src)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
        try:
            def write_all() -> None:
                if direct:
                    with ThreadPoolExecutor(THREADS) as ex:
                        wrote = list(ex.map(lambda p: os.pwrite(fd, src[p[0]:p[0] + p[1]], p[0]), self.pieces))
                    if wrote != [n for _, n in self.pieces]:
                        raise RuntimeError("ceiling: a pwrite came back short")
                else:
                    view = src
                    while view:
                        view = view[os.write(fd, view[:8 << 20]):]
                os.fdatasync(fd)

            return timed(write_all)
        finally:
            os.close(fd)

    def _read(self, path: Path, method: str, *, cold: bool = True) -> float:
        """Seconds of one read of the file by ``method`` into its destination (then checked)."""
        huge = method.endswith("huge pages")
        dest = self.dest_huge if huge else self.dest
        dest.fill(0)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if method.startswith("O_DIRECT") else 0))
        try:
            if method.startswith("buffered"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            piece, threads = (32 << 20, 1) if method == "buffered, 1 thread" else (PIECE, THREADS)
            pieces = [(fd, o, o, min(piece, len(dest) - o)) for o in range(0, len(dest), piece)]
            seconds = timed(lambda: parallel_pread(pieces, dest, threads))
        finally:
            os.close(fd)
        check_equal(dest[:self.total], self.src[:self.total], f"ceiling ({method})")
        return seconds

    def run(self, w: Workload, workdir: Path) -> dict[str, Any]:
        path = workdir / "ceiling.bin"
        turn = self.rounds
        self.rounds += 1
        writes, reads = list(CEILING_WRITES), list(CEILING_READS)
        writes = writes[turn % len(writes):] + writes[:turn % len(writes)]
        reads = reads[turn % len(reads):] + reads[:turn % len(reads)]
        write_methods: dict[str, float] = {}
        for method in writes:  # each writes the file anew; the last one's stays for the reads
            path.unlink(missing_ok=True)
            write_methods[method] = gbps(w.total, self._write(path, method))
        cold_methods: dict[str, float] = {}
        cold_disks: dict[str, dict[str, float] | None] = {}
        for method in reads:
            seconds, _, trace = cold_pass(path, lambda: self._read(path, method))
            cold_methods[method], cold_disks[method] = gbps(w.total, seconds), trace
        hot = hot_pass(path, lambda: self._read(path, "buffered, 4 threads"))
        path.unlink()
        return {"write_methods": write_methods, "cold_methods": cold_methods, "cold_disks": cold_disks,
                "hot_read_gbps": gbps(w.total, hot[0]), "hot_passes": hot[1], "huge_pages": self.huge}


def ceiling_row(runs: list[dict[str, Any]]) -> dict[str, str]:
    """Make the ceiling's rounds those of its fastest raw methods: the write method and the
    cold-read method with the highest median over the rounds (a per-round max would pick
    noise). Sets each round's ``write_gbps``, ``cold_read_gbps`` and ``cold_disk`` from
    them, in place; returns {"write": method, "cold": method}."""
    def best(key: str) -> str:
        return max(runs[0][key], key=lambda m: statistics.median(r[key][m] for r in runs))

    write, cold = best("write_methods"), best("cold_methods")
    for r in runs:
        r["write_gbps"], r["cold_read_gbps"] = r["write_methods"][write], r["cold_methods"][cold]
        r["cold_disk"] = r["cold_disks"][cold]
    return {"write": write, "cold": cold}


# ------------------------------------------------------------------ stores
def read_paths(store: BlockStore) -> dict[str, Any]:
    """Which path the records of a pass took (the LMDB store's read engine: ``hot`` from
    the page cache, ``direct`` O_DIRECT, ``buffered`` cold through the page cache, read
    ahead by the kernel) and whether cold runs use O_DIRECT; empty for a store without them."""
    engine = getattr(getattr(store, "_segments", None), "reads", None)
    if engine is None:
        return {}
    return {**engine.paths, "cold_direct": engine.cold_direct}


def store_run(name: str, w: Workload, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the store's round, the round of plain parallel reads of its files)."""
    path = workdir / name
    max_bytes = 2 * w.records * record_size(w.payload_bytes)
    open_store = BACKENDS[name]
    store = open_store(path, max_bytes)
    try:
        def write_all() -> None:
            for r in w.batches():
                if not all(store.put_many(w.items[r.start:r.stop])):
                    raise RuntimeError(f"{name}: a fresh store reported an existing record")

        write_s = timed(write_all)
    finally:
        store.close()

    traces: list[dict[str, Any]] = []  # per pass: which path each record took (LMDB)

    def read_all() -> float:
        w.dest.fill(0)
        store = open_store(path, max_bytes)  # a fresh handle per pass
        try:
            def get_all() -> None:
                for r in w.batches():
                    metas = store.get_many(w.keys[r.start:r.stop], list(w.dest[r.start:r.stop]))
                    if any(m is None for m in metas):
                        raise RuntimeError(f"{name}: a stored record was a miss")

            seconds = timed(get_all)
            traces.append(read_paths(store))
        finally:
            store.close()
        check_equal(w.dest, w.payloads, name)
        return seconds

    cold = cold_pass(path, read_all)
    cold_paths = traces[-1] if traces else {}
    figures = round_figures(w.total, write_s, cold, hot_pass(path, read_all))
    figures["cold_paths"] = cold_paths
    files = files_run(path)
    shutil.rmtree(path)
    return figures, files


def files_run(path: Path) -> dict[str, Any]:
    """Parallel buffered preads of every file under ``path`` into one array of their size,
    cold and hot (GB/s of the files' bytes)."""
    files = files_under(path)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    out = destination((total,))
    want = np.concatenate([np.fromfile(f, np.uint8) for f in files])

    def read_all() -> float:
        out.fill(0)
        fds = [os.open(f, os.O_RDONLY) for f in files]
        try:
            pieces, at = [], 0
            for fd, size in zip(fds, sizes):
                pieces += [(fd, off, at + off, min(PIECE, size - off)) for off in range(0, size, PIECE)]
                at += size
            seconds = timed(lambda: parallel_pread(pieces, out))
        finally:
            for fd in fds:
                os.close(fd)
        check_equal(out, want, f"{path.name} files")
        return seconds

    cold, hot = cold_pass(path, read_all), hot_pass(path, read_all)
    return {"write_gbps": None, "cold_read_gbps": total / cold[0] / 1e9, "hot_read_gbps": total / hot[0] / 1e9,
            "cold_cached_before": cold[1], "hot_passes": hot[1], "bytes": total, "cold_disk": cold[2]}


# ------------------------------------------------------------------ one run
def median_of(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    return {m: None if runs[0][m] is None else statistics.median(r[m] for r in runs) for m in METRICS}


def run(records: int, batch: int, repeats: int, workdir: Path, *, payload_bytes: int | None = None,
        peers: dict[str, Path] | None = None) -> dict[str, Any]:
    """Every contender, ``repeats`` interleaved rounds after one warm-up. ``peers``: name ->
    the interpreter of its venv (default: each peer of peer_launch.PEERS under the checkout)."""
    if records <= 0 or batch <= 0 or repeats <= 0:
        raise ValueError(f"records, batch, repeats: expected positive, got {records}, {batch}, {repeats}")
    payload_bytes = payload_bytes or flash_block_bytes()
    pythons = {p.name: p.python() for p in PEERS} if peers is None else peers
    procs = [PeerProcess(p, pythons[p.name], records=records, payload_bytes=payload_bytes, batch=batch,
                         workdir=workdir / p.name) for p in PEERS if p.name in pythons]
    try:
        w = Workload(records, batch, payload_bytes)
        ceiling = Ceiling(w)
        runs: dict[str, list[dict[str, Any]]] = {"raw": [], "ceiling": [],
                                                 **{k: [] for b in BACKENDS for k in (b, f"{b}_files")}}
        for r in range(repeats + 1):  # round 0: the untimed warm-up (first-use costs)
            got = {"raw": raw_run(w, workdir), "ceiling": ceiling.run(w, workdir)}
            for name in BACKENDS:
                got[name], got[f"{name}_files"] = store_run(name, w, workdir)
            for proc in procs:
                proc.round(keep=r > 0)
            if r > 0:
                for k, v in got.items():
                    runs[k].append(v)
    finally:
        for proc in procs:
            proc.close()
    return results(w, repeats, workdir, runs, procs)


def results(w: Workload, repeats: int, workdir: Path, runs: dict[str, list[dict[str, Any]]],
            procs: list[PeerProcess]) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    for name in ("raw", "ceiling"):
        rows[name] = {"label": LABELS[name], "kind": "baseline", "durability": DURABILITY[name]}
    rows["ceiling"]["methods"] = ceiling_row(runs["ceiling"])
    for b in BACKENDS:
        rows[f"{b}_files"] = {"label": f"{b} store's files, {THREADS}-thread pread", "kind": "baseline",
                              "durability": DURABILITY["files"]}
    for proc in procs:
        info = proc.info or {}
        rows[proc.peer.name] = {"label": info.get("label", proc.peer.label), "kind": "peer",
                                "durability": info.get("durability"), "settings": info.get("settings"),
                                "note": info.get("note")}
        if proc.not_run is not None:
            rows[proc.peer.name]["not_run"] = proc.not_run
        else:
            runs[proc.peer.name] = proc.runs
    for b in BACKENDS:
        rows[b] = {"label": LABELS[b], "kind": "ours", "durability": DURABILITY["store"]}
    for name, row in rows.items():
        if "not_run" not in row:
            row["median"] = median_of(runs[name])
            row["runs"] = runs[name]
    return {
        "config": {"payload_bytes": w.payload_bytes, "record_bytes": record_size(w.payload_bytes),
                   "records": w.records, "batch": w.batch, "repeats": repeats, "total_bytes": w.total,
                   "workdir": str(workdir), "statistic": "median", "warmup_rounds": 1,
                   "destination": "the size of the data, pages faulted in, zeroed before each pass"},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "rows": rows,
        "ratios": {b: ratios(rows, b) for b in BACKENDS},
        "targets": targets(rows),
        "cold_targets": cold_targets(rows),
    }


def ratios(rows: dict[str, dict[str, Any]], ours: str) -> dict[str, dict[str, float | None] | str]:
    """``ours`` over each other contender, per metric (None where either was not measured),
    or "not run: ..." for a peer that did not run."""
    mine = rows[ours]["median"]
    out: dict[str, dict[str, float | None] | str] = {}
    for name, row in rows.items():
        if row["kind"] == "ours" or (name.endswith("_files") and name != f"{ours}_files"):
            continue
        if "not_run" in row:
            out[name] = f"not run: {row['not_run']}"
            continue
        out[name] = {m: None if mine[m] is None or row["median"][m] is None else mine[m] / row["median"][m]
                     for m in METRICS}
    return out


#: issue 15's hot-read targets for the LMDB store: x LMCache's hot read, x its files' pread
TARGETS = {"lmcache_disk": 1.0, "lmdb_files": 0.8}


def cold_targets(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 25's targets for the LMDB store, same run: cold read >= 1.0x vLLM's FS tier and
    >= 0.95x the ceiling (medians), every cold round >= 0.9x vLLM's slowest round; write
    >= 0.95x the ceiling and >= 1.3x vLLM."""
    ours = rows["lmdb"]
    out: dict[str, dict[str, Any]] = {}

    def judge(name: str, got: float | None, target: float) -> None:
        out[name] = {"target": target, "ratio": got,
                     "verdict": "not measured" if got is None else ("meets" if got >= target else "misses")}

    ceiling, vllm = rows["ceiling"], rows.get("vllm_fs")
    have_vllm = vllm is not None and "not_run" not in vllm
    m = ours["median"]
    judge("cold / ceiling", m["cold_read_gbps"] / ceiling["median"]["cold_read_gbps"], 0.95)
    judge("write / ceiling", m["write_gbps"] / ceiling["median"]["write_gbps"], 0.95)
    if have_vllm:
        assert vllm is not None
        judge("cold / vLLM", m["cold_read_gbps"] / vllm["median"]["cold_read_gbps"], 1.0)
        judge("write / vLLM", m["write_gbps"] / vllm["median"]["write_gbps"], 1.3)
        slowest = min(r["cold_read_gbps"] for r in vllm["runs"])
        judge("slowest cold round / vLLM's slowest", min(r["cold_read_gbps"] for r in ours["runs"]) / slowest, 0.9)
    else:
        for name, target in (("cold / vLLM", 1.0), ("write / vLLM", 1.3), ("slowest cold round / vLLM's slowest", 0.9)):
            judge(name, None, target)
    return out


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for other, target in TARGETS.items():
        row = rows.get(other)
        if row is None or "not_run" in row:
            out[other] = {"target": target, "ratio": None, "verdict": "not measured"}
            continue
        ratio = rows["lmdb"]["median"]["hot_read_gbps"] / row["median"]["hot_read_gbps"]
        out[other] = {"target": target, "ratio": ratio, "verdict": "meets" if ratio >= target else "misses"}
    return out


# ------------------------------------------------------------------ output
def _cell(x: float | None, width: int, fmt: str = ".2f") -> str:
    return f"{'-' if x is None else format(x, fmt):>{width}}"


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"disk tier: {c['records']} blocks x {c['payload_bytes']:,} B ({c['total_bytes'] / 1e6:.0f} MB), "
             f"batches of {c['batch']}, median of {c['repeats']} rounds after a warm-up; every read lands in "
             f"a destination the size of the data",
             f"{'GB/s of payload':<44}{'write':>8}{'cold':>8}{'hot':>8}   what a write guarantees / reads check"]
    for name, row in res["rows"].items():
        if "not_run" in row:
            lines.append(f"{row['label']:<44}{'not run: ' + row['not_run']}")
            continue
        m = row["median"]
        lines.append(f"{row['label']:<44}" + "".join(_cell(m[k], 8, ".3f") for k in METRICS)
                     + f"   {row['durability'] or ''}")
    for ours, rs in res["ratios"].items():
        lines.append(f"{LABELS[ours] + ' / each (same run)':<44}{'write':>8}{'cold':>8}{'hot':>8}")
        for name, r in rs.items():
            label = res["rows"][name]["label"]
            if isinstance(r, str):
                lines.append(f"  / {label:<40}{r}")
            else:
                lines.append(f"  / {label:<40}" + "".join(_cell(r[k], 8) for k in METRICS))
    peer_labels = {p.name: p.label for p in PEERS}    # a peer left out of this run has no row
    verdicts = [f"x {res['rows'].get(k, {}).get('label', peer_labels.get(k, k))} "
                + (f"{t['ratio']:.2f} ({t['verdict']} >= {t['target']})"
                   if t["ratio"] is not None else f"not measured (>= {t['target']})")
                for k, t in res["targets"].items()]
    lines.append("LMDB hot-read targets (issue 15): " + "; ".join(verdicts))
    lines.append("LMDB cold-read and write targets (issue 25, same run): " + "; ".join(
        f"{k} " + ("not measured" if t["ratio"] is None else f"{t['ratio']:.2f}") + f" ({t['verdict']} >= {t['target']})"
        for k, t in res["cold_targets"].items()))
    lines += rounds_table(res)
    lines += [f"note, {row['label']}: {row['note']}" for row in res["rows"].values()
              if row.get("note") and "not_run" not in row]
    return "\n".join(lines)


def rounds_table(res: dict[str, Any]) -> list[str]:
    """Every round, not only the median: write and cold read GB/s per contender, then what
    the disk did in each cold pass (KiB per request after merging, mean queue depth, the
    fraction of the pass a request was in flight) and which path the LMDB store's records
    took (h: found in the page cache, read ahead by the kernel during the pass; d: O_DIRECT;
    b: cold, through the page cache)."""
    rows = {k: r for k, r in res["rows"].items() if "not_run" not in r}
    n = len(next(iter(rows.values()))["runs"])
    head = "".join(f"{f'r{i + 1}':>7}" for i in range(n))
    lines = [f"{'per round, GB/s':<44}{head}   (write | cold)"]
    for name, row in rows.items():
        runs = row["runs"]
        w = "".join(_cell(r["write_gbps"], 7) for r in runs)
        c = "".join(_cell(r["cold_read_gbps"], 7) for r in runs)
        lines.append(f"  {row['label'][:40]:<42}{w}   | {c}")
    lines.append(f"{'cold passes: KiB/request, queue depth, busy':<44}")
    for name, row in rows.items():
        cells = []
        for r in row["runs"]:
            d = r.get("cold_disk")
            cells.append("-" if not d else f"{d['kib_per_request']:.0f}/{d['queue_depth']:.1f}/{d['busy']:.2f}")
        lines.append(f"  {row['label'][:40]:<42}" + "  ".join(f"{c:>13}" for c in cells))
    lmdb, ceiling, vllm = rows.get("lmdb"), rows.get("ceiling"), rows.get("vllm_fs")
    if lmdb and ceiling:
        lines.append(f"  {'LMDB cold / ceiling, each round':<42}" + "".join(
            _cell(a["cold_read_gbps"] / b["cold_read_gbps"], 7) for a, b in zip(lmdb["runs"], ceiling["runs"])))
    if lmdb and vllm:
        lines.append(f"  {'LMDB cold / vLLM FS tier, each round':<42}" + "".join(
            _cell(a["cold_read_gbps"] / b["cold_read_gbps"], 7) for a, b in zip(lmdb["runs"], vllm["runs"])))
    if ceiling and "write_methods" in ceiling["runs"][0]:
        lines += ceiling_table(res["rows"]["ceiling"])
    if lmdb and lmdb["runs"][0].get("cold_paths"):
        cells = [f"{p.get('hot', 0)}h/{p.get('direct', 0)}d/{p.get('buffered', 0)}b"
                 for p in (r["cold_paths"] for r in lmdb["runs"])]
        lines.append(f"  {'LMDB cold records per path (h/d/b)':<42}" + "  ".join(f"{c:>13}" for c in cells)
                     + ("   (cold runs: O_DIRECT)" if lmdb["runs"][0]["cold_paths"].get("cold_direct")
                        else "   (cold runs: page cache, kernel read-ahead)"))
    return lines


def ceiling_table(row: dict[str, Any]) -> list[str]:
    """Each raw method of the ceiling: its median and every round, GB/s, and for the cold
    reads what the disk did (KiB per request, queue depth, busy); ``*`` marks the method
    that is the ceiling."""
    runs, chosen = row["runs"], row["methods"]
    huge = runs[0].get("huge_pages") or {}
    lines = [f"{'disk ceiling, each raw method (GB/s)':<44}{'median':>7}" + "".join(
        f"{f'r{i + 1}':>7}" for i in range(len(runs)))
        + "   huge pages backing the THP buffers: " + ", ".join(
            f"{k} {'?' if v is None else format(v, '.0%')}" for k, v in huge.items())]
    for key, what, mark in (("write_methods", "write", chosen["write"]), ("cold_methods", "cold", chosen["cold"])):
        for method in runs[0][key]:
            vals = [r[key][method] for r in runs]
            star = "*" if method == mark else " "
            line = f" {star}{what + ', ' + method:<42}{statistics.median(vals):>7.2f}" + "".join(_cell(v, 7) for v in vals)
            if key == "cold_methods":
                line += "   " + " ".join("-" if not (d := r["cold_disks"][method]) else
                                         f"{d['kib_per_request']:.0f}/{d['queue_depth']:.1f}/{d['busy']:.2f}"
                                         for r in runs)
            lines.append(line)
    return lines


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {k: r for k, r in res["rows"].items() if "not_run" not in r}
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(rows)
    for i, (name, row) in enumerate(rows.items()):
        xs = [j + i * width for j in range(len(METRICS))]
        vals = [row["median"][m] or 0.0 for m in METRICS]
        hatch = "//" if row["kind"] == "peer" else None
        ax.bar(xs, vals, width, label=row["label"], hatch=hatch)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(METRICS))],
                  ["write", "cold read", "hot read"])
    ax.set_ylabel("GB/s (payload)")
    c = res["config"]
    missing = [r["label"] for r in res["rows"].values() if "not_run" in r]
    note = res["machine"].get("note")
    ax.set_title(f"disk tier, {c['records']} x {c['payload_bytes']:,} B blocks, median of {c['repeats']}, "
                 f"same run" + (f" (not run: {', '.join(missing)})" if missing else "")
                 + (f"\n{note}" if note else ""), fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 blocks, 2 rounds, JSON only")
    ap.add_argument("--records", type=int, help="blocks (default 128 quick, 512 full)")
    ap.add_argument("--payload-bytes", type=int, default=None,
                    help=f"bytes per block (default the Flash block, {FLASH_BLOCK_BYTES:,})")
    ap.add_argument("--batch", type=int, default=16, help="blocks per put_many / get_many / peer call (default 16)")
    ap.add_argument("--repeats", type=int, help="timed rounds (default 2 quick, 5 full)")
    ap.add_argument("--peer-python", action="append", default=[], metavar="NAME=PATH",
                    help="the interpreter of a peer's venv (names: "
                         + ", ".join(p.name for p in PEERS) + "; default <checkout>/<venv>/bin/python)")
    ap.add_argument("--no-peers", action="store_true", help="measure our stores and the baselines only")
    ap.add_argument("--note", default=None, help="recorded in the JSON, e.g. 'shared machine'")
    ap.add_argument("--dir", type=Path, default=None, help="filesystem to measure (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    records = args.records or (128 if args.quick else 512)
    repeats = args.repeats or (2 if args.quick else 5)
    peers = {} if args.no_peers else {p.name: p.python() for p in PEERS}
    for spec in args.peer_python:
        name, sep, path = spec.partition("=")
        if not sep or name not in {p.name for p in PEERS}:
            ap.error(f"--peer-python: expected NAME=PATH with NAME one of {[p.name for p in PEERS]}, got {spec!r}")
        peers[name] = Path(path)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tkv-disk-bench-", dir=args.dir))
    try:
        res = run(records, args.batch, repeats, workdir, payload_bytes=args.payload_bytes, peers=peers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.note:
        res["machine"]["note"] = args.note
    print(table(res))
    (args.out / "disk.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out / 'disk.json'}")
    if not args.quick:
        plot(res, args.out / "disk.png")
        print(f"wrote {args.out / 'disk.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
