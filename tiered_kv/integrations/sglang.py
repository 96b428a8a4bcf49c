"""SGLang HiCache L3 backend over tiered_kv stores (SGLang 0.5.23).

SGLang's hierarchical cache keeps KV pages in GPU memory (L1), a host pool (L2) and an
optional storage backend (L3, :class:`~sglang.srt.mem_cache.hicache_storage.HiCacheStorage`).
:class:`TieredKVHiCacheStorage` is that L3 over any tiered_kv store URL or chain (LMDB,
Zarr, Zarr on S3, ``[local, shared]``), loaded as a ``dynamic`` backend::

    python -m sglang.launch_server --model-path deepseek-ai/DeepSeek-V4-Flash \\
        --enable-hierarchical-cache --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tiered_kv",
            "module_path": "tiered_kv.integrations.sglang",
            "class_name": "TieredKVHiCacheStorage", "interface_v1": 1,
            "store": "lmdb:///var/cache/sglang-kv", "tenant": "team-a"}'

What it implements, and how SGLang calls it (``managers/cache_controller.py``,
``mem_cache/hybrid_cache/hybrid_cache_controller.py``):

- ``batch_exists(keys)``: the number of leading pages stored (prefetch planning).
- ``batch_set_v1`` / ``batch_get_v1(keys, host_indices)``: zero-copy page I/O straight
  between the store and the host pool's pages, located with the pool's
  ``get_page_buffer_meta`` (used when the extra config has ``"interface_v1": 1``).
- ``batch_exists_v2`` / ``batch_set_v2`` / ``batch_get_v2(PoolTransfer...)``: the same for
  every pool of a hybrid model (DeepSeek V4's compressed-KV, indexer and state pools,
  SWA, Mamba...), with per-pool hit policies.
- ``get`` / ``set`` / ``batch_get`` / ``batch_set`` / ``exists``: the legacy calls SGLang
  uses without ``interface_v1`` (one flat page tensor per key, copied through).

Keys. SGLang names a page by a 64-hex chained hash of its tokens (and the request's
``cache_salt`` / ``extra_key``). Each page of each pool is one record under::

    RecordKey.block(sha256(pool_root || sglang_key))
    pool_root = sha256(namespace_root || pool name, host-pool class, layout, page size,
                       dtype, byte sizes of the page's buffers, format)
    namespace_root = sha256("tiered_kv.sglang.v1", model id, tenant, the rank's shard)

so two models, two tenants, two TP shards of an MHA model, two pools of one request or
two host layouts never read each other's pages. A record also carries
``token_digest = sha256(pool_root || "page" || sglang_key)``, checked on every read.

Verified reads. Every read checks the record's checksum, key and digest; a corrupt,
torn or foreign record is a failed page (``False``), counted as a miss, never bytes: a
page that failed may hold partial data, and SGLang uses only the leading run of pages
that succeeded. Store failures (full, unreachable, closed) make the affected pages
``False`` and are counted; they never raise into SGLang.

Metrics: :meth:`get_stats` returns SGLang's ``StorageMetrics`` (pages and GB/s per
prefetch / backup batch; exported as ``sglang:`` histograms when the server runs
with ``--enable-metrics``), and :meth:`counters` our own page counters
plus the store's (hits, misses, corrupt, evictions, bytes);
:meth:`TieredKVHiCacheStorage.of` finds the backend behind SGLang's failure injector.

The cache's counters (issue 22) as this backend can count them, in :meth:`counters`:
hits per tier are ``pages_read`` (this L3) beside SGLang's own L1 / L2 hits; misses by
reason are ``lookup_pages_not_cached`` and ``lookup_pages_no_state`` (pages whose KV is
stored but which no state pool snapshot lets SGLang resume at: DeepSeek V4's compressor
state, SWA, Mamba), and ``pages_missed`` / ``store.corrupt`` at read time; evictions are
``store.evictions`` (the store's LRU under ``max_bytes``). Snapshot bytes and stranding
evictions have no counterpart: SGLang's state pages are pages of a pool like any other
here, and where SGLang snapshots its state and which pages its L1 / L2 evict is SGLang's.

Policies. tiered_kv's snapshot placement and eviction policies (``snapshot_policy``,
``eviction``) choose what tiered_kv's own GPU and host tiers keep; under SGLang those
tiers are SGLang's (its radix cache and host pool, with their own eviction), and this
backend is a store that evicts least recently accessed records first. The two keys in
the extra config are refused with a ValueError that says so, rather than ignored.

``clear`` (SGLang's ``POST /hicache/storage-backend/clear``) is refused by default: the
store may be shared. It raises, since SGLang 0.5.23's cache controller ignores a returned
``False``; SGLang's storage layer then logs the failure and reports it as ``False`` (its
scheduler still answers HTTP 200, an SGLang bug). With ``"allow_clear": true`` in the
extra config it empties the node's own store (level 0 of a chain; a shared level is
trimmed by ``tiered-kv gc`` on its own URL), so that the endpoint's answer is true.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from ..storage import (
    BlockStore,
    PutItem,
    RecordKey,
    StoreError,
    StoreFullError,
    StoreWriter,
    WriterKind,
    open_store,
)
from ..storage.api.counters import Counters
from ..storage.format.record import OutSegments
from ._adapter import block_key, display_url, namespace_root, open_options

__all__ = ["SGLANG_LAYOUT_FINGERPRINT", "ClearRefusedError", "TieredKVHiCacheStorage"]

logger = logging.getLogger(__name__)

#: The layout fingerprint of a store holding SGLang HiCache pages. Pages of any model
#: share such a store (their keys are namespaced); tiered_kv's own KV layouts do not.
SGLANG_LAYOUT_FINGERPRINT = "sglang-hicache-v1"

_ZERO_HASH = bytes(32)


class ClearRefusedError(RuntimeError):
    """``clear()`` deletes nothing: the store may be shared by other servers and tenants."""


class _PageFormat(enum.Enum):
    """How a page's bytes are laid out in its record."""

    BUFFERS = "buffers"  # the page's host buffers (get_page_buffer_meta order), concatenated
    FLAT = "flat"        # the legacy calls' flat page tensor (get_data_page(flat=True))


