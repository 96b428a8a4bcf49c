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
    #: The first block (index) of this request's path that an earlier request reused,
    #: as the disk admission filter ``retraced`` counts it (sealed again where a snapshot
    #: was held back): the snapshots it publishes after it are written (see
    #: ``AdmissionFilter.retraces``).
    _retraced_at: int | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sealed_blocks(self) -> int:
        return len(self.block_hashes)


#: A C ``unsigned int`` is 32 bits here: its array refuses (OverflowError) an id outside
#: ``[0, 2**32)``, and holds the ids as uint32 (little-endian ones where the platform is).
_UINT32_ARRAY = array.array("I").itemsize == 4


def _fit_uint32(ids: list[int]) -> bool:
    """Whether every int of ``ids`` lies in ``[0, 2**32)``: one C loop (an array of C
    unsigned ints refuses the others), ~3x faster than min() and max() on a long prompt."""
    if not _UINT32_ARRAY:
        return min(ids) >= 0 and max(ids) <= _MAX_TOKEN
    return _uint32_array(ids) is not None


def _uint32_array(ids: list[int]) -> array.array | None:
    """``ids`` (ints) as a C unsigned-int array, or None when one lies outside ``[0, 2**32)``
    (only where :data:`_UINT32_ARRAY`)."""
    try:
        return array.array("I", ids)
    except OverflowError:
        return None


def as_token_list(token_ids: Sequence[int] | np.ndarray | torch.Tensor, what: str = "token_ids") -> list[int]:
    return checked_tokens(token_ids, what)[0]


def checked_tokens(token_ids: Sequence[int] | np.ndarray | torch.Tensor,
                   what: str = "token_ids") -> tuple[list[int], array.array | None]:
    """:func:`as_token_list`, with the C unsigned-int array its range check made when it
    made one (a list of ints where :data:`_UINT32_ARRAY`; else None): the cache hashes a
    block advanced whole from that array's bytes instead of converting the ids again."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError(f"{what}: expected a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    out = list(token_ids)
    # the common case, checked without numpy (advance is hot): every item exactly an int
    # (a list's count() compares by identity first: one C loop, ~2x a set of the types)
    if list(map(type, out)).count(int) == len(out):
        if not out:
            return out, None
        arr = _uint32_array(out) if _UINT32_ARRAY else None
        if arr is None and (_UINT32_ARRAY or not _fit_uint32(out)):
            raise ValueError(f"{what}: expected ids in [0, 2**32), got min {min(out)}, max {max(out)}")
        return out, arr
    for t in out:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{what}: expected integer token ids, got {type(t).__name__}")
    tokens_to_bytes(out)  # range check
    return [int(t) for t in out], None
