"""Where tensors live: CUDA detection, device parsing and host-buffer allocation.

CUDA is detected once per process (:func:`cuda_available`) and every other module
asks this one instead of calling ``torch.cuda`` itself. Without CUDA the library runs
the same code on CPU tensors: host memory is unpinned, copies are synchronous and
every kernel takes its torch implementation (``docs/architecture.md`` §7).

CPU-only torch facts this module shields callers from: ``pin_memory=True`` raises,
and so do ``torch.cuda.Stream()`` and ``torch.cuda.Event()``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

__all__ = ["cuda_available", "empty_host", "pin_memory_supported", "resolve_device"]


@functools.cache
def cuda_available() -> bool:
    """Whether torch sees a usable CUDA device. Checked once, then cached; never raises."""
    try:
        return bool(torch.cuda.is_available())
    except RuntimeError:  # a broken driver install reports here rather than returning False
        return False


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse ``device`` into a concrete ``torch.device``: ``cpu`` or ``cuda:<index>``.

    ``"cuda"`` without an index resolves to the current CUDA device. Raises
    ``ValueError`` for CUDA when this process has no CUDA, for an index past the
    device count, and for any other device type.
    """
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:<index>', got {device!r}") from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")

    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device: expected a cpu or cuda device, got {dev}")
    if not cuda_available():
        raise ValueError(
            f"device: {dev} was requested but CUDA is not available in this process "
            "(CPU-only torch or no visible GPU); use device='cpu'"
        )
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device: expected a cuda index in [0, {count}), got {index}")
    return torch.device("cuda", index)


def pin_memory_supported(device: str | torch.device) -> bool:
    """Whether host buffers that feed ``device`` can be pinned (page-locked).

    True only for a CUDA ``device`` in a process with CUDA; pinning buys nothing for a
    CPU device and is impossible without a CUDA backend.
    """
    if isinstance(device, str):
        device = torch.device(device)
    return device.type == "cuda" and cuda_available()


def empty_host(
    shape_or_nbytes: int | Sequence[int] | torch.Size,
    dtype: torch.dtype = torch.uint8,
    *,
    pinned: bool,
) -> torch.Tensor:
    """Allocate an uninitialised CPU tensor, page-locked when asked for *and* possible.

    ``shape_or_nbytes``: a shape, or an int. An int is a byte count: the result is 1-D
    with ``nbytes // dtype.itemsize`` elements (``nbytes`` must be a multiple of the
    item size). ``pinned=True`` pins only when CUDA is available (so the same code runs
    on CPU-only machines); check ``result.is_pinned()`` if it matters.
    """
    if isinstance(shape_or_nbytes, bool):
        raise TypeError("shape_or_nbytes: expected an int or a sequence of ints, got bool")
    if isinstance(shape_or_nbytes, int):
        itemsize = torch.empty((), dtype=dtype).element_size()
        if shape_or_nbytes < 0 or shape_or_nbytes % itemsize:
            raise ValueError(
                f"shape_or_nbytes: expected a non-negative multiple of {itemsize} bytes "
                f"({dtype}), got {shape_or_nbytes}"
            )
        shape: tuple[int, ...] = (shape_or_nbytes // itemsize,)
    else:
        shape = tuple(int(s) for s in shape_or_nbytes)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape_or_nbytes: expected non-negative sizes, got {shape}")
    pin = pinned and cuda_available()
    return torch.empty(shape, dtype=dtype, pin_memory=pin)
