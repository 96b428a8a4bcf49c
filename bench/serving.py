"""The serving loop at length: throughput and tokens computed with the tiered cache,
beside the same workload with prefix reuse off, measured in the same run.

    python bench/serving.py --quick          # 60 requests, a few minutes on 2 cores
    python bench/serving.py --requests 1000  # the long variant

Workload: requests whose prompts share random prefixes (``make_workload``), 20% aborted
mid-prefill or mid-decode, a GPU pool small enough that blocks are evicted to a small
host tier and to an LMDB store, preemption when the pool is full. Reports wall time,
tokens computed per request, prompt tokens served from cache, and the ratio
``baseline time / tiered time``; checks that no block leaked. Writes
``bench/results/serving.json`` and ``bench/results/serving.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

from tiered_kv import TieredKVCache, presets
from tiered_kv.hisparse import HiSparseConfig
from tiered_kv.reference import ReferenceModel
from tiered_kv.reference.serving import ServingLoop, Status, make_workload

RESULTS = Path(__file__).resolve().parent / "results"


def run_once(num_requests: int, *, reuse: bool, hisparse: bool, seed: int) -> dict:
    layout = presets.tiny()
    model = ReferenceModel(layout, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        extra = {"hisparse": HiSparseConfig(device_buffer_entries=2 * layout.top_k)} if hisparse else {}
        host_records = 20 if hisparse else 8
        cache = TieredKVCache(layout, num_blocks=24, num_state_slots=3, num_snapshots=12, snapshot_interval=2,
                              host_bytes=host_records * layout.block_bytes + 2 * layout.snapshot_bytes,
                              store=f"lmdb://{tmp}/store", **extra)
        loop = ServingLoop(model, cache, prefill_chunk=128, reuse=reuse)
        for r in make_workload(num_requests, seed=seed, num_prefixes=12, prefix_tokens=(300, 1200),
                               suffix_tokens=(1, 60), new_tokens=(1, 4), record_every=10**9):
            loop.submit(r)
        t0 = time.perf_counter()
        done = loop.run()
        cache.flush()
        wall = time.perf_counter() - t0
        s = cache.stats()
        assert s["blocks_used"] == 0 and s["live_requests"] == 0, "leak"
        cache.shutdown()
    return {"reuse": reuse, "hisparse": hisparse, "requests": len(done), "wall_s": wall,
            "done": sum(r.status is Status.DONE for r in done),
            "aborted": sum(r.status is Status.ABORTED for r in done),
            "tokens_computed": loop.tokens_computed, "prompt_tokens": s["prompt_tokens"],
            "cached_tokens": s["cached_tokens"], "preemptions": loop.preemptions,
            "blocks_evicted": s["blocks_evicted"], "blocks_from_host": s["blocks_from_host"],
            "blocks_from_disk": s["blocks_from_disk"], "snapshots_from_disk": s["snapshots_from_disk"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    n = args.requests or (60 if args.quick else 1000)
    rows = []
    for hisparse in (False, True):
        tiered = run_once(n, reuse=True, hisparse=hisparse, seed=args.seed)
        base = run_once(n, reuse=False, hisparse=hisparse, seed=args.seed)
        rows.append({"tiered": tiered, "baseline": base, "speedup": base["wall_s"] / tiered["wall_s"],
                     "compute_ratio": base["tokens_computed"] / max(tiered["tokens_computed"], 1)})
    print(f"{'config':<10} {'requests':>8} {'tiered s':>9} {'no-reuse s':>10} {'speedup':>8} "
          f"{'computed tiered':>16} {'computed base':>14} {'cached tok':>10} {'from host':>9} {'from disk':>9} "
          f"{'preempt':>7}")
    for row in rows:
        t, b = row["tiered"], row["baseline"]
        name = "hisparse" if t["hisparse"] else "plain"
        print(f"{name:<10} {t['requests']:>8} {t['wall_s']:>9.1f} {b['wall_s']:>10.1f} {row['speedup']:>8.2f} "
              f"{t['tokens_computed']:>16} {b['tokens_computed']:>14} {t['cached_tokens']:>10} "
              f"{t['blocks_from_host']:>9} {t['blocks_from_disk']:>9} {t['preemptions']:>7}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "serving.json").write_text(json.dumps({"machine": platform.platform(), "rows": rows}, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["hisparse" if r["tiered"]["hisparse"] else "plain" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["baseline"]["wall_s"] for r in rows], 0.4, label="no prefix reuse (baseline)")
    ax.bar([x + 0.2 for x in xs], [r["tiered"]["wall_s"] for r in rows], 0.4, label="tiered cache")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("wall seconds")
    ax.set_title(f"Serving loop, {n} requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "serving.png", dpi=120)


if __name__ == "__main__":
    main()
