"""Which cached block a tier gives up first: the eviction policies.

A prefix cache has a hazard a flat LRU ignores: a block is of use only while every block
before it on its path is held (somewhere) and a snapshot at or after it is. Evicting a
path's start strands its end; evicting a block and keeping the snapshot at its end
strands the snapshot. ::

    lru        each pool evicts its least recently released block, each snapshot pool its
               least recently released snapshot, independently (the original policy)
    leaf-lru   leaves first: within a tier, no block is evicted while a block cached after
               it on the same path remains (LRU among the blocks without a cached child:
               :class:`~tiered_kv.block_pool.BlockPool` ``leaf_first``, O(1) amortised),
               and a block evicted from a tier takes the tier's snapshot at its end along
               (from the GPU both move to the host tier; from the host tier both go); a
               snapshot dropped from the last tier that holds it (no tier below keeps a
               copy) takes along the blocks that led only to it (the default)
    leaf-s3fifo[:P]  leaf-lru's rules over S3-FIFO's queues (Yang et al., SOSP 2023): a
               block used once waits in a small queue (P % of the pool, default 10) and
               leaves first; a block reused (taken again by a lookup, loaded from a
               lower tier, evicted from one that saw it reused, or computed again soon
               after it left the small queue: a ghost) waits in the main queue
               (:class:`~tiered_kv.block_pool.BlockPool` ``small_fraction``)

The cache releases a request's blocks last block first, so in the GPU pool the least
recently released block is nearly always a leaf already; the host tier, filled by
offloads and by loads, is where the two policies part.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._spec import _int_after_colon

__all__ = ["DEFAULT_EVICTION", "EVICTION_POLICIES", "EvictionPolicy", "eviction_policy"]

#: The cache's default eviction (issue 22): leaves first, snapshots with their blocks;
#: it strands no byte in any replay, where ``lru`` strands 1-7 GiB with the GPU tier alone.
DEFAULT_EVICTION = "leaf-lru"


@dataclass(frozen=True, kw_only=True, slots=True)
class EvictionPolicy:
    """An eviction policy of the cache's memory tiers (see the module docstring)."""

    name: str
    #: block pools evict leaves first (BlockPool ``leaf_first``)
    leaf_first: bool
    #: a block evicted from a tier takes that tier's snapshot at its end along
    coherent_snapshots: bool
    #: the small queue's share of each block pool (S3-FIFO's queues; None: one LRU)
    small_fraction: float | None = None

    def __post_init__(self) -> None:
        f = self.small_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0):
            raise ValueError(f"eviction policy: expected small_fraction None or in (0, 1), got {f!r}")
        if f is not None and not self.leaf_first:
            raise ValueError("eviction policy: S3-FIFO's queues come with leaves first (leaf_first=True)")

    @property
    def label(self) -> str:
        return self.name


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": EvictionPolicy(name="lru", leaf_first=False, coherent_snapshots=False),
    "leaf-lru": EvictionPolicy(name="leaf-lru", leaf_first=True, coherent_snapshots=True),
    "leaf-s3fifo": EvictionPolicy(name="leaf-s3fifo", leaf_first=True, coherent_snapshots=True, small_fraction=0.1),
}


def eviction_policy(spec: str | EvictionPolicy) -> EvictionPolicy:
    """``lru``, ``leaf-lru``, ``leaf-s3fifo`` or ``leaf-s3fifo:P`` (small queue P % of each
    pool, 1-99) -> the :class:`EvictionPolicy`."""
    if isinstance(spec, EvictionPolicy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"eviction: expected a str like 'lru' or 'leaf-lru', got {type(spec).__name__}")
    if spec in EVICTION_POLICIES:
        return EVICTION_POLICIES[spec]
    name, sep, arg = spec.partition(":")
    if name == "leaf-s3fifo" and sep:
        pct = _int_after_colon("eviction", spec, arg, noun="an integer percent")
        if not 1 <= pct <= 99:
            raise ValueError(f"eviction {spec!r}: expected a small-queue percent in 1..99, got {pct}")
        return EvictionPolicy(name=spec, leaf_first=True, coherent_snapshots=True, small_fraction=pct / 100)
    raise ValueError(f"eviction: expected one of {', '.join(sorted(EVICTION_POLICIES))} "
                     f"(or leaf-s3fifo:P), got {spec!r}")
