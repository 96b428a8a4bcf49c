"""The LMDB data file (``data.mdb``) read without mapping it: is the index whole?

LMDB maps ``data.mdb`` and follows page numbers through the mapping. A page past the end
of a truncated file is a SIGBUS; a zeroed page makes a cursor read node 0 at offset 0 of
the page and then walk page-pointer slots far past it. Neither can be caught in Python,
so the store checks the file with ``pread`` before LMDB touches anything beyond the two
meta pages (:func:`check_data_file`) and walks every B-tree of the snapshot it is about to
use (:func:`walk_index`).

The on-disk format read here is LMDB 0.9's (``MDB_DATA_VERSION`` 1, ``PAGEBASE`` 0; the
py-lmdb 1.x-3.x bundles, checked against ``lmdb.version()`` at import)::

    page     u64 pgno | u16 pad | u16 flags | u16 lower | u16 upper | u16 ptrs[(lower-16)/2]
             (an overflow page: u32 page count in place of lower/upper)
    meta     pages 0 and 1: header, then u32 magic 0xBEEFC0DE | u32 version | u64 address |
             u64 mapsize | MDB_db free | MDB_db main | u64 last_pg | u64 txnid
    MDB_db   u32 pad (page size, in the free db) | u16 flags | u16 depth | u64 branch pages |
             u64 leaf pages | u64 overflow pages | u64 entries | u64 root (~0: empty)
    node     u16 lo | u16 hi | u16 flags | u16 ksize | key | data
             branch: child pgno = lo | hi << 16 | flags << 32
             leaf:   data size = lo | hi << 16; F_BIGDATA: data is the u64 pgno of overflow
                     pages; F_SUBDATA: data is an MDB_db (a named database, in the main db)

:func:`walk_index` checks every page reachable from a meta page: inside the file, its
own page number in its header, the kind of page its parent says (branch / leaf /
overflow), bounds of its node table and of every node, no page reached twice, leaves at
the depth the database records, and the entry count of every database. After it passes,
LMDB's reads of that snapshot stay inside pages of the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["DataFileState", "IndexDamage", "MetaPage", "check_data_file", "read_metas", "walk_index"]

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
PAGE_HEADER = 16
NODE_HEADER = 8
P_INVALID = (1 << 64) - 1
MIN_PAGE = 512
MAX_PAGE = 0x8000

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
FREE_DBI, MAIN_DBI = 0, 1

_PAGE = struct.Struct("<QHHHH")
_META = struct.Struct("<IIQQ48s48sQQ")
_DB = struct.Struct("<IHHQQQQQ")


class IndexDamage(Exception):
    """The index file is damaged; the message says where, in one line."""


@dataclass(frozen=True, slots=True)
class DbRecord:
    """One ``MDB_db``: a B-tree's root, depth and counts."""

    flags: int
    depth: int
    entries: int
    root: int

    @classmethod
    def parse(cls, raw: bytes) -> DbRecord:
        pad, flags, depth, _branch, _leaf, _overflow, entries, root = _DB.unpack(raw)
        return cls(flags, depth, entries, root)


@dataclass(frozen=True, slots=True)
class MetaPage:
    """A valid meta page: page size, the free and main databases, last page, txn id."""

    psize: int
    free: DbRecord
    main: DbRecord
    last_pg: int
    txnid: int


class DataFileState:
    """What is at a store's ``data.mdb`` path, before anything opens it."""

    MISSING = "missing"
    EMPTY = "empty"        # 0 bytes: a new store (LMDB writes the meta pages on open)
    VALID = "valid"        # two valid meta pages


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = b""
    while len(out) < n:
        got = os.pread(fd, n - len(out), offset + len(out))
        if not got:
            break
        out += got
    return out


def _parse_meta(raw: bytes, which: int) -> MetaPage:
    if len(raw) < PAGE_HEADER + _META.size:
        raise IndexDamage(f"meta page {which} is cut short ({len(raw)} bytes): the file is truncated")
    _pgno, _pad, flags, _lower, _upper = _PAGE.unpack_from(raw, 0)
    magic, version, _addr, _mapsize, free, main, last_pg, txnid = _META.unpack_from(raw, PAGE_HEADER)
    if not flags & P_META or magic != MAGIC:
        raise IndexDamage(f"meta page {which} is not an LMDB meta page (flags {flags:#x}, magic {magic:#x}): "
                          f"overwritten or zeroed")
    if version != DATA_VERSION:
        raise IndexDamage(f"meta page {which} has LMDB data version {version}, expected {DATA_VERSION}")
    free_db, main_db = DbRecord.parse(free), DbRecord.parse(main)
    psize = _DB.unpack(free)[0]
    if psize < MIN_PAGE or psize > MAX_PAGE or psize & (psize - 1):
        raise IndexDamage(f"meta page {which} has page size {psize}, expected a power of two in "
                          f"[{MIN_PAGE}, {MAX_PAGE}]")
    return MetaPage(psize, free_db, main_db, last_pg, txnid)


