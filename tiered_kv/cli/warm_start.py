"""``tiered-kv warm-start``: prefill a prompt set through the cache and persist it to a store.

::

    tiered-kv warm-start --store .demo/store --prompts bundled
    tiered-kv warm-start --store lmdb:///var/cache/kv --prompts prompts.jsonl --json
    tiered-kv warm-start --endpoint http://127.0.0.1:8000 --prompts prompts.jsonl --passes 2

Each prompt (a JSONL line ``{"id": ..., "tokens": [...]}`` or ``{"id": ..., "text": "..."}``,
text tokenized byte-level) is matched against the store; the reference model prefills
what is missing; full blocks and state snapshots are written to the store behind the
request. Per prompt it reports the tokens, the tokens served from the cache, and the time
to first token (``cache.open`` + the prefill forward). Run it twice: the second run
resumes every prompt from the store and computes only the last partial block.

The store is created if missing. With ``--json`` it prints one object::

    {"store": ..., "model": "tiny", "layout_fingerprint": ..., "salt": "",
     "prompts": [{"id", "tokens", "cached_tokens", "ttft_s", "blocks_from_store"}, ...],
     "totals": {"prompts", "tokens", "cached_tokens", "computed_tokens", "ttft_s",
                "mean_ttft_s", "wall_s", "records_before", "records", "bytes",
                "records_written", "write_errors", "last_write_error"}}

Exit codes: 0 ok; 1 some records could not be written (the message says why); 2 bad
arguments or prompts, or a model other than ``tiny`` (the reference model's weights are
random: KV for a real model's layout must come from that model); 4 the store holds another
layout; 5 the store is locked.

With ``--endpoint URL`` it warms a live OpenAI-compatible server instead (vLLM, SGLang,
``tiered-kv serve-reference``): each prompt is sent as a ``max_tokens=1`` completion,
``--passes N`` times, and the time to its first token is reported per pass, with the
store's counters when ``--store`` names the server's store (see :mod:`._warm_endpoint`).
Exit codes there: 0 ok; 1 an HTTP error or a malformed answer (the message names the URL);
2 bad arguments or prompts; 3 no store at ``--store``; 6 the endpoint is unreachable.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..planner import format_bytes
from . import _common, _keys
from ._common import CommandFailed, Progress, Prompt
from .main import ExitCode, UsageError

if TYPE_CHECKING:
    from ..cache import TieredKVCache
    from ..layout import KVLayout
    from ..reference import ReferenceModel

__all__ = ["add_parser", "run", "warm_start"]

#: the reference model's weights (fixed: cached KV is only valid for the weights that made it)
MODEL_SEED = 0
#: the GPU (hot) pools are sized for the prompt set, up to these bounds
MAX_POOL_BLOCKS = 4096
MAX_POOL_SNAPSHOTS = 1024


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "warm-start",
        help="prefill prompts with the reference model and persist their KV to a store",
        description="Match each prompt against the store, prefill the misses with the reference "
                    "model, write full blocks and state snapshots to the store, and report tokens, "
                    "cached tokens and time to first token per prompt. The store is created if "
                    "missing; a second run resumes every prompt from it.",
        epilog="exit codes: 0 ok, 1 some records were not written (with --endpoint: an HTTP error), "
               "2 bad arguments, 3 store missing (--endpoint), 4 foreign-layout store, 5 store locked, "
               "6 endpoint unreachable",
    )
    _common.add_store_arg(p, creates=True, required=False,
                          note="; required, unless --endpoint: then optional, the server's store, whose "
                               "counters each pass reports (read-only)")
    p.add_argument("--prompts", required=True, metavar="FILE", help=_common.prompts_arg_help("prompts"))
    _common.add_layout_args(p)
    p.add_argument("--salt", default="", metavar="S",
                   help="tenant salt of the prefix hash: prompts of different salts never share "
                        "cached blocks (default: none)")
    p.add_argument("--snapshot-interval", type=_common.positive_int, default=1, metavar="N",
                   help="store a state snapshot (a resume point) every N blocks, besides the end of "
                        "each prompt; 1 lets prompts that share a prefix resume at its last full "
                        "block (default %(default)s)")
    p.add_argument("--max-bytes", type=_common.size_arg, default=None, metavar="SIZE",
                   help="bound of the store's records (LRU-evicted), e.g. 8G (default: the backend's)")
    p.add_argument("--device", default="cpu",
                   help="where the cache's hot pools and the model run: cpu or cuda[:i] (default %(default)s)")
    p.add_argument("--threads", type=_common.positive_int, default=1, metavar="N",
                   help="torch intra-op threads for the reference model (default %(default)s: its "
                        "matrices are tiny, and more threads mostly add synchronisation)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    _keys.add_key_args(p, tenant_default="the --salt, as a cache's")
    live = p.add_argument_group("live endpoint", "warm an OpenAI-compatible server (vLLM, SGLang, "
                                                 "tiered-kv serve-reference) instead of the reference model")
    live.add_argument("--endpoint", metavar="URL", default=None,
                      help="the server, http://host:port (or .../v1): each prompt is sent as a max_tokens=1 "
                           "completion and its time to first token measured")
    live.add_argument("--served-model", metavar="NAME", default=None,
                      help="the request's model field (default: the first model GET /v1/models lists)")
    live.add_argument("--passes", type=_common.positive_int, default=1, metavar="N",
                      help="send the prompt set N times; the report compares the first pass (cold) with "
                           "the last (warm) (default %(default)s)")
    live.add_argument("--timeout", type=_common.seconds_arg, default=300.0, metavar="S",
                      help="seconds to wait to connect and for each answer (default %(default)s)")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


#: options of the local warm-start that a live endpoint's own configuration decides
_LOCAL_ONLY = ("salt", "snapshot_interval", "max_bytes", "device", "threads", "key_file", "tenant")
#: options of --endpoint only
_ENDPOINT_ONLY = ("served_model", "passes", "timeout")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The options of ``names`` given a value other than their default, as ``--opt-name``."""
    parser: argparse.ArgumentParser = args._parser
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) != parser.get_default(n)]


