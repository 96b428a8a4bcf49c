"""LMDB block store: the embedded default (one directory, ACID index, multi-process).

LMDB is the index; the records (record.py format, unchanged) live in append-only segment
files beside it (see segments.py). Layout of one store directory (files 0o600, dirs 0o700)::

    data.mdb, lock.mdb        the LMDB environment (the index)
    segments/00000001.seg     records, appended in 4 KiB-aligned batches
    index.reserve             disk held for the index's deletes on a full disk (see below)
    damaged-index-<time>/     a damaged data.mdb, moved aside by a rebuild (see below)

    sub-db    key                                 value
    -------   ---------------------------------   -----------------------------------------
    records   RecordKey.to_bytes() (33 B)         u32 segment, u64 offset, u64 record bytes,
                                                  16 B xxh3-128 checksum (all LE; the record's own)
    meta      b"format_version"                   u16 LE, STORE_FORMAT_VERSION
              b"record_format_version"            u16 LE, record.FORMAT_VERSION
              b"layout_fingerprint"               ascii
              b"record_bytes"                     u64 LE, sum of the accounted record sizes
              b"next_segment"                     u32 LE, the next segment id to hand out
              b"writer"                           JSON: who created the store (writer.py)
              b"segment_end:" + u32 BE segment    u64 LE, the segment is indexed below this offset
              b"segment_gen:" + u32 BE segment    u64 LE, bumped by every transaction that indexes
                                                  records into the segment (gc compares it)
    atime     RecordKey bytes                     u64 LE last access ns, u64 LE record size
    lru       u64 BE last access ns + key bytes   b"" (ordered: the first entry is the LRU)

Writes: a ``put_many`` stages its new records in an aligned buffer and appends them to a
range of this process's active segment reserved for it (``O_DIRECT`` where the filesystem
takes it); concurrent calls of this process's threads write their ranges in parallel.
Then, group commit (group_commit.py): one of the waiting calls ``fdatasync``s the segment
once for every batch written so far and commits all their index entries in one LMDB
transaction (one data flush, no meta flush: see below), and wakes the others, each with
its own results. Each writer process appends to its own segment (flock'ed), so writers
of different processes never coordinate beyond LMDB's write lock.

Durability contract. The segment is the write-ahead log; the index is opened with
``MDB_NOMETASYNC`` (``metasync=False``): a commit flushes its pages but not the meta page,
which LMDB documents as keeping the database's integrity after an OS crash while possibly
losing the last transaction (``MDB_NOSYNC`` is not used: without an order-preserving
filesystem an OS crash could leave the meta page pointing at pages never written). Each
index transaction stores ``segment_end`` of the segments it indexed into: below it every
batch is indexed or given up (it stops at the lowest range another thread of the writer
is still writing or committing), so:

- when ``put_many`` returns, its records survive kill -9, an OS crash and power loss: the
  segment bytes are synced, and if the OS crash took the index transaction with it, the
  records lie past ``segment_end`` and are recovered;
- recovery (:meth:`LmdbStore._recover`, on a writable open and before ``gc`` /
  ``verify(repair=True)`` reclaim space) scans each segment no writer holds from its
  ``segment_end`` to its end and indexes every record that verifies (header, xxh3-128
  checksum, fingerprint) and whose key is not indexed; torn or failing records never are,
  and the scan resumes at the next record magic (a segment whose id allocation the index
  lost is scanned from 0; ids are never reused);
- a crash before ``put_many`` returns leaves each record of the batch indexed (and
  durable), recovered, or a miss; the index never points at segment bytes that were not
  synced, and every read verifies anyway;
- other transactions (deletes, evictions, access times) survive kill -9 when they return;
  an OS crash may undo the last one (the records it touched are then verified on read
  like any other).

Reads: one read transaction looks up every key; the records are then read in parallel
(from the page cache when it holds them: straight into the caller's buffers, natively by
helper threads that take each record as soon as it is prepared, hashed as it is read,
see :meth:`~tiered_kv.storage.segments.SegmentFiles.batch_read`; else adjacent records of
a segment in one ``O_DIRECT`` transfer), and each one is verified (header,
xxh3-128 checksum against the record and the index, fingerprint, key, token digest; see
:class:`~tiered_kv.storage.record.PartsVerifier`). A record that fails while the index still points at it is corrupt: a miss,
counted and unindexed. Deleting or evicting a record punches a hole over its bytes.

Access times are ``time.time_ns()`` (made strictly increasing within a process) so that they
agree between processes. ``atime`` and ``lru`` are kept together in the same write
transactions as the index, so eviction order survives restarts and is shared by every
process. Reads do not write: a hit queues its access time in memory and the queue is
applied by the next write transaction of this process (every ``put_many`` applies it before
evicting, so in-process LRU order is exact), or on its own when it is older than
``access_flush_s`` or larger than 4096 entries, and at ``close()``. A crash loses at most
those queued hints, never a record.

Full disk: segment space is reserved with ``posix_fallocate`` before a batch is written,
so a full disk raises :class:`StoreFullError` with nothing appended (never SIGBUS: nothing
is written through a mapping of ``data.mdb``, ``writemap`` stays off; ``lock.mdb``, which
LMDB does write through a mapping, has its blocks allocated before LMDB maps it, and a
new store on a disk without room for them is a StoreFullError). The index is
copy-on-write, so even a delete needs new pages: a writable open holds ``index.reserve``
(``index_reserve_bytes``: allocated, never written), which ``gc`` on a full disk gives to
its deletes, in transactions of a few records each followed by its punched holes, and
takes back once there is room. The map starts at
``initial_map_size`` (default ``min(map limit, 1 GiB)``) and doubles on ``MDB_MAP_FULL``
up to the map limit, ``map_size`` if given, else ``1.5 * max_bytes + 64 MiB``; at the
limit ``put_many`` raises :class:`StoreFullError` and the transaction is aborted.

Reclaiming space (``gc``, ``verify(repair=True)``): recovery runs first, then one read
transaction collects every segment's live ranges and ``segment_gen``, then each segment is
locked (its ``flock``) in turn and given back what no entry covers (see
:meth:`SegmentFiles.reclaim`). Only the holder of a segment's lock commits index entries
into it, so once gc holds the lock the segment's entries cannot change but by deletes; a
``segment_gen`` that moved since the snapshot means entries were indexed into it meanwhile
(a writer that committed, then let go, before gc got there; a recovery in another
process): that segment is left for the next gc. So gc only gives back bytes that no
committed index entry covers while it holds the segment's lock. Bytes past a segment's
``segment_end`` (recovery could not index them: a full disk) are kept too.

Index damage. LMDB maps ``data.mdb`` and follows page numbers through the mapping: a
truncated file is a SIGBUS, a zeroed page an assertion abort or garbage. So every open
checks the meta pages and walks every page of the snapshot it pins with ``pread`` before
LMDB touches one (:mod:`.lmdb_file`), and checks the ``meta`` entries' lengths; a value of
the wrong length read later is :class:`IndexDamagedError` too, never a struct.error. A
damaged index (or a missing / empty ``data.mdb`` beside segment files) is
:class:`IndexDamagedError` on a readonly open; a writable open rebuilds it from the
segments (:mod:`.lmdb_rebuild`: LMDB's exclusive lock, every verified record indexed,
the damaged file moved aside) unless ``repair_index=False``. ``verify`` walks the index
again and checks every entry of every sub-database.

A readonly open writes nothing: where ``lock.mdb`` cannot be written (a read-only mount,
a directory this user may not write) it opens without LMDB's lock file (``lock_free``).
Readers keep at most ``max_open_segments`` segment descriptors open (LRU; one in use is
never closed).

Stores of format version 1 (records inside LMDB, before segment files) are refused with
an error that says what to do: the disk tier is a cache, so remove the directory (or use
another path) and it refills as prompts are served. There is no in-place migration.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np

from .base import (
    BlockStore,
    OpenRegistry,
    PutItem,
    SharedExclusiveLock,
    StoreStats,
    check_open,
    create_private_file,
    mkdir_private,
    payload_of_record,
    select_victims,
)
from .errors import (
    CorruptRecordError,
    IndexDamagedError,
    LayoutMismatchError,
    RecordCheck,
    StoreError,
    StoreFullError,
)
from .group_commit import REWRITE, SYNCED, FaultPoint, GroupCommit
from .lmdb_file import DataFileState, IndexDamage, IndexWalk, check_data_file, walk_index
from .record import (
    CHECKSUM_BYTES,
    FORMAT_VERSION,
    HEADER_BYTES,
    KEY_BYTES,
    MAGIC,
    PartsVerifier,
    RecordKey,
    RecordKind,
    RecordMeta,
    as_out_segments,
    decode_record,
    encode_record_into,
    fingerprint_field,
    parse_header,
    record_size,
    verify_record_parts,
    write_segments,
)
from .segments import (
    ALIGN,
    DEFAULT_MAX_OPEN_SEGMENTS,
    Appended,
    Location,
    ReadTask,
    Reclaimable,
    SegmentFiles,
    allocate_blocks,
)
from .writer import StoreWriter, parse_recorded
from . import fastread
from .rows import RowScatter

__all__ = ["DEFAULT_MAX_BYTES", "LmdbStore", "STORE_FORMAT_VERSION", "pack_entry", "unpack_entry"]

#: Version of the store's layout (sub-dbs, meta keys and segment files above). 1: records
#: inside LMDB (refused, see the module docstring).
STORE_FORMAT_VERSION = 2
DEFAULT_SEGMENT_BYTES = 256 << 20
DEFAULT_IO_THREADS = 8  # transfers in flight per call (1 MiB extents: 8 MiB deep)
DEFAULT_MAX_BYTES = 64 << 30
_MiB = 1 << 20
_DEFAULT_INITIAL_MAP = 1 << 30
#: ``index.reserve``: disk held for the index's deletes on a full disk (see gc)
_RESERVE_NAME = "index.reserve"
_DEFAULT_RESERVE = 4 * _MiB  # or 1/64 of the filesystem if that is less, but at least:
_MIN_RESERVE = 256 << 10
#: disk blocks allocated for ``lock.mdb`` (LMDB's reader table: 8 KiB for 126 readers)
_LOCK_FILE_BYTES = 64 << 10
#: records per eviction transaction once the disk is full (each one's holes punched before the next)
_GC_FULL_DISK_BATCH = 4
_ACCESS_QUEUE_MAX = 4096

_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_PAYLOAD_BYTES = struct.Struct("<Q")  # the header's last field
_ATIME = struct.Struct("<QQ")   # last access ns, accounted record bytes
_LRU_NS = struct.Struct(">Q")   # big-endian so that byte order is time order

_M_FORMAT = b"format_version"
_M_RECORD_FORMAT = b"record_format_version"
_M_FINGERPRINT = b"layout_fingerprint"
_M_TOTAL = b"record_bytes"
_M_NEXT_SEGMENT = b"next_segment"
#: the writer that created the store (JSON, see writer.py)
_M_WRITER = b"writer"
_U32 = struct.Struct("<I")
#: an index entry: segment, offset, record bytes, the record's xxh3-128 checksum
_ENTRY = struct.Struct("<IQQ16s")
#: lifetime counters of every process that used the store: u64 LE each, StoreStats.NAMES order
_M_COUNTERS = b"counters"
#: + u32 BE segment id -> u64 LE: the segment's bytes below this offset are indexed (what
#: is past it, when no writer holds the segment, is scanned and verified on open / gc)
_M_SEGMENT_END = b"segment_end:"
#: + u32 BE segment id -> u64 LE: bumped by every transaction that indexes records into the
#: segment; gc reclaims a segment only if it did not move since gc read the index
_M_SEGMENT_GEN = b"segment_gen:"
_U32BE = struct.Struct(">I")

_REGISTRY = OpenRegistry()
T = TypeVar("T")
log = logging.getLogger(__name__)


def _close_env(env: lmdb.Environment, ident: tuple[int, int]) -> None:
    try:
        env.close()
    finally:
        _REGISTRY.release(ident)


def _segment_end_key(seg: int) -> bytes:
    return _M_SEGMENT_END + _U32BE.pack(seg)


def _segment_gen_key(seg: int) -> bytes:
    return _M_SEGMENT_GEN + _U32BE.pack(seg)


def _align_up(x: int) -> int:
    return (x + ALIGN - 1) & ~(ALIGN - 1)


def _scan_segment(fd: int, seg: int, start: int, size: int, fingerprint: str
                  ) -> list[tuple[bytes, Location, bytes]]:
    """The verified records of ``[start, size)`` of segment ``seg``: (key bytes, location,
    checksum), in file order. Records lie back to back within 4 KiB-aligned batches; a
    record that fails a check, a punched hole (a deleted or evicted record: zeros), the
    padding of a batch, a torn write or garbage are skipped to the next record magic
    (so the records after a hole in the middle of a batch are found)."""
    out: list[tuple[bytes, Location, bytes]] = []
    pos = start
    while pos + HEADER_BYTES + CHECKSUM_BYTES <= size:
        head = os.pread(fd, HEADER_BYTES, pos)
        try:
            if head[:len(MAGIC)] != MAGIC:
                raise CorruptRecordError(RecordCheck.MAGIC, "")
            n = record_size(_PAYLOAD_BYTES.unpack_from(head, HEADER_BYTES - 8)[0])
            parse_header(head, n)
            if pos + n > size:
                raise CorruptRecordError(RecordCheck.TRUNCATED, "")
            buf = np.frombuffer(os.pread(fd, n, pos), np.uint8)
            if buf.nbytes != n:
                raise CorruptRecordError(RecordCheck.TRUNCATED, "")
            parsed = parse_header(buf, n)
            key = RecordKey(parsed.kind, parsed.block_hash)
            verify_record_parts(buf[:HEADER_BYTES], buf[HEADER_BYTES:n - CHECKSUM_BYTES], buf[n - CHECKSUM_BYTES:],
                                parsed=parsed, expect_key=key, expect_fingerprint=fingerprint)
        except (CorruptRecordError, struct.error):
            pos = _next_magic(fd, pos + 1, size)
            continue
        out.append((key.to_bytes(), Location(seg, pos, n), buf[-CHECKSUM_BYTES:].tobytes()))
        pos += n
    return out


def _next_magic(fd: int, pos: int, size: int) -> int:
    """Offset of the next record magic at or after ``pos`` in the file (``size`` if none)."""
    while pos < size:
        buf = os.pread(fd, min(1 << 20, size - pos), pos)
        if not buf:
            return size
        at = buf.find(MAGIC)
        if at >= 0:
            return pos + at
        if pos + len(buf) >= size:
            return size
        pos += len(buf) - (len(MAGIC) - 1)  # a magic across the chunk boundary is found next time
    return size


@dataclass(slots=True)
class _EntryProblem:
    """A kind of malformed or inconsistent index entry: how many, and the first key."""

    kind: str
    count: int
    first_key: bytes

    def line(self) -> str:
        return f"{self.kind}: {self.count} (first key {self.first_key.hex()[:80]})"


@dataclass(eq=False, slots=True)
class _PutBatch:
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


def pack_entry(loc: Location, checksum: bytes) -> bytes:
    """The ``records`` value of a record stored at ``loc``."""
    return _ENTRY.pack(loc.segment, loc.offset, loc.length, checksum)


def unpack_entry(raw: Any) -> tuple[Location, bytes] | None:
    """``(location, checksum)`` of a ``records`` value, or None if it is not an entry."""
    if raw is None or len(raw) != _ENTRY.size:
        return None
    seg, off, n, checksum = _ENTRY.unpack(raw)
    return Location(seg, off, n), checksum


class LmdbStore(BlockStore):
    """Block store in one LMDB environment directory.

    ``path``: the environment directory (created 0o700 if missing). ``max_bytes``: bound
    on the stored records (header + payload + checksum), LRU-evicted. ``map_size``: the
    largest LMDB map (default derived from ``max_bytes``, see the module docstring).
    ``readonly``: open an existing store without writing (corrupt records are misses but
    stay; access times are not recorded). ``layout_fingerprint=None``: a *maintenance
    open* of an existing store, bound to whatever fingerprint it holds (stats, verify, gc,
    delete, reads; ``put_many`` raises StoreError: records are only written by someone who
    knows their layout). ``writer``: recorded when the store is created, or on the first
    writable open of a store that has none (see :mod:`~.writer`). ``segment_bytes``: a writer starts a new segment
    file past this size. ``direct_io``: O_DIRECT segment writes and cold reads (None: where
    the filesystem accepts it). ``io_threads``: parallel transfers of one call.
    ``repair_index``: a writable open that finds the index damaged rebuilds it from the
    segments when no other process has the store open (see "Index damage" in the module
    docstring); False raises :class:`IndexDamagedError` instead, as a readonly open does.
    ``index_reserve_bytes``: disk held back for a gc on a full disk (default 4 MiB, or
    1/64 of a smaller filesystem; see "Full disk"). ``max_open_segments``: read
    descriptors of segment files kept open at most (least recently used closed first).
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
                 max_open_segments: int = DEFAULT_MAX_OPEN_SEGMENTS) -> None:
        if layout_fingerprint is not None:
            fingerprint_field(layout_fingerprint)
        if writer is not None and not isinstance(writer, StoreWriter):
            raise TypeError(f"writer: expected a StoreWriter or None, got {type(writer).__name__}")
        for name, value in (("max_bytes", max_bytes), ("map_size", map_size),
                            ("initial_map_size", initial_map_size), ("segment_bytes", segment_bytes),
                            ("io_threads", io_threads), ("index_reserve_bytes", index_reserve_bytes),
                            ("max_open_segments", max_open_segments)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.path = Path(os.path.abspath(path))
        self.layout_fingerprint: str = layout_fingerprint  # type: ignore[assignment]  (None: read at open)
        self.maintenance = layout_fingerprint is None
        self._writer = writer
        self.max_bytes = max_bytes
        self.readonly = readonly
        self.map_limit = map_size if map_size is not None else max_bytes * 3 // 2 + 64 * _MiB
        initial = min(self.map_limit, initial_map_size or _DEFAULT_INITIAL_MAP)
        self._access_flush_s = access_flush_s
        self._stats = StoreStats()
        self._rw = SharedExclusiveLock()
        self._access_lock = threading.Lock()
        self._local = threading.local()
        self._access: dict[bytes, int] = {}
        self._access_since = time.monotonic()
        self._last_ns = 0
        self._closed = True
        self._verifier: PartsVerifier | None = None

        if (self.path / "zarr.json").exists():
            raise StoreError(f"{self.path}: this directory holds a Zarr block store; open it with "
                             f"ZarrStore or a zarr:// URL")
        if readonly or self.maintenance:  # only an existing store (one whose index is gone: see _open_index)
            if not (self.path / "data.mdb").is_file() and not self._has_segments():
                why = "readonly" if readonly else "without a layout fingerprint"
                raise FileNotFoundError(f"{self.path}: no LMDB store here (no data.mdb) to open {why}")
        else:
            mkdir_private(self.path)
            fd = create_private_file(self.path / "lock.mdb")  # owner-only before LMDB opens it
            if fd is not None:
                os.close(fd)
        #: what a rebuild of a damaged index at this open did (see lmdb_rebuild), else None
        self.index_rebuild: dict[str, Any] | None = None
        self._repair_index = repair_index
        self._io_threads = io_threads
        self._reserve_option = index_reserve_bytes
        ident = _REGISTRY.claim(self.path)
        try:
            self._env = self._open_index(initial)
        except BaseException:
            _REGISTRY.release(ident)
            raise
        self._finalizer = weakref.finalize(self, _close_env, self._env, ident)
        try:
            if not readonly:
                self._env.reader_check()  # slots of readers that died (kill -9)
            self._open_dbs()
        except BaseException:
            self._finalizer()
            raise
        self._segments = SegmentFiles(self.path / "segments", new_segment_id=self._new_segment_id,
                                      segment_bytes=segment_bytes, direct_io=direct_io,
                                      io_threads=io_threads, readonly=readonly,
                                      max_open_segments=max_open_segments)
        self._commits: GroupCommit[_PutBatch] = GroupCommit(
            sync=self._sync_group, index=self._index_group,
            closed_error=lambda: StoreError(f"{self.path}: store is closed"))
        self._closed = False
        self._recovered = 0
        if not readonly:
            try:
                self._recover()
            except StoreFullError:
                pass  # no room to index them now: those records stay misses until a later open or gc
            except BaseException:
                self.close()
                raise
            self._keep_reserve()

    # ------------------------------------------------------------------ opening
    def _open_dbs(self) -> None:
        env = self._env
        if self.readonly:
            try:  # (handles opened inside a read-only transaction die with it)
                self._records, self._meta, self._atime, self._lru = (
                    env.open_db(name, create=False) for name in (b"records", b"meta", b"atime", b"lru"))
            except lmdb.NotFoundError:
                raise StoreError(f"{self.path}: not a tiered_kv LMDB store (sub-databases missing)") from None
            with env.begin() as txn:
                self._check_meta(txn, create=False)
            return
        with env.begin(write=True) as txn:
            self._records, self._meta, self._atime, self._lru = (
                env.open_db(name, txn=txn, create=True) for name in (b"records", b"meta", b"atime", b"lru"))
            self._check_meta(txn, create=True)

    def _check_meta(self, txn: lmdb.Transaction, *, create: bool) -> None:
        stored_version = txn.get(_M_FORMAT, db=self._meta)
        if stored_version is None:
            if not create or self.maintenance:
                raise StoreError(f"{self.path}: not a tiered_kv LMDB store (no metadata)")
            txn.put(_M_FORMAT, _U16.pack(STORE_FORMAT_VERSION), db=self._meta)
            txn.put(_M_RECORD_FORMAT, _U16.pack(FORMAT_VERSION), db=self._meta)
            txn.put(_M_FINGERPRINT, self.layout_fingerprint.encode("ascii"), db=self._meta)
            txn.put(_M_TOTAL, _U64.pack(0), db=self._meta)
            txn.put(_M_NEXT_SEGMENT, _U32.pack(1), db=self._meta)
            self._record_writer(txn)
            return
        version = self._field(_U16, stored_version, "meta format_version")[0]
        if version == 1:
            raise StoreError(f"{self.path}: store format version 1 (records inside LMDB); this code "
                             f"reads version {STORE_FORMAT_VERSION} (records in segment files). The disk "
                             f"tier is a cache: remove this directory (or open another path) and it "
                             f"refills as prompts are served")
        if version != STORE_FORMAT_VERSION:
            raise StoreError(f"{self.path}: store format version {version}, this code reads "
                             f"version {STORE_FORMAT_VERSION}")
        stored_fp = bytes(txn.get(_M_FINGERPRINT, db=self._meta) or b"").decode("ascii", "replace")
        if self.maintenance:
            self.layout_fingerprint = stored_fp
        elif stored_fp != self.layout_fingerprint:
            raise LayoutMismatchError(str(self.path), stored_fp, self.layout_fingerprint)
        if create and txn.get(_M_WRITER, db=self._meta) is None:
            self._record_writer(txn)

    def _record_writer(self, txn: lmdb.Transaction) -> None:
        if self._writer is not None:
            txn.put(_M_WRITER, self._writer.to_json(), db=self._meta)

    # ------------------------------------------------------------------ index health
    def _open_index(self, map_size: int) -> lmdb.Environment:
        """The LMDB environment, opened only once the index checked whole. A damaged
        index is rebuilt from the segments (a writable open with ``repair_index``: the
        rebuild refuses while another process has the store open), else
        IndexDamagedError."""
        try:
            return self._open_checked_env(map_size)
        except IndexDamage as e:
            problem = str(e)
        if self.readonly or not self._repair_index:
            raise IndexDamagedError(str(self.path), problem)
        from .lmdb_rebuild import rebuild_claimed

        self.index_rebuild = rebuild_claimed(self.path, self.layout_fingerprint, io_threads=self._io_threads,
                                             problem=problem)
        log.warning("%s: the index was damaged (%s); rebuilt it from the segment files: %d records, the "
                    "damaged index moved to %s", self.path, problem, self.index_rebuild["records"],
                    self.index_rebuild["moved_to"])
        try:
            return self._open_checked_env(map_size)
        except IndexDamage as e:
            raise IndexDamagedError(str(self.path), f"{e} (right after a rebuild)") from None

    def _open_checked_env(self, map_size: int) -> lmdb.Environment:
        """Check ``data.mdb`` (meta pages, roots inside the file), open LMDB, then walk
        the snapshot it sees (every reachable page, see lmdb_file): before this, nothing
        of LMDB reads a page it could fault on. Raises IndexDamage."""
        data = self.path / "data.mdb"
        state = check_data_file(data)
        if state != DataFileState.VALID and self._has_segments():
            raise IndexDamage("data.mdb is missing" if state == DataFileState.MISSING
                              else "data.mdb is empty (0 bytes)")
        existing_only = self.readonly or self.maintenance
        if existing_only and state == DataFileState.MISSING:
            why = "readonly" if self.readonly else "without a layout fingerprint"
            raise FileNotFoundError(f"{self.path}: no LMDB store here (no data.mdb) to open {why}")
        if existing_only and state == DataFileState.EMPTY:
            raise IndexDamage("data.mdb is empty (0 bytes): the store was never initialized")
        if state == DataFileState.MISSING:
            fd = create_private_file(data)  # owner-only before LMDB opens it
            if fd is not None:
                os.close(fd)
        env = self._lmdb_open(map_size, lock=self._prepare_lock_file())
        try:
            self._walk_snapshot(env)
            self._check_meta_entries(env)
        except BaseException:
            env.close()
            raise
        return env

    def _check_meta_entries(self, env: lmdb.Environment) -> None:
        """IndexDamage if a ``meta`` entry (a few per segment) has not its format: the
        store could not account, allocate segments or recover with it. (Bad lifetime
        counters are only reported by verify: they read as zeros.)"""
        with env.begin() as txn:
            try:
                meta = env.open_db(b"meta", txn=txn, create=False)
            except lmdb.NotFoundError:
                return  # a new store (or not ours: _open_dbs says so)
            for kb, value in txn.cursor(db=meta):
                want = self._meta_value_bytes(bytes(kb))
                if want is not None and want >= 0 and len(value) != want and bytes(kb) != _M_COUNTERS:
                    raise IndexDamage(f"meta entry {bytes(kb)[:32]!r} is {len(value)} bytes, expected {want}")

    def _lmdb_open(self, map_size: int, *, lock: bool) -> lmdb.Environment:
        """lmdb.open with the store's flags. A readonly open where ``lock.mdb`` cannot be
        written (a read-only mount: LMDB skips the lock itself on EROFS; a directory this
        user may not write: EACCES; a full disk: see _prepare_lock_file) opens without
        the lock: there is no reader slot, so a writer in another process could reuse
        pages under this reader (every record read is still verified). ``self.lock_free``
        says which."""
        self.lock_free = not lock
        options = dict(map_size=map_size, subdir=True, readonly=self.readonly, create=not self.readonly,
                       max_dbs=4, mode=0o600, sync=True, metasync=False, writemap=False, map_async=False,
                       readahead=True, meminit=True)
        try:
            return lmdb.open(str(self.path), lock=lock, **options)
        except lmdb.Error as e:
            denied = isinstance(e, (lmdb.ReadonlyError, PermissionError)) or \
                getattr(e, "errno", None) in (errno.EACCES, errno.EROFS, errno.EPERM)
            if not (self.readonly and denied):
                raise
        self.lock_free = True
        return lmdb.open(str(self.path), lock=False, **options)

    def _walk_snapshot(self, env: lmdb.Environment) -> IndexWalk:
        """Walk the pages of the snapshot a read transaction pins (a newer transaction
        cannot reuse them meanwhile). Raises IndexDamage."""
        for _ in range(8):
            with env.begin() as txn:
                try:
                    return walk_index(self.path / "data.mdb", txnid=txn.id())
                except LookupError:
                    continue  # writers committed twice since: its meta page was rewritten; retry
        raise IndexDamage("no meta page matches the current transaction (the meta pages keep changing)")

    def _field(self, st: struct.Struct, raw: Any, what: str) -> tuple[Any, ...]:
        """``st.unpack(raw)`` of a value read from the index; IndexDamagedError (never a
        struct.error) when its length is not the format's."""
        if len(raw) != st.size:
            raise IndexDamagedError(str(self.path), f"{what} is {len(raw)} bytes, expected {st.size}")
        return st.unpack(bytes(raw))

    def _lru_ns(self, key: Any) -> int:
        """The access time of an ``lru`` key (u64 BE ns + record key)."""
        if len(key) != _LRU_NS.size + KEY_BYTES:
            raise IndexDamagedError(str(self.path), f"an LRU entry's key is {len(key)} bytes, expected "
                                                    f"{_LRU_NS.size + KEY_BYTES}")
        return _LRU_NS.unpack(bytes(key[:_LRU_NS.size]))[0]

    def _has_segments(self) -> bool:
        """Whether the store has segment files (records an index must point at)."""
        try:
            return any(name.endswith(".seg") for name in os.listdir(self.path / "segments"))
        except (FileNotFoundError, NotADirectoryError):
            return False

    # ------------------------------------------------------------------ transactions
    def _run(self, fn: Callable[[lmdb.Transaction], T], *, write: bool, need: int = 0) -> T:
        """Run ``fn`` in a transaction (committed if ``fn`` returns), adapting the map size.

        A write that finds the map full is aborted and retried after the map grew; at the
        map limit, or when the disk is full, StoreFullError. ``need``: bytes the write adds.
        """
        check_open(self._closed, str(self.path))
        while True:
            try:
                with self._rw.shared(), self._env.begin(write=write, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:  # another process grew the map past ours
                with self._rw.exclusive():
                    self._env.set_mapsize(0)
            except lmdb.MapFullError:
                self._grow_map()
            except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError) as e:
                raise IndexDamagedError(str(self.path), f"LMDB reports {e}") from None
            except lmdb.DiskError as e:
                raise StoreFullError(f"{self.path}: disk full ({e}); nothing was written by this call, "
                                     f"stored records are intact") from e
            except lmdb.Error as e:
                # LMDB reports a short page write as EIO: on a disk without room for this
                # transaction that is a full disk, anything else is a real I/O error.
                if write and type(e) is lmdb.Error and self._disk_free() < need + 4 * _MiB:
                    raise StoreFullError(f"{self.path}: disk full ({e}, {self._disk_free()} bytes free); "
                                         f"nothing was written by this call, stored records are intact"
                                         ) from e
                raise

    def _disk_free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def _grow_map(self) -> None:
        with self._rw.exclusive():
            current = self._env.info()["map_size"]
            if current >= self.map_limit:
                raise StoreFullError(
                    f"{self.path}: LMDB map full at {current} bytes, the map limit (map_size="
                    f"{self.map_limit}); records take {self._total()} of max_bytes={self.max_bytes}. "
                    f"Nothing was written by this call; raise map_size or lower max_bytes")
            self._env.set_mapsize(min(self.map_limit, 2 * current))

    def _total(self) -> int:
        with self._env.begin(buffers=True) as txn:
            raw = txn.get(_M_TOTAL, db=self._meta)
            return self._field(_U64, raw, "meta record_bytes")[0] if raw is not None else 0

    def _new_segment_id(self) -> int:
        def take(txn: lmdb.Transaction) -> int:
            raw = txn.get(_M_NEXT_SEGMENT, db=self._meta)
            seg = self._field(_U32, raw, "meta next_segment")[0] if raw is not None else 1
            txn.put(_M_NEXT_SEGMENT, _U32.pack(seg + 1), db=self._meta)
            txn.put(_segment_end_key(seg), _U64.pack(0), db=self._meta)
            return seg

        return self._run(take, write=True)

    def _now_ns(self) -> int:
        with self._access_lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreError(f"{self.path}: store was opened readonly")

    # ------------------------------------------------------------------ access bookkeeping
    def _touch(self, txn: lmdb.Transaction, kb: bytes, ns: int, size: int | None = None) -> None:
        """Set ``kb``'s last access to ``ns`` (``size``: its record bytes when just written)."""
        old = txn.get(kb, db=self._atime)
        if old is not None:
            old_ns, old_size = self._field(_ATIME, old, "an access-time entry")
            txn.delete(_LRU_NS.pack(old_ns) + kb, db=self._lru)
            if size is None:
                size = old_size
        elif size is None:
            return  # the record is gone (deleted or evicted meanwhile): nothing to touch
        txn.put(kb, _ATIME.pack(ns, size), db=self._atime)
        txn.put(_LRU_NS.pack(ns) + kb, b"", db=self._lru)

    def _remove(self, txn: lmdb.Transaction, kb: bytes, freed: list[Location]) -> int:
        """Unindex record ``kb`` and its access entries (its location is appended to
        ``freed``, to punch once the transaction committed); returns its accounted bytes."""
        found = unpack_entry(txn.get(kb, db=self._records))
        if found is not None:
            freed.append(found[0])
        size = 0
        old = txn.get(kb, db=self._atime)
        if old is not None:
            old_ns, size = self._field(_ATIME, old, "an access-time entry")
            txn.delete(_LRU_NS.pack(old_ns) + kb, db=self._lru)
            txn.delete(kb, db=self._atime)
        txn.delete(kb, db=self._records)
        return size

    def _get_total(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_M_TOTAL, db=self._meta)
        return self._field(_U64, raw, "meta record_bytes")[0] if raw is not None else 0

    def _evict_for(self, txn: lmdb.Transaction, total: int, need: int, freed: list[Location], *,
                   limit: int | None = None, max_records: int | None = None) -> tuple[int, int]:
        """Evict least recently accessed records until ``need`` more bytes fit in ``limit``
        (default ``max_bytes``), or ``max_records`` were evicted; records the
        :attr:`eviction_guard` holds are skipped. Returns (bytes left, records evicted).

        Raises StoreFullError when a put (``need > 0``) cannot make room because the
        guard holds the rest; ``gc`` (``need == 0``) then stops short of its bound."""
        bound = self.max_bytes if limit is None else limit
        if total + need <= bound:
            return total, 0
        victims, _, kept = select_victims(self._lru_candidates(txn), total + need - bound, self.eviction_guard,
                                          max_records=max_records)
        for kb in victims:
            total -= self._remove(txn, kb, freed)
        if total + need > bound and (max_records is None or len(victims) < max_records):
            if kept and need:
                raise StoreFullError(
                    f"{self.path}: no room for {need} bytes: records take {total} of {bound} bytes and the "
                    f"{kept} least recently used that could go are held by the store's eviction guard "
                    f"(uploads to a farther level still pending); nothing was written by this call")
            if not kept:
                raise StoreError(f"{self.path}: accounting broken: {total} bytes recorded but no "
                                 f"record left to evict")
        return total, len(victims)

    def _lru_candidates(self, txn: lmdb.Transaction) -> Iterator[tuple[bytes, RecordKey | None, int]]:
        """Every record, least recently accessed first: (key bytes, its RecordKey when an
        eviction guard is set, accounted bytes)."""
        guarded = self.eviction_guard is not None
        cur = txn.cursor(db=self._lru)
        ok = cur.first()
        while ok:
            kb = bytes(cur.key()[_LRU_NS.size:])
            raw = txn.get(kb, db=self._atime)
            key = None
            if guarded:
                try:
                    key = RecordKey.from_bytes(kb)
                except ValueError:  # not a RecordKey: nothing can hold it
                    key = None
            yield kb, key, _ATIME.unpack(raw)[1] if raw is not None else 0
            ok = cur.next()

    def _take_access(self) -> dict[bytes, int]:
        with self._access_lock:
            taken, self._access = self._access, {}
            self._access_since = time.monotonic()
            return taken

    def _restore_access(self, taken: dict[bytes, int]) -> None:
        with self._access_lock:
            for kb, ns in taken.items():
                if self._access.get(kb, 0) < ns:
                    self._access[kb] = ns

    def _apply_access(self, txn: lmdb.Transaction, taken: dict[bytes, int]) -> None:
        for kb, ns in taken.items():
            self._touch(txn, kb, ns)

    def _flush_access(self) -> None:
        """Write the queued access times and this handle's counter deltas into the lifetime
        counters (one transaction). Raises StoreFullError."""
        taken = self._take_access()
        delta = self._stats.take_deltas()
        if not taken and not any(delta.values()):
            return

        def write(txn: lmdb.Transaction) -> None:
            self._apply_access(txn, taken)
            if any(delta.values()):
                totals = self._get_counters(txn)
                txn.put(_M_COUNTERS, b"".join(_U64.pack(max(0, totals[k] + delta[k])) for k in StoreStats.NAMES),
                        db=self._meta)

        try:
            self._run(write, write=True)
        except BaseException:
            self._restore_access(taken)
            self._stats.restore_deltas(delta)
            raise

    def _get_counters(self, txn: lmdb.Transaction) -> dict[str, int]:
        raw = txn.get(_M_COUNTERS, db=self._meta)
        if raw is None or len(raw) != 8 * len(StoreStats.NAMES):
            return dict.fromkeys(StoreStats.NAMES, 0)
        return {k: _U64.unpack_from(raw, 8 * i)[0] for i, k in enumerate(StoreStats.NAMES)}

    def _maybe_flush_access(self) -> None:
        with self._access_lock:
            due = (len(self._access) >= _ACCESS_QUEUE_MAX
                   or (self._access and time.monotonic() - self._access_since >= self._access_flush_s))
        if due:
            try:
                self._flush_access()
            except StoreFullError:
                # Access times are LRU hints: on a full disk they stay queued (one entry per
                # key at most) and reads go on; the next put or flush writes them.
                pass

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
        if not items:
            return []
        batch = self._prepare_put(items)
        try:
            while True:
                if batch.new:
                    self._append_batch(batch)
                outcome = self._commits.submit(batch)
                if outcome is not REWRITE:
                    break
        finally:
            if batch.appended is not None:  # not committed (the store closed before its turn)
                self._segments.give_up([batch.appended])
        results, evicted, corrupt, written, freed = outcome
        self._segments.punch(freed)
        self._stats.add(puts=sum(results), put_bytes=written, evictions=evicted, corrupt=corrupt)
        return results

    def _prepare_put(self, items: list[PutItem]) -> _PutBatch:
        """What one ``put_many`` writes: record sizes, which keys are new (an indexed key
        keeps its record if it verifies: write-once; a corrupt one is replaced), the index
        values seen. StoreFullError: a record larger than ``max_bytes``."""
        sizes = [record_size(item.payload_bytes) for item in items]
        for item, size in zip(items, sizes):
            if size > self.max_bytes:
                raise StoreFullError(f"{self.path}: record {item.key!r} of {size} bytes is larger "
                                     f"than max_bytes={self.max_bytes}")
        kbs = [item.key.to_bytes() for item in items]
        seen = self._run(lambda txn: [txn.get(kb, db=self._records) for kb in kbs], write=False)
        seen = [bytes(v) if v is not None else None for v in seen]
        present = {i for i, v in enumerate(seen) if v is not None}
        corrupt_seen = self._corrupt_among([(i, items[i].key, seen[i]) for i in sorted(present)])
        first: dict[bytes, int] = {}
        for i, kb in enumerate(kbs):
            first.setdefault(kb, i)
        new = [i for i, kb in enumerate(kbs) if first[kb] == i and (i not in present or i in corrupt_seen)]
        return _PutBatch(items, kbs, sizes, seen, new)

    def _append_batch(self, batch: _PutBatch) -> None:
        """Encode ``batch``'s new records into this thread's staging buffer and write them
        to a range of the segment reserved for it (in parallel with other writers); not
        yet synced. Sets ``batch.appended`` and ``batch.locs``. StoreFullError: the disk
        is full (nothing of this batch was kept)."""
        checksums: list[bytes] = []
        hook = self._commits.hook

        def fill(j: int, dst: np.ndarray) -> None:
            item = batch.items[batch.new[j]]
            encode_record_into(dst, key=item.key, parent_hash=item.parent_hash, token_digest=item.token_digest,
                               layout_fingerprint=self.layout_fingerprint, payload=item.payload)
            checksums.append(bytes(dst[-CHECKSUM_BYTES:]))
            hook(FaultPoint.STAGED, j)

        try:
            appended = self._segments.append_records([batch.sizes[i] for i in batch.new], fill)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise StoreFullError(f"{self.path}: disk full ({e}); nothing was written by this call, "
                                     f"stored records are intact") from e
            raise
        batch.appended = appended
        batch.locs = {i: (loc, checksum) for i, loc, checksum in zip(batch.new, appended.locations, checksums)}
        hook(FaultPoint.APPENDED, batch)

    def _sync_group(self, batches: list[_PutBatch]) -> list[Any]:
        """The sync stage of a group of written batches (a leader's work, see
        group_commit.py): one ``fdatasync`` per segment they lie in. Returns each batch's
        outcome: SYNCED (its index entries may now be committed: the index never points at
        bytes that are not durable), REWRITE (its segment was given up by a failed sync),
        or the error of the failed sync (its bytes are given up)."""
        outcomes: list[Any] = [SYNCED] * len(batches)
        for j, b in enumerate(batches):
            if b.appended is not None and b.appended.segment.failed:  # a failed sync gave its segment up
                self._segments.give_up([b.appended])
                b.appended, outcomes[j] = None, REWRITE
        live = [j for j, outcome in enumerate(outcomes) if outcome is SYNCED]
        appended = [batches[j].appended for j in live if batches[j].appended is not None]
        if appended:
            try:
                self._segments.sync(appended)
            except BaseException as e:  # every batch of the sync fails with it
                self._segments.give_up(appended, sync_failed=True)
                for j in live:
                    batches[j].appended, outcomes[j] = None, e
                return outcomes
        self._commits.hook(FaultPoint.SYNCED, len(live))
        return outcomes

    def _index_group(self, group: list[_PutBatch]) -> list[Any]:
        """The index stage of a group: its synced batches in one transaction (with the
        queued access times and each segment's indexed end); if it fails for a group of
        several, each batch in a transaction of its own, in segment order, so that only
        the batches that fail alone get an error (their bytes are given back). Returns
        each batch's outcome (its ``_index_puts`` result or its error); releases every
        batch's segment range."""
        outcomes = self._index_txns(group)
        self._commits.hook(FaultPoint.INDEXED, len(group))
        return outcomes

    def _index_txns(self, group: list[_PutBatch]) -> list[Any]:
        appended = [b.appended for b in group if b.appended is not None]
        ends = self._segments.indexed_ends(appended)
        taken = self._take_access()
        try:
            outcomes: list[Any] = self._run(lambda txn: self._index_txn(txn, group, ends, taken),
                                            write=True, need=len(group) << 13)
        except BaseException as e:
            self._restore_access(taken)
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
            ends = self._segments.indexed_ends(mine)
            try:
                outcomes[j] = self._run(lambda txn: self._index_txn(txn, [b], ends, {})[0], write=True, need=8 << 10)
            except BaseException as e:
                outcomes[j] = e
                self._settle([b], given_up=True)
            else:
                self._settle([b], given_up=False)
        return outcomes

    def _settle(self, batches: list[_PutBatch], *, given_up: bool) -> None:
        """The batches' segment ranges are indexed (released) or will not be (given up)."""
        appended = [b.appended for b in batches if b.appended is not None]
        for b in batches:
            b.appended = None
        if given_up:
            self._segments.give_up(appended)
        else:
            self._segments.release(appended)

    def _index_txn(self, txn: lmdb.Transaction, batches: list[_PutBatch], ends: dict[int, int],
                   taken: dict[bytes, int]) -> list[Any]:
        """One index transaction: the queued access times, each segment's indexed end
        (``ends``: a recovery scan starts there), then each batch's records."""
        self._apply_access(txn, taken)
        for seg, end in ends.items():
            txn.put(_segment_end_key(seg), _U64.pack(end), db=self._meta)
            self._bump_segment_gen(txn, seg)
        return [self._index_puts(txn, b.items, b.kbs, b.sizes, b.seen, b.new, b.locs) for b in batches]

    def _bump_segment_gen(self, txn: lmdb.Transaction, seg: int) -> None:
        """Mark segment ``seg`` as indexed into by this transaction (see _reclaim)."""
        raw = txn.get(_segment_gen_key(seg), db=self._meta)
        n = _U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == _U64.size else 0
        txn.put(_segment_gen_key(seg), _U64.pack(n + 1), db=self._meta)

    def _corrupt_among(self, present: list[tuple[int, RecordKey, bytes]]) -> set[int]:
        """Which of the indexed records ``(index, key, index value)`` fail their checks."""
        if not present:
            return set()
        with self._rw.shared():
            check_open(self._closed, str(self.path))
            _, failed = self._read_verified([(i, key, value, None, None) for i, key, value in present])
        return set(failed)

    def _index_puts(self, txn: lmdb.Transaction, items: Sequence[PutItem], kbs: list[bytes], sizes: list[int],
                    seen: list[bytes | None], new: list[int], locs: dict[int, tuple[Location, bytes]]
                    ) -> tuple[list[bool], int, int, int, list[Location]]:
        """Index one ``put_many``'s records (in the group's transaction). Returns
        ``(results, evicted, corrupt replaced, bytes written, locations to punch)``."""
        total = self._get_total(txn)
        freed: list[Location] = []
        results: list[bool] = []
        evicted = corrupt = written = 0
        new_set = set(new)
        for i, (kb, size) in enumerate(zip(kbs, sizes)):
            now = txn.get(kb, db=self._records)
            now = bytes(now) if now is not None else None
            if i not in new_set:
                if now is not None:
                    self._touch(txn, kb, self._now_ns())
                    results.append(False)
                    continue
                # gone meanwhile (deleted / evicted): nothing of ours to index for it
                results.append(False)
                continue
            loc, checksum = locs[i]
            if now is not None:
                if now != seen[i]:  # another writer stored it meanwhile: keep theirs
                    freed.append(loc)
                    self._touch(txn, kb, self._now_ns())
                    results.append(False)
                    continue
                corrupt += 1  # the corrupt record we saw: replaced
                total -= self._remove(txn, kb, freed)
            total, n = self._evict_for(txn, total, size, freed)
            evicted += n
            txn.put(kb, pack_entry(loc, checksum), db=self._records)
            self._touch(txn, kb, self._now_ns(), size=size)
            total += size
            written += size
            results.append(True)
        txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)
        return results, evicted, corrupt, written, freed

    def delete(self, key: RecordKey) -> bool:
        check_open(self._closed, str(self.path))
        self._check_writable()
        kb = key.to_bytes()
        with self._access_lock:
            self._access.pop(kb, None)
        freed: list[Location] = []

        def remove(txn: lmdb.Transaction) -> bool:
            if txn.get(kb, db=self._records) is None:
                return False
            total = self._get_total(txn) - self._remove(txn, kb, freed)
            txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)
            return True

        gone = self._run(remove, write=True)
        self._segments.punch(freed)
        return gone

    def _remove_if_corrupt(self, bad: list[tuple[bytes, bytes]]) -> int:
        """Unindex the records of ``bad`` (key bytes, the index value that failed) whose
        index value is still that one (another process may have replaced it); returns how
        many were removed."""
        freed: list[Location] = []

        def remove(txn: lmdb.Transaction) -> int:
            total = self._get_total(txn)
            n = 0
            for kb, value in bad:
                now = txn.get(kb, db=self._records)
                if now is not None and bytes(now) == value:
                    total -= self._remove(txn, kb, freed)
                    n += 1
            txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)
            return n

        try:
            n = self._run(remove, write=True)
        except StoreFullError:
            # Deleting needs fresh pages (copy-on-write); on a full disk the bad record
            # stays indexed, and stays a miss: every read verifies it again.
            return 0
        self._segments.punch(freed)
        return n

    # ------------------------------------------------------------------ reads
    def _read_verified(self, jobs: list[tuple[int, RecordKey, bytes, Any, bytes | None]]
                       ) -> tuple[dict[int, RecordMeta], list[int]]:
        """Read and verify records. ``jobs``: (index, key, index value, out as
        :class:`~tiered_kv.storage.record.OutSegments` (a scatter list, often of one) or None, expected token digest).
        Returns index -> meta for the good ones and the indices that failed (read or
        check). ValueError: an out buffer of the wrong size for a valid record.

        An index entry whose length does not fit in its segment file (torn, or corrupt:
        e.g. an absurd length) fails without allocating anything of that size."""
        fp = self.layout_fingerprint
        verifier = self._parts_verifier()
        expectation = verifier.expectation
        tasks: list[ReadTask] = []
        heads = np.empty((len(jobs), HEADER_BYTES), np.uint8)
        tails = np.empty((len(jobs), CHECKSUM_BYTES), np.uint8)
        odd: list[tuple[int, RecordKey, Location, Any, bytes | None]] = []
        info: dict[int, tuple[RecordKey, bytes, bytes | None]] = {}
        failed: list[int] = []

        def check(t: ReadTask) -> None:  # in the reading thread, while the record is in the CPU cache
            key, checksum, digest = info[t.index]
            t.result = verifier.verify(t.header.tobytes(), t.digest, t.tail, key=key, record_bytes=t.loc.length,
                                       checksum=checksum, token_digest=digest)

        # Each task is handed to the reader as soon as it is made: natively, helper threads
        # read and check the first records while this loop prepares the next ones.
        reader = self._segments.batch_read(len(jobs), sum(out.nbytes for _, _, _, out, _ in jobs if out is not None),
                                           check)
        try:
            for i, key, value, out, digest in jobs:
                if len(value) != _ENTRY.size:
                    failed.append(i)  # not an index entry
                    continue
                seg, offset, length, checksum = _ENTRY.unpack(value)
                loc = Location(seg, offset, length)
                payload_bytes = length - (HEADER_BYTES + CHECKSUM_BYTES)
                if out is None:
                    if payload_bytes < 0 or not self._segments.holds(loc):
                        failed.append(i)
                        continue
                    out = as_out_segments(np.empty(payload_bytes, np.uint8))
                if payload_bytes < 0 or out.nbytes != payload_bytes:
                    odd.append((i, key, loc, out, digest))
                    continue
                info[i] = (key, checksum, digest)
                k = len(tasks)
                task = ReadTask(i, loc, heads[k], out, tails[k], expect=expectation(key, length, checksum, digest))
                tasks.append(task)
                reader.add(task)
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
        for i, key, loc, out, digest in odd:  # stored size differs from the out buffer's
            if loc.length < HEADER_BYTES + CHECKSUM_BYTES or not self._segments.holds(loc):
                failed.append(i)  # never allocate what an entry claims unchecked
                continue
            whole = np.empty(loc.length, np.uint8)
            task = ReadTask(i, loc, whole[:HEADER_BYTES], [whole[HEADER_BYTES:-CHECKSUM_BYTES]],
                            whole[-CHECKSUM_BYTES:])
            self._segments.read([task])
            try:
                if not task.ok:
                    raise CorruptRecordError(RecordCheck.TRUNCATED, "record bytes could not be read")
                meta = decode_record(whole, expect_key=key, expect_fingerprint=fp, expect_token_digest=digest)
            except CorruptRecordError:
                failed.append(i)
                continue
            if out.nbytes != meta.payload_bytes:
                raise ValueError(f"out: expected {meta.payload_bytes} bytes (the stored payload of "
                                 f"{key!r}), got {out.nbytes}")
            write_segments(out, whole[HEADER_BYTES:HEADER_BYTES + meta.payload_bytes])
            metas[i] = meta
        return metas, sorted(failed)

    def _parts_verifier(self) -> PartsVerifier:
        """The verifier of this store's fingerprint (made once: it holds no per-record state)."""
        v = self._verifier
        if v is None or v.fingerprint != self.layout_fingerprint:
            v = self._verifier = PartsVerifier(self.layout_fingerprint)
        return v

    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, str(self.path))
        keys, dsts, digests = self._check_get_args(keys, outs, token_digests, scatter=True)
        kbs = [key.to_bytes() for key in keys]
        values = self._run(lambda txn: [None if (v := txn.get(kb, db=self._records)) is None else bytes(v)
                                        for kb in kbs], write=False)
        jobs = [(i, keys[i], v, dsts[i], digests[i]) for i, v in enumerate(values) if v is not None]
        with self._rw.shared():
            check_open(self._closed, str(self.path))
            good, failed = self._read_verified(jobs)
        bad = self._still_indexed([(kbs[i], values[i]) for i in failed])
        metas: list[RecordMeta | None] = [good.get(i) for i in range(len(keys))]
        hits = len(good)
        self._stats.add(hits=hits, misses=len(metas) - hits, corrupt=len(bad))
        if bad and not self.readonly:
            self._remove_if_corrupt(bad)
        if hits and not self.readonly:
            ns = self._now_ns()
            with self._access_lock:
                for kb, meta in zip(kbs, metas):
                    if meta is not None:
                        self._access[kb] = ns
            self._maybe_flush_access()
        return metas

    def _still_indexed(self, failed: list[tuple[bytes, bytes | None]]) -> list[tuple[bytes, bytes]]:
        """The failed reads whose index entry is unchanged: corrupt. The others raced with
        a delete, an eviction or a replacement by another writer: plain misses."""
        if not failed:
            return []

        def check(txn: lmdb.Transaction) -> list[tuple[bytes, bytes]]:
            out = []
            for kb, value in failed:
                now = txn.get(kb, db=self._records)
                if value is not None and now is not None and bytes(now) == value:
                    out.append((kb, value))
            return out

        return self._run(check, write=False)

    @property
    def supports_row_reads(self) -> bool:  # type: ignore[override]
        """``get_rows`` reads natively where the helper is built (else through get_many)."""
        return fastread.read_verify_rows is not None

    def get_rows(self, keys: Sequence[RecordKey], rows: RowScatter, *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[bool]:
        """See :meth:`BlockStore.get_rows`. Natively: one read transaction looks up every
        key, then :meth:`SegmentFiles.read_rows` reads and verifies the batch on its
        threads, each record's pieces straight into ``rows`` (the same checks as
        ``get_many``: header, both checksums, fingerprint, key, token digest). Failures
        are counted and a corrupt record unindexed as by ``get_many``."""
        if fastread.read_verify_rows is None or not keys:
            return super().get_rows(keys, rows, token_digests=token_digests)
        check_open(self._closed, str(self.path))
        keys, digests = self._check_rows_args(keys, rows, token_digests)
        if len({d is None for d in digests}) > 1:  # one expectation size per native call
            return super().get_rows(keys, rows, token_digests=digests)
        kbs = [key.to_bytes() for key in keys]
        values = self._run(lambda txn: [None if (v := txn.get(kb, db=self._records)) is None else bytes(v)
                                        for kb in kbs], write=False)
        verifier, payload = PartsVerifier(self.layout_fingerprint), rows.nbytes
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
            with self._rw.shared():
                check_open(self._closed, str(self.path))
                status = self._segments.read_rows([loc for _, loc, _ in read],
                                                  rows.take([i for i, _, _ in read]), expects)
            for (i, _, _), st in zip(read, status.tolist()):
                if st == fastread.VERIFIED:
                    ok[i] = True
                else:
                    failed.append(i)
        if odd:
            for i, got in zip(odd, super().get_rows([keys[i] for i in odd], rows.take(odd),
                                                    token_digests=[digests[i] for i in odd])):
                ok[i] = got
        bad = self._still_indexed([(kbs[i], values[i]) for i in failed])
        hits = sum(ok) - sum(ok[i] for i in odd)  # (get_many counted the odd ones)
        self._stats.add(hits=hits, misses=len(keys) - len(odd) - hits, corrupt=len(bad))
        if bad and not self.readonly:
            self._remove_if_corrupt(bad)
        if hits and not self.readonly:
            ns = self._now_ns()
            with self._access_lock:
                for kb, good in zip(kbs, ok):
                    if good:
                        self._access[kb] = ns
            self._maybe_flush_access()
        return ok

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        """See :meth:`BlockStore.payload_sizes`: from the index, one read transaction."""
        kbs = [key.to_bytes() for key in keys]

        def read(txn: lmdb.Transaction) -> list[int | None]:
            out: list[int | None] = []
            for kb in kbs:
                found = unpack_entry(txn.get(kb, db=self._records))
                out.append(payload_of_record(found[0].length) if found is not None else None)
            return out

        return self._run(read, write=False)

    def contains(self, key: RecordKey) -> bool:
        kb = key.to_bytes()
        return self._run(lambda txn: txn.get(kb, db=self._records) is not None, write=False)

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        kbs = [key.to_bytes() for key in keys]
        return self._run(lambda txn: [txn.get(kb, db=self._records) is not None for kb in kbs], write=False)

    def contains_hashes(self, kind: RecordKind, hashes: Sequence[bytes]) -> list[bool]:
        """See :meth:`BlockStore.contains_hashes`: the key bytes made straight from the hashes."""
        prefix = bytes((RecordKind(kind),))
        if not set(map(type, hashes)) <= {bytes} or not set(map(len, hashes)) <= {KEY_BYTES - 1}:
            raise ValueError(f"hashes: expected {KEY_BYTES - 1}-byte bytes objects")
        db = self._records
        return self._run(lambda txn: [txn.get(prefix + h, db=db) is not None for h in hashes], write=False)

    def __iter__(self) -> Iterator[RecordKey]:
        def keys(txn: lmdb.Transaction) -> list[bytes]:
            return [bytes(k) for k in txn.cursor(db=self._records).iternext(keys=True, values=False)]

        out = []
        for kb in self._run(keys, write=False):
            try:
                out.append(RecordKey.from_bytes(kb))
            except ValueError:
                continue  # not a record key: verify reports it, verify --repair removes it
        return iter(out)

    def __len__(self) -> int:
        return self._run(lambda txn: txn.stat(self._records)["entries"], write=False)

    def stats(self) -> dict[str, Any]:
        if not self.readonly:
            self._maybe_flush_access_now()

        def read(txn: lmdb.Transaction) -> dict[str, Any]:
            cur = txn.cursor(db=self._lru)
            oldest = self._lru_ns(cur.key()) if cur.first() else None
            newest = self._lru_ns(cur.key()) if cur.last() else None
            lifetime = {f"lifetime_{k}": v for k, v in self._get_counters(txn).items()}
            writer = txn.get(_M_WRITER, db=self._meta)
            return {"records": txn.stat(self._records)["entries"], "bytes": self._get_total(txn),
                    "oldest_access_ns": oldest, "newest_access_ns": newest,
                    "writer": parse_recorded(None if writer is None else bytes(writer)), **lifetime}

        out: dict[str, Any] = {"backend": "lmdb", "path": str(self.path),
                               "layout_fingerprint": self.layout_fingerprint, "max_bytes": self.max_bytes}
        out.update(self._run(read, write=False))
        out.update(self._stats.as_dict())
        out["map_size"] = self._env.info()["map_size"]
        out["map_limit"] = self.map_limit
        out["segments"] = len(self._segments.segment_ids())
        out["segment_disk_bytes"] = self._segments.disk_bytes()
        out["open_segment_files"] = self._segments.open_files
        out["direct_io"] = self._segments.direct_io
        out["recovered_records"] = self._recovered
        return out

    def _maybe_flush_access_now(self) -> None:
        try:
            self._flush_access()
        except StoreFullError:
            pass  # hints stay queued (see _maybe_flush_access)

    # ------------------------------------------------------------------ maintenance
    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """Check every record (see :meth:`BlockStore.verify`): every index entry is read
        and verified, in batches; with ``repair`` the bad ones are unindexed (each only if
        its entry is still the one that failed). Also reports ``accounted_bytes`` (the
        store's running total) and ``actual_bytes`` (the sizes of the indexed records);
        ``repair`` sets the total to the actual bytes and gives back unindexed segment
        space (as :meth:`gc` does).

        The index itself is checked whole first: every page of every sub-database is
        walked (see lmdb_file), then every entry of ``meta``, ``atime`` and ``lru`` is
        checked against its format and against ``records`` (``index_problems``: one line
        per kind of problem; ``repair`` fixes them). An index whose pages are damaged
        raises IndexDamagedError (never a count of 0 corrupt); a writable open rebuilds
        it from the segments (``index_rebuilt``: what that rebuild did, else None)."""
        check_open(self._closed, str(self.path))
        if repair:
            self._check_writable()
        with self._rw.shared():
            check_open(self._closed, str(self.path))
            try:
                self._walk_snapshot(self._env)
            except IndexDamage as e:
                raise IndexDamagedError(str(self.path), str(e)) from None
        index_problems = self._run(lambda txn: [p.line() for p in self._index_entry_problems(txn)], write=False)

        def scan(txn: lmdb.Transaction) -> tuple[list[tuple[bytes, bytes]], int | None]:
            raw = txn.get(_M_TOTAL, db=self._meta)
            total = _U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == _U64.size else None
            return [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._records)], total

        entries, accounted = self._run(scan, write=False)
        actual = 0
        bad: list[tuple[bytes, bytes]] = []
        batch: list[tuple[int, RecordKey, bytes, Any, bytes | None]] = []
        batch_bytes = 0

        def run_batch() -> None:
            nonlocal batch, batch_bytes
            with self._rw.shared():
                _, failed = self._read_verified(batch)
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
            if batch_bytes >= (64 << 20) or len(batch) >= 256:
                run_batch()
        if batch:
            run_batch()
        removed = 0
        if repair:
            if index_problems:
                self._run(self._repair_index_entries, write=True)
            removed = self._remove_if_corrupt(bad)
            freed: list[Location] = []

            def fix(txn: lmdb.Transaction) -> None:
                total = 0
                for kb, value in txn.cursor(db=self._records):
                    kb = bytes(kb)
                    found = unpack_entry(value)
                    if found is None:
                        total -= self._remove(txn, kb, freed)
                        continue
                    total += found[0].length
                    if txn.get(kb, db=self._atime) is None:  # not in the LRU index: add it
                        self._touch(txn, kb, self._now_ns(), size=found[0].length)
                txn.put(_M_TOTAL, _U64.pack(max(total, 0)), db=self._meta)

            self._run(fix, write=True)
            self._segments.punch(freed)
            self._stats.add(corrupt=removed)
            self._reclaim()
        return {"checked": len(entries), "corrupt": len(bad), "removed": removed,
                "corrupt_keys": [kb.hex() for kb, _ in bad], "accounted_bytes": accounted,
                "actual_bytes": actual, "index_problems": index_problems, "index_rebuilt": self.index_rebuild}

    def _index_entry_problems(self, txn: lmdb.Transaction) -> list[_EntryProblem]:
        """The entries of ``meta``, ``atime`` and ``lru`` that do not have their format or
        disagree with each other or with ``records``, and records without an access
        entry (a record's own entry is checked by reading the record). Grouped by kind."""
        found: dict[str, _EntryProblem] = {}

        def note(kind: str, key: bytes) -> None:
            found.setdefault(kind, _EntryProblem(kind, 0, key)).count += 1

        for kb, value in txn.cursor(db=self._meta):  # (keys this code does not know are left alone)
            kb = bytes(kb)
            want = self._meta_value_bytes(kb)
            if want is not None and want >= 0 and len(value) != want:
                note("meta: a value of the wrong length", kb)
        nxt = txn.get(_M_NEXT_SEGMENT, db=self._meta)
        on_disk = self._segments.segment_ids()
        if nxt is not None and len(nxt) == _U32.size and on_disk and _U32.unpack(bytes(nxt))[0] <= on_disk[-1]:
            note("meta: next_segment not past the last segment file", _M_NEXT_SEGMENT)
        for kb, value in txn.cursor(db=self._atime):
            kb = bytes(kb)
            if len(kb) != KEY_BYTES or len(value) != _ATIME.size:
                note("atime: an entry of the wrong length", kb)
            elif txn.get(kb, db=self._records) is None:
                note("atime: an entry of a record that is not indexed", kb)
            elif txn.get(_LRU_NS.pack(_ATIME.unpack(bytes(value))[0]) + kb, db=self._lru) is None:
                note("atime: an entry with no lru entry", kb)
        for kb, value in txn.cursor(db=self._lru):
            kb = bytes(kb)
            if len(kb) != _LRU_NS.size + KEY_BYTES or len(value) != 0:
                note("lru: an entry of the wrong length", kb)
                continue
            at = txn.get(kb[_LRU_NS.size:], db=self._atime)
            if at is None or len(at) != _ATIME.size or _ATIME.unpack(bytes(at))[0] != _LRU_NS.unpack(kb[:8])[0]:
                note("lru: an entry that disagrees with atime", kb)
        for kb in txn.cursor(db=self._records).iternext(keys=True, values=False):
            if txn.get(kb, db=self._atime) is None:
                note("records: a record with no access entry", bytes(kb))
        return list(found.values())

    @staticmethod
    def _meta_value_bytes(kb: bytes) -> int | None:
        """The length a ``meta`` value of key ``kb`` must have (-1: any), None for a key
        this code does not write (a newer version's: never a problem)."""
        if kb.startswith(_M_SEGMENT_END):
            return _U64.size if len(kb) == len(_M_SEGMENT_END) + _U32BE.size else None
        if kb.startswith(_M_SEGMENT_GEN):
            return _U64.size if len(kb) == len(_M_SEGMENT_GEN) + _U32BE.size else None
        return {_M_FORMAT: _U16.size, _M_RECORD_FORMAT: _U16.size, _M_FINGERPRINT: -1, _M_TOTAL: _U64.size,
                _M_NEXT_SEGMENT: _U32.size, _M_COUNTERS: _U64.size * len(StoreStats.NAMES)}.get(kb)

    def _repair_index_entries(self, txn: lmdb.Transaction) -> None:
        """Fix what :meth:`_index_entry_problems` finds: access entries of the wrong
        length or of records not indexed are deleted (``verify``'s repair then gives each
        record without one a fresh access time), a bad ``segment_end`` is set to 0 (the
        next recovery scans the segment whole; indexed keys are skipped), a bad
        ``segment_gen`` is set to 0, bad counters are reset, ``next_segment`` moves past
        the last segment file."""
        stale_atime = [bytes(k) for k, v in txn.cursor(db=self._atime)
                       if len(k) != KEY_BYTES or len(v) != _ATIME.size or txn.get(k, db=self._records) is None]
        for kb in stale_atime:
            txn.delete(kb, db=self._atime)
        stale_lru = []
        for kb in txn.cursor(db=self._lru).iternext(keys=True, values=False):
            kb = bytes(kb)
            at = txn.get(kb[_LRU_NS.size:], db=self._atime) if len(kb) == _LRU_NS.size + KEY_BYTES else None
            if at is None or _ATIME.unpack(bytes(at))[0] != _LRU_NS.unpack(kb[:8])[0]:
                stale_lru.append(kb)
        for kb in stale_lru:
            txn.delete(kb, db=self._lru)
        for kb in [bytes(k) for k in txn.cursor(db=self._atime).iternext(keys=True, values=False)]:
            ns = _ATIME.unpack(bytes(txn.get(kb, db=self._atime)))[0]
            if txn.get(_LRU_NS.pack(ns) + kb, db=self._lru) is None:
                txn.delete(kb, db=self._atime)  # re-touched by verify's repair
        for kb, value in [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._meta)]:
            want = self._meta_value_bytes(kb)
            if want is None or want < 0 or len(value) == want:
                continue
            if kb.startswith(_M_SEGMENT_END):
                txn.put(kb, _U64.pack(0), db=self._meta)
            elif kb.startswith(_M_SEGMENT_GEN):
                txn.put(kb, _U64.pack(0), db=self._meta)  # (moved: a gc that read it skips the segment)
            elif kb in (_M_COUNTERS, _M_TOTAL):
                txn.delete(kb, db=self._meta)  # counters restart; the total is recomputed
        on_disk = self._segments.segment_ids()
        nxt = txn.get(_M_NEXT_SEGMENT, db=self._meta)
        if on_disk and (nxt is None or len(nxt) != _U32.size or _U32.unpack(bytes(nxt))[0] <= on_disk[-1]):
            txn.put(_M_NEXT_SEGMENT, _U32.pack(on_disk[-1] + 1), db=self._meta)

    def _recover(self) -> int:
        """Index the records that writers which died (kill -9, OS crash) appended past
        their segments' indexed end: each segment no writer holds is scanned from its
        ``segment_end`` to its end, every record verified (header, checksum, fingerprint)
        and indexed unless its key is; then ``segment_end`` moves to the segment's end.
        Runs on a writable open and before ``gc`` reclaims space. Returns how many records
        were indexed."""
        recovered = 0
        for seg in self._segments.segment_ids():
            with self._segments.sealed(seg) as fd:
                if fd is None:
                    continue
                start = self._run(lambda txn: self._indexed_end(txn, seg), write=False)
                size = os.fstat(fd).st_size
                if start is None or start >= size:
                    continue  # fully indexed (or a segment of a store written before this scan)
                try:
                    found = _scan_segment(fd, seg, start, size, self.layout_fingerprint)
                except OSError:
                    continue  # unreadable (EIO): its records stay misses, the next open tries again
                n, freed = self._run(lambda txn: self._index_recovered(txn, seg, found, size), write=True,
                                     need=8 << 10)
            self._segments.punch(freed)
            recovered += n
        self._recovered += recovered
        return recovered

    def _indexed_end(self, txn: lmdb.Transaction, seg: int) -> int | None:
        """Where the recovery scan of segment ``seg`` starts: its ``segment_end``; 0 for a
        segment whose id allocation the index lost (an OS crash: nothing can point into
        it); None for a segment of a store written before segment ends were kept."""
        raw = txn.get(_segment_end_key(seg), db=self._meta)
        if raw is not None:
            return self._field(_U64, raw, "meta segment_end")[0]
        nxt = txn.get(_M_NEXT_SEGMENT, db=self._meta)
        return 0 if nxt is not None and seg >= self._field(_U32, nxt, "meta next_segment")[0] else None

    def _index_recovered(self, txn: lmdb.Transaction, seg: int, found: list[tuple[bytes, Location, bytes]],
                         size: int) -> tuple[int, list[Location]]:
        total = self._get_total(txn)
        freed: list[Location] = []
        n = 0
        for kb, loc, checksum in found:
            if loc.length > self.max_bytes or txn.get(kb, db=self._records) is not None:
                continue  # write-once: an indexed key keeps its record
            total, _ = self._evict_for(txn, total, loc.length, freed)
            txn.put(kb, pack_entry(loc, checksum), db=self._records)
            self._touch(txn, kb, self._now_ns(), size=loc.length)
            total += loc.length
            n += 1
        txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)
        txn.put(_segment_end_key(seg), _U64.pack(size), db=self._meta)
        if n:
            self._bump_segment_gen(txn, seg)
        return n, freed

    def _reclaim(self) -> dict[str, int]:
        """Give back the segment space no index entry covers, after indexing what dead
        writers left (see _recover).

        One read transaction takes every segment's live ranges and ``segment_gen`` (the
        snapshot); then :meth:`SegmentFiles.reclaim` locks each segment in turn and asks
        :meth:`_reclaimable`, which reads the segment's ``segment_gen`` and
        ``segment_end`` again, now that the lock is held. The invariant (module
        docstring): gc only gives back bytes that no committed index entry covers at the
        moment it holds the segment's lock, and no index entry for that segment can be
        committed while it holds it."""
        try:
            self._recover()
        except StoreFullError:
            pass  # what it could not index is past its segment's segment_end: kept

        def snapshot(txn: lmdb.Transaction) -> tuple[dict[int, list[tuple[int, int]]], dict[int, bytes]]:
            live: dict[int, list[tuple[int, int]]] = {}
            for value in txn.cursor(db=self._records).iternext(keys=False, values=True):
                found = unpack_entry(value)
                if found is not None:
                    loc = found[0]
                    live.setdefault(loc.segment, []).append((loc.offset, loc.end))
            for ranges in live.values():
                ranges.sort()
            gens: dict[int, bytes] = {}
            cur = txn.cursor(db=self._meta)
            ok = cur.set_range(_M_SEGMENT_GEN)
            while ok and bytes(cur.key()).startswith(_M_SEGMENT_GEN):
                key = bytes(cur.key())
                if len(key) == len(_M_SEGMENT_GEN) + _U32BE.size:
                    gens[_U32BE.unpack(key[len(_M_SEGMENT_GEN):])[0]] = bytes(cur.value())
                ok = cur.next()
            return live, gens

        live, gens = self._run(snapshot, write=False)
        done = self._segments.reclaim(lambda seg: self._reclaimable(seg, live.get(seg, []), gens.get(seg)))
        self._forget_segments(done.removed)
        return {"segments_removed": len(done.removed), "punched_bytes": done.punched}

    def _reclaimable(self, seg: int, live: list[tuple[int, int]], gen: bytes | None) -> Reclaimable | None:
        """What gc may give back of segment ``seg``, whose lock it holds: its ``live``
        ranges as the snapshot saw them, if nothing was indexed into it since (its
        ``segment_gen`` is still ``gen``; else None: the next gc), up to its
        ``segment_end`` (past it: not scanned by a recovery yet, kept)."""
        def read(txn: lmdb.Transaction) -> tuple[bytes | None, int | None]:
            raw = txn.get(_segment_gen_key(seg), db=self._meta)
            return (None if raw is None else bytes(raw)), self._indexed_end(txn, seg)

        now, indexed_end = self._run(read, write=False)
        if now != gen:
            return None
        return Reclaimable(live, indexed_end)

    def _forget_segments(self, segs: list[int]) -> None:
        """Drop the ``meta`` entries of segments gc unlinked (ids are never reused).
        Best effort: on a full disk they stay (they take a few bytes each)."""
        if not segs:
            return

        def forget(txn: lmdb.Transaction) -> None:
            for seg in segs:
                txn.delete(_segment_end_key(seg), db=self._meta)
                txn.delete(_segment_gen_key(seg), db=self._meta)

        try:
            self._run(forget, write=True)
        except StoreFullError:
            pass

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
        is taken back (see "Full disk" in the module docstring); ``full_disk`` says
        whether it came to that."""
        check_open(self._closed, str(self.path))
        self._check_writable()
        self._check_gc_bound(max_bytes)
        evicted = freed_bytes = 0
        batch, full = _ACCESS_QUEUE_MAX, False
        while True:
            taken = {} if full else self._take_access()  # (a full disk: no page to spare for hints)
            freed: list[Location] = []

            def evict(txn: lmdb.Transaction, taken: dict[bytes, int] = taken,
                      freed: list[Location] = freed, batch: int = batch) -> tuple[int, int, int]:
                self._apply_access(txn, taken)
                total = self._get_total(txn)
                left, n = self._evict_for(txn, total, 0, freed, limit=max_bytes, max_records=batch)
                txn.put(_M_TOTAL, _U64.pack(left), db=self._meta)
                return n, total - left, left

            try:
                n, gone, left = self._run(evict, write=True)
            except StoreFullError:
                self._restore_access(taken)
                if full and batch == _GC_FULL_DISK_BATCH:
                    raise
                full = True
                self._release_reserve()
                batch = max(_GC_FULL_DISK_BATCH, batch // 64)
                continue
            except BaseException:
                self._restore_access(taken)
                raise
            self._segments.punch(freed)
            evicted += n
            freed_bytes += gone
            if left <= max_bytes or n == 0:
                break
        self._stats.add(evictions=evicted)
        records = self._run(lambda txn: txn.stat(self._records)["entries"], write=False)
        out = {"evicted": evicted, "freed_bytes": freed_bytes, "bytes": left, "records": records,
               **self._reclaim(), "full_disk": full}
        self._keep_reserve()
        return out

    # ------------------------------------------------------------------ full disk: the index reserve
    @property
    def _reserve_file(self) -> Path:
        return self.path / _RESERVE_NAME

    def _keep_reserve(self) -> bool:
        """Hold ``index_reserve_bytes`` of disk in ``index.reserve`` (allocated, never
        written), for the deletes of a gc on a full disk: LMDB copies every page it
        changes, so even a delete needs new pages. Best effort: False where there is no
        room now (the next writable open or gc tries again). A reserve already there is
        kept as it is (its size is the store's)."""
        path = self._reserve_file
        if path.exists():
            return True
        st = os.statvfs(self.path)
        want = self._reserve_option or min(_DEFAULT_RESERVE, max(_MIN_RESERVE, st.f_blocks * st.f_frsize // 64))
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

    def _prepare_lock_file(self) -> bool:
        """Allocate the disk blocks of ``lock.mdb`` before LMDB maps it: LMDB writes its
        reader table through a shared mapping, and on a full disk the first write to a
        page the filesystem cannot allocate is a SIGBUS, not an error. Returns whether
        LMDB may use the lock file; False (a readonly open only) when it can be neither
        written nor allocated: that open goes on without it (see _lmdb_open). A writable
        open on a disk too full for it raises StoreFullError.

        Only before this process opens the environment: closing any descriptor of
        ``lock.mdb`` drops every LMDB lock the process holds on it."""
        try:
            fd = os.open(self.path / "lock.mdb", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            if self.readonly:
                return False  # a read-only mount or directory (LMDB would skip it on EROFS too)
            raise
        try:
            st = os.fstat(fd)
            if st.st_size == 0 and not self.readonly:
                os.fchmod(fd, 0o600)  # created here (or by create_private_file): owner-only
            err = allocate_blocks(fd, 0, max(st.st_size, _LOCK_FILE_BYTES))
            if err in (0, errno.EOPNOTSUPP, errno.ENOSYS) or \
                    (st.st_size and os.fstat(fd).st_blocks * 512 >= st.st_size):
                return True  # allocated (or the filesystem cannot say: as before)
        finally:
            os.close(fd)
        if self.readonly:
            return False
        raise StoreFullError(f"{self.path}: disk full: no room for the store's lock file (lock.mdb, "
                             f"{_LOCK_FILE_BYTES} bytes); free some space first")

    def _release_reserve(self) -> bool:
        """Give the reserve's disk space back (to the transaction about to retry)."""
        try:
            self._reserve_file.unlink()
            return True
        except FileNotFoundError:
            return False

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
            self._maybe_flush_access_now()  # on a full disk the last hints are lost; records are not
        with self._rw.exclusive():
            self._closed = True
            try:
                self._segments.close()
            finally:
                self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("readonly" if self.readonly else "open")
        return f"LmdbStore({str(self.path)!r}, {self.layout_fingerprint!r}, {state})"
