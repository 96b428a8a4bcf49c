"""What leaf-first eviction costs an LMDB store's puts, and what it strands, against the
plain LRU store it replaced.

A store bounded to a quarter of what is written: paths of 8 blocks with a snapshot at
their end (V4-Flash stand-in sizes at 1/128: 15,401 and 28,472 payload bytes), each path
one ``put_many`` written root first (as the cache's disk writer does); a third of the
paths branch from the one before after its first 4 blocks, a third extend it; only new
blocks are written (shared ones were served by a memory tier, which the store does not
see). Once the store is full every put evicts. Measured per put: wall time (median over the evicting puts); at the end, the
records the store holds that no resume can use (a block whose parent block is not in the
store, a snapshot whose block is not). That last count is a check, not the figure: here
plain LRU evicts whole paths too, at most one at a time being cut, so both stores end
with none; the stranding plain LRU causes comes from hits served by the memory tiers,
which a store alone does not see (`tiered-kv replay` measures it, docs/policies.md).

The baseline is the same worker run on another source tree (``--baseline-src``, e.g. a
checkout of the commit before the tree: ``git worktree add /tmp/base 8e116f3``), in the
same run, rounds interleaved (each case going first in turn). Each worker imports the
store from its own tree and says which file it measured (the editable install would
otherwise give both the installed one: the 1.04 of 2026-12-01 measured one store twice). Writes
bench/results/store_eviction.json and .png.

    python bench/store_eviction.py --baseline-src /tmp/base --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BLOCK, SNAP, PATH_BLOCKS = 15_401, 28_472, 8


#: the source tree a worker measures (set by :func:`run_in`)
_SRC_ENV = "TIERED_KV_BENCH_SRC"


def _storage_from(src: Path) -> str:
    """Import ``tiered_kv`` and ``tiered_kv.storage`` from the tree ``src``; returns the
    storage package's file. PYTHONPATH alone is not enough: the project's editable install
    maps ``tiered_kv.storage`` (``storage/`` in a checkout, by ``package-dir``) to the
    installed tree whatever PYTHONPATH says, so before this both cases measured the
    installed store."""
    import importlib.util

    import tiered_kv

    if not Path(tiered_kv.__file__).resolve().is_relative_to(src):
        raise SystemExit(f"tiered_kv imported from {tiered_kv.__file__}, not from {src}")
    if "tiered_kv.storage" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tiered_kv.storage", src / "storage" / "__init__.py",
                                                      submodule_search_locations=[str(src / "storage")])
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["tiered_kv.storage"] = module
        spec.loader.exec_module(module)
        tiered_kv.storage = module  # type: ignore[attr-defined]
    from tiered_kv.storage import lmdb

    where = Path(lmdb.__file__).resolve()
    if not where.is_relative_to(src):
        raise SystemExit(f"tiered_kv.storage.lmdb imported from {where}, not from {src}")
    return str(where)


def worker(paths: int) -> dict:
    """One store, ``paths`` paths written; run inside the source tree being measured."""
    import numpy as np

    storage_file = _storage_from(Path(os.environ[_SRC_ENV]).resolve())
    from tiered_kv.storage import LmdbStore, PutItem, RecordKey, record_size

    root = hashlib.sha256(b"bench").digest()
    digest = hashlib.sha256(b"tokens").digest()
    parent: dict[bytes, bytes] = {}
    payload_b, payload_s = np.zeros(BLOCK, np.uint8), np.zeros(SNAP, np.uint8)
    total = paths * (PATH_BLOCKS * record_size(BLOCK) + record_size(SNAP))
    times: list[float] = []
    evicting = False
    with tempfile.TemporaryDirectory() as tmp:
        store = LmdbStore(Path(tmp) / "s", layout_fingerprint="bench-store-eviction", max_bytes=total // 4)
        last: list[bytes] = []
        for i in range(paths):
            # i % 3: 0 a new path; 1 a branch of the last one after its first 4 blocks; 2 the
            # last one extended past its end (a longer prompt). Only the new blocks are
            # written, as the cache does: the shared ones were served by a memory tier, so
            # the store sees no access to them
            shared = last[:4] if i % 3 == 1 else []
            hs = list(shared)
            p = hs[-1] if hs else (last[-1] if i % 3 == 2 else root)
            start = p
            while len(hs) < PATH_BLOCKS:
                p = hashlib.sha256(p + i.to_bytes(4, "little") + bytes([len(hs)])).digest()
                hs.append(p)
            last = hs
            items = []
            for j, h in enumerate(hs):
                parent[h] = hs[j - 1] if j else start
                if j >= len(shared):
                    items.append(PutItem(RecordKey.block(h), parent_hash=parent[h], token_digest=digest,
                                         payload=payload_b))
            items.append(PutItem(RecordKey.snapshot(hs[-1]), parent_hash=hs[-2], token_digest=digest,
                                 payload=payload_s))
            t0 = time.perf_counter()
            store.put_many(items)
            dt = time.perf_counter() - t0
            if evicting:
                times.append(dt)
            elif i % 20 == 0:
                evicting = store.stats()["evictions"] > 0
        held = set(store)
        blocks = {k.block_hash for k in held if k.kind.name == "BLOCK"}
        unreachable = sum(1 for h in blocks if parent[h] != root and parent[h] not in blocks)
        snaps_orphan = sum(1 for k in held if k.kind.name == "SNAPSHOT" and k.block_hash not in blocks)
        s = store.stats()
        store.close()
    return {"put_ms_median": 1e3 * statistics.median(times), "evicting_puts": len(times),
            "evictions": s["evictions"], "records": s["records"], "blocks_unreachable": unreachable,
            "snapshots_unreachable": snaps_orphan, "storage_file": storage_file}


def run_in(src: Path, paths: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), _SRC_ENV: str(src)}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--paths", str(paths)],
                         cwd=src, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--paths", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-src", type=Path, help="the source tree of the baseline (plain LRU store)")
    ap.add_argument("--quick", action="store_true", help="300 paths, 1 round (make bench)")
    args = ap.parse_args()
    if args.quick:
        args.paths, args.rounds = 300, 1
    if args.worker:
        print(json.dumps(worker(args.paths)))
        return
    cases = {"leaf-first (this tree)": ROOT}
    if args.baseline_src is not None:
        cases["baseline"] = args.baseline_src.resolve()
    rounds: dict[str, list[dict]] = {name: [] for name in cases}
    load = [os.getloadavg()]
    for r in range(args.rounds):
        order = list(cases.items())
        for name, src in (order if r % 2 == 0 else order[::-1]):  # each goes first in turn
            got = run_in(src, args.paths)
            rounds[name].append(got)
            if r == 0:
                print(f"{name}: the store measured is {got['storage_file']}", flush=True)
            print(f"round {r + 1} {name:<24} put {got['put_ms_median']:7.3f} ms (median of {got['evicting_puts']}), "
                  f"{got['evictions']} evicted, unreachable: {got['blocks_unreachable']} blocks, "
                  f"{got['snapshots_unreachable']} snapshots", flush=True)
    load.append(os.getloadavg())
    med = {name: statistics.median(g["put_ms_median"] for g in rs) for name, rs in rounds.items()}
    print(f"\nload average {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end")
    for name in cases:
        last = rounds[name][-1]
        print(f"{name:<24} put_many {med[name]:.3f} ms median; at the end {last['blocks_unreachable']} blocks and "
              f"{last['snapshots_unreachable']} snapshots unreachable of {last['records']} records")
    if "baseline" in med:
        print(f"ratio leaf-first / baseline: {med['leaf-first (this tree)'] / med['baseline']:.3f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"paths": args.paths, "rounds": rounds, "median_put_ms": med, "loadavg": load,
              "baseline_src": str(args.baseline_src) if args.baseline_src else None,
              "python": platform.python_version(), "machine": platform.machine()}
    (RESULTS / "store_eviction.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, rs in rounds.items():
        ax.plot(range(1, len(rs) + 1), [g["put_ms_median"] for g in rs], "o-", label=name)
    ax.set_xlabel("round")
    ax.set_ylabel("put_many of one path, median ms")
    ax.set_title(f"LMDB store at 1/4 of what is written ({args.paths} paths)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "store_eviction.png", dpi=120)


if __name__ == "__main__":
    main()
