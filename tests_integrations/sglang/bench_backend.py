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
"""

from __future__ import annotations

import argparse
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


Timing = tuple[float, float, float, float]  # write s, read s, write CPU s, read CPU s


def run_adapter(layout: str, pages: int) -> Timing:
    with tempfile.TemporaryDirectory() as d:
        p = pool(layout, pages)
        b = env.create_backend(env.storage_config(f"lmdb://{d}/kv"), p)
        keys = env.page_keys(pages)
        src, dst = p.alloc(pages * PAGE), p.alloc(pages * PAGE)
        p.kv_buffer.view(torch.uint8).random_(0, 256)
        t0, c0 = time.perf_counter(), time.process_time()
        assert all(b.batch_set_v1(keys, src))
        t1, c1 = time.perf_counter(), time.process_time()
        assert all(b.batch_get_v1(keys, dst))
        t2, c2 = time.perf_counter(), time.process_time()
        b.close()
        return t1 - t0, t2 - t1, c1 - c0, c2 - c1


def run_store(pages: int) -> Timing:
    page_bytes = PAGE * LAYERS * (KV_LORA + ROPE) * 2
    with tempfile.TemporaryDirectory() as d:
        store = open_store(f"lmdb://{d}/kv", layout_fingerprint=SGLANG_LAYOUT_FINGERPRINT)
        payloads = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8).numpy() for _ in range(pages)]
        outs = [torch.zeros(page_bytes, dtype=torch.uint8).numpy() for _ in range(pages)]  # touched, like a pool
        from tiered_kv.storage import RecordKey
        keys = [RecordKey.block(bytes([i % 256, i // 256]) + bytes(30)) for i in range(pages)]
        t0, c0 = time.perf_counter(), time.process_time()
        store.put_many([PutItem(k, bytes(32), bytes(32), v) for k, v in zip(keys, payloads)])
        t1, c1 = time.perf_counter(), time.process_time()
        assert all(m is not None for m in store.get_many(keys, outs))
        t2, c2 = time.perf_counter(), time.process_time()
        store.close()
        return t1 - t0, t2 - t1, c1 - c0, c2 - c1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
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
    print(f"{a.pages} pages x {page_mb:.2f} MB, medians of {a.repeat}")
    print(f"{'':28s} {'write GB/s':>10s} {'read GB/s':>10s} {'ratio to store w / r':>22s} {'paired w / r':>13s} "
          f"{'CPU s/GB w / r':>16s}")
    for name, label in (("store", "store put_many/get_many"), ("page_first", "adapter v1 page_first"),
                        ("layer_first", "adapter v1 layer_first")):
        w, r, cw, cr = med[name]
        ratio = "(baseline)" if name == "store" else f"{bw / w:.2f} / {br / r:.2f}"
        pair = "" if name == "store" else f"{paired[name][0]:.2f} / {paired[name][1]:.2f}"
        print(f"{label:28s} {gb / w:10.2f} {gb / r:10.2f} {ratio:>22s} {pair:>13s} {cw / gb:7.2f} / {cr / gb:.2f}")
    out = Path(__file__).resolve().parents[2] / "bench" / "results" / "sglang_backend.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "pages": a.pages, "page_bytes": int(page_mb * 1e6), "repeat": a.repeat,
        "runs_columns": ["write s", "read s", "write CPU s", "read CPU s"], "runs": runs,
        "median_gb_s": {k: {"write": gb / v[0], "read": gb / v[1]} for k, v in med.items()},
        "median_cpu_s_per_gb": {k: {"write": v[2] / gb, "read": v[3] / gb} for k, v in med.items()},
        "ratio_to_store": {k: {"write": bw / med[k][0], "read": br / med[k][1]} for k in ("page_first", "layer_first")},
        "median_paired_ratio_to_store": {k: {"write": v[0], "read": v[1]} for k, v in paired.items()},
        "machine": "2 shared CPU cores, no GPU"}, indent=1))

if __name__ == "__main__":
    main()
