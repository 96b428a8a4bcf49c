"""Sequential read-ahead of the segment files (storage/lmdb/read_ahead.py): which reads
start and continue a stream, what is asked of the disk, and that records read after it
are still verified (a corrupt one is a miss, counted)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from storage_helpers import FP, digest_for, item_for, make_key, payload_for
from tiered_kv.storage import LmdbStore
from tiered_kv.storage.lmdb import read_ahead
from tiered_kv.storage.lmdb.open_files import OpenSegments
from tiered_kv.storage.lmdb.read_ahead import AHEAD_MAX, AHEAD_MIN, ReadAhead

MIB = 1 << 20


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every (offset, length) the read-ahead asks with POSIX_FADV_WILLNEED."""
    got: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def spy(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            got.append((offset, length))
        real(fd, offset, length, advice)

    monkeypatch.setattr(read_ahead.os, "posix_fadvise", spy)
    return got


def _ahead(tmp_path: Path) -> tuple[ReadAhead, OpenSegments]:
    folder = tmp_path / "segments"
    folder.mkdir()
    with open(folder / "00000001.seg", "wb") as f:
        f.truncate(64 * MIB)
    files = OpenSegments(folder, limit=4)
    return ReadAhead(files), files


def _spans(asked: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(a, a + n) for a, n in asked]


def test_a_run_read_cold_asks_for_what_follows(tmp_path: Path, asked: list[tuple[int, int]]) -> None:
    ra, files = _ahead(tmp_path)
    try:
        ra.note([(1, 0, 8 * MIB, 8 * MIB)], cold=True)   # a run of records read from the disk
        ra.close()
        assert ra.covers(1, 8 * MIB, 16 * MIB) and not ra.covers(1, 8 * MIB, 30 * MIB)
        total = sum(n for _, n in asked)
        assert asked[0][0] == 8 * MIB and total == min(AHEAD_MAX, 16 * MIB)  # twice the span, at most AHEAD_MAX
        assert all(n <= 4 * MIB for _, n in asked)
    finally:
        files.close()


def test_scattered_or_hot_reads_start_no_stream(tmp_path: Path, asked: list[tuple[int, int]]) -> None:
    ra, files = _ahead(tmp_path)
    try:
        ra.note([(1, 0, 32 * MIB, 2 * MIB)], cold=True)  # a few records scattered over 32 MiB
        ra.note([(1, 40 * MIB, 48 * MIB, 8 * MIB)], cold=False)  # from the page cache, outside any stream
        ra.close()
        assert asked == [] and not ra.active
    finally:
        files.close()


def test_a_stream_keeps_ahead_but_never_far_ahead(tmp_path: Path, asked: list[tuple[int, int]]) -> None:
    ra, files = _ahead(tmp_path)
    try:
        at = 0
        for _ in range(5):  # batches of 2 MiB read in order, the later ones from the page cache
            ra.note([(1, at, at + 2 * MIB, 2 * MIB)], cold=at == 0)
            at += 2 * MIB
        ra.close()
        spans = _spans(asked)
        assert spans[0][0] == 2 * MIB
        assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))  # in order, nothing asked twice
        assert spans[-1][1] <= at + max(AHEAD_MIN, 4 * MIB)              # about twice a batch ahead
        ra.note([(1, 50 * MIB, 52 * MIB, 2 * MIB)], cold=False)        # a jump: not the stream
        assert ra.covers(1, at, at + 2 * MIB) and not ra.covers(1, 50 * MIB, 52 * MIB)
    finally:
        files.close()


@pytest.mark.parametrize("direct_io", [None, False])
def test_cold_reads_in_order_are_read_ahead_and_still_verified(tmp_path: Path, direct_io: bool | None) -> None:
    """Batches of records read cold in the order they were written: after the first ones
    the store asks the disk ahead and reads the rest from the page cache; every record is
    verified on the way (one corrupted beyond the first batch is a miss, counted)."""
    n, size, batch = 48, 200_000, 8
    keys = [make_key(i) for i in range(n)]
    path = tmp_path / "s"
    with LmdbStore(path, layout_fingerprint=FP, direct_io=direct_io) as store:
        store.put_many([item_for(k, size) for k in keys])
    seg = next((path / "segments").iterdir())
    raw = bytearray(seg.read_bytes())
    bad = 30
    pos = raw.find(payload_for(keys[bad], size)[:64].tobytes())
    raw[pos + 5000] ^= 0xFF
    seg.write_bytes(bytes(raw))
    fd = os.open(seg, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    with LmdbStore(path, layout_fingerprint=FP, direct_io=direct_io) as store:
        outs = [np.zeros(size, np.uint8) for _ in keys]
        metas = []
        for a in range(0, n, batch):
            metas += store.get_many(keys[a:a + batch], outs[a:a + batch],
                                    token_digests=[digest_for(k) for k in keys[a:a + batch]])
        engine = store._segments.reads
        assert engine.ahead.asked_bytes > 0 or engine.ahead.calls == 0  # (asks still in flight are fine)
        assert [m is None for m in metas] == [i == bad for i in range(n)]
        for i in range(n):
            if i != bad:
                np.testing.assert_array_equal(outs[i], payload_for(keys[i], size))
        assert store.stats()["corrupt"] == 1
        assert sum(engine.paths.values()) == n
        assert engine.paths["hot"] > 0  # read ahead: found in the page cache
