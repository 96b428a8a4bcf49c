"""Sealed records read in place (``BlockStore.map_unhashed``, storage/lmdb/mapped.py): an
encrypted LMDB level decrypts the envelopes the page cache holds straight from a map of
their segment file into the caller's buffer.

What must hold: only records that pass every check but the payload hash are mapped, and
only while their file covers them and the page cache holds them (else the ordinary read,
which counts and drops what is corrupt); the views die with the ``with`` block (never
dangling: an escaped view keeps its map); a record whose bytes change under the map fails
its tag, leaves zeros, and is then judged by its checksum; an exception while decrypting
leaves no plaintext.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encryption_helpers import key_files  # noqa: E402
from storage_helpers import FP, item_for, make_key, payload_for  # noqa: E402
from tiered_kv.storage import EncryptedStore, LmdbStore, RecordKey  # noqa: E402
from tiered_kv.storage.encrypted.crypto import ENVELOPE_OVERHEAD, Keyring  # noqa: E402
from tiered_kv.storage.format.record import CHECKSUM_BYTES, HEADER_BYTES  # noqa: E402
from tiered_kv.storage.lmdb import mapped as mapped_module  # noqa: E402
from tiered_kv.storage.lmdb.schema import segment_name, unpack_entry  # noqa: E402
from tiered_kv.storage.os import libc  # noqa: E402

N = 20_000


def enc(files: list[str]) -> dict[str, Any]:
    return {"key_files": files, "tenant": "acme"}


def warm(store: Any, keys: list[RecordKey], size: int = N) -> None:
    """Read every record once (a cold read fills the page cache)."""
    outs = [np.empty(size, np.uint8) for _ in keys]
    assert all(m is not None for m in store.get_many(keys, outs))


def location(store: LmdbStore, key: RecordKey) -> Any:
    value = store._reads.lookup([key.to_bytes()])[0]
    assert value is not None
    return unpack_entry(value)[0]


def segment_file(store: LmdbStore, key: RecordKey) -> Path:
    return store.path / "segments" / segment_name(location(store, key).segment)


# ------------------------------------------------------------------ the backend's contract
def test_hot_records_are_mapped_checked_and_counted_and_the_views_die_with_the_block(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(6)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as s:
        s.put_many([item_for(k, N) for k in keys])
        warm(s, keys)
        hits = s.stats()["hits"]
        absent = make_key(99)
        with s.map_unhashed([*keys, absent, keys[0]], [N] * 6 + [N, N - 1]) as got:
            assert [m is None for m in got] == [False] * 6 + [True, True]  # absent; another size
            for k, m in zip(keys, got):
                assert m.meta.key == k and m.meta.payload_bytes == N
                np.testing.assert_array_equal(m.payload, payload_for(k, N))
                assert not m.payload.flags.writeable
            kept = got
        assert kept == []  # emptied when the block ends
        assert s.stats()["hits"] == hits + 6


def test_what_is_not_cached_or_not_covered_by_its_file_is_not_mapped(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(3)]
    big = 600_000  # (one record per run of records: the page cache is asked run by run)
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as s:
        s.put_many([item_for(k, big) for k in keys])
        warm(s, keys, big)
        real = libc.cached_pages
        first = location(s, keys[0])

        def first_record_evicted(fd: int, offset: int, length: int) -> tuple[int, int] | None:
            got = real(fd, offset, length)
            if got is not None and offset <= first.offset < offset + length:
                return got[0] - 1, got[1]  # one of its pages is not in the page cache
            return got

        monkeypatch.setattr(mapped_module.libc, "cached_pages", first_record_evicted)
        with s.map_unhashed(keys, [big] * 3) as got:
            assert got[0] is None and all(m is not None for m in got[1:])
        monkeypatch.setattr(mapped_module.libc, "cached_pages", lambda fd, offset, length: None)
        with s.map_unhashed(keys, [big] * 3) as got:  # no cachestat: nothing is known to be cached
            assert got == [None] * 3
        monkeypatch.setattr(mapped_module.libc, "cached_pages", real)
        last = max(keys, key=lambda k: location(s, k).offset)
        os.truncate(segment_file(s, last), location(s, last).end - 1)  # torn: the file ends inside it
        with s.map_unhashed(keys, [big] * 3) as got:
            assert [m is None for m in got] == [k == last for k in keys]
        assert s.get(last, np.empty(big, np.uint8)) is None and s.stats()["corrupt"] == 1


def test_a_record_failing_a_header_check_is_not_mapped_and_the_ordinary_read_drops_it(tmp_path: Path) -> None:
    keys = [make_key(i) for i in range(2)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as s:
        s.put_many([item_for(k, N) for k in keys])
        warm(s, keys)
        seg, loc = segment_file(s, keys[0]), location(s, keys[0])
        with open(seg, "r+b") as f:  # a header byte (the fingerprint), in place: still cached
            f.seek(loc.offset + 20)
            b = f.read(1)
            f.seek(loc.offset + 20)
            f.write(bytes([b[0] ^ 0x01]))
        with s.map_unhashed(keys, [N, N]) as got:
            assert got[0] is None and got[1] is not None
        assert s.get_many_unhashed(keys, [np.empty(N, np.uint8) for _ in keys])[0] is None
        assert s.stats()["corrupt"] == 1 and not s.contains(keys[0])


def test_a_view_that_escapes_stays_readable_after_the_block_and_the_store_closes(tmp_path: Path) -> None:
    key = make_key(1)
    s = LmdbStore(tmp_path / "s", layout_fingerprint=FP)
    s.put_many([item_for(key, N)])
    warm(s, [key])
    with s.map_unhashed([key], [N]) as got:
        escaped = got[0].payload
    s.close()
    np.testing.assert_array_equal(escaped, payload_for(key, N))  # its map lives as long as it does


# ------------------------------------------------------------------ the encrypted level over it
def open_sealed(tmp_path: Path) -> EncryptedStore:
    return EncryptedStore(LmdbStore(tmp_path / "s", layout_fingerprint=FP), enc(key_files(tmp_path, "a")))


def test_hot_sealed_reads_decrypt_from_the_map_without_reading_into_an_arena(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(40)]  # > 1 MiB: decrypted on the pool and the caller
    with open_sealed(tmp_path) as s:
        s.put_many([item_for(k, N * 3) for k in keys])
        warm(s, keys, N * 3)
        inner = s.inner

        def no_copy(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("a hot envelope was copied out of the page cache")

        monkeypatch.setattr(inner, "get_many_unhashed", no_copy)
        hot = inner._segments.reads.paths["hot"]
        outs = [np.full(N * 3, 0x5A, np.uint8) for _ in keys]
        metas = s.get_many(keys, outs)
        assert all(m is not None for m in metas)
        for k, out in zip(keys, outs):
            np.testing.assert_array_equal(out, payload_for(k, N * 3))
        assert inner._segments.reads.paths["hot"] == hot + len(keys)
        scatter = [[np.empty(100, np.uint8), np.empty(N * 3 - 100, np.uint8)] for _ in keys[:2]]
        assert all(m is not None for m in s.get_many(keys[:2], scatter))
        np.testing.assert_array_equal(np.concatenate(scatter[1]), payload_for(keys[1], N * 3))


def test_bytes_changed_under_the_map_fail_the_tag_leave_zeros_and_are_judged_by_the_checksum(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the checks and the decryption a record's bytes change (another process
    punched it, or the disk rotted it): the tag fails, the caller's buffer is zeroed, and
    the hashed re-read decides: a record whose checksum fails is a corrupt miss (dropped),
    not a forgery."""
    keys = [make_key(i) for i in range(3)]
    with open_sealed(tmp_path) as s:
        s.put_many([item_for(k, N) for k in keys])
        warm(s, keys)
        inner = s.inner
        name = s.name_of(keys[0])
        seg, loc = segment_file(inner, name), location(inner, name)
        real = inner.map_unhashed

        class FlipAfterMapping:
            def __init__(self, names: list[RecordKey], sizes: list[int]) -> None:
                self.cm = real(names, sizes)

            def __enter__(self) -> Any:
                got = self.cm.__enter__()
                assert got[0] is not None
                with open(seg, "r+b") as f:  # a ciphertext byte, in place: the map sees it
                    at = loc.offset + HEADER_BYTES + ENVELOPE_OVERHEAD + N // 2
                    f.seek(at)
                    b = f.read(1)
                    f.seek(at)
                    f.write(bytes([b[0] ^ 0x10]))
                return got

            def __exit__(self, *exc: Any) -> Any:
                return self.cm.__exit__(*exc)

        monkeypatch.setattr(inner, "map_unhashed", FlipAfterMapping)
        outs = [np.full(N, 0x5A, np.uint8) for _ in keys]
        metas = s.get_many(keys, outs)
        assert [m is None for m in metas] == [True, False, False]
        assert not outs[0].any()
        np.testing.assert_array_equal(outs[2], payload_for(keys[2], N))
        st = s.stats()
        assert st["corrupt"] == 1 and st["auth_failures"] == 0 and not s.contains(keys[0])


