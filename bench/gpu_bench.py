"""GPU benchmarks of the host <-> device paths, for ``bench/gpu_check.sh``.

Layout: DeepSeek-V4-Flash, fp8 entries (block record 492,832 B; CSA entry 584 B).

1. Copy engine against one large memcpy, both directions::

       offload   CopyEngine.offload_blocks(parts, ids, pinned records [n, 492832])  (GPU -> host)
       load      CopyEngine.load_blocks(pinned records, ids, parts)                (host -> GPU)
       memcpy    one dst.copy_(src, non_blocking=True) of the same n * 492,832 bytes
                 between a pinned host tensor and a device tensor (the baseline)

   GB/s = 1e9 bytes/s of record bytes; the engine is timed by its own CUDA events (on its
   side stream), the memcpy by CUDA events on the current stream; ratio = engine / memcpy.

2. HiSparse swap-in of top-512 with 10% and 50% misses (51 and 256 entries) from a
   1M-token host mirror: ``HostTier(...).csa_rows()``, the strided 3-D view
   ``[8192 blocks, 21 * 32 rows, 584 B]`` of pinned block records, into a device buffer
   of 2048 slots (4 x top-k):

       kernels.swap_in(impl="torch") and impl="cuda" (CUDA events around the call; rows
       on the CPU and checked, as HiSparseBuffers passes them), and
       HiSparseBuffers.swap_in end to end (hit detection, LRU victims, the copy), for
       512 ids of which exactly 10% / 50% are not resident.

3. Batched HiSparse swap-in, one CSA layer (``kernels.hisparse_swap_in``, what
   ``cache.swap_in_batch`` runs): B = 1, 8, 32, 64 requests, top-512 each with exactly
   10% / 50% of every row not resident, N = 2048, from the same 1M-token mirror (every
   request maps the same 8192 host records); eager (one launch per call) and replayed
   from a CUDA graph that captured the launch, event and wall time. Plus one whole Flash
   decode step's swap-ins: 21 CSA layers at B = 32, eager and graph-replayed. On the CPU
   (``--device cpu``) the torch implementation at B = 1, 8, 32 against the per-request
   loop it replaced (the pre-batching ``HiSparseBuffers.swap_in``, kept below as the
   baseline).

4. Host cost of building one batched swap-in launch: ``cuda_ops.hisparse_swap_in`` with a
   launcher that launches nothing (``cuda_ops.launcher``), B = 32, k = 512, N = 2048: the
   arguments converted for CuPy each call (``miss``: the conversion cache emptied first)
   and found in the cache keyed on all of their values (``hit``: a decode loop passing the
   same tensors). Runs on the CPU too (``--only launch``).

Every number is the median of ``--repeats`` timed calls after warm-up; wall-clock medians
are reported beside the event times. Results are checked (records, buffer rows) once per
configuration.

    python bench/gpu_bench.py                    # needs CUDA; JSON to $OUT/gpu.json or
                                                 # bench/results/gpu.json
    python bench/gpu_bench.py --device cpu       # dry run of the same code on the CPU
                                                 # (small sizes, torch impl only)
    python bench/gpu_bench.py --device cpu --quick --only batched
                                                 # CPU: batched torch impl vs the old loop
    python bench/gpu_bench.py --device cpu --only launch
                                                 # host cost of the launch's arguments
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    from tiered_kv import kernels, presets
    from tiered_kv.device import cuda_available, empty_host
    from tiered_kv.hisparse import HiSparseBuffers, HiSparseConfig
    from tiered_kv.host import HostTier
    from tiered_kv.kernels import cuda_ops
    from tiered_kv.transfer import CopyEngine
except ImportError as exc:  # e.g. run from a checkout without `pip install -e .`
    sys.exit(f"gpu_bench: cannot import tiered_kv ({exc}); run it through `bash bench/gpu_check.sh` "
             "(which lays the package out from this checkout) or `pip install -e .` first")

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = presets.deepseek_v4_flash()
RECORD_BYTES = LAYOUT.block_bytes  # 492,832
ENTRY_BYTES = LAYOUT.entry_bytes  # 584
TOP_K = LAYOUT.top_k  # 512
BUFFER_ENTRIES = 4 * TOP_K
MISS_FRACTIONS = (0.10, 0.50)


# ------------------------------------------------------------------------ timing
def timed(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2,
          setup: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of ``fn``: CUDA event time (GPU) and wall time, after ``warmup`` calls.

    ``setup`` runs before each call, outside the timed region.
    """
    cuda = device.type == "cuda"
    events, walls = [], []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            end.synchronize()
            wall = time.perf_counter() - t0
            event = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            wall = event = time.perf_counter() - t0
        if i >= warmup:
            events.append(event)
            walls.append(wall)
    return {"event_s": statistics.median(events), "wall_s": statistics.median(walls)}


