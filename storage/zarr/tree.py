"""The Zarr store's prefix tree, in memory: which record leads to which, so that eviction
takes leaves first and never strands a path's end behind a missing start.

The same tree and rules as the LMDB store's (storage/lmdb/tree.py), kept by one store
handle instead of an index every process shares:

- ``parent``: each linked record's parent key (a block's previous block, from the parent
  hash in its header; a snapshot's own block);
- ``kids``: per key, how many resident records name it as their parent (kept while > 0,
  whether that key is resident or not: a child may be stored before its parent);
- two access orders, least recently used first: ``leaves`` (no resident child: the
  eviction candidates) and ``parked`` (the rest).

Eviction (:meth:`RecordTree.evict`, through
:func:`~tiered_kv.storage.api.eviction.evict_leaves_first`, as LMDB's) takes the least
recently used leaf the eviction guard does not hold, then the blocks that led only to it,
up the path to the nearest block that still has a snapshot or another branch; an interior
record only when the guard holds every leaf.

Where the links come from (see :mod:`.store`): puts (the parent hash of each
:class:`~.api.PutItem`) and reads (that of each record read); at a scan, for records
this handle has no link for, the record's header (only when the store evicts). A record
without a link is a leaf: plain LRU among those, as before the tree. A wrong link only
changes which record is evicted, never what a read returns.

Each order is a sorted list of ``(access ns, key bytes, key)``: an access moves a record
to its end (a ``bisect`` and a list shift), a record that changes order is inserted at its
place, so the order is exact whatever the order of the accesses (a scan's file times).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import NamedTuple

from ..api.eviction import EvictionGuard, evict_leaves_first
from ..format.record import RecordKey, RecordKind

__all__ = ["RecordTree", "Victim", "parent_key"]


def parent_key(key: RecordKey, parent_hash: bytes) -> RecordKey:
    """``key``'s parent in the prefix tree: a block's previous block (``parent_hash``), a
    snapshot's own block."""
    return RecordKey.block(parent_hash if key.kind == RecordKind.BLOCK else key.block_hash)


class Victim(NamedTuple):
    """A record an eviction took out of the tree (what :meth:`RecordTree.restore` needs)."""

    key: RecordKey
    size: int
    ns: int
    parent: RecordKey | None


class _Order:
    """Records in access order, least recently used first (ties: by key bytes)."""

    def __init__(self, entries: Iterable[tuple[int, bytes, RecordKey]] = ()) -> None:
        self._sorted = sorted(entries)
        self._entry = {e[2]: e for e in self._sorted}

    def add(self, key: RecordKey, ns: int) -> None:
        e = (ns, key.to_bytes(), key)
        self._entry[key] = e
        if not self._sorted or self._sorted[-1] < e:
            self._sorted.append(e)  # the common case: an access now
        else:
            bisect.insort(self._sorted, e)

    def discard(self, key: RecordKey) -> None:
        e = self._entry.pop(key, None)
        if e is not None:
            del self._sorted[bisect.bisect_left(self._sorted, e)]

    def __contains__(self, key: RecordKey) -> bool:
        return key in self._entry

    def __len__(self) -> int:
        return len(self._entry)

    def entries(self) -> list[tuple[int, bytes, RecordKey]]:
        return self._sorted


