"""The LMDB store's reads: index lookups, verified reads of the records, and what every read
does after them (count, unindex what is corrupt, queue access times).

One read transaction looks up every key; the records are then read in parallel by the
segment files' read engine (:mod:`.reads`: from the page cache when it holds them, straight
into the caller's buffers, natively by helper threads that take each record as soon as it
is prepared, hashed as it is read; else adjacent records of a segment in one ``O_DIRECT``
transfer), and each one is verified (header, xxh3-128 checksum against the record and the
index, fingerprint, key, token digest; see
:class:`~tiered_kv.storage.format.record.PartsVerifier`). A record that fails while the
index still points at it is corrupt: a miss, counted and unindexed. ``get_many`` and
``get_rows`` share the lookup and that bookkeeping (:meth:`StoreReads.settle`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lmdb
import numpy as np

from ..api.counters import StoreStats
from ..api.store import check_open
from ..errors import CorruptRecordError, RecordCheck, StoreFullError
from ..format.record import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    OutSegments,
    PartsVerifier,
    RecordKey,
    RecordMeta,
    as_out_segments,
    decode_record,
    write_segments,
)
from ..format.rows import RowScatter
from ..os import fastread
from .access import AccessTimes
from .environment import Index
from .read_tasks import ReadTask
from .schema import ENTRY, Location, unpack_entry
from .segments import SegmentFiles

__all__ = ["Job", "StoreReads"]

#: One record to read and verify: (index in the call, key, its index value, out as
#: OutSegments (None: into a fresh buffer, e.g. verify), expected token digest).
Job = tuple[int, RecordKey, bytes, OutSegments | None, bytes | None]


class StoreReads:
    """The read side of one open LMDB store (see the module docstring)."""

    def __init__(self, index: Index, access: AccessTimes, segments: SegmentFiles, stats: StoreStats, *,
                 layout_fingerprint: str, readonly: bool) -> None:
        self.index = index
        self.access = access
        self.segments = segments
        self.stats = stats
        self.layout_fingerprint = layout_fingerprint
        self.readonly = readonly
        self._verifier: PartsVerifier | None = None

    def parts_verifier(self) -> PartsVerifier:
        """The verifier of this store's fingerprint (made once: it holds no per-record state)."""
        v = self._verifier
        if v is None or v.fingerprint != self.layout_fingerprint:
            v = self._verifier = PartsVerifier(self.layout_fingerprint)
        return v

    # ------------------------------------------------------------------ shared by every read
    def lookup(self, kbs: list[bytes]) -> list[bytes | None]:
        """The index values of ``kbs`` (None: not indexed), in one read transaction."""
        records = self.index.dbs.records  # type: ignore[union-attr]
        return self.index.run(lambda txn: [None if (v := txn.get(kb, db=records)) is None else bytes(v)
                                           for kb in kbs], write=False)

    def settle(self, kbs: list[bytes], values: Sequence[bytes | None], failed: list[int], found: Sequence[Any], *,
               hits: int, misses: int) -> None:
        """What a read does after reading: count ``hits``/``misses``; the ``failed`` reads
        whose index entry did not change meanwhile are corrupt: counted and unindexed; an
        access is queued for each ``kbs[i]`` with ``found[i]`` true."""
        bad = self.still_indexed([(kbs[i], values[i]) for i in failed])
        self.stats.add(hits=hits, misses=misses, corrupt=len(bad))
        if bad and not self.readonly:
            self.remove_if_corrupt(bad)
        if hits and not self.readonly:
            self.access.queue_hits(kbs, found)

    def still_indexed(self, failed: list[tuple[bytes, bytes | None]]) -> list[tuple[bytes, bytes]]:
        """The failed reads whose index entry is unchanged: corrupt. The others raced with
        a delete, an eviction or a replacement by another writer: plain misses."""
        if not failed:
            return []
        records = self.index.dbs.records  # type: ignore[union-attr]

        def check(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
            out = []
            for kb, value in failed:
                now = txn.get(kb, db=records)
                if value is not None and now is not None and bytes(now) == value:
                    out.append((kb, value))
            return out

        return self.index.run(check, write=False)

    def remove_if_corrupt(self, bad: list[tuple[bytes, bytes]]) -> int:
        """Unindex the records of ``bad`` (key bytes, the index value that failed) whose
        index value is still that one (another process may have replaced it); returns how
        many were removed."""
        freed: list[Location] = []
        records = self.index.dbs.records  # type: ignore[union-attr]

        def remove(txn: lmdb.Transaction) -> int:
            total = self.index.get_total(txn)
            n = 0
            for kb, value in bad:
                now = txn.get(kb, db=records)
                if now is not None and bytes(now) == value:
                    total -= self.access.remove(txn, kb, freed)
                    n += 1
            self.access.put_total(txn, total)
            return n

        try:
            n = self.index.run(remove, write=True)
        except StoreFullError:
            # Deleting needs fresh pages (copy-on-write); on a full disk the bad record
            # stays indexed, and stays a miss: every read verifies it again.
            return 0
        self.segments.punch(freed)
        return n

    # ------------------------------------------------------------------ get_many
    def get_many(self, keys: list[RecordKey], dsts: list[OutSegments], digests: list[bytes | None], *,
                 hashed: bool = True) -> list[RecordMeta | None]:
        """:meth:`~tiered_kv.storage.api.store.BlockStore.get_many` of checked arguments
        (``hashed=False``: :meth:`~tiered_kv.storage.api.store.BlockStore.get_many_unhashed`)."""
        kbs = [key.to_bytes() for key in keys]
        values = self.lookup(kbs)
        jobs = [(i, keys[i], v, dsts[i], digests[i]) for i, v in enumerate(values) if v is not None]
        good, failed = self.read_locked(jobs, hashed=hashed)
        metas: list[RecordMeta | None] = [good.get(i) for i in range(len(keys))]
        self.settle(kbs, values, failed, metas, hits=len(good), misses=len(keys) - len(good))
        return metas

    def read_locked(self, jobs: list[Job], *, hashed: bool = True) -> tuple[dict[int, RecordMeta], list[int]]:
        """:meth:`read_verified` with the store held open meanwhile (closing waits)."""
        with self.index.rw.shared():
            check_open(self.index.closed, str(self.index.path))
            return self.read_verified(jobs, hashed=hashed)

    def read_verified(self, jobs: list[Job], *, hashed: bool = True) -> tuple[dict[int, RecordMeta], list[int]]:
        """Read and verify records (see :data:`Job`). Returns index -> meta for the good
        ones and the indices that failed (read or check). ValueError: an out buffer of the
        wrong size for a valid record. ``hashed=False``: every check but the xxh3 of the
        payload, which is not computed natively (the caller authenticates the payload).

        An index entry whose length does not fit in its segment file (torn, or corrupt:
        e.g. an absurd length) fails without allocating anything of that size."""
        verifier = self.parts_verifier()
        heads = np.empty((len(jobs), HEADER_BYTES), np.uint8)
        tasks: list[ReadTask] = []
        info: dict[int, tuple[RecordKey, bytes, bytes | None]] = {}
        odd: list[tuple[int, RecordKey, Location, Any, bytes | None]] = []
        failed: list[int] = []

        def check(t: ReadTask) -> None:  # in the reading thread, while the record is in the CPU cache
            key, checksum, digest = info[t.index]
            t.result = verifier.verify(t.header.tobytes(), t.digest, t.tail, key=key, record_bytes=t.loc.length,
                                       checksum=checksum, token_digest=digest, hashed=hashed)

        # Each task is handed to the reader as soon as it is made: natively, helper threads
        # read and check the first records while this loop prepares the next ones.
        reader = self.segments.reads.batch_read(
            len(jobs), sum(out.nbytes for _, _, _, out, _ in jobs if out is not None), check)
        try:
            self._hand_over(jobs, heads, reader, tasks, info, odd, failed, hashed)
        finally:
            reader.finish()
        metas: dict[int, RecordMeta] = {}
        head_bytes = heads.tobytes()  # (one copy for the batch: each meta slices its fields)
        for k, t in enumerate(tasks):
            if t.verified:  # checked by the native batch read
                t.result = verifier.meta(head_bytes[k * HEADER_BYTES:(k + 1) * HEADER_BYTES], info[t.index][0],
                                         t.loc.length)
            if t.result is None:
                failed.append(t.index)
            else:
                metas[t.index] = t.result
        self._read_odd(odd, metas, failed)
        return metas, sorted(failed)

    def _hand_over(self, jobs: list[Job], heads: np.ndarray, reader: Any, tasks: list[ReadTask],
                   info: dict[int, tuple[RecordKey, bytes, bytes | None]],
                   odd: list[tuple[int, RecordKey, Location, Any, bytes | None]], failed: list[int],
                   hashed: bool = True) -> None:
        """Make a task of each job and hand it to ``reader``; a job whose stored size is
        not its out's goes to ``odd``, one that is no index entry to ``failed``."""
        tails = np.empty((len(jobs), CHECKSUM_BYTES), np.uint8)
        expectation = self.parts_verifier().expectation
        holds = self.segments.reads.holds
        for i, key, value, out, digest in jobs:
            if len(value) != ENTRY.size:
                failed.append(i)  # not an index entry
                continue
            seg, offset, length, checksum = ENTRY.unpack(value)
            loc = Location(seg, offset, length)
            payload_bytes = length - (HEADER_BYTES + CHECKSUM_BYTES)
            if out is None:
                if payload_bytes < 0 or not holds(loc):
                    failed.append(i)
                    continue
                out = as_out_segments(np.empty(payload_bytes, np.uint8))
            if payload_bytes < 0 or out.nbytes != payload_bytes:
                odd.append((i, key, loc, out, digest))
                continue
            info[i] = (key, checksum, digest)
            k = len(tasks)
            task = ReadTask(i, loc, heads[k], out, tails[k],
                            expect=expectation(key, length, checksum, digest, hashed=hashed))
            tasks.append(task)
            reader.add(task)

    def _read_odd(self, odd: list[tuple[int, RecordKey, Location, Any, bytes | None]],
                  metas: dict[int, RecordMeta], failed: list[int]) -> None:
        """Records whose stored size differs from their out buffer's: read whole and
        decoded, so a valid record of another size is a ValueError (the caller's mistake)
        and an invalid one a miss."""
        for i, key, loc, out, digest in odd:
            if loc.length < HEADER_BYTES + CHECKSUM_BYTES or not self.segments.reads.holds(loc):
                failed.append(i)  # never allocate what an entry claims unchecked
                continue
            whole = np.empty(loc.length, np.uint8)
            task = ReadTask(i, loc, whole[:HEADER_BYTES], [whole[HEADER_BYTES:-CHECKSUM_BYTES]],
                            whole[-CHECKSUM_BYTES:])
            self.segments.reads.read([task])
            try:
                if not task.ok:
                    raise CorruptRecordError(RecordCheck.TRUNCATED, "record bytes could not be read")
                meta = decode_record(whole, expect_key=key, expect_fingerprint=self.layout_fingerprint,
                                     expect_token_digest=digest)
            except CorruptRecordError:
                failed.append(i)
                continue
            if out.nbytes != meta.payload_bytes:
                raise ValueError(f"out: expected {meta.payload_bytes} bytes (the stored payload of "
                                 f"{key!r}), got {out.nbytes}")
            write_segments(out, whole[HEADER_BYTES:HEADER_BYTES + meta.payload_bytes])
            metas[i] = meta

    # ------------------------------------------------------------------ get_rows
    def get_rows_natively(self, keys: list[RecordKey], rows: RowScatter, digests: list[bytes | None],
                          get_rows: Any) -> list[bool]:
        """Natively: one read transaction looks up every key, then the read engine reads
        and verifies the batch on its threads, each record's pieces straight into ``rows``
        (the same checks as ``get_many``). A record whose stored payload size is not the
        plan's goes through ``get_rows(keys, rows, token_digests=...)``, the generic path
        (it decides between a miss and a ValueError, and counts itself)."""
        kbs = [key.to_bytes() for key in keys]
        values = self.lookup(kbs)
        verifier, payload = self.parts_verifier(), rows.nbytes
        ok = [False] * len(keys)
        failed: list[int] = []
        odd: list[int] = []  # stored payload size differs from the plan's: get_many decides
        read: list[tuple[int, Location, bytes]] = []
        for i, value in enumerate(values):
            found = None if value is None else unpack_entry(value)
            if found is None:
                if value is not None:
                    failed.append(i)
                continue
            loc, checksum = found
            if loc.length - HEADER_BYTES - CHECKSUM_BYTES != payload:
                odd.append(i)
                continue
            read.append((i, loc, verifier.expectation(keys[i], loc.length, checksum, digests[i])))
        if read:
            expects = np.frombuffer(b"".join(e for _, _, e in read), np.uint8).reshape(len(read), -1)
            with self.index.rw.shared():
                check_open(self.index.closed, str(self.index.path))
                status = self.segments.reads.read_rows([loc for _, loc, _ in read],
                                                       rows.take([i for i, _, _ in read]), expects)
            for (i, _, _), st in zip(read, status.tolist()):
                if st == fastread.VERIFIED:
                    ok[i] = True
                else:
                    failed.append(i)
        if odd:
            for i, got in zip(odd, get_rows([keys[i] for i in odd], rows.take(odd),
                                            token_digests=[digests[i] for i in odd])):
                ok[i] = got
        hits = sum(ok) - sum(ok[i] for i in odd)  # (get_many counted the odd ones)
        self.settle(kbs, values, failed, ok, hits=hits, misses=len(keys) - len(odd) - hits)
        return ok
