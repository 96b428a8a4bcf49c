"""bench/buffer_faults.py on a tiny buffer (not a timing test): both mappings sampled, the
switch between them restored, the JSON written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tiered_kv.storage.os import libc

ROOT = Path(__file__).resolve().parent.parent


def test_buffer_faults_samples_both_mappings_and_restores_the_switch(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("bench_buffer_faults", ROOT / "bench" / "buffer_faults.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    before = libc.SHARED_BUFFERS
    result = bench.main(["--mib", "4", "--rounds", "2", "--per-round", "2", "--out", str(tmp_path)])
    assert libc.SHARED_BUFFERS == before
    saved = json.loads((tmp_path / "buffer_faults.json").read_text())
    assert {k: len(v) for k, v in saved["cpu_ms"].items()} == {"private": 4, "shared": 4}
    assert saved["ratio_private_to_shared"] == result["ratio_private_to_shared"] > 0
