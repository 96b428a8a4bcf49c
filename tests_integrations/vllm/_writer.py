"""A second vLLM engine process for test_two_processes_on_one_store_and_a_killed_writer.

Stores batches of 4 chunks (keys ``chunk_keys(f"writer-{b}", 4)``) into the store at
``argv[1]`` through the real tiering manager (engine id ``argv[2]``), printing "batch-<b> stored" after each of
the first two, and keeps storing until it is killed (at most 200 batches).
"""

from __future__ import annotations

import sys

from _vllm_engine import Engine, chunk_keys


def main() -> None:
    engine = Engine(sys.argv[1], num_chunks=8, engine_id=sys.argv[2])
    try:
        for b in range(200):
            engine.store(chunk_keys(f"writer-{b}", 4))
            engine.wait_jobs()
            if b < 2:
                print(f"batch-{b} stored", flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
