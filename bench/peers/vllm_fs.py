"""bench/disk.py's driver for vLLM's FS offloading tier (run by ``.venv-vllm/bin/python``).

What it drives, all vLLM 0.33's own code: ``TieringOffloadingSpec`` (the spec vLLM builds
from ``--kv-transfer-config``) makes the CPU primary tier, whose shared-memory region of
``records`` chunks is the tier's source and destination, as in vLLM; each round then makes a
fresh ``fs`` secondary tier over a fresh directory through ``SecondaryTierFactory``, from the
config a user writes (``{"type": "fs", "root_dir": ...}``, vLLM's default thread counts), and
calls the tier's own API the way vLLM's tiering manager does:

    write      ``submit_store(TransferJob)``, one job per batch of blocks, all in flight at
               once (a cascade from the primary tier), until ``drain_jobs()`` returns and
               ``get_finished_jobs()`` reports every job successful
    read       ``submit_load(TransferJob)`` (promotions) into the primary region, likewise

Each file holds one block. vLLM asserts that a chunk is a whole number of pages, so a
492,832-byte Flash block occupies a 495,616-byte chunk (the tier also writes with O_DIRECT,
which refuses lengths that are not so aligned); figures count the payload bytes, as for
every contender. What a write guarantees (read from vLLM's tiering/fs/io.py): a temp file
renamed into place, written with O_DIRECT where the filesystem allows it, no fsync of the
file or its directory, no checksum (a short file is caught on read, wrong bytes are not).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import mmap
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_common import batches, check_equal, cold_pass, hot_pass, round_figures, serve, timed  # noqa: E402

#: the tier config a user puts in ``kv_connector_extra_config["secondary_tiers"]``
TIER_CONFIG = {"type": "fs"}


class VllmFsTier:
    """vLLM's primary region over the workload plus a fresh ``fs`` tier per round."""

    def __init__(self, args: argparse.Namespace, payloads: np.ndarray, workdir: Path) -> None:
        import vllm
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self._factory, self._job = SecondaryTierFactory, TransferJob
        self.payloads, self.workdir, self.batch = payloads, workdir, args.batch
        n, size = payloads.shape
        self.chunk = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE  # vLLM: a chunk is whole pages
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=128, layer_names=("model.layers.0.self_attn.attn",),
                                          group_id=0),),
            worker_kv_bytes_per_block=self.chunk,
            enable_kv_cache_events=False,
            extra_config={"cpu_bytes_to_use": n * self.chunk, "block_size": 128, "secondary_tiers": []},
            engine_id=f"tkv-bench-{uuid.uuid4().hex[:12]}",
            model=OffloadingModelConfig(name="bench/deepseek-v4-flash", dtype="fp8", max_model_len=1 << 20),
            cache=OffloadingCacheConfig(tokens_per_hash=128, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=True),
        )
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.view = self.manager.primary_tier.get_kv_memoryview()
        #: ``[records, chunk] uint8`` over vLLM's primary region: the source and the destination
        self.rows = np.asarray(self.view).view(np.uint8)
        if self.rows.shape != (n, self.chunk):
            raise RuntimeError(f"primary region: expected {(n, self.chunk)} rows, got {self.rows.shape}")
        self.rows.fill(0)  # fault the region in: no first touch inside a timed pass
        self.keys = [make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0) for i in range(n)]
        self.ctx = ReqContext(req_id="tkv-bench")
        self.job_ids = itertools.count(1)
        self.rounds = 0
        probe = self._new_tier()
        try:
            o_direct, threads = probe._use_o_direct, len(probe._pool._threads)
        finally:
            self._close_tier(probe)
        self.info: dict[str, Any] = {
            "peer": "vllm_fs", "label": f"vLLM {vllm.__version__} FS tier", "version": vllm.__version__,
            "durability": ("O_DIRECT" if o_direct else "buffered (O_DIRECT refused here)")
                          + " write to a temp file + rename, no fsync, no checksum",
            "settings": {"tier_config": TIER_CONFIG, "io_threads": threads, "o_direct": o_direct,
                         "chunk_bytes": self.chunk, "payload_bytes": size, "blocks_per_job": self.batch,
                         "native_io": fs_io._HAS_FSIO_C},
            "note": f"each block in a {self.chunk:,} B chunk (vLLM: whole pages); "
                    + ("reads with O_DIRECT too, so its hot read is a disk read; " if o_direct else "")
                    + ("its C I/O helper ran" if fs_io._HAS_FSIO_C else
                       "its pure-Python I/O path ran (vLLM's fs_io_C links CUDA torch)"),
        }

    # ----------------------------------------------------------- the tier's own calls
    def _new_tier(self):  # -> FileSystemTierManager
        root = self.workdir / f"round-{self.rounds}"
        root.mkdir(parents=True)
        return self._factory.create_secondary_tier(dict(TIER_CONFIG, root_dir=str(root)), self.view, self.spec)

    def _close_tier(self, tier) -> None:
        tier.shutdown()
        shutil.rmtree(self.workdir / f"round-{self.rounds}", ignore_errors=True)
        self.rounds += 1

    def _transfer(self, tier, load: bool) -> None:
        """Every block as one job per batch, all submitted, then waited for."""
        n = len(self.keys)
        jobs = []
        for r in batches(n, self.batch):
            job = self._job(job_id=next(self.job_ids), keys=self.keys[r.start:r.stop],
                            chunk_ids=np.arange(r.start, r.stop, dtype=np.int64), is_promotion=load,
                            req_context=self.ctx)
            (tier.submit_load if load else tier.submit_store)(job)
            jobs.append(job.job_id)
        tier.drain_jobs()
        done = {r.job_id: r.success for r in tier.get_finished_jobs()}
        if sorted(done) != jobs or not all(done.values()):
            failed = [j for j in jobs if not done.get(j)]
            raise RuntimeError(f"vLLM fs tier: {'load' if load else 'store'} jobs failed or missing: {failed}")

    def round(self) -> dict[str, Any]:
        n, size = self.payloads.shape
        self.rows[:, :size] = self.payloads
        self.rows[:, size:] = 0
        tier = self._new_tier()
        try:
            write_s = timed(lambda: self._transfer(tier, load=False))
            files = self.workdir / f"round-{self.rounds}"

            def read_all() -> float:
                self.rows.fill(0)
                seconds = timed(lambda: self._transfer(tier, load=True))
                check_equal(self.rows[:, :size], self.payloads, "vLLM fs tier")
                return seconds

            cold = cold_pass(files, read_all)
            hot = hot_pass(files, read_all)
        finally:
            self._close_tier(tier)
        return round_figures(n * size, write_s, cold, hot)

    def close(self) -> None:
        del self.rows  # the region's memoryview is released by the manager's shutdown
        self.manager.shutdown()


if __name__ == "__main__":
    raise SystemExit(serve(VllmFsTier))
