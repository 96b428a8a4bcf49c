"""Types of the kernels' arguments and their checks (installed as ``tiered_kv.kernels.types``).

:class:`HiSparseTables` is the device-resident state of the batched HiSparse swap-in,
checked once when it is made; both implementations (:mod:`.torch_ops`, :mod:`.cuda_ops`)
address it by the layout checked here. It lives apart from the ops of
``tiered_kv.kernels`` so that the implementations can name it without importing the
package that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HiSparseTables", "check_tensor"]


def check_tensor(name: str, t: object, *, dtype: torch.dtype, ndim: int, shape_doc: str) -> torch.Tensor:
    """``t`` if it is a ``ndim``-D tensor of ``dtype`` (else TypeError / ValueError naming
    ``name`` and ``shape_doc``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {shape_doc} {dtype}, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim}-D {shape_doc}, got shape {list(t.shape)}")
    return t


@dataclass(frozen=True, kw_only=True, slots=True)
class HiSparseTables:
    """The device-resident state of HiSparse swap-in (all on one device, all static).

    ``S`` State slots, ``C`` CSA layers, ``N`` buffer slots per (State slot, layer)::

        buffer_rows    [S * C * N + 1, entry_bytes] uint8  the buffers, row (s*C + c)*N + slot;
                                                            the last row is a sink for padding
        entry_of_slot  [S, C, N] int64   entry id held by each slot, -1 empty
        last_used      [S, C, N] int64   step of last use, -1 never
        lru            [S, C, N] int64   a permutation of the slots, least recently used
                                         first (ties: lower slot first), i.e. the stable
                                         argsort of ``last_used``
        step           [S, C]    int64   swap-ins so far of each (State slot, layer)
        host_block     [S, max_blocks] int64  host record of each sealed block, -1 none
        counters       [2]       int64   hits, misses (unique ids) accumulated
        entries_per_block  E: CSA entries per block (host row of entry j of layer c in
                       record hb: ``c * E + j % E`` of ``host[hb]``)
    """

    buffer_rows: torch.Tensor
    entry_of_slot: torch.Tensor
    last_used: torch.Tensor
    lru: torch.Tensor
    step: torch.Tensor
    host_block: torch.Tensor
    counters: torch.Tensor
    entries_per_block: int

    def __post_init__(self) -> None:
        """Check, once, the layout both implementations address the tables by: contiguous
        int64 tables on one device (the kernel indexes ``(s * C + c) * N + slot``), uint8
        buffer rows with unit stride in the bytes (their row stride may exceed the entry
        size: a padded row is copied for its entry size only)."""
        eos = check_tensor("entry_of_slot", self.entry_of_slot, dtype=torch.int64, ndim=3, shape_doc="[S, C, N]")
        S, C, N = eos.shape
        device = eos.device
        for name, t, shape in [("entry_of_slot", eos, (S, C, N)), ("last_used", self.last_used, (S, C, N)),
                               ("lru", self.lru, (S, C, N)), ("step", self.step, (S, C)),
                               ("host_block", self.host_block, (S, None)), ("counters", self.counters, (2,))]:
            check_tensor(name, t, dtype=torch.int64, ndim=len(shape), shape_doc=str(list(shape)))
            if any(want is not None and got != want for got, want in zip(t.shape, shape)) or t.device != device:
                raise ValueError(f"{name}: expected shape {list(shape)} (None: any) on {device} like entry_of_slot, "
                                 f"got {list(t.shape)} on {t.device}")
            if not t.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor, got strides {t.stride()}")
        rows = check_tensor("buffer_rows", self.buffer_rows, dtype=torch.uint8, ndim=2,
                             shape_doc="[S * C * N + 1, entry_bytes]")
        if rows.shape[0] != S * C * N + 1 or rows.device != device:
            raise ValueError(f"buffer_rows: expected [S * C * N + 1 = {S * C * N + 1}, entry_bytes] on {device}, "
                             f"got {list(rows.shape)} on {rows.device}")
        if rows.shape[1] > 1 and rows.stride(1) != 1:
            raise ValueError(f"buffer_rows: expected unit stride in the bytes dim, got strides {rows.stride()}")
        if rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]:
            raise ValueError(f"buffer_rows: expected rows that do not overlap (row stride >= {rows.shape[1]} "
                             f"entry bytes), got strides {rows.stride()}")
        if isinstance(self.entries_per_block, bool) or not isinstance(self.entries_per_block, int) or \
                self.entries_per_block < 1:
            raise ValueError(f"entries_per_block: expected an int >= 1, got {self.entries_per_block!r}")
