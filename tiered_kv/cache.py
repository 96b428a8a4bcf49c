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
from dataclasses import dataclass, field

import numpy as np
import torch

from .block_pool import BlockPool
from .classical_pool import ClassicalPool
from .device import resolve_device
from .errors import CacheFullError
from .layout import KVLayout, LayerKind
from .prefix import PrefixHasher, tokens_to_bytes
from .state_pool import SnapshotPool, StatePool, StateView

__all__ = ["Request", "TieredKVCache"]


@dataclass(eq=False)
class Request:
    """One sequence's view of the cache. Created by :meth:`TieredKVCache.open`."""

    request_id: int
    #: State slot index in the State pool.
    slot: int
    #: Tokens whose KV is in the cache (cached prefix + everything advanced since).
    token_ids: list[int]
    #: Block table: Classical block ids, one per started block.
    block_ids: list[int]
    #: Prefix hashes of the sealed (full) blocks, ``len(block_hashes) <= len(block_ids)``.
    block_hashes: list[bytes]
    #: Tokens served from the cache at open.
    num_cached_tokens: int
    closed: bool = False
    #: Private snapshots of the latest block boundaries: (num_blocks, snapshot id, hash).
    _pending: list[tuple[int, int, bytes]] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_sealed_blocks(self) -> int:
        return len(self.block_hashes)


def _as_token_list(token_ids: Sequence[int] | np.ndarray | torch.Tensor, what: str = "token_ids") -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise ValueError(f"{what}: expected a 1-D integer tensor, got {token_ids.dtype} {list(token_ids.shape)}")
        token_ids = token_ids.tolist()
    out = list(token_ids)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"{what}: expected integer token ids, got {type(t).__name__}")
    tokens_to_bytes(out)  # range check
    return [int(t) for t in out]


