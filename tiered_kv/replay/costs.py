"""The prefill cost model of a replay report: every number a flag, each default with its source.

A hit of ``k`` tokens saves prefilling them and costs loading their bytes from where
they are (a GPU hit is read in place)::

    saved_s = k / prefill_tokens_per_s - sum over non-GPU tiers of bytes_from_tier / tier_bandwidth

``prefill_tokens_per_s`` is what the engine computes per second (not counting hits).
Defaults:

* prefill 32,200 tokens/s: DeepSeek's published 73.7k input tokens/s per H800 node
  *including* a 56.3 % cache hit rate (DeepSeek-V3/R1 Inference System Overview,
  2025-03-01), i.e. 73.7k x (1 - 0.563) computed tokens/s per 8-GPU node. A V3/R1 figure:
  give your engine's own for V4.
* host -> GPU 50 GB/s: pinned host to H200 copies measured at 48-55 GB/s
  (ARCHITECTURE.md section 9, 2026-11-30).
* disk -> host: this machine's LMDB store cold read, ``bench/results/disk.json``
  (``rows.lmdb.median.cold_read_gbps``) when it is there, else 1.11 GB/s (its value when
  this default was set).
* shared level -> host: this machine's SeaweedFS S3 on 127.0.0.1,
  ``bench/results/shared_store.json`` (the "get, batches of 16" row) when there, else
  0.223 GB/s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..lookup import Tier

__all__ = ["CostModel"]

_REPO_RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass(frozen=True, kw_only=True, slots=True)
class CostModel:
    """Rates of the prefill cost model (see the module docstring)."""

    prefill_tokens_per_s: float
    host_gbps: float
    disk_gbps: float
    shared_gbps: float
    #: where each default came from: field name -> text
    sources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "host_gbps", "disk_gbps", "shared_gbps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}: expected a positive number, got {v!r}")

    @classmethod
    def defaults(cls, results_dir: Path | None = None) -> CostModel:
        """The defaults, with this machine's measured disk and shared-level figures from
        ``bench/results`` where they exist."""
        where = _REPO_RESULTS if results_dir is None else results_dir
        disk, disk_src = _measured(where / "disk.json", _disk_gbps, 1.11,
                                   "LMDB cold read measured on this machine")
        shared, shared_src = _measured(where / "shared_store.json", _shared_gbps, 0.223,
                                       "SeaweedFS S3 get (batches of 16) measured on this machine")
        return cls(prefill_tokens_per_s=32_200.0, host_gbps=50.0, disk_gbps=disk, shared_gbps=shared, sources=(
            ("prefill_tokens_per_s", "DeepSeek-V3/R1 Inference System Overview (2025-03-01): 73.7k input "
                                     "tokens/s per H800 node at a 56.3 % hit rate -> 73.7k x 0.437 computed"),
            ("host_gbps", "pinned host -> H200 copies, 48-55 GB/s (ARCHITECTURE.md section 9)"),
            ("disk_gbps", disk_src),
            ("shared_gbps", shared_src),
        ))

    def with_overrides(self, **rates: float | None) -> CostModel:
        """This model with the given rates replaced (None: kept); their source becomes "flag"."""
        given = {k: v for k, v in rates.items() if v is not None}
        unknown = set(given) - {"prefill_tokens_per_s", "host_gbps", "disk_gbps", "shared_gbps"}
        if unknown:
            raise ValueError(f"cost model: unknown rate(s) {sorted(unknown)}")
        values = {k: given.get(k, getattr(self, k)) for k in ("prefill_tokens_per_s", "host_gbps", "disk_gbps",
                                                                "shared_gbps")}
        sources = tuple((k, "given on the command line" if k in given else s) for k, s in self.sources)
        return CostModel(**values, sources=sources)

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def load_s(self, tier: Tier, nbytes: int) -> float:
        """Seconds to bring ``nbytes`` from ``tier`` to the GPU (0 for the GPU itself)."""
        rate = {Tier.GPU: None, Tier.HOST: self.host_gbps, Tier.DISK: self.disk_gbps,
                Tier.SHARED: self.shared_gbps}[tier]
        return 0.0 if rate is None else nbytes / (rate * 1e9)

    def to_dict(self) -> dict[str, Any]:
        return {"prefill_tokens_per_s": self.prefill_tokens_per_s, "host_gbps": self.host_gbps,
                "disk_gbps": self.disk_gbps, "shared_gbps": self.shared_gbps, "sources": dict(self.sources)}


def _measured(path: Path, read: Any, fallback: float, what: str) -> tuple[float, str]:
    try:
        value = float(read(json.loads(path.read_text())))
    except (OSError, ValueError, KeyError, TypeError):
        return fallback, f"{what} ({fallback} GB/s when this default was set; {path.name} not found here)"
    return value, f"{what}: bench/results/{path.name}"


def _disk_gbps(d: dict[str, Any]) -> float:
    return d["rows"]["lmdb"]["median"]["cold_read_gbps"]


def _shared_gbps(d: dict[str, Any]) -> float:
    row = next(r for r in d["rows"] if r["op"] == "get, batches of 16")
    return row["store"] / 1e3  # MB/s -> GB/s