@dataclass(frozen=True, slots=True)
class _PoolBinding:
    """One registered host pool and the key root of its pages.

    ``buffer_bytes``: byte size of each host buffer of one page, in
    ``get_page_buffer_meta`` order (e.g. ``(page_size * layers * row,)`` for a page_first
    MLA pool, one entry per layer for layer_first). Empty for a logical anchor pool
    (DeepSeek V4's KV anchor), which holds no bytes.
    """

    name: str
    pool: Any
    page_size: int
    buffer_bytes: tuple[int, ...]
    roots: dict[_PageFormat, bytes]

    @property
    def logical(self) -> bool:
        return not self.buffer_bytes

    @property
    def page_bytes(self) -> int:
        return sum(self.buffer_bytes)


#: Page counters of one backend object (this process, since it was created), in order:
#: pages_missed: absent, corrupt or foreign (the read returned False); pages_write_failed:
#: store full or failing; store_errors: calls the store failed (each failed call, not page).
#: lookup_*: the pages ``batch_exists`` / ``batch_exists_v2`` were asked about, per query:
#: lookup_pages_hit restorable (the hit), lookup_pages_no_state held by every KV pool but
#: past the last page a state pool can restore (the cache's ``no_snapshot`` miss reason),
#: lookup_pages_not_cached not held (never stored, evicted, or unreadable: ``not_cached``).
_COUNTERS = ("pages_read", "pages_missed", "pages_written", "pages_already_stored", "pages_write_failed",
             "store_errors", "lookup_pages", "lookup_pages_hit", "lookup_pages_no_state", "lookup_pages_not_cached")
#: Cache options that do not apply to this backend (module docstring: Policies).
_CACHE_POLICY_KEYS = ("snapshot_policy", "eviction")


