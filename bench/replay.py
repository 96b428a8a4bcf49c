"""The whole trace through one node's real tiers: the per-tier table and the replay's run time.

For each trace (``bundled:conversation``: 12,031 requests, 144.8M prompt tokens;
``bundled:synthetic``) one replay through a ``TieredKVCache`` with V4-Flash capacities of
40 GiB HBM, 512 GiB host and 4 TiB disk (LMDB under the temporary directory), the cache's
own policies (snapshots at prompt ends and every 8 blocks, LRU). Printed: the report
(``tiered-kv replay``'s table) and the run time beside the target (issue 21: the whole
conversation trace in <= 10 minutes on this 2-core machine), with the process CPU time
and the load average of the machine during the run (other jobs share it). Written:
``bench/results/replay_<trace>.json`` and ``.png``.

The same table: ``tiered-kv replay --trace bundled:conversation --hbm 40G --host 512G --disk 4T``.

    python bench/replay.py --quick        # the first 500 requests of each trace
    python bench/replay.py                # both traces, whole
    python bench/replay.py --trace conversation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tiered_kv.replay import Capacity, ReplayConfig, load_trace, replay  # noqa: E402
from tiered_kv.replay.plot import plot_report  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGET_S = 600.0


class LoadSampler:
    """The 1-minute load average, sampled every 5 s while the replay runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(5.0):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(name: str, limit: int | None) -> dict:
    trace = load_trace(f"bundled:{name}", limit=limit)
    cfg = ReplayConfig(hbm=Capacity.of_bytes(40 << 30), host=Capacity.of_bytes(512 << 30),
                       disk=Capacity.of_bytes(4 << 40))
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    with LoadSampler() as load:
        t0 = time.perf_counter()
        report = replay(trace, cfg)
        wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    print(report.text())
    print(f"\n{name}: {len(trace):,} requests, {trace.prompt_tokens:,} prompt tokens replayed in {wall:.1f} s wall "
          f"({cpu:.1f} s CPU, all threads); target {TARGET_S:.0f} s: ratio {wall / TARGET_S:.2f}; "
          f"load average during the run {min(load.samples):.1f}-{max(load.samples):.1f} "
          f"(mean {sum(load.samples) / len(load.samples):.1f}) on {os.cpu_count()} CPUs")
    out = report.to_dict()
    out["bench"] = {"wall_s": wall, "cpu_s": cpu, "target_s": TARGET_S, "ratio_to_target": wall / TARGET_S,
                    "load_avg_1min": {"min": min(load.samples), "max": max(load.samples),
                                      "mean": sum(load.samples) / len(load.samples)},
                    "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "command": f"tiered-kv replay --trace bundled:{name} --hbm 40G --host 512G --disk 4T"
                               + (f" --limit {limit}" if limit else "")}
    suffix = "_quick" if limit else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"replay_{name}{suffix}.json").write_text(json.dumps(out, indent=1) + "\n")
    plot_report(report, RESULTS / f"replay_{name}{suffix}.png")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", choices=("conversation", "synthetic", "both"), default="both")
    p.add_argument("--quick", action="store_true", help="the first 500 requests only")
    args = p.parse_args()
    names = ["conversation", "synthetic"] if args.trace == "both" else [args.trace]
    for name in names:
        run(name, 500 if args.quick else None)


if __name__ == "__main__":
    main()
