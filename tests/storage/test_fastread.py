"""Verified hot reads: read_and_hash (native and Python), the shards hot reads are spread
over, and get_many giving the same answers through either implementation."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from storage_helpers import FP, digest_for, item_for, make_key, payload_for
from tiered_kv.storage import LmdbStore
from tiered_kv.storage.os import fastread, libc
from tiered_kv.storage.os import threads as os_threads
from tiered_kv.storage.format.record import CHECKSUM_BYTES, HEADER_BYTES
from tiered_kv.storage.lmdb.read_tasks import MIN_SHARD, ReadTask, cut_shards
from tiered_kv.storage.lmdb.schema import Location, segment_name
from tiered_kv.storage.lmdb.segments import SegmentFiles

IMPLS = {"python": fastread.python_read_and_hash}
if fastread.native_read_and_hash is not None:
    IMPLS["native"] = fastread.native_read_and_hash


@pytest.fixture(params=sorted(IMPLS))
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Each read_and_hash implementation in turn, as the one the stores use (natively
    with the batch read-and-verify, in Python without it)."""
    fn = IMPLS[request.param]
    monkeypatch.setattr(fastread, "read_and_hash", fn)
    monkeypatch.setattr(fastread, "read_verify_many",
                        fastread.native_read_verify_many if request.param == "native" else None)
    monkeypatch.setattr(fastread, "VerifyBatch", fastread.native_VerifyBatch if request.param == "native" else None)
    monkeypatch.setattr(fastread, "verify_copy_many",
                        fastread.native_verify_copy_many if request.param == "native" else None)
    return fn


def test_native_helper_is_built_where_a_compiler_is() -> None:
    """`pip install` (make venv) builds storage/os/_fastread.c; it binds python-xxhash's xxh3
    and passes the self-check. Skipped where no C compiler or Python headers exist (the
    package then installs without it and the Python implementation is used)."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (shutil.which("cc") or shutil.which("gcc")) or not headers.exists():
        pytest.skip("no C compiler or Python headers: the optional native helper is not built")
    assert fastread.native_read_and_hash is not None, \
        "storage/os/_fastread.c was not built or failed its check: reinstall with `make venv`"
    assert fastread.NATIVE == (os.environ.get("TIERED_KV_NATIVE", "1") != "0")


def _file(tmp_path: Path, data: np.ndarray) -> int:
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    return os.open(path, os.O_RDONLY)


def test_native_helper_exports_the_python_record_format() -> None:
    """The C helper's compiled-in header layout and read statuses are the Python ones."""
    if fastread.native_read_and_hash is None:
        pytest.skip("the native helper is not built here")
    from tiered_kv.storage.os import _fastread

    assert fastread.layout_mismatches(_fastread) == []
    assert (_fastread.HEADER_BYTES, _fastread.ST_UNCACHED) == (HEADER_BYTES, fastread.UNCACHED)


_MISMATCH_SCRIPT = """
import json, sys, warnings
import tiered_kv.storage.os._fastread as ext
setattr(ext, sys.argv[1], getattr(ext, sys.argv[1]) + 1)   # as if built from another format
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from tiered_kv.storage.os import fastread
    from tiered_kv.storage import LmdbStore   # and the store still reads (the Python path)
print(json.dumps({"native": fastread.NATIVE, "bound": fastread.native_read_and_hash is not None,
                  "batch": fastread.read_verify_many is not None,
                  "warnings": [str(w.message) for w in caught if w.category is RuntimeWarning]}))
"""


@pytest.mark.parametrize("name", ["HEADER_BYTES", "DIGEST_AT", "ST_BAD"])
def test_native_helper_of_another_format_is_not_used(name: str) -> None:
    """A helper whose compiled-in layout or statuses differ from Python's is refused when
    it loads: the Python read path is used, with a warning that names the difference."""
    if fastread.native_read_and_hash is None:
        pytest.skip("the native helper is not built here")
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TIERED_KV_NATIVE"}
    proc = subprocess.run([sys.executable, "-c", _MISMATCH_SCRIPT, name], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["native"], got["bound"], got["batch"]) == (False, False, False)
    assert len(got["warnings"]) == 1 and name in got["warnings"][0] and "Python read path" in got["warnings"][0]



