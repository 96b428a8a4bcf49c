"""The ``api`` layer of the disk tier: the interface every store implements, and what the
backends share to implement it.

==============  ===========================================================================
store.py        :class:`BlockStore` (the interface and its contract), :class:`PutItem`,
                the streamed-read sink, argument checks
counters.py     :class:`Counters` (every set of counters), :class:`StoreStats`
eviction.py     :func:`select_victims`: LRU order past an eviction guard, and
                :func:`evict_leaves_first` over a prefix tree, for every backend
scatter.py      scatter-list outs for a backend that reads into one buffer
wrapper.py      :class:`StoreWrapper`: a store over another, every call and capability it
                does not change forwarded (an encrypted level is one)
==============  ===========================================================================

Imports ``errors``, ``format`` and ``os``; the backends, wrappers and URLs build on it.
"""

from __future__ import annotations

from .counters import Counters, StoreStats
from .eviction import GUARD_SCAN_MAX, EvictionGuard, evict_leaves_first, select_victims
from .scatter import scatter_via_temporaries
from .store import BlockStore, PayloadSink, PutItem, Unread, check_open, payload_of_record
from .wrapper import StoreWrapper

__all__ = ["GUARD_SCAN_MAX", "BlockStore", "Counters", "EvictionGuard", "PayloadSink", "PutItem", "StoreStats", "StoreWrapper", "Unread",
           "check_open", "evict_leaves_first", "payload_of_record", "scatter_via_temporaries", "select_victims"]
