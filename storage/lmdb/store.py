"""LMDB block store: the embedded default (one directory, ACID index, multi-process).

LMDB is the index; the records (record.py format, unchanged) live in append-only segment
files beside it, which are the store's write-ahead log (WiscKey-style). :class:`LmdbStore`
is a facade over parts that each own one concern, as RocksDB splits its DB class by
concern over an ``env/`` for OS access (here: the segments are the log, LMDB the index,
recovery the open path and gc the compaction)::

    schema.py          sub-databases, meta keys, codecs, a new store's metadata, file names
    environment.py     the LMDB environment: opened only once the index checked whole
                       (pages.py, the page walker; rebuild.py when it is damaged), and
                       the transactions every part runs in (map growth, full disk)
    access.py          access times, the LRU order and eviction, lifetime counters
    segments.py        segment ownership, appends, syncs, reclaiming space; its read
                       engine (reads.py, read_strategies.py, read_tasks.py, open_files.py)
    store_reads.py     index lookups, verified reads, the bookkeeping every read shares
    writes.py          put_many through the group commit (group_commit.py), deletes
    recovery.py        indexing what dead writers appended past the indexed end (scan.py)
    maintenance.py     verify and repair, gc, reclaiming segment space, the index reserve

Durability contract. The segment is the write-ahead log; the index is opened with
``MDB_NOMETASYNC`` (``metasync=False``): a commit flushes its pages but not the meta page,
which LMDB documents as keeping the database's integrity after an OS crash while possibly
losing the last transaction (``MDB_NOSYNC`` is not used: without an order-preserving
filesystem an OS crash could leave the meta page pointing at pages never written). When
``put_many`` returns, its records survive kill -9, an OS crash and power loss (the segment
bytes are synced; an index commit an OS crash took is redone by recovery); a crash before
it returns leaves each record of the batch indexed, recovered, or a miss; the index never
points at segment bytes that were not synced, and every read verifies anyway. The details
are in the docstrings of :mod:`.writes` and :mod:`.recovery`.

Readers keep at most ``max_open_segments`` segment descriptors open (LRU; one in use is
never closed). Deleting or evicting a record punches a hole over its bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import lmdb

from ..api.counters import StoreStats
from ..api.store import BlockStore, MappedPayload, PutItem, check_open, payload_of_record
from ..errors import StoreError, StoreFullError
from ..format.record import KEY_BYTES, RecordKey, RecordKind, RecordMeta, fingerprint_field
from ..format.rows import RowScatter
from ..format.sealed_level import SEALED_LEVEL, sealing_json
from ..format.writer import StoreWriter, parse_recorded
from ..os import fastread
from ..os.faults import Faults
from ..os.files import create_private_file, mkdir_private
from .access import AccessTimes
from .environment import Index, has_segments
from .group_commit import GroupCommit
from .maintenance import Maintenance
from .mapped import MappedReads
from .open_files import DEFAULT_MAX_OPEN_SEGMENTS
from .recovery import Recovery
from .schema import (M_ENCRYPTION, M_WRITER, STORE_FORMAT_VERSION, check_meta, pack_entry, read_sealed_file,
                     unpack_entry, write_sealed_file)
from .segments import SegmentFiles
from .store_reads import StoreReads
from .writes import PutBatch, Writes, new_segment_id

__all__ = ["DEFAULT_MAX_BYTES", "LmdbStore", "STORE_FORMAT_VERSION", "pack_entry", "unpack_entry"]

DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_IO_THREADS = 8  # transfers in flight per call (1 MiB extents: 8 MiB deep)
DEFAULT_MAX_BYTES = 64 << 30
_MiB = 1 << 20
_DEFAULT_INITIAL_MAP = 1 << 30


class LmdbStore(BlockStore):
    """Block store in one LMDB environment directory.

    ``path``: the environment directory (created 0o700 if missing). ``max_bytes``: bound
    on the stored records (header + payload + checksum), LRU-evicted. ``map_size``: the
    largest LMDB map (default ``1.5 * max_bytes + 64 MiB``; the map starts at
    ``initial_map_size``, default ``min(map limit, 1 GiB)``, and doubles when full).
    ``readonly``: open an existing store without writing (corrupt records are misses but
    stay; access times are not recorded). ``layout_fingerprint=None``: a *maintenance
    open* of an existing store, bound to whatever fingerprint it holds (stats, verify, gc,
    delete, reads; ``put_many`` raises StoreError: records are only written by someone who
    knows their layout). ``writer``: recorded when the store is created, or on the first
    writable open of a store that has none (see :mod:`~..format.writer`). ``segment_bytes``:
    a writer starts a new segment file past this size. ``direct_io``: O_DIRECT segment
    writes and cold reads (None: where the filesystem accepts it). ``io_threads``:
    parallel transfers of one call. ``repair_index``: a writable open that finds the index
    damaged rebuilds it from the segments when no other process has the store open (see
    :mod:`.environment`); False raises :class:`IndexDamagedError` instead, as a readonly
    open does. ``index_reserve_bytes``: disk held back for a gc on a full disk (default 4
    MiB, or 1/64 of a smaller filesystem; see :mod:`.maintenance`). ``max_open_segments``:
    read descriptors of segment files kept open at most (least recently used closed
    first). ``sealed``: the opener is an :class:`~..encrypted.EncryptedStore` (a new store
    records that it is a sealed level; a sealed level opened for writing without it raises
    :class:`EncryptedLevelError`, see :mod:`~..format.sealed_level`); :attr:`sealing` is
    what the store records.
    """

    supports_multiprocess = True
    supports_shared_writers = True
    supports_mmap_reads = False  # records are pread (page cache or O_DIRECT) into the out buffers
    supports_scatter_reads = True  # one preadv per record: header, every piece, checksum
    supports_eviction_guard = True

    def __init__(self, path: str | os.PathLike[str], *, layout_fingerprint: str | None,
                 max_bytes: int = DEFAULT_MAX_BYTES, map_size: int | None = None, readonly: bool = False,
                 initial_map_size: int | None = None, access_flush_s: float = 5.0,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES, direct_io: bool | None = None,
                 io_threads: int = DEFAULT_IO_THREADS, writer: StoreWriter | None = None,
                 repair_index: bool = True, index_reserve_bytes: int | None = None,
                 max_open_segments: int = DEFAULT_MAX_OPEN_SEGMENTS, sealed: bool = False) -> None:
        _check_options(layout_fingerprint, writer, max_bytes=max_bytes, map_size=map_size,
                       initial_map_size=initial_map_size, segment_bytes=segment_bytes, io_threads=io_threads,
                       index_reserve_bytes=index_reserve_bytes, max_open_segments=max_open_segments)
        self.path = Path(os.path.abspath(path))
        self.layout_fingerprint: str = layout_fingerprint  # type: ignore[assignment]  (None: read at open)
        self.maintenance = layout_fingerprint is None
        self.max_bytes = max_bytes
        self.readonly = readonly
        self.map_limit = map_size if map_size is not None else max_bytes * 3 // 2 + 64 * _MiB
        #: what the store records about sealing (format/sealed_level.py), None for a plain level
        self.sealing: dict[str, str] | None = None
        #: the fault points of its writes (:class:`~.group_commit.FaultPoint`): a test seam
        self.faults = Faults()
        self._writer = writer
        self._sealed = bool(sealed)
        self._stats = StoreStats()
        self._closed = True
        self._prepare_directory()
        self._index = Index(self.path, map_size=min(self.map_limit, initial_map_size or _DEFAULT_INITIAL_MAP),
                            map_limit=self.map_limit, max_bytes=max_bytes, readonly=readonly,
                            maintenance=self.maintenance, repair_index=repair_index,
                            layout_fingerprint=layout_fingerprint, io_threads=io_threads)
        try:
            if not readonly:
                self._index.env.reader_check()  # slots of readers that died (kill -9)
            self._index.open_dbs(self._check_meta)
            if self.sealing is not None and not (readonly or self.maintenance):
                write_sealed_file(self.path)  # (a level sealed before the file existed gets it now)
        except BaseException:
            self._index.close()
            raise
        self._make_parts(access_flush_s=access_flush_s, segment_bytes=segment_bytes, direct_io=direct_io,
                         io_threads=io_threads, max_open_segments=max_open_segments,
                         index_reserve_bytes=index_reserve_bytes)
        self._closed = False
        if not readonly:
            self._recover_at_open()

    # ------------------------------------------------------------------ opening
    def _prepare_directory(self) -> None:
        """Refuse a Zarr store's directory and, for an open that only reads an existing
        store, a directory without one; create a new store's directory and lock file
        owner-only before LMDB opens it."""
        if (self.path / "zarr.json").exists():
            raise StoreError(f"{self.path}: this directory holds a Zarr block store; open it with "
                             f"ZarrStore or a zarr:// URL")
        if self.readonly or self.maintenance:  # only an existing store (one whose index is gone: see Index)
            if not (self.path / "data.mdb").is_file() and not has_segments(self.path):
                why = "readonly" if self.readonly else "without a layout fingerprint"
                raise FileNotFoundError(f"{self.path}: no LMDB store here (no data.mdb) to open {why}")
        else:
            mkdir_private(self.path)
            fd = create_private_file(self.path / "lock.mdb")  # owner-only before LMDB opens it
            if fd is not None:
                os.close(fd)

    def _check_meta(self, txn: lmdb.Transaction, meta: Any, create: bool) -> None:
        fingerprint = None if self.maintenance else self.layout_fingerprint
        self.layout_fingerprint, self.sealing = check_meta(txn, meta, self.path, fingerprint=fingerprint,
                                                           create=create, writer=self._writer, sealed=self._sealed,
                                                           marked=read_sealed_file(self.path))

    def _make_parts(self, *, access_flush_s: float, segment_bytes: int, direct_io: bool | None, io_threads: int,
                    max_open_segments: int, index_reserve_bytes: int | None) -> None:
        """The store's parts over its open index (see the module docstring)."""
        index, fp = self._index, self.layout_fingerprint
        self._access = AccessTimes(index, self._stats, max_bytes=self.max_bytes, flush_s=access_flush_s,
                                   guard=lambda: self.eviction_guard)
        self._segments = SegmentFiles(self.path / "segments", new_segment_id=lambda: new_segment_id(index),
                                      segment_bytes=segment_bytes, direct_io=direct_io, io_threads=io_threads,
                                      readonly=self.readonly, max_open_segments=max_open_segments,
                                      faults=self.faults)
        self._reads = StoreReads(index, self._access, self._segments, self._stats, layout_fingerprint=fp,
                                 readonly=self.readonly)
        self._mapped = MappedReads(self._reads)
        self._writes = writes = Writes(index, self._access, self._segments, self._reads, self._stats, self.faults,
                                       layout_fingerprint=fp, max_bytes=self.max_bytes)
        self._commits: GroupCommit[PutBatch] = GroupCommit(
            sync=writes.sync_group, index=writes.index_group,
            closed_error=lambda: StoreError(f"{self.path}: store is closed"), faults=self.faults)
        writes.commits = self._commits
        self._recovery = Recovery(index, self._access, self._segments, layout_fingerprint=fp,
                                  max_bytes=self.max_bytes)
        self._maintenance = Maintenance(index, self._access, self._segments, self._reads, self._recovery,
                                        self._stats, reserve_bytes=index_reserve_bytes)

    def _recover_at_open(self) -> None:
        try:
            self._recovery.recover()
        except StoreFullError:
            pass  # no room to index them now: those records stay misses until a later open or gc
        except BaseException:
            self.close()
            raise
        self._maintenance.keep_reserve()

    @property
    def on_evict(self) -> Callable[[list[RecordKey]], None] | None:
        """Told the keys of the records this handle's evictions took (a put's or ``gc``'s;
        not those of the recovery at open), once the eviction's transaction committed, on
        the thread that evicted (a put's caller: a disk tier's writer thread). None (the
        default): nobody is told. Another process's evictions are never reported here: a
        listener learns only what this handle evicted. The transaction is over when it runs
        (it may read the store); it should be quick (a put waits for it), and one that
        raises is logged."""
        return self._access.on_evict

    @on_evict.setter
    def on_evict(self, listener: Callable[[list[RecordKey]], None] | None) -> None:
        self._access.on_evict = listener

    @property
    def index_rebuild(self) -> dict[str, Any] | None:
        """What a rebuild of a damaged index at this open did (see rebuild.py), else None."""
        return self._index.index_rebuild

    @property
    def lock_free(self) -> bool:
        """Opened without LMDB's lock file (a readonly open where it cannot be written)."""
        return self._index.lock_free

    def record_sealing(self) -> None:
        """Record that this existing store is a sealed level (an encrypted opener found
        none recorded: an empty store, an index rebuilt from the segments, a migration;
        see :mod:`~..format.sealed_level`), and drop the tenant hash of its writer record."""
        check_open(self._closed, str(self.path))
        if self.readonly:
            raise StoreError(f"{self.path}: opened readonly: cannot record that the level is sealed")
        meta = self._index.dbs.meta  # type: ignore[union-attr]

        def write(txn: lmdb.Transaction) -> None:
            txn.put(M_ENCRYPTION, sealing_json(), db=meta)
            info = parse_recorded(None if (w := txn.get(M_WRITER, db=meta)) is None else bytes(w))
            if info is not None and info.get("tenant_sha256") is not None:
                txn.put(M_WRITER, json.dumps({**info, "tenant_sha256": None}, sort_keys=True).encode(), db=meta)

        self._index.run(write, write=True)
        write_sealed_file(self.path)
        self.sealing = dict(SEALED_LEVEL)

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreError(f"{self.path}: store was opened readonly")

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """See :meth:`BlockStore.put_many`. Concurrent calls of this process's threads
        write their records in parallel, then share one segment sync and one index commit
        (group commit, see group_commit.py); each returns once its own records are
        synced and indexed."""
        check_open(self._closed, str(self.path))
        self._check_writable()
        self._check_layout_known(str(self.path))
        items = self._check_put_items(items)
        return self._writes.put_many(items) if items else []

    def delete(self, key: RecordKey) -> bool:
        check_open(self._closed, str(self.path))
        self._check_writable()
        return self._writes.delete(key.to_bytes())

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, str(self.path))
        keys, dsts, digests = self._check_get_args(keys, outs, token_digests, scatter=True)
        return self._reads.get_many(keys, dsts, digests)

    def get_many_unhashed(self, keys: Sequence[RecordKey], outs: Sequence[Any]) -> list[RecordMeta | None]:
        """See :meth:`BlockStore.get_many_unhashed`: :meth:`get_many` whose native read
        checks everything but the payload's xxh3, which it does not compute (the Python
        read path computes it but does not compare it)."""
        check_open(self._closed, str(self.path))
        keys, dsts, digests = self._check_get_args(keys, outs, None, scatter=True)
        return self._reads.get_many(keys, dsts, digests, hashed=False)

    def map_unhashed(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int]
                     ) -> AbstractContextManager[list[MappedPayload | None]]:
        """See :meth:`BlockStore.map_unhashed`: the records the page cache holds, mapped
        from their segment files (:mod:`.mapped`)."""
        check_open(self._closed, str(self.path))
        keys = list(keys)
        for i, k in enumerate(keys):
            if not isinstance(k, RecordKey):
                raise TypeError(f"keys[{i}]: expected a RecordKey, got {type(k).__name__}")
        if len(payload_bytes) != len(keys):
            raise ValueError(f"payload_bytes: expected one size per key ({len(keys)}), got {len(payload_bytes)}")
        return self._mapped.map_unhashed(keys, payload_bytes)

    @property
    def supports_row_reads(self) -> bool:  # type: ignore[override]
        """``get_rows`` reads natively where the helper is built (else through get_many)."""
        return fastread.read_verify_rows is not None

    def get_rows(self, keys: Sequence[RecordKey], rows: RowScatter, *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[bool]:
        """See :meth:`BlockStore.get_rows`. Natively: one read transaction looks up every
        key, then the segment files' read engine reads and verifies the batch on its
        threads, each record's pieces straight into ``rows`` (the same checks as
        ``get_many``: header, both checksums, fingerprint, key, token digest). Failures
        are counted and a corrupt record unindexed as by ``get_many``."""
        if fastread.read_verify_rows is None or not keys:
            return super().get_rows(keys, rows, token_digests=token_digests)
        check_open(self._closed, str(self.path))
        keys, digests = self._check_rows_args(keys, rows, token_digests)
        if len({d is None for d in digests}) > 1:  # one expectation size per native call
            return super().get_rows(keys, rows, token_digests=digests)
        return self._reads.get_rows_natively(keys, rows, digests, super().get_rows)

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        """See :meth:`BlockStore.payload_sizes`: from the index, one read transaction."""
        values = self._reads.lookup([key.to_bytes() for key in keys])
        return [payload_of_record(found[0].length) if (found := unpack_entry(v)) is not None else None
                for v in values]

    def contains(self, key: RecordKey) -> bool:
        return self._reads.lookup([key.to_bytes()])[0] is not None

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        return [v is not None for v in self._reads.lookup([key.to_bytes() for key in keys])]

    def contains_hashes(self, kind: RecordKind, hashes: Sequence[bytes]) -> list[bool]:
        """See :meth:`BlockStore.contains_hashes`: the key bytes made straight from the hashes."""
        prefix = bytes((RecordKind(kind),))
        if not set(map(type, hashes)) <= {bytes} or not set(map(len, hashes)) <= {KEY_BYTES - 1}:
            raise ValueError(f"hashes: expected {KEY_BYTES - 1}-byte bytes objects")
        return [v is not None for v in self._reads.lookup([prefix + h for h in hashes])]

    def __iter__(self) -> Iterator[RecordKey]:
        records = self._index.dbs.records  # type: ignore[union-attr]

        def keys(txn: lmdb.Transaction) -> list[bytes]:
            return [bytes(k) for k in txn.cursor(db=records).iternext(keys=True, values=False)]

        out = []
        for kb in self._index.run(keys, write=False):
            try:
                out.append(RecordKey.from_bytes(kb))
            except ValueError:
                continue  # not a record key: verify reports it, verify --repair removes it
        return iter(out)

    def __len__(self) -> int:
        records = self._index.dbs.records  # type: ignore[union-attr]
        return self._index.run(lambda txn: txn.stat(records)["entries"], write=False)

    def stats(self) -> dict[str, Any]:
        if not self.readonly:
            self._access.flush_quietly()
        out: dict[str, Any] = {"backend": "lmdb", "path": str(self.path),
                               "layout_fingerprint": self.layout_fingerprint, "max_bytes": self.max_bytes}
        out.update(self._index.run(self._stored_stats, write=False))
        out.update(self._stats.as_dict())
        out["map_size"] = self._index.map_size()
        out["map_limit"] = self.map_limit
        out["segments"] = len(self._segments.segment_ids())
        out["segment_disk_bytes"] = self._segments.disk_bytes()
        out["open_segment_files"] = self._segments.open_files
        out["direct_io"] = self._segments.direct_io
        out["recovered_records"] = self._recovery.recovered
        return out

    def _stored_stats(self, txn: lmdb.Transaction) -> dict[str, Any]:
        """What :meth:`stats` reads of the index (one transaction)."""
        dbs = self._index.dbs
        assert dbs is not None
        firsts, lasts = [], []
        for db in (dbs.lru, dbs.parked):  # (the leaves, and the records with a resident child)
            if db is not None:
                cur = txn.cursor(db=db)
                if cur.first():
                    firsts.append(self._index.lru_ns(cur.key()))
                if cur.last():
                    lasts.append(self._index.lru_ns(cur.key()))
        oldest, newest = min(firsts, default=None), max(lasts, default=None)
        lifetime = {f"lifetime_{k}": v for k, v in self._access.lifetime(txn).items()}
        writer = txn.get(M_WRITER, db=dbs.meta)
        return {"records": txn.stat(dbs.records)["entries"], "bytes": self._index.get_total(txn),
                "oldest_access_ns": oldest, "newest_access_ns": newest,
                "writer": parse_recorded(None if writer is None else bytes(writer)), **lifetime}

    # ------------------------------------------------------------------ maintenance
    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """Check every record (see :meth:`BlockStore.verify`): every index entry is read
        and verified, in batches; with ``repair`` the bad ones are unindexed (each only if
        its entry is still the one that failed). Also reports ``accounted_bytes`` (the
        store's running total) and ``actual_bytes`` (the sizes of the indexed records);
        ``repair`` sets the total to the actual bytes and gives back unindexed segment
        space (as :meth:`gc` does).

        The index itself is checked whole first: every page of every sub-database is
        walked (see pages.py), then every entry of ``meta``, ``atime`` and ``lru`` is
        checked against its format and against ``records`` (``index_problems``: one line
        per kind of problem; ``repair`` fixes them). An index whose pages are damaged
        raises IndexDamagedError (never a count of 0 corrupt); a writable open rebuilds
        it from the segments (``index_rebuilt``: what that rebuild did, else None)."""
        check_open(self._closed, str(self.path))
        if repair:
            self._check_writable()
        try:
            return self._maintenance.verify(repair=repair)
        finally:
            self._mapped.close()  # (repair gives segment space back as gc does)

    def gc(self, max_bytes: int) -> dict[str, Any]:
        """Evict least recently accessed records until at most ``max_bytes`` remain (see
        :meth:`BlockStore.gc`); queued access times are applied first, so the order is
        exact. Evicts in transactions of at most 4096 records. Then gives back segment
        space that no record uses (bytes of crashed writers, of removed records): sealed
        segments with nothing indexed are unlinked, the rest get holes punched.
        Also returns ``segments_removed`` and ``punched_bytes``.

        On a full disk (the copy-on-write index needs new pages even to delete) the
        index reserve is given to the deletes and transactions shrink to a few records,
        each followed by its punched holes, until there is room again; then the reserve
        is taken back (see maintenance.py); ``full_disk`` says whether it came to that."""
        check_open(self._closed, str(self.path))
        self._check_writable()
        self._check_gc_bound(max_bytes)
        try:
            return self._maintenance.gc(max_bytes)
        finally:
            self._mapped.close()  # (no map keeps a segment it unlinked on the disk)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        # Writers queued for a group commit get the closed error, the group in commit
        # finishes (its index transaction needs the shared lock closing takes), writers
        # still appending give their ranges back.
        self._commits.close()
        self._segments.drain()
        if not self.readonly:
            self._access.flush_quietly()  # on a full disk the last hints are lost; records are not
        with self._index.rw.exclusive():
            self._closed = True
            self._mapped.close()
            try:
                self._segments.close()
            finally:
                self._index.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("readonly" if self.readonly else "open")
        return f"LmdbStore({str(self.path)!r}, {self.layout_fingerprint!r}, {state})"


def _check_options(layout_fingerprint: str | None, writer: StoreWriter | None, **sizes: int | None) -> None:
    """ValueError / TypeError naming the first bad option of an LmdbStore."""
    if layout_fingerprint is not None:
        fingerprint_field(layout_fingerprint)
    if writer is not None and not isinstance(writer, StoreWriter):
        raise TypeError(f"writer: expected a StoreWriter or None, got {type(writer).__name__}")
    for name, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
