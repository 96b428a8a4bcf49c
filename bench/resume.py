"""Resume a long DeepSeek-V4-Flash prompt from an LMDB store: ``cache.open()`` in a new
process beside plain reads of the same store's files.

The store is written through the cache API (a CPU cache on the ``deepseek_v4_flash``
preset; random KV bytes stand in for the model, which is far too slow at Flash size):
every 128-token block (492,832 B) and a state snapshot (3.3 MB) every 8 blocks and at
the last two boundaries. Then, each in a NEW process (median over ``--repeats``):

    hot   the store's files are read once (page cache hot), then timed:
            open()      a new cache (no host tier) opens the prompt: every block and the
                        last snapshot come from disk, verified, into the pools (default
                        settings: the whole range is one row read, spread over the store's
                        threads, each record straight into its pool rows)
            open() per-block   the same with batches of 1 and no read-ahead (~ the old path)
            open() staging     batched, read into a staging ring then copied into the pools
                        (resume_read_into_pools=False: the path before scatter reads)
            plain read  read() of every file of the store (8 MiB calls)
            py-lmdb     a cursor over every record, each value copied out (shown when the
                        values are the records; a store keeping payloads in other files
                        has only its index in LMDB)
            get_many    the store's own verified reads of the resumed records, 8 per call
          Every baseline reads into a destination the size of what it reads (each byte to
          its own place, pages faulted in beforehand, as the cache's pools are), never into
          a few buffers that stay in the CPU's cache while open() fills pools of 256 MB.
    cold  posix_fadvise(DONTNEED) on every file of the store (and /proc/sys/vm/drop_caches
          when writable) before each process, then:
            open()      as above
            disk        plain read() of every file of the store, 1 thread, and 4 threads
                        of 8 MiB preads: the disk's cold-read bandwidth is the faster

Rates are bytes / wall time, GB/s = 1e9 B/s; open() moves the resumed payload bytes
(blocks + one snapshot). CPU s/GB: process CPU time (every thread) per GB moved, for
open() and for the plain reads, less sensitive than wall time to other jobs on the CPUs. Targets (issue 15): hot open() >= 0.6x plain read (16K tokens);
cold open() within 1.1x of resumed bytes / the disk's cold-read bandwidth.

    python bench/resume.py --quick     # 16K tokens, 3 repeats; bench/results/resume.json
    python bench/resume.py             # 64K tokens, 5 repeats; also resume.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # allow `python bench/resume.py` from a checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tiered_kv import TieredKVCache, presets  # noqa: E402

CHUNK = 8 << 20
SEED_TOKENS = 12345


def prompt_tokens(n: int) -> list[int]:
    g = torch.Generator().manual_seed(SEED_TOKENS)
    return torch.randint(0, 1 << 16, (n,), generator=g).tolist()


# ------------------------------------------------------------------ writing the store
def write_store(url: str, num_tokens: int, snapshot_interval: int) -> dict[str, Any]:
    """One request through a CPU Flash cache with random KV bytes; blocks and snapshots
    are written behind it by the cache's disk tier."""
    layout = presets.deepseek_v4_flash()
    bt = layout.block_tokens
    tokens = prompt_tokens(num_tokens)
    nblocks = num_tokens // bt
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, generator=g)
    fnoise = torch.randn(1 << 20, generator=g)
    t0 = time.perf_counter()
    with TieredKVCache(layout, num_blocks=nblocks + 1, num_state_slots=1, store=url,
                       snapshot_interval=snapshot_interval) as cache:
        req = cache.open(tokens)
        cache.reserve(req, num_tokens)
        st = cache.state(req)
        for k in range(nblocks):
            b = req.block_ids[k]
            for part in cache.classical.parts:  # [L, num_blocks, E, B]: block b of every layer
                view = part[:, b]
                off = int(torch.randint(0, noise.numel() - view.numel(), (1,), generator=g))
                view.copy_(noise[off:off + view.numel()].view(view.shape))
            off = int(torch.randint(0, noise.numel() - st.swa.numel(), (1,), generator=g))
            st.swa.copy_(noise[off:off + st.swa.numel()].view(st.swa.shape))
            for tail in (st.csa_tail, st.idx_tail):
                off = int(torch.randint(0, fnoise.numel() - tail.numel(), (1,), generator=g))
                tail.copy_(fnoise[off:off + tail.numel()].view(tail.shape))
            cache.advance(req, tokens[k * bt:(k + 1) * bt])
        cache.close(req)
        cache.flush()
        s = cache.stats()
    return {"write_s": time.perf_counter() - t0, "records": s["store_records"], "store_bytes": s["store_bytes"],
            "disk_write_errors": s["disk_write_errors"]}


