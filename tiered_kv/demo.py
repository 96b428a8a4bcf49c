"""The warm-start demo (``make demo``; ``python -m tiered_kv.demo [--dir .demo]``).

On a fresh LMDB store (``<dir>/store``, the embedded default) it runs what a user would
type::

    tiered-kv warm-start --store .demo/store --prompts bundled   # cold: the store is empty
    tiered-kv warm-start --store .demo/store --prompts bundled   # warm: a new cache, same store
    tiered-kv stats  --store .demo/store
    tiered-kv verify --store .demo/store

then compares cold and warm time to first token, and checks that a prompt resumed from
the store gives the same next-token logits as a full recompute (the reference model is
the correctness oracle). The bundled prompts share a system prompt or a document, so
even the cold run reuses blocks between prompts; the warm run resumes every prompt from
the store and computes only its last partial block.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from . import presets
from .cli._common import BUNDLED_PROMPTS, load_prompts, parse_store
from .cli.main import main as cli_main
from .cli.warm_start import MODEL_SEED, warm_start

#: the largest |logit| difference between a store-resumed and a from-scratch run
LOGIT_TOLERANCE = 1e-4


def _say(cmd: str, note: str = "") -> None:
    print(f"\n$ {cmd}" + (f"    # {note}" if note else ""), flush=True)


def check_resume(store_url: str, tokens: list[int]) -> tuple[int, float]:
    """Resume ``tokens`` from the store in a new cache; return (cached tokens, max |diff|)
    between its next-token logits and a full recompute."""
    from .cache import TieredKVCache
    from .reference import ReferenceModel

    layout = presets.tiny()
    model = ReferenceModel(layout, seed=MODEL_SEED)
    with TieredKVCache(layout, num_blocks=layout.num_blocks_for(len(tokens)) + 1, num_state_slots=1,
                       store=store_url) as cache:
        req = cache.open(tokens)
        got = model.forward(cache, req, tokens[req.num_cached_tokens:])[-1]
        cached = req.num_cached_tokens
        cache.close(req)
    want = model.naive_logits(tokens)[-1]
    return cached, float((got - want).abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tiered_kv.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=".demo", help="directory of the demo store (default %(default)s)")
    parser.add_argument("--prompts", default=BUNDLED_PROMPTS,
                        help="prompt file (default: the bundled set)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default %(default)s, as warm-start)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)  # this process is the demo's: no one to restore it for

    demo_dir = Path(args.dir)
    store_arg = str(demo_dir / "store")
    loc = parse_store(store_arg)
    if loc.path.exists():
        shutil.rmtree(loc.path)  # a fresh store every run: the first warm-start is cold
    demo_dir.mkdir(parents=True, exist_ok=True)
    (demo_dir / ".gitignore").write_text("*\n")  # keep the demo's files out of git
    layout = presets.tiny()
    prompts = load_prompts(args.prompts)
    cmd = f"tiered-kv warm-start --store {store_arg} --prompts {args.prompts}"

    runs = []
    for note in ("cold: the store is empty", "warm: a new cache (empty GPU pool), the same store"):
        _say(cmd, note)
        runs.append(warm_start(layout, loc, prompts))
    cold, warm = (r["totals"] for r in runs)

    print(f"\ntime to first token, mean over {cold['prompts']} prompts: "
          f"cold {cold['mean_ttft_s'] * 1e3:.1f} ms -> warm {warm['mean_ttft_s'] * 1e3:.1f} ms "
          f"({cold['mean_ttft_s'] / warm['mean_ttft_s']:.1f}x faster); tokens computed "
          f"{cold['computed_tokens']} -> {warm['computed_tokens']} of {cold['tokens']}")
    misses = [r["id"] for r in runs[1]["prompts"] if r["cached_tokens"] == 0]
    if misses:
        print(f"demo: the warm run found nothing cached for {misses}", file=sys.stderr)
        return 1

    shortest = min(prompts, key=lambda p: len(p.tokens))
    t0 = time.perf_counter()
    cached, diff = check_resume(loc.url, shortest.tokens)
    ok = diff <= LOGIT_TOLERANCE
    print(f"check: {shortest.id!r} resumed from the store at token {cached} gives the next-token logits "
          f"of a full recompute: max |diff| {diff:.1e} ({'ok' if ok else 'MISMATCH'}, "
          f"{time.perf_counter() - t0:.1f} s)")
    if not ok:
        return 1

    for sub in ("stats", "verify"):
        _say(f"tiered-kv {sub} --store {store_arg}")
        code = cli_main([sub, "--store", store_arg])
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
