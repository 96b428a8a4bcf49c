"""A vLLM secondary offloading tier that keeps vLLM's KV chunks in a tiered_kv store.

vLLM 0.33's ``TieringOffloadingSpec`` keeps offloaded KV chunks in a CPU *primary* tier
(a shared-memory buffer, one row per chunk) and cascades every chunk stored there to its
*secondary* tiers; a chunk missing from the primary tier is looked up in the secondary
tiers and promoted back. :class:`TieredKVTier` is such a secondary tier over any store
:func:`tiered_kv.storage.open_store` opens: LMDB, Zarr, Zarr on S3, or a chain of them.
vLLM loads it by name, without registration::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 34359738368,
        "secondary_tiers": [{"type": "TieredKVTier",
                             "module_path": "tiered_kv.integrations.vllm",
                             "store": "lmdb:///var/cache/tiered-kv-vllm",
                             "max_bytes": 1099511627776, "tenant": "team-a"}]}}'

What it does, per :class:`vllm.v1.kv_offload.tiering.base.SecondaryTierManager`:

- ``lookup``: vLLM's own :class:`AsyncLookupManager` batches the step's keys; its worker
  thread answers each batch with one :meth:`BlockStore.contains_many` (concurrent on an
  object store). ``RETRY`` until the batch is answered; a store that raises is a ``MISS``.
- ``submit_store`` / ``submit_load``: one job = one batched ``put_many`` / ``get_many``
  on a thread pool of ``io_threads``; the scheduler thread never touches the store.
  Stores read the primary rows in place (no copy before the record encoding); loads are
  verified reads straight into the primary rows.
- Read-ahead (``read_ahead_bytes``, :mod:`tiered_kv.integrations.read_ahead`): the chunks
  a lookup finds are read (verified) into staging rows as soon as the lookup answers, a
  scheduler step before vLLM submits their load; the load job then copies them into the
  primary rows it is given and reads the others straight into theirs.
- A record that fails verification (checksum, key, layout, token digest) is a *failed
  key* of its load job (``JobResult.successful_keys`` lists the others), so vLLM
  recomputes that chunk: bad bytes are never handed to the engine. A store that is
  down, full or closed fails the whole job; vLLM counts it
  (``vllm:kv_offload_tiering_{promotion,cascade}_job_failures``) and goes on.
- ``get_stats`` / ``build_metric_definitions``: counters of this tier (below), and
  ``config_info`` the store, tenant and namespace on ``vllm:kv_offload_config_info``.

Key mapping
-----------
vLLM's ``OffloadKey`` is its chained block hash (of the chunk's last block; sha256 by
default, seeded by a fixed ``NONE_HASH``, so it agrees across processes) followed by the
4-byte KV-cache group index. Our record key is::

    namespace = sha256("tiered_kv.vllm.v1" \\0 model_id \\0 tenant \\0 layout_fingerprint)
    RecordKey.block(sha256(namespace || offload_key))

``layout_fingerprint`` (``"vllm-"`` + 27 hex digits) hashes the byte format of a chunk:
vLLM's own storage-namespace fields (``FileMapper``'s run config: tokens per hash, blocks
per chunk, dtype, KV-cache groups with their layer names, parallel sizes unless the
layout is parallelism-agnostic, canonical format) and the chunk's byte size; the store is
bound to it (another layout cannot open it; at another TP size, MLA included, the chunk
format differs). ``model_id`` (default: vLLM's ``--model`` as given, a path or a Hugging
Face id: the offloading API passes no served model name, so set it on every node of a
fleet) and ``tenant`` salt every key, so two deployments with a different model or tenant
never read each other's chunks, even on one shared bucket. Each record also carries
``parent_hash = namespace`` and ``token_digest = sha256("vllm.offload_key" \\0
offload_key)``, both checked on every read.

Counters (``get_stats``; Prometheus names)::

    vllm:kv_offload_tiered_kv_chunks_stored          chunks written to the store
    vllm:kv_offload_tiered_kv_chunks_present         chunks a store job found already stored
    vllm:kv_offload_tiered_kv_chunks_loaded          chunks loaded (verified)
    vllm:kv_offload_tiered_kv_chunks_read_ahead      of those, chunks a lookup had read ahead
    vllm:kv_offload_tiered_kv_read_ahead_dropped     chunks read ahead that no load took (evicted
                                                     for newer lookups) or whose read failed
    vllm:kv_offload_tiered_kv_load_misses            chunks a load could not deliver:
                                                     evicted since the lookup, or corrupt
    vllm:kv_offload_tiered_kv_job_errors{error=}     jobs the store failed: full, unavailable,
                                                     closed, error
    vllm:kv_offload_tiered_kv_lookup_errors          lookup batches the store failed (MISS)
    vllm:kv_offload_tiered_kv_lookup_misses          chunks a lookup did not find: not cached
                                                     (never stored, or evicted)
    vllm:kv_offload_tiered_kv_store_corrupt          records that failed verification: each a
                                                     miss (recomputed), counted by the store
    vllm:kv_offload_tiered_kv_store_evictions        records the store evicted for space (its
                                                     LRU, by access time, under max_bytes)

These are the cache's counters (``tiered_kv_hits_total``, ``tiered_kv_miss_tokens_total
{reason}``, ``tiered_kv_evictions_total``, ``tiered_kv_corrupt_total``) as this tier can
count them: ``chunks_loaded`` are its hits; its misses are ``lookup_misses`` (not cached),
``load_misses`` (evicted since the lookup, or corrupt) and of those ``store_corrupt``.
The store counters are read from ``store.stats()`` at most every
:data:`STORE_STATS_INTERVAL_S` (it is an index transaction). The cache's snapshot and
stranding counters have no counterpart here: vLLM's chunks are KV blocks only (no State
snapshots), and their records carry no parent link (vLLM's chained hash is opaque), so
neither snapshot bytes nor a stranding eviction can be told apart in this store.

Policies. The snapshot placement and eviction policies of :mod:`tiered_kv.policy`
(``snapshot_policy``, ``eviction``) choose what tiered_kv's own GPU and host tiers keep
and where its requests snapshot State; under vLLM those tiers are vLLM's (its GPU blocks
and its CPU primary tier, with vLLM's own eviction), and this tier is a store that evicts
least recently accessed records first. The two keys are therefore refused with a
ValueError that says so, rather than accepted and ignored.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import inspect
import json
import logging
import queue
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfo,
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from ..storage import (
    BlockStore,
    EncryptionConfig,
    LayoutMismatchError,
    PutItem,
    RecordKey,
    StoreFullError,
    StoreWriter,
    WriterKind,
    open_store,
)
from ..storage.api.counters import Counters
from ._adapter import block_key, display_url, namespace_root, open_options
from .read_ahead import ReadAhead, Staged

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["TieredKVTier", "TieredKVTierInfo", "VllmKeyMapper", "TieredKVTierMetrics"]

log = logging.getLogger(__name__)

_NAMESPACE_TAG = b"tiered_kv.vllm.v1"
_KEY_DIGEST_TAG = b"vllm.offload_key\0"
_FINGERPRINT_PREFIX = "vllm-"
_FINGERPRINT_HEX = 32 - len(_FINGERPRINT_PREFIX)   # the record header holds 32 ascii bytes
#: Staging memory for chunks read ahead from their lookup (TieredKVTier's read_ahead_bytes).
DEFAULT_READ_AHEAD_BYTES = 256 << 20
#: Seconds between two reads of ``store.stats()`` by ``get_stats`` (the store's own counters).
STORE_STATS_INTERVAL_S = 10.0
#: Cache options that do not apply to this tier (see the module docstring: Policies).
_CACHE_POLICY_KEYS = ("snapshot_policy", "eviction")


class TieredKVTierMetrics:
    """Prometheus names of this tier's counters."""

    CHUNKS_STORED = "vllm:kv_offload_tiered_kv_chunks_stored"
    CHUNKS_PRESENT = "vllm:kv_offload_tiered_kv_chunks_present"
    CHUNKS_LOADED = "vllm:kv_offload_tiered_kv_chunks_loaded"
    CHUNKS_READ_AHEAD = "vllm:kv_offload_tiered_kv_chunks_read_ahead"
    READ_AHEAD_DROPPED = "vllm:kv_offload_tiered_kv_read_ahead_dropped"
    LOAD_MISSES = "vllm:kv_offload_tiered_kv_load_misses"
    JOB_ERRORS = "vllm:kv_offload_tiered_kv_job_errors"
    LOOKUP_ERRORS = "vllm:kv_offload_tiered_kv_lookup_errors"
    LOOKUP_MISSES = "vllm:kv_offload_tiered_kv_lookup_misses"
    STORE_CORRUPT = "vllm:kv_offload_tiered_kv_store_corrupt"
    STORE_EVICTIONS = "vllm:kv_offload_tiered_kv_store_evictions"

    #: the ``error`` label values of JOB_ERRORS
    ERROR_KINDS = ("full", "unavailable", "closed", "error")


