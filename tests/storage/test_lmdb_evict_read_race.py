"""LMDB reads racing evictions of the keys they read: misses, never wrong bytes, never corrupt.

A read looks every key up in one index transaction, then reads the records the entries
point at (:mod:`tiered_kv.storage.lmdb.store_reads`). An eviction between the two (a put
that makes room, e.g. a disk tier's writer thread; or ``gc``) unindexes the record and
punches a hole over its bytes, or unlinks its sealed segment file: the read finds zeros or
no file where the entry said. That read must be a plain miss (``misses``; the record is no
longer indexed, so it is not ``corrupt``, and nothing is unindexed for it), the other
records of the batch hits with their exact bytes, and a key put again meanwhile (another
location) is read by the next read. Every read path a cache uses is covered: ``get_many``
(the staging and host-record resume reads, snapshots), ``get_many_unhashed`` (the
encrypted level's reads) and ``get_rows`` (reads straight into pool rows, native and
through ``get_many``).

Each race is made to happen, never timed: the index lookup of the read under test runs the
eviction right after it returns (the store's ``StoreReads.lookup`` wrapped), before a
byte is read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storage_helpers import FP, digest_for, item_for, make_key, payload_for, row_impls, use_row_impl
from tiered_kv.storage import LmdbStore, RowScatter, record_size
from tiered_kv.storage.lmdb.segments import ALIGN

PAYLOAD = 30_000
N = 12
#: room for the N records the tests start with, and a little more (but for one more record)
PADDED = -(-record_size(PAYLOAD) // ALIGN) * ALIGN
MAX_BYTES = N * record_size(PAYLOAD) + record_size(PAYLOAD) // 2
#: a segment seals after about two records: gc unlinks the ones nothing indexed is left in
SEGMENT_BYTES = 2 * PADDED

@pytest.fixture(params=row_impls())
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each row-read implementation in turn: the native one, or get_many with views."""
    return use_row_impl(request.param, monkeypatch)


@pytest.fixture
def store(tmp_path: Path):
    """An LMDB store holding N records (keys 0..N-1) of PAYLOAD bytes, put oldest first."""
    keys = [make_key(i) for i in range(N)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=MAX_BYTES, segment_bytes=SEGMENT_BYTES,
                   access_flush_s=0.0) as s:
        for k in keys:  # one put each: the LRU order is the put order
            assert s.put_many([item_for(k, PAYLOAD)]) == [True]
        yield s, keys


