"""The LMDB environment of a store: opened only once its index file checked whole, and the
transactions every part of the store runs in.

LMDB maps ``data.mdb`` and follows page numbers through the mapping: a truncated file is
a SIGBUS, a zeroed page an assertion abort or garbage. So every open checks the meta pages
and walks every page of the snapshot it pins with ``pread`` before LMDB touches one
(:mod:`.pages`), and checks the ``meta`` entries' lengths; a value of the wrong length
read later is :class:`IndexDamagedError` too, never a struct.error. A damaged index (or
a missing / empty ``data.mdb`` beside segment files) is :class:`IndexDamagedError` on a
readonly open; a writable open rebuilds it from the segments (:mod:`.rebuild`: LMDB's
exclusive lock, every verified record indexed, the damaged file moved aside) unless
``repair_index=False``.

A readonly open writes nothing: where ``lock.mdb`` cannot be written (a read-only mount,
a directory this user may not write) it opens without LMDB's lock file (``lock_free``).
The map starts at ``initial_map_size`` and doubles on ``MDB_MAP_FULL`` up to the map
limit; at the limit a write raises :class:`StoreFullError` and its transaction is aborted.
Nothing is written through a mapping of ``data.mdb`` (``writemap`` stays off); ``lock.mdb``,
which LMDB does write through a mapping, has its blocks allocated before LMDB maps it.
"""

from __future__ import annotations

import errno
import logging
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from ..api.store import check_open
from ..errors import IndexDamagedError, StoreError, StoreFullError
from ..format.record import KEY_BYTES
from ..os.files import create_private_file
from ..os.libc import allocate_blocks
from ..os.locks import SharedExclusiveLock
from .claims import REGISTRY
from .pages import DataFileState, IndexDamage, IndexWalk, check_data_file, walk_index
from .rebuild import rebuild_claimed
from .schema import DB_NAMES, LRU_NS, M_COUNTERS, M_TOTAL, MAX_DBS, TREE_DB_NAMES, U64, Dbs, decode, meta_value_bytes

__all__ = ["Index", "has_segments"]

T = TypeVar("T")
log = logging.getLogger(__name__)

#: disk blocks allocated for ``lock.mdb`` (LMDB's reader table: 8 KiB for 126 readers)
_LOCK_FILE_BYTES = 64 << 10
_MiB = 1 << 20


def has_segments(path: Path) -> bool:
    """Whether the store at ``path`` has segment files (records an index must point at)."""
    try:
        return any(name.endswith(".seg") for name in os.listdir(path / "segments"))
    except (FileNotFoundError, NotADirectoryError):
        return False


def _close_env(env: lmdb.Environment, ident: tuple[int, int]) -> None:
    try:
        env.close()
    finally:
        REGISTRY.release(ident)


