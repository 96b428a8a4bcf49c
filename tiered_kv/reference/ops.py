"""Math shared by the cached and the naive reference paths (docs/architecture.md §8).

Everything is computed in float64 so that the cached path (chunks, gathers, other
reduction orders) and the naive full recompute agree to ~1e-12 and the indexer's top-k
selections coincide; what is *stored* is rounded exactly as the cache stores it
(entries through their :class:`EntryCodec`, compressor rows through fp32), and both
paths apply the same rounding.
"""

from __future__ import annotations

import math

import torch


__all__ = ["attend", "pool", "rmsnorm", "round_fp32", "select_topk"]

COMPUTE_DTYPE = torch.float64


def round_fp32(x: torch.Tensor) -> torch.Tensor:
    """Compressor rows are kept in fp32 tails; both paths round them alike."""
    return x.to(torch.float32).to(COMPUTE_DTYPE)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling over the token axis, per dimension.

    kv, score: ``[..., tokens, dim]`` (score already includes the positional bias;
    ``-inf`` masks a token) -> ``[..., dim]``.
    """
    return (torch.softmax(score, dim=-2) * kv).sum(-2)


def csa_pool(prev_kv: torch.Tensor, prev_s: torch.Tensor, cur_kv: torch.Tensor, cur_s: torch.Tensor,
             ape: torch.Tensor, has_prev: torch.Tensor) -> torch.Tensor:
    """CSA entries with the 8-token overlap.

    prev_*, cur_*: ``[groups, r, 2 * dim]`` fp32-rounded rows of the previous and the
    entry's own group; ape ``[r, 2 * dim]``; has_prev ``[groups]`` bool (False for entry 0).
    Entry = pool over the previous group's first half and the own group's second half.
    Returns ``[groups, dim]``.
    """
    dim = cur_kv.shape[-1] // 2
    s_prev = prev_s[..., :dim] + ape[:, :dim]
    s_prev = torch.where(has_prev[:, None, None], s_prev, torch.full_like(s_prev, -math.inf))
    s = torch.cat([s_prev, cur_s[..., dim:] + ape[:, dim:]], dim=-2)
    kv = torch.cat([prev_kv[..., :dim], cur_kv[..., dim:]], dim=-2)
    return pool(kv, s)


def attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MQA with K = V.

    q ``[n, heads, dim]``; keys ``[m, dim]``; mask ``[n, m]`` bool (True = visible).
    Returns ``[n, heads * dim]``.
    """
    n, h, d = q.shape
    # plain 2-D matmuls: much faster than einsum's batched path for these small shapes
    scores = (q.reshape(n * h, d) @ keys.T).view(n, h, -1) / math.sqrt(d)
    scores = scores.masked_fill(~mask[:, None, :], -math.inf)
    out = torch.softmax(scores, dim=-1).view(n * h, -1) @ keys
    return out.reshape(n, h * d)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Lightning indexer: ``score[n, j] = sum_h w[n, h] * relu(q[n, h] . keys[j])``.

    q ``[n, heads, dim]``, w ``[n, heads]``, keys ``[m, dim]`` -> ``[n, m]``.
    """
    n, h, d = q.shape
    per_head = torch.relu(q.reshape(n * h, d) @ keys.T).view(n, h, -1)
    return (w[:, :, None] * per_head).sum(1)


def select_topk(scores: torch.Tensor, num_valid: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the ids of the ``k`` best entries among ``[0, num_valid[row])``.

    Ties go to the lowest id (a stable sort), so every path selects the same set.
    scores ``[n, m]``, num_valid ``[n]`` int -> mask ``[n, m]`` bool of the selected ids.
    """
    n, m = scores.shape
    ids = torch.arange(m, device=scores.device)
    valid = ids[None, :] < num_valid[:, None]
    masked = scores.masked_fill(~valid, -math.inf)
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    chosen = torch.zeros(n, m, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, order, True)
    return chosen & valid
