"""Drive vLLM 0.33's real tiering machinery over a TieredKVTier, on CPU.

:class:`Engine` builds the real ``TieringOffloadingSpec`` -> ``TieringOffloadingManager``
(CPU primary tier in a ``/dev/shm`` region + our secondary tier, loaded by vLLM's
``SecondaryTierFactory`` from ``type`` + ``module_path``) and makes the calls vLLM's
scheduler-side ``OffloadingConnector`` makes, in its order and under the manager lock:
``on_new_request``, ``prepare_store`` / ``complete_store``, ``lookup`` / ``prepare_load`` /
``complete_load``, ``on_schedule_end`` once per step, ``on_request_finished``.

The one piece played by hand is vLLM's GPU worker (``CPUOffloadingWorker``), which needs
CUDA: it copies GPU blocks into the primary rows that ``prepare_store`` allotted, and out
of the rows ``prepare_load`` names. Here the test writes and reads those rows directly.
"""

from __future__ import annotations

import functools
import hashlib
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tiered_kv.integrations.vllm import TieredKVTier

#: bytes one worker keeps per GPU block, and GPU blocks per offloaded chunk: 12 KiB chunks
WORKER_BYTES_PER_BLOCK = 6144
BLOCKS_PER_CHUNK = 2
CHUNK_BYTES = WORKER_BYTES_PER_BLOCK * BLOCKS_PER_CHUNK
TIER_MODULE = "tiered_kv.integrations.vllm"


def offload_config(tier: dict[str, Any], *, num_chunks: int = 8, model: str = "org/tiny-model",
                   engine_id: str | None = None,
                   worker_bytes_per_block: int = WORKER_BYTES_PER_BLOCK) -> OffloadingConfig:
    """The normalized config vLLM builds from ``--kv-transfer-config`` for one small model;
    ``tier``: the secondary tier's config (a TieredKVTier unless it names another ``type``)."""
    chunk_size = worker_bytes_per_block * BLOCKS_PER_CHUNK
    extra = {"cpu_bytes_to_use": num_chunks * chunk_size, "block_size": 16 * BLOCKS_PER_CHUNK,
             "secondary_tiers": [{"type": "TieredKVTier", "module_path": TIER_MODULE, **tier}]}
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("model.layers.0.self_attn.attn",),
                                      group_id=0),),
        worker_kv_bytes_per_block=worker_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id or f"tkv-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True),
    )


def chunk_keys(seed: str, n: int, group: int = 0) -> list[OffloadKey]:
    """``n`` vLLM offload keys (32-byte block hash + group index)."""
    return [make_offload_key(hashlib.sha256(f"{seed}:{i}".encode()).digest(), group) for i in range(n)]