# ------------------------------------------------------------------ key mapping
@dataclass(frozen=True, kw_only=True, slots=True)
class VllmKeyMapper:
    """vLLM ``OffloadKey`` -> our :class:`RecordKey`, in one model + tenant namespace.

    ``layout_fingerprint``: the store's fingerprint for this chunk format; ``namespace``:
    the 32-byte root every key of this deployment is salted with.
    """

    model_id: str
    tenant: str
    layout_fingerprint: str
    namespace: bytes

    @classmethod
    def create(cls, *, model_id: str, tenant: str, layout_fields: dict[str, Any]) -> VllmKeyMapper:
        """``layout_fields``: the JSON-able facts that fix a chunk's byte format."""
        if not isinstance(model_id, str) or not model_id:
            raise ValueError(f"model_id: expected a non-empty str, got {model_id!r}")
        if not isinstance(tenant, str):
            raise ValueError(f"tenant: expected a str, got {type(tenant).__name__}")
        canonical = json.dumps(layout_fields, sort_keys=True, separators=(",", ":")).encode()
        fingerprint = _FINGERPRINT_PREFIX + hashlib.sha256(canonical).hexdigest()[:_FINGERPRINT_HEX]
        namespace = namespace_root(_NAMESPACE_TAG, model_id, tenant, fingerprint)
        return cls(model_id=model_id, tenant=tenant, layout_fingerprint=fingerprint, namespace=namespace)

    @classmethod
    def from_offloading_spec(cls, spec: OffloadingSpec, *, chunk_bytes: int, tenant: str = "",
                             model_id: str | None = None) -> VllmKeyMapper:
        """The mapper of one vLLM deployment: vLLM's own storage-namespace fields (those its
        ``fs`` tier hashes into its directory name) plus the chunk size in bytes."""
        mapper = FileMapper.from_offloading_spec(root_dir="", offloading_spec=spec,
                                                 blocks_per_file=spec.blocks_per_chunk, parallel_agnostic=True)
        fields = mapper.get_run_config()
        model = fields.pop("model_name")
        fields["chunk_bytes"] = int(chunk_bytes)
        return cls.create(model_id=model if model_id is None else model_id, tenant=tenant, layout_fields=fields)

    def record_key(self, key: OffloadKey) -> RecordKey:
        return block_key(self.namespace, bytes(key))

    @staticmethod
    def key_digest(key: OffloadKey) -> bytes:
        """The record's token-digest field: ties a record to the exact vLLM key."""
        return hashlib.sha256(_KEY_DIGEST_TAG + bytes(key)).digest()


