"""A small continuous-batching serving loop over the reference model.

It drives a :class:`~tiered_kv.cache.TieredKVCache` the way a serving engine does:
requests arrive with prompts that share prefixes, are admitted while State slots are
free, prefill in chunks, decode greedily, and leave when done or aborted. When the GPU
block pool runs out (:class:`~tiered_kv.errors.CacheFullError`) the loop *preempts* a
request: it closes it (its sealed blocks stay cached and flow down to host and disk as
space is needed) and re-queues it; re-admission resumes from the cached prefix.

Used by ``tests/test_serving_loop.py`` and ``bench/serving.py`` to show that no block
leaks under churn and that completed requests' logits equal the naive recompute.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import torch

from ..cache import Request, TieredKVCache
from ..device import resolve_device
from ..errors import CacheFullError
from .model import ReferenceModel

__all__ = ["ServeRequest", "ServingLoop", "Status"]


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"


@dataclass(eq=False)
class ServeRequest:
    """A request of the loop.

    ``abort_after``: abort once this many tokens (prompt + generated) are in the cache,
    mid-prefill or mid-decode; None runs to completion. ``record``: keep every
    position's logits so the caller can compare them with the naive run.
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    abort_after: int | None = None
    record: bool = False
    status: Status = Status.WAITING
    generated: list[int] = field(default_factory=list)
    preemptions: int = 0
    cached_tokens: list[int] = field(default_factory=list)
    #: position -> logits row ``[vocab]`` (when ``record``)
    logits: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _req: Request | None = field(default=None, repr=False)
    _last: torch.Tensor | None = field(default=None, repr=False)

    @property
    def tokens(self) -> list[int]:
        """Prompt plus generated tokens: what is (or will be) in the cache."""
        return self.prompt + self.generated


class ServingLoop:
    """Round-robin scheduler: each step gives every running request one prefill chunk or
    one decode token.

    Args:
        model, cache: the reference model and the cache it runs through.
        prefill_chunk: tokens per prefill step.
        max_running: admitted requests at once (at most the cache's State slots).
        reuse: look prefixes up in the cache (False: recompute every prompt, a baseline).
        device: where the model computes (default: the cache's device, e.g. ``"cuda"``);
            ``self.model`` is ``model`` moved there, and recorded logits live there.
    """

    def __init__(self, model: ReferenceModel, cache: TieredKVCache, *, prefill_chunk: int = 64,
                 max_running: int | None = None, reuse: bool = True,
                 device: str | torch.device | None = None) -> None:
        self.device = cache.device if device is None else resolve_device(device)
        self.model = model.to(self.device)
        self.cache = cache
        self.reuse = reuse
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running or cache.states.num_slots
        self.waiting: deque[ServeRequest] = deque()
        self.running: list[ServeRequest] = []
        self.finished: list[ServeRequest] = []
        self.steps = 0
        self.preemptions = 0
        self.tokens_computed = 0

    def submit(self, request: ServeRequest) -> None:
        self.waiting.append(request)

    # ------------------------------------------------------------- scheduling
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            try:
                r._req = self.cache.open(r.tokens, max_cached_tokens=None if self.reuse else 0)
            except CacheFullError:
                return
            self.waiting.popleft()
            r.status = Status.RUNNING
            r.cached_tokens.append(r._req.num_cached_tokens)
            self.running.append(r)

    def _finish(self, r: ServeRequest, status: Status) -> None:
        assert r._req is not None
        self.cache.close(r._req)
        r._req = None
        r.status = status
        self.running.remove(r)
        self.finished.append(r)

    def _preempt(self, r: ServeRequest) -> None:
        """Give back r's slot and blocks (kept as cached prefix) and queue it again."""
        assert r._req is not None
        self.cache.close(r._req)
        r._req = None
        r._last = None
        r.status = Status.WAITING
        r.preemptions += 1
        self.preemptions += 1
        self.running.remove(r)
        self.waiting.appendleft(r)

    def _run(self, r: ServeRequest, tokens: list[int]) -> None:
        assert r._req is not None
        start = r._req.num_tokens
        logits = self.model.forward(self.cache, r._req, tokens)
        self.tokens_computed += len(tokens)
        if r.record:
            for i in range(logits.shape[0]):
                r.logits[start + i] = logits[i]
        r._last = logits[-1]

    def step(self) -> None:
        """One scheduling iteration."""
        self._admit()
        self.steps += 1
        for r in list(self.running):
            req = r._req
            assert req is not None
            if r.abort_after is not None and req.num_tokens >= r.abort_after:
                self._finish(r, Status.ABORTED)
                continue
            todo = r.tokens[req.num_tokens:]
            try:
                if todo:  # prefill (or re-prefill after a resume)
                    n = len(todo) if r.abort_after is None else min(len(todo), max(1, r.abort_after - req.num_tokens))
                    self._run(r, todo[:min(n, self.prefill_chunk)])
                elif len(r.generated) < r.max_new_tokens:
                    assert r._last is not None
                    nxt = int(torch.argmax(r._last))
                    r.generated.append(nxt)
                    self._run(r, [nxt])
                else:
                    self._finish(r, Status.DONE)
            except CacheFullError:
                if len(self.running) == 1:
                    raise  # nothing else to preempt: the pool cannot hold one request
                self._preempt(r)

    def run(self, max_steps: int = 1_000_000) -> list[ServeRequest]:
        """Step until every request has finished; returns them in finishing order."""
        while self.waiting or self.running:
            if self.steps >= max_steps:
                raise RuntimeError(f"serving loop: not done after {max_steps} steps")
            self.step()
        return self.finished


def make_workload(num_requests: int, *, seed: int = 0, vocab: int = 256, num_prefixes: int = 6,
                  prefix_tokens: tuple[int, int] = (100, 400), suffix_tokens: tuple[int, int] = (1, 90),
                  new_tokens: tuple[int, int] = (1, 12), abort_fraction: float = 0.2,
                  record_every: int = 10) -> list[ServeRequest]:
    """Requests whose prompts share random prefixes; some abort mid-prefill or mid-decode."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(*prefix_tokens))] for _ in range(num_prefixes)]
    out = []
    for i in range(num_requests):
        base = rng.choice(prefixes)
        cut = rng.randint(len(base) // 2, len(base))
        prompt = base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(*suffix_tokens))]
        max_new = rng.randint(*new_tokens)
        abort = None
        if rng.random() < abort_fraction:  # mid-prefill or mid-decode
            abort = rng.randint(1, len(prompt) + max_new - 1)
        out.append(ServeRequest(rid=i, prompt=prompt, max_new_tokens=max_new, abort_after=abort,
                                record=(i % record_every == 0)))
    return out
