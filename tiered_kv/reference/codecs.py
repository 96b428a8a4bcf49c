"""How the reference model stores an entry: float vectors <-> the cache's bytes.

Every codec maps ``[..., dim]`` float64 to ``[..., nbytes]`` uint8 and back; ``round(x)``
is what a store-then-load gives, and both the cached and the naive path apply it, so the
oracle compares like with like.

* fp32 / bf16: the values in that dtype.
* ``fp8_ds_mla`` (584 bytes for a 512-dim entry), DeepSeek-V4's cache entry::

      | 448 x fp8 e4m3 (no-RoPE dims) | 64 x bf16 (RoPE dims) | 7 x UE8M0 scale | pad |
        tile t = dims [64t, 64t+64) is stored as x / 2**e_t, e_t = ceil(log2(amax_t / 448)),
        and its scale byte is e_t + 127

* fp8 indexer keys (``dim + 4`` bytes, 132 for a 128-dim key): ``dim`` x fp8 e4m3 and one
  fp32 scale ``amax / 448``.
"""

from __future__ import annotations

import torch

from ..layout import EntryFormat

__all__ = ["Codec", "Fp8DsMlaCodec", "Fp8KeyCodec", "PlainCodec", "entry_codec", "key_codec"]

COMPUTE_DTYPE = torch.float64
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class Codec:
    """Base: ``[..., dim]`` float <-> ``[..., nbytes]`` uint8."""

    dim: int
    nbytes: int

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """What a store-then-load of ``x`` gives back."""
        return self.decode(self.encode(x))


class PlainCodec(Codec):
    """fp32 or bf16 values, ``dim * itemsize`` bytes."""

    def __init__(self, dtype: torch.dtype, dim: int) -> None:
        self.dtype = dtype
        self.dim = dim
        self.nbytes = dim * torch.empty((), dtype=dtype).element_size()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.contiguous().view(self.dtype).to(COMPUTE_DTYPE)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).to(COMPUTE_DTYPE)


class Fp8DsMlaCodec(Codec):
    """DeepSeek's ``fp8_ds_mla`` entry: 448 fp8 + 64 bf16 RoPE + 7 UE8M0 scales + 1 pad."""

    NOPE, ROPE, TILE = 448, 64, 64

    def __init__(self) -> None:
        self.dim = self.NOPE + self.ROPE
        self.nbytes = self.NOPE + 2 * self.ROPE + self.NOPE // self.TILE + 1

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        tiles = x[..., :self.NOPE].reshape(*lead, self.NOPE // self.TILE, self.TILE)
        amax = tiles.abs().amax(-1).clamp_min(1e-30)
        exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127)
        q = (tiles / torch.exp2(exp)[..., None]).to(FP8).reshape(*lead, self.NOPE)
        rope = x[..., self.NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
        scale = (exp + 127).to(torch.uint8)
        pad = torch.zeros(*lead, 1, dtype=torch.uint8, device=x.device)
        return torch.cat([q.view(torch.uint8), rope, scale, pad], dim=-1)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.contiguous()
        lead = raw.shape[:-1]
        q = raw[..., :self.NOPE].contiguous().view(FP8).to(COMPUTE_DTYPE)
        rope_end = self.NOPE + 2 * self.ROPE
        rope = raw[..., self.NOPE:rope_end].contiguous().view(torch.bfloat16).to(COMPUTE_DTYPE)
        exp = raw[..., rope_end:rope_end + self.NOPE // self.TILE].to(COMPUTE_DTYPE) - 127
        nope = (q.reshape(*lead, self.NOPE // self.TILE, self.TILE) * torch.exp2(exp)[..., None])
        return torch.cat([nope.reshape(*lead, self.NOPE), rope], dim=-1)


class Fp8KeyCodec(Codec):
    """An fp8 lightning-indexer key: ``dim`` x fp8 e4m3 + one fp32 scale."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.nbytes = dim + 4

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        scale = (x.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-30).to(torch.float32)
        q = (x / scale.to(COMPUTE_DTYPE)).to(FP8)
        return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.contiguous()
        q = raw[..., :self.dim].contiguous().view(FP8).to(COMPUTE_DTYPE)
        scale = raw[..., self.dim:].contiguous().view(torch.float32).to(COMPUTE_DTYPE)
        return q * scale


_PLAIN = {EntryFormat.FP32: torch.float32, EntryFormat.BF16: torch.bfloat16}


def entry_codec(fmt: EntryFormat, dim: int, nbytes: int) -> Codec:
    """The codec of a CSA / HCA / SWA entry; ValueError if ``nbytes`` does not fit."""
    codec = Fp8DsMlaCodec() if fmt is EntryFormat.FP8_DS_MLA else PlainCodec(_PLAIN[fmt], dim)
    if (codec.dim, codec.nbytes) != (dim, nbytes):
        raise ValueError(f"entry: expected {codec.nbytes} bytes for a {codec.dim}-dim {fmt.value} entry, "
                         f"got {nbytes} bytes for {dim} dims")
    return codec


def key_codec(fmt: EntryFormat, dim: int, nbytes: int) -> Codec:
    """The codec of an indexer key: fp32 / bf16 keys with those layouts, else fp8 + scale."""
    for codec in ([PlainCodec(_PLAIN[fmt], dim)] if fmt in _PLAIN else []) + [Fp8KeyCodec(dim)]:
        if codec.nbytes == nbytes:
            return codec
    plain = f"{dim * torch.empty((), dtype=_PLAIN[fmt]).element_size()} ({fmt.value}) or " if fmt in _PLAIN else ""
    raise ValueError(f"indexer key: expected {plain}{dim + 4} (fp8 + fp32 scale) bytes for a {dim}-dim key, "
                     f"got {nbytes}")
