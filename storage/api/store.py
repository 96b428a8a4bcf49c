"""The block-store interface every disk backend implements (in zarr-python's manner).

A :class:`BlockStore` is a durable map ``RecordKey -> record`` bound to one layout
fingerprint. It is small on purpose::

    put_many(items)              -> list[bool]   write-once; True if written
    get_many(keys, outs)         -> list[RecordMeta | None]   verified reads into caller buffers
    contains / delete / iter / len / stats / close, and a context manager
    verify(repair=False)         -> dict         maintenance: check every record
    gc(max_bytes)                -> dict         maintenance: LRU-evict down to a bound

Contract (the conformance suite ``tests/storage/test_storage_conformance.py`` checks it
for every backend):

- **Write-once.** A key that holds a valid record is never overwritten; ``put_many``
  returns False for it. A record is either fully present or absent after any crash.
- **Verified reads.** Every read checks the checksum, the layout fingerprint, the key and
  (when given) the token digest. A failed check is a miss, counted as ``corrupt``, and the
  bad record is deleted, so a later put of the right record works.
- **Bounded.** Records take at most ``max_bytes`` (header + payload + checksum); a put that
  would exceed it first evicts the least recently accessed records (reads and writes
  count as accesses; a single call larger than ``max_bytes`` evicts its own first
  records). A full disk or map raises :class:`StoreFullError` and harms nothing.
- **Guarded eviction.** Where ``supports_eviction_guard`` is set, a record the store's
  :attr:`~BlockStore.eviction_guard` holds is never evicted (a store chain holds level-0
  records whose upload is still pending): a put that cannot make room without them
  raises :class:`StoreFullError`, and ``gc`` stops short of its bound.
- **One layout.** The fingerprint is persisted when the store is created; opening it
  with another raises :class:`LayoutMismatchError`.
- **Owner-only.** Every file and directory a store creates is 0o600 / 0o700, whatever
  the umask.
- **Threads.** One open store object may be shared by the threads of a process.
- **Processes.** Where ``supports_multiprocess`` is set, any number of processes may read
  and write one store at once; ``supports_shared_writers`` says they need no coordination.

Out buffers: see :mod:`tiered_kv.storage.record`. An out may be one buffer or a *scatter
list* (a list or tuple of buffers whose sizes add up to the payload size, filled in
order). Backends with native scatter reads (``supports_scatter_reads``: LMDB's segment
files ``preadv`` straight into the pieces) copy the payload once; the others decorate
their ``get_many`` with :func:`scatter_via_temporaries` (read into one temporary, then copy
into the pieces). On a miss the contents of an out buffer are unspecified (a backend may
have streamed bytes into it before a check failed).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import StoreError
from ..format.record import (
    CHECKSUM_BYTES,
    HASH_BYTES,
    HEADER_BYTES,
    RecordKey,
    RecordKind,
    RecordMeta,
    as_byte_array,
    as_out_segments,
    payload_views,
    record_parts,
)
from ..format.rows import RowScatter
from .eviction import EvictionGuard

__all__ = ["BlockStore", "MappedPayload", "PayloadSink", "PutItem", "Unread", "check_open", "payload_of_record"]


class PayloadSink(Protocol):
    """Takes one record's payload as it arrives (:meth:`BlockStore.read_each`), on the
    backend's I/O thread, and must authenticate it itself: the backend checked only the
    header."""

    def write(self, chunk: np.ndarray) -> bool:
        """The next bytes of the payload (1-D uint8, valid during the call only); False:
        the rest is not wanted (the backend stops reading this record)."""

    def finish(self) -> Any:
        """The payload has been written in full, or the sink stopped it: its outcome, which
        :meth:`BlockStore.read_each` returns."""


class Unread(enum.Enum):
    """What :meth:`BlockStore.read_each` returns for a record whose payload no sink saw."""

    ABSENT = "absent"          # no record, or one whose header failed a check (removed, counted corrupt)
    OTHER_SIZE = "other size"  # a valid record of another payload size than asked (kept)


@dataclass(frozen=True, eq=False, slots=True)
class MappedPayload:
    """One record's payload mapped in place (:meth:`BlockStore.map_unhashed`): its meta
    (from the header, checked) and ``payload``, a read-only ``[payload_bytes] uint8`` view
    of the page cache, valid inside the ``with`` block that gave it."""

    meta: RecordMeta
    payload: np.ndarray


@dataclass(frozen=True, eq=False, slots=True)
class PutItem:
    """One record to store.

    ``payload``: the block or snapshot bytes: bytes-like, numpy array or CPU torch tensor
    (C-contiguous; its raw bytes are stored), or a list or tuple of them, the pieces of
    one payload in order (stored back to back; the LMDB store encodes them straight from
    where they are). ``payload_bytes``: its size. ``parent_hash``: the previous block's hash
    (``h_{i-1}``); ``token_digest``: :func:`tiered_kv.prefix.token_digest` of the block's
    own token ids. Both 32 bytes.
    """

    key: RecordKey
    parent_hash: bytes
    token_digest: bytes
    payload: Any
    payload_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, RecordKey):
            raise TypeError(f"key: expected a RecordKey, got {type(self.key).__name__}")
        for name in ("parent_hash", "token_digest"):
            value = getattr(self, name)
            if not isinstance(value, (bytes, bytearray)) or len(value) != HASH_BYTES:
                got = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) else repr(value)
                raise ValueError(f"{name}: expected {HASH_BYTES} bytes, got {got}")
            object.__setattr__(self, name, bytes(value))
        # validates type and contiguity (of each piece)
        object.__setattr__(self, "payload_bytes", payload_views(self.payload)[1])

    def parts(self, layout_fingerprint: str) -> tuple[bytes, Any, bytes]:
        """``(header, payload view, checksum)`` of this item's record."""
        return record_parts(key=self.key, parent_hash=self.parent_hash, token_digest=self.token_digest,
                            layout_fingerprint=layout_fingerprint, payload=self.payload)


