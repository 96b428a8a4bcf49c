"""One SGLang server process's L3 traffic, run as a subprocess by the tests.

    python _worker.py STORE write SEED FIRST N   # write pages [FIRST, FIRST+N) of chain SEED
    python _worker.py STORE read SEED N          # print JSON: leading hits and page digests

Page bytes are a function of (SEED, page number), so the parent can check them.
"""

from __future__ import annotations

import hashlib
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
            n = int(sys.argv[4])
            keys = env.page_keys(n, seed)
            hits = backend.batch_exists(keys)
            idx = pool.alloc(n * env.PAGE)
            ok = backend.batch_get_v1(keys[:hits], idx[:hits * env.PAGE])
            digests = [hashlib.sha256(b).hexdigest() for b in env.page_bytes(pool, idx[:hits * env.PAGE])]
            print(json.dumps({"hits": hits, "ok": ok, "digests": digests}))
    finally:
        backend.close()


if __name__ == "__main__":
    main()
