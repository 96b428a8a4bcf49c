"""Block gather / scatter throughput against a plain memcpy of the same bytes.

Layout: DeepSeek-V4-Flash, fp8 entries (``presets.deepseek_v4_flash()``), so a block
record is 492,832 bytes from three parts::

    CSA KV    [21, num_blocks, 32, 584]
    indexer   [21, num_blocks, 32, 132]
    HCA KV    [20, num_blocks,  1, 584]

For each batch size n (unsorted, distinct block ids drawn from the pool), in one run:

    gather   kernels.gather_blocks(parts, ids, records[n, 492832])
    scatter  kernels.scatter_blocks(records, ids, parts)
    memcpy   dst.copy_(src), one contiguous tensor of n * 492,832 bytes (the baseline)

each repeated ``--repeats`` times (after one warm-up); the table reports the medians as
GB/s (1e9 bytes per second of record bytes moved) and gather/memcpy, scatter/memcpy
ratios. Runs on CPU, and on the GPU too when CUDA is present (torch and CUDA kernels,
device to device, plus gather into pinned host records against a device-to-host memcpy).

    python bench/transfer.py --quick        # well under a minute on CPU
    python bench/transfer.py --threads 0    # full run, torch's default CPU threads

Writes ``bench/results/transfer.json`` and ``bench/results/transfer.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tiered_kv import kernels, presets
from tiered_kv.device import cuda_available, empty_host
from tiered_kv.kernels import cuda_ops

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    device: str  # where the pool lives
    impl: str  # kernel implementation
    records_on: str  # where the records live
    blocks: int
    mbytes: float
    gather_gbps: float
    scatter_gbps: float
    memcpy_gbps: float

    @property
    def gather_ratio(self) -> float:
        return self.gather_gbps / self.memcpy_gbps

    @property
    def scatter_ratio(self) -> float:
        return self.scatter_gbps / self.memcpy_gbps


def flash_parts(num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    layout = presets.deepseek_v4_flash()
    shapes = [
        (layout.num_csa_layers, num_blocks, layout.csa_entries_per_block, layout.entry_bytes),
        (layout.num_csa_layers, num_blocks, layout.csa_entries_per_block, layout.indexer_bytes),
        (layout.num_hca_layers, num_blocks, layout.hca_entries_per_block, layout.entry_bytes),
    ]
    assert shapes == [(21, num_blocks, 32, 584), (21, num_blocks, 32, 132), (20, num_blocks, 1, 584)]
    parts = [torch.empty(s, dtype=torch.uint8, device=device) for s in shapes]
    g = torch.Generator(device=device).manual_seed(0)
    for p in parts:
        p.random_(0, 256, generator=g)
    assert kernels.record_bytes(parts) == layout.block_bytes == 492_832
    return parts


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds one call of ``fn`` takes on ``device`` (CUDA: event time)."""
    if device.type == "cuda":
        def run_cuda(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return run_cuda

    def run_cpu(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run_cpu


def median_seconds(fns: dict[str, Callable[[], object]], device: torch.device,
                   repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn. The fns are interleaved within each repeat, so
    load from other processes on the machine hits all of them alike."""
    run = timer(device)
    for fn in fns.values():
        run(fn)  # warm-up (first touch of the pages; CUDA: kernel compilation)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(run(fn))
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_one(parts: list[torch.Tensor], n: int, *, impl: str, records_on: torch.device,
              repeats: int) -> Row:
    device = parts[0].device
    nbytes = kernels.record_bytes(parts)
    num_blocks = parts[0].shape[1]
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(n))[:n]
    pinned = records_on.type == "cpu" and device.type == "cuda"
    if pinned:
        records = empty_host((n, nbytes), pinned=True)
        src = torch.empty(n * nbytes, dtype=torch.uint8, device=device)
        dst = empty_host(n * nbytes, pinned=True)
    else:
        records = torch.empty(n, nbytes, dtype=torch.uint8, device=records_on)
        src = torch.empty(n * nbytes, dtype=torch.uint8, device=records_on)
        dst = torch.empty_like(src)
    src.random_(0, 256)

    def gather() -> None:
        kernels.gather_blocks(parts, ids, records, impl=impl)

    def scatter() -> None:
        kernels.scatter_blocks(records, ids, parts, impl=impl)

    def memcpy() -> None:
        dst.copy_(src, non_blocking=pinned)

    t = median_seconds({"gather": gather, "scatter": scatter, "memcpy": memcpy}, device, repeats)
    # sanity: the records are the blocks (first and last of the batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for i in (0, n - 1):
        want = torch.cat([p[:, int(ids[i])].reshape(-1) for p in parts]).to(records.device)
        assert torch.equal(records[i], want), f"gather produced a wrong record ({impl}, n={n})"
    t_gather, t_scatter, t_memcpy = t["gather"], t["scatter"], t["memcpy"]
    total = n * nbytes
    return Row(device=str(device), impl=impl, records_on=str(records.device), blocks=n,
               mbytes=total / 1e6, gather_gbps=total / t_gather / 1e9,
               scatter_gbps=total / t_scatter / 1e9, memcpy_gbps=total / t_memcpy / 1e9)


def configurations(quick: bool) -> list[tuple[torch.device, str, torch.device]]:
    """(pool device, impl, records device) to measure."""
    cpu = torch.device("cpu")
    configs = [(cpu, "torch", cpu)]
    if cuda_available():
        gpu = torch.device("cuda", torch.cuda.current_device())
        impls = ["torch"] + (["cuda"] if cuda_ops.cupy_available() else [])
        for impl in impls:
            configs.append((gpu, impl, gpu))
            configs.append((gpu, impl, cpu))
    return configs


def print_table(rows: list[Row]) -> None:
    header = (f"{'device':<8} {'impl':<6} {'records':<8} {'blocks':>6} {'MB':>8} "
              f"{'gather GB/s':>12} {'scatter GB/s':>13} {'memcpy GB/s':>12} "
              f"{'gather/memcpy':>14} {'scatter/memcpy':>15}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r.device:<8} {r.impl:<6} {r.records_on:<8} {r.blocks:>6} {r.mbytes:>8.1f} "
              f"{r.gather_gbps:>12.2f} {r.scatter_gbps:>13.2f} {r.memcpy_gbps:>12.2f} "
              f"{r.gather_ratio:>14.2f} {r.scatter_ratio:>15.2f}")


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.device, r.impl, r.records_on), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, ((device, impl, records_on), rs) in zip(axes[0], groups.items()):
        xs = [r.blocks for r in rs]
        ax.plot(xs, [r.gather_gbps for r in rs], "o-", label="gather_blocks")
        ax.plot(xs, [r.scatter_gbps for r in rs], "s-", label="scatter_blocks")
        ax.plot(xs, [r.memcpy_gbps for r in rs], "k--", label="memcpy (same bytes)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks per batch (492,832 B each)")
        ax.set_ylabel("GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(f"pool {device}, {impl} impl, records on {records_on}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("V4-Flash fp8 block records: gather / scatter vs memcpy (medians)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small pool and batches (well under a minute)")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement (median)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for transfer.json / transfer.png")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 0 = torch's default. 1 (the default) keeps the "
                             "CPU numbers steady on a shared machine, where oversubscribed "
                             "OpenMP threads make every multi-threaded copy erratic")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: expected a positive int")
    if args.threads < 0:
        parser.error("--threads: expected 0 (torch's default) or a positive int")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    pool_blocks, batches = (256, [1, 8, 32, 128]) if args.quick else (1024, [1, 8, 32, 128, 512])
    rows: list[Row] = []
    t0 = time.perf_counter()
    for device, impl, records_on in configurations(args.quick):
        parts = flash_parts(pool_blocks, device)
        for n in batches:
            rows.append(bench_one(parts, n, impl=impl, records_on=records_on, repeats=args.repeats))
        del parts
    elapsed = time.perf_counter() - t0

    print(f"V4-Flash fp8, record 492,832 B, pool {pool_blocks} blocks, median of {args.repeats}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print_table(rows)
    print(f"({elapsed:.1f} s)")

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {
        "benchmark": "transfer",
        "layout": "deepseek_v4_flash fp8",
        "record_bytes": 492_832,
        "parts": {"csa_kv": [21, pool_blocks, 32, 584], "indexer": [21, pool_blocks, 32, 132],
                  "hca_kv": [20, pool_blocks, 1, 584]},
        "baseline": "dst.copy_(src) of one contiguous tensor of the same bytes",
        "repeats": args.repeats,
        "statistic": "median",
        "quick": args.quick,
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        # other processes share this machine's CPUs: the 1-minute load, before and after
        "loadavg_1min": [load_before[0], os.getloadavg()[0]],
        "gpu": torch.cuda.get_device_name() if cuda_available() else None,
        "rows": [asdict(r) | {"gather_ratio": r.gather_ratio, "scatter_ratio": r.scatter_ratio} for r in rows],
    }
    (args.out / "transfer.json").write_text(json.dumps(meta, indent=2) + "\n")
    plot(rows, args.out / "transfer.png")
    print(f"wrote {args.out / 'transfer.json'} and {args.out / 'transfer.png'}")


if __name__ == "__main__":
    main()
