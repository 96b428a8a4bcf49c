"""Backend-specific behaviour beyond the conformance suite, and open_store."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

from storage_helpers import FP, OTHER_FP, item_for, make_key, payload_for, verify_all
from tiered_kv.storage import (
    LayoutMismatchError,
    LmdbStore,
    StoreError,
    StoreFullError,
    StoreLockedError,
    ZarrStore,
    open_store,
    record_size,
)

SIZES_100K = {make_key(i): 100_000 for i in range(200)}


# ------------------------------------------------------------------ LMDB
SIZES_10 = {make_key(i): 10 for i in range(5000)}


def test_lmdb_map_full_raises_and_keeps_data(tmp_path: Path) -> None:
    """The map (the index; here map_size=256 KiB) full is a clean StoreFullError; reads
    keep working, and the segment bytes of the refused batch are given back."""
    store = LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=1 << 30, map_size=256 << 10)
    stored: list = []
    with pytest.raises(StoreFullError, match="map full"):
        for start in range(0, 5000, 50):
            keys = [make_key(i) for i in range(start, start + 50)]
            store.put_many([item_for(k, 10) for k in keys])
            stored.extend(keys)
    assert 100 <= len(stored) < 5000
    assert verify_all(store, sizes=SIZES_10) == len(stored)
    assert store.stats()["segment_disk_bytes"] <= len(stored) * record_size(10) + (64 << 10)
    assert store.delete(stored[0])
    store.close()
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=1 << 30, map_size=256 << 10) as store:
        assert verify_all(store, sizes=SIZES_10) == len(stored) - 1


def test_lmdb_map_full_batch_is_all_or_nothing(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=1 << 30, map_size=256 << 10) as store:
        store.put_many([item_for(make_key(0), 10)])
        with pytest.raises(StoreFullError):
            store.put_many([item_for(make_key(i), 10) for i in range(1, 5000)])
        assert set(store) == {make_key(0)}


def test_lmdb_map_grows_up_to_the_limit(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=64 << 20, initial_map_size=256 << 10) as store:
        assert store.stats()["map_size"] == 256 << 10
        store.put_many([item_for(make_key(i), 10) for i in range(2000)])  # the index outgrows 256 KiB
        s = store.stats()
        assert (256 << 10) < s["map_size"] <= s["map_limit"] == (96 << 20) + (64 << 20)
        assert verify_all(store, sizes=SIZES_10) == 2000


def test_lmdb_map_limit_derived_from_max_bytes(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=100 << 20) as store:
        assert store.map_limit == 150 * (1 << 20) + (64 << 20)


def test_lmdb_same_process_open_twice_is_refused(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        with pytest.raises(StoreLockedError, match="already open in this process"):
            LmdbStore(tmp_path / "s", layout_fingerprint=FP)
        assert store.put_many([item_for(make_key(0), 10)]) == [True]
    LmdbStore(tmp_path / "s", layout_fingerprint=FP).close()  # released on close


def test_lmdb_readonly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        LmdbStore(tmp_path / "none", layout_fingerprint=FP, readonly=True)
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(0), 10)])
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, readonly=True) as store:
        assert store.get(make_key(0), np.empty(10, np.uint8)) is not None
        with pytest.raises(StoreError, match="readonly"):
            store.put_many([item_for(make_key(1), 10)])
    with pytest.raises(LayoutMismatchError):
        LmdbStore(tmp_path / "s", layout_fingerprint=OTHER_FP, readonly=True)


def test_lmdb_access_times_persist_and_order_eviction(tmp_path: Path) -> None:
    """Reads are queued and written by the next put: in-process LRU order is exact."""
    n = 100
    one = record_size(n)
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=3 * one) as store:
        store.put_many([item_for(make_key(i), n) for i in range(3)])
        before = store.stats()["newest_access_ns"]
        for i in (2, 0, 1):  # LRU order now 2, 0, 1
            store.get(make_key(i), np.empty(n, np.uint8))
        assert store.stats()["newest_access_ns"] > before
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=3 * one) as store:
        store.put_many([item_for(make_key(3), n)])
        assert not store.contains(make_key(2)) and store.contains(make_key(0))
        store.put_many([item_for(make_key(4), n)])
        assert not store.contains(make_key(0)) and store.contains(make_key(1))


def test_lmdb_stats_extra_fields(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=1 << 20) as store:
        s = store.stats()
        assert s["backend"] == "lmdb" and s["max_bytes"] == 1 << 20 and s["map_size"] <= s["map_limit"]
        assert LmdbStore.supports_multiprocess and not LmdbStore.supports_mmap_reads


def test_lmdb_sub_databases(tmp_path: Path) -> None:
    """The documented layout: records, meta, atime, lru sub-dbs."""
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(0), 10)])
    env = lmdb.open(str(tmp_path / "s"), max_dbs=4, readonly=True)
    try:
        with env.begin() as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            assert txn.get(b"layout_fingerprint", db=meta) == FP.encode()
            for name in (b"records", b"atime", b"lru"):
                assert txn.stat(env.open_db(name, txn=txn, create=False))["entries"] == 1
    finally:
        env.close()


# ------------------------------------------------------------------ Zarr
def test_zarr_group_is_readable_with_plain_zarr(tmp_path: Path) -> None:
    import zarr
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    with ZarrStore(tmp_path / "z", layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(0), 100)])
    group = zarr.open_group(str(tmp_path / "z"), mode="r")
    attrs = group.attrs["tiered_kv"]
    assert attrs["layout_fingerprint"] == FP and attrs["store_format_version"] == 1
    h = make_key(0).block_hash.hex()
    raw = sync(zarr.storage.LocalStore(str(tmp_path / "z"), read_only=True).get(
        f"blocks/{h[:2]}/{h[2:]}", prototype=default_buffer_prototype()))
    assert raw is not None and raw.to_bytes()[144:244] == payload_for(make_key(0), 100).tobytes()
    # and a LocalStore is accepted in place of a path
    with ZarrStore(zarr.storage.LocalStore(str(tmp_path / "z")), layout_fingerprint=FP) as store:
        assert store.supports_multiprocess and len(store) == 1


def test_zarr_refuses_a_foreign_group(tmp_path: Path) -> None:
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group",
                                                          "attributes": {}}))
    with pytest.raises(StoreError, match="not the metadata of a tiered_kv block store"):
        ZarrStore(tmp_path / "z", layout_fingerprint=FP)


def test_zarr_stale_partials_are_cleaned(tmp_path: Path) -> None:
    with ZarrStore(tmp_path / "z", layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(0), 100)])
    h = make_key(0).block_hash.hex()
    shard = tmp_path / "z" / "blocks" / h[:2]
    old, new = shard / f".{h[2:]}.123.dead.partial", shard / f".{h[2:]}.124.beef.partial"
    old.write_bytes(b"half a rec")
    new.write_bytes(b"in flight")
    past = time.time() - 7200
    os.utime(old, (past, past))
    with ZarrStore(tmp_path / "z", layout_fingerprint=FP) as store:
        assert len(store) == 1
    assert not old.exists() and new.exists()  # a writer may still be filling the new one


def test_zarr_two_handles_in_one_process(tmp_path: Path) -> None:
    a = ZarrStore(tmp_path / "z", layout_fingerprint=FP)
    b = ZarrStore(tmp_path / "z", layout_fingerprint=FP)
    assert a.put_many([item_for(make_key(0), 100)]) == [True]
    assert b.put_many([item_for(make_key(0), 100)]) == [False]  # write-once across writers
    assert b.get(make_key(0), np.empty(100, np.uint8)) is not None
    a.close()
    b.close()


def test_zarr_rejects_other_urls(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="file:// URL"):
        ZarrStore("s3://bucket/x", layout_fingerprint=FP)
    with ZarrStore(f"file://{tmp_path}/z", layout_fingerprint=FP) as store:
        assert store.path == tmp_path / "z"


# ------------------------------------------------------------------ open_store
def test_open_store_schemes(tmp_path: Path) -> None:
    with open_store(f"lmdb://{tmp_path}/a", layout_fingerprint=FP, max_bytes=1 << 20) as s:
        assert isinstance(s, LmdbStore) and s.max_bytes == 1 << 20
    with open_store(f"zarr://{tmp_path}/b", layout_fingerprint=FP) as s:
        assert isinstance(s, ZarrStore)
    with open_store(str(tmp_path / "c"), layout_fingerprint=FP) as s:
        assert isinstance(s, LmdbStore)
    with open_store(tmp_path / "d", layout_fingerprint=FP) as s:
        assert isinstance(s, LmdbStore)


def test_open_store_bad_urls(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lmdb:///abs/path, zarr:///abs/path"):
        open_store(f"s3://{tmp_path}/a", layout_fingerprint=FP)
    with pytest.raises(ValueError, match="expected a path after lmdb://"):
        open_store("lmdb://", layout_fingerprint=FP)  # (a relative path is the working directory's: test_store_urls)
    with pytest.raises(ValueError, match="layout_fingerprint"):
        open_store(f"lmdb://{tmp_path}/a", layout_fingerprint="")
    with pytest.raises(ValueError, match="max_bytes"):
        open_store(f"lmdb://{tmp_path}/a", layout_fingerprint=FP, max_bytes=0)


@pytest.mark.parametrize("scheme", ["lmdb", "zarr"])
def test_open_store_accepts_timeout_s_on_a_local_store(tmp_path: Path, scheme: str) -> None:
    """``timeout_s`` bounds calls to an object store; a local store makes none and takes it
    without effect, so one ``store_options`` serves a local store and a chain alike."""
    url = f"{scheme}://{tmp_path}/s"
    with open_store(url, layout_fingerprint=FP, timeout_s=2.0) as s:
        assert s.put_many([item_for(make_key(1))]) == [True]
    with open_store(url, layout_fingerprint=FP, timeout_s=2.0) as s:
        assert verify_all(s) == 1
    with pytest.raises(ValueError, match="timeout_s: expected a finite number of seconds > 0, got inf"):
        open_store(url, layout_fingerprint=FP, timeout_s=float("inf"))


@pytest.mark.parametrize(("scheme", "backend", "some_valid"), [("lmdb", "LmdbStore", ("max_bytes", "map_size")),
                                                               ("zarr", "ZarrStore", ("max_bytes", "io_threads"))])
def test_open_store_unknown_option_lists_the_valid_ones(tmp_path: Path, scheme: str, backend: str,
                                                         some_valid: tuple[str, ...]) -> None:
    with pytest.raises(TypeError, match=rf"{backend} at .*: unknown option\(s\) \['max_byte'\]; expected some of \[") as e:
        open_store(f"{scheme}://{tmp_path}/s", layout_fingerprint=FP, max_byte=1 << 20)
    assert all(f"'{name}'" in str(e.value) for name in (*some_valid, "timeout_s"))
    assert not (tmp_path / "s").exists()  # refused before anything was created


def test_backends_refuse_each_others_directories(tmp_path: Path) -> None:
    LmdbStore(tmp_path / "l", layout_fingerprint=FP).close()
    ZarrStore(tmp_path / "z", layout_fingerprint=FP).close()
    with pytest.raises(StoreError, match="LMDB block store"):
        ZarrStore(tmp_path / "l", layout_fingerprint=FP)
    with pytest.raises(StoreError, match="Zarr block store"):
        LmdbStore(tmp_path / "z", layout_fingerprint=FP)
