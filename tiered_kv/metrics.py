"""Per-tier counters and gauges of a cache, exportable as Prometheus text.

``cache.metrics()`` returns a :class:`MetricsSnapshot`; ``snapshot.to_prometheus()``
renders the text exposition format (version 0.0.4) that a ``/metrics`` endpoint serves::

    # HELP tiered_kv_bytes Bytes held by a tier.
    # TYPE tiered_kv_bytes gauge
    tiered_kv_bytes{tier="gpu"} 62720
    tiered_kv_bytes{tier="host"} 12544
    ...

Metric families (label ``tier`` is one of gpu, host, disk; ``kind`` is block or
snapshot where both exist):

=================================  =======  ==================================================
name                               type     meaning
=================================  =======  ==================================================
tiered_kv_bytes                    gauge    bytes held (cached or in use) by the tier
tiered_kv_capacity_bytes           gauge    the tier's byte capacity
tiered_kv_hits_total               counter  blocks / snapshots served from the tier
tiered_kv_misses_total             counter  lookups the tier could not serve
tiered_kv_evictions_total          counter  entries evicted for space
tiered_kv_corrupt_total            counter  disk records that failed verification (dropped)
tiered_kv_auth_failures_total      counter  records of an encrypted store level that failed
                                            authentication (tag, key, tenant, moved, plain): misses
tiered_kv_write_errors_total       counter  disk writes that failed (full disk, I/O error)
tiered_kv_bytes_moved_total        counter  bytes moved, label ``direction`` (d2h, h2d, disk_write,
                                            disk_read, hisparse_swap_in)
tiered_kv_copy_latency_seconds     gauge    copy-engine latency, label ``stat`` (mean, max)
tiered_kv_requests_total           counter  requests opened / closed, label ``event``
tiered_kv_tokens_total             counter  prompt tokens and tokens served from cache, label ``kind``
tiered_kv_live_requests            gauge    requests open now
tiered_kv_snapshot_bytes           gauge    bytes of State snapshots held by the tier (gpu, host)
tiered_kv_miss_tokens_total        counter  prompt tokens computed, label ``reason``: no_snapshot
                                            (held by some tier, no snapshot to resume there),
                                            not_cached (no tier holds the block: never seen or
                                            evicted), tail (the partial last block and the one
                                            token always computed)
tiered_kv_stranding_evictions_total counter blocks evicted while a block cached after them on
                                            their path stayed in the tier (stranded it there)
tiered_kv_snapshots_published_total counter snapshots published, label ``where``: branch (where
                                            a prompt left the cached prefix tree), other
tiered_kv_disk_admission_rejects_total counter records the disk admission filter held back
                                            when sealed / published (not written then)
tiered_kv_disk_admitted_total      counter  records the filter wrote later: a snapshot on a memory-
                                            tier hit, published again (seen-twice), by a
                                            request that retraced a path (retraced)
                                            or having survived, and the blocks it took along
tiered_kv_disk_admission_expired_total counter ``survived:N``: records held back that were due
                                            when no memory tier held them any more (never written)
=================================  =======  ==================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Metric", "MetricsSnapshot", "TierGauges", "collect"]


@dataclass
class Metric:
    """One metric family: name, type, help text and labelled samples."""

    name: str
    kind: str  # "counter" | "gauge"
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> Metric:
        self.samples.append((labels, float(value)))
        return self


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


@dataclass
class MetricsSnapshot:
    """Metric families at one instant."""

    metrics: list[Metric]

    def get(self, name: str, **labels: str) -> float:
        """The value of one sample (KeyError if absent)."""
        for m in self.metrics:
            if m.name == name:
                for lab, v in m.samples:
                    if lab == labels:
                        return v
        raise KeyError(f"{name}{labels}")

    def as_dict(self) -> dict[str, float]:
        """``{'name{label="v"}': value}`` for every sample."""
        out = {}
        for m in self.metrics:
            for lab, v in m.samples:
                out[m.name + _labels(lab)] = v
        return out

    def to_prometheus(self) -> str:
        """The Prometheus text exposition format."""
        lines = []
        for m in self.metrics:
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            for lab, v in m.samples:
                lines.append(f"{m.name}{_labels(lab)} {_fmt(v)}")
        return "\n".join(lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


@dataclass(frozen=True, kw_only=True, slots=True)
class TierGauges:
    """What a cache's metrics need besides the counters of its ``stats()``: bytes held
    and capacities per tier, copy latencies, and which tiers exist. The cache fills it
    in (``TieredKVCache.metrics``), so this module depends on no cache type."""

    block_tokens: int
    gpu_bytes: int               # Classical blocks + snapshots cached or in use on the GPU
    gpu_capacity_bytes: int      # Classical pool + snapshot pool + State slots
    copy_latency_mean_s: float
    copy_latency_max_s: float
    host_bytes: int | None = None           # None: no host tier
    host_capacity_bytes: int | None = None
    hisparse: bool = False
    disk: bool = False
    gpu_snapshot_bytes: int = 0
    host_snapshot_bytes: int | None = None


def collect(s: Mapping[str, int], g: TierGauges) -> MetricsSnapshot:
    """The metric families of a cache from its ``stats()`` counters ``s`` and gauges ``g``."""
    held = Metric("tiered_kv_bytes", "gauge", "Bytes held (cached or in use) by a tier.")
    cap = Metric("tiered_kv_capacity_bytes", "gauge", "Byte capacity of a tier.")
    hits = Metric("tiered_kv_hits_total", "counter", "Blocks or snapshots served from a tier.")
    misses = Metric("tiered_kv_misses_total", "counter", "Lookups a tier could not serve.")
    evict = Metric("tiered_kv_evictions_total", "counter", "Entries evicted from a tier for space.")
    corrupt = Metric("tiered_kv_corrupt_total", "counter", "Disk records that failed verification and were dropped.")
    auth = Metric("tiered_kv_auth_failures_total", "counter",
                  "Records of an encrypted store level that failed authentication (served as misses).")
    werr = Metric("tiered_kv_write_errors_total", "counter", "Disk writes that failed (full disk, I/O error).")
    moved = Metric("tiered_kv_bytes_moved_total", "counter", "Bytes moved between tiers.")
    lat = Metric("tiered_kv_copy_latency_seconds", "gauge", "Copy-engine latency per copy.")
    reqs = Metric("tiered_kv_requests_total", "counter", "Requests opened and closed.")
    toks = Metric("tiered_kv_tokens_total", "counter", "Prompt tokens seen and tokens served from cache.")
    live = Metric("tiered_kv_live_requests", "gauge", "Requests open now.")
    snap_bytes = Metric("tiered_kv_snapshot_bytes", "gauge", "Bytes of State snapshots held by a tier.")
    miss_tokens = Metric("tiered_kv_miss_tokens_total", "counter", "Prompt tokens computed, by why they were.")
    stranding = Metric("tiered_kv_stranding_evictions_total", "counter",
                       "Blocks evicted while a block cached after them on their path stayed in the tier.")
    published = Metric("tiered_kv_snapshots_published_total", "counter", "State snapshots published, by where.")
    rejects = Metric("tiered_kv_disk_admission_rejects_total", "counter",
                     "Records the disk admission filter held back when sealed or published.")
    admitted = Metric("tiered_kv_disk_admitted_total", "counter",
                      "Records the disk admission filter wrote later (a snapshot on a hit, published again "
                      "or having survived, and its blocks).")
    expired = Metric("tiered_kv_disk_admission_expired_total", "counter",
                     "Records held back by survived:N that were due when no memory tier held them (never written).")

    snap_bytes.add(g.gpu_snapshot_bytes, tier="gpu")
    for reason in ("no_snapshot", "not_cached", "tail"):
        miss_tokens.add(s.get(f"miss_tokens_{reason}", 0), reason=reason)
    stranding.add(s.get("blocks_stranding_evictions", 0), tier="gpu")
    branch = s.get("snapshots_branch", 0)
    published.add(branch, where="branch")
    published.add(s.get("snapshots_registered", 0) - branch, where="other")

    held.add(g.gpu_bytes, tier="gpu")
    cap.add(g.gpu_capacity_bytes, tier="gpu")
    gpu_block_hits = s["cached_tokens"] // g.block_tokens - s["blocks_from_host"] - s["blocks_from_disk"]
    hits.add(max(gpu_block_hits, 0), tier="gpu", kind="block")
    hits.add(s["snapshot_hits"] - s["snapshots_from_host"] - s["snapshots_from_disk"], tier="gpu", kind="snapshot")
    evict.add(s["blocks_evicted"], tier="gpu", kind="block")
    evict.add(s["snapshots_evicted"], tier="gpu", kind="snapshot")
    moved.add(s["copy_bytes_d2h"], direction="d2h")
    moved.add(s["copy_bytes_h2d"], direction="h2d")
    lat.add(g.copy_latency_mean_s, stat="mean")
    lat.add(g.copy_latency_max_s, stat="max")

    if g.host_bytes is not None:
        held.add(g.host_bytes, tier="host")
        cap.add(g.host_capacity_bytes or 0, tier="host")
        hits.add(s["blocks_from_host"], tier="host", kind="block")
        hits.add(s["snapshots_from_host"], tier="host", kind="snapshot")
        evict.add(s["host_blocks_evicted"], tier="host", kind="block")
        evict.add(s["host_snapshots_evicted"], tier="host", kind="snapshot")
        snap_bytes.add(g.host_snapshot_bytes or 0, tier="host")
        stranding.add(s.get("host_blocks_stranding_evictions", 0), tier="host")
    if g.hisparse:
        hits.add(s["hisparse_hits"], tier="hisparse_buffer", kind="csa_entry")
        misses.add(s["hisparse_misses"], tier="hisparse_buffer", kind="csa_entry")
        moved.add(s["hisparse_bytes_moved"], direction="hisparse_swap_in")
    if g.disk:
        held.add(s.get("store_bytes", 0), tier="disk")
        if s.get("store_max_bytes"):
            cap.add(s["store_max_bytes"], tier="disk")
        hits.add(s["blocks_from_disk"], tier="disk", kind="block")
        hits.add(s["snapshots_from_disk"], tier="disk", kind="snapshot")
        misses.add(s["disk_reads"] - s["disk_read_hits"], tier="disk")
        evict.add(s.get("store_evictions", 0), tier="disk")
        corrupt.add(s.get("store_corrupt", 0), tier="disk")
        if s.get("store_encrypted") or "store_auth_failures" in s:
            auth.add(s.get("store_auth_failures", 0), tier="disk")
        werr.add(s["disk_write_errors"], tier="disk")
        moved.add(s["disk_write_bytes"], direction="disk_write")
        moved.add(s["disk_read_bytes"], direction="disk_read")
        rejects.add(s.get("admission_rejects", 0))
        admitted.add(s.get("admission_admitted", 0))
        expired.add(s.get("admission_expired", 0))
    reqs.add(s["requests_opened"], event="opened")
    reqs.add(s["requests_closed"], event="closed")
    toks.add(s["prompt_tokens"], kind="prompt")
    toks.add(s["cached_tokens"], kind="cached")
    live.add(s["live_requests"])
    families = [held, cap, hits, misses, evict, corrupt, auth, werr, moved, lat, reqs, toks, live, snap_bytes,
                miss_tokens, stranding, published, rejects, admitted, expired]
    return MetricsSnapshot([m for m in families if m.samples])
