"""The LMDB store's writes: a ``put_many`` staged, appended to this process's segment, synced
and indexed through the group commit, and deletes.

A ``put_many`` stages its new records in an aligned buffer and appends them to a range of
this process's active segment reserved for it (``O_DIRECT`` where the filesystem takes
it); concurrent calls of this process's threads write their ranges in parallel. Then,
group commit (:mod:`.group_commit`): one of the waiting calls ``fdatasync``s the segment
once for every batch written so far and commits all their index entries in one LMDB
transaction (one data flush, no meta flush: ``MDB_NOMETASYNC``), and wakes the others,
each with its own results. Each writer process appends to its own segment (flock'ed), so
writers of different processes never coordinate beyond LMDB's write lock.

Durability: the segment is the write-ahead log; each index transaction stores
``segment_end`` of the segments it indexed into (:mod:`.recovery`). A crash before
``put_many`` returns leaves each record of the batch indexed (and durable), recovered, or
a miss; the index never points at segment bytes that were not synced, and every read
verifies anyway. Other transactions (deletes, evictions, access times) survive kill -9
when they return; an OS crash may undo the last one.

Full disk: segment space is reserved with ``posix_fallocate`` before a batch is written,
so a full disk raises :class:`StoreFullError` with nothing appended.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lmdb
import numpy as np

from ..api.counters import StoreStats
from ..api.store import PutItem
from ..errors import StoreFullError
from ..format.record import CHECKSUM_BYTES, encode_record_into, record_size
from .access import AccessTimes
from .environment import Index
from ..os.faults import Faults
from .group_commit import REWRITE, SYNCED, FaultPoint, GroupCommit
from .schema import M_NEXT_SEGMENT, U32, U64, Location, bump_segment_gen, pack_entry, parent_key_bytes, segment_end_key
from .segments import Appended, SegmentFiles
from .store_reads import StoreReads

__all__ = ["PutBatch", "Writes", "new_segment_id"]


@dataclass(eq=False, slots=True)
class PutBatch:
    """One ``put_many`` call on its way through the group commit: its items, the index
    values seen before (``seen``), which items are new records (``new``); once written,
    ``appended`` (its range of the segment, until indexed or given up) and ``locs``
    (item index -> location, checksum)."""

    items: list[PutItem]
    kbs: list[bytes]
    sizes: list[int]
    seen: list[bytes | None]
    new: list[int]
    appended: Appended | None = None
    locs: dict[int, tuple[Location, bytes]] = field(default_factory=dict)

    @property
    def start(self) -> int:
        """Where its records start in their segment (0 if none)."""
        return self.appended.start if self.appended is not None else 0


class Writes:
    """The write side of one open LMDB store (see the module docstring). ``commits``: the
    store's group commit, whose two stages are :meth:`sync_group` and :meth:`index_group`."""

    def __init__(self, index: Index, access: AccessTimes, segments: SegmentFiles, reads: StoreReads,
                 stats: StoreStats, faults: Faults, *, layout_fingerprint: str, max_bytes: int) -> None:
        self.index = index
        self.faults = faults
        self.access = access
        self.segments = segments
        self.reads = reads
        self.stats = stats
        self.layout_fingerprint = layout_fingerprint
        self.max_bytes = max_bytes
        self.commits: GroupCommit[PutBatch] | None = None  # set by the store (it makes the group commit)

    # ------------------------------------------------------------------ put_many
    def put_many(self, items: list[PutItem]) -> list[bool]:
        """:meth:`~tiered_kv.storage.api.store.BlockStore.put_many` of checked items."""
        commits = self.commits
        assert commits is not None
        batch = self._prepare(items)
        try:
            while True:
                if batch.new:
                    self._append(batch)
                outcome = commits.submit(batch)
                if outcome is not REWRITE:
                    break
        finally:
            if batch.appended is not None:  # not committed (the store closed before its turn)
                self.segments.give_up([batch.appended])
        results, evicted, corrupt, written, freed, gone = outcome
        self.segments.punch(freed)
        self.stats.add(puts=sum(results), put_bytes=written, evictions=evicted, corrupt=corrupt)
        self.access.report_evicted(gone)
        return results

    def _prepare(self, items: list[PutItem]) -> PutBatch:
        """What one ``put_many`` writes: record sizes, which keys are new (an indexed key
        keeps its record if it verifies: write-once; a corrupt one is replaced), the index
        values seen. StoreFullError: a record larger than ``max_bytes``."""
        sizes = [record_size(item.payload_bytes) for item in items]
        for item, size in zip(items, sizes):
            if size > self.max_bytes:
                raise StoreFullError(f"{self.index.path}: record {item.key!r} of {size} bytes is larger "
                                     f"than max_bytes={self.max_bytes}")
        kbs = [item.key.to_bytes() for item in items]
        seen = self.reads.lookup(kbs)
        present = {i for i, v in enumerate(seen) if v is not None}
        corrupt_seen = self._corrupt_among([(i, items[i].key, seen[i]) for i in sorted(present)])
        first: dict[bytes, int] = {}
        for i, kb in enumerate(kbs):
            first.setdefault(kb, i)
        new = [i for i, kb in enumerate(kbs) if first[kb] == i and (i not in present or i in corrupt_seen)]
        return PutBatch(items, kbs, sizes, seen, new)

    def _corrupt_among(self, present: list[tuple[int, Any, Any]]) -> set[int]:
        """Which of the indexed records ``(index, key, index value)`` fail their checks."""
        if not present:
            return set()
        _, failed = self.reads.read_locked([(i, key, value, None, None) for i, key, value in present])
        return set(failed)

    def _append(self, batch: PutBatch) -> None:
        """Encode ``batch``'s new records into this thread's staging buffer and write them
        to a range of the segment reserved for it (in parallel with other writers); not
        yet synced. Sets ``batch.appended`` and ``batch.locs``. StoreFullError: the disk
        is full (nothing of this batch was kept)."""
        checksums: list[bytes] = []
        hook = self.commits.hook  # type: ignore[union-attr]

        def fill(j: int, dst: np.ndarray) -> None:
            item = batch.items[batch.new[j]]
            encode_record_into(dst, key=item.key, parent_hash=item.parent_hash, token_digest=item.token_digest,
                               layout_fingerprint=self.layout_fingerprint, payload=item.payload)
            checksums.append(bytes(dst[-CHECKSUM_BYTES:]))
            hook(FaultPoint.STAGED, j)

        try:
            appended = self.segments.append_records([batch.sizes[i] for i in batch.new], fill)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StoreFullError(f"{self.index.path}: disk full ({e}); nothing was written by this call, "
                                     f"stored records are intact") from e
            raise
        batch.appended = appended
        batch.locs = {i: (loc, checksum) for i, loc, checksum in zip(batch.new, appended.locations, checksums)}
        hook(FaultPoint.APPENDED, batch)

    # ------------------------------------------------------------------ the group commit's stages
    def sync_group(self, batches: list[PutBatch]) -> list[Any]:
        """The sync stage of a group of written batches (a leader's work, see
        group_commit.py): one ``fdatasync`` per segment they lie in. Returns each batch's
        outcome: SYNCED (its index entries may now be committed: the index never points at
        bytes that are not durable), REWRITE (its segment was given up by a failed sync),
        or the error of the failed sync (its bytes are given up)."""
        commits = self.commits
        assert commits is not None
        outcomes: list[Any] = [SYNCED] * len(batches)
        for j, b in enumerate(batches):
            if b.appended is not None and b.appended.segment.failed:  # a failed sync gave its segment up
                self.segments.give_up([b.appended])
                b.appended, outcomes[j] = None, REWRITE
        live = [j for j, outcome in enumerate(outcomes) if outcome is SYNCED]
        appended = [batches[j].appended for j in live if batches[j].appended is not None]
        if appended:
            try:
                self.segments.sync(appended)
            except BaseException as e:  # every batch of the sync fails with it
                self.segments.give_up(appended, sync_failed=True)
                for j in live:
                    batches[j].appended, outcomes[j] = None, e
                return outcomes
        commits.hook(FaultPoint.SYNCED, len(live))
        return outcomes

    def index_group(self, group: list[PutBatch]) -> list[Any]:
        """The index stage of a group: its synced batches in one transaction (with the
        queued access times and each segment's indexed end); if it fails for a group of
        several, each batch in a transaction of its own, in segment order, so that only
        the batches that fail alone get an error (their bytes are given back). Returns
        each batch's outcome (its index_puts result or its error); releases every
        batch's segment range."""
        outcomes = self.index_txns(group)
        self.commits.hook(FaultPoint.INDEXED, len(group))  # type: ignore[union-attr]
        return outcomes

    def index_txns(self, group: list[PutBatch]) -> list[Any]:
        self.faults.hit(FaultPoint.INDEXING, group)
        appended = [b.appended for b in group if b.appended is not None]
        ends = self.segments.indexed_ends(appended)
        taken = self.access.take()
        try:
            outcomes: list[Any] = self.index.run(lambda txn: self.index_txn(txn, group, ends, taken),
                                                 write=True, need=len(group) << 13)
        except BaseException as e:
            self.access.restore(taken)
            if len(group) == 1:
                self._settle(group, given_up=True)
                return [e]
        else:
            self._settle(group, given_up=False)
            return outcomes
        outcomes = [None] * len(group)
        for j in sorted(range(len(group)), key=lambda j: (group[j].appended is None, group[j].start)):
            b = group[j]
            mine = [b.appended] if b.appended is not None else []
            ends = self.segments.indexed_ends(mine)
            try:
                outcomes[j] = self.index.run(lambda txn: self.index_txn(txn, [b], ends, {})[0], write=True,
                                             need=8 << 10)
            except BaseException as e:
                outcomes[j] = e
                self._settle([b], given_up=True)
            else:
                self._settle([b], given_up=False)
        return outcomes

    def _settle(self, batches: list[PutBatch], *, given_up: bool) -> None:
        """The batches' segment ranges are indexed (released) or will not be (given up)."""
        appended = [b.appended for b in batches if b.appended is not None]
        for b in batches:
            b.appended = None
        if given_up:
            self.segments.give_up(appended)
        else:
            self.segments.release(appended)

    def index_txn(self, txn: lmdb.Transaction, batches: list[PutBatch], ends: dict[int, int],
                  taken: dict[bytes, int]) -> list[Any]:
        """One index transaction: the queued access times, each segment's indexed end
        (``ends``: a recovery scan starts there), then each batch's records."""
        meta = self.index.dbs.meta  # type: ignore[union-attr]
        self.faults.hit(FaultPoint.INDEX_TXN, batches)
        self.access.apply(txn, taken)
        for seg, end in ends.items():
            txn.put(segment_end_key(seg), U64.pack(end), db=meta)
            bump_segment_gen(txn, meta, seg)
        return [self.index_puts(txn, b.items, b.kbs, b.sizes, b.seen, b.new, b.locs) for b in batches]

    def index_puts(self, txn: lmdb.Transaction, items: Sequence[PutItem], kbs: list[bytes], sizes: list[int],
                   seen: list[bytes | None], new: list[int], locs: dict[int, tuple[Location, bytes]]
                   ) -> tuple[list[bool], int, int, int, list[Location], list[bytes]]:
        """Index one ``put_many``'s records (in the group's transaction). Returns
        ``(results, evicted, corrupt replaced, bytes written, locations to punch, key bytes
        evicted)``."""
        self.faults.hit(FaultPoint.INDEX_BATCH, kbs)
        records = self.index.dbs.records  # type: ignore[union-attr]
        access = self.access
        total = self.index.get_total(txn)
        freed: list[Location] = []
        gone: list[bytes] = []
        results: list[bool] = []
        evicted = corrupt = written = 0
        new_set = set(new)
        for i, (kb, size) in enumerate(zip(kbs, sizes)):
            now = txn.get(kb, db=records)
            now = bytes(now) if now is not None else None
            if i not in new_set:
                if now is not None:
                    access.touch(txn, kb, access.now_ns())
                results.append(False)  # (None: gone meanwhile, deleted / evicted: nothing of ours to index)
                continue
            loc, checksum = locs[i]
            if now is not None:
                if now != seen[i]:  # another writer stored it meanwhile: keep theirs
                    freed.append(loc)
                    access.touch(txn, kb, access.now_ns())
                    results.append(False)
                    continue
                corrupt += 1  # the corrupt record we saw: replaced
                total -= access.remove(txn, kb, freed)
            total, n = access.evict_for(txn, total, size, freed, gone=gone)
            evicted += n
            txn.put(kb, pack_entry(loc, checksum), db=records)
            access.touch(txn, kb, access.now_ns(), size=size)
            key = items[i].key
            access.link(txn, kb, parent_key_bytes(key.kind, key.block_hash, items[i].parent_hash))
            total += size
            written += size
            results.append(True)
        access.put_total(txn, total)
        return results, evicted, corrupt, written, freed, gone

    # ------------------------------------------------------------------ delete
    def delete(self, kb: bytes) -> bool:
        """Unindex the record of key bytes ``kb``; True if there was one."""
        records = self.index.dbs.records  # type: ignore[union-attr]
        self.access.forget(kb)
        freed: list[Location] = []

        def remove(txn: lmdb.Transaction) -> bool:
            if txn.get(kb, db=records) is None:
                return False
            self.access.put_total(txn, self.index.get_total(txn) - self.access.remove(txn, kb, freed))
            return True

        gone = self.index.run(remove, write=True)
        self.segments.punch(freed)
        return gone


def new_segment_id(index: Index) -> int:
    """A fresh segment id from the index's counter (ids are never reused), its
    ``segment_end`` set to 0 in the same transaction."""
    meta = index.dbs.meta  # type: ignore[union-attr]

    def take(txn: lmdb.Transaction) -> int:
        raw = txn.get(M_NEXT_SEGMENT, db=meta)
        seg = index.field(U32, raw, "meta next_segment")[0] if raw is not None else 1
        txn.put(M_NEXT_SEGMENT, U32.pack(seg + 1), db=meta)
        txn.put(segment_end_key(seg), U64.pack(0), db=meta)
        return seg

    return index.run(take, write=True)
