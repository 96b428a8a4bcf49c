"""HiSparse: CSA entries of sealed blocks live in host memory; each request keeps a small
device buffer of them, managed LRU, and swaps in the top-k it needs each step.

Per live request (State slot ``s``) and CSA layer ``c`` (on the cache's device)::

    buffer        [num_state_slots, num_csa_layers, N, entry_bytes]  uint8
    entry_of_slot [num_state_slots, num_csa_layers, N]               int64  (-1: empty)
    last_used     [num_state_slots, num_csa_layers, N]               int64  (-1: never)

``swap_in(ids)`` for one request and layer (ids: unique CSA entry ids of sealed blocks)::

    hits    = ids already in the buffer            -> their slots, last_used = step
    misses  = the rest                             -> copied from the host mirror into
              the least-recently-used slots not used by this step (empty slots first,
              ties to the lowest slot), entry_of_slot / last_used updated

The entries of the newest, not-yet-sealed block are always resident: they stay in the
GPU Classical pool until the block is sealed and mirrored (see ``ClassicalPool``'s open
CSA part). Because swap-in returns the very bytes the non-HiSparse path gathers, in the
same order, logits with HiSparse are bit-identical to logits without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import kernels
from .layout import KVLayout

__all__ = ["HiSparseBuffers", "HiSparseConfig"]


@dataclass(frozen=True, kw_only=True)
class HiSparseConfig:
    """Enables HiSparse in :class:`~tiered_kv.cache.TieredKVCache`.

    Args:
        device_buffer_entries: N, CSA entry slots per request and CSA layer on the
            device; at least the layout's top-k (e.g. 4 x top-k).
    """

    device_buffer_entries: int

    def validate(self, layout: KVLayout) -> None:
        n = self.device_buffer_entries
        if isinstance(n, bool) or not isinstance(n, int) or n < layout.top_k:
            raise ValueError(f"device_buffer_entries: expected an int >= top_k = {layout.top_k}, got {n!r}")


class HiSparseBuffers:
    """Device buffers and LRU state of every State slot."""

    def __init__(self, layout: KVLayout, config: HiSparseConfig, num_slots: int, device: torch.device) -> None:
        config.validate(layout)
        self.layout = layout
        self.capacity = config.device_buffer_entries
        shape = (num_slots, layout.num_csa_layers, self.capacity)
        #: ``[num_state_slots, num_csa_layers, N, entry_bytes]`` uint8
        self.buffer = torch.zeros(*shape, layout.entry_bytes, dtype=torch.uint8, device=device)
        #: ``[num_state_slots, num_csa_layers, N]`` int64, -1 where empty
        self.entry_of_slot = torch.full(shape, -1, dtype=torch.int64, device=device)
        #: ``[num_state_slots, num_csa_layers, N]`` int64 step of last use, -1 never
        self.last_used = torch.full(shape, -1, dtype=torch.int64, device=device)
        self._step = [0] * num_slots
        self.hits = 0
        self.misses = 0
        self.bytes_moved = 0
        self.direct_reads = 0

    def reset(self, slot: int) -> None:
        """Forget a slot's buffered entries (a new request takes the slot)."""
        self.entry_of_slot[slot].fill_(-1)
        self.last_used[slot].fill_(-1)
        self._step[slot] = 0

    def swap_in(self, slot: int, part: int, ids: torch.Tensor, host_rows: torch.Tensor,
                host: torch.Tensor) -> torch.Tensor:
        """Make entries ``ids`` resident in the buffer of (slot, CSA part); return their slots.

        ids ``[k]`` int64 unique, ``k <= N``; host_rows ``[k]`` int64: row of each id in
        ``host`` ``[num_host_blocks, rows_per_block, entry_bytes]`` (flattened index
        ``block * rows_per_block + row``). Returns ``[k]`` int64 slot ids.
        """
        k = ids.numel()
        if k > self.capacity:
            raise ValueError(f"ids: expected at most device_buffer_entries = {self.capacity} ids, got {k}")
        dev = self.buffer.device
        ids = ids.to(dev)
        eos = self.entry_of_slot[slot, part]
        last = self.last_used[slot, part]
        self._step[slot] += 1
        step = self._step[slot]
        match = eos[None, :] == ids[:, None]  # [k, N]
        hit = match.any(1)
        slots = match.to(torch.int8).argmax(1)
        miss = (~hit).nonzero().flatten()
        m = miss.numel()
        if m:
            # victims: LRU among slots this step does not use; empty (-1) first, then lowest slot
            score = last.masked_fill(match.any(0), torch.iinfo(torch.int64).max)
            victims = torch.sort(score, stable=True).indices[:m]
            kernels.swap_in(host, host_rows.to(host.device)[miss.to(host_rows.device)], self.buffer[slot, part],
                            victims)
            eos[victims] = ids[miss]
            slots[miss] = victims
        last[slots] = step
        nh = k - m
        self.hits += nh
        self.misses += m
        self.bytes_moved += m * self.layout.entry_bytes
        return slots

    def read_direct(self, host_rows: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Entries straight from the host mirror, bypassing the buffer (for a prefill chunk
        whose selection exceeds the buffer): ``[k, entry_bytes]`` uint8 on the device."""
        rpb = host.shape[1]
        rows = host[host_rows // rpb, host_rows % rpb]
        self.direct_reads += 1
        self.misses += rows.shape[0]
        self.bytes_moved += rows.numel()
        return rows.to(self.buffer.device)

    def read(self, slot: int, part: int, slots: torch.Tensor) -> torch.Tensor:
        """Buffered entries at ``slots``: ``[k, entry_bytes]`` uint8."""
        return self.buffer[slot, part, slots]

    def stats(self) -> dict[str, int]:
        return {"hisparse_hits": self.hits, "hisparse_misses": self.misses,
                "hisparse_bytes_moved": self.bytes_moved, "hisparse_direct_reads": self.direct_reads}
