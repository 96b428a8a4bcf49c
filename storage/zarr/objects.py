"""The object layer under :class:`~.store.ZarrStore`: record names, the I/O pool, and
the interface each backend implements.

A ZarrStore keeps its records as raw objects under string keys (see the layout in
:mod:`~.store`); where those objects live is an :class:`Objects`:

- :class:`~.local.LocalObjects`: files under a local directory;
- :class:`~.bucket.S3Objects`: objects in an S3-compatible bucket (create-only puts);
- :class:`~.generic.ZarrApiObjects`: any other zarr Store, through the zarr Store API.
"""

from __future__ import annotations

import abc
import contextlib
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..api import PayloadSink, Unread
from ..format.record import (
    FORMAT_VERSION,
    HEADER_BYTES,
    RecordKey,
    RecordKind,
    RecordMeta,
    check_identity,
    decode_record,
    parse_header,
    record_size,
)
from ..format.writer import StoreWriter

__all__ = ["ATTR", "DIR_KINDS", "IoPool", "KIND_DIRS", "META_KEY", "Objects", "STORE_FORMAT_VERSION", "group_metadata",
           "key_of", "object_name", "raise_first"]

STORE_FORMAT_VERSION = 1
#: The group's metadata object.
META_KEY = "zarr.json"
#: The group attribute holding the store's description.
ATTR = "tiered_kv"
_STORE_NAME = "tiered_kv.block_store"
KIND_DIRS = {RecordKind.BLOCK: "blocks", RecordKind.SNAPSHOT: "snapshots"}
DIR_KINDS = {v: k for k, v in KIND_DIRS.items()}
_HEX = frozenset("0123456789abcdef")


def object_name(key: RecordKey) -> str:
    h = key.block_hash.hex()
    return f"{KIND_DIRS[key.kind]}/{h[:2]}/{h[2:]}"


def key_of(kind_dir: str, shard: str, rest: str) -> RecordKey | None:
    """The key of object ``kind_dir/shard/rest``, or None if it is not a record name."""
    kind = DIR_KINDS.get(kind_dir)
    if kind is None or len(shard) != 2 or len(rest) != 62 or not _HEX.issuperset(shard + rest):
        return None
    return RecordKey(kind, bytes.fromhex(shard + rest))


def group_metadata(layout_fingerprint: str, writer: StoreWriter | None = None,
                   sealing: dict[str, str] | None = None) -> bytes:
    """``zarr.json`` of a new store; ``writer``: who creates it (see :mod:`~.writer`);
    ``sealing``: the record that it is a sealed level (see :mod:`~.sealed_level`)."""
    attrs: dict[str, Any] = {ATTR: {"store": _STORE_NAME, "store_format_version": STORE_FORMAT_VERSION,
                                    "record_format_version": FORMAT_VERSION,
                                    "layout_fingerprint": layout_fingerprint}}
    if writer is not None:
        attrs[ATTR]["writer"] = writer.to_dict()
    if sealing is not None:
        attrs[ATTR]["encryption"] = dict(sealing)
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attrs}
    return json.dumps(doc, indent=2, sort_keys=True).encode()



class IoPool:
    """A few threads for blocking file / object I/O (syscalls release the GIL)."""

    def __init__(self, threads: int) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"io_threads: expected a positive int, got {threads!r}")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def map(self, fn: Callable[[Any], Any], args: Sequence[Any]) -> list[Any]:
        """``[fn(a) for a in args]``, concurrently; an exception is returned in its place."""

        def call(a: Any) -> Any:
            try:
                return fn(a)
            except BaseException as e:  # handed back to the caller, which raises it
                return e

        if len(args) <= 1 or self.threads == 1:
            return [call(a) for a in args]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tiered_kv.storage")
            pool = self._pool
        return list(pool.map(call, args))

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()


def raise_first(outcomes: Sequence[Any]) -> None:
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o


