"""``TieredKVCache``: the facade serving stacks and the reference model talk to.

Lifecycle of a request (ARCHITECTURE §5)::

    req = cache.open(prompt)             # longest cached prefix ending at a resume point
                                         # with a snapshot: blocks shared, State restored
    model.forward(cache, req, prompt[req.num_cached_tokens:])
        per segment (never crossing a block boundary):
            cache.reserve(req, n)        # blocks for n more tokens
            cache.state(req)             # SWA ring + compressor tails, updated in place
            cache.write_csa / write_hca  # completed entries into the request's open block
            cache.read_indexer_keys / read_csa / read_hca
            cache.advance(req, tokens)   # seals a full block (prefix hash), snapshots
                                         # the State at block boundaries
    cache.close(req)                     # State slot freed; full blocks stay cached
                                         # (evictable, LRU) with a snapshot at the last
                                         # resume point

Snapshot policy: at every block boundary the request snapshots its State into a private
snapshot slot and keeps the latest two; every ``snapshot_interval`` blocks the snapshot
is registered at once (shared with other requests); at close the private ones are
registered. So a closed prefix is resumable at its last block boundary (and the one
before, for the same prompt sent again: one token is always recomputed), and long
prompts are resumable every ``snapshot_interval`` blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from .block_pool import BlockPool
from .classical_pool import ClassicalPool
from .device import empty_host, resolve_device
from .disk import DiskTier
from .errors import CacheFullError
from .hisparse import HiSparseBuffers, HiSparseConfig
from .host import HostTier
from .layout import KVLayout, LayerKind
from .metrics import MetricsSnapshot
from .metrics import collect as collect_metrics
from .prefix import PrefixHasher, token_digest, tokens_to_bytes
from .request import Request, as_token_list
from .state_pool import SnapshotPool, StatePool, StateView
from .tiering import TierMoves, record_key
from .transfer import CopyEngine

__all__ = ["Request", "TieredKVCache"]


class TieredKVCache(TierMoves):
    """The KV cache of one model, across tiers (this version: the GPU tier).

    Args:
        layout: the model's :class:`~tiered_kv.layout.KVLayout`.
        device: where the pools live (``"cpu"`` or ``"cuda[:i]"``).
        num_blocks: Classical blocks in the pool (each ``layout.block_bytes``).
        num_state_slots: concurrent requests (each ``layout.state_bytes``).
        num_snapshots: snapshot slots (each ``layout.snapshot_bytes``); at least
            ``num_state_slots + 1``; default ``4 * num_state_slots``.
        snapshot_interval: register a shared snapshot every this many blocks.
        model_id, salt: the prefix-hash namespace (model id + layout fingerprint + tenant
            salt); requests of different salts never share blocks.
        host_bytes: enable the host tier with this many bytes of (pinned) CPU memory: it
            keeps blocks and snapshots evicted from the GPU, and the HiSparse mirror.
        hisparse: enable HiSparse (needs ``host_bytes``): sealed blocks' CSA entries live
            on the host, each request keeps ``device_buffer_entries`` of them per CSA
            layer on the device.
        store: enable the disk tier: a :class:`tiered_kv.storage.BlockStore` or a URL
            (``"lmdb:///path"``, ``"zarr:///path"``). Full blocks and snapshots are
            written behind the request; :meth:`flush` waits for them.
        store_options: keyword options for :func:`tiered_kv.storage.open_store`.
    """

    def __init__(self, layout: KVLayout, *, device: str | torch.device = "cpu", num_blocks: int = 256,
                 num_state_slots: int = 8, num_snapshots: int | None = None, snapshot_interval: int = 8,
                 model_id: str | None = None, salt: str | bytes = b"", host_bytes: int | None = None,
                 hisparse: HiSparseConfig | None = None, store: object | None = None,
                 store_options: dict | None = None) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        self.device = resolve_device(device)
        if num_snapshots is None:
            num_snapshots = 4 * num_state_slots
        if num_snapshots < num_state_slots + 1:
            raise ValueError(f"num_snapshots: expected >= num_state_slots + 1 = {num_state_slots + 1}, "
                             f"got {num_snapshots}")
        if isinstance(snapshot_interval, bool) or not isinstance(snapshot_interval, int) or snapshot_interval <= 0:
            raise ValueError(f"snapshot_interval: expected a positive int, got {snapshot_interval!r}")
        self.snapshot_interval = snapshot_interval
        if hisparse is not None and host_bytes is None:
            raise ValueError("hisparse: expected host_bytes too (the CSA mirror lives in the host tier)")
        if hisparse is not None and not isinstance(hisparse, HiSparseConfig):
            raise TypeError(f"hisparse: expected a HiSparseConfig, got {type(hisparse).__name__}")
        self.hasher = PrefixHasher(layout, model_id=model_id, salt=salt)
        self.copies = CopyEngine(self.device)
        self.blocks = BlockPool(num_blocks, on_evict=self._on_block_evict)
        self.classical = ClassicalPool(layout, num_blocks, self.device,
                                       csa_blocks=num_state_slots if hisparse is not None else None)
        self.states = StatePool(layout, num_state_slots, self.device)
        self.snapshots = SnapshotPool(layout, num_snapshots, self.device)
        self.snapshots.ids.on_evict = self._on_snapshot_evict
        self.host = HostTier(layout, host_bytes, self.device) if host_bytes is not None else None
        self.hisparse = (HiSparseBuffers(layout, hisparse, num_state_slots, self.device)
                         if hisparse is not None else None)
        #: HiSparse: GPU block -> the host record holding its CSA part (one host ref each).
        self._host_of_block: dict[int, int] = {}
        self.disk = DiskTier(store, layout, store_options=store_options) if store is not None else None
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._counters: dict[str, int] = dict.fromkeys(
            ["requests_opened", "requests_closed", "prompt_tokens", "cached_tokens", "blocks_sealed",
             "blocks_duplicate", "snapshots_taken", "snapshots_registered", "snapshots_skipped",
             "snapshot_hits", "blocks_from_host", "blocks_from_disk", "snapshots_from_host",
             "snapshots_from_disk", "blocks_offloaded", "disk_read_failures"], 0)

    # ---------------------------------------------------------------- checks
    def _live(self, request: Request) -> Request:
        if not isinstance(request, Request):
            raise TypeError(f"request: expected a Request, got {type(request).__name__}")
        if request.closed:
            raise ValueError(f"request {request.request_id} is closed (double close or use after close)")
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id} is unknown to this cache")
        return request

    def _check_bytes(self, what: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.uint8:
            raise ValueError(f"{what}: expected dtype torch.uint8, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{what}: expected shape {list(shape)}, got {list(x.shape)}")
        if x.device != self.device:
            raise ValueError(f"{what}: expected device {self.device}, got {x.device}")

    def _entry_ids(self, what: str, ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{what}: expected a 1-D int64 tensor of entry ids, got {ids.dtype} {list(ids.shape)}")
        return ids.to(torch.int64).cpu()

    def _layer_part(self, layer: int, kind: LayerKind) -> int:
        if not isinstance(layer, int) or not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer: expected an int in [0, {self.layout.num_layers}), got {layer!r}")
        if self.layout.layer_kinds[layer] is not kind:
            raise ValueError(f"layer {layer}: expected a {kind.value} layer, got {self.layout.layer_kinds[layer].value}")
        return self.layout.part_index(layer)

    def _locate(self, request: Request, ids: torch.Tensor, per_block: int, *,
                writable: bool, num_entries: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry ids -> (block ids, offsets) through the request's block table.

        ``num_entries`` bounds the ids (default: every entry of the request's blocks).
        """
        if num_entries is None:
            num_entries = len(request.block_ids) * per_block
        if ids.numel() == 0:
            return ids, ids
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_entries:
            raise ValueError(f"entry ids: expected ids in [0, {num_entries}), got [{lo}, {hi}]")
        block_idx = ids // per_block
        if writable and int(block_idx.min()) < request.num_sealed_blocks:
            raise ValueError(f"entry ids: block {int(block_idx.min())} of request {request.request_id} is "
                             f"sealed (immutable); writes go to blocks >= {request.num_sealed_blocks}")
        table = torch.tensor(request.block_ids, dtype=torch.int64)
        return table[block_idx], ids % per_block

    # ------------------------------------------------------------ open/close
    def open(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, *,
             max_cached_tokens: int | None = None) -> Request:
        """Start a request for ``token_ids`` (its prompt), reusing the longest cached prefix.

        The prefix must end at a resume point (a multiple of ``block_tokens``) that has a
        state snapshot in some tier; blocks and the snapshot are looked up nearest first
        (GPU, host, disk) and loaded up the tiers. At least one prompt token is always
        left to compute so the caller gets logits (``max_cached_tokens`` lowers the bound
        further). The request then stands at ``num_cached_tokens``.

        Raises :class:`CacheFullError` when no State slot is free.
        """
        tokens = as_token_list(token_ids)
        limit = max(0, len(tokens) - 1)
        if max_cached_tokens is not None:
            if max_cached_tokens < 0:
                raise ValueError(f"max_cached_tokens: expected >= 0, got {max_cached_tokens}")
            limit = min(limit, max_cached_tokens)
        slot = self.states.allocate()
        if slot is None:
            raise CacheFullError(f"open: no free state slot ({self.states.num_slots} in use); close a request first")
        if self.hisparse is not None:
            self.hisparse.reset(slot)
        bt = self.layout.block_tokens
        hashes = self.hasher.block_hashes(tokens[:limit - limit % bt])
        block_ids, num_blocks = self._match_prefix(slot, tokens, hashes)
        P = num_blocks * bt
        req = Request(request_id=next(self._ids), slot=slot, token_ids=tokens[:P], block_ids=block_ids,
                      block_hashes=hashes[:num_blocks], num_cached_tokens=P)
        self._requests[req.request_id] = req
        self._counters["requests_opened"] += 1
        self._counters["prompt_tokens"] += len(tokens)
        self._counters["cached_tokens"] += P
        return req

    def close(self, request: Request) -> None:
        """End a request: free its State slot; its full blocks stay as cached prefix."""
        req = self._live(request)
        for k, snap_id, h in req._pending:
            self._register_snapshot(snap_id, h, req.token_ids[(k - 1) * self.layout.block_tokens:
                                                              k * self.layout.block_tokens])
        req._pending = []
        if req._host_reserved is not None:
            assert self.host is not None
            self.host.blocks.free(req._host_reserved)
            req._host_reserved = None
        # Free the tail first so LRU eviction takes a prefix's end before its start.
        for b in reversed(req.block_ids):
            self._release_block(b)
        self.states.free(req.slot)
        req.closed = True
        del self._requests[req.request_id]
        self._counters["requests_closed"] += 1

    def flush(self, *, uploads: bool = False, timeout_s: float | None = None) -> bool:
        """Wait for every pending copy and disk write submitted so far.

        When it returns, every block and snapshot written so far is durable in the store
        (for a store chain: in its local level 0, with the uploads to the farther levels
        journaled when level 0 is a local directory, so a process killed now loses none of
        them: the next one to open the chain resumes them). ``uploads=True`` also waits
        until those uploads are in the farther levels (see
        :meth:`tiered_kv.storage.StoreChain.flush`). Returns False if ``timeout_s`` passed
        first (only with ``uploads=True``; a far level may be down); True otherwise.
        """
        self.copies.synchronize()
        if self.disk is not None:
            return self.disk.flush(uploads=uploads, timeout_s=timeout_s)
        return True

    def shutdown(self) -> None:
        """Flush and close the disk tier (a store opened from a URL is closed).

        A store chain keeps uploading for up to its ``close_timeout_s`` and then stops;
        uploads not done by then stay journaled and the next process resumes them (see
        :meth:`flush` to wait for them instead)."""
        self.copies.synchronize()
        if self.disk is not None:
            self.disk.close()

    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------ engine interface
    def state(self, request: Request) -> StateView:
        """Views of the request's State slot (SWA ring and compressor tails), written in place."""
        return self.states.view(self._live(request).slot)

    def reserve(self, request: Request, num_new_tokens: int) -> None:
        """Make sure the request's block table covers ``num_new_tokens`` more tokens.

        Evicts unreferenced cached blocks (LRU) as needed; raises :class:`CacheFullError`
        if the pool cannot supply them (nothing is allocated then).
        """
        req = self._live(request)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens: expected >= 0, got {num_new_tokens}")
        need = self.layout.num_blocks_for(req.num_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return
        got = self.blocks.allocate_many(need)
        if got is None:
            raise CacheFullError(f"reserve: request {req.request_id} needs {need} more blocks, "
                                 f"{self.blocks.num_available} available of {self.blocks.num_blocks}")
        req.block_ids.extend(got)
        if self.hisparse is not None and req._host_reserved is None:
            req._host_reserved = self._reserve_host_record(req)

    def _reserve_host_record(self, req: Request) -> int:
        """HiSparse: a host record for the CSA part of the block the request fills."""
        hid = self._allocate_host_record()
        if hid is None:
            raise CacheFullError(f"request {req.request_id}: the host tier has no free record for a sealed "
                                 f"block's CSA entries ({self.host.num_blocks} records, all referenced)")
        return hid

    def write_csa(self, request: Request, layer: int, entry_ids: torch.Tensor,
                  kv: torch.Tensor, keys: torch.Tensor) -> None:
        """Store completed CSA entries and their indexer keys of CSA ``layer``.

        entry_ids ``[m]`` int64 (request-relative entry index); kv ``[m, entry_bytes]`` uint8;
        keys ``[m, indexer_bytes]`` uint8; both on the cache's device.
        """
        req = self._live(request)
        c = self._layer_part(layer, LayerKind.CSA)
        ids = self._entry_ids("entry_ids", entry_ids)
        m, L = ids.numel(), self.layout
        self._check_bytes("kv", kv, (m, L.entry_bytes))
        self._check_bytes("keys", keys, (m, L.indexer_bytes))
        blk, off = self._locate(req, ids, L.csa_entries_per_block, writable=True)
        self.classical.indexer[c, blk, off] = keys
        if self.hisparse is None:
            self.classical.csa_kv[c, blk, off] = kv
            return
        # HiSparse: entries are written to the request's open block, one per State slot
        if m and int(ids.max()) >= (req.num_sealed_blocks + 1) * L.csa_entries_per_block:
            raise ValueError(f"entry ids: with HiSparse only the open block {req.num_sealed_blocks} of request "
                             f"{req.request_id} is writable, got entry {int(ids.max())}")
        self.classical.csa_kv[c, req.slot, off] = kv

    def write_hca(self, request: Request, layer: int, entry_ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Store completed HCA entries of HCA ``layer``: kv ``[m, entry_bytes]`` uint8."""
        req = self._live(request)
        h = self._layer_part(layer, LayerKind.HCA)
        ids = self._entry_ids("entry_ids", entry_ids)
        L = self.layout
        self._check_bytes("kv", kv, (ids.numel(), L.entry_bytes))
        blk, off = self._locate(req, ids, L.hca_entries_per_block, writable=True)
        self.classical.hca_kv[h, blk, off] = kv

    def read_indexer_keys(self, request: Request, layer: int, num_entries: int) -> torch.Tensor:
        """The first ``num_entries`` indexer keys of CSA ``layer``: ``[num_entries, indexer_bytes]`` uint8."""
        req = self._live(request)
        c = self._layer_part(layer, LayerKind.CSA)
        ids = torch.arange(num_entries)
        blk, off = self._locate(req, ids, self.layout.csa_entries_per_block, writable=False)
        return self.classical.indexer[c, blk, off]

    def read_csa(self, request: Request, layer: int, entry_ids: torch.Tensor) -> torch.Tensor:
        """CSA entries ``entry_ids`` of CSA ``layer``: ``[m, entry_bytes]`` uint8 (a gather)."""
        req = self._live(request)
        c = self._layer_part(layer, LayerKind.CSA)
        ids = self._entry_ids("entry_ids", entry_ids)
        E = self.layout.csa_entries_per_block
        blk, off = self._locate(req, ids, E, writable=False)
        if self.hisparse is None:
            return self.classical.csa_kv[c, blk, off]
        out = torch.empty(ids.numel(), self.layout.entry_bytes, dtype=torch.uint8, device=self.device)
        sealed = ids // E < req.num_sealed_blocks
        if (~sealed).any():
            out[~sealed] = self.classical.csa_kv[c, req.slot, off[~sealed]]
        if sealed.any():
            out[sealed] = self._swap_in(req, c, ids[sealed], blk[sealed], off[sealed])
        return out

    def swap_in(self, request: Request, layer: int, entry_ids: torch.Tensor) -> torch.Tensor:
        """HiSparse: make CSA entries of sealed blocks resident in the request's device
        buffer for CSA ``layer``; returns their buffer slots ``[k]`` int64.

        entry_ids ``[k]`` int64, unique, ``k <= device_buffer_entries``, all in sealed
        blocks. The bytes are then ``cache.hisparse.buffer[request.slot, part, slots]``.
        """
        req = self._live(request)
        if self.hisparse is None:
            raise ValueError("swap_in: HiSparse is not enabled (pass hisparse=HiSparseConfig(...))")
        c = self._layer_part(layer, LayerKind.CSA)
        ids = self._entry_ids("entry_ids", entry_ids)
        E = self.layout.csa_entries_per_block
        blk, off = self._locate(req, ids, E, num_entries=req.num_sealed_blocks * E, writable=False)
        if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
            raise ValueError("entry_ids: expected unique ids")
        return self.hisparse.swap_in(req.slot, c, ids, self._host_rows(c, blk, off), self.host.csa_rows())

    def _host_rows(self, c: int, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """Flat rows of CSA entries (GPU block, offset) in the host mirror's row view."""
        E = self.layout.csa_entries_per_block
        hb = torch.tensor([self._host_of_block[int(b)] for b in blk], dtype=torch.int64)
        return hb * (self.layout.num_csa_layers * E) + c * E + off

    def _swap_in(self, req: Request, c: int, ids: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        assert self.hisparse is not None and self.host is not None
        rows = self._host_rows(c, blk, off)
        if ids.numel() <= self.hisparse.capacity:
            slots = self.hisparse.swap_in(req.slot, c, ids, rows, self.host.csa_rows())
            return self.hisparse.read(req.slot, c, slots)
        # more entries than the buffer holds (a long prefill chunk): read the mirror directly
        return self.hisparse.read_direct(rows, self.host.csa_rows())

    def read_hca(self, request: Request, layer: int, num_entries: int) -> torch.Tensor:
        """The first ``num_entries`` HCA entries of HCA ``layer``: ``[num_entries, entry_bytes]`` uint8."""
        req = self._live(request)
        h = self._layer_part(layer, LayerKind.HCA)
        ids = torch.arange(num_entries)
        blk, off = self._locate(req, ids, self.layout.hca_entries_per_block, writable=False)
        return self.classical.hca_kv[h, blk, off]

    def advance(self, request: Request, token_ids: Sequence[int]) -> None:
        """Record that the KV of ``token_ids`` has been written; seal and snapshot at boundaries.

        The tokens must not cross a block boundary (split chunks there: the State at the
        boundary is what a snapshot needs), and their blocks must have been reserved.
        """
        req = self._live(request)
        tokens = as_token_list(token_ids)
        bt = self.layout.block_tokens
        n0 = req.num_tokens
        n1 = n0 + len(tokens)
        if not tokens:
            return
        boundary = (n0 // bt + 1) * bt
        if n1 > boundary:
            raise ValueError(f"advance: tokens [{n0}, {n1}) cross the block boundary at {boundary}; "
                             f"split the chunk there")
        if n1 > len(req.block_ids) * bt:
            raise ValueError(f"advance: tokens up to {n1} need {self.layout.num_blocks_for(n1)} blocks, "
                             f"request has {len(req.block_ids)}; call reserve() first")
        req.token_ids.extend(tokens)
        if n1 == boundary:
            self._seal(req)

    # --------------------------------------------------------- seal/snapshot
    def _seal(self, req: Request) -> None:
        """The request's open block is full: hash it, publish it, mirror and persist it."""
        bt = self.layout.block_tokens
        k = req.num_sealed_blocks
        b = req.block_ids[k]
        parent = req.block_hashes[-1] if req.block_hashes else self.hasher.root
        block_tokens = req.token_ids[k * bt:(k + 1) * bt]
        h = self.hasher.chain(parent, tokens_to_bytes(block_tokens))
        req.block_hashes.append(h)
        self._counters["blocks_sealed"] += 1
        record = None
        if self.hisparse is not None:
            record = self._mirror_to_host(req, b, h)
        if not self.blocks.cache(b, h):
            self._counters["blocks_duplicate"] += 1
        if self.disk is not None:
            if record is None:
                record = empty_host((1, self.layout.block_bytes), pinned=self.copies.device.type == "cuda")
                handle = self.copies.offload_blocks(self.classical.parts, torch.tensor([b]), record)
                ready = handle.wait_event
            else:
                record, ready = record.clone(), None  # a private copy: the host record may be recycled
            self.disk.submit(record_key("block", h), parent, token_digest(block_tokens), record[0], ready)
        self._snapshot_at_boundary(req, h, k + 1)

    def _mirror_to_host(self, req: Request, b: int, h: bytes) -> torch.Tensor:
        """HiSparse: copy the sealed block's record (CSA part from the open block) to the
        host; the GPU block keeps a reference on it. Returns the host record ``[1, B]``."""
        assert self.host is not None
        hid = req._host_reserved if req._host_reserved is not None else self._reserve_host_record(req)
        req._host_reserved = None
        cp = self.classical
        parts = (cp.csa_kv[:, req.slot:req.slot + 1], cp.indexer[:, b:b + 1], cp.hca_kv[:, b:b + 1])
        self.copies.offload_blocks(parts, torch.tensor([0]), self.host.records[hid:hid + 1]).wait()
        if not self.host.blocks.cache(hid, h):  # the host already has this block: use that record
            existing = self.host.blocks.lookup(h)
            assert existing is not None
            self.host.blocks.free(hid)
            self.host.blocks.incref(existing)
            hid = existing
        self._host_of_block[b] = hid
        return self.host.records[hid:hid + 1]

    def _snapshot_at_boundary(self, req: Request, h: bytes, num_blocks: int) -> None:
        """Snapshot the State at the boundary after block ``num_blocks``.

        Private snapshots of the last two boundaries are kept (a prompt of exactly k
        blocks resumes at block k-1, since one token is always recomputed); older private
        ones are recycled. Interval boundaries are published at once.
        """
        ids = self.snapshots.ids
        recycled: int | None = None
        keep: list[tuple[int, int, bytes]] = []
        for k, snap_id, old_h in req._pending:
            if k < num_blocks - 1 and recycled is None:
                recycled = snap_id
            elif k < num_blocks - 1:
                ids.free(snap_id)
            else:
                keep.append((k, snap_id, old_h))
        req._pending = keep
        snap_id = recycled if recycled is not None else ids.allocate()
        if snap_id is None:
            self._counters["snapshots_skipped"] += 1
            return
        self.states.snapshot(req.slot, out=self.snapshots.data[snap_id])
        self._counters["snapshots_taken"] += 1
        if num_blocks % self.snapshot_interval == 0:
            bt = self.layout.block_tokens
            self._register_snapshot(snap_id, h, req.token_ids[(num_blocks - 1) * bt:num_blocks * bt])
        else:
            req._pending.append((num_blocks, snap_id, h))

    def _register_snapshot(self, snap_id: int, h: bytes, block_tokens: list[int]) -> None:
        """Publish a private snapshot under ``h`` (unless one exists), persist it, drop our ref."""
        ids = self.snapshots.ids
        if ids.cache(snap_id, h):
            self._counters["snapshots_registered"] += 1
            if self.disk is not None:
                parent = self.hasher.root  # a snapshot record's parent field is unused; keep it fixed
                self.disk.submit(record_key("snapshot", h), parent, token_digest(block_tokens),
                                 self.snapshots.data[snap_id].to("cpu", copy=True))
        ids.free(snap_id)

    # ----------------------------------------------------------------- stats
    def metrics(self) -> MetricsSnapshot:
        """Counters and gauges per tier; ``.to_prometheus()`` renders the text format."""
        return collect_metrics(self)

    def stats(self) -> dict[str, int]:
        """Counters and pool occupancy of every tier."""
        out = {
            **self._counters,
            "live_requests": len(self._requests),
            "blocks_total": self.blocks.num_blocks,
            "blocks_free": self.blocks.num_free,
            "blocks_cached_evictable": self.blocks.num_evictable,
            "blocks_used": self.blocks.num_used,
            "blocks_evicted": self.blocks.evictions,
            "state_slots_free": self.states.num_free,
            "snapshots_cached": self.snapshots.ids.num_cached,
            "snapshots_evicted": self.snapshots.ids.evictions,
            "copy_bytes_d2h": self.copies.bytes_d2h,
            "copy_bytes_h2d": self.copies.bytes_h2d,
        }
        if self.host is not None:
            out.update(self.host.stats())
        if self.hisparse is not None:
            out.update(self.hisparse.stats())
        if self.disk is not None:
            out.update(self.disk.stats())
        return out
