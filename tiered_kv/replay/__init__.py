"""Replay production request traces through the real tiers (``tiered-kv replay``).

Mooncake-format traces (:mod:`.trace`; two bundled: ``bundled:conversation``,
``bundled:synthetic``) are turned into deterministic tokens (:mod:`.tokens`) and served by
a real :class:`~tiered_kv.cache.TieredKVCache` with a GPU pool, a host tier, a disk store
and a shared level, sized in the target model's bytes or in tokens (:mod:`.config`) and
run on a scaled stand-in layout (:mod:`.standin`) with synthetic, verifiable bytes
(:mod:`.synth`). Every prompt token is accounted for: hit by a tier, or computed for a
reason (:mod:`.tally`). See docs/replay.md.

    >>> from tiered_kv.replay import Capacity, ReplayConfig, replay
    >>> report = replay("bundled:conversation", ReplayConfig(hbm=Capacity.of_tokens(3_000_000)))
    >>> report.hit_rate, report.total.max_tokens / report.prompt_tokens
"""

from __future__ import annotations

from .config import Capacity, ReplayConfig, TierPlan, parse_tokens, plan_tiers
from .costs import CostModel
from .policies import (ADMISSION_POLICIES, EVICTION_POLICIES, SNAPSHOT_POLICIES, Policy, admission_policy,
                       eviction_policy, snapshot_policy)
from .report import ReplayReport
from .run import replay
from .standin import StandIn, stand_in
from .tally import REASONS, Tally
from .tokens import TokenMaker
from .trace import BUNDLED, Trace, TraceRequest, load_trace

__all__ = ["ADMISSION_POLICIES", "BUNDLED", "Capacity", "CostModel", "EVICTION_POLICIES", "Policy", "REASONS", "ReplayConfig",
           "ReplayReport", "SNAPSHOT_POLICIES", "StandIn", "Tally", "TierPlan", "TokenMaker", "Trace",
           "TraceRequest", "admission_policy", "eviction_policy", "load_trace", "parse_tokens", "plan_tiers", "replay",
           "snapshot_policy", "stand_in"]