class Objects(abc.ABC):
    """Where the records of a ZarrStore live: raw objects under string keys."""

    local: bool
    #: Listing costs requests (an object store): list at open only when bounded, and
    #: check an existing record on put by its size, not by reading it.
    remote: bool = False
    #: :meth:`read_stream` is implemented (records can be streamed to sinks).
    streams: bool = False
    #: :meth:`read_header` is implemented (a scan can link records from their headers).
    reads_headers: bool = False

    @abc.abstractmethod
    def read_meta(self) -> bytes | None: ...

    @abc.abstractmethod
    def create_meta(self, data: bytes) -> None:
        """Create ``zarr.json`` unless it exists (then keep the existing one)."""

    def replace_meta(self, data: bytes) -> None:
        """Replace ``zarr.json`` (an existing store's attributes change: it becomes a sealed
        level, see :mod:`~.sealed_level`); atomic where the objects allow it."""
        raise NotImplementedError(f"{type(self).__name__}: zarr.json cannot be replaced")

    @abc.abstractmethod
    def write_new(self, name: str, parts: Sequence[Any]) -> bool:
        """Create object ``name`` from ``parts`` (written back to back) unless it exists."""

    @abc.abstractmethod
    def read_whole(self, name: str) -> np.ndarray | None: ...

    @abc.abstractmethod
    def read_into(self, name: str, key: RecordKey, fingerprint: str, digest: bytes | None,
                  out: np.ndarray) -> RecordMeta | None:
        """Verified read of ``name``'s payload into ``out``; None if absent."""

    @abc.abstractmethod
    def exists(self, name: str) -> bool: ...

    @abc.abstractmethod
    def size_of(self, name: str) -> int | None:
        """Stored bytes of object ``name``, None if absent."""

    @abc.abstractmethod
    def remove(self, name: str) -> bool: ...

    @abc.abstractmethod
    def touch(self, name: str, ns: int) -> None: ...

    @abc.abstractmethod
    def scan(self) -> list[tuple[RecordKey, int, int]]:
        """Every record: (key, bytes, last access ns)."""

    def sync(self) -> None:
        """Make the objects written since the last call durable."""

    def read_header(self, name: str) -> bytes | None:
        """The first ``HEADER_BYTES`` bytes of object ``name``, read without moving its
        access time where the objects keep one; None if it is absent or shorter."""
        raise NotImplementedError(f"{type(self).__name__}: no header reads")

    def read_stream(self, name: str) -> tuple[int, Iterator[np.ndarray]] | None:
        """Object ``name``'s size and its bytes in order as they arrive (1-D uint8 chunks,
        adding up to the size; closing the iterator drops the rest), or None if absent."""
        raise NotImplementedError(f"{type(self).__name__}: no streamed reads")

    def read_to_sink(self, name: str, key: RecordKey, fingerprint: str, payload_bytes: int,
                     open_sink: Callable[[RecordMeta], PayloadSink]) -> Any:
        """One record of :meth:`~.base.BlockStore.read_each`: its header checked (raises
        CorruptRecordError), then its payload streamed to ``open_sink(meta)``; the sink's
        outcome, or an :class:`~.base.Unread`. The checksum's bytes are dropped unread."""
        started = self.read_stream(name)
        if started is None:
            return Unread.ABSENT
        size, chunks = started
        with contextlib.closing(chunks):
            if size != record_size(payload_bytes):
                chunks.close()
                whole = self.read_whole(name)  # corrupt (removed), or a valid record of another size
                if whole is None:
                    return Unread.ABSENT
                decode_record(whole, expect_key=key, expect_fingerprint=fingerprint)
                return Unread.OTHER_SIZE
            head = bytearray()
            sink: PayloadSink | None = None
            left = payload_bytes  # payload bytes the sink has yet to get
            for chunk in chunks:
                if sink is None:
                    take = HEADER_BYTES - len(head)
                    head += memoryview(chunk[:take])
                    chunk = chunk[take:]
                    if len(head) < HEADER_BYTES:
                        continue
                    meta = check_identity(parse_header(head, size), expect_key=key, expect_fingerprint=fingerprint)
                    sink = open_sink(meta)
                n = min(left, chunk.nbytes)
                if n:
                    left -= n
                    if not sink.write(chunk[:n]):
                        break
                if not left:
                    break  # (what follows is the checksum)
            assert sink is not None  # (the size covers a header)
            return sink.finish()