def _run(args: argparse.Namespace) -> int:
    if args.endpoint is not None:
        return _run_endpoint(args)
    given = _given(args, _ENDPOINT_ONLY)
    if given:
        raise UsageError(f"{given[0]}: expected together with --endpoint URL")
    if args.store is None:
        raise UsageError("--store: expected a store URL (required unless --endpoint)")
    layout = _common.layout_from_args(args)
    if layout.name != "tiny":
        raise UsageError(
            f"--model {args.model}: warm-start computes KV with the reference model, whose weights are "
            f"random, so it runs only the demo layout, --model tiny; KV for {args.model} must come from "
            f"the real model in a serving engine. Its stores can be planned (tiered-kv plan) and "
            f"inspected (stats, verify, gc, ls)")
    if args.max_bytes == 0:
        raise UsageError("--max-bytes: expected a positive size, e.g. 8G, got 0")
    loc = _common.parse_store(args.store)
    from ..tokenizer import VOCAB_SIZE

    prompts = _common.load_prompts(args.prompts, vocab_size=VOCAB_SIZE)
    from ..device import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    encryption = _keys.encryption_from_args(args, default_tenant=args.salt)
    # The disk tier's own warning is dropped: the summary line below counts every failed write.
    with _torch_threads(args.threads), _common.quiet_logger("tiered_kv.disk"):
        report = warm_start(layout, loc, prompts, device=str(device), salt=args.salt,
                            snapshot_interval=args.snapshot_interval, max_bytes=args.max_bytes,
                            verbose=not args.json, encryption=encryption)
    if args.json:
        _common.print_json(report)
    totals = report["totals"]
    if totals["write_errors"]:
        raise CommandFailed(ExitCode.FAILURE,
                            f"{totals['write_errors']} records could not be written to {loc.path} "
                            f"(last error: {totals['last_write_error']}); the prompts were served, "
                            f"but a later run will recompute what is missing")
    return ExitCode.OK


