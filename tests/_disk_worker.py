"""A separate process for the disk-tier tests:
``python _disk_worker.py URL PHASE N [SNAPSHOT_POLICY EVICTION [ADMISSION]]``.

PHASE ``a`` runs the reference model over the first N tokens and exits; ``kill`` does the
same, flushes, prints its stats and kills itself with SIGKILL (no close, no shutdown: a
crash after ``flush()`` returned); ``b`` opens the same store, resumes the full sequence
and prints the max |cached - naive| logit error and the number of cached tokens as JSON.
SNAPSHOT_POLICY / EVICTION: the cache's policies by name (default: the cache's defaults).
ADMISSION: a disk admission filter; phases ``a`` and ``kill`` then serve the N tokens
twice (the second time a GPU hit), so that any filter has let the prefix through.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from tiered_kv import TieredKVCache, presets
from tiered_kv.reference import ReferenceModel

from _util import random_tokens

url, phase, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
policies = {"snapshot_policy": sys.argv[4], "eviction": sys.argv[5]} if len(sys.argv) > 5 else {}
if len(sys.argv) > 6:
    policies["admission"] = sys.argv[6]
layout = presets.tiny()
model = ReferenceModel(layout, seed=0)
tokens = random_tokens(420, seed=4)
with TieredKVCache(layout, num_blocks=16, num_state_slots=2, store=url, **policies) as cache:
    if phase in ("a", "kill"):
        for _ in range(2 if "admission" in policies else 1):
            req = cache.open(tokens[:n])
            model.forward(cache, req, tokens[:n][req.num_cached_tokens:])
            cache.close(req)
        cache.flush()
        print(json.dumps(cache.stats()), flush=True)
        if phase == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # after flush(), before close: nothing else runs
    else:
        req = cache.open(tokens)
        got = model.forward(cache, req, tokens[req.num_cached_tokens:])
        want = model.naive_logits(tokens)[req.num_cached_tokens:]
        cache.close(req)
        print(json.dumps({"cached": req.num_cached_tokens, "err": float((got - want).abs().max()),
                          **cache.stats()}))
