"""bench/disk.py's driver for LMCache's local-disk backend (run by ``.venv-lmcache/bin/python``).

What it drives, all LMCache 0.5.6's own code, set up as its storage manager sets it up for a
config with ``local_disk`` (``lmcache.v1.storage_backend.CreateStorageBackends``): an asyncio
event loop on a thread of its own, a ``LocalCPUBackend`` whose memory allocator (LMCache's
choice for the config and metadata) holds every block written and read, and a
``LocalDiskBackend`` (fresh, over a fresh directory, each round) with LMCache's default
settings. Its own calls, as LMCache's storage manager makes them:

    write      ``batched_submit_put_task(keys, memory_objs, on_complete_callback=...)``, one
               call per batch of blocks, until every block's completion callback has run
               (the callback runs once the block's file is written and indexed)
    read       ``batched_get_blocking(keys)``, one call per batch (LMCache reads a batch
               with its pool of disk threads into memory objects from the allocator); every
               object of a pass is held until the pass ends, so the destination is the size
               of the data, as in a restore

Every block is a memory object of shape ``[1, 1, 1, payload_bytes]`` uint8 (``KV_MLA_FMT``,
DeepSeek's MLA format) and one file. What a write guarantees (read from
``local_disk_backend.py``): a buffered ``open(path, "wb").write``, no fsync, no checksum, the
byte count of a read not checked; the index of the files is kept in memory only, so a
restarted process does not find them again.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_common import batches, check_equal, cold_pass, hot_pass, round_figures, serve, timed  # noqa: E402

#: head-room in the allocator over the data: its objects are aligned and it keeps some back
POOL_SLACK = 1.25
GIB = 1 << 30


class LmcacheLocalDisk:
    """LMCache's CPU allocator over the workload plus a fresh LocalDiskBackend per round."""

    def __init__(self, args: argparse.Namespace, payloads: np.ndarray, workdir: Path) -> None:
        import lmcache
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        self._torch, self._disk_cls, self._config_cls = torch, LocalDiskBackend, LMCacheEngineConfig
        self.payloads, self.workdir, self.batch = payloads, workdir, args.batch
        n, size = payloads.shape
        self.shape, self.dtype, self.fmt = torch.Size([1, 1, 1, size]), torch.uint8, MemoryFormat.KV_MLA_FMT
        self.data_gib = n * size / GIB
        self.rounds = 0
        self.config = self._config(workdir / "round-0")
        metadata = LMCacheMetadata(model_name="bench/deepseek-v4-flash", world_size=1, local_world_size=1,
                                   worker_id=0, local_worker_id=0, kv_dtype=torch.uint8,
                                   kv_shape=(1, 1, 1, 1, size), use_mla=True)
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self.loop_thread.start()
        self.cpu = LocalCPUBackend(self.config, metadata, dst_device="cpu")
        self.keys = [CacheEngineKey("bench/deepseek-v4-flash", 1, 0,
                                    int.from_bytes(hashlib.sha256(i.to_bytes(8, "little")).digest()[:8], "little"),
                                    torch.uint8) for i in range(n)]
        probe = self._new_disk()
        try:
            threads, o_direct = probe._read_thread_pool._max_workers, probe.use_odirect
        finally:
            self._close_disk(probe)
        self.info: dict[str, Any] = {
            "peer": "lmcache_disk", "label": f"LMCache {lmcache.__version__} local disk",
            "version": lmcache.__version__,
            "durability": ("O_DIRECT" if o_direct else "buffered") + " write, no fsync, no checksum, "
                          "index in memory only",
            "settings": {"disk_io_threads": threads, "use_odirect": o_direct,
                         "allocator": type(self.cpu.memory_allocator).__name__,
                         "memory_obj": {"shape": list(self.shape), "dtype": "uint8", "fmt": self.fmt.name},
                         "blocks_per_call": self.batch},
        }

    def _config(self, directory: Path):  # -> LMCacheEngineConfig
        return self._config_cls.from_defaults(
            chunk_size=256, local_cpu=False, max_local_cpu_size=self.data_gib * POOL_SLACK + 0.01,
            local_disk=str(directory), max_local_disk_size=self.data_gib * 2 + 0.01,
            lmcache_instance_id="tkv-bench")

    # ----------------------------------------------------------- the backend's own calls
    def _new_disk(self):  # -> LocalDiskBackend
        directory = self.workdir / f"round-{self.rounds}"
        directory.mkdir(parents=True)
        return self._disk_cls(self._config(directory), self.loop, self.cpu, dst_device="cpu")

    def _close_disk(self, disk) -> None:
        disk.close()
        shutil.rmtree(self.workdir / f"round-{self.rounds}", ignore_errors=True)
        self.rounds += 1

    def _allocate(self) -> list:
        objs = [self.cpu.allocate(self.shape, self.dtype, self.fmt) for _ in self.keys]
        if any(o is None for o in objs):
            for o in objs:
                if o is not None:
                    o.ref_count_down()
            raise RuntimeError("LMCache's CPU allocator could not hold the workload")
        return objs

    def _release(self, objs: list) -> None:
        """Zero the objects, then hand them back: the next pass cannot find the bytes there."""
        for o in objs:
            o.tensor.zero_()
            o.ref_count_down()

    def _write(self, disk, objs: list) -> None:
        done = threading.Semaphore(0)
        for r in batches(len(self.keys), self.batch):
            disk.batched_submit_put_task(self.keys[r.start:r.stop], objs[r.start:r.stop],
                                         on_complete_callback=lambda key: done.release())
        for _ in self.keys:
            if not done.acquire(timeout=600):
                raise RuntimeError("LMCache local disk: a put did not complete in 600 s")

    def _read(self, disk) -> list:
        objs: list = []
        for r in batches(len(self.keys), self.batch):
            objs.extend(disk.batched_get_blocking(self.keys[r.start:r.stop]))
        return objs

    def round(self) -> dict[str, Any]:
        n, size = self.payloads.shape
        src = self._allocate()
        for o, p in zip(src, self.payloads):
            o.tensor.view(-1).copy_(self._torch.from_numpy(p))
        disk = self._new_disk()
        try:
            try:
                write_s = timed(lambda: self._write(disk, src))
            finally:
                self._release(src)
            files = self.workdir / f"round-{self.rounds}"

            def read_all() -> float:
                got: list = []
                try:
                    seconds = timed(lambda: got.extend(self._read(disk)))
                    if len(got) != n or any(o is None for o in got):
                        raise RuntimeError("LMCache local disk: a stored block was a miss")
                    for i, o in enumerate(got):
                        check_equal(o.tensor.view(-1).numpy(), self.payloads[i], "LMCache local disk")
                    return seconds
                finally:
                    self._release([o for o in got if o is not None])

            cold = cold_pass(files, read_all)
            hot = hot_pass(files, read_all)
        finally:
            self._close_disk(disk)
        return round_figures(n * size, write_s, cold, hot)

    def close(self) -> None:
        self.cpu.memory_allocator.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)


if __name__ == "__main__":
    raise SystemExit(serve(LmcacheLocalDisk))
