"""Row reads: ``get_rows`` reads a batch of records into the pieces a :class:`RowScatter`
gives them (a cache's pool rows), natively where the helper is built and through
``get_many`` otherwise, with the same verdicts as ``get_many``: every record verified, a
corrupt one a counted miss (and unindexed), the others exact."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from _util import lmdb_raw_read, lmdb_raw_write
from storage_helpers import FP, digest_for, item_for, make_key, payload_for, row_impls, use_row_impl
from tiered_kv.storage import LmdbStore, RowScatter, ZarrStore, fastread

PAYLOAD = 30_000
#: the payload of every record cut into pieces of these sizes (a header-sized piece, odd ones)
CUTS = [0, 144, 145, 9_000, 20_001, PAYLOAD]
N = 12

@pytest.fixture(params=row_impls())
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each implementation in turn: the native row read, or get_many with views."""
    return use_row_impl(request.param, monkeypatch)


def _rows(n: int, *, slots: list[int] | None = None) -> tuple[RowScatter, list[np.ndarray]]:
    """Two destinations of ``n + 2`` record slots each; piece j of record k goes to slot
    ``slots[k]`` (default: reversed) of dest ``j % 2``, at the piece's own place in it."""
    dests = [np.zeros((n + 2) * PAYLOAD, np.uint8) for _ in range(2)]
    slots = list(range(n))[::-1] if slots is None else slots
    lengths = np.diff(CUTS).astype(np.int64)
    dest_of = np.arange(len(lengths), dtype=np.int64) % 2
    offsets = np.array(slots, np.int64)[:, None] * PAYLOAD + np.array(CUTS[:-1], np.int64)
    return RowScatter(tuple(dests), dest_of, lengths, offsets), dests


def _payload_at(rows: RowScatter, k: int) -> np.ndarray:
    """Record k's payload as it landed: its pieces, joined."""
    return np.concatenate([rows.dests[d][o:o + n] for d, o, n in
                           zip(rows.dest_of.tolist(), rows.offsets[k].tolist(), rows.lengths.tolist())])