def _run_endpoint(args: argparse.Namespace) -> int:
    from ._warm_endpoint import warm_endpoint

    given = _given(args, _LOCAL_ONLY)
    if given:
        raise UsageError(f"{given[0]}: applies to the reference model's warm-start; "
                         f"with --endpoint the server's own configuration decides it")
    layout = _common.layout_from_args(args)  # only to open --store (whatever layout it holds)
    loc = _common.parse_store(args.store) if args.store is not None else None
    prompts = _common.load_prompts(args.prompts)  # the server checks token ids against its vocabulary
    report = warm_endpoint(args.endpoint, prompts, model=args.served_model, passes=args.passes, store=loc,
                           layout=layout, timeout_s=args.timeout, verbose=not args.json)
    if args.json:
        _common.print_json(report)
    return ExitCode.OK


def warm_start(layout: KVLayout, loc: _common.StoreLocation, prompts: list[Prompt], *, device: str = "cpu",
               salt: str = "", snapshot_interval: int = 1, max_bytes: int | None = None,
               verbose: bool = True, encryption: Any = None) -> dict[str, Any]:
    """Prefill ``prompts`` through a cache backed by the store at ``loc``; return the report
    (the ``--json`` object). ``verbose`` prints a line per prompt as it completes.
    ``encryption``: an EncryptionConfig sealing the store's records."""
    from ..cache import TieredKVCache
    from ..reference import ReferenceModel

    # hot pools sized for the whole prompt set (bounded): blocks shared between prompts stay
    # on the GPU tier for the run; the store holds everything for the next one
    need = [layout.num_blocks_for(len(p.tokens)) for p in prompts]
    num_blocks = min(sum(need) + 1, max(MAX_POOL_BLOCKS, max(need) + 1))
    num_snapshots = max(3, min(sum(need) + 2, MAX_POOL_SNAPSHOTS))
    store_options: dict[str, Any] = {} if max_bytes is None else {"max_bytes": max_bytes}
    if encryption is not None:
        store_options["encryption"] = encryption
    with _common.store_errors(loc, layout):
        cache = TieredKVCache(layout, device=device, num_blocks=num_blocks, num_state_slots=1,
                              num_snapshots=num_snapshots, snapshot_interval=snapshot_interval,
                              salt=salt, store=loc.url, store_options=store_options,
                              admission="all")  # (warming writes every prompt: its purpose)
        try:
            model = ReferenceModel(layout, seed=MODEL_SEED)
            _warm_up(model, layout, device)
            report = _Report(layout, loc, prompts, records_before=_store_stats(cache)["records"],
                             verbose=verbose)
            for prompt in prompts:
                report.started(prompt)
                report.add(_prefill(cache, model, prompt))
            report.flushing()
            cache.flush()
            assert cache.disk is not None
            report.finish(_store_stats(cache), cache.disk)
        finally:
            cache.shutdown()
    return report.to_dict(salt)


def _prefill(cache: TieredKVCache, model: ReferenceModel, prompt: Prompt) -> dict[str, Any]:
    """Open, prefill and close one prompt; time to first token = open + prefill forward."""
    from_disk = cache.stats()["blocks_from_disk"]
    t0 = time.perf_counter()
    req = cache.open(prompt.tokens)
    model.forward(cache, req, prompt.tokens[req.num_cached_tokens:])
    ttft = time.perf_counter() - t0
    cached = req.num_cached_tokens
    cache.close(req)
    return {"id": prompt.id, "tokens": len(prompt.tokens), "cached_tokens": cached, "ttft_s": ttft,
            "blocks_from_store": cache.stats()["blocks_from_disk"] - from_disk}


