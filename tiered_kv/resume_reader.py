"""Resume reading: the blocks of a prefix read from disk into new GPU blocks on ``open()``.

:class:`DiskResume` runs the pipeline: batches of ``resume_batch_blocks`` records (None,
the default: the destination's choice), up to ``resume_read_depth`` of them in flight on
the disk tier's reader threads, taken back in order on the opening thread::

    CUDA   reader threads:  read+verify b0 | read+verify b1 | read+verify b2 ...
           this thread:                      H2D b0 (async)  | H2D b1 ...
    CPU    reader threads:  read+verify+copy b0 | read+verify+copy b2 ...
                            read+verify+copy b1 | ...

Into CPU pools from a store that reads rows natively (LMDB), the whole range is one
batch, read on the opening thread: the store deals runs of records to its threads (each
one native call, the GIL released) and asks a cold disk for every extent at once::

    this thread:        index lookup | rows 0-3 | rows 8-11 | ...  | keep the verified prefix
    the store's thread:              | rows 4-7 | rows 12-15 | ...
    a reader thread:    snapshot: read+verify, restore into the State slot

Where the records land is the cache's configuration, chosen once
(:func:`choose_destination`); each destination is one small object that reads top to
bottom (:meth:`~Destination.start` a batch, the reader thread's
:meth:`~Destination.read_job`, then :meth:`~Destination.land` on the opening thread):

==============  ===========================================================================
PoolRows        CPU pools, no host tier, no HiSparse: each record is read straight into its
                GPU block's rows of the pools (its scatter list as offsets, a
                :class:`~tiered_kv.storage.RowScatter`: one ``preadv`` per record, no
                buffer object per row); nothing to copy afterwards
StagingRing     no host tier otherwise (CUDA; CPU with ``resume_read_into_pools = False``):
                a ring of ``depth`` staging buffers (pinned on CUDA), copied into the pools
                on the reader thread (CPU) or by the copy engine from the opening thread
                (CUDA: a slot is read into again only after the upload out of it is done)
HostRecords     a host tier: records read into newly allocated host records (a verified
                block is promoted there, as a host hit would be), then copied into the pools
                on the reader thread (CPU) or through the copy engine (CUDA)
==============  ===========================================================================

The first record that is absent or fails verification ends the load (a counted miss): the
blocks before it are kept; reads in flight are waited for and their blocks freed.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .device import empty_host
from .prefix import block_token_digests

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .classical_pool import ClassicalPool
    from .disk import DiskTier
    from .hisparse import HiSparseBuffers
    from .host import HostTier
    from .layout import KVLayout
    from .storage.format.rows import RowScatter as RowScatterT
    from .transfer import CopyHandle

#: Blocks per batch by default (8 Flash blocks are 3.9 MB), where a destination has no better size.
DEFAULT_BATCH = 8

__all__ = ["DEFAULT_BATCH", "DiskBatch", "DiskResume", "Destination", "HostRecords", "PoolRows", "ResumeCache",
           "StagingRing", "choose_destination", "id_runs", "prepare_destination"]


class ResumeCache(Protocol):
    """What resume reading needs of the cache (:class:`~tiered_kv.cache.TieredKVCache`,
    through its :class:`~tiered_kv.tiering.TierMoves` half): its pools and tiers, the
    settings of the reads, and the block / host-record bookkeeping it calls back into.
    Declared here so that this module depends on no part of the cache but this one."""

    layout: KVLayout
    device: torch.device
    blocks: BlockPool
    classical: ClassicalPool
    host: HostTier | None
    hisparse: HiSparseBuffers | None
    disk: DiskTier | None
    #: the cache's counters (``blocks_from_disk``, ``disk_read_failures``...)
    _counters: dict[str, int]
    #: settings (see TierMoves): blocks per batch (None: the destination's choice), batches
    #: in flight, who copies into CPU pools (None: by device), reads straight into CPU pools
    resume_batch_blocks: int | None
    resume_read_depth: int
    resume_copy_on_readers: bool | None
    resume_read_into_pools: bool
    #: the newest copy out of host memory into the pools / the newest offload into host records
    _last_load: CopyHandle | None
    _last_offload: CopyHandle | None

    def _allocate_blocks(self, n: int) -> list[int]:
        """Up to ``n`` GPU blocks (refcount 1 each), fewer when the pool runs out."""
        ...

    def _release_block(self, b: int) -> None:
        """Drop one reference on GPU block ``b`` (and its host record when it dies)."""
        ...

    def _load_records(self, records: torch.Tensor, bids: list[int]) -> None:
        """Scatter host records ``[n, block_bytes]`` uint8 into GPU blocks ``bids`` on the
        copy engine's stream (sets ``_last_load``)."""
        ...

    def _allocate_host_records(self, n: int) -> list[int]:
        """Up to ``n`` host records (refcount 1 each), fewer when the host tier runs out."""
        ...

    def _load_host_records(self, hids: list[int], bids: list[int]) -> None:
        """Copy host records ``hids`` into GPU blocks ``bids``, then keep or drop the records'
        references as :meth:`_keep_host_refs` does."""
        ...

    def _keep_host_refs(self, hids: list[int], bids: list[int]) -> None:
        """After a load from host records: with HiSparse each GPU block keeps its record's
        reference (its CSA part lives there), otherwise the references are dropped."""
        ...

    def _drop_host_refs(self, hids: list[int]) -> None:
        """Drop one reference on each of host records ``hids``."""
        ...


