"""Cache policies, one small module each, selected by name (STYLE §11).

* :mod:`.snapshots`: where a request takes and publishes State snapshots
  (``interval:N``, the cache's original policy; ``branch``; ``branch+interval:N``).
* :mod:`.eviction`: which cached block a pool gives up first (``lru``, the original;
  ``leaf-lru``: leaves first, so a pool never strands a block behind an evicted one).
* :mod:`.admission`: which records reach the disk tier (``all``, the original;
  ``second-hit`` / ``hits:N``: only once a memory tier has served them).

The cache holds the pools and the index and asks the policy; a policy holds no tensors.
"""

from __future__ import annotations

from .admission import ADMISSION_POLICIES, AdmissionFilter, AdmissionPolicy, admission_policy
from .eviction import EVICTION_POLICIES, EvictionPolicy, eviction_policy
from .snapshots import PromptEnds, SnapshotPolicy, snapshot_policy

__all__ = ["ADMISSION_POLICIES", "EVICTION_POLICIES", "AdmissionFilter", "AdmissionPolicy", "EvictionPolicy",
           "PromptEnds", "SnapshotPolicy", "admission_policy", "eviction_policy", "snapshot_policy"]
