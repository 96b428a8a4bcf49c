"""Overhead of the SGLang adapter over its store: pages/s of batch_set_v1 / batch_get_v1
against put_many / get_many of the same records on the same LMDB store (the baseline).

    .venv-sglang/bin/python tests_integrations/sglang/bench_backend.py [--pages 32] [--repeat 5]

Geometry: DeepSeek-V3/R1-like MLA rows (576 bf16 = 1152 B), 61 layers, 16-token pages
(1.12 MB a page). Every read is cold: the store writes with O_DIRECT. Prints medians of
--repeat runs, each on a fresh store, as GB/s, the ratio to the bare store (of the
medians, and the median of each repeat's own ratio: a repeat runs the three back to back),
and CPU
seconds per GB (the whole process, all threads: less sensitive than wall time to other
jobs on the machine); writes bench/results/sglang_backend.json.

Python's garbage collector: SGLang's import leaves ~500K objects that the collector tracks,
so a full (generation 2) collection takes 0.1-0.6 s here, and one landing inside a timed
phase of ~0.05 s made a contender look 3-5x slower ("slow mode"). Each timed phase starts
right after ``gc.collect()``, so what is timed is the copy, not the collector's schedule;
``--gc-as-is`` times them without it. Either way the collector's pauses inside the timed
phases are measured (``gc.callbacks``) and printed, per contender, with the largest one.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _sglang_env as env  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.device_pool_info import MLABufferInfo  # noqa: E402
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402

from tiered_kv.storage import PutItem, open_store  # noqa: E402
from tiered_kv.integrations.sglang import SGLANG_LAYOUT_FINGERPRINT  # noqa: E402

LAYERS, KV_LORA, ROPE, PAGE = 61, 512, 64, 16


def pool(layout: str, pages: int) -> MLATokenToKVPoolHost:
    bufs = tuple(torch.zeros(PAGE, 1, KV_LORA + ROPE, dtype=torch.bfloat16) for _ in range(LAYERS))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64),
                         layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PAGE,
                         kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, kv_cache_dim=KV_LORA + ROPE,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    with host_memory_budget_scope(8 << 30):
        return MLATokenToKVPoolHost(info, 1.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=2 * pages * PAGE, start_layer=0, end_layer=LAYERS,
                                    target_layer_num=LAYERS)


Timing = tuple[float, float, float, float, float, float]
# write s, read s, write CPU s, read CPU s, GC pause s in the write, GC pause s in the read


class GcPauses:
    """The collector's pauses (s), from ``gc.callbacks``: their running sum and the largest."""

    def __init__(self) -> None:
        self.total = self.largest = 0.0
        self.full = 0  # generation-2 collections
        self._t: float | None = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            pause = time.perf_counter() - self._t
            self._t = None
            self.total += pause
            self.largest = max(self.largest, pause)
            self.full += info.get("generation") == 2


PAUSES = GcPauses()
COLLECT_FIRST = True  # --gc-as-is turns it off
INSIDE = {"full": 0, "largest": 0.0}  # full collections inside timed phases, and their largest pause


def timed(fn) -> tuple[float, float, float]:
    """``fn()``'s wall s, CPU s and the GC pause s inside it, after a full collection
    (unless --gc-as-is) so that no collection already due lands inside."""
    if COLLECT_FIRST:
        gc.collect()
    g0, f0, PAUSES.largest = PAUSES.total, PAUSES.full, 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    t1, c1 = time.perf_counter(), time.process_time()
    INSIDE["full"] += PAUSES.full - f0
    INSIDE["largest"] = max(INSIDE["largest"], PAUSES.largest)
    return t1 - t0, c1 - c0, PAUSES.total - g0


def _timing(write: tuple[float, float, float], read: tuple[float, float, float]) -> Timing:
    return write[0], read[0], write[1], read[1], write[2], read[2]


def run_adapter(layout: str, pages: int) -> Timing:
    with tempfile.TemporaryDirectory() as d:
        p = pool(layout, pages)
        b = env.create_backend(env.storage_config(f"lmdb://{d}/kv"), p)
        keys = env.page_keys(pages)
        src, dst = p.alloc(pages * PAGE), p.alloc(pages * PAGE)
        p.kv_buffer.view(torch.uint8).random_(0, 256)
        w = timed(lambda: _check(b.batch_set_v1(keys, src)))
        r = timed(lambda: _check(b.batch_get_v1(keys, dst)))
        b.close()
        return _timing(w, r)


