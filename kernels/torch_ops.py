"""Torch implementations of the block movers (CPU and GPU tensors alike).

Below the public API (:mod:`tiered_kv.kernels`): inputs are validated, every tensor
is on one device (block ids included), ids are in range and, for scatter / swap-in,
unique. The layout is the one documented in :mod:`tiered_kv.kernels`.

Choices measured on CPU (Flash fp8 CSA part, 128 blocks): ``index_select`` into a
transposed view of the records writes each record in place (~8 GB/s, half a memcpy);
``index_copy_`` along the block dim is ~1 GB/s on CPU, so a CPU scatter copies block
by block instead (~6 GB/s), while on a GPU ``index_copy_`` is one kernel per part.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .types import HiSparseTables

__all__ = ["gather_blocks", "hisparse_swap_in", "ids_to", "scatter_blocks", "swap_in"]


def ids_to(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``ids`` as a contiguous int64 tensor on ``device``, without blocking the host.

    CPU ids bound for a GPU go through pinned staging: a plain ``.to(device)`` from
    pageable memory synchronizes the current stream, which on a copy engine's side
    stream would wait for the producer's kernels. Torch's pinned allocator keeps the
    staging until the upload is done.
    """
    if ids.device == device:
        return ids.contiguous()
    if ids.device.type == "cpu" and device.type == "cuda":
        return ids.contiguous().pin_memory().to(device, non_blocking=True)
    return ids.to(device)


