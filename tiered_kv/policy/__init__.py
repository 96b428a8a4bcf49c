"""Cache policies, one small module each, selected by name (STYLE §11).

* :mod:`.snapshots`: where a request takes and publishes State snapshots
  (``branch+interval:32``, the default; ``interval:N``, the cache's original policy;
  ``branch``).
* :mod:`.eviction`: which cached block a pool gives up first (``leaf-lru``, the default:
  leaves first, so a pool never strands a block behind an evicted one; ``leaf-s3fifo``:
  the same over S3-FIFO's small / main / ghost queues; ``lru``, the original).
* :mod:`.admission`: which records reach the disk tier (``all``, the default and the
  original: every record written through; ``retraced``: ``seen-twice``, or a snapshot of
  a request that recomputed a held-back path, the filter that wins on both traces;
  ``second-hit`` / ``hits:N``: only once a memory tier has served them; ``seen-twice``;
  ``survived:N``: once hit, or once it has lived N requests in memory).

The cache holds the pools and the index and asks the policy; a policy holds no tensors.
"""

from __future__ import annotations

from .admission import ADMISSION_POLICIES, DEFAULT_ADMISSION, AdmissionFilter, AdmissionPolicy, admission_policy
from .eviction import DEFAULT_EVICTION, EVICTION_POLICIES, EvictionPolicy, eviction_policy
from .snapshots import DEFAULT_SNAPSHOT_POLICY, PromptEnds, SnapshotPolicy, snapshot_policy

__all__ = ["ADMISSION_POLICIES", "DEFAULT_ADMISSION", "DEFAULT_EVICTION", "DEFAULT_SNAPSHOT_POLICY", "EVICTION_POLICIES",
           "AdmissionFilter", "AdmissionPolicy", "EvictionPolicy", "PromptEnds", "SnapshotPolicy",
           "admission_policy", "eviction_policy", "snapshot_policy"]
