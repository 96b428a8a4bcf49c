"""Adapters that plug tiered_kv's stores into serving engines.

Each adapter lives in its own module and imports its engine only there, so importing
:mod:`tiered_kv` (or this package) never pulls an engine in:

- :mod:`tiered_kv.integrations.vllm`: a vLLM 0.33 secondary offloading tier
  (``vllm.v1.kv_offload.tiering``), :class:`~tiered_kv.integrations.vllm.TieredKVTier`.
  See ``docs/integrations/vllm.md``.
- :mod:`tiered_kv.integrations.sglang`: an SGLang 0.5.23 HiCache L3 storage backend
  (``sglang.srt.mem_cache.hicache_storage``),
  :class:`~tiered_kv.integrations.sglang.TieredKVHiCacheStorage`.
  See ``docs/integrations/sglang.md``.

Each engine pins its own torch, so each adapter is tested in a virtual environment of its
own against the engine's real classes (``make test-integrations``).
"""

from __future__ import annotations

__all__: list[str] = []
