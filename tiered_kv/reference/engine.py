"""The reference model and a :class:`~tiered_kv.TieredKVCache` behind one lock.

:class:`ReferenceEngine` runs completions for :mod:`.openai_server`: prefill from the
longest cached prefix, then greedy decoding.

Concurrency: requests are served on threads, but the cache is single-threaded, so one
lock (:attr:`ReferenceEngine.lock`) serializes every use of the model and the cache.
After each completion the server waits for the request's store writes and persists the
store's counters (:meth:`ReferenceEngine.sync_store`), so ``tiered-kv stats`` and
``warm-start --store`` see them as soon as the answer ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import torch

from ..cache import TieredKVCache
from ..metrics import Metric, MetricsSnapshot
from .model import ReferenceModel
from .protocol import CompletionRequest, RequestError

if TYPE_CHECKING:
    from ..layout import KVLayout

__all__ = ["Completion", "ReferenceEngine", "RequestCancelled"]


class RequestCancelled(Exception):
    """A completion stopped between tokens: its client left, or the server is stopping."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """What one completion did."""

    prompt_tokens: int
    #: prompt tokens served from the cache (GPU pool or store)
    cached_tokens: int
    token_ids: list[int]
    #: seconds from taking the model to the first generated token
    ttft_s: float


class ReferenceEngine:
    """The reference model and a :class:`TieredKVCache` over a store, behind one lock.

    Args:
        layout: the cache's layout (the reference model runs it; ``presets.tiny()``).
        store: the store URL (or chain) of the cache's disk tier.
        num_blocks, num_snapshots, snapshot_interval, salt, device, store_options: the
            cache's (one State slot: requests run one at a time).
        seed: the reference model's weights (cached KV is valid only for the weights
            that made it).
        served_model: the name ``/v1/models`` lists and requests must name.
    """

    def __init__(self, layout: KVLayout, *, store: object, served_model: str, seed: int = 0, num_blocks: int = 1024,
                 num_snapshots: int = 256, snapshot_interval: int = 1, salt: str = "", device: str = "cpu",
                 store_options: dict[str, Any] | None = None) -> None:
        self.layout = layout
        self.served_model = served_model
        self.model = ReferenceModel(layout, seed=seed)
        self.cache = TieredKVCache(layout, device=device, num_blocks=num_blocks, num_state_slots=1,
                                   num_snapshots=num_snapshots, snapshot_interval=snapshot_interval,
                                   salt=salt, store=store, store_options=store_options)
        #: every use of the model and the cache holds this
        self.lock = threading.Lock()
        #: tokens one request may hold (prompt + generated): the GPU pool's blocks
        self.max_model_len = num_blocks * layout.block_tokens
        self.created = int(time.time())
        self._counts = dict.fromkeys(("requests_ok", "requests_rejected", "requests_failed", "requests_cancelled",
                                      "prompt_tokens", "cached_tokens", "computed_tokens", "generated_tokens"), 0)
        self._ttft_s = 0.0
        self._closed = False

    def complete(self, request: CompletionRequest, on_token: Callable[[int], None] | None = None, *,
                 cancelled: Callable[[], bool] | None = None) -> Completion:
        """Prefill the prompt (from its longest cached prefix) and decode greedily.

        ``on_token(id)`` is called with each generated token as it is made (streaming),
        under the model lock: it must not block (the server queues the bytes, see
        :class:`StreamSender`). ``cancelled()`` is asked before the prefill and between
        tokens; True ends the request with :class:`RequestCancelled` (an abandoned
        request frees the model at once). Either way the cache request is closed.
        """
        tokens = request.prompt_tokens
        need = len(tokens) + request.max_tokens
        if need > self.max_model_len:
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) = {need} "
                               f"tokens: expected at most {self.max_model_len} (the server's --num-blocks "
                               f"{self.max_model_len // self.layout.block_tokens} x {self.layout.block_tokens})",
                               param="max_tokens")
        out: list[int] = []
        with self.lock:
            if self._closed:
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down",
                                   kind="ServiceUnavailableError")
            if cancelled is not None and cancelled():
                raise RequestCancelled("cancelled before it started")
            t0 = time.perf_counter()
            req = self.cache.open(tokens)
            cached, ttft = req.num_cached_tokens, 0.0
            try:
                logits = self.model.forward(self.cache, req, tokens[cached:])[-1]
                for i in range(request.max_tokens):
                    nxt = int(torch.argmax(logits))
                    out.append(nxt)
                    if i == 0:
                        ttft = time.perf_counter() - t0
                    if on_token is not None:
                        on_token(nxt)
                    if i + 1 < request.max_tokens:
                        if cancelled is not None and cancelled():
                            raise RequestCancelled(f"cancelled after {len(out)} of {request.max_tokens} tokens")
                        logits = self.model.forward(self.cache, req, [nxt])[-1]
            finally:
                self.cache.close(req)
                c = self._counts
                c["prompt_tokens"] += len(tokens)
                c["cached_tokens"] += cached
                # the last generated token is never fed back
                c["computed_tokens"] += len(tokens) - cached + max(len(out) - 1, 0)
                c["generated_tokens"] += len(out)
                self._ttft_s += ttft
        return Completion(prompt_tokens=len(tokens), cached_tokens=cached, token_ids=out, ttft_s=ttft)

    def count(self, outcome: str) -> None:
        """Count a finished request: ``ok``, ``rejected`` (4xx), ``failed`` (5xx) or
        ``cancelled`` (its client left, or the server stopped it)."""
        with self.lock:
            self._counts[f"requests_{outcome}"] += 1

    def sync_store(self) -> None:
        """Wait for the store writes submitted so far and persist the store's counters
        (``BlockStore.stats()`` writes an LMDB handle's pending counter deltas)."""
        with self.lock:
            if not self._closed:
                self.cache.flush()
                self.cache.stats()

    def metrics(self) -> MetricsSnapshot:
        """The cache's metrics plus the server's request and token counters."""
        with self.lock:
            snap = self.cache.metrics()
            c = dict(self._counts)
            ttft = self._ttft_s
        reqs = Metric("tiered_kv_server_requests_total", "counter", "Completion requests by outcome (cancelled: the client left, or "
                                                                        "the server stopped it).")
        for outcome in ("ok", "rejected", "failed", "cancelled"):
            reqs.add(c[f"requests_{outcome}"], outcome=outcome)
        toks = Metric("tiered_kv_server_tokens_total", "counter",
                      "Tokens of completions: prompt, cached (prompt tokens from the cache), computed "
                      "(run through the model), generated.")
        for kind in ("prompt", "cached", "computed", "generated"):
            toks.add(c[f"{kind}_tokens"], kind=kind)
        first = Metric("tiered_kv_server_ttft_seconds_total", "counter",
                       "Seconds from taking the model to the first token, summed over completions "
                       "(divide by the ok requests for the mean).").add(ttft)
        return MetricsSnapshot([*snap.metrics, reqs, toks, first])

    def close(self) -> None:
        """Flush the store writes and close the store (idempotent); later requests get 503."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.cache.shutdown()

    def store_stats(self) -> dict[str, Any]:
        """The store's own stats (records, bytes, counters)."""
        with self.lock:
            assert self.cache.disk is not None
            return self.cache.disk.store.stats()
