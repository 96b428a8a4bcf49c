"""Moving blocks and snapshots between the tiers: prefix matching and loading on
``open()``, offload on GPU eviction, host-record references for HiSparse.

:class:`TierMoves` is the half of :class:`~tiered_kv.cache.TieredKVCache` that moves
data across tiers; the facade (``cache.py``) owns the pools and the request lifecycle
and sets every attribute used here (``blocks``, ``snapshots``, ``states``, ``classical``,
``host``, ``hisparse``, ``disk``, ``copies``, ``hasher``, ``_host_of_block``,
``_counters``). Lookups go nearest first — GPU, host, disk — and what is found farther
away is loaded up the tiers (a disk hit lands in the host tier first when there is one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .device import empty_host
from .prefix import token_digest
from .resume_reader import Destination, DiskResume, choose_destination, id_runs

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .classical_pool import ClassicalPool
    from .disk import DiskTier
    from .hisparse import HiSparseBuffers
    from .host import HostTier
    from .layout import KVLayout
    from .policy.eviction import EvictionPolicy
    from .prefix import PrefixHasher
    from .state_pool import SnapshotPool, StatePool
    from .transfer import CopyEngine, CopyHandle

__all__ = ["TierMoves", "record_key"]

#: Snapshots whose presence on disk is asked in one ``contains_many`` batch (at most).
_DISK_BATCH = 64


class TierMoves:
    """Prefix matching and data movement across tiers (a base of ``TieredKVCache``)."""

    layout: KVLayout
    device: torch.device
    blocks: BlockPool
    classical: ClassicalPool
    states: StatePool
    snapshots: SnapshotPool
    host: HostTier | None
    hisparse: HiSparseBuffers | None
    disk: DiskTier | None
    copies: CopyEngine
    hasher: PrefixHasher
    eviction: EvictionPolicy
    _host_of_block: dict[int, int]
    _counters: dict[str, int]

    #: Disk reads of ``open()`` (:mod:`tiered_kv.resume_reader`): blocks per batch (one
    #: read call; None: the destination's choice, the whole range where the store reads rows
    #: natively into CPU pools, else 8: 8 Flash blocks are 3.9 MB) and batches in flight
    #: (the staging ring's slots).
    resume_batch_blocks: int | None = None
    resume_read_depth: int = 3
    #: Who copies a batch read from disk into the pools: the reader thread (numpy copies;
    #: CPU pools) or this thread through the copy engine (its stream: CUDA). None: by device.
    resume_copy_on_readers: bool | None = None
    #: CPU pools without a host tier: each record is read straight into its pool block
    #: (a scatter list of the block's rows: one copy, no staging ring). False: through
    #: the staging ring as on CUDA (kept to compare against).
    resume_read_into_pools: bool = True
    #: The newest copy out of host memory into the pools (a later read into host memory
    #: that copy may still be reading waits for it; copies on one stream finish in order).
    _last_load: CopyHandle | None = None
    #: The newest offload into a host record (evicted GPU block -> host tier).
    _last_offload: CopyHandle | None = None
    #: Where resume reads land (kept between opens: the staging ring, the pools' row views)
    _resume_dest: Destination | None = None
    _snap_staging: torch.Tensor | None = None
    #: leaf-lru: a prune of blocks that lead to no snapshot is running (see _prune_to_snapshot)
    _pruning: bool = False
    _snap_staging_ready: Callable[[], None] | None = None

    # ------------------------------------------------------- prefix matching
    def _match_prefix(self, slot: int, tokens: np.ndarray, hashes: list[bytes]) -> tuple[list[int], int]:
        """Find, load and reference the longest resumable prefix; restore its State.
        ``tokens``: the prompt, ``[n] uint32`` (:func:`~tiered_kv.prefix.token_array`).

        Returns (GPU block ids, each with a reference taken, number of blocks). Tries
        shorter prefixes when a block or snapshot cannot be loaded (a corrupt disk record,
        a full pool).
        """
        available = self._available_blocks(hashes)
        while available > 0:
            n = self._longest_snapshot(hashes[:available])
            if n == 0:
                break
            # A snapshot only the disk holds is read meanwhile, on a reader thread.
            snap = self._prefetch_snapshot(hashes[n - 1], tokens, n, slot)
            try:
                got = self._acquire_blocks(tokens, hashes[:n])
            except BaseException:
                if snap is not None:
                    self._drop_snapshot_read(snap)
                raise
            if len(got) == n and self._restore_snapshot(slot, hashes[n - 1], tokens, n, snap):
                if self.disk is not None and not self.disk.admission.policy.write_through:
                    self._admit_on_hit(tokens, hashes[:n], got)
                return got, n
            if snap is not None and len(got) < n:  # (when used, the restore took care of it)
                self._drop_snapshot_read(snap)
            for b in reversed(got):
                self._release_block(b)
            available = len(got) if len(got) < n else n - 1
        return [], 0

    def _available_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks may be had: those the GPU and host tiers hold, and past
        them, when the disk holds the next one, all of ``hashes``.

        The disk is asked about one block only: asking about every block of a long prefix
        reads the start of every record (a random read each on a cold disk) just before
        the same records are read in full. A block missing on disk ends the load instead
        (see :meth:`_acquire_blocks`), and :meth:`_match_prefix` tries a shorter prefix.
        """
        n = 0
        while n < len(hashes):
            h = hashes[n]
            if self.blocks.lookup(h) is not None or (
                    self.host is not None and self.host.blocks.lookup(h) is not None):
                n += 1
                continue
            if self.disk is None or not self.disk.contains_many([record_key("block", h)])[0]:
                return n
            return len(hashes)
        return n

    def _longest_snapshot(self, hashes: list[bytes]) -> int:
        """The longest prefix (in blocks) whose end has a snapshot in some tier.

        Scans from the longest down, asking the disk in batches that grow 1, 4, 16, 64,
        64, ...: a prompt resumed whole costs one key (every present snapshot asked
        about is a read of its record's start, a random read on a cold disk), and a long
        prompt few round trips, not one per block.
        """
        n, size = len(hashes), 1
        while n > 0:
            batch = list(range(n, max(0, n - size), -1))  # n, n-1, ... (longest first)
            size = min(4 * size, _DISK_BATCH)
            near = next((m for m in batch if self._snapshot_above_disk(hashes[m - 1])), None)
            longer = batch if near is None else batch[:batch.index(near)]  # only these can beat it
            if self.disk is not None and longer:
                found = self.disk.contains_many([record_key("snapshot", hashes[m - 1]) for m in longer])
                hit = next((m for m, f in zip(longer, found) if f), None)
                if hit is not None:
                    return hit
            if near is not None:
                return near
            n = batch[-1] - 1
        return 0

    def _snapshot_above_disk(self, h: bytes) -> bool:
        if self.snapshots.ids.lookup(h) is not None:
            return True
        return bool(self.host is not None and self.host.snapshots is not None
                    and self.host.snapshots.lookup(h) is not None)

    def _acquire_blocks(self, tokens: np.ndarray, hashes: list[bytes]) -> list[int]:
        """Take a reference on the GPU block of each hash, loading it from host or disk.

        Blocks the GPU already holds are referenced first, so that allocating blocks for
        the others cannot evict them. The others load in order, run by run: host records
        with one copy per run of adjacent records, disk records through the read pipeline
        (:mod:`tiered_kv.resume_reader`). Stops at the first block that cannot be had (a miss, a
        record that fails verification, a full pool); returns the blocks acquired, a
        prefix of ``hashes``.
        """
        got: list[int | None] = []
        for h in hashes:
            b = self.blocks.lookup(h)
            if b is not None:
                self.blocks.incref(b)
            got.append(b)
        n, i, cut = len(hashes), 0, len(hashes)
        while i < n:
            if got[i] is not None:
                i += 1
                continue
            on_host = self._host_has(hashes[i])
            j = i + 1
            while j < n and got[j] is None and self._host_has(hashes[j]) == on_host:
                j += 1
            load = self._load_from_host if on_host else self._load_from_disk
            try:
                loaded = load(tokens, hashes, i, j)
            except BaseException:  # (a store error) the loader gave back its own blocks
                for b in reversed(got):
                    if b is not None:
                        self._release_block(b)
                raise
            got[i:i + len(loaded)] = loaded
            if len(loaded) < j - i:
                cut = i + len(loaded)
                break
            i = j
        for b in reversed(got[cut:]):
            if b is not None:
                self._release_block(b)
        return [b for b in got[:cut] if b is not None]

    def _host_has(self, h: bytes) -> bool:
        return self.host is not None and self.host.blocks.lookup(h) is not None

    def _allocate_blocks(self, n: int) -> list[int]:
        """Up to ``n`` GPU blocks (refcount 1 each), fewer when the pool runs out."""
        got: list[int] = []
        while len(got) < n:
            b = self.blocks.allocate()
            if b is None:
                break
            got.append(b)
        return got

    def _admit_on_hit(self, tokens: np.ndarray, hashes: list[bytes], bids: list[int]) -> None:
        """The disk admission filter's second chance: a resume was served the prefix
        ``hashes`` (GPU blocks ``bids``, referenced) and the snapshot at its end, which
        counts a hit (:mod:`tiered_kv.policy.admission`).

        A snapshot admitted takes along every block before it not known to be on disk,
        queued ahead of it, and a block goes to disk only so: the disk never holds an
        admitted snapshot whose blocks the filter held back, nor a block the filter wrote
        with no snapshot at or after it."""
        assert self.disk is not None
        adm = self.disk.admission
        bt = self.layout.block_tokens
        n = len(hashes)
        if not adm.hit("snapshot", hashes[-1]):
            return
        for i in self._blocks_to_write(hashes):  # the path segment it ends, ahead of it
            h = hashes[i]
            adm.admit("block", h)
            parent = hashes[i - 1] if i else self.hasher.root
            self._submit_block_copy(bids[i], h, parent, token_digest(tokens[i * bt:(i + 1) * bt]))
        h = hashes[-1]
        sid = self.snapshots.ids.lookup(h)
        data = (self.snapshots.data[sid].to("cpu", copy=True) if sid is not None else
                self.host.lookup_snapshot(h) if self.host is not None else None)
        if data is None:  # (served from the staging buffer, i.e. from disk: already there)
            return
        self.disk.submit(record_key("snapshot", h), self.hasher.root, token_digest(tokens[(n - 1) * bt:n * bt]),
                         data.clone() if sid is None else data)

    def _blocks_to_write(self, hashes: Sequence[bytes]) -> list[int]:
        """Of the blocks before a snapshot being admitted (``hashes``, in path order), the
        indices of those to write ahead of it: the ones the filter does not know on disk,
        and the ones it does that the disk no longer holds (the store evicted them since:
        leaving them out would put the snapshot behind a missing block)."""
        assert self.disk is not None
        adm = self.disk.admission
        known = [i for i, h in enumerate(hashes) if adm.known_on_disk("block", h)]
        gone = set()
        if known:
            held = self.disk.holds_many([record_key("block", hashes[i]) for i in known])
            gone = {i for i, ok in zip(known, held) if not ok}
        return [i for i in range(len(hashes)) if i in gone or not adm.known_on_disk("block", hashes[i])]

    def _write_survivors(self) -> None:
        """``survived:N`` (:mod:`tiered_kv.policy.admission`), after each close: the
        snapshots held back N requests ago that a memory tier still holds are written now,
        each with its blocks not known on disk, queued ahead of it; a snapshot with a
        block neither in a memory tier nor known on disk expired, as one no tier holds."""
        assert self.disk is not None
        adm = self.disk.admission
        for d in adm.tick():
            sid = self.snapshots.ids.lookup(d.h)
            data: torch.Tensor | None = None
            if sid is not None:
                data = self.snapshots.data[sid].to("cpu", copy=True)
            elif self.host is not None and self.host.snapshots is not None:
                hs = self.host.snapshots.lookup(d.h)
                data = None if hs is None else self.host.snapshot_data[hs].clone()
            todo = [] if data is None else [d.before[i] for i in self._blocks_to_write([x[0] for x in d.before])]
            if data is None or not all(self.blocks.lookup(x[0]) is not None or self._host_has(x[0]) for x in todo):
                adm.expired += 1
                continue
            for h, parent, digest in todo:
                adm.admit("block", h)
                b = self.blocks.lookup(h)
                if b is not None:
                    self._submit_block_copy(b, h, parent, digest, order=True)
                    continue
                hid = self.host.blocks.lookup(h)  # type: ignore[union-attr]
                self._wait_host_copies()
                self.disk.submit(record_key("block", h), parent, digest, self.host.records[hid].clone())  # type: ignore[union-attr]
            adm.admit("snapshot", d.h)
            self.disk.submit(record_key("snapshot", d.h), d.parent, d.digest, data)

    def _wait_host_copies(self) -> None:
        """Before host code reads a host record: the offloads into it and the HiSparse
        mirror copies have landed (a no-op on CPU)."""
        if self._last_offload is not None:
            self._last_offload.wait()
        if self.hisparse is not None:
            self._wait_host_mirrors()  # type: ignore[attr-defined]

    def _submit_block_copy(self, b: int, h: bytes, parent: bytes, digest: bytes, *, order: bool = False) -> None:
        """Queue a disk write of cached GPU block ``b`` (hash ``h``): copied into a
        private record (a pool block may be reused before the write), as at seal.
        ``order``: later work on the current stream waits for the copy (``b`` is not
        referenced and may be reused at once)."""
        assert self.disk is not None
        hid = self._host_of_block.get(b)
        if hid is not None:  # HiSparse: the full record (CSA part too) is the host's mirror
            assert self.host is not None
            self._wait_host_mirrors()  # type: ignore[attr-defined]
            self.disk.submit(record_key("block", h), parent, digest, self.host.records[hid].clone())
            return
        record = empty_host((1, self.layout.block_bytes), pinned=self.copies.device.type == "cuda")
        handle = self.copies.offload_blocks(self.classical.parts, torch.tensor([b]), record)
        if order:
            handle.make_stream_wait()
        self.disk.submit(record_key("block", h), parent, digest, record[0], handle.wait_event)

    def _load_from_host(self, tokens: np.ndarray, hashes: list[bytes], lo: int, hi: int) -> list[int]:
        """Blocks ``hashes[lo:hi]`` (all in the host tier) into new GPU blocks."""
        host = self.host
        assert host is not None
        hids: list[int] = []
        for h in hashes[lo:hi]:  # referenced first: allocating GPU blocks may offload to host
            hid = host.blocks.lookup(h)
            assert hid is not None
            host.blocks.incref(hid)
            hids.append(hid)
        bids = self._allocate_blocks(len(hids))
        for hid in hids[len(bids):]:
            self._drop_host_ref(hid)
        self._load_host_records(hids[:len(bids)], bids)
        for i, b in enumerate(bids, lo):
            self.blocks.cache(b, hashes[i], hashes[i - 1] if i else self.hasher.root, reused=True)
        self._counters["blocks_from_host"] += len(bids)
        return bids

    def _load_host_records(self, hids: list[int], bids: list[int]) -> None:
        """Copy host records ``hids`` into GPU blocks ``bids``, one copy per run of adjacent
        records. With HiSparse the GPU block keeps its host reference (the CSA part lives
        there); otherwise the reference is dropped (the record stays cached on the host,
        and a later read into it first waits for this copy: see
        :class:`~tiered_kv.resume_reader.HostRecords`)."""
        assert self.host is not None
        for start, stop in id_runs(hids):
            records = self.host.records[hids[start]:hids[start] + (stop - start)]
            self._load_records(records, bids[start:stop])
        self._keep_host_refs(hids, bids)

    def _load_records(self, records: torch.Tensor, bids: list[int]) -> None:
        """Scatter host records ``[n, block_bytes]`` into GPU blocks ``bids`` on the copy
        engine's stream; the current stream waits for it (the host does not)."""
        ids = torch.tensor(bids, dtype=torch.int64)
        if self.hisparse is not None:
            handle = self.copies.load_blocks(records[:, self.layout.csa_kv_block_bytes:], ids,
                                             self.classical.rest_parts)
        else:
            handle = self.copies.load_blocks(records, ids, self.classical.parts)
        handle.make_stream_wait()
        self._last_load = handle

    def _load_from_disk(self, tokens: np.ndarray, hashes: list[bytes], lo: int, hi: int) -> list[int]:
        """Blocks ``hashes[lo:hi]`` from disk into new GPU blocks, batch by batch: the
        pipeline and the three destinations (the pools' rows, the staging ring, host
        records) live in :mod:`tiered_kv.resume_reader`. Returns the blocks loaded, a
        prefix of the range (the first record absent or failing verification ends it)."""
        if self.disk is None:
            return []
        self._resume_dest = choose_destination(self, self._resume_dest)
        loaded = DiskResume(self, self._resume_dest, tokens, hashes, lo, hi).run()
        for h in hashes[lo:lo + len(loaded)]:  # (the admission filter never writes them again)
            self.disk.admission.on_disk("block", h)
        return loaded

    def _keep_host_refs(self, hids: list[int], bids: list[int]) -> None:
        """After a load from host records: with HiSparse each GPU block keeps its record's
        reference (its CSA part lives there), otherwise the references are dropped."""
        for b, hid in zip(bids, hids):
            if self.hisparse is not None:
                self._host_of_block[b] = hid
            else:
                self._drop_host_ref(hid)

    def _allocate_host_record(self) -> int | None:
        """A host record id (refcount 1), evicting host LRU records as needed.

        With HiSparse, records referenced only by cached-but-unused GPU blocks come free
        by evicting those GPU blocks (their records stay cached on the host, evictable).
        """
        assert self.host is not None
        hid = self.host.blocks.allocate()
        while hid is None and self.hisparse is not None and self.blocks.evict_lru() is not None:
            hid = self.host.blocks.allocate()
        return hid

    def _drop_host_ref(self, hid: int) -> None:
        assert self.host is not None
        self.host.blocks.free(hid)

    def _drop_host_refs(self, hids: list[int]) -> None:
        for hid in hids:
            self._drop_host_ref(hid)

    def _allocate_host_records(self, n: int) -> list[int]:
        """Up to ``n`` host records (refcount 1 each), fewer when the host tier runs out."""
        got: list[int] = []
        while len(got) < n:
            hid = self._allocate_host_record()
            if hid is None:
                break
            got.append(hid)
        return got

    def _restore_snapshot(self, slot: int, h: bytes, tokens: np.ndarray, n: int,
                          read: _SnapshotRead | None = None) -> bool:
        """Restore the State at the end of block ``n`` (hash ``h``) into ``slot``.

        Nearest first: the GPU snapshot pool, the host tier, the disk (``read``: its read,
        started by :meth:`_prefetch_snapshot`). A snapshot found farther away is promoted
        into the GPU snapshot pool so the next open hits it there.
        """
        if read is not None:
            return self._finish_snapshot_read(slot, read)
        ids = self.snapshots.ids
        sid = ids.lookup(h)
        if sid is not None:
            ids.incref(sid)  # refresh its LRU position
            self.states.restore(slot, self.snapshots.data[sid])
            ids.free(sid)
            self._counters["snapshot_hits"] += 1
            return True
        data = self.host.lookup_snapshot(h) if self.host is not None else None
        if data is not None:
            self._counters["snapshots_from_host"] += 1
            self.states.restore(slot, data.to(self.device))
            self._counters["snapshot_hits"] += 1
            sid = ids.allocate()
            if sid is not None:
                self.snapshots.data[sid].copy_(data)
                ids.cache(sid, h)
                ids.free(sid)
            return True
        if self.disk is None:
            return False
        bt = self.layout.block_tokens
        digest = token_digest(tokens[(n - 1) * bt:n * bt])
        return self._finish_snapshot_read(slot, self._start_snapshot_read(h, digest))

    def _prefetch_snapshot(self, h: bytes, tokens: np.ndarray, n: int, slot: int) -> _SnapshotRead | None:
        """Start reading snapshot ``h`` (the end of block ``n``) from disk when no tier
        above holds it, so that it is read while the prefix's blocks are (on CPU also
        restored into state slot ``slot`` there); None otherwise."""
        if self.disk is None or self._snapshot_above_disk(h):
            return None
        bt = self.layout.block_tokens
        return self._start_snapshot_read(h, token_digest(tokens[(n - 1) * bt:n * bt]), slot)

    def _start_snapshot_read(self, h: bytes, digest: bytes, slot: int | None = None) -> _SnapshotRead:
        """Start reading snapshot ``h`` from disk on a reader thread: on CPU straight into
        a newly allocated GPU snapshot slot (no other copy); on CUDA, or without a free
        slot, into the pinned staging buffer (read into again only after the upload out of
        it is done).

        On CPU, with a snapshot slot, the reader thread also restores the verified
        snapshot into state slot ``slot`` (when given) while the blocks are still being
        read: the slot is this open's own, and whoever uses it next (the restore when
        the prefix loads, a shorter prefix's restore or the reset otherwise) comes after
        the read is waited for."""
        assert self.disk is not None
        sid = self.snapshots.ids.allocate()
        cuda = self.device.type == "cuda"
        if cuda or sid is None:
            if self._snap_staging is None:
                self._snap_staging = empty_host(self.layout.snapshot_bytes, pinned=cuda)
            buf, ready = self._snap_staging, self._snap_staging_ready
        else:
            buf, ready = self.snapshots.data[sid], None
        key = [record_key("snapshot", h)]
        if slot is None or cuda or sid is None:
            return _SnapshotRead(h, sid, buf, self.disk.read_async(key, [buf], [digest], ready=ready))
        disk, states = self.disk, self.states

        def read_and_restore() -> list[bool]:
            ok = disk.read_many(key, [buf], [digest])
            if ok[0]:
                states.restore(slot, buf)
            return ok

        return _SnapshotRead(h, sid, buf, disk.run_reader(read_and_restore), restored=slot)

    def _finish_snapshot_read(self, slot: int, read: _SnapshotRead) -> bool:
        """Wait for ``read`` and restore ``slot`` from it; False when the record was
        absent or failed verification (a counted miss). Without a GPU snapshot slot the
        State is restored from the staging buffer and nothing is promoted; from the
        staging on CUDA it is uploaded on the copy engine's stream first."""
        ids = self.snapshots.ids
        if not read.future.result()[0]:
            if read.sid is not None:
                ids.free(read.sid)  # never cached: back to the free list
            self._counters["disk_read_failures"] += 1
            return False
        self._counters["snapshots_from_disk"] += 1
        self._counters["snapshot_hits"] += 1
        assert self.disk is not None
        self.disk.admission.on_disk("snapshot", read.h)
        if read.sid is None:
            self.states.restore(slot, read.buf)
            return True
        data = self.snapshots.data[read.sid]
        if read.buf is not data:
            handle = self.copies.copy(data, read.buf)
            handle.make_stream_wait()
            self._snap_staging_ready = handle.wait_event
        if read.restored != slot:  # (else restored on the reader thread)
            self.states.restore(slot, data)
        ids.cache(read.sid, read.h)
        ids.free(read.sid)
        return True

    def _drop_snapshot_read(self, read: _SnapshotRead) -> None:
        """A prefetched snapshot that is not used: wait for its read (its error, if any,
        is not this call's to report) and give its GPU snapshot slot back, uncached."""
        try:
            read.future.result()
        except BaseException:  # noqa: S110 - a shorter prefix (or the caller's error) decides
            pass
        if read.sid is not None:
            self.snapshots.ids.free(read.sid)

    # ----------------------------------------------------- tier movements
    def _release_block(self, b: int) -> None:
        """Drop one reference on GPU block ``b`` (and its host record when it dies)."""
        if self.blocks.refcount(b) == 1 and self.blocks.block_hash(b) is None:
            hid = self._host_of_block.pop(b, None)
            if hid is not None:
                self._drop_host_ref(hid)
        self.blocks.free(b)

    def _on_block_evict(self, b: int, h: bytes) -> None:
        """A cached GPU block is reused: keep its record in the host tier (and with the
        leaf-lru policy the GPU's snapshot at its end goes down with it)."""
        if self.eviction.coherent_snapshots:
            if self.snapshots.ids.evict_hash(h):
                self._counters["snapshots_evicted_with_block"] += 1
            if self.host is None and self._disk_lacks("block", h):  # its parent may now lead to no snapshot
                self._prune_to_snapshot(self.blocks, self.snapshots.ids, self.blocks.evicted_parent)
        hid = self._host_of_block.pop(b, None)
        if hid is not None:  # HiSparse: the host already holds the record
            self._drop_host_ref(hid)
            return
        if self.host is None or self.host.blocks.lookup(h) is not None:
            return
        parent = self.blocks.evicted_parent  # (the path, kept in the host tier)
        hid = self.host.blocks.allocate()
        if hid is None:
            return
        handle = self.copies.offload_blocks(self.classical.parts, torch.tensor([b]), self.host.records[hid:hid + 1])
        handle.make_stream_wait()  # the block is overwritten only after the copy read it
        self._last_offload = handle
        self.host.blocks.cache(hid, h, parent, reused=self.blocks.evicted_hot)
        self.host.blocks.free(hid)
        self._counters["blocks_offloaded"] += 1

    def _on_host_block_evict(self, hid: int, h: bytes) -> None:
        """leaf-lru: a host record evicted takes the host's snapshot at its end along."""
        host = self.host
        if host is not None and host.snapshots is not None and host.snapshots.evict_hash(h):
            self._counters["snapshots_evicted_with_block"] += 1
        if host is not None and self._disk_lacks("block", h):  # its parent may now lead to no snapshot
            self._prune_to_snapshot(host.blocks, host.snapshots, host.blocks.evicted_parent)

    def _on_snapshot_evict(self, sid: int, h: bytes) -> None:
        kept = self.host is not None and self.host.put_snapshot(h, self.snapshots.data[sid].cpu())
        if not kept and self._disk_lacks("snapshot", h) and self.eviction.coherent_snapshots:
            self._prune_to_snapshot(self.blocks, self.snapshots.ids, h)

    def _on_host_snapshot_evict(self, sid: int, h: bytes) -> None:
        """leaf-lru: a host snapshot evicted that the disk below does not hold (there is
        none, or its filter held the snapshot back): its blocks' path goes too."""
        host = self.host
        if self._disk_lacks("snapshot", h) and host is not None:
            self._prune_to_snapshot(host.blocks, host.snapshots, h)

    @property
    def _disk_holds_all(self) -> bool:
        """A disk tier below writes every record through (admission ``all``): a record a
        memory tier drops is still on disk, so no memory tier prunes a path for want of it
        (unless the store reported it evicted: :meth:`_disk_lacks`)."""
        return self.disk is not None and self.disk.admission.policy.write_through

    def _disk_lacks(self, kind: str, h: bytes) -> bool:
        """A record a memory tier drops may be missing below: there is no disk, or one
        behind an admission filter, or one writing through whose store reported the record
        evicted (:meth:`~tiered_kv.disk.DiskTier.take_evicted`)."""
        return not self._disk_holds_all or self.disk.evicted_from_store(record_key(kind, h))  # type: ignore[union-attr]

    def _disk_may_hold(self, h: bytes) -> bool:
        """Block ``h`` may be on disk, where it still leads to a snapshot: written through,
        or (behind a filter) known on disk, and not reported evicted since. The filter
        writes a block only along with a snapshot at or after it
        (:mod:`tiered_kv.policy.admission`), and the store evicts leaves first, taking
        the blocks that led only to a snapshot with it (and reporting them)."""
        disk = self.disk
        if disk is None:
            return False
        if not (disk.admission.policy.write_through or disk.admission.known_on_disk("block", h)):
            return False
        return not disk.evicted_from_store(record_key("block", h))

    def _prune_store_evictions(self) -> None:
        """On the cache's thread (``open``, ``close``, ``flush``): take the keys the
        store evicted since the last call (reported on the writer thread, queued by the
        disk tier) and, with a leaf-first policy, prune the memory-tier blocks that led
        only to them: walking up from each evicted key while a block is unreferenced in
        both memory tiers, has no child there, no snapshot in either, and is not on disk
        (:meth:`_disk_may_hold`). Such a block has no snapshot at or after it in any tier
        any more, so no resume can use it. The admission filter keeps what it knew on disk
        (forgetting it made ``seen-twice`` write each evicted snapshot again at its next
        publish: +50 % disk bytes on the synthetic trace); a block it knows that the store
        evicted is written again ahead of the next snapshot admitted after it
        (:meth:`_blocks_to_write`)."""
        disk = self.disk
        if disk is None:
            return
        gone = disk.take_evicted()
        if not gone or not self.eviction.coherent_snapshots:
            return
        self._pruning = True  # (the host evictions below call back into _prune_to_snapshot)
        try:
            for key in gone:
                self._prune_up_from(key.block_hash)
        finally:
            self._pruning = False

    def _prune_up_from(self, h: bytes) -> None:
        """The walk of :meth:`_prune_store_evictions` from block or snapshot ``h``."""
        host = self.host.blocks if self.host is not None else None
        x: bytes | None = h
        while x is not None:
            b = self.blocks.lookup(x)
            hid = host.lookup(x) if host is not None else None
            if ((b is None and hid is None)
                    or (b is not None and self.blocks.refcount(b))
                    or (hid is not None and host.refcount(hid))  # type: ignore[union-attr]
                    or self.blocks.num_children(x) or (host is not None and host.num_children(x))
                    or self._snapshot_above_disk(x) or self._disk_may_hold(x)):
                return
            parent = self.blocks.parent_hash(b) if b is not None else host.parent_hash(hid)  # type: ignore[union-attr,arg-type]
            if b is not None:  # (dropped, not offloaded: the host would hold it stranded)
                self.blocks.uncache(b)
                mirror = self._host_of_block.pop(b, None)
                if mirror is not None:
                    self._drop_host_ref(mirror)
            if hid is not None:
                host.evict_hash(x)  # type: ignore[union-attr]
            self._counters["blocks_evicted_with_snapshot"] += 1
            x = parent

    def _prune_to_snapshot(self, pool: BlockPool, snaps: BlockPool | None, h: bytes | None) -> None:
        """leaf-lru, in a tier with nothing below it that holds every record (no disk, or
        one behind an admission filter): a snapshot or block at ``h`` left; the blocks of
        ``pool`` that led only to it (walking up from ``h`` while each is unreferenced,
        childless, has no snapshot of its own and is not known on disk) are dead weight,
        since a resume needs a snapshot at or after them, and are evicted too. The walk
        stops at a block known on disk: the filter writes a block only along with a
        snapshot at or after it (:mod:`tiered_kv.policy.admission`), so it still leads to
        one there."""
        if self._pruning:  # (the evictions below call back here: the loop does their work)
            return
        self._pruning = True
        try:
            x = h
            while x is not None:
                b = pool.lookup(x)
                if (b is None or pool.refcount(b) or pool.num_children(x)
                        or (snaps is not None and snaps.lookup(x) is not None)
                        or self.snapshots.ids.lookup(x) is not None
                        or self._disk_may_hold(x)):
                    return
                parent = pool.parent_hash(b)
                pool.evict_hash(x)
                self._counters["blocks_evicted_with_snapshot"] += 1
                x = parent
        finally:
            self._pruning = False


@dataclass(slots=True)
class _SnapshotRead:
    """A snapshot record being read from disk on a reader thread: snapshot ``h`` into
    ``buf``, GPU snapshot slot ``sid``'s data (None: the staging buffer)."""

    h: bytes
    sid: int | None
    buf: torch.Tensor
    future: Future[list[bool]]
    #: the state slot the reader thread restored it into once verified (None: not done there)
    restored: int | None = None


def record_key(kind: str, h: bytes):  # -> tiered_kv.storage.RecordKey
    from .storage import RecordKey

    return RecordKey.block(h) if kind == "block" else RecordKey.snapshot(h)