def _part_views(parts: Sequence[torch.Tensor], records: torch.Tensor,
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pair each non-empty part with its columns of ``records``, both as ``[.., L, run]``.

    part ``[L, num_blocks, E, B]`` -> ``[L, num_blocks, E*B]`` when ``[E, B]`` is
    contiguous (a view), else kept 4-D; records ``[n, R]`` -> ``[n, L, E*B]`` (or
    ``[n, L, E, B]``), always a view of ``records``.
    """
    offset = 0
    for part in parts:
        num_layers, _, entries, nbytes = part.shape
        size = num_layers * entries * nbytes
        if size == 0:
            continue
        cols = records[:, offset:offset + size]
        if _flattens_as_view(part):
            yield part.flatten(2), cols.unflatten(1, (num_layers, entries * nbytes))
        else:
            yield part, cols.unflatten(1, (num_layers, entries, nbytes))
        offset += size


def _flattens_as_view(part: torch.Tensor) -> bool:
    entries, nbytes = part.shape[2], part.shape[3]
    if entries == 1 or nbytes == 1:
        return True
    return part.stride(2) == nbytes * part.stride(3)


def gather_blocks(parts: Sequence[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor) -> None:
    """``out[i] = record of block block_ids[i]``; duplicate and unsorted ids allowed."""
    if block_ids.numel() == 0:
        return
    for part, cols in _part_views(parts, out):
        # cols: [n, L, ...]; index_select writes [L, n, ...] straight into its transpose.
        torch.index_select(part, 1, block_ids, out=cols.transpose(0, 1))


def scatter_blocks(records: torch.Tensor, block_ids: torch.Tensor,
                   parts: Sequence[torch.Tensor]) -> None:
    """Block ``block_ids[i]`` of every part = ``records[i]``; ids unique."""
    if block_ids.numel() == 0:
        return
    if records.device.type == "cpu":
        ids = block_ids.tolist()
        for part, cols in _part_views(parts, records):
            for i, block in enumerate(ids):
                part[:, block].copy_(cols[i])
    else:
        for part, cols in _part_views(parts, records):
            part.index_copy_(1, block_ids, cols.transpose(0, 1))


def swap_in(host: torch.Tensor, host_rows: torch.Tensor, buffer: torch.Tensor,
            slots: torch.Tensor) -> None:
    """``buffer[slots[i]] = host[host_rows[i]]``; ``host_rows`` on host's device, ``slots``
    on buffer's; slots unique. A pinned host copies to the device without blocking."""
    if host_rows.numel() == 0:
        return
    if host.dim() == 3:  # strided [num_blocks, rows_per_block, entry_bytes] view
        rpb = host.shape[1]
        rows = host[host_rows // rpb, host_rows % rpb]
        buffer.index_copy_(0, slots, rows.to(buffer.device, non_blocking=host.is_pinned()))
        return
    if host.device == buffer.device:
        buffer.index_copy_(0, slots, host.index_select(0, host_rows))
        return
    # Gather on the host side (into pinned staging when the host tier is pinned, so the
    # upload does not block; torch's host allocator keeps it until the copy is done).
    staging = torch.empty((host_rows.numel(), host.shape[1]), dtype=host.dtype,
                          pin_memory=host.is_pinned())
    torch.index_select(host, 0, host_rows, out=staging)
    rows = staging.to(buffer.device, non_blocking=staging.is_pinned())
    buffer.index_copy_(0, slots, rows)


def hisparse_swap_in(t: HiSparseTables, state_slots: torch.Tensor, part: int, ids: torch.Tensor,
                     host: torch.Tensor, host_rows: torch.Tensor | None, out: torch.Tensor) -> None:
    """Batched HiSparse swap-in with static shapes (see :func:`tiered_kv.kernels.hisparse_swap_in`).

    Row ``b`` is State slot ``state_slots[b]``; every tensor op here has a shape fixed by
    ``(B, k, N)``, so nothing reads device values back to the host. Where the CUDA kernel
    copies only the missed entries, this copies the host row of *every* valid position
    (a hit's slot already holds those very bytes, so rewriting it changes nothing) and
    sends padded positions to the buffer's sink row.
    """
    B, k = ids.shape
    N = t.entry_of_slot.shape[2]
    C = t.entry_of_slot.shape[1]
    dev = ids.device
    if B == 0 or k == 0:
        return
    s = state_slots
    eos = t.entry_of_slot[s, part]  # [B, N] (copies)
    lru = t.lru[s, part]  # [B, N] slots, least recently used first
    valid = ids >= 0
    pos = torch.arange(k, device=dev).expand(B, k)
    # -- duplicates: the first occurrence of an id owns it (a stable sort keeps it first)
    sid, perm = torch.sort(ids, dim=1, stable=True)
    head = torch.ones_like(sid, dtype=torch.bool)
    head[:, 1:] = sid[:, 1:] != sid[:, :-1]
    run_head = torch.cummax(torch.where(head, pos, 0), dim=1).values  # sorted pos of the run's head
    owner_sorted = perm.gather(1, run_head)  # original position of the first occurrence
    owner = torch.empty_like(perm).scatter_(1, perm, owner_sorted)  # [B, k]
    is_owner = valid & (owner == pos)
    # -- hits: look every resident entry up among the sorted ids
    q = torch.searchsorted(sid, eos).clamp_(max=k - 1)  # index guard only, checked below
    found = (eos >= 0) & (sid.gather(1, q) == eos)  # [B, N]
    slot_of = torch.full((B, k + 1), -1, dtype=torch.int64, device=dev)  # column k: sink
    slot_idx = torch.arange(N, device=dev).expand(B, N)
    slot_of.scatter_(1, torch.where(found, owner_sorted.gather(1, q), k), slot_idx)
    slot_of = slot_of[:, :k]
    miss_owner = is_owner & (slot_of < 0)
    miss_rank = torch.cumsum(miss_owner, 1) - 1
    m = miss_owner.sum(1, keepdim=True)  # [B, 1]
    # -- victims: the first m slots in LRU order that no hit uses
    free = ~found.gather(1, lru)  # [B, N] in LRU order
    rank = torch.cumsum(free, 1) - 1
    victim_by_rank = torch.full((B, N + 1), -1, dtype=torch.int64, device=dev)
    victim_by_rank.scatter_(1, torch.where(free & (rank < m), rank, N), lru)
    victim = victim_by_rank.gather(1, torch.where(miss_owner, miss_rank, N))
    slot_of = torch.where(miss_owner, victim, slot_of)
    out.copy_(torch.where(valid, slot_of.gather(1, owner), -1))
    # -- copy: host row of every valid position into its slot; padding into the sink row
    E = t.entries_per_block
    rpb = host.shape[1]
    safe = ids.clamp(min=0)  # padding reads row 0 of its block 0 (into the sink); never used
    if host_rows is None:
        hb = t.host_block[s].gather(1, safe // E)
        hb = torch.where(hb < 0, host.shape[0], hb)  # an unmapped block indexes out of range: raises
        blk, row = hb, part * E + safe % E
    else:
        r = torch.where(valid, host_rows, 0)
        blk, row = r // rpb, r % rpb
    # An id below -1 is no padding: index out of range, so it raises (a device assert on a
    # GPU) like the kernel's trap, without reading it back.
    blk = torch.where(ids < -1, host.shape[0], blk)
    # Moved as 8/4/2-byte words where the layout allows: torch's CPU index kernels work
    # element by element, so a 584-byte entry as 73 int64 words copies ~8x faster.
    host_w, flat = _as_words(host, t.buffer_rows)  # flat: [S * C * N + 1, words]
    rows = host_w[blk.to(host.device), row.to(host.device)]  # [B, k, words]
    dest = torch.where(valid, (s[:, None] * C + part) * N + out, flat.shape[0] - 1)
    flat.index_copy_(0, dest.flatten(), rows.to(flat.device).flatten(0, 1))
    # -- tables: entries of the victims, LRU order, last use, step, counters
    eos_ext = torch.cat([eos, eos.new_empty(B, 1)], 1)
    eos_ext.scatter_(1, torch.where(miss_owner, victim, N), ids)
    t.entry_of_slot[s, part] = eos_ext[:, :N]
    used_lru = ~free | (rank < m)  # [B, N] in LRU order: hit or victim
    used = torch.zeros(B, N, dtype=torch.bool, device=dev).scatter_(1, lru, used_lru)  # by slot
    n_used = used.sum(1, keepdim=True)
    u_rank = torch.cumsum(used, 1) - 1
    # new order: the unused slots in their old order, then the used ones by slot index
    dest_pos = torch.where(used_lru, N - n_used + u_rank.gather(1, lru), rank - m)
    t.lru[s, part] = torch.empty_like(lru).scatter_(1, dest_pos, lru)
    step = t.step[s, part] + 1  # [B]
    t.last_used[s, part] = torch.where(used, step[:, None], t.last_used[s, part])
    t.step[s, part] = step
    t.counters.add_(torch.stack([(is_owner & ~miss_owner).sum(), m.sum()]))


def _as_words(*ts: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``ts`` (uint8, last dim contiguous) viewed with the widest integer dtype
    whose size divides every last dim, stride, storage offset and address; as is otherwise."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if all(t.shape[-1] % size == 0 and all(st % size == 0 for st in t.stride()[:-1])
               and t.storage_offset() % size == 0 and t.data_ptr() % size == 0 for t in ts):
            return [t.view(dtype) for t in ts]
    return list(ts)
