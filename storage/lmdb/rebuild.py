"""Rebuild an LMDB store's index (``data.mdb``) from its segment files.

The segments are the store's write-ahead log: every record is self-describing (header,
xxh3-128 checksum, layout fingerprint), so the index can always be derived again from
them. :func:`rebuild_index` does that when the index is damaged (truncated, zeroed,
empty, deleted; see :mod:`.lmdb_file`):

1. Takes LMDB's own exclusive lock (an ``fcntl`` write lock on byte 0 of ``lock.mdb``,
   which every process holding the environment open keeps a read lock on): if another
   process has the store open, nothing is done (:class:`StoreLockedError`); while the
   rebuild runs, a process that opens the store for writing waits for it.
2. Scans every segment from its start and keeps each record that verifies (header,
   checksum, fingerprint); a key found more than once keeps its last copy (the newest
   write; copies of one key hold the same KV). Torn, zeroed or foreign bytes are skipped
   and never indexed.
3. Writes a fresh index beside the store (``index.rebuild/``), then moves the damaged
   ``data.mdb`` aside into ``damaged-index-<UTC time>/`` (kept as evidence, never
   deleted) and renames the new one into place.

The prefix tree (tree.py) is rebuilt from the records' parent hashes. What the rebuilt
index cannot know: access times (records get them in segment order, so
the oldest writes are evicted first) and the lifetime counters (start again at zero).
A record deleted on a filesystem that could not punch its hole comes back: it verifies,
so it is a valid cache entry.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import shutil
import struct
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import numpy as np

from ..errors import CorruptRecordError, LayoutMismatchError, StoreError, StoreLockedError
from ..format.record import CHECKSUM_BYTES, HEADER_BYTES, RecordKey, decode_record, parse_header, record_size
from ..os.files import fsync_dir, mkdir_private
from .claims import REGISTRY
from .scan import next_magic, scan_segment
from .schema import (
    ATIME,
    DB_NAMES,
    KIDS,
    LRU_NS,
    MAX_DBS,
    PAYLOAD_BYTES,
    TREE_DB_NAMES,
    U64,
    Location,
    pack_entry,
    parse_segment_name,
    read_sealed_file,
    segment_end_key,
    segment_name,
    write_new_meta,
)

__all__ = ["rebuild_index"]

#: Directory the new index is written in before it replaces ``data.mdb``.
REBUILD_DIR = "index.rebuild"
#: Prefix of the directories that keep damaged index files.
DAMAGED_PREFIX = "damaged-index-"
_TXN_RECORDS = 20_000


@contextmanager
def exclusive_store_lock(path: Path) -> Iterator[None]:
    """Hold LMDB's exclusive environment lock of the store at ``path``: no other process
    has it open meanwhile, and writers that open it wait. StoreLockedError if one has it
    open. Must not be taken while this process has the environment open (closing any
    descriptor of ``lock.mdb`` drops every lock this process holds on it)."""
    try:
        fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_size == 0:
            os.fchmod(fd, 0o600)  # owner-only whatever the umask, as every file of a store
    except OSError as e:
        raise StoreError(f"{path}: cannot open lock.mdb for writing ({e.strerror}); the index can only "
                         f"be rebuilt where the store is writable") from None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0, os.SEEK_SET)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise StoreLockedError(f"{path}: another process has this store open; stop it (and every "
                                       f"process using the store), then rebuild the index") from None
            raise
        yield
    finally:
        os.close(fd)


def rebuild_index(path: str | os.PathLike[str], layout_fingerprint: str | None, *,
                  io_threads: int = 4, problem: str = "") -> dict[str, Any]:
    """Replace the index of the LMDB store at ``path`` by one built from its segments.

    ``layout_fingerprint``: the layout the caller expects (None: the one the records
    carry). LayoutMismatchError, with nothing changed, if the segments hold records of
    another layout. ``problem``: what was wrong with the old index (kept in the result).
    Returns ``{"records", "bytes", "segments", "moved_to", "problem"}`` (``moved_to``:
    where the damaged ``data.mdb`` went, None if there was none). StoreLockedError if the
    store is open, in another process or in this one (LMDB's lock cannot tell this
    process's own handle apart: the in-process registry does)."""
    root = Path(os.path.abspath(path))
    ident = REGISTRY.claim(root)
    try:
        return rebuild_claimed(root, layout_fingerprint, io_threads=io_threads, problem=problem)
    finally:
        REGISTRY.release(ident)


def rebuild_claimed(root: Path, layout_fingerprint: str | None, *, io_threads: int, problem: str) -> dict[str, Any]:
    """:func:`rebuild_index` by a caller that holds the store's in-process claim (an
    LmdbStore being opened, with no environment open yet)."""
    with exclusive_store_lock(root):
        seg_dir = root / "segments"
        segs = _segment_ids(seg_dir)
        found_fp = _fingerprint_of_segments(seg_dir, segs)
        if layout_fingerprint is not None and found_fp is not None and found_fp != layout_fingerprint:
            raise LayoutMismatchError(str(root), found_fp, layout_fingerprint)
        fingerprint = layout_fingerprint or found_fp
        if fingerprint is None:
            raise StoreError(f"{root}: the index is damaged and no segment holds a verifiable record to tell the "
                             f"store's layout; open it with its layout fingerprint to rebuild an empty index")
        records, sizes = _scan_all(seg_dir, segs, fingerprint, io_threads)
        tmp = root / REBUILD_DIR
        shutil.rmtree(tmp, ignore_errors=True)
        mkdir_private(tmp)
        total = _write_index(tmp, fingerprint, records, sizes, sealed=read_sealed_file(root) is not None)
        os.chmod(tmp / "data.mdb", 0o600)
        moved = _move_aside(root)
        os.replace(tmp / "data.mdb", root / "data.mdb")
        fsync_dir(root)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"records": len(records), "bytes": total, "segments": len(segs),
            "moved_to": str(moved) if moved is not None else None, "problem": problem}


