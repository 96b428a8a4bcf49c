"""What a fresh O_DIRECT staging buffer costs to fault in: private (the store's mapping,
transparent huge pages) against shared (Python's default anonymous mmap, 4 KiB shmem pages).

    python bench/buffer_faults.py [--mib 74] [--rounds 3] [--per-round 10]
    python bench/buffer_faults.py --quick     # 1 round of 5 each (make bench)

A store stages each writer thread's batch in one page-aligned buffer of at least 8 MiB
(storage/os/libc.py ``aligned_buffer``, storage/lmdb/segments.py): a fresh store, or a
batch larger than any before, faults in a new one. Each sample maps ``--mib`` MiB, touches
every 4 KiB page once (what the first staging copy does) and unmaps it; the figure is the
CPU time of the process (ms), whose kernel side is the page faults and zeroing. The two
mappings take turns per round, so load drifts hit both alike. Also counted per mapping:
``/proc/vmstat``'s THP faults and compaction stalls (direct compaction would show there).
Prints min / median / max per mapping and the ratio of the medians; writes
bench/results/buffer_faults.json and a PNG. Quote the machine's load (recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from tiered_kv.storage.os import libc

RESULTS = Path(__file__).resolve().parent / "results"
_VMSTAT = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall", "allocstall_normal", "allocstall_movable")


def _vmstat() -> dict[str, int]:
    try:
        with open("/proc/vmstat") as f:
            return {k: int(v) for k, v in (line.split() for line in f) if k in _VMSTAT}
    except OSError:
        return {}


def _sample(nbytes: int) -> float:
    c0 = time.process_time()
    buf = libc.aligned_buffer(nbytes)
    buf[::4096] = 1
    del buf
    return (time.process_time() - c0) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=74, help="buffer size (default 74: a 64-page SGLang batch)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="1 round of 5 samples each")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.per_round = 1, 5
    load0 = os.getloadavg()
    ms: dict[str, list[float]] = {"private": [], "shared": []}
    vm: dict[str, dict[str, int]] = {k: dict.fromkeys(_VMSTAT, 0) for k in ms}
    try:
        for _ in range(a.rounds):
            for mode in ms:
                libc.SHARED_BUFFERS = mode == "shared"
                v0 = _vmstat()
                ms[mode] += [_sample(a.mib << 20) for _ in range(a.per_round)]
                v1 = _vmstat()
                for k in v1:
                    vm[mode][k] += v1[k] - v0.get(k, 0)
    finally:
        libc.SHARED_BUFFERS = os.environ.get("TIERED_KV_DIRECT_BUFFERS", "private") == "shared"
    load1 = os.getloadavg()
    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"fault in a fresh {a.mib} MiB O_DIRECT buffer, CPU ms, {a.rounds} rounds x {a.per_round}, "
          f"load {load0[0]:.1f} -> {load1[0]:.1f}")
    print(f"{'mapping':10s} {'min':>7s} {'median':>7s} {'max':>7s}   /proc/vmstat during its samples")
    for k, v in ms.items():
        counts = ", ".join(f"{n} {c}" for n, c in vm[k].items() if c) or "-"
        print(f"{k:10s} {min(v):7.1f} {med[k]:7.1f} {max(v):7.1f}   {counts}")
    print(f"private / shared, medians: {med['private'] / med['shared']:.2f} (lower is cheaper)")
    result = {"mib": a.mib, "rounds": a.rounds, "per_round": a.per_round, "cpu_ms": ms, "median_ms": med,
              "ratio_private_to_shared": med["private"] / med["shared"], "vmstat": vm,
              "load_before": load0, "load_after": load1}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "buffer_faults.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return result
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.boxplot([ms["private"], ms["shared"]], tick_labels=["private (THP)", "shared (4 KiB)"])
    ax.set_ylabel("CPU ms to fault in")
    ax.set_title(f"fresh {a.mib} MiB O_DIRECT buffer")
    fig.tight_layout()
    fig.savefig(a.out / "buffer_faults.png", dpi=120)
    return result


if __name__ == "__main__":
    main()
