"""The batched write path: completed CSA / HCA entries of several layers and requests
scattered into the Classical pool with one device copy per pool part.

:meth:`TieredKVCache.write_csa` and :meth:`~TieredKVCache.write_hca` are thin front ends
over :class:`EntryWriter`. Destination of entry ``j`` of request ``i`` in layer part ``p``
(``E`` entries per block, ``NB`` blocks in the part)::

    pool  [num_parts, NB, E, nbytes]   viewed flat as   [num_parts * NB * E, nbytes]
    row = (p * NB + block_table[slot_i, j // E]) * E + j % E

With HiSparse the CSA KV part has one *open* block per State slot (sealed blocks' CSA
entries live in the host tier): there the "block" is the request's State slot, and only
entries of the open block are writable.

Everything that decides where bytes go runs on the host — from host entry ids and the
block tables' host mirror (:class:`~tiered_kv.block_table.BlockTables`) — so a write reads
no device value and never synchronizes. The bytes then move in one device op per part:
a strided slice copy when the batch is one contiguous run of entries in one block and
the layers are consecutive parts (a request's prefill segment or decode step), else an
``index_copy_`` of flat rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from .layout import KVLayout, LayerKind

if TYPE_CHECKING:
    from .block_table import BlockTables
    from .request import Request

__all__ = ["EntryWriter", "PartSet", "Placement", "host_entry_ids", "host_entry_list"]


def host_entry_ids(what: str, ids: object, ndim: int) -> np.ndarray:
    """Entry ids as an ``ndim``-D int64 numpy array, read on the host.

    Host tensors, numpy arrays and (nested) lists are read in place; a device tensor is
    copied to the host first (a synchronization: pass host ids on a hot path).
    """
    if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.is_cpu and ids.dim() == ndim:
        return ids.numpy()  # the common case (host int64 ids), checked in four attribute reads
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != ndim:
            raise ValueError(f"{what}: expected a {ndim}-D int64 tensor of entry ids, "
                             f"got {ids.dtype} {list(ids.shape)}")
        if ids.device.type != "cpu":
            ids = ids.cpu()
        arr = ids.numpy()
    else:
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.ndim != ndim or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{what}: expected a {ndim}-D int64 tensor of entry ids, "
                             f"got {arr.dtype} {list(arr.shape)}")
    return arr.astype(np.int64, copy=False)


def host_entry_list(ids: object) -> list[int] | None:
    """The ids of a host int64 ``[m]`` tensor as a list (one C call: no numpy array, which
    costs more than the list on this hot path, made per write), or None for any other ids
    (then :func:`host_entry_ids` reads them, and refuses what it must)."""
    if type(ids) is torch.Tensor and ids.dtype is torch.int64 and ids.is_cpu and ids.dim() == 1:
        return ids.tolist()
    return None


@dataclass(frozen=True, slots=True)
class PartSet:
    """Layers of one kind a write covers, as their rows in the pool part."""

    #: ``[n]`` int64 part index of each layer, in the caller's order.
    parts: np.ndarray
    #: ``parts[0]`` when the parts are consecutive (``parts == arange(start, start + n)``), else None.
    start: int | None
    #: Whether the caller passed a sequence of layers (then kv has a leading layer axis).
    batched: bool

    @classmethod
    def of(cls, parts: Sequence[int], batched: bool) -> PartSet:
        arr = np.asarray(parts, dtype=np.int64)
        consecutive = arr.size > 0 and bool((arr == np.arange(arr[0], arr[0] + arr.size)).all())
        return cls(arr, int(arr[0]) if consecutive else None, batched)


#: Above this many runs a CPU write uses one ``index_copy_`` instead of a copy per run.
_MAX_RUNS = 64


class Run(NamedTuple):
    """``count`` entries with consecutive offsets in one block, from consecutive source
    positions: the unit one strided slice copy moves (all layers at once). (A NamedTuple:
    immutable, and made in a third of a frozen dataclass's time, on every write.)"""

    block: int
    slot: int
    offset: int
    src: int
    count: int


class Placement(NamedTuple):
    """Where the valid entries of a ``[B, m]`` batch of entry ids go, row-major.

    ``runs`` describes them (empty when there are more than ``_MAX_RUNS``); the per-entry
    arrays are None for a single run found by the one-request fast path and built on
    demand (:meth:`arrays`) when a write needs flat rows. (A NamedTuple, as :class:`Run`.)
    """

    #: Valid entries.
    size: int
    runs: list[Run]
    #: ``[M]`` int64 Classical block / offset in it / owning State slot of each valid entry.
    blocks: np.ndarray | None = None
    offsets: np.ndarray | None = None
    slots: np.ndarray | None = None
    #: ``[M]`` int64 flat indices (into ``B * m``) of the valid entries; None if all are.
    select: np.ndarray | None = None

    def arrays(self, by_slot: bool) -> tuple[np.ndarray, np.ndarray]:
        """(block or, with ``by_slot``, State slot of each entry; offsets), as ``[M]`` int64."""
        if self.blocks is None:
            (run,) = self.runs
            where = run.slot if by_slot else run.block
            return np.full(self.size, where, dtype=np.int64), np.arange(run.offset, run.offset + run.count)
        assert self.offsets is not None and self.slots is not None
        return (self.slots if by_slot else self.blocks), self.offsets


class EntryWriter:
    """Validates entry ids against the requests' block tables and scatters the bytes."""

    def __init__(self, layout: KVLayout, tables: BlockTables) -> None:
        self.layout = layout
        self.tables = tables
        self._part_of = {kind: {layer: p for p, layer in enumerate(layers)}
                         for kind, layers in ((LayerKind.CSA, layout.csa_layers), (LayerKind.HCA, layout.hca_layers))}
        self._partsets: dict[tuple[LayerKind, tuple[int, ...]], PartSet] = {}
        #: per kind, the last tuple of layers asked for and its parts (held: its id stays its own)
        self._recent: dict[LayerKind, tuple[tuple[int, ...], PartSet]] = {}
        self._single = {kind: {layer: PartSet(np.array([p], dtype=np.int64), p, False) for layer, p in parts.items()}
                        for kind, parts in self._part_of.items()}

    # --------------------------------------------------------------- layers
    def part_set(self, kind: LayerKind, layers: int | Sequence[int]) -> PartSet | None:
        """The parts of ``layers`` (an int or a sequence of ints), or None if any is not
        a ``kind`` layer (the caller then raises its own, precise error)."""
        if isinstance(layers, int) and not isinstance(layers, bool):
            return self._single[kind].get(layers)
        recent = self._recent.get(kind)
        if recent is not None and recent[0] is layers:  # the same tuple as last time (e.g. the
            return recent[1]                            # layout's csa_layers): no re-hashing
        part_of = self._part_of[kind]
        key = (kind, tuple(layers))
        found = self._partsets.get(key)
        if found is None:
            if not key[1] or any(isinstance(x, bool) or x not in part_of for x in key[1]):
                return None
            found = self._partsets[key] = PartSet.of([part_of[x] for x in key[1]], True)
        if type(layers) is tuple:  # (immutable: its identity names its contents while it is held here)
            self._recent[kind] = (layers, found)
        return found

    # ------------------------------------------------------------ placement
    def place(self, reqs: Sequence[Request], ids: np.ndarray, per_block: int, *, padded: bool) -> Placement:
        """Check ``ids`` ``[B, m]`` (row i: entry ids of ``reqs[i]``; ``-1`` = padding when
        ``padded``) and locate them. Entries must lie in the requests' unsealed blocks."""
        B, m = ids.shape
        if B == 1 and m:  # one request: most often one run of consecutive ids in one block
            place = self.place_run(reqs[0], ids[0].tolist(), per_block)
            if place is not None:
                return place
        return self._place_many(reqs, ids, per_block, padded)

    def place_run(self, req: Request, row: list[int], per_block: int) -> Placement | None:
        """:meth:`place` of one request's ids ``row`` (a list) when they are one run of
        consecutive ids in one of its unsealed blocks (raises if that block is sealed);
        None for any other ids (then :meth:`place` decides, or refuses them)."""
        if not row:
            return None
        first = row[0]
        m = len(row)
        if m == 1 or row == list(range(first, first + m)):
            k = first // per_block
            if first >= 0 and k == (first + m - 1) // per_block and k < len(req.block_ids):
                if k < req.num_sealed_blocks:
                    self._sealed_error(req, k)
                return Placement(m, [Run(req.block_ids[k], req.slot, first % per_block, 0, m)])
        return None

    def _place_many(self, reqs: Sequence[Request], ids: np.ndarray, per_block: int, padded: bool) -> Placement:
        B, m = ids.shape
        E = per_block
        slots = np.fromiter((r.slot for r in reqs), dtype=np.int64, count=B)
        sealed = np.fromiter((r.num_sealed_blocks for r in reqs), dtype=np.int64, count=B)
        limit = self.tables.lengths[slots] * E  # [B] entries the requests' blocks hold
        valid = ids >= 0 if padded else None
        lowest = -1 if padded else 0
        if ids.size and (ids.min() < lowest or (ids >= limit[:, None]).any()):
            self._range_error(reqs, ids, limit, valid, padded)
        bidx = ids // E
        is_sealed = bidx < sealed[:, None]
        if valid is not None:
            is_sealed &= valid
        if is_sealed.any():
            i = int(is_sealed.any(1).argmax())
            self._sealed_error(reqs[i], int(bidx[i][is_sealed[i]].min()))
        blocks = self.tables.host[slots[:, None], bidx].astype(np.int64).reshape(-1)
        offsets = (ids % E).reshape(-1)
        row_slots = np.repeat(slots, m)
        src = None
        if valid is not None and not valid.all():
            src = np.flatnonzero(valid)
            blocks, offsets, row_slots = blocks[src], offsets[src], row_slots[src]
        self._check_no_overlap(reqs, ids, blocks * E + offsets, src)
        # runs: break where the block, the slot, the offset or the source position jumps
        pos = np.arange(blocks.size) if src is None else src
        brk = np.flatnonzero((np.diff(blocks) != 0) | (np.diff(row_slots) != 0) | (np.diff(offsets) != 1)
                             | (np.diff(pos) != 1)) + 1
        starts = np.concatenate(([0], brk)).tolist() if blocks.size else []
        ends = np.concatenate((brk, [blocks.size])).tolist() if blocks.size else []
        runs = [Run(int(blocks[a]), int(row_slots[a]), int(offsets[a]), int(pos[a]), b - a)
                for a, b in zip(starts, ends)] if len(starts) <= _MAX_RUNS else []
        return Placement(int(blocks.size), runs, blocks=blocks, offsets=offsets, slots=row_slots, select=src)

    @staticmethod
    def _check_no_overlap(reqs: Sequence[Request], ids: np.ndarray, dest: np.ndarray,
                          src: np.ndarray | None) -> None:
        """Each destination entry at most once per write: the same request twice in a batch
        with overlapping ids, or an id repeated in a row, would leave which bytes land to
        the order of the copies. ``dest`` ``[M]``: flat destination of each valid entry;
        ``src``: their flat positions in ``ids`` (None: all of them)."""
        if dest.size < 2:
            return
        order = np.argsort(dest, kind="stable")
        same = np.flatnonzero(dest[order][1:] == dest[order][:-1])
        if not same.size:
            return
        pos = np.arange(ids.size) if src is None else src
        a, b = (int(pos[order[same[0]]]), int(pos[order[same[0] + 1]]))
        m = ids.shape[1]
        (ra, ca), (rb, cb) = divmod(a, m), divmod(b, m)
        req = reqs[ra]
        where = (f"rows {ra} and {rb} (request {req.request_id} twice)" if ra != rb
                 else f"row {ra} (request {req.request_id}), columns {ca} and {cb}")
        raise ValueError(f"entry ids: expected each entry at most once per write, got entry {int(ids[ra, ca])} "
                         f"in {where}")

    @staticmethod
    def _sealed_error(req: Request, k: int) -> None:
        raise ValueError(f"entry ids: block {k} of request {req.request_id} is sealed (immutable); "
                         f"writes go to blocks >= {req.num_sealed_blocks}")

    def _range_error(self, reqs: Sequence[Request], ids: np.ndarray, limit: np.ndarray,
                     valid: np.ndarray | None, padded: bool) -> None:
        lowest = -1 if padded else 0
        bad = (ids < lowest) | (ids >= limit[:, None])
        i = int(bad.any(1).argmax())
        row = ids[i] if valid is None else ids[i][(ids[i] != -1)]
        lo, hi = (int(row.min()), int(row.max())) if row.size else (int(ids[i].min()), int(ids[i].max()))
        where = f" in row {i} (request {reqs[i].request_id})" if padded else ""
        pad = "; -1 = padding" if padded else ""
        raise ValueError(f"entry ids: expected ids in [0, {int(limit[i])}){pad}, got [{lo}, {hi}]{where}")

    def check_open_block(self, reqs: Sequence[Request], ids: np.ndarray, per_block: int, padded: bool) -> None:
        """HiSparse: CSA KV entries may only go to each request's open block."""
        sealed = np.fromiter((r.num_sealed_blocks for r in reqs), dtype=np.int64, count=len(reqs))
        beyond = ids >= (sealed[:, None] + 1) * per_block
        if beyond.any():
            i = int(beyond.any(1).argmax())
            raise ValueError(f"entry ids: with HiSparse only the open block {int(sealed[i])} of request "
                             f"{reqs[i].request_id} is writable, got entry {int(ids[i].max())}")

    # --------------------------------------------------------------- scatter
    @staticmethod
    def scatter(pool: torch.Tensor, parts: PartSet, place: Placement, src: torch.Tensor, *,
                by_slot: bool = False) -> None:
        """``pool[parts[l], block, offset] = src[l, entry]`` for every valid entry.

        pool ``[num_parts, NB, E, nbytes]`` uint8 (contiguous); src ``[n, B * m, nbytes]``
        uint8 on the pool's device (``n = len(parts)``). ``by_slot``: the pool's second axis
        is the State slot (HiSparse's open CSA blocks), not the Classical block.

        Consecutive layers go run by run, each a strided slice copy of every layer: on the
        CPU always (``index_copy_`` there moves element by element, ~50x slower than a
        slice copy), on a GPU when there is one run (one launch either way). Otherwise one
        ``index_copy_`` of flat rows, the index built on the host (no device read).
        """
        M = place.size
        if M == 0:
            return
        n = parts.parts.size
        runs = place.runs
        if parts.start is not None and runs and (len(runs) == 1 or pool.device.type == "cpu"):
            p0 = parts.start
            shape = pool.shape
            whole_parts = p0 == 0 and n == shape[0]
            for r in runs:
                # (each torch view costs a few us: a block's whole row of every part, the common
                # prefill case, is one select; the source is sliced only when it is not all of it)
                where = r.slot if by_slot else r.block
                if whole_parts and r.offset == 0 and r.count == shape[2]:
                    dst = pool.select(1, where)
                else:
                    dst = pool[p0:p0 + n, where, r.offset:r.offset + r.count]
                # (src's axis 1 holds B * m entries; with no padding they are the M valid ones)
                whole_src = r.src == 0 and r.count == M and place.select is None
                dst.copy_(src if whole_src else src[:, r.src:r.src + r.count])
            return
        _, NB, E, nbytes = pool.shape
        blk, off = place.arrays(by_slot)
        rows = (parts.parts[:, None] * NB + blk[None, :]) * E + off[None, :]
        dst = torch.from_numpy(rows.reshape(-1))
        if pool.device.type != "cpu":
            dst = dst.to(pool.device, non_blocking=True)
        if place.select is not None:
            sel = torch.from_numpy(place.select)
            if pool.device.type != "cpu":
                sel = sel.to(pool.device, non_blocking=True)
            src = src.index_select(1, sel)
        flat, rows_src = pool.view(-1, nbytes), src.reshape(n * M, nbytes)
        if pool.device.type == "cpu":  # wider elements: index_copy_ on the CPU is per element
            wide = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                        if nbytes % d.itemsize == 0)
            flat, rows_src = flat.view(wide), rows_src.contiguous().view(wide)
        flat.index_copy_(0, dst, rows_src)