class _OpenStores:
    """The stores open in this process, shared by the backends that name the same store.

    LMDB allows one handle per store per process, and several backends may live in one
    process (one per attached engine, or per test); each holds a reference and the last
    :meth:`release` closes the store.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, tuple[BlockStore, int]] = {}

    def acquire(self, url: Any, options: dict[str, Any], writer: StoreWriter | None = None) -> tuple[str, BlockStore]:
        """The store at ``url`` (opened with ``options`` unless open); ``writer`` is recorded
        if this call creates it."""
        ident = json.dumps([url, options], sort_keys=True, default=str)
        with self._lock:
            store, refs = self._open.get(ident, (None, 0))
            if store is None or store.closed:
                opts = {"writer": writer, **options} if writer is not None else options
                store, refs = open_store(url, layout_fingerprint=SGLANG_LAYOUT_FINGERPRINT, **opts), 0
            self._open[ident] = (store, refs + 1)
            return ident, store

    def release(self, ident: str) -> None:
        with self._lock:
            store, refs = self._open[ident]
            if refs > 1:
                self._open[ident] = (store, refs - 1)
                return
            del self._open[ident]
        store.close()


_STORES = _OpenStores()


class _HostSpan:
    """``[nbytes] uint8`` of host memory at ``ptr``, through numpy's array interface."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def _buffer_runs(ptrs: np.ndarray, sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The buffers of a page grouped into runs ``(first, end, stride)`` of columns
    ``first..end-1`` of ``ptrs`` that hold one size at one stride (>= the size: rows
    never overlap) in every page; ``stride`` 0 for a run of one.

    ``ptrs``: ``[n_pages, per_page] int64`` host addresses, ``sizes``: ``[per_page]``
    bytes. A layer_first MLA page is one run (a buffer per layer, ``layer_stride``
    apart); an MHA layer_first page two (K per layer, then V per layer)::

        page i:  L0 ---- stride ---> L1 ---- stride ---> L2 ...   (one run: rows of a 2-D view)
    """
    per_page = len(sizes)
    steps = np.diff(ptrs, axis=1)                        # [n_pages, per_page - 1]
    same = (steps == steps[:1]).all(axis=0).tolist()     # column j -> j+1: one step on every page
    step0 = steps[0].tolist()
    runs: list[tuple[int, int, int]] = []
    first = 0
    while first < per_page:
        size, end, stride = sizes[first], first + 1, 0
        if end < per_page and same[first] and sizes[end] == size and step0[first] >= size:
            stride = step0[first]
            while end < per_page and same[end - 1] and step0[end - 1] == stride and sizes[end] == size:
                end += 1
        runs.append((first, end, stride))
        first = end
    return runs


def _page_pieces(ptrs: np.ndarray, sizes: tuple[int, ...]) -> list[OutSegments]:
    """Per page, writable uint8 views of its host buffers, in place (no copy).

    ``ptrs``: ``[n_pages, per_page] int64`` addresses from the host pool's
    ``get_page_buffer_meta``, ``sizes``: each buffer's bytes. That is CPU (pinned) memory
    the pool owns and keeps alive while SGLang holds the pages. One array spans them all;
    a run of buffers at one stride (:func:`_buffer_runs`: a layer_first page's layers)
    is one strided 2-D view whose rows are the buffers, so a page of 61 layers costs one
    array and one ``list()``, not 61 slices. Each page is an
    :class:`~tiered_kv.storage.format.record.OutSegments`: the scatter list the store reads
    into (every piece is by construction a 1-D, C-contiguous, writable uint8 view).
    """
    n_pages, per_page = ptrs.shape
    if n_pages == 0:
        return []
    page_bytes = sum(sizes)
    lo = int(ptrs.min())
    hi = int((ptrs + np.asarray(sizes, dtype=np.int64)).max())
    span = np.asarray(_HostSpan(lo, hi - lo))
    runs = _buffer_runs(ptrs, sizes)
    starts = (ptrs[:, [first for first, _, _ in runs]] - lo).tolist()   # [n_pages, n_runs] offsets
    u8 = np.dtype(np.uint8)
    pages: list[OutSegments] = []
    for offsets in starts:
        pieces: list[np.ndarray] = []
        for (first, end, stride), off in zip(runs, offsets):
            size = sizes[first]
            if end - first == 1:
                pieces.append(span[off:off + size])
            else:
                pieces.extend(np.ndarray((end - first, size), u8, span, off, (stride, 1)))
        pages.append(OutSegments(pieces, page_bytes))
    return pages


def _config_str(extra: dict[str, Any], name: str, default: str | None = None) -> str | None:
    value = extra.get(name, default)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"extra_config[{name!r}]: expected a string, got {value!r}")
    return value


class TieredKVHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage over a tiered_kv store (see the module docstring).

    Constructed by SGLang's ``StorageBackendFactory`` as
    ``TieredKVHiCacheStorage(storage_config, kwargs)``. Reads from ``extra_config``:

    - ``store`` (required): a store URL (``lmdb:///abs/path``, ``zarr:///abs/path``,
      ``zarr+s3://bucket/prefix?endpoint=...``) or a list of them (a chain, nearest first).
    - ``store_options``: keyword options of :func:`tiered_kv.storage.open_store`
      (``max_bytes``, ``timeout_s``, ``level_options``...).
    - ``tenant``: salt of this deployment's keys (default ``""``).
    - ``encryption``: seal every page record for this tenant (XAES-256-GCM under keyed names, see
      docs/shared-store.md): ``{"key_files": ["/etc/tiered-kv/key"], "tenant": ...}``; the
      tenant defaults to ``tenant``. For a chain it seals every level; one level only:
      put it in that level's ``store_options["level_options"]`` entry instead.
    - ``model_id``: the model part of the namespace (default: SGLang's ``model_name``).
    - ``interface_v1``: SGLang's switch to the zero-copy calls; it also selects which
      record format ``exists`` / ``batch_exists`` look for.
    - ``allow_clear`` (default ``false``): let :meth:`clear` empty the node's own store
      (every record of a single store, level 0 of a chain) instead of refusing.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise TypeError(f"storage_config: expected a HiCacheStorageConfig, got "
                            f"{type(storage_config).__name__}")
        extra = dict(storage_config.extra_config or {})
        policy = sorted(set(extra) & set(_CACHE_POLICY_KEYS))
        if policy:
            raise ValueError(f"extra_config: {', '.join(policy)} select the policies of tiered_kv's own GPU and host "
                             f"tiers (TieredKVCache); under SGLang those tiers are SGLang's, and this backend is a "
                             f"store that evicts least recently used records first (bound it with "
                             f"store_options.max_bytes). See docs/integrations/sglang.md, Policies")
        store_url = extra.get("store")
        if store_url is None:
            raise ValueError('extra_config: expected "store": a tiered_kv store URL or list of URLs '
                             '(e.g. "lmdb:///var/cache/sglang-kv")')
        store_options = extra.get("store_options") or {}
        if not isinstance(store_options, dict):
            raise ValueError(f"extra_config['store_options']: expected an object, got {store_options!r}")
        model_id = _config_str(extra, "model_id") or storage_config.model_name
        if not model_id:
            raise ValueError("extra_config['model_id'] or SGLang's model name: expected a non-empty model id "
                             "(pages are namespaced by model)")
        tenant = _config_str(extra, "tenant", "") or ""
        store_options = open_options(store_options, tenant=tenant, encryption=extra.get("encryption"),
                                          name="extra_config['encryption']")
        self.storage_config = storage_config
        self.model_id = model_id
        self.tenant = tenant
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        allow_clear = extra.get("allow_clear", False)
        if not isinstance(allow_clear, bool):
            raise ValueError(f"extra_config['allow_clear']: expected true or false, got {allow_clear!r}")
        self.allow_clear = allow_clear
        self.enable_storage_metrics = bool(storage_config.enable_storage_metrics)
        self._kv_format = _PageFormat.BUFFERS if self.interface_v1 else _PageFormat.FLAT
        self._namespace_root = self._namespace(storage_config, model_id=model_id, tenant=tenant)
        self._bindings: dict[str, _PoolBinding] = {}
        self._lock = threading.Lock()
        self._counters = Counters(_COUNTERS)
        self._metrics: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [],
                                                 "prefetch_bandwidth": [], "backup_bandwidth": []}
        self.store: BlockStore
        self._store_ident: str | None
        writer = StoreWriter.of(WriterKind.SGLANG, model=model_id, tenant=tenant)  # (the tenant is hashed)
        self._store_ident, self.store = _STORES.acquire(store_url, store_options, writer)
        logger.info("tiered_kv HiCache storage: store %r, model %r, tenant %r, %s calls", display_url(store_url), model_id,
                    tenant, "zero-copy v1" if self.interface_v1 else "legacy")

    @classmethod
    def of(cls, backend: Any) -> TieredKVHiCacheStorage:
        """The :class:`TieredKVHiCacheStorage` that SGLang's ``storage_backend`` is, or wraps.

        With ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY`` / ``..._FAILURE`` set, SGLang wraps
        its backend in ``HiCacheStorageFailureInjector``, which forwards only HiCacheStorage's
        own calls; ``TieredKVHiCacheStorage.of(controller.storage_backend).counters()`` works
        either way.
        """
        inner = backend._backend if isinstance(backend, HiCacheStorageFailureInjector) else backend
        if not isinstance(inner, cls):
            raise TypeError(f"backend: expected a TieredKVHiCacheStorage, or SGLang's failure injector around "
                            f"one, got {type(backend).__name__}")
        return inner

    # ------------------------------------------------------------------ keys
    @staticmethod
    def _namespace(cfg: HiCacheStorageConfig, *, model_id: str, tenant: str) -> bytes:
        """The root every key of this deployment and rank shard derives from.

        MLA KV is identical on every TP rank, so MLA ranks share pages; an MHA rank holds
        its own heads, so its TP rank is part of the shard. Pipeline stages hold other
        layers, context-parallel ranks other slices of each page.
        """
        shard = [f"pp{cfg.pp_rank}/{cfg.pp_size}", f"cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}",
                 f"dcp{cfg.dcp_rank}/{cfg.dcp_size}"]
        if not cfg.is_mla_model:
            shard.append(f"tp{cfg.tp_rank}/{cfg.tp_size}")
        return namespace_root(b"tiered_kv.sglang.v1", model_id, tenant, "|".join(shard))

    def _pool_roots(self, name: str, pool: Any, buffer_bytes: tuple[int, ...]) -> dict[_PageFormat, bytes]:
        cfg = self.storage_config
        shard = f"tp{cfg.tp_rank}/{cfg.tp_size}" if name == PoolName.MAMBA.value else ""  # Mamba state is TP-sharded
        desc = "|".join([name, type(pool).__name__, str(getattr(pool, "layout", "")), str(pool.page_size),
                         str(getattr(pool, "dtype", "")), str(getattr(pool, "storage_format_tag", None)),
                         ",".join(map(str, buffer_bytes)), shard])
        return {fmt: hashlib.sha256(self._namespace_root + b"\0" + desc.encode() + b"\0" + fmt.value.encode()).digest()
                for fmt in _PageFormat}

    def _record_keys(self, binding: _PoolBinding, fmt: _PageFormat,
                     keys: Sequence[str]) -> tuple[list[RecordKey], list[bytes]]:
        """Record keys and token digests of SGLang page keys of one pool."""
        root = binding.roots[fmt]
        sha256 = hashlib.sha256
        rkeys, digests = [], []
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"keys: expected str page keys, got {type(k).__name__}")
            kb = k.encode()
            rkeys.append(block_key(root, kb))
            digests.append(sha256(root + b"page\0" + kb).digest())
        return rkeys, digests

    def record_keys(self, keys: Sequence[str], pool: str = PoolName.KV.value) -> list[RecordKey]:
        """The store keys of SGLang page ``keys`` of a registered ``pool`` (zero-copy format;
        for operators and tests, e.g. to look a record up with the store's own API)."""
        return self._record_keys(self._binding(pool), _PageFormat.BUFFERS, keys)[0]

    # ------------------------------------------------------------------ pools
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._bind(PoolName.KV.value, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == PoolName.KV.value and PoolName.KV.value in self._bindings:
            return  # the anchor KV pool, already bound by register_mem_pool_host
        self._bind(name, host_pool)

    def _bind(self, name: str, pool: Any) -> _PoolBinding:
        page_size = int(getattr(pool, "page_size", 0) or 0)
        if page_size <= 0:
            raise ValueError(f"host pool {name!r}: expected a positive page_size, got {page_size}")
        device = str(getattr(pool, "device", "cpu"))
        if device != "cpu":
            raise ValueError(f"host pool {name!r}: expected a CPU host pool, got device {device!r}")
        if getattr(pool, "dcp_size", 1) != 1:
            raise ValueError(f"host pool {name!r}: decode context parallelism (dcp_size > 1) is not supported")
        meta = pool.get_page_buffer_meta(torch.zeros(page_size, dtype=torch.int64))
        buffer_bytes: tuple[int, ...] = () if meta is None else tuple(int(s) for s in meta[1])
        if any(s <= 0 for s in buffer_bytes):
            raise ValueError(f"host pool {name!r}: expected positive page buffer sizes, got {buffer_bytes}")
        binding = _PoolBinding(name=name, pool=pool, page_size=page_size, buffer_bytes=buffer_bytes,
                               roots=self._pool_roots(name, pool, buffer_bytes))
        with self._lock:
            self._bindings[name] = binding
        return binding

    def _binding(self, name: Any) -> _PoolBinding:
        binding = self._bindings.get(str(name))
        if binding is None:
            raise ValueError(f"pool {str(name)!r}: not registered (registered: {sorted(self._bindings)}); "
                             f"SGLang registers pools with register_mem_pool_host / register_mem_host_pool_v2")
        return binding

    def _page_views(self, binding: _PoolBinding, keys: Sequence[str],
                    host_indices: torch.Tensor) -> list[OutSegments]:
        """Per page, writable views of its host buffers (``binding.buffer_bytes`` each), in
        the pool's memory (see :func:`_page_pieces`)."""
        n = len(keys)
        if host_indices.numel() != n * binding.page_size:
            raise ValueError(f"host_indices of pool {binding.name!r}: expected {n} pages x page_size "
                             f"{binding.page_size} = {n * binding.page_size} indices, got {host_indices.numel()}")
        if n == 0:
            return []
        ptrs, sizes = binding.pool.get_page_buffer_meta(host_indices.cpu())
        per_page = len(binding.buffer_bytes)
        if len(ptrs) != n * per_page or len(sizes) != n * per_page or np.any(
                np.asarray(sizes, dtype=np.int64).reshape(n, per_page) != binding.buffer_bytes):
            raise ValueError(f"pool {binding.name!r}: expected {per_page} buffers of {binding.buffer_bytes} bytes "
                             f"per page, the pool reported {len(ptrs)} buffers of sizes {sorted(set(sizes))} for "
                             f"{n} pages")
        return _page_pieces(np.asarray(ptrs, dtype=np.int64).reshape(n, per_page), binding.buffer_bytes)

    # ------------------------------------------------------------------ page I/O
    def _exists_prefix(self, binding: _PoolBinding, fmt: _PageFormat, keys: Sequence[str]) -> list[bool]:
        rkeys, _ = self._record_keys(binding, fmt, keys)
        try:
            return self.store.contains_many(rkeys)
        except (StoreError, OSError) as e:
            self._store_failed("exists", e)
            return [False] * len(keys)

    def _write_pages(self, binding: _PoolBinding, keys: Sequence[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        if binding.logical:
            return [True] * len(keys)  # an anchor pool holds no bytes: its pages are the other pools'
        views = self._page_views(binding, keys, host_indices)
        rkeys, digests = self._record_keys(binding, _PageFormat.BUFFERS, keys)
        # parent of page i: the page before it in SGLang's chain (prefix_keys, then keys)
        prefix = list(extra_info.prefix_keys or []) if extra_info is not None else []
        chain = prefix[-1:] + list(keys)
        parents = [_ZERO_HASH] * (len(keys) + 1 - len(chain)) + [
            k.block_hash for k in self._record_keys(binding, _PageFormat.BUFFERS, chain[:-1])[0]]
        start = time.perf_counter()
        try:
            present = self.store.contains_many(rkeys)
        except (StoreError, OSError) as e:
            self._store_failed("write", e)
            self._counters.add(pages_write_failed=len(keys))
            return [False] * len(keys)
        todo = [i for i, p in enumerate(present) if not p]
        # A page of several host buffers (e.g. one per layer: layer_first) is one record
        # whose payload is the list of its buffers: encoded straight from the pool.
        items = [PutItem(rkeys[i], parents[i], digests[i], views[i][0] if len(views[i]) == 1 else views[i])
                 for i in todo]
        ok = [True] * len(keys)
        written = 0
        if items:
            try:
                written = sum(self.store.put_many(items))
            except StoreFullError as e:
                logger.warning("tiered_kv HiCache storage: store full, %d pages of pool %r not written: %s",
                               len(items), binding.name, e)
                self._counters.add(pages_write_failed=len(items), store_errors=1)
                for i in todo:
                    ok[i] = False
                return ok
            except (StoreError, OSError) as e:
                self._store_failed("write", e)
                self._counters.add(pages_write_failed=len(items))
                for i in todo:
                    ok[i] = False
                return ok
        self._counters.add(pages_written=written, pages_already_stored=len(keys) - written)
        self._record_metric("backup", len(items), binding.page_bytes, time.perf_counter() - start)
        return ok

    def _read_pages(self, binding: _PoolBinding, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        if binding.logical:
            return [True] * len(keys)
        views = self._page_views(binding, keys, host_indices)
        rkeys, digests = self._record_keys(binding, _PageFormat.BUFFERS, keys)
        # Each page is read straight into its host buffers: a page of several (e.g. one
        # per layer: layer_first) as the scatter list of its buffers, verified as read.
        start = time.perf_counter()
        try:
            metas = self.store.get_many(rkeys, views, token_digests=digests)
        except (StoreError, OSError) as e:
            self._store_failed("read", e)
            self._counters.add(pages_missed=len(keys))
            return [False] * len(keys)
        ok = [m is not None for m in metas]
        hits = sum(ok)
        self._counters.add(pages_read=hits, pages_missed=len(keys) - hits)
        self._record_metric("prefetch", hits, binding.page_bytes, time.perf_counter() - start)
        return ok

    def _store_failed(self, what: str, e: BaseException) -> None:
        logger.warning("tiered_kv HiCache storage: %s failed, pages count as misses: %s: %s", what,
                       type(e).__name__, e)
        self._counters.add(store_errors=1)

    def _record_metric(self, kind: str, pages: int, page_bytes: int, seconds: float) -> None:
        if not self.enable_storage_metrics or pages == 0:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(pages * page_bytes / (1 << 30) / max(seconds, 1e-9))

    # ------------------------------------------------------------------ v1: zero-copy
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The number of leading ``keys`` whose KV page is stored."""
        n = self._kv_prefix(keys)
        self._count_lookup(len(keys), held=n, restorable=n)
        return n

    def _kv_prefix(self, keys: list[str]) -> int:
        binding = self._binding(PoolName.KV)
        if binding.logical:
            return len(keys)
        present = self._exists_prefix(binding, self._kv_format, keys)
        return present.index(False) if False in present else len(present)

    def _count_lookup(self, asked: int, *, held: int, restorable: int) -> None:
        """A query of ``asked`` pages: ``held`` leading ones stored in every KV pool, of
        which ``restorable`` leading ones resumable (the lookup_* counters)."""
        self._counters.add(lookup_pages=asked, lookup_pages_hit=restorable, lookup_pages_no_state=held - restorable,
                           lookup_pages_not_cached=asked - held)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the KV pages at ``host_indices`` (``len(keys) * page_size`` slots) under ``keys``."""
        return self._write_pages(self._binding(PoolName.KV), keys, host_indices, extra_info)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read the KV pages of ``keys`` into the host pool at ``host_indices``."""
        return self._read_pages(self._binding(PoolName.KV), keys, host_indices)

    # ------------------------------------------------------------------ v2: several pools
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The longest KV prefix of ``keys`` every pool in ``pool_transfers`` can serve.

        ``ALL_PAGES`` pools need each page of the prefix; ``TRAILING_PAGES`` pools only the
        last ``len(transfer.keys)`` pages before a stop point (SWA / Mamba state).
        """
        kv_pages = self._kv_prefix(keys)
        hit_count: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        held = kv_pages   # leading pages every all-pages pool holds (a pool not asked: all)
        for transfer in pool_transfers or []:
            if not restorable:
                break
            binding = self._binding(transfer.name)
            present = (self._exists_prefix(binding, _PageFormat.BUFFERS, keys[:kv_pages]) if not binding.logical
                       else [True] * kv_pages)
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                pool_restorable = set(range(1, boundary + 1))
                held = min(held, boundary)
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - window):n])}
                boundary = max(pool_restorable, default=0)
            else:
                raise ValueError(f"pool {str(transfer.name)!r}: hit policy {transfer.hit_policy} is not supported "
                                 f"(expected all_pages or trailing_pages)")
            if boundary:
                hit_count[transfer.name] = boundary
            restorable = [n for n in restorable if n in pool_restorable]
        resumable = restorable[-1] if restorable else 0
        self._count_lookup(len(keys), held=max(held, resumable), restorable=resumable)
        return PoolTransferResult(resumable, hit_count, restorable)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Store each transfer's pages (``keys`` at ``host_indices`` of its pool)."""
        return {t.name: self._write_pages(self._binding(t.name), t.keys or [], self._indices(t), extra_info)
                for t in transfers}

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        """Read each transfer's pages into its pool at ``host_indices``."""
        return {t.name: self._read_pages(self._binding(t.name), t.keys or [], self._indices(t)) for t in transfers}

    @staticmethod
    def _indices(transfer: PoolTransfer) -> torch.Tensor:
        if transfer.host_indices is None:
            raise ValueError(f"pool {str(transfer.name)!r}: expected host_indices for a storage transfer")
        return transfer.host_indices

    # ------------------------------------------------------------------ legacy: flat pages
    def _flat_key(self, key: str) -> tuple[RecordKey, bytes]:
        rkeys, digests = self._record_keys(self._binding(PoolName.KV), _PageFormat.FLAT, [key])
        return rkeys[0], digests[0]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Read the flat page of ``key`` into ``target_location`` (a CPU tensor of one page)."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError(f"target_locations: expected one page tensor per key ({len(keys)})")
        if not keys:
            return []
        if self._binding(PoolName.KV).logical:
            return list(target_locations)  # an anchor pool's pages hold no bytes
        found = [self._flat_key(k) for k in keys]
        try:
            metas = self.store.get_many([f[0] for f in found], list(target_locations),
                                        token_digests=[f[1] for f in found])
        except (StoreError, OSError) as e:
            self._store_failed("read", e)
            metas = [None] * len(keys)
        hits = sum(m is not None for m in metas)
        self._counters.add(pages_read=hits, pages_missed=len(keys) - hits)
        return [t if m is not None else None for t, m in zip(target_locations, metas)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store the flat page tensor ``value`` under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store each flat page of ``values``; True if every page is stored."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"values: expected one page tensor per key ({len(keys)})")
        if self._binding(PoolName.KV).logical:
            return True
        items = []
        for k, v in zip(keys, values):
            rkey, digest = self._flat_key(k)
            items.append(PutItem(rkey, _ZERO_HASH, digest, v.contiguous() if isinstance(v, torch.Tensor) else v))
        try:
            written = sum(self.store.put_many(items))
        except (StoreError, OSError) as e:
            self._store_failed("write", e)
            self._counters.add(pages_write_failed=len(items))
            return False
        self._counters.add(pages_written=written, pages_already_stored=len(items) - written)
        return True

    def exists(self, key: str) -> bool:
        """Whether the KV page of ``key`` is stored (in the format this backend's calls use)."""
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ admin
    def clear(self) -> None:
        """Empty the node's own store, where the extra config allows it; else refuse.

        With ``"allow_clear": true``: every record of a single store, or of level 0 of a
        chain, is deleted (``BlockStore.gc(0)``); a shared level is left to ``tiered-kv gc``
        on its own URL, run once for the fleet. Pages SGLang writes while this runs may
        survive it. Otherwise (the default) nothing is deleted and
        :class:`ClearRefusedError` is raised: the store may be shared by other models,
        tenants and servers. It raises rather than returning ``False`` because SGLang
        0.5.23's cache controller ignores the returned value; an exception is what its
        storage layer reports as a failed clear (``Failed to clear hierarchical cache
        storage backend: ...``). Trim a store with ``open_store(url,
        layout_fingerprint=SGLANG_LAYOUT_FINGERPRINT).gc(n)`` (docs/integrations/sglang.md).
        """
        if not self.allow_clear:
            raise ClearRefusedError(f"tiered_kv HiCache storage refuses clear(): the store may be shared by other "
                                    f"servers and tenants, nothing was deleted ({self.counters().get('store.records')} "
                                    f"records). Set extra_config['allow_clear'] to let it empty this node's store, "
                                    f"or trim it with BlockStore.gc (docs/integrations/sglang.md)")
        done = self.store.gc(0)
        level = " (level 0 of the chain; shared levels are kept)" if "level" in done else ""
        logger.warning("tiered_kv HiCache storage cleared%s: %d records, %d bytes deleted, %d records left",
                       level, done.get("evicted", 0), done.get("freed_bytes", 0), done.get("records", 0))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call (pages and GB/s per batch)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            taken = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        return StorageMetrics(prefetch_pgs=taken["prefetch_pgs"], backup_pgs=taken["backup_pgs"],
                              prefetch_bandwidth=taken["prefetch_bandwidth"],
                              backup_bandwidth=taken["backup_bandwidth"])

    def counters(self) -> dict[str, Any]:
        """This backend's page counters and the store's own (``store.<name>``)."""
        out: dict[str, Any] = self._counters.as_dict()
        try:
            out.update({f"store.{k}": v for k, v in self.store.stats().items()})
        except (StoreError, OSError) as e:
            out["store.error"] = f"{type(e).__name__}: {e}"
        return out

    def close(self) -> None:
        """Release the store, closing it unless another backend of this process shares it
        (SGLang calls this when the backend is detached). Idempotent."""
        ident, self._store_ident = self._store_ident, None
        if ident is not None:
            _STORES.release(ident)
