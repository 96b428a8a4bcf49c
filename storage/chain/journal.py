"""Durable journal of the uploads a :class:`~.chain.StoreChain` owes its far levels.

A chain writes every record into its local level 0 at once and uploads it to the farther
levels (a bucket shared by a fleet) in the background. The queue of those uploads must
outlive the process: a node killed (``kill -9``, OOM, power loss) between writing a record
locally and uploading it would otherwise never send it. So before a record is queued, its
key is added here, in the same batch as the local ``put_many`` (one transaction, one
fsync per batch, never one per record); it is removed when the far level has it. The next
process that opens a chain on the same local store resumes whatever is left.

The journal is its own LMDB environment, one file in the local store's directory::

    <local store dir>/upload-journal.mdb        (and upload-journal.mdb-lock)
      sub-database "levels"          level id (16 B)  -> the level's name (utf-8)
      sub-database "l:<level id hex>" record key (33 B, RecordKey.to_bytes)
                                                      -> payload bytes (8 B, little-endian)

A level is named by where it is (``zarr+s3://bucket/prefix``, a path; the URL's query,
which holds the endpoint, is not part of the name), its id is the first 16 bytes of the
name's sha256. Entries of a level the chain no longer has stay until a chain with that
level opens (:meth:`UploadJournal.levels` lists them).

Durability: commits are fsynced (LMDB's default ``sync=True``), so a journaled upload
survives kill -9 and power loss; removals are ordinary commits too (losing one would only
re-send a record, which a create-only put makes harmless). Files are 0o600. Any number of
processes may open one journal (LMDB's lock file); within a process one environment per
file is shared by every :class:`UploadJournal` on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, TypeVar

import lmdb

from ..api import BlockStore
from ..errors import StoreError, StoreFullError
from ..format.record import KEY_BYTES, RecordKey
from ..os.files import open_private_file

__all__ = ["JOURNAL_FILE", "UploadJournal", "keep_owed_uploads", "level_name"]

#: File name of the journal inside the local store's directory.
JOURNAL_FILE = "upload-journal.mdb"
_INITIAL_MAP = 64 << 20         # ~500k entries; grown on demand
_MAX_MAP = 64 << 30
_SIZE = struct.Struct("<Q")
_FULL_ERRNOS = (28, 122)        # ENOSPC, EDQUOT

T = TypeVar("T")



@dataclass(eq=False)
class _Env:
    """One journal file's LMDB environment, shared by every handle on it in this process.

    ``lock`` serializes every use of ``env`` here: LMDB forbids opening sub-databases from
    concurrent transactions of one process, and a map resize needs no live transaction.
    Journal transactions are tiny, so this costs nothing measurable."""

    env: lmdb.Environment
    names: Any                      # the "levels" sub-database
    users: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)
    dbs: dict[str, Any] = field(default_factory=dict)


_envs_lock = threading.Lock()
_envs: dict[tuple[int, int], _Env] = {}  # by (st_dev, st_ino) of the journal file


def level_name(where: str) -> str:
    """The journal's name for a far level: where it is, without the URL's query."""
    return where.split("?", 1)[0]


def _level_id(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()[:16]


class UploadJournal:
    """The uploads still owed to far levels, kept in ``directory / JOURNAL_FILE``.

    Every method is one LMDB transaction; methods may be called from any thread.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"directory: expected an existing directory (the local store's), got {directory}")
        self.path = directory / JOURNAL_FILE
        # Both files created before LMDB does, owner-only whatever the umask (LMDB's mode
        # argument is subject to it).
        os.close(open_private_file(Path(f"{self.path}-lock")))
        fd = open_private_file(self.path)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self._ident = (st.st_dev, st.st_ino)
        with _envs_lock:
            shared = _envs.get(self._ident)
            if shared is None:
                env = lmdb.open(str(self.path), subdir=False, map_size=max(_INITIAL_MAP, st.st_size), max_dbs=256,
                                mode=0o600, sync=True, metasync=True, readahead=False, max_spare_txns=4)
                shared = _envs[self._ident] = _Env(env, env.open_db(b"levels"))
            shared.users += 1
        self._shared = shared
        self._env = shared.env
        self._closed = False

    # ------------------------------------------------------------------ internals
    def _db(self, name: str) -> lmdb._Database:
        shared = self._shared
        with shared.lock:
            db = shared.dbs.get(name)
            if db is None:
                level_id = _level_id(name)
                db = self._env.open_db(b"l:" + level_id.hex().encode())
                self._write(lambda txn: txn.put(level_id, name.encode(), db=shared.names))
                shared.dbs[name] = db
            return db

    def _read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn(txn)`` in one read transaction."""
        if self._closed:
            raise StoreError(f"{self.path}: upload journal is closed")
        with self._shared.lock:
            while True:
                try:
                    with self._env.begin() as txn:
                        return fn(txn)
                except lmdb.MapResizedError:  # another process grew the map: adopt its size
                    self._env.set_mapsize(0)

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn(txn)`` in one write transaction, growing the map when it is full."""
        if self._closed:
            raise StoreError(f"{self.path}: upload journal is closed")
        with self._shared.lock:
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapResizedError:  # another process grew the map: adopt its size
                    self._env.set_mapsize(0)
                except lmdb.MapFullError:
                    size = self._env.info()["map_size"]
                    if size >= _MAX_MAP:
                        raise StoreFullError(f"{self.path}: upload journal reached {size} bytes") from None
                    self._env.set_mapsize(min(_MAX_MAP, size * 2))
                except lmdb.Error as e:
                    if getattr(e, "errno", None) in _FULL_ERRNOS or "No space left" in str(e):
                        raise StoreFullError(f"{self.path}: disk full writing the upload journal ({e})") from e
                    raise

    # ------------------------------------------------------------------ API
    def add(self, levels: Sequence[str], entries: Sequence[tuple[RecordKey, int]]) -> None:
        """Journal ``entries`` ((key, payload bytes)) for every level of ``levels``: one
        fsynced transaction whatever their number."""
        if not levels or not entries:
            return
        dbs = [self._db(name) for name in levels]
        rows = [(key.to_bytes(), _SIZE.pack(nbytes)) for key, nbytes in entries]

        def put(txn: lmdb.Transaction) -> int:
            for db in dbs:
                for k, v in rows:
                    txn.put(k, v, db=db)
            return len(rows)

        self._write(put)

    def remove(self, level: str, keys: Iterable[RecordKey]) -> int:
        """Remove ``keys`` from ``level``'s entries; how many were there."""
        kbs = [key.to_bytes() for key in keys]
        if not kbs:
            return 0
        db = self._db(level)
        return self._write(lambda txn: sum(txn.delete(kb, db=db) for kb in kbs))

    def scan(self, level: str, *, after: RecordKey | None = None, limit: int = 1024) -> list[tuple[RecordKey, int]]:
        """Up to ``limit`` entries of ``level`` in key order, starting after ``after``."""
        if limit <= 0:
            raise ValueError(f"limit: expected a positive int, got {limit!r}")
        db = self._db(level)

        def read(txn: lmdb.Transaction) -> list[tuple[RecordKey, int]]:
            out: list[tuple[RecordKey, int]] = []
            cur = txn.cursor(db=db)
            start = after.to_bytes() if after is not None else b""
            ok = cur.set_range(start) if start else cur.first()
            if ok and after is not None and cur.key() == start:
                ok = cur.next()
            while ok and len(out) < limit:
                kb, v = cur.key(), cur.value()
                if len(kb) == KEY_BYTES and len(v) == _SIZE.size:
                    out.append((RecordKey.from_bytes(kb), _SIZE.unpack(v)[0]))
                ok = cur.next()
            return out

        return self._read(read)

    def pending_among(self, levels: Sequence[str], keys: Sequence[RecordKey]) -> set[RecordKey]:
        """Which of ``keys`` have an entry for any of ``levels`` (one read transaction)."""
        if not levels or not keys:
            return set()
        dbs = [self._db(name) for name in levels]

        def read(txn: lmdb.Transaction) -> set[RecordKey]:
            return {key for key in keys if any(txn.get(key.to_bytes(), db=db) is not None for db in dbs)}

        return self._read(read)

    def count(self, level: str) -> int:
        """Entries of ``level`` (O(1))."""
        db = self._db(level)
        return self._read(lambda txn: int(txn.stat(db)["entries"]))

    def levels(self) -> dict[str, int]:
        """Every level with entries here, and how many."""
        names = self._read(lambda txn: [bytes(v).decode() for _, v in txn.cursor(db=self._shared.names)])
        return {name: n for name in names if (n := self.count(name))}

    def close(self) -> None:
        """Release this handle (the environment closes with its last user). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _envs_lock:
            shared = self._shared
            shared.users -= 1
            if not shared.users:
                del _envs[self._ident]
                with shared.lock:
                    shared.env.close()

    def __enter__(self) -> UploadJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"UploadJournal({str(self.path)!r}, {'closed' if self._closed else 'open'})"


@contextlib.contextmanager
def keep_owed_uploads(store: BlockStore) -> Iterator[int]:
    """While inside, ``store`` (a chain's level 0 opened without its chain, e.g. by
    ``tiered-kv gc``) evicts no record that the upload journal in its directory still owes
    a farther level, whichever chain or process journaled it. Yields the number of
    journal entries (0: no journal there, or a store that cannot guard its evictions, which
    is left as it is). Any guard the store has already is kept."""
    path = store.path
    if not store.supports_eviction_guard or not isinstance(path, os.PathLike) \
            or not (Path(path) / JOURNAL_FILE).is_file():
        yield 0
        return
    with UploadJournal(path) as journal:
        owed = journal.levels()
        names = list(owed)
        previous = store.eviction_guard

        def guard(keys: Sequence[RecordKey]) -> set[RecordKey]:
            held = set(previous(keys)) if previous is not None else set()
            return held | journal.pending_among(names, [key for key in keys if key not in held])

        store.eviction_guard = guard
        try:
            yield sum(owed.values())
        finally:
            store.eviction_guard = previous
