"""Records of a ZarrStore in an S3-compatible bucket under a prefix (obstore).

A record is written by one HEAD (skip if present) and one single-part conditional PUT
(``If-None-Match: *``, :func:`~.s3.put_create_only`): of any number of racing writers of a
record exactly one creates it and nobody overwrites it. Reads stream the payload straight
into the caller's buffer and verify it there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

try:  # the object-store path needs obstore (the ``s3`` extra)
    from .. import s3 as _s3
except ImportError:  # pragma: no cover - obstore not installed
    _s3 = None  # type: ignore[assignment]
from ..format.record import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    RecordKey,
    RecordMeta,
    decode_record,
    parse_header,
    record_size,
    verify_record_parts,
)
from .objects import DIR_KINDS, META_KEY, Objects, key_of

__all__ = ["S3Objects", "s3_objects"]


class S3Objects(Objects):
    """Records in an S3-compatible bucket under a prefix (obstore, create-only puts)."""

    local = False
    remote = True
    streams = True

    def __init__(self, store: Any, where: str) -> None:
        self.store = store  # obstore.store.S3Store, keys relative to its prefix
        self.where = where

    def read_meta(self) -> bytes | None:
        data = _s3.get_bytes(self.store, META_KEY)
        return None if data is None else bytes(data)

    def create_meta(self, data: bytes) -> None:
        _s3.put_create_only(self.store, META_KEY, data)  # False: another writer created it first

    def replace_meta(self, data: bytes) -> None:
        _s3.put_replace(self.store, META_KEY, data)

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

    def read_stream(self, name: str) -> tuple[int, Iterator[np.ndarray]] | None:
        return _s3.get_stream(self.store, name)

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
        for kind_dir in DIR_KINDS:
            for info in _s3.list_objects(self.store, kind_dir + "/"):
                parts = info.key.split("/")
                key = key_of(*parts) if len(parts) == 3 else None
                if key is not None:
                    found.append((key, info.size, info.last_modified_ns))
        return found


def s3_objects(target: Any, options: dict[str, Any]) -> S3Objects:
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
        return S3Objects(_s3.open_object_store(target, **client), target.url())
    if options or client:
        raise ValueError(f"options {sorted(options) + sorted(client)}: an open S3Store is already configured; "
                         f"pass a zarr+s3:// URL or an S3Location to set them")
    cfg = target.config
    where = f"zarr+s3://{cfg.get('bucket')}/{target.prefix or ''}".rstrip("/")
    if cfg.get("endpoint"):
        where += f"?endpoint={cfg['endpoint']}"
    return S3Objects(target, where)

