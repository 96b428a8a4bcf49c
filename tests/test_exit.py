"""A process that exits without ``shutdown()`` / ``close()`` loses nothing and prints no
traceback (storage/os/at_exit.py), and a cache refuses use after ``shutdown()``.

The exits run in subprocesses (tests/_exit_worker.py): the interpreter's own exit order
(threading atexit callbacks, then pools refusing work) is what is under test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiered_kv import CacheShutdownError, TieredKVCache, presets
from tiered_kv.disk import DiskTierClosedError
from tiered_kv.storage import RecordKey, open_store
from tiered_kv.storage.chain.journal import UploadJournal

HERE = Path(__file__).parent
FP = presets.tiny().fingerprint


def exit_without_shutdown(*jobs: str) -> str:
    """Run the worker (each job ``MODE=URL[,URL]``, in one process); returns its stderr
    (it must exit 0)."""
    done = subprocess.run([sys.executable, str(HERE / "_exit_worker.py"), *jobs], cwd=HERE,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stderr


def keys_of(url: str) -> set[RecordKey]:
    with open_store(url, layout_fingerprint=FP) as store:
        return set(store)


def test_exit_without_shutdown_loses_nothing(tmp_path: Path) -> None:
    """One process writes through a cache on a single store, a cache on a chain, and a
    chain directly, and exits without shutting any down: every queued write landed, the
    chains uploaded (closed at exit), and nothing was printed."""
    single, near, far = (f"lmdb://{tmp_path / 'single'}", f"lmdb://{tmp_path / 'near'}",
                         f"zarr://{tmp_path / 'far'}")
    direct_near, direct_far = f"lmdb://{tmp_path / 'direct-near'}", f"zarr://{tmp_path / 'direct-far'}"
    err = exit_without_shutdown(f"cache={single}", f"cache={near},{far}", f"chain={direct_near},{direct_far}")
    assert err == ""
    expected = keys_of(single)
    assert len(expected) == 6  # 3 blocks and their snapshots
    assert keys_of(near) == expected
    assert keys_of(far) == expected
    with UploadJournal(tmp_path / "near") as journal:
        assert journal.levels() == {}
    assert len(keys_of(direct_near)) == 4 and keys_of(direct_far) == keys_of(direct_near)


def test_exit_with_the_far_level_down_journals_every_upload(tmp_path: Path) -> None:
    single, near = f"lmdb://{tmp_path / 'single'}", f"lmdb://{tmp_path / 'near'}"
    err = exit_without_shutdown(f"cache={single}", f"far-down={near}")
    assert "Traceback" not in err and "cannot schedule" not in err, err
    # only the warnings that the far level is down and that its uploads wait in the journal
    assert all("down://far" in line or "the next chain opened on it resumes them" in line
               for line in err.splitlines() if line.strip()), err
    expected = keys_of(single)
    assert len(expected) == 6 and keys_of(near) == expected
    with UploadJournal(tmp_path / "near") as journal:
        owed = {key for key, _ in journal.scan("down://far", limit=100)}
    assert owed == expected  # the next process on this level 0 resumes them


# ------------------------------------------------------------------ after shutdown()
def test_use_after_shutdown_raises_a_clear_error(tmp_path: Path) -> None:
    layout = presets.tiny()
    cache = TieredKVCache(layout, num_blocks=8, num_state_slots=1, store=f"lmdb://{tmp_path / 's'}")
    req = cache.open(list(range(40)))
    cache.shutdown()
    cache.shutdown()  # idempotent
    for call, what in ((lambda: cache.close(req), "close"), (lambda: cache.open([1, 2, 3]), "open"),
                       (lambda: cache.flush(), "flush"), (lambda: cache.reserve(req, 8), "request calls")):
        with pytest.raises(CacheShutdownError, match=f"^{what}: the cache was shut down .*create a new"):
            call()
    with pytest.raises(DiskTierClosedError, match="disk tier is closed"):
        cache.disk.submit(RecordKey.block(bytes(32)), bytes(32), bytes(32), torch.zeros(4, dtype=torch.uint8))
