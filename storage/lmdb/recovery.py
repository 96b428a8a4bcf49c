"""Recovery: index what writers that died (kill -9, an OS crash) appended past their
segments' indexed end.

Each index transaction of a writer stores ``segment_end`` of the segments it indexed into:
below it every batch is indexed or given up (it stops at the lowest range another thread
of the writer is still writing or committing). So when ``put_many`` returns, its records
survive kill -9, an OS crash and power loss: the segment bytes are synced, and if the OS
crash took the index transaction with it, the records lie past ``segment_end`` and are
recovered here, on a writable open and before ``gc`` / ``verify(repair=True)`` reclaim
space. Each segment no writer holds is scanned from its ``segment_end`` to its end
(:mod:`.scan`), and every record that verifies (header, xxh3-128 checksum, fingerprint)
and whose key is not indexed is indexed; torn or failing records never are (a segment
whose id allocation the index lost is scanned from 0; ids are never reused).
"""

from __future__ import annotations

import os

import lmdb

from .access import AccessTimes
from .environment import Index
from .scan import scan_segment
from .schema import M_NEXT_SEGMENT, U32, U64, Location, bump_segment_gen, pack_entry, segment_end_key
from .segments import SegmentFiles

__all__ = ["Recovery"]


class Recovery:
    """The recovery scan of one open store (see the module docstring)."""

    def __init__(self, index: Index, access: AccessTimes, segments: SegmentFiles, *, layout_fingerprint: str,
                 max_bytes: int) -> None:
        self.index = index
        self.access = access
        self.segments = segments
        self.layout_fingerprint = layout_fingerprint
        self.max_bytes = max_bytes
        #: records indexed by the scans of this handle
        self.recovered = 0

    def recover(self) -> int:
        """Scan every segment no writer holds from its ``segment_end`` and index what
        verifies; then ``segment_end`` moves to the segment's end. Returns how many
        records were indexed."""
        recovered = 0
        for seg in self.segments.segment_ids():
            with self.segments.sealed(seg) as fd:
                if fd is None:
                    continue
                start = self.index.run(lambda txn: self.indexed_end(txn, seg), write=False)
                size = os.fstat(fd).st_size
                if start is None or start >= size:
                    continue  # fully indexed (or a segment of a store written before this scan)
                try:
                    found = scan_segment(fd, seg, start, size, self.layout_fingerprint)
                except OSError:
                    continue  # unreadable (EIO): its records stay misses, the next open tries again
                n, freed = self.index.run(lambda txn: self.index_records(txn, seg, found, size), write=True,
                                          need=8 << 10)
            self.segments.punch(freed)
            recovered += n
        self.recovered += recovered
        return recovered

    def indexed_end(self, txn: lmdb.Transaction, seg: int) -> int | None:
        """Where the recovery scan of segment ``seg`` starts: its ``segment_end``; 0 for a
        segment whose id allocation the index lost (an OS crash: nothing can point into
        it); None for a segment of a store written before segment ends were kept."""
        meta = self.index.dbs.meta  # type: ignore[union-attr]
        raw = txn.get(segment_end_key(seg), db=meta)
        if raw is not None:
            return self.index.field(U64, raw, "meta segment_end")[0]
        nxt = txn.get(M_NEXT_SEGMENT, db=meta)
        return 0 if nxt is not None and seg >= self.index.field(U32, nxt, "meta next_segment")[0] else None

    def index_records(self, txn: lmdb.Transaction, seg: int, found: list[tuple[bytes, Location, bytes, bytes]],
                      size: int) -> tuple[int, list[Location]]:
        """Index the records ``found`` in segment ``seg`` (those whose key is not indexed),
        and move its ``segment_end`` to ``size``; returns (records indexed, locations of
        the records eviction freed, to punch)."""
        dbs = self.index.dbs
        assert dbs is not None
        total = self.index.get_total(txn)
        freed: list[Location] = []
        n = 0
        for kb, loc, checksum, parent_kb in found:
            if loc.length > self.max_bytes or txn.get(kb, db=dbs.records) is not None:
                continue  # write-once: an indexed key keeps its record
            total, _ = self.access.evict_for(txn, total, loc.length, freed)
            txn.put(kb, pack_entry(loc, checksum), db=dbs.records)
            self.access.touch(txn, kb, self.access.now_ns(), size=loc.length)
            self.access.link(txn, kb, parent_kb)
            total += loc.length
            n += 1
        self.access.put_total(txn, total)
        txn.put(segment_end_key(seg), U64.pack(size), db=dbs.meta)
        if n:
            bump_segment_gen(txn, dbs.meta, seg)
        return n, freed
