"""Who writes a store: a short description kept beside its layout fingerprint.

A store records, when it is created (an LMDB store also on the first writable open of a
store that has none), the description of the writer that created it::

    {"writer": "vllm-adapter", "model": "meta-llama/Llama-3.1-8B",
     "tenant_sha256": "3f1c0a9e2b7d4c55", "recorded_at": "2026-12-03T10:00:00Z"}

so an operator can tell what a store holds without knowing its layout
(``tiered-kv stats`` shows it). The tenant is never stored: only the first 16 hex digits
of a salted sha256 of it (None when there is no tenant), which tells two tenants apart
without revealing either. The model is the model id the writer salts its keys with.

LMDB keeps it in its ``meta`` sub-database under ``writer`` (JSON); Zarr in ``zarr.json``'s
``attributes["tiered_kv"]["writer"]``.
"""

from __future__ import annotations

import enum
import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StoreWriter", "WriterKind", "tenant_hash"]

#: Longest model id kept (a path can be long; the description stays short).
_MAX_MODEL = 200


class WriterKind(enum.Enum):
    """What writes the store."""

    CACHE = "tiered_kv-cache"        # TieredKVCache (and the CLI's warm-start / serve-reference)
    VLLM = "vllm-adapter"            # tiered_kv.integrations.vllm.TieredKVTier
    SGLANG = "sglang-adapter"        # tiered_kv.integrations.sglang.TieredKVHiCacheStorage


def tenant_hash(tenant: str | bytes) -> str | None:
    """16 hex digits of ``sha256("tiered_kv.tenant" \\0 tenant)``; None for no tenant."""
    raw = tenant.encode() if isinstance(tenant, str) else bytes(tenant)
    if not raw:
        return None
    return hashlib.sha256(b"tiered_kv.tenant\0" + raw).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreWriter:
    """The description a store records of the writer that created it (see the module
    docstring). Build it with :meth:`of`, which hashes the tenant."""

    kind: WriterKind
    model: str
    tenant_sha256: str | None

    @classmethod
    def of(cls, kind: WriterKind, *, model: str, tenant: str | bytes = b"") -> StoreWriter:
        if not isinstance(kind, WriterKind):
            raise TypeError(f"kind: expected a WriterKind, got {type(kind).__name__}")
        if not isinstance(model, str):
            raise TypeError(f"model: expected a str, got {type(model).__name__}")
        return cls(kind=kind, model=model[:_MAX_MODEL], tenant_sha256=tenant_hash(tenant))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object stored, stamped with the time it is recorded."""
        return {"writer": self.kind.value, "model": self.model, "tenant_sha256": self.tenant_sha256,
                "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, info: Mapping[str, Any] | None) -> StoreWriter | None:
        """The writer a store recorded (None if none, or a kind this version does not know)."""
        if not isinstance(info, Mapping):
            return None
        try:
            kind = WriterKind(info.get("writer"))
        except ValueError:
            return None
        model, tenant = info.get("model"), info.get("tenant_sha256")
        if not isinstance(model, str) or not (tenant is None or isinstance(tenant, str)):
            return None
        return cls(kind=kind, model=model, tenant_sha256=tenant)


def parse_recorded(raw: bytes | str | None) -> dict[str, Any] | None:
    """A stored writer record as a dict (None when absent or not a JSON object)."""
    if raw is None:
        return None
    try:
        info = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) else None
