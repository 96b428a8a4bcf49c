"""Zarr block store: the same records in a Zarr v3 group, shareable by uncoordinated writers.

Layout (keys relative to the group; on a local directory each key is a file)::

    zarr.json                     group metadata; attributes["tiered_kv"] = {
                                    "store": "tiered_kv.block_store",
                                    "store_format_version": 1, "record_format_version": 1,
                                    "layout_fingerprint": "kvl1-…",
                                    "writer": {...},  (who created it, see writer.py; optional)
                                    "encryption": {...}}  (a sealed level, see sealed_level.py; optional)
    blocks/<h[0:2]>/<h[2:64]>     one Classical-block record, h = block hash in hex
    snapshots/<h[0:2]>/<h[2:64]>  one state-snapshot record

Each record is one raw object holding exactly the bytes of :mod:`~.record` (header,
payload, checksum) — not a Zarr array, so one record is one object and is written in one
atomic step. Plain ``zarr`` reads it all: ``zarr.open_group(path).attrs["tiered_kv"]`` gives
the fingerprint, ``zarr.storage.LocalStore(path).get("blocks/ab/…")`` a record.

Content-addressed and write-once, so any number of processes (or hosts, on an object
store) can share one group without coordinating. The records of one call are written
(and read) concurrently on a few I/O threads:

- **Local directory** (a path, ``file://`` URL or ``zarr.storage.LocalStore``): a record is
  written to a private temporary file next to its final name (``.<name>.<pid>.<rand>.partial``,
  0o600), fsynced, then hard-linked to the final name — ``link`` never replaces, so two
  writers of one record never tear or overwrite each other — and the directories are
  fsynced at the end of ``put_many``, which is durable when it returns. Reads stream the payload straight into the caller's buffer
  (``preadv``) and verify it there. Partial files left by a killed writer are removed by
  the next scan once older than ``stale_partial_s``. Files are 0o600, directories 0o700.
  This path uses plain POSIX calls on the same keys ``LocalStore`` uses, because
  ``LocalStore`` neither fsyncs nor sets modes nor reads into a caller's buffer.
- **An S3-compatible object store** (``zarr+s3://bucket/prefix?endpoint=...``, an
  :class:`~tiered_kv.storage.s3.S3Location`, an ``obstore`` ``S3Store``, or a
  ``zarr.storage.ObjectStore`` over one): the same keys under the prefix. A record is
  written by one HEAD (skip if present) and one single-part conditional PUT
  (``If-None-Match: *``, :func:`~tiered_kv.storage.s3.put_create_only`), so of any number
  of racing writers of a record (processes or hosts) exactly one creates it and nobody
  overwrites it; ``zarr.json`` is created the same way. zarr's own ``ObjectStore`` is not
  used for writes: its ``set_if_not_exists`` does not tell the caller whether it won, and
  errors are not mapped to :mod:`~tiered_kv.storage.s3`'s classes (unavailable / auth /
  no bucket); the bucket stays a plain Zarr group (``zarr.open_group(ObjectStore(s3))``
  reads it). Reads stream the payload straight into the caller's buffer and verify it
  there, as on a local disk. A put checks an existing record of the expected size by
  that size (HEAD) only, not by a GET of its bytes (another size: read and verified); its
  contents are checked by every read (a bad one is a miss and is deleted). Credentials
  and client options are those of :func:`~tiered_kv.storage.s3.parse_s3_url`, plus
  ``timeout_s`` / ``max_retries`` of :func:`~tiered_kv.storage.s3.open_object_store`;
  failures raise its error classes.
- **Any other zarr Store** (e.g. ``MemoryStore`` in tests) goes through
  the zarr Store API: ``set_if_not_exists`` and ``get``. Two racing writers of one key may
  both report True there (the store keeps one of the two, both valid).

Eviction: leaves first over the records' prefix tree, as the LMDB store's (see
:mod:`.tree`: the least recently used record with no resident child, with the blocks that
led only to it; an interior record only when the eviction guard holds every leaf); what
an eviction takes is reported to :attr:`ZarrStore.on_evict`. The tree lives in memory:
links come from puts and reads, and, when the store evicts (``max_bytes`` set), a scan
reads the header of each record it has no link for (local: one ``pread``, ``O_NOATIME``;
another zarr Store: a byte-range ``get``; an S3 bucket reads none: what it lists unlinked
stays plain LRU).

LRU: on a local directory the last access of a record is its file's atime, set
explicitly (``os.utime``) on every hit and write, so it survives restarts and is shared by
every process without an index file; a scan rebuilds the in-memory LRU order from it. The
scan runs at open, for ``len``/``iter``/``stats``, and before evicting once this process has
written ``rescan_fraction * max_bytes`` since the last scan, so concurrent writers exceed
``max_bytes`` by at most that much each. Other zarr stores keep access times in memory
only (a reopened store evicts in listing order until records are accessed again; on S3
in last-modified order, i.e. oldest written first). On an object store a listing costs one
request per 1000 records, so it is done at open only when ``max_bytes`` is set, and
``stats()`` reports ``records``/``bytes`` as of the last listing (open, ``len``, ``iter``,
``verify``, ``gc``) plus this handle's own writes, reads and evictions.

Maintenance: :meth:`ZarrStore.verify` reads and checks every record (on S3: one GET
each), :meth:`ZarrStore.gc` evicts least recently accessed records down to a bound.

Code: this module holds the store (index, LRU, put / get / verify / gc); the objects live
behind :class:`~.objects.Objects` (names, I/O pool): :mod:`~.local` (a local
directory), :mod:`~.bucket` (an S3 bucket), :mod:`~.generic` (any other zarr Store).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..api import (
    BlockStore,
    PayloadSink,
    PutItem,
    StoreStats,
    Unread,
    check_open,
    payload_of_record,
    scatter_via_temporaries,
)
from ..api.eviction import tell_evicted
from ..errors import CorruptRecordError, LayoutMismatchError, StoreError, StoreFullError
from ..format.record import RecordKey, RecordMeta, decode_record, fingerprint_field, parse_header, record_size
from .objects import (
    ATTR,
    META_KEY,
    STORE_FORMAT_VERSION,
    IoPool,
    group_metadata,
    object_name,
    raise_first,
)
from ..format.sealed_level import SEALED_LEVEL, check_opener, parse_sealing
from ..format.writer import StoreWriter
from .targets import local_dir, make_objects
from .tree import RecordTree, parent_key

__all__ = ["STORE_FORMAT_VERSION", "ZarrStore"]

#: Record headers one I/O task reads at a scan (the tasks run on the I/O threads).
_HEADER_BATCH = 256


class ZarrStore(BlockStore):
    """Block store in a Zarr v3 group (see the module docstring for the layout).

    ``url_or_path``: a local directory (path, ``file://`` URL or ``zarr.storage.LocalStore``);
    an S3-compatible bucket prefix (``zarr+s3://bucket/prefix?endpoint=...&region=...``, an
    :class:`~tiered_kv.storage.s3.S3Location`, an obstore ``S3Store`` or a
    ``zarr.storage.ObjectStore`` over one); or any other ``zarr.abc.store.Store`` instance.
    ``max_bytes``: bound on the stored records (None: unbounded), evicted leaves first in
    LRU order (see the module docstring).
    ``io_threads``: records of one ``put_many`` / ``get_many`` are written / read
    concurrently by this many threads (their fsyncs, reads or requests overlap).
    ``stale_partial_s``: age after which a scan removes a temporary file left by a killed
    writer. ``sealed``: the opener is an :class:`~.encrypted.EncryptedStore` (see
    :mod:`.sealed_level`; :attr:`sealing` is what the store records). ``rescan_fraction``:
    see the module docstring. ``layout_fingerprint=None``: a maintenance open of an
    existing store (see :func:`tiered_kv.storage.open_store`; puts raise StoreError). ``writer``: recorded in ``zarr.json`` when the store is created.

    ``s3_options`` (object stores only): ``timeout_s`` (default 5) and ``max_retries``
    (default 2) of :func:`~tiered_kv.storage.s3.open_object_store`, and with a URL the
    keywords of :func:`~tiered_kv.storage.s3.parse_s3_url` (``access_key_id``,
    ``secret_access_key``, ``session_token``, ``endpoint``, ``region``, ``allow_http``...;
    credentials default to ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``). Opening
    reads (or creates, create-only) ``zarr.json``, so a bad endpoint, bucket or credentials
    fail here with :class:`~tiered_kv.storage.s3.ObjectStoreUnavailable`,
    :class:`~tiered_kv.storage.s3.BucketNotFoundError` or
    :class:`~tiered_kv.storage.s3.ObjectStoreAuthError`.
    """

    supports_multiprocess = True
    supports_shared_writers = True
    supports_mmap_reads = False
    supports_eviction_guard = True
    supports_recent = True

    def __init__(self, url_or_path: Any, *, layout_fingerprint: str | None, max_bytes: int | None = None,
                 io_threads: int = 8, stale_partial_s: float = 3600.0, rescan_fraction: float = 0.1,
                 writer: StoreWriter | None = None, sealed: bool = False, **s3_options: Any) -> None:
        if layout_fingerprint is not None:
            fingerprint_field(layout_fingerprint)
        if writer is not None and not isinstance(writer, StoreWriter):
            raise TypeError(f"writer: expected a StoreWriter or None, got {type(writer).__name__}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes <= 0):
            raise ValueError(f"max_bytes: expected None or a positive int, got {max_bytes!r}")
        if not 0 < rescan_fraction <= 1:
            raise ValueError(f"rescan_fraction: expected a value in (0, 1], got {rescan_fraction!r}")
        self.layout_fingerprint: str = layout_fingerprint  # type: ignore[assignment]  (None: read at open)
        self.maintenance = layout_fingerprint is None
        self._writer = writer
        self._sealed = bool(sealed)
        self.writer_info: dict[str, Any] | None = None
        #: what ``zarr.json`` records about sealing (sealed_level.py), None for a plain level
        self.sealing: dict[str, str] | None = None
        local = local_dir(url_or_path)
        if self.maintenance and local is not None and not (local / META_KEY).is_file():
            raise FileNotFoundError(f"{local}: no Zarr store here (no {META_KEY}) to open without a layout "
                                    f"fingerprint")
        self.max_bytes = max_bytes
        self._rescan_bytes = None if max_bytes is None else max(1, int(rescan_fraction * max_bytes))
        self._io = IoPool(io_threads)
        self._objects = make_objects(url_or_path, stale_partial_s, self._io, dict(s3_options))
        self.path: Path | None = getattr(self._objects, "root", None)
        self.supports_multiprocess = self._objects.local or self._objects.remote
        self.supports_shared_writers = True
        self.supports_streamed_reads = self._objects.streams
        self.where = (str(self.path) if self.path is not None
                      else getattr(self._objects, "where", None) or repr(url_or_path))
        self._stats = StoreStats()
        self._lock = threading.Lock()
        #: the resident records: sizes, access times, the prefix tree eviction walks (tree.py)
        self._tree = RecordTree()
        self._on_evict: Callable[[list[RecordKey]], None] | None = None
        self._written_since_scan = 0
        self._last_ns = 0
        self._scanned_ns: int | None = None
        self._closed = True
        self._open_meta()
        if not self._objects.remote or max_bytes is not None:
            self._rescan()
        self._closed = False

    def _open_meta(self) -> None:
        raw = self._objects.read_meta()
        if raw is None and self.path is not None and (self.path / "data.mdb").exists():
            raise StoreError(f"{self.where}: this directory holds an LMDB block store; open it with "
                             f"LmdbStore or an lmdb:// URL")
        if raw is None and self.maintenance:
            raise FileNotFoundError(f"{self.where}: no Zarr store here (no {META_KEY}) to open without a "
                                    f"layout fingerprint")
        if raw is None:
            self._objects.create_meta(group_metadata(self.layout_fingerprint, self._writer,
                                                     SEALED_LEVEL if self._sealed else None))
            raw = self._objects.read_meta()  # another process may have created it first
            if raw is None:
                raise StoreError(f"{self.where}: could not create {META_KEY}")
        try:
            attrs = json.loads(raw)["attributes"][ATTR]
            version = attrs["store_format_version"]
            stored_fp = attrs["layout_fingerprint"]
        except (ValueError, KeyError, TypeError):
            raise StoreError(f"{self.where}: {META_KEY} is not the metadata of a tiered_kv block store "
                             f"(expected attributes[{ATTR!r}])") from None
        if version != STORE_FORMAT_VERSION:
            raise StoreError(f"{self.where}: store format version {version}, this code reads "
                             f"version {STORE_FORMAT_VERSION}")
        if self.maintenance:
            self.layout_fingerprint = str(stored_fp)
        elif stored_fp != self.layout_fingerprint:
            raise LayoutMismatchError(self.where, str(stored_fp), self.layout_fingerprint)
        writer = attrs.get("writer")
        self.writer_info = writer if isinstance(writer, dict) else None
        self.sealing = parse_sealing(attrs.get("encryption"), self.where)
        check_opener(self.sealing, sealed=self._sealed, maintenance=self.maintenance, where=self.where)

    def record_sealing(self) -> None:
        """Record in ``zarr.json`` that this existing store is a sealed level (see
        :mod:`.sealed_level`; an encrypted opener found none recorded), and drop the
        tenant hash of its writer record."""
        check_open(self._closed, self.where)
        raw = self._objects.read_meta()
        if raw is None:
            raise StoreError(f"{self.where}: {META_KEY} is gone")
        doc = json.loads(raw)
        attrs = doc["attributes"][ATTR]
        attrs["encryption"] = dict(SEALED_LEVEL)
        if isinstance(attrs.get("writer"), dict) and attrs["writer"].get("tenant_sha256") is not None:
            attrs["writer"] = {**attrs["writer"], "tenant_sha256": None}
        self._objects.replace_meta(json.dumps(doc, indent=2, sort_keys=True).encode())
        self.writer_info = attrs.get("writer")
        self.sealing = dict(SEALED_LEVEL)

    # ------------------------------------------------------------------ index
    def _rescan(self) -> None:
        """Rebuild the tree from a listing: every record's size and stored access time
        (this handle's own later accesses kept), its link kept where this handle has one,
        else, when the store evicts, read from its header (:meth:`_read_parents`)."""
        found = self._objects.scan()
        if self.max_bytes is not None and self._objects.reads_headers:
            with self._lock:
                unlinked = [(key, size) for key, size, _ in found if self._tree.parent_of(key) is None]
            read = self._read_parents(unlinked)
        else:
            read = {}
        with self._lock:
            old = self._tree
            records = []
            for key, size, ns in found:
                # accesses this process made after the scan started are newer than the files say
                mine = old.get(key)
                records.append((key, size, max(ns, mine[1] if mine else 0)))
            self._tree = RecordTree.build(records, {**read, **old.links()})
            self._written_since_scan = 0
            self._scanned_ns = time.time_ns()

    def _read_parents(self, records: Sequence[tuple[RecordKey, int]]) -> dict[RecordKey, RecordKey]:
        """The parents of ``records`` (key, stored bytes) from their headers (one small
        read each, on the I/O threads: see :meth:`~.objects.Objects.read_header`); a record
        whose header is absent, unreadable or not its own stays out (an unlinked leaf)."""

        def parent(record: tuple[RecordKey, int]) -> RecordKey | None:
            key, size = record
            header = self._objects.read_header(object_name(key))
            if header is None:
                return None
            try:
                parsed = parse_header(header, size)
            except CorruptRecordError:
                return None  # (a read of it finds it corrupt and removes it)
            if parsed.kind != key.kind or parsed.block_hash != key.block_hash:
                return None
            return parent_key(key, parsed.parent_hash)

        def batch(chunk: Sequence[tuple[RecordKey, int]]) -> list[RecordKey | None]:
            got: list[RecordKey | None] = []
            for record in chunk:
                try:
                    got.append(parent(record))
                except Exception:  # an I/O error: unlinked, like an unreadable header
                    got.append(None)
            return got

        # Batches of records per I/O task: one task per header costs more than the read.
        chunks = [records[i:i + _HEADER_BATCH] for i in range(0, len(records), _HEADER_BATCH)]
        outcomes = self._io.map(batch, chunks)
        raise_first(outcomes)
        out: dict[RecordKey, RecordKey] = {}
        for chunk, got in zip(chunks, outcomes):
            out.update((key, p) for (key, _), p in zip(chunk, got) if p is not None)
        return out

    def _now_ns(self) -> int:
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _accessed(self, key: RecordKey, size: int, parent: RecordKey | None = None) -> None:
        """``key`` was read or written now; ``parent``: its parent in the tree, from the
        put or the header read."""
        ns = self._now_ns()
        self._objects.touch(object_name(key), ns)
        with self._lock:
            self._tree.touch(key, size, ns)
            if parent is not None:
                self._tree.link(key, parent)

    def _forget(self, key: RecordKey) -> None:
        with self._lock:
            self._tree.remove(key)

    @property
    def on_evict(self) -> Callable[[list[RecordKey]], None] | None:
        """Told the keys of the records this handle's evictions took (a put's or ``gc``'s),
        once they are removed, on the thread that evicted (a put's caller: a disk tier's
        writer thread). None (the default): nobody is told. Another process's evictions
        are never reported here: a listener learns only what this handle evicted. It
        should be quick (a put waits for it); one that raises is logged, and the eviction
        stands. The same contract as :attr:`.LmdbStore.on_evict`."""
        return self._on_evict

    @on_evict.setter
    def on_evict(self, listener: Callable[[list[RecordKey]], None] | None) -> None:
        self._on_evict = listener

    def _make_room(self, need: int) -> int:
        """Evict records until ``need`` more bytes fit, leaves first (see tree.py); returns
        how many this call removed."""
        if self.max_bytes is None:
            return 0
        assert self._rescan_bytes is not None
        if self._written_since_scan >= self._rescan_bytes:
            self._rescan()
        with self._lock:
            victims, kept = self._tree.evict(self._tree.total + need - self.max_bytes, self.eviction_guard)
            if self._tree.total + need > self.max_bytes and kept:
                self._tree.restore(victims)
                raise StoreFullError(
                    f"{self.where}: no room for {need} bytes: records take {self._tree.total} of {self.max_bytes} "
                    f"bytes and the {kept} least recently used that could go are held by the store's eviction "
                    f"guard (uploads to a farther level still pending); nothing was written by this call")
        removed = sum(self._objects.remove(object_name(v.key)) for v in victims)
        tell_evicted(self._on_evict, [v.key for v in victims])
        return removed

    # ------------------------------------------------------------------ writes
    def _existing_is_valid(self, key: RecordKey, size: int) -> bool | None:
        """Check the record stored under ``key`` (``size``: the record bytes a put would
        write): True valid, False corrupt (and removed), None absent.

        Local stores verify the whole record. Object stores first compare its size (one
        HEAD): the same size is taken as valid without a GET (reads verify the contents
        anyway); another size is verified in full (a valid record of another payload size
        is kept: write-once).
        """
        name = object_name(key)
        if self._objects.remote:
            stored = self._objects.size_of(name)
            if stored is None:
                return None
            if stored == size:
                return True
        data = self._objects.read_whole(name)
        if data is None:
            return None
        try:
            decode_record(data, expect_key=key, expect_fingerprint=self.layout_fingerprint)
            valid = True
        except CorruptRecordError:
            valid = False
        if not valid:
            self._objects.remove(name)
            self._forget(key)
            self._stats.add(corrupt=1)
        return valid

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        check_open(self._closed, self.where)
        self._check_layout_known(self.where)
        items = self._check_put_items(items)
        prepared: list[tuple[RecordKey, Any, int]] = []
        for item in items:
            parts = item.parts(self.layout_fingerprint)
            size = record_size(parts[1].nbytes)
            if self.max_bytes is not None and size > self.max_bytes:
                raise StoreFullError(f"{self.where}: record {item.key!r} of {size} bytes is larger "
                                     f"than max_bytes={self.max_bytes}")
            prepared.append((item.key, parts, size))
        results = [False] * len(prepared)
        first: dict[RecordKey, int] = {}
        todo: list[int] = []
        for i, (key, _, size) in enumerate(prepared):
            if key in first:
                continue  # a repeated key in one call: the first occurrence writes
            first[key] = i
            with self._lock:
                known = key in self._tree
            if known and self._existing_is_valid(key, size):
                self._accessed(key, size, parent_key(key, items[i].parent_hash))  # write-once: keep it
            else:
                todo.append(i)
        self._stats.add(evictions=self._make_room(sum(prepared[i][2] for i in todo)))
        # Create the new records concurrently: each is atomic on its own, and their fsyncs
        # overlap (one journal commit for many files instead of one each).
        error: BaseException | None = None
        try:
            for i, outcome in zip(todo, self._io.map(lambda i: self._objects.write_new(
                    object_name(prepared[i][0]), prepared[i][1]), todo)):
                key, parts, size = prepared[i]
                if isinstance(outcome, BaseException):
                    error = error or outcome
                    continue
                results[i] = outcome or self._rewrite_if_corrupt(key, parts, size)
                if results[i]:
                    with self._lock:
                        self._written_since_scan += size
                    self._stats.add(puts=1, put_bytes=size)
                self._accessed(key, size, parent_key(key, items[i].parent_hash))
        finally:
            self._objects.sync()
        if error is not None:
            raise error
        return results

    def _rewrite_if_corrupt(self, key: RecordKey, parts: Any, size: int) -> bool:
        """``key`` already existed when we tried to create it (another writer got there
        first, or it was not in our index): keep it if valid, else write ours."""
        for _ in range(3):
            if self._existing_is_valid(key, size):
                return False
            # corrupt (now removed) or gone meanwhile (deleted, evicted): write it
            self._stats.add(evictions=self._make_room(size))
            if self._objects.write_new(object_name(key), parts):
                return True
        raise StoreError(f"{self.where}: {key!r} keeps being replaced by corrupt records")

    def delete(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        self._forget(key)
        return self._objects.remove(object_name(key))

    # ------------------------------------------------------------------ reads
    @scatter_via_temporaries
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, self.where)
        keys, dsts, digests = self._check_get_args(keys, outs, token_digests)
        outcomes = self._io.map(lambda i: self._objects.read_into(
            object_name(keys[i]), keys[i], self.layout_fingerprint, digests[i], dsts[i]), range(len(keys)))
        metas: list[RecordMeta | None] = []
        for key, outcome in zip(keys, outcomes):
            if isinstance(outcome, CorruptRecordError):
                # Immutable objects: a bad one stays bad, remove it so a put can replace it.
                self._objects.remove(object_name(key))
                self._forget(key)
                self._stats.add(corrupt=1, misses=1)
                metas.append(None)
            elif isinstance(outcome, BaseException):
                raise outcome
            elif outcome is None:
                self._forget(key)
                self._stats.add(misses=1)
                metas.append(None)
            else:
                self._accessed(key, outcome.record_bytes, parent_key(key, outcome.parent_hash))
                self._stats.add(hits=1)
                metas.append(outcome)
        return metas

    def read_each(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int],
                  open_sink: Callable[[int, RecordMeta], PayloadSink]) -> list[Any]:
        """See :meth:`~.base.BlockStore.read_each` (on an object store: each record on an
        I/O thread, its payload handed over chunk by chunk as the response arrives)."""
        check_open(self._closed, self.where)
        if not self.supports_streamed_reads:
            return super().read_each(keys, payload_bytes, open_sink)
        keys = list(keys)
        if len(payload_bytes) != len(keys):
            raise ValueError(f"payload_bytes: expected one per key ({len(keys)}), got {len(payload_bytes)}")
        parents: list[RecordKey | None] = [None] * len(keys)  # from each header read

        def opened(i: int, meta: RecordMeta) -> PayloadSink:
            parents[i] = parent_key(keys[i], meta.parent_hash)
            return open_sink(i, meta)

        outcomes = self._io.map(lambda i: self._objects.read_to_sink(
            object_name(keys[i]), keys[i], self.layout_fingerprint, payload_bytes[i],
            lambda meta: opened(i, meta)), range(len(keys)))
        results: list[Any] = []
        for key, n, parent, outcome in zip(keys, payload_bytes, parents, outcomes):
            if isinstance(outcome, CorruptRecordError):
                self._objects.remove(object_name(key))  # (immutable: a bad one stays bad)
                self._forget(key)
                self._stats.add(corrupt=1, misses=1)
                outcome = Unread.ABSENT
            elif isinstance(outcome, BaseException):
                raise outcome
            elif outcome is Unread.ABSENT:
                self._forget(key)
                self._stats.add(misses=1)
            elif outcome is Unread.OTHER_SIZE:
                self._stats.add(misses=1)
            else:
                self._accessed(key, record_size(n), parent)
                self._stats.add(hits=1)
            results.append(outcome)
        return results

    def contains(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        return self._objects.exists(object_name(key))

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        """One HEAD (or stat) per key, ``io_threads`` at a time."""
        check_open(self._closed, self.where)
        outcomes = self._io.map(lambda k: self._objects.exists(object_name(k)), list(keys))
        raise_first(outcomes)
        return [bool(o) for o in outcomes]

    def __iter__(self) -> Iterator[RecordKey]:
        check_open(self._closed, self.where)
        self._rescan()
        with self._lock:
            return iter(list(self._tree.oldest_first()))

    def __len__(self) -> int:
        check_open(self._closed, self.where)
        self._rescan()
        with self._lock:
            return len(self._tree)

    def recent(self, n: int) -> list[RecordKey]:
        """The ``n`` most recent records, newest first: by last write on an object store
        (its last-modified time; records are written once), by last access on a local
        directory. Lists the store (on S3 one request per 1000 records)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected a non-negative int, got {n!r}")
        check_open(self._closed, self.where)
        self._rescan()
        with self._lock:
            keys = list(self._tree.oldest_first())
        return keys[::-1][:n]

    def stats(self) -> dict[str, Any]:
        """See :meth:`BlockStore.stats`. On an object store no request is made: ``records``
        and ``bytes`` are as of the last listing (``listed_ns``, None if never) plus this
        handle's own writes, reads and evictions."""
        check_open(self._closed, self.where)
        if not self._objects.remote:
            self._rescan()
        with self._lock:
            times = self._tree.access_times()
            out: dict[str, Any] = {
                "backend": "zarr+s3" if self._objects.remote else "zarr", "path": self.where,
                "layout_fingerprint": self.layout_fingerprint,
                "records": len(self._tree), "bytes": self._tree.total, "max_bytes": self.max_bytes,
                "oldest_access_ns": min(times) if times else None,
                "newest_access_ns": max(times) if times else None,
                "listed_ns": self._scanned_ns, "writer": self.writer_info,
            }
        out.update(self._stats.as_dict())
        return out

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        """See :meth:`BlockStore.payload_sizes`: from the listing this handle holds, else
        one stat / HEAD per key (``io_threads`` at a time)."""
        check_open(self._closed, self.where)
        keys = list(keys)
        with self._lock:
            known = [self._tree.get(key) for key in keys]
        todo = [i for i, entry in enumerate(known) if entry is None]
        sizes = self._io.map(lambda i: self._objects.size_of(object_name(keys[i])), todo)
        raise_first(sizes)
        asked = dict(zip(todo, sizes))
        return [payload_of_record(asked[i] if entry is None else entry[0]) for i, entry in enumerate(known)]

    # ------------------------------------------------------------------ maintenance
    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """Read every record and check it (see :meth:`BlockStore.verify`); on an object
        store one GET per record, ``io_threads`` at a time."""
        check_open(self._closed, self.where)
        self._rescan()
        with self._lock:
            keys = list(self._tree.oldest_first())
        fp = self.layout_fingerprint

        def check(key: RecordKey) -> CorruptRecordError | bool:
            data = self._objects.read_whole(object_name(key))
            if data is None:
                return False  # removed meanwhile (evicted or deleted by another process)
            try:
                decode_record(data, expect_key=key, expect_fingerprint=fp)
            except CorruptRecordError as e:
                return e
            return True

        checked = removed = 0
        corrupt: list[str] = []
        for start in range(0, len(keys), 256):  # bounded fan-out, whatever the store's size
            chunk = keys[start:start + 256]
            for key, outcome in zip(chunk, self._io.map(check, chunk)):
                if isinstance(outcome, CorruptRecordError):
                    corrupt.append(key.to_bytes().hex())
                    if repair:
                        removed += self._objects.remove(object_name(key))
                        self._forget(key)
                        self._stats.add(corrupt=1)
                elif isinstance(outcome, BaseException):
                    raise outcome
                checked += outcome is not False
        return {"checked": checked, "corrupt": len(corrupt), "removed": removed, "corrupt_keys": corrupt}

    def gc(self, max_bytes: int) -> dict[str, Any]:
        """Evict records, leaves first (see tree.py), until at most ``max_bytes`` remain
        (see :meth:`BlockStore.gc`). Access order: this handle's accesses, then the stored
        one (local: the files' atime; object store: last-modified, i.e. write order)."""
        check_open(self._closed, self.where)
        self._check_gc_bound(max_bytes)
        self._rescan()
        with self._lock:  # (records the eviction guard holds stay: gc may stop above its bound)
            victims = self._tree.evict(self._tree.total - max_bytes, self.eviction_guard)[0]
        removed = self._io.map(lambda v: self._objects.remove(object_name(v.key)), victims)
        tell_evicted(self._on_evict, [v.key for v, r in zip(victims, removed) if not isinstance(r, BaseException)])
        raise_first(removed)
        evicted = sum(1 for r in removed if r)
        freed = sum(v.size for v, r in zip(victims, removed) if r)
        self._stats.add(evictions=evicted)
        with self._lock:
            return {"evicted": evicted, "freed_bytes": freed, "bytes": self._tree.total, "records": len(self._tree)}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._objects.sync()
        self._closed = True
        self._io.shutdown()

    def __repr__(self) -> str:
        return f"ZarrStore({self.where!r}, {self.layout_fingerprint!r}, {'closed' if self._closed else 'open'})"