# ------------------------------------------------------------------ page cache
def store_files(path: Path) -> list[Path]:
    return sorted(Path(d) / f for d, _, fs in os.walk(path) for f in fs)


def drop_cache(path: Path) -> bool:
    """Evict the store's files from the page cache; True if /proc/sys/vm/drop_caches took too."""
    os.sync()
    for f in store_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ baselines (in the child)
def destination(nbytes: int) -> np.ndarray:
    """``[nbytes] uint8``, its pages faulted in (as the cache's zeroed pools are): where a
    baseline's reads land."""
    out = np.empty(nbytes, np.uint8)
    out.fill(0)
    return out


def plain_read(path: Path, buf: np.ndarray) -> tuple[int, float]:
    """read() every file of the store (8 MiB calls), each byte to its own place in ``buf``
    (at least the files' size): (bytes, seconds)."""
    total = 0
    view = memoryview(buf)
    t = time.perf_counter()
    for f in store_files(path):
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(view[total:total + CHUNK]):
                total += n
    return total, time.perf_counter() - t


def parallel_read(path: Path, buf: np.ndarray, threads: int = 4) -> tuple[int, float]:
    """pread every file of the store in 8 MiB pieces, ``threads`` at once, each piece to its
    own place in ``buf`` (at least the files' size): (bytes, seconds)."""
    pieces, at = [], 0
    for f in store_files(path):
        size = f.stat().st_size
        pieces += [(f, off, at + off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
        at += size
    done = [0] * threads
    view = memoryview(buf)

    def work(i: int) -> None:
        for f, off, dst, n in pieces[i::threads]:
            fd = os.open(f, os.O_RDONLY)
            try:
                done[i] += os.preadv(fd, [view[dst:dst + n]], off)
            finally:
                os.close(fd)

    t = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    return sum(done), time.perf_counter() - t


def lmdb_iterate(path: Path, buf: np.ndarray) -> tuple[int, float]:
    """Plain py-lmdb: every record of the records sub-db copied out, one after the other
    into ``buf``: (bytes, seconds)."""
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4, subdir=True)
    try:
        try:
            db = env.open_db(b"records", create=False)
        except lmdb.Error:
            return 0, 1.0  # not this layout: no records sub-database
        total = 0
        t = time.perf_counter()
        with env.begin(buffers=True) as txn:
            for _, v in txn.cursor(db=db):
                n = len(v)
                buf[total:total + n] = np.frombuffer(v, dtype=np.uint8)
                total += n
        return total, time.perf_counter() - t
    finally:
        env.close()


def store_get_many(path: Path, layout, tokens: list[int], nblocks: int, buf: np.ndarray) -> tuple[int, float]:
    """The store's verified ``get_many`` of the resumed block records, 8 per call, each
    block to its own row of ``buf`` (at least ``nblocks * block_bytes``)."""
    from tiered_kv.prefix import PrefixHasher, token_digest
    from tiered_kv.storage import LmdbStore, RecordKey

    hashes = PrefixHasher(layout).block_hashes(tokens[:nblocks * layout.block_tokens])
    bt = layout.block_tokens
    rows = buf[:nblocks * layout.block_bytes].reshape(nblocks, layout.block_bytes)
    store = LmdbStore(path, layout_fingerprint=layout.fingerprint, readonly=True)
    try:
        t = time.perf_counter()
        for a in range(0, nblocks, 8):
            keys = [RecordKey.block(h) for h in hashes[a:a + 8]]
            digests = [token_digest(tokens[i * bt:(i + 1) * bt]) for i in range(a, a + len(keys))]
            metas = store.get_many(keys, list(rows[a:a + len(keys)]), token_digests=digests)
            if any(m is None for m in metas):
                raise RuntimeError("get_many: a stored record was a miss")
        return nblocks * layout.block_bytes, time.perf_counter() - t
    finally:
        store.close()


def timed_open(path: Path, num_tokens: int, device: str, batch: int | None, depth: int | None,
               staging: bool = False) -> dict[str, Any]:
    """A new cache opens the prompt (one extra token, so every block is resumable)."""
    layout = presets.deepseek_v4_flash()
    nblocks = num_tokens // layout.block_tokens
    tokens = prompt_tokens(num_tokens) + [1]
    cache = TieredKVCache(layout, device=device, num_blocks=nblocks + 4, num_state_slots=1,
                          store=f"lmdb://{path}")
    if batch is not None:
        cache.resume_batch_blocks = batch
    if depth is not None:
        cache.resume_read_depth = depth
    if staging:
        cache.resume_read_into_pools = False
    try:
        c, t = time.process_time(), time.perf_counter()
        req = cache.open(tokens)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        dt, cpu = time.perf_counter() - t, time.process_time() - c
        s = cache.stats()
    finally:
        cache.shutdown()
    if req.num_cached_tokens != nblocks * layout.block_tokens or s["snapshots_from_disk"] != 1:
        raise RuntimeError(f"open() resumed {req.num_cached_tokens} tokens, expected {nblocks * layout.block_tokens}")
    resumed = nblocks * layout.block_bytes + layout.snapshot_bytes
    return {"open_s": dt, "resumed_bytes": resumed, "open_gbps": resumed / dt / 1e9,
            "open_cpu_s_per_gb": cpu / (resumed / 1e9), "blocks_from_disk": s["blocks_from_disk"]}


def child(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.torch_threads)
    path = Path(args.store)
    files_bytes = sum(f.stat().st_size for f in store_files(path))
    if args.child == "cold-open":
        return timed_open(path, args.tokens, args.device, args.batch, args.depth)
    if args.child == "cold-read":
        n, dt = plain_read(path, destination(files_bytes))
        out = {"cold_plain_gbps": n / dt / 1e9}
        return out
    if args.child == "cold-parallel":
        n, dt = parallel_read(path, destination(files_bytes))
        return {"cold_parallel_gbps": n / dt / 1e9}
    # hot: warm the page cache, then the open() first (one LMDB handle per process), then the baselines
    buf = destination(files_bytes)
    plain_read(path, buf)
    out = timed_open(path, args.tokens, args.device, args.batch, args.depth, bool(args.staging))
    if args.batch is not None or args.staging:
        return out
    layout = presets.deepseek_v4_flash()
    nblocks = args.tokens // layout.block_tokens
    c = time.process_time()
    plain = [plain_read(path, buf) for _ in range(3)]
    plain_cpu = (time.process_time() - c) / (sum(n for n, _ in plain) / 1e9)
    lm = [lmdb_iterate(path, buf) for _ in range(3)]
    lmdb_holds_records = lm[0][0] >= nblocks * layout.block_bytes
    gm = [store_get_many(path, layout, prompt_tokens(args.tokens), nblocks, buf) for _ in range(3)]
    out.update({
        "files_bytes": files_bytes,
        "plain_gbps": statistics.median(n / dt / 1e9 for n, dt in plain),
        "plain_cpu_s_per_gb": plain_cpu,
        "lmdb_iter_gbps": statistics.median(n / dt / 1e9 for n, dt in lm) if lmdb_holds_records else None,
        "get_many_gbps": statistics.median(n / dt / 1e9 for n, dt in gm),
    })
    return out


def spawn(args: argparse.Namespace, mode: str, store: Path, **extra: Any) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--store", str(store),
           "--tokens", str(args.tokens), "--device", args.device, "--torch-threads", str(args.torch_threads)]
    for k, v in extra.items():
        cmd += [f"--{k}", str(v)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def med(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    store = workdir / "store"
    written = write_store(f"lmdb://{store}", args.tokens, args.snapshot_interval)
    hot = [spawn(args, "hot", store) for _ in range(args.repeats)]
    per_block = [spawn(args, "hot", store, batch=1, depth=1) for _ in range(args.repeats)]
    staged = [spawn(args, "hot", store, staging=1) for _ in range(args.repeats)]
    cold_open, cold_plain, cold_par, dropped = [], [], [], False
    for _ in range(args.repeats):  # interleaved, so that drifts of the disk hit everyone alike
        dropped |= drop_cache(store)
        cold_open.append(spawn(args, "cold-open", store))
        drop_cache(store)
        cold_plain.append(spawn(args, "cold-read", store))
        drop_cache(store)
        cold_par.append(spawn(args, "cold-parallel", store))
    layout = presets.deepseek_v4_flash()
    resumed = hot[0]["resumed_bytes"]
    h = {k: med(hot, k) for k in ("open_s", "open_gbps", "plain_gbps", "get_many_gbps", "open_cpu_s_per_gb",
                                  "plain_cpu_s_per_gb")}
    h["lmdb_iter_gbps"] = None if hot[0]["lmdb_iter_gbps"] is None else med(hot, "lmdb_iter_gbps")
    h["per_block_open_gbps"] = med(per_block, "open_gbps")
    h["staging_open_gbps"] = med(staged, "open_gbps")
    h["staging_vs_plain"] = h["staging_open_gbps"] / h["plain_gbps"]
    h["speedup_vs_staging"] = h["open_gbps"] / h["staging_open_gbps"]
    h["open_vs_plain"] = h["open_gbps"] / h["plain_gbps"]
    h["open_vs_lmdb_iter"] = h["open_gbps"] / h["lmdb_iter_gbps"] if h["lmdb_iter_gbps"] else None
    h["open_vs_get_many"] = h["open_gbps"] / h["get_many_gbps"]
    h["per_block_vs_plain"] = h["per_block_open_gbps"] / h["plain_gbps"]
    h["speedup_vs_per_block"] = h["open_gbps"] / h["per_block_open_gbps"]
    c = {"open_s": med(cold_open, "open_s"), "open_gbps": med(cold_open, "open_gbps"),
         "open_cpu_s_per_gb": med(cold_open, "open_cpu_s_per_gb"),
         "plain_gbps": med(cold_plain, "cold_plain_gbps"), "parallel_gbps": med(cold_par, "cold_parallel_gbps")}
    c["disk_gbps"] = max(c["plain_gbps"], c["parallel_gbps"])
    c["ideal_s"] = resumed / (c["disk_gbps"] * 1e9)
    c["open_vs_ideal"] = c["open_s"] / c["ideal_s"]  # target <= 1.1
    return {
        "config": {"layout": layout.name, "tokens": args.tokens, "blocks": args.tokens // layout.block_tokens,
                   "block_bytes": layout.block_bytes, "snapshot_bytes": layout.snapshot_bytes,
                   "resumed_bytes": resumed, "files_bytes": hot[0]["files_bytes"],
                   "snapshot_interval": args.snapshot_interval, "repeats": args.repeats,
                   "device": args.device, "torch_threads": args.torch_threads, "statistic": "median", "drop_caches_writable": dropped,
                   "workdir": str(workdir)},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count(), "note": "shared machine: other jobs ran on the same CPUs"},
        "write": written,
        "hot": h, "cold": c,
        "targets": {"hot_open_vs_plain": 0.6, "cold_open_vs_ideal": 1.1},
        "runs": {"hot": hot, "per_block": per_block, "staging": staged, "cold_open": cold_open, "cold_plain": cold_plain,
                 "cold_parallel": cold_par},
    }


def table(res: dict[str, Any]) -> str:
    c, h, k = res["config"], res["hot"], res["cold"]
    t = res["targets"]
    ok = lambda good: "meets" if good else "misses"  # noqa: E731
    return "\n".join([
        f"resume: {c['layout']}, {c['tokens']} tokens = {c['blocks']} blocks + 1 snapshot "
        f"({c['resumed_bytes'] / 1e6:.0f} MB resumed; store files {c['files_bytes'] / 1e6:.0f} MB), "
        f"new process each, median of {c['repeats']}, device {c['device']}",
        f"{'hot (page cache)':<34}{'GB/s':>8}{'open() / this':>16}",
        f"{'  plain read() of the store files':<34}{h['plain_gbps']:>8.2f}{h['open_vs_plain']:>16.2f}",
        (f"{'  py-lmdb cursor, values copied':<34}{h['lmdb_iter_gbps']:>8.2f}{h['open_vs_lmdb_iter']:>16.2f}"
         if h["lmdb_iter_gbps"] else f"{'  py-lmdb cursor':<34}{'n/a':>8}   (records are not in LMDB)"),
        f"{'  store get_many (verified)':<34}{h['get_many_gbps']:>8.2f}{h['open_vs_get_many']:>16.2f}",
        f"{'  open() per block (~ before)':<34}{h['per_block_open_gbps']:>8.2f}"
        f"{h['speedup_vs_per_block']:>16.2f}",
        f"{'  open() via staging ring':<34}{h['staging_open_gbps']:>8.2f}{h['speedup_vs_staging']:>16.2f}"
        f"   (ratio to plain read {h['staging_vs_plain']:.2f})",
        f"{'  open() batched':<34}{h['open_gbps']:>8.2f}   ({h['open_s'] * 1e3:.1f} ms)",
        f"{'  CPU s/GB: open() / plain read':<34}{h['open_cpu_s_per_gb']:>8.3f}{h['plain_cpu_s_per_gb']:>16.3f}"
        f"   (every thread of the process; less sensitive to other jobs than wall time)",
        f"{'cold (fadvise DONTNEED)':<34}{'GB/s':>8}",
        f"{'  plain read(), 1 thread':<34}{k['plain_gbps']:>8.2f}",
        f"{'  pread, 4 threads':<34}{k['parallel_gbps']:>8.2f}",
        f"{'  open() batched':<34}{k['open_gbps']:>8.2f}   ({k['open_s'] * 1e3:.1f} ms; ideal "
        f"{k['ideal_s'] * 1e3:.1f} ms at {k['disk_gbps']:.2f} GB/s: {k['open_vs_ideal']:.2f}x; "
        f"CPU {k['open_cpu_s_per_gb']:.3f} s/GB)",
        f"targets: hot open()/plain read {h['open_vs_plain']:.2f} ({ok(h['open_vs_plain'] >= t['hot_open_vs_plain'])}"
        f" >= {t['hot_open_vs_plain']}); cold open()/ideal {k['open_vs_ideal']:.2f} "
        f"({ok(k['open_vs_ideal'] <= t['cold_open_vs_ideal'])} <= {t['cold_open_vs_ideal']})",
        "machine shared with other jobs: figures are medians, compare ratios within the run",
    ])


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    h, k = res["hot"], res["cold"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["plain read", "py-lmdb", "get_many", "open()\nper block", "open()\nstaging", "open()\nbatched"]
    vals = [h["plain_gbps"], h["lmdb_iter_gbps"] or 0.0, h["get_many_gbps"], h["per_block_open_gbps"],
            h["staging_open_gbps"], h["open_gbps"]]
    bars = a1.bar(names, vals, color=["grey"] * 3 + ["tab:orange", "tab:orange", "tab:blue"])
    a1.bar_label(bars, labels=[f"{v / h['plain_gbps']:.2f}x" for v in vals], fontsize=8)
    a1.set_title("hot page cache (ratio to plain read)")
    a1.set_ylabel("GB/s")
    names = ["read()\n1 thread", "pread\n4 threads", "open()\nbatched"]
    vals = [k["plain_gbps"], k["parallel_gbps"], k["open_gbps"]]
    bars = a2.bar(names, vals, color=["grey", "grey", "tab:blue"])
    a2.bar_label(bars, labels=[f"{v / k['disk_gbps']:.2f}x" for v in vals], fontsize=8)
    a2.set_title("cold (ratio to the disk's bandwidth)")
    c = res["config"]
    fig.suptitle(f"open() of a {c['tokens']}-token Flash prompt from LMDB, new process (median of {c['repeats']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16K tokens, 3 repeats, JSON only")
    ap.add_argument("--tokens", type=int, help="prompt tokens, a multiple of 128 (default 16384 quick, 65536)")
    ap.add_argument("--repeats", type=int, help="processes per measurement (default 3 quick, 5)")
    ap.add_argument("--snapshot-interval", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="the resuming cache's device (cpu or cuda)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads in the timed processes (default 1: on a machine whose "
                         "cores other jobs share, OpenMP teams stall on descheduled threads)")
    ap.add_argument("--dir", type=Path, default=None, help="filesystem to measure (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--child", choices=["hot", "cold-open", "cold-read", "cold-parallel"], help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--staging", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (16384 if args.quick else 65536)
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.tokens % 128 or args.tokens <= 0:
        ap.error(f"--tokens: expected a positive multiple of 128, got {args.tokens}")
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tkv-resume-bench-", dir=args.dir))
    try:
        res = run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(res))
    (args.out / "resume.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out / 'resume.json'}")
    if not args.quick:
        plot(res, args.out / "resume.png")
        print(f"wrote {args.out / 'resume.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
