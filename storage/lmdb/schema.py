"""The LMDB store's schema, defined once: its sub-databases, meta keys and value codecs, how
a new store's metadata is written, where records lie and what the segment files are named.

Layout of one store directory (files 0o600, dirs 0o700)::

    data.mdb, lock.mdb        the LMDB environment (the index)
    segments/00000001.seg     records, appended in 4 KiB-aligned batches
    index.reserve             disk held for the index's deletes on a full disk (maintenance.py)
    damaged-index-<time>/     a damaged data.mdb, moved aside by a rebuild (rebuild.py)
    sealed-level.json         a sealed level's record (format/sealed_level.py), beside the
                              segments: it survives an index rebuilt from them (SEALED_FILE)

    sub-db    key                                 value
    -------   ---------------------------------   -----------------------------------------
    records   RecordKey.to_bytes() (33 B)         u32 segment, u64 offset, u64 record bytes,
                                                  16 B xxh3-128 checksum (all LE; the record's own)
    meta      b"format_version"                   u16 LE, STORE_FORMAT_VERSION
              b"record_format_version"            u16 LE, record.FORMAT_VERSION
              b"layout_fingerprint"               ascii
              b"record_bytes"                     u64 LE, sum of the accounted record sizes
              b"next_segment"                     u32 LE, the next segment id to hand out
              b"writer"                           JSON: who created the store (format/writer.py)
              b"encryption"                       JSON: the store is a sealed level (format/sealed_level.py)
              b"counters"                         u64 LE each, StoreStats.NAMES order: lifetime counters
              b"segment_end:" + u32 BE segment    u64 LE, the segment is indexed below this offset
              b"segment_gen:" + u32 BE segment    u64 LE, bumped by every transaction that indexes
                                                  records into the segment (gc compares it)
    atime     RecordKey bytes                     u64 LE last access ns, u64 LE record size
    lru       u64 BE last access ns + key bytes   b"" (ordered: the first entry is the LRU);
                                                  only records with no resident child (leaves)
    parked    u64 BE last access ns + key bytes   b"": the records with a resident child
                                                  (interior blocks), out of ``lru`` until it goes
    parent    RecordKey bytes                     the parent's key bytes (33 B): a block's previous
                                                  block, a snapshot's own block
    kids      RecordKey bytes                     u32 LE, resident records whose ``parent`` it is
                                                  (kept while > 0, resident or not)

The last three are the store's prefix tree (:mod:`.tree`): eviction takes leaves first, so it
never strands a path's end behind a missing start. Stores written before them (and indexes
rebuilt from the segments) have records without a ``parent`` entry: those are leaves for
eviction, in plain LRU order, as before; a writable open creates the three sub-dbs, a
readonly open does without them.

Stores of format version 1 (records inside LMDB, before segment files) are refused with an
error that says what to do (:func:`check_meta`).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from ..api.counters import StoreStats
from ..errors import IndexDamagedError, LayoutMismatchError, StoreError
from ..format.record import FORMAT_VERSION, RecordKind
from ..format.sealed_level import SEALED_LEVEL, check_opener, parse_sealing, sealing_json
from ..format.writer import StoreWriter
from ..os.files import fsync_dir

__all__ = ["DB_NAMES", "KIDS", "MAX_DBS", "TREE_DB_NAMES", "SEALED_FILE", "SEGMENT_SUFFIX", "STORE_FORMAT_VERSION", "Dbs", "Location", "bump_segment_gen",
           "check_meta", "decode", "meta_value_bytes", "pack_entry", "parent_key_bytes", "parse_segment_name", "read_sealed_file",
           "segment_end_key", "segment_gen_key", "segment_name", "unpack_entry", "write_new_meta",
           "write_sealed_file"]

#: Version of the store's layout (sub-dbs, meta keys and segment files above). 1: records
#: inside LMDB (refused, see :func:`check_meta`).
STORE_FORMAT_VERSION = 2
#: The sub-databases every store has, in the order every open names them.
DB_NAMES = (b"records", b"meta", b"atime", b"lru")
#: The prefix tree's sub-databases (:mod:`.tree`): created by a writable open, absent from
#: stores written before them (see the module docstring).
TREE_DB_NAMES = (b"parked", b"parent", b"kids")
#: named databases an environment may open (all of the above, and room to grow)
MAX_DBS = 8

U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
U32BE = struct.Struct(">I")
#: the record header's last field (its payload length)
PAYLOAD_BYTES = struct.Struct("<Q")
#: ``atime`` value: last access ns, accounted record bytes
ATIME = struct.Struct("<QQ")
#: ``lru`` key prefix: big-endian so that byte order is time order
LRU_NS = struct.Struct(">Q")
#: ``kids`` value: resident children
KIDS = struct.Struct("<I")
#: ``records`` value: segment, offset, record bytes, the record's xxh3-128 checksum
ENTRY = struct.Struct("<IQQ16s")

M_FORMAT = b"format_version"
M_RECORD_FORMAT = b"record_format_version"
M_FINGERPRINT = b"layout_fingerprint"
M_TOTAL = b"record_bytes"
M_NEXT_SEGMENT = b"next_segment"
#: the writer that created the store (JSON, see format/writer.py)
M_WRITER = b"writer"
#: the store is a sealed (encrypted) level: JSON, see format/sealed_level.py
M_ENCRYPTION = b"encryption"
#: lifetime counters of every process that used the store: u64 LE each, StoreStats.NAMES order
M_COUNTERS = b"counters"
#: + u32 BE segment id -> u64 LE: the segment's bytes below this offset are indexed (what
#: is past it, when no writer holds the segment, is scanned and verified on open / gc)
M_SEGMENT_END = b"segment_end:"
#: + u32 BE segment id -> u64 LE: bumped by every transaction that indexes records into the
#: segment; gc reclaims a segment only if it did not move since gc read the index
M_SEGMENT_GEN = b"segment_gen:"

SEGMENT_SUFFIX = ".seg"


# ------------------------------------------------------------------ segment files
def segment_name(seg_id: int) -> str:
    """The file name of segment ``seg_id`` (8 hex digits, then ``.seg``)."""
    return f"{seg_id:08x}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """The id of the segment file ``name``; None for any other file."""
    if not name.endswith(SEGMENT_SUFFIX) or len(name) != 8 + len(SEGMENT_SUFFIX):
        return None
    try:
        return int(name[:8], 16)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Location:
    """Where one record lies: segment id, byte offset, record bytes."""

    segment: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


# ------------------------------------------------------------------ codecs
def pack_entry(loc: Location, checksum: bytes) -> bytes:
    """The ``records`` value of a record stored at ``loc``."""
    return ENTRY.pack(loc.segment, loc.offset, loc.length, checksum)


def unpack_entry(raw: Any) -> tuple[Location, bytes] | None:
    """``(location, checksum)`` of a ``records`` value, or None if it is not an entry."""
    if raw is None or len(raw) != ENTRY.size:
        return None
    seg, off, n, checksum = ENTRY.unpack(raw)
    return Location(seg, off, n), checksum


def parent_key_bytes(kind: int, block_hash: bytes, parent_hash: bytes) -> bytes:
    """The key bytes of a record's parent in the prefix tree (``parent``): the previous
    block for a block, the block it was taken at for a snapshot."""
    return bytes((RecordKind.BLOCK,)) + (parent_hash if kind == RecordKind.BLOCK else block_hash)


def segment_end_key(seg: int) -> bytes:
    return M_SEGMENT_END + U32BE.pack(seg)


def segment_gen_key(seg: int) -> bytes:
    return M_SEGMENT_GEN + U32BE.pack(seg)


def bump_segment_gen(txn: lmdb.Transaction, meta: Any, seg: int) -> None:
    """Mark segment ``seg`` as indexed into by this transaction (gc compares it)."""
    raw = txn.get(segment_gen_key(seg), db=meta)
    n = U64.unpack(bytes(raw))[0] if raw is not None and len(raw) == U64.size else 0
    txn.put(segment_gen_key(seg), U64.pack(n + 1), db=meta)


def decode(st: struct.Struct, raw: Any, what: str, where: Path | str) -> tuple[Any, ...]:
    """``st.unpack(raw)`` of a value read from the index; IndexDamagedError (never a
    struct.error) when its length is not the format's."""
    if len(raw) != st.size:
        raise IndexDamagedError(str(where), f"{what} is {len(raw)} bytes, expected {st.size}")
    return st.unpack(bytes(raw))


