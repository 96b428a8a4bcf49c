"""``tiered-kv warm-start --endpoint URL``: warm a live OpenAI-compatible server and time it.

Each prompt is sent once per pass as a completion with ``max_tokens=1`` (text prompts as
text, for the server's tokenizer; ``tokens`` lines as token ids), and the client times its
first token (see :mod:`._openai_client`). ``--passes N`` repeats the prompt set N times in
one run: pass 1 is *cold* for whatever the server does not hold yet, the last pass shows
the *warm* time to first token from whatever tier now holds the prompts. Warm-from-disk is
measured by running twice around a server restart on the same store: the second run's
pass 1 is served from the store (its ``store.hits`` rise, its ``cached_tokens`` too).

With ``--store`` (the server's store), the store's record count and, for LMDB, its
lifetime hit / miss / corrupt / put counters (summed over every process, as ``tiered-kv
stats`` shows them) are read before and after each pass, read-only and whatever layout
the store holds; a pass reports their differences. A server persists its counters in its
own time (``serve-reference`` after each response, an LMDB store otherwise within
``access_flush_s`` of a read, and at close), so a busy engine's last few may show in the
next pass.

The report (``--json``)::

    {"endpoint": "http://host:port/v1", "model": ..., "mode": "stream" | "stream-no-usage" | "full",
     "store": URL | null,
     "passes": [{"pass": 1,
                 "prompts": [{"id", "prompt_tokens", "cached_tokens", "ttft_s", "total_s"}, ...],
                 "totals": {"prompts", "ttft_s", "mean_ttft_s", "median_ttft_s", "prompt_tokens",
                            "cached_tokens", "computed_tokens", "wall_s"},
                 "store": {"records_before", "records", "records_added",
                           "hits", "misses", "corrupt", "puts"} | null}, ...],
     "summary": {"first_mean_ttft_s", "last_mean_ttft_s", "speedup"} | null}

``prompt_tokens`` / ``cached_tokens`` are the server's ``usage`` (``null`` when it does
not report them); the store's counters are ``null`` for a backend without lifetime
counters (Zarr). ``summary`` compares the first and the last pass (``null`` for one pass).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

from . import _common
from ._common import CommandFailed, Progress, Prompt
from ._openai_client import EndpointError, EndpointUnreachable, FirstToken, OpenAIClient
from .main import ExitCode, UsageError

if TYPE_CHECKING:
    from ..layout import KVLayout

__all__ = ["read_store_counters", "warm_endpoint"]

#: the store counters a pass reports (LMDB's lifetime counters)
COUNTERS = ("hits", "misses", "corrupt", "puts")


def warm_endpoint(url: str, prompts: list[Prompt], *, model: str | None = None, passes: int = 1,
                  store: _common.StoreLocation | None = None, layout: KVLayout | None = None,
                  timeout_s: float = 300.0, verbose: bool = True) -> dict[str, Any]:
    """Send ``prompts`` ``passes`` times to the server at ``url``; return the report (the
    ``--json`` object). Raises :class:`CommandFailed` (unreachable endpoint: exit 6; an
    HTTP or protocol error: exit 1) naming the URL."""
    try:
        client = OpenAIClient(url, timeout_s=timeout_s)
    except ValueError as exc:
        raise UsageError(f"--endpoint: {str(exc).removeprefix('url: ')}") from None
    try:
        if model is None:
            model = _served_model(client)
        report = _Report(client, model, prompts, passes, store, verbose)
        for n in range(1, passes + 1):
            before = read_store_counters(store, layout) if store is not None else None
            report.start_pass(n)
            for prompt in prompts:
                report.started(prompt)
                got = client.first_token(prompt.text if prompt.text is not None else prompt.tokens, model)
                report.add(prompt, got)
            after = read_store_counters(store, layout) if store is not None else None
            report.end_pass(before, after)
    except EndpointUnreachable as exc:
        raise CommandFailed(ExitCode.ENDPOINT_UNREACHABLE, str(exc)) from None
    except EndpointError as exc:
        raise CommandFailed(ExitCode.FAILURE, str(exc)) from None
    return report.finish()


def _served_model(client: OpenAIClient) -> str:
    try:
        models = client.models()
    except EndpointUnreachable:
        raise
    except EndpointError as exc:
        raise EndpointError(f"{exc} (name the model with --served-model)") from None
    if not models:
        raise EndpointError(f"{client.url}/models lists no model; name one with --served-model")
    return models[0]


def read_store_counters(loc: _common.StoreLocation, layout: KVLayout | None) -> dict[str, Any]:
    """``records`` and, where the backend keeps lifetime counters, ``hits`` / ``misses`` /
    ``corrupt`` / ``puts`` (else None) of the store at ``loc``, opened read-only (LMDB)
    whatever layout it holds: only its counters are read."""
    from ..presets import tiny
    from ..storage import LayoutMismatchError, open_store

    layout = layout or tiny()
    if not loc.exists():
        raise _common.missing_store(loc)
    options: dict[str, Any] = {"readonly": True} if loc.backend is _common.Backend.LMDB else {}
    with _common.store_errors(loc, layout):
        try:
            s = open_store(loc.url, layout_fingerprint=layout.fingerprint, **options)
        except LayoutMismatchError as exc:  # an engine's store: its counters are still the ones to read
            if exc.stored is None:
                raise
            s = open_store(loc.url, layout_fingerprint=exc.stored, **options)
        try:
            stats = s.stats()
        finally:
            s.close()
    lifetime = "lifetime_hits" in stats
    return {"records": stats["records"],
            **{k: (stats[f"lifetime_{k}"] if lifetime else None) for k in COUNTERS}}


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"records_before": before["records"], "records": after["records"],
                           "records_added": after["records"] - before["records"]}
    for k in COUNTERS:
        out[k] = None if after[k] is None or before[k] is None else after[k] - before[k]
    return out


class _Report:
    """Rows and totals per pass; prints them as they come when ``verbose`` (with a
    progress bar when stderr is a terminal)."""

    def __init__(self, client: OpenAIClient, model: str, prompts: list[Prompt], passes: int,
                 store: _common.StoreLocation | None, verbose: bool) -> None:
        self.client = client
        self.model = model
        self.num_prompts = len(prompts)
        self.passes_total = passes
        self.store = store
        self.verbose = verbose
        self.passes: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self.progress = Progress(passes * len(prompts))
        self._done = 0
        self._t0 = 0.0
        if verbose:
            where = f"; store {store.url}" if store is not None else ""
            print(f"warm-start: {len(prompts)} prompts x {passes} pass{'es' if passes > 1 else ''} -> "
                  f"{client.url} (model {model}{where})", flush=True)

    def start_pass(self, n: int) -> None:
        self.rows = []
        self._t0 = time.perf_counter()
        if self.verbose:
            self.progress.println(f"  pass {n}\n  {'id':<20} {'tokens':>7} {'cached':>7} {'ttft_ms':>9} "
                                  f"{'total_ms':>9}")

    def started(self, prompt: Prompt) -> None:
        self.progress.update(self._done, f"pass {len(self.passes) + 1}/{self.passes_total} "
                                         f"{len(self.rows) + 1}/{self.num_prompts} {prompt.id}")

    def add(self, prompt: Prompt, got: FirstToken) -> None:
        row = {"id": prompt.id, "prompt_tokens": got.prompt_tokens, "cached_tokens": got.cached_tokens,
               "ttft_s": got.ttft_s, "total_s": got.total_s}
        self.rows.append(row)
        self._done += 1
        if self.verbose:
            self.progress.println(f"  {prompt.id:<20} {_cell(got.prompt_tokens):>7} {_cell(got.cached_tokens):>7} "
                                  f"{got.ttft_s * 1e3:>9.1f} {got.total_s * 1e3:>9.1f}")

    def end_pass(self, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        ttfts = [r["ttft_s"] for r in self.rows]
        prompt_tokens = _sum(r["prompt_tokens"] for r in self.rows)
        cached = _sum(r["cached_tokens"] for r in self.rows)
        totals = {"prompts": len(self.rows), "ttft_s": sum(ttfts), "mean_ttft_s": statistics.fmean(ttfts),
                  "median_ttft_s": statistics.median(ttfts), "prompt_tokens": prompt_tokens,
                  "cached_tokens": cached,
                  "computed_tokens": None if prompt_tokens is None or cached is None else prompt_tokens - cached,
                  "wall_s": time.perf_counter() - self._t0}
        store = _delta(before, after) if before is not None and after is not None else None
        self.passes.append({"pass": len(self.passes) + 1, "prompts": self.rows, "totals": totals, "store": store})
        if self.verbose:
            t = totals
            self.progress.println(f"  {'total':<20} {_cell(prompt_tokens):>7} {_cell(cached):>7} "
                                  f"{t['ttft_s'] * 1e3:>9.1f}  mean ttft {t['mean_ttft_s'] * 1e3:.1f} ms, "
                                  f"median {t['median_ttft_s'] * 1e3:.1f} ms")
            if store is not None:
                counts = ", ".join(f"{store[k]} {k}" for k in COUNTERS if store[k] is not None) \
                    or "no lifetime counters (not LMDB)"
                self.progress.println(f"  store: {store['records']} records (+{store['records_added']}); "
                                      f"this pass: {counts}")

    def finish(self) -> dict[str, Any]:
        self.progress.close()
        summary = None
        if len(self.passes) > 1:
            first, last = (p["totals"]["mean_ttft_s"] for p in (self.passes[0], self.passes[-1]))
            summary = {"first_mean_ttft_s": first, "last_mean_ttft_s": last, "speedup": first / last}
            if self.verbose:
                print(f"mean time to first token: pass 1 {first * 1e3:.1f} ms -> pass {len(self.passes)} "
                      f"{last * 1e3:.1f} ms ({first / last:.1f}x)", flush=True)
        assert self.client.mode is not None
        return {"endpoint": self.client.url, "model": self.model, "mode": self.client.mode.value,
                "store": None if self.store is None else self.store.url, "passes": self.passes,
                "summary": summary}


def _sum(values: Any) -> int | None:
    """The sum, or None when any value is unknown (the server does not report it)."""
    total = 0
    for v in values:
        if v is None:
            return None
        total += v
    return total


def _cell(v: int | None) -> str:
    return "-" if v is None else str(v)
