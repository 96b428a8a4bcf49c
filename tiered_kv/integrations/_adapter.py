"""What the engine adapters share (:mod:`.vllm`, :mod:`.sglang`): how a deployment's keys
are namespaced, how its store options are completed, and how a store URL is shown.

No engine is imported here; each adapter imports its own engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from ..storage import EncryptionConfig, RecordKey
from ..storage.encrypted.crypto import default_tenant

__all__ = ["block_key", "display_url", "namespace_root", "open_options"]


def namespace_root(tag: bytes, *parts: str) -> bytes:
    """The 32-byte root every key of one deployment derives from:
    ``sha256(tag \\0 part_0 \\0 part_1 ...)`` (e.g. the model id, the tenant, and what
    else makes the engine's bytes differ: a layout fingerprint, a rank's shard)."""
    return hashlib.sha256(b"\0".join([tag, *(p.encode() for p in parts)])).digest()


def block_key(root: bytes, key: bytes) -> RecordKey:
    """The record key of the engine's ``key`` under ``root``: ``RecordKey.block(sha256(root || key))``."""
    return RecordKey.block(hashlib.sha256(root + key).digest())


def open_options(options: Mapping[str, Any] | None, *, tenant: str, encryption: Any = None,
                  name: str = "encryption") -> dict[str, Any]:
    """:func:`~tiered_kv.storage.open_store` options of an adapter: ``options`` with
    ``encryption`` (an :class:`~tiered_kv.storage.EncryptionConfig` or its dict, checked
    under ``name``) set when given, and every encryption config in them (top level and
    each of ``level_options``) sealing for ``tenant`` unless it names its own."""
    out = dict(options or {})
    if encryption is not None:
        out["encryption"] = EncryptionConfig.parse(encryption, name=name)
    return default_tenant(out, tenant) or {}


def display_url(store: str | Sequence[str]) -> str:
    """Store URL(s) as logs and metrics show them: comma-joined, without query strings
    (which may carry credentials)."""
    urls = [store] if isinstance(store, str) else list(store)
    return ",".join(str(u).split("?", 1)[0] for u in urls)
