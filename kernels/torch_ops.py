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

import torch

__all__ = ["gather_blocks", "ids_to", "scatter_blocks", "swap_in"]


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
