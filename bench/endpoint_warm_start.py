"""Time to first token over HTTP: cold, warm from the GPU pool, warm from disk after a restart.

    python bench/endpoint_warm_start.py --quick   # 1 round, ~20 s on 2 cores
    python bench/endpoint_warm_start.py           # 3 rounds, medians

Each round, on a fresh LMDB store: ``tiered-kv serve-reference`` (a child process) is
warmed with ``tiered-kv warm-start --endpoint URL --prompts bundled --passes 2 --store``
(pass 1 **cold**, the baseline; pass 2 warm from the server's GPU pool), stopped with
SIGTERM, and a second server on the same store is asked the same prompts once (**warm
from disk**: every prompt resumes from the store). Prints the mean TTFT per prompt of each,
the ratios to the cold baseline, tokens computed and store hits; writes
``bench/results/endpoint_warm_start.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tiered_kv.cli._common import BUNDLED_PROMPTS, load_prompts, parse_store
from tiered_kv.cli._warm_endpoint import warm_endpoint

RESULTS = Path(__file__).resolve().parent / "results"


def serve(store: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tiered_kv.cli", "serve-reference", "--store", str(store),
                             "--port", "0", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"serve-reference did not start: {proc.communicate()[1]}")
    proc.url = json.loads(line)["url"]  # type: ignore[attr-defined]
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"serve-reference exited {proc.returncode}: {err}")


def one_round(store: Path) -> dict[str, Any]:
    prompts = load_prompts(BUNDLED_PROMPTS)
    loc = parse_store(str(store))
    first = serve(store)
    try:
        r1 = warm_endpoint(first.url, prompts, passes=2, store=loc, verbose=False)  # type: ignore[attr-defined]
    finally:
        stop(first)
    second = serve(store)
    try:
        r2 = warm_endpoint(second.url, prompts, passes=1, store=loc, verbose=False)  # type: ignore[attr-defined]
    finally:
        stop(second)

    def row(p: dict[str, Any]) -> dict[str, Any]:
        t = p["totals"]
        return {"mean_ttft_s": t["mean_ttft_s"], "median_ttft_s": t["median_ttft_s"],
                "computed_tokens": t["computed_tokens"], "cached_tokens": t["cached_tokens"],
                "store_hits": p["store"]["hits"]}

    return {"cold": row(r1["passes"][0]), "gpu_warm": row(r1["passes"][1]), "disk_warm": row(r2["passes"][0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    rows = []
    for i in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(one_round(Path(tmp) / "store"))
        r = rows[-1]
        print(f"round {i + 1}: mean ttft cold {r['cold']['mean_ttft_s'] * 1e3:.1f} ms, "
              f"gpu-warm {r['gpu_warm']['mean_ttft_s'] * 1e3:.1f} ms, "
              f"disk-warm {r['disk_warm']['mean_ttft_s'] * 1e3:.1f} ms", flush=True)
    med = {k: statistics.median(r[k]["mean_ttft_s"] for r in rows) for k in ("cold", "gpu_warm", "disk_warm")}
    last = rows[-1]
    print(f"\nmedian over {rounds} round(s) of the mean TTFT per prompt (8 bundled prompts, 6103 tokens), "
          f"client-side over HTTP:")
    for k, label in (("cold", "cold (baseline)"), ("gpu_warm", "warm, GPU pool"),
                     ("disk_warm", "warm, store after restart")):
        print(f"  {label:<27} {med[k] * 1e3:7.1f} ms  {med['cold'] / med[k]:4.2f}x  "
              f"computed {last[k]['computed_tokens']:>5} tokens, store hits {last[k]['store_hits']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "endpoint_warm_start.json").write_text(json.dumps(
        {"machine": platform.platform(), "rounds": rows, "median_mean_ttft_s": med}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    labels = ["cold", "warm\n(GPU pool)", "warm\n(store, restart)"]
    ax.bar(labels, [med[k] * 1e3 for k in ("cold", "gpu_warm", "disk_warm")], color=["#999", "#4a8", "#48c"])
    ax.set_ylabel("mean TTFT per prompt (ms)")
    ax.set_title("serve-reference over HTTP, bundled prompts")
    fig.tight_layout()
    fig.savefig(RESULTS / "endpoint_warm_start.png", dpi=120)


if __name__ == "__main__":
    main()
