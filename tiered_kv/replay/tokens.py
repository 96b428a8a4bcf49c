"""Deterministic prompt tokens for a trace that only gives prefix-block ids.

A Mooncake trace has no text: request ``i`` is ``input_length`` tokens whose j-th block
of ``block_tokens`` has id ``hash_ids[j]``. :class:`TokenMaker` turns that into token ids:

* block id ``x`` always gives the same ``block_tokens`` tokens, in every request, process
  and run: token ``j`` of it is ``splitmix64((x << 20) | j) >> 33`` (31 bits, top bit 0);
  a partial last block takes the first tokens of its id's block;
* tokens past the last id (a prompt longer than its ids cover) are unique to the request:
  ``splitmix64(2**63 | (i << 32) | j) >> 33 | 2**31`` (top bit 1, so they never equal a
  block token).

So two requests share exactly the token prefix their ids say they share, and the cache's
chained prefix hashes (:mod:`tiered_kv.prefix`) of those tokens agree exactly where the
ids agree. Collisions between different ids are those of a 64-bit mix over 512 tokens at
once: none in practice.
"""

from __future__ import annotations

import numpy as np

from .trace import TraceRequest

__all__ = ["TokenMaker"]

_MAX_ID = (1 << 44) - 1
_C1 = np.uint64(0x9E3779B97F4A7C15)
_C2 = np.uint64(0xBF58476D1CE4E5B9)
_C3 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _C1
        z = (z ^ (z >> np.uint64(30))) * _C2
        z = (z ^ (z >> np.uint64(27))) * _C3
        return z ^ (z >> np.uint64(31))


class TokenMaker:
    """Prompt tokens of trace requests: see the module docstring.

    >>> maker = TokenMaker(512)
    >>> tokens = maker.prompt(0, trace.requests[0])   # list[int] of input_length ids
    """

    def __init__(self, block_tokens: int) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 0 < block_tokens <= 1 << 20:
            raise ValueError(f"block_tokens: expected an int in [1, 2**20], got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._offsets = np.arange(block_tokens, dtype=np.uint64)

    def block(self, hash_id: int) -> np.ndarray:
        """The tokens of block id ``hash_id``: ``[block_tokens]`` uint32."""
        return self._blocks(np.asarray([hash_id], dtype=np.uint64)).reshape(-1)

    def prompt_array(self, index: int, request: TraceRequest) -> np.ndarray:
        """Request ``index``'s prompt: ``[input_length]`` uint32."""
        ids = request.hash_ids
        if ids and max(ids) > _MAX_ID:
            raise ValueError(f"hash_ids: expected ids below 2**44, got {max(ids)}")
        n, bt = request.input_length, self.block_tokens
        body = self._blocks(np.asarray(ids, dtype=np.uint64)).reshape(-1)[:n]
        if body.size == n:
            return body
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 31:
            raise ValueError(f"index: expected a request index in [0, 2**31), got {index!r}")
        j = np.arange(body.size, n, dtype=np.uint64)
        seed = np.uint64((1 << 63) | (index << 32))
        tail = (_splitmix64(seed | j) >> np.uint64(33)).astype(np.uint32) | np.uint32(1 << 31)
        assert body.size == len(ids) * bt
        return np.concatenate([body, tail])

    def prompt(self, index: int, request: TraceRequest) -> list[int]:
        """Request ``index``'s prompt as a list of ints (what ``TieredKVCache.open`` takes)."""
        return self.prompt_array(index, request).tolist()

    def _blocks(self, ids: np.ndarray) -> np.ndarray:
        """``[len(ids), block_tokens]`` uint32: the tokens of each block id."""
        grid = (ids[:, None] << np.uint64(20)) | self._offsets[None, :]
        return (_splitmix64(grid) >> np.uint64(33)).astype(np.uint32)
