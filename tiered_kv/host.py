"""The host tier: pinned CPU memory holding block records and state snapshots.

Two fixed-size slabs, each with its own :class:`~tiered_kv.block_pool.BlockPool`
(refcounts, hash map, LRU) and together bounded by ``host_bytes``::

    records    [num_host_blocks, block_bytes]        uint8  block-contiguous records
    snapshots  [num_host_snapshots, snapshot_bytes]  uint8

A record is a block in its disk form (parts ``csa_kv | indexer | hca_kv``, layer-major;
see :mod:`tiered_kv.kernels`). It serves two roles:

* **L2 for Classical blocks**: a block evicted from the GPU pool is kept here, so an
  ``open()`` that hits it loads from host instead of recomputing.
* **HiSparse mirror**: with HiSparse on, a sealed block's CSA part lives only here; the
  GPU keeps its indexer keys and HCA entries. :meth:`HostTier.csa_rows` views the CSA
  parts as ``[num_host_blocks, num_csa_layers * E, entry_bytes]`` for swap-in.

Memory is pinned when the cache's device is a GPU (so copies are async DMA and the
swap-in kernel can read it over UVA) and plain otherwise.
"""

from __future__ import annotations

import torch

from .block_pool import BlockPool
from .device import empty_host, pin_memory_supported
from .layout import KVLayout

__all__ = ["HostTier"]


class HostTier:
    """Block records and snapshots in (pinned) host memory, keyed by prefix hash.

    Args:
        layout: the KV layout.
        host_bytes: byte capacity of both slabs together.
        device: the GPU tier's device (memory is pinned for a CUDA device).
        snapshot_fraction: share of ``host_bytes`` given to snapshots.
        leaf_first: the record pool evicts leaves first (the ``leaf-lru`` policy).
        small_fraction: the record pool's small queue (the ``leaf-s3fifo`` policy; None:
            one LRU).
    """

    def __init__(self, layout: KVLayout, host_bytes: int, device: torch.device, *,
                 snapshot_fraction: float = 0.25, leaf_first: bool = False,
                 small_fraction: float | None = None) -> None:
        if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
            raise ValueError(f"host_bytes: expected a positive int, got {host_bytes!r}")
        if not 0.0 <= snapshot_fraction < 1.0:
            raise ValueError(f"snapshot_fraction: expected a float in [0, 1), got {snapshot_fraction}")
        self.layout = layout
        self.host_bytes = host_bytes
        num_snaps = int(host_bytes * snapshot_fraction) // layout.snapshot_bytes
        num_blocks = (host_bytes - num_snaps * layout.snapshot_bytes) // layout.block_bytes
        if num_blocks < 1:
            raise ValueError(f"host_bytes: expected at least one block record "
                             f"({layout.block_bytes} B) after snapshots, got {host_bytes}")
        self.pinned = pin_memory_supported(device)
        #: ``[num_host_blocks, block_bytes]`` uint8
        self.records = empty_host((num_blocks, layout.block_bytes), pinned=self.pinned)
        self.blocks = BlockPool(num_blocks, leaf_first=leaf_first, small_fraction=small_fraction)
        #: ``[num_host_snapshots, snapshot_bytes]`` uint8 (may have 0 rows)
        self.snapshot_data = empty_host((num_snaps, layout.snapshot_bytes), pinned=self.pinned)
        self.snapshots: BlockPool | None = BlockPool(num_snaps) if num_snaps else None

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_snapshots(self) -> int:
        return 0 if self.snapshots is None else self.snapshots.num_blocks

    @property
    def nbytes(self) -> int:
        return self.records.numel() + self.snapshot_data.numel()

    def csa_rows(self) -> torch.Tensor:
        """CSA entries of every record: ``[num_host_blocks, num_csa_layers * E, entry_bytes]``.

        Row ``c * E + e`` of block ``hb`` is entry ``e`` of CSA layer ``c`` (a view).
        """
        L = self.layout
        return self.records[:, :L.csa_kv_block_bytes].view(
            self.num_blocks, L.num_csa_layers * L.csa_entries_per_block, L.entry_bytes)

    def put_snapshot(self, h: bytes, data: torch.Tensor) -> bool:
        """Keep a copy of snapshot ``data`` (``[snapshot_bytes]`` uint8) under ``h``.

        Returns False when there is no room (every slot referenced) or no snapshot slab.
        """
        if self.snapshots is None:
            return False
        if self.snapshots.lookup(h) is not None:
            return True
        sid = self.snapshots.allocate()
        if sid is None:
            return False
        self.snapshot_data[sid].copy_(data)
        self.snapshots.cache(sid, h)
        self.snapshots.free(sid)
        return True

    def lookup_snapshot(self, h: bytes) -> torch.Tensor | None:
        """The host copy of snapshot ``h`` (a view; LRU refreshed) or None."""
        if self.snapshots is None:
            return None
        sid = self.snapshots.lookup(h)
        if sid is None:
            return None
        self.snapshots.incref(sid)
        self.snapshots.free(sid)
        return self.snapshot_data[sid]

    def stats(self) -> dict[str, int]:
        s = {
            "host_bytes": self.nbytes,
            "host_blocks_total": self.blocks.num_blocks,
            "host_blocks_cached": self.blocks.num_cached,
            "host_blocks_used": self.blocks.num_used,
            "host_blocks_evicted": self.blocks.evictions,
            "host_blocks_stranding_evictions": self.blocks.stranding_evictions,
            "host_snapshots_total": self.num_snapshots,
            "host_snapshots_cached": 0 if self.snapshots is None else self.snapshots.num_cached,
            "host_snapshots_evicted": 0 if self.snapshots is None else self.snapshots.evictions,
        }
        return s
