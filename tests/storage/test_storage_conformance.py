"""The block-store contract, written once; every backend and every wrapper runs it (zarr's
``StoreTests`` manner): LMDB, a Zarr directory, the generic zarr Store API, an encrypted level
(a :class:`~tiered_kv.storage.api.StoreWrapper`), a one-level and a two-level chain.

A subclass provides ``open(where, **options)`` and raw access to one stored record
(``raw_read`` / ``raw_write``, used with the store closed: every copy of it, on a chain)
for the corruption tests. Tests needing a local directory or several processes are gated
by ``local`` and the store's ``supports_multiprocess`` flag.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from _util import lmdb_raw_read, lmdb_raw_write
from storage_helpers import FP, OTHER_FP, digest_for, item_for, make_key, payload_for, payload_size, verify_all
from tiered_kv.prefix import PrefixHasher, token_digest
from tiered_kv.presets import tiny
from tiered_kv.storage import (
    BlockStore,
    EncryptedStore,
    LayoutMismatchError,
    LmdbStore,
    PutItem,
    RecordKey,
    RecordKind,
    StoreChain,
    StoreFullError,
    ZarrStore,
    encode_record,
    record_size,
)
from tiered_kv.storage.format.record import HEADER_BYTES

FORK = mp.get_context("fork")


def _mutations(rec: bytes, key: RecordKey) -> dict[str, bytes]:
    """Damaged versions of the valid record ``rec`` of ``key``."""

    def flip(i: int) -> bytes:
        b = bytearray(rec)
        b[i] ^= 0x10
        return bytes(b)

    n = len(rec)
    other_key = make_key(10**6)
    return {
        "payload_bitflip": flip(HEADER_BYTES + (n - HEADER_BYTES - 16) // 2),
        "magic": flip(0),
        "version": flip(4),
        "kind": flip(6),
        "flags": flip(7),
        "fingerprint": flip(10),
        "block_hash": flip(50),
        "parent_hash": flip(80),
        "token_digest": flip(110),
        "payload_length": flip(137),
        "checksum": flip(n - 1),
        "truncated": rec[: n // 2],
        "truncated_header": rec[:100],
        "empty": b"",
        "trailing": rec + b"\0" * 7,
        "torn": rec[: n // 2] + bytes(n - n // 2),
        "garbage": random.Random(n).randbytes(n),
        "other_fingerprint": bytes(encode_record(key=key, parent_hash=bytes(32), token_digest=digest_for(key),
                                                 layout_fingerprint=OTHER_FP, payload=payload_for(key))),
        "wrong_hash": bytes(encode_record(key=other_key, parent_hash=bytes(32), token_digest=digest_for(key),
                                          layout_fingerprint=FP, payload=payload_for(key))),
    }


MUTATIONS = list(_mutations(b"\0" * 400, make_key(0)))

NEW_PROCESS_SCRIPT = """
import json, sys
import numpy as np
from tiered_kv.storage import open_store, RecordKey
url, fp, spec, options = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
with open_store(url, layout_fingerprint=fp, **options) as store:
    keys = [RecordKey.block(bytes.fromhex(h)) for h, _ in spec]
    outs = [np.empty(n, np.uint8) for _, n in spec]
    metas = store.get_many(keys, outs)
    print(json.dumps({"hits": [m is not None for m in metas], "len": len(store),
                      "crc": [int(o.astype(np.uint64).sum()) for o in outs]}))
