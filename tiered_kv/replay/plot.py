"""PNG pictures of replays (matplotlib, the ``bench`` extra): one report, a capacity sweep
(Mooncake's Fig. 9 with GB axes for V4-Flash, V4-Pro and a dense model), a fleet.

Each takes the result object or its ``to_dict()`` (so a saved JSON can be drawn again).
"""

from __future__ import annotations

import os
from typing import Any

from .sweep import DENSE_BYTES_PER_TOKEN, SweepResult
from .tally import REASONS

__all__ = ["PAPER_RANGE_AT_3M", "plot_fleet", "plot_report", "plot_sweep"]

_TIER_COLORS = {"gpu": "#2b8cbe", "host": "#7bccc4", "disk": "#fdae61", "shared": "#d7191c"}
_VARIANT_COLORS = {"hbm": "#2b8cbe", "hbm+host": "#41ab5d", "hbm+host+disk": "#fd8d3c",
                   "hbm+host+disk+shared": "#d7191c"}
#: Mooncake FAST'25 Fig. 9: a local cache of 3M tokens reaches 41-75 % of the maximum hit
#: rate. The paper publishes the range over its three workloads (conversation, tool and
#: agent, synthetic), not which workload is where in it: a replay is compared with the range.
PAPER_RANGE_AT_3M = (0.41, 0.75)
_GIB = 2**30


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--png: matplotlib is needed to draw (pip install 'tiered-kv[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _as_dict(obj: Any) -> dict[str, Any]:
    return obj if isinstance(obj, dict) else obj.to_dict()


def plot_report(report: Any, path: str | os.PathLike[str]) -> None:
    """Hit rate by tier beside every-boundary and the maximum; misses by reason; bytes
    resident per tier, blocks and snapshots apart."""
    plt = _pyplot()
    d = _as_dict(report)
    t = d["total"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    ax = axes[0]
    bottom = 0.0
    for tier in ("gpu", "host", "disk", "shared"):
        v = 100 * t["hit_rate_by_tier"][tier]
        if v:
            ax.bar(0, v, bottom=bottom, color=_TIER_COLORS[tier], label=f"{tier} {v:.1f} %")
            bottom += v
    every = 100 * t["every_boundary_hit_rate"]
    mx = 100 * (d["fleet_max_hit_rate"] if d.get("fleet_max_hit_rate") is not None else t["max_hit_rate"])
    ax.bar(1, every, color="#999999")
    ax.bar(2, mx, color="#444444")
    for x, v in ((0, bottom), (1, every), (2, mx)):
        ax.text(x, v, f"{v:.2f} %", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0, 1, 2], ["achieved\n(by tier)", "every boundary\nresumable", "trace max\n(unbounded)"])
    ax.set_ylabel("token hit rate (%)")
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title(f"{d['trace']}: {d['model']}, {d['tiers']}", fontsize=10)
    ax = axes[1]
    reasons = [r for r in REASONS if t["miss_tokens"][r]]
    vals = [100 * t["miss_rate_by_reason"][r] for r in reasons]
    ax.barh(range(len(reasons)), vals, color="#636363")
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.2f} %", va="center", fontsize=8)
    ax.set_yticks(range(len(reasons)), [r.replace("_", " ") for r in reasons])
    ax.invert_yaxis()
    ax.set_xlim(0, max(vals + [1]) * 1.25)
    ax.set_xlabel("share of prompt tokens computed (%)")
    ax.set_title("why each miss missed", fontsize=10)
    ax = axes[2]
    res = d["resident_bytes"]
    names = list(res)
    xs = range(len(names))
    blocks = [res[n].get("blocks", 0) / _GIB for n in names]
    snaps = [res[n].get("snapshots", 0) / _GIB for n in names]
    ax.bar([x - 0.2 for x in xs], blocks, width=0.4, color="#2b8cbe", label="blocks")
    ax.bar([x + 0.2 for x in xs], snaps, width=0.4, color="#fdae61", label="snapshots")
    for x, b, s in zip(xs, blocks, snaps):
        ax.text(x - 0.2, b, f"{b:.0f}", ha="center", va="bottom", fontsize=7)
        ax.text(x + 0.2, s, f"{s:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel(f"GiB of {d['model']} resident at the end")
    ax.legend(fontsize=8)
    ax.set_title("bytes resident", fontsize=10)
    _save(fig, path)


def plot_sweep(result: SweepResult | dict[str, Any], path: str | os.PathLike[str], *,
               paper_range: tuple[float, float] | None = None) -> None:
    """Hit rate against capacity (log tokens), per variant, the every-boundary curves
    dashed, the trace maximum dotted; GB axes for V4-Flash, V4-Pro and a dense model.
    ``paper_range``: fractions of the maximum (low, high) drawn as a bar at 3M tokens
    (:data:`PAPER_RANGE_AT_3M`, Mooncake's Fig. 9)."""
    plt = _pyplot()
    d = _as_dict(result)
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(13, 6.4))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for v in variants:
        pts = sorted((r["capacity_tokens"], r) for r in rows if r["variant"] == v)
        xs = [x for x, _ in pts]
        c = _VARIANT_COLORS.get(v)
        ax.plot(xs, [100 * r["hit_rate"] for _, r in pts], "o-", color=c, label=f"{v}: achieved (snapshot policy)")
        ax.plot(xs, [100 * r["every_boundary_hit_rate"] for _, r in pts], "--", color=c, alpha=0.7,
                label=f"{v}: every boundary resumable")
        sim = [(x, r["lru_simulation_hit_rate"]) for x, r in pts if "lru_simulation_hit_rate" in r]
        if sim:
            ax.plot([x for x, _ in sim], [100 * s for _, s in sim], "x", color="black",
                    label="plain LRU prefix simulation (paper's method)")
    if rows:
        mx = 100 * rows[0]["max_hit_rate"]
        ax.axhline(mx, color="black", linestyle=":", label=f"trace maximum {mx:.1f} %")
        if paper_range is not None:
            lo, hi = paper_range
            ax.errorbar([3e6], [mx * (lo + hi) / 2], yerr=[[mx * (hi - lo) / 2]], fmt="none", ecolor="#7a0177",
                        elinewidth=2.5, capsize=6,
                        label=f"Mooncake Fig. 9 at 3M: {100 * lo:.0f}-{100 * hi:.0f} % of max (its 3 workloads)")
    ax.axvline(3e6, color="grey", linewidth=0.8)
    ax.text(3e6, 1, " 3M tokens", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens of 512-token Classical blocks)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"{d['trace']}: hit rate vs {d['tier']} capacity (LRU, request sequence only)", fontsize=10,
                 pad=72)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, which="both", alpha=0.2)
    if rows:
        gb = rows[0]["capacity_gb"]
        tokens = rows[0]["capacity_tokens"]
        per_token = {name: g / tokens for name, g in gb.items()}
        per_token["dense-320KB"] = DENSE_BYTES_PER_TOKEN / 1e9
        for k, (name, g) in enumerate(per_token.items()):
            sec = ax.secondary_xaxis(1.0 + 0.085 * k, functions=(lambda x, g=g: x * g, lambda y, g=g: y / g))
            sec.set_xlabel(f"GB, {name}" + (" (incl. snapshot share)" if name.startswith("deepseek") else ""),
                           fontsize=7, labelpad=0)
            sec.tick_params(labelsize=7)
    _save(fig, path)