def meta_value_bytes(kb: bytes) -> int | None:
    """The length a ``meta`` value of key ``kb`` must have (-1: any), None for a key this
    code does not write (a newer version's: never a problem)."""
    if kb.startswith(M_SEGMENT_END):
        return U64.size if len(kb) == len(M_SEGMENT_END) + U32BE.size else None
    if kb.startswith(M_SEGMENT_GEN):
        return U64.size if len(kb) == len(M_SEGMENT_GEN) + U32BE.size else None
    return {M_FORMAT: U16.size, M_RECORD_FORMAT: U16.size, M_FINGERPRINT: -1, M_TOTAL: U64.size,
            M_ENCRYPTION: -1, M_NEXT_SEGMENT: U32.size, M_COUNTERS: U64.size * len(StoreStats.NAMES)}.get(kb)


# ------------------------------------------------------------------ metadata
@dataclass(frozen=True, slots=True)
class Dbs:
    """The handles of the sub-databases of an open environment; the tree's three are None
    on a readonly open of a store written before them."""

    records: Any
    meta: Any
    atime: Any
    lru: Any
    parked: Any = None
    parent: Any = None
    kids: Any = None


#: A sealed level's record in the store directory (the same JSON as meta ``b"encryption"``):
#: the index is rebuilt from the segment files when damaged, and the marker must not be
#: lost with it (a plain writer would be let in until the next encrypted open). Written
#: with the store's creation by an encrypted opener (or when one records the sealing on an
#: existing level), read by every open and by a rebuild.
SEALED_FILE = "sealed-level.json"


