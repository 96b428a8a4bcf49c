"""``Request``: one sequence's view of a :class:`~tiered_kv.cache.TieredKVCache`."""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .prefix import tokens_to_bytes

#: Token ids are hashed as uint32 (see :func:`~tiered_kv.prefix.tokens_to_bytes`).
_MAX_TOKEN = 2**32 - 1

__all__ = ["Request", "as_token_list"]


@dataclass(eq=False)
class Request:
    """One sequence's view of the cache. Created by :meth:`TieredKVCache.open`."""

    request_id: int
    #: State slot index in the State pool.
    slot: int
    #: Tokens whose KV is in the cache (cached prefix + everything advanced since).
    token_ids: list[int]
    #: Block table: Classical block ids, one per started block.
    block_ids: list[int]
    #: Prefix hashes of the sealed (full) blocks, ``len(block_hashes) <= len(block_ids)``.
    block_hashes: list[bytes]
    #: Tokens served from the cache at open.
    num_cached_tokens: int
    closed: bool = False
    #: Private snapshots of the latest block boundaries: (num_blocks, snapshot id, hash).
    _pending: list[tuple[int, int, bytes]] = field(default_factory=list, repr=False)
    #: HiSparse: a host record reserved for the CSA part of the block being filled.
    _host_reserved: int | None = field(default=None, repr=False)
    #: The furthest token count ``reserve`` was asked for: the engine will compute up to
    #: here before it can close the request, so boundaries two or more blocks short of it
    #: need no private snapshot (see ``TieredKVCache._snapshot_at_boundary``).
    _reserved_to: int = field(default=0, repr=False)
    #: The boundary (in blocks) where the prompt leaves the cached prefix tree, when the
    #: snapshot policy publishes branch points there (see :mod:`tiered_kv.policy.snapshots`).
    _branch_at: int | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sealed_blocks(self) -> int:
        return len(self.block_hashes)


def _fit_uint32(ids: list[int]) -> bool:
    """Whether every int of ``ids`` lies in ``[0, 2**32)``: one C loop (an array of C
    unsigned ints refuses the others), ~3x faster than min() and max() on a long prompt."""
    if array.array("I").itemsize != 4:
        return min(ids) >= 0 and max(ids) <= _MAX_TOKEN
    try:
        array.array("I", ids)
    except OverflowError:
        return False
    return True


def as_token_list(token_ids: Sequence[int] | np.ndarray | torch.Tensor, what: str = "token_ids") -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError(f"{what}: expected a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    out = list(token_ids)
    if set(map(type, out)) <= {int}:  # the common case, checked without numpy (advance is hot)
        if out and not _fit_uint32(out):
            raise ValueError(f"{what}: expected ids in [0, 2**32), got min {min(out)}, max {max(out)}")
        return out
    for t in out:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{what}: expected integer token ids, got {type(t).__name__}")
    tokens_to_bytes(out)  # range check
    return [int(t) for t in out]
