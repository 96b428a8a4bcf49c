"""Disk-tier throughput: LMDB and Zarr block stores against a raw-file baseline.

Records are Flash-sized: the payload is one 128-token DeepSeek-V4-Flash fp8 block
(``deepseek_v4_flash().block_bytes`` = 492,832 bytes). Every number is payload bytes over
wall time, the median of ``--repeats`` runs, and each backend is also shown as a ratio of
the raw baseline measured in the same run on the same filesystem:

    write      raw: write() the payloads back to back to one file, fsync after every batch
               store: put_many(batch) into a fresh store (each call is durable when it returns)
    cold read  drop the page cache of the files (posix_fadvise DONTNEED; the store closed
               first so nothing is mapped), then read every record once
               raw: readinto() one preallocated buffer; store: get_many into preallocated
               numpy buffers (verified: checksum, fingerprint, key)
    hot read   the same reads again, now from the page cache

    python bench/disk.py --quick     # < 1 minute; writes bench/results/disk.json
    python bench/disk.py             # also bench/results/disk.png
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # allow `python bench/disk.py` from a checkout
    sys.path.insert(0, str(ROOT))

from tiered_kv.storage import BlockStore, LmdbStore, PutItem, RecordKey, ZarrStore, record_size  # noqa: E402

FLASH_BLOCK_BYTES = 492_832  # 21*32*584 + 21*32*132 + 20*1*584


def flash_block_bytes() -> int:
    try:
        from tiered_kv.presets import deepseek_v4_flash
    except ImportError:
        return FLASH_BLOCK_BYTES
    return deepseek_v4_flash().block_bytes


FINGERPRINT = "kvl1-bench-flash-fp8"
BACKENDS: dict[str, Callable[[Path, int], BlockStore]] = {
    "lmdb": lambda path, max_bytes: LmdbStore(path, layout_fingerprint=FINGERPRINT, max_bytes=max_bytes),
    "zarr": lambda path, max_bytes: ZarrStore(path, layout_fingerprint=FINGERPRINT, max_bytes=max_bytes),
}


def drop_cache(path: Path) -> None:
    """posix_fadvise(DONTNEED) every file under ``path`` (clean pages leave the page cache)."""
    files = [path] if path.is_file() else [Path(d) / f for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class Workload:
    """``n`` distinct Flash-block payloads and their keys, written in batches of ``batch``."""

    def __init__(self, n: int, batch: int, payload_bytes: int) -> None:
        rng = np.random.default_rng(0)
        self.payload_bytes = payload_bytes
        self.batch = batch
        self.payloads = [rng.integers(0, 256, payload_bytes, dtype=np.uint8) for _ in range(n)]
        hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(n)]
        self.items = [PutItem(RecordKey.block(h), parent_hash=bytes(32), token_digest=hashlib.sha256(h).digest(),
                              payload=p) for h, p in zip(hashes, self.payloads)]
        self.keys = [it.key for it in self.items]
        self.total = n * payload_bytes

    def batches(self, seq: list[Any]) -> list[list[Any]]:
        return [seq[i:i + self.batch] for i in range(0, len(seq), self.batch)]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ------------------------------------------------------------------ raw baseline
def raw_run(w: Workload, workdir: Path) -> dict[str, float]:
    path = workdir / "raw.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for batch in w.batches(w.payloads):
            for p in batch:
                view = memoryview(p)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
    finally:
        os.close(fd)
    write_s = time.perf_counter() - t0

    buf = np.empty(w.payload_bytes, np.uint8)

    def read_all() -> float:
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            for _ in range(len(w.payloads)):
                if f.readinto(buf) != w.payload_bytes:
                    raise RuntimeError("raw read came back short")
        return time.perf_counter() - t

    drop_cache(path)
    cold_s = read_all()
    hot_s = read_all()
    path.unlink()
    return {"write_gbps": gbps(w.total, write_s), "cold_read_gbps": gbps(w.total, cold_s),
            "hot_read_gbps": gbps(w.total, hot_s)}


# ------------------------------------------------------------------ stores
def store_run(name: str, w: Workload, workdir: Path) -> dict[str, float]:
    path = workdir / name
    max_bytes = 2 * len(w.items) * record_size(w.payload_bytes)
    open_store = BACKENDS[name]
    store = open_store(path, max_bytes)
    try:
        t0 = time.perf_counter()
        for batch in w.batches(w.items):
            if not all(store.put_many(batch)):
                raise RuntimeError(f"{name}: a fresh store reported an existing record")
        write_s = time.perf_counter() - t0
    finally:
        store.close()

    outs = [np.empty(w.payload_bytes, np.uint8) for _ in range(w.batch)]

    def read_all(store: BlockStore) -> float:
        t = time.perf_counter()
        for keys in w.batches(w.keys):
            metas = store.get_many(keys, outs[:len(keys)])
            if any(m is None for m in metas):
                raise RuntimeError(f"{name}: a stored record was a miss")
        return time.perf_counter() - t

    drop_cache(path)
    store = open_store(path, max_bytes)
    try:
        cold_s = read_all(store)
        hot_s = read_all(store)
        last = w.batches(list(range(len(w.keys))))[-1]  # the outs hold the last batch now
        np.testing.assert_array_equal(outs[0], w.payloads[last[0]])
    finally:
        store.close()
    shutil.rmtree(path)
    return {"write_gbps": gbps(w.total, write_s), "cold_read_gbps": gbps(w.total, cold_s),
            "hot_read_gbps": gbps(w.total, hot_s)}


# ------------------------------------------------------------------ driver
METRICS = ("write_gbps", "cold_read_gbps", "hot_read_gbps")
TARGETS = {"write_ratio": 0.8, "cold_read_ratio": 0.8}  # for lmdb


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {m: statistics.median(r[m] for r in runs) for m in METRICS}


def run(records: int, batch: int, repeats: int, workdir: Path) -> dict[str, Any]:
    w = Workload(records, batch, flash_block_bytes())
    warm = Workload(min(records, 2 * batch), batch, w.payload_bytes)
    raw_run(warm, workdir)  # untimed: first-use costs (imports, allocator, thread pools)
    for name in BACKENDS:
        store_run(name, warm, workdir)
    runs: dict[str, list[dict[str, float]]] = {"raw": [], **{b: [] for b in BACKENDS}}
    for _ in range(repeats):  # interleaved, so that drifts of the disk hit everyone alike
        runs["raw"].append(raw_run(w, workdir))
        for name in BACKENDS:
            runs[name].append(store_run(name, w, workdir))
    baseline = median_of(runs["raw"])
    backends: dict[str, dict[str, float]] = {}
    for name in BACKENDS:
        med = median_of(runs[name])
        for m in METRICS:
            med[m.replace("_gbps", "_ratio")] = med[m] / baseline[m]
        backends[name] = med
    return {
        "config": {"payload_bytes": w.payload_bytes, "record_bytes": record_size(w.payload_bytes),
                   "records": records, "batch": batch, "repeats": repeats, "total_bytes": w.total,
                   "workdir": str(workdir), "statistic": "median"},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "baseline": baseline,
        "backends": backends,
        "targets": {"lmdb": TARGETS},
        "runs": runs,
    }


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [f"disk tier: {c['records']} records x {c['payload_bytes']:,} B payload "
             f"({c['total_bytes'] / 1e6:.0f} MB), batches of {c['batch']}, median of {c['repeats']}",
             f"{'backend':<8}{'write GB/s':>12}{'ratio':>8}{'cold GB/s':>12}{'ratio':>8}"
             f"{'hot GB/s':>12}{'ratio':>8}"]
    b = res["baseline"]
    lines.append(f"{'raw':<8}{b['write_gbps']:>12.3f}{'1.00':>8}{b['cold_read_gbps']:>12.3f}{'1.00':>8}"
                 f"{b['hot_read_gbps']:>12.3f}{'1.00':>8}")
    for name, r in res["backends"].items():
        lines.append(f"{name:<8}{r['write_gbps']:>12.3f}{r['write_ratio']:>8.2f}{r['cold_read_gbps']:>12.3f}"
                     f"{r['cold_read_ratio']:>8.2f}{r['hot_read_gbps']:>12.3f}{r['hot_read_ratio']:>8.2f}")
    lmdb = res["backends"]["lmdb"]
    verdict = [f"{k} {lmdb[k]:.2f} ({'meets' if lmdb[k] >= t else 'misses'} >= {t})" for k, t in TARGETS.items()]
    lines.append("lmdb targets: " + ", ".join(verdict))
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["raw", *res["backends"]]
    rows = [res["baseline"], *res["backends"].values()]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(names)
    for i, (name, row) in enumerate(zip(names, rows)):
        xs = [j + i * width for j in range(len(METRICS))]
        bars = ax.bar(xs, [row[m] for m in METRICS], width, label=name)
        if name != "raw":
            ratios = [row[m.replace("_gbps", "_ratio")] for m in METRICS]
            ax.bar_label(bars, labels=[f"{r:.2f}x" for r in ratios], fontsize=7)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(METRICS))],
                  ["write + fsync", "cold read", "hot read"])
    ax.set_ylabel("GB/s (payload)")
    c = res["config"]
    ax.set_title(f"disk tier, {c['records']} x {c['payload_bytes']:,} B records (median of {c['repeats']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 1 min), JSON only")
    ap.add_argument("--records", type=int, help="records per run (default 128 quick, 512 full)")
    ap.add_argument("--batch", type=int, default=16, help="records per put_many / fsync (default 16)")
    ap.add_argument("--repeats", type=int, help="runs per measurement (default 5 quick, 7 full)")
    ap.add_argument("--dir", type=Path, default=None, help="filesystem to measure (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    records = args.records or (128 if args.quick else 512)
    repeats = args.repeats or (5 if args.quick else 7)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tkv-disk-bench-", dir=args.dir))
    try:
        res = run(records, args.batch, repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(res))
    (args.out / "disk.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out / 'disk.json'}")
    if not args.quick:
        plot(res, args.out / "disk.png")
        print(f"wrote {args.out / 'disk.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
