"""HiSparse device-buffer hit rate and bytes moved per decode step, versus buffer size.

Each decode step, per CSA layer, the indexer picks top-k CSA entries; HiSparse keeps N of
them per request and layer in a device buffer (LRU) and copies only the misses from the
host mirror (docs/architecture.md §4). How large must N be? This replays per-step top-k id sets
through the real :class:`tiered_kv.hisparse.HiSparseBuffers` for N = 1, 2, 4, 8 x top-k::

    model traces      ReferenceModel(presets.tiny(top_k=k), seed) runs a prefill and then
                      decode steps through a TieredKVCache with HiSparse on; a subclass
                      of the cache records, per read_csa call, the ids of sealed entries
                      it sends to the buffer (what HiSparse really swaps in). Replayed in
                      call order (prefill included, as warm-up). Cross-check: the replay at
                      the run's own N reproduces the cache's hisparse_hits / misses over
                      the measured steps exactly.
    synthetic traces  1M-token Flash scale: 262,144 CSA entries, top-512. Step t keeps
                      round(p * k) ids of step t-1 (a uniform subset) and draws the rest
                      from the context outside step t-1's set, uniformly or Zipf(s=1) over
                      a random ranking of the entries; p in {0.5, 0.8, 0.95}.

Warm-up (replayed, not counted): a model trace's prefill and first decode steps; a
synthetic trace's first steps, enough for the largest buffer to fill (full mode).

Reported per trace and N, over the measured steps (per CSA layer per step):

    hit rate        hits / ids requested
    moved           misses * 584 B: what HiSparse copies per step, in Flash fp8 bytes
    baseline        k * 584 B: the same step without buffering (every selected entry
                    re-read from host), k = ids requested, from the same trace
    saved           baseline / moved
    swap-in us      median CPU time of one HiSparseBuffers.swap_in call (torch impl, this
                    machine; only a relative cost: the GPU numbers come from gpu_bench.py)

The replay mirror is small (8-byte entries holding their own id, checked after every
call), so bytes are counted, not copied at Flash size.

    python bench/hisparse.py --quick     # well under a minute on 2 cores
    python bench/hisparse.py             # the full run (a few minutes on 2 cores)

Writes ``bench/results/hisparse.json`` and ``bench/results/hisparse.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # allow `python bench/hisparse.py` from a checkout
    sys.path.insert(0, str(ROOT))

from tiered_kv import TieredKVCache, presets  # noqa: E402
from tiered_kv.cache import Request  # noqa: E402
from tiered_kv.hisparse import HiSparseBuffers, HiSparseConfig  # noqa: E402
from tiered_kv.layout import EntryFormat, KVLayout, LayerKind  # noqa: E402
from tiered_kv.reference import ReferenceModel  # noqa: E402

RESULTS = ROOT / "bench" / "results"
#: Bytes of one DeepSeek-V4-Flash fp8_ds_mla CSA entry: moved bytes are quoted in these.
FLASH_ENTRY_BYTES = presets.deepseek_v4_flash().entry_bytes
#: 1M tokens of Flash: 2^20 / 4 CSA entries per CSA layer.
FLASH_1M_ENTRIES = (1 << 20) // 4
FLASH_TOP_K = presets.deepseek_v4_flash().top_k
MULTIPLES = (1, 2, 4, 8)
#: Calls recorded before the measured steps carry this step number.
WARMUP = -1


# ------------------------------------------------------------------------- traces
@dataclass(frozen=True, slots=True)
class Call:
    """One swap-in of one request: ``ids`` ``[m]`` int64 (CPU), CSA entries of layer ``part``."""

    step: int  # decode step, counted from 0; WARMUP for warm-up calls
    part: int  # CSA layer index among the CSA layers
    ids: torch.Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheCheck:
    """What the real cache counted over the measured steps, at its own buffer size."""

    buffer_entries: int
    hits: int
    misses: int


@dataclass(frozen=True, kw_only=True)
class Trace:
    """Per-step top-k id sets of one request, in call order."""

    name: str
    kind: str  # "model" | "synthetic"
    top_k: int
    #: CSA entries per layer in the context (every id is below this).
    num_entries: int
    num_csa_layers: int
    calls: list[Call]
    params: dict[str, Any] = field(default_factory=dict)
    check: CacheCheck | None = None

    @property
    def steps(self) -> int:
        """Measured decode steps."""
        return len({c.step for c in self.calls if c.step != WARMUP})


class RecordingCache(TieredKVCache):
    """A :class:`TieredKVCache` that records the ids each ``read_csa`` swaps in.

    With HiSparse, ``read_csa`` serves entries of the open block from the GPU and sends
    the sealed ones (in the given order) to the device buffer; those are recorded,
    tagged with :attr:`step`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[Call] = []
        self.step = WARMUP

    def read_csa(self, request: Request, layer: int, entry_ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(entry_ids).to(torch.int64).cpu()
        sealed = ids[ids // self.layout.csa_entries_per_block < request.num_sealed_blocks]
        if sealed.numel():
            self.calls.append(Call(self.step, self.layout.part_index(layer), sealed.clone()))
        return super().read_csa(request, layer, entry_ids)


def record_model_trace(*, top_k: int, prefill: int, decode: int, warmup_steps: int, seed: int = 0,
                       run_multiple: int = 4, phrase: int | None = None) -> Trace:
    """Run the reference model with HiSparse (N = ``run_multiple`` x top-k) and record its
    swap-ins: a ``prefill``-token prompt of random tokens, then ``warmup_steps + decode``
    decode steps; the last ``decode`` steps are measured.

    Decode tokens are random too, or, with ``phrase``, one random phrase of that many
    tokens repeated (a low-entropy continuation: the queries recur with the phrase).
    """
    layout = presets.tiny(top_k=top_k)
    model = ReferenceModel(layout, seed)
    total = prefill + warmup_steps + decode
    num_blocks = layout.num_blocks_for(total) + 1
    # the host tier gives 1/4 to snapshots; the rest must hold every sealed block's record
    host_bytes = 2 * (num_blocks + 2) * layout.block_bytes + 8 * layout.snapshot_bytes
    n_run = run_multiple * top_k
    cache = RecordingCache(layout, num_blocks=num_blocks, num_state_slots=1, host_bytes=host_bytes,
                           hisparse=HiSparseConfig(device_buffer_entries=n_run))
    tokens = torch.randint(0, model.vocab_size, (total,), generator=torch.Generator().manual_seed(seed)).tolist()
    if phrase is not None:
        tokens[prefill:] = (tokens[prefill - phrase:prefill] * (total // phrase + 1))[:total - prefill]
    req = cache.open(tokens[:prefill])
    model.forward(cache, req, tokens[:prefill])
    before = cache.stats()
    for i in range(prefill, total):
        step = i - prefill - warmup_steps
        if step == 0:
            before = cache.stats()
        cache.step = step if step >= 0 else WARMUP
        model.forward(cache, req, tokens[i:i + 1])
    after = cache.stats()
    cache.close(req)
    check = CacheCheck(buffer_entries=n_run,
                       hits=after["hisparse_hits"] - before["hisparse_hits"],
                       misses=after["hisparse_misses"] - before["hisparse_misses"])
    return Trace(
        name=f"model top-{top_k}, {prefill} prefill" + (f", {phrase}-token loop" if phrase else ""),
        kind="model", top_k=top_k, num_entries=total // layout.csa_ratio,
        num_csa_layers=layout.num_csa_layers, calls=cache.calls, check=check,
        params={"preset": "tiny", "top_k": top_k, "seed": seed, "prefill_tokens": prefill,
                "warmup_decode_steps": warmup_steps, "decode_steps": decode,
                "run_buffer_entries": n_run,
                "tokens": "uniform random ids" if phrase is None else
                          f"random prompt; decode repeats its last {phrase} tokens"},
    )


def _sampler(rng: np.random.Generator, num_entries: int, draw: str, zipf_s: float):
    """A function ``size -> [size] int64`` of ids drawn with replacement."""
    if draw == "uniform":
        return lambda size: rng.integers(0, num_entries, size)
    if draw == "zipf":
        weights = np.arange(1, num_entries + 1, dtype=np.float64) ** -zipf_s
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        ranking = rng.permutation(num_entries)  # hot entries scattered over the context
        return lambda size: ranking[np.minimum(np.searchsorted(cdf, rng.random(size)), num_entries - 1)]
    raise ValueError(f"draw: expected 'uniform' or 'zipf', got {draw!r}")


def _draw_distinct(sample, need: int, excluded: np.ndarray) -> np.ndarray:
    """``need`` distinct ids from ``sample`` outside ``excluded`` (a bool mask, updated)."""
    got: list[np.ndarray] = []
    left = need
    while left:
        cand = sample(2 * left + 16)
        cand = cand[~excluded[cand]]
        _, first = np.unique(cand, return_index=True)
        cand = cand[np.sort(first)][:left]
        excluded[cand] = True
        got.append(cand)
        left -= cand.size
    return np.concatenate(got) if got else np.empty(0, dtype=np.int64)


def synthetic_trace(*, p: float, draw: str = "uniform", num_entries: int = FLASH_1M_ENTRIES,
                    top_k: int = FLASH_TOP_K, steps: int, warmup_steps: int, zipf_s: float = 1.0,
                    seed: int = 0) -> Trace:
    """One CSA layer's top-k over ``warmup_steps + steps`` steps with locality ``p``:
    step t keeps ``round(p * top_k)`` ids of step t-1 and draws the rest outside step
    t-1's set, so consecutive steps share exactly that many ids."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p: expected a fraction in [0, 1], got {p}")
    if not 0 < top_k <= num_entries // 2:
        raise ValueError(f"top_k: expected 0 < top_k <= num_entries / 2 = {num_entries // 2}, got {top_k}")
    rng = np.random.default_rng(seed)
    sample = _sampler(rng, num_entries, draw, zipf_s)
    keep = round(p * top_k)
    calls: list[Call] = []
    prev = _draw_distinct(sample, top_k, np.zeros(num_entries, dtype=bool))
    for t in range(warmup_steps + steps):
        if t:
            kept = rng.choice(prev, size=keep, replace=False)
            excluded = np.zeros(num_entries, dtype=bool)
            excluded[prev] = True
            prev = np.concatenate([kept, _draw_distinct(sample, top_k - keep, excluded)])
        step = t - warmup_steps
        calls.append(Call(step if step >= 0 else WARMUP, 0, torch.from_numpy(np.sort(prev)).to(torch.int64)))
    label = "uniform" if draw == "uniform" else f"zipf s={zipf_s:g}"
    return Trace(name=f"synthetic p={p:g} {label}", kind="synthetic", top_k=top_k, num_entries=num_entries,
                 num_csa_layers=1, calls=calls,
                 params={"p": p, "draw": draw, "zipf_s": zipf_s if draw == "zipf" else None,
                         "kept_per_step": keep, "warmup_steps": warmup_steps, "steps": steps, "seed": seed})


def fill_warmup_steps(p: float, top_k: int, max_multiple: int, extra: int = 16) -> int:
    """Steps for a buffer of ``max_multiple`` x top-k to fill with ``(1-p) k`` new ids a step."""
    fresh = top_k - round(p * top_k)
    return extra + (math.ceil(max_multiple * top_k / fresh) if fresh else 1)


# ------------------------------------------------------------------------ replay
@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayRow:
    """One trace replayed at one buffer size; counts over the measured steps."""

    trace: str
    kind: str
    top_k: int
    multiple: int
    buffer_entries: int
    steps: int
    csa_layers: int
    ids: int  # ids requested (sum over steps and layers)
    hits: int
    misses: int
    #: Bytes the replay buffer copied (``misses * replay_entry_bytes``, from HiSparseBuffers).
    bytes_moved: int
    replay_entry_bytes: int
    #: Max over steps of the misses of one step, summed over layers.
    misses_per_step_max: int
    swap_in_us_median: float
    #: True when this is the model run's own N and the replay matched its cache stats.
    matches_cache: bool | None

    @property
    def hit_rate(self) -> float:
        return self.hits / self.ids if self.ids else 0.0

    @property
    def ids_per_step_layer(self) -> float:
        return self.ids / (self.steps * self.csa_layers)

    @property
    def misses_per_step_layer(self) -> float:
        return self.misses / (self.steps * self.csa_layers)

    @property
    def flash_bytes_per_step(self) -> float:
        """Flash fp8 bytes moved per decode step per CSA layer with HiSparse."""
        return self.misses_per_step_layer * FLASH_ENTRY_BYTES

    @property
    def baseline_flash_bytes_per_step(self) -> float:
        """Flash fp8 bytes per step per CSA layer without buffering: all k re-read."""
        return self.ids_per_step_layer * FLASH_ENTRY_BYTES

    @property
    def saved(self) -> float | None:
        """baseline / moved (None when nothing moved)."""
        return self.ids / self.misses if self.misses else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "hit_rate": self.hit_rate, "ids_per_step_layer": self.ids_per_step_layer,
            "misses_per_step_layer": self.misses_per_step_layer,
            "flash_bytes_per_step_layer": self.flash_bytes_per_step,
            "baseline_flash_bytes_per_step_layer": self.baseline_flash_bytes_per_step,
            "flash_bytes_per_step_21_layers": 21 * self.flash_bytes_per_step,
            "baseline_over_moved": self.saved,
        }


def replay_layout(trace: Trace) -> KVLayout:
    """A layout with the trace's CSA layers and top-k and tiny 8-byte entries."""
    return KVLayout(name="hisparse-replay", layer_kinds=(LayerKind.CSA,) * trace.num_csa_layers,
                    entry_format=EntryFormat.FP32, head_dim=2, indexer_dim=2, indexer_bytes=8,
                    top_k=trace.top_k)


def replay_mirror(layout: KVLayout, num_entries: int) -> torch.Tensor:
    """Host mirror ``[num_blocks, num_csa_layers * E, 8]`` uint8 like ``HostTier.csa_rows()``
    (host block = context block); entry j of CSA layer c holds the int64 ``c * num_entries + j``."""
    E, C = layout.csa_entries_per_block, layout.num_csa_layers
    nb = -(-num_entries // E)
    c = torch.arange(C).view(1, C, 1)
    j = torch.arange(nb).view(nb, 1, 1) * E + torch.arange(E).view(1, 1, E)
    return (c * num_entries + j).reshape(nb, C * E, 1).contiguous().view(torch.uint8)


def replay(trace: Trace, multiples: tuple[int, ...] = MULTIPLES) -> list[ReplayRow]:
    """Replay ``trace`` through ``HiSparseBuffers`` (CPU) once per buffer size."""
    layout = replay_layout(trace)
    E, C = layout.csa_entries_per_block, layout.num_csa_layers
    host = replay_mirror(layout, trace.num_entries)
    rows: list[ReplayRow] = []
    for mult in multiples:
        n = mult * trace.top_k
        buf = HiSparseBuffers(layout, HiSparseConfig(device_buffer_entries=n), 1, torch.device("cpu"))
        ids_total = hits = misses = moved = 0
        step_misses: dict[int, int] = {}
        times: list[float] = []
        for call in trace.calls:
            ids = call.ids
            host_rows = (ids // E) * (C * E) + call.part * E + ids % E
            h0, m0, b0 = buf.hits, buf.misses, buf.bytes_moved
            t0 = time.perf_counter()
            if ids.numel() <= n:
                got = buf.read(0, call.part, buf.swap_in(0, call.part, ids, host_rows, host))
            else:  # like TieredKVCache: a selection larger than the buffer bypasses it
                got = buf.read_direct(host_rows, host)
            dt = time.perf_counter() - t0
            want = call.part * trace.num_entries + ids
            if not torch.equal(got.contiguous().view(torch.int64).flatten(), want):
                raise AssertionError(f"{trace.name}, N={n}: the buffer returned the wrong entries")
            if call.step == WARMUP:
                continue
            times.append(dt)
            ids_total += ids.numel()
            hits += buf.hits - h0
            misses += buf.misses - m0
            moved += buf.bytes_moved - b0
            step_misses[call.step] = step_misses.get(call.step, 0) + buf.misses - m0
        if moved != misses * layout.entry_bytes:
            raise AssertionError(f"{trace.name}, N={n}: bytes moved {moved} != misses * entry_bytes")
        matches = None
        if trace.check is not None and trace.check.buffer_entries == n:
            if (hits, misses) != (trace.check.hits, trace.check.misses):
                raise AssertionError(
                    f"{trace.name}, N={n}: replay hits/misses {hits}/{misses} differ from the cache's "
                    f"{trace.check.hits}/{trace.check.misses}")
            matches = True
        rows.append(ReplayRow(
            trace=trace.name, kind=trace.kind, top_k=trace.top_k, multiple=mult, buffer_entries=n,
            steps=trace.steps, csa_layers=C, ids=ids_total, hits=hits, misses=misses, bytes_moved=moved,
            replay_entry_bytes=layout.entry_bytes, misses_per_step_max=max(step_misses.values(), default=0),
            swap_in_us_median=statistics.median(times) * 1e6 if times else 0.0, matches_cache=matches))
    return rows


# --------------------------------------------------------------------- reporting
def format_table(rows: list[ReplayRow]) -> str:
    header = (f"{'trace':<44} {'N':>9} {'hit rate':>8} {'miss/step':>9} {'moved B/step':>12} "
              f"{'baseline B/step':>15} {'saved':>7} {'swap-in us':>10}")
    lines = [header, "-" * len(header)]
    for r in rows:
        saved = f"{r.saved:.2f}x" if r.saved is not None else "inf"
        check = " (= cache)" if r.matches_cache else ""
        lines.append(
            f"{r.trace:<44} {f'{r.multiple}x {r.buffer_entries}':>9} {r.hit_rate:>8.3f} "
            f"{r.misses_per_step_layer:>9.1f} {r.flash_bytes_per_step:>12,.0f} "
            f"{r.baseline_flash_bytes_per_step:>15,.0f} {saved:>7} {r.swap_in_us_median:>10.0f}{check}")
    return "\n".join(lines)


def plot(rows: list[ReplayRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces: dict[str, list[ReplayRow]] = {}
    for r in rows:
        traces.setdefault(r.trace, []).append(r)
    colors = plt.get_cmap("tab10")
    fig, (ax_hit, ax_bytes) = plt.subplots(1, 2, figsize=(12, 5.6))
    for i, (name, rs) in enumerate(traces.items()):
        style = dict(color=colors(i % 10), marker="o" if rs[0].kind == "model" else "s",
                     linestyle="-" if rs[0].kind == "model" else "--")
        ax_hit.plot([r.multiple for r in rs], [r.hit_rate for r in rs], label=name, **style)
        if rs[0].kind == "synthetic":
            ax_bytes.plot([r.multiple for r in rs], [r.flash_bytes_per_step / 1024 for r in rs], **style)
    synth = [r for r in rows if r.kind == "synthetic"]
    if synth:
        ax_bytes.axhline(synth[0].baseline_flash_bytes_per_step / 1024, color="k", linestyle=":",
                         label=f"no buffering: top-{synth[0].top_k} re-read (k x {FLASH_ENTRY_BYTES} B)")
        ax_bytes.legend(fontsize=8, loc="center right")
    for ax in (ax_hit, ax_bytes):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(MULTIPLES), [f"{m}x" for m in MULTIPLES])
        ax.set_xlabel("device buffer N (multiple of top-k)")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_hit.set_ylim(0, 1)
    ax_hit.set_ylabel("hit rate (measured decode steps)")
    ax_hit.set_title("HiSparse LRU hit rate (model: tiny reference model)")
    ax_bytes.set_ylabel("KiB moved per decode step per CSA layer (Flash fp8)")
    ax_bytes.set_title("synthetic 1M-token Flash traces (262,144 entries, top-512)")
    fig.legend(*ax_hit.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------- main
def build_traces(quick: bool, seed: int) -> list[Trace]:
    if quick:
        model_runs: list[dict[str, Any]] = [dict(top_k=16, prefill=1024, decode=48, warmup_steps=16)]
        synth_steps = 40
    else:
        model_runs = [dict(top_k=16, prefill=4096, decode=256, warmup_steps=32),
                      dict(top_k=64, prefill=4096, decode=256, warmup_steps=32),
                      dict(top_k=64, prefill=4096, decode=256, warmup_steps=32, phrase=16)]
        synth_steps = 400
    traces = [record_model_trace(seed=seed, **run) for run in model_runs]
    for draw in ("uniform", "zipf"):
        for p in (0.5, 0.8, 0.95):
            warm = 16 if quick else fill_warmup_steps(p, FLASH_TOP_K, max(MULTIPLES))
            traces.append(synthetic_trace(p=p, draw=draw, steps=synth_steps, warmup_steps=warm, seed=seed))
    return traces


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short traces (well under a minute)")
    parser.add_argument("--seed", type=int, default=0, help="model weights, tokens and synthetic draws")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for hisparse.json / hisparse.png")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 0 = torch's default (1 keeps timings steady on a shared machine)")
    args = parser.parse_args(argv)
    if args.threads < 0:
        parser.error("--threads: expected 0 (torch's default) or a positive int")
    if args.threads:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    traces = build_traces(args.quick, args.seed)
    t_traces = time.perf_counter() - t0
    rows = [row for trace in traces for row in replay(trace)]
    elapsed = time.perf_counter() - t0

    print(f"HiSparse replay through HiSparseBuffers (CPU), N = {', '.join(f'{m}x' for m in MULTIPLES)} top-k; "
          f"bytes per decode step per CSA layer in Flash fp8 ({FLASH_ENTRY_BYTES} B/entry); "
          f"baseline = k x {FLASH_ENTRY_BYTES} B (no buffering); saved = baseline / moved; "
          f"swap-in us = median per call; torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(format_table(rows))
    print(f"(traces {t_traces:.1f} s, total {elapsed:.1f} s; '(= cache)': replay equals the model run's "
          f"hisparse_hits/misses at its own N)")

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "benchmark": "hisparse",
        "quick": args.quick,
        "seed": args.seed,
        "multiples_of_top_k": list(MULTIPLES),
        "flash_entry_bytes": FLASH_ENTRY_BYTES,
        "bytes_unit": "Flash fp8 bytes per decode step per CSA layer (misses x 584); x21 for all Flash CSA layers",
        "baseline": "no HiSparse buffering: every selected entry re-read from host each step (k x 584 B)",
        "timing": "swap_in_us_median: median CPU seconds per HiSparseBuffers.swap_in call over measured calls",
        "traces": [{"name": t.name, "kind": t.kind, "top_k": t.top_k, "num_entries": t.num_entries,
                    "num_csa_layers": t.num_csa_layers, "measured_steps": t.steps,
                    "calls": len(t.calls), **t.params} for t in traces],
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "elapsed_s": elapsed,
        "rows": [r.to_dict() for r in rows],
    }
    (args.out / "hisparse.json").write_text(json.dumps(meta, indent=2) + "\n")
    plot(rows, args.out / "hisparse.png")
    print(f"wrote {args.out / 'hisparse.json'} and {args.out / 'hisparse.png'}")


if __name__ == "__main__":
    main()
