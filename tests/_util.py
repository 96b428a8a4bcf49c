"""Small helpers shared by tests (importable as ``_util``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from tiered_kv.layout import EntryFormat, KVLayout, LayerKind

#: DeepSeek's fp8_ds_mla entries (584 B) and fp8 indexer keys (132 B), V4-Flash dims, 4 layers
FLASH_MINI = KVLayout(name="flash-mini", layer_kinds=(LayerKind.SWA_ONLY, LayerKind.CSA, LayerKind.HCA, LayerKind.CSA),
                      entry_format=EntryFormat.FP8_DS_MLA, head_dim=512, indexer_dim=128, indexer_bytes=132, top_k=8)


def random_tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
