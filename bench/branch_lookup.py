"""The branch lookup inside ``open()``: what the extra router lookup costs a request.

When ``open()`` resumes less than the whole prompt (P of its n full blocks), it asks the
cache's own router lookup how many leading blocks some tier holds (``d``): the branch
point policies publish a snapshot at ``d``, and the miss counters say why ``[P, n)`` is
computed (no snapshot, or not cached). That lookup walks the prompt's hashes past P
through the tiers. This bench measures ``open()`` + ``close()`` of such a prompt with the
lookup and with it stubbed out (``_held_prefix`` returning P: the counters are then
wrong, which is why the cache does not do it), interleaved in the same run, and the
lookup alone; the baseline is hashing the prompt (which ``open()`` does anyway).

The prompt: 131,072 tokens written by a cache with a snapshot at block n/2 only (and at
its end), then opened as its first 1000/1024 of the blocks plus new tokens: ``open()``
resumes n/2 blocks and the lookup finds ~0.98 n held (the branch point).

    gpu     every block in the GPU pool
    disk    the first n/2 blocks in the GPU pool (loaded by the first open), the rest on
            disk only (a new cache on the same LMDB store): the lookup asks the disk

Both at 128-token blocks (the cache's default, 1,024 blocks) and 512 (the replay's, 256).
Writes bench/results/branch_lookup.json and .png.

    python bench/branch_lookup.py --quick     # 10 repeats
    python bench/branch_lookup.py             # 60 repeats
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

sys.path.insert(0, str(ROOT / "bench"))
from lookup import write_prompt  # noqa: E402  (bench/lookup.py: the same prompt writer)

RESULTS = ROOT / "bench" / "results"
TOKENS = 131_072


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _case(name: str, cache: TieredKVCache, prompt: list[int], P: int, d: int, repeats: int) -> dict:
    bt = cache.layout.block_tokens
    req = cache.open(prompt)  # warm (a disk case: loads the first P blocks into the GPU pool)
    assert req.num_cached_tokens == P * bt, (name, req.num_cached_tokens, P * bt)
    cache.close(req)
    hashes = cache.hasher.block_hashes(prompt[:len(prompt) - len(prompt) % bt])
    assert cache._held_prefix(hashes, len(prompt)) == d, (name, cache._held_prefix(hashes, len(prompt)), d)
    real = cache._held_prefix

    def stubbed(_hashes: list[bytes], _n: int) -> int:
        return P

    with_t, without_t, lookup_t, hash_t = [], [], [], []
    for _ in range(repeats):  # interleaved: the same conditions for both
        cache._held_prefix = real  # type: ignore[method-assign]
        with_t.append(_time(lambda: cache.close(cache.open(prompt))))
        cache._held_prefix = stubbed  # type: ignore[method-assign]
        without_t.append(_time(lambda: cache.close(cache.open(prompt))))
        lookup_t.append(_time(lambda: real(hashes, len(prompt))))
        hash_t.append(_time(lambda: cache.hasher.block_hashes(prompt[:len(hashes) * bt])))
    cache._held_prefix = real  # type: ignore[method-assign]
    ms = {k: 1e3 * statistics.median(v) for k, v in
          (("open_with_ms", with_t), ("open_without_ms", without_t), ("lookup_ms", lookup_t), ("hashing_ms", hash_t))}
    return {"block_tokens": bt, "blocks": len(hashes), "case": name, "resumed_blocks": P, "held_blocks": d, **ms,
            "extra_ms": ms["open_with_ms"] - ms["open_without_ms"],
            "ratio_with_to_without": ms["open_with_ms"] / ms["open_without_ms"],
            "extra_share_of_open": (ms["open_with_ms"] - ms["open_without_ms"]) / ms["open_with_ms"]}


def run_block_size(bt: int, repeats: int, work: Path) -> list[dict]:
    layout = presets.tiny(block_tokens=bt)
    n = TOKENS // bt
    half, d = n // 2, n * 1000 // 1024
    written = [(7 * i) % 50_000 for i in range(TOKENS)] + [1]
    prompt = written[:d * bt] + [50_000 + i for i in range(bt + 17)]  # leaves the tree at block d
    store = work / f"disk-{bt}"
    opts = {"num_blocks": n + 4, "num_state_slots": 1, "num_snapshots": 16}
    gpu = TieredKVCache(layout, store=f"lmdb://{store}", snapshot_policy=f"interval:{half}", **opts)
    write_prompt(gpu, written)
    gpu.flush()
    rows = [_case("gpu", gpu, prompt, half, d, repeats)]
    gpu.shutdown()
    disk = TieredKVCache(layout, store=f"lmdb://{store}", **opts)
    rows.append(_case("disk", disk, prompt, half, d, repeats))
    disk.shutdown()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args()
    repeats = args.repeats or (10 if args.quick else 60)
    work = Path(tempfile.mkdtemp(prefix="tkv-branch-lookup-"))
    try:
        rows = run_block_size(128, repeats, work) + run_block_size(512, repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"open() + close() of a {TOKENS:,}-token prompt resumed to half, held to ~98 % (median of {repeats}, "
          f"interleaved): with the branch lookup, without it (stubbed: the baseline), the lookup alone, hashing")
    print(f"{'block':>6} {'case':<6} {'P':>5} {'d':>5} {'with ms':>9} {'without ms':>11} {'extra ms':>9} "
          f"{'ratio':>6} {'lookup ms':>10} {'hashing ms':>11}")
    for r in rows:
        print(f"{r['block_tokens']:>6} {r['case']:<6} {r['resumed_blocks']:>5} {r['held_blocks']:>5} "
              f"{r['open_with_ms']:>9.3f} {r['open_without_ms']:>11.3f} {r['extra_ms']:>9.3f} "
              f"{r['ratio_with_to_without']:>6.3f} {r['lookup_ms']:>10.3f} {r['hashing_ms']:>11.3f}")
    out = {"config": {"tokens": TOKENS, "repeats": repeats, "statistic": "median", "interleaved": True,
                      "layout": "tiny (a lookup reads no record; open() copies the tiny State)"},
           "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_avg_1min": os.getloadavg()[0]},
           "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "branch_lookup_quick" if args.quick else "branch_lookup"
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['case']}\n{r['block_tokens']}-token blocks" for r in rows]
    x = range(len(rows))
    w = 0.2
    for i, (key, name) in enumerate((("open_without_ms", "open() without the lookup (baseline)"),
                                     ("open_with_ms", "open() with it"), ("lookup_ms", "the lookup alone"),
                                     ("hashing_ms", "hashing the prompt"))):
        ax.bar([j + (i - 1.5) * w for j in x], [r[key] for r in rows], w, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"Branch lookup inside open(), {TOKENS:,}-token prompt resumed to half")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)
    print(f"wrote {RESULTS / (stem + '.json')} and .png")


if __name__ == "__main__":
    main()