def evict_after_lookup(s: LmdbStore, evict: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next index lookup of ``s`` run ``evict()`` once, right after it returns (the
    entries are read; no record byte yet). Returns a list the number of keys that lookup
    found indexed is appended to (so a test checks that the race did happen: every key was
    read from an entry found before the eviction)."""
    real = s._reads.lookup
    ran: list[int] = []

    def lookup(kbs: list[bytes]) -> list[bytes | None]:
        values = real(kbs)
        if not ran:
            ran.append(sum(v is not None for v in values))
            evict()
        return values

    monkeypatch.setattr(s._reads, "lookup", lookup)
    return ran


def by_put(s: LmdbStore, first: int, count: int, *, payload_seed: int = 1000) -> Callable[[], None]:
    """An eviction by a writer's puts: ``count`` new records, each evicting the least
    recently used one (``first``, ``first + 1``, ...: the store is full)."""
    def evict() -> None:
        for j in range(count):
            assert s.put_many([item_for(make_key(payload_seed + j), PAYLOAD)]) == [True]

    return evict


def read(s: LmdbStore, how: str, keys: list[Any]) -> list[np.ndarray | None]:
    """Read ``keys`` through ``how``: each record's payload as read, None for a miss."""
    outs = [np.full(PAYLOAD, 0xAB, np.uint8) for _ in keys]
    if how == "get_many":
        metas = s.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
    elif how == "get_many_unhashed":
        metas = s.get_many_unhashed(keys, outs)
    else:
        dest = np.full(len(keys) * PAYLOAD, 0xAB, np.uint8)
        rows = RowScatter((dest,), np.zeros(1, np.int64), np.array([PAYLOAD], np.int64),
                          (np.arange(len(keys), dtype=np.int64) * PAYLOAD)[:, None])
        metas = s.get_rows(keys, rows, token_digests=[digest_for(k) for k in keys])
        outs = [dest[i * PAYLOAD:(i + 1) * PAYLOAD] for i in range(len(keys))]
    return [out if ok else None for out, ok in zip(outs, [m is not None and m is not False for m in metas])]


def check(s: LmdbStore, got: list[np.ndarray | None], keys: list[Any], gone: set[int], before: dict[str, int],
          payloads: dict[int, list[np.ndarray]] | None = None) -> None:
    """The evicted keys (``gone``) are misses, the others hits with their exact bytes (or
    one of the payloads ever stored under the key: ``payloads``); counted as misses, never
    corrupt."""
    for i, (key, out) in enumerate(zip(keys, got)):
        if i in gone:
            assert out is None, f"key {i}: evicted between the lookup and the read, yet read"
        else:
            assert out is not None, f"key {i}: never evicted, yet a miss"
            expected = (payloads or {}).get(i, [payload_for(key, PAYLOAD)])
            assert any(np.array_equal(out, p) for p in expected), f"key {i}: wrong bytes"
    st = s.stats()
    assert st["corrupt"] == before["corrupt"] == 0
    assert st["misses"] - before["misses"] == len(gone)
    assert st["hits"] - before["hits"] == len(keys) - len(gone)


HOW = ["get_many", "get_many_unhashed", "get_rows"]


@pytest.mark.parametrize("how", HOW)
def test_records_a_put_evicts_after_the_lookup_are_misses(store, how: str, impl: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's race: a batch of N reads looked up, then four puts evict keys 0-3
    (the least recently used) before any byte is read."""
    s, keys = store
    before = s.stats()
    ran = evict_after_lookup(s, by_put(s, 0, 4), monkeypatch)
    got = read(s, how, keys)
    assert ran == [N], "the eviction never ran between the lookup and the read"
    assert [k in s for k in keys] == [i >= 4 for i in range(N)]  # the puts did evict 0-3
    check(s, got, keys, set(range(4)), before)
    assert all(k in s for k in keys[4:])  # nothing of the batch was unindexed as corrupt


@pytest.mark.parametrize("how", HOW)
def test_records_gc_evicts_after_the_lookup_are_misses_their_segments_gone(store, how: str, impl: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``gc`` between the lookup and the read: the 6 oldest records evicted, and the sealed
    segments that held only them unlinked (the entries point into files that are gone)."""
    s, keys = store
    segments_before = sorted((s.path / "segments").glob("*.seg"))
    before = s.stats()
    ran = evict_after_lookup(s, lambda: s.gc(MAX_BYTES - 6 * record_size(PAYLOAD)), monkeypatch)
    got = read(s, how, keys)
    assert ran == [N]
    gone = {i for i, k in enumerate(keys) if k not in s}
    assert gone == set(range(6))
    assert len(sorted((s.path / "segments").glob("*.seg"))) < len(segments_before)  # files unlinked
    check(s, got, keys, gone, before)


@pytest.mark.parametrize("how", HOW)
def test_a_key_evicted_and_put_again_after_the_lookup_is_a_miss_then_a_hit(store, how: str, impl: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Key 0 evicted and put again (another payload, another place) between the lookup and
    the read: this read misses it (its entry was the old one), the next one reads the new
    bytes; neither counts corrupt nor unindexes the new record."""
    s, keys = store
    new = np.arange(PAYLOAD, dtype=np.uint8)

    def evict_and_put_again() -> None:
        by_put(s, 0, 1)()
        assert keys[0] not in s
        assert s.put_many([item_for(keys[0], PAYLOAD, payload=new)]) == [True]

    before = s.stats()
    ran = evict_after_lookup(s, evict_and_put_again, monkeypatch)
    got = read(s, how, keys[:4])
    assert ran == [4] and keys[0] in s
    gone = {i for i, k in enumerate(keys[:4]) if got[i] is None}
    assert 0 in gone  # the old entry's bytes were punched
    check(s, got, keys[:4], gone, before)
    again = read(s, how, [keys[0]])
    assert again[0] is not None and np.array_equal(again[0], new)
    assert s.stats()["corrupt"] == 0


def test_every_key_of_a_batch_evicted_after_the_lookup(store, impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole batch evicted (``gc`` to nothing) between its lookup and its read: N
    misses, no error, nothing corrupt; the store is empty and takes the records again."""
    s, keys = store
    before = s.stats()
    ran = evict_after_lookup(s, lambda: s.gc(0), monkeypatch)
    got = read(s, "get_rows", keys)
    assert ran == [N] and not any(k in s for k in keys)
    check(s, got, keys, set(range(N)), before)
    assert all(s.put_many([item_for(k, PAYLOAD) for k in keys]))
    assert all(out is not None for out in read(s, "get_many", keys))