@dataclass(slots=True)
class DiskBatch:
    """One batch in flight: blocks ``[lo, lo + len(bids))`` of the prefix (``hashes``),
    bound for GPU blocks ``bids``; read into host records ``hids`` (HostRecords) or ring
    slot ``slot`` (StagingRing), else -1."""

    bids: list[int]
    hids: list[int] = field(default_factory=list)
    slot: int = -1
    lo: int = 0
    hashes: list[bytes] = field(default_factory=list)
    #: the hash of the block before ``lo`` (None: ``lo`` is the path's first block)
    parent: bytes | None = None
    future: Future[list[bool]] | None = None

    def parents(self) -> list[bytes | None]:
        """Each block's parent hash, in order (for the pools' leaves-first bookkeeping)."""
        return [self.parent, *self.hashes[:-1]]


def leading_good(ok: list[bool]) -> int:
    """How many records of a batch, from its start, were read and verified."""
    return next((i for i, f in enumerate(ok) if not f), len(ok))


def id_runs(ids: list[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of ``ids`` whose values increase by one: [3, 4, 7] ->
    [(0, 2), (2, 3)]."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            if i > start:
                runs.append((start, i))
            start = i
    return runs


def scatter_on_cpu(moves: ResumeCache, records: torch.Tensor, bids: list[int]) -> None:
    """CPU pools: block ``bids[i]`` = ``records[i]`` (``[n, block_bytes]`` uint8), with
    numpy copies: one thread each and the GIL released, so reader threads copy in
    parallel (torch's intra-op pool oversubscribes the CPUs when several threads copy at
    once). With HiSparse only the parts after the CSA part are copied (the CSA part stays
    in the host record)."""
    rec = records.numpy()
    hisparse = moves.hisparse is not None
    parts = moves.classical.rest_parts if hisparse else moves.classical.parts
    start = moves.layout.csa_kv_block_bytes if hisparse else 0
    arrays = [p.numpy() for p in parts]
    for i, b in enumerate(bids):
        off = start
        for part in arrays:
            dst = part[:, b]
            np.copyto(dst, rec[i, off:off + dst.size].reshape(dst.shape))
            off += dst.size


# ------------------------------------------------------------------ destinations
class Destination(ABC):
    """Where one cache's resumed records land (see the module docstring)."""

    def __init__(self, moves: ResumeCache) -> None:
        self.moves = moves

    def batch_blocks(self, n: int) -> int:
        """Blocks per batch when ``resume_batch_blocks`` is None, for a range of ``n``."""
        return DEFAULT_BATCH

    @abstractmethod
    def start(self, n: int) -> DiskBatch | None:
        """Take up to ``n`` new GPU blocks (refcount 1 each) and whatever the records are
        read into; None when there are none now."""

    @abstractmethod
    def read_job(self, batch: DiskBatch, keys: list[Any], digests: list[bytes]) -> Callable[[], list[bool]]:
        """What a reader thread runs for ``batch``: read and verify its records (one
        ``get_many``), on CPU also copy the leading verified ones into their blocks;
        returns one bool per record."""

    def land(self, batch: DiskBatch, good: int) -> None:
        """On the opening thread, once the read is back: the first ``good`` records are
        verified; whatever is left to bring them into ``batch.bids[:good]`` happens here,
        and what ``start`` took besides the GPU blocks is given back for the rest."""

    def abandon(self, batch: DiskBatch) -> None:
        """Give back what ``start`` took besides the GPU blocks (the read failed)."""


class PoolRows(Destination):
    """CPU pools, no host tier, no HiSparse: each record is read into its block's rows.

    A block's record is the ``[entries * bytes]`` uint8 row of each layer of each part, in
    record order (``csa_kv``, ``indexer``, ``hca_kv``; layer by layer: 62 rows of 0.6-18
    KiB for a Flash block). The rows of block ``b`` sit at the same offsets in every block,
    shifted by ``b`` rows of their part::

        part p, [layers, num_blocks, row] uint8:  layer l's row of block b at byte
                                                  (l * num_blocks + b) * row

    so a batch's scatter lists are one numpy expression (:meth:`scatter`), read natively
    by stores with row reads (no buffer object per row); other stores get them as views.
    """

    def __init__(self, moves: ResumeCache) -> None:
        super().__init__(moves)
        #: each Classical part with rows, flat: ``[layers * num_blocks * entries * bytes]`` uint8
        self.dests: list[np.ndarray] = []
        dest_of: list[int] = []
        base: list[int] = []
        stride: list[int] = []
        for part in moves.classical.parts:  # [L, num_blocks, E, B] uint8, contiguous
            L, nb, E, B = part.shape
            if not part.is_contiguous():  # the flat view would copy: the reads would land nowhere
                raise ValueError(f"classical pool part: expected a contiguous tensor, got strides "
                                 f"{tuple(part.stride())}")
            if L and E * B:
                row = E * B
                dest_of += [len(self.dests)] * L
                base += [layer * nb * row for layer in range(L)]
                stride += [row] * L
                self.dests.append(part.numpy().reshape(-1))
        #: piece j of a block's record: in ``dests[dest_of[j]]`` at ``base[j] + b * stride[j]``
        self.dest_of = np.array(dest_of, np.int64)
        self.base = np.array(base, np.int64)
        self.stride = np.array(stride, np.int64)
        self.block_bytes = int(self.stride.sum())
        assert self.block_bytes == moves.layout.block_bytes, (self.block_bytes, moves.layout.block_bytes)

    def scatter(self, bids: list[int]) -> RowScatterT:
        """Where the records of blocks ``bids`` land: ``[len(bids), pieces]`` offsets."""
        from .storage import RowScatter  # (the storage package loads with the disk tier)

        offsets = self.base + np.asarray(bids, np.int64)[:, None] * self.stride
        return RowScatter(tuple(self.dests), self.dest_of, self.stride, offsets)

    def batch_blocks(self, n: int) -> int:
        # A store that reads rows natively spreads one call over its threads and asks a
        # cold disk for every extent at once: the whole range in one batch keeps the disk's
        # queue full and takes the fewest Python steps.
        return n if self.moves.disk is not None and self.moves.disk.store.supports_row_reads else DEFAULT_BATCH

    def start(self, n: int) -> DiskBatch | None:
        bids = self.moves._allocate_blocks(n)
        return DiskBatch(bids) if bids else None

    def read_job(self, batch: DiskBatch, keys: list[Any], digests: list[bytes]) -> Callable[[], list[bool]]:
        # (the scatter plan is one numpy expression, made here; the read runs on a reader
        # thread, or on this one when the batch is the whole range: see DiskResume._fill)
        return functools.partial(self.moves.disk.read_rows, keys, self.scatter(batch.bids), digests)


class StagingRing(Destination):
    """No host tier: records read into ``[depth, batch_blocks, block_bytes]`` uint8 staging
    buffers (pinned on CUDA), then copied into the pools: by the reader thread
    (``copy_on_readers``, CPU) or by the copy engine from the opening thread."""

    def __init__(self, moves: ResumeCache, *, batch_blocks: int, depth: int, copy_on_readers: bool) -> None:
        super().__init__(moves)
        self.copy_on_readers = copy_on_readers
        self.ring = empty_host((depth, batch_blocks, moves.layout.block_bytes), pinned=moves.device.type == "cuda")
        #: per slot: waits until the last upload out of it is done (None: nothing pending)
        self.ready: list[Callable[[], None] | None] = [None] * depth
        self._next = 0

    def fits(self, *, batch_blocks: int, depth: int, copy_on_readers: bool) -> bool:
        return (tuple(self.ring.shape[:2]) == (depth, batch_blocks)
                and self.copy_on_readers == copy_on_readers)

    def drain(self) -> None:
        """Wait for every upload out of the ring (before it is dropped)."""
        for ready in self.ready:
            if ready is not None:
                ready()

    def start(self, n: int) -> DiskBatch | None:
        bids = self.moves._allocate_blocks(n)
        if not bids:
            return None
        slot = self._next % len(self.ready)  # round robin: at most depth batches in flight
        self._next += 1
        return DiskBatch(bids, slot=slot)

    def read_job(self, batch: DiskBatch, keys: list[Any], digests: list[bytes]) -> Callable[[], list[bool]]:
        records = self.ring[batch.slot, :len(batch.bids)]
        ready = self.ready[batch.slot]
        disk, moves, copy = self.moves.disk, self.moves, self.copy_on_readers

        def job() -> list[bool]:
            if ready is not None:
                ready()  # the upload that last read this slot
            ok = disk.read_many(keys, list(records), digests)
            good = leading_good(ok)
            if copy and good:
                scatter_on_cpu(moves, records[:good], batch.bids[:good])
            return ok

        return job

    def land(self, batch: DiskBatch, good: int) -> None:
        if self.copy_on_readers or not good:
            return
        self.moves._load_records(self.ring[batch.slot, :good], batch.bids[:good])
        self.ready[batch.slot] = self.moves._last_load.wait_event


class HostRecords(Destination):
    """A host tier: records read into new host records, promoted there once verified, then
    copied into the pools (by the reader thread on CPU, the copy engine otherwise)."""

    def __init__(self, moves: ResumeCache, *, copy_on_readers: bool) -> None:
        super().__init__(moves)
        self.copy_on_readers = copy_on_readers

    def start(self, n: int) -> DiskBatch | None:
        moves = self.moves
        hids = moves._allocate_host_records(n)
        bids = moves._allocate_blocks(len(hids))
        moves._drop_host_refs(hids[len(bids):])
        return DiskBatch(bids, hids=hids[:len(bids)]) if bids else None

    def read_job(self, batch: DiskBatch, keys: list[Any], digests: list[bytes]) -> Callable[[], list[bool]]:
        moves = self.moves
        host = moves.host
        assert host is not None
        ready = self._records_idle()
        outs = [host.records[hid] for hid in batch.hids]
        copy = self.copy_on_readers

        def job() -> list[bool]:
            if ready is not None:
                ready()
            ok = moves.disk.read_many(keys, outs, digests)
            hids = batch.hids[:leading_good(ok)]
            if copy:
                for start, stop in id_runs(hids):
                    rows = host.records[hids[start]:hids[start] + (stop - start)]
                    scatter_on_cpu(moves, rows, batch.bids[start:stop])
            return ok

        return job

    def _records_idle(self) -> Callable[[], None] | None:
        """What a reader thread waits for before it writes into host records just
        allocated (CUDA): the newest copy out of host records into the pools and the newest
        offload into them (an evicted record may still be read or written by one; copies
        on one stream finish in order, so the newest covers the older ones)."""
        moves = self.moves
        waits = [h.wait_event for h in (moves._last_load, moves._last_offload) if h is not None and not h.done()]
        if not waits:
            return None

        def wait() -> None:
            for w in waits:
                w()

        return wait

    def land(self, batch: DiskBatch, good: int) -> None:
        moves = self.moves
        assert moves.host is not None
        hids, bids = batch.hids[:good], batch.bids[:good]
        for hid, h, parent in zip(hids, batch.hashes, batch.parents()):
            moves.host.blocks.cache(hid, h, parent, reused=True)  # verified: promoted to the host tier
        if self.copy_on_readers:  # already copied on the reader thread
            moves._keep_host_refs(hids, bids)
        else:
            moves._load_host_records(hids, bids)
        moves._drop_host_refs(batch.hids[good:])

    def abandon(self, batch: DiskBatch) -> None:
        self.moves._drop_host_refs(batch.hids)


def choose_destination(moves: ResumeCache, current: Destination | None) -> Destination:
    """The destination of ``moves``' resume reads under its settings now: ``current``
    again when it still fits (the ring and the pool views are kept between opens).

    Settings (attributes of the cache, see ResumeCache): ``resume_batch_blocks`` (None: by
    destination), ``resume_read_depth``, ``resume_copy_on_readers`` (None: on CPU), and
    ``resume_read_into_pools``."""
    size, depth = moves.resume_batch_blocks, moves.resume_read_depth
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise ValueError(f"resume_batch_blocks: expected a positive int or None, got {size!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or depth <= 0:
        raise ValueError(f"resume_read_depth: expected a positive int, got {depth!r}")
    size = size or DEFAULT_BATCH  # (the staging ring's batches)
    on_readers = moves.resume_copy_on_readers
    if on_readers is None:
        on_readers = moves.device.type != "cuda"
    elif on_readers and moves.device.type != "cpu":
        raise ValueError(f"resume_copy_on_readers: expected False or None on {moves.device} "
                         f"(reader threads copy into CPU pools only)")
    if moves.host is not None:
        if isinstance(current, HostRecords) and current.copy_on_readers == on_readers:
            return current
        new: Destination = HostRecords(moves, copy_on_readers=on_readers)
    elif on_readers and moves.resume_read_into_pools and moves.hisparse is None and moves.device.type == "cpu":
        if isinstance(current, PoolRows):
            return current
        new = PoolRows(moves)
    else:
        if isinstance(current, StagingRing) and current.fits(batch_blocks=size, depth=depth,
                                                            copy_on_readers=on_readers):
            return current
        new = StagingRing(moves, batch_blocks=size, depth=depth, copy_on_readers=on_readers)
    if isinstance(current, StagingRing):  # replaced: the uploads out of the old ring finish first
        current.drain()
    return new


def prepare_destination(moves: ResumeCache) -> Destination | None:
    """The destination made when the cache is, where it is only views of the pools
    (:class:`PoolRows`: CPU pools, default settings), so that the first cold ``open()``
    does not build it (about 2 ms of Python) before its first disk read. None otherwise
    (a staging ring is allocated when first needed); :func:`choose_destination` still
    decides on each open, and keeps this one while the settings select it."""
    if moves.disk is None or moves.host is not None or moves.device.type != "cpu":
        return None
    dest = choose_destination(moves, None) if moves.resume_read_into_pools and moves.hisparse is None else None
    return dest if isinstance(dest, PoolRows) else None


# ------------------------------------------------------------------ the pipeline
class DiskResume:
    """Blocks ``hashes[lo:hi]`` from disk into new GPU blocks, batch by batch (see the
    module docstring); :meth:`run` returns the GPU blocks loaded (cached, one reference
    each), a prefix of the range."""

    def __init__(self, moves: ResumeCache, dest: Destination, tokens: np.ndarray, hashes: list[bytes],
                 lo: int, hi: int) -> None:
        bt = moves.layout.block_tokens
        self.moves, self.dest = moves, dest
        self.hashes, self.lo, self.hi = hashes, lo, hi
        self.batch_blocks = moves.resume_batch_blocks or dest.batch_blocks(hi - lo)
        self.depth = moves.resume_read_depth
        self.digests = block_token_digests(tokens[lo * bt:hi * bt], bt)
        self.inflight: deque[DiskBatch] = deque()
        self.loaded: list[int] = []
        self.next_lo = lo
        self.stopped = False

    def run(self) -> list[int]:
        self._fill()
        while self.inflight:
            batch = self.inflight.popleft()
            try:
                ok = batch.future.result()
            except BaseException:  # an I/O error: no reader may write our buffers after we return
                self._abandon([batch, *self.inflight])
                for b in reversed(self.loaded):
                    self.moves._release_block(b)
                raise
            self._take(batch, ok)
            self._fill()
        return self.loaded

    def _fill(self) -> None:
        """Start batches until ``depth`` are in flight, the range is covered, or no GPU
        block (or host record) is free now."""
        while not self.stopped and self.next_lo < self.hi and len(self.inflight) < self.depth:
            batch = self.dest.start(min(self.batch_blocks, self.hi - self.next_lo))
            if batch is None:
                return
            a = self.next_lo
            b = a + len(batch.bids)
            batch.lo, batch.hashes = a, self.hashes[a:b]
            batch.parent = self.hashes[a - 1] if a else None
            keys = [_block_key(h) for h in batch.hashes]
            job = self.dest.read_job(batch, keys, self.digests[a - self.lo:b - self.lo])
            if a == self.lo and b == self.hi:  # the whole range at once: nothing to overlap with
                batch.future = _run_here(job)  # (the store spreads it over its threads)
            else:
                batch.future = self.moves.disk.run_reader(job)
            self.inflight.append(batch)
            self.next_lo = b

    def _take(self, batch: DiskBatch, ok: list[bool]) -> None:
        """A batch read back, in order: keep its leading verified blocks; the first
        failure stops the load (the batches in flight are then only waited for)."""
        moves = self.moves
        good = 0 if self.stopped else leading_good(ok)
        if good < len(ok) and not self.stopped:
            moves._counters["disk_read_failures"] += 1
        for b in batch.bids[good:]:  # read into but not verified (or past the end): never cached
            moves.blocks.free(b)
        self.dest.land(batch, good)
        bids = batch.bids[:good]
        for b, h, parent in zip(bids, batch.hashes, batch.parents()):
            moves.blocks.cache(b, h, parent, reused=True)
        self.loaded += bids
        moves._counters["blocks_from_disk"] += good
        if good < len(batch.bids):
            self.stopped = True

    def _abandon(self, batches: list[DiskBatch]) -> None:
        """Wait for the reads of ``batches`` (errors ignored: one is being raised) and give
        back their GPU blocks and what else they took, none of it cached."""
        for batch in batches:
            try:
                batch.future.result()
            except BaseException:  # noqa: S110 - the first error is the one reported
                pass
            for b in batch.bids:
                self.moves.blocks.free(b)
            self.dest.abandon(batch)


def _run_here(job: Callable[[], list[bool]]) -> Future[list[bool]]:
    """``job`` run on this thread, as a finished future (its result or its error)."""
    future: Future[list[bool]] = Future()
    try:
        future.set_result(job())
    except BaseException as e:  # handed over as a reader thread's error would be
        future.set_exception(e)
    return future


def _block_key(h: bytes):  # -> tiered_kv.storage.RecordKey
    from .storage import RecordKey

    return RecordKey.block(h)
