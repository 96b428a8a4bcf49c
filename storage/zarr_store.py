"""Zarr block store: the same records in a Zarr v3 group, shareable by uncoordinated writers.

Layout (keys relative to the group; on a local directory each key is a file)::

    zarr.json                     group metadata; attributes["tiered_kv"] = {
                                    "store": "tiered_kv.block_store",
                                    "store_format_version": 1, "record_format_version": 1,
                                    "layout_fingerprint": "kvl1-…"}
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
"""

from __future__ import annotations

import abc
import errno
import json
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .base import (BlockStore, PutItem, StoreStats, check_open, create_private_file, fsync_dir, mkdir_private,
                   scatter_via_temporaries)
from .errors import CorruptRecordError, LayoutMismatchError, RecordCheck, StoreError, StoreFullError

try:  # the object-store path needs obstore (the ``s3`` extra)
    from . import s3 as _s3
except ImportError:  # pragma: no cover - obstore not installed
    _s3 = None  # type: ignore[assignment]
from .record import (
    CHECKSUM_BYTES,
    FORMAT_VERSION,
    HEADER_BYTES,
    RecordKey,
    RecordKind,
    RecordMeta,
    decode_record,
    fingerprint_field,
    parse_header,
    record_size,
    verify_record_parts,
)

__all__ = ["STORE_FORMAT_VERSION", "ZarrStore"]

STORE_FORMAT_VERSION = 1
_META_KEY = "zarr.json"
_ATTR = "tiered_kv"
_STORE_NAME = "tiered_kv.block_store"
_KIND_DIRS = {RecordKind.BLOCK: "blocks", RecordKind.SNAPSHOT: "snapshots"}
_DIR_KINDS = {v: k for k, v in _KIND_DIRS.items()}
_HEX = frozenset("0123456789abcdef")
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _object_name(key: RecordKey) -> str:
    h = key.block_hash.hex()
    return f"{_KIND_DIRS[key.kind]}/{h[:2]}/{h[2:]}"


def _key_of(kind_dir: str, shard: str, rest: str) -> RecordKey | None:
    """The key of object ``kind_dir/shard/rest``, or None if it is not a record name."""
    kind = _DIR_KINDS.get(kind_dir)
    if kind is None or len(shard) != 2 or len(rest) != 62 or not _HEX.issuperset(shard + rest):
        return None
    return RecordKey(kind, bytes.fromhex(shard + rest))


def _group_metadata(layout_fingerprint: str) -> bytes:
    attrs = {_ATTR: {"store": _STORE_NAME, "store_format_version": STORE_FORMAT_VERSION,
                     "record_format_version": FORMAT_VERSION, "layout_fingerprint": layout_fingerprint}}
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attrs}
    return json.dumps(doc, indent=2, sort_keys=True).encode()


class _IoPool:
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


def _raise_first(outcomes: Sequence[Any]) -> None:
    for o in outcomes:
        if isinstance(o, BaseException):
            raise o


class _Objects(abc.ABC):
    """Where the records of a ZarrStore live: raw objects under string keys."""

    local: bool
    #: Listing costs requests (an object store): list at open only when bounded, and
    #: check an existing record on put by its size, not by reading it.
    remote: bool = False

    @abc.abstractmethod
    def read_meta(self) -> bytes | None: ...

    @abc.abstractmethod
    def create_meta(self, data: bytes) -> None:
        """Create ``zarr.json`` unless it exists (then keep the existing one)."""

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

    def size_of(self, name: str) -> int | None:
        """Stored bytes of object ``name``, None if absent (used where ``remote``)."""
        raise NotImplementedError

    @abc.abstractmethod
    def remove(self, name: str) -> bool: ...

    @abc.abstractmethod
    def touch(self, name: str, ns: int) -> None: ...

    @abc.abstractmethod
    def scan(self) -> list[tuple[RecordKey, int, int]]:
        """Every record: (key, bytes, last access ns)."""

    def sync(self) -> None:
        """Make the objects written since the last call durable."""


def _raise_full(root: object, e: OSError) -> None:
    if e.errno in _FULL_ERRNOS:
        raise StoreFullError(f"{root}: disk full ({e.strerror}); records already stored are intact") from e