@dataclass(frozen=True)
class TieredKVTierInfo(ConfigInfo):
    """Labels of this tier's series on ``vllm:kv_offload_config_info``."""

    tiered_kv_store: str          # the store URL(s), without query strings (credentials)
    tiered_kv_tenant: str
    tiered_kv_namespace: str      # first 16 hex digits of the namespace root
    tiered_kv_layout: str         # the store's layout fingerprint
    tiered_kv_io_threads: int


def _error_kind(exc: BaseException, store: BlockStore) -> str:
    """The ``error`` label of a failed job (TieredKVTierMetrics.ERROR_KINDS)."""
    if isinstance(exc, StoreFullError):
        return "full"
    if store.closed:
        return "closed"
    if isinstance(exc, OSError):   # ConnectionError (ObjectStoreUnavailable), TimeoutError, EIO...
        return "unavailable"
    return "error"


class _StoreLookup(AsyncLookupManager):
    """vLLM's async lookup front end; each step's batch is one ``contains_many``."""

    def __init__(self, tier: TieredKVTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        tier = self._tier
        try:
            found = tier.store.contains_many([tier.keys.record_key(k) for k in keys])
        except Exception:
            tier.counters.add_to((TieredKVTierMetrics.LOOKUP_ERRORS, ()))
            raise   # AsyncLookupManager logs it and answers MISS for the batch
        found = list(found)
        tier.counters.add_to((TieredKVTierMetrics.LOOKUP_MISSES, ()), found.count(False))
        if tier.read_ahead is not None:   # a hit is promoted next step: start reading it now
            tier.read_ahead.start([k for k, hit in zip(keys, found) if hit])
        return found


def _config_keys() -> list[str]:
    """The keys of a TieredKVTier's ``secondary_tiers`` entry: vLLM's own (``type``,
    ``module_path``, ``backpressure``) and this tier's keyword options."""
    params = inspect.signature(TieredKVTier.__init__).parameters
    own = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "backpressure_detector"]
    return sorted(["type", "module_path", "backpressure", *own])