@pytest.mark.parametrize("pieces", [[144, 16], [144, 1, 70_000, 3, 16], [144] + [584] * 300 + [16]])
def test_read_and_hash_fills_buffers_and_hashes_all_but_the_last(impl, tmp_path: Path, pieces: list[int]) -> None:
    data = np.random.default_rng(0).integers(0, 256, sum(pieces) + 100, dtype=np.uint8)
    fd = _file(tmp_path, data)
    try:
        bufs = [np.zeros(n, np.uint8) for n in pieces]
        got, digest = impl(fd, 50, bufs)
    finally:
        os.close(fd)
    total = sum(pieces)
    assert got == total
    assert digest == xxhash.xxh3_128(data[50:50 + total - 16]).digest()
    np.testing.assert_array_equal(np.concatenate(bufs), data[50:50 + total])


def test_read_and_hash_short_read_gives_no_digest(impl, tmp_path: Path) -> None:
    data = np.arange(1000, dtype=np.uint8)
    fd = _file(tmp_path, data)
    try:
        got, digest = impl(fd, 900, [np.zeros(144, np.uint8), np.zeros(16, np.uint8)])
        assert (got, digest) == (100, None)
    finally:
        os.close(fd)


def test_read_and_hash_read_error_raises(impl, tmp_path: Path) -> None:
    fd = _file(tmp_path, np.zeros(100, np.uint8))
    os.close(fd)
    with pytest.raises(OSError):
        impl(fd, 0, [np.zeros(84, np.uint8), np.zeros(16, np.uint8)])


def test_native_rejects_read_only_buffers_and_bad_tails(tmp_path: Path) -> None:
    if "native" not in IMPLS:
        pytest.skip("native helper not built")
    fn = IMPLS["native"]
    fd = _file(tmp_path, np.zeros(200, np.uint8))
    try:
        with pytest.raises((TypeError, BufferError, ValueError)):
            fn(fd, 0, [bytes(144), np.zeros(16, np.uint8)])
        with pytest.raises(ValueError, match="16 bytes"):
            fn(fd, 0, [np.zeros(144, np.uint8), np.zeros(15, np.uint8)])
    finally:
        os.close(fd)


# ------------------------------------------------------------------ shards of a hot read
def _tasks(lengths: list[int]) -> list[ReadTask]:
    out, off = [], 0
    empty = np.zeros(0, np.uint8)
    for i, n in enumerate(lengths):
        out.append(ReadTask(i, Location(1, off, n), empty, [empty], empty))
        off += n
    return out


@pytest.mark.parametrize("threads,lengths,shards", [
    (1, [500_000] * 8, 1),              # one thread: one shard
    (2, [500_000] * 16, 4),             # 8 MB, 2 threads: two shards each
    (4, [500_000] * 12, 5),             # 6 MB over 4 threads: at least 1 MiB per shard
    (8, [500_000] * 8, 3),              # 4 MB gives 3 (not 16)
    (4, [4096] * 50, 1),                # small records: one shard
    (4, [3_000_000, 10, 10, 10], 2),    # one big record and small ones
])
def test_shards_cover_every_record_once_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                threads: int, lengths: list[int], shards: int) -> None:
    monkeypatch.setattr(os_threads, "usable_cpus", lambda: threads)
    files = SegmentFiles(tmp_path, new_segment_id=lambda: 1, segment_bytes=1 << 30, direct_io=False,
                         io_threads=8, readonly=True)
    hot = _tasks(lengths)
    got = cut_shards(hot, files.reads.hot_threads)
    assert len(got) == shards and files.reads.hot_threads == min(8, threads)
    assert len(got) <= (2 * threads if threads > 1 else 1)
    assert [t for shard in got for t in shard] == hot
    if len(got) > 1:
        # about equal bytes, on average at least MIN_SHARD (cut at record boundaries)
        sizes = [sum(t.loc.length for t in s) for s in got]
        assert sum(sizes) / len(sizes) >= MIN_SHARD
        assert max(sizes) - min(sizes) <= 2 * max(lengths)


