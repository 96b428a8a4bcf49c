"""A fleet sharing one bucket (Mooncake's Fig. 10): N node processes, each with its own
tiers, with and without a shared level on SeaweedFS S3, routed at random or by prefix.

Two settings, as issue 21 asks:

* ``paper``: the paper's local cache, 3M tokens per node (``--hbm-tokens 3M``, no other
  local tier); with the shared level, the same nodes plus one bucket they all write to and
  read from (Mooncake's global cache). The paper (10 prefill nodes, 3M tokens each, a
  KVCache-aware scheduler) reports the global cache's hit rate 2.22x the local one's on
  the conversation trace and 2.36x on the synthetic one; that ratio is printed beside ours
  (prefix routing, the closest to the paper's scheduler).
* ``flash``: V4-Flash bytes per node (40 GiB HBM, 512 GiB host, 4 TiB disk), with and
  without the bucket behind each node's disk.

Each combination replays the whole trace (``--limit`` for fewer); the per-node and fleet
tables are printed, bench/results/replay_fleet_<setting>_<trace>.json and .png written.
SeaweedFS is started as the tests start it (tests/seaweedfs.py) and killed at the end.

    python bench/replay_fleet.py --quick                       # 2 nodes, 200 requests, paper setting
    python bench/replay_fleet.py --setting paper --trace conversation
    tiered-kv replay --trace bundled:conversation --hbm-tokens 3M --nodes 10 \\
        --shared 'zarr+s3://BUCKET/replay?endpoint=http://127.0.0.1:PORT&allow_http=true'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from tiered_kv.cli.replay import fleet_table  # noqa: E402
from tiered_kv.replay import Capacity, ReplayConfig, load_trace  # noqa: E402
from tiered_kv.replay.fleet import fleet_replay  # noqa: E402
from tiered_kv.replay.plot import plot_fleet  # noqa: E402

RESULTS = ROOT / "bench" / "results"
#: Mooncake FAST'25 Fig. 10: global cache hit rate / local cache hit rate
PAPER_RATIO = {"conversation": 2.22, "tool&agent": 1.38, "synthetic": 2.36}


#: each node's tiers (the shared level, when a run has one, is added to these)
SETTINGS = {
    "paper": ReplayConfig(hbm=Capacity.of_tokens(3_000_000), verify_every=64),
    "flash": ReplayConfig(hbm=Capacity.of_bytes(40 << 30), host=Capacity.of_bytes(512 << 30),
                          disk=Capacity.of_bytes(4 << 40), verify_every=64),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setting", choices=("paper", "flash", "both"), default="both")
    p.add_argument("--trace", choices=("conversation", "synthetic", "both"), default="both")
    p.add_argument("--nodes", type=int, default=10)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.limit, args.setting, args.trace = 2, 200, "paper", "conversation"
    from seaweedfs import WeedUnavailable, find_weed, running_seaweedfs

    try:
        find_weed()
    except WeedUnavailable as e:
        print(f"replay_fleet: skipped, no SeaweedFS here: {e}")
        return
    names = ["conversation", "synthetic"] if args.trace == "both" else [args.trace]
    chosen = ["paper", "flash"] if args.setting == "both" else [args.setting]
    configs = SETTINGS

    def progress_every(step: int):
        """A progress line every ``step`` requests (a fleet run takes minutes to an hour)."""
        t0 = time.perf_counter()

        def tell(i: int, n: int) -> None:
            if i % step == 0 or i == n:
                print(f"    {i:,}/{n:,} requests in {time.perf_counter() - t0:.0f} s (load {os.getloadavg()[0]:.1f})",
                      flush=True)
        return tell

    for setting in chosen:
        for name in names:
            trace = load_trace(f"bundled:{name}", limit=args.limit)
            reports = []
            for route in ("random", "prefix"):
                for with_shared in (False, True):
                    t0 = time.perf_counter()
                    if with_shared:  # a fresh server per run: a run stores ~4 GB of stand-in records
                        with running_seaweedfs(volume_max=256) as sw:
                            sw.make_bucket("tkv-replay")
                            os.environ.update(sw.env())
                            cfg = dataclasses.replace(configs[setting], shared_url=sw.url("tkv-replay", "fleet"))
                            r = fleet_replay(trace, cfg, nodes=args.nodes, route=route, progress=progress_every(500))
                    else:
                        r = fleet_replay(trace, configs[setting], nodes=args.nodes, route=route,
                                         progress=progress_every(500))
                    print(f"  {setting} {name} {route} shared={with_shared}: hit {100 * r.hit_rate:.2f} % in "
                          f"{time.perf_counter() - t0:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)
                    reports.append(r)
            for r in reports:
                print(r.text())
                print()
            print(fleet_table(reports))
            ratios = {}
            for route in ("random", "prefix"):
                local, shared = (r for r in reports if r.route == route)
                ratios[route] = shared.hit_rate / local.hit_rate if local.hit_rate else float("inf")
            paper = PAPER_RATIO.get(name)
            print(f"\n{setting} / {name}: shared-level hit rate / local-only hit rate: random "
                  f"{ratios['random']:.2f}x, prefix {ratios['prefix']:.2f}x"
                  + (f"; Mooncake Fig. 10: {paper:.2f}x" if paper else "") + "\n")
            suffix = "_quick" if args.quick else ""
            out = {"setting": setting, "trace": name, "nodes": args.nodes, "limit": args.limit,
                   "ratio_shared_to_local": ratios, "paper_ratio": paper,
                   "load_avg_1min": os.getloadavg()[0], "runs": [r.to_dict() for r in reports]}
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"replay_fleet_{setting}_{name}{suffix}.json").write_text(json.dumps(out, indent=1) + "\n")
            plot_fleet(reports, RESULTS / f"replay_fleet_{setting}_{name}{suffix}.png")


if __name__ == "__main__":
    main()
