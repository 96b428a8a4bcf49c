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

Every number is the median of ``--repeats`` timed calls after warm-up; wall-clock medians
are reported beside the event times. Results are checked (records, buffer rows) once per
configuration.

    python bench/gpu_bench.py                    # needs CUDA; JSON to $OUT/gpu.json or
                                                 # bench/results/gpu.json
    python bench/gpu_bench.py --device cpu       # dry run of the same code on the CPU
                                                 # (small sizes, torch impl only)
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


# ------------------------------------------------------------------ report
def print_tables(result: dict[str, Any]) -> None:
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
                        "bench/results/gpu.json)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 5 if args.quick else 20
    if args.repeats < 1:
        parser.error("--repeats: expected a positive int")
    if args.device == "cuda" and not cuda_available():
        print("gpu_bench: no CUDA device visible to torch "
              f"(torch {torch.__version__}); nothing measured. Use --device cpu for a dry run.")
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dry = device.type == "cpu"
    out = args.out or default_out()

    impls = ["torch"]
    skipped: dict[str, str] = {}
    if not dry and cuda_ops.cupy_available():
        impls.append("cuda")
    else:
        skipped["cuda"] = "no CUDA device (dry run)" if dry else \
            "cupy is not importable (install cupy-cuda12x / cupy-cuda13x to measure impl='cuda')"

    t0 = time.perf_counter()
    pool_blocks, batches = (64, [1, 8, 32]) if dry else (1024, [8, 64, 256, 1024])
    copy_rows = bench_copy_engine(device, pool_blocks, batches, args.repeats)
    t_copy = time.perf_counter() - t0
    mirror = Mirror(device, 256 if dry else (1 << 20) // LAYOUT.block_tokens)
    kernel_rows = bench_swap_in_kernel(mirror, device, impls, args.repeats)
    e2e_rows = bench_hisparse_e2e(mirror, device, args.repeats)
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
        "elapsed_s": {"copy_engine": t_copy, "total": elapsed},
    }
    print(f"{result['device']}, torch {torch.__version__} (CUDA {torch.version.cuda}), cupy {result['cupy']}")
    print_tables(result)
    print(f"\n({elapsed:.1f} s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def _cupy_version() -> str | None:
    if not cuda_ops.cupy_available():
        return None
    import cupy

    return str(cupy.__version__)


if __name__ == "__main__":
    sys.exit(main())
