"""HiSparse: CSA entries of sealed blocks live in host memory; each request keeps a small
device buffer of them, managed LRU, and swaps in the top-k it needs each step.

Per live request (State slot ``s``) and CSA layer ``c``, on the cache's device (all
static: allocated once, so a decode step that uses them can be captured in a CUDA graph)::

    buffer        [num_state_slots, num_csa_layers, N, entry_bytes]  uint8
    entry_of_slot [num_state_slots, num_csa_layers, N]               int64  (-1: empty)
    last_used     [num_state_slots, num_csa_layers, N]               int64  (-1: never)
    lru           [num_state_slots, num_csa_layers, N]               int64  slots, LRU first
    step          [num_state_slots, num_csa_layers]                  int64
    host_block    [num_state_slots, max_blocks]                      int64  host record of
                                                                            each sealed block
    counters      [2]                                                int64  hits, misses

``swap_in_batch(state_slots, c, ids)`` for B requests at once (ids ``[B, k]``, -1 padding)::

    hits    = ids already in the buffer            -> their slots
    misses  = the rest (first occurrence of each)  -> copied from the host mirror into the
              least-recently-used slots no hit of this step uses (empty slots first, ties
              to the lowest slot), in order of first occurrence
    then    entry_of_slot, lru, last_used = step, step += 1, counters

Victim choice is exact LRU, kept as an explicit order (``lru``) rather than sorted each
step: the used slots move to the back (by slot index), the others keep their order, so a
step needs prefix sums only (one CUDA block per request, see
``kernels/hisparse_swap_in.cu``). ``lru`` is always the stable argsort of ``last_used``.

The entries of the newest, not-yet-sealed block are always resident: they stay in the
GPU Classical pool until the block is sealed and mirrored (see ``ClassicalPool``'s open
CSA part). Because swap-in returns the very bytes the non-HiSparse path gathers, in the
same order, logits with HiSparse are bit-identical to logits without it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import kernels
from .kernels import cuda_ops
from .layout import KVLayout

__all__ = ["HiSparseBuffers", "HiSparseConfig", "warn_if_decode_syncs"]


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
    """Device buffers, LRU state and host-record tables of every State slot.

    ``max_blocks``: width of the per-slot block -> host record table (the most blocks a
    request can hold: the cache passes its Classical pool size).
    """

    def __init__(self, layout: KVLayout, config: HiSparseConfig, num_slots: int, device: torch.device,
                 *, max_blocks: int = 1) -> None:
        config.validate(layout)
        warn_if_decode_syncs(device)
        self.layout = layout
        self.capacity = N = config.device_buffer_entries
        S, C = num_slots, layout.num_csa_layers
        shape = (S, C, N)
        rows = torch.zeros(S * C * N + 1, layout.entry_bytes, dtype=torch.uint8, device=device)
        #: ``[num_state_slots, num_csa_layers, N, entry_bytes]`` uint8 (a view: one more
        #: row follows it, the sink the torch implementation writes padded positions to)
        self.buffer = rows[:-1].view(S, C, N, layout.entry_bytes)
        #: ``[num_state_slots, num_csa_layers, N]`` int64, -1 where empty
        self.entry_of_slot = torch.full(shape, -1, dtype=torch.int64, device=device)
        #: ``[num_state_slots, num_csa_layers, N]`` int64 step of last use, -1 never
        self.last_used = torch.full(shape, -1, dtype=torch.int64, device=device)
        #: ``[num_state_slots, num_csa_layers, N]`` int64 slots, least recently used first
        self.lru = torch.arange(N, device=device).repeat(S, C, 1)
        #: ``[num_state_slots, num_csa_layers]`` int64 swap-ins so far
        self.step = torch.zeros(S, C, dtype=torch.int64, device=device)
        #: ``[num_state_slots, max_blocks]`` int64 host record of each sealed block, -1 none
        self.host_block = torch.full((S, max_blocks), -1, dtype=torch.int64, device=device)
        #: ``[2]`` int64: hits, misses (read by :meth:`stats`, never on the hot path)
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        self.tables = kernels.HiSparseTables(
            buffer_rows=rows, entry_of_slot=self.entry_of_slot, last_used=self.last_used, lru=self.lru,
            step=self.step, host_block=self.host_block, counters=self.counters,
            entries_per_block=layout.csa_entries_per_block)
        self._direct_misses = 0
        self.direct_reads = 0
        self.direct_bytes = 0
        #: tuple of State slots -> their ``[B]`` int64 device tensor (static, for graphs)
        self._slot_tensors: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def hits(self) -> int:
        return int(self.counters[0])

    @property
    def misses(self) -> int:
        return int(self.counters[1]) + self._direct_misses

    @property
    def bytes_moved(self) -> int:
        return int(self.counters[1]) * self.layout.entry_bytes + self.direct_bytes

    def reset(self, slot: int) -> None:
        """Forget a slot's buffered entries and host records (a new request takes the slot)."""
        self.entry_of_slot[slot].fill_(-1)
        self.last_used[slot].fill_(-1)
        self.lru[slot].copy_(torch.arange(self.capacity, device=self.lru.device).expand(self.lru.shape[1:]))
        self.step[slot].zero_()
        self.host_block[slot].fill_(-1)

    def set_host_blocks(self, slot: int, start: int, host_ids: list[int]) -> None:
        """Record the host records of a request's sealed blocks ``start, start + 1, ...``."""
        if not host_ids:
            return
        if start + len(host_ids) > self.host_block.shape[1]:
            raise ValueError(f"blocks: expected at most {self.host_block.shape[1]} per request, "
                             f"got {start + len(host_ids)}")
        if len(host_ids) == 1:
            self.host_block[slot, start] = host_ids[0]  # a fill kernel: no host->device copy
        else:
            self.host_block[slot, start:start + len(host_ids)] = torch.tensor(host_ids, dtype=torch.int64)

    def slot_tensor(self, slots: tuple[int, ...]) -> torch.Tensor:
        """The ``[B]`` int64 device tensor of these State slots, built once per tuple: the
        same tensor (same address) every step, so a captured graph can replay it."""
        t = self._slot_tensors.get(slots)
        if t is None:
            if len(self._slot_tensors) >= 256:
                self._slot_tensors.clear()
            t = self._slot_tensors[slots] = torch.tensor(slots, dtype=torch.int64).to(self.lru.device)
        return t

    def swap_in_batch(self, state_slots: torch.Tensor, part: int, ids: torch.Tensor, host: torch.Tensor, *,
                      host_rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Make entries ``ids`` ``[B, k]`` (-1: padding) of CSA ``part`` resident in the buffers
        of ``state_slots`` ``[B]``; returns their slots ``[B, k]`` int64 (-1 where padded).

        host: the mirror's row view ``[num_host_blocks, num_csa_layers * E, entry_bytes]``;
        rows come from :attr:`host_block` unless ``host_rows`` ``[B, k]`` gives them.
        One kernel launch on a GPU; see :func:`tiered_kv.kernels.hisparse_swap_in`.
        """
        return kernels.hisparse_swap_in(self.tables, state_slots, part, ids, host, host_rows=host_rows, out=out)

    def swap_in(self, slot: int, part: int, ids: torch.Tensor, host_rows: torch.Tensor,
                host: torch.Tensor) -> torch.Tensor:
        """One request: make entries ``ids`` ``[k]`` int64 resident in the buffer of (slot, CSA
        part); return their slots ``[k]`` int64. host_rows ``[k]`` int64: row of each id in
        ``host`` ``[num_host_blocks, rows_per_block, entry_bytes]`` (flattened index
        ``block * rows_per_block + row``). A batch of one for :meth:`swap_in_batch`.
        """
        k = ids.numel()
        if k > self.capacity:
            raise ValueError(f"ids: expected at most device_buffer_entries = {self.capacity} ids, got {k}")
        dev = self.buffer.device
        ids = ids.to(dev).view(1, k)
        rows = host_rows.to(dev).view(1, k)
        return self.swap_in_batch(self.slot_tensor((slot,)), part, ids, host, host_rows=rows)[0]

    def read_direct(self, host_rows: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Entries straight from the host mirror, bypassing the buffer (for a prefill chunk
        whose selection exceeds the buffer): ``[k, entry_bytes]`` uint8 on the device."""
        rpb = host.shape[1]
        rows = host[host_rows // rpb, host_rows % rpb]
        self.direct_reads += 1
        self._direct_misses += rows.shape[0]
        self.direct_bytes += rows.numel()
        return rows.to(self.buffer.device)

    def read(self, slot: int, part: int, slots: torch.Tensor) -> torch.Tensor:
        """Buffered entries at ``slots``: ``[k, entry_bytes]`` uint8."""
        return self.buffer[slot, part, slots]

    def stats(self) -> dict[str, int]:
        """Counters (reads the device counters: a host sync, outside any decode step)."""
        hits, misses = self.counters.tolist()
        return {"hisparse_hits": hits, "hisparse_misses": misses + self._direct_misses,
                "hisparse_bytes_moved": misses * self.layout.entry_bytes + self.direct_bytes,
                "hisparse_direct_reads": self.direct_reads}


def warn_if_decode_syncs(device: torch.device) -> None:
    """Warn, once per cache built, when ``swap_in_batch`` on ``device`` cannot run its CUDA
    kernel: without CuPy a GPU runs the torch implementation, whose copy from the pinned
    host mirror synchronises the host with the device at every decode step (and cannot be
    captured in a CUDA graph). Nothing is said per call."""
    if torch.device(device).type == "cuda" and not cuda_ops.cupy_available():
        warnings.warn(
            "HiSparse on a CUDA device without CuPy: swap_in_batch runs the torch implementation, which "
            "synchronises the host with the device at every decode step (pip install cupy-cuda13x, or "
            "cupy-cuda12x on CUDA 12, for the one-launch kernel)", RuntimeWarning, stacklevel=3)
