r"""Block gather/scatter and HiSparse swap-in kernels (installed as ``tiered_kv.kernels``).

Every op has a torch implementation (:mod:`.torch_ops`, CPU and GPU tensors) and a
CUDA one (:mod:`.cuda_ops`: CUDA C in ``*.cu``, compiled by CuPy/NVRTC at run time,
launched on torch's current stream). The functions here validate their arguments and
dispatch: ``impl="auto"`` takes CUDA when the tensors are on a CUDA device and cupy
imports, torch otherwise; ``impl="torch"`` / ``impl="cuda"`` force one (tests compare
the two).

The layout contract of the whole project — a Classical pool is a list of *parts*, and a
*block record* is one block's bytes of every part, in part order, layer-major. The
record is what goes to the host tier and, as the payload, to disk::

    parts (one block id addresses every part; a part may have 0 layers)
        part 0  CSA KV    [L0 = 21, num_blocks, E0 = 32, B0 = 584]  uint8
        part 1  indexer   [L1 = 21, num_blocks, E1 = 32, B1 = 132]  uint8
        part 2  HCA KV    [L2 = 20, num_blocks, E2 = 1,  B2 = 584]  uint8

    block record of block b, uint8 [record_bytes], record_bytes = sum_p Lp*Ep*Bp
        |<-------- part 0 --------->|<-------- part 1 --------->|<---- part 2 ---->|
        | l=0 | l=1 | ... | l=L0-1  | l=0 | l=1 | ... | l=L1-1  | l=0 | ... |l=L2-1|
           \__ part0[0, b] : [E0, B0] row-major (entry 0's B0 bytes, entry 1's, ...)

        byte (p, l, e, k)  ->  sum_{q<p} Lq*Eq*Bq  +  (l*Ep + e)*Bp  +  k

    Flash fp8: 21*32*584 + 21*32*132 + 20*1*584 = 392,448 + 88,704 + 11,680 = 492,832 B

``gather_blocks`` packs n blocks into records ``[n, record_bytes]``; ``scatter_blocks``
is its inverse; ``swap_in`` is the copy half of a HiSparse swap-in,
``buffer[slots[i]] = host[host_rows[i]]`` (on a GPU: one kernel reading pinned host
memory over UVA). Asynchrony: a copy into or out of *pinned* host memory is enqueued on
the current stream and not waited for; synchronize (or use
:class:`tiered_kv.transfer.CopyEngine`) before reading the host side.

Validation of id *values* (``check_ids=True``) reads ids to the host: it runs for ids on
the CPU, and for ids on a GPU only under ``TIERED_KV_DEBUG=1`` (there it is a device
sync, which a decode step cannot afford); an out-of-range id otherwise traps in the
CUDA kernel. ``hisparse_swap_in`` is the batched, sync-free HiSparse decode op; its
device state, :class:`HiSparseTables` (re-exported here), and the check of tensor
arguments live in :mod:`.types`, which both implementations import.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence

import torch

from . import cuda_ops, torch_ops
from .types import HiSparseTables
from .types import check_tensor as _check_tensor

__all__ = ["HiSparseTables", "Impl", "debug_checks", "gather_blocks", "hisparse_swap_in", "record_bytes",
           "scatter_blocks", "swap_in"]


#: Block copies between a GPU pool and pinned records up to this size run as one kernel
#: reading / writing host memory over UVA (small batches: no staging, one launch); larger
#: ones gather on the device and move by DMA (the copy engine's full bandwidth).
UVA_DIRECT_MAX_BYTES = 32 << 20


def debug_checks() -> bool:
    """Whether ``TIERED_KV_DEBUG=1``: then checks that read device values back to the host
    (id ranges, duplicates) run too. Off by default: on a GPU each one is a device sync,
    which a decode step (and a CUDA graph capture) cannot afford."""
    return os.environ.get("TIERED_KV_DEBUG", "") not in ("", "0")


class Impl(enum.Enum):
    """Which implementation runs an op."""

    AUTO = "auto"
    TORCH = "torch"
    CUDA = "cuda"

    @classmethod
    def parse(cls, value: str | Impl) -> Impl:
        if isinstance(value, Impl):
            return value
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"impl: expected one of 'auto', 'torch', 'cuda', got {value!r}") from None


# ---------------------------------------------------------------------- validation
def _check_parts(parts: Sequence[torch.Tensor]) -> tuple[torch.device, int]:
    """Validate pool parts; return their device and num_blocks."""
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence):
        raise TypeError(f"parts: expected a sequence of tensors, got {type(parts).__name__}")
    if len(parts) == 0:
        raise ValueError("parts: expected at least one part")
    doc = "[num_layers, num_blocks, entries, entry_bytes]"
    for i, part in enumerate(parts):
        _check_tensor(f"parts[{i}]", part, dtype=torch.uint8, ndim=4, shape_doc=doc)
    device, num_blocks = parts[0].device, parts[0].shape[1]
    for i, part in enumerate(parts[1:], start=1):
        if part.device != device:
            raise ValueError(f"parts[{i}]: expected device {device} like parts[0], got {part.device}")
        if part.shape[1] != num_blocks:
            raise ValueError(
                f"parts[{i}]: expected num_blocks {num_blocks} like parts[0] (dim 1), "
                f"got shape {list(part.shape)}"
            )
    return device, num_blocks


def _check_ids(name: str, ids: object, *, devices: tuple[torch.device, ...]) -> torch.Tensor:
    ids = _check_tensor(name, ids, dtype=torch.int64, ndim=1, shape_doc="[n]")
    if ids.device not in devices:
        allowed = " or ".join(str(d) for d in dict.fromkeys(devices))
        raise ValueError(f"{name}: expected a tensor on {allowed}, got {ids.device}")
    return ids


def _host_checkable(ids: torch.Tensor) -> bool:
    """Checks that read ``ids``' values run for CPU ids, and for device ids only under
    ``TIERED_KV_DEBUG=1`` (there each is a device sync)."""
    return ids.device.type == "cpu" or debug_checks()


def _check_range(name: str, ids: torch.Tensor, upper: int, what: str) -> None:
    if ids.numel() == 0 or not _host_checkable(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= upper:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name}: expected ids in [0, {upper}) ({what}), got {bad}")


def _check_unique(name: str, ids: torch.Tensor, why: str) -> None:
    if not _host_checkable(ids):
        return
    if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{name}: expected unique ids ({why}), got duplicates in {ids.tolist()[:16]}")


def _host_or(device: torch.device) -> tuple[torch.device, ...]:
    return (device, torch.device("cpu"))


def _select(impl: Impl, reason: str | None) -> Impl:
    if impl is Impl.AUTO:
        return Impl.CUDA if reason is None else Impl.TORCH
    if impl is Impl.CUDA and reason is not None:
        raise ValueError(f"impl='cuda': not runnable here: {reason}")
    return impl


# ------------------------------------------------------------------------- public
def record_bytes(parts: Sequence[torch.Tensor]) -> int:
    """Bytes of one block record: ``sum(L * E * B)`` over the parts ``[L, num_blocks, E, B]``."""
    _check_parts(parts)
    return sum(p.shape[0] * p.shape[2] * p.shape[3] for p in parts)


def gather_blocks(
    parts: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    impl: str | Impl = "auto",
    check_ids: bool = True,
) -> torch.Tensor:
    """Pack blocks into records: ``out[i] = record of block block_ids[i]``; returns ``out``.

    parts: ``[L_p, num_blocks, E_p, B_p] uint8`` each, one device (any strides).
    block_ids: ``[n] int64`` on the parts' device or the CPU; any order, repeats allowed.
    out: ``[n, record_bytes] uint8`` on the parts' device or the CPU (pinned or not).
    When ``out`` is pinned (and at most :data:`UVA_DIRECT_MAX_BYTES`) and the CUDA kernel
    runs, it writes the records straight into host memory over UVA: one launch for every
    segment of every block, no staging. With
    the torch implementation (or unpinned ``out``) the records are gathered into a
    device staging tensor and copied down (non-blocking when ``out`` is pinned).
    """
    impl = Impl.parse(impl)
    device, num_blocks = _check_parts(parts)
    block_ids = _check_ids("block_ids", block_ids, devices=_host_or(device))
    _check_tensor("out", out, dtype=torch.uint8, ndim=2, shape_doc="[n, record_bytes]")
    n, nbytes = block_ids.numel(), record_bytes(parts)
    if tuple(out.shape) != (n, nbytes):
        raise ValueError(
            f"out: expected shape [n={n}, record_bytes={nbytes}], got {list(out.shape)}"
            + (" (record_bytes mismatch)" if out.shape[0] == n else "")
        )
    if out.device not in _host_or(device):
        raise ValueError(f"out: expected a tensor on {device} or cpu, got {out.device}")
    if check_ids:
        _check_range("block_ids", block_ids, num_blocks, "num_blocks of the parts")

    direct = impl is not Impl.TORCH and out.device != device and out.numel() <= UVA_DIRECT_MAX_BYTES and \
        cuda_ops.unsupported_reason(parts=parts, host=out) is None
    if direct:
        cuda_ops.gather_blocks(parts, block_ids, out)
        return out
    staging = out if out.device == device else torch.empty_like(out, device=device)
    chosen = _select(impl, None if impl is Impl.TORCH else
                     cuda_ops.unsupported_reason(parts=parts, records=staging))
    if n:
        if chosen is Impl.CUDA:
            cuda_ops.gather_blocks(parts, block_ids, staging)
        else:
            torch_ops.gather_blocks(parts, torch_ops.ids_to(block_ids, device), staging)
        if staging is not out:
            out.copy_(staging, non_blocking=out.is_pinned())
    return out


def scatter_blocks(
    records: torch.Tensor,
    block_ids: torch.Tensor,
    parts: Sequence[torch.Tensor],
    *,
    impl: str | Impl = "auto",
    check_ids: bool = True,
) -> None:
    """Unpack records into blocks, the inverse of :func:`gather_blocks`.

    records: ``[n, record_bytes] uint8`` on the parts' device or the CPU (uploaded
    first, non-blocking when pinned). block_ids: ``[n] int64``, unique (two records for
    one block would race). parts: as for :func:`gather_blocks`; written in place.
    """
    impl = Impl.parse(impl)
    device, num_blocks = _check_parts(parts)
    _check_tensor("records", records, dtype=torch.uint8, ndim=2, shape_doc="[n, record_bytes]")
    block_ids = _check_ids("block_ids", block_ids, devices=_host_or(device))
    n, nbytes = block_ids.numel(), record_bytes(parts)
    if tuple(records.shape) != (n, nbytes):
        raise ValueError(
            f"records: expected shape [n={n}, record_bytes={nbytes}], got {list(records.shape)}"
            + (" (record_bytes mismatch)" if records.shape[0] == n else "")
        )
    if records.device not in _host_or(device):
        raise ValueError(f"records: expected a tensor on {device} or cpu, got {records.device}")
    if check_ids:
        _check_range("block_ids", block_ids, num_blocks, "num_blocks of the parts")
        _check_unique("block_ids", block_ids, "each block is written by one record")
    if impl is not Impl.TORCH and records.device != device and records.numel() <= UVA_DIRECT_MAX_BYTES and \
            cuda_ops.unsupported_reason(parts=parts, host=records) is None:
        if n:  # the kernel reads the pinned records over UVA: one launch, no upload
            cuda_ops.scatter_blocks(records, block_ids, parts)
        return
    if records.device != device:
        records = records.to(device, non_blocking=records.is_pinned())
    chosen = _select(impl, None if impl is Impl.TORCH else
                     cuda_ops.unsupported_reason(parts=parts, records=records))
    if n == 0:
        return
    if chosen is Impl.CUDA:
        cuda_ops.scatter_blocks(records, block_ids, parts)
    else:
        torch_ops.scatter_blocks(records, torch_ops.ids_to(block_ids, device), parts)


def swap_in(
    host: torch.Tensor,
    host_rows: torch.Tensor,
    buffer: torch.Tensor,
    slots: torch.Tensor,
    *,
    impl: str | Impl = "auto",
    check_ids: bool = True,
) -> None:
    """HiSparse swap-in copy: ``buffer[slots[i]] = host[host_rows[i]]`` for all i.

    host: ``[num_rows, entry_bytes] uint8``, the host mirror of one CSA layer (pinned
    CPU memory on a GPU machine; the CUDA kernel reads it directly over UVA, one launch
    for all rows) or a tensor on the buffer's device. It may also be a strided 3-D view
    ``[num_blocks, rows_per_block, entry_bytes]`` (e.g. the CSA part of block-contiguous
    host records, which cannot be flattened without a copy); row ``r`` is then
    ``host[r // rows_per_block, r % rows_per_block]``.
    host_rows: ``[m] int64``, repeats allowed. buffer: ``[num_slots, entry_bytes] uint8``,
    the device buffer. slots: ``[m] int64``, unique. Ids on the CPU or buffer's device.
    """
    impl = Impl.parse(impl)
    if isinstance(host, torch.Tensor) and host.dim() == 3:
        _check_tensor("host", host, dtype=torch.uint8, ndim=3,
                      shape_doc="[num_blocks, rows_per_block, entry_bytes]")
        if host.stride(2) != 1:
            raise ValueError(f"host: expected contiguous entries (stride 1 in dim 2), got strides {host.stride()}")
    else:
        _check_tensor("host", host, dtype=torch.uint8, ndim=2, shape_doc="[num_rows, entry_bytes]")
    _check_tensor("buffer", buffer, dtype=torch.uint8, ndim=2, shape_doc="[num_slots, entry_bytes]")
    device = buffer.device
    if host.device not in _host_or(device):
        raise ValueError(f"host: expected a tensor on cpu or {device} (the buffer's device), got {host.device}")
    if host.shape[-1] != buffer.shape[1]:
        raise ValueError(
            f"host: expected entry_bytes {buffer.shape[1]} like buffer, got shape {list(host.shape)}"
        )
    num_rows = host.shape[0] * host.shape[1] if host.dim() == 3 else host.shape[0]
    host_rows = _check_ids("host_rows", host_rows, devices=_host_or(device))
    slots = _check_ids("slots", slots, devices=_host_or(device))
    if host_rows.numel() != slots.numel():
        raise ValueError(
            f"slots: expected as many ids as host_rows ({host_rows.numel()}), got {slots.numel()}"
        )
    if check_ids:
        _check_range("host_rows", host_rows, num_rows, "rows of host")
        _check_range("slots", slots, buffer.shape[0], "slots of buffer")
        _check_unique("slots", slots, "each slot is written by one row")
    chosen = _select(impl, None if impl is Impl.TORCH else
                     cuda_ops.unsupported_reason(host=host, buffer=buffer))
    if host_rows.numel() == 0:
        return
    if chosen is Impl.CUDA:
        cuda_ops.swap_in(host, host_rows, buffer, slots)
    else:
        torch_ops.swap_in(host, torch_ops.ids_to(host_rows, host.device), buffer,
                           torch_ops.ids_to(slots, device))


# ------------------------------------------------------------------ HiSparse, batched
def hisparse_swap_in(
    tables: HiSparseTables,
    state_slots: torch.Tensor,
    part: int,
    ids: torch.Tensor,
    host: torch.Tensor,
    *,
    host_rows: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    impl: str | Impl = "auto",
) -> torch.Tensor:
    """Batched HiSparse swap-in of CSA layer ``part``: returns ``slots`` ``[B, k]`` int64.

    Row ``b`` serves State slot ``state_slots[b]`` (``[B]`` int64, distinct, on the
    tables' device); ``ids`` ``[B, k]`` int64 entry ids, ``-1`` = padding (slot ``-1``),
    ``k <= N``; repeats within a row share one slot and count once. Per row: ids already
    resident are hits (their slots); the rest are copied from ``host`` (the strided view
    ``[num_host_blocks, rows_per_block, entry_bytes]``, pinned CPU memory read over UVA on
    a GPU) into victims chosen LRU among the slots no hit of this step uses (empty slots
    first, ties to the lower slot), in order of first occurrence; then ``entry_of_slot``,
    ``lru``, ``last_used``, ``step`` and ``counters`` are updated. Host rows come from
    ``tables.host_block`` unless ``host_rows`` ``[B, k]`` gives them explicitly.

    ``impl='cuda'``: one kernel launch for the whole batch, no host sync, no
    data-dependent shapes (CUDA-graph capturable). ``impl='torch'``: the same algorithm
    in static-shape torch ops (no host sync when ``host`` is on the tables' device, e.g.
    on CPU). Checks of device values (id ranges) run only under ``TIERED_KV_DEBUG=1``.
    """
    impl = Impl.parse(impl)
    eos = tables.entry_of_slot
    device = eos.device
    _check_tensor("ids", ids, dtype=torch.int64, ndim=2, shape_doc="[B, k]")
    _check_tensor("state_slots", state_slots, dtype=torch.int64, ndim=1, shape_doc="[B]")
    S, C, N = eos.shape
    B, k = ids.shape
    if ids.device != device or state_slots.device != device:
        raise ValueError(f"ids, state_slots: expected tensors on {device}, got {ids.device}, {state_slots.device}")
    if state_slots.shape[0] != B:
        raise ValueError(f"state_slots: expected [B={B}] like ids, got {list(state_slots.shape)}")
    if k > N:
        raise ValueError(f"ids: expected at most device_buffer_entries = {N} ids per row, got {k}")
    if not 0 <= part < C:
        raise ValueError(f"part: expected a CSA layer index in [0, {C}), got {part}")
    if host_rows is not None:
        _check_tensor("host_rows", host_rows, dtype=torch.int64, ndim=2, shape_doc="[B, k]")
        if host_rows.shape != ids.shape or host_rows.device != device:
            raise ValueError(f"host_rows: expected [B={B}, k={k}] on {device}, got "
                             f"{list(host_rows.shape)} on {host_rows.device}")
    _check_tensor("host", host, dtype=torch.uint8, ndim=3, shape_doc="[num_host_blocks, rows_per_block, entry_bytes]")
    entry_bytes = tables.buffer_rows.shape[1]
    if host.shape[2] != entry_bytes or (entry_bytes > 1 and host.stride(2) != 1):
        raise ValueError(f"host: expected contiguous entries of {entry_bytes} B like the buffer, got shape "
                         f"{list(host.shape)} strides {host.stride()}")
    if host.device not in _host_or(device):
        raise ValueError(f"host: expected a tensor on cpu or {device}, got {host.device}")
    if out is None:
        out = torch.empty(B, k, dtype=torch.int64, device=device)
    elif out.shape != ids.shape or out.dtype != torch.int64 or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out: expected a contiguous int64 [B={B}, k={k}] tensor on {device}")
    ids, state_slots = ids.contiguous(), state_slots.contiguous()  # no-ops when already so
    host_rows = None if host_rows is None else host_rows.contiguous()
    if _host_checkable(ids) and ids.numel() and int(ids.min()) < -1:
        raise ValueError(f"ids: expected entry ids >= 0 or -1 (padding), got {int(ids.min())}")
    if debug_checks():
        _debug_check_swap(tables, state_slots, part, ids, host, host_rows)
    chosen = _select(impl, None if impl is Impl.TORCH else _swap_unsupported(tables, host))
    if B == 0 or k == 0:
        return out
    if chosen is Impl.CUDA:
        cuda_ops.hisparse_swap_in(tables, state_slots, part, ids, host, host_rows, out)
    else:
        torch_ops.hisparse_swap_in(tables, state_slots, part, ids, host, host_rows, out)
    return out


def _swap_unsupported(tables: HiSparseTables, host: torch.Tensor) -> str | None:
    """:func:`cuda_ops.unsupported_reason` for the batched swap-in, remembered per (buffer,
    host): asking whether ``host`` is pinned is a CUDA call, made once (eagerly) rather
    than on every decode step or inside a graph capture. Any N and k run on the GPU (the
    kernel's work area moves to global memory past shared memory)."""
    key = (tables.buffer_rows.data_ptr(), tables.buffer_rows.device, tables.buffer_rows.stride(),
           host.data_ptr(), host.device, tuple(host.shape), host.stride())
    if key not in _SWAP_REASONS:
        if len(_SWAP_REASONS) >= 256:
            _SWAP_REASONS.clear()
        _SWAP_REASONS[key] = cuda_ops.unsupported_reason(host=host, buffer=tables.buffer_rows)
    return _SWAP_REASONS[key]


_SWAP_REASONS: dict[tuple, str | None] = {}


def _debug_check_swap(t: HiSparseTables, state_slots: torch.Tensor, part: int, ids: torch.Tensor,
                      host: torch.Tensor, host_rows: torch.Tensor | None) -> None:
    """``TIERED_KV_DEBUG=1``: the checks that need device values (each a host sync), among
    them the invariants of the tables both implementations rely on: each row of ``lru`` is
    a permutation of the N slots, and an entry sits in at most one slot of its row."""
    S, _, N = t.entry_of_slot.shape
    _check_range("state_slots", state_slots, S, "State slots")
    _check_unique("state_slots", state_slots, "one row per request")
    if ids.numel() == 0:
        return
    if int(ids.min()) < -1:
        raise ValueError(f"ids: expected entry ids >= 0 or -1 (padding), got {int(ids.min())}")
    lru = t.lru[state_slots, part]  # [B, N]
    not_perm = (lru.sort(dim=1).values != torch.arange(N, device=lru.device)).any(dim=1)
    if bool(not_perm.any()):
        b = int(not_perm.nonzero()[0, 0])
        raise ValueError(f"tables.lru[{int(state_slots[b])}, {part}]: expected a permutation of the {N} slots "
                         f"(the LRU order), got {lru[b].tolist()[:16]}{' ...' if N > 16 else ''}")
    eos = t.entry_of_slot[state_slots, part].sort(dim=1).values  # [B, N]
    twice = (eos[:, 1:] == eos[:, :-1]) & (eos[:, 1:] >= 0)
    if bool(twice.any()):
        b, j = (int(x) for x in twice.nonzero()[0])
        raise ValueError(f"tables.entry_of_slot[{int(state_slots[b])}, {part}]: expected each entry in at most "
                         f"one slot, got entry {int(eos[b, j])} in two")
    valid = ids >= 0
    if host_rows is not None:
        _check_range("host_rows", host_rows[valid], host.shape[0] * host.shape[1], "rows of host")
        return
    E = t.entries_per_block
    blocks = (ids.clamp(min=0) // E)
    if int(blocks.max()) >= t.host_block.shape[1]:
        raise ValueError(f"ids: expected entry ids < {t.host_block.shape[1] * E}, got {int(ids.max())}")
    hb = t.host_block[state_slots].gather(1, blocks)
    bad = valid & (hb < 0)
    if bool(bad.any()):
        raise ValueError(f"ids: entry {int(ids[bad][0])} is not in a sealed block of its request "
                         "(no host record)")
