"""What checking and rebuilding the LMDB index costs, against what reading it costs anyway.

    python bench/index_check.py --quick      # under a minute

Every open of an LMDB store walks every page of its index with pread before LMDB maps
it (storage/lmdb_file.py: a damaged index must be an error, never a SIGBUS), and a
damaged index is rebuilt from the segment files (storage/lmdb_rebuild.py). For a store
of N small records (the index's size grows with the record count, not the payloads) it
times, medians of ``--repeats`` in one run:

    walk      walk_index(data.mdb)                        the check every open runs
    open      LmdbStore(readonly=True) opened and closed  (includes the walk)
    baseline  one LMDB cursor pass over the records' keys  (what `stats` does to count them)
    rebuild   rebuild_index() of the store                (scan + verify every record, write a new index)
    read      reading every segment file once             (its baseline: the bytes it must read)

and prints walk/baseline and rebuild/read. Writes ``bench/results/index_check.json`` and a
PNG. Figures from a machine shared with other jobs are noisy: compare the ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np

from tiered_kv.storage import LmdbStore, PutItem, RecordKey
from tiered_kv.storage.lmdb.pages import walk_index
from tiered_kv.storage.lmdb.rebuild import rebuild_index

RESULTS = Path(__file__).resolve().parent / "results"
FP = "kvl1-bench-0123456789abcdef01"
PAYLOAD = 64


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up (and the page cache)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(where: Path, n: int) -> None:
    payload = np.zeros(PAYLOAD, np.uint8)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        for start in range(0, n, 5000):
            items = []
            for i in range(start, min(n, start + 5000)):
                h = hashlib.sha256(i.to_bytes(8, "little")).digest()
                items.append(PutItem(RecordKey.block(h), parent_hash=h, token_digest=h, payload=payload))
            store.put_many(items)


def iterate_keys(where: Path) -> int:
    env = lmdb.open(str(where), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            db = env.open_db(b"records", txn=txn, create=False)
            return sum(1 for _ in txn.cursor(db=db).iternext(keys=True, values=False))
    finally:
        env.close()


def read_segments(where: Path) -> int:
    total = 0
    for p in sorted((where / "segments").glob("*.seg")):
        with open(p, "rb") as f:
            while chunk := f.read(8 << 20):
                total += len(chunk)
    return total


def measure(n: int, repeats: int, root: Path) -> dict[str, float]:
    where = root / f"s{n}"
    build(where, n)
    data = where / "data.mdb"
    index_bytes, pages = data.stat().st_size, walk_index(data).pages
    walk = median_s(lambda: walk_index(data), repeats)
    opened = median_s(lambda: LmdbStore(where, layout_fingerprint=FP, readonly=True).close(), repeats)
    baseline = median_s(lambda: iterate_keys(where), repeats)
    read = median_s(lambda: read_segments(where), repeats)
    rebuild = median_s(lambda: rebuild_index(where, FP), max(1, repeats // 3))
    shutil.rmtree(where)
    return {"records": n, "index_bytes": index_bytes, "pages": pages, "walk_ms": walk * 1e3,
            "open_ms": opened * 1e3,
            "baseline_ms": baseline * 1e3, "walk_over_baseline": walk / baseline,
            "rebuild_ms": rebuild * 1e3, "read_ms": read * 1e3, "rebuild_over_read": rebuild / read}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    sizes = [10_000, 50_000] if args.quick else [10_000, 100_000, 500_000]
    with tempfile.TemporaryDirectory(prefix="tkv-index-bench-") as tmp:
        rows = [measure(n, repeats, Path(tmp)) for n in sizes]
    print(f"{'records':>8} {'walk ms':>9} {'open ms':>9} {'keys ms':>9} {'walk/keys':>9} "
          f"{'rebuild ms':>11} {'read ms':>9} {'rebuild/read':>12}")
    for r in rows:
        print(f"{r['records']:>8} {r['walk_ms']:>9.1f} {r['open_ms']:>9.1f} {r['baseline_ms']:>9.1f} "
              f"{r['walk_over_baseline']:>9.2f} {r['rebuild_ms']:>11.1f} {r['read_ms']:>9.1f} "
              f"{r['rebuild_over_read']:>12.2f}")
    print(f"medians of {repeats} (rebuild: of {max(1, repeats // 3)}); baseline of the walk: one LMDB cursor "
          f"pass over the record keys; of the rebuild: reading the segment files once")
    RESULTS.mkdir(exist_ok=True)
    out = {"statistic": "median", "repeats": repeats, "cpus": os.cpu_count(),
           "machine": {"platform": platform.platform()}, "payload_bytes": PAYLOAD, "rows": rows}
    (RESULTS / "index_check.json").write_text(json.dumps(out, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["records"] for r in rows]
    ax.loglog(xs, [r["walk_ms"] for r in rows], "o-", label="walk (every open)")
    ax.loglog(xs, [r["baseline_ms"] for r in rows], "s--", label="one cursor pass over the keys (baseline)")
    ax.loglog(xs, [r["rebuild_ms"] for r in rows], "^-", label="rebuild from the segments")
    ax.set_xlabel("records")
    ax.set_ylabel("ms (median)")
    ax.set_title("Checking and rebuilding the LMDB index")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "index_check.png", dpi=120)


if __name__ == "__main__":
    main()
