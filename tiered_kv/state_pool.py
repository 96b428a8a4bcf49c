"""The State pool: one fixed-size slot per live request, and state snapshots.

Tensors of the :class:`StatePool` (on the pool's device)::

    swa       [num_slots, num_layers, window, entry_bytes]              uint8    SWA ring
    csa_tail  [num_slots, num_csa_layers, 2, 2 * csa_ratio, 2 * head_dim]   float32
    idx_tail  [num_slots, num_csa_layers, 2, 2 * csa_ratio, 2 * indexer_dim] float32
    hca_tail  [num_slots, num_hca_layers, 2, hca_ratio, head_dim]       float32

The SWA ring holds the entry of position ``p`` at row ``p % window``. In each tail,
index 0 of the second axis is the kv rows and index 1 the score rows; a CSA / indexer
tail keeps the previous group of ``csa_ratio`` tokens in rows ``[0, r)`` and the current,
incomplete group in rows ``[r, 2r)``; an HCA tail keeps the current group.

A snapshot (the State at a resume point, a multiple of ``block_tokens``) is one
contiguous ``[snapshot_bytes]`` uint8 buffer::

    | swa ring (all of it) | csa_tail[:, :, :r, :head_dim] | idx_tail[:, :, :r, :indexer_dim] |

At such a point the current groups and the HCA tails are empty and only the first half of
the previous group's rows is read again (the CSA overlap), so nothing else is needed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from .layout import KVLayout

__all__ = ["SnapshotPool", "StatePool", "StateView"]


@dataclass(frozen=True)
class StateView:
    """Views of one slot's state (writes go to the pool)."""

    #: ``[num_layers, window, entry_bytes]`` uint8
    swa: torch.Tensor
    #: ``[num_csa_layers, 2, 2 * csa_ratio, 2 * head_dim]`` float32
    csa_tail: torch.Tensor
    #: ``[num_csa_layers, 2, 2 * csa_ratio, 2 * indexer_dim]`` float32
    idx_tail: torch.Tensor
    #: ``[num_hca_layers, 2, hca_ratio, head_dim]`` float32
    hca_tail: torch.Tensor


class StatePool:
    """Fixed-size per-request state slots with byte-exact snapshot / restore."""

    def __init__(self, layout: KVLayout, num_slots: int, device: torch.device) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_state_slots: expected a positive int, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.device = device
        L = layout
        f32 = torch.float32
        self.swa = torch.zeros(num_slots, L.num_layers, L.window, L.entry_bytes,
                               dtype=torch.uint8, device=device)
        self.csa_tail = torch.zeros(num_slots, L.num_csa_layers, *L.csa_tail_shape, dtype=f32, device=device)
        self.idx_tail = torch.zeros(num_slots, L.num_csa_layers, *L.indexer_tail_shape, dtype=f32, device=device)
        self.hca_tail = torch.zeros(num_slots, L.num_hca_layers, *L.hca_tail_shape, dtype=f32, device=device)
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()

    # ------------------------------------------------------------ allocation
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, *, zero: bool = True) -> int | None:
        """A zeroed slot, or None when every slot is taken. ``zero=False``: its contents are
        left as they are, for a caller that overwrites it whole (:meth:`restore`) or else
        calls :meth:`reset` (zeroing a Flash slot is ~15 MB of writes: once is enough)."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._used.add(slot)
        if zero:
            self.reset(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"free: state slot {slot} is not allocated (double free?)")
        self._used.remove(slot)
        self._free.append(slot)

    def _check(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot}: expected an allocated slot")

    # ----------------------------------------------------------------- views
    def view(self, slot: int) -> StateView:
        self._check(slot)
        return StateView(self.swa[slot], self.csa_tail[slot], self.idx_tail[slot], self.hca_tail[slot])

    def reset(self, slot: int) -> None:
        for t in (self.swa, self.csa_tail, self.idx_tail, self.hca_tail):
            t[slot].zero_()

    # ------------------------------------------------------- snapshot/restore
    def _overlaps(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        r, L = self.layout.csa_ratio, self.layout
        return (self.csa_tail[slot, :, :, :r, :L.head_dim], self.idx_tail[slot, :, :, :r, :L.indexer_dim])

    def snapshot(self, slot: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The slot's state at a resume point as one ``[snapshot_bytes]`` uint8 buffer.

        Only meaningful when the slot's request stands at a multiple of ``block_tokens``.
        """
        self._check(slot)
        n = self.layout.snapshot_bytes
        if out is None:
            out = torch.empty(n, dtype=torch.uint8, device=self.device)
        elif out.dtype != torch.uint8 or out.shape != (n,):
            raise ValueError(f"out: expected uint8 [{n}], got {out.dtype} {list(out.shape)}")
        pieces = [self.swa[slot], *self._overlaps(slot)]
        offset = 0
        for piece in pieces:
            nbytes = piece.numel() * piece.element_size()
            dst = out[offset:offset + nbytes]
            if (dst.data_ptr() % piece.element_size()) == 0:
                # copy the strided piece straight into its place (no temporary: a fresh
                # buffer of this size costs page faults on every snapshot)
                dst.view(piece.dtype).view(piece.shape).copy_(piece)
            else:
                dst.copy_(piece.contiguous().view(torch.uint8).reshape(-1))
            offset += nbytes
        assert offset == n, (offset, n)
        return out

    def restore(self, slot: int, snapshot: torch.Tensor) -> None:
        """Put back a snapshot taken by :meth:`snapshot`; the rest of the slot is zeroed."""
        self._check(slot)
        n = self.layout.snapshot_bytes
        if not isinstance(snapshot, torch.Tensor) or snapshot.dtype != torch.uint8 or snapshot.shape != (n,):
            got = f"{snapshot.dtype} {list(snapshot.shape)}" if isinstance(snapshot, torch.Tensor) else type(snapshot)
            raise ValueError(f"snapshot: expected a uint8 tensor [{n}], got {got}")
        for t in (self.csa_tail, self.idx_tail, self.hca_tail):  # the SWA ring is overwritten whole
            t[slot].zero_()
        snapshot = snapshot.to(self.device)
        swa = self.swa[slot]
        offset = swa.numel()
        swa.copy_(snapshot[:offset].view(swa.shape))
        for dst in self._overlaps(slot):
            nbytes = dst.numel() * dst.element_size()
            # clone() gives an aligned buffer so the byte view can be reinterpreted as fp32.
            raw = snapshot[offset:offset + nbytes].clone()
            dst.copy_(raw.view(dst.dtype).view(dst.shape))
            offset += nbytes


class SnapshotPool:
    """Device buffers for state snapshots, ``[num_snapshots, snapshot_bytes]`` uint8.

    Ids are managed by a :class:`~tiered_kv.block_pool.BlockPool` keyed by the prefix
    hash of the block that ends at the resume point, so snapshots are cached, shared and
    evicted LRU exactly like Classical blocks.
    """

    def __init__(self, layout: KVLayout, num_snapshots: int, device: torch.device) -> None:
        from .block_pool import BlockPool

        if num_snapshots <= 0:
            raise ValueError(f"num_snapshots: expected a positive int, got {num_snapshots}")
        self.layout = layout
        self.ids = BlockPool(num_snapshots)
        #: ``[num_snapshots, snapshot_bytes]`` uint8
        self.data = torch.zeros(num_snapshots, layout.snapshot_bytes, dtype=torch.uint8, device=device)
