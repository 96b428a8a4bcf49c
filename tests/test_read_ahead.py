"""ReadAhead (tiered_kv.integrations.read_ahead): chunks a lookup found, read ahead into
bounded staging rows and delivered to the load, over a real LMDB store."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from tiered_kv.integrations.read_ahead import ReadAhead
from tiered_kv.storage import LmdbStore, PutItem, RecordKey

CHUNK = 4096


def _record(key: str) -> tuple[RecordKey, bytes]:
    return RecordKey.block(hashlib.sha256(key.encode()).digest()), hashlib.sha256(b"digest" + key.encode()).digest()


def _payload(key: str) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key.encode()[-4:].rjust(4, b"\0"), "little")).integers(
        0, 256, CHUNK, dtype=np.uint8)


@pytest.fixture
def store(tmp_path: Path):
    s = LmdbStore(tmp_path / "kv", layout_fingerprint="read-ahead-test")
    yield s
    s.close()


def _put(store: LmdbStore, keys: list[str]) -> None:
    store.put_many([PutItem(_record(k)[0], bytes(32), _record(k)[1], _payload(k)) for k in keys])


def _read_ahead(store, capacity: int = 8) -> ReadAhead[str]:
    return ReadAhead(store, chunk_bytes=CHUNK, capacity=capacity, record=_record)


def test_staged_chunks_are_delivered_verified_and_read_once(store: LmdbStore) -> None:
    keys = [f"k{i}" for i in range(5)]
    _put(store, keys)
    ra = _read_ahead(store)
    hits = store.stats()["hits"]
    assert ra.start(keys) == 5
    assert ra.start(keys[:2]) == 0                      # already staged: not read twice
    staged = ra.take(keys)
    assert set(staged) == set(keys) and ra.take(keys) == {}   # taken once
    for k in keys:
        out = np.zeros(CHUNK, np.uint8)
        assert ra.deliver(staged[k], out) is True
        assert np.array_equal(out, _payload(k))
    assert store.stats()["hits"] - hits == 5            # one verified read per chunk, by the read-ahead
    st = ra.stats()
    assert (st.started, st.delivered, st.dropped) == (5, 5, 0)
    ra.close()


def test_a_missing_or_corrupt_record_is_a_miss_never_bytes(store: LmdbStore, tmp_path: Path) -> None:
    from _util import lmdb_raw_read, lmdb_raw_write

    _put(store, ["good", "bad"])
    bad_key = _record("bad")[0].to_bytes()
    store.close()
    value = bytearray(lmdb_raw_read(tmp_path / "kv", bad_key))
    value[len(value) // 2] ^= 0xFF                      # a payload byte, in the segment file
    lmdb_raw_write(tmp_path / "kv", bad_key, bytes(value))
    store = LmdbStore(tmp_path / "kv", layout_fingerprint="read-ahead-test")
    ra = _read_ahead(store)
    assert ra.start(["good", "bad", "absent"]) == 3
    staged = ra.take(["good", "bad", "absent"])
    outs = {k: np.full(CHUNK, 7, np.uint8) for k in staged}
    assert {k: ra.deliver(s, outs[k]) for k, s in staged.items()} == {"good": True, "bad": False, "absent": False}
    assert np.array_equal(outs["good"], _payload("good"))
    assert (outs["bad"] == 7).all() and (outs["absent"] == 7).all()   # nothing copied for a miss
    assert store.stats()["corrupt"] == 1
    ra.close()
    store.close()


def test_staging_is_bounded_and_the_oldest_finished_entries_make_room(store: LmdbStore) -> None:
    keys = [f"k{i}" for i in range(7)]
    _put(store, keys)
    ra = _read_ahead(store, capacity=3)
    assert ra.start(keys[:5]) == 3                      # no room for k3, k4: left to their load
    assert ra.take(keys[3:5]) == {}
    # wait for the first batch: finished entries no load took can make room
    staged = ra.take(keys[:1])
    assert ra.deliver(staged["k0"], np.zeros(CHUNK, np.uint8)) is True
    assert ra.start(keys[5:7]) == 2                     # k0's row is free; k1 (oldest) is dropped
    assert set(ra.take(keys)) == {"k2", "k5", "k6"}
    st = ra.stats()
    assert (st.started, st.delivered, st.dropped) == (5, 1, 1)
    ra.close()


class _GatedStore:
    """A store whose get_many waits for ``gate`` (holds the read-ahead's reader busy), or
    raises ``fail`` when set."""

    def __init__(self, store: LmdbStore) -> None:
        self.store = store
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def get_many(self, keys, outs, **kw):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        return self.store.get_many(keys, outs, **kw)


def test_a_read_not_started_is_cancelled_and_one_that_raised_is_left_to_the_load(store: LmdbStore) -> None:
    _put(store, ["a", "b", "c"])
    gated = _GatedStore(store)
    ra = _read_ahead(gated)
    assert ra.start(["a"]) == 1                         # the reader blocks on this one
    assert ra.start(["b"]) == 1                         # queued behind it
    staged = ra.take(["b"])
    assert ra.deliver(staged["b"], np.zeros(CHUNK, np.uint8)) is None   # cancelled: not read
    gated.fail = OSError("store unreachable")
    gated.gate.set()
    assert ra.deliver(ra.take(["a"])["a"], np.zeros(CHUNK, np.uint8)) is None   # raised: not read
    gated.fail = None
    assert ra.start(["b", "c"]) == 2                    # the rows came back
    staged = ra.take(["c"])["c"]
    staged.future.result(30)                            # read (not cancelled as not started)
    out = np.zeros(CHUNK, np.uint8)
    assert ra.deliver(staged, out) is True and np.array_equal(out, _payload("c"))
    ra.close()


def test_close_waits_for_reads_and_stops_reading_ahead(store: LmdbStore) -> None:
    _put(store, ["a", "b"])
    gated = _GatedStore(store)
    ra = _read_ahead(gated)
    assert ra.start(["a"]) == 1
    assert gated.entered.wait(30)                       # the read is in flight
    closer = threading.Thread(target=ra.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()                            # the read in flight uses the store
    gated.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert ra.start(["b"]) == 0 and ra.take(["a", "b"]) == {}
    assert ra.stats().dropped == 1


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity >= 1"):
        ReadAhead(object(), chunk_bytes=CHUNK, capacity=0, record=_record)  # type: ignore[arg-type]


def test_a_key_staged_as_a_miss_is_read_again_by_its_next_lookup(store: LmdbStore) -> None:
    """A lookup raced with an eviction (its read found nothing); once the chunk is stored
    again, the next lookup reads it again rather than keep the stale miss."""
    _put(store, ["other"])
    ra = _read_ahead(store)
    assert ra.start(["gone"]) == 1                      # its read finds no record
    assert ra.start(["other"]) == 1
    other = ra.take(["other"])["other"]
    other.future.result(30)                             # one reader, in order: "gone" was read first
    assert ra.deliver(other, np.zeros(CHUNK, np.uint8)) is True
    _put(store, ["gone"])
    assert ra.start(["gone"]) == 1                      # read again, not kept as a miss
    staged = ra.take(["gone"])["gone"]
    staged.future.result(30)
    out = np.zeros(CHUNK, np.uint8)
    assert ra.deliver(staged, out) is True and np.array_equal(out, _payload("gone"))
    assert ra.stats().dropped == 1
    ra.close()
