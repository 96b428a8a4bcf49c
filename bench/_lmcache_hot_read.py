"""LMCache 0.5.6's local disk backend, hot reads: the peer side of ``bench/hot_read.py``.

Runs in a venv of its own with ``lmcache==0.5.6`` (``make venv-lmcache``), never imports
tiered_kv, and prints one JSON line. The same payloads as the parent (``--records`` random
``--payload-bytes`` payloads from numpy's ``default_rng(0)``) are put through
``LocalDiskBackend.submit_put_task`` (one file per chunk, no fsync, no checksum), the
backend's files are read once so the page cache holds them, then every round reads every
chunk back with ``batched_get_blocking`` in batches of ``--batch`` (LMCache's parallel
read path: its ``disk_io_threads`` = 4 threads, one ``readinto`` per file into memory
objects of its own CPU allocator, sized here to the data plus a margin). Rounds alternate
two arenas: "written", the one the puts wrote (as a running server's pinned arena is), and
"fresh", a new one per round (its pages fault on first write); and two lifetimes: every
object of the round held until it ends (a destination the size of the data, as the
store's: the figures compared), or ("_reused") each batch's objects freed once read, as a
restore that copies them to the GPU frees them: the allocator (address-ordered first fit)
then hands the same batch-sized memory to every batch, which stays in the CPU's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.mixed_memory_allocator import MixedMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

GiB = 1024 ** 3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, required=True)
    ap.add_argument("--payload-bytes", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dir", type=Path, required=True)
    args = ap.parse_args()
    n, nbytes = args.records, args.payload_bytes
    if nbytes % 2:
        raise SystemExit("--payload-bytes: expected an even number (chunks are [2, 1, 1, bytes/2] uint8)")
    shutil.rmtree(args.dir, ignore_errors=True)
    total = n * nbytes
    arena = int(total * 1.25) + (64 << 20)
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, max_local_cpu_size=arena / GiB,
                                            local_disk=f"file://{args.dir}", max_local_disk_size=2 * total / GiB)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    cpu = LocalCPUBackend(cfg, memory_allocator=MixedMemoryAllocator(arena))
    disk = LocalDiskBackend(cfg, loop, cpu)
    shape = torch.Size([2, 1, 1, nbytes // 2])
    keys = [CacheEngineKey("tkv-bench", 1, 0, i, torch.uint8) for i in range(n)]
    rng = np.random.default_rng(0)
    stored = threading.Semaphore(0)
    samples = sorted({0, n // 2, n - 1})
    expected = {}
    try:
        for i, key in enumerate(keys):
            payload = rng.integers(0, 256, nbytes, dtype=np.uint8)
            if i in samples:
                expected[i] = payload
            obj = cpu.allocate(shape, torch.uint8, MemoryFormat.KV_2LTD)
            obj.tensor.view(-1).copy_(torch.from_numpy(payload))
            disk.submit_put_task(key, obj, on_complete_callback=lambda _k: stored.release())
            obj.ref_count_down()
        for _ in keys:
            if not stored.acquire(timeout=600):
                raise SystemExit("LMCache: a put did not complete")
        # held: every object of a round is kept until the round ends, so the reads fill a
        # destination the size of the data, as the store's do (the target); reused: each
        # batch's objects are freed once read, so the allocator (address-ordered first fit)
        # hands the same ~batch-sized memory to the next batch, which stays in CPU cache
        times: dict[str, list[float]] = {kind: [] for kind in ("written", "fresh", "written_reused", "fresh_reused")}
        files = [Path(d) / f for d, _, fs in os.walk(args.dir) for f in fs]
        for r in range(4 * args.rounds):
            kind = ("written", "fresh", "written_reused", "fresh_reused")[r % 4]
            if kind.startswith("fresh"):  # a new arena: its pages are written first by these reads
                disk.local_cpu_backend = LocalCPUBackend(cfg, memory_allocator=MixedMemoryAllocator(arena))
            else:  # the arena the puts (and earlier reads) wrote, as a running server has it
                disk.local_cpu_backend = cpu
            hold = not kind.endswith("reused")
            buf = bytearray(1 << 20)
            for f in files:  # the page cache holds every chunk file
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass
            held = []
            t = time.perf_counter()
            got = {}
            for a in range(0, n, args.batch):
                objs = disk.batched_get_blocking(keys[a:a + args.batch])
                if any(o is None for o in objs):
                    raise SystemExit("LMCache: a stored chunk was a miss")
                for j, o in enumerate(objs):
                    if a + j in samples:
                        got[a + j] = o.tensor.view(-1).numpy().copy()  # (a few, checked after the clock)
                    if hold:
                        held.append(o)
                    else:
                        o.ref_count_down()
            times[kind].append(time.perf_counter() - t)
            for o in held:
                o.ref_count_down()
            for i, want in expected.items():
                if not np.array_equal(got[i], want):
                    raise SystemExit(f"LMCache: chunk {i} read back wrong")
    finally:
        disk.close()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(timeout=10)
        shutil.rmtree(args.dir, ignore_errors=True)
    gbps = {kind: total / statistics.median(ts) / 1e9 for kind, ts in times.items()}
    print(json.dumps({"hot_read_gbps": gbps, "runs_s": times,
                      "note": "LocalDiskBackend.batched_get_blocking, 4 threads, no checksum"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
