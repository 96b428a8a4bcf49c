"""The LMDB store on a full disk and with few file descriptors.

* ``gc`` frees a full disk: the index is copy-on-write, so even a delete needs new pages;
  the store keeps ``index.reserve`` for that and gives it to the deletes (a real 8 MiB
  tmpfs, filled by the store itself; skipped where mounting is not permitted).
* Writes that fail on a full disk are counted and logged once, not once per record.
* Reads keep one descriptor per segment at most up to a bound (LRU): a store of 2,000
  segments reads and writes under ``ulimit -n 256``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import resource
from pathlib import Path

import numpy as np
import pytest
import torch

from storage_helpers import FP, item_for, make_key, payload_for, verify_all
from tiered_kv import presets
from tiered_kv.storage import LmdbStore, StoreFullError
from tiered_kv.storage.lmdb.maintenance import Maintenance

FORK = mp.get_context("fork")
TINY_FP = presets.tiny().fingerprint
RECORD = 20_000


def _fill(where: Path, fingerprint: str = TINY_FP) -> list:
    """Write records until the disk is full; returns the keys stored."""
    stored = []
    with LmdbStore(where, layout_fingerprint=fingerprint, segment_bytes=1 << 20) as store:
        with pytest.raises(StoreFullError):
            for i in range(10_000):
                store.put_many([item_for(make_key(i), RECORD)])
                stored.append(make_key(i))
    return stored


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_gc_frees_a_full_disk(tmpfs_8m: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_kv.cli.main import main

    where = tmpfs_8m / "store"
    stored = _fill(where)
    assert len(stored) > 100 and _free(tmpfs_8m) < 64 << 10  # really full
    assert (where / "index.reserve").is_file()
    with LmdbStore(where, layout_fingerprint=TINY_FP) as store:
        with pytest.raises(StoreFullError):
            store.put_many([item_for(make_key(10**6), RECORD)])
        got = store.gc(2 << 20)  # the API
        assert got["full_disk"] and got["bytes"] <= 2 << 20 and got["evicted"] > 0
        assert _free(tmpfs_8m) > 4 << 20  # the holes were punched: the space is back
        kept = set(store)
        assert verify_all(store, sizes={k: RECORD for k in kept}) == len(kept) > 0
        assert store.put_many([item_for(make_key(10**6), RECORD)]) == [True]  # writes work again
    assert (where / "index.reserve").is_file()  # taken back for the next time

    stored = _fill_more(where, start=2 * 10**6)
    assert _free(tmpfs_8m) < 64 << 10
    assert main(["gc", "--store", str(where), "--max-bytes", "2M"]) == 0  # the CLI, as the issue ran it
    out, err = capsys.readouterr()
    assert "records" in out and err == ""
    assert _free(tmpfs_8m) > 4 << 20
    with LmdbStore(where, layout_fingerprint=TINY_FP) as store:
        kept = set(store)
        assert store.stats()["bytes"] <= 2 << 20
        assert verify_all(store, sizes={k: RECORD for k in kept}) == len(kept) > 0


def test_gc_on_a_full_disk_needs_the_reserve_when_the_index_has_no_free_page(
        tmpfs_8m: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compact index (just rebuilt: no free page inside data.mdb), then something else
    fills the disk: even a one-record delete needs a new page. Without the reserve gc
    fails; with it, gc frees the disk."""
    from tiered_kv.storage.lmdb.rebuild import rebuild_index

    where = tmpfs_8m / "store"
    with LmdbStore(where, layout_fingerprint=TINY_FP, segment_bytes=1 << 20) as store:
        for i in range(0, 200, 50):
            store.put_many([item_for(make_key(j), RECORD) for j in range(i, i + 50)])
    rebuild_index(where, TINY_FP)
    LmdbStore(where, layout_fingerprint=TINY_FP).close()  # a writable open takes the reserve
    assert (where / "index.reserve").is_file()
    try:
        with open(tmpfs_8m / "other-file", "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
    except OSError:
        pass
    assert _free(tmpfs_8m) == 0
    with LmdbStore(where, layout_fingerprint=TINY_FP) as store:
        with monkeypatch.context() as m:  # the control: the reserve kept back
            m.setattr(Maintenance, "release_reserve", lambda self: False)
            with pytest.raises(StoreFullError):
                store.gc(1 << 20)
        got = store.gc(1 << 20)
        assert got["full_disk"] and got["bytes"] <= 1 << 20 and _free(tmpfs_8m) > 2 << 20
        kept = set(store)
        assert verify_all(store, sizes={k: RECORD for k in kept}) == len(kept) > 0


def _fill_more(where: Path, start: int) -> list:
    stored = []
    with LmdbStore(where, layout_fingerprint=TINY_FP) as store:
        with pytest.raises(StoreFullError):
            for i in range(start, start + 10_000):
                store.put_many([item_for(make_key(i), RECORD)])
                stored.append(make_key(i))
    return stored


def test_a_new_store_on_a_full_disk_is_an_error_not_a_bus_error(tmpfs_8m: Path) -> None:
    """LMDB writes its lock file through a mapping: a page the full disk cannot give is a
    SIGBUS. The store allocates it first, or refuses."""
    _fill(tmpfs_8m / "store")
    (tmpfs_8m / "store" / "index.reserve").unlink()  # leave nothing at all
    try:  # take the last free blocks too
        with open(tmpfs_8m / "filler", "wb") as f:
            while True:
                f.write(bytes(4096))
                f.flush()
    except OSError:
        pass
    assert _free(tmpfs_8m) == 0
    with pytest.raises(StoreFullError, match="lock file"):
        LmdbStore(tmpfs_8m / "new", layout_fingerprint=FP)
    with LmdbStore(tmpfs_8m / "store", layout_fingerprint=TINY_FP, readonly=True) as store:
        assert len(store) > 100  # reading the full store still works


def test_failed_writes_are_counted_and_logged_once(tmpfs_8m: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tiered_kv.disk import DiskTier

    where = tmpfs_8m / "store"
    _fill(where)
    layout = presets.tiny()
    caplog.set_level(logging.WARNING, logger="tiered_kv.disk")
    with LmdbStore(where, layout_fingerprint=TINY_FP) as store:
        disk = DiskTier(store, layout)
        for i in range(40):
            key = make_key(5 * 10**6 + i)
            item = item_for(key, RECORD)
            disk.submit(key, item.parent_hash, item.token_digest, torch.from_numpy(payload_for(key, RECORD)))
        disk.flush()
        assert disk.stats()["disk_write_errors"] == 40 and disk.writes == 0
        warned = [r for r in caplog.records if r.name == "tiered_kv.disk"]
        assert len(warned) == 1 and "further failures are counted" in warned[0].getMessage()
        store.gc(2 << 20)  # room again: the next write succeeds and says how many failed
        key = make_key(6 * 10**6)
        item = item_for(key, RECORD)
        disk.submit(key, item.parent_hash, item.token_digest, torch.from_numpy(payload_for(key, RECORD)))
        disk.close()
        assert disk.writes == 1
        warned = [r.getMessage() for r in caplog.records if r.name == "tiered_kv.disk"]
        assert len(warned) == 2 and "after 40 failed" in warned[1]


# ----------------------------------------------------------------------------- descriptors
SEGMENTS = 2000
PAYLOAD = 100


def _child_under_ulimit(where: str, bound: int, result) -> None:
    """In a forked child with RLIMIT_NOFILE 256: read all 2,000 segments at once and in
    batches, write new records into new segments, read those back."""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        keys = [make_key(i) for i in range(SEGMENTS)]
        with LmdbStore(where, layout_fingerprint=FP, segment_bytes=4096, max_open_segments=bound,
                       io_threads=4) as store:
            outs = [np.empty(PAYLOAD, np.uint8) for _ in keys]
            hits = sum(m is not None for m in store.get_many(keys, outs))
            exact = all(np.array_equal(o, payload_for(k, PAYLOAD)) for k, o in zip(keys, outs))
            rng = np.random.default_rng(0)
            for _ in range(5):
                pick = [keys[i] for i in rng.choice(SEGMENTS, 300, replace=False)]
                hits += sum(m is not None for m in store.get_many(pick, [np.empty(PAYLOAD, np.uint8)
                                                                        for _ in pick]))
            new = [make_key(10**6 + i) for i in range(50)]
            written = sum(sum(store.put_many([item_for(k, PAYLOAD)])) for k in new)
            hits += sum(m is not None for m in store.get_many(new, [np.empty(PAYLOAD, np.uint8) for _ in new]))
            result.put({"hits": hits, "exact": exact, "written": written,
                        "open": store.stats()["open_segment_files"], "segments": store.stats()["segments"]})
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result.put({"error": f"{type(e).__name__}: {e}"})


def _run_child(where: Path, bound: int) -> dict:
    result = FORK.Queue()
    proc = FORK.Process(target=_child_under_ulimit, args=(str(where), bound, result))
    proc.start()
    got = result.get(timeout=600)
    proc.join(60)
    return got


@pytest.fixture
def fast_dir(tmp_path: Path):
    """A 64 MiB tmpfs (2,000 segments written with a sync each take a minute on a loaded
    disk), or tmp_path where mounting is not permitted."""
    import subprocess

    mnt = tmp_path / "fast"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, timeout=30)
    try:
        yield mnt
    finally:
        if r.returncode == 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_reads_and_writes_under_ulimit_256_with_2000_segments(fast_dir: Path) -> None:
    where = fast_dir / "s"
    with LmdbStore(where, layout_fingerprint=FP, segment_bytes=4096) as store:
        for i in range(SEGMENTS):  # one batch per segment (each batch pads to 4 KiB)
            store.put_many([item_for(make_key(i), PAYLOAD)])
        assert store.stats()["segments"] == SEGMENTS
    got = _run_child(where, bound=64)
    assert "error" not in got, got
    assert got["hits"] == SEGMENTS + 5 * 300 + 50 and got["exact"] and got["written"] == 50
    assert got["open"] <= 64 and got["segments"] == SEGMENTS + 50
    # without the bound the same work runs out of descriptors: misses, or a write's EMFILE
    unbounded = _run_child(where, bound=10**6)
    assert "Too many open files" in unbounded.get("error", "") or \
        unbounded["hits"] < SEGMENTS + 5 * 300 + 50


def test_warm_start_on_a_full_disk_prints_one_summary_line(tmpfs_8m: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The issue's run printed 893 warnings, one per record: now the disk tier's warning
    is dropped in favour of warm-start's own summary, one line with the count."""
    import json

    from tiered_kv.cli.main import ExitCode, main

    where = tmpfs_8m / "store"
    _fill(where)
    (where / "index.reserve").unlink()  # nothing left for anyone
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": [(i * 7 + j) % 256 for j in range(300)]}) + "\n"
                               for i in range(6)))
    caplog.set_level(logging.WARNING)
    code = main(["warm-start", "--store", str(where), "--prompts", str(prompts)])
    out, err = capsys.readouterr()
    assert code == ExitCode.FAILURE
    assert err.count("\n") == 1 and "records could not be written" in err, err
    assert not [r for r in caplog.records if r.name == "tiered_kv.disk"]