def engine_timed(submit: Callable[[], Any], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of a CopyEngine copy: the handle's own event latency and wall time
    from submission to completion."""
    lat, walls = [], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        handle = submit()
        handle.wait()
        wall = time.perf_counter() - t0
        if i >= warmup:
            lat.append(handle.latency_s)
            walls.append(wall)
    return {"event_s": statistics.median(lat), "wall_s": statistics.median(walls)}


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# ------------------------------------------------------------ 1. copy engine
def flash_parts(num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    L = LAYOUT
    shapes = [(L.num_csa_layers, num_blocks, L.csa_entries_per_block, L.entry_bytes),
              (L.num_csa_layers, num_blocks, L.csa_entries_per_block, L.indexer_bytes),
              (L.num_hca_layers, num_blocks, L.hca_entries_per_block, L.entry_bytes)]
    parts = [torch.empty(s, dtype=torch.uint8, device=device) for s in shapes]
    for p in parts:
        p.random_(0, 256)
    assert kernels.record_bytes(parts) == RECORD_BYTES
    return parts


def bench_copy_engine(device: torch.device, pool_blocks: int, batches: list[int],
                      repeats: int) -> list[dict[str, Any]]:
    pinned = device.type == "cuda"
    parts = flash_parts(pool_blocks, device)
    engine = CopyEngine(device)
    rows = []
    for n in batches:
        ids = torch.randperm(pool_blocks, generator=torch.Generator().manual_seed(n))[:n]
        records = empty_host((n, RECORD_BYTES), pinned=pinned)
        nbytes = n * RECORD_BYTES
        off = engine_timed(lambda: engine.offload_blocks(parts, ids, records), repeats)
        # the records are the blocks
        for i in (0, n - 1):
            want = torch.cat([p[:, int(ids[i])].reshape(-1) for p in parts]).cpu()
            if not torch.equal(records[i], want):
                raise AssertionError(f"offload_blocks wrote a wrong record (n={n})")
        restored = [torch.zeros_like(p) for p in parts]
        load = engine_timed(lambda: engine.load_blocks(records, ids, restored), repeats)
        if pinned:
            torch.cuda.synchronize(device)
        for got, want in zip(restored, parts):
            if not torch.equal(got[:, ids.to(device)], want[:, ids.to(device)]):
                raise AssertionError(f"load_blocks restored wrong blocks (n={n})")
        del restored
        dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host_buf = empty_host(nbytes, pinned=pinned)
        d2h = timed(lambda: host_buf.copy_(dev_buf, non_blocking=pinned), device, repeats)
        h2d = timed(lambda: dev_buf.copy_(host_buf, non_blocking=pinned), device, repeats)
        del dev_buf, host_buf
        row = {
            "blocks": n, "mbytes": nbytes / 1e6,
            "offload_gbps": _gbps(nbytes, off["event_s"]), "memcpy_d2h_gbps": _gbps(nbytes, d2h["event_s"]),
            "load_gbps": _gbps(nbytes, load["event_s"]), "memcpy_h2d_gbps": _gbps(nbytes, h2d["event_s"]),
            "offload_wall_gbps": _gbps(nbytes, off["wall_s"]), "load_wall_gbps": _gbps(nbytes, load["wall_s"]),
        }
        row["offload_ratio"] = row["offload_gbps"] / row["memcpy_d2h_gbps"]
        row["load_ratio"] = row["load_gbps"] / row["memcpy_h2d_gbps"]
        rows.append(row)
    return rows


# --------------------------------------------------------------- 2. swap-in
class Mirror:
    """A 1M-token Flash host mirror: ``HostTier.csa_rows()`` of pinned block records.

    Entry j of CSA layer c sits in host block ``j // E`` (identity block mapping), row
    ``c * E + j % E`` of the view.
    """

    def __init__(self, device: torch.device, num_blocks: int) -> None:
        self.tier = HostTier(LAYOUT, num_blocks * RECORD_BYTES, device, snapshot_fraction=0.0)
        assert self.tier.num_blocks == num_blocks
        if device.type == "cuda" and not self.tier.pinned:
            raise AssertionError("the host tier of a CUDA device must be pinned")
        _fill_random(self.tier.records, device)
        #: ``[num_blocks, 21 * 32, 584]`` uint8, strided (block stride 492,832)
        self.rows3d = self.tier.csa_rows()
        self.num_entries = num_blocks * LAYOUT.csa_entries_per_block

    def host_rows(self, part: int, entry_ids: torch.Tensor) -> torch.Tensor:
        E = LAYOUT.csa_entries_per_block
        return (entry_ids // E) * (LAYOUT.num_csa_layers * E) + part * E + entry_ids % E

    def gather(self, host_rows: torch.Tensor) -> torch.Tensor:
        rpb = self.rows3d.shape[1]
        return self.rows3d[host_rows // rpb, host_rows % rpb]


def _fill_random(records: torch.Tensor, device: torch.device, chunk_rows: int = 1024) -> None:
    """Random bytes into host records, generated on ``device`` in chunks."""
    for r0 in range(0, records.shape[0], chunk_rows):
        dst = records[r0:r0 + chunk_rows]
        src = torch.empty(dst.shape, dtype=torch.uint8, device=device).random_(0, 256)
        dst.copy_(src)


def bench_swap_in_kernel(mirror: Mirror, device: torch.device, impls: list[str],
                         repeats: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    buffer = torch.zeros(BUFFER_ENTRIES, ENTRY_BYTES, dtype=torch.uint8, device=device)
    rows = []
    for impl in impls:
        for frac in MISS_FRACTIONS:
            m = round(frac * TOP_K)
            part = 5
            ids = torch.randperm(mirror.num_entries, generator=g)[:m]
            host_rows = mirror.host_rows(part, ids)
            slots = torch.randperm(BUFFER_ENTRIES, generator=g)[:m].to(device)

            def call() -> None:
                kernels.swap_in(mirror.rows3d, host_rows, buffer, slots, impl=impl)

            t = timed(call, device, repeats, warmup=3)  # warm-up compiles the CUDA kernel
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if not torch.equal(buffer[slots].cpu(), mirror.gather(host_rows)):
                raise AssertionError(f"swap_in(impl={impl!r}) copied wrong rows")
            rows.append({"impl": impl, "miss_fraction": frac, "misses": m, "bytes": m * ENTRY_BYTES,
                         "event_us": t["event_s"] * 1e6, "wall_us": t["wall_s"] * 1e6,
                         "gbps": _gbps(m * ENTRY_BYTES, t["event_s"])})
    return rows


def bench_hisparse_e2e(mirror: Mirror, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """HiSparseBuffers.swap_in of 512 ids with exactly ``frac`` of them not resident."""
    g = torch.Generator().manual_seed(2)
    hs = HiSparseBuffers(LAYOUT, HiSparseConfig(device_buffer_entries=BUFFER_ENTRIES), 1, device)
    part = 7
    # fill the buffer: 4 disjoint top-512 sets
    warm = torch.randperm(mirror.num_entries, generator=g)[:BUFFER_ENTRIES]
    for chunk in warm.split(TOP_K):
        ids = chunk.sort().values
        hs.swap_in(0, part, ids, mirror.host_rows(part, ids), mirror.rows3d)
    rows = []
    for frac in MISS_FRACTIONS:
        m = round(frac * TOP_K)
        state: dict[str, torch.Tensor] = {}

        def setup() -> None:
            resident = hs.entry_of_slot[0, part].cpu()
            resident = resident[resident >= 0]
            hit = resident[torch.randperm(resident.numel(), generator=g)[:TOP_K - m]]
            out = torch.ones(mirror.num_entries, dtype=torch.bool)
            out[resident] = False
            candidates = out.nonzero().flatten()
            miss = candidates[torch.randperm(candidates.numel(), generator=g)[:m]]
            ids = torch.cat([hit, miss]).sort().values
            state.update(ids=ids, rows=mirror.host_rows(part, ids))

        def call() -> None:
            state["slots"] = hs.swap_in(0, part, state["ids"], state["rows"], mirror.rows3d)

        misses_before = hs.misses
        calls = 3 + repeats
        t = timed(call, device, repeats, warmup=3, setup=setup)
        if hs.misses - misses_before != calls * m:
            raise AssertionError(f"HiSparseBuffers counted {hs.misses - misses_before} misses, "
                                 f"expected {calls} calls x {m}")
        got = hs.read(0, part, state["slots"]).cpu()
        if not torch.equal(got, mirror.gather(state["rows"])):
            raise AssertionError("HiSparseBuffers.swap_in left wrong entries in the buffer")
        impl = "cuda" if cuda_ops.unsupported_reason(host=mirror.rows3d, buffer=hs.buffer[0, part]) is None \
            else "torch"
        rows.append({"miss_fraction": frac, "ids": TOP_K, "misses": m, "impl": impl,
                     "event_us": t["event_s"] * 1e6, "wall_us": t["wall_s"] * 1e6})
    return rows


# ------------------------------------------------------- 3. batched swap-in
def legacy_swap_in(hs: HiSparseBuffers, legacy: dict[str, Any], slot: int, part: int, ids: torch.Tensor,
                   host_rows: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """The per-request swap-in as it was before batching (the baseline): data-dependent
    shapes (``nonzero``), a host sync per call on a GPU, one call per request."""
    eos = legacy["eos"][slot, part]
    last = legacy["last"][slot, part]
    legacy["step"] += 1
    match = eos[None, :] == ids[:, None]  # [k, N]
    hit = match.any(1)
    slots = match.to(torch.int8).argmax(1)
    miss = (~hit).nonzero().flatten()
    if miss.numel():
        score = last.masked_fill(match.any(0), torch.iinfo(torch.int64).max)
        victims = torch.sort(score, stable=True).indices[:miss.numel()]
        kernels.swap_in(host, host_rows.to(host.device)[miss.to(host_rows.device)], hs.buffer[slot, part], victims)
        eos[victims] = ids[miss]
        slots[miss] = victims
    last[slots] = legacy["step"]
    return slots


class BatchedWorkload:
    """B requests (State slots 0..B-1) with full buffers; each step's ids have exactly
    ``m`` entries per row that are not resident (fresh ids: never seen before) and
    ``top_k - m`` resident ones."""

    def __init__(self, mirror: Mirror, device: torch.device, B: int, n_parts: int, seed: int) -> None:
        self.B, self.device, self.mirror = B, device, mirror
        E = LAYOUT.csa_entries_per_block
        self.hs = HiSparseBuffers(LAYOUT, HiSparseConfig(device_buffer_entries=BUFFER_ENTRIES), B, device,
                                  max_blocks=mirror.tier.num_blocks)
        self.hs.host_block.copy_(torch.arange(mirror.tier.num_blocks).expand(B, -1))  # identity mapping
        self.g = torch.Generator().manual_seed(seed)
        self.order = torch.stack([torch.randperm(mirror.num_entries, generator=self.g) for _ in range(B)])
        self.next = torch.zeros(B, dtype=torch.int64)
        self.slots = torch.arange(B, device=device)
        self.ids = torch.full((B, TOP_K), -1, dtype=torch.int64, device=device)  # static (graphs)
        self.out = torch.empty(B, TOP_K, dtype=torch.int64, device=device)
        self.n_parts = n_parts
        for part in range(n_parts):  # fill the buffers: N / top_k all-miss steps
            for _ in range(BUFFER_ENTRIES // TOP_K):
                self.next_ids(part, TOP_K)
                self.call(part, "torch" if device.type == "cpu" else "auto")
        E  # noqa: B018 (entries per block documented in Mirror)

    def fresh(self, m: int) -> torch.Tensor:
        idx = (self.next[:, None] + torch.arange(m)) % self.order.shape[1]
        self.next += m
        return self.order.gather(1, idx)

    def next_ids(self, part: int, m: int) -> torch.Tensor:
        """Write the next step's ids into the static ``ids`` (outside any timed region)."""
        resident = self.hs.entry_of_slot[:, part].cpu()  # [B, N], full after warm-up
        pick = torch.rand(resident.shape, generator=self.g).argsort(1)[:, :TOP_K - m]
        hits = resident.gather(1, pick)
        ids = torch.cat([hits, self.fresh(m)], 1)
        ids = ids.gather(1, torch.rand(ids.shape, generator=self.g).argsort(1))
        self.ids.copy_(ids)
        return ids

    def call(self, part: int, impl: str = "auto") -> None:
        kernels.hisparse_swap_in(self.hs.tables, self.slots, part, self.ids, self.mirror.rows3d, out=self.out,
                                 impl=impl)

    def check(self, part: int, ids: torch.Tensor) -> None:
        got = self.hs.buffer[self.slots[:, None], part, self.out].cpu()
        E = LAYOUT.csa_entries_per_block
        want = self.mirror.rows3d[ids // E, part * E + ids % E]
        if not torch.equal(got, want):
            raise AssertionError("hisparse_swap_in left wrong entries in the buffer")


def bench_batched(mirror: Mirror, device: torch.device, batches: list[int], repeats: int,
                  impl: str) -> list[dict[str, Any]]:
    rows = []
    for B in batches:
        work = BatchedWorkload(mirror, device, B, 1, seed=B)
        for frac in MISS_FRACTIONS:
            m = round(frac * TOP_K)
            misses0 = int(work.hs.counters[1])
            t = timed(lambda: work.call(0, impl), device, repeats, setup=lambda: work.next_ids(0, m))
            calls = 2 + repeats
            if int(work.hs.counters[1]) - misses0 != calls * B * m:
                raise AssertionError(f"B={B}: {int(work.hs.counters[1]) - misses0} misses, expected {calls * B * m}")
            ids = work.next_ids(0, m)
            work.call(0, impl)
            work.check(0, ids)
            row = {"B": B, "miss_fraction": frac, "misses_per_request": m, "impl": impl,
                   "eager_event_us": t["event_s"] * 1e6, "eager_wall_us": t["wall_s"] * 1e6}
            if device.type == "cuda":
                graph = capture(lambda: work.call(0, impl), device)
                g = timed(graph.replay, device, repeats, setup=lambda: work.next_ids(0, m))
                ids = work.next_ids(0, m)
                graph.replay()
                work.check(0, ids)
                row.update(graph_event_us=g["event_s"] * 1e6, graph_wall_us=g["wall_s"] * 1e6)
            else:  # the per-request loop it replaced, on the same state
                legacy = {"eos": work.hs.entry_of_slot.clone(), "last": work.hs.last_used.clone(), "step": 10 ** 6}
                E = LAYOUT.csa_entries_per_block
                state: dict[str, torch.Tensor] = {}

                def setup() -> None:
                    state["ids"] = work.next_ids(0, m)
                    legacy["eos"].copy_(work.hs.entry_of_slot)

                def loop() -> None:
                    ids = state["ids"]
                    for b in range(B):
                        rows_b = ids[b] // E * (LAYOUT.num_csa_layers * E) + ids[b] % E
                        legacy_swap_in(work.hs, legacy, b, 0, ids[b], rows_b, mirror.rows3d)

                base = timed(loop, device, repeats, setup=setup)
                row.update(loop_wall_us=base["wall_s"] * 1e6, speedup=base["wall_s"] / t["wall_s"])
            rows.append(row)
    return rows


def capture(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``fn`` (warmed up on a side stream first, as torch requires)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_decode_step(mirror: Mirror, device: torch.device, B: int, repeats: int) -> dict[str, Any]:
    """Every CSA layer's swap-in of one Flash decode step (21 launches), 10% misses."""
    work = BatchedWorkload(mirror, device, B, LAYOUT.num_csa_layers, seed=99)
    m = round(0.10 * TOP_K)
    step_ids: list[torch.Tensor] = []
    ids_per_part = [torch.full((B, TOP_K), -1, dtype=torch.int64, device=device)
                    for _ in range(LAYOUT.num_csa_layers)]

    def setup() -> None:
        for part, buf in enumerate(ids_per_part):
            buf.copy_(work.next_ids(part, m))

    def step() -> None:
        for part, buf in enumerate(ids_per_part):
            kernels.hisparse_swap_in(work.hs.tables, work.slots, part, buf, mirror.rows3d, out=work.out)

    eager = timed(step, device, repeats, setup=setup)
    graph = capture(step, device)
    replay = timed(graph.replay, device, repeats, setup=setup)
    step_ids.clear()
    return {"layers": LAYOUT.num_csa_layers, "B": B, "miss_fraction": 0.10,
            "eager_event_us": eager["event_s"] * 1e6, "eager_wall_us": eager["wall_s"] * 1e6,
            "graph_event_us": replay["event_s"] * 1e6, "graph_wall_us": replay["wall_s"] * 1e6}


# ------------------------------------------------ 4. launch argument building (host)
def bench_launch_host(device: torch.device, repeats: int, calls: int = 2000) -> dict[str, Any]:
    """Microseconds of host time per ``cuda_ops.hisparse_swap_in`` call, kernel not launched."""
    B, C, N, k = 32, 1, BUFFER_ENTRIES, TOP_K
    S = B
    tables = kernels.HiSparseTables(
        buffer_rows=torch.empty(S * C * N + 1, ENTRY_BYTES, dtype=torch.uint8, device=device),
        entry_of_slot=torch.full((S, C, N), -1, dtype=torch.int64, device=device),
        last_used=torch.full((S, C, N), -1, dtype=torch.int64, device=device),
        lru=torch.arange(N, device=device).repeat(S, C, 1), step=torch.zeros(S, C, dtype=torch.int64, device=device),
        host_block=torch.zeros(S, 64, dtype=torch.int64, device=device),
        counters=torch.zeros(2, dtype=torch.int64, device=device), entries_per_block=LAYOUT.csa_entries_per_block)
    host = torch.empty(64, C * LAYOUT.csa_entries_per_block, ENTRY_BYTES, dtype=torch.uint8, device=device)
    slots = torch.arange(B, device=device)
    ids = torch.zeros(B, k, dtype=torch.int64, device=device)
    out = torch.empty(B, k, dtype=torch.int64, device=device)

    def nothing(*args: Any) -> None:
        return None

    def call() -> None:
        cuda_ops.hisparse_swap_in(tables, slots, 0, ids, host, None, out)

    def per_call(empty_cache: bool) -> float:
        runs = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            for _ in range(calls):
                if empty_cache:
                    cuda_ops._HISPARSE_ARGS.clear()
                call()
            if i:  # the first round warms up
                runs.append((time.perf_counter() - t0) / calls)
        return statistics.median(runs) * 1e6

    with cuda_ops.launcher(nothing):
        miss, hit = per_call(True), per_call(False)
    return {"B": B, "k": k, "N": N, "calls": calls, "miss_us": miss, "hit_us": hit, "hit_over_miss": hit / miss}


def plot(result: dict[str, Any], path: Path) -> str:
    """PNG of the batched swap-in (us per CSA layer vs B); returns what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for frac in MISS_FRACTIONS:
        rows = [r for r in result["batched"] if r["miss_fraction"] == frac]
        Bs = [r["B"] for r in rows]
        ax.plot(Bs, [r["eager_wall_us"] for r in rows], "o-", label=f"eager wall, {frac:.0%} misses")
        if rows and "graph_wall_us" in rows[0]:
            ax.plot(Bs, [r["graph_wall_us"] for r in rows], "s--", label=f"graph replay wall, {frac:.0%} misses")
        if rows and "loop_wall_us" in rows[0]:
            ax.plot(Bs, [r["loop_wall_us"] for r in rows], "x:", label=f"per-request loop (old), {frac:.0%}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests in the batch (B)")
    ax.set_ylabel("us per CSA layer")
    ax.set_title(f"batched HiSparse swap-in, top-{TOP_K}, N = {BUFFER_ENTRIES} ({result['device']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


# ------------------------------------------------------------------ report
def print_tables(result: dict[str, Any]) -> None:
    if not result["copy_engine"]:  # --only batched
        print_batched(result)
        return
    print("\n1. copy engine vs one memcpy (Flash block records, 492,832 B each; GB/s = 1e9 B/s, event-timed medians)")
    print(f"{'blocks':>6} {'MB':>8} {'offload':>8} {'memcpy d2h':>10} {'ratio':>6} "
          f"{'load':>8} {'memcpy h2d':>10} {'ratio':>6}")
    for r in result["copy_engine"]:
        print(f"{r['blocks']:>6} {r['mbytes']:>8.1f} {r['offload_gbps']:>8.2f} {r['memcpy_d2h_gbps']:>10.2f} "
              f"{r['offload_ratio']:>6.2f} {r['load_gbps']:>8.2f} {r['memcpy_h2d_gbps']:>10.2f} {r['load_ratio']:>6.2f}")
    print(f"\n2a. kernels.swap_in, top-{TOP_K} misses from the strided host mirror (median of {result['repeats']})")
    print(f"{'impl':<6} {'miss %':>6} {'entries':>7} {'KB':>7} {'event us':>9} {'wall us':>8} {'GB/s':>7}")
    for r in result["swap_in_kernel"]:
        print(f"{r['impl']:<6} {100 * r['miss_fraction']:>6.0f} {r['misses']:>7} {r['bytes'] / 1e3:>7.1f} "
              f"{r['event_us']:>9.1f} {r['wall_us']:>8.1f} {r['gbps']:>7.2f}")
    for impl, why in result["swap_in_skipped"].items():
        print(f"{impl:<6} skipped: {why}")
    print(f"\n2b. HiSparseBuffers.swap_in end to end, {TOP_K} ids, N = {BUFFER_ENTRIES} (median of {result['repeats']})")
    print(f"{'impl':<6} {'miss %':>6} {'misses':>6} {'event us':>9} {'wall us':>8}")
    for r in result["hisparse_e2e"]:
        print(f"{r['impl']:<6} {100 * r['miss_fraction']:>6.0f} {r['misses']:>6} {r['event_us']:>9.1f} {r['wall_us']:>8.1f}")
    print_batched(result)


def print_batched(result: dict[str, Any]) -> None:
    rows = result.get("batched", [])
    if not rows:
        return
    print(f"\n3. batched swap-in per CSA layer (kernels.hisparse_swap_in = cache.swap_in_batch), top-{TOP_K}, "
          f"N = {BUFFER_ENTRIES}, median of {result['repeats']}")
    graphs = "graph_wall_us" in rows[0]
    extra = f"{'graph ev us':>11} {'graph wall us':>13}" if graphs else f"{'old loop us':>11} {'speedup':>7}"
    print(f"{'impl':<6} {'B':>3} {'miss %':>6} {'eager ev us':>11} {'eager wall us':>13} {extra}")
    for r in rows:
        tail = (f"{r['graph_event_us']:>11.1f} {r['graph_wall_us']:>13.1f}" if graphs
                else f"{r['loop_wall_us']:>11.0f} {r['speedup']:>7.2f}")
        print(f"{r['impl']:<6} {r['B']:>3} {100 * r['miss_fraction']:>6.0f} {r['eager_event_us']:>11.1f} "
              f"{r['eager_wall_us']:>13.1f} {tail}")
    d = result.get("decode_step")
    if d:
        print(f"whole Flash decode step, {d['layers']} CSA layers, B = {d['B']}, 10% misses: eager "
              f"{d['eager_event_us']:.1f} us event / {d['eager_wall_us']:.1f} us wall; graph replay "
              f"{d['graph_event_us']:.1f} us event / {d['graph_wall_us']:.1f} us wall")


def default_out() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu.json" if out else ROOT / "bench" / "results" / "gpu.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (default); cpu = a small dry run of the same code")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (median; "
                        "default 20, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats (what `make bench` runs)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default $OUT/gpu.json, else "
                        "bench/results/gpu.json; --device cpu: bench/results/gpu_cpu.json); a PNG beside it")
    parser.add_argument("--only", choices=["all", "batched", "launch"], default="all",
                        help="batched = only section 3 (the batched swap-in); launch = only section 4")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.quick else 20
    if args.repeats < 1:
        parser.error("--repeats: expected a positive int")
    if args.device == "cuda" and not cuda_available():
        print("gpu_bench: no CUDA device visible to torch "
              f"(torch {torch.__version__}); nothing measured. Use --device cpu for a dry run "
              "(--device cpu --quick --only batched times the batched swap-in's torch implementation).")
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dry = device.type == "cpu"
    if dry:  # a shared CPU: one intra-op thread, for the batched op and its baseline alike
        torch.set_num_threads(1)
    out = args.out or (default_out() if not dry or os.environ.get("OUT") else
                       ROOT / "bench" / "results" / "gpu_cpu.json")

    impls = ["torch"]
    skipped: dict[str, str] = {}
    if not dry and cuda_ops.cupy_available():
        impls.append("cuda")
    else:
        skipped["cuda"] = "no CUDA device (dry run)" if dry else \
            "cupy is not importable (install cupy-cuda12x / cupy-cuda13x to measure impl='cuda')"

    launch = bench_launch_host(device, args.repeats)
    print(f"launch host cost (B={launch['B']}, k={launch['k']}, N={launch['N']}): arguments converted "
          f"{launch['miss_us']:.2f} us/call (baseline), found in the keyed cache {launch['hit_us']:.2f} us/call "
          f"(ratio {launch['hit_over_miss']:.2f})")
    if args.only == "launch":
        out.parent.mkdir(parents=True, exist_ok=True)
        if args.out is not None or not dry:
            out.write_text(json.dumps({"benchmark": "gpu", "launch_host": launch}, indent=2) + "\n")
            print(f"wrote {out}")
        return 0
    t0 = time.perf_counter()
    pool_blocks, batches = (64, [1, 8, 32]) if dry else (1024, [8, 64, 256, 1024])
    copy_rows = [] if args.only == "batched" else bench_copy_engine(device, pool_blocks, batches, args.repeats)
    t_copy = time.perf_counter() - t0
    mirror = Mirror(device, 512 if dry else (1 << 20) // LAYOUT.block_tokens)
    kernel_rows = [] if args.only == "batched" else bench_swap_in_kernel(mirror, device, impls, args.repeats)
    e2e_rows = [] if args.only == "batched" else bench_hisparse_e2e(mirror, device, args.repeats)
    # 3. batched: the CUDA kernel on a GPU (graphs need it), the torch twin on the CPU
    batched_impl = "cuda" if "cuda" in impls else "torch"
    if dry:
        batched_rows = bench_batched(mirror, device, [1, 8, 32], min(args.repeats, 7), "torch")
        decode = None
    elif batched_impl == "cuda":
        batched_rows = bench_batched(mirror, device, [1, 8, 32, 64], args.repeats, "cuda")
        decode = bench_decode_step(mirror, device, 32, args.repeats)
    else:
        batched_rows, decode = [], None
        skipped["batched"] = "the batched swap-in is measured with impl='cuda' (cupy is not importable)"
    elapsed = time.perf_counter() - t0

    result: dict[str, Any] = {
        "benchmark": "gpu",
        "device": torch.cuda.get_device_name(device) if not dry else "cpu (dry run)",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cupy": _cupy_version(),
        "python": platform.python_version(),
        "machine": platform.platform(),
        "layout": "deepseek_v4_flash fp8",
        "record_bytes": RECORD_BYTES,
        "entry_bytes": ENTRY_BYTES,
        "top_k": TOP_K,
        "buffer_entries": BUFFER_ENTRIES,
        "host_mirror": {"blocks": mirror.tier.num_blocks, "view": list(mirror.rows3d.shape),
                        "view_strides": list(mirror.rows3d.stride()), "pinned": mirror.tier.pinned},
        "repeats": args.repeats,
        "statistic": "median",
        "copy_engine_impl": "cuda" if "cuda" in impls else "torch",
        "copy_engine": copy_rows,
        "swap_in_kernel": kernel_rows,
        "swap_in_skipped": skipped,
        "hisparse_e2e": e2e_rows,
        "batched": batched_rows,
        "decode_step": decode,
        "launch_host": launch,
        "elapsed_s": {"copy_engine": t_copy, "total": elapsed},
    }
    print(f"{result['device']}, torch {torch.__version__} (CUDA {torch.version.cuda}), cupy {result['cupy']}")
    print_tables(result)
    print(f"\n({elapsed:.1f} s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if batched_rows:
        print(plot(result, out.with_suffix(".png")))
    return 0


def _cupy_version() -> str | None:
    if not cuda_ops.cupy_available():
        return None
    import cupy

    return str(cupy.__version__)


if __name__ == "__main__":
    sys.exit(main())
