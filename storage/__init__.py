"""Disk tier: record format and block stores (installed as ``tiered_kv.storage``).

>>> store = open_store("lmdb:///var/cache/kv", layout_fingerprint=layout.fingerprint,
...                    max_bytes=512 << 30)
>>> store.put_many([PutItem(RecordKey.block(h), parent, token_digest(ids), block_bytes)])
>>> store.get_many([RecordKey.block(h)], [pinned_uint8_tensor])

Backends: :class:`LmdbStore` (embedded default) and :class:`ZarrStore` (a Zarr v3 group
on a directory or an object store). Both pass the same conformance suite.
"""

from __future__ import annotations

import os
from typing import Any

from .base import BlockStore, PutItem
from .errors import (
    CorruptRecordError,
    LayoutMismatchError,
    RecordCheck,
    StoreError,
    StoreFullError,
    StoreLockedError,
)
from .lmdb_store import LmdbStore
from .record import (
    FORMAT_VERSION,
    RecordKey,
    RecordKind,
    RecordMeta,
    decode_record,
    encode_record,
    encode_record_into,
    record_size,
)
from .zarr_store import ZarrStore

__all__ = [
    "BlockStore",
    "CorruptRecordError",
    "FORMAT_VERSION",
    "LayoutMismatchError",
    "LmdbStore",
    "PutItem",
    "RecordCheck",
    "RecordKey",
    "RecordKind",
    "RecordMeta",
    "SCHEMES",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "ZarrStore",
    "decode_record",
    "encode_record",
    "encode_record_into",
    "open_store",
    "record_size",
]

#: URL schemes :func:`open_store` accepts, and the backend each selects.
SCHEMES: dict[str, type[BlockStore]] = {"lmdb": LmdbStore, "zarr": ZarrStore}


def open_store(url: str | os.PathLike[str], *, layout_fingerprint: str, **options: Any) -> BlockStore:
    """Open (creating if needed) the block store at ``url``.

    ``lmdb:///abs/path`` -> :class:`LmdbStore`, ``zarr:///abs/path`` -> :class:`ZarrStore`,
    a plain path -> :class:`LmdbStore`. ``options`` go to the backend (e.g. ``max_bytes``).
    """
    s = os.fspath(url)
    if not isinstance(s, str):
        raise TypeError(f"url: expected a str or path, got {type(url).__name__}")
    if "://" not in s:
        return LmdbStore(s, layout_fingerprint=layout_fingerprint, **options)
    scheme, _, rest = s.partition("://")
    backend = SCHEMES.get(scheme)
    if backend is None:
        accepted = ", ".join(f"{name}:///abs/path" for name in SCHEMES)
        raise ValueError(f"url: expected one of {accepted} or a plain path, got scheme {scheme!r} in {s!r}")
    if not rest.startswith("/"):
        raise ValueError(f"url: expected an absolute path after {scheme}:// (e.g. {scheme}:///abs/path), "
                         f"got {s!r}")
    return backend(rest, layout_fingerprint=layout_fingerprint, **options)
