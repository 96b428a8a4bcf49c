"""LMDB keeps lifetime hit / miss / corrupt / eviction counters across processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tiered_kv.storage import LmdbStore, PutItem, RecordKey

FP = "kvl1-lifetime-test"


def _item(i: int, n: int = 500) -> PutItem:
    return PutItem(key=RecordKey.block(bytes([i]) * 32), parent_hash=b"\0" * 32, token_digest=b"\1" * 32,
                   payload=np.full(n, i, np.uint8))


def test_counters_add_up_over_processes_and_reopen(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with LmdbStore(path, layout_fingerprint=FP) as store:
        store.put_many([_item(1), _item(2)])
        assert store.get(_item(1).key, np.empty(500, np.uint8)) is not None   # hit
        assert store.get(_item(9).key, np.empty(500, np.uint8)) is None       # miss
    code = ("import numpy as np; from tiered_kv.storage import LmdbStore, RecordKey; "
            f"s = LmdbStore({str(path)!r}, layout_fingerprint={FP!r}); "
            "s.get(RecordKey.block(bytes([2]) * 32), np.empty(500, np.uint8)); s.close()")
    subprocess.run([sys.executable, "-c", code], check=True)
    with LmdbStore(path, layout_fingerprint=FP, readonly=True) as store:
        s = store.stats()
        assert (s["lifetime_hits"], s["lifetime_misses"], s["lifetime_puts"]) == (2, 1, 2)
        assert s["hits"] == 0  # this handle's own activity
