"""The maintenance methods every backend implements: ``verify(repair=)`` and ``gc(max_bytes)``.

Each test runs on LMDB, Zarr on a local directory and Zarr in an S3 bucket (the session
SeaweedFS server; marked ``s3``). A record is damaged by writing bytes straight into the
backend (LMDB transaction, file, object PUT), as a bad disk or a foreign writer would.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import test_storage_conformance as conformance  # raw record access of the local backends
from storage_helpers import FP, item_for, make_key, payload_for, verify_all
from tiered_kv.storage import BlockStore, LmdbStore, RecordKey, RecordKind, ZarrStore, record_size
from tiered_kv.storage.format.record import HEADER_BYTES

BUCKET = "tkv-maintenance"
N = 2000  # payload bytes of every record here
ONE = record_size(N)


class _S3Backend:
    """Zarr in a fresh prefix of the test bucket; raw access through obstore."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.creds = {"access_key_id": server.access_key, "secret_access_key": server.secret_key}

    def new_where(self, tmp_path: Path) -> str:
        return self.server.url(BUCKET, f"m-{uuid.uuid4().hex[:12]}")

    def open(self, where: str, **options: Any) -> BlockStore:
        return ZarrStore(where, layout_fingerprint=FP, **self.creds, **options)

    def _raw(self, where: str) -> Any:
        from tiered_kv.storage.s3 import open_object_store, parse_s3_url

        return open_object_store(parse_s3_url(where, env={}, **self.creds))

    @staticmethod
    def _name(key: RecordKey) -> str:
        h = key.block_hash.hex()
        return f"{'blocks' if key.kind is RecordKind.BLOCK else 'snapshots'}/{h[:2]}/{h[2:]}"

    def raw_read(self, where: str, key: RecordKey) -> bytes:
        import obstore

        return bytes(obstore.get(self._raw(where), self._name(key)).bytes())

    def raw_write(self, where: str, key: RecordKey, data: bytes) -> None:
        import obstore

        obstore.put(self._raw(where), self._name(key), data)  # overwrite: what a bad writer does


class _LocalBackend:
    def __init__(self, conf: Any) -> None:
        self.conf = conf

    def new_where(self, tmp_path: Path) -> Path:
        return tmp_path / "store"

    def open(self, where: Path, **options: Any) -> BlockStore:
        return self.conf.open(where, **options)

    def raw_read(self, where: Path, key: RecordKey) -> bytes:
        return self.conf.raw_read(where, key)

    def raw_write(self, where: Path, key: RecordKey, data: bytes) -> None:
        self.conf.raw_write(where, key, data)


