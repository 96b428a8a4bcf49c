"""A replay's result: per-tier hit rates beside the trace maximum, miss reasons, bytes
resident and moved, the prefill cost model; as text, JSON and a PNG (:mod:`.plot`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..planner import format_bytes
from .config import ReplayConfig
from .node import NodeResult
from .tally import REASONS, Tally

__all__ = ["ReplayReport", "format_report"]

_REASON_TEXT = {
    "never_seen": "never seen (compulsory)",
    "evicted_gpu": "evicted from gpu",
    "evicted_host": "evicted from host",
    "evicted_disk": "evicted from disk",
    "evicted_shared": "evicted from shared",
    "no_snapshot": "no snapshot where the prefix diverged",
    "corrupt": "corrupt record (failed verification)",
    "unavailable": "shared level unavailable",
}


@dataclass
class ReplayReport:
    """One replay (one node, or a fleet: ``nodes`` and their total)."""

    trace: str
    num_requests: int
    prompt_tokens: int
    block_tokens: int
    config: ReplayConfig
    nodes: list[NodeResult]
    wall_s: float
    #: fleet only: routing policy and the fleet-wide maximum (one unbounded cache for all)
    route: str | None = None
    fleet_max_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> Tally:
        if len(self.nodes) == 1:
            return self.nodes[0].tally
        t = Tally()
        for n in self.nodes:
            t.add(n.tally)
        return t

    @property
    def hit_rate(self) -> float:
        return self.total.rate(self.total.hits)

    def resident(self) -> dict[str, dict[str, int]]:
        """Bytes resident per tier, summed over nodes (a shared level counted once)."""
        return self._summed("resident")

    def stranded(self) -> dict[str, dict[str, int]]:
        """Stranded bytes per tier, summed over nodes (a shared level counted once)."""
        return self._summed("stranded")

    def moved(self) -> dict[str, dict[str, int]]:
        """Bytes moved per path between tiers, summed over nodes."""
        return self._summed("moved")

    def store_bytes(self) -> dict[str, int] | None:
        """Model bytes written to and read from the nodes' store (the disk, or the shared
        level without one), blocks and snapshots together: ``{"written": .., "read": ..}``;
        None without a store."""
        moved = self.moved()
        written = [sum(v.values()) for k, v in moved.items() if k in ("gpu->disk", "gpu->shared")]
        read = [sum(v.values()) for k, v in moved.items() if k in ("disk->memory", "shared->memory")]
        if not written and not read:
            return None
        return {"written": sum(written), "read": sum(read)}

    def admission(self) -> dict[str, int] | None:
        """The disk admission filter's counters, summed over nodes (None without a store):
        ``rejected`` (records held back at seal / publish), ``admitted`` (written later: on
        a memory-tier hit, published a second time, or having survived), ``expired``
        (``survived:N``: due when no memory tier held them any more, never written); see
        :mod:`tiered_kv.policy.admission`."""
        if not any("admission_rejects" in n.stats for n in self.nodes):
            return None
        names = {"rejected": "admission_rejects", "admitted": "admission_admitted", "expired": "admission_expired"}
        return {k: sum(int(n.stats.get(v, 0)) for n in self.nodes) for k, v in names.items()}

    def _summed(self, what: str) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for i, n in enumerate(self.nodes):
            for name, kinds in getattr(n, what).items():
                if name == "shared" and i > 0:  # one level for the fleet: node0 counted it
                    continue
                d = out.setdefault(name, {})
                for k, v in kinds.items():
                    d[k] = d.get(k, 0) + v
        return out

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        plan = self.nodes[0].plan
        return {
            "trace": self.trace, "requests": self.num_requests, "prompt_tokens": self.prompt_tokens,
            "block_tokens": self.block_tokens, "wall_s": self.wall_s,
            "requests_per_s": self.num_requests / self.wall_s if self.wall_s else None,
            "model": c.model, "tiers": c.tiers_label,
            "capacity": {"hbm": c.hbm.describe(), "host": c.host.describe() if c.host else None,
                         "disk": c.disk.describe() if c.disk else None, "shared": c.shared_url is not None},
            "snapshot_fraction": c.snapshot_fraction,
            "policies": {"snapshot": c.snapshot().label, "eviction": c.eviction().label,
                         "admission": c.admission().label},
            "standin": {"scale": plan.standin.scale, "exact": plan.standin.exact,
                        "block_bytes": plan.standin.layout.block_bytes,
                        "snapshot_bytes": plan.standin.layout.snapshot_bytes,
                        "model_block_bytes": plan.standin.model.block_bytes,
                        "model_snapshot_bytes": plan.standin.model.snapshot_bytes,
                        "snapshot_ratio_error": plan.standin.snapshot_ratio_error},
            "pools": {"gpu_blocks": plan.gpu_blocks, "gpu_snapshots": plan.gpu_snapshots,
                      "host_blocks": plan.host_blocks, "host_snapshots": plan.host_snapshots,
                      "disk_max_bytes": plan.disk_max_bytes, "model_bytes": plan.model_bytes},
            "cost_model": c.cost.to_dict(),
            "total": self.total.to_dict(),
            "resident_bytes": self.resident(),
            "moved_bytes": self.moved(),
            "stranded_bytes": self.stranded(),
            "store_write_errors": sum(int(n.stats.get("disk_write_errors", 0)) for n in self.nodes),
            "store_bytes": self.store_bytes(),
            "admission_counters": self.admission(),
            "route": self.route,
            "fleet_max_hit_rate": (self.fleet_max_tokens / self.prompt_tokens
                                   if self.fleet_max_tokens is not None and self.prompt_tokens else None),
            "nodes": [{"name": n.name, "wall_s": n.wall_s, **n.tally.to_dict(), "resident_bytes": n.resident,
                       "moved_bytes": n.moved, "stranded_bytes": n.stranded} for n in self.nodes]
            if len(self.nodes) > 1 else None,
            **self.extra,
        }

    def text(self) -> str:
        return format_report(self)


def _pct(x: float) -> str:
    return f"{100 * x:6.2f} %"


def format_report(r: ReplayReport) -> str:
    """The report as the text table ``tiered-kv replay`` prints."""
    c, t = r.config, r.total
    plan = r.nodes[0].plan
    lines = [f"tiered-kv replay: {r.trace}, {r.num_requests:,} requests, {r.prompt_tokens:,} prompt tokens, "
             f"{r.block_tokens}-token blocks",
             f"tiers {c.tiers_label}; snapshot policy {c.snapshot().label}; eviction {c.eviction().label}; "
             f"admission {c.admission().label}"
             + (f"; {len(r.nodes)} nodes, route {r.route}" if r.route else "")]
    lines += ["  " + x for x in plan.describe()]
    lines.append(f"  replayed in {r.wall_s:.1f} s ({r.num_requests / max(r.wall_s, 1e-9):.1f} requests/s)")
    mx = t.max_tokens if r.fleet_max_tokens is None else r.fleet_max_tokens
    lines += ["", f"{'token hit rate':<40} {'tokens':>15} {'rate':>9} {'of max':>9}"]
    for tier in ("gpu", "host", "disk", "shared"):
        if tier in _tiers_on(c):
            v = t.hit_tokens[tier]
            lines.append(f"  {tier:<38} {v:>15,} {_pct(t.rate(v))} {_pct(v / mx if mx else 0)}")
    lines.append(f"  {'all tiers':<38} {t.hits:>15,} {_pct(t.rate(t.hits))} {_pct(t.hits / mx if mx else 0)}")
    lines.append(f"  {'if every block boundary were resumable':<38} {t.resident_tokens:>15,} "
                 f"{_pct(t.rate(t.resident_tokens))} {_pct(t.resident_tokens / mx if mx else 0)}")
    label = "trace maximum (one unbounded cache)" if r.fleet_max_tokens is not None else "trace maximum (unbounded cache)"
    lines.append(f"  {label:<38} {mx:>15,} {_pct(t.rate(mx))}")
    lines += ["", f"{'tokens computed, by reason':<40} {'tokens':>15} {'rate':>9}"]
    for reason in REASONS:
        v = t.miss_tokens[reason]
        if v or reason in ("never_seen", "no_snapshot", "corrupt") or reason.removeprefix("evicted_") in _tiers_on(c):
            lines.append(f"  {_REASON_TEXT[reason]:<38} {v:>15,} {_pct(t.rate(v))}")
    lines.append(f"  {'total computed':<38} {t.computed_tokens:>15,} {_pct(t.rate(t.computed_tokens))}")
    lines += ["", f"{'resident at the end (model bytes)':<40} {'blocks':>12} {'snapshots':>12} {'snap/block':>10}"]
    for tier, kinds in r.resident().items():
        b, s = kinds.get("blocks", 0), kinds.get("snapshots", 0)
        lines.append(f"  {tier:<38} {format_bytes(b):>12} {format_bytes(s):>12} "
                     f"{(s / b if b else 0):>10.3f}")
    lines += ["", f"{'stranded at the end (held, no resume can use)':<40} {'no block':>12} {'no snapshot':>12} "
                  f"{'snapshots':>12}",
              "  (blocks a block before them is missing for / blocks no snapshot at or after them serves / "
              "snapshots whose blocks are not all held)"]
    for tier, kinds in r.stranded().items():
        lines.append(f"  {tier:<38} {format_bytes(kinds.get('unreachable', 0)):>12} "
                     f"{format_bytes(kinds.get('no_snapshot', 0)):>12} "
                     f"{format_bytes(kinds.get('snapshots_unreachable', 0)):>12}"
                     + (f"  ({format_bytes(kinds['unknown'])} of blocks not seen by this replay)"
                        if kinds.get("unknown") else ""))
    moved = r.moved()
    if moved:
        lines += ["", f"{'moved between tiers (model bytes)':<40} {'blocks':>12} {'snapshots':>12}"]
        for path, kinds in moved.items():
            if "records" in kinds:
                lines.append(f"  {path:<38} {kinds['records']:>12,} records (blocks and snapshots)")
            else:
                lines.append(f"  {path:<38} {format_bytes(kinds['blocks']):>12} {format_bytes(kinds['snapshots']):>12}")
    io, adm = r.store_bytes(), r.admission()
    if io is not None:
        store = "disk" if c.disk is not None else "shared level"
        lines += ["", f"{store} written {format_bytes(io['written'])}, read {format_bytes(io['read'])} (model bytes, "
                      f"blocks and snapshots)"]
        if adm is not None:
            lines.append(f"  admission {c.admission().label}: {adm['rejected']:,} records held back at seal / "
                         f"publish, {adm['admitted']:,} admitted later (hit, seen twice or survived), "
                         f"{adm['expired']:,} expired (survived:N: no memory tier held them when due)")
    errors = sum(int(n.stats.get("disk_write_errors", 0)) for n in r.nodes)
    uploads_lost = sum(int(n.stats.get("store_failed_uploads", 0)) + int(n.stats.get("store_dropped_uploads", 0))
                       for n in r.nodes)
    if errors or uploads_lost:
        last = next((n.last_write_error for n in r.nodes if n.last_write_error), None)
        lines += ["", f"store writes that failed: {errors:,} records (they stayed in memory; a block lost later is "
                      f"counted evicted from the tier it last reached)" + (f"; last: {last}" if last else "")]
        if uploads_lost:
            lines.append(f"uploads to the shared level given up or dropped: {uploads_lost:,} records")
    cost = c.cost
    saved = t.saved_s
    lines += ["", "prefill (cost model; every rate is a flag)",
              f"  tokens computed {t.computed_tokens:,} of {t.prompt_tokens:,}; prefill "
              f"{t.prefill_s_without_cache:,.1f} s without the cache, {t.prefill_s:,.1f} s with it + "
              f"{t.load_s:,.1f} s loading hits: {saved:,.1f} s saved "
              f"({100 * saved / t.prefill_s_without_cache if t.prefill_s_without_cache else 0:.1f} %)"]
    src = dict(cost.sources)
    for name, value, unit in (("prefill_tokens_per_s", cost.prefill_tokens_per_s, "tokens/s"),
                              ("host_gbps", cost.host_gbps, "GB/s"), ("disk_gbps", cost.disk_gbps, "GB/s"),
                              ("shared_gbps", cost.shared_gbps, "GB/s")):
        lines.append(f"  --{name.replace('_', '-'):<22} {value:>10,.3f} {unit:<8} {src.get(name, '')}")
    by_tier = ", ".join(f"{k} {v:,}" for k, v in t.verified_by_tier.items() if v)
    lines += ["", f"verified byte-exact: {t.verified_requests:,} resumed requests, {t.verified_blocks:,} blocks "
                  f"({by_tier or 'none'}), {t.verified_snapshots:,} snapshots; every hit is also checksum-verified "
                  f"by the stores on read"]
    if t.late_tokens:
        lines += [f"resumed beyond the lookup just before the open: {t.late_tokens:,} tokens in {t.late_requests:,} "
                  f"requests (other nodes' uploads to the shared level landed in between; counted as shared hits)"]
    if len(r.nodes) > 1:
        lines += ["", f"{'per node':<10} {'requests':>9} {'prompt tokens':>15} {'hit rate':>9} {'gpu':>8} {'host':>8} "
                      f"{'disk':>8} {'shared':>8} {'max':>8}"]
        for n in r.nodes:
            nt = n.tally
            lines.append(f"  {n.name:<8} {nt.requests:>9,} {nt.prompt_tokens:>15,} {_pct(nt.rate(nt.hits))} "
                         + " ".join(f"{100 * nt.rate(nt.hit_tokens[k]):7.2f}%" for k in ("gpu", "host", "disk",
                                                                                         "shared"))
                         + f" {100 * nt.rate(nt.max_tokens):7.2f}%")
    return "\n".join(lines)


def _tiers_on(c: ReplayConfig) -> set[str]:
    on = {"gpu"}
    if c.host is not None:
        on.add("host")
    if c.disk is not None:
        on.add("disk")
    if c.shared_url is not None:
        on.add("shared")
    return on