def _segment_ids(seg_dir: Path) -> list[int]:
    try:
        return sorted(i for i in map(parse_segment_name, os.listdir(seg_dir)) if i is not None)
    except FileNotFoundError:
        return []


def _fingerprint_of_segments(seg_dir: Path, segs: list[int]) -> str | None:
    """The layout fingerprint of the first record in the segments that passes its
    checksum (every record of a store carries the store's)."""
    for seg in segs:
        try:
            fd = os.open(seg_dir / segment_name(seg), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            found = _first_fingerprint(fd, os.fstat(fd).st_size)
        except OSError:
            found = None
        finally:
            os.close(fd)
        if found is not None:
            return found
    return None


def _first_fingerprint(fd: int, size: int) -> str | None:
    pos = next_magic(fd, 0, size)
    while pos + HEADER_BYTES + CHECKSUM_BYTES <= size:
        head = os.pread(fd, HEADER_BYTES, pos)
        try:
            n = record_size(PAYLOAD_BYTES.unpack_from(head, HEADER_BYTES - 8)[0])
            parsed = parse_header(head, n)
            fp = parsed.fingerprint.rstrip(b"\0").decode("ascii")
            decode_record(np.frombuffer(os.pread(fd, n, pos), np.uint8),
                          expect_key=RecordKey(parsed.kind, parsed.block_hash), expect_fingerprint=fp)
            return fp
        except (CorruptRecordError, UnicodeDecodeError, ValueError, struct.error):
            pos = next_magic(fd, pos + 1, size)
    return None


def _scan_all(seg_dir: Path, segs: list[int], fingerprint: str, io_threads: int
              ) -> tuple[dict[bytes, tuple[Location, bytes, bytes]], dict[int, int]]:
    """Every verified record of every segment (key -> location, checksum, parent key
    bytes; the last copy of a key wins) and each segment's size."""
    def scan(seg: int) -> tuple[int, int, list[tuple[bytes, Location, bytes]]]:
        try:
            fd = os.open(seg_dir / segment_name(seg), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return seg, 0, []
        try:
            size = os.fstat(fd).st_size
            try:
                return seg, size, scan_segment(fd, seg, 0, size, fingerprint)
            except OSError:  # unreadable (EIO): its records stay out of the index
                return seg, size, []
        finally:
            os.close(fd)

    records: dict[bytes, tuple[Location, bytes, bytes]] = {}
    sizes: dict[int, int] = {}
    with ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="tkv-rebuild") as pool:
        for seg, size, found in pool.map(scan, segs):  # in segment order: later copies win
            sizes[seg] = size
            for kb, loc, checksum, parent_kb in found:
                records.pop(kb, None)
                records[kb] = (loc, checksum, parent_kb)
    return records, sizes


def _write_index(where: Path, fingerprint: str, records: dict[bytes, tuple[Location, bytes, bytes]],
                 sizes: dict[int, int], *, sealed: bool) -> int:
    """Write a complete index into ``where/data.mdb``, its prefix tree too (tree.py);
    returns the records' bytes. ``sealed``: the store directory records a sealed level
    (schema.SEALED_FILE): so does the new index's meta."""
    total = sum(loc.length for loc, _, _ in records.values())
    map_size = max(64 << 20, 1536 * len(records) + (16 << 20))
    env = lmdb.open(str(where), map_size=map_size, subdir=True, max_dbs=MAX_DBS, mode=0o600, lock=False,
                    sync=True, metasync=True, writemap=False, meminit=True)
    try:
        with env.begin(write=True) as txn:
            dbs = {name: env.open_db(name, txn=txn, create=True) for name in DB_NAMES + TREE_DB_NAMES}
            meta = dbs[b"meta"]
            write_new_meta(txn, meta, fingerprint, total=total, next_segment=max(sizes, default=0) + 1,
                           sealed=sealed)
            for seg, size in sizes.items():
                txn.put(segment_end_key(seg), U64.pack(size), db=meta)
        # Access times in segment order (oldest write first), all in the past, distinct.
        ordered = sorted(records.items(), key=lambda kv: (kv[1][0].segment, kv[1][0].offset))
        base = time.time_ns() - len(ordered) - 1
        ns = {kb: base + i for i, (kb, _) in enumerate(ordered)}
        by_key = sorted(records.items())  # each tree filled in key order (MDB_APPEND: dense pages)
        kids = Counter(parent for kb, (_, _, parent) in by_key if parent != kb)
        _append(env, dbs[b"records"], ((kb, pack_entry(loc, sum_)) for kb, (loc, sum_, _) in by_key))
        _append(env, dbs[b"atime"], ((kb, ATIME.pack(ns[kb], loc.length)) for kb, (loc, _, _) in by_key))
        _append(env, dbs[b"lru"], ((LRU_NS.pack(ns[kb]) + kb, b"") for kb, _ in ordered if not kids[kb]))
        _append(env, dbs[b"parked"], ((LRU_NS.pack(ns[kb]) + kb, b"") for kb, _ in ordered if kids[kb]))
        _append(env, dbs[b"parent"], ((kb, parent) for kb, (_, _, parent) in by_key if parent != kb))
        _append(env, dbs[b"kids"], ((kb, KIDS.pack(n)) for kb, n in sorted(kids.items())))
        env.sync(True)
    finally:
        env.close()
    return total


def _append(env: lmdb.Environment, db: Any, items: Iterator[tuple[bytes, bytes]]) -> None:
    """Put ``items`` (in key order) into ``db``, in transactions of ``_TXN_RECORDS``."""
    while True:
        chunk = list(itertools.islice(items, _TXN_RECORDS))
        if not chunk:
            return
        with env.begin(write=True) as txn:
            txn.cursor(db=db).putmulti(chunk, append=True)


def _move_aside(root: Path) -> Path | None:
    """Move the damaged ``data.mdb`` (if any) into a new ``damaged-index-<time>/``."""
    src = root / "data.mdb"
    if not src.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dst_dir = root / f"{DAMAGED_PREFIX}{stamp}"
    n = 1
    while dst_dir.exists():
        n += 1
        dst_dir = root / f"{DAMAGED_PREFIX}{stamp}-{n}"
    mkdir_private(dst_dir)
    os.rename(src, dst_dir / "data.mdb")
    return dst_dir / "data.mdb"
