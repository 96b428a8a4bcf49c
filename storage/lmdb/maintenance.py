"""The LMDB store's maintenance: ``verify`` (and its repair), ``gc``, reclaiming segment
space, and the index reserve that lets gc delete on a full disk.

**verify** checks the index itself whole first: every page of every sub-database is walked
(:mod:`.pages`), then every entry of ``meta``, ``atime``, ``lru`` and ``parked`` is checked
against its format and against ``records``, and the prefix tree (:mod:`.tree`: ``parent``,
``kids``) against the links of the indexed records; then every record is read and
verified, in batches. With ``repair``, the bad records are unindexed (each only if its
entry is still the one that failed), the entries that do not fit are fixed (the tree is
recounted from the links), the total is set to the actual bytes, and unindexed segment
space is given back (as gc does).

**Reclaiming space** (``gc``, ``verify(repair=True)``): recovery runs first, then one read
transaction collects every segment's live ranges and ``segment_gen``, then each segment is
locked (its ``flock``) in turn and given back what no entry covers
(:meth:`~.segments.SegmentFiles.reclaim`). Only the holder of a segment's lock commits
index entries into it, so once gc holds the lock the segment's entries cannot change but
by deletes; a ``segment_gen`` that moved since the snapshot means entries were indexed
into it meanwhile (a writer that committed, then let go, before gc got there; a recovery
in another process): that segment is left for the next gc. So gc only gives back bytes
that no committed index entry covers while it holds the segment's lock. Bytes past a
segment's ``segment_end`` (recovery could not index them: a full disk) are kept too.

**Full disk.** The index is copy-on-write, so even a delete needs new pages: a writable
open holds ``index.reserve`` (``index_reserve_bytes``: allocated, never written), which
``gc`` on a full disk gives to its deletes, in transactions of a few records each followed
by its punched holes, and takes back once there is room.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from ..api.counters import StoreStats
from ..api.store import check_open
from ..errors import IndexDamagedError, StoreFullError
from ..format.record import KEY_BYTES, RecordKey
from .access import ACCESS_QUEUE_MAX, AccessTimes
from .environment import Index
from .pages import IndexDamage
from .recovery import Recovery
from .schema import (
    ATIME,
    KIDS,
    LRU_NS,
    M_COUNTERS,
    M_NEXT_SEGMENT,
    M_SEGMENT_END,
    M_SEGMENT_GEN,
    M_TOTAL,
    U32,
    U32BE,
    U64,
    Location,
    meta_value_bytes,
    segment_end_key,
    segment_gen_key,
    unpack_entry,
)
from .segments import Reclaimable, SegmentFiles
from .store_reads import Job, StoreReads

__all__ = ["Maintenance"]

#: ``index.reserve``: disk held for the index's deletes on a full disk (see gc)
RESERVE_NAME = "index.reserve"
_MiB = 1 << 20
_DEFAULT_RESERVE = 4 * _MiB  # or 1/64 of the filesystem if that is less, but at least:
_MIN_RESERVE = 256 << 10
#: records per eviction transaction once the disk is full (each one's holes punched before the next)
_GC_FULL_DISK_BATCH = 4
#: records of one verify read, and their bytes at most
_VERIFY_BATCH, _VERIFY_BATCH_BYTES = 256, 64 << 20


@dataclass(slots=True)
class _EntryProblem:
    """A kind of malformed or inconsistent index entry: how many, and the first key."""

    kind: str
    count: int
    first_key: bytes

    def line(self) -> str:
        return f"{self.kind}: {self.count} (first key {self.first_key.hex()[:80]})"


class Maintenance:
    """verify, gc and the index reserve of one open store (see the module docstring).
    ``reserve_bytes``: the reserve's size (None: 4 MiB, or 1/64 of a smaller filesystem)."""

    def __init__(self, index: Index, access: AccessTimes, segments: SegmentFiles, reads: StoreReads,
                 recovery: Recovery, stats: StoreStats, *, reserve_bytes: int | None) -> None:
        self.index = index
        self.access = access
        self.segments = segments
        self.reads = reads
        self.recovery = recovery
        self.stats = stats
        self.reserve_bytes = reserve_bytes

    # ------------------------------------------------------------------ verify
    def verify(self, *, repair: bool) -> dict[str, Any]:
        """See :meth:`~tiered_kv.storage.lmdb.LmdbStore.verify`."""
        with self.index.rw.shared():
            check_open(self.index.closed, str(self.index.path))
            try:
                self.index.walk_snapshot()
            except IndexDamage as e:
                raise IndexDamagedError(str(self.index.path), str(e)) from None
        index_problems = self.index.run(lambda txn: [p.line() for p in self._entry_problems(txn)], write=False)
        entries, accounted = self.index.run(self._all_entries, write=False)
        bad, actual = self._verify_records(entries)
        removed = self._repair(bad, index_problems) if repair else 0
        return {"checked": len(entries), "corrupt": len(bad), "removed": removed,
                "corrupt_keys": [kb.hex() for kb, _ in bad], "accounted_bytes": accounted,
                "actual_bytes": actual, "index_problems": index_problems, "index_rebuilt": self.index.index_rebuild}

    def _all_entries(self, txn: lmdb.Transaction) -> tuple[list[tuple[bytes, bytes]], int | None]:
        """Every ``records`` entry, and the accounted total (None: unreadable)."""
        dbs = self.index.dbs
        assert dbs is not None
        raw = txn.get(M_TOTAL, db=dbs.meta)
        total = U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == U64.size else None
        return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=dbs.records)], total

    def _verify_records(self, entries: list[tuple[bytes, bytes]]) -> tuple[list[tuple[bytes, bytes]], int]:
        """Read and verify every entry's record, in batches; returns the bad entries and
        the bytes of the indexed records."""
        actual = 0
        bad: list[tuple[bytes, bytes]] = []
        batch: list[Job] = []
        batch_bytes = 0

        def run_batch() -> None:
            nonlocal batch, batch_bytes
            with self.index.rw.shared():
                _, failed = self.reads.read_verified(batch)
            bad.extend(entries[i] for i in failed)
            batch, batch_bytes = [], 0

        for i, (kb, value) in enumerate(entries):
            found = unpack_entry(value)
            actual += found[0].length if found is not None else 0
            try:
                key = RecordKey.from_bytes(kb)
            except ValueError:  # the stored key is not a RecordKey
                bad.append((kb, value))
                continue
            batch.append((i, key, value, None, None))
            batch_bytes += found[0].length if found is not None else 0
            if batch_bytes >= _VERIFY_BATCH_BYTES or len(batch) >= _VERIFY_BATCH:
                run_batch()
        if batch:
            run_batch()
        return bad, actual

    def _repair(self, bad: list[tuple[bytes, bytes]], index_problems: list[str]) -> int:
        """verify's repair: fix the entries, unindex the bad records, recount the total,
        re-enter records missing from the LRU index, give back unindexed space."""
        if index_problems:
            self.index.run(self._repair_entries, write=True)
        removed = self.reads.remove_if_corrupt(bad)
        freed: list[Location] = []
        dbs = self.index.dbs
        assert dbs is not None

        def fix(txn: lmdb.Transaction) -> None:
            total = 0
            for kb, value in txn.cursor(db=dbs.records):
                kb = bytes(kb)
                found = unpack_entry(value)
                if found is None:
                    total -= self.access.remove(txn, kb, freed)
                    continue
                total += found[0].length
                if txn.get(kb, db=dbs.atime) is None:  # not in the LRU index: add it
                    self.access.touch(txn, kb, self.access.now_ns(), size=found[0].length)
            self.access.put_total(txn, max(total, 0))

        self.index.run(fix, write=True)
        self.segments.punch(freed)
        self.stats.add(corrupt=removed)
        self.reclaim()
        return removed

    def _entry_problems(self, txn: lmdb.Transaction) -> list[_EntryProblem]:
        """The entries of ``meta``, ``atime`` and ``lru`` that do not have their format or
        disagree with each other or with ``records``, and records without an access
        entry (a record's own entry is checked by reading the record). Grouped by kind."""
        dbs = self.index.dbs
        assert dbs is not None
        found: dict[str, _EntryProblem] = {}

        def note(kind: str, key: bytes) -> None:
            found.setdefault(kind, _EntryProblem(kind, 0, key)).count += 1

        for kb, value in txn.cursor(db=dbs.meta):  # (keys this code does not know are left alone)
            kb = bytes(kb)
            want = meta_value_bytes(kb)
            if want is not None and want >= 0 and len(value) != want:
                note("meta: a value of the wrong length", kb)
        nxt = txn.get(M_NEXT_SEGMENT, db=dbs.meta)
        on_disk = self.segments.segment_ids()
        if nxt is not None and len(nxt) == U32.size and on_disk and U32.unpack(bytes(nxt))[0] <= on_disk[-1]:
            note("meta: next_segment not past the last segment file", M_NEXT_SEGMENT)
        for kb, value in txn.cursor(db=dbs.atime):
            kb = bytes(kb)
            if len(kb) != KEY_BYTES or len(value) != ATIME.size:
                note("atime: an entry of the wrong length", kb)
            elif txn.get(kb, db=dbs.records) is None:
                note("atime: an entry of a record that is not indexed", kb)
            elif self._order_entry(txn, LRU_NS.pack(ATIME.unpack(bytes(value))[0]) + kb) is None:
                note("atime: an entry with no lru entry", kb)
        tree = self.access.tree
        for name, db in self._order_dbs():
            for kb, value in txn.cursor(db=db):
                kb = bytes(kb)
                if len(kb) != LRU_NS.size + KEY_BYTES or len(value) != 0:
                    note(f"{name}: an entry of the wrong length", kb)
                    continue
                at = txn.get(kb[LRU_NS.size:], db=dbs.atime)
                if at is None or len(at) != ATIME.size or ATIME.unpack(bytes(at))[0] != LRU_NS.unpack(kb[:8])[0]:
                    note(f"{name}: an entry that disagrees with atime", kb)
                elif tree.enabled and (db is dbs.parked) != (self._kids_of(txn, kb[LRU_NS.size:]) > 0):
                    note(f"{name}: a record in the wrong order table (its resident children say otherwise)", kb)
        for kb in txn.cursor(db=dbs.records).iternext(keys=True, values=False):
            if txn.get(kb, db=dbs.atime) is None:
                note("records: a record with no access entry", bytes(kb))
        if tree.enabled:
            for kind, kb in self._tree_problems(txn):
                note(kind, kb)
        return list(found.values())

    def _order_dbs(self) -> list[tuple[str, Any]]:
        """The order tables this store has: ``lru``, and ``parked`` with the tree."""
        dbs = self.index.dbs
        assert dbs is not None
        return [("lru", dbs.lru)] + ([("parked", dbs.parked)] if dbs.parked is not None else [])

    def _order_entry(self, txn: lmdb.Transaction, okey: bytes) -> Any:
        """The order table holding ``okey`` (None: neither)."""
        return next((db for _, db in self._order_dbs() if txn.get(okey, db=db) is not None), None)

    def _kids_of(self, txn: lmdb.Transaction, kb: bytes) -> int:
        raw = txn.get(kb, db=self.index.dbs.kids)  # type: ignore[union-attr]
        return KIDS.unpack(bytes(raw))[0] if raw is not None and len(raw) == KIDS.size else 0

    def _recount(self, txn: lmdb.Transaction) -> dict[bytes, int]:
        """The child count of every key, from the links of indexed records."""
        dbs = self.index.dbs
        assert dbs is not None
        counts: dict[bytes, int] = {}
        for kb, pkb in txn.cursor(db=dbs.parent):
            if len(pkb) == KEY_BYTES and txn.get(kb, db=dbs.records) is not None:
                counts[bytes(pkb)] = counts.get(bytes(pkb), 0) + 1
        return counts

    def _tree_problems(self, txn: lmdb.Transaction) -> list[tuple[str, bytes]]:
        """The prefix tree's entries that do not fit: links of records not indexed or of
        the wrong length, and child counts that disagree with the links."""
        dbs = self.index.dbs
        assert dbs is not None
        out: list[tuple[str, bytes]] = []
        for kb, pkb in txn.cursor(db=dbs.parent):
            if len(kb) != KEY_BYTES or len(pkb) != KEY_BYTES:
                out.append(("parent: an entry of the wrong length", bytes(kb)))
            elif txn.get(kb, db=dbs.records) is None:
                out.append(("parent: a link of a record that is not indexed", bytes(kb)))
        counts = self._recount(txn)
        for kb, raw in txn.cursor(db=dbs.kids):
            if len(raw) != KIDS.size or KIDS.unpack(bytes(raw))[0] != counts.pop(bytes(kb), 0):
                out.append(("kids: a count that disagrees with the links", bytes(kb)))
        out.extend(("kids: a count that disagrees with the links", kb) for kb in counts)
        return out

    def _repair_tree(self, txn: lmdb.Transaction) -> None:
        """Recount the prefix tree from the links of indexed records (links that do not
        fit are dropped) and put every access entry in the order table its count says."""
        dbs = self.index.dbs
        assert dbs is not None
        stale = [bytes(kb) for kb, pkb in txn.cursor(db=dbs.parent)
                 if len(kb) != KEY_BYTES or len(pkb) != KEY_BYTES or txn.get(kb, db=dbs.records) is None]
        for kb in stale:
            txn.delete(kb, db=dbs.parent)
        counts = self._recount(txn)
        txn.drop(dbs.kids, delete=False)
        for kb, n in counts.items():
            txn.put(kb, KIDS.pack(n), db=dbs.kids)
        for kb, value in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=dbs.atime)]:
            if len(value) != ATIME.size:
                continue
            okey = LRU_NS.pack(ATIME.unpack(value)[0]) + kb
            src = self._order_entry(txn, okey)
            dst = dbs.parked if counts.get(kb, 0) else dbs.lru
            if src is not None and src is not dst:
                txn.delete(okey, db=src)
                txn.put(okey, b"", db=dst)

    def _repair_entries(self, txn: lmdb.Transaction) -> None:
        """Fix what :meth:`_entry_problems` finds: access entries of the wrong length or
        of records not indexed are deleted (the repair then gives each record without one
        a fresh access time), a bad ``segment_end`` is set to 0 (the next recovery scans
        the segment whole; indexed keys are skipped), a bad ``segment_gen`` is set to 0,
        bad counters are reset, ``next_segment`` moves past the last segment file."""
        self._drop_stale_access(txn)
        dbs = self.index.dbs
        assert dbs is not None
        if self.access.tree.enabled:
            self._repair_tree(txn)
        for kb, value in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=dbs.meta)]:
            want = meta_value_bytes(kb)
            if want is None or want < 0 or len(value) == want:
                continue
            if kb.startswith(M_SEGMENT_END):
                txn.put(kb, U64.pack(0), db=dbs.meta)
            elif kb.startswith(M_SEGMENT_GEN):
                txn.put(kb, U64.pack(0), db=dbs.meta)  # (moved: a gc that read it skips the segment)
            elif kb in (M_COUNTERS, M_TOTAL):
                txn.delete(kb, db=dbs.meta)  # counters restart; the total is recomputed
        on_disk = self.segments.segment_ids()
        nxt = txn.get(M_NEXT_SEGMENT, db=dbs.meta)
        if on_disk and (nxt is None or len(nxt) != U32.size or U32.unpack(bytes(nxt))[0] <= on_disk[-1]):
            txn.put(M_NEXT_SEGMENT, U32.pack(on_disk[-1] + 1), db=dbs.meta)

    def _drop_stale_access(self, txn: lmdb.Transaction) -> None:
        """Delete the ``atime`` and ``lru`` entries that do not fit (see _repair_entries)."""
        dbs = self.index.dbs
        assert dbs is not None
        stale_atime = [bytes(k) for k, v in txn.cursor(db=dbs.atime)
                       if len(k) != KEY_BYTES or len(v) != ATIME.size or txn.get(k, db=dbs.records) is None]
        for kb in stale_atime:
            txn.delete(kb, db=dbs.atime)
        for _, db in self._order_dbs():
            stale_lru = []
            for kb in txn.cursor(db=db).iternext(keys=True, values=False):
                kb = bytes(kb)
                at = txn.get(kb[LRU_NS.size:], db=dbs.atime) if len(kb) == LRU_NS.size + KEY_BYTES else None
                if at is None or ATIME.unpack(bytes(at))[0] != LRU_NS.unpack(kb[:8])[0]:
                    stale_lru.append(kb)
            for kb in stale_lru:
                txn.delete(kb, db=db)
        for kb in [bytes(k) for k in txn.cursor(db=dbs.atime).iternext(keys=True, values=False)]:
            ns = ATIME.unpack(bytes(txn.get(kb, db=dbs.atime)))[0]
            if self._order_entry(txn, LRU_NS.pack(ns) + kb) is None:
                txn.delete(kb, db=dbs.atime)  # re-touched by verify's repair

    # ------------------------------------------------------------------ gc
    def gc(self, max_bytes: int) -> dict[str, Any]:
        """See :meth:`~tiered_kv.storage.lmdb.LmdbStore.gc`."""
        evicted = freed_bytes = 0
        batch, full = ACCESS_QUEUE_MAX, False
        while True:
            taken = {} if full else self.access.take()  # (a full disk: no page to spare for hints)
            freed: list[Location] = []
            keys: list[bytes] = []
            try:
                n, gone, left = self.index.run(lambda txn: self._evict(txn, taken, freed, max_bytes, batch, keys),
                                               write=True)
            except StoreFullError:
                self.access.restore(taken)
                if full and batch == _GC_FULL_DISK_BATCH:
                    raise
                full = True
                self.release_reserve()
                batch = max(_GC_FULL_DISK_BATCH, batch // 64)
                continue
            except BaseException:
                self.access.restore(taken)
                raise
            self.segments.punch(freed)
            self.access.report_evicted(keys)
            evicted += n
            freed_bytes += gone
            if left <= max_bytes or n == 0:
                break
        self.stats.add(evictions=evicted)
        records = self.index.run(lambda txn: txn.stat(self.index.dbs.records)["entries"],  # type: ignore[union-attr]
                                 write=False)
        out = {"evicted": evicted, "freed_bytes": freed_bytes, "bytes": left, "records": records,
               **self.reclaim(), "full_disk": full}
        self.keep_reserve()
        return out

    def _evict(self, txn: lmdb.Transaction, taken: dict[bytes, int], freed: list[Location], max_bytes: int,
               batch: int, keys: list[bytes]) -> tuple[int, int, int]:
        """One gc transaction: the queued access times, then up to ``batch`` evictions
        towards ``max_bytes`` (their key bytes into ``keys``, emptied first: a transaction
        retried starts over). Returns (evicted, bytes freed, bytes left)."""
        keys.clear()
        self.access.apply(txn, taken)
        total = self.index.get_total(txn)
        left, n = self.access.evict_for(txn, total, 0, freed, limit=max_bytes, max_records=batch, gone=keys)
        self.access.put_total(txn, left)
        return n, total - left, left

    def reclaim(self) -> dict[str, int]:
        """Give back the segment space no index entry covers, after indexing what dead
        writers left (recovery).

        One read transaction takes every segment's live ranges and ``segment_gen`` (the
        snapshot); then :meth:`SegmentFiles.reclaim` locks each segment in turn and asks
        :meth:`_reclaimable`, which reads the segment's ``segment_gen`` and
        ``segment_end`` again, now that the lock is held (the invariant: module docstring)."""
        try:
            self.recovery.recover()
        except StoreFullError:
            pass  # what it could not index is past its segment's segment_end: kept
        live, gens = self.index.run(self._snapshot, write=False)
        done = self.segments.reclaim(lambda seg: self._reclaimable(seg, live.get(seg, []), gens.get(seg)))
        self._forget_segments(done.removed)
        return {"segments_removed": len(done.removed), "punched_bytes": done.punched}

    def _snapshot(self, txn: lmdb.Transaction) -> tuple[dict[int, list[tuple[int, int]]], dict[int, bytes]]:
        """Every segment's live ranges (sorted) and ``segment_gen``, in one transaction."""
        dbs = self.index.dbs
        assert dbs is not None
        live: dict[int, list[tuple[int, int]]] = {}
        for value in txn.cursor(db=dbs.records).iternext(keys=False, values=True):
            found = unpack_entry(value)
            if found is not None:
                loc = found[0]
                live.setdefault(loc.segment, []).append((loc.offset, loc.end))
        for ranges in live.values():
            ranges.sort()
        gens: dict[int, bytes] = {}
        cur = txn.cursor(db=dbs.meta)
        ok = cur.set_range(M_SEGMENT_GEN)
        while ok and bytes(cur.key()).startswith(M_SEGMENT_GEN):
            key = bytes(cur.key())
            if len(key) == len(M_SEGMENT_GEN) + U32BE.size:
                gens[U32BE.unpack(key[len(M_SEGMENT_GEN):])[0]] = bytes(cur.value())
            ok = cur.next()
        return live, gens

    def _reclaimable(self, seg: int, live: list[tuple[int, int]], gen: bytes | None) -> Reclaimable | None:
        """What gc may give back of segment ``seg``, whose lock it holds: its ``live``
        ranges as the snapshot saw them, if nothing was indexed into it since (its
        ``segment_gen`` is still ``gen``; else None: the next gc), up to its
        ``segment_end`` (past it: not scanned by a recovery yet, kept)."""
        meta = self.index.dbs.meta  # type: ignore[union-attr]

        def read(txn: lmdb.Transaction) -> tuple[bytes | None, int | None]:
            raw = txn.get(segment_gen_key(seg), db=meta)
            return (None if raw is None else bytes(raw)), self.recovery.indexed_end(txn, seg)

        now, indexed_end = self.index.run(read, write=False)
        if now != gen:
            return None
        return Reclaimable(live, indexed_end)

    def _forget_segments(self, segs: list[int]) -> None:
        """Drop the ``meta`` entries of segments gc unlinked (ids are never reused).
        Best effort: on a full disk they stay (they take a few bytes each)."""
        if not segs:
            return
        meta = self.index.dbs.meta  # type: ignore[union-attr]

        def forget(txn: lmdb.Transaction) -> None:
            for seg in segs:
                txn.delete(segment_end_key(seg), db=meta)
                txn.delete(segment_gen_key(seg), db=meta)

        try:
            self.index.run(forget, write=True)
        except StoreFullError:
            pass

    # ------------------------------------------------------------------ the index reserve
    @property
    def reserve_file(self) -> Path:
        return self.index.path / RESERVE_NAME

    def keep_reserve(self) -> bool:
        """Hold ``index_reserve_bytes`` of disk in ``index.reserve`` (allocated, never
        written), for the deletes of a gc on a full disk: LMDB copies every page it
        changes, so even a delete needs new pages. Best effort: False where there is no
        room now (the next writable open or gc tries again). A reserve already there is
        kept as it is (its size is the store's)."""
        path = self.reserve_file
        if path.exists():
            return True
        st = os.statvfs(self.index.path)
        want = self.reserve_bytes or min(_DEFAULT_RESERVE, max(_MIN_RESERVE, st.f_blocks * st.f_frsize // 64))
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(fd, 0o600)  # whatever the umask
                os.posix_fallocate(fd, 0, want)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            return True
        except OSError:
            tmp.unlink(missing_ok=True)
            return False

    def release_reserve(self) -> bool:
        """Give the reserve's disk space back (to the transaction about to retry)."""
        try:
            self.reserve_file.unlink()
            return True
        except FileNotFoundError:
            return False
