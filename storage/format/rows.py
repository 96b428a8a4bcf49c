"""Row scatter plans: where the payloads of a batch of records land in a few large buffers.

A cache's CPU pools hold a block as one row per layer of each part (62 rows of 0.6-18 KiB
for a DeepSeek-V4-Flash block). Reading a record straight into its block means a scatter
list of those rows; made of one buffer object per row, that is ~8,000 numpy views for a
16K-token prompt, each made and then taken apart again (``PyObject_GetBuffer``) on every
read. A :class:`RowScatter` says the same with four integer arrays, built with numpy in a
few steps for the whole batch::

    payload of record k:  | piece 0 | piece 1 | ... | piece m-1 |   (lengths[j] bytes each)
                               |         |                |
                               v         v                v
    dests[dest_of[j]] at byte offsets[k, j]

:meth:`~tiered_kv.storage.lmdb_store.LmdbStore.get_rows` reads and verifies such a batch
natively (``read_verify_rows`` in ``_fastread.c``, which checks every piece lies within its
buffer before reading); every store also takes it through
:meth:`~tiered_kv.storage.api.store.BlockStore.get_rows`, as a scatter list per record
(:meth:`RowScatter.out_segments`) read by ``get_many``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .record import OutSegments

__all__ = ["RowScatter"]


@dataclass(frozen=True, slots=True)
class RowScatter:
    """The destinations of ``n`` records' payloads, each cut into the same ``m`` pieces.

    ``dests``: writable 1-D C-contiguous uint8 arrays. ``dest_of``: ``[m] int64``, the dest
    of piece j. ``lengths``: ``[m] int64``, its bytes (the same for every record; they add
    up to the payload size). ``offsets``: ``[n, m] int64``, where piece j of record k starts
    in its dest.
    """

    dests: tuple[np.ndarray, ...]
    dest_of: np.ndarray
    lengths: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        for i, d in enumerate(self.dests):
            if d.dtype != np.uint8 or d.ndim != 1 or not d.flags.c_contiguous or not d.flags.writeable:
                raise ValueError(f"dests[{i}]: expected a writable 1-D C-contiguous uint8 array, got "
                                 f"{d.dtype} {d.shape} (contiguous {d.flags.c_contiguous}, "
                                 f"writable {d.flags.writeable})")
        m = self.lengths.shape[0] if self.lengths.ndim == 1 else -1
        for name, a, shape in (("dest_of", self.dest_of, (m,)), ("lengths", self.lengths, (m,)),
                               ("offsets", self.offsets, (self.offsets.shape[0], m))):
            if a.dtype != np.int64 or a.shape != shape or m < 1:
                raise ValueError(f"{name}: expected int64 {shape} (m >= 1 pieces), got {a.dtype} {a.shape}")
        if self.dest_of.size and (self.dest_of.min() < 0 or self.dest_of.max() >= len(self.dests)):
            raise ValueError(f"dest_of: expected indices into dests (0..{len(self.dests) - 1})")
        if (self.lengths < 0).any():
            raise ValueError("lengths: expected byte counts >= 0")
        if self.offsets.size:
            sizes = np.array([d.nbytes for d in self.dests], np.int64)[self.dest_of]
            if (self.offsets < 0).any() or (self.offsets > sizes - self.lengths).any():
                raise ValueError("offsets: expected every piece within its dest")

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    @property
    def nbytes(self) -> int:
        """Payload bytes of one record."""
        return int(self.lengths.sum())

    def take(self, index: Sequence[int] | np.ndarray | slice) -> RowScatter:
        """The plan of the records ``index`` selects (in that order)."""
        return RowScatter(self.dests, self.dest_of, self.lengths, np.ascontiguousarray(self.offsets[index]))

    def out_segments(self) -> list[OutSegments]:
        """Each record's destination as a scatter list of views (for a plain ``get_many``)."""
        nbytes = self.nbytes
        ends = self.offsets + self.lengths
        return [OutSegments([self.dests[d][a:b] for d, a, b in zip(self.dest_of.tolist(), starts, stops)], nbytes)
                for starts, stops in zip(self.offsets.tolist(), ends.tolist())]
