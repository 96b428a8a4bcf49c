"""Prefix-hash speed: chained block hashes of a long prompt against one raw sha256.

    python bench/prefix_hash.py --quick      # a few seconds

For a prompt of N tokens (1M by default) it times, ``--repeats`` times each in one run:

    prefix    PrefixHasher(flash).block_hashes(tokens)   every 128-token block's chained hash
    baseline  hashlib.sha256(token bytes).digest()       one hash over the same bytes

and prints the medians, the ratio baseline/prefix (how close the chain gets to raw hashing
speed) and the target: 1M tokens well under 50 ms. Writes ``bench/results/prefix_hash.json``
and a PNG of time versus prompt length.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from tiered_kv import presets
from tiered_kv.prefix import PrefixHasher, tokens_to_bytes

RESULTS = Path(__file__).resolve().parent / "results"


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(num_tokens: int, repeats: int) -> dict[str, float]:
    hasher = PrefixHasher(presets.deepseek_v4_flash(), salt="bench")
    tokens = np.random.default_rng(0).integers(0, 129280, num_tokens, dtype=np.int64)
    raw = tokens_to_bytes(tokens)
    prefix = median_s(lambda: hasher.block_hashes(tokens), repeats)
    baseline = median_s(lambda: hashlib.sha256(raw).digest(), repeats)
    return {"tokens": num_tokens, "blocks": num_tokens // 128, "prefix_ms": prefix * 1e3,
            "baseline_ms": baseline * 1e3, "ratio": baseline / prefix}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    sizes = [1 << 16, 1 << 20] if args.quick else [1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
    rows = [measure(n, repeats) for n in sizes]
    print(f"{'tokens':>9} {'blocks':>7} {'prefix ms':>10} {'sha256 ms':>10} {'sha256/prefix':>14}")
    for r in rows:
        print(f"{r['tokens']:>9} {r['blocks']:>7} {r['prefix_ms']:>10.2f} {r['baseline_ms']:>10.2f} {r['ratio']:>14.2f}")
    one_m = next(r for r in rows if r["tokens"] == 1 << 20)
    verdict = "met" if one_m["prefix_ms"] < 50 else "MISSED"
    print(f"target: 1M tokens < 50 ms -> {one_m['prefix_ms']:.1f} ms ({verdict}); medians of {repeats}")
    RESULTS.mkdir(exist_ok=True)
    out = {"statistic": "median", "repeats": repeats, "machine": {"platform": platform.platform()},
           "rows": rows, "target_ms_1m": 50, "met": one_m["prefix_ms"] < 50}
    (RESULTS / "prefix_hash.json").write_text(json.dumps(out, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["tokens"] for r in rows]
    ax.loglog(xs, [r["prefix_ms"] for r in rows], "o-", label="chained block hashes")
    ax.loglog(xs, [r["baseline_ms"] for r in rows], "s--", label="one sha256 (baseline)")
    ax.axhline(50, color="grey", lw=0.8, ls=":", label="50 ms target")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms (median)")
    ax.set_title("Prefix hash of a prompt")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "prefix_hash.png", dpi=120)


if __name__ == "__main__":
    main()