class _LocalObjects(_Objects):
    """Records as files under a directory (the key scheme of zarr's LocalStore)."""

    local = True

    def __init__(self, root: Path, *, stale_partial_s: float, io: _IoPool) -> None:
        self.root = root
        self.io = io
        self.stale_partial_s = stale_partial_s
        self._known_dirs: set[str] = set()
        self._dirty_dirs: set[Path] = set()
        self._lock = threading.Lock()
        mkdir_private(root)

    # -- writing
    def _ensure_dir(self, parent: str) -> Path:
        d = self.root / parent
        if parent not in self._known_dirs:
            kind_dir = d.parent
            if mkdir_private(kind_dir):
                with self._lock:
                    self._dirty_dirs.add(self.root)
            if mkdir_private(d):
                with self._lock:
                    self._dirty_dirs.add(kind_dir)
            self._known_dirs.add(parent)
        return d

    def _create(self, path: Path, parts: Sequence[Any]) -> bool:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
        fd = create_private_file(tmp)
        if fd is None:  # a random name taken: only by another writer of this very record
            raise StoreError(f"{tmp}: temporary name already exists")
        try:
            try:
                _write_all(fd, parts)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            with self._lock:
                self._dirty_dirs.add(path.parent)
            return True
        except OSError as e:
            _raise_full(self.root, e)
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def create_meta(self, data: bytes) -> None:
        self._create(self.root / _META_KEY, [data])
        self.sync()

    def write_new(self, name: str, parts: Sequence[Any]) -> bool:
        parent, _, base = name.rpartition("/")
        try:
            d = self._ensure_dir(parent)
        except OSError as e:
            _raise_full(self.root, e)
            raise
        return self._create(d / base, parts)

    def sync(self) -> None:
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        # Concurrently: each directory fsync is a device flush, concurrent ones merge.
        _raise_first(self.io.map(fsync_dir, sorted(dirs)))

    # -- reading
    def read_meta(self) -> bytes | None:
        try:
            return (self.root / _META_KEY).read_bytes()
        except FileNotFoundError:
            return None

    def read_whole(self, name: str) -> np.ndarray | None:
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            size = os.fstat(fd).st_size
            buf = np.empty(size, dtype=np.uint8)
            n = _pread_into(fd, [buf], 0)
            return buf[:n]
        finally:
            os.close(fd)

    def read_into(self, name: str, key: RecordKey, fingerprint: str, digest: bytes | None,
                  out: np.ndarray) -> RecordMeta | None:
        try:
            fd = os.open(self.root / name, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            size = os.fstat(fd).st_size
            if size != record_size(out.nbytes):
                # Corrupt, or the caller's buffer has the wrong size: decide on the whole record.
                whole = np.empty(size, dtype=np.uint8)
                _pread_into(fd, [whole], 0)
                decode_record(whole, expect_key=key, expect_fingerprint=fingerprint, expect_token_digest=digest)
                raise ValueError(f"out: expected {size - record_size(0)} bytes (the stored payload of "
                                 f"{key!r}), got {out.nbytes}")
            # One read straight into the caller's buffer, then verify it there.
            header, checksum = bytearray(HEADER_BYTES), bytearray(CHECKSUM_BYTES)
            n = _pread_into(fd, [header, out, checksum], 0)
            if n != size:
                raise CorruptRecordError(RecordCheck.TRUNCATED, f"short read: {n} of {size} bytes")
            parsed = parse_header(header, size)
            return verify_record_parts(header, out, checksum, parsed=parsed, expect_key=key,
                                       expect_fingerprint=fingerprint, expect_token_digest=digest)
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        return (self.root / name).is_file()

    def remove(self, name: str) -> bool:
        try:
            os.unlink(self.root / name)
            return True
        except FileNotFoundError:
            return False

    def touch(self, name: str, ns: int) -> None:
        try:
            os.utime(self.root / name, ns=(ns, ns))
        except FileNotFoundError:
            pass  # evicted or deleted by another process meanwhile

    def scan(self) -> list[tuple[RecordKey, int, int]]:
        found: list[tuple[RecordKey, int, int]] = []
        stale_before = time.time() - self.stale_partial_s
        for kind_dir in _DIR_KINDS:
            for shard in _scandir(self.root / kind_dir):
                if not shard.is_dir(follow_symlinks=False):
                    continue
                for entry in _scandir(Path(shard.path)):
                    key = _key_of(kind_dir, shard.name, entry.name)
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if key is not None:
                        found.append((key, st.st_size, st.st_atime_ns))
                    elif entry.name.endswith(".partial") and st.st_mtime < stale_before:
                        Path(entry.path).unlink(missing_ok=True)  # left by a killed writer
        return found


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _write_all(fd: int, parts: Sequence[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(memoryview(p).cast("B"))]
    while views:
        n = os.writev(fd, views)
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0


def _pread_into(fd: int, bufs: Sequence[Any], offset: int) -> int:
    """Fill ``bufs`` from ``offset``; returns the bytes read (less only at end of file)."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if len(v)]
    done = 0
    while views:
        n = os.preadv(fd, views, offset + done)
        if n == 0:
            break
        done += n
        while n:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0] = views[0][n:]
                n = 0
    return done


class _ZarrApiObjects(_Objects):
    """Records under any zarr Store, through the zarr Store API (sync wrappers)."""

    local = False

    def __init__(self, store: Any) -> None:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        self.store = store
        self._sync = sync
        self._proto = default_buffer_prototype()

    def _get(self, name: str) -> np.ndarray | None:
        buf = self._sync(self.store.get(name, prototype=self._proto))
        return None if buf is None else buf.as_numpy_array().view(np.uint8).reshape(-1)

    def _put(self, name: str, data: bytes) -> None:
        self._sync(self.store.set_if_not_exists(name, self._proto.buffer.from_bytes(data)))

    def read_meta(self) -> bytes | None:
        arr = self._get(_META_KEY)
        return None if arr is None else arr.tobytes()

    def create_meta(self, data: bytes) -> None:
        self._put(_META_KEY, data)

    def write_new(self, name: str, parts: Sequence[Any]) -> bool:
        if self.exists(name):
            return False
        self._put(name, b"".join(memoryview(p).cast("B") for p in parts))
        return True

    def read_whole(self, name: str) -> np.ndarray | None:
        return self._get(name)

    def read_into(self, name: str, key: RecordKey, fingerprint: str, digest: bytes | None,
                  out: np.ndarray) -> RecordMeta | None:
        arr = self._get(name)
        if arr is None:
            return None
        return decode_record(arr, expect_key=key, expect_fingerprint=fingerprint,
                             expect_token_digest=digest, out=out)

    def exists(self, name: str) -> bool:
        return bool(self._sync(self.store.exists(name)))

    def remove(self, name: str) -> bool:
        if not self.exists(name):
            return False
        self._sync(self.store.delete(name))
        return True

    def touch(self, name: str, ns: int) -> None:
        pass  # object stores: access times live in the in-memory index only

    def scan(self) -> list[tuple[RecordKey, int, int]]:
        async def listing() -> list[str]:
            return [name for kind_dir in _DIR_KINDS async for name in self.store.list_prefix(kind_dir + "/")]

        found = []
        for name in self._sync(listing()):
            parts = name.split("/")
            key = _key_of(*parts) if len(parts) == 3 else None
            if key is not None:
                found.append((key, int(self._sync(self.store.getsize(name))), 0))
        return found


class _S3Objects(_Objects):
    """Records in an S3-compatible bucket under a prefix (obstore, create-only puts)."""

    local = False
    remote = True

    def __init__(self, store: Any, where: str) -> None:
        self.store = store  # obstore.store.S3Store, keys relative to its prefix
        self.where = where

    def read_meta(self) -> bytes | None:
        data = _s3.get_bytes(self.store, _META_KEY)
        return None if data is None else bytes(data)

    def create_meta(self, data: bytes) -> None:
        _s3.put_create_only(self.store, _META_KEY, data)  # False: another writer created it first

    def write_new(self, name: str, parts: Sequence[Any]) -> bool:
        # HEAD first: a present record is the common case when many nodes hold the same
        # prefix, and a conditional PUT racing another writer of the key can wait seconds.
        if _s3.exists(self.store, name):
            return False
        # One contiguous buffer: obstore sends iterables as multipart uploads, which are
        # not create-only.
        body = np.concatenate([np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts])
        return _s3.put_create_only(self.store, name, body)

    def read_whole(self, name: str) -> np.ndarray | None:
        data = _s3.get_bytes(self.store, name)
        return None if data is None else np.frombuffer(data, dtype=np.uint8)

    def read_into(self, name: str, key: RecordKey, fingerprint: str, digest: bytes | None,
                  out: np.ndarray) -> RecordMeta | None:
        header, checksum = bytearray(HEADER_BYTES), bytearray(CHECKSUM_BYTES)
        size = _s3.get_parts_into(self.store, name, [header, out, checksum])
        if size is None:
            return None
        if size != record_size(out.nbytes):
            # Corrupt, or the caller's buffer has the wrong size: decide on the whole record.
            whole = self.read_whole(name)
            if whole is None:
                return None  # deleted meanwhile
            decode_record(whole, expect_key=key, expect_fingerprint=fingerprint, expect_token_digest=digest)
            raise ValueError(f"out: expected {whole.nbytes - record_size(0)} bytes (the stored payload of "
                             f"{key!r}), got {out.nbytes}")
        parsed = parse_header(header, size)
        return verify_record_parts(header, out, checksum, parsed=parsed, expect_key=key,
                                   expect_fingerprint=fingerprint, expect_token_digest=digest)

    def exists(self, name: str) -> bool:
        return _s3.exists(self.store, name)

    def size_of(self, name: str) -> int | None:
        info = _s3.stat(self.store, name)
        return None if info is None else info.size

    def remove(self, name: str) -> bool:
        if not _s3.exists(self.store, name):
            return False
        _s3.delete(self.store, name)
        return True

    def touch(self, name: str, ns: int) -> None:
        pass  # objects are immutable and have no access time: the in-memory index keeps it

    def scan(self) -> list[tuple[RecordKey, int, int]]:
        found = []
        for kind_dir in _DIR_KINDS:
            for info in _s3.list_objects(self.store, kind_dir + "/"):
                parts = info.key.split("/")
                key = _key_of(*parts) if len(parts) == 3 else None
                if key is not None:
                    found.append((key, info.size, info.last_modified_ns))
        return found


def _s3_objects(target: Any, options: dict[str, Any]) -> _S3Objects:
    """``target``: a ``zarr+s3://`` URL, an S3Location or an obstore S3Store."""
    if _s3 is None:
        raise TypeError("url_or_path: an S3 store needs obstore installed (pip install 'tiered-kv[s3]')")
    client = {k: options.pop(k) for k in ("timeout_s", "max_retries") if k in options}
    if isinstance(target, str):
        target = _s3.parse_s3_url(target, **options)
        options = {}
    if isinstance(target, _s3.S3Location):
        if options:
            raise ValueError(f"options {sorted(options)}: expected none besides timeout_s / max_retries "
                             f"with an S3Location (they are part of the location)")
        return _S3Objects(_s3.open_object_store(target, **client), target.url())
    if options or client:
        raise ValueError(f"options {sorted(options) + sorted(client)}: an open S3Store is already configured; "
                         f"pass a zarr+s3:// URL or an S3Location to set them")
    cfg = target.config
    where = f"zarr+s3://{cfg.get('bucket')}/{target.prefix or ''}".rstrip("/")
    if cfg.get("endpoint"):
        where += f"?endpoint={cfg['endpoint']}"
    return _S3Objects(target, where)


class ZarrStore(BlockStore):
    """Block store in a Zarr v3 group (see the module docstring for the layout).

    ``url_or_path``: a local directory (path, ``file://`` URL or ``zarr.storage.LocalStore``);
    an S3-compatible bucket prefix (``zarr+s3://bucket/prefix?endpoint=...&region=...``, an
    :class:`~tiered_kv.storage.s3.S3Location`, an obstore ``S3Store`` or a
    ``zarr.storage.ObjectStore`` over one); or any other ``zarr.abc.store.Store`` instance.
    ``max_bytes``: bound on the stored records (None: unbounded), LRU-evicted.
    ``io_threads``: records of one ``put_many`` / ``get_many`` are written / read
    concurrently by this many threads (their fsyncs, reads or requests overlap).
    ``stale_partial_s``: age after which a scan removes a temporary file left by a killed
    writer. ``rescan_fraction``: see the module docstring.

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

    def __init__(self, url_or_path: Any, *, layout_fingerprint: str, max_bytes: int | None = None,
                 io_threads: int = 8, stale_partial_s: float = 3600.0, rescan_fraction: float = 0.1,
                 **s3_options: Any) -> None:
        fingerprint_field(layout_fingerprint)
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes <= 0):
            raise ValueError(f"max_bytes: expected None or a positive int, got {max_bytes!r}")
        if not 0 < rescan_fraction <= 1:
            raise ValueError(f"rescan_fraction: expected a value in (0, 1], got {rescan_fraction!r}")
        self.layout_fingerprint = layout_fingerprint
        self.max_bytes = max_bytes
        self._rescan_bytes = None if max_bytes is None else max(1, int(rescan_fraction * max_bytes))
        self._io = _IoPool(io_threads)
        self._objects = self._make_objects(url_or_path, stale_partial_s, self._io, dict(s3_options))
        self.path: Path | None = getattr(self._objects, "root", None)
        self.supports_multiprocess = self._objects.local or self._objects.remote
        self.supports_shared_writers = True
        self.where = (str(self.path) if self.path is not None
                      else getattr(self._objects, "where", None) or repr(url_or_path))
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[RecordKey, tuple[int, int]] = OrderedDict()  # LRU first: (bytes, ns)
        self._total = 0
        self._written_since_scan = 0
        self._last_ns = 0
        self._scanned_ns: int | None = None
        self._closed = True
        self._open_meta()
        if not self._objects.remote or max_bytes is not None:
            self._rescan()
        self._closed = False

    @staticmethod
    def _make_objects(url_or_path: Any, stale_partial_s: float, io: _IoPool,
                      s3_options: dict[str, Any]) -> _Objects:
        objects = ZarrStore._object_store(url_or_path, s3_options)
        if objects is not None:
            return objects
        if s3_options:
            raise ValueError(f"options {sorted(s3_options)}: expected only with an object store "
                             f"(zarr+s3:// URL, S3Location or S3Store), got {url_or_path!r}")
        if isinstance(url_or_path, (str, os.PathLike)):
            s = os.fspath(url_or_path)
            if "://" in s:
                scheme, _, rest = s.partition("://")
                if scheme != "file":
                    raise ValueError(f"url_or_path: expected a local path, file:// URL or zarr+s3:// URL "
                                     f"(pass a zarr Store instance for other stores), got {s!r}")
                s = rest
            return _LocalObjects(Path(os.path.abspath(s)), stale_partial_s=stale_partial_s, io=io)
        try:
            from zarr.abc.store import Store
            from zarr.storage import LocalStore
        except ImportError:  # pragma: no cover - zarr is a dependency
            raise TypeError("url_or_path: a zarr Store needs zarr installed") from None
        if isinstance(url_or_path, LocalStore):
            return _LocalObjects(Path(url_or_path.root).absolute(), stale_partial_s=stale_partial_s, io=io)
        if isinstance(url_or_path, Store):
            return _ZarrApiObjects(url_or_path)
        raise TypeError(f"url_or_path: expected a path, file:// URL or zarr Store, got "
                        f"{type(url_or_path).__name__}")

    @staticmethod
    def _object_store(target: Any, s3_options: dict[str, Any]) -> _Objects | None:
        """The S3 objects of ``target`` if it names an S3 bucket prefix, else None."""
        if isinstance(target, str) and target.startswith("zarr+s3://"):
            return _s3_objects(target, s3_options)
        if _s3 is None:
            return None
        if isinstance(target, _s3.S3Location | _s3.S3Store):
            return _s3_objects(target, s3_options)
        inner = getattr(target, "store", None)  # zarr.storage.ObjectStore over an obstore store
        if isinstance(inner, _s3.S3Store) and type(target).__name__ == "ObjectStore":
            return _s3_objects(inner, s3_options)
        return None

    def _open_meta(self) -> None:
        raw = self._objects.read_meta()
        if raw is None and self.path is not None and (self.path / "data.mdb").exists():
            raise StoreError(f"{self.where}: this directory holds an LMDB block store; open it with "
                             f"LmdbStore or an lmdb:// URL")
        if raw is None:
            self._objects.create_meta(_group_metadata(self.layout_fingerprint))
            raw = self._objects.read_meta()  # another process may have created it first
            if raw is None:
                raise StoreError(f"{self.where}: could not create {_META_KEY}")
        try:
            attrs = json.loads(raw)["attributes"][_ATTR]
            version = attrs["store_format_version"]
            stored_fp = attrs["layout_fingerprint"]
        except (ValueError, KeyError, TypeError):
            raise StoreError(f"{self.where}: {_META_KEY} is not the metadata of a tiered_kv block store "
                             f"(expected attributes[{_ATTR!r}])") from None
        if version != STORE_FORMAT_VERSION:
            raise StoreError(f"{self.where}: store format version {version}, this code reads "
                             f"version {STORE_FORMAT_VERSION}")
        if stored_fp != self.layout_fingerprint:
            raise LayoutMismatchError(self.where, str(stored_fp), self.layout_fingerprint)

    # ------------------------------------------------------------------ index
    def _rescan(self) -> None:
        found = sorted(self._objects.scan(), key=lambda t: t[2])
        with self._lock:
            index: OrderedDict[RecordKey, tuple[int, int]] = OrderedDict()
            for key, size, ns in found:
                # accesses this process made after the scan started are newer than the files say
                mine = self._index.get(key)
                index[key] = (size, max(ns, mine[1] if mine else 0))
            self._index = OrderedDict(sorted(index.items(), key=lambda kv: kv[1][1]))
            self._total = sum(size for size, _ in index.values())
            self._written_since_scan = 0
            self._scanned_ns = time.time_ns()

    def _now_ns(self) -> int:
        with self._lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns

    def _accessed(self, key: RecordKey, size: int) -> None:
        ns = self._now_ns()
        self._objects.touch(_object_name(key), ns)
        with self._lock:
            old = self._index.pop(key, None)
            self._index[key] = (size, ns)
            self._total += size - (old[0] if old else 0)

    def _forget(self, key: RecordKey) -> None:
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None:
                self._total -= old[0]

    def _make_room(self, need: int) -> int:
        """Evict least recently accessed records until ``need`` more bytes fit."""
        if self.max_bytes is None:
            return 0
        assert self._rescan_bytes is not None
        if self._written_since_scan >= self._rescan_bytes:
            self._rescan()
        victims = []
        with self._lock:
            while self._total + need > self.max_bytes and self._index:
                key, (size, _) = self._index.popitem(last=False)
                self._total -= size
                victims.append(key)
        return sum(self._objects.remove(_object_name(key)) for key in victims)

    # ------------------------------------------------------------------ writes
    def _existing_is_valid(self, key: RecordKey, size: int) -> bool | None:
        """Check the record stored under ``key`` (``size``: the record bytes a put would
        write): True valid, False corrupt (and removed), None absent.

        Local stores verify the whole record. Object stores first compare its size (one
        HEAD): the same size is taken as valid without a GET (reads verify the contents
        anyway); another size is verified in full (a valid record of another payload size
        is kept: write-once).
        """
        name = _object_name(key)
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
                known = key in self._index
            if known and self._existing_is_valid(key, size):
                self._accessed(key, size)  # write-once: keep it, count the access
            else:
                todo.append(i)
        self._stats.add(evictions=self._make_room(sum(prepared[i][2] for i in todo)))
        # Create the new records concurrently: each is atomic on its own, and their fsyncs
        # overlap (one journal commit for many files instead of one each).
        error: BaseException | None = None
        try:
            for i, outcome in zip(todo, self._io.map(lambda i: self._objects.write_new(
                    _object_name(prepared[i][0]), prepared[i][1]), todo)):
                key, parts, size = prepared[i]
                if isinstance(outcome, BaseException):
                    error = error or outcome
                    continue
                results[i] = outcome or self._rewrite_if_corrupt(key, parts, size)
                if results[i]:
                    with self._lock:
                        self._written_since_scan += size
                    self._stats.add(puts=1, put_bytes=size)
                self._accessed(key, size)
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
            if self._objects.write_new(_object_name(key), parts):
                return True
        raise StoreError(f"{self.where}: {key!r} keeps being replaced by corrupt records")

    def delete(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        self._forget(key)
        return self._objects.remove(_object_name(key))

    # ------------------------------------------------------------------ reads
    @scatter_via_temporaries
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, self.where)
        keys, dsts, digests = self._check_get_args(keys, outs, token_digests)
        outcomes = self._io.map(lambda i: self._objects.read_into(
            _object_name(keys[i]), keys[i], self.layout_fingerprint, digests[i], dsts[i]), range(len(keys)))
        metas: list[RecordMeta | None] = []
        for key, outcome in zip(keys, outcomes):
            if isinstance(outcome, CorruptRecordError):
                # Immutable objects: a bad one stays bad, remove it so a put can replace it.
                self._objects.remove(_object_name(key))
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
                self._accessed(key, outcome.record_bytes)
                self._stats.add(hits=1)
                metas.append(outcome)
        return metas

    def contains(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        return self._objects.exists(_object_name(key))

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        """One HEAD (or stat) per key, ``io_threads`` at a time."""
        check_open(self._closed, self.where)
        outcomes = self._io.map(lambda k: self._objects.exists(_object_name(k)), list(keys))
        _raise_first(outcomes)
        return [bool(o) for o in outcomes]

    def __iter__(self) -> Iterator[RecordKey]:
        check_open(self._closed, self.where)
        self._rescan()
        with self._lock:
            return iter(list(self._index))

    def __len__(self) -> int:
        check_open(self._closed, self.where)
        self._rescan()
        with self._lock:
            return len(self._index)

    def stats(self) -> dict[str, Any]:
        """See :meth:`BlockStore.stats`. On an object store no request is made: ``records``
        and ``bytes`` are as of the last listing (``listed_ns``, None if never) plus this
        handle's own writes, reads and evictions."""
        check_open(self._closed, self.where)
        if not self._objects.remote:
            self._rescan()
        with self._lock:
            times = [ns for _, ns in self._index.values()]
            out: dict[str, Any] = {
                "backend": "zarr+s3" if self._objects.remote else "zarr", "path": self.where,
                "layout_fingerprint": self.layout_fingerprint,
                "records": len(self._index), "bytes": self._total, "max_bytes": self.max_bytes,
                "oldest_access_ns": min(times) if times else None,
                "newest_access_ns": max(times) if times else None,
                "listed_ns": self._scanned_ns,
            }
        out.update(self._stats.as_dict())
        return out

    # ------------------------------------------------------------------ maintenance
    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        """Read every record and check it (see :meth:`BlockStore.verify`); on an object
        store one GET per record, ``io_threads`` at a time."""
        check_open(self._closed, self.where)
        self._rescan()
        with self._lock:
            keys = list(self._index)
        fp = self.layout_fingerprint

        def check(key: RecordKey) -> CorruptRecordError | bool:
            data = self._objects.read_whole(_object_name(key))
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
                        removed += self._objects.remove(_object_name(key))
                        self._forget(key)
                        self._stats.add(corrupt=1)
                elif isinstance(outcome, BaseException):
                    raise outcome
                checked += outcome is not False
        return {"checked": checked, "corrupt": len(corrupt), "removed": removed, "corrupt_keys": corrupt}

    def gc(self, max_bytes: int) -> dict[str, Any]:
        """Evict least recently accessed records until at most ``max_bytes`` remain (see
        :meth:`BlockStore.gc`). Access order: this handle's accesses, then the stored one
        (local: the files' atime; object store: last-modified, i.e. write order)."""
        check_open(self._closed, self.where)
        self._check_gc_bound(max_bytes)
        self._rescan()
        victims: list[tuple[RecordKey, int]] = []
        with self._lock:
            while self._total > max_bytes and self._index:
                key, (size, _) = self._index.popitem(last=False)
                self._total -= size
                victims.append((key, size))
        removed = self._io.map(lambda v: self._objects.remove(_object_name(v[0])), victims)
        _raise_first(removed)
        evicted = sum(1 for r in removed if r)
        freed = sum(size for (_, size), r in zip(victims, removed) if r)
        self._stats.add(evictions=evicted)
        with self._lock:
            return {"evicted": evicted, "freed_bytes": freed, "bytes": self._total, "records": len(self._index)}

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._objects.sync()
        self._closed = True
        self._io.shutdown()

    def __repr__(self) -> str:
        return f"ZarrStore({self.where!r}, {self.layout_fingerprint!r}, {'closed' if self._closed else 'open'})"
