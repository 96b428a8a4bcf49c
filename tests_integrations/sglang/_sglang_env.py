"""Builds real SGLang 0.5.23 objects on CPU for the adapter tests (and their worker processes).

The host pools are SGLang's own classes (``MLATokenToKVPoolHost``, ``DeepSeekV4PagedHostPool``,
``LogicalHostPool``) over CPU device buffers; the backend is created by SGLang's
``StorageBackendFactory`` from a ``dynamic`` extra config, exactly as ``--hicache-storage-backend
dynamic`` does, then given its host pools the way the cache controllers do.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torchvision_placeholder  # noqa: E402

_torchvision_placeholder.install()

import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import (  # noqa: E402
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, LogicalHostPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: E402
from sglang.srt.mem_cache.utils import get_hash_str  # noqa: E402

PAGE = 16          # tokens per HiCache page
LAYERS = 3
KV_LORA, ROPE = 32, 8  # MLA row: 40 bf16 = 80 bytes
DEVICE_TOKENS = 128
HOST_BUDGET = 1 << 30  # books pools against this instead of the machine's free memory

BACKEND = {"backend_name": "tiered_kv", "module_path": "tiered_kv.integrations.sglang",
           "class_name": "TieredKVHiCacheStorage"}


def storage_config(store: Any, *, model: str = "deepseek-ai/DeepSeek-V4-Flash", tenant: str = "",
                   interface_v1: bool = True, is_mla: bool = True, tp_rank: int = 0, tp_size: int = 1,
                   metrics: bool = False, **extra: Any) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla, enable_storage_metrics=metrics, is_page_first_layout=True, model_name=model,
        extra_config={**BACKEND, "store": store, "tenant": tenant, "interface_v1": int(interface_v1), **extra})


def mla_host_pool(layout: str = "page_first", device_tokens: int = DEVICE_TOKENS) -> MLATokenToKVPoolHost:
    """SGLang's MLA host pool (``[size, layers, 1, 40] bf16`` for page_first) over CPU buffers."""
    bufs = tuple(torch.zeros(device_tokens, 1, KV_LORA + ROPE, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, kv_cache_dim=KV_LORA + ROPE,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    with host_memory_budget_scope(HOST_BUDGET):
        return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=device_tokens, start_layer=0, end_layer=LAYERS,
                                    target_layer_num=LAYERS)


def mha_host_pool(layout: str = "page_first", heads: int = 2, head_dim: int = 8) -> MHATokenToKVPoolHost:
    """SGLang's MHA host pool (separate K and V buffers: two or more buffers per page)."""
    def layer() -> torch.Tensor:
        return torch.zeros(DEVICE_TOKENS, heads, head_dim, dtype=torch.bfloat16)

    k, v = tuple(layer() for _ in range(LAYERS)), tuple(layer() for _ in range(LAYERS))
    bufs = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k], dtype=torch.uint64),
                     v_data_ptrs=torch.tensor([t.data_ptr() for t in v], dtype=torch.uint64),
                     layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=bufs, page_size=PAGE, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    with host_memory_budget_scope(HOST_BUDGET):
        return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=DEVICE_TOKENS, start_layer=0, end_layer=LAYERS)


def v4_paged_pool(name: str, item_bytes: int, layout: str = "page_first", layers: int = 2,
                  pages: int = 24) -> DeepSeekV4PagedHostPool:
    """SGLang's DeepSeek V4 side pool (one ``[layers, item_bytes]`` uint8 row per page)."""
    device_buffers = [torch.zeros(pages, item_bytes, dtype=torch.uint8) for _ in range(layers)]
    with host_memory_budget_scope(HOST_BUDGET):
        return DeepSeekV4PagedHostPool(name, device_buffers, item_bytes=item_bytes, num_host_pages=pages,
                                       slot_page_size=PAGE, layout=layout, pin_memory=False)


def v4_pools() -> tuple[LogicalHostPool, dict[str, DeepSeekV4PagedHostPool]]:
    """DeepSeek V4's arrangement: a logical KV anchor plus byte-holding side pools."""
    anchor = LogicalHostPool(size=24 * PAGE, page_size=PAGE)
    return anchor, {PoolName.DEEPSEEK_V4_C4.value: v4_paged_pool(PoolName.DEEPSEEK_V4_C4.value, 584),
                    PoolName.DEEPSEEK_V4_C4_INDEXER.value: v4_paged_pool(PoolName.DEEPSEEK_V4_C4_INDEXER.value, 132),
                    PoolName.DEEPSEEK_V4_C4_STATE.value: v4_paged_pool(PoolName.DEEPSEEK_V4_C4_STATE.value, 256)}


def create_backend(config: HiCacheStorageConfig, host_pool: Any, side_pools: dict[str, Any] | None = None) -> Any:
    """The backend as SGLang attaches it: factory, then register the pools."""
    backend = StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    for name, pool in (side_pools or {}).items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


def page_keys(n_pages: int, seed: int = 0) -> list[str]:
    """SGLang's own chained page hashes of ``n_pages`` pages of token ids."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (n_pages * PAGE,), generator=g).tolist()
    return get_hash_str(tokens, None, page_size=PAGE)


def fill_pages(pool: Any, indices: torch.Tensor, seed: int) -> None:
    """Random bytes into every page at ``indices`` (``n * page_size`` slots), through the
    pool's own ``set_from_flat_data_page``."""
    g = torch.Generator().manual_seed(seed)
    page_size = pool.page_size
    for start in indices[::page_size].tolist():
        flat = pool.get_dummy_flat_data_page()
        raw = flat.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
        pool.set_from_flat_data_page(start, flat)


def page_bytes(pool: Any, indices: torch.Tensor) -> list[bytes]:
    """The bytes of each page at ``indices``, read with the pool's ``get_data_page``."""
    return [pool.get_data_page(start, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
            for start in indices[::pool.page_size].tolist()]