# ------------------------------------------------------------------ get_many through either implementation
def test_hot_get_many_spreads_over_threads(impl, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A hot batch of several MiB is read by ``hot_threads`` threads and every record comes
    back whole and verified: natively by one native batch with ``hot_threads - 1`` helper
    threads of its own (records handed to it as they are prepared); in Python cut into
    shards that the calling thread and ``hot_threads - 1`` I/O threads drain (which thread
    reads which record depends on timing)."""
    monkeypatch.setattr(os_threads, "usable_cpus", lambda: 4)
    made: list[tuple[int, int, bool]] = []
    if fastread.VerifyBatch is not None:  # (native)
        real = fastread.VerifyBatch

        def batch(capacity: int, threads: int = 1, cached_only: bool = False):
            made.append((capacity, threads, cached_only))
            return real(capacity, threads, cached_only)

        monkeypatch.setattr(fastread, "VerifyBatch", batch)
    keys = [make_key(i) for i in range(12)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, io_threads=4, direct_io=False) as store:
        store.put_many([item_for(k, 500_000) for k in keys])
        for f in (tmp_path / "s" / "segments").iterdir():
            f.read_bytes()  # the page cache holds them
        files = store._segments
        pool = files.pool()
        submitted: list[object] = []
        real_submit = pool.submit
        monkeypatch.setattr(pool, "submit", lambda fn, *a: submitted.append(fn) or real_submit(fn, *a))
        outs = [np.empty(500_000, np.uint8) for _ in keys]
        metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
        assert store.stats()["hits"] == 12
    assert all(metas)
    for k, out in zip(keys, outs):
        np.testing.assert_array_equal(out, payload_for(k, 500_000))
    if impl is IMPLS.get("native"):
        assert made == [(12, 4, True)] and submitted == []  # one native batch, 3 helpers
    else:
        assert len(submitted) == 3  # 6 MB in 5 shards: the caller and 3 pool threads drain them


@pytest.mark.parametrize("direct_io", [False, True, None])
def test_get_many_same_answers_either_implementation(impl, tmp_path: Path, direct_io: bool | None) -> None:
    """Hits, scatter-list outs, a corrupt record (a miss, counted) and an absent key come
    out the same through the native and the Python read_and_hash, hot and cold."""
    keys = [make_key(i) for i in range(6)]
    sizes = [100_000, 4097, 1, 0, 300_000, 65_536]
    path = tmp_path / "s"
    with LmdbStore(path, layout_fingerprint=FP, direct_io=direct_io) as store:
        store.put_many([item_for(k, n) for k, n in zip(keys, sizes)])
    seg = next((path / "segments").iterdir())
    raw = bytearray(seg.read_bytes())
    pos = raw.find(payload_for(keys[4], 300_000)[:64].tobytes())
    raw[pos + 1000] ^= 0xFF  # corrupt record 4's payload
    seg.write_bytes(bytes(raw))
    fd = os.open(seg, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold: read from the disk
    os.close(fd)
    with LmdbStore(path, layout_fingerprint=FP, direct_io=direct_io) as store:
        outs: list[object] = [np.empty(n, np.uint8) for n in sizes]
        first = np.empty(60_000, np.uint8)
        outs[0] = [first, np.empty(40_000, np.uint8)]  # a scatter list
        absent = make_key(99)
        metas = store.get_many([*keys, absent], [*outs, np.empty(10, np.uint8)],
                               token_digests=[*(digest_for(k) for k in keys), None])
        assert [m is not None for m in metas] == [True, True, True, True, False, True, False]
        np.testing.assert_array_equal(np.concatenate(outs[0]), payload_for(keys[0], 100_000))
        for i in (1, 2, 3, 5):
            np.testing.assert_array_equal(outs[i], payload_for(keys[i], sizes[i]))
            assert metas[i].payload_bytes == sizes[i] and metas[i].token_digest == digest_for(keys[i])
        assert store.stats()["corrupt"] == 1 and keys[4] not in store
    assert HEADER_BYTES + CHECKSUM_BYTES == 160


# ------------------------------------------------------------------ the native batch check
needs_native = pytest.mark.skipif("native" not in IMPLS, reason="native helper not built")


def _one_record(tmp_path: Path, flip: int | None, n: int = 5000) -> tuple[int, bytes]:
    """A file holding one encoded record (one bit flipped at byte ``flip``); (fd, record)."""
    from tiered_kv.storage.format.record import encode_record

    key = make_key(7)
    rec = bytearray(encode_record(key=key, parent_hash=bytes(range(32)), token_digest=digest_for(key),
                                  layout_fingerprint=FP, payload=payload_for(key, n)))
    clean = bytes(rec)
    if flip is not None:
        rec[flip] ^= 0x10
    path = tmp_path / f"r{flip}.bin"
    path.write_bytes(b"\0" * 100 + bytes(rec))
    return os.open(path, os.O_RDONLY), clean


def _both_verdicts(fd: int, record: bytes, *, checksum: bytes, token_digest: bytes | None,
                   length: int | None = None) -> tuple[bool, bool]:
    """(native batch verdict, Python read_and_hash + PartsVerifier verdict) of the record at 100."""
    from tiered_kv.storage.format.record import PartsVerifier

    key, n = make_key(7), len(record) if length is None else length
    v = PartsVerifier(FP)
    bufs = [np.empty(HEADER_BYTES, np.uint8), np.empty(n - 160 - 9, np.uint8), np.empty(9, np.uint8),
            np.empty(CHECKSUM_BYTES, np.uint8)]
    [status] = fastread.native_read_verify_many([(fd, 100, bufs, v.expectation(key, n, checksum, token_digest))])
    got, digest = fastread.python_read_and_hash(fd, 100, bufs)
    meta = None if got < n else v.verify(bufs[0].tobytes(), digest, bufs[-1], key=key, record_bytes=n,
                                         checksum=checksum, token_digest=token_digest)
    return status == fastread.VERIFIED, meta is not None


@needs_native
@settings(max_examples=120, deadline=None)
@given(pos=st.integers(0, 5000 + 160 - 1))
def test_native_batch_check_rejects_what_python_rejects(tmp_path_factory, pos: int) -> None:
    fd, clean = _one_record(tmp_path_factory.mktemp("r"), pos)
    try:
        assert _both_verdicts(fd, clean, checksum=clean[-16:], token_digest=digest_for(make_key(7))) == (False, False)
    finally:
        os.close(fd)


@needs_native
def test_native_batch_check_accepts_and_rejects_like_python(tmp_path: Path) -> None:
    fd, clean = _one_record(tmp_path, None)
    try:
        good = digest_for(make_key(7))
        assert _both_verdicts(fd, clean, checksum=clean[-16:], token_digest=good) == (True, True)
        assert _both_verdicts(fd, clean, checksum=clean[-16:], token_digest=None) == (True, True)
        assert _both_verdicts(fd, clean, checksum=bytes(16), token_digest=good) == (False, False)  # index differs
        assert _both_verdicts(fd, clean, checksum=clean[-16:], token_digest=bytes(32)) == (False, False)
        with pytest.raises(ValueError, match="expect must be"):
            fastread.native_read_verify_many([(fd, 100, [np.empty(144, np.uint8), np.empty(16, np.uint8)], b"x")])
        status = fastread.native_read_verify_many([(fd, 10_000, [np.empty(144, np.uint8), np.empty(16, np.uint8)],
                                             bytes(96))])
        assert status == [fastread.SHORT]  # past the end of the file
    finally:
        os.close(fd)


@needs_native
@settings(max_examples=60, deadline=None)
@given(pos=st.one_of(st.none(), st.integers(0, 5000 + 160 - 1)), pieces=st.integers(1, 4))
def test_verify_copy_many_gives_read_verify_many_verdicts(tmp_path_factory, pos: int | None, pieces: int) -> None:
    """A record already in memory (a cold read's bounce buffer), copied out and checked by
    verify_copy_many: the verdict read_verify_many gives the same bytes from a file, and,
    verified, the same bytes in every part (header, payload pieces, checksum)."""
    from tiered_kv.storage.format.record import PartsVerifier

    fd, clean = _one_record(tmp_path_factory.mktemp("r"), pos)
    try:
        n, key = len(clean), make_key(7)
        src = np.frombuffer(os.pread(fd, n + 100, 0), np.uint8)
        expect = PartsVerifier(FP).expectation(key, n, clean[-16:], digest_for(key))
        cuts = [(n - 160) * j // pieces for j in range(pieces + 1)]

        def parts() -> list[np.ndarray]:
            return [np.zeros(HEADER_BYTES, np.uint8), *(np.zeros(b - a, np.uint8) for a, b in zip(cuts, cuts[1:])),
                    np.zeros(CHECKSUM_BYTES, np.uint8)]

        mine, theirs = parts(), parts()
        [got] = fastread.native_verify_copy_many(src, [(100, mine, expect)])
        [want] = fastread.native_read_verify_many([(fd, 100, theirs, expect)])
        assert got == want == (fastread.VERIFIED if pos is None else fastread.FAILED)
        if pos is None:
            assert np.concatenate(mine).tobytes() == clean
        assert fastread.native_verify_copy_many(src[:n + 99], [(100, parts(), expect)]) == [fastread.SHORT]
        with pytest.raises(TypeError, match="expected \\(at, bufs, expect\\)"):
            fastread.native_verify_copy_many(src, [(100, parts())])
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the native batch, fed one record at a time
def _records_file(tmp_path: Path, sizes: list[int]) -> tuple[int, list[tuple[int, int, bytes]]]:
    """A file of encoded records (key i, sizes[i] of payload) after 100 bytes of junk:
    ``(fd, [(offset, record bytes, checksum)])``."""
    from tiered_kv.storage.format.record import encode_record

    blob, places = bytearray(b"\x07" * 100), []
    for i, n in enumerate(sizes):
        key = make_key(i)
        rec = encode_record(key=key, parent_hash=bytes(32), token_digest=digest_for(key), layout_fingerprint=FP,
                            payload=payload_for(key, n))
        places.append((len(blob), len(rec), bytes(rec[-16:])))
        blob += rec
    path = tmp_path / "records.bin"
    path.write_bytes(bytes(blob))
    return os.open(path, os.O_RDONLY), places


def _items(fd: int, places: list[tuple[int, int, bytes]], *, pieces: int = 1):
    """read_verify_many items for the records of _records_file (payloads cut in ``pieces``)."""
    from tiered_kv.storage.format.record import PartsVerifier

    v, items = PartsVerifier(FP), []
    for i, (off, n, checksum) in enumerate(places):
        payload = n - 160
        cuts = [payload * j // pieces for j in range(pieces + 1)]
        bufs = [np.zeros(HEADER_BYTES, np.uint8), *(np.zeros(b - a, np.uint8) for a, b in zip(cuts, cuts[1:])),
                np.zeros(CHECKSUM_BYTES, np.uint8)]
        items.append((fd, off, bufs, v.expectation(make_key(i), n, checksum, digest_for(make_key(i)))))
    return items


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("pieces", [1, 7])
def test_verify_batch_gives_read_verify_many_verdicts(tmp_path: Path, threads: int, pieces: int) -> None:
    """Records handed over one at a time come out as the one-call batch says, whatever the
    threads: good ones verified and filled (a payload over several 128 KiB runs, in pieces),
    a flipped payload byte and a wrong index checksum failed, a record past the end of the
    file short."""
    sizes = [300_000, 0, 5000, 700_000, 1, 140_000]
    fd, places = _records_file(tmp_path, sizes)
    try:
        places[3] = (places[3][0], places[3][1], bytes(16))  # the index's checksum differs
        os.close(fd)
        path = tmp_path / "records.bin"
        raw = bytearray(path.read_bytes())
        raw[places[5][0] + 160 + 70_000] ^= 1  # a payload byte of record 5
        path.write_bytes(bytes(raw))
        fd = os.open(path, os.O_RDONLY)
        places.append((len(raw) - 1000, 5160, bytes(16)))  # runs past the end: short
        want = [0, 0, 0, 2, 0, 2, 1]
        one = _items(fd, places, pieces=pieces)
        assert fastread.native_read_verify_many(one, threads) == want
        fed = _items(fd, places, pieces=pieces)
        batch = fastread.native_VerifyBatch(len(fed), threads)
        assert [batch.add(*item) for item in fed] == list(range(len(fed)))
        assert batch.finish() == want
        for (_, _, a, _), (_, _, b, _) in zip(one, fed):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        for i in (0, 1, 2, 4):
            np.testing.assert_array_equal(np.concatenate(fed[i][2][1:-1]), payload_for(make_key(i), sizes[i]))
        with pytest.raises(RuntimeError, match="finished"):
            batch.finish()
    finally:
        os.close(fd)


@needs_native
def test_verify_batch_rejects_bad_items_and_stays_usable(tmp_path: Path) -> None:
    fd, places = _records_file(tmp_path, [4000, 4000])
    try:
        items = _items(fd, places)
        batch = fastread.native_VerifyBatch(2, 2)
        with pytest.raises(ValueError, match="expect must be"):
            batch.add(fd, places[0][0], items[0][2], b"short")
        with pytest.raises(ValueError, match="header first"):
            batch.add(fd, places[0][0], [np.zeros(10, np.uint8), np.zeros(16, np.uint8)], items[0][3])
        with pytest.raises((TypeError, BufferError, ValueError)):
            batch.add(fd, places[0][0], [bytes(144), np.zeros(16, np.uint8)], items[0][3])
        batch.add(*items[0])
        batch.add(*items[1])
        with pytest.raises(ValueError, match="holds 2 records"):
            batch.add(*items[1])
        assert batch.finish() == [0, 0]
        abandoned = fastread.native_VerifyBatch(2, 2)  # never finished: dropping it waits for its helpers
        abandoned.add(*_items(fd, places)[0])
        del abandoned
        assert fastread.native_read_verify_many(_items(fd, places), 2) == [0, 0]  # the helpers are free again
    finally:
        os.close(fd)


@needs_native
def test_verify_batch_cached_only_leaves_what_the_page_cache_lacks(tmp_path: Path) -> None:
    """``cached_only``: a record not (all) in the page cache is not read (status 3, its
    buffers untouched), so that the store reads it on its cold path."""
    fd, places = _records_file(tmp_path, [200_000, 200_000])
    try:
        if libc.cached_pages(fd, 0, 4096) is None:
            pytest.skip("no cachestat here: every record counts as cached")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if libc.cached_pages(fd, places[1][0], places[1][1])[0] != 0:
            pytest.skip("this filesystem keeps the pages cached")
        os.pread(fd, places[0][1], places[0][0])  # record 0 back in the page cache...
        os.posix_fadvise(fd, places[1][0], places[1][1], os.POSIX_FADV_DONTNEED)  # ...not (all of) record 1
        items = _items(fd, places)
        batch = fastread.native_VerifyBatch(2, 2, True)
        for item in items:
            batch.add(*item)
        assert batch.finish() == [fastread.VERIFIED, fastread.UNCACHED]
        assert not items[1][2][1].any()
    finally:
        os.close(fd)


def _break_records(path: Path, keys: list, n: int) -> None:
    """In the store at ``path``: flip a payload byte of keys[1], the payload length in the
    header of keys[2], make the index entry of keys[3] claim 4 KiB more, and cut the
    segment inside keys[-1] (a torn tail)."""
    import lmdb

    from tiered_kv.storage.lmdb import pack_entry, unpack_entry

    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    db = env.open_db(b"records")
    with env.begin(write=True) as txn:
        locs = {k: unpack_entry(txn.get(k.to_bytes(), db=db)) for k in keys}
        loc, checksum = locs[keys[3]]
        txn.put(keys[3].to_bytes(), pack_entry(Location(loc.segment, loc.offset, loc.length + 4096), checksum), db=db)
    env.close()
    seg_file = path / "segments" / segment_name(locs[keys[1]][0].segment)
    raw = bytearray(seg_file.read_bytes())
    raw[locs[keys[1]][0].offset + HEADER_BYTES + n // 2] ^= 0x40
    raw[locs[keys[2]][0].offset + 136] ^= 0x01
    last = locs[keys[-1]][0]
    seg_file.write_bytes(bytes(raw[:last.offset + last.length // 2]))


@pytest.mark.parametrize("n", [4096, 600_000])
def test_get_many_batch_path_counts_broken_records_as_misses(impl, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path, n: int) -> None:
    """Through the batch read (natively: helper threads; in Python: shards), hot: a flipped
    payload byte, a wrong length in a header, an index entry with a wrong length and a torn
    tail are each a counted corrupt miss, and removed; every other record, read into one
    buffer or a scatter list, is whole. The same answers either implementation."""
    monkeypatch.setattr(os_threads, "usable_cpus", lambda: 2)
    keys = [make_key(i) for i in range(8)]
    path = tmp_path / "s"
    with LmdbStore(path, layout_fingerprint=FP, direct_io=False) as store:
        store.put_many([item_for(k, n) for k in keys])
    _break_records(path, keys, n)
    for f in (path / "segments").iterdir():
        f.read_bytes()  # hot
    with LmdbStore(path, layout_fingerprint=FP, direct_io=False) as store:
        outs: list[object] = [np.zeros(n, np.uint8) for _ in keys]
        outs[4] = [np.zeros(n // 3, np.uint8), np.zeros(n - n // 3, np.uint8)]
        metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
        assert [m is not None for m in metas] == [True, False, False, False, True, True, True, False]
        for i in (0, 4, 5, 6):
            got = np.concatenate(outs[i]) if isinstance(outs[i], list) else outs[i]
            np.testing.assert_array_equal(got, payload_for(keys[i], n))
            assert metas[i].payload_bytes == n and metas[i].token_digest == digest_for(keys[i])
        s = store.stats()
        assert (s["hits"], s["misses"], s["corrupt"]) == (4, 4, 4)
        assert [k in store for k in keys] == [True, False, False, False, True, True, True, False]


def test_get_many_over_more_segments_than_open_descriptors(impl, monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    """A batch whose records lie in more segments than ``max_open_segments`` is read whole,
    and afterwards no more than that many descriptors stay open."""
    keys = [make_key(i) for i in range(7)]
    path = tmp_path / "s"
    with LmdbStore(path, layout_fingerprint=FP, direct_io=False, segment_bytes=4096) as store:
        for k in keys:
            store.put_many([item_for(k, 300_000)])
        assert len(store._segments.segment_ids()) >= 5
    for f in (path / "segments").iterdir():
        f.read_bytes()
    with LmdbStore(path, layout_fingerprint=FP, direct_io=False, max_open_segments=2) as store:
        outs = [np.zeros(300_000, np.uint8) for _ in keys]
        assert all(store.get_many(keys, outs))
        for k, out in zip(keys, outs):
            np.testing.assert_array_equal(out, payload_for(k, 300_000))
        assert store._segments.open_files <= 2


def test_concurrent_get_many_share_the_helpers(impl, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Threads reading at once (one of them gets the native helpers, the others read
    alone) all get every record whole."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(os_threads, "usable_cpus", lambda: 2)
    keys = [make_key(i) for i in range(16)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, direct_io=False) as store:
        store.put_many([item_for(k, 400_000) for k in keys])
        for f in (tmp_path / "s" / "segments").iterdir():
            f.read_bytes()

        def read(r: int) -> bool:
            outs = [np.zeros(400_000, np.uint8) for _ in keys]
            ok = all(store.get_many(keys, outs))
            return ok and all(np.array_equal(o, payload_for(k, 400_000)) for k, o in zip(keys, outs))

        with ThreadPoolExecutor(3) as pool:
            assert all(pool.map(read, range(9)))


@pytest.mark.parametrize(("direct_io", "window", "direct"), [
    (None, 8 << 20, False), (None, 2 << 20, False), (None, 128 << 10, True), (None, None, True),
    (True, 8 << 20, True), (False, 128 << 10, False)])
def test_cold_runs_read_through_the_page_cache_where_the_kernel_reads_ahead(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, direct_io: bool | None, window: int | None,
        direct: bool) -> None:
    """By default cold runs go through the page cache where the kernel reads ahead at least
    KERNEL_READ_AHEAD_MIN (its read-ahead keeps the disk busy across calls, in large
    requests), with O_DIRECT where it reads ahead less or cannot say; direct_io=True / False
    decide it whatever the window."""
    from tiered_kv.storage.lmdb import reads

    monkeypatch.setattr(reads.libc, "read_ahead_bytes", lambda path: window)
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, direct_io=direct_io) as store:
        assert store._segments.reads.cold_direct is direct


def test_read_ahead_bytes_reads_the_devices_window(tmp_path: Path) -> None:
    got = libc.read_ahead_bytes(tmp_path)
    assert got is None or (got >= 0 and got % 1024 == 0)
    assert libc.read_ahead_bytes(tmp_path / "not-there") is None


# ------------------------------------------------------------------ reads of payloads that authenticate themselves
@pytest.mark.parametrize("native", [True, False])
def test_get_many_unhashed_checks_all_but_the_payload_hash(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           native: bool) -> None:
    """get_many_unhashed (for sealed envelopes, whose GCM tag the caller checks) checks the
    header and the stored checksum against the index, and only skips the payload's xxh3:
    a flipped payload bit comes back (the tag will catch it), a flipped header bit or a
    stored checksum that is not the index's is a miss, counted corrupt; get_many still
    catches the payload bit."""
    if native and fastread.native_VerifyBatch is None:
        pytest.skip("native helper not built")
    if not native:
        monkeypatch.setattr(fastread, "read_verify_many", None)
        monkeypatch.setattr(fastread, "VerifyBatch", None)
        monkeypatch.setattr(fastread, "verify_copy_many", None)
        monkeypatch.setattr(fastread, "read_and_hash", fastread.python_read_and_hash)
    keys = [make_key(i) for i in range(4)]
    n = 20_000
    path = tmp_path / "s"
    with LmdbStore(path, layout_fingerprint=FP, direct_io=False) as store:
        store.put_many([item_for(k, n) for k in keys])
    seg = next((path / "segments").iterdir())
    raw = bytearray(seg.read_bytes())
    pos = [raw.find(payload_for(k, n)[:64].tobytes()) for k in keys]
    raw[pos[1] + 777] ^= 0x01                   # record 1: a payload bit
    raw[pos[2] - HEADER_BYTES + 20] ^= 0x01     # record 2: a fingerprint bit of its header
    raw[pos[3] + n + 3] ^= 0x01                 # record 3: its stored checksum
    seg.write_bytes(bytes(raw))
    with LmdbStore(path, layout_fingerprint=FP, direct_io=False) as store:
        outs = [np.zeros(n, np.uint8) for _ in keys]
        metas = store.get_many_unhashed(keys, outs)
        assert [m is not None for m in metas] == [True, True, False, False]
        np.testing.assert_array_equal(outs[0], payload_for(keys[0], n))
        assert metas[0].token_digest == digest_for(keys[0]) and metas[0].payload_bytes == n
        assert store.stats()["corrupt"] == 2
        assert store.get_many(keys[:2], [np.zeros(n, np.uint8) for _ in range(2)])[1] is None  # hashed: caught
        assert store.stats()["corrupt"] == 3


@needs_native
def test_unhashed_expectation_skips_only_the_hash_natively(tmp_path: Path) -> None:
    """An expectation ending in EXPECT_UNHASHED: read_verify_many, VerifyBatch and
    verify_copy_many accept a record whose payload differs from its checksum, and reject
    what they reject otherwise (here a wrong token digest); a bad trailing byte is refused."""
    from tiered_kv.storage.format.record import EXPECT_UNHASHED, PartsVerifier

    fd, clean = _one_record(tmp_path, 500)   # a payload bit flipped at byte 500
    try:
        key, n = make_key(7), len(clean)
        v = PartsVerifier(FP)
        src = np.frombuffer(os.pread(fd, n + 100, 0), np.uint8)

        def parts() -> list[np.ndarray]:
            return [np.zeros(HEADER_BYTES, np.uint8), np.zeros(n - 160, np.uint8), np.zeros(CHECKSUM_BYTES, np.uint8)]

        for digest, want in ((digest_for(key), fastread.VERIFIED), (bytes(32), fastread.FAILED)):
            unhashed = v.expectation(key, n, clean[-16:], digest, hashed=False)
            assert unhashed[-1] == EXPECT_UNHASHED
            assert fastread.native_read_verify_many([(fd, 100, parts(), unhashed)]) == [want]
            batch = fastread.native_VerifyBatch(1)
            batch.add(fd, 100, parts(), unhashed)
            assert batch.finish() == [want]
            assert fastread.native_verify_copy_many(src, [(100, parts(), unhashed)]) == [want]
            hashed = v.expectation(key, n, clean[-16:], digest)
            assert fastread.native_read_verify_many([(fd, 100, parts(), hashed)]) == [fastread.FAILED]
        with pytest.raises(ValueError, match="expect must be"):
            fastread.native_read_verify_many([(fd, 100, parts(), v.expectation(key, n, clean[-16:]) + b"\x01")])
    finally:
        os.close(fd)


def test_aligned_buffers_of_a_huge_page_or_more_start_on_one() -> None:
    """O_DIRECT bounce and staging buffers: page-aligned, their size rounded up to pages,
    and, from half a huge page up, 2 MiB-aligned and asked for transparent huge pages (so
    that a transfer is not cut into ~1 MiB requests of 4 KiB pages)."""
    small = libc.aligned_buffer(100)
    assert small.nbytes == 4096 and small.ctypes.data % 4096 == 0
    big = libc.aligned_buffer((1 << 20) + 8192)
    assert big.nbytes == (1 << 20) + 8192 and big.flags.writeable
    assert big.ctypes.data % (libc.HUGE_PAGE if hasattr(__import__("mmap"), "MADV_HUGEPAGE") else 4096) == 0
    big[:] = 7
    assert int(big.sum()) == 7 * big.nbytes


def _smaps_field(address: int, field: str) -> int | None:
    """``field`` (e.g. THPeligible) of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="no /proc/self/smaps")
def test_aligned_buffers_are_private_memory_that_thp_may_back() -> None:
    """The buffers map private anonymous memory: a shared anonymous mapping is shmem,
    which THP backs only where shmem_enabled allows (``never`` by default), so its
    MADV_HUGEPAGE would do nothing (docs/disk-reads.md)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in thp or libc.SHARED_BUFFERS:
        pytest.skip("THP off, or TIERED_KV_DIRECT_BUFFERS=shared")
    big = libc.aligned_buffer(4 << 20)
    eligible = _smaps_field(big.ctypes.data, "THPeligible")
    if eligible is None:
        pytest.skip("this kernel's smaps has no THPeligible")
    assert eligible == 1
