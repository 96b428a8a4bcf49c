"""tiered_kv: tiered KV-cache memory for DeepSeek-V4-style attention.

The GPU holds the hot Classical + State layout, pinned CPU memory holds inactive CSA
entries (HiSparse), and a disk tier persists immutable 128-token blocks keyed by a
prefix hash. Start with :class:`TieredKVCache` and :mod:`tiered_kv.presets`.

The names below are imported when first used (PEP 562): ``import tiered_kv`` (and so
``tiered_kv.storage`` and the ``tiered-kv`` commands that compute no KV) does not import
torch; ``tiered_kv.TieredKVCache`` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import presets
    from .cache import Request, TieredKVCache
    from .errors import CacheFullError, CacheShutdownError
    from .layout import EntryFormat, KVLayout, LayerKind

__all__ = ["CacheFullError", "CacheShutdownError", "EntryFormat", "KVLayout", "LayerKind", "Request", "TieredKVCache",
           "presets"]
__version__ = "0.1.0"

#: public name -> the module that defines it (None: the name is that submodule)
_LAZY: dict[str, str | None] = {
    "CacheFullError": "errors",
    "CacheShutdownError": "errors",
    "EntryFormat": "layout",
    "KVLayout": "layout",
    "LayerKind": "layout",
    "Request": "cache",
    "TieredKVCache": "cache",
    "presets": None,
}


def __getattr__(name: str) -> Any:
    """A public name, imported on first use; any other submodule (``tiered_kv.disk``...) too,
    as it was when this package imported the cache eagerly."""
    if name.startswith("__"):  # (probes such as __wrapped__ are not submodules)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _LAZY.get(name, name)
    try:
        module = importlib.import_module(f"{__name__}.{name if where is None else where}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name if where is None else where}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = module if where is None or where == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
