"""PNG pictures of replays (matplotlib, the ``bench`` extra): one report, a capacity sweep
(Mooncake's Fig. 9 with GB axes for V4-Flash, V4-Pro and a dense model), a fleet."""

from __future__ import annotations

import os
from typing import Any

from .sweep import DENSE_BYTES_PER_TOKEN, SweepResult
from .tally import REASONS

__all__ = ["plot_fleet", "plot_report", "plot_sweep"]

_TIER_COLORS = {"gpu": "#2b8cbe", "host": "#7bccc4", "disk": "#fdae61", "shared": "#d7191c"}
_VARIANT_COLORS = {"hbm": "#2b8cbe", "hbm+host": "#41ab5d", "hbm+host+disk": "#fd8d3c",
                   "hbm+host+disk+shared": "#d7191c"}
#: Mooncake FAST'25 Fig. 9: a 3M-token cache's hit rate as a fraction of the maximum
PAPER_FRACTION_AT_3M = {"conversation": 0.41, "tool&agent": 0.75, "synthetic": 0.46}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--png: matplotlib is needed to draw (pip install 'tiered-kv[bench]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | os.PathLike[str]) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)


def plot_report(report: Any, path: str | os.PathLike[str]) -> None:
    """Hit rate by tier beside every-boundary and the maximum; misses by reason; bytes
    resident per tier (blocks and snapshots)."""
    plt = _pyplot()
    t = report.total
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    ax = axes[0]
    bottom = 0.0
    for tier in ("gpu", "host", "disk", "shared"):
        v = 100 * t.rate(t.hit_tokens[tier])
        if v:
            ax.bar(0, v, bottom=bottom, color=_TIER_COLORS[tier], label=tier)
            bottom += v
    ax.bar(1, 100 * t.rate(t.resident_tokens), color="#999999")
    mx = t.max_tokens if report.fleet_max_tokens is None else report.fleet_max_tokens
    ax.bar(2, 100 * t.rate(mx), color="#444444")
    ax.set_xticks([0, 1, 2], ["achieved\n(by tier)", "every boundary\nresumable", "trace max\n(unbounded)"])
    ax.set_ylabel("token hit rate (%)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"{report.trace}: {report.config.tiers_label}")
    ax = axes[1]
    reasons = [r for r in REASONS if t.miss_tokens[r]]
    ax.barh(range(len(reasons)), [100 * t.rate(t.miss_tokens[r]) for r in reasons], color="#636363")
    ax.set_yticks(range(len(reasons)), [r.replace("_", " ") for r in reasons])
    ax.invert_yaxis()
    ax.set_xlabel("share of prompt tokens computed (%)")
    ax.set_title("why each miss missed")
    ax = axes[2]
    res = report.resident()
    names = list(res)
    gib = 2**30
    ax.bar(range(len(names)), [res[n].get("blocks", 0) / gib for n in names], color="#2b8cbe", label="blocks")
    ax.bar(range(len(names)), [res[n].get("snapshots", 0) / gib for n in names],
           bottom=[res[n].get("blocks", 0) / gib for n in names], color="#fdae61", label="snapshots")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(f"resident at the end (GiB of {report.config.model})")
    ax.set_yscale("symlog")
    ax.legend(fontsize=8)
    ax.set_title("bytes resident")
    _save(fig, path)


def plot_sweep(result: SweepResult, path: str | os.PathLike[str], *, paper: dict[str, float] | None = None) -> None:
    """Hit rate against capacity (log tokens), per variant, the every-boundary curves
    dashed, the trace maximum dotted; GB axes for V4-Flash, V4-Pro and a dense model."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 6.2))
    for v in result.variants():
        pts = sorted((result.capacity_tokens(p.capacity), p.total) for p in result.points if p.variant == v)
        xs = [x for x, _ in pts]
        c = _VARIANT_COLORS.get(v, None)
        ax.plot(xs, [100 * t["hit_rate"] for _, t in pts], "o-", color=c, label=f"{v}: achieved")
        ax.plot(xs, [100 * t["every_boundary_hit_rate"] for _, t in pts], "--", color=c, alpha=0.7,
                label=f"{v}: every boundary resumable")
    if result.points:
        mx = 100 * result.points[0].total["max_hit_rate"]
        ax.axhline(mx, color="black", linestyle=":", label=f"trace maximum {mx:.1f} %")
    ax.axvline(3e6, color="grey", linewidth=0.8)
    ax.text(3e6, ax.get_ylim()[1] * 0.02, " 3M tokens", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens of Classical blocks)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"{result.trace}: hit rate vs {result.tier} capacity (LRU, request sequence only)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.2)
    per_token = {name: result.capacity_gb(1_000_000)[name] / 1e6 for name in ("deepseek-v4-flash", "deepseek-v4-pro")}
    per_token["dense-320KB"] = DENSE_BYTES_PER_TOKEN / 1e9
    for k, (name, gb) in enumerate(per_token.items()):
        sec = ax.secondary_xaxis(1.0 + 0.1 * k, functions=(lambda x, g=gb: x * g, lambda y, g=gb: y / g))
        sec.set_xlabel(f"GB, {name}", fontsize=8, labelpad=1)
        sec.tick_params(labelsize=7)
    if paper:
        ax.text(0.99, 0.02, "Mooncake Fig. 9, fraction of max at 3M: "
                + ", ".join(f"{k} {100 * v:.0f} %" for k, v in paper.items()),
                transform=ax.transAxes, ha="right", fontsize=7, color="grey")
    _save(fig, path)


def plot_fleet(reports: list[Any], path: str | os.PathLike[str]) -> None:
    """Per fleet replay (routing x shared level): the hit rate stacked by tier, beside the
    fleet's maximum; the per-node hit rates as dots."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(reports), 4.8))
    for i, r in enumerate(reports):
        t = r.total
        bottom = 0.0
        for tier in ("gpu", "host", "disk", "shared"):
            v = 100 * t.rate(t.hit_tokens[tier])
            if v:
                ax.bar(i, v, bottom=bottom, color=_TIER_COLORS[tier], label=tier if i == 0 or tier == "shared" else None)
                bottom += v
        rates = [100 * n.tally.rate(n.tally.hits) for n in r.nodes]
        ax.plot([i + 0.3] * len(rates), rates, "k.", markersize=4)
        if r.fleet_max_tokens:
            ax.plot([i - 0.4, i + 0.4], [100 * r.fleet_max_tokens / r.prompt_tokens] * 2, "k:")
    ax.set_xticks(range(len(reports)), [f"{r.route}\n{'shared' if r.config.shared_url else 'local only'}"
                                        for r in reports])
    ax.set_ylabel("token hit rate (%)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="upper left")
    n = len(reports[0].nodes) if reports else 0
    ax.set_title(f"{reports[0].trace if reports else ''}: {n} nodes, {reports[0].config.tiers_label if reports else ''}"
                 " (dots: nodes; dotted: fleet max)", fontsize=9)
    _save(fig, path)
