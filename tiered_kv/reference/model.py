"""A small DeepSeek-V4-style attention stack that reads and writes KV only through the cache.

It is the correctness oracle of every tier: :meth:`ReferenceModel.forward` runs through a
:class:`~tiered_kv.cache.TieredKVCache` and :meth:`ReferenceModel.naive_logits` recomputes
the same math from scratch; the two must agree (docs/architecture.md §8).

Per layer (pre-norm residual)::

    h = rmsnorm(x)
    SWA entry of every token          kv = norm(W_kv h)                       -> State ring
    CSA layer: compressor (r=4, overlap 8, coff 2)  -> CSA entries          -> Classical
               indexer compressor (same scheme)     -> indexer keys          -> Classical
               indexer: top-k CSA entries per query
    HCA layer: compressor (r'=128, coff 1)          -> HCA entries           -> Classical
    attention (MQA, K = V): SWA window + selected CSA | all complete HCA, one softmax
    x = x + W_o attn

Cached forward is processed in segments that never cross a block boundary, so the cache
sees the State at every resume point and can snapshot it.

Devices: weights and compute live on the model's ``device`` (float64 everywhere; on the CPU
the results are bit-identical whatever the cache's device). The cache may live on another
device: what the model writes is moved to ``cache.device`` and what it reads is moved back,
at the cache boundary only. Entry ids and token ids stay on the host.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from ..device import resolve_device
from ..layout import KVLayout, LayerKind
from . import ops
from .codecs import entry_codec, key_codec
from .ops import COMPUTE_DTYPE, attend, csa_pool, indexer_scores, pool, rmsnorm, round_fp32

if TYPE_CHECKING:
    from ..cache import Request, TieredKVCache

__all__ = ["ReferenceModel"]


@dataclass(frozen=True)
class _Compressor:
    """Weights of one compressor: ``kv = W_kv h``, ``s = W_s h`` of width ``coff * dim``."""

    w_kv: torch.Tensor  # [coff * dim, hidden]
    w_s: torch.Tensor  # [coff * dim, hidden]
    ape: torch.Tensor  # [ratio, coff * dim]  per-position score bias
    norm: torch.Tensor  # [dim]

    def rows(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32-rounded kv and score rows ``[n, coff * dim]`` of hidden states ``[n, hidden]``."""
        return round_fp32(h @ self.w_kv.T), round_fp32(h @ self.w_s.T)


@dataclass(frozen=True)
class _Layer:
    kind: LayerKind
    attn_norm: torch.Tensor  # [hidden]
    w_q: torch.Tensor  # [heads * dim, hidden]
    w_kv: torch.Tensor  # [dim, hidden]
    kv_norm: torch.Tensor  # [dim]
    w_o: torch.Tensor  # [hidden, heads * dim]
    comp: _Compressor | None  # CSA / HCA compressor
    idx_comp: _Compressor | None  # CSA: indexer-key compressor
    w_iq: torch.Tensor | None  # CSA: [index_heads * indexer_dim, hidden]
    w_iw: torch.Tensor | None  # CSA: [index_heads, hidden]


