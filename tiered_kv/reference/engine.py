"""The reference model and a :class:`~tiered_kv.TieredKVCache`, shared by many requests.

:class:`ReferenceEngine` runs completions for :mod:`.openai_server`: prefill from the
longest cached prefix, then greedy decoding, for as many requests at once as it admits.

Sharing the model. The cache is single-threaded, so one lock (:attr:`ReferenceEngine.lock`,
a :class:`~._turns.TurnLock`) serializes every use of the model and the cache. A request
holds it for one *step* at a time, a prefill chunk (at most ``prefill_chunk`` tokens, cut
at block boundaries) or one decode token, and then queues again behind every other
request: the requests in flight take steps in turn, round-robin, so between two tokens
of a request every other request takes at most one turn, whatever their lengths (a step;
or, for one that ends, its close, and the store flush of :meth:`sync_store`; ``/metrics``
takes one too), and a long prompt's prefill does not hold the others up either. (The model has no batched
forward: :class:`~.serving.ServingLoop` steps its requests one by one too; threads keep
streaming, cancelling and errors with each request's own HTTP handler.)

Admission. A request holds one State slot of the cache and, at worst, blocks for all its
tokens (prompt + max_tokens - 1): the engine admits at most ``max_running`` requests at
once, and only as many as the GPU pool holds at their worst (:class:`~._turns.Admission`),
so that no running request runs out of blocks halfway. Others wait, first fit: a short
request is admitted past a long one that does not fit yet.

Exactness. Steps of different requests touch different State slots and blocks; a
request's prefill chunks end on block boundaries, where the model cuts its segments
anyway. A request's tokens are therefore the same whatever runs beside it.

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

from ..cache import Request, TieredKVCache
from ..metrics import Metric, MetricsSnapshot
from ._turns import Admission, Seat, TurnLock
from .model import ReferenceModel
from .protocol import CompletionRequest, RequestError

if TYPE_CHECKING:
    from ..layout import KVLayout

__all__ = ["CANCEL_REASONS", "Completion", "ReferenceEngine", "RequestCancelled"]

#: why a completion was cancelled (``tiered_kv_server_cancelled_total{reason}``):
#: its client left; the server stopped it (shutdown); its client left too many bytes
#: unread, or took none for the send timeout (a slow reader, see ``_connection``)
CANCEL_REASONS = ("client_left", "shutdown", "unread_bytes", "send_timeout")
#: prompt tokens per prefill step by default (two blocks of the tiny layout)
PREFILL_CHUNK = 256
#: requests admitted at once by default
MAX_RUNNING = 32


class RequestCancelled(Exception):
    """A completion stopped between steps: its client left or reads too slowly, or the
    server is stopping. :attr:`reason` is one of :data:`CANCEL_REASONS` (or what the
    ``cancelled`` callback of :meth:`ReferenceEngine.complete` returned)."""

    def __init__(self, message: str, *, reason: str = "client_left") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """What one completion did."""

    prompt_tokens: int
    #: prompt tokens served from the cache (GPU pool or store)
    cached_tokens: int
    token_ids: list[int]
    #: seconds from its admission to the first generated token
    ttft_s: float


class ReferenceEngine:
    """The reference model and a :class:`TieredKVCache` over a store, shared in turns.

    Args:
        layout: the cache's layout (the reference model runs it; ``presets.tiny()``).
        store: the store URL (or chain) of the cache's disk tier.
        num_blocks, num_snapshots, snapshot_interval, salt, device, store_options: the
            cache's (``num_snapshots`` must exceed ``max_running``: the cache keeps one
            per State slot and one shared).
        seed: the reference model's weights (cached KV is valid only for the weights
            that made it).
        served_model: the name ``/v1/models`` lists and requests must name.
        max_running: requests admitted at once (the cache's State slots); more wait.
            Default :data:`MAX_RUNNING`, or ``num_snapshots - 1`` if that is less.
        prefill_chunk: prompt tokens per step at most (cut at block boundaries).
    """

    def __init__(self, layout: KVLayout, *, store: object, served_model: str, seed: int = 0, num_blocks: int = 1024,
                 num_snapshots: int = 256, snapshot_interval: int = 1, salt: str = "", device: str = "cpu",
                 store_options: dict[str, Any] | None = None, max_running: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        if max_running is None:
            max_running = max(1, min(MAX_RUNNING, num_snapshots - 1))
        for name, value in (("max_running", max_running), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if num_snapshots <= max_running:
            raise ValueError(f"num_snapshots: expected more than max_running ({max_running}: one per running "
                             f"request + one shared), got {num_snapshots}")
        self.layout = layout
        self.served_model = served_model
        self.model = ReferenceModel(layout, seed=seed)
        self.cache = TieredKVCache(layout, device=device, num_blocks=num_blocks, num_state_slots=max_running,
                                   num_snapshots=num_snapshots, snapshot_interval=snapshot_interval,
                                   salt=salt, store=store, store_options=store_options)
        #: every use of the model and the cache holds this, one step at a time, in turns
        self.lock = TurnLock()
        #: requests running at once and the GPU-pool blocks they may hold
        self.admission = Admission(slots=max_running, blocks=num_blocks)
        self.prefill_chunk = prefill_chunk
        #: tokens one request may hold (prompt + generated): the GPU pool's blocks
        self.max_model_len = num_blocks * layout.block_tokens
        self.created = int(time.time())
        self._stats = threading.Lock()  # guards _counts, _cancelled and _ttft_s
        self._counts = dict.fromkeys(("requests_ok", "requests_rejected", "requests_failed", "requests_cancelled",
                                      "prompt_tokens", "cached_tokens", "computed_tokens", "generated_tokens"), 0)
        self._cancelled = dict.fromkeys(CANCEL_REASONS, 0)
        self._ttft_s = 0.0
        self._closed = False

    def complete(self, request: CompletionRequest, on_token: Callable[[int], None] | None = None, *,
                 cancelled: Callable[[], object] | None = None) -> Completion:
        """Prefill the prompt (from its longest cached prefix) and decode greedily.

        Waits to be admitted (see the module docstring), then takes its steps in turn
        with the other requests. ``on_token(id)`` is called with each generated token as
        it is made (streaming), on this thread between its steps, outside the lock: it
        should not block (the server queues the bytes, see ``StreamSender``).
        ``cancelled()`` is asked while it waits, and between its steps: a true value ends
        the request with :class:`RequestCancelled` (a string one names the reason). The
        cache request is closed however it ends.

        Raises :class:`RequestError`: 400 when prompt + ``max_tokens`` exceed the pool,
        503 when the engine is closed.
        """
        tokens = request.prompt_tokens
        need = len(tokens) + request.max_tokens
        if need > self.max_model_len:
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) = {need} "
                               f"tokens: expected at most {self.max_model_len} (the server's --num-blocks "
                               f"{self.max_model_len // self.layout.block_tokens} x {self.layout.block_tokens})",
                               param="max_tokens")

        def check() -> None:
            if self._closed:
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down",
                                   kind="ServiceUnavailableError")
            why = cancelled() if cancelled is not None else None
            if why:
                raise RequestCancelled("cancelled before it started",
                                       reason=why if isinstance(why, str) else "client_left")

        check()
        # the last generated token is never fed back: prompt + max_tokens - 1 tokens at most
        with self.admission.admit(self.layout.num_blocks_for(need - 1), check):
            seat = self.lock.seat()
            try:
                return self._run(request, seat, on_token, cancelled)
            finally:
                seat.leave()

    def _run(self, request: CompletionRequest, seat: Seat, on_token: Callable[[int], None] | None,
             cancelled: Callable[[], object] | None) -> Completion:
        """The admitted request, one step per turn of ``seat``."""
        tokens, n = request.prompt_tokens, len(request.prompt_tokens)
        out: list[int] = []
        req: Request | None = None
        cached = computed = 0
        ttft = 0.0

        def stop_if_asked() -> None:
            why = cancelled() if cancelled is not None else None
            if why:
                raise RequestCancelled(f"cancelled after {len(out)} of {request.max_tokens} tokens",
                                       reason=why if isinstance(why, str) else "client_left")

        try:
            with seat:  # open, and the first prefill chunk
                self._check_open(out, request)
                stop_if_asked()
                t0 = time.perf_counter()
                req = self.cache.open(tokens)
                cached = pos = req.num_cached_tokens
                end = self._chunk_end(pos, n)
                logits = self.model.forward(self.cache, req, tokens[pos:end])[-1]
                computed += end - pos
                pos = end
            while pos < n:  # the rest of the prompt, a chunk per turn
                stop_if_asked()
                with seat:
                    self._check_open(out, request)
                    end = self._chunk_end(pos, n)
                    logits = self.model.forward(self.cache, req, tokens[pos:end])[-1]
                    computed += end - pos
                    pos = end
            for i in range(request.max_tokens):
                nxt = int(torch.argmax(logits))
                out.append(nxt)
                if i == 0:
                    ttft = time.perf_counter() - t0
                if on_token is not None:
                    on_token(nxt)
                if i + 1 < request.max_tokens:
                    stop_if_asked()
                    with seat:  # one decode step
                        self._check_open(out, request)
                        logits = self.model.forward(self.cache, req, [nxt])[-1]
                        computed += 1
        finally:
            if req is not None:
                with seat:
                    if not self._closed:
                        self.cache.close(req)
            with self._stats:
                c = self._counts
                c["prompt_tokens"] += n
                c["cached_tokens"] += cached
                c["computed_tokens"] += computed
                c["generated_tokens"] += len(out)
                self._ttft_s += ttft
        return Completion(prompt_tokens=n, cached_tokens=cached, token_ids=out, ttft_s=ttft)

    def _chunk_end(self, pos: int, n: int) -> int:
        """Where the prefill step from ``pos`` ends: ``prefill_chunk`` tokens on, cut back
        to a block boundary (the model cuts its segments there anyway), or the prompt's end."""
        end = pos + self.prefill_chunk
        if end >= n:
            return n
        bt = self.layout.block_tokens
        return end - end % bt if end - end % bt > pos else end

    def _check_open(self, out: list[int], request: CompletionRequest) -> None:
        """Under the lock: the engine was closed (the server stopped) while this request ran."""
        if self._closed:
            raise RequestCancelled(f"the server stopped after {len(out)} of {request.max_tokens} tokens",
                                   reason="shutdown")

    def count(self, outcome: str, reason: str | None = None) -> None:
        """Count a finished request: ``ok``, ``rejected`` (4xx), ``failed`` (5xx) or
        ``cancelled`` (its client left or read too slowly, or the server stopped it:
        ``reason``, one of :data:`CANCEL_REASONS`)."""
        with self._stats:
            self._counts[f"requests_{outcome}"] += 1
            if outcome == "cancelled":
                self._cancelled[reason if reason in self._cancelled else "client_left"] += 1

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
        with self._stats:
            c, cut, ttft = dict(self._counts), dict(self._cancelled), self._ttft_s
        reqs = Metric("tiered_kv_server_requests_total", "counter",
                      "Completion requests by outcome (cancelled: the client left or read too slowly, or "
                      "the server stopped it).")
        for outcome in ("ok", "rejected", "failed", "cancelled"):
            reqs.add(c[f"requests_{outcome}"], outcome=outcome)
        why = Metric("tiered_kv_server_cancelled_total", "counter",
                     "Cancelled completions by reason: client_left, shutdown (cut at the drain deadline), "
                     "unread_bytes (the client left more than the stream buffer unread), send_timeout "
                     "(it took no byte for the send timeout).")
        for reason, k in cut.items():
            why.add(k, reason=reason)
        a = self.admission
        running = Metric("tiered_kv_server_requests", "gauge",
                         "Completion requests now: running (admitted), waiting (for admission).")
        running.add(a.running, state="running").add(a.queued(), state="waiting")
        toks = Metric("tiered_kv_server_tokens_total", "counter",
                      "Tokens of completions: prompt, cached (prompt tokens from the cache), computed "
                      "(run through the model), generated.")
        for kind in ("prompt", "cached", "computed", "generated"):
            toks.add(c[f"{kind}_tokens"], kind=kind)
        first = Metric("tiered_kv_server_ttft_seconds_total", "counter",
                       "Seconds from admission to the first token, summed over completions "
                       "(divide by the ok requests for the mean).").add(ttft)
        return MetricsSnapshot([*snap.metrics, reqs, why, running, toks, first])

    def close(self) -> None:
        """Flush the store writes and close the store (idempotent); later requests get 503,
        requests still running stop at their next step (``RequestCancelled``, shutdown)."""
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