def _layout_mismatch(exc: LayoutMismatchError, where: str, spec: OffloadingSpec,
                     chunk_bytes: int) -> LayoutMismatchError:
    """``exc`` restated with this engine's chunk format and what makes formats differ: a
    store holds one, set by the TP size (MLA models too), block size, KV dtype, model."""
    cfg = spec.config
    par = cfg.parallel
    copies = "one copy per rank" if not cfg.replicated_layout else "replicated MLA layout: one copy"
    fmt = (f"{chunk_bytes} bytes per chunk ({cfg.cache.blocks_per_chunk} blocks, {cfg.cache.tokens_per_hash} "
           f"tokens per hash), dtype {cfg.model.dtype}, tensor-parallel size {par.tp_size} ({copies}; "
           f"pp {par.pp_size}, pcp {par.pcp_size}, dcp {par.dcp_size})")
    err = LayoutMismatchError(
        f"{where}: the store holds vLLM chunks of layout fingerprint {exc.stored!r}, this engine writes "
        f"{exc.requested!r}: {fmt}. A store holds one chunk format: an engine at another tensor-parallel "
        f"size (MLA models included), block size, KV dtype or model needs a store path or bucket prefix "
        f"of its own")
    err.stored, err.requested = exc.stored, exc.requested
    return err


