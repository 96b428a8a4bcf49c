"""The LMDB store's prefix tree: which record leads to which, so that eviction takes leaves
first and never strands a path's end behind a missing start.

A block's record names its parent (the previous block's hash, ``h_{i-1}``, in its
header); a snapshot at boundary ``i`` belongs to block ``i``. The index keeps, in the same
write transactions as ``records`` (so every process sharing the store sees one tree, and
kill -9 leaves it whole):

- ``parent``: each record's parent key (a block's previous block, a snapshot's own block);
- ``kids``: per key, how many resident records name it as their parent (kept while > 0,
  whether that key is resident or not: a child may be stored before its parent);
- which order table a resident record's access entry is in: ``lru`` while it has no
  resident child (a leaf: an eviction candidate), ``parked`` while it has one.

Eviction (:meth:`.access.AccessTimes.evict_for`) walks ``lru``, the leaves, least recently
used first, and only when no leaf can go (all held by the eviction guard) ``parked``. When
a record goes, its parent's count drops; a block whose last child went has no snapshot and
no block after it, so no resume can use it: it goes in the same transaction, and so on up
the path, to the nearest block that still has a snapshot or another branch (a path's
blocks after its last snapshot go with that snapshot).

Records without a ``parent`` entry (stores written before the tree, indexes rebuilt by an
older version) are leaves: plain LRU among them, as before. A tree that is wrong about a
record (a count off after an older version wrote the store) only changes which record is
evicted, never what a read returns; :meth:`~.maintenance.Maintenance.verify` reports it
and its repair recounts the tree.
"""

from __future__ import annotations

from typing import Any

import lmdb

from .environment import Index
from .schema import ATIME, KIDS, LRU_NS, parent_key_bytes

__all__ = ["Tree", "parent_key_bytes"]

class Tree:
    """The prefix tree's index operations of one open store (inside write transactions).
    Without the tree's sub-databases (a readonly open of an older store) every record is
    a leaf with no parent and nothing is written."""

    def __init__(self, index: Index) -> None:
        self.index = index

    @property
    def enabled(self) -> bool:
        return self.index.dbs is not None and self.index.dbs.kids is not None

    def kids(self, txn: lmdb.Transaction, kb: bytes) -> int:
        """How many resident records name ``kb`` as their parent."""
        if not self.enabled:
            return 0
        raw = txn.get(kb, db=self.index.dbs.kids)  # type: ignore[union-attr]
        return self.index.field(KIDS, raw, "a child count")[0] if raw is not None else 0

    def order_db(self, txn: lmdb.Transaction, kb: bytes) -> Any:
        """The order table ``kb``'s access entry belongs in: ``parked`` while it has a
        resident child, else ``lru``."""
        dbs = self.index.dbs
        assert dbs is not None
        return dbs.parked if self.kids(txn, kb) else dbs.lru

    def link(self, txn: lmdb.Transaction, kb: bytes, pkb: bytes) -> None:
        """Record that ``kb`` (just indexed) is a child of ``pkb``; a resident parent that
        had no child moves to ``parked``."""
        dbs = self.index.dbs
        if not self.enabled or pkb == kb:
            return
        assert dbs is not None
        old = txn.get(kb, db=dbs.parent)
        if old is not None:  # (a replaced corrupt record: its link is unlinked first)
            self._count(txn, bytes(old), -1)
        txn.put(kb, pkb, db=dbs.parent)
        if self._count(txn, pkb, +1) == 1:
            self._move(txn, pkb, dbs.lru, dbs.parked)

    def unlink(self, txn: lmdb.Transaction, kb: bytes) -> bytes | None:
        """Forget ``kb``'s link (its record is being removed). Returns its parent when
        that parent is resident and ``kb`` was its last child (now a leaf, moved to
        ``lru``), else None."""
        dbs = self.index.dbs
        if not self.enabled:
            return None
        assert dbs is not None
        raw = txn.get(kb, db=dbs.parent)
        if raw is None:
            return None
        pkb = bytes(raw)
        txn.delete(kb, db=dbs.parent)
        if self._count(txn, pkb, -1) == 0 and self._move(txn, pkb, dbs.parked, dbs.lru):
            return pkb
        return None

    def _count(self, txn: lmdb.Transaction, kb: bytes, delta: int) -> int:
        """Add ``delta`` to ``kb``'s child count (never below 0; deleted at 0); returns it."""
        db = self.index.dbs.kids  # type: ignore[union-attr]
        n = max(0, self.kids(txn, kb) + delta)
        if n:
            txn.put(kb, KIDS.pack(n), db=db)
        else:
            txn.delete(kb, db=db)
        return n

    def _move(self, txn: lmdb.Transaction, kb: bytes, src: Any, dst: Any) -> bool:
        """Move resident ``kb``'s access entry from order table ``src`` to ``dst``; False
        if ``kb`` is not resident."""
        raw = txn.get(kb, db=self.index.dbs.atime)  # type: ignore[union-attr]
        if raw is None:
            return False
        ns = self.index.field(ATIME, raw, "an access-time entry")[0]
        okey = LRU_NS.pack(ns) + kb
        txn.delete(okey, db=src)
        txn.put(okey, b"", db=dst)
        return True
