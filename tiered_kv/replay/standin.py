"""A scaled stand-in layout: the target model's block and snapshot bytes, divided by one factor.

A full trace through a DeepSeek-V4-Flash cache of 40 GB HBM, 512 GB host and 4 TB disk
does not fit a 2-core test machine, and needs not: what the tiers decide (what fits,
what is evicted, what is resumable) depends on the number of blocks and snapshots each
tier holds, i.e. on ``block_bytes`` and ``snapshot_bytes`` relative to the capacities.
:func:`stand_in` returns a :class:`KVLayout` with the model's ``block_tokens`` whose
block and snapshot are the model's divided by the same ``scale``; the replay divides
every capacity by ``scale`` too, so each tier holds exactly as many blocks and snapshots
as it would at full size, and reports bytes multiplied back.

The stand-in's shape is chosen for its byte counts only (no model runs): one CSA and one
HCA layer with one fp32 value per entry, both compressing a whole block into one entry
(``csa_ratio = hca_ratio = block_tokens``), so that::

    block_bytes    = 4 (CSA entry) + indexer_bytes + 4 (HCA entry)
    snapshot_bytes = 2 layers * window * 4 (SWA ring) + 16 * block_tokens (CSA overlap rows)

``indexer_bytes`` and ``window`` are solved for. The scale is the largest divisor of
``gcd(block_bytes, snapshot_bytes)`` for which both equations have a solution: for V4-Flash
at 512-token blocks that is 128 (1,971,328 B / 3,644,416 B -> 15,401 B / 28,472 B,
exactly), for V4-Pro 326 (2,821,856 / 5,174,272 -> 8,656 / 15,872). A model whose block
is already small (the ``tiny`` preset) runs as itself (scale 1). A scale may also be
forced; where it divides neither size exactly the snapshot is rounded and
:attr:`StandIn.snapshot_ratio_error` says by how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..layout import EntryFormat, KVLayout, LayerKind

__all__ = ["StandIn", "stand_in"]

#: A model whose block is at most this many bytes runs as itself.
SMALL_BLOCK_BYTES = 64 << 10


@dataclass(frozen=True, kw_only=True, slots=True)
class StandIn:
    """The target model's layout and the layout the replay's cache runs."""

    #: the target model, at the trace's block size
    model: KVLayout
    #: what the cache runs: ``model``'s bytes divided by ``scale``
    layout: KVLayout
    #: model bytes per stand-in byte (exact for blocks)
    scale: int

    @property
    def exact(self) -> bool:
        """Blocks and snapshots both scaled by exactly ``scale``."""
        return (self.layout.block_bytes * self.scale == self.model.block_bytes
                and self.layout.snapshot_bytes * self.scale == self.model.snapshot_bytes)

    @property
    def snapshot_ratio_error(self) -> float:
        """Relative error of the stand-in's snapshot : block byte ratio (0.0 when exact)."""
        want = self.model.snapshot_bytes / self.model.block_bytes
        got = self.layout.snapshot_bytes / self.layout.block_bytes
        return got / want - 1.0

    def describe(self) -> str:
        m, s = self.model, self.layout
        how = "exact" if self.exact else f"snapshot:block ratio off by {100 * self.snapshot_ratio_error:+.3f} %"
        return (f"{m.name} at {m.block_tokens}-token blocks: block {m.block_bytes:,} B, snapshot "
                f"{m.snapshot_bytes:,} B; stand-in 1/{self.scale}: block {s.block_bytes:,} B, snapshot "
                f"{s.snapshot_bytes:,} B ({how})")


def stand_in(model: KVLayout, *, scale: int | None = None) -> StandIn:
    """The stand-in of ``model`` (see the module docstring). ``scale``: force this factor."""
    if not isinstance(model, KVLayout):
        raise TypeError(f"model: expected a KVLayout, got {type(model).__name__}")
    B, S, bt = model.block_bytes, model.snapshot_bytes, model.block_tokens
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
            raise ValueError(f"scale: expected a positive int, got {scale!r}")
        if scale == 1:
            return StandIn(model=model, layout=model, scale=1)
        layout = _solve(model, B // scale, S / scale, rounding=True)
        if layout is None:
            raise ValueError(f"scale: {scale} leaves a block of {B // scale} B and a snapshot of {S // scale} B; "
                             f"a stand-in needs a block of at least 9 B and a snapshot above "
                             f"{16 * bt + 8} B (16 * block_tokens + 8): use a smaller scale")
        return StandIn(model=model, layout=layout, scale=scale)
    if B <= SMALL_BLOCK_BYTES:
        return StandIn(model=model, layout=model, scale=1)
    g = math.gcd(B, S)
    for s in sorted(_divisors(g), reverse=True):
        layout = _solve(model, B // s, S // s, rounding=False)
        if layout is not None:
            return StandIn(model=model, layout=layout, scale=s)
    raise AssertionError(f"no stand-in for {model.name}: scale 1 always solves")  # pragma: no cover


def _solve(model: KVLayout, block: int, snapshot: float, *, rounding: bool) -> KVLayout | None:
    """The stand-in layout with ``block`` bytes per block and ``snapshot`` bytes per
    snapshot (rounded to the nearest reachable size when ``rounding``), or None."""
    bt = model.block_tokens
    ib = block - 8
    swa = snapshot - 16 * bt  # = 2 layers * window * 4 B
    if ib < 1 or swa < 8:
        return None
    if rounding:
        window = max(1, round(swa / 8))
    elif swa % 8:
        return None
    else:
        window = int(swa) // 8
    return KVLayout(name=f"{model.name}-standin", layer_kinds=(LayerKind.CSA, LayerKind.HCA),
                    entry_format=EntryFormat.FP32, head_dim=1, indexer_dim=1, indexer_bytes=ib, window=window,
                    csa_ratio=bt, hca_ratio=bt, block_tokens=bt, top_k=1)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
