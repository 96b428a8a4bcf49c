"""TieredKVTier (LMDB) against vLLM's own ``fs`` tier, both inside vLLM's real tiering
manager, on the same driver, disk and chunk stream (run in .venv-vllm)::

    .venv-vllm/bin/python tests_integrations/vllm/bench_tier.py [--repeats 3] [--chunks 256]

Per repeat and tier: 16-chunk requests store ``--chunks`` chunks of 512 KiB through a
64-chunk primary tier (so all but the last 64 leave it), wait for the cascades (store
MB/s), then load 48 evicted chunks back through lookups and promotions, checking every
byte (load MB/s). Both read cold: both write with O_DIRECT where the filesystem allows it.
Not like for like on durability: the fs tier neither syncs nor checksums; LMDB commits
durably (fsync) and verifies every read. Our tier reads a lookup's hits ahead of their
load (its default ``read_ahead_bytes``); the fs tier reads at the load job.

Prints medians, the fs tier's beside ours, and the ratio (of the medians, and the median
of each repeat's own ratio: both tiers run back to back in a repeat), plus the CPU seconds per GB of
each phase (the whole process: vLLM's manager and this driver included, alike for both
tiers; less sensitive than wall time to other jobs on the machine); writes
bench/results/vllm_tier.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from _vllm_engine import BLOCKS_PER_CHUNK, Engine, chunk_bytes, chunk_keys

CACHED_CHUNKS = chunk_bytes.cache_info().maxsize

WORKER_BYTES = 256 << 10
CHUNK = WORKER_BYTES * BLOCKS_PER_CHUNK
PRIMARY_CHUNKS = 64
PER_REQUEST = 16
LOADED = 48


def run_once(name: str, root: Path, n: int, seed: str) -> tuple[float, float, float, float]:
    """``(store MB/s, load MB/s, store CPU s/GB, load CPU s/GB)`` of one tier."""
    if name == "tiered_kv":
        engine = Engine(f"lmdb://{root / 'lmdb'}", num_chunks=PRIMARY_CHUNKS, worker_bytes_per_block=WORKER_BYTES,
                        io_threads=4)
    else:
        engine = Engine(None, num_chunks=PRIMARY_CHUNKS, worker_bytes_per_block=WORKER_BYTES, type="fs",
                        root_dir=str(root / "fs"), n_read_threads=4, n_write_threads=4)
    try:
        keys = chunk_keys(seed, n)
        for k in keys:                            # generate the bytes outside the timed part (the
            chunk_bytes(k, CHUNK)                 # tier run second would find them cached)
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, n, PER_REQUEST):
            while engine.try_store(keys[i:i + PER_REQUEST]) is None:
                engine.tier.drain_jobs()          # primary full of chunks in flight: wait, retry
                engine.step()
        engine.wait_jobs()
        store_s, store_cpu = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, LOADED, PER_REQUEST):
            batch = keys[i:i + PER_REQUEST]
            got = engine.load(batch)
            assert got == {k: chunk_bytes(k, CHUNK) for k in batch}, f"{name}: wrong bytes"
        load_s, load_cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        engine.close()
    return (n * CHUNK / store_s / 1e6, LOADED * CHUNK / load_s / 1e6,
            store_cpu / (n * CHUNK / 1e9), load_cpu / (LOADED * CHUNK / 1e9))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=256)
    args = ap.parse_args()
    if not LOADED <= args.chunks <= CACHED_CHUNKS:
        ap.error(f"--chunks: expected {LOADED}..{CACHED_CHUNKS} (the chunks' bytes are generated once, "
                 f"before the timed part, and kept), got {args.chunks}")
    runs: dict[str, list[tuple[float, float, float, float]]] = {"tiered_kv": [], "vllm_fs": []}
    for r in range(args.repeats):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for name in order:                        # alternate, so drift (and going first) hits both alike
            with tempfile.TemporaryDirectory(dir=Path.home()) as d:
                runs[name].append(run_once(name, Path(d), args.chunks, f"bench-{r}"))
    med = {name: tuple(statistics.median(r[j] for r in v) for j in range(4)) for name, v in runs.items()}
    ours, base = med["tiered_kv"], med["vllm_fs"]
    # each repeat runs both tiers back to back: its own ratio is the least exposed to drift
    paired = {what: statistics.median(a[j] / b[j] for a, b in zip(runs["tiered_kv"], runs["vllm_fs"]))
              for j, what in enumerate(("store", "load"))}
    print(f"chunk {CHUNK >> 10} KiB, {args.chunks} stored, {LOADED} loaded back, medians of {args.repeats}")
    print(f"store MB/s: tiered_kv LMDB {ours[0]:.0f}   vLLM fs tier {base[0]:.0f}   ratio {ours[0] / base[0]:.2f}"
          f"   (median of per-repeat ratios {paired['store']:.2f}; CPU s/GB {ours[2]:.2f} / {base[2]:.2f})")
    print(f"load  MB/s: tiered_kv LMDB {ours[1]:.0f}   vLLM fs tier {base[1]:.0f}   ratio {ours[1] / base[1]:.2f}"
          f"   (median of per-repeat ratios {paired['load']:.2f}; CPU s/GB {ours[3]:.2f} / {base[3]:.2f})")
    out = Path(__file__).resolve().parents[2] / "bench" / "results" / "vllm_tier.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"chunk_bytes": CHUNK, "chunks": args.chunks, "loaded": LOADED,
                               "repeats": args.repeats, "runs_mb_s": runs,
                               "runs_columns": ["store MB/s", "load MB/s", "store CPU s/GB", "load CPU s/GB"],
                               "median_mb_s": {k: {"store": v[0], "load": v[1]} for k, v in med.items()},
                               "median_cpu_s_per_gb": {k: {"store": v[2], "load": v[3]} for k, v in med.items()},
                               "ratio": {"store": ours[0] / base[0], "load": ours[1] / base[1]},
                               "median_paired_ratio": paired,
                               "machine": "2 shared CPU cores, no GPU"}, indent=1))


if __name__ == "__main__":
    main()