def run_store(pages: int) -> Timing:
    page_bytes = PAGE * LAYERS * (KV_LORA + ROPE) * 2
    with tempfile.TemporaryDirectory() as d:
        store = open_store(f"lmdb://{d}/kv", layout_fingerprint=SGLANG_LAYOUT_FINGERPRINT)
        payloads = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8).numpy() for _ in range(pages)]
        outs = [torch.zeros(page_bytes, dtype=torch.uint8).numpy() for _ in range(pages)]  # touched, like a pool
        from tiered_kv.storage import RecordKey
        keys = [RecordKey.block(bytes([i % 256, i // 256]) + bytes(30)) for i in range(pages)]
        w = timed(lambda: store.put_many([PutItem(k, bytes(32), bytes(32), v) for k, v in zip(keys, payloads)]))
        r = timed(lambda: _check([m is not None for m in store.get_many(keys, outs)]))
        store.close()
        return _timing(w, r)


def _check(results) -> None:
    assert all(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gc-as-is", action="store_true",
                    help="do not gc.collect() before each timed phase (the collector runs when it is due)")
    a = ap.parse_args()
    global COLLECT_FIRST
    COLLECT_FIRST = not a.gc_as_is
    tracked = len(gc.get_objects())
    page_mb = PAGE * LAYERS * (KV_LORA + ROPE) * 2 / 1e6
    run_store(a.pages)  # warm-up
    runs: dict[str, list[Timing]] = {"store": [], "page_first": [], "layer_first": []}
    names = list(runs)
    for r in range(a.repeat):  # interleaved, each going first in turn, so machine noise hits all three alike
        for name in names[r % 3:] + names[:r % 3]:
            runs[name].append(run_store(a.pages) if name == "store" else run_adapter(name, a.pages))
    med = {k: tuple(statistics.median(t[j] for t in v) for j in range(4)) for k, v in runs.items()}
    bw, br = med["store"][:2]
    gb = a.pages * page_mb / 1e3
    # each repeat runs the three back to back: its own ratios are the least exposed to drift
    paired = {k: tuple(statistics.median(s[j] / t[j] for s, t in zip(runs["store"], runs[k])) for j in (0, 1))
              for k in ("page_first", "layer_first")}
    gc_med = {k: (statistics.median(t[4] for t in v), statistics.median(t[5] for t in v), max(max(t[4], t[5]) for t in v))
              for k, v in runs.items()}
    print(f"{a.pages} pages x {page_mb:.2f} MB, medians of {a.repeat}; "
          f"{'gc.collect() before each timed phase' if COLLECT_FIRST else 'GC as it comes (--gc-as-is)'}, "
          f"{tracked:,} objects tracked at start")
    print(f"{'':28s} {'write GB/s':>10s} {'read GB/s':>10s} {'ratio to store w / r':>22s} {'paired w / r':>13s} "
          f"{'CPU s/GB w / r':>16s}")
    for name, label in (("store", "store put_many/get_many"), ("page_first", "adapter v1 page_first"),
                        ("layer_first", "adapter v1 layer_first")):
        w, r, cw, cr = med[name]
        ratio = "(baseline)" if name == "store" else f"{bw / w:.2f} / {br / r:.2f}"
        pair = "" if name == "store" else f"{paired[name][0]:.2f} / {paired[name][1]:.2f}"
        print(f"{label:28s} {gb / w:10.2f} {gb / r:10.2f} {ratio:>22s} {pair:>13s} {cw / gb:7.2f} / {cr / gb:.2f}")
    print("GC pauses inside the timed phases, median s write / read, largest in any repeat:")
    for name in runs:
        gw, gr, gmax = gc_med[name]
        print(f"  {name:12s} {gw:.4f} / {gr:.4f}   largest {gmax:.4f}")
    print(f"full (generation 2) collections inside timed phases: {INSIDE['full']}, the largest pause inside one "
          f"{INSIDE['largest']:.3f} s")
    out = Path(__file__).resolve().parents[2] / "bench" / "results" / "sglang_backend.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "pages": a.pages, "page_bytes": int(page_mb * 1e6), "repeat": a.repeat,
        "runs_columns": ["write s", "read s", "write CPU s", "read CPU s", "write GC s", "read GC s"], "runs": runs,
        "gc_collect_before_phases": COLLECT_FIRST, "gc_full_inside_timed": INSIDE["full"],
        "gc_largest_pause_inside_timed_s": INSIDE["largest"], "gc_tracked_objects_at_start": tracked,
        "median_gb_s": {k: {"write": gb / v[0], "read": gb / v[1]} for k, v in med.items()},
        "median_cpu_s_per_gb": {k: {"write": v[2] / gb, "read": v[3] / gb} for k, v in med.items()},
        "ratio_to_store": {k: {"write": bw / med[k][0], "read": br / med[k][1]} for k in ("page_first", "layer_first")},
        "median_paired_ratio_to_store": {k: {"write": v[0], "read": v[1]} for k, v in paired.items()},
        "machine": "2 shared CPU cores, no GPU"}, indent=1))

if __name__ == "__main__":
    main()