class RecordTree:
    """The resident records of one Zarr store handle: sizes, access times, the prefix tree
    and its two access orders (see the module docstring). Not thread-safe: the store
    holds its lock around every call."""

    def __init__(self) -> None:
        self._records: dict[RecordKey, tuple[int, int]] = {}  # key -> (bytes, last access ns)
        self._parent: dict[RecordKey, RecordKey] = {}
        self._kids: dict[RecordKey, int] = {}
        self._leaves = _Order()
        self._parked = _Order()
        #: bytes of the resident records
        self.total = 0

    @classmethod
    def build(cls, records: Iterable[tuple[RecordKey, int, int]],
              parents: dict[RecordKey, RecordKey]) -> RecordTree:
        """A tree of ``records`` (key, bytes, last access ns), linked by ``parents``
        (resident key -> its parent key; the others stay unlinked leaves)."""
        tree = cls()
        tree._records = {key: (size, ns) for key, size, ns in records}
        tree._parent = {k: p for k, p in parents.items() if k in tree._records and p != k}
        tree._kids = dict(Counter(tree._parent.values()))
        tree.total = sum(size for size, _ in tree._records.values())
        leaves, parked = [], []
        for key, (_, ns) in tree._records.items():
            (parked if key in tree._kids else leaves).append((ns, key.to_bytes(), key))
        tree._leaves, tree._parked = _Order(leaves), _Order(parked)
        return tree

    # ------------------------------------------------------------------ queries
    def __contains__(self, key: RecordKey) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def get(self, key: RecordKey) -> tuple[int, int] | None:
        """``key``'s (bytes, last access ns), None if not resident."""
        return self._records.get(key)

    def parent_of(self, key: RecordKey) -> RecordKey | None:
        """``key``'s parent when it is resident and linked."""
        return self._parent.get(key)

    def links(self) -> dict[RecordKey, RecordKey]:
        """Every resident record's link (a copy)."""
        return dict(self._parent)

    def kids(self, key: RecordKey) -> int:
        """How many resident records name ``key`` as their parent."""
        return self._kids.get(key, 0)

    def is_leaf(self, key: RecordKey) -> bool:
        return key in self._leaves

    def oldest_first(self) -> Iterator[RecordKey]:
        """Every resident record, least recently accessed first."""
        for _, _, key in heapq.merge(self._leaves.entries(), self._parked.entries()):
            yield key

    def access_times(self) -> list[int]:
        return [ns for _, ns in self._records.values()]

    # ------------------------------------------------------------------ changes
    def touch(self, key: RecordKey, size: int, ns: int) -> None:
        """``key`` (``size`` bytes) was accessed at ``ns``, or just stored."""
        old = self._records.get(key)
        order = self._order_of(key)
        if old is not None:
            order.discard(key)
        self._records[key] = (size, ns)
        self.total += size - (old[0] if old else 0)
        order.add(key, ns)

    def link(self, key: RecordKey, parent: RecordKey) -> None:
        """Resident ``key``'s parent is ``parent`` (from its put or its header); a resident
        parent that had no child becomes interior."""
        if key not in self._records or parent == key:
            return
        old = self._parent.get(key)
        if old == parent:
            return
        if old is not None:
            self._drop_kid(old)
        self._parent[key] = parent
        self._kids[parent] = self._kids.get(parent, 0) + 1
        if self._kids[parent] == 1 and parent in self._records:
            self._leaves.discard(parent)
            self._parked.add(parent, self._records[parent][1])

    def remove(self, key: RecordKey, released: list[RecordKey] | None = None) -> Victim | None:
        """Take ``key`` out (deleted, corrupt, gone or evicted); None if it was not
        resident. A resident parent left without a child becomes a leaf and is appended to
        ``released``."""
        entry = self._records.pop(key, None)
        if entry is None:
            return None
        self._order_of(key).discard(key)
        self.total -= entry[0]
        parent = self._parent.pop(key, None)
        if parent is not None and self._drop_kid(parent) and released is not None:
            released.append(parent)
        return Victim(key, entry[0], entry[1], parent)

    def _drop_kid(self, parent: RecordKey) -> bool:
        """One resident child of ``parent`` fewer; True when that made resident ``parent``
        a leaf."""
        n = self._kids.get(parent, 0) - 1
        if n > 0:
            self._kids[parent] = n
            return False
        self._kids.pop(parent, None)
        if parent not in self._records:
            return False
        self._parked.discard(parent)
        self._leaves.add(parent, self._records[parent][1])
        return True

    def _order_of(self, key: RecordKey) -> _Order:
        return self._parked if self._kids.get(key) else self._leaves

    # ------------------------------------------------------------------ eviction
    def evict(self, excess: int, guard: EvictionGuard | None) -> tuple[list[Victim], int]:
        """Take records worth ``excess`` bytes out, leaves first, each with the blocks that
        led only to it (see the module docstring), past those ``guard`` holds. Returns
        (the records taken, in order; guarded records walked past)."""
        if excess <= 0:
            return [], 0
        taken: dict[RecordKey, Victim] = {}

        def walk(order: _Order) -> Iterator[tuple[RecordKey, RecordKey, int]]:
            for _, _, key in order.entries():
                yield key, key, self._records[key][0]

        def remove(key: RecordKey, released: list[RecordKey]) -> int | None:
            victim = self.remove(key, released)
            if victim is None:
                return None
            taken[key] = victim
            return victim.size

        keys, _, kept = evict_leaves_first([lambda: walk(self._leaves), lambda: walk(self._parked)], excess,
                                           remove, guard, key_of=lambda key: key)
        return [taken[key] for key in keys], kept

    def restore(self, victims: list[Victim]) -> None:
        """Undo :meth:`evict` (nothing is evicted after all): the tree as it was."""
        for v in reversed(victims):
            self.touch(v.key, v.size, v.ns)
            if v.parent is not None:
                self.link(v.key, v.parent)
