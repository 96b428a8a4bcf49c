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

from typing import TYPE_CHECKING

import torch

from .prefix import token_digest

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .classical_pool import ClassicalPool
    from .disk import DiskTier
    from .hisparse import HiSparseBuffers
    from .host import HostTier
    from .layout import KVLayout
    from .prefix import PrefixHasher
    from .state_pool import SnapshotPool, StatePool
    from .transfer import CopyEngine

__all__ = ["TierMoves", "record_key"]

#: Blocks whose presence on disk is asked in one ``contains_many`` batch.
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
    _host_of_block: dict[int, int]
    _counters: dict[str, int]

    # ------------------------------------------------------- prefix matching
    def _match_prefix(self, slot: int, tokens: list[int], hashes: list[bytes]) -> tuple[list[int], int]:
        """Find, load and reference the longest resumable prefix; restore its State.

        Returns (GPU block ids, each with a reference taken, number of blocks). Tries
        shorter prefixes when a block or snapshot cannot be loaded (a corrupt disk record,
        a full pool).
        """
        available = self._available_blocks(hashes)
        while available > 0:
            n = self._longest_snapshot(hashes[:available])
            if n == 0:
                break
            got = self._acquire_blocks(tokens, hashes[:n])
            if len(got) == n and self._restore_snapshot(slot, hashes[n - 1], tokens, n):
                return got, n
            for b in reversed(got):
                self._release_block(b)
            available = len(got) if len(got) < n else n - 1
        return [], 0

    def _available_blocks(self, hashes: list[bytes]) -> int:
        """How many leading blocks some tier holds (the disk is asked in batches)."""
        n = 0
        while n < len(hashes):
            h = hashes[n]
            if self.blocks.lookup(h) is not None or (
                    self.host is not None and self.host.blocks.lookup(h) is not None):
                n += 1
                continue
            if self.disk is None:
                return n
            batch = hashes[n:n + _DISK_BATCH]
            found = self.disk.contains_many([record_key("block", x) for x in batch])
            run = next((i for i, f in enumerate(found) if not f), len(found))
            n += run
            if run < len(batch):
                return n
        return n

    def _longest_snapshot(self, hashes: list[bytes]) -> int:
        """The longest prefix (in blocks) whose end has a snapshot in some tier.

        Scans from the longest down, asking the disk in batches so a long prompt costs a
        few concurrent round trips, not one per block.
        """
        n = len(hashes)
        while n > 0:
            batch = list(range(n, max(0, n - _DISK_BATCH), -1))  # n, n-1, ... (longest first)
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

    def _acquire_blocks(self, tokens: list[int], hashes: list[bytes]) -> list[int]:
        """Take a reference on the GPU block of each hash, loading it from host or disk.

        Stops at the first block that cannot be had; returns the blocks acquired.
        """
        bt = self.layout.block_tokens
        got: list[int] = []
        for i, h in enumerate(hashes):
            b = self.blocks.lookup(h)
            if b is not None:
                self.blocks.incref(b)
                got.append(b)
                continue
            fetched = self._fetch_record(h, tokens[i * bt:(i + 1) * bt])
            b = self.blocks.allocate() if fetched is not None else None
            if b is None:
                if fetched is not None and fetched[1] is not None:
                    self._drop_host_ref(fetched[1])
                break
            record, hid = fetched
            bid = torch.tensor([b])
            if self.hisparse is not None:
                assert hid is not None
                self.copies.load_blocks(record[:, self.layout.csa_kv_block_bytes:], bid,
                                        self.classical.rest_parts).make_stream_wait()
                self._host_of_block[b] = hid  # the GPU block keeps the host reference
            else:
                self.copies.load_blocks(record, bid, self.classical.parts).make_stream_wait()
                if hid is not None:
                    self._drop_host_ref(hid)
            self.blocks.cache(b, h)
            got.append(b)
        return got

    def _fetch_record(self, h: bytes, block_tokens: list[int]) -> tuple[torch.Tensor, int | None] | None:
        """Block ``h``'s record ``[1, block_bytes]`` from the host tier, or read from disk.

        With a host tier the record is a referenced host record (id returned; a disk read
        lands there, promoting the block); without one, a temporary CPU tensor (id None).
        None when no tier has a good copy.
        """
        host = self.host
        if host is not None:
            hid = host.blocks.lookup(h)
            if hid is not None:
                host.blocks.incref(hid)
                self._counters["blocks_from_host"] += 1
                return host.records[hid:hid + 1], hid
        if self.disk is None:
            return None
        hid = None
        if host is not None:
            hid = self._allocate_host_record()
            if hid is None:
                return None
            record = host.records[hid:hid + 1]
        else:
            record = torch.empty(1, self.layout.block_bytes, dtype=torch.uint8)
        if not self.disk.read(record_key("block", h), record[0], token_digest(block_tokens)):
            if hid is not None:
                self._drop_host_ref(hid)
            self._counters["disk_read_failures"] += 1
            return None
        if hid is not None:
            assert host is not None
            host.blocks.cache(hid, h)
        self._counters["blocks_from_disk"] += 1
        return record, hid

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

    def _restore_snapshot(self, slot: int, h: bytes, tokens: list[int], n: int) -> bool:
        """Restore the State at the end of block ``n`` (hash ``h``) into ``slot``."""
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
        elif self.disk is not None:
            data = torch.empty(self.layout.snapshot_bytes, dtype=torch.uint8)
            bt = self.layout.block_tokens
            if not self.disk.read(record_key("snapshot", h), data, token_digest(tokens[(n - 1) * bt:n * bt])):
                self._counters["disk_read_failures"] += 1
                return False
            self._counters["snapshots_from_disk"] += 1
        else:
            return False
        self.states.restore(slot, data.to(self.device))
        self._counters["snapshot_hits"] += 1
        # promote into the GPU snapshot pool so the next open hits it there
        sid = ids.allocate()
        if sid is not None:
            self.snapshots.data[sid].copy_(data)
            ids.cache(sid, h)
            ids.free(sid)
        return True

    # ----------------------------------------------------- tier movements
    def _release_block(self, b: int) -> None:
        """Drop one reference on GPU block ``b`` (and its host record when it dies)."""
        if self.blocks.refcount(b) == 1 and self.blocks.block_hash(b) is None:
            hid = self._host_of_block.pop(b, None)
            if hid is not None:
                self._drop_host_ref(hid)
        self.blocks.free(b)

    def _on_block_evict(self, b: int, h: bytes) -> None:
        """A cached GPU block is reused: keep its record in the host tier."""
        hid = self._host_of_block.pop(b, None)
        if hid is not None:  # HiSparse: the host already holds the record
            self._drop_host_ref(hid)
            return
        if self.host is None or self.host.blocks.lookup(h) is not None:
            return
        hid = self.host.blocks.allocate()
        if hid is None:
            return
        handle = self.copies.offload_blocks(self.classical.parts, torch.tensor([b]), self.host.records[hid:hid + 1])
        handle.make_stream_wait()  # the block is overwritten only after the copy read it
        self.host.blocks.cache(hid, h)
        self.host.blocks.free(hid)
        self._counters["blocks_offloaded"] += 1

    def _on_snapshot_evict(self, sid: int, h: bytes) -> None:
        if self.host is not None:
            self.host.put_snapshot(h, self.snapshots.data[sid].cpu())


def record_key(kind: str, h: bytes):  # -> tiered_kv.storage.RecordKey
    from .storage import RecordKey

    return RecordKey.block(h) if kind == "block" else RecordKey.snapshot(h)