class _Report:
    """Per-prompt rows and totals of one run; prints them as they come when ``verbose``
    (with a progress bar when stderr is a terminal)."""

    def __init__(self, layout: KVLayout, loc: _common.StoreLocation, prompts: list[Prompt], *,
                 records_before: int, verbose: bool) -> None:
        self.layout = layout
        self.loc = loc
        self.num_prompts = len(prompts)
        self.total_tokens = sum(len(p.tokens) for p in prompts)
        self.records_before = records_before
        self.verbose = verbose
        self.rows: list[dict[str, Any]] = []
        self.totals: dict[str, Any] = {}
        self.progress = Progress(self.total_tokens)  # a bar on a terminal's stderr, else nothing
        self._done_tokens = 0
        self._t0 = time.perf_counter()
        if verbose:
            print(f"warm-start: {self.num_prompts} prompts, {self.total_tokens} tokens -> {loc.url}")
            print(f"  layout {layout.name} {layout.fingerprint}, block {layout.block_tokens} tokens; "
                  f"store had {records_before} records")
            print(f"  {'id':<20} {'tokens':>7} {'cached':>7} {'computed':>8} {'ttft_ms':>9}  cached blocks from")

    def started(self, prompt: Prompt) -> None:
        self.progress.update(self._done_tokens, f"{len(self.rows) + 1}/{self.num_prompts} {prompt.id} "
                                                f"({len(prompt.tokens)} tokens)")

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._done_tokens += row["tokens"]
        if self.verbose:
            cached = row["cached_tokens"]
            src = _source(cached // self.layout.block_tokens, row["blocks_from_store"])
            self.progress.println(f"  {row['id']:<20} {row['tokens']:>7} {cached:>7} {row['tokens'] - cached:>8} "
                                  f"{row['ttft_s'] * 1e3:>9.1f}  {src}")

    def flushing(self) -> None:
        self.progress.update(self._done_tokens, "writing the store")

    def finish(self, store: dict[str, Any], disk: Any) -> None:
        self.progress.close()
        ttft = sum(r["ttft_s"] for r in self.rows)
        cached = sum(r["cached_tokens"] for r in self.rows)
        self.totals = {
            "prompts": len(self.rows), "tokens": self.total_tokens, "cached_tokens": cached,
            "computed_tokens": self.total_tokens - cached, "ttft_s": ttft,
            "mean_ttft_s": ttft / len(self.rows), "wall_s": time.perf_counter() - self._t0,
            "records_before": self.records_before, "records": store["records"], "bytes": store["bytes"],
            "records_written": disk.writes, "write_errors": disk.write_errors,
            "last_write_error": disk.last_write_error,
        }
        if self.verbose:
            t = self.totals
            print(f"  {'total':<20} {t['tokens']:>7} {cached:>7} {t['computed_tokens']:>8} {ttft * 1e3:>9.1f}"
                  f"  mean ttft {t['mean_ttft_s'] * 1e3:.1f} ms")
            print(f"  store: {t['records']} records, {format_bytes(t['bytes'])} "
                  f"({t['records_written']} written by this run)")

    def to_dict(self, salt: str) -> dict[str, Any]:
        return {"store": self.loc.url, "model": self.layout.name, "layout_fingerprint": self.layout.fingerprint,
                "salt": salt, "prompts": self.rows, "totals": self.totals}


def _warm_up(model: ReferenceModel, layout: KVLayout, device: str) -> None:
    """One small forward through a throwaway cache, so the first prompt's TTFT does not
    pay for torch's lazy initialisation."""
    from ..cache import TieredKVCache

    cache = TieredKVCache(layout, device=device, num_blocks=2, num_state_slots=1)
    tokens = list(range(1, 1 + min(64, layout.block_tokens)))
    req = cache.open(tokens)
    model.forward(cache, req, tokens)
    cache.close(req)
    cache.shutdown()


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads, then restore the previous number (the
    command may run inside another program, e.g. a test)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _store_stats(cache: TieredKVCache) -> dict[str, Any]:
    assert cache.disk is not None
    return cache.disk.store.stats()


def _source(cached_blocks: int, from_store: int) -> str:
    """Where a prompt's cached blocks came from: ``"store 4"``, ``"gpu 2 + store 2"``, ``"-"``."""
    parts = [f"{tier} {n}" for tier, n in (("gpu", cached_blocks - from_store), ("store", from_store)) if n]
    return " + ".join(parts) or "-"