def read_metas(fd: int) -> tuple[MetaPage, MetaPage]:
    """Both meta pages of an open ``data.mdb`` (read as LMDB does: page 0, then page 1 at
    page 0's page size). IndexDamage if either is not valid: LMDB refuses such a file."""
    first = _parse_meta(_pread(fd, PAGE_HEADER + _META.size, 0), 0)
    second = _parse_meta(_pread(fd, PAGE_HEADER + _META.size, first.psize), 1)
    if second.psize != first.psize:
        raise IndexDamage(f"meta pages disagree on the page size ({first.psize}, {second.psize})")
    return first, second


def newest(metas: tuple[MetaPage, MetaPage]) -> MetaPage:
    """The meta page LMDB uses: the one with the larger txn id."""
    return metas[1] if metas[1].txnid > metas[0].txnid else metas[0]


def check_data_file(path: Path) -> str:
    """A :class:`DataFileState` of ``path`` (``data.mdb``); IndexDamage when the file
    is there but LMDB could not use it safely: shorter than its two meta pages, a meta
    page that is not valid, or a root page past the end of the file.

    Cheap (a few preads): run before every ``lmdb.open``, which itself reads only the
    meta pages. Pages below the roots are checked by :func:`walk_index`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return DataFileState.MISSING
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return DataFileState.EMPTY
        meta = newest(read_metas(fd))
        # fstat after the metas: a writer extends the file before it writes a meta page
        pages = os.fstat(fd).st_size // meta.psize
        if pages < 2:
            raise IndexDamage(f"the file is {size} bytes, shorter than its two {meta.psize}-byte meta pages")
        for name, db in (("free-space", meta.free), ("main", meta.main)):
            if db.root != P_INVALID and not 2 <= db.root < pages:
                raise IndexDamage(f"the {name} database's root page {db.root} lies past the end of the "
                                  f"file ({pages} pages of {meta.psize} bytes): the file is truncated")
        return DataFileState.VALID
    finally:
        os.close(fd)


@dataclass
class IndexWalk:
    """What :func:`walk_index` saw: pages per database and entries per named database."""

    txnid: int
    pages: int = 0
    entries: dict[str, int] = field(default_factory=dict)


def walk_index(path: Path, *, txnid: int | None = None) -> IndexWalk:
    """Check every page reachable from the newest meta page (or the meta page of txn
    ``txnid``, e.g. a read transaction's, which pins it) of ``data.mdb`` at ``path``.

    Raises IndexDamage naming the first bad page. Reads with ``pread`` only: safe on a
    file LMDB itself would fault on."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        metas = read_metas(fd)
        if txnid is None:
            meta = newest(metas)
        else:
            found = [m for m in metas if m.txnid == txnid]
            if not found:
                raise LookupError(f"no meta page of txn {txnid} (newer transactions replaced it)")
            meta = found[0]
        return _Walker(fd, meta).run()
    finally:
        os.close(fd)


#: why a page is not a usable B-tree page (pass 1 of the walk), for the message
_WHY = {
    1: "is not a B-tree page (its header names another page, or its flags are not a branch's or a leaf's): "
       "overwritten or zeroed",
    2: "has a bad node table (lower/upper bounds)",
    3: "has a node outside its node area",
    4: "has a node past the end of the page",
    5: "has a duplicate-data node (not a tiered_kv index)",
}
_BRANCH, _LEAF, _OVERFLOW = 1, 2, 4


class _Walker:
    """Two passes. 1: read the whole file in large sequential chunks and check every
    page's header and node table, vectorized across the chunk (a page that fails is
    remembered with the reason; free pages may hold anything, so nothing fails yet).
    2: walk each B-tree from its root through the branch pages' children recorded in
    pass 1: every page reached must be a good page of the right kind, at the right
    depth, inside the file, and reached once."""

    CHUNK = 1024  # pages read and checked at once (4 MiB of 4 KiB pages)

    def __init__(self, fd: int, meta: MetaPage) -> None:
        self.fd = fd
        self.meta = meta
        self.psize = meta.psize
        self.file_pages = os.fstat(fd).st_size // meta.psize
        n = max(self.file_pages, 2)
        self.kind = np.zeros(n, np.uint8)        # _BRANCH / _LEAF / _OVERFLOW (a run's first page), 0: bad
        self.why = np.ones(n, np.uint8)          # _WHY key when kind is 0
        self.count = np.zeros(n, np.int64)       # nodes of a B-tree page; pages of an overflow run
        self.children: dict[int, np.ndarray] = {}             # branch page -> child pages
        self.big: dict[int, list[tuple[int, int]]] = {}       # leaf page -> (overflow page, data bytes)
        self.named: dict[int, list[tuple[str, DbRecord]]] = {}  # leaf page -> named databases
        self.seen = np.zeros(n, bool)
        self.seen[:2] = True
        self.result = IndexWalk(meta.txnid)

    def run(self) -> IndexWalk:
        for first in range(2, self.file_pages, self.CHUNK):
            self._scan(first, min(self.CHUNK, self.file_pages - first))
        subs: list[tuple[str, DbRecord]] = []
        self._walk_db("free-space", self.meta.free, subs=None)
        self._walk_db("main", self.meta.main, subs=subs)
        for name, db in subs:
            self.result.entries[name] = self._walk_db(name, db, subs=None)
        self.result.pages = int(self.seen.sum())
        return self.result

    # ---------------------------------------------------------------- pass 1
    def _scan(self, first: int, count: int) -> None:
        ps = self.psize
        buf = np.empty((count, ps), np.uint8)
        view, want, got = memoryview(buf.reshape(-1)), count * ps, 0
        while got < want:
            n = os.preadv(self.fd, [view[got:]], first * ps + got)
            if n <= 0:
                break  # the file shrank meanwhile: what was not read stays bad
            got += n
        count = got // ps
        pages, pgnos = buf[:count], np.arange(first, first + count, dtype=np.int64)
        head = pages[:, :PAGE_HEADER].copy()
        stored = head[:, :8].view("<u8")[:, 0].astype(np.int64)
        flags, lower, upper = (head[:, 10 + 2 * i:12 + 2 * i].view("<u2")[:, 0].astype(np.int64)
                               for i in range(3))
        kind = flags & (P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP)
        own = stored == pgnos
        over = own & (kind == P_OVERFLOW)
        self.kind[pgnos[over]] = _OVERFLOW
        self.count[pgnos[over]] = head[over, 12:16].view("<u4")[:, 0]
        tree = own & ((kind == P_BRANCH) | (kind == P_LEAF))
        most = (ps - PAGE_HEADER) // (2 + NODE_HEADER)  # nodes a page can hold (pointer + node header each)
        table_ok = (lower >= PAGE_HEADER + 2) & (lower & 1 == 0) & (upper <= ps) & (upper >= lower) & \
            ((lower - PAGE_HEADER) >> 1 <= most)
        self.why[pgnos[tree & ~table_ok]] = 2
        rows = np.flatnonzero(tree & table_ok)
        if rows.size == 0:
            return
        self._check_nodes(pages[rows], pgnos[rows], kind[rows] == P_LEAF, lower[rows], upper[rows])

    def _check_nodes(self, pages: np.ndarray, pgnos: np.ndarray, leaf: np.ndarray,
                     lower: np.ndarray, upper: np.ndarray) -> None:
        """Node-table checks of pages whose headers passed; records kind, count, the
        children of branch pages and the overflow / named-database nodes of leaves.
        Vectorized over every node of the batch: ``row`` / ``ptr`` / ... are ``[nodes]``."""
        ps = self.psize
        n = (lower - PAGE_HEADER) >> 1
        first = np.cumsum(n) - n                                   # each page's first node
        row = np.repeat(np.arange(n.size), n)                      # [nodes] -> its page (row)
        col = np.arange(row.size) - first[row]                     # its slot in the page's table
        words = pages.view("<u2").reshape(-1)
        base = row * (ps // 2)
        ptr = words[base + PAGE_HEADER // 2 + col].astype(np.int64)
        outside = (ptr < upper[row]) | (ptr + NODE_HEADER > ps) | (ptr & 1 == 1)
        at = base + (np.where(outside, ps - NODE_HEADER, ptr) >> 1)
        lo, hi, nflags, ksize = (words[at + i].astype(np.int64) for i in range(4))
        key_end = ptr + NODE_HEADER + ksize
        on_leaf = leaf[row]
        big = on_leaf & ((nflags & F_BIGDATA) != 0)
        dsize = lo | (hi << 16)
        past = ~outside & (np.where(on_leaf, np.where(big, key_end + 8, key_end + dsize), key_end) > ps)
        dup = ~outside & ~past & on_leaf & ((nflags & F_DUPDATA) != 0)
        why = np.zeros(n.size, np.uint8)                           # per page: the first reason, by rank
        for code, bad in ((5, dup), (4, past), (3, outside)):
            why[np.unique(row[bad])] = code
        good = why == 0
        self.why[pgnos[~good]] = why[~good]
        self.kind[pgnos[good]] = np.where(leaf[good], _LEAF, _BRANCH)
        self.count[pgnos[good]] = n[good]
        for r in np.flatnonzero(good & ~leaf).tolist():
            a, b = int(first[r]), int(first[r] + n[r])
            self.children[int(pgnos[r])] = lo[a:b] | (hi[a:b] << 16) | (nflags[a:b] << 32)
        special = good[row] & on_leaf & (big | ((nflags & F_SUBDATA) != 0))
        for j in np.flatnonzero(special).tolist():
            r, pg, k_end = int(row[j]), int(pgnos[row[j]]), int(key_end[j])
            if big[j]:
                self.big.setdefault(pg, []).append((int(pages[r, k_end:k_end + 8].view("<u8")[0]), int(dsize[j])))
            elif int(dsize[j]) == _DB.size:
                self.named.setdefault(pg, []).append(
                    (pages[r, int(ptr[j]) + NODE_HEADER:k_end].tobytes().decode("ascii", "replace"),
                     DbRecord.parse(pages[r, k_end:k_end + _DB.size].tobytes())))

    # ---------------------------------------------------------------- pass 2
    def _claim(self, pgnos: np.ndarray, what: str) -> None:
        """Mark pages reached; IndexDamage for one past the file, a meta page, or one
        reached twice."""
        if pgnos.size == 0:
            return
        hi, lo = int(pgnos.max()), int(pgnos.min())
        if hi >= self.file_pages:
            raise IndexDamage(f"{what}: page {hi} lies past the end of the file ({self.file_pages} pages of "
                              f"{self.psize} bytes): the file is truncated")
        if lo < 2:
            raise IndexDamage(f"{what}: points at meta page {lo}")
        if self.seen[pgnos].any() or np.unique(pgnos).size != pgnos.size:
            raise IndexDamage(f"{what}: a page is reached twice (a loop or a cross-linked page)")
        self.seen[pgnos] = True

    def _walk_db(self, name: str, db: DbRecord, *, subs: list[tuple[str, DbRecord]] | None) -> int:
        """Walk one B-tree level by level; returns its leaf entries. ``subs`` (the main
        db) collects the named databases."""
        what = f"database {name!r}"
        if db.root == P_INVALID:
            if db.entries:
                raise IndexDamage(f"{what}: empty tree but {db.entries} entries recorded")
            return 0
        if db.flags & 0x04:  # MDB_DUPSORT: no database of the store uses it
            raise IndexDamage(f"{what}: flags {db.flags:#x} (DUPSORT), not a tiered_kv index")
        if not 1 <= db.depth <= 64:
            raise IndexDamage(f"{what}: tree depth {db.depth}")
        entries = 0
        level = np.array([db.root], np.int64)
        for depth in range(1, db.depth + 1):
            self._claim(level, what)
            want = _LEAF if depth == db.depth else _BRANCH
            wrong = np.flatnonzero(self.kind[level] != want)
            if wrong.size:
                pg = int(level[wrong[0]])
                got = int(self.kind[pg])
                why = _WHY[int(self.why[pg])] if got == 0 else \
                    f"is a {'branch' if got == _BRANCH else 'leaf' if got == _LEAF else 'overflow'} page where " \
                    f"the tree (depth {db.depth}) has a {'leaf' if want == _LEAF else 'branch'} page"
                raise IndexDamage(f"{what}: page {pg} {why}")
            if want == _BRANCH:
                level = np.concatenate([self.children[int(p)] for p in level.tolist()])
                continue
            entries += int(self.count[level].sum())
            for pg in level.tolist():
                for ov, dsize in self.big.get(pg, ()):
                    self._check_overflow(ov, dsize, what)
                if subs is not None:
                    subs.extend(self.named.get(pg, ()))
        if entries != db.entries:
            raise IndexDamage(f"{what}: {entries} entries in its pages, {db.entries} recorded")
        return entries

    def _check_overflow(self, pgno: int, dsize: int, what: str) -> None:
        if not 2 <= pgno < self.file_pages or self.kind[pgno] != _OVERFLOW:
            raise IndexDamage(f"{what}: overflow page {pgno} is not an overflow page of the file: overwritten, "
                              f"zeroed or truncated")
        count = int(self.count[pgno])
        if count < 1 or pgno + count > self.file_pages or dsize > count * self.psize - PAGE_HEADER:
            raise IndexDamage(f"{what}: overflow run at page {pgno} ({count} pages, {dsize} bytes) does not fit "
                              f"the file")
        self._claim(np.arange(pgno, pgno + count, dtype=np.int64), what)
