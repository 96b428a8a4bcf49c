"""Disk tier: record format and block stores (installed as ``tiered_kv.storage``).

>>> store = open_store("lmdb:///var/cache/kv", layout_fingerprint=layout.fingerprint,
...                    max_bytes=512 << 30)
>>> store.put_many([PutItem(RecordKey.block(h), parent, token_digest(ids), block_bytes)])
>>> store.get_many([RecordKey.block(h)], [pinned_uint8_tensor])

Backends: :class:`LmdbStore` (embedded default) and :class:`ZarrStore` (a Zarr v3 group
on a directory or an S3-compatible object store, ``zarr+s3://bucket/prefix?endpoint=...``).
Both pass the same conformance suite. A list of URLs opens a :class:`StoreChain`: the
first level local and synchronous, the others (e.g. a bucket shared by a fleet) behind it,
read on a local miss and written in the background::

    open_store(["lmdb:///var/cache/kv", "zarr+s3://kv-cache/v4?endpoint=https://s3.example"],
               layout_fingerprint=layout.fingerprint, timeout_s=2.0,
               level_options=[{"max_bytes": 512 << 30}, {}])

Any level can seal its records for one tenant (AES-256-GCM, :class:`EncryptedStore`): the
``encryption`` option, e.g. only on the shared level::

    open_store(["lmdb:///var/cache/kv", "zarr+s3://kv-cache/v4?endpoint=https://s3.example"],
               layout_fingerprint=layout.fingerprint,
               level_options=[{}, {"encryption": {"key_files": ["/etc/tiered-kv/key"], "tenant": "acme"}}])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# (Nothing here may be named like a sub-package: importing tiered_kv.storage.os, .format,
# .zarr... sets the package attribute of that name, over a module-level global.)
from . import _moved, urls
from .api import BlockStore, PutItem
from .errors import (
    CorruptRecordError,
    EncryptedLevelError,
    IndexDamagedError,
    LayoutMismatchError,
    RecordCheck,
    StoreError,
    StoreFullError,
    StoreLockedError,
)
from .format.record import (
    FORMAT_VERSION,
    RecordKey,
    RecordKind,
    RecordMeta,
    decode_record,
    encode_record,
    encode_record_into,
    record_size,
)
from .format.rows import RowScatter
from .format.writer import StoreWriter, WriterKind, tenant_hash
from .urls import StoreSpec, open_chain, open_store

if TYPE_CHECKING:
    from .chain.store import DEFAULT_TIMEOUT_S, DeferredLevel, StoreChain
    from .encrypted.crypto import EncryptionConfig, KeyFileError, Keyring
    from .encrypted.store import EncryptedStore
    from .lmdb.store import LmdbStore
    from .zarr.store import ZarrStore

    SCHEMES: dict[str, type[BlockStore]]
    OBJECT_STORE_SCHEMES: dict[str, type[BlockStore]]

__all__ = [
    "BlockStore",
    "CorruptRecordError",
    "DeferredLevel",
    "EncryptedLevelError",
    "EncryptedStore",
    "EncryptionConfig",
    "FORMAT_VERSION",
    "IndexDamagedError",
    "KeyFileError",
    "LayoutMismatchError",
    "LmdbStore",
    "OBJECT_STORE_SCHEMES",
    "PutItem",
    "RecordCheck",
    "RecordKey",
    "RecordKind",
    "RecordMeta",
    "RowScatter",
    "SCHEMES",
    "StoreChain",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
    "StoreWriter",
    "WriterKind",
    "ZarrStore",
    "decode_record",
    "encode_record",
    "encode_record_into",
    "open_chain",
    "open_store",
    "record_size",
    "tenant_hash",
]

#: The backends, wrappers and encryption are imported when first used (PEP 562): a
#: command that opens an LMDB store loads neither the Zarr backend nor the chain, and
#: ``tiered_kv.storage.record`` can be imported without them. name -> its module.
_LAZY = {"DEFAULT_TIMEOUT_S": "chain", "DeferredLevel": "chain", "StoreChain": "chain",
         "EncryptionConfig": "encrypted.crypto", "KeyFileError": "encrypted.crypto", "Keyring": "encrypted.crypto",
         "EncryptedStore": "encrypted", "LmdbStore": "lmdb", "ZarrStore": "zarr"}


_moved.install()


def __getattr__(name: str) -> Any:
    if name == "SCHEMES":
        #: Local-path URL schemes (``scheme:///abs/path``) :func:`open_store` accepts, and the
        #: backend each selects.
        value: Any = {k: urls.backend(v) for k, v in urls.LOCAL_BACKENDS.items()}
    elif name == "OBJECT_STORE_SCHEMES":
        #: Object-store URL schemes (``scheme://bucket/prefix?...``) :func:`open_store` accepts.
        value = {k: urls.backend(v) for k, v in urls.OBJECT_STORE_BACKENDS.items()}
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
