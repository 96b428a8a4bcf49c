"""A process that writes through caches and stores and exits WITHOUT ``shutdown()`` or
``close()``: ``python _exit_worker.py JOB [JOB...]``, each JOB ``MODE=URL[,URL...]``.

MODE ``cache``: ``TieredKVCache(store=URL or [URLs])``; prompts served through the
reference model, requests closed, then the interpreter exits normally with disk writes
still queued behind the requests (and, for a chain, uploads owed).

MODE ``far-down``: the same over ``StoreChain([URL, <a far level that refuses every
call>])``, so no upload can happen before exit: they must end up journaled.

MODE ``chain``: a chain opened with ``open_store([URLs])`` and written with ``put_many``
directly, never closed.

Prints nothing on success (the test asserts an empty stderr, but for far-down's warnings).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiered_kv import TieredKVCache, presets
from tiered_kv.prefix import token_digest
from tiered_kv.reference import ReferenceModel
from tiered_kv.storage import BlockStore, PutItem, RecordKey, StoreChain, open_store

from _util import random_tokens

#: 2 prompts sharing a block: 3 distinct blocks, each with a snapshot
PROMPTS = [random_tokens(300, seed=7), random_tokens(128, seed=7) + random_tokens(140, seed=8)]
layout = presets.tiny()


class Down(BlockStore):
    """A far level that cannot be reached (every call raises ConnectionError)."""

    layout_fingerprint = layout.fingerprint
    max_bytes = None
    where = "down://far"

    def _down(self, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("far level unreachable (test double)")

    put_many = get_many = contains = delete = stats = verify = gc = _down  # type: ignore[assignment]

    def __iter__(self) -> Any:
        return self._down()

    def __len__(self) -> int:
        return self._down()

    def close(self) -> None:
        pass


#: a chain closed at exit uploads until done (a loaded CI box is slow, never a failure)
CHAIN_OPTIONS = {"close_timeout_s": 300.0}


def serve(store: Any, store_options: dict[str, Any] | None = None) -> None:
    model = ReferenceModel(layout, seed=0)
    cache = TieredKVCache(layout, num_blocks=32, num_state_slots=1, snapshot_interval=1, store=store,
                          store_options=store_options)
    for tokens in PROMPTS:
        req = cache.open(tokens)
        model.forward(cache, req, tokens[req.num_cached_tokens:])
        cache.close(req)
    # no cache.flush(), no cache.shutdown(): the interpreter exits with writes queued


def put_directly(urls: Sequence[str]) -> None:
    chain = open_store(list(urls), layout_fingerprint=layout.fingerprint, **CHAIN_OPTIONS)
    items = [PutItem(RecordKey.block(bytes([i]) * 32), bytes(32), token_digest([i]),
                     np.full(layout.block_bytes, i, np.uint8)) for i in range(4)]
    chain.put_many(items)
    # never closed


for job in sys.argv[1:]:
    mode, _, spec = job.partition("=")
    urls = spec.split(",")
    if mode == "cache":
        serve(urls[0], None) if len(urls) == 1 else serve(urls, CHAIN_OPTIONS)
    elif mode == "far-down":
        serve(StoreChain([open_store(urls[0], layout_fingerprint=layout.fingerprint), Down()], close_timeout_s=1.0))
    elif mode == "chain":
        put_directly(urls)
    else:
        raise SystemExit(f"mode: expected cache, far-down or chain, got {mode!r}")
