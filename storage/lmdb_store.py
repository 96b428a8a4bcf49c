"""LMDB block store: the embedded default (one directory, ACID, multi-process, zero-copy reads).

Layout of one environment directory (``data.mdb`` + ``lock.mdb``, both 0o600)::

    sub-db    key                                 value
    -------   ---------------------------------   -----------------------------------------
    records   RecordKey.to_bytes() (33 B)         the record (record.py format)
    meta      b"format_version"                   u16 LE, STORE_FORMAT_VERSION
              b"record_format_version"            u16 LE, record.FORMAT_VERSION
              b"layout_fingerprint"               ascii
              b"record_bytes"                     u64 LE, sum of the accounted record sizes
    atime     RecordKey bytes                     u64 LE last access ns, u64 LE record size
    lru       u64 BE last access ns + key bytes   b"" (ordered: the first entry is the LRU)

Access times are ``time.time_ns()`` (made strictly increasing within a process) so that they
agree between processes. ``atime`` and ``lru`` are kept together in the same write
transactions as the records, so eviction order survives restarts and is shared by every
process. Reads do not write: a hit queues its access time in memory and the queue is
applied by the next write transaction of this process (every ``put_many`` applies it before
evicting, so in-process LRU order is exact), or on its own when it is older than
``access_flush_s`` or larger than 4096 entries, and at ``close()``. A crash loses at most
those queued hints, never a record.

Durability: LMDB's defaults (``sync=True, metasync=True``; no ``writemap``): a
``put_many`` is one transaction, durable when it returns, and all-or-nothing on a crash.
``writemap`` stays off: it writes through a shared mapping of a file sized to the map, so a
full disk would surface as SIGBUS in the writing process instead of StoreFullError.
Multi-process safety is LMDB's own lock file (robust mutexes): any number of processes may
read and write one directory at once; write transactions serialize.

Map size: the map starts at ``initial_map_size`` (default ``min(map limit, 1 GiB)``) and
doubles on ``MDB_MAP_FULL`` up to the map limit, ``map_size`` if given, else
``1.5 * max_bytes + 64 MiB`` (records never exceed ``max_bytes``; the rest is B-tree
pages, and pages freed in a transaction that a reader may still see). At the limit, or on
ENOSPC, ``put_many`` raises :class:`StoreFullError`; the transaction is aborted, so the
stored records and the environment are untouched. On Linux the data file grows with its
contents, not with the map size.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
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
)
from .errors import CorruptRecordError, LayoutMismatchError, StoreError, StoreFullError
from .record import (
    FORMAT_VERSION,
    RecordKey,
    RecordMeta,
    as_byte_array,
    decode_record,
    encode_record_into,
    fingerprint_field,
    record_size,
)

__all__ = ["DEFAULT_MAX_BYTES", "LmdbStore", "STORE_FORMAT_VERSION"]

#: Version of the environment's layout (sub-dbs and meta keys above).
STORE_FORMAT_VERSION = 1
DEFAULT_MAX_BYTES = 64 << 30
_MiB = 1 << 20
_DEFAULT_INITIAL_MAP = 1 << 30
_ACCESS_QUEUE_MAX = 4096

_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_ATIME = struct.Struct("<QQ")   # last access ns, accounted record bytes
_LRU_NS = struct.Struct(">Q")   # big-endian so that byte order is time order

_M_FORMAT = b"format_version"
_M_RECORD_FORMAT = b"record_format_version"
_M_FINGERPRINT = b"layout_fingerprint"
_M_TOTAL = b"record_bytes"
#: lifetime counters of every process that used the store: u64 LE each, StoreStats.NAMES order
_M_COUNTERS = b"counters"

_REGISTRY = OpenRegistry()
T = TypeVar("T")


def _close_env(env: lmdb.Environment, ident: tuple[int, int]) -> None:
    try:
        env.close()
    finally:
        _REGISTRY.release(ident)


class LmdbStore(BlockStore):
    """Block store in one LMDB environment directory.

    ``path``: the environment directory (created 0o700 if missing). ``max_bytes``: bound
    on the stored records (header + payload + checksum), LRU-evicted. ``map_size``: the
    largest LMDB map (default derived from ``max_bytes``, see the module docstring).
    ``readonly``: open an existing store without writing (corrupt records are misses but
    stay; access times are not recorded).
    """

    supports_multiprocess = True
    supports_shared_writers = True
    supports_mmap_reads = True

    def __init__(self, path: str | os.PathLike[str], *, layout_fingerprint: str,
                 max_bytes: int = DEFAULT_MAX_BYTES, map_size: int | None = None, readonly: bool = False,
                 initial_map_size: int | None = None, access_flush_s: float = 5.0) -> None:
        fingerprint_field(layout_fingerprint)
        for name, value in (("max_bytes", max_bytes), ("map_size", map_size),
                            ("initial_map_size", initial_map_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.path = Path(os.path.abspath(path))
        self.layout_fingerprint = layout_fingerprint
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

        if (self.path / "zarr.json").exists():
            raise StoreError(f"{self.path}: this directory holds a Zarr block store; open it with "
                             f"ZarrStore or a zarr:// URL")
        if readonly:
            if not (self.path / "data.mdb").is_file():
                raise FileNotFoundError(f"{self.path}: no LMDB store here (no data.mdb) to open readonly")
        else:
            mkdir_private(self.path)
            for name in ("data.mdb", "lock.mdb"):  # owner-only before LMDB opens them
                fd = create_private_file(self.path / name)
                if fd is not None:
                    os.close(fd)
        ident = _REGISTRY.claim(self.path)
        try:
            self._env = lmdb.open(str(self.path), map_size=initial, subdir=True, readonly=readonly,
                                  create=not readonly, max_dbs=4, mode=0o600, sync=True, metasync=True,
                                  writemap=False, map_async=False, readahead=True, meminit=True, lock=True)
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
        self._closed = False

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
            if not create:
                raise StoreError(f"{self.path}: not a tiered_kv LMDB store (no metadata)")
            txn.put(_M_FORMAT, _U16.pack(STORE_FORMAT_VERSION), db=self._meta)
            txn.put(_M_RECORD_FORMAT, _U16.pack(FORMAT_VERSION), db=self._meta)
            txn.put(_M_FINGERPRINT, self.layout_fingerprint.encode("ascii"), db=self._meta)
            txn.put(_M_TOTAL, _U64.pack(0), db=self._meta)
            return
        (version,) = _U16.unpack(bytes(stored_version))
        if version != STORE_FORMAT_VERSION:
            raise StoreError(f"{self.path}: store format version {version}, this code reads "
                             f"version {STORE_FORMAT_VERSION}")
        stored_fp = bytes(txn.get(_M_FINGERPRINT, db=self._meta) or b"").decode("ascii", "replace")
        if stored_fp != self.layout_fingerprint:
            raise LayoutMismatchError(str(self.path), stored_fp, self.layout_fingerprint)

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
            return _U64.unpack(bytes(raw))[0] if raw is not None else 0

    def _now_ns(self) -> int:
        with self._access_lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _scratch(self, size: int) -> memoryview:
        """This thread's encode buffer, at least ``size`` bytes."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or len(buf) < size:
            buf = self._local.scratch = np.empty(size, dtype=np.uint8)
        return memoryview(buf)

    def _check_writable(self) -> None:
        if self.readonly:
            raise StoreError(f"{self.path}: store was opened readonly")

    # ------------------------------------------------------------------ access bookkeeping
    def _touch(self, txn: lmdb.Transaction, kb: bytes, ns: int, size: int | None = None) -> None:
        """Set ``kb``'s last access to ``ns`` (``size``: its record bytes when just written)."""
        old = txn.get(kb, db=self._atime)
        if old is not None:
            old_ns, old_size = _ATIME.unpack(old)
            txn.delete(_LRU_NS.pack(old_ns) + kb, db=self._lru)
            if size is None:
                size = old_size
        elif size is None:
            return  # the record is gone (deleted or evicted meanwhile): nothing to touch
        txn.put(kb, _ATIME.pack(ns, size), db=self._atime)
        txn.put(_LRU_NS.pack(ns) + kb, b"", db=self._lru)

    def _remove(self, txn: lmdb.Transaction, kb: bytes) -> int:
        """Delete record ``kb`` and its access entries; returns its accounted bytes."""
        size = 0
        old = txn.get(kb, db=self._atime)
        if old is not None:
            old_ns, size = _ATIME.unpack(old)
            txn.delete(_LRU_NS.pack(old_ns) + kb, db=self._lru)
            txn.delete(kb, db=self._atime)
        txn.delete(kb, db=self._records)
        return size

    def _get_total(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_M_TOTAL, db=self._meta)
        return _U64.unpack(raw)[0] if raw is not None else 0

    def _evict_for(self, txn: lmdb.Transaction, total: int, need: int, *, limit: int | None = None,
                   max_records: int | None = None) -> tuple[int, int]:
        """Evict least recently accessed records until ``need`` more bytes fit in ``limit``
        (default ``max_bytes``), or ``max_records`` were evicted."""
        bound = self.max_bytes if limit is None else limit
        evicted = 0
        while total + need > bound and (max_records is None or evicted < max_records):
            cur = txn.cursor(db=self._lru)
            if not cur.first():
                raise StoreError(f"{self.path}: accounting broken: {total} bytes recorded but no "
                                 f"record left to evict")
            kb = bytes(cur.key()[_LRU_NS.size:])
            total -= self._remove(txn, kb)
            evicted += 1
        return total, evicted

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
        check_open(self._closed, str(self.path))
        self._check_writable()
        items = self._check_put_items(items)
        if not items:
            return []
        sizes = [record_size(as_byte_array(item.payload, name="payload").nbytes) for item in items]
        for item, size in zip(items, sizes):
            if size > self.max_bytes:
                raise StoreFullError(f"{self.path}: record {item.key!r} of {size} bytes is larger "
                                     f"than max_bytes={self.max_bytes}")
        # Records are encoded one at a time into a reused per-thread buffer, inside the
        # transaction: LMDB copies the value anyway, and fresh 0.5 MB buffers cost a page
        # fault per 4 KiB on every put.
        scratch = self._scratch(max(sizes))

        def write(txn: lmdb.Transaction) -> tuple[list[bool], int, int, int]:
            self._apply_access(txn, taken)
            total = self._get_total(txn)
            results: list[bool] = []
            evicted = corrupt = written = 0
            for item, size in zip(items, sizes):
                key = item.key
                kb = key.to_bytes()
                old = txn.get(kb, db=self._records)
                if old is not None:
                    try:
                        decode_record(old, expect_key=key, expect_fingerprint=self.layout_fingerprint)
                    except CorruptRecordError:
                        corrupt += 1
                        total -= self._remove(txn, kb)
                    else:
                        self._touch(txn, kb, self._now_ns())
                        results.append(False)
                        continue
                total, n = self._evict_for(txn, total, size)
                evicted += n
                encode_record_into(scratch, key=key, parent_hash=item.parent_hash, token_digest=item.token_digest,
                                   layout_fingerprint=self.layout_fingerprint, payload=item.payload)
                txn.put(kb, scratch[:size], db=self._records)
                self._touch(txn, kb, self._now_ns(), size=size)
                total += size
                written += size
                results.append(True)
            txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)
            return results, evicted, corrupt, written

        taken = self._take_access()
        try:
            results, evicted, corrupt, written = self._run(write, write=True, need=sum(sizes))
        except BaseException:
            self._restore_access(taken)
            raise
        self._stats.add(puts=sum(results), put_bytes=written, evictions=evicted, corrupt=corrupt)
        return results

    def delete(self, key: RecordKey) -> bool:
        check_open(self._closed, str(self.path))
        self._check_writable()
        kb = key.to_bytes()
        with self._access_lock:
            self._access.pop(kb, None)

        def remove(txn: lmdb.Transaction) -> bool:
            if txn.get(kb, db=self._records) is None:
                return False
            total = self._get_total(txn) - self._remove(txn, kb)
            txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)
            return True

        return self._run(remove, write=True)

    def _remove_if_corrupt(self, bad: list[tuple[RecordKey, bytes | None]]) -> None:
        """Delete the records that still fail their check (another process may have
        replaced one with a valid record since we read it)."""

        def remove(txn: lmdb.Transaction) -> None:
            total = self._get_total(txn)
            for key, digest in bad:
                kb = key.to_bytes()
                rec = txn.get(kb, db=self._records)
                if rec is None:
                    continue
                try:
                    decode_record(rec, expect_key=key, expect_fingerprint=self.layout_fingerprint,
                                  expect_token_digest=digest)
                except CorruptRecordError:
                    total -= self._remove(txn, kb)
            txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)

        try:
            self._run(remove, write=True)
        except StoreFullError:
            # Deleting needs fresh pages (copy-on-write); on a full disk the bad record
            # stays, and stays a miss: every read verifies it again.
            pass

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, str(self.path))
        keys, dsts, digests = self._check_get_args(keys, outs, token_digests)

        def read(txn: lmdb.Transaction) -> tuple[list[RecordMeta | None], list[int]]:
            metas: list[RecordMeta | None] = []
            bad: list[int] = []
            for i, key in enumerate(keys):
                rec = txn.get(key.to_bytes(), db=self._records)
                if rec is None:
                    metas.append(None)
                    continue
                try:
                    metas.append(decode_record(rec, expect_key=key, expect_fingerprint=self.layout_fingerprint,
                                               expect_token_digest=digests[i], out=dsts[i]))
                except CorruptRecordError:
                    metas.append(None)
                    bad.append(i)
            return metas, bad

        metas, bad = self._run(read, write=False)
        hits = sum(m is not None for m in metas)
        self._stats.add(hits=hits, misses=len(metas) - hits, corrupt=len(bad))
        if bad and not self.readonly:
            self._remove_if_corrupt([(keys[i], digests[i]) for i in bad])
        if hits and not self.readonly:
            ns = self._now_ns()
            with self._access_lock:
                for key, meta in zip(keys, metas):
                    if meta is not None:
                        self._access[key.to_bytes()] = ns
            self._maybe_flush_access()
        return metas

    def contains(self, key: RecordKey) -> bool:
        kb = key.to_bytes()
        return self._run(lambda txn: txn.get(kb, db=self._records) is not None, write=False)

    def __iter__(self) -> Iterator[RecordKey]:
        def keys(txn: lmdb.Transaction) -> list[bytes]:
            return [bytes(k) for k in txn.cursor(db=self._records).iternext(keys=True, values=False)]

        return iter([RecordKey.from_bytes(kb) for kb in self._run(keys, write=False)])

    def __len__(self) -> int:
        return self._run(lambda txn: txn.stat(self._records)["entries"], write=False)

    def stats(self) -> dict[str, Any]:
        if not self.readonly:
            self._maybe_flush_access_now()

        def read(txn: lmdb.Transaction) -> dict[str, Any]:
            cur = txn.cursor(db=self._lru)
            oldest = _LRU_NS.unpack(bytes(cur.key()[:8]))[0] if cur.first() else None
            newest = _LRU_NS.unpack(bytes(cur.key()[:8]))[0] if cur.last() else None
            lifetime = {f"lifetime_{k}": v for k, v in self._get_counters(txn).items()}
            return {"records": txn.stat(self._records)["entries"], "bytes": self._get_total(txn),
                    "oldest_access_ns": oldest, "newest_access_ns": newest, **lifetime}

        out: dict[str, Any] = {"backend": "lmdb", "path": str(self.path),
                               "layout_fingerprint": self.layout_fingerprint, "max_bytes": self.max_bytes}
        out.update(self._run(read, write=False))
        out.update(self._stats.as_dict())
        out["map_size"] = self._env.info()["map_size"]
        out["map_limit"] = self.map_limit
        return out

    def _maybe_flush_access_now(self) -> None:
        try:
            self._flush_access()
        except StoreFullError:
            pass  # hints stay queued (see _maybe_flush_access)

    # ------------------------------------------------------------------ maintenance
    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """Check every record (see :meth:`BlockStore.verify`) in one read transaction; with
        ``repair`` the bad ones are deleted in one write transaction, each checked again
        there (another process may have replaced it meanwhile). Also reports
        ``accounted_bytes`` (the store's running total) and ``actual_bytes`` (the sizes
        of the records found); ``repair`` sets the total to the actual bytes."""
        check_open(self._closed, str(self.path))
        if repair:
            self._check_writable()
        fp = self.layout_fingerprint

        def check(kb: bytes, rec: Any) -> bool:
            try:
                decode_record(rec, expect_key=RecordKey.from_bytes(kb), expect_fingerprint=fp)
            except (CorruptRecordError, ValueError):  # ValueError: the stored key is not a RecordKey
                return False
            return True

        def scan(txn: lmdb.Transaction) -> tuple[int, int, int, list[bytes]]:
            checked = actual = 0
            bad: list[bytes] = []
            for kb, rec in txn.cursor(db=self._records):
                kb = bytes(kb)
                checked += 1
                actual += len(rec)
                if not check(kb, rec):
                    bad.append(kb)
            return checked, actual, self._get_total(txn), bad

        checked, actual, accounted, bad = self._run(scan, write=False)
        removed = 0
        if repair:
            def fix(txn: lmdb.Transaction) -> int:
                gone = 0
                for kb in bad:
                    rec = txn.get(kb, db=self._records)
                    if rec is not None and not check(kb, rec):
                        self._remove(txn, kb)
                        gone += 1
                total = 0
                for kb, rec in txn.cursor(db=self._records):
                    kb = bytes(kb)
                    total += len(rec)
                    if txn.get(kb, db=self._atime) is None:  # not in the LRU index: add it
                        self._touch(txn, kb, self._now_ns(), size=len(rec))
                txn.put(_M_TOTAL, _U64.pack(total), db=self._meta)
                return gone

            removed = self._run(fix, write=True)
            self._stats.add(corrupt=removed)
        return {"checked": checked, "corrupt": len(bad), "removed": removed,
                "corrupt_keys": [kb.hex() for kb in bad], "accounted_bytes": accounted,
                "actual_bytes": actual}

    def gc(self, max_bytes: int) -> dict[str, Any]:
        """Evict least recently accessed records until at most ``max_bytes`` remain (see
        :meth:`BlockStore.gc`); queued access times are applied first, so the order is
        exact. Evicts in transactions of at most 4096 records."""
        check_open(self._closed, str(self.path))
        self._check_writable()
        self._check_gc_bound(max_bytes)
        evicted = freed = 0
        while True:
            taken = self._take_access()

            def evict(txn: lmdb.Transaction, taken: dict[bytes, int] = taken) -> tuple[int, int, int]:
                self._apply_access(txn, taken)
                total = self._get_total(txn)
                left, n = self._evict_for(txn, total, 0, limit=max_bytes, max_records=_ACCESS_QUEUE_MAX)
                txn.put(_M_TOTAL, _U64.pack(left), db=self._meta)
                return n, total - left, left

            try:
                n, gone, left = self._run(evict, write=True)
            except BaseException:
                self._restore_access(taken)
                raise
            evicted += n
            freed += gone
            if left <= max_bytes or n == 0:
                break
        self._stats.add(evictions=evicted)
        records = self._run(lambda txn: txn.stat(self._records)["entries"], write=False)
        return {"evicted": evicted, "freed_bytes": freed, "bytes": left, "records": records}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        if not self.readonly:
            self._maybe_flush_access_now()  # on a full disk the last hints are lost; records are not
        with self._rw.exclusive():
            self._closed = True
            self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("readonly" if self.readonly else "open")
        return f"LmdbStore({str(self.path)!r}, {self.layout_fingerprint!r}, {state})"
