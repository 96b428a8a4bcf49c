"""tiered_kv: tiered KV-cache memory for DeepSeek-V4-style attention.

The GPU holds the hot Classical + State layout, pinned CPU memory holds inactive CSA
entries (HiSparse), and a disk tier persists immutable 128-token blocks keyed by a
prefix hash. Start with :class:`TieredKVCache` and :mod:`tiered_kv.presets`.
"""

from __future__ import annotations

from . import presets
from .cache import Request, TieredKVCache
from .errors import CacheFullError, CacheShutdownError
from .layout import EntryFormat, KVLayout, LayerKind

__all__ = ["CacheFullError", "CacheShutdownError", "EntryFormat", "KVLayout", "LayerKind", "Request", "TieredKVCache",
           "presets"]
__version__ = "0.1.0"