class Index:
    """The LMDB environment of the store at ``path``, claimed for this process and open
    (see the module docstring), its sub-databases once :meth:`open_dbs` ran, and
    :meth:`run`, the one way the store's parts use it.

    ``layout_fingerprint``: what a rebuild of a damaged index expects (None: what the
    records carry); ``io_threads``: the rebuild's readers.
    """

    def __init__(self, path: Path, *, map_size: int, map_limit: int, max_bytes: int, readonly: bool,
                 maintenance: bool, repair_index: bool, layout_fingerprint: str | None, io_threads: int) -> None:
        self.path = path
        self.map_limit = map_limit
        self.max_bytes = max_bytes
        self.readonly = readonly
        self.maintenance = maintenance
        self.closed = False
        #: shared by every transaction, exclusive while the map is resized or the store closes
        self.rw = SharedExclusiveLock()
        #: what a rebuild of a damaged index at this open did (see rebuild.py), else None
        self.index_rebuild: dict[str, Any] | None = None
        self.lock_free = False
        self._repair_index = repair_index
        self._fingerprint = layout_fingerprint
        self._io_threads = io_threads
        self.dbs: Dbs | None = None
        ident = REGISTRY.claim(path)
        try:
            self.env = self._open_index(map_size)
        except BaseException:
            REGISTRY.release(ident)
            raise
        self._finalizer = weakref.finalize(self, _close_env, self.env, ident)

    def close(self) -> None:
        """Close the environment and release the claim (idempotent)."""
        self.closed = True
        self._finalizer()

    # ------------------------------------------------------------------ opening
    def open_dbs(self, check: Callable[[lmdb.Transaction, Any, bool], None]) -> Dbs:
        """Open the sub-databases (created on a writable open; on a readonly one the
        prefix tree's are None where the store has none: written before them) and call
        ``check(txn, meta db, create)`` in the same transaction (a new store's metadata is
        written with its databases, in one commit)."""
        env = self.env
        if self.readonly:
            try:  # (handles opened inside a read-only transaction die with it)
                dbs = Dbs(*(env.open_db(name, create=False) for name in DB_NAMES), *self._tree_dbs_readonly())
            except lmdb.NotFoundError:
                raise StoreError(f"{self.path}: not a tiered_kv LMDB store (sub-databases missing)") from None
            with env.begin() as txn:
                check(txn, dbs.meta, False)
        else:
            with env.begin(write=True) as txn:
                dbs = Dbs(*(env.open_db(name, txn=txn, create=True) for name in DB_NAMES + TREE_DB_NAMES))
                check(txn, dbs.meta, True)
        self.dbs = dbs
        return dbs

    def _tree_dbs_readonly(self) -> list[Any]:
        """The prefix tree's handles on a readonly open: None each where the store has
        them not (all three are created together)."""
        try:
            return [self.env.open_db(name, create=False) for name in TREE_DB_NAMES]
        except lmdb.NotFoundError:
            return [None] * len(TREE_DB_NAMES)

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
        self.index_rebuild = rebuild_claimed(self.path, self._fingerprint, io_threads=self._io_threads,
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
        the snapshot it sees (every reachable page, see pages.py): before this, nothing
        of LMDB reads a page it could fault on. Raises IndexDamage."""
        data = self.path / "data.mdb"
        state = check_data_file(data)
        if state != DataFileState.VALID and has_segments(self.path):
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
            self.walk_snapshot(env)
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
                return  # a new store (or not ours: open_dbs says so)
            for kb, value in txn.cursor(db=meta):
                want = meta_value_bytes(bytes(kb))
                if want is not None and want >= 0 and len(value) != want and bytes(kb) != M_COUNTERS:
                    raise IndexDamage(f"meta entry {bytes(kb)[:32]!r} is {len(value)} bytes, expected {want}")

    def _lmdb_open(self, map_size: int, *, lock: bool) -> lmdb.Environment:
        """lmdb.open with the store's flags. A readonly open where ``lock.mdb`` cannot be
        written (a read-only mount: LMDB skips the lock itself on EROFS; a directory this
        user may not write: EACCES; a full disk: see _prepare_lock_file) opens without
        the lock: there is no reader slot, so a writer in another process could reuse
        pages under this reader (every record read is still verified). ``lock_free``
        says which."""
        self.lock_free = not lock
        options = dict(map_size=map_size, subdir=True, readonly=self.readonly, create=not self.readonly,
                       max_dbs=MAX_DBS, mode=0o600, sync=True, metasync=False, writemap=False, map_async=False,
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

    def walk_snapshot(self, env: lmdb.Environment | None = None) -> IndexWalk:
        """Walk the pages of the snapshot a read transaction pins (a newer transaction
        cannot reuse them meanwhile). Raises IndexDamage."""
        env = self.env if env is None else env
        for _ in range(8):
            with env.begin() as txn:
                try:
                    return walk_index(self.path / "data.mdb", txnid=txn.id())
                except LookupError:
                    continue  # writers committed twice since: its meta page was rewritten; retry
        raise IndexDamage("no meta page matches the current transaction (the meta pages keep changing)")

    # ------------------------------------------------------------------ transactions
    def run(self, fn: Callable[[lmdb.Transaction], T], *, write: bool, need: int = 0) -> T:
        """Run ``fn`` in a transaction (committed if ``fn`` returns), adapting the map size.

        A write that finds the map full is aborted and retried after the map grew; at the
        map limit, or when the disk is full, StoreFullError. ``need``: bytes the write adds.
        """
        check_open(self.closed, str(self.path))
        while True:
            try:
                with self.rw.shared(), self.env.begin(write=write, buffers=True) as txn:
                    return fn(txn)
            except lmdb.MapResizedError:  # another process grew the map past ours
                with self.rw.exclusive():
                    self.env.set_mapsize(0)
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
                if write and type(e) is lmdb.Error and self.disk_free() < need + 4 * _MiB:
                    raise StoreFullError(f"{self.path}: disk full ({e}, {self.disk_free()} bytes free); "
                                         f"nothing was written by this call, stored records are intact"
                                         ) from e
                raise

    def disk_free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def _grow_map(self) -> None:
        with self.rw.exclusive():
            current = self.env.info()["map_size"]
            if current >= self.map_limit:
                raise StoreFullError(
                    f"{self.path}: LMDB map full at {current} bytes, the map limit (map_size="
                    f"{self.map_limit}); records take {self.total()} of max_bytes={self.max_bytes}. "
                    f"Nothing was written by this call; raise map_size or lower max_bytes")
            self.env.set_mapsize(min(self.map_limit, 2 * current))

    def map_size(self) -> int:
        return self.env.info()["map_size"]

    # ------------------------------------------------------------------ values
    def field(self, st: Any, raw: Any, what: str) -> tuple[Any, ...]:
        """``st.unpack(raw)`` of a value read from the index (see schema.decode)."""
        return decode(st, raw, what, self.path)

    def get_total(self, txn: lmdb.Transaction) -> int:
        """The accounted record bytes (``meta`` record_bytes)."""
        assert self.dbs is not None
        raw = txn.get(M_TOTAL, db=self.dbs.meta)
        return self.field(U64, raw, "meta record_bytes")[0] if raw is not None else 0

    def total(self) -> int:
        with self.env.begin(buffers=True) as txn:
            return self.get_total(txn)

    def lru_ns(self, key: Any) -> int:
        """The access time of an ``lru`` key (u64 BE ns + record key)."""
        if len(key) != LRU_NS.size + KEY_BYTES:
            raise IndexDamagedError(str(self.path), f"an LRU entry's key is {len(key)} bytes, expected "
                                                    f"{LRU_NS.size + KEY_BYTES}")
        return LRU_NS.unpack(bytes(key[:LRU_NS.size]))[0]