@pytest.mark.parametrize("records", [2, 40], ids=["this-thread", "pool-and-this-thread"])
def test_an_exception_while_decrypting_from_the_map_leaves_no_plaintext(tmp_path: Path, records: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [make_key(i) for i in range(records)]
    size = N if records == 2 else 3 * N  # (40 x 60 kB: past the bound above which the pool joins in)
    with open_sealed(tmp_path) as s:
        s.put_many([item_for(k, size) for k in keys])
        warm(s, keys, size)

        def write_then_raise(opened: Any, ciphertext: Any, aad: bytes, out: Any) -> bool:
            assert not np.asarray(ciphertext).flags.writeable  # (read from the map)
            out[:] = 0x77
            raise MemoryError("while decrypting (test)")

        monkeypatch.setattr(Keyring, "open_into", staticmethod(write_then_raise))
        outs = [np.full(size, 0x5A, np.uint8) for _ in keys]
        with pytest.raises(MemoryError):
            s.get_many(keys, outs)
        assert not any(o.any() for o in outs)


def test_the_stored_checksum_is_still_compared_with_the_index(tmp_path: Path) -> None:
    """A record whose stored checksum differs from the index's copy (a record of the
    same key and size rewritten by someone else) is not mapped."""
    key = make_key(3)
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as s:
        s.put_many([item_for(key, N)])
        warm(s, [key])
        seg, loc = segment_file(s, key), location(s, key)
        with open(seg, "r+b") as f:
            f.seek(loc.end - CHECKSUM_BYTES)
            b = f.read(1)
            f.seek(loc.end - CHECKSUM_BYTES)
            f.write(bytes([b[0] ^ 0x01]))
        with s.map_unhashed([key], [N]) as got:
            assert got == [None]


def test_a_segment_is_mapped_once_for_many_reads_and_let_go_when_gc_unlinks_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The maps are kept from read to read (no map, no page faults per hot read), mapped
    again larger when a record lies past the end of the kept map (the active segment
    grows), and dropped where they would keep a segment's disk space: gc (this process),
    a segment found unlinked (another process's gc, at the next sweep), close."""
    keys = [make_key(i) for i in range(4)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as s:
        s.put_many([item_for(k, N) for k in keys[:2]])
        warm(s, keys[:2])
        maps = s._mapped._maps
        with s.map_unhashed(keys[:2], [N, N]) as got:
            first = got[0].payload.base
        with s.map_unhashed(keys[:2], [N, N]) as got:
            assert got[0].payload.base is first and len(maps) == 1  # the same map again
        s.put_many([item_for(k, N) for k in keys[2:]])  # appended to the same segment
        warm(s, keys[2:])
        with s.map_unhashed(keys, [N] * 4) as got:
            assert all(m is not None for m in got)
            assert got[3].payload.base is not first  # mapped again, over the longer file
            np.testing.assert_array_equal(got[3].payload, payload_for(keys[3], N))
        assert len(maps) == 1
        s.gc(0)
        assert not maps
        s.put_many([item_for(keys[0], N)])
        warm(s, keys[:1])
        with s.map_unhashed(keys[:1], [N]) as got:
            assert got[0] is not None and len(maps) == 1
        seg = next(iter(maps))
        monkeypatch.setattr(mapped_module, "SWEEP_S", 0.0)
        os.unlink(s.path / "segments" / segment_name(seg))  # as another process's gc would
        with s.map_unhashed(keys[:1], [N]) as got:
            assert got == [None] and not maps


def test_workers_stream_keeps_the_order_and_finishes_started_jobs_before_raising() -> None:
    """Workers.stream (the pipeline of the mapped reads): results in job order across
    batches; a batch source that raises leaves no job running when the error arrives."""
    import threading

    from tiered_kv.storage.encrypted.work import Workers

    w = Workers(2)
    try:
        def batches(fail: bool) -> Any:
            for b in range(4):
                yield list(range(b * 10, b * 10 + 10))
            if fail:
                raise RuntimeError("mapping the next chunk failed (test)")

        assert w.stream(lambda j: j * 2, batches(False), 1 << 30) == [j * 2 for j in range(40)]
        running = set()
        lock = threading.Lock()

        def job(j: int) -> int:
            with lock:
                running.add(j)
            try:
                return j
            finally:
                with lock:
                    running.discard(j)

        with pytest.raises(RuntimeError):
            w.stream(job, batches(True), 1 << 30)
        assert not running
    finally:
        w.close()
