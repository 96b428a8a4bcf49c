"""What a replay runs: the tiers' capacities (in model bytes or in tokens), the policies,
the stand-in layout, and how each tier is sized from them.

Capacities are the target model's: ``Capacity.of_bytes(40 << 30)`` is 40 GiB of
DeepSeek-V4-Flash memory, whatever stand-in the cache runs (:mod:`.standin`). A memory
tier (GPU, host) gives ``snapshot_fraction`` of its bytes to State snapshots and the rest
to Classical blocks, as the host tier does; the disk holds both in one byte budget.
``Capacity.of_tokens(3_000_000)`` is a tier that holds 3M tokens of Classical blocks
*plus* its snapshot share: ``ceil(tokens / block_tokens)`` blocks, and bytes
``blocks * block_bytes / (1 - snapshot_fraction)`` for the tier as a whole (the disk
counts the same bytes). So a token capacity compares with Mooncake's (a dense model has
no snapshots), and snapshots are still paid for.

:func:`plan_tiers` turns a config into pool sizes of the stand-in: GPU blocks and
snapshot slots, host bytes (the host tier splits them), the disk store's ``max_bytes``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..layout import KVLayout
from ..policy.admission import DEFAULT_ADMISSION
from ..policy.eviction import DEFAULT_EVICTION
from ..policy.snapshots import DEFAULT_SNAPSHOT_POLICY
from ..presets import get_preset
from .costs import CostModel
from .policies import Policy, admission_policy, eviction_policy, snapshot_policy
from .standin import StandIn, stand_in

__all__ = ["Capacity", "ReplayConfig", "TierPlan", "parse_tokens", "plan_tiers"]

_TOKENS_RE = re.compile(r"(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[kKmMgG]?)", re.ASCII)
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_tokens(text: str | int) -> int:
    """A token count with an optional decimal suffix: ``3M`` = 3,000,000, ``128K``, ``1.5M``."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"tokens: expected a positive count, got {text}")
        return text
    m = _TOKENS_RE.fullmatch(str(text).strip())
    if m is None:
        raise ValueError(f"tokens: expected a count with an optional decimal suffix K, M or G "
                         f"(e.g. 3M = 3,000,000), got {text!r}")
    value = float(m.group("num")) * _DECIMAL[m.group("unit").lower()]
    if value < 1 or value != int(value):
        raise ValueError(f"tokens: expected a positive whole number of tokens, got {text!r}")
    return int(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Capacity:
    """A tier's capacity in the target model's bytes, or in tokens of Classical blocks."""

    model_bytes: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        if (self.model_bytes is None) == (self.tokens is None):
            raise ValueError("Capacity: expected model_bytes or tokens (exactly one)")
        v = self.model_bytes if self.model_bytes is not None else self.tokens
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"Capacity: expected a positive int, got {v!r}")

    @classmethod
    def of_bytes(cls, n: int) -> Capacity:
        return cls(model_bytes=n)

    @classmethod
    def of_tokens(cls, n: int) -> Capacity:
        return cls(tokens=n)

    def resolve(self, model: KVLayout, snapshot_fraction: float) -> int:
        """The tier's size in model bytes."""
        if self.model_bytes is not None:
            return self.model_bytes
        assert self.tokens is not None
        blocks = -(-self.tokens // model.block_tokens)
        return math.ceil(blocks * model.block_bytes / (1.0 - snapshot_fraction))

    def describe(self) -> str:
        if self.tokens is not None:
            return f"{self.tokens:,} tokens"
        from ..planner import format_bytes

        assert self.model_bytes is not None
        return format_bytes(self.model_bytes)


@dataclass(frozen=True, kw_only=True)
class ReplayConfig:
    """One replay's tiers and policies (the CLI's options; see docs/replay.md).

    ``hbm`` is required (a cache always has its GPU tier); ``host``, ``disk`` and
    ``shared`` are optional. ``disk_url``: where the disk tier's store lives (None: a fresh
    LMDB directory under ``workdir``, removed afterwards); any store URL works
    (``lmdb:///path``, ``zarr:///path``). ``shared_url``: the level every node shares
    (``zarr+s3://bucket/prefix?endpoint=...``; credentials in the standard AWS
    variables), behind the disk when there is one (a store chain), else the node's only
    store; the replay writes under a fresh sub-prefix of it.
    """

    model: str = "deepseek-v4-flash"
    hbm: Capacity
    host: Capacity | None = None
    disk: Capacity | None = None
    disk_url: str | None = None
    shared_url: str | None = None
    #: share of each memory tier's bytes given to snapshots (the host tier's own default)
    snapshot_fraction: float = 0.25
    #: the cache's defaults (:mod:`tiered_kv.policy`)
    snapshot_policy: str = DEFAULT_SNAPSHOT_POLICY
    eviction_policy: str = DEFAULT_EVICTION
    #: the disk admission filter (the cache's own default: :data:`~tiered_kv.policy.DEFAULT_ADMISSION`)
    admission_policy: str = DEFAULT_ADMISSION
    #: force the stand-in's scale (None: the largest exact one)
    scale: int | None = None
    #: read back and check every n-th request that hits (and the first hit from each tier); 0: never
    verify_every: int = 16
    salt: str = ""
    cost: CostModel = field(default_factory=CostModel.defaults)
    #: where a disk store made for the replay goes (None: the system's temporary directory)
    workdir: str | None = None
    #: options of the chain when ``shared_url`` is given behind a disk (e.g. ``{"backoff_max_s": 5.0}``)
    chain_options: dict[str, Any] = field(default_factory=dict)
    #: bound on each call to the shared level (a serving cache's default is 2 s; a replay on a
    #: small machine shares its CPUs with the object store, which then answers slowly)
    shared_timeout_s: float = 30.0
    #: the GPU pools in counts, instead of ``hbm``'s bytes split by ``snapshot_fraction``
    #: (e.g. a snapshot pool that never evicts, to compare with a plain LRU simulation)
    gpu_blocks: int | None = None
    gpu_snapshots: int | None = None
    #: disk writes queued behind the requests (the cache's ``disk_max_pending``; a serving
    #: cache's default is 64): a replay seals blocks far faster than an engine computes
    #: them, so a deeper queue lets the writer sync them in bigger batches
    disk_queue: int = 1024
    #: wait for the disk writer to land every queued write before each request's lookup.
    #: Without it the disk figures depend on how far the writer thread got at each lookup
    #: (which records are on disk, and when the store evicted): a busy machine moves them
    #: by a few blocks. With it they are deterministic, at one wait per request.
    sync_disk: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.hbm, Capacity):
            raise TypeError(f"hbm: expected a Capacity, got {type(self.hbm).__name__}")
        for name in ("host", "disk"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, Capacity):
                raise TypeError(f"{name}: expected a Capacity or None, got {type(v).__name__}")
        if not 0.0 < self.snapshot_fraction < 1.0:
            raise ValueError(f"snapshot_fraction: expected a float in (0, 1), got {self.snapshot_fraction!r}")
        if self.disk_url is not None and self.disk is None:
            raise ValueError("disk_url: give the disk tier's capacity (disk) too")
        for name in ("gpu_blocks", "gpu_snapshots"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "gpu_blocks" else 2)):
                raise ValueError(f"{name}: expected an int >= {1 if name == 'gpu_blocks' else 2} or None, got {v!r}")
        if isinstance(self.verify_every, bool) or not isinstance(self.verify_every, int) or self.verify_every < 0:
            raise ValueError(f"verify_every: expected a non-negative int, got {self.verify_every!r}")
        self.snapshot()  # validates the policy names
        self.eviction()
        self.admission()

    def snapshot(self) -> Policy:
        return snapshot_policy(self.snapshot_policy)

    def eviction(self) -> Policy:
        return eviction_policy(self.eviction_policy)

    def admission(self) -> Policy:
        return admission_policy(self.admission_policy)

    @property
    def tiers_label(self) -> str:
        """``hbm``, ``hbm+host``, ``hbm+host+disk``, ``hbm+host+disk+shared`` (the tiers on)."""
        parts = ["hbm"] + [n for n, v in (("host", self.host), ("disk", self.disk), ("shared", self.shared_url))
                           if v is not None]
        return "+".join(parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class TierPlan:
    """Pool sizes of the stand-in cache for one config, and the model bytes behind them."""

    standin: StandIn
    gpu_blocks: int
    gpu_snapshots: int
    #: host tier bytes of the stand-in (None: no host tier)
    host_bytes: int | None
    host_blocks: int
    host_snapshots: int
    #: the disk store's max_bytes (stand-in record bytes; None: no disk tier)
    disk_max_bytes: int | None
    #: the tiers' sizes in model bytes (None: off)
    model_bytes: dict[str, int | None]

    def describe(self) -> list[str]:
        from ..planner import format_bytes

        s = self.standin
        lines = [s.describe()]
        g = self.model_bytes
        lines.append(f"gpu: {format_bytes(g['gpu'] or 0)} = {self.gpu_blocks:,} blocks + {self.gpu_snapshots:,} "
                     f"snapshots")
        if self.host_bytes is not None:
            lines.append(f"host: {format_bytes(g['host'] or 0)} = {self.host_blocks:,} blocks + "
                         f"{self.host_snapshots:,} snapshots")
        if self.disk_max_bytes is not None:
            lines.append(f"disk: {format_bytes(g['disk'] or 0)} = max_bytes {self.disk_max_bytes:,} of stand-in "
                         f"records (blocks and snapshots)")
        return lines


def model_layout(name: str, block_tokens: int) -> KVLayout:
    """The preset ``name`` at ``block_tokens``-token blocks (ValueError naming the presets)."""
    return get_preset(name, block_tokens=block_tokens)


def plan_tiers(config: ReplayConfig, block_tokens: int) -> TierPlan:
    """Size every tier of ``config`` for a trace of ``block_tokens``-token blocks."""
    from ..storage import record_size

    model = model_layout(config.model, block_tokens)
    standin = stand_in(model, scale=config.scale)
    B, S, f = model.block_bytes, model.snapshot_bytes, config.snapshot_fraction
    gpu = config.hbm.resolve(model, f)
    gpu_snaps = int(gpu * f) // S if config.gpu_snapshots is None else config.gpu_snapshots
    gpu_blocks = (gpu - gpu_snaps * S) // B if config.gpu_blocks is None else config.gpu_blocks
    if config.gpu_blocks is not None or config.gpu_snapshots is not None:  # the pools as given
        gpu = gpu_blocks * B + gpu_snaps * S
    if gpu_blocks < 1 or gpu_snaps < 2:
        raise ValueError(f"hbm: {config.hbm.describe()} holds {gpu_blocks} blocks and {gpu_snaps} snapshots of "
                         f"{model.name}; expected at least 1 block and 2 snapshots")
    host_bytes = host_blocks = host_snaps = 0
    host_model = None
    if config.host is not None:
        host_model = config.host.resolve(model, f)
        host_bytes = host_model // standin.scale
        L = standin.layout
        host_snaps = int(host_bytes * f) // L.snapshot_bytes  # as the host tier (tiered_kv.host) splits it
        host_blocks = (host_bytes - host_snaps * L.snapshot_bytes) // L.block_bytes
        if host_blocks < 1:
            raise ValueError(f"host: {config.host.describe()} holds no block of {model.name}")
    disk_max = disk_model = None
    if config.disk is not None:
        disk_model = config.disk.resolve(model, f)
        # records carry a header and checksum: keep the number of block records that fit
        disk_max = disk_model * record_size(standin.layout.block_bytes) // record_size(B)
    return TierPlan(standin=standin, gpu_blocks=gpu_blocks, gpu_snapshots=gpu_snaps,
                    host_bytes=host_bytes if config.host is not None else None, host_blocks=host_blocks,
                    host_snapshots=host_snaps, disk_max_bytes=disk_max,
                    model_bytes={"gpu": gpu, "host": host_model, "disk": disk_model})
