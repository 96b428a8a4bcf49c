"""One SGLang server process's L3 traffic, run as a subprocess by the tests.

    python _worker.py STORE write SEED FIRST N   # write pages [FIRST, FIRST+N) of chain SEED

Page bytes are a function of (SEED, page number), so the parent can check them.
"""

from __future__ import annotations

import json
import sys

import _sglang_env as env
import torch


def page_data(pool, seed: int, page: int, slot: int) -> None:
    env.fill_pages(pool, torch.arange(slot, slot + env.PAGE), seed * 1000 + page)


def main() -> None:
    store, op, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pool = env.mla_host_pool("page_first")
    backend = env.create_backend(env.storage_config(store), pool)
    try:
        if op == "write":
            first, n = int(sys.argv[4]), int(sys.argv[5])
            keys = env.page_keys(first + n, seed)[first:]
            idx = pool.alloc(n * env.PAGE)
            for i in range(n):
                page_data(pool, seed, first + i, int(idx[i * env.PAGE]))
            ok = backend.batch_set_v1(keys, idx)
            print(json.dumps({"written": sum(ok)}))
        else:
            raise SystemExit(f"unknown op {op!r}")
    finally:
        backend.close()


if __name__ == "__main__":
    main()
