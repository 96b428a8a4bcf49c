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
               copy) takes along the blocks that led only to it

The cache releases a request's blocks last block first, so in the GPU pool the least
recently released block is nearly always a leaf already; the host tier, filled by
offloads and by loads, is where the two policies part.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "eviction_policy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EvictionPolicy:
    """An eviction policy of the cache's memory tiers (see the module docstring)."""

    name: str
    #: block pools evict leaves first (BlockPool ``leaf_first``)
    leaf_first: bool
    #: a block evicted from a tier takes that tier's snapshot at its end along
    coherent_snapshots: bool

    @property
    def label(self) -> str:
        return self.name


EVICTION_POLICIES: dict[str, EvictionPolicy] = {
    "lru": EvictionPolicy(name="lru", leaf_first=False, coherent_snapshots=False),
    "leaf-lru": EvictionPolicy(name="leaf-lru", leaf_first=True, coherent_snapshots=True),
}


def eviction_policy(spec: str | EvictionPolicy) -> EvictionPolicy:
    """``lru`` or ``leaf-lru`` -> the :class:`EvictionPolicy`."""
    if isinstance(spec, EvictionPolicy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"eviction: expected a str like 'lru' or 'leaf-lru', got {type(spec).__name__}")
    try:
        return EVICTION_POLICIES[spec]
    except KeyError:
        raise ValueError(f"eviction: expected one of {', '.join(sorted(EVICTION_POLICIES))}, got {spec!r}") from None
