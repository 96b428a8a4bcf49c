"""A chain of block stores, nearest first: a node's local store in front of a shared one.

==============  ===========================================================================
store.py        :class:`StoreChain` (its module docstring: reads, writes, uploads, health,
                what the chain guarantees), :class:`DeferredLevel`
journal.py      the durable journal of the uploads a chain owes its far levels
==============  ===========================================================================
"""

from __future__ import annotations

from .store import DEFAULT_TIMEOUT_S, DeferredLevel, StoreChain

__all__ = ["DEFAULT_TIMEOUT_S", "DeferredLevel", "StoreChain"]
