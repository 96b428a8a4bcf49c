"""``TieredKVCache``: the facade serving stacks and the reference model talk to.

Lifecycle of a request (docs/architecture.md §5)::

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

Snapshot policy (:mod:`tiered_kv.policy.snapshots`): at block boundaries the request
snapshots its State into a private snapshot slot and keeps the latest two; at the
boundaries the policy names the snapshot is registered at once (shared with other
requests); at close the private ones of the prompt's end are registered. The default,
``branch+interval:32``, registers where the prompt leaves the cached prefix tree (so the
next request on either branch resumes exactly there), every 32 blocks and at the
prompt's end (with the boundary before it when the request ends on one: one token is
always recomputed). ``snapshot_interval=N`` alone selects the original policy,
``interval:N``: every N blocks and the prompt's last two boundaries.
"""

from __future__ import annotations

import array
import collections
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from .block_pool import BlockPool
from .block_table import BlockTables
from .checks import as_int
from .classical_pool import ClassicalPool
from .device import empty_host, resolve_device
from .disk import DiskTier
from .errors import CacheFullError, CacheShutdownError
from .hisparse import HiSparseBuffers, HiSparseConfig
from .host import HostTier
from .layout import KVLayout, LayerKind
from .lookup import ResumeLookup, Tier
from .metrics import MetricsSnapshot, TierGauges
from .metrics import collect as collect_metrics
from .policy.admission import DEFAULT_ADMISSION, AdmissionPolicy, admission_policy
from .policy.eviction import DEFAULT_EVICTION, EvictionPolicy, eviction_policy
from .policy.snapshots import DEFAULT_SNAPSHOT_POLICY, SnapshotPolicy
from .policy.snapshots import snapshot_policy as policy_by_name
from .prefix import PrefixHasher, checked_token_bytes, digest_token_bytes, token_array, uint32_array_bytes
from .request import Request, as_token_list, checked_tokens
from .resume_reader import prepare_destination
from .state_pool import SnapshotPool, StatePool, StateView
from .tiering import TierMoves, record_key
from .transfer import CopyEngine, CopyHandle
from .write_path import EntryWriter, PartSet, Placement, host_entry_ids, host_entry_list

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
        snapshot_interval: given without ``snapshot_policy``: the ``interval:N`` policy,
            a shared snapshot every this many blocks (and at the prompt's last two
            boundaries). None (default): the default policy, ``branch+interval:32``.
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
        store_options: keyword options for :func:`tiered_kv.storage.open_store`. An
            ``encryption`` config there (or in a level's ``level_options``) without a
            ``tenant`` seals under the tenant ``salt``: ``store_options={"encryption":
            {"key_files": ["/etc/tiered-kv/key"]}}``.
        host_snapshot_fraction: the share of ``host_bytes`` the host tier gives to
            snapshots (the rest holds block records).
        disk_max_pending: disk writes queued behind requests before a new one waits for
            the oldest (:class:`~tiered_kv.disk.DiskTier`'s ``max_pending``; also the most
            records written in one batch).
        snapshot_policy: where requests publish State snapshots, by name or as a
            :class:`~tiered_kv.policy.SnapshotPolicy`: ``"branch+interval:N"`` (where a
            prompt leaves the cached prefix tree, at its end and every N blocks; the
            default is ``branch+interval:32``), ``"branch"`` or ``"interval:N"`` (the
            original policy). None: ``interval:snapshot_interval`` when that is given,
            else the default.
        eviction: the memory tiers' eviction policy (:mod:`tiered_kv.policy.eviction`):
            ``"leaf-lru"`` (the default: leaves first, snapshots with their blocks:
            evicts nothing a cached block after it still needs), ``"leaf-s3fifo"``
            (leaves first, S3-FIFO's small / main / ghost queues) or ``"lru"`` (the
            original: each pool its least recently released entry).
        admission: the disk tier's admission filter (:mod:`tiered_kv.policy.admission`):
            ``"all"`` (the default: every sealed block and published snapshot is written
            through, so a prompt served once is on disk for the next process),
            ``"retraced"`` (seen-twice, or a snapshot of a request that recomputed a path
            whose snapshot was held back, written with its path: as many hits or more on
            both bundled traces, 71-75 % fewer bytes written), ``"second-hit"`` (a
            record reaches the disk once a memory tier has served it), ``"seen-twice"``
            (that, or when it is computed a second time), ``"hits:N"`` or
            ``"survived:N"`` (second-hit, or once it has lived N requests in a memory
            tier). Rejects: ``stats()["admission_rejects"]``. A record held back is not
            on disk: ``flush()`` makes durable what was admitted.
    """

    def __init__(self, layout: KVLayout, *, device: str | torch.device = "cpu", num_blocks: int = 256,
                 num_state_slots: int = 8, num_snapshots: int | None = None, snapshot_interval: int | None = None,
                 model_id: str | None = None, salt: str | bytes = b"", host_bytes: int | None = None,
                 hisparse: HiSparseConfig | None = None, store: object | None = None,
                 store_options: dict | None = None, host_snapshot_fraction: float = 0.25,
                 disk_max_pending: int = 64, snapshot_policy: str | SnapshotPolicy | None = None,
                 eviction: str | EvictionPolicy = DEFAULT_EVICTION, admission: str | AdmissionPolicy = DEFAULT_ADMISSION) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
        self.layout = layout
        #: the layout's sizes the write path reads on every call (properties of a frozen layout)
        self._entry_bytes, self._indexer_bytes = layout.entry_bytes, layout.indexer_bytes
        self._csa_per_block, self._hca_per_block = layout.csa_entries_per_block, layout.hca_entries_per_block
        self.device = resolve_device(device)
        num_blocks = as_int("num_blocks", num_blocks, minimum=1)
        num_state_slots = as_int("num_state_slots", num_state_slots, minimum=1)
        if num_snapshots is None:
            num_snapshots = 4 * num_state_slots
        num_snapshots = as_int("num_snapshots", num_snapshots, minimum=num_state_slots + 1)
        if snapshot_interval is not None:
            snapshot_interval = as_int("snapshot_interval", snapshot_interval, minimum=1)
        #: where requests publish snapshots (:mod:`tiered_kv.policy.snapshots`): the policy
        #: given; else ``interval:snapshot_interval`` when that is given; else the default
        self.snapshot_policy: SnapshotPolicy = (
            policy_by_name(snapshot_policy) if snapshot_policy is not None
            else SnapshotPolicy.intervals(snapshot_interval) if snapshot_interval is not None
            else policy_by_name(DEFAULT_SNAPSHOT_POLICY))
        #: the policy's interval (None: it publishes no interval snapshots)
        self.snapshot_interval: int | None = self.snapshot_policy.interval
        if hisparse is not None and host_bytes is None:
            raise ValueError("hisparse: expected host_bytes too (the CSA mirror lives in the host tier)")
        if hisparse is not None and not isinstance(hisparse, HiSparseConfig):
            raise TypeError(f"hisparse: expected a HiSparseConfig, got {type(hisparse).__name__}")
        self.hasher = PrefixHasher(layout, model_id=model_id, salt=salt)
        self.copies = CopyEngine(self.device)
        self.eviction: EvictionPolicy = eviction_policy(eviction)
        self.blocks = BlockPool(num_blocks, on_evict=self._on_block_evict, leaf_first=self.eviction.leaf_first,
                                small_fraction=self.eviction.small_fraction)
        self.classical = ClassicalPool(layout, num_blocks, self.device,
                                       csa_blocks=num_state_slots if hisparse is not None else None)
        self.states = StatePool(layout, num_state_slots, self.device)
        #: Per State slot: the request's Classical block ids on the device (``block_table``).
        self.tables = BlockTables(num_state_slots, num_blocks, self.device)
        self._writer = EntryWriter(layout, self.tables)
        self.snapshots = SnapshotPool(layout, num_snapshots, self.device)
        self.snapshots.ids.on_evict = self._on_snapshot_evict
        self.host = (HostTier(layout, host_bytes, self.device, snapshot_fraction=host_snapshot_fraction,
                              leaf_first=self.eviction.leaf_first, small_fraction=self.eviction.small_fraction)
                     if host_bytes is not None else None)
        if self.host is not None and self.eviction.coherent_snapshots:
            self.host.blocks.on_evict = self._on_host_block_evict
            if self.host.snapshots is not None:
                self.host.snapshots.on_evict = self._on_host_snapshot_evict
        self.hisparse = (HiSparseBuffers(layout, hisparse, num_state_slots, self.device, max_blocks=num_blocks)
                         if hisparse is not None else None)
        #: HiSparse: GPU block -> the host record holding its CSA part (one host ref each).
        self._host_of_block: dict[int, int] = {}
        #: HiSparse: mirror copies (device -> host) not yet known to be complete
        self._mirrors_pending: collections.deque[CopyHandle] = collections.deque()
        if store_options is not None and not isinstance(store_options, dict):
            raise TypeError(f"store_options: expected a dict, got {type(store_options).__name__}")
        from .storage.encrypted.crypto import default_tenant  # an encrypted level's tenant defaults to the salt

        store_options = default_tenant(store_options, salt)
        self.disk = DiskTier(store, layout, store_options=store_options, max_pending=disk_max_pending,
                             writer=self._store_writer(salt), admission=admission) if store is not None else None
        if store is None:
            admission_policy(admission)  # (validated even without a disk tier)
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._shut_down = False
        self._counters: dict[str, int] = dict.fromkeys(
            ["requests_opened", "requests_closed", "prompt_tokens", "cached_tokens", "blocks_sealed",
             "blocks_duplicate", "snapshots_taken", "snapshots_registered", "snapshots_skipped",
             "snapshots_elided", "snapshots_branch", "snapshots_evicted_with_block",
             "blocks_evicted_with_snapshot", "miss_tokens_no_snapshot", "miss_tokens_not_cached",
             "miss_tokens_tail",
             "snapshot_hits", "blocks_from_host", "blocks_from_disk", "snapshots_from_host",
             "snapshots_from_disk", "blocks_offloaded", "disk_read_failures", "disk_blocks_rewritten"], 0)
        self._resume_dest = prepare_destination(self)

    def _store_writer(self, salt: str | bytes) -> object:
        """What a store created by this cache records about its writer (model id, a hash
        of the tenant salt; see :mod:`tiered_kv.storage.writer`)."""
        from .storage import StoreWriter, WriterKind

        return StoreWriter.of(WriterKind.CACHE, model=self.hasher.model_id, tenant=salt)

    # ---------------------------------------------------------------- checks
    def _check_running(self, what: str) -> None:
        if self._shut_down:
            raise CacheShutdownError(f"{what}: the cache was shut down (shutdown() was called); expected a "
                                     f"running cache: create a new TieredKVCache")

    def _live(self, request: Request) -> Request:
        self._check_running("request calls")
        if not isinstance(request, Request):
            raise TypeError(f"request: expected a Request, got {type(request).__name__}")
        if request.closed:
            raise ValueError(f"request {request.request_id} is closed (double close or use after close)")
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id} is unknown to this cache")
        return request

    def _check_bytes(self, what: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
        if type(x) is torch.Tensor and x.dtype is torch.uint8 and x.shape == shape and x.device == self.device:
            return  # (the common case in one expression: this runs twice per write)
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
        layer = as_int("layer", layer, minimum=0, below=self.layout.num_layers)
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
        self._check_running("open")
        self._prune_store_evictions()  # (what the store evicted meanwhile: see tiering)
        tokens = as_token_list(token_ids)
        limit = max(0, len(tokens) - 1)
        if max_cached_tokens is not None:
            if max_cached_tokens < 0:
                raise ValueError(f"max_cached_tokens: expected >= 0, got {max_cached_tokens}")
            limit = min(limit, max_cached_tokens)
        slot = self.states.allocate(zero=False)  # a restored snapshot overwrites it whole; else reset below
        if slot is None:
            raise CacheFullError(f"open: no free state slot ({self.states.num_slots} in use); close a request first")
        if self.hisparse is not None:
            self.hisparse.reset(slot)
            self._wait_host_mirrors()  # matching may read or recycle host records on the host
        bt = self.layout.block_tokens
        ids = token_array(tokens)  # [len(tokens)] uint32: hashed and digested in slices
        hashes = self.hasher.block_hashes(ids[:limit - limit % bt])
        try:
            block_ids, num_blocks = self._match_prefix(slot, ids, hashes)
        except BaseException:  # e.g. a store's I/O error: the slot goes back, the error up
            self.states.free(slot)
            raise
        if num_blocks == 0:  # nothing restored: a fresh request starts from a zeroed State
            self.states.reset(slot)
        P = num_blocks * bt
        req = Request(request_id=next(self._ids), slot=slot, token_ids=tokens[:P], block_ids=block_ids,
                      block_hashes=hashes[:num_blocks], num_cached_tokens=P)
        held = num_blocks
        if num_blocks < len(hashes):  # why the rest is computed: held without a snapshot, or not held
            held = self._held_prefix(hashes, len(tokens))
            if self.snapshot_policy.branch_points and num_blocks < held < len(hashes):
                req._branch_at = held
        self._counters["miss_tokens_no_snapshot"] += (held - num_blocks) * bt
        self._counters["miss_tokens_not_cached"] += (len(hashes) - held) * bt
        self._counters["miss_tokens_tail"] += len(tokens) - len(hashes) * bt
        self._requests[req.request_id] = req
        self.tables.assign(slot, block_ids)
        if self.hisparse is not None:  # the device's block -> host record table of the prefix
            self.hisparse.set_host_blocks(slot, 0, [self._host_of_block[b] for b in block_ids[:num_blocks]])
        self._counters["requests_opened"] += 1
        self._counters["prompt_tokens"] += len(tokens)
        self._counters["cached_tokens"] += P
        return req

    def _held_prefix(self, hashes: list[bytes], num_tokens: int) -> int:
        """How many leading blocks of ``hashes`` some tier holds: where the prompt leaves
        the cached prefix tree (its first block no tier holds; the router lookup's answer)."""
        look = self.lookup(block_hashes=hashes, num_tokens=num_tokens)
        return look.resident_blocks[look.tiers[-1]]

    def lookup(self, token_ids: Sequence[int] | np.ndarray | torch.Tensor | None = None, *,
               block_hashes: Sequence[bytes] | None = None, num_tokens: int | None = None,
               upto: Tier | None = None) -> ResumeLookup:
        """How many tokens of a prompt each tier could resume, without loading anything,
        taking a reference or changing LRU order: for routers (:mod:`tiered_kv.lookup`).

        Give the prompt's ``token_ids`` (hashed here), or its full blocks' ``block_hashes``
        as a router keeps them (``num_tokens``: the prompt's length, for the rule that one
        token is always recomputed; None: the prompt goes on past the last hash). The
        answer is per tier, cumulative: ``look.tokens(Tier.HOST)`` is what :meth:`open`
        resumes with the GPU and host tiers, ``look.tokens()`` with every tier. ``upto``:
        ask only the tiers up to this one (``Tier.DISK``: not the shared level of a chain).
        """
        from .lookup import ResumeIndex

        self._check_running("lookup")
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("lookup: expected token_ids or block_hashes (one of them)")
        if token_ids is not None:
            if num_tokens is not None:
                raise ValueError("num_tokens: expected it only with block_hashes (the prompt gives its length)")
            tokens = as_token_list(token_ids)
            bt = self.layout.block_tokens
            block_hashes = self.hasher.block_hashes(token_array(tokens)[:len(tokens) - len(tokens) % bt])
            num_tokens = len(tokens)
        index = self.__dict__.get("_resume_index")
        if index is None:
            index = self._resume_index = ResumeIndex.of_cache(self)
        return index.lookup(block_hashes, num_tokens=num_tokens, upto=upto)

    def close(self, request: Request) -> None:
        """End a request: free its State slot; its full blocks stay as cached prefix."""
        self._check_running("close")
        req = self._live(request)
        bt = self.layout.block_tokens
        publish = set(self.snapshot_policy.publish_at_close([k for k, _, _ in req._pending], req.num_tokens, bt))
        for k, snap_id, h in req._pending:
            if k in publish:
                self._register_snapshot(snap_id, h, req, k)
            else:  # never published: the slot goes back uncached
                self.snapshots.ids.free(snap_id)
        req._pending = []
        if req._host_reserved is not None:
            assert self.host is not None
            self.host.blocks.free(req._host_reserved)
            req._host_reserved = None
        # Free the tail first so LRU eviction takes a prefix's end before its start.
        for b in reversed(req.block_ids):
            self._release_block(b)
        self.tables.clear(req.slot)
        self.states.free(req.slot)
        req.closed = True
        del self._requests[req.request_id]
        self._counters["requests_closed"] += 1
        if self.disk is not None and self.disk.admission.policy.survive is not None:
            self._write_survivors()
        self._prune_store_evictions()

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
        self._check_running("flush")
        self.copies.synchronize()
        if self.disk is not None:
            done = self.disk.flush(uploads=uploads, timeout_s=timeout_s)
            self._prune_store_evictions()
            return done
        return True

    def shutdown(self) -> None:
        """Flush and close the disk tier (a store opened from a URL is closed).

        A store chain keeps uploading for up to its ``close_timeout_s`` and then stops;
        uploads not done by then stay journaled and the next process resumes them (see
        :meth:`flush` to wait for them instead).

        Idempotent. Afterwards ``open``, ``close``, ``flush`` and every call on a request
        raise :class:`~tiered_kv.errors.CacheShutdownError`. A cache never shut down is
        shut down at interpreter exit as far as its disk tier goes (queued writes land,
        chain uploads are journaled; :mod:`tiered_kv.storage.at_exit`)."""
        if self._shut_down:
            return
        self._shut_down = True
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
        req._reserved_to = max(req._reserved_to, req.num_tokens + num_new_tokens)
        need = self.layout.num_blocks_for(req.num_tokens + num_new_tokens) - len(req.block_ids)
        if need <= 0:
            return
        got = self.blocks.allocate_many(need)
        if got is None:
            raise CacheFullError(f"reserve: request {req.request_id} needs {need} more blocks, "
                                 f"{self.blocks.num_available} available of {self.blocks.num_blocks}")
        req.block_ids.extend(got)
        self.tables.append(req.slot, got)
        if self.hisparse is not None and req._host_reserved is None:
            req._host_reserved = self._reserve_host_record(req)

    def _reserve_host_record(self, req: Request) -> int:
        """HiSparse: a host record for the CSA part of the block the request fills."""
        hid = self._allocate_host_record()
        if hid is None:
            raise CacheFullError(f"request {req.request_id}: the host tier has no free record for a sealed "
                                 f"block's CSA entries ({self.host.num_blocks} records, all referenced)")
        return hid

    def write_csa(self, requests: Request | Sequence[Request], layers: int | Sequence[int],
                  entry_ids: torch.Tensor | np.ndarray | Sequence, kv: torch.Tensor, keys: torch.Tensor) -> None:
        """Store completed CSA entries and their indexer keys, of one or several CSA layers
        and one or several requests, in one call (one device copy per pool part and run of
        consecutive entries; see :mod:`tiered_kv.write_path`).

        One request, one layer (``requests`` a Request, ``layers`` an int)::

            entry_ids [m] int64       kv [m, entry_bytes]       keys [m, indexer_bytes]

        Each sequence argument adds a leading axis: ``layers`` a sequence of n CSA layers
        puts ``n`` in front of kv / keys (``kv[l]`` is layer ``layers[l]``); ``requests`` a
        sequence of B requests makes ``entry_ids [B, m]`` (row i: request i's entry ids,
        ``-1`` = padding) and puts ``B`` before ``m``. So the full batch is::

            entry_ids [B, m] int64    kv [n, B, m, entry_bytes]    keys [n, B, m, indexer_bytes]

        Entry ids are request-relative and must lie in the requests' unsealed blocks (with
        HiSparse: the open block). Pass them on the host (a CPU tensor, numpy or a list):
        the destinations are computed there, so the call never waits for the device. kv and
        keys are uint8 on the cache's device.
        """
        cp = self.classical
        if self._write_run(LayerKind.CSA, requests, layers, entry_ids, (cp.indexer, cp.csa_kv), (keys, kv),
                           (self._indexer_bytes, self._entry_bytes), self._csa_per_block):
            return
        reqs, batched = self._live_batch(requests)
        parts = self._write_parts(LayerKind.CSA, layers)
        ids, row = self._write_ids(entry_ids, reqs, batched)
        m = len(row) if ids is None else ids.shape[1]
        lead = self._write_lead(parts, batched, len(reqs), m)
        entry_bytes, indexer_bytes = self._entry_bytes, self._indexer_bytes
        self._check_bytes("kv", kv, (*lead, entry_bytes))
        self._check_bytes("keys", keys, (*lead, indexer_bytes))
        E = self._csa_per_block
        place, ids = self._place(reqs, ids, row, entry_ids, E, batched)
        if self.hisparse is not None:
            if ids is None:
                ids = host_entry_ids("entry_ids", entry_ids, 1)[None]
            self._writer.check_open_block(reqs, ids, E, batched)
        if not (parts.batched and not batched):  # (else already [n, m, bytes]: no reshape to pay for)
            n, flat = parts.parts.size, len(reqs) * m
            keys, kv = keys.reshape(n, flat, indexer_bytes), kv.reshape(n, flat, entry_bytes)
        self._writer.scatter(self.classical.indexer, parts, place, keys)
        # HiSparse: the CSA KV part holds each State slot's open block
        self._writer.scatter(self.classical.csa_kv, parts, place, kv, by_slot=self.hisparse is not None)

    def write_hca(self, requests: Request | Sequence[Request], layers: int | Sequence[int],
                  entry_ids: torch.Tensor | np.ndarray | Sequence, kv: torch.Tensor) -> None:
        """Store completed HCA entries of one or several HCA layers and requests.

        Shapes as in :meth:`write_csa`: ``entry_ids [m]``, ``kv [m, entry_bytes]`` for one
        request and layer; the batch form is ``entry_ids [B, m]`` (-1 = padding) and
        ``kv [n, B, m, entry_bytes]``.
        """
        if self._write_run(LayerKind.HCA, requests, layers, entry_ids, (self.classical.hca_kv,), (kv,),
                           (self._entry_bytes,), self._hca_per_block):
            return
        reqs, batched = self._live_batch(requests)
        parts = self._write_parts(LayerKind.HCA, layers)
        ids, row = self._write_ids(entry_ids, reqs, batched)
        m = len(row) if ids is None else ids.shape[1]
        entry_bytes = self._entry_bytes
        self._check_bytes("kv", kv, (*self._write_lead(parts, batched, len(reqs), m), entry_bytes))
        place, _ = self._place(reqs, ids, row, entry_ids, self._hca_per_block, batched)
        if not (parts.batched and not batched):  # (else already [n, m, bytes])
            kv = kv.reshape(parts.parts.size, len(reqs) * m, entry_bytes)
        self._writer.scatter(self.classical.hca_kv, parts, place, kv)

    def _write_run(self, kind: LayerKind, request: object, layers: object, entry_ids: object,
                   pools: tuple[torch.Tensor, ...], srcs: tuple[object, ...], nbytes: tuple[int, ...],
                   per_block: int) -> bool:
        """The prefill write, checked and done in one pass: one request, a tuple of
        consecutive ``kind`` layers, a host int64 ``[m]`` tensor of consecutive entry ids
        in one of the request's unsealed blocks, ``srcs`` of exactly the expected
        ``[n, m, nbytes]`` (uint8, on the device), no HiSparse. Then the bytes are copied
        exactly as the general path's single run copies them (a block's row of every part
        through one select, else a slice) and True is returned. Anything else returns False
        having done nothing (the general path then checks everything and refuses what it
        must, in its order); the only error raised here is the request's own, which the
        general path would raise first too."""
        if type(request) is not Request or type(layers) is not tuple or self.hisparse is not None:
            return False
        req = self._live(request)
        row = host_entry_list(entry_ids)
        if not row:
            return False
        parts = self._writer.part_set(kind, layers)
        if parts is None or parts.start is None:
            return False
        first, m = row[0], len(row)
        k = first // per_block
        if (first < 0 or k != (first + m - 1) // per_block or not req.num_sealed_blocks <= k < len(req.block_ids)
                or (m > 1 and row != list(range(first, first + m)))):
            return False
        n, device = parts.parts.size, self.device
        for src, nb in zip(srcs, nbytes):
            if not (type(src) is torch.Tensor and src.dtype is torch.uint8 and src.shape == (n, m, nb)
                    and src.device == device):
                return False
        b, p0, off = req.block_ids[k], parts.start, first % per_block
        for pool, src in zip(pools, srcs):
            if p0 == 0 and n == pool.shape[0] and off == 0 and m == per_block:
                pool.select(1, b).copy_(src)  # type: ignore[arg-type]
            else:
                pool[p0:p0 + n, b, off:off + m].copy_(src)  # type: ignore[arg-type]
        return True

    def _live_batch(self, requests: Request | Sequence[Request]) -> tuple[list[Request], bool]:
        """(live requests, whether a sequence was passed)."""
        if isinstance(requests, Request):
            return [self._live(requests)], False
        if not isinstance(requests, Sequence):
            raise TypeError(f"requests: expected a Request or a sequence of them, got {type(requests).__name__}")
        return [self._live(r) for r in requests], True

    @staticmethod
    def _write_ids(entry_ids: object, reqs: list[Request], batched: bool) -> tuple[np.ndarray | None, list[int] | None]:
        """Host entry ids as ``[B, m]`` int64, or (one request's host int64 tensor, the
        common case) as the list of its ids: ``(ids, None)`` or ``(None, row)``."""
        if not batched:
            row = host_entry_list(entry_ids)
            if row is not None:
                return None, row
            return host_entry_ids("entry_ids", entry_ids, 1)[None], None
        ids = host_entry_ids("entry_ids", entry_ids, 2)
        if ids.shape[0] != len(reqs):
            raise ValueError(f"entry_ids: expected [B, m] with B = {len(reqs)} requests, got {list(ids.shape)}")
        return ids, None

    def _place(self, reqs: list[Request], ids: np.ndarray | None, row: list[int] | None, entry_ids: object,
               per_block: int, batched: bool) -> tuple[Placement, np.ndarray | None]:
        """:meth:`EntryWriter.place` of a write's ids as :meth:`_write_ids` gave them; the
        ``[B, m]`` array too when it was made (a row that is not one run needs it)."""
        if row is not None:
            place = self._writer.place_run(reqs[0], row, per_block)
            if place is not None:
                return place, ids
            ids = host_entry_ids("entry_ids", entry_ids, 1)[None]
        assert ids is not None
        return self._writer.place(reqs, ids, per_block, padded=batched), ids

    def _write_parts(self, kind: LayerKind, layers: int | Sequence[int]) -> PartSet:
        plain = type(layers) in (tuple, int, list) or (isinstance(layers, (int, Sequence))
                                                       and not isinstance(layers, bool))
        parts = self._writer.part_set(kind, layers) if plain else None
        if parts is None:  # integer-likes (numpy ints, a 1-D array), or an invalid layer
            layers = _layer_args(layers)
            parts = self._writer.part_set(kind, layers)
        if parts is None:  # raise the precise error
            if isinstance(layers, tuple) and not layers:
                raise ValueError("layers: expected at least one layer")
            for layer in ([layers] if isinstance(layers, int) else layers):
                self._layer_part(layer, kind)
            raise AssertionError(f"layers {layers!r}: rejected but no layer is invalid")
        return parts

    @staticmethod
    def _write_lead(parts: PartSet, batched: bool, B: int, m: int) -> tuple[int, ...]:
        """Leading dims of kv / keys: ``[n,] [B,] m``."""
        if parts.batched:
            return (parts.parts.size, B, m) if batched else (parts.parts.size, m)
        return (B, m) if batched else (m,)

    def block_table(self, requests: Request | Sequence[Request], *, max_blocks: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The requests' block tables: ``[B, max_blocks]`` int32 on the cache's device.

        Row i holds ``requests[i].block_ids`` (the Classical block of tokens
        ``[k * block_tokens, (k + 1) * block_tokens)`` at column k), ``-1`` past its end.
        ``max_blocks`` defaults to the longest row of the batch; fix it (at most
        ``num_blocks``) and pass ``out`` (``[B, max_blocks]`` int32 on the device) for the
        static shapes a CUDA graph needs. A device gather from the persistent per-slot
        table (``cache.tables.device_table``, ``[num_state_slots, capacity]``), which
        ``open`` / ``reserve`` / ``close`` keep current; nothing is rebuilt from lists.
        """
        reqs, _ = self._live_batch(requests)
        slots = [r.slot for r in reqs]
        if max_blocks is None:
            max_blocks = max((len(r.block_ids) for r in reqs), default=0)
        elif isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 0:
            raise ValueError(f"max_blocks: expected a non-negative int, got {max_blocks!r}")
        return self.tables.gather(slots, max_blocks, out=out)

    def read_indexer_keys(self, request: Request, layer: int, num_entries: int) -> torch.Tensor:
        """The first ``num_entries`` indexer keys of CSA ``layer``: ``[num_entries, indexer_bytes]`` uint8."""
        req = self._live(request)
        c = self._layer_part(layer, LayerKind.CSA)
        ids = torch.arange(as_int("num_entries", num_entries, minimum=0))
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
        # which ids are sealed is decided on the host (ids are host tensors): index lists,
        # not boolean masks on device tensors, so nothing here waits for the device
        sealed = ids // E < req.num_sealed_blocks
        in_open, in_sealed = (~sealed).nonzero().flatten(), sealed.nonzero().flatten()
        if in_open.numel():
            out.index_copy_(0, in_open.to(self.device), self.classical.csa_kv[c, req.slot, off[in_open]])
        if in_sealed.numel():
            out.index_copy_(0, in_sealed.to(self.device),
                            self._swap_in(req, c, ids[in_sealed], blk[in_sealed], off[in_sealed]))
        return out

    def swap_in(self, request: Request, layer: int, entry_ids: torch.Tensor) -> torch.Tensor:
        """HiSparse: make CSA entries of sealed blocks resident in the request's device
        buffer for CSA ``layer``; returns their buffer slots ``[k]`` int64.

        entry_ids ``[k]`` int64, unique, ``k <= device_buffer_entries``, all in sealed
        blocks. The bytes are then ``cache.hisparse.buffer[request.slot, part, slots]``.
        A batch of one for :meth:`swap_in_batch` (this one checks its ids on the host).
        """
        req = self._live(request)
        hs = self._require_hisparse("swap_in")
        c = self._layer_part(layer, LayerKind.CSA)
        ids = self._entry_ids("entry_ids", entry_ids)
        E = self.layout.csa_entries_per_block
        self._locate(req, ids, E, num_entries=req.num_sealed_blocks * E, writable=False)
        if ids.numel() > hs.capacity:
            raise ValueError(f"ids: expected at most device_buffer_entries = {hs.capacity} ids, got {ids.numel()}")
        if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
            raise ValueError("entry_ids: expected unique ids")
        return hs.swap_in_batch(hs.slot_tensor((req.slot,)), c, ids.to(self.device).view(1, -1),
                                self._csa_rows())[0]

    def swap_in_batch(self, requests: Sequence[Request], layer: int, entry_ids: torch.Tensor, *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """HiSparse decode step of CSA ``layer`` for a batch: make the entries each request
        needs resident in its device buffer; returns ``slots`` ``[B, k]`` int64.

        entry_ids ``[B, k]`` int64 on the cache's device: row ``i`` holds entry ids of
        sealed blocks of ``requests[i]`` (e.g. the indexer's top-k), ``-1`` = padding;
        ``k <= device_buffer_entries``; an id repeated within a row gets one slot. Entry
        ``entry_ids[i, j]`` is then ``cache.hisparse.buffer[requests[i].slot, part,
        slots[i, j]]`` (``slots[i, j] = -1`` where padded), ``part =
        layout.part_index(layer)``. ``out``: an optional ``[B, k]`` int64 result tensor.

        On a GPU this is one kernel launch for the whole batch (hits, LRU victims, the copy
        of misses from the pinned host mirror over UVA, table updates), with no host
        synchronization: it can be captured in a CUDA graph (docs/api.md). Id values are
        checked only under ``TIERED_KV_DEBUG=1``; an id outside its request's sealed blocks
        otherwise raises (CPU) or traps the kernel (GPU).
        """
        hs = self._require_hisparse("swap_in_batch")
        c = self._layer_part(layer, LayerKind.CSA)
        if isinstance(requests, Request):
            raise TypeError("requests: expected a sequence of Request, got a single Request")
        slots = tuple(self._live(r).slot for r in requests)
        if len(set(slots)) != len(slots):
            raise ValueError("requests: expected distinct requests (one row each)")
        if not isinstance(entry_ids, torch.Tensor) or entry_ids.dim() != 2 or entry_ids.shape[0] != len(slots):
            got = f"{entry_ids.dtype} {list(entry_ids.shape)}" if isinstance(entry_ids, torch.Tensor) else \
                type(entry_ids).__name__
            raise ValueError(f"entry_ids: expected an int64 [B={len(slots)}, k] tensor, got {got}")
        return hs.swap_in_batch(hs.slot_tensor(slots), c, entry_ids, self._csa_rows(), out=out)

    def _csa_rows(self) -> torch.Tensor:
        """The host mirror's row view (built once: the host slab is never reallocated)."""
        rows = self.__dict__.get("_csa_rows_view")
        if rows is None:
            assert self.host is not None
            rows = self._csa_rows_view = self.host.csa_rows()
        return rows

    def _require_hisparse(self, what: str) -> HiSparseBuffers:
        if self.hisparse is None:
            raise ValueError(f"{what}: HiSparse is not enabled (pass hisparse=HiSparseConfig(...))")
        assert self.host is not None
        return self.hisparse

    def _host_rows(self, c: int, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """Flat rows of CSA entries (GPU block, offset) in the host mirror's row view."""
        E = self.layout.csa_entries_per_block
        hb = torch.tensor([self._host_of_block[int(b)] for b in blk], dtype=torch.int64)
        return hb * (self.layout.num_csa_layers * E) + c * E + off

    def _swap_in(self, req: Request, c: int, ids: torch.Tensor, blk: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        assert self.hisparse is not None and self.host is not None
        hs = self.hisparse
        if ids.numel() <= hs.capacity:
            slots = hs.swap_in_batch(hs.slot_tensor((req.slot,)), c, ids.to(self.device).view(1, -1),
                                     self._csa_rows())[0]
            return hs.read(req.slot, c, slots)
        # more entries than the buffer holds (a long prefill chunk): read the mirror directly
        self._wait_host_mirrors()
        return hs.read_direct(self._host_rows(c, blk, off), self.host.csa_rows())

    def read_hca(self, request: Request, layer: int, num_entries: int) -> torch.Tensor:
        """The first ``num_entries`` HCA entries of HCA ``layer``: ``[num_entries, entry_bytes]`` uint8."""
        req = self._live(request)
        h = self._layer_part(layer, LayerKind.HCA)
        ids = torch.arange(as_int("num_entries", num_entries, minimum=0))
        blk, off = self._locate(req, ids, self.layout.hca_entries_per_block, writable=False)
        return self.classical.hca_kv[h, blk, off]

    def advance(self, request: Request, token_ids: Sequence[int]) -> None:
        """Record that the KV of ``token_ids`` has been written; seal and snapshot at boundaries.

        The tokens must not cross a block boundary (split chunks there: the State at the
        boundary is what a snapshot needs), and their blocks must have been reserved.
        """
        req = self._live(request)
        tokens, arr = checked_tokens(token_ids)
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
            self._seal(req, arr if len(tokens) == bt else None)

    # --------------------------------------------------------- seal/snapshot
    def _seal(self, req: Request, whole: array.array | None = None) -> None:
        """The request's open block is full: hash it, publish it, mirror and persist it.

        ``whole``: the block's ids as the C array ``advance`` checked them in, when they
        came in one call (then they are the last ``block_tokens`` ids: no second conversion).
        """
        bt = self.layout.block_tokens
        k = req.num_sealed_blocks
        b = req.block_ids[k]
        parent = req.block_hashes[-1] if req.block_hashes else self.hasher.root
        if whole is not None and len(req.token_ids) == (k + 1) * bt:
            data = uint32_array_bytes(whole)
        else:
            data = checked_token_bytes(req.token_ids[k * bt:(k + 1) * bt])  # (advance checked the ids)
        h = self.hasher.chain(parent, data)
        req.block_hashes.append(h)
        self._counters["blocks_sealed"] += 1
        if self.hisparse is None:
            parts, ids = self.classical.parts, [b]
        else:
            parts, ids = self._mirror_to_host(req, b, h), [0]
        if not self.blocks.cache(b, h, parent):
            self._counters["blocks_duplicate"] += 1
        disk = self.disk
        if disk is not None and req._retraced_at is None and disk.admission.retraces(h):
            req._retraced_at = k
        if disk is not None and disk.admission.at_write("block", h):
            if k and disk.admission.policy.write_through:
                self._rewrite_evicted_path(req, k)
            # A private record (a host tier's may be recycled before the write), copied
            # asynchronously; the writer thread waits for the copy's event.
            record = empty_host((1, self.layout.block_bytes), pinned=self.copies.device.type == "cuda")
            handle = self.copies.offload_blocks(parts, torch.tensor(ids), record)
            if self.hisparse is not None:  # it reads the slot's open block: order its next writes after
                handle.make_stream_wait()
            self.disk.submit(record_key("block", h), parent, digest_token_bytes(data), record[0],
                             handle.wait_event)
        # (held back, it goes to disk only along with an admitted snapshot after it)
        self._snapshot_at_boundary(req, h, k + 1)

    def _mirror_to_host(self, req: Request, b: int, h: bytes) -> tuple[torch.Tensor, ...]:
        """HiSparse: copy the sealed block's record (CSA part from the open block) to the
        host; the GPU block keeps a reference on it. Returns the parts of that one-block
        record (block index 0), for the disk copy.

        Asynchronous on a GPU (synchronous on CPU): the copy runs on the copy engine's
        device-to-host stream and the current stream waits for its event on the device,
        so the swap-in kernel (reading the mirror over UVA) and the next writes into the
        slot's open block are ordered after it while the host goes on. Host-side readers
        of the mirror call :meth:`_wait_host_mirrors` first.
        """
        assert self.host is not None and self.hisparse is not None
        hid = req._host_reserved if req._host_reserved is not None else self._reserve_host_record(req)
        req._host_reserved = None
        cp = self.classical
        parts = (cp.csa_kv[:, req.slot:req.slot + 1], cp.indexer[:, b:b + 1], cp.hca_kv[:, b:b + 1])
        handle = self.copies.offload_blocks(parts, torch.tensor([0]), self.host.records[hid:hid + 1])
        handle.make_stream_wait()
        while self._mirrors_pending and self._mirrors_pending[0].done():  # bounded: drop landed copies
            self._mirrors_pending.popleft()
        if not handle.finished:
            self._mirrors_pending.append(handle)
        parent = req.block_hashes[-2] if len(req.block_hashes) > 1 else self.hasher.root
        if not self.host.blocks.cache(hid, h, parent):  # the host already has this block: use that record
            existing = self.host.blocks.lookup(h)
            assert existing is not None
            handle.wait()  # the freed record may be reused (and written on the host) at once
            self.host.blocks.free(hid)
            self.host.blocks.incref(existing)
            hid = existing
        self._host_of_block[b] = hid
        self.hisparse.set_host_blocks(req.slot, req.num_sealed_blocks - 1, [hid])
        return parts

    def _wait_host_mirrors(self) -> None:
        """Block until every in-flight HiSparse mirror copy has landed in host memory (for
        readers and writers of host records on the host; a no-op on CPU)."""
        while self._mirrors_pending:
            self._mirrors_pending.popleft().wait()

    def _snapshot_at_boundary(self, req: Request, h: bytes, num_blocks: int) -> None:
        """Snapshot the State at the boundary after block ``num_blocks``.

        Private snapshots of the last two boundaries are kept (a prompt of exactly k
        blocks resumes at block k-1, since one token is always recomputed); older private
        ones are recycled. Interval boundaries are published at once.

        A boundary two or more blocks short of what the request has reserved is skipped
        (unless it is an interval boundary): the engine computes the reserved chunk
        before the request can close, so that snapshot would be recycled unpublished.
        This removes the State copy (3.6 MB for Flash) from all but the last two blocks
        of a prefill chunk reserved at once; an engine that reserves block by block sees
        no change.
        """
        branch = num_blocks == req._branch_at
        interval = self.snapshot_policy.at_interval(num_blocks) or branch
        if not interval and (num_blocks + 2) * self.layout.block_tokens <= req._reserved_to:
            self._counters["snapshots_elided"] += 1
            return
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
        if interval:
            if branch:
                self._counters["snapshots_branch"] += 1
            self._register_snapshot(snap_id, h, req, num_blocks)
        else:
            req._pending.append((num_blocks, snap_id, h))

    def _register_snapshot(self, snap_id: int, h: bytes, req: Request, k: int) -> None:
        """Publish a private snapshot under ``h`` (unless one exists) at request ``req``'s
        boundary ``k``, persist it (when the disk admission filter lets it: with every
        block before it not known on disk, queued ahead of it), drop our ref."""
        ids = self.snapshots.ids
        if ids.cache(snap_id, h):
            self._counters["snapshots_registered"] += 1
            if self.disk is not None:
                self._persist_snapshot(snap_id, h, req, k)
        ids.free(snap_id)

    def _persist_snapshot(self, snap_id: int, h: bytes, req: Request, k: int) -> None:
        """The disk part of :meth:`_register_snapshot`. Its blocks are the request's
        ``block_ids[:k]`` (referenced by it, sealed)."""
        assert self.disk is not None
        adm = self.disk.admission
        bt = self.layout.block_tokens
        parent = self.hasher.root  # a snapshot record's parent field is unused; keep it fixed
        digest = digest_token_bytes(checked_token_bytes(req.token_ids[(k - 1) * bt:k * bt]))
        if adm.at_write("snapshot", h, retraced=self._retraced(req, k)):
            if adm.policy.write_through:
                self._rewrite_evicted_path(req, k)
            else:
                for i in self._blocks_to_write(req.block_hashes[:k]):  # the path segment it ends, ahead of it
                    adm.admit("block", req.block_hashes[i])
                    self._submit_request_block(req, i)
            self.disk.submit(record_key("snapshot", h), parent, digest, self.snapshots.data[snap_id].to("cpu", copy=True))
        elif adm.policy.survive is not None:  # held back: survived:N writes it later if it lives on
            before = [(bh, req.block_hashes[i - 1] if i else parent,
                       digest_token_bytes(checked_token_bytes(req.token_ids[i * bt:(i + 1) * bt])))
                      for i, bh in enumerate(req.block_hashes[:k])]
            adm.defer(h, parent, digest, before)

    def _rewrite_evicted_path(self, req: Request, k: int) -> None:
        """Written through (``all``): the blocks of ``req``'s path before boundary ``k``
        that the store reported evicted (and that were not submitted since) are written
        again, in path order, ahead of the record at ``k``, which would otherwise land on
        disk behind a missing block: stranded, no resume could reach it. The request holds
        every block before ``k`` in the GPU pool. The walk goes back from ``k - 1`` while
        each block is reported evicted: the store evicts leaves first, so a block it holds
        has every block before it (the filters' path: :meth:`_blocks_to_write`). Counted in
        ``stats()["disk_blocks_rewritten"]``."""
        disk = self.disk
        assert disk is not None
        hashes = req.block_hashes
        i = k
        while i > 0 and disk.evicted_from_store(record_key("block", hashes[i - 1])):
            i -= 1
        for j in range(i, k):
            self._submit_request_block(req, j)
        self._counters["disk_blocks_rewritten"] += k - i

    def _submit_request_block(self, req: Request, i: int) -> None:
        """Queue a disk write of ``req``'s sealed block ``i`` from its GPU block, with the
        parent and token digest its seal gave it (a path segment written after the seal)."""
        bt = self.layout.block_tokens
        hashes = req.block_hashes
        self._submit_block_copy(req.block_ids[i], hashes[i], hashes[i - 1] if i else self.hasher.root,
                                digest_token_bytes(checked_token_bytes(req.token_ids[i * bt:(i + 1) * bt])))

    def _retraced(self, req: Request, k: int) -> bool:
        """Whether request ``req``'s path up to boundary ``k`` was retraced, as the
        admission filter ``retraced`` counts it: a block before ``k`` was computed again
        where a snapshot had been held back."""
        return req._retraced_at is not None and req._retraced_at < k

    # ----------------------------------------------------------------- stats
    def metrics(self) -> MetricsSnapshot:
        """Counters and gauges per tier; ``.to_prometheus()`` renders the text format."""
        L = self.layout
        snap_ids = self.snapshots.ids
        copy = self.copies.stats()
        host_bytes = host_capacity = None
        if self.host is not None:
            h = self.host
            snaps = 0 if h.snapshots is None else h.snapshots.num_used + h.snapshots.num_evictable
            host_bytes = (h.blocks.num_used + h.blocks.num_evictable) * L.block_bytes + snaps * L.snapshot_bytes
            host_capacity = h.nbytes
        host_snap_bytes = None
        if self.host is not None:
            hs = self.host.snapshots
            host_snap_bytes = 0 if hs is None else (hs.num_used + hs.num_evictable) * L.snapshot_bytes
        gauges = TierGauges(
            gpu_snapshot_bytes=(snap_ids.num_used + snap_ids.num_evictable) * L.snapshot_bytes,
            host_snapshot_bytes=host_snap_bytes,
            block_tokens=L.block_tokens,
            gpu_bytes=(self.blocks.num_used + self.blocks.num_evictable) * L.block_bytes
            + (snap_ids.num_used + snap_ids.num_evictable) * L.snapshot_bytes,
            gpu_capacity_bytes=self.classical.nbytes + self.snapshots.data.numel() + self.states.num_slots * L.state_bytes,
            copy_latency_mean_s=copy.latency_mean_s, copy_latency_max_s=copy.latency_max_s,
            host_bytes=host_bytes, host_capacity_bytes=host_capacity,
            hisparse=self.hisparse is not None, disk=self.disk is not None)
        return collect_metrics(self.stats(), gauges)

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
            "blocks_stranding_evictions": self.blocks.stranding_evictions,
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


def _layer_args(layers: object) -> int | tuple[int, ...]:
    """``layers`` of a write as an int or a tuple of ints (integer-likes accepted)."""
    if isinstance(layers, (np.ndarray, torch.Tensor)) and layers.ndim > 0:
        if layers.ndim != 1:
            raise ValueError(f"layers: expected a layer index or a 1-D sequence of them, got {layers.ndim}-D")
        return tuple(as_int(f"layers[{i}]", x, minimum=0) for i, x in enumerate(layers.tolist()))
    if isinstance(layers, Sequence) and not isinstance(layers, (str, bytes)):
        return tuple(as_int(f"layers[{i}]", x, minimum=0) for i, x in enumerate(layers))
    return as_int("layers", layers, minimum=0)