def plot_fleet(reports: list[Any], path: str | os.PathLike[str]) -> None:
    """Per fleet replay (routing x shared level): the hit rate stacked by tier, beside the
    fleet's maximum (dotted); the per-node hit rates as dots."""
    plt = _pyplot()
    ds = [_as_dict(r) for r in reports]
    fig, ax = plt.subplots(figsize=(2.2 + 1.7 * len(ds), 4.8))
    seen: set[str] = set()
    for i, d in enumerate(ds):
        t = d["total"]
        bottom = 0.0
        for tier in ("gpu", "host", "disk", "shared"):
            v = 100 * t["hit_rate_by_tier"][tier]
            if v:
                ax.bar(i, v, bottom=bottom, color=_TIER_COLORS[tier], label=None if tier in seen else tier)
                seen.add(tier)
                bottom += v
        ax.text(i, bottom, f"{bottom:.1f} %", ha="center", va="bottom", fontsize=8)
        nodes = d.get("nodes") or []
        rates = [100 * n["hit_rate"] for n in nodes]
        ax.plot([i + 0.3] * len(rates), rates, "k.", markersize=4)
        if d.get("fleet_max_hit_rate"):
            ax.plot([i - 0.4, i + 0.4], [100 * d["fleet_max_hit_rate"]] * 2, "k:")
    ax.set_xticks(range(len(ds)), [f"{d['route']}\n{'+ shared level' if d['capacity']['shared'] else 'local only'}"
                                   for d in ds], fontsize=8)
    ax.set_ylabel("token hit rate (%)")
    ax.legend(fontsize=8, loc="upper left")
    n = d["nodes_count"] if ds and "nodes_count" in ds[0] else len(ds[0].get("nodes") or []) if ds else 0
    ax.set_title(f"{ds[0]['trace'] if ds else ''}: {n} nodes, {ds[0]['model'] if ds else ''} "
                 f"(dots: nodes; dotted: fleet max)", fontsize=9)
    _save(fig, path)
