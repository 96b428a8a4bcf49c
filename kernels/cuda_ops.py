"""CUDA launchers for the block movers: CuPy-compiled kernels run on torch tensors.

The CUDA C sources (:data:`CUDA_SOURCES`) are compiled at run time by NVRTC through
``cupy.RawModule`` (once per device, cached by CuPy on disk) and launched on the raw
``data_ptr()`` of torch tensors, on torch's *current* stream, so they are ordered with
the surrounding torch work exactly like a torch op would be. ``cupy`` is imported
lazily, only on this path: importing this module never needs it.

Everything here is *below* the public API (:mod:`tiered_kv.kernels`): callers pass
validated tensors that all live on one CUDA device, block ids that are in range and,
for scatter / swap-in, free of duplicates. What is still checked here is what only
this implementation needs (:func:`unsupported_reason`: strides the kernels cannot
address, host memory the device cannot map).

How a pool part becomes kernel segments (see ``gather_scatter.cu``)::

    part [L, num_blocks, E, B] uint8, strides (sL, sN, sE, 1)

    block b, layer l  ->  one run of E*B bytes at  part + l*sL + b*sN      (sE == B)
                      ->  E runs of B bytes at     part + l*sL + b*sN + e*sE  (otherwise)
    (and the L runs merge into one when sL == E*B, e.g. a block-major view)

    segment table, int64 [num_segments, 4]:
        base = part address of the run for block 0, block_stride = sN,
        run_bytes, record_offset = where the run starts inside a block record
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from .torch_ops import ids_to

__all__ = [
    "CUDA_SOURCES",
    "KERNEL_NAMES",
    "cupy_available",
    "gather_blocks",
    "scatter_blocks",
    "segment_table",
    "swap_in",
    "unsupported_reason",
]

_HERE = Path(__file__).resolve().parent

#: Every CUDA C source of this package; each compiles standalone (``nvcc -c``).
CUDA_SOURCES: list[Path] = [_HERE / "gather_scatter.cu", _HERE / "swap_in.cu"]

#: The ``extern "C"`` kernels each source defines (the names the launchers look up).
KERNEL_NAMES: dict[str, tuple[str, ...]] = {
    "gather_scatter.cu": ("tkv_gather_blocks", "tkv_scatter_blocks"),
    "swap_in.cu": ("tkv_swap_in",),
}

_THREADS_GATHER = 256
_THREADS_SWAP = 256  # 8 warps, one row per warp
_MAX_GRID_Y = 65535
_MAX_SWAP_BLOCKS = 4096
_NVRTC_OPTIONS = ("--std=c++17",)

# cudaMemoryType values of cudaPointerAttributes.type
_MEMORY_TYPE_HOST = 1
_MEMORY_TYPE_DEVICE = 2


@functools.cache
def _cupy() -> ModuleType | None:
    try:
        import cupy
    except ImportError:
        return None
    module: ModuleType = cupy
    return module


def cupy_available() -> bool:
    """Whether ``cupy`` can be imported (checked once). It is needed for the CUDA path."""
    return _cupy() is not None


def _require_cupy() -> ModuleType:
    cupy = _cupy()
    if cupy is None:
        raise ValueError("impl='cuda': expected cupy to be importable (pip install cupy-cuda12x)")
    return cupy


# ----------------------------------------------------------------------- compiling
@functools.cache
def _kernel(source_name: str, name: str, device_index: int) -> Any:  # cupy.RawKernel
    """Compile ``source_name`` for ``device_index`` (once) and return its kernel ``name``."""
    cupy = _require_cupy()
    code = (_HERE / source_name).read_text()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=code, options=_NVRTC_OPTIONS)
        return module.get_function(name)


def _launch(device: torch.device, source_name: str, name: str, grid: tuple[int, ...],
            block: tuple[int, ...], args: tuple[Any, ...]) -> None:
    """Launch ``name`` from ``source_name`` on torch's current stream of ``device``."""
    cupy = _require_cupy()
    kernel = _kernel(source_name, name, device.index)
    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream.cuda_stream):
        kernel(grid, block, args)


def _ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's address, passed by value as a pointer argument."""
    return np.uint64(t.data_ptr())


def _i64(x: int) -> np.int64:
    return np.int64(x)


