"""Layout spec: exact byte figures of the public configs, validation, fingerprints."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tiered_kv.layout import EntryFormat, KVLayout, LayerKind
from tiered_kv.presets import deepseek_v4_flash, deepseek_v4_pro, get_preset, tiny

M = 1 << 20


def test_flash_classical_bytes_at_1m() -> None:
    L = deepseek_v4_flash()
    assert L.num_layers == 43 and L.num_csa_layers == 21 and L.num_hca_layers == 20
    assert L.layer_kinds[:2] == (LayerKind.SWA_ONLY, LayerKind.SWA_ONLY)
    assert L.csa_layers == tuple(range(2, 43, 2)) and L.hca_layers == tuple(range(3, 42, 2))
    assert L.classical_bytes(M) == 21 * 262144 * 584 + 20 * 8192 * 584 + 21 * 262144 * 132 == 4037279744
    parts = L.classical_bytes_by_part(M)
    assert parts == {"csa_kv": 21 * 262144 * 584, "indexer": 21 * 262144 * 132, "hca_kv": 20 * 8192 * 584}
    assert L.block_bytes == 492832


def test_pro_bf16_classical_bytes_at_1m() -> None:
    L = deepseek_v4_pro(entry_format="bf16", indexer_bytes=256)
    assert L.num_layers == 61 and L.num_csa_layers == 30 and L.num_hca_layers == 31
    assert L.layer_kinds[:2] == (LayerKind.HCA, LayerKind.HCA)
    assert L.entry_bytes == 1024 and L.top_k == 1024
    assert L.classical_bytes(M) == 30 * 262144 * 1024 + 31 * 8192 * 1024 + 30 * 262144 * 256 == 10326376448


def test_state_and_snapshot_bytes_flash() -> None:
    L = deepseek_v4_flash()
    swa = 43 * 128 * 584
    tails = 21 * (64 << 10) + 20 * (512 << 10) + 21 * (16 << 10)  # docs/architecture.md §1 table
    assert L.state_bytes == swa + tails
    assert L.snapshot_bytes == swa + 21 * 4 * 2 * 4 * (512 + 128)
    # "about 7 Classical blocks"
    assert 6 < L.snapshot_bytes / L.block_bytes < 8


def test_partial_block_rounds_up_and_block_tokens_multiple() -> None:
    L = tiny()
    assert L.classical_bytes(0) == 0
    assert L.classical_bytes(1) == L.block_bytes
    assert L.classical_bytes(129) == 2 * L.block_bytes
    L256 = tiny(block_tokens=256)
    assert L256.csa_entries_per_block == 64 and L256.hca_entries_per_block == 2
    assert L256.block_bytes == 2 * L.block_bytes


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_tokens=100), "multiple of lcm"),
    (dict(top_k=0), "top_k"),
    (dict(window=-1), "window"),
    (dict(layer_kinds=()), "layer_kinds"),
    (dict(layer_kinds=("csa",)), "layer_kinds\\[0\\]"),
    (dict(entry_format=EntryFormat.FP8_DS_MLA), "head_dim 512"),
    (dict(head_dim=True), "head_dim"),
])
def test_invalid_layouts_name_what_was_expected(kwargs: dict, match: str) -> None:
    base = dict(name="t", layer_kinds=(LayerKind.CSA,), entry_format=EntryFormat.FP32, head_dim=16)
    with pytest.raises(ValueError, match=match):
        KVLayout(**{**base, **kwargs})


def test_layout_is_frozen_and_keyword_only() -> None:
    L = tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.top_k = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        KVLayout("t", (LayerKind.CSA,), EntryFormat.FP32)  # type: ignore[misc]


def test_fingerprint_changes_with_every_field() -> None:
    L = tiny()
    seen = {L.fingerprint}
    changes = dict(name="x", layer_kinds=(LayerKind.CSA,), entry_format=EntryFormat.BF16, head_dim=32,
                   indexer_dim=16, indexer_bytes=16, window=64, csa_ratio=8, hca_ratio=64,
                   block_tokens=256, top_k=9)
    assert set(changes) == {f.name for f in dataclasses.fields(KVLayout)}
    for k, v in changes.items():
        fp = dataclasses.replace(L, **{k: v}).fingerprint
        assert fp not in seen, k
        seen.add(fp)


def test_fingerprint_is_stable_across_processes() -> None:
    code = "from tiered_kv.presets import deepseek_v4_flash as f; print(f().fingerprint)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == deepseek_v4_flash().fingerprint


def test_presets_overrides_and_lookup() -> None:
    assert get_preset("deepseek-v4-flash", entry_format="bf16").entry_bytes == 1024
    assert get_preset("deepseek-v4-pro", indexer_bytes=68).indexer_bytes == 68
    assert EntryFormat.parse("fp8") is EntryFormat.FP8_DS_MLA
    with pytest.raises(ValueError, match="expected one of"):
        get_preset("llama")
    with pytest.raises(ValueError, match="entry_format"):
        EntryFormat.parse("int4")
    t = tiny()
    assert t.entry_format is EntryFormat.FP32 and t.top_k * t.csa_ratio < 4 * t.block_tokens


def test_part_index() -> None:
    L = tiny()
    assert [L.part_index(i) for i in range(L.num_layers)] == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        L.part_index(5)
