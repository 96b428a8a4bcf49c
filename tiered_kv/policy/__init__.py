"""Cache policies, one small module each, selected by name (STYLE §11).

* :mod:`.snapshots`: where a request takes and publishes State snapshots
  (``interval:N``, the cache's original policy; ``branch``; ``branch+interval:N``).
* :mod:`.eviction`: which cached block a pool gives up first (``lru``, the original;
  ``leaf-lru``: leaves first, so a pool never strands a block behind an evicted one).

The cache holds the pools and the index and asks the policy; a policy holds no tensors.
"""

from __future__ import annotations

from .eviction import EVICTION_POLICIES, EvictionPolicy, eviction_policy
from .snapshots import PromptEnds, SnapshotPolicy, snapshot_policy

__all__ = ["EVICTION_POLICIES", "EvictionPolicy", "PromptEnds", "SnapshotPolicy", "eviction_policy",
           "snapshot_policy"]
