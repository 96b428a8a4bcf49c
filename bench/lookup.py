"""The router lookup (``TieredKVCache.lookup``) for a 128K-token prompt, against hashing it.

A router asks each engine how much of a prompt it could resume and from which tier,
before it places the request; the lookup must cost little beside hashing the prompt,
which the router does once anyway (issue 21: <= 1 ms beyond hashing for 128K tokens).
The prompt is 131,072 tokens = 1,024 blocks of 128 tokens (the cache's default block),
every block held and a snapshot every 8 blocks and at the end, the whole prompt held:

    gpu     every block and snapshot in the GPU pools
    host    every one in the host tier (the GPU pools hold another prompt)
    disk    every one on disk only (a new cache on the same LMDB store)
    chain   every one on the far level of a chain only (a local Zarr directory standing
            for the bucket; level 0 empty): the lookup asks level 0, then the far level

Each case: ``lookup(block_hashes=..., num_tokens=...)`` (the router keeps hashes),
median of ``--repeats``; baselines measured in the same run: ``PrefixHasher.block_hashes``
of the prompt (what a router pays to hash it) and, for the GPU case, ``open()`` +
``close()`` of the same prompt (what trying it on the cache costs). Also the 512-token
block size of the trace replay (256 blocks). Writes bench/results/lookup.json and .png.

    python bench/lookup.py --quick     # 20 repeats
    python bench/lookup.py             # 200 repeats
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tiered_kv import TieredKVCache, presets  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TOKENS = 131_072
TARGET_MS = 1.0


def write_prompt(cache: TieredKVCache, tokens: list[int]) -> None:
    """Compute ``tokens`` into ``cache`` (no model: the pools' bytes are whatever they hold)
    and close the request, so every block of the prompt is cached and published."""
    bt = cache.layout.block_tokens
    req = cache.open(tokens)
    cache.reserve(req, len(tokens) - req.num_tokens)
    for k in range(req.num_tokens // bt, -(-len(tokens) // bt)):
        cache.advance(req, tokens[k * bt:(k + 1) * bt])
    cache.close(req)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run_block_size(bt: int, repeats: int, work: Path) -> list[dict]:
    layout = presets.tiny(block_tokens=bt)
    n = TOKENS // bt
    prompt = [(7 * i) % 50_000 for i in range(TOKENS)] + [1]  # + 1: every block may resume
    other = [50_000 + i for i in range(TOKENS + bt)]
    snaps = n // 8 + 4
    rows = []
    store = work / f"disk-{bt}"
    gpu = TieredKVCache(layout, num_blocks=n + 2, num_state_slots=1, num_snapshots=snaps, store=f"lmdb://{store}",
                        host_bytes=(n + 4) * layout.block_bytes + snaps * layout.snapshot_bytes * 4,
                        host_snapshot_fraction=0.5)
    write_prompt(gpu, prompt)
    gpu.flush()
    hashes = gpu.hasher.block_hashes(prompt[:n * bt])
    hashing = _median_ms(lambda: gpu.hasher.block_hashes(prompt[:n * bt]), max(5, repeats // 10))

    def case(name: str, cache: TieredKVCache) -> None:
        look = cache.lookup(block_hashes=hashes, num_tokens=len(prompt))
        assert look.blocks() == n, (name, look.to_dict())
        ms = _median_ms(lambda: cache.lookup(block_hashes=hashes, num_tokens=len(prompt)), repeats)
        rows.append({"block_tokens": bt, "blocks": n, "case": name, "lookup_ms": ms, "hashing_ms": hashing,
                     "ratio_to_hashing": ms / hashing, "target_ms": TARGET_MS, "meets": ms <= TARGET_MS,
                     "tiers": {t.label: look.tokens(t) for t in look.tiers},
                     "blocks_by_tier": look.to_dict()["blocks_by_tier"]})

    case("gpu", gpu)
    open_ms = _median_ms(lambda: gpu.close(gpu.open(prompt)), max(5, repeats // 10))
    rows[-1]["open_close_ms"] = open_ms
    write_prompt(gpu, other)  # the GPU pools now hold the other prompt: ours went to the host tier
    case("host", gpu)
    gpu.shutdown()
    disk = TieredKVCache(layout, num_blocks=n + 2, num_state_slots=1, num_snapshots=snaps, store=f"lmdb://{store}")
    case("disk", disk)
    disk.shutdown()
    far = work / f"far-{bt}"
    shutil.copytree(store, work / f"copy-{bt}")
    from tiered_kv.storage import open_store

    with open_store(f"lmdb://{work / f'copy-{bt}'}", layout_fingerprint=layout.fingerprint) as src, \
            open_store(f"zarr://{far}", layout_fingerprint=layout.fingerprint) as dst:
        from tiered_kv.storage import PutItem
        import numpy as np

        keys = list(src)
        sizes = src.payload_sizes(keys)
        for key, size in zip(keys, sizes):
            buf = np.empty(size, dtype=np.uint8)
            meta = src.get_many([key], [buf])[0]
            dst.put_many([PutItem(key, meta.parent_hash, meta.token_digest, buf)])
    chain = TieredKVCache(layout, num_blocks=n + 2, num_state_slots=1, num_snapshots=snaps,
                          store=[f"lmdb://{work / f'empty-{bt}'}", f"zarr://{far}"])
    case("chain far level", chain)
    chain.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    repeats = args.repeats or (20 if args.quick else 200)
    work = Path(tempfile.mkdtemp(prefix="tkv-lookup-bench-"))
    try:
        rows = run_block_size(128, repeats, work) + run_block_size(512, repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"router lookup of a {TOKENS:,}-token prompt held whole (median of {repeats}; hashing the prompt is the "
          f"baseline; target <= {TARGET_MS} ms)")
    print(f"{'block':>6} {'blocks':>6} {'case':<16} {'lookup ms':>10} {'hashing ms':>11} {'ratio':>7} {'target':>7}")
    for r in rows:
        extra = f"   open()+close() {r['open_close_ms']:.2f} ms" if "open_close_ms" in r else ""
        print(f"{r['block_tokens']:>6} {r['blocks']:>6} {r['case']:<16} {r['lookup_ms']:>10.3f} {r['hashing_ms']:>11.3f} "
              f"{r['ratio_to_hashing']:>7.3f} {'meets' if r['meets'] else 'MISSES':>7}{extra}")
    out = {"config": {"tokens": TOKENS, "repeats": repeats, "statistic": "median", "layout": "tiny (bytes do not "
                      "matter to a lookup: it reads no record)"},
           "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_avg_1min": os.getloadavg()[0]},
           "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / ("lookup_quick.json" if args.quick else "lookup.json")).write_text(json.dumps(out, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['case']}\n{r['block_tokens']}-token" for r in rows]
    ax.bar(range(len(rows)), [r["lookup_ms"] for r in rows], color="#2b8cbe", label="lookup")
    ax.plot(range(len(rows)), [r["hashing_ms"] for r in rows], "k_", markersize=30, label="hashing the prompt")
    ax.axhline(TARGET_MS, color="red", linestyle=":", label=f"target {TARGET_MS} ms")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"router lookup of a {TOKENS // 1024}K-token prompt")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / ("lookup_quick.png" if args.quick else "lookup.png"), dpi=110)


if __name__ == "__main__":
    main()