class ReferenceModel:
    """Random-weight V4-style attention stack over ``layout``.

    Entries are stored in the layout's format (fp32, bf16, or DeepSeek's fp8_ds_mla with
    fp8 indexer keys; see :mod:`.codecs`).

    Args:
        layout: the KV layout (fp32, bf16 or fp8_ds_mla entries).
        seed: weights are drawn from ``torch.Generator().manual_seed(seed)``.
        vocab_size: size of the token embedding and the output head.
        num_heads: query heads of the MQA attention.
        num_index_heads: heads of the lightning indexer.
        device: where weights and compute live (``"cpu"`` or ``"cuda[:i]"``); weights are
            drawn on the CPU and moved, so every device starts from the same values.
    """

    def __init__(self, layout: KVLayout, seed: int = 0, vocab_size: int = 256, *,
                 num_heads: int = 2, num_index_heads: int = 2, device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_index_heads = num_index_heads
        self.codec = entry_codec(layout.entry_format, layout.head_dim, layout.entry_bytes)
        self.key_codec = key_codec(layout.entry_format, layout.indexer_dim, layout.indexer_bytes)
        d, di, H = layout.head_dim, layout.indexer_dim, 2 * layout.head_dim
        self.hidden = H
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=COMPUTE_DTYPE) * scale

        def norm_w(n: int) -> torch.Tensor:
            return 1.0 + 0.1 * rand(n)

        def compressor(dim: int, coff: int, ratio: int) -> _Compressor:
            return _Compressor(rand(coff * dim, H, scale=H ** -0.5), rand(coff * dim, H, scale=2 * H ** -0.5),
                               rand(ratio, coff * dim, scale=0.5), norm_w(dim))

        self.embed = rand(vocab_size, H)
        self.layers: list[_Layer] = []
        for kind in layout.layer_kinds:
            comp = idx_comp = w_iq = w_iw = None
            if kind is LayerKind.CSA:
                comp = compressor(d, 2, layout.csa_ratio)
                idx_comp = compressor(di, 2, layout.csa_ratio)
                w_iq = rand(num_index_heads * di, H, scale=H ** -0.5)
                w_iw = rand(num_index_heads, H, scale=H ** -0.5)
            elif kind is LayerKind.HCA:
                comp = compressor(d, 1, layout.hca_ratio)
            self.layers.append(_Layer(
                kind=kind, attn_norm=norm_w(H), w_q=rand(num_heads * d, H, scale=H ** -0.5),
                w_kv=rand(d, H, scale=H ** -0.5), kv_norm=norm_w(d),
                w_o=rand(H, num_heads * d, scale=(num_heads * d) ** -0.5 * 0.5),
                comp=comp, idx_comp=idx_comp, w_iq=w_iq, w_iw=w_iw))
        self.final_norm = norm_w(H)
        self.head = rand(vocab_size, H, scale=H ** -0.5)
        self._move(resolve_device(device))

    def to(self, device: str | torch.device) -> ReferenceModel:
        """This model with weights and compute on ``device`` (``self`` if already there)."""
        dev = resolve_device(device)
        if dev == self.device:
            return self
        other = copy.copy(self)
        other._move(dev)
        return other

    def _move(self, device: torch.device) -> None:
        """Put every weight on ``device`` (new tensors and layer records; shares nothing mutable)."""
        def mv(obj):  # a tensor, None, or a frozen dataclass of them
            if obj is None or isinstance(obj, (torch.Tensor, LayerKind)):
                return obj.to(device) if isinstance(obj, torch.Tensor) else obj
            return replace(obj, **{f.name: mv(getattr(obj, f.name)) for f in fields(obj)})

        self.device = device
        self.embed, self.final_norm, self.head = (t.to(device) for t in (self.embed, self.final_norm, self.head))
        self.layers = [mv(layer) for layer in self.layers]

    def _to_cache(self, cache: TieredKVCache, x: torch.Tensor) -> torch.Tensor:
        """Bytes the model hands the cache, on the cache's device."""
        return x if x.device == cache.device else x.to(cache.device)

    def _from_cache(self, x: torch.Tensor) -> torch.Tensor:
        """Bytes read from the cache, on the model's device."""
        return x if x.device == self.device else x.to(self.device)

    # ------------------------------------------------------------- helpers
    def _tokens(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.vocab_size):
            raise ValueError(f"token_ids: expected ids in [0, {self.vocab_size}), "
                             f"got min {int(t.min())}, max {int(t.max())}")
        return t

    def _swa_entry(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        return self.codec.round(rmsnorm(h @ layer.w_kv.T, layer.kv_norm))

    def _queries(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        return (h @ layer.w_q.T).view(h.shape[0], self.num_heads, self.layout.head_dim)

    def _index_queries(self, layer: _Layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert layer.w_iq is not None and layer.w_iw is not None
        q = (h @ layer.w_iq.T).view(h.shape[0], self.num_index_heads, self.layout.indexer_dim)
        return q, h @ layer.w_iw.T

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.final_norm) @ self.head.T

    # --------------------------------------------------------------- naive
    def naive_logits(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Recompute everything without a cache: logits ``[T, vocab_size]`` float64."""
        L = self.layout
        tokens = self._tokens(token_ids).to(self.device)
        T = tokens.numel()
        pos = torch.arange(T, device=self.device)
        x = self.embed[tokens]
        swa_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - L.window)
        for layer in self.layers:
            h = rmsnorm(x, layer.attn_norm)
            keys, mask = self._swa_entry(layer, h), swa_mask
            if layer.kind is LayerKind.CSA:
                assert layer.comp is not None and layer.idx_comp is not None
                entries = self.codec.round(self._naive_csa(layer.comp, h))
                ikeys = self.key_codec.round(self._naive_csa(layer.idx_comp, h))
                qi, wi = self._index_queries(layer, h)
                chosen = ops.select_topk(indexer_scores(qi, wi, ikeys), (pos + 1) // L.csa_ratio, L.top_k)
                keys, mask = torch.cat([keys, entries]), torch.cat([mask, chosen], dim=1)
            elif layer.kind is LayerKind.HCA:
                assert layer.comp is not None
                G = T // L.hca_ratio
                kv, s = layer.comp.rows(h[:G * L.hca_ratio])
                kv, s = kv.view(G, L.hca_ratio, L.head_dim), s.view(G, L.hca_ratio, L.head_dim) + layer.comp.ape
                entries = self.codec.round(rmsnorm(pool(kv, s), layer.comp.norm))
                visible = torch.arange(G, device=self.device)[None, :] < ((pos + 1) // L.hca_ratio)[:, None]
                keys, mask = torch.cat([keys, entries]), torch.cat([mask, visible], dim=1)
            x = x + attend(self._queries(layer, h), keys, mask) @ layer.w_o.T
        return self._logits(x)

    def _naive_csa(self, comp: _Compressor, h: torch.Tensor) -> torch.Tensor:
        """All complete CSA-scheme entries of a whole sequence: ``[T // r, dim]`` (normed)."""
        r = self.layout.csa_ratio
        G = h.shape[0] // r
        kv, s = comp.rows(h[:G * r])
        kv, s = kv.view(G, r, kv.shape[-1]), s.view(G, r, s.shape[-1])
        # the group before entry 0 does not exist: shift by one, pad with (masked) zeros
        prev_kv = torch.cat([torch.zeros_like(kv[:1]), kv[:-1]])
        prev_s = torch.cat([torch.zeros_like(s[:1]), s[:-1]])
        has_prev = torch.arange(G, device=self.device) > 0
        return rmsnorm(csa_pool(prev_kv, prev_s, kv, s, comp.ape, has_prev), comp.norm)

    # -------------------------------------------------------------- cached
    def forward(self, cache: TieredKVCache, request: Request,
                token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` to ``request`` and return their logits ``[n, vocab_size]`` float64.

        Works for a prefill chunk of any length or a single decode step; KV is read and
        written only through ``cache``. The chunk is split at block boundaries.
        """
        tokens = self._tokens(token_ids)
        bt = self.layout.block_tokens
        out = []
        start = 0
        while start < tokens.numel():
            p0 = request.num_tokens
            n = min(tokens.numel() - start, bt - p0 % bt)
            seg = tokens[start:start + n]
            cache.reserve(request, n)
            out.append(self._segment(cache, request, seg, p0))
            cache.advance(request, seg.tolist())
            start += n
        if not out:
            return torch.empty(0, self.vocab_size, dtype=COMPUTE_DTYPE, device=self.device)
        return torch.cat(out)

    def _segment(self, cache: TieredKVCache, request: Request, tokens: torch.Tensor, p0: int) -> torch.Tensor:
        """Tokens at positions ``[p0, p0 + n)``, inside one block."""
        L = self.layout
        n = tokens.numel()
        p1 = p0 + n
        dev = cache.device
        state = cache.state(request)
        pos = torch.arange(p0, p1, device=self.device)
        x = self.embed[tokens.to(self.device)]
        # SWA keys: the ring's old positions [p0 - W, p0) that exist, then the new tokens
        old_pos = torch.arange(max(0, p0 - L.window), p0, device=self.device)
        key_pos = torch.cat([old_pos, pos])
        swa_mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - L.window)
        keep = pos[-L.window:]  # only the last W new entries survive in the ring
        for li, layer in enumerate(self.layers):
            h = rmsnorm(x, layer.attn_norm)
            new = self._swa_entry(layer, h)
            ring = state.swa[li]
            old = self.codec.decode(self._from_cache(ring[(old_pos % L.window).to(dev)]))
            ring[(keep % L.window).to(dev)] = self._to_cache(cache, self.codec.encode(new[-L.window:]))
            keys, mask = torch.cat([old, new]), swa_mask
            if layer.kind is LayerKind.CSA:
                keys, mask = self._csa_segment(cache, request, state, li, layer, h, p0, keys, mask)
            elif layer.kind is LayerKind.HCA:
                keys, mask = self._hca_segment(cache, request, state, li, layer, h, p0, keys, mask)
            x = x + attend(self._queries(layer, h), keys, mask) @ layer.w_o.T
        return self._logits(x)

    def _advance_csa_tail(self, comp: _Compressor, tail: torch.Tensor, h: torch.Tensor,
                          p0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the overlapped compressor over new rows; returns (entries [m, dim], first id).

        tail ``[2, 2r, coff*dim]`` fp32 (rows 0..r-1 previous group, r.. current) is updated
        in place.
        """
        r = self.layout.csa_ratio
        dev = tail.device
        kv, s = comp.rows(h)
        g0, a = divmod(p0, r)
        p1 = p0 + h.shape[0]
        g1, a1 = divmod(p1, r)
        old = self._from_cache(tail).to(COMPUTE_DTYPE)
        # rows from position (g0 - 1) * r on: previous group, current partial, new rows
        buf_kv = torch.cat([old[0, :r + a], kv])
        buf_s = torch.cat([old[1, :r + a], s])
        m = g1 - g0  # groups completed by this segment
        entries = torch.empty(0, kv.shape[1] // 2, dtype=COMPUTE_DTYPE, device=self.device)
        if m > 0:
            gkv = buf_kv[:(m + 1) * r].view(m + 1, r, -1)
            gs = buf_s[:(m + 1) * r].view(m + 1, r, -1)
            has_prev = torch.arange(g0, g1, device=self.device) > 0
            entries = rmsnorm(csa_pool(gkv[:-1], gs[:-1], gkv[1:], gs[1:], comp.ape, has_prev), comp.norm)
        new_tail = torch.zeros_like(old)
        lo = (g1 - g0) * r  # buffer row of position (g1 - 1) * r
        new_tail[0, :r + a1] = buf_kv[lo:lo + r + a1]
        new_tail[1, :r + a1] = buf_s[lo:lo + r + a1]
        tail.copy_(new_tail.to(dtype=tail.dtype, device=dev))
        return entries, torch.arange(g0, g1)  # entry ids stay on the host

    def _csa_segment(self, cache: TieredKVCache, request: Request, state, li: int, layer: _Layer,
                     h: torch.Tensor, p0: int, keys: torch.Tensor, mask: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        assert layer.comp is not None and layer.idx_comp is not None
        L = self.layout
        c = L.part_index(li)
        p1 = p0 + h.shape[0]
        entries, ids = self._advance_csa_tail(layer.comp, state.csa_tail[c], h, p0)
        ikeys, _ = self._advance_csa_tail(layer.idx_comp, state.idx_tail[c], h, p0)
        if ids.numel():
            cache.write_csa(request, li, ids, self._to_cache(cache, self.codec.encode(entries)),
                            self._to_cache(cache, self.key_codec.encode(ikeys)))
        G = p1 // L.csa_ratio
        if G == 0:
            return keys, mask
        pos = torch.arange(p0, p1, device=self.device)
        qi, wi = self._index_queries(layer, h)
        all_keys = self.key_codec.decode(self._from_cache(cache.read_indexer_keys(request, li, G)))
        chosen = ops.select_topk(indexer_scores(qi, wi, all_keys), (pos + 1) // L.csa_ratio, L.top_k)
        union = chosen.any(0).nonzero().flatten()  # ascending entry ids
        selected = self.codec.decode(self._from_cache(cache.read_csa(request, li, union)))
        return torch.cat([keys, selected]), torch.cat([mask, chosen[:, union]], dim=1)

    def _hca_segment(self, cache: TieredKVCache, request: Request, state, li: int, layer: _Layer,
                     h: torch.Tensor, p0: int, keys: torch.Tensor, mask: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        assert layer.comp is not None
        L = self.layout
        r = L.hca_ratio
        tail = state.hca_tail[L.part_index(li)]
        kv, s = layer.comp.rows(h)
        p1 = p0 + h.shape[0]
        g0, a = divmod(p0, r)
        g1, a1 = divmod(p1, r)
        old = self._from_cache(tail).to(COMPUTE_DTYPE)
        buf_kv, buf_s = torch.cat([old[0, :a], kv]), torch.cat([old[1, :a], s])
        m = g1 - g0
        if m > 0:
            gkv, gs = buf_kv[:m * r].view(m, r, -1), buf_s[:m * r].view(m, r, -1) + layer.comp.ape
            entries = rmsnorm(pool(gkv, gs), layer.comp.norm)
            cache.write_hca(request, li, torch.arange(g0, g1), self._to_cache(cache, self.codec.encode(entries)))
        new_tail = torch.zeros_like(old)
        new_tail[0, :a1], new_tail[1, :a1] = buf_kv[m * r:], buf_s[m * r:]
        tail.copy_(new_tail.to(dtype=tail.dtype, device=tail.device))
        if g1 == 0:
            return keys, mask
        pos = torch.arange(p0, p1, device=self.device)
        entries_all = self.codec.decode(self._from_cache(cache.read_hca(request, li, g1)))
        visible = torch.arange(g1, device=self.device)[None, :] < ((pos + 1) // r)[:, None]
        return torch.cat([keys, entries_all]), torch.cat([mask, visible], dim=1)
