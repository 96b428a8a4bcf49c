"""Layouts of the public DeepSeek-V4 configs, and a tiny one for tests and demos.

| preset              | layers | kinds                                                    | top-k |
|---------------------|--------|----------------------------------------------------------|-------|
| deepseek_v4_flash   | 43     | 0-1 SWA-only; CSA on even 2..42 (21); HCA on odd 3..41   | 512   |
| deepseek_v4_pro     | 61     | 0-1 HCA; CSA on even 2..60 (30); HCA on odd 3..59 (31)   | 1024  |
"""

from __future__ import annotations

from collections.abc import Callable

from .layout import EntryFormat, KVLayout, LayerKind

__all__ = ["PRESETS", "deepseek_v4_flash", "deepseek_v4_pro", "get_preset", "tiny"]


def _alternating(num_layers: int, first: LayerKind) -> tuple[LayerKind, ...]:
    """Layers 0-1 of kind ``first``; from 2 on, CSA on even and HCA on odd layers."""
    return tuple(first if i < 2 else (LayerKind.CSA if i % 2 == 0 else LayerKind.HCA)
                 for i in range(num_layers))


def deepseek_v4_flash(*, entry_format: EntryFormat | str = EntryFormat.FP8_DS_MLA,
                      indexer_bytes: int = 132, block_tokens: int = 128) -> KVLayout:
    """DeepSeek-V4-Flash: 43 layers, head dim 512, fp8 indexer keys (132 B), top-512."""
    return KVLayout(name="deepseek-v4-flash", layer_kinds=_alternating(43, LayerKind.SWA_ONLY),
                    entry_format=EntryFormat.parse(entry_format), head_dim=512, indexer_dim=128,
                    indexer_bytes=indexer_bytes, block_tokens=block_tokens, top_k=512)


def deepseek_v4_pro(*, entry_format: EntryFormat | str = EntryFormat.FP8_DS_MLA,
                    indexer_bytes: int = 132, block_tokens: int = 128) -> KVLayout:
    """DeepSeek-V4-Pro: 61 layers, head dim 512, fp8 indexer keys (132 B), top-1024."""
    return KVLayout(name="deepseek-v4-pro", layer_kinds=_alternating(61, LayerKind.HCA),
                    entry_format=EntryFormat.parse(entry_format), head_dim=512, indexer_dim=128,
                    indexer_bytes=indexer_bytes, block_tokens=block_tokens, top_k=1024)


def tiny(*, entry_format: EntryFormat | str = EntryFormat.FP32, indexer_bytes: int | None = None,
         block_tokens: int = 128, window: int = 128, top_k: int = 8) -> KVLayout:
    """Five small layers (SWA-only, CSA, HCA, CSA, HCA), head dim 16, fp32, top-8.

    Top-8 of 4:1 entries is exceeded after 32 tokens, so any multi-block test sequence
    exercises the sparse selection.
    """
    fmt = EntryFormat.parse(entry_format)
    indexer_dim = 8
    if indexer_bytes is None:
        indexer_bytes = indexer_dim * (2 if fmt is EntryFormat.BF16 else 4)
    kinds = (LayerKind.SWA_ONLY, LayerKind.CSA, LayerKind.HCA, LayerKind.CSA, LayerKind.HCA)
    return KVLayout(name="tiny", layer_kinds=kinds, entry_format=fmt, head_dim=16,
                    indexer_dim=indexer_dim, indexer_bytes=indexer_bytes, window=window,
                    block_tokens=block_tokens, top_k=top_k)


#: CLI model names -> preset constructors.
PRESETS: dict[str, Callable[..., KVLayout]] = {
    "deepseek-v4-flash": deepseek_v4_flash,
    "deepseek-v4-pro": deepseek_v4_pro,
    "tiny": tiny,
}


def get_preset(name: str, **overrides: object) -> KVLayout:
    """Build the preset called ``name`` (a key of :data:`PRESETS`) with keyword overrides."""
    try:
        make = PRESETS[name]
    except KeyError:
        raise ValueError(f"model: expected one of {', '.join(PRESETS)}, got {name!r}") from None
    return make(**{k: v for k, v in overrides.items() if v is not None})
