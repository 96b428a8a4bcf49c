"""What the upload journal costs the write path: StoreChain.put_many with and without it.

    python bench/upload_journal.py --quick     # ~30 s; writes bench/results/upload_journal.json (+ .png)

A chain ``[LMDB, far level]`` writes each record into the LMDB and queues it for the far
level; with the journal (the default when level 0 is a local directory) ``put_many`` first
adds the batch's keys to ``upload-journal.mdb`` in one fsynced transaction. The far level
here is parked (a level that cannot be opened, retried in an hour), so no upload runs and
the figures are the request path's alone. Records are Flash-sized (one 128-token
DeepSeek-V4-Flash fp8 block, 492,832 bytes), written in ``put_many`` batches of 1 (what
the cache's disk writer does) and of 16. Per case, medians of ``--repeats`` runs, each on
a fresh store, measured in one run:

    baseline   LmdbStore.put_many alone (no chain)
    no journal StoreChain(journal=False).put_many
    journal    StoreChain.put_many (the default)

and the ratio journal / baseline of write throughput (GB/s = 1e9 B/s of payload).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # allow `python bench/upload_journal.py` from a checkout
    sys.path.insert(0, str(ROOT))

from tiered_kv import presets  # noqa: E402
from tiered_kv.storage import DeferredLevel, LmdbStore, PutItem, RecordKey, StoreChain  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUT = presets.deepseek_v4_flash()
BLOCK = LAYOUT.block_bytes


def _parked() -> Any:
    raise ConnectionError("parked for the benchmark")


def _items(n: int) -> list[PutItem]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        h = hashlib.sha256(b"bench-journal" + i.to_bytes(8, "little")).digest()
        out.append(PutItem(RecordKey.block(h), bytes(32), hashlib.sha256(h).digest(),
                           rng.integers(0, 256, BLOCK, dtype=np.uint8)))
    return out


def _run(case: str, items: list[PutItem], batch: int, root: Path) -> float:
    """Seconds to put ``items`` in batches of ``batch`` through ``case``'s store."""
    d = Path(tempfile.mkdtemp(dir=root))
    near = LmdbStore(d / "near", layout_fingerprint=LAYOUT.fingerprint, max_bytes=4 << 30)
    store: Any = near
    if case != "baseline":
        store = StoreChain([near, DeferredLevel("parked", _parked)], owned=[False, True], backoff_initial_s=3600,
                           close_timeout_s=0.1, max_pending_uploads=len(items) + 1,
                           journal=None if case == "journal" else False)
    try:
        t0 = time.perf_counter()
        for i in range(0, len(items), batch):
            store.put_many(items[i:i + batch])
        return time.perf_counter() - t0
    finally:
        if store is not near:
            store.close()
        near.close()
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer records and repeats")
    ap.add_argument("--records", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (default: the temp dir)")
    args = ap.parse_args()
    logging.getLogger("tiered_kv.storage.chain").setLevel(logging.ERROR)  # "closed with N uploads not done"
    n = args.records or (128 if args.quick else 512)
    repeats = args.repeats or (3 if args.quick else 5)
    items = _items(n)
    root = Path(tempfile.mkdtemp(prefix="tkv-bench-journal-", dir=args.dir))
    rows = []
    try:
        for batch in (1, 16):
            times: dict[str, list[float]] = {"baseline": [], "no_journal": [], "journal": []}
            for _ in range(repeats):  # interleaved, so drifting load hits every case alike
                for case in times:
                    times[case].append(_run(case, items, batch, root))
            med = {case: statistics.median(ts) for case, ts in times.items()}
            gbps = {case: n * BLOCK / t / 1e9 for case, t in med.items()}
            rows.append({"batch": batch, "records": n, **{f"{c}_gbps": g for c, g in gbps.items()},
                         "journal_vs_baseline": gbps["journal"] / gbps["baseline"],
                         "journal_vs_no_journal": gbps["journal"] / gbps["no_journal"],
                         "journal_ms_per_call": (med["journal"] - med["no_journal"]) / -(-n // batch) * 1e3})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{n} Flash blocks ({n * BLOCK / 1e6:.0f} MB) per run, medians of {repeats}; GB/s of payload")
    print(f"{'batch':>5} {'baseline':>9} {'no journal':>11} {'journal':>8} {'journal/baseline':>17} "
          f"{'journal/no journal':>19} {'ms per put_many':>16}")
    for r in rows:
        print(f"{r['batch']:>5} {r['baseline_gbps']:>9.3f} {r['no_journal_gbps']:>11.3f} {r['journal_gbps']:>8.3f} "
              f"{r['journal_vs_baseline']:>17.2f} {r['journal_vs_no_journal']:>19.2f} "
              f"{r['journal_ms_per_call']:>16.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = {"benchmark": "upload_journal", "statistic": "median", "repeats": repeats, "block_bytes": BLOCK,
           "machine": {"platform": platform.platform()}, "rows": rows}
    (RESULTS / "upload_journal.json").write_text(json.dumps(out, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    cases = [("baseline", "LMDB alone (baseline)"), ("no_journal", "chain, journal=False"), ("journal", "chain + journal")]
    width = 0.27
    for j, (case, label) in enumerate(cases):
        ax.bar([i + (j - 1) * width for i in range(len(rows))], [r[f"{case}_gbps"] for r in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [f"put_many of {r['batch']}" for r in rows])
    ax.set_ylabel("write GB/s (median)")
    ax.set_title("Upload journal on the write path (Flash blocks)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "upload_journal.png", dpi=120)


if __name__ == "__main__":
    main()
