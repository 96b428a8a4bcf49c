"""Layouts and writers in words: the options that select a layout fingerprint, the preset
a store's layout is, the model a cache salted its keys with, and a store's writer record."""

from __future__ import annotations

import functools
import itertools
from typing import TYPE_CHECKING, Any

from ..presets import PRESETS, get_preset
from ._args import ENTRY_FORMATS
from .main import UsageError

if TYPE_CHECKING:
    from ..layout import KVLayout

__all__ = ["cache_model_id", "describe_writer", "hashing_layout", "layout_hint", "layout_options", "model_of",
           "preset_layout"]


def layout_options(layout: KVLayout) -> str:
    """The command-line options that select ``layout``, e.g. ``--model tiny --entry-format bf16``."""
    return _options_for(layout.fingerprint) or f"--model {layout.name}"


def _options_for(fingerprint: str) -> str | None:
    """Options of a preset layout with this fingerprint (None if no common variant has it)."""
    found = _preset_variant(fingerprint)
    return found[1] if found is not None else None


def preset_layout(fingerprint: str) -> KVLayout | None:
    """The preset layout (a common variant) with this fingerprint, None if there is none
    (e.g. a store of the vLLM or SGLang adapter)."""
    found = _preset_variant(fingerprint)
    return found[0] if found is not None else None


@functools.lru_cache(maxsize=64)
def _preset_variant(fingerprint: str) -> tuple[KVLayout, str] | None:
    variants = itertools.product(sorted(PRESETS), (None, *ENTRY_FORMATS), (None, 16, 32, 68, 132, 256),
                                 (None, 256))
    for name, fmt, ib, bt in variants:
        try:
            layout = get_preset(name, entry_format=fmt, indexer_bytes=ib, block_tokens=bt)
        except ValueError:  # not a valid variant of this preset (e.g. tiny with fp8)
            continue
        if layout.fingerprint == fingerprint:
            opts = [f"--model {name}"]
            opts += [f"--entry-format {fmt}"] if fmt else []
            opts += [f"--indexer-bytes {ib}"] if ib else []
            opts += [f"--block-tokens {bt}"] if bt else []
            return layout, " ".join(opts)
    return None


def hashing_layout(layout: KVLayout | None, fingerprint: str) -> KVLayout:
    """The layout prompts are hashed with (``--prompts`` of ``ls`` / ``prefetch``): the
    options', else the preset layout the store holds; UsageError for an engine's store."""
    if layout is not None:
        return layout
    found = preset_layout(fingerprint)
    if found is None:
        raise UsageError(f"--prompts: the store holds layout {fingerprint}, not a tiered_kv preset (e.g. a "
                         f"vLLM or SGLang adapter's store), so prompts cannot be hashed here; give the layout "
                         f"with --model and the overrides (prefetch: or select records with --recent N)")
    return found


def cache_model_id(writer: dict[str, Any] | None) -> str | None:
    """The model id a tiered_kv cache salted its keys with, as its store recorded it (None:
    not recorded, or another writer: the preset's name is used)."""
    if writer and writer.get("writer") == "tiered_kv-cache" and isinstance(writer.get("model"), str):
        return writer["model"]
    return None


def layout_hint(fingerprint: str, writer: dict[str, Any] | None) -> str:
    """What selects ``fingerprint``: a preset's options, else where such layouts come from."""
    options = _options_for(fingerprint)
    if options is not None:
        return options
    if writer and writer.get("writer") in ("vllm-adapter", "sglang-adapter"):
        return "an engine's layout (see writer)"
    return "not a tiered_kv preset"


def describe_writer(info: dict[str, Any] | None) -> str:
    """A store's writer record (:mod:`tiered_kv.storage.format.writer`) in a few words."""
    if not info:
        return "not recorded (created before writers were recorded, or by a maintenance tool)"
    names = {"tiered_kv-cache": "tiered_kv cache", "vllm-adapter": "vLLM adapter",
             "sglang-adapter": "SGLang adapter"}
    kind = names.get(str(info.get("writer")), str(info.get("writer")))
    tenant = info.get("tenant_sha256")
    parts = [kind, f"model {info.get('model')}", f"tenant sha256 {tenant}" if tenant else "no tenant recorded"]
    if info.get("recorded_at"):
        parts.append(f"since {info['recorded_at']}")
    return ", ".join(parts)


def model_of(layout: KVLayout | None, fingerprint: str) -> str | None:
    """The preset name of the layout the command used: the options', else the store's
    (None for a layout no preset has, e.g. an engine's store)."""
    if layout is not None:
        return layout.name
    found = preset_layout(fingerprint)
    return found.name if found is not None else None