# ------------------------------------------------------------------------ segments
def segment_table(parts: Sequence[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """The kernels' view of ``parts``: one ``(base, block_stride, run_bytes, record_offset)``
    per contiguous run of a block (see the module docstring).

    ``base`` is an absolute address (``data_ptr`` + offset of the run in block 0). Pure
    Python: it runs, and is tested, without CUDA. Parts must have unit stride in their
    last dimension (:func:`unsupported_reason`).
    """
    rows: list[tuple[int, int, int, int]] = []
    record_offset = 0
    for part in parts:
        num_layers, _, entries, nbytes = part.shape
        if num_layers * entries * nbytes == 0:
            continue
        s_layer, s_block, s_entry, s_byte = part.stride()
        if s_byte != 1 and nbytes > 1:
            raise ValueError(f"parts: expected unit stride in the bytes dim, got strides {part.stride()}")
        base = part.data_ptr()
        entry_merges = entries == 1 or s_entry == nbytes
        layer_merges = entry_merges and (num_layers == 1 or s_layer == entries * nbytes)
        if layer_merges:
            rows.append((base, s_block, num_layers * entries * nbytes, record_offset))
        elif entry_merges:
            for layer in range(num_layers):
                rows.append((base + layer * s_layer, s_block, entries * nbytes,
                             record_offset + layer * entries * nbytes))
        else:
            for layer in range(num_layers):
                for entry in range(entries):
                    rows.append((base + layer * s_layer + entry * s_entry, s_block, nbytes,
                                 record_offset + (layer * entries + entry) * nbytes))
        record_offset += num_layers * entries * nbytes
    return rows


@functools.lru_cache(maxsize=64)
def _segment_tensor(rows: tuple[tuple[int, int, int, int], ...], device: torch.device) -> torch.Tensor:
    # Keyed by content, so a cached table is right for any parts with these addresses and
    # strides. A blocking copy, once per distinct pool layout.
    return torch.tensor(rows, dtype=torch.int64).to(device)


def unsupported_reason(
    *,
    parts: Sequence[torch.Tensor] = (),
    records: torch.Tensor | None = None,
    host: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
) -> str | None:
    """Why the CUDA kernels cannot run on these (validated) tensors, or ``None`` if they can.

    Needs: cupy; ``parts`` / ``records`` / ``buffer`` on a CUDA device with unit stride
    in the last dim; ``host`` on that device or in pinned CPU memory.
    """
    for name, t in [*((f"parts[{i}]", p) for i, p in enumerate(parts)),
                    ("records", records), ("buffer", buffer)]:
        if t is None:
            continue
        if t.device.type != "cuda":
            return f"{name} is on {t.device}, expected a cuda device"
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            return f"{name} has strides {t.stride()}, expected unit stride in the last dim"
    if host is not None:
        if host.device.type == "cpu" and not host.is_pinned():
            return "host is unpinned CPU memory, expected pinned memory or a cuda tensor"
        if host.shape[-1] > 1 and host.stride(-1) != 1:
            return f"host has strides {host.stride()}, expected unit stride in the last dim"
    if not cupy_available():  # last: never import cupy for tensors it could not take
        return "cupy is not importable"
    return None


# ------------------------------------------------------------------------ launchers
def _block_copy(kernel_name: str, parts: Sequence[torch.Tensor], block_ids: torch.Tensor,
                records: torch.Tensor) -> None:
    n = block_ids.numel()
    rows = tuple(segment_table(parts))
    if n == 0 or not rows:
        return
    device = records.device
    seg = _segment_tensor(rows, device)
    ids = ids_to(block_ids, device)
    grid = (len(rows), min(n, _MAX_GRID_Y))
    args = (_ptr(seg), _ptr(ids), _i64(n), _i64(parts[0].shape[1]), _ptr(records),
            _i64(records.stride(0)))
    _launch(device, "gather_scatter.cu", kernel_name, grid, (_THREADS_GATHER,), args)
    # `ids` was allocated on this stream, so the caching allocator reuses it only after
    # the kernel. The cached `seg` may be evicted while a kernel on another stream still
    # reads it: tell the allocator about every stream that uses it.
    seg.record_stream(torch.cuda.current_stream(device))


def gather_blocks(parts: Sequence[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor) -> None:
    """``out[i] = record of block block_ids[i]``; parts and out on one CUDA device."""
    _block_copy("tkv_gather_blocks", parts, block_ids, out)


def scatter_blocks(records: torch.Tensor, block_ids: torch.Tensor,
                   parts: Sequence[torch.Tensor]) -> None:
    """Block ``block_ids[i]`` of every part = ``records[i]``; ids unique."""
    _block_copy("tkv_scatter_blocks", parts, block_ids, records)


def _device_address(host: torch.Tensor, device: torch.device) -> int:
    """Address under which ``device`` reads ``host`` (pinned CPU memory or device memory)."""
    if host.device.type == "cuda":
        return host.data_ptr()
    cupy = _require_cupy()
    with cupy.cuda.Device(device.index):
        attrs = cupy.cuda.runtime.pointerGetAttributes(host.data_ptr())
    if attrs.type != _MEMORY_TYPE_HOST or attrs.devicePointer == 0:
        raise ValueError(
            "host: expected page-locked memory mapped into the device address space "
            f"(torch pin_memory), got cudaMemoryType {attrs.type}"
        )
    # Under unified addressing this equals data_ptr(); the lookup also covers memory
    # registered with cudaHostRegister on platforms where the two differ.
    return int(attrs.devicePointer)


def swap_in(host: torch.Tensor, host_rows: torch.Tensor, buffer: torch.Tensor,
            slots: torch.Tensor) -> None:
    """``buffer[slots[i]] = host[host_rows[i]]`` in one launch; ``host`` read over UVA."""
    m = host_rows.numel()
    entry_bytes = buffer.shape[1]
    if m == 0 or entry_bytes == 0:
        return
    device = buffer.device
    rows = ids_to(host_rows, device)
    dst = ids_to(slots, device)
    warps_per_block = _THREADS_SWAP // 32
    grid = (min(-(-m // warps_per_block), _MAX_SWAP_BLOCKS),)
    if host.dim() == 3:  # [num_blocks, rows_per_block, entry_bytes], any block stride
        block_stride, rows_per_block, row_stride = host.stride(0), host.shape[1], host.stride(1)
        num_rows = host.shape[0] * host.shape[1]
    else:
        block_stride, rows_per_block, row_stride, num_rows = 0, max(host.shape[0], 1), host.stride(0), host.shape[0]
    args = (np.uint64(_device_address(host, device)), _i64(block_stride), _i64(rows_per_block),
            _i64(row_stride), _i64(num_rows),
            _ptr(rows), _ptr(buffer), _i64(buffer.stride(0)), _i64(buffer.shape[0]), _ptr(dst),
            _i64(m), _i64(entry_bytes))
    _launch(device, "swap_in.cu", "tkv_swap_in", grid, (_THREADS_SWAP,), args)
