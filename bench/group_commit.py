"""Concurrent writers on one LMDB store: group commit against one-sync-per-call, same run.

    python bench/group_commit.py --quick     # < 1 minute on 2 cores
    python bench/group_commit.py             # more data, more repetitions

``--writers`` threads of one process each store ``--batches`` batches of ``--records``
records of ``--payload`` bytes (default: 4 writers, 16 x 512 KiB, vLLM's tier jobs) with
``put_many``, every one fsync-durable when it returns. Three ways, alternated within
every repetition so machine load hits them alike:

- ``group``: the store as it is: the writers append in parallel and share each segment
  sync and index commit (storage/group_commit.py);
- ``serial``: the same calls one at a time (a lock around ``put_many``): each call appends,
  syncs and commits alone, as the store did before group commit (the baseline);
- ``raw``: the same bytes, each writer ``pwrite``\\ s its batch (``O_DIRECT`` where the
  filesystem takes it) into a file of its own and ``fdatasync``\\ s it: no index, no
  checksum, no staging copy (the disk's durable-write figure for this pattern).

Prints MB/s (payload) and the ratios group / serial and group / raw, the groups the
store formed; writes ``bench/results/group_commit.json`` (and ``.png`` without --quick).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # allow `python bench/group_commit.py` from a checkout
    sys.path.insert(0, str(ROOT))

from tiered_kv.storage import LmdbStore, PutItem, RecordKey  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FP = "bench-group-commit"
MODES = ("group", "serial", "raw")


def _payloads(records: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(records)]


def _run_threads(writers: int, work: Callable[[int], None]) -> float:
    """Seconds for ``writers`` threads each running ``work(w)``, started together."""
    start = threading.Barrier(writers + 1)
    errors: list[BaseException] = []

    def run(w: int) -> None:
        start.wait()
        try:
            work(w)
        except BaseException as e:  # reported after the run
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def run_store(root: Path, mode: str, a: argparse.Namespace, payloads: list[np.ndarray], rep: int
              ) -> tuple[float, dict[str, int]]:
    store = LmdbStore(root / "store", layout_fingerprint=FP)
    serial = threading.Lock()

    def work(w: int) -> None:
        for b in range(a.batches):
            items = [PutItem(RecordKey.block(_hash(rep, w, b, i)), bytes(32), bytes(32), p)
                     for i, p in enumerate(payloads)]
            if mode == "serial":
                with serial:
                    ok = store.put_many(items)
            else:
                ok = store.put_many(items)
            assert all(ok)

    try:
        seconds = _run_threads(a.writers, work)
        groups = {"groups": store._commits.groups, "batches": store._commits.batches}
        assert len(store) == a.writers * a.batches * a.records
    finally:
        store.close()
    return seconds, groups


def run_raw(root: Path, a: argparse.Namespace, payloads: list[np.ndarray]) -> float:
    batch = sum(p.nbytes for p in payloads)
    padded = -(-batch // 4096) * 4096
    bufs = []
    for _ in range(a.writers):  # aligned sources, as O_DIRECT needs (the store stages into one too)
        buf = np.frombuffer(mmap.mmap(-1, padded), np.uint8)
        buf[:batch] = np.concatenate(payloads)
        bufs.append(buf)

    def work(w: int) -> None:
        path = root / f"raw{w}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            for b in range(a.batches):
                os.posix_fallocate(fd, b * padded, padded)
                done = 0
                while done < padded:
                    done += os.pwrite(fd, memoryview(bufs[w])[done:], b * padded + done)
                os.fdatasync(fd)
        finally:
            os.close(fd)

    return _run_threads(a.writers, work)


def _hash(rep: int, w: int, b: int, i: int) -> bytes:
    return (rep.to_bytes(4, "little") + w.to_bytes(4, "little") + b.to_bytes(4, "little")
            + i.to_bytes(4, "little")) * 2


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    values = [res["median_mb_s"][m] for m in MODES]
    bars = ax.bar(MODES, values, color=["tab:blue", "tab:gray", "tab:green"])
    ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], fontsize=8)
    c = res["config"]
    ax.set_ylabel("MB/s (payload), fsync-durable")
    ax.set_title(f"{c['writers']} writers x {c['batches']} batches x {c['records']} x {c['payload']:,} B "
                 f"(median of {c['repeats']}); group/serial {res['ratio']['group_vs_serial']:.2f}x", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--batches", type=int, default=8, help="put_many calls per writer")
    ap.add_argument("--records", type=int, default=16, help="records per put_many")
    ap.add_argument("--payload", type=int, default=512 << 10, help="bytes per record")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path.home(), help="where the stores go (a real disk)")
    ap.add_argument("--quick", action="store_true", help="small run (< 1 min), JSON only")
    a = ap.parse_args()
    if a.quick:
        a.batches, a.repeats = 4, 3
    for name in ("writers", "batches", "records", "payload", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}: expected a positive int, got {getattr(a, name)}")
    payloads = _payloads(a.records, a.payload)
    total = a.writers * a.batches * a.records * a.payload
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    groups: list[dict[str, int]] = []
    for rep in range(a.repeats):
        for mode in MODES:
            with tempfile.TemporaryDirectory(dir=a.dir) as d:
                if mode == "raw":
                    seconds = run_raw(Path(d), a, payloads)
                else:
                    seconds, g = run_store(Path(d), mode, a, payloads, rep)
                    if mode == "group":
                        groups.append(g)
            runs[mode].append(total / seconds / 1e6)
    med = {m: statistics.median(v) for m, v in runs.items()}
    ratio = {"group_vs_serial": med["group"] / med["serial"], "group_vs_raw": med["group"] / med["raw"]}
    print(f"{a.writers} writers x {a.batches} put_many x {a.records} records x {a.payload:,} B "
          f"({total / 1e6:.0f} MB a run), medians of {a.repeats}, MB/s, every call fsync-durable")
    print(f"  group commit (the store)      {med['group']:7.0f}   "
          f"groups: {groups[-1]['batches']} calls in {groups[-1]['groups']} commits (last run)")
    print(f"  one sync per call (baseline)  {med['serial']:7.0f}")
    print(f"  raw pwrite + fdatasync        {med['raw']:7.0f}")
    print(f"  ratio group / serial {ratio['group_vs_serial']:.2f}   group / raw {ratio['group_vs_raw']:.2f}")
    res = {"config": {"writers": a.writers, "batches": a.batches, "records": a.records, "payload": a.payload,
                      "repeats": a.repeats, "dir": str(a.dir)},
           "runs_mb_s": runs, "median_mb_s": med, "ratio": ratio, "groups": groups,
           "machine": "2 shared CPU cores, no GPU"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "group_commit.json").write_text(json.dumps(res, indent=2) + "\n")
    if not a.quick:
        plot(res, RESULTS / "group_commit.png")


if __name__ == "__main__":
    main()
