"""One serving node of the shared-store tests: ``python _node_worker.py PHASE LOCAL SHARED``.

The node's store is the chain ``[lmdb://LOCAL, SHARED]`` (SHARED: a ``zarr+s3://`` URL;
credentials from the AWS environment variables). Prints one JSON line.

PHASE ``compute``: run the reference model over the prompts' first ``PREFIX`` tokens,
wait until the uploads have landed, print the cache's stats.

PHASE ``warm``: resume the full prompt (whatever the node's own LMDB holds: nothing, for a
fresh node), print the cached tokens, the max |cached - naive| logit error, time to first
token (open + forward of the uncached rest) warm, and cold (the same prompt on a cache
without a store), and the cache's stats.
"""

from __future__ import annotations

import json
import sys
import time

from tiered_kv import TieredKVCache, presets
from tiered_kv.reference import ReferenceModel

from _util import random_tokens

PROMPT = random_tokens(520, seed=21)
PREFIX = 500  # node A computes this much; node B asks for all of PROMPT

phase, local, shared = sys.argv[1], sys.argv[2], sys.argv[3]
layout = presets.tiny()
model = ReferenceModel(layout, seed=0)
options = {"timeout_s": 5.0, "level_options": [{"max_bytes": 1 << 30}, {}]}


def forward_all(cache: TieredKVCache, tokens: list[int]) -> tuple[int, float, object]:
    t0 = time.perf_counter()
    req = cache.open(tokens)
    logits = model.forward(cache, req, tokens[req.num_cached_tokens:])
    ttft = time.perf_counter() - t0
    cache.close(req)
    return req.num_cached_tokens, ttft, logits


with TieredKVCache(layout, num_blocks=16, num_state_slots=2, store=[f"lmdb://{local}", shared],
                   store_options=options) as cache:
    if phase == "compute":
        forward_all(cache, PROMPT[:PREFIX])
        cache.flush()
        landed = cache.disk.store.wait_uploads(timeout_s=120)
        print(json.dumps({"uploads_landed": landed, **cache.stats()}))
    elif phase == "warm":
        warmup = TieredKVCache(layout, num_blocks=16, num_state_slots=1)
        forward_all(warmup, PROMPT[:130])  # first-call costs (allocator, kernels) out of the timings
        cached, ttft_warm, got = forward_all(cache, PROMPT)
        want = model.naive_logits(PROMPT)[cached:]
        err = float((got - want).abs().max())
        _, ttft_cold, _ = forward_all(TieredKVCache(layout, num_blocks=16, num_state_slots=1), PROMPT)
        cache.disk.store.wait_uploads(timeout_s=60)  # promotions into the local LMDB are write-behind
        print(json.dumps({"cached": cached, "err": err, "ttft_warm_s": ttft_warm, "ttft_cold_s": ttft_cold,
                          **cache.stats()}))
    else:
        raise SystemExit(f"phase: expected compute or warm, got {phase!r}")