@pytest.fixture
def store(tmp_path: Path):
    keys = [make_key(i) for i in range(N)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as s:
        assert all(s.put_many([item_for(k, PAYLOAD) for k in keys]))
    yield tmp_path / "s", keys


def test_rows_land_in_their_pieces_exactly(store, impl: str) -> None:
    path, keys = store
    rows, _ = _rows(N)
    with LmdbStore(path, layout_fingerprint=FP) as s:
        assert s.supports_row_reads == (impl == "native")
        assert s.get_rows(keys, rows, token_digests=[digest_for(k) for k in keys]) == [True] * N
        assert s.stats()["hits"] == N and s.stats()["misses"] == 0
    for k, key in enumerate(keys):
        np.testing.assert_array_equal(_payload_at(rows, k), payload_for(key, PAYLOAD))


def _evict(path: Path) -> None:
    """Drop the store's segment files from the page cache (the next read is cold)."""
    for f in (path / "segments").iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.parametrize("cold", [False, True], ids=["hot", "cold"])
def test_a_corrupt_record_mid_batch_is_a_counted_miss_the_others_exact(store, impl: str, cold: bool) -> None:
    """Hot: read into the pieces, then checked; cold (O_DIRECT extents): checked in the
    bounce buffer, then copied. Either way only the corrupt record is a miss."""
    path, keys = store
    kb = keys[5].to_bytes()
    rec = bytearray(lmdb_raw_read(path, kb))
    rec[len(rec) // 2] ^= 0x01  # one payload bit, in the segment file
    lmdb_raw_write(path, kb, bytes(rec))
    if cold:
        _evict(path)
    rows, _ = _rows(N)
    with LmdbStore(path, layout_fingerprint=FP) as s:
        ok = s.get_rows(keys, rows, token_digests=[digest_for(k) for k in keys])
        assert ok == [k != 5 for k in range(N)]
        st = s.stats()
        assert st["hits"] == N - 1 and st["misses"] == 1 and st["corrupt"] == 1
        assert keys[5] not in s  # unindexed, so that a later put of the right record works
    for k, key in enumerate(keys):
        if k != 5:
            np.testing.assert_array_equal(_payload_at(rows, k), payload_for(key, PAYLOAD))


def test_misses_and_foreign_digests_are_misses(store, impl: str) -> None:
    path, keys = store
    absent = make_key(999)
    rows, _ = _rows(3)
    with LmdbStore(path, layout_fingerprint=FP, readonly=True) as s:
        ok = s.get_rows([keys[0], absent, keys[2]], rows,
                        token_digests=[digest_for(keys[0]), digest_for(absent), digest_for(keys[1])])
        assert ok == [True, False, False]
        assert s.stats()["misses"] == 2
        # digests given for some records and not for others: each checked as given
        assert s.get_rows(keys[:2], rows.take([0, 1]), token_digests=[None, digest_for(keys[1])]) == [True, True]
    np.testing.assert_array_equal(_payload_at(rows, 0), payload_for(keys[0], PAYLOAD))


def test_a_stored_payload_of_another_size_is_refused_as_by_get_many(tmp_path: Path, impl: str) -> None:
    key = make_key(1)
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as s:
        s.put_many([item_for(key, PAYLOAD + 1)])
        rows, _ = _rows(1)
        with pytest.raises(ValueError, match="expected 30001 bytes"):
            s.get_rows([key], rows)


def test_cold_rows_read_the_same(store, impl: str) -> None:
    """Evicted from the page cache first: the native path reads extents with O_DIRECT
    (or, where the filesystem refuses it, asks the disk for every extent with
    POSIX_FADV_WILLNEED and reads as the pages arrive)."""
    path, keys = store
    for direct in (None, False):
        _evict(path)
        rows, _ = _rows(N, slots=list(range(N)))
        with LmdbStore(path, layout_fingerprint=FP, readonly=True, direct_io=direct) as s:
            assert s.get_rows(keys, rows) == [True] * N
    for k, key in enumerate(keys):
        np.testing.assert_array_equal(_payload_at(rows, k), payload_for(key, PAYLOAD))


def test_every_store_takes_row_reads(tmp_path: Path) -> None:
    """Stores without native row reads take the plan as scatter lists through get_many."""
    keys = [make_key(i) for i in range(3)]
    with ZarrStore(tmp_path / "z", layout_fingerprint=FP) as s:
        s.put_many([item_for(k, PAYLOAD) for k in keys])
        assert not s.supports_row_reads
        rows, _ = _rows(3)
        assert s.get_rows(keys, rows) == [True] * 3
    for k, key in enumerate(keys):
        np.testing.assert_array_equal(_payload_at(rows, k), payload_for(key, PAYLOAD))


def test_plans_are_checked() -> None:
    rows, dests = _rows(2)
    with pytest.raises(ValueError, match="offsets: expected every piece within its dest"):
        RowScatter(rows.dests, rows.dest_of, rows.lengths, rows.offsets + len(dests[0]))
    with pytest.raises(ValueError, match="dest_of: expected indices into dests"):
        RowScatter(rows.dests, rows.dest_of + 1, rows.lengths, rows.offsets)
    with pytest.raises(ValueError, match="dests\\[0\\]: expected a writable"):
        RowScatter((dests[0][::2], dests[1]), rows.dest_of, rows.lengths, rows.offsets)
    with pytest.raises(ValueError, match="lengths: expected int64"):
        RowScatter(rows.dests, rows.dest_of, rows.lengths.astype(np.int32), rows.offsets)


@pytest.mark.skipif(fastread.native_read_verify_rows is None, reason="native helper not built")
def test_native_checks_every_piece_lies_within_its_dest(tmp_path: Path) -> None:
    """The native call checks the plan itself (it is handed raw offsets)."""
    rows, _ = _rows(1)
    path = tmp_path / "f"
    path.write_bytes(bytes(PAYLOAD + 160))
    fd = os.open(path, os.O_RDONLY)
    try:
        where = np.array([[fd, 0]], np.int64)
        expect = np.zeros((1, 96), np.uint8)
        bad = rows.offsets.copy()
        bad[0, 2] = rows.dests[0].nbytes - 1  # piece 2 would run past its dest
        with pytest.raises(ValueError, match="expected a piece within dests"):
            fastread.native_read_verify_rows(rows.dests, rows.dest_of, rows.lengths, bad, where, expect)
        with pytest.raises(ValueError, match="expected a dest index"):
            fastread.native_read_verify_rows(rows.dests, rows.dest_of + 5, rows.lengths, rows.offsets, where, expect)
        with pytest.raises((BufferError, ValueError), match="read-only|writable"):
            ro = rows.dests[0].copy()
            ro.flags.writeable = False
            fastread.native_read_verify_rows((ro, rows.dests[1]), rows.dest_of, rows.lengths, rows.offsets,
                                             where, expect)
        # all zeros: read whole, but not a record
        assert fastread.native_read_verify_rows(rows.dests, rows.dest_of, rows.lengths, rows.offsets, where,
                                                expect) == bytes([fastread.FAILED])
    finally:
        os.close(fd)


@pytest.mark.skipif(fastread.native_verify_rows is None, reason="native helper not built")
def test_native_verify_rows_checks_the_plan_and_the_source() -> None:
    """The in-memory variant (cold O_DIRECT extents): the same plan checks; a record not
    wholly in ``src`` is SHORT, one failing its checks FAILED, and neither is copied out."""
    rows, dests = _rows(2)
    src = np.zeros(PAYLOAD + 160 + 100, np.uint8)
    expect = np.zeros((2, 96), np.uint8)
    bad = rows.offsets.copy()
    bad[1, 0] = -1
    with pytest.raises(ValueError, match="expected a piece within dests"):
        fastread.native_verify_rows(src, np.array([0, 50], np.int64), rows.dests, rows.dest_of, rows.lengths,
                                    bad, expect)
    dests[0][:] = 7
    got = fastread.native_verify_rows(src, np.array([0, 200], np.int64), rows.dests, rows.dest_of, rows.lengths,
                                      rows.offsets, expect)
    assert got == bytes([fastread.FAILED, fastread.SHORT])
    assert (dests[0] == 7).all()  # nothing copied out of a record that failed
