"""Capacity sweeps: one tier's capacity varied, the same trace replayed at each point, with
the tiers behind it switched on one by one (HBM only, + host, + disk, + shared).

With token capacities over the HBM tier this is Mooncake's Fig. 9 (hit rate against
cache capacity in tokens, LRU, the request sequence only): the HBM-only curve is what an
engine's own prefix cache gives; its every-boundary curve is the paper's setting (a dense
model resumes at any block). Each point's capacity is also given in GB for V4-Flash, V4-Pro
and a dense model of 320 KB per token (LLaMA3-70B, the paper's), which is what V4's
layout buys: the same DRAM holds ~80x more tokens.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import Capacity, ReplayConfig, model_layout
from .run import replay
from .trace import Trace

__all__ = ["DENSE_BYTES_PER_TOKEN", "SWEEP_TIERS", "SweepPoint", "SweepResult", "sweep", "variants_of"]

#: tiers whose capacity can be swept
SWEEP_TIERS = ("hbm", "host", "disk")
#: LLaMA3-70B: 80 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes
DENSE_BYTES_PER_TOKEN = 327_680
_ORDER = ("hbm", "host", "disk", "shared")


@dataclass
class SweepPoint:
    """One replay of a sweep."""

    capacity: Capacity
    variant: str
    #: the replay's totals (:meth:`Tally.to_dict`) and wall time
    total: dict[str, Any]
    wall_s: float
    prompt_tokens: int


@dataclass
class SweepResult:
    trace: str
    tier: str
    model: str
    block_tokens: int
    snapshot_fraction: float
    points: list[SweepPoint] = field(default_factory=list)

    def capacity_tokens(self, cap: Capacity) -> int:
        """A point's capacity in tokens of Classical blocks."""
        if cap.tokens is not None:
            return cap.tokens
        m = model_layout(self.model, self.block_tokens)
        assert cap.model_bytes is not None
        return int(cap.model_bytes * (1 - self.snapshot_fraction) // m.block_bytes * self.block_tokens)

    def capacity_gb(self, tokens: int) -> dict[str, float]:
        """``tokens`` of cache in GB (1e9 bytes) for V4-Flash, V4-Pro (their snapshot share
        included) and the dense 320 KB/token model."""
        out = {}
        for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
            out[name] = Capacity.of_tokens(tokens).resolve(model_layout(name, self.block_tokens),
                                                            self.snapshot_fraction) / 1e9
        out["dense-320KB"] = tokens * DENSE_BYTES_PER_TOKEN / 1e9
        return out

    def variants(self) -> list[str]:
        return list(dict.fromkeys(p.variant for p in self.points))

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for p in self.points:
            tokens = self.capacity_tokens(p.capacity)
            t = p.total
            rows.append({"capacity": p.capacity.describe(), "capacity_tokens": tokens,
                         "capacity_gb": self.capacity_gb(tokens), "variant": p.variant,
                         "hit_rate": t["hit_rate"], "every_boundary_hit_rate": t["every_boundary_hit_rate"],
                         "max_hit_rate": t["max_hit_rate"], "hit_rate_by_tier": t["hit_rate_by_tier"],
                         "miss_rate_by_reason": t["miss_rate_by_reason"], "wall_s": p.wall_s})
        return {"trace": self.trace, "tier": self.tier, "model": self.model, "block_tokens": self.block_tokens,
                "snapshot_fraction": self.snapshot_fraction, "rows": rows}

    def text(self) -> str:
        lines = [f"sweep of {self.tier} capacity on {self.trace} ({self.model}, snapshot share "
                 f"{self.snapshot_fraction:g}); hit rate (every-boundary) [fraction of the maximum]",
                 f"{'capacity':>16} {'tokens':>12} {'Flash GB':>9} {'Pro GB':>8} {'dense GB':>9}  "
                 + "  ".join(f"{v:>26}" for v in self.variants())]
        by_cap: dict[str, dict[str, SweepPoint]] = {}
        for p in self.points:
            by_cap.setdefault(p.capacity.describe(), {})[p.variant] = p
        for cap, row in by_cap.items():
            first = next(iter(row.values()))
            tokens = self.capacity_tokens(first.capacity)
            gb = self.capacity_gb(tokens)
            cells = []
            for v in self.variants():
                p = row.get(v)
                if p is None:
                    cells.append(f"{'-':>26}")
                    continue
                t = p.total
                frac = t["hit_rate"] / t["max_hit_rate"] if t["max_hit_rate"] else 0.0
                cells.append(f"{100 * t['hit_rate']:6.2f}% ({100 * t['every_boundary_hit_rate']:5.2f}%) "
                             f"[{100 * frac:5.1f}%]")
            lines.append(f"{cap:>16} {tokens:>12,} {gb['deepseek-v4-flash']:>9.1f} {gb['deepseek-v4-pro']:>8.1f} "
                         f"{gb['dense-320KB']:>9.1f}  " + "  ".join(cells))
        if self.points:
            lines.append(f"trace maximum (unbounded cache): {100 * self.points[0].total['max_hit_rate']:.2f} %")
        return "\n".join(lines)


def variants_of(config: ReplayConfig) -> list[str]:
    """The variants a sweep of ``config`` compares: HBM only, then each further tier it has."""
    out = ["hbm"]
    on = ["hbm"]
    for name, value in (("host", config.host), ("disk", config.disk), ("shared", config.shared_url)):
        if value is not None:
            on.append(name)
            out.append("+".join(on))
    return out


def _variant_config(base: ReplayConfig, variant: str, tier: str, cap: Capacity) -> ReplayConfig:
    tiers = set(variant.split("+"))
    unknown = tiers - set(_ORDER)
    if unknown or "hbm" not in tiers:
        raise ValueError(f"variant {variant!r}: expected hbm[+host][+disk][+shared]")
    changes: dict[str, Any] = {tier: cap}
    for name in ("host", "disk"):
        if name not in tiers:
            changes[name] = None
            if name == "disk":
                changes["disk_url"] = None
        elif name != tier and getattr(base, name) is None:
            raise ValueError(f"variant {variant!r}: give the {name} tier's capacity")
    if "shared" not in tiers:
        changes["shared_url"] = None
    elif base.shared_url is None:
        raise ValueError(f"variant {variant!r}: give the shared level's URL")
    return dataclasses.replace(base, **changes)


def sweep(trace: Trace, base: ReplayConfig, *, tier: str, capacities: Sequence[Capacity],
          variants: Sequence[str] | None = None, limit: int | None = None,
          progress: Callable[[str], None] | None = None) -> SweepResult:
    """Replay ``trace`` at each capacity of ``tier`` for each variant (default: HBM only,
    then each further tier ``base`` has: :func:`variants_of`). ``progress(line)`` is told
    each point as it finishes."""
    if tier not in SWEEP_TIERS:
        raise ValueError(f"tier: expected one of {', '.join(SWEEP_TIERS)}, got {tier!r}")
    if not capacities:
        raise ValueError("capacities: expected at least one")
    chosen = list(variants) if variants is not None else variants_of(base)
    chosen = [v for v in chosen if tier in v.split("+")]  # a tier a variant lacks has no capacity to sweep
    if not chosen:
        raise ValueError(f"variants: none of them has the {tier} tier")
    trace = trace.head(limit)
    out = SweepResult(trace=trace.name, tier=tier, model=base.model, block_tokens=trace.block_tokens,
                      snapshot_fraction=base.snapshot_fraction)
    for cap in capacities:
        for v in chosen:
            cfg = _variant_config(base, v, tier, cap)
            t0 = time.perf_counter()
            report = replay(trace, cfg)
            point = SweepPoint(capacity=cap, variant=v, total=report.total.to_dict(),
                               wall_s=time.perf_counter() - t0, prompt_tokens=report.prompt_tokens)
            out.points.append(point)
            if progress is not None:
                t = point.total
                progress(f"{tier} {cap.describe()} {v}: hit {100 * t['hit_rate']:.2f} % (every boundary "
                         f"{100 * t['every_boundary_hit_rate']:.2f} %, max {100 * t['max_hit_rate']:.2f} %) "
                         f"in {point.wall_s:.0f} s")
    return out