# ------------------------------------------------------------------ the tier
class TieredKVTier(SecondaryTierManager):
    """vLLM secondary tier over a tiered_kv store. See the module docstring.

    Tier-config keys (``secondary_tiers[i]`` of ``kv_connector_extra_config``):

    - ``store`` (required): a URL or path, or a list of them (a :class:`StoreChain`,
      nearest first), as :func:`tiered_kv.storage.open_store` takes.
    - ``tenant`` (default ``""``): salts every key; deployments with another tenant never
      see these chunks.
    - ``model_id`` (default: vLLM's ``--model`` as given): salts every key too. Nodes
      that load one model from different paths must set the same one to share chunks.
    - ``max_bytes``: LRU bound of the store (of its first level for a chain).
    - ``store_options``: more :func:`open_store` options (``timeout_s``,
      ``level_options``, credentials...).
    - ``encryption``: seal every record for this deployment's tenant (XAES-256-GCM under keyed names, see
      docs/shared-store.md): ``{"key_files": ["/etc/tiered-kv/key"], "tenant": ...}`` or an
      :class:`~tiered_kv.storage.EncryptionConfig`; the tenant defaults to ``tenant``. For a
      chain it seals every level; to seal one level only, put it in that level's
      ``store_options["level_options"]`` entry instead (its tenant defaults the same way).
    - ``io_threads`` (default 4): worker threads running store and load jobs.
    - ``read_ahead_bytes`` (default 256 MiB): staging memory for chunks read ahead of
      their load, from the lookup that found them (whole chunks; 0: no read-ahead).
    - ``enable_kv_events``, ``locality``: as vLLM's ``fs`` tier.

    An unknown key is a :class:`TypeError` that lists the valid ones.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str, *,
                 store: str | Sequence[str], tenant: str = "", model_id: str | None = None,
                 max_bytes: int | None = None, store_options: dict[str, Any] | None = None,
                 io_threads: int = 4, read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
                 enable_kv_events: bool = False, locality: str | None = None,
                 encryption: EncryptionConfig | dict[str, Any] | None = None,
                 backpressure_detector: BackpressureDetector | None = None, **unknown: Any) -> None:
        policy = sorted(set(unknown) & set(_CACHE_POLICY_KEYS))
        if policy:
            raise ValueError(f"secondary tier {tier_type!r} (TieredKVTier): {', '.join(policy)} select the policies "
                             f"of tiered_kv's own GPU and host tiers (TieredKVCache); under vLLM those tiers are "
                             f"vLLM's, and this tier is a store that evicts least recently used records first "
                             f"(bound it with max_bytes). See docs/integrations/vllm.md, Policies")
        if unknown:
            raise TypeError(f"secondary tier {tier_type!r} (TieredKVTier): unknown option(s) {sorted(unknown)}; "
                            f"expected some of {_config_keys()} (open_store options go in store_options)")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads: expected an int >= 1, got {io_threads!r}")
        if isinstance(read_ahead_bytes, bool) or not isinstance(read_ahead_bytes, int) or read_ahead_bytes < 0:
            raise ValueError(f"read_ahead_bytes: expected an int >= 0, got {read_ahead_bytes!r}")
        if store_options is not None and not isinstance(store_options, dict):
            raise ValueError(f"store_options: expected a dict, got {type(store_options).__name__}")
        if not isinstance(store, (str, list, tuple)) or not store:
            raise ValueError(f"store: expected a store URL or a list of them, got {store!r}")
        self.locality = Locality(locality) if locality is not None else None

        if primary_kv_view.ndim != 2 or primary_kv_view.itemsize != 1 or not primary_kv_view.c_contiguous:
            raise ValueError(f"primary_kv_view: expected a C-contiguous 2-D byte view [num_chunks, chunk_bytes], "
                             f"got shape {primary_kv_view.shape} format {primary_kv_view.format!r}")
        self.keys = VllmKeyMapper.from_offloading_spec(offloading_spec, chunk_bytes=self.block_size_bytes,
                                                       tenant=tenant, model_id=model_id)
        # an encrypted level seals for this tenant
        options = open_options(store_options, tenant=tenant, encryption=encryption)
        if max_bytes is not None:
            if isinstance(store, str):
                options["max_bytes"] = max_bytes
            else:
                levels = list(options.get("level_options") or [None] * len(store))
                levels[0] = {**(levels[0] or {}), "max_bytes": max_bytes}
                options["level_options"] = levels
        # recorded by a store created here: `tiered-kv stats` names its writer (the tenant hashed)
        options.setdefault("writer", StoreWriter.of(WriterKind.VLLM, model=self.keys.model_id, tenant=tenant))
        try:
            self.store: BlockStore = open_store(store if isinstance(store, str) else list(store),
                                                layout_fingerprint=self.keys.layout_fingerprint, **options)
        except LayoutMismatchError as exc:
            raise _layout_mismatch(exc, display_url(store), offloading_spec, self.block_size_bytes) from None
        #: ``[num_chunks, chunk_bytes] uint8``: the primary tier's buffer, row c = chunk c (vLLM
        #: exposes it as int8); shares its memory.
        self._rows: np.ndarray | None = np.asarray(primary_kv_view).view(np.uint8)
        staging_rows = read_ahead_bytes // self.block_size_bytes
        self.read_ahead: ReadAhead[OffloadKey] | None = None
        if staging_rows:
            self.read_ahead = ReadAhead(self.store, chunk_bytes=self.block_size_bytes, capacity=staging_rows,
                                        record=lambda k: (self.keys.record_key(k), self.keys.key_digest(k)))
        self._info = TieredKVTierInfo(tiered_kv_store=display_url(store), tiered_kv_tenant=tenant,
                                      tiered_kv_namespace=self.keys.namespace.hex()[:16],
                                      tiered_kv_layout=self.keys.layout_fingerprint,
                                      tiered_kv_io_threads=io_threads)

        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning("enable_kv_events is set on tier %r but KV cache events are disabled globally; "
                            "the tier emits none", tier_type)
        #: (Prometheus name, label values) -> count since the last get_stats
        self.counters = Counters()
        #: the store's own counters (STORE_STATS) as last read, and when (monotonic; None: never)
        self._store_seen: dict[str, int] = {}
        self._store_read_at: float | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=io_threads,
                                                           thread_name_prefix="tiered_kv_vllm")
        # Written by pool threads, drained by get_finished_jobs() on the scheduler side.
        self._finished: queue.SimpleQueue[tuple[JobResult, list[OffloadKey], bool]] = queue.SimpleQueue()
        self._in_flight: set[concurrent.futures.Future[None]] = set()
        self._lookup = _StoreLookup(self)
        log.info("tiered_kv vLLM tier on %s: layout %s, model_id %r, tenant %r, namespace %s",
                 self._info.tiered_kv_store, self.keys.layout_fingerprint, self.keys.model_id, tenant,
                 self._info.tiered_kv_namespace)

    # ------------------------------------------------------------- lookups
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookup.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup.flush()

    # ------------------------------------------------------------- jobs
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, chunk_ids = self._job_args(job_metadata)
        self._submit(self._store_job, job_metadata.job_id, keys, chunk_ids)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, chunk_ids = self._job_args(job_metadata)
        self._submit(self._load_job, job_metadata.job_id, keys, chunk_ids)

    def _job_args(self, job: TransferJob) -> tuple[list[OffloadKey], list[int]]:
        keys = list(job.keys)
        chunk_ids = [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ValueError(f"job {job.job_id}: expected one chunk id per key ({len(keys)}), "
                             f"got {len(chunk_ids)}")
        return keys, chunk_ids

    def _submit(self, fn: Any, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        future = self._pool.submit(fn, job_id, keys, chunk_ids)
        self._in_flight.add(future)

    def _store_job(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        """Pool thread: write the primary rows ``chunk_ids`` as the records of ``keys``."""
        start = time.monotonic()
        rows = self._rows
        assert rows is not None, "job ran after shutdown"
        try:
            items = [PutItem(self.keys.record_key(k), self.keys.namespace, self.keys.key_digest(k), rows[c])
                     for k, c in zip(keys, chunk_ids)]
            written = self.store.put_many(items)
        except Exception as e:  # the engine goes on without this tier: a failed job, counted
            self._job_failed("store", job_id, keys, e)
            return
        n_written = sum(written)
        self.counters.add_to((TieredKVTierMetrics.CHUNKS_STORED, ()), n_written)
        self.counters.add_to((TieredKVTierMetrics.CHUNKS_PRESENT, ()), len(keys) - n_written)
        self._finished.put((JobResult(job_id=job_id, success=True, transfer_time=time.monotonic() - start,
                                      transfer_bytes=len(keys) * self.block_size_bytes), keys, False))

    def _load_job(self, job_id: JobId, keys: list[OffloadKey], chunk_ids: list[int]) -> None:
        """Pool thread: ``keys`` into the primary rows ``chunk_ids``: the chunks a lookup read
        ahead copied from staging, the others read (verified) straight into their rows."""
        start = time.monotonic()
        rows = self._rows
        assert rows is not None, "job ran after shutdown"
        read_ahead = self.read_ahead
        taken = read_ahead.take(keys) if read_ahead is not None else {}
        staged: dict[int, Staged] = {i: taken.pop(k) for i, k in enumerate(keys) if k in taken}  # index -> entry
        hit = [False] * len(keys)
        try:
            # first the chunks not read ahead, straight into their rows (the staged reads end meanwhile)
            self._read_into(keys, chunk_ids, [i for i in range(len(keys)) if i not in staged], hit)
            unread = []
            while staged:
                assert read_ahead is not None
                i, entry = staged.popitem()
                delivered = read_ahead.deliver(entry, rows[chunk_ids[i]])
                if delivered is None:
                    unread.append(i)   # not read ahead after all (not started, or the store raised)
                hit[i] = bool(delivered)
            self._read_into(keys, chunk_ids, unread, hit)
        except Exception as e:
            for entry in staged.values():
                assert read_ahead is not None
                read_ahead.discard(entry)
            self._job_failed("load", job_id, keys, e)
            return
        loaded = [k for k, h in zip(keys, hit) if h]
        self.counters.add_to((TieredKVTierMetrics.CHUNKS_LOADED, ()), len(loaded))
        self.counters.add_to((TieredKVTierMetrics.LOAD_MISSES, ()), len(keys) - len(loaded))
        ok = len(loaded) == len(keys)
        # A failed key's row holds unspecified bytes; vLLM frees it (complete_write(False)).
        result = JobResult(job_id=job_id, success=ok, successful_keys=None if ok else tuple(loaded),
                           transfer_time=time.monotonic() - start,
                           transfer_bytes=len(loaded) * self.block_size_bytes)
        self._finished.put((result, keys, True))

    def _read_into(self, keys: list[OffloadKey], chunk_ids: list[int], which: list[int], hit: list[bool]) -> None:
        """One verified ``get_many`` of ``keys[i]`` straight into primary row ``chunk_ids[i]``,
        for ``i`` in ``which``; sets ``hit[i]``."""
        if not which:
            return
        rows = self._rows
        assert rows is not None, "job ran after shutdown"
        picked = [keys[i] for i in which]
        metas = self.store.get_many([self.keys.record_key(k) for k in picked], [rows[chunk_ids[i]] for i in which],
                                    token_digests=[self.keys.key_digest(k) for k in picked])
        for i, m in zip(which, metas):
            hit[i] = m is not None

    def _job_failed(self, what: str, job_id: JobId, keys: list[OffloadKey], exc: BaseException) -> None:
        kind = _error_kind(exc, self.store)
        self.counters.add_to((TieredKVTierMetrics.JOB_ERRORS, (kind,)), 1)
        if kind == "error":
            log.error("tiered_kv %s job %s (%d chunks) failed", what, job_id, len(keys), exc_info=exc)
        else:
            log.warning("tiered_kv %s job %s (%d chunks) failed: %s: %s", what, job_id, len(keys),
                        type(exc).__name__, exc)
        self._finished.put((JobResult(job_id=job_id, success=False), keys, what == "load"))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                result, keys, is_load = self._finished.get_nowait()
            except queue.Empty:
                break
            if is_load and not result.success:
                # Stop this request re-promoting chunks that just failed (vLLM #49176).
                done = set(result.successful_keys or ())
                self._lookup.mark_miss([k for k in keys if k not in done])
            elif not is_load and result.success and self.events is not None:
                self.events.append(OffloadingEvent(keys=keys, medium=self.medium, removed=False,
                                                   locality=self.locality))
            results.append(result)
        self._in_flight = {f for f in self._in_flight if not f.done()}
        return results

    def has_pending_work(self) -> bool:
        return any(not f.done() for f in self._in_flight)

    def drain_jobs(self) -> None:
        concurrent.futures.wait(self._in_flight)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is not None:
            events, self.events = self.events, []
            yield from events

    # ------------------------------------------------------------- metrics
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        m = TieredKVTierMetrics
        return {
            m.CHUNKS_STORED: OffloadingCounterMetadata(documentation="KV chunks written to the tiered_kv store."),
            m.CHUNKS_PRESENT: OffloadingCounterMetadata(
                documentation="KV chunks a tiered_kv store job found already stored (write-once)."),
            m.CHUNKS_LOADED: OffloadingCounterMetadata(
                documentation="KV chunks loaded from the tiered_kv store, verified."),
            m.CHUNKS_READ_AHEAD: OffloadingCounterMetadata(
                documentation="KV chunks loaded from the tiered_kv store that a lookup had read ahead "
                              "(verified, then copied into the primary tier by the load)."),
            m.READ_AHEAD_DROPPED: OffloadingCounterMetadata(
                documentation="KV chunks the tiered_kv tier read ahead that no load took (dropped for newer "
                              "lookups), or whose read failed (the load then read them from the store)."),
            m.LOAD_MISSES: OffloadingCounterMetadata(
                documentation="KV chunks a tiered_kv load could not deliver: evicted since the lookup, or a "
                              "record that failed verification (recomputed by vLLM)."),
            m.JOB_ERRORS: OffloadingCounterMetadata(
                documentation="tiered_kv store/load jobs failed by the store, by error: full, unavailable, "
                              "closed, error.", labelnames=("error",)),
            m.LOOKUP_ERRORS: OffloadingCounterMetadata(
                documentation="tiered_kv lookup batches the store failed (answered as misses)."),
            m.LOOKUP_MISSES: OffloadingCounterMetadata(
                documentation="KV chunks a tiered_kv lookup did not find: not cached (never stored, or evicted)."),
            m.STORE_CORRUPT: OffloadingCounterMetadata(
                documentation="tiered_kv records that failed verification (checksum, key, layout, token digest): "
                              "each a miss, recomputed by vLLM, never served."),
            m.STORE_EVICTIONS: OffloadingCounterMetadata(
                documentation="tiered_kv records the store evicted for space (least recently accessed first)."),
        }

    #: the store's counters get_stats forwards: stats() key -> our counter
    _STORE_STATS = {"corrupt": TieredKVTierMetrics.STORE_CORRUPT, "evictions": TieredKVTierMetrics.STORE_EVICTIONS}

    def _poll_store(self, *, force: bool = False) -> None:
        """Add what the store's ``corrupt`` / ``evictions`` counters gained since the last
        read to ours: at most every STORE_STATS_INTERVAL_S unless ``force``. A store that
        cannot answer is skipped (its jobs count their own errors)."""
        now = time.monotonic()
        if not force and self._store_read_at is not None and now - self._store_read_at < STORE_STATS_INTERVAL_S:
            return
        self._store_read_at = now
        try:
            stats = self.store.stats()
        except Exception:
            return
        for key, name in self._STORE_STATS.items():
            value = int(stats.get(key) or 0)
            gained = value - self._store_seen.get(key, 0)
            self._store_seen[key] = value
            if gained > 0:
                self.counters.add_to((name, ()), gained)

    def get_stats(self) -> OffloadingConnectorStats | None:
        self._poll_store()
        if self.read_ahead is not None:
            ra = self.read_ahead.stats()
            self.counters.add_to((TieredKVTierMetrics.CHUNKS_READ_AHEAD, ()), ra.delivered)
            self.counters.add_to((TieredKVTierMetrics.READ_AHEAD_DROPPED, ()), ra.dropped)
        values = self.counters.take()
        if not values:
            return None
        stats = OffloadingConnectorStats()
        for (name, labels), n in values.items():
            stats.increase_counter(name, n, labels)
        return stats

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return TieredKVTierInfo.config_info_keys()

    def config_info(self) -> ConfigInfoMapping:
        return self._info.as_config_info()

    # ------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Finish the jobs in flight (they touch the primary buffer), then close the store
        and drop the view of the primary buffer, so vLLM can unmap it."""
        self._lookup.shutdown()
        self._pool.shutdown(wait=True)
        if self.read_ahead is not None:
            self.read_ahead.close()
        self.store.close()
        self._rows = None