"""


class StoreConformance:
    """Base class of the per-backend test classes (not collected itself)."""

    #: URL scheme for open_store, and whether the store lives in a local directory.
    scheme: ClassVar[str]
    local: ClassVar[bool] = True
    #: whether access times (the LRU order) survive closing and reopening the store;
    #: the generic zarr Store API and object stores keep them in memory only
    persists_access_order: ClassVar[bool] = True
    #: copies of a record the store keeps (a two-level chain: one per level), each of them
    #: damaged by ``raw_write`` and counted ``corrupt`` when read
    copies: ClassVar[int] = 1
    #: a record evicted past ``max_bytes`` is gone from the store (not so on a chain whose
    #: farther level keeps it)
    evicts: ClassVar[bool] = True
    #: an out of another size than the stored payload raises ValueError; an encrypted level
    #: learns the size only by opening the envelope, and answers a miss (the record kept)
    other_size_raises: ClassVar[bool] = True

    # ----------------------------------------------------------- backend hooks
    def stored_size(self, payload_bytes: int) -> int:
        """The bytes one record of ``payload_bytes`` takes in the store's accounting."""
        return record_size(payload_bytes)

    def settle(self, store: BlockStore) -> None:
        """Wait until every copy of what was put is written (a chain's uploads)."""

    def url(self, where: Any) -> tuple[Any, dict[str, Any]]:
        """``(url, options)``: how :func:`open_store` in another process opens the store."""
        return f"{self.scheme}://{where}", {}

    def open(self, where: Any, **options: Any) -> BlockStore:
        raise NotImplementedError

    def open_sealed(self, where: Any, encryption: dict[str, Any] | None, **options: Any) -> BlockStore:
        """:meth:`open`, with every record sealed when ``encryption`` is given (the kill -9
        matrix runs both ways)."""
        if encryption is None:
            return self.open(where, **options)
        return EncryptedStore(self.open(where, sealed=True, **options), encryption)

    def raw_read(self, where: Any, key: RecordKey) -> bytes:
        raise NotImplementedError

    def raw_write(self, where: Any, key: RecordKey, data: bytes) -> None:
        raise NotImplementedError

    def new_where(self, tmp_path: Path, name: str = "store") -> Any:
        return tmp_path / name

    @pytest.fixture
    def where(self, tmp_path: Path) -> Any:
        return self.new_where(tmp_path)

    @pytest.fixture
    def store(self, where: Any):
        s = self.open(where)
        yield s
        s.close()

    def reopen(self, store: BlockStore, where: Any, **options: Any) -> BlockStore:
        store.close()
        return self.open(where, **options)

    # ----------------------------------------------------------- round trips
    def test_roundtrip_sizes_byte_exact(self, store: BlockStore) -> None:
        sizes = [0, 1, 15, 4096, 65_537, 492_832]
        keys = [make_key(i) for i in range(len(sizes))]
        items = [item_for(k, n) for k, n in zip(keys, sizes)]
        assert store.put_many(items) == [True] * len(items)
        outs = [np.full(n, 0xAA, np.uint8) for n in sizes]
        metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
        for key, n, out, meta, item in zip(keys, sizes, outs, metas, items):
            assert meta is not None
            assert meta.key == key and meta.payload_bytes == n and meta.record_bytes == record_size(n)
            assert meta.parent_hash == item.parent_hash and meta.token_digest == item.token_digest
            assert meta.layout_fingerprint == FP
            np.testing.assert_array_equal(out, payload_for(key, n))

    def test_out_buffer_types(self, store: BlockStore) -> None:
        key = make_key(1)
        n = 4096
        store.put_many([item_for(key, n)])
        expected = payload_for(key, n)
        outs: list[Any] = [bytearray(n), memoryview(bytearray(n)), np.empty(n, np.uint8),
                           np.empty(n // 4, np.float32), np.empty((16, n // 16), np.uint8),
                           torch.empty(n, dtype=torch.uint8), torch.empty(n // 2, dtype=torch.bfloat16)]
        for out in outs:
            assert store.get(key, out) is not None, type(out)
            if isinstance(out, torch.Tensor):
                got = out.view(torch.uint8).numpy().reshape(-1)
            else:
                got = np.frombuffer(out, np.uint8) if not isinstance(out, np.ndarray) else out.reshape(-1).view(np.uint8)
            np.testing.assert_array_equal(got, expected)

    # ----------------------------------------------------------- scatter-list outs
    def test_scatter_outs_byte_exact(self, store: BlockStore) -> None:
        """An out may be a list of buffers (filled in order): mixed types, empty pieces,
        and more pieces than one preadv takes (IOV_MAX = 1024)."""
        sizes = [0, 1, 4096, 65_537, 492_832]
        keys = [make_key(i) for i in range(len(sizes))]
        store.put_many([item_for(k, n) for k, n in zip(keys, sizes)])

        def pieces(n: int, count: int) -> list[Any]:
            cuts = sorted(random.Random(n + count).sample(range(n + 1), min(count, n + 1) - 1)) if n else []
            bounds = [0, *cuts, n]
            kinds = [lambda m: np.full(m, 0xAA, np.uint8), lambda m: torch.full((m,), 0x55, dtype=torch.uint8),
                     bytearray]
            return [kinds[j % 3](b - a) for j, (a, b) in enumerate(zip(bounds, bounds[1:]))] + [bytearray(0)]

        def joined(out: list[Any]) -> bytes:
            return b"".join(bytes(p.numpy()) if isinstance(p, torch.Tensor) else bytes(p) for p in out)

        outs = [pieces(n, 3) for n in sizes]
        outs[-1] = pieces(sizes[-1], 1500)  # > IOV_MAX pieces in one record
        outs[-2] = tuple(pieces(sizes[-2], 7))
        metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
        for key, n, out, meta in zip(keys, sizes, outs, metas):
            assert meta is not None and meta.payload_bytes == n
            assert joined(list(out)) == payload_for(key, n).tobytes()
        # a pool block's rows: strided pieces of one 2-D array, the way open() reads into a pool
        n = 4096
        pool = np.zeros((4, 3, n // 4), np.uint8)  # [layers, blocks, bytes]
        assert store.get(keys[2], list(pool[:, 1])) is not None
        np.testing.assert_array_equal(pool[:, 1].reshape(-1), payload_for(keys[2], n))
        assert not pool[:, [0, 2]].any()  # the other blocks untouched

    def _check_other_size(self, store: BlockStore, key: RecordKey, out: Any) -> None:
        """``out`` is not the size of ``key``'s 1000-byte payload: ValueError, or (where
        not ``other_size_raises``) a miss that keeps the record and counts nothing corrupt."""
        if self.other_size_raises:
            with pytest.raises(ValueError, match="out: expected 1000 bytes"):
                store.get(key, out)
            return
        assert store.get(key, out) is None
        assert store.contains(key) and store.stats()["corrupt"] == 0

    def test_scatter_out_wrong_total_raises(self, store: BlockStore) -> None:
        key = make_key(2)
        store.put_many([item_for(key, 1000)])
        self._check_other_size(store, key, [np.empty(500, np.uint8), np.empty(499, np.uint8)])
        self._check_other_size(store, key, [bytearray(1000), bytearray(1)])
        with pytest.raises(ValueError, match="writable"):
            store.get(key, [bytearray(500), bytes(500)])
        with pytest.raises(ValueError, match="contiguous"):
            store.get(key, [torch.empty(2000, dtype=torch.uint8)[::2]])
        out = [np.empty(300, np.uint8), np.empty(700, np.uint8)]
        assert store.get(key, out) is not None  # nothing was harmed
        np.testing.assert_array_equal(np.concatenate(out), payload_for(key, 1000))
        assert store.stats()["corrupt"] == 0

    @pytest.mark.parametrize("mutation", ["payload_bitflip", "checksum", "truncated", "payload_length"])
    def test_scatter_out_of_a_corrupt_record_is_a_counted_miss(self, where: Any, mutation: str) -> None:
        key, n = make_key(7), 3000
        with self.open(where) as s:
            s.put_many([item_for(key, n), item_for(make_key(8), n)])
        good = self.raw_read(where, key)
        self.raw_write(where, key, _mutations(good, key)[mutation])
        with self.open(where) as s:
            outs = [[np.empty(1000, np.uint8), np.empty(n - 1000, np.uint8)], [np.empty(n, np.uint8)]]
            metas = s.get_many([key, make_key(8)], outs)
            assert metas[0] is None and metas[1] is not None
            st_ = s.stats()
            assert (st_["hits"], st_["misses"], st_["corrupt"]) == (1, 1, self.copies)
            assert not s.contains(key)
            np.testing.assert_array_equal(outs[1][0], payload_for(make_key(8), n))

    def test_put_payload_types(self, store: BlockStore) -> None:
        n = 1024
        payloads = {0: bytes(payload_for(make_key(0), n)), 1: bytearray(payload_for(make_key(1), n)),
                    2: memoryview(payload_for(make_key(2), n)), 3: payload_for(make_key(3), n),
                    4: torch.from_numpy(payload_for(make_key(4), n))}
        assert store.put_many([item_for(make_key(i), payload=p) for i, p in payloads.items()]) == [True] * 5
        for i in payloads:
            out = np.empty(n, np.uint8)
            assert store.get(make_key(i), out) is not None
            np.testing.assert_array_equal(out, payload_for(make_key(i), n))

    def test_put_payload_of_pieces(self, store: BlockStore) -> None:
        """A payload given as a list of pieces (of any buffer type, empty ones too) is
        stored as their bytes back to back, and verified like any record."""
        n = 130_001
        whole = payload_for(make_key(0), n)
        cuts = [0, 7, 7, 4096, 70_000, n]
        pieces: list[Any] = [whole[a:b] for a, b in zip(cuts, cuts[1:])]
        pieces[1], pieces[3] = bytes(pieces[1]), torch.from_numpy(pieces[3].copy())
        item = item_for(make_key(0), payload=pieces)
        assert item.payload_bytes == n
        assert store.put_many([item, item_for(make_key(1), payload=(whole[:10], whole[10:100]))]) == [True, True]
        out = np.empty(n, np.uint8)
        assert store.get(make_key(0), out, token_digest=digest_for(make_key(0))) is not None
        np.testing.assert_array_equal(out, whole)
        assert store.get(make_key(1), np.empty(100, np.uint8)) is not None
        with pytest.raises(ValueError, match=r"payload\[1\]: expected a contiguous tensor"):
            PutItem(make_key(2), bytes(32), bytes(32), [whole[:4], torch.zeros(8, dtype=torch.uint8)[::2]])
        with pytest.raises(TypeError, match=r"payload\[0\]: expected a bytes-like"):
            PutItem(make_key(2), bytes(32), bytes(32), [3])

    def test_bad_out_buffers_raise(self, store: BlockStore) -> None:
        key = make_key(2)
        store.put_many([item_for(key, 1000)])
        self._check_other_size(store, key, np.empty(999, np.uint8))
        self._check_other_size(store, key, bytearray(1001))
        with pytest.raises(ValueError, match="writable"):
            store.get(key, bytes(1000))
        with pytest.raises(ValueError, match="contiguous"):
            store.get(key, torch.empty(2000, dtype=torch.uint8)[::2])
        with pytest.raises(ValueError, match="one buffer per key"):
            store.get_many([key, key], [bytearray(1000)])
        with pytest.raises(TypeError, match="bytes-like"):
            store.get(key, 1000)
        assert store.get(key, bytearray(1000)) is not None  # nothing was harmed

    def test_bad_items_raise(self, store: BlockStore) -> None:
        with pytest.raises(ValueError, match="block_hash: expected 32 bytes"):
            RecordKey(RecordKind.BLOCK, b"short")
        with pytest.raises(ValueError, match="parent_hash: expected 32 bytes"):
            PutItem(make_key(0), b"x", bytes(32), b"payload")
        with pytest.raises(TypeError, match="PutItem"):
            store.put_many([b"not an item"])  # type: ignore[list-item]

    def test_missing_key_is_a_miss(self, store: BlockStore) -> None:
        store.put_many([item_for(make_key(0), 10)])
        assert store.get(make_key(1), np.empty(10, np.uint8)) is None
        assert store.get(make_key(0, kind=RecordKind.SNAPSHOT), np.empty(10, np.uint8)) is None
        s = store.stats()
        assert (s["hits"], s["misses"], s["corrupt"]) == (0, 2, 0)

    def test_block_and_snapshot_keys_are_distinct(self, store: BlockStore) -> None:
        block, snap = make_key(5), make_key(5, kind=RecordKind.SNAPSHOT)
        assert store.put_many([item_for(block, 100), item_for(snap, 200)]) == [True, True]
        assert store.get(block, np.empty(100, np.uint8)) is not None
        assert store.get(snap, np.empty(200, np.uint8)) is not None
        assert set(store) == {block, snap}

    # ----------------------------------------------------------- write-once, basic ops
    def test_write_once(self, store: BlockStore) -> None:
        key = make_key(3)
        assert store.put_many([item_for(key, 100)]) == [True]
        other = item_for(key, payload=np.zeros(100, np.uint8))
        assert store.put_many([other]) == [False]
        assert store.put_many([item_for(make_key(4), 10), other, item_for(make_key(4), 10)]) == [True, False, False]
        out = np.empty(100, np.uint8)
        assert store.get(key, out) is not None
        np.testing.assert_array_equal(out, payload_for(key, 100))  # the first write stays
        assert store.stats()["puts"] == 2

    def test_contains_delete_iter_len(self, store: BlockStore) -> None:
        keys = [make_key(i) for i in range(6)]
        assert len(store) == 0 and list(store) == []
        store.put_many([item_for(k, 64) for k in keys])
        assert len(store) == 6 and set(store) == set(keys)
        assert all(store.contains(k) for k in keys) and keys[0] in store
        assert not store.contains(make_key(99))
        self.settle(store)  # (a chain: a delete does not stop an upload already in flight)
        assert store.delete(keys[2]) is True
        assert store.delete(keys[2]) is False
        assert not store.contains(keys[2]) and len(store) == 5
        assert store.get(keys[2], np.empty(64, np.uint8)) is None
        assert set(store) == set(keys) - {keys[2]}
        assert store.put_many([item_for(keys[2], 64)]) == [True]  # a deleted key can be written again

    def test_contains_hashes(self, store: BlockStore) -> None:
        keys = [make_key(i) for i in range(4)]
        store.put_many([item_for(k, 64) for k in keys[:3]])
        kind = keys[0].kind
        hashes = [k.block_hash for k in keys]
        assert store.contains_hashes(kind, hashes) == [True, True, True, False]
        other = RecordKind.SNAPSHOT if kind is RecordKind.BLOCK else RecordKind.BLOCK
        assert store.contains_hashes(other, hashes) == [False] * 4  # the kind is part of the key
        assert store.contains_hashes(kind, []) == []

    def test_stats_counters(self, store: BlockStore) -> None:
        keys = [make_key(i) for i in range(3)]
        assert store.stats()["oldest_access_ns"] is None
        store.put_many([item_for(k, 1000) for k in keys])
        store.put_many([item_for(keys[0], 1000)])
        store.get_many(keys[:2] + [make_key(50)], [np.empty(1000, np.uint8) for _ in range(3)])
        s = store.stats()
        for name in ("records", "bytes", "hits", "misses", "corrupt", "evictions", "puts", "put_bytes",
                     "max_bytes", "oldest_access_ns", "newest_access_ns"):
            assert name in s
        assert s["records"] == 3 and s["bytes"] == 3 * self.stored_size(1000)
        assert (s["hits"], s["misses"], s["corrupt"], s["evictions"]) == (2, 1, 0, 0)
        assert s["puts"] == 3 and s["put_bytes"] == 3 * self.stored_size(1000)
        assert 0 < s["oldest_access_ns"] < s["newest_access_ns"]

    def test_closed_store_raises(self, store: BlockStore) -> None:
        store.close()
        store.close()  # idempotent
        with pytest.raises(Exception, match="closed"):
            store.put_many([item_for(make_key(0), 1)])
        with pytest.raises(Exception, match="closed"):
            store.get(make_key(0), bytearray(1))

    def test_context_manager(self, where: Any) -> None:
        with self.open(where) as s:
            s.put_many([item_for(make_key(0), 10)])
        assert s.closed
        with self.open(where) as s:
            assert len(s) == 1

    # ----------------------------------------------------------- persistence
    def test_reopen_hits_every_committed_record(self, store: BlockStore, where: Any) -> None:
        keys = [make_key(i) for i in range(20)]
        for k in keys:  # many small commits
            store.put_many([item_for(k)])
        store = self.reopen(store, where)
        try:
            assert verify_all(store) == 20
        finally:
            store.close()

    def test_reopen_in_new_process(self, store: BlockStore, where: Any) -> None:
        if not store.supports_multiprocess:
            pytest.skip(f"{type(store).__name__} over this store is not shared between processes")
        keys = [make_key(i) for i in range(8)]
        store.put_many([item_for(k) for k in keys])
        store.close()
        spec = [(k.block_hash.hex(), payload_size(k)) for k in keys]
        url, options = self.url(where)
        proc = subprocess.run([sys.executable, "-c", NEW_PROCESS_SCRIPT, json.dumps(str(url) if isinstance(url, Path)
                               else url), FP, json.dumps(spec), json.dumps(options)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["hits"] == [True] * 8 and got["len"] == 8
        assert got["crc"] == [int(payload_for(k).astype(np.uint64).sum()) for k in keys]

    def test_layout_mismatch_raises(self, store: BlockStore, where: Any) -> None:
        store.put_many([item_for(make_key(0), 10)])
        store.close()
        with pytest.raises(LayoutMismatchError) as e:
            self.open(where, layout_fingerprint=OTHER_FP)
        assert FP in str(e.value) and OTHER_FP in str(e.value)
        assert isinstance(e.value, ValueError)
        with self.open(where) as s:  # the store is unharmed
            assert verify_all(s, sizes={make_key(0): 10}) == 1

    def test_files_are_owner_only(self, tmp_path: Path) -> None:
        if not self.local:
            pytest.skip("store has no local files")
        for umask in (0o000, 0o277):
            where = tmp_path / f"umask{umask:o}" / "store"
            old = os.umask(umask)
            try:
                with self.open(where) as s:
                    s.put_many([item_for(make_key(i), 100) for i in range(4)])
                    s.put_many([item_for(make_key(0, kind=RecordKind.SNAPSHOT), 100)])
                    s.get(make_key(0), np.empty(100, np.uint8))
            finally:
                os.umask(old)
            created = [where.parent, *where.parent.rglob("*")]
            assert len(created) > 3
            for p in created:
                mode = stat.S_IMODE(p.lstat().st_mode)
                want = 0o700 if p.is_dir() else 0o600
                assert mode == want, f"{p}: mode {mode:o}, expected {want:o} (umask {umask:o})"

    # ----------------------------------------------------------- capacity
    def test_lru_eviction_order(self, where: Any) -> None:
        if not self.evicts:
            pytest.skip("a farther level keeps what level 0 evicts")
        n = 1000
        one = self.stored_size(n)
        store = self.open(where, max_bytes=4 * one)
        a, b, c, d, e, f, g = (make_key(i) for i in range(7))
        try:
            store.put_many([item_for(k, n) for k in (a, b, c, d)])
            assert store.stats()["evictions"] == 0
            assert store.get(a, np.empty(n, np.uint8)) is not None     # a: read
            assert store.put_many([item_for(b, n)]) == [False]         # b: rewritten (an access)
            assert store.put_many([item_for(e, n)]) == [True]          # evicts c
            assert [store.contains(k) for k in (a, b, c, d, e)] == [True, True, False, True, True]
            store.put_many([item_for(f, n)])                           # evicts d
            assert [store.contains(k) for k in (a, b, c, d, e, f)] == [True, True, False, False, True, True]
            s = store.stats()
            assert s["evictions"] == 2 and s["records"] == 4 and s["bytes"] == 4 * one <= s["max_bytes"]
            if self.persists_access_order:
                store = self.reopen(store, where, max_bytes=4 * one)   # the order survives a restart
            store.put_many([item_for(g, n)])                           # evicts a, the oldest access
            assert set(store) == {b, e, f, g}
        finally:
            store.close()

    def test_record_larger_than_max_bytes(self, where: Any) -> None:
        with self.open(where, max_bytes=self.stored_size(100)) as store:
            store.put_many([item_for(make_key(0), 100)])
            with pytest.raises(StoreFullError, match="max_bytes"):
                store.put_many([item_for(make_key(1), 101)])
            assert store.get(make_key(0), np.empty(100, np.uint8)) is not None

    # ----------------------------------------------------------- corruption
    @pytest.mark.parametrize("mutation", MUTATIONS)
    def test_corrupt_record_is_a_miss(self, where: Any, mutation: str) -> None:
        key, n = make_key(7), 3000
        with self.open(where) as s:
            s.put_many([item_for(key, n), item_for(make_key(8), n)])
        good = self.raw_read(where, key)
        self.raw_write(where, key, _mutations(good, key)[mutation])
        with self.open(where) as s:
            assert s.get(key, np.empty(n, np.uint8)) is None
            st_ = s.stats()
            assert (st_["hits"], st_["misses"], st_["corrupt"]) == (0, 1, self.copies)
            assert not s.contains(key)                                 # the bad record is gone
            assert s.put_many([item_for(key, n)]) == [True]            # and can be rewritten
            out = np.empty(n, np.uint8)
            assert s.get(key, out) is not None
            np.testing.assert_array_equal(out, payload_for(key, n))
            assert verify_all(s, sizes={key: n, make_key(8): n}) == 2  # the neighbour is untouched

    def test_corrupt_record_is_replaced_by_put(self, where: Any) -> None:
        key, n = make_key(9), 500
        with self.open(where) as s:
            s.put_many([item_for(key, n)])
        good = self.raw_read(where, key)
        self.raw_write(where, key, good[: len(good) // 2])
        with self.open(where) as s:
            assert s.put_many([item_for(key, n)]) == [True]  # a torn record does not block a rewrite
            self.settle(s)
            assert s.stats()["corrupt"] == self.copies
            assert s.get(key, np.empty(n, np.uint8)) is not None

    def test_token_digest_mismatch_is_a_miss(self, store: BlockStore) -> None:
        key = make_key(11)
        store.put_many([item_for(key, 100)])
        self.settle(store)
        assert store.get(key, np.empty(100, np.uint8), token_digest=token_digest([1, 2, 3])) is None
        assert store.stats()["corrupt"] == self.copies and not store.contains(key)

    # ----------------------------------------------------------- tenants
    def test_two_tenants_never_share(self, store: BlockStore) -> None:
        layout = tiny()
        tokens = np.arange(4 * layout.block_tokens) % 1000
        ha = PrefixHasher(layout, salt="a").block_hashes(tokens)
        hb = PrefixHasher(layout, salt="b").block_hashes(tokens)
        parents = [PrefixHasher(layout, salt="a").root, *ha[:-1]]
        items = [PutItem(RecordKey.block(h), p, token_digest(tokens[i * 128:(i + 1) * 128]),
                         payload_for(RecordKey.block(h), 256)) for i, (h, p) in enumerate(zip(ha, parents))]
        assert store.put_many(items) == [True] * 4
        outs = [np.empty(256, np.uint8) for _ in range(4)]
        assert store.get_many([RecordKey.block(h) for h in hb], outs) == [None] * 4
        assert all(m is not None for m in store.get_many([RecordKey.block(h) for h in ha], outs))

    # ----------------------------------------------------------- processes
    def _need_processes(self) -> None:
        if not self.local:
            pytest.skip("store is not shared between processes")

    @pytest.mark.parametrize("sealed", [False, True], ids=["plain", "encrypted"])
    def test_kill_9_during_puts(self, where: Any, sealed: bool, tmp_path: Path) -> None:
        """A writer killed at a random moment leaves every record intact or absent (and,
        encrypted, every record left authenticates and decrypts to its payload)."""
        self._need_processes()
        rng = random.Random(1234)
        max_bytes = 4 << 20  # small: evictions happen while writers die too
        enc = _encryption(tmp_path) if sealed else None
        self.open_sealed(where, enc, max_bytes=max_bytes).close()
        seen = 0
        for it in range(20):
            ready = FORK.Event()
            proc = FORK.Process(target=_put_forever, args=(self, where, max_bytes, it, ready, enc), daemon=True)
            proc.start()
            assert ready.wait(30), "writer did not start"
            time.sleep(rng.uniform(0.02, 0.2))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            assert proc.exitcode == -signal.SIGKILL
            with self.open_sealed(where, enc, max_bytes=max_bytes) as s:
                n = verify_all(s)
                st_ = s.stats()
                assert st_["corrupt"] == 0, f"iteration {it}: {st_['corrupt']} torn records"
                assert st_.get("auth_failures", 0) == 0
                assert st_["bytes"] <= max_bytes
                if isinstance(s, LmdbStore) or isinstance(getattr(s, "inner", None), LmdbStore):
                    size = (lambda n: record_size(n + _envelope_overhead())) if sealed else self.stored_size
                    assert st_["bytes"] == sum(size(payload_size(k)) for k in s)  # transactional too
            seen += n
        assert seen > 0, "no writer got a record committed before it was killed"

    @pytest.mark.parametrize("sealed", [False, True], ids=["plain", "encrypted"])
    def test_two_processes_share_one_store(self, where: Any, sealed: bool, tmp_path: Path) -> None:
        self._need_processes()
        enc = _encryption(tmp_path) if sealed else None
        self.open_sealed(where, enc).close()
        procs = [FORK.Process(target=_writer_reader, args=(self, where, me, enc)) for me in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert [p.exitcode for p in procs] == [0, 0]
        with self.open_sealed(where, enc) as s:
            assert verify_all(s) == 2 * 30 + 10
            assert s.stats()["corrupt"] == 0

    # ----------------------------------------------------------- full disk
    def test_full_disk(self, tmpfs: Path) -> None:
        if not self.local:
            pytest.skip("store has no local files")
        where = tmpfs / "store"
        stored = []
        with self.open(where, max_bytes=1 << 30) as s:
            with pytest.raises(StoreFullError):
                for i in range(100):  # 100 x 200 KB > 4 MiB
                    key = make_key(i)
                    s.put_many([item_for(key, 200_000)])
                    stored.append(key)
            assert len(stored) >= 3
            assert verify_all(s, sizes={k: 200_000 for k in stored}) == len(stored)  # reads keep working
            assert s.stats()["corrupt"] == 0
        with self.open(where, max_bytes=1 << 30) as s:  # and after a restart
            assert verify_all(s, sizes={k: 200_000 for k in stored}) == len(stored)
            assert s.delete(stored[0])
            s.put_many([item_for(make_key(1000), 1000)])  # space freed: writes work again

    # ----------------------------------------------------------- model-based
    def test_state_machine(self, tmp_path: Path) -> None:
        conf = self
        counter = iter(range(10**6))

        class StoreMachine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                self.where = conf.new_where(tmp_path, f"sm{next(counter)}")
                self.store = conf.open(self.where)
                self.model: dict[int, np.ndarray] = {}

            @rule(k=st.integers(0, 5), size=st.integers(0, 3000), fill=st.integers(0, 255))
            def put(self, k: int, size: int, fill: int) -> None:
                payload = np.full(size, fill, np.uint8)
                new = k not in self.model
                assert self.store.put_many([item_for(make_key(k), payload=payload)]) == [new]
                if new:
                    self.model[k] = payload

            @rule(k=st.integers(0, 5))
            def get(self, k: int) -> None:
                expected = self.model.get(k)
                out = np.empty(0 if expected is None else expected.size, np.uint8)
                meta = self.store.get(make_key(k), out, token_digest=digest_for(make_key(k)))
                assert (meta is None) == (expected is None)
                if expected is not None:
                    np.testing.assert_array_equal(out, expected)

            @rule(k=st.integers(0, 5))
            def delete(self, k: int) -> None:
                assert self.store.delete(make_key(k)) == (k in self.model)
                self.model.pop(k, None)

            @rule(k=st.integers(0, 5))
            def contains(self, k: int) -> None:
                assert self.store.contains(make_key(k)) == (k in self.model)

            @rule()
            def reopen(self) -> None:
                self.store = conf.reopen(self.store, self.where)

            @invariant()
            def same_keys(self) -> None:
                assert set(self.store) == {make_key(k) for k in self.model}

            def teardown(self) -> None:
                self.store.close()

        run_state_machine_as_test(StoreMachine, settings=settings(
            max_examples=12, stateful_step_count=15, deadline=None, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]))


# ------------------------------------------------------------------ process bodies (fork)
def _envelope_overhead() -> int:
    from tiered_kv.storage.encrypted.crypto import ENVELOPE_OVERHEAD

    return ENVELOPE_OVERHEAD


def _encryption(tmp_path: Path) -> dict[str, Any] | None:
    """An encryption config with a fresh key file (skips without the cryptography package)."""
    pytest.importorskip("cryptography", reason="encryption needs the cryptography package")
    from tiered_kv.storage.encrypted.crypto import write_key_file

    key = tmp_path / "master.key"
    if not key.exists():
        write_key_file(key)
    return {"key_files": [str(key)], "tenant": "conformance"}


def _put_forever(conf: StoreConformance, where: Any, max_bytes: int, it: int, ready: Any,
                 encryption: dict[str, Any] | None = None) -> None:
    store = conf.open_sealed(where, encryption, max_bytes=max_bytes)
    ready.set()
    i = 0
    while True:
        store.put_many([item_for(make_key(i + j, salt=b"kill%d" % it)) for j in range(3)])
        i += 3


def _writer_reader(conf: StoreConformance, where: Any, me: int, encryption: dict[str, Any] | None = None) -> None:
    """Write 30 own and 10 shared records in small batches, reading the peer's as they appear."""
    store = conf.open_sealed(where, encryption)
    mine = [make_key(i, salt=b"proc%d" % me) for i in range(30)]
    theirs = [make_key(i, salt=b"proc%d" % (1 - me)) for i in range(30)]
    shared = [make_key(i, salt=b"shared") for i in range(10)]
    todo = mine + shared if me == 0 else shared[::-1] + mine
    for start in range(0, len(todo), 4):
        store.put_many([item_for(k) for k in todo[start:start + 4]])
        outs = [np.empty(payload_size(k), np.uint8) for k in theirs]
        for key, meta, out in zip(theirs, store.get_many(theirs, outs), outs):
            if meta is not None:
                assert np.array_equal(out, payload_for(key)), "peer record read back wrong"
    assert verify_all(store) >= 40
    assert store.stats()["corrupt"] == 0
    store.close()


# ------------------------------------------------------------------ backends
class TestLmdbStore(StoreConformance):
    scheme = "lmdb"

    def open(self, where: Any, **options: Any) -> BlockStore:
        options.setdefault("layout_fingerprint", FP)
        options.setdefault("initial_map_size", 8 << 20)
        if "max_bytes" not in options:
            options["max_bytes"] = 1 << 30
        return LmdbStore(where, **options)

    def raw_read(self, where: Any, key: RecordKey) -> bytes:
        return lmdb_raw_read(where, key.to_bytes())

    def raw_write(self, where: Any, key: RecordKey, data: bytes) -> None:
        lmdb_raw_write(where, key.to_bytes(), data)


class TestZarrLocalStore(StoreConformance):
    scheme = "zarr"

    def open(self, where: Any, **options: Any) -> BlockStore:
        options.setdefault("layout_fingerprint", FP)
        return ZarrStore(where, **options)

    def _path(self, where: Path, key: RecordKey) -> Path:
        h = key.block_hash.hex()
        return where / {RecordKind.BLOCK: "blocks", RecordKind.SNAPSHOT: "snapshots"}[key.kind] / h[:2] / h[2:]

    def raw_read(self, where: Any, key: RecordKey) -> bytes:
        return self._path(where, key).read_bytes()

    def raw_write(self, where: Any, key: RecordKey, data: bytes) -> None:
        self._path(where, key).write_bytes(data)


class TestZarrMemoryStore(StoreConformance):
    """The generic zarr Store API path (what an object store uses), on a MemoryStore."""

    scheme = "zarr"
    local = False
    persists_access_order = False  # no access times in the zarr Store API: reopened, any order

    def new_where(self, tmp_path: Path, name: str = "store") -> Any:
        from zarr.storage import MemoryStore

        return MemoryStore()

    def open(self, where: Any, **options: Any) -> BlockStore:
        options.setdefault("layout_fingerprint", FP)
        return ZarrStore(where, **options)

    def _name(self, key: RecordKey) -> str:
        h = key.block_hash.hex()
        return f"{'blocks' if key.kind is RecordKind.BLOCK else 'snapshots'}/{h[:2]}/{h[2:]}"

    def raw_read(self, where: Any, key: RecordKey) -> bytes:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        return sync(where.get(self._name(key), prototype=default_buffer_prototype())).to_bytes()

    def raw_write(self, where: Any, key: RecordKey, data: bytes) -> None:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        sync(where.set(self._name(key), default_buffer_prototype().buffer.from_bytes(data)))


# ------------------------------------------------------------------ wrappers
class TestEncryptedLmdbStore(TestLmdbStore):
    """An encrypted level over LMDB (:class:`EncryptedStore`, a ``StoreWrapper``): records
    sealed and stored under keyed names, the contract unchanged."""

    other_size_raises = False
    encryption: dict[str, Any]

    @pytest.fixture(autouse=True)
    def _key_file(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.encryption = _encryption(tmp_path_factory.mktemp("key"))  # (outside the store's directory)

    def open(self, where: Any, **options: Any) -> BlockStore:
        options.pop("sealed", None)
        return EncryptedStore(super().open(where, sealed=True, **options), self.encryption)

    def open_sealed(self, where: Any, encryption: dict[str, Any] | None, **options: Any) -> BlockStore:
        return self.open(where, **options)  # (sealed either way, under this class's key)

    def stored_size(self, payload_bytes: int) -> int:
        return record_size(payload_bytes + _envelope_overhead())

    def url(self, where: Any) -> tuple[Any, dict[str, Any]]:
        return f"lmdb://{where}", {"encryption": self.encryption}

    def _name(self, where: Any, key: RecordKey) -> RecordKey:
        with self.open(where) as s:
            return s.name_of(key)

    def raw_read(self, where: Any, key: RecordKey) -> bytes:
        return super().raw_read(where, self._name(where, key))

    def raw_write(self, where: Any, key: RecordKey, data: bytes) -> None:
        super().raw_write(where, self._name(where, key), data)


class TestOneLevelChain(TestLmdbStore):
    """A :class:`StoreChain` of one LMDB level: the chain's read, write and stats paths."""

    def open(self, where: Any, **options: Any) -> BlockStore:
        return StoreChain([super().open(where, **options)], journal=False)

    def open_sealed(self, where: Any, encryption: dict[str, Any] | None, **options: Any) -> BlockStore:
        if encryption is None:
            return self.open(where, **options)
        return StoreChain([EncryptedStore(TestLmdbStore.open(self, where, sealed=True, **options), encryption)],
                          journal=False)


class TestTwoLevelChain(StoreConformance):
    """A :class:`StoreChain` of an LMDB level 0 and a Zarr directory behind it: every record
    uploaded (closing the chain finishes its uploads), so damaged at both levels it is a
    miss counted twice."""

    scheme = "lmdb"
    copies = 2
    evicts = False

    @staticmethod
    def _levels(where: Path) -> tuple[Path, Path]:
        return where / "near", where / "far"

    def open(self, where: Any, **options: Any) -> BlockStore:
        return self.open_sealed(where, None, **options)

    def open_sealed(self, where: Any, encryption: dict[str, Any] | None, **options: Any) -> BlockStore:
        near, far = self._levels(where)
        options.setdefault("layout_fingerprint", FP)
        options.setdefault("max_bytes", 1 << 30)
        near_store = LmdbStore(near, initial_map_size=8 << 20, sealed=encryption is not None, **options)
        options.pop("max_bytes")  # (the far level keeps everything: what it evicted could not be read back)
        try:
            far_store = ZarrStore(far, sealed=encryption is not None, **options)
        except BaseException:
            near_store.close()
            raise
        levels = [near_store, far_store] if encryption is None else [
            EncryptedStore(near_store, encryption), EncryptedStore(far_store, encryption)]
        return StoreChain(levels, timeout_s=60.0)  # (the contract, not the far level's deadline)

    def settle(self, store: BlockStore) -> None:
        assert isinstance(store, StoreChain) and store.wait_uploads(60.0)

    def url(self, where: Any) -> tuple[Any, dict[str, Any]]:
        near, far = self._levels(where)
        return [f"lmdb://{near}", f"zarr://{far}"], {}

    def raw_read(self, where: Any, key: RecordKey) -> bytes:
        return lmdb_raw_read(self._levels(where)[0], key.to_bytes())

    def raw_write(self, where: Any, key: RecordKey, data: bytes) -> None:
        near, far = self._levels(where)
        lmdb_raw_write(near, key.to_bytes(), data)
        TestZarrLocalStore.raw_write(TestZarrLocalStore(), far, key, data)
