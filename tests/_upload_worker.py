"""One serving process of the durable-upload tests: ``python _upload_worker.py PHASE LOCAL SHARED``.

The store is the chain ``[lmdb://LOCAL, SHARED]`` (SHARED: a store URL; for ``zarr+s3://``
credentials come from the AWS environment variables). Prints one JSON line.

PHASE ``write``: serve a few prompts through the reference model on a cache whose far
level is *stalled* (every upload blocks forever, as on a hung link), ``cache.flush()``,
print the stats, then kill itself with SIGKILL: the uploads are owed, only the journal
knows them.

PHASE ``resume``: open a cache on the same chain (nothing else: no ``tiered-kv sync``),
``cache.flush(uploads=True)``, print the stats.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from tiered_kv import TieredKVCache, presets
from tiered_kv.reference import ReferenceModel
from tiered_kv.storage import BlockStore, PutItem, StoreChain, open_store

from _util import random_tokens

PROMPTS = [random_tokens(300, seed=60 + i) for i in range(3)]

phase, local, shared = sys.argv[1], sys.argv[2], sys.argv[3]
layout = presets.tiny()


class Stalled(BlockStore):
    """``inner`` whose ``put_many`` never returns (reads still answer)."""

    def __init__(self, inner: BlockStore) -> None:
        self.inner = inner
        self.layout_fingerprint = inner.layout_fingerprint
        self.max_bytes = inner.max_bytes
        self.where = inner.where  # type: ignore[attr-defined]

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        threading.Event().wait()
        raise AssertionError("unreachable")

    def get_many(self, keys: Any, outs: Any, *, token_digests: Any = None) -> Any:
        return self.inner.get_many(keys, outs, token_digests=token_digests)

    def contains(self, key: Any) -> bool:
        return self.inner.contains(key)

    def delete(self, key: Any) -> bool:
        return self.inner.delete(key)

    def __iter__(self) -> Any:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        return self.inner.verify(repair=repair)

    def gc(self, max_bytes: int) -> dict[str, Any]:
        return self.inner.gc(max_bytes)

    def close(self) -> None:
        self.inner.close()


if phase == "write":
    near = open_store(f"lmdb://{local}", layout_fingerprint=layout.fingerprint)
    far = Stalled(open_store(shared, layout_fingerprint=layout.fingerprint))
    chain = StoreChain([near, far], timeout_s=5.0)
    model = ReferenceModel(layout, seed=0)
    cache = TieredKVCache(layout, num_blocks=16, num_state_slots=1, store=chain)
    for tokens in PROMPTS:
        req = cache.open(tokens)
        model.forward(cache, req, tokens[req.num_cached_tokens:])
        cache.close(req)
    assert cache.flush()
    print(json.dumps({"local": len(near), **chain.stats(), "levels": None}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # after flush(), before shutdown(): nothing else runs
elif phase == "resume":
    with TieredKVCache(layout, num_blocks=16, num_state_slots=1, store=[f"lmdb://{local}", shared],
                       store_options={"timeout_s": 5.0}) as cache:
        done = cache.flush(uploads=True, timeout_s=120)
        print(json.dumps({"done": done, **cache.disk.store.stats(), "levels": None}))
else:
    raise SystemExit(f"phase: expected write or resume, got {phase!r}")