class TieredKVCache:
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
    """

    def __init__(self, layout: KVLayout, *, device: str | torch.device = "cpu", num_blocks: int = 256,
                 num_state_slots: int = 8, num_snapshots: int | None = None, snapshot_interval: int = 8,
                 model_id: str | None = None, salt: str | bytes = b"") -> None:
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
        self.hasher = PrefixHasher(layout, model_id=model_id, salt=salt)
        self.blocks = BlockPool(num_blocks)
        self.classical = ClassicalPool(layout, num_blocks, self.device)
        self.states = StatePool(layout, num_state_slots, self.device)
        self.snapshots = SnapshotPool(layout, num_snapshots, self.device)
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._counters: dict[str, int] = dict.fromkeys(
            ["requests_opened", "requests_closed", "prompt_tokens", "cached_tokens", "blocks_sealed",
             "blocks_duplicate", "snapshots_taken", "snapshots_registered", "snapshots_skipped",
             "snapshot_hits"], 0)

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
                num_entries: int, writable: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Entry ids -> (block ids, offsets) through the request's block table."""
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
        state snapshot; at least one prompt token is always left to compute so the caller
        gets logits (``max_cached_tokens`` lowers the bound further). The request then
        stands at ``num_cached_tokens``; the caller runs the rest of the prompt.

        Raises :class:`CacheFullError` when no State slot is free.
        """
        tokens = _as_token_list(token_ids)
        limit = max(0, len(tokens) - 1)
        if max_cached_tokens is not None:
            if max_cached_tokens < 0:
                raise ValueError(f"max_cached_tokens: expected >= 0, got {max_cached_tokens}")
            limit = min(limit, max_cached_tokens)
        slot = self.states.allocate()
        if slot is None:
            raise CacheFullError(f"open: no free state slot ({self.states.num_slots} in use); close a request first")
        bt = self.layout.block_tokens
        matched: list[tuple[bytes, int]] = []
        for h in self.hasher.iter_block_hashes(tokens[:limit - limit % bt]):
            b = self.blocks.lookup(h)
            if b is None:
                break
            matched.append((h, b))
        num_blocks = 0
        snap_id = None
        for i in range(len(matched), 0, -1):
            snap_id = self.snapshots.ids.lookup(matched[i - 1][0])
            if snap_id is not None:
                num_blocks = i
                break
        for _, b in matched[:num_blocks]:
            self.blocks.incref(b)
        if snap_id is not None:
            self.snapshots.ids.incref(snap_id)  # refresh its LRU position
            self.states.restore(slot, self.snapshots.data[snap_id])
            self.snapshots.ids.free(snap_id)
            self._counters["snapshot_hits"] += 1
        P = num_blocks * bt
        req = Request(request_id=next(self._ids), slot=slot, token_ids=tokens[:P],
                      block_ids=[b for _, b in matched[:num_blocks]],
                      block_hashes=[h for h, _ in matched[:num_blocks]], num_cached_tokens=P)
        self._requests[req.request_id] = req
        self._counters["requests_opened"] += 1
        self._counters["prompt_tokens"] += len(tokens)
        self._counters["cached_tokens"] += P
        return req

    def close(self, request: Request) -> None:
        """End a request: free its State slot; its full blocks stay as cached prefix."""
        req = self._live(request)
        for _, snap_id, h in req._pending:
            self._register_snapshot(snap_id, h)
        req._pending = []
        # Free the tail first so LRU eviction takes a prefix's end before its start.
        for b in reversed(req.block_ids):
            self.blocks.free(b)
        self.states.free(req.slot)
        req.closed = True
        del self._requests[req.request_id]
        self._counters["requests_closed"] += 1

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
        blk, off = self._locate(req, ids, L.csa_entries_per_block,
                                num_entries=len(req.block_ids) * L.csa_entries_per_block, writable=True)
        self.classical.csa_kv[c, blk, off] = kv
        self.classical.indexer[c, blk, off] = keys

    def write_hca(self, request: Request, layer: int, entry_ids: torch.Tensor, kv: torch.Tensor) -> None:
        """Store completed HCA entries of HCA ``layer``: kv ``[m, entry_bytes]`` uint8."""
        req = self._live(request)
        h = self._layer_part(layer, LayerKind.HCA)
        ids = self._entry_ids("entry_ids", entry_ids)
        L = self.layout
        self._check_bytes("kv", kv, (ids.numel(), L.entry_bytes))
        blk, off = self._locate(req, ids, L.hca_entries_per_block,
                                num_entries=len(req.block_ids) * L.hca_entries_per_block, writable=True)
        self.classical.hca_kv[h, blk, off] = kv

    def read_indexer_keys(self, request: Request, layer: int, num_entries: int) -> torch.Tensor:
        """The first ``num_entries`` indexer keys of CSA ``layer``: ``[num_entries, indexer_bytes]`` uint8."""
        req = self._live(request)
        c = self._layer_part(layer, LayerKind.CSA)
        ids = torch.arange(num_entries)
        blk, off = self._locate(req, ids, self.layout.csa_entries_per_block,
                                num_entries=len(req.block_ids) * self.layout.csa_entries_per_block, writable=False)
        return self.classical.indexer[c, blk, off]

    def read_csa(self, request: Request, layer: int, entry_ids: torch.Tensor) -> torch.Tensor:
        """CSA entries ``entry_ids`` of CSA ``layer``: ``[m, entry_bytes]`` uint8 (a gather)."""
        req = self._live(request)
        c = self._layer_part(layer, LayerKind.CSA)
        ids = self._entry_ids("entry_ids", entry_ids)
        blk, off = self._locate(req, ids, self.layout.csa_entries_per_block,
                                num_entries=len(req.block_ids) * self.layout.csa_entries_per_block, writable=False)
        return self.classical.csa_kv[c, blk, off]

    def read_hca(self, request: Request, layer: int, num_entries: int) -> torch.Tensor:
        """The first ``num_entries`` HCA entries of HCA ``layer``: ``[num_entries, entry_bytes]`` uint8."""
        req = self._live(request)
        h = self._layer_part(layer, LayerKind.HCA)
        ids = torch.arange(num_entries)
        blk, off = self._locate(req, ids, self.layout.hca_entries_per_block,
                                num_entries=len(req.block_ids) * self.layout.hca_entries_per_block, writable=False)
        return self.classical.hca_kv[h, blk, off]

    def advance(self, request: Request, token_ids: Sequence[int]) -> None:
        """Record that the KV of ``token_ids`` has been written; seal and snapshot at boundaries.

        The tokens must not cross a block boundary (split chunks there: the State at the
        boundary is what a snapshot needs), and their blocks must have been reserved.
        """
        req = self._live(request)
        tokens = _as_token_list(token_ids)
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
        bt = self.layout.block_tokens
        k = req.num_sealed_blocks
        parent = req.block_hashes[-1] if req.block_hashes else self.hasher.root
        h = self.hasher.chain(parent, tokens_to_bytes(req.token_ids[k * bt:(k + 1) * bt]))
        req.block_hashes.append(h)
        self._counters["blocks_sealed"] += 1
        if not self.blocks.cache(req.block_ids[k], h):
            self._counters["blocks_duplicate"] += 1
        self._snapshot_at_boundary(req, h, k + 1)

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
            self._register_snapshot(snap_id, h)
        else:
            req._pending.append((num_blocks, snap_id, h))

    def _register_snapshot(self, snap_id: int, h: bytes) -> None:
        """Publish a private snapshot under ``h`` (unless one exists) and drop our reference."""
        ids = self.snapshots.ids
        if ids.cache(snap_id, h):
            self._counters["snapshots_registered"] += 1
        ids.free(snap_id)

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict[str, int]:
        """Counters and pool occupancy."""
        return {
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
        }
