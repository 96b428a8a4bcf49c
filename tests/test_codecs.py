"""The reference model's storage codecs, above all DeepSeek's fp8_ds_mla entry bytes."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.layout import EntryFormat
from tiered_kv.reference.codecs import Fp8DsMlaCodec, Fp8KeyCodec, PlainCodec, entry_codec, key_codec


def test_fp8_ds_mla_byte_layout() -> None:
    c = Fp8DsMlaCodec()
    assert (c.dim, c.nbytes) == (512, 584)
    x = torch.zeros(512, dtype=torch.float64)
    x[0], x[64], x[448], x[511] = 3.0, -0.001, 1.5, -2.25
    raw = c.encode(x)
    assert raw.shape == (584,) and raw.dtype == torch.uint8
    # tile 0: amax 3 -> e = ceil(log2(3 / 448)) = -7; tile 1: amax 0.001 -> e = -18
    assert raw[576].item() == -7 + 127 and raw[577].item() == -18 + 127
    assert raw[583].item() == 0  # pad
    rope = raw[448:576].view(torch.bfloat16)
    assert rope[0].item() == 1.5 and rope[63].item() == -2.25  # RoPE dims are exact bf16
    y = c.decode(raw)
    assert y[0].item() == 3.0 and y[448].item() == 1.5


def test_fp8_round_is_idempotent_and_bounded() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g, dtype=torch.float64) * torch.logspace(-3, 2, 64, dtype=torch.float64)[:, None]
    c = Fp8DsMlaCodec()
    y = c.round(x)
    assert torch.equal(c.round(y), y)
    tiles = (x[:, :448] - y[:, :448]).abs().view(64, 7, 64).amax(-1)
    amax = x[:, :448].abs().view(64, 7, 64).amax(-1)
    assert (tiles <= amax * 2.0 ** -3).all()  # e4m3: 3 mantissa bits, power-of-two scale
    k = Fp8KeyCodec(128)
    assert k.nbytes == 132 and torch.equal(k.round(k.round(x[:, :128])), k.round(x[:, :128]))


def test_codec_selection_and_errors() -> None:
    assert isinstance(entry_codec(EntryFormat.BF16, 16, 32), PlainCodec)
    assert isinstance(key_codec(EntryFormat.FP32, 8, 32), PlainCodec)
    assert isinstance(key_codec(EntryFormat.FP32, 8, 12), Fp8KeyCodec)
    assert isinstance(key_codec(EntryFormat.FP8_DS_MLA, 128, 132), Fp8KeyCodec)
    with pytest.raises(ValueError, match="expected 584 bytes"):
        entry_codec(EntryFormat.FP8_DS_MLA, 512, 600)
    with pytest.raises(ValueError, match="indexer key: expected 32 .fp32. or 12"):
        key_codec(EntryFormat.FP32, 8, 33)