class BlockStore(abc.ABC):
    """A durable, verified, write-once store of records bound to one layout fingerprint."""

    #: Several processes may open the store at once (readers and writers).
    supports_multiprocess: bool = False
    #: Several writers may put into the store at once without coordinating.
    supports_shared_writers: bool = False
    #: Reads copy straight out of a memory map (no read() into a bounce buffer).
    supports_mmap_reads: bool = False
    #: ``get_many`` reads a scatter-list out straight into its pieces (no temporary).
    supports_scatter_reads: bool = False
    #: Eviction (by a put or ``gc``) skips the records :attr:`eviction_guard` holds.
    supports_eviction_guard: bool = False
    #: ``get_rows`` reads a batch natively, without a buffer object per piece.
    supports_row_reads: bool = False
    #: :meth:`read_each` streams each record's payload to a sink as it arrives (an object
    #: store: the bytes of one response are handled while the others are in flight).
    supports_streamed_reads: bool = False

    #: Set by the owner of the store (a :class:`~tiered_kv.storage.StoreChain` on its level
    #: 0) where ``supports_eviction_guard``; None: every record may be evicted.
    eviction_guard: EvictionGuard | None = None

    #: :meth:`recent` lists records by their last write or access (Zarr stores).
    supports_recent: bool = False

    layout_fingerprint: str
    max_bytes: int | None
    #: Opened with ``layout_fingerprint=None``: bound to whatever fingerprint the store
    #: holds, for maintenance (stats, verify, gc, delete, reads); puts raise StoreError.
    maintenance: bool = False
    #: Opened without writing: nothing is written, not even access times.
    readonly: bool = False
    #: The store's directory on this machine (a chain's upload journal and a rekey journal
    #: live there), None where it has none (an object store, a chain of several).
    path: Path | None = None
    #: What the store records about sealing (:mod:`~..format.sealed_level`): None for a
    #: plain level.
    sealing: dict[str, str] | None = None
    #: What a rebuild of the store's damaged index did when it was opened (an LMDB store:
    #: see :mod:`~..lmdb.environment`), None when there was none.
    index_rebuild: dict[str, Any] | None = None
    _closed: bool = True
    _where: str | None = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (every other call then raises StoreError)."""
        return self._closed

    @property
    def where(self) -> str:
        """How the store is named in messages and stats, without credentials: what it was
        given this name, else its directory, else its type."""
        if self._where is not None:
            return self._where
        return str(self.path) if self.path is not None else type(self).__name__

    @where.setter
    def where(self, value: str) -> None:
        self._where = value

    # --------------------------------------------------------------- interface
    @abc.abstractmethod
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """Store each item unless a valid record already exists under its key.

        Returns one bool per item: True if written, False if a valid record was already
        there (it is kept, never overwritten; counts as an access). Raises
        :class:`StoreFullError` when the disk or the map is full.
        """

    @abc.abstractmethod
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        """Read each record's payload into the matching out buffer.

        ``outs[i]``: writable buffer of exactly the stored payload size (else ValueError), or
        a scatter list of buffers whose sizes add up to it, filled in order.
        ``token_digests[i]``, when not None, must equal the record's token digest. Returns
        the record's metadata, or None for a miss (absent or failed a check).
        """

    def get_many_unhashed(self, keys: Sequence[RecordKey], outs: Sequence[Any]) -> list[RecordMeta | None]:
        """:meth:`get_many` for payloads that authenticate themselves, such as the envelopes
        of :class:`~tiered_kv.storage.EncryptedStore`, whose AES-GCM tag covers every byte
        the record's checksum covers (and the header fields the envelope's metadata comes
        from): the record is checked as by :meth:`get_many` (structure, fingerprint, key,
        length, its stored checksum against the index's) but the checksum of its payload
        need not be computed, so a sealed record is hashed once, by its tag. The caller
        must authenticate every payload returned before using it.

        Here: :meth:`get_many` (hashed). A backend that can skip the hash overrides it."""
        return self.get_many(keys, outs)

    def map_unhashed(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int]
                     ) -> AbstractContextManager[list[MappedPayload | None]]:
        """For payloads that authenticate themselves (as for :meth:`get_many_unhashed`):
        a context manager giving, for each ``keys[i]``, the stored payload of
        ``payload_bytes[i]`` bytes as a read-only view of the page cache (no copy: an
        encrypted level decrypts straight from it into its caller's buffer), or None where
        the backend does not map it: absent, not all in the page cache, of another size,
        failing a check (read it with :meth:`get_many_unhashed`, which counts and removes
        what is corrupt). A mapped record passed every check of :meth:`get_many_unhashed`
        (structure, fingerprint, key, length, its stored checksum against the index's);
        its payload's checksum is not computed, so the caller must authenticate it before
        using it. Counts a hit per record mapped.

        The views are valid only inside the ``with`` block: the list is emptied when it
        ends (the maps are released once nothing refers to them; Python's buffer
        protocol keeps a view that escaped mapped, never dangling).

        Here: nothing is mapped (every entry None)."""
        return nullcontext([None] * len(keys))

    def get_rows(self, keys: Sequence[RecordKey], rows: RowScatter, *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[bool]:
        """Read record ``keys[k]``'s payload into the pieces ``rows`` gives it (a
        :class:`~tiered_kv.storage.rows.RowScatter` of ``len(keys)`` records: e.g. a cache's
        pool rows), verified as by :meth:`get_many`; True per record read and verified.

        Here: ``get_many`` with one scatter list of views per record. Backends that read
        natively (``supports_row_reads``) take the plan as it is.
        """
        keys, digests = self._check_rows_args(keys, rows, token_digests)
        metas = self.get_many(keys, rows.out_segments(), token_digests=digests)
        return [m is not None for m in metas]

    @abc.abstractmethod
    def contains(self, key: RecordKey) -> bool:
        """Whether a record is stored under ``key`` (not verified: a get may still miss)."""

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        """:meth:`contains` of each key; backends with per-request latency (object
        stores) answer them concurrently."""
        return [self.contains(k) for k in keys]

    def contains_hashes(self, kind: RecordKind, hashes: Sequence[bytes]) -> list[bool]:
        """:meth:`contains_many` of the records of ``kind`` under each of ``hashes`` (a
        router's lookup asks this for every block of a prompt; a backend may answer it
        without building a RecordKey per hash)."""
        return self.contains_many([RecordKey(kind, h) for h in hashes])

    @abc.abstractmethod
    def delete(self, key: RecordKey) -> bool:
        """Remove the record under ``key``; True if there was one."""

    @abc.abstractmethod
    def __iter__(self) -> Iterator[RecordKey]:
        """The keys stored now (a snapshot taken when iteration starts)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of records stored."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """At least: records, bytes, max_bytes, hits, misses, corrupt, evictions, puts,
        put_bytes, oldest_access_ns, newest_access_ns (None when empty)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release the store; further calls raise StoreError. Idempotent."""

    # --------------------------------------------------------------- maintenance
    @abc.abstractmethod
    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """Check every stored record: header, checksum, layout fingerprint and that it sits
        under its own key (token digests are not known here).

        Removes nothing unless ``repair`` is True; then the records that failed are deleted
        (and counted as ``corrupt`` in :meth:`stats`). Returns at least ``{"checked": int,
        "corrupt": int, "removed": int, "corrupt_keys": [str]}``; a corrupt key is
        ``RecordKey.to_bytes().hex()`` (kind byte, then the hash), or the raw stored key in
        hex where it is not a valid RecordKey.
        """

    @abc.abstractmethod
    def gc(self, max_bytes: int) -> dict[str, Any]:
        """Evict least recently accessed records until the stored records take at most
        ``max_bytes`` (an int >= 0; 0 empties the store). Does not change the store's own
        ``max_bytes``. Returns at least ``{"evicted": int, "freed_bytes": int, "bytes": int,
        "records": int}`` (``bytes`` / ``records``: what is left)."""

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        """The payload bytes of the record stored under each key (None: absent), from the
        store's index or object sizes, not verified: what a reader must allocate to
        ``get`` it when it does not know the layout (``tiered-kv sync`` / ``prefetch`` on
        a store of an engine's)."""
        raise NotImplementedError(f"{type(self).__name__}: payload sizes are not known without the layout")

    def read_each(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int],
                  open_sink: Callable[[int, RecordMeta], PayloadSink]) -> list[Any]:
        """Stream the payload of each record to a sink, on the I/O threads, as it arrives
        (where ``supports_streamed_reads``): for payloads that authenticate themselves, such
        as the envelopes of :class:`~tiered_kv.storage.EncryptedStore`, whose AES-GCM tag
        covers every byte the record's checksum covers, and which are decrypted straight
        into place this way (no copy of the ciphertext, no second pass to hash it).

        For each ``keys[i]``: when the record is stored with a payload of
        ``payload_bytes[i]`` bytes and its header passes every check but the checksum
        (structure, layout fingerprint, key: :func:`~.record.check_identity`),
        ``open_sink(i, meta)`` makes its sink, which gets the payload in order
        (:meth:`PayloadSink.write`) and whose :meth:`PayloadSink.finish` is the result.
        The record's checksum is not read: the sink is the check. Otherwise the result is
        an :class:`Unread` (a bad header: removed and counted corrupt, as by
        :meth:`get_many`). Counts a hit per sink finished, a miss per record unread. A
        store failing mid-transfer raises (a sink may then have taken part of a payload).
        """
        raise NotImplementedError(f"{type(self).__name__}: no streamed reads (supports_streamed_reads is False)")

    def name_of(self, key: RecordKey) -> RecordKey:
        """The key the backend stores ``key``'s record under: ``key`` itself, except on an
        encrypted level (its keyed name: :meth:`~.encrypted.EncryptedStore.name_of`)."""
        return key

    def names(self) -> Iterator[RecordKey]:
        """The stored names (:meth:`name_of` of each record), listed without reading any
        record: the keys themselves, except on an encrypted level."""
        return iter(self)

    def recent(self, n: int) -> list[RecordKey]:
        """The keys of the ``n`` most recent records, newest first (where
        ``supports_recent``: by last write on an object store, by last access on a local
        directory)."""
        raise NotImplementedError(f"{type(self).__name__}: keeps no write or access order (supports_recent is False)")

    def record_sealing(self) -> None:
        """Record that this store is a sealed level (:mod:`.sealed_level`); backends that
        can hold a sealed level implement it."""
        raise NotImplementedError(f"{type(self).__name__}: cannot record that it is a sealed level")

    # --------------------------------------------------------------- helpers
    def put(self, item: PutItem) -> bool:
        return self.put_many([item])[0]

    def get(self, key: RecordKey, out: Any, *, token_digest: bytes | None = None) -> RecordMeta | None:
        return self.get_many([key], [out], token_digests=[token_digest])[0]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, RecordKey) and self.contains(key)

    def __enter__(self) -> BlockStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_layout_known(self, where: str) -> None:
        if self.maintenance:
            raise StoreError(f"{where}: opened without a layout fingerprint (a maintenance open); writing "
                             f"records needs the layout: open it with layout_fingerprint=... (the store holds "
                             f"{self.layout_fingerprint!r})")

    @staticmethod
    def _check_gc_bound(max_bytes: object) -> int:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes: expected an int >= 0, got {max_bytes!r}")
        return max_bytes

    @staticmethod
    def _check_put_items(items: Sequence[PutItem]) -> list[PutItem]:
        items = list(items)
        for i, item in enumerate(items):
            if not isinstance(item, PutItem):
                raise TypeError(f"items[{i}]: expected a PutItem, got {type(item).__name__}")
        return items

    @staticmethod
    def _check_rows_args(keys: Sequence[RecordKey], rows: RowScatter, token_digests: Sequence[bytes | None] | None
                         ) -> tuple[list[RecordKey], list[bytes | None]]:
        """Validated ``(keys, token digests)`` of a :meth:`get_rows`."""
        if not isinstance(rows, RowScatter):
            raise TypeError(f"rows: expected a RowScatter, got {type(rows).__name__}")
        if len(rows) != len(keys):
            raise ValueError(f"rows: expected one record per key ({len(keys)}), got {len(rows)}")
        keys, _, digests = BlockStore._check_get_args(keys, [np.empty(0, np.uint8)] * len(keys), token_digests)
        return keys, digests

    @staticmethod
    def _check_get_args(keys: Sequence[RecordKey], outs: Sequence[Any],
                        token_digests: Sequence[bytes | None] | None, *, scatter: bool = False
                        ) -> tuple[list[RecordKey], list[Any], list[bytes | None]]:
        """Validated ``(keys, outs, token digests)``. Each out becomes a 1-D uint8 view, or
        with ``scatter=True`` (a backend with native scatter reads) a list of them."""
        keys = list(keys)
        if scatter:
            outs = [as_out_segments(o, name=f"outs[{i}]") for i, o in enumerate(outs)]
        else:
            outs = [as_byte_array(o, writable=True, name=f"outs[{i}]") for i, o in enumerate(outs)]
        if len(outs) != len(keys):
            raise ValueError(f"outs: expected one buffer per key ({len(keys)}), got {len(outs)}")
        for i, k in enumerate(keys):
            if not isinstance(k, RecordKey):
                raise TypeError(f"keys[{i}]: expected a RecordKey, got {type(k).__name__}")
        digests: list[bytes | None] = [None] * len(keys) if token_digests is None else list(token_digests)
        if len(digests) != len(keys):
            raise ValueError(f"token_digests: expected one per key ({len(keys)}), got {len(digests)}")
        for i, d in enumerate(digests):
            if d is not None and (not isinstance(d, (bytes, bytearray)) or len(d) != HASH_BYTES):
                raise ValueError(f"token_digests[{i}]: expected None or {HASH_BYTES} bytes, got {d!r}")
        return keys, outs, digests


# ------------------------------------------------------------------ helpers of the backends
def payload_of_record(nbytes: int | None) -> int | None:
    """Payload bytes of a stored record of ``nbytes`` (None: absent or too short to be one)."""
    if nbytes is None or nbytes < HEADER_BYTES + CHECKSUM_BYTES:
        return None
    return nbytes - HEADER_BYTES - CHECKSUM_BYTES


def check_open(closed: bool, what: str) -> None:
    if closed:
        raise StoreError(f"{what}: store is closed")