@functools.lru_cache(maxsize=512)
def chunk_bytes(key: OffloadKey, size: int = CHUNK_BYTES) -> bytes:
    """Deterministic KV bytes of the chunk under ``key``."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(bytes(key)).digest()[:8], "little"))
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


class Engine:
    """One vLLM engine's scheduler-side offloading stack with a TieredKVTier."""

    def __init__(self, store: str | Sequence[str] | None, *, num_chunks: int = 8, model: str = "org/tiny-model",
                 engine_id: str | None = None, worker_bytes_per_block: int = WORKER_BYTES_PER_BLOCK,
                 **tier_options: Any) -> None:
        """``store``: a TieredKVTier's; None with ``type=...`` in ``tier_options`` for
        another tier (benchmarks compare vLLM's own)."""
        if store is not None:
            tier_options = {"store": store, "io_threads": 2, **tier_options}
        self.spec = TieringOffloadingSpec(offload_config(tier_options, num_chunks=num_chunks, model=model,
                                                         engine_id=engine_id,
                                                         worker_bytes_per_block=worker_bytes_per_block))
        self.chunk_size = worker_bytes_per_block * BLOCKS_PER_CHUNK
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, TieredKVTier) or store is None
        self.tier: TieredKVTier = tier  # type: ignore[assignment]
        self.stats: dict[str, float] = {}
        self.closed = False
        self._next_req = 0

    # ----------------------------------------------------------- the scheduler's calls
    def _request(self) -> ReqContext:
        self._next_req += 1
        ctx = ReqContext(req_id=f"req-{self._next_req}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def step(self, *new_req_ids: str) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext(new_req_ids, ()))
        self._collect_stats()

    def store(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """One request offloads ``keys``: GPU -> primary (the worker's copy, by hand here),
        then vLLM cascades them to the secondary tier. Returns the keys newly stored."""
        stored = self.try_store(keys)
        assert stored is not None, "primary tier could not take the chunks"
        return stored

    def try_store(self, keys: Sequence[OffloadKey]) -> list[OffloadKey] | None:
        """:meth:`store`, or None where the primary tier had no free slot (vLLM then skips
        the offload: every slot is pinned by transfers in flight)."""
        ctx = self._request()
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
            if out is not None:
                rows = self._rows()
                for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
                    rows[int(chunk)] = np.frombuffer(chunk_bytes(key, self.chunk_size), dtype=np.uint8)
                del rows
                self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.step(ctx.req_id)
        return None if out is None else list(out.keys_to_store)

    def wait_jobs(self) -> None:
        """Let the tier finish its jobs, then one step so vLLM processes them."""
        self.tier.drain_jobs()
        self.step()
        assert not self.manager.has_pending_work()

    def load(self, keys: Sequence[OffloadKey], timeout_s: float = 30.0) -> dict[OffloadKey, bytes | None]:
        """One request looks ``keys`` up and loads each hit to the "GPU": its bytes, or
        None where vLLM answered MISS (recompute)."""
        ctx = self._request()
        pending = list(keys)
        got: dict[OffloadKey, bytes | None] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            assert time.monotonic() < deadline, f"lookups still pending after {timeout_s}s"
            with self.manager.lock:
                for key in list(pending):
                    result = self.manager.lookup(key, ctx)
                    if result is LookupResult.HIT:
                        spec = self.manager.prepare_load([key], ctx)
                        rows = self._rows()
                        got[key] = rows[int(spec.block_ids[0])].tobytes()
                        del rows
                        self.manager.complete_load([key], ctx)
                    elif result is LookupResult.MISS:
                        got[key] = None
                    else:
                        continue
                    pending.remove(key)
            if pending:
                self.step()         # still waiting: not scheduled yet
                self.tier.drain_jobs()
                time.sleep(0.002)   # the lookup thread answers between steps
        self.step(ctx.req_id)       # every chunk resolved: the request is scheduled
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        return got

    def primary_holds(self, key: OffloadKey) -> bool:
        with self.manager.lock:
            return self.manager.primary_tier.lookup(key, ReqContext(req_id="probe")) is LookupResult.HIT

    def close(self) -> None:
        """vLLM's shutdown: the tier finishes its jobs and closes the store, then the
        primary region is unmapped."""
        if not self.closed:
            self._collect_stats()
            self.manager.shutdown()
            self.closed = True

    # ----------------------------------------------------------- helpers
    def _rows(self) -> np.ndarray:
        """``[num_chunks, CHUNK_BYTES] uint8`` over the primary tier's shared buffer."""
        return np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    def _collect_stats(self) -> None:
        with self.manager.lock:
            stats = self.manager.get_stats()
        if stats is None:
            return
        for name, value in stats.reduce().items():
            self.stats[name] = self.stats.get(name, 0) + value

    def counter(self, name: str, *labels: str) -> float:
        """A counter summed over this engine's life (``name`` without the ``vllm:`` prefix)."""
        key = f"vllm:{name}" + (f":{labels!r}" if labels else "")
        return self.stats.get(key, 0)

    @property
    def region(self) -> str:
        """The /dev/shm file of this engine's primary tier (vLLM's SharedOffloadRegion)."""
        return f"/dev/shm/vllm_offload_{self.spec.config.engine_id}.mmap"

