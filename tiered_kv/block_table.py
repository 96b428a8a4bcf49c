"""Per-State-slot block tables: each live request's Classical block ids, on the device.

Paged-attention kernels address a pool through a block table; so do an engine's KV-write
and attention kernels here. The cache keeps **one persistent row per State slot** and
writes only what changes — a row is filled when a request opens (its cached prefix),
extended when ``reserve`` appends blocks, cleared at close — so a step never rebuilds a
table from Python lists::

    device  [num_state_slots, capacity] int32   on the cache's device; -1 past the end
    host    [num_state_slots, capacity] int32   numpy, the same values: host-side
                                                bookkeeping (the write path's checks and
                                                destinations) reads it, never the device

    row slot:  | b0 | b1 | b2 | -1 | -1 | ... |      b_k = Classical block of tokens
                                                     [k * block_tokens, (k+1) * block_tokens)

On a CPU cache both are one buffer (``device`` is ``torch.from_numpy(host)``). On CUDA an
update copies the changed cells host -> device with ``non_blocking=True`` from pageable
memory: the driver stages the bytes before returning, so the host may change them again
at once, and nothing waits for the device.

``capacity`` starts at 64 blocks and doubles when a request needs more (up to the pool's
``num_blocks``, the most one request can hold); growing reallocates ``device``, so hold
on to :meth:`BlockTables.gather` results or pass ``out=``, not to ``device`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BlockTables"]

#: Initial blocks per row (8192 tokens at 128-token blocks).
_INITIAL_CAPACITY = 64


class BlockTables:
    """The block table of every State slot, on the device with a host mirror."""

    def __init__(self, num_slots: int, max_blocks: int, device: torch.device) -> None:
        if num_slots <= 0 or max_blocks <= 0:
            raise ValueError(f"BlockTables: expected positive num_slots and max_blocks, got {num_slots}, {max_blocks}")
        self.num_slots = num_slots
        #: The most blocks one row can hold (the pool size).
        self.max_blocks = max_blocks
        self.device = device
        #: Blocks in use per row (the rest of the row is -1).
        self.lengths = np.zeros(num_slots, dtype=np.int64)
        self._alloc(min(_INITIAL_CAPACITY, max_blocks))

    def _alloc(self, capacity: int) -> None:
        host = np.full((self.num_slots, capacity), -1, dtype=np.int32)
        if hasattr(self, "host"):
            old = self.host.shape[1]
            host[:, :old] = self.host
        #: ``[num_slots, capacity]`` int32, the host mirror.
        self.host = host
        if self.device.type == "cpu":
            #: ``[num_slots, capacity]`` int32 on the cache's device.
            self.device_table = torch.from_numpy(host)
        else:
            self.device_table = torch.from_numpy(host).to(self.device, non_blocking=True)

    @property
    def capacity(self) -> int:
        return self.host.shape[1]

    def _ensure(self, width: int) -> None:
        if width > self.max_blocks:
            raise ValueError(f"block table: expected at most {self.max_blocks} blocks per request, got {width}")
        if width > self.capacity:
            cap = self.capacity
            while cap < width:
                cap *= 2
            self._alloc(min(cap, self.max_blocks))

    def _push(self, slot: int, start: int, stop: int) -> None:
        """Copy host cells ``[slot, start:stop)`` to the device (no-op on CPU)."""
        if self.device.type != "cpu" and stop > start:
            src = torch.from_numpy(self.host[slot, start:stop])
            self.device_table[slot, start:stop].copy_(src, non_blocking=True)

    # ------------------------------------------------------------- updates
    def assign(self, slot: int, block_ids: Sequence[int]) -> None:
        """Row ``slot`` := ``block_ids`` (a request opened with a cached prefix)."""
        n = len(block_ids)
        self._ensure(n)
        old = int(self.lengths[slot])
        row = self.host[slot]
        row[:n] = block_ids
        row[n:old] = -1
        self.lengths[slot] = n
        self._push(slot, 0, max(n, old))

    def append(self, slot: int, block_ids: Sequence[int]) -> None:
        """Extend row ``slot`` with ``block_ids`` (``reserve`` took new blocks)."""
        start = int(self.lengths[slot])
        stop = start + len(block_ids)
        self._ensure(stop)
        self.host[slot, start:stop] = block_ids
        self.lengths[slot] = stop
        self._push(slot, start, stop)

    def clear(self, slot: int) -> None:
        """Row ``slot`` := empty (the request closed)."""
        self.assign(slot, ())

    # -------------------------------------------------------------- reads
    def gather(self, slots: Sequence[int], width: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``slots`` cut (or padded with -1) to ``width`` columns: ``[B, width]`` int32.

        A device gather from the persistent table; ``out`` (``[B, width]`` int32 on the
        device) receives it in place, e.g. a static buffer a CUDA graph reads.
        """
        self._ensure(width)
        B = len(slots)
        if out is None:
            out = torch.empty(B, width, dtype=torch.int32, device=self.device)
        elif (not isinstance(out, torch.Tensor) or out.dtype != torch.int32 or tuple(out.shape) != (B, width)
              or out.device != self.device):
            got = f"{out.dtype} {list(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out: expected int32 [{B}, {width}] on {self.device}, got {got}")
        idx = torch.tensor(slots, dtype=torch.int64)
        if self.device.type != "cpu":
            idx = idx.to(self.device, non_blocking=True)
        torch.index_select(self.device_table[:, :width], 0, idx, out=out)
        return out