def read_sealed_file(root: Path) -> dict[str, str] | None:
    """What ``root``'s :data:`SEALED_FILE` records (None: no file)."""
    try:
        raw = (root / SEALED_FILE).read_bytes()
    except FileNotFoundError:
        return None
    return parse_sealing(raw, str(root / SEALED_FILE))


def write_sealed_file(root: Path) -> None:
    """Create ``root``'s :data:`SEALED_FILE` (owner-only, durable: written aside, renamed,
    the directory synced) unless it is there."""
    path = root / SEALED_FILE
    if path.exists():
        return
    tmp = root / f"{SEALED_FILE}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, sealing_json())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(root)


def write_new_meta(txn: lmdb.Transaction, meta: Any, fingerprint: str, *, total: int = 0, next_segment: int = 1,
                   writer: StoreWriter | None = None, sealed: bool = False) -> None:
    """The metadata of a new store (or of an index rebuilt from the segment files): the
    format versions, the layout, the accounted bytes, the next segment id, and who wrote
    it and whether it is sealed, when known."""
    txn.put(M_FORMAT, U16.pack(STORE_FORMAT_VERSION), db=meta)
    txn.put(M_RECORD_FORMAT, U16.pack(FORMAT_VERSION), db=meta)
    txn.put(M_FINGERPRINT, fingerprint.encode("ascii"), db=meta)
    txn.put(M_TOTAL, U64.pack(total), db=meta)
    txn.put(M_NEXT_SEGMENT, U32.pack(next_segment), db=meta)
    if writer is not None:
        txn.put(M_WRITER, writer.to_json(), db=meta)
    if sealed:
        txn.put(M_ENCRYPTION, sealing_json(), db=meta)


def check_meta(txn: lmdb.Transaction, meta: Any, where: Path | str, *, fingerprint: str | None, create: bool,
               writer: StoreWriter | None, sealed: bool,
               marked: dict[str, str] | None = None) -> tuple[str, dict[str, str] | None]:
    """Check (with ``create``: write when absent) the metadata at an open; returns the
    store's layout fingerprint and what it records about sealing: the meta's, or where it
    has none ``marked`` (the directory's :data:`SEALED_FILE`).

    ``fingerprint`` None: a maintenance open, bound to whatever fingerprint the store
    holds. Raises StoreError (not a tiered_kv store, format version 1 or newer),
    LayoutMismatchError, EncryptedLevelError (a plain writer of a sealed level)."""
    stored_version = txn.get(M_FORMAT, db=meta)
    if stored_version is None:
        if not create or fingerprint is None:
            raise StoreError(f"{where}: not a tiered_kv LMDB store (no metadata)")
        check_opener(marked, sealed=sealed, maintenance=False, where=str(where))
        write_new_meta(txn, meta, fingerprint, writer=writer, sealed=sealed)
        return fingerprint, dict(SEALED_LEVEL) if sealed else None
    version = decode(U16, stored_version, "meta format_version", where)[0]
    if version == 1:
        raise StoreError(f"{where}: store format version 1 (records inside LMDB); this code "
                         f"reads version {STORE_FORMAT_VERSION} (records in segment files). The disk "
                         f"tier is a cache: remove this directory (or open another path) and it "
                         f"refills as prompts are served")
    if version != STORE_FORMAT_VERSION:
        raise StoreError(f"{where}: store format version {version}, this code reads "
                         f"version {STORE_FORMAT_VERSION}")
    stored_fp = bytes(txn.get(M_FINGERPRINT, db=meta) or b"").decode("ascii", "replace")
    if fingerprint is not None and stored_fp != fingerprint:
        raise LayoutMismatchError(str(where), stored_fp, fingerprint)
    raw = txn.get(M_ENCRYPTION, db=meta)
    sealing = parse_sealing(None if raw is None else bytes(raw), str(where)) or marked
    check_opener(sealing, sealed=sealed, maintenance=fingerprint is None, where=str(where))
    if create and writer is not None and txn.get(M_WRITER, db=meta) is None:
        txn.put(M_WRITER, writer.to_json(), db=meta)
    return stored_fp, sealing