@pytest.fixture(params=["lmdb", "zarr", pytest.param("zarr+s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "lmdb":
        return _LocalBackend(conformance.TestLmdbStore())
    if request.param == "zarr":
        return _LocalBackend(conformance.TestZarrLocalStore())
    server = request.getfixturevalue("seaweedfs")
    server.make_bucket(BUCKET)
    return _S3Backend(server)


def _flip_payload(rec: bytes) -> bytes:
    bad = bytearray(rec)
    bad[HEADER_BYTES + N // 2] ^= 0x40
    return bytes(bad)


def test_verify_finds_keeps_then_repairs(backend: Any, tmp_path: Path) -> None:
    where = backend.new_where(tmp_path)
    keys = [make_key(i, salt=b"verify") for i in range(5)] + [make_key(0, kind=RecordKind.SNAPSHOT)]
    with backend.open(where) as store:
        assert store.put_many([item_for(k, N) for k in keys]) == [True] * 6
        clean = store.verify()
        assert (clean["checked"], clean["corrupt"], clean["removed"], clean["corrupt_keys"]) == (6, 0, 0, [])
    bad_key = keys[2]
    good = backend.raw_read(where, bad_key)
    backend.raw_write(where, bad_key, _flip_payload(good))
    with backend.open(where) as store:
        found = store.verify()
        assert (found["checked"], found["corrupt"], found["removed"]) == (6, 1, 0)
        assert found["corrupt_keys"] == [bad_key.to_bytes().hex()]
        assert RecordKey.from_bytes(bytes.fromhex(found["corrupt_keys"][0])) == bad_key
        assert store.contains(bad_key) and len(store) == 6          # found, and kept
        assert store.verify()["corrupt_keys"] == [bad_key.to_bytes().hex()]
        repaired = store.verify(repair=True)
        assert (repaired["checked"], repaired["corrupt"], repaired["removed"]) == (6, 1, 1)
        assert not store.contains(bad_key) and len(store) == 5
        assert store.stats()["corrupt"] == 1
        again = store.verify()
        assert (again["checked"], again["corrupt"], again["removed"]) == (5, 0, 0)
        sizes = {k: N for k in keys}
        assert verify_all(store, sizes=sizes) == 5                 # the others are untouched
        assert store.put_many([item_for(bad_key, N)]) == [True]     # and the key can be written again


def test_verify_reports_a_record_under_the_wrong_key(backend: Any, tmp_path: Path) -> None:
    where = backend.new_where(tmp_path)
    a, b = make_key(1, salt=b"wrong"), make_key(2, salt=b"wrong")
    with backend.open(where) as store:
        store.put_many([item_for(a, N), item_for(b, N)])
    backend.raw_write(where, b, backend.raw_read(where, a))  # a valid record, of another key
    with backend.open(where) as store:
        found = store.verify(repair=True)
        assert found["corrupt_keys"] == [b.to_bytes().hex()] and found["removed"] == 1
        assert store.contains(a) and not store.contains(b)


def test_gc_evicts_oldest_accessed_first_to_the_bound(backend: Any, tmp_path: Path) -> None:
    where = backend.new_where(tmp_path)
    a, b, c, d, e = (make_key(i, salt=b"gc") for i in range(5))
    with backend.open(where) as store:
        store.put_many([item_for(k, N) for k in (a, b, c, d, e)])     # written in this order
        assert store.get(c, np.empty(N, np.uint8)) is not None        # c: read
        assert store.put_many([item_for(a, N)]) == [False]            # a: put again (an access)
        # access order now, oldest first: b, d, e, c, a
        before = store.stats()["evictions"]
        out = store.gc(3 * ONE + ONE // 2)
        assert out["evicted"] == 2 and out["freed_bytes"] == 2 * ONE
        assert out["bytes"] == 3 * ONE and out["records"] == 3
        assert set(store) == {e, c, a}
        assert store.stats()["evictions"] - before == 2
        assert store.gc(10 * ONE)["evicted"] == 0                     # under the bound: nothing
        out = store.gc(ONE)
        assert out["evicted"] == 2 and set(store) == {a}
        got = np.empty(N, np.uint8)
        assert store.get(a, got) is not None
        np.testing.assert_array_equal(got, payload_for(a, N))
        out = store.gc(0)  # (a backend may add keys of its own, e.g. LMDB's segment reclaim)
        assert {k: out[k] for k in ("evicted", "freed_bytes", "bytes", "records")} == {
            "evicted": 1, "freed_bytes": ONE, "bytes": 0, "records": 0}
        assert len(store) == 0
        assert store.max_bytes != 0                                    # the store's own bound is unchanged
        with pytest.raises(ValueError, match="max_bytes: expected an int >= 0"):
            store.gc(-1)


def test_lmdb_verify_reports_and_repairs_the_byte_accounting(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(i), N) for i in range(3)])
        r = store.verify()
        assert r["accounted_bytes"] == r["actual_bytes"] == 3 * ONE
    import lmdb

    env = lmdb.open(str(tmp_path / "s"), max_dbs=4)
    with env.begin(write=True) as txn:  # drift the running total, as a bug would
        meta = env.open_db(b"meta", txn=txn, create=False)
        txn.put(b"record_bytes", (12345).to_bytes(8, "little"), db=meta)
    env.close()
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        r = store.verify()
        assert (r["accounted_bytes"], r["actual_bytes"], r["corrupt"]) == (12345, 3 * ONE, 0)
        store.verify(repair=True)
        assert store.stats()["bytes"] == 3 * ONE
        assert store.gc(ONE)["records"] == 1


def test_readonly_lmdb_verifies_but_refuses_repair_and_gc(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(0), N)])
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, readonly=True) as store:
        assert store.verify()["checked"] == 1
        with pytest.raises(Exception, match="readonly"):
            store.verify(repair=True)
        with pytest.raises(Exception, match="readonly"):
            store.gc(0)
