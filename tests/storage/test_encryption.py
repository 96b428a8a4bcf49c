"""Tenant-encrypted records (storage/crypto.py, storage/encrypted.py) on local backends.

The bucket-writer adversary on a real object store is in tests/test_encryption_s3.py; here
a local Zarr directory plays the bucket (every record one file anyone with write access
may replace), and LMDB and a zarr MemoryStore run the round trips.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("cryptography", reason="encryption needs the cryptography package (the encryption extra)")

from encryption_helpers import flip_ciphertext, key_files, leaked_runs, reencode, sealed_name  # noqa: E402
from storage_helpers import FP, digest_for, item_for, make_key, payload_for  # noqa: E402
from tiered_kv.storage import (  # noqa: E402
    EncryptedStore,
    EncryptionConfig,
    KeyFileError,
    PutItem,
    RecordKind,
    ZarrStore,
    encode_record,
    open_store,
)
from tiered_kv.storage.encrypted.crypto import ENVELOPE_OVERHEAD, Keyring, read_key_file, write_key_file  # noqa: E402

N = 20_000
SIZES = {RecordKind.BLOCK: N, RecordKind.SNAPSHOT: N}


def enc(files: list[str], tenant: str = "acme") -> dict[str, Any]:
    return {"key_files": files, "tenant": tenant}


def zpath(where: Path, key) -> Path:
    h = key.block_hash.hex()
    return where / ("blocks" if key.kind is RecordKind.BLOCK else "snapshots") / h[:2] / h[2:]


def read_all(store, keys, n: int = N) -> list[np.ndarray | None]:
    outs = [np.empty(n, np.uint8) for _ in keys]
    metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
    return [o if m is not None else None for m, o in zip(metas, outs)]


@pytest.fixture(params=["lmdb", "zarr", "memory"])
def backend(request, tmp_path: Path):
    """``open(**encryption options) -> store`` on one backend (same data every call)."""
    from zarr.storage import MemoryStore

    mem = MemoryStore()

    def open_(**opts: Any):
        if request.param == "memory":
            return EncryptedStore(ZarrStore(mem, layout_fingerprint=FP, sealed=True), opts["encryption"])
        return open_store(f"{request.param}://{tmp_path / 'store'}", layout_fingerprint=FP, **opts)

    return open_


# ------------------------------------------------------------------ key files
def test_key_files_are_owner_only_32_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "k"
    key_id = write_key_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_bytes()) == 32
    assert len(key_id) == 16 and Keyring(EncryptionConfig(key_files=[str(path)], tenant="t")).key_ids == [key_id]
    with pytest.raises(FileExistsError):
        write_key_file(path)  # never overwritten
    os.chmod(path, 0o640)
    with pytest.raises(KeyFileError, match=r"mode 0640 .*group or others.*chmod 600"):
        read_key_file(path)
    os.chmod(path, 0o604)
    with pytest.raises(KeyFileError, match="group or others"):
        open_store(f"lmdb://{tmp_path / 's'}", layout_fingerprint=FP, encryption=enc([str(path)]))
    assert not (tmp_path / "s").exists()  # a bad key creates nothing
    short = tmp_path / "short"
    short.write_bytes(b"x" * 31)
    short.chmod(0o600)
    with pytest.raises(KeyFileError, match="expected exactly 32 random bytes, got 31 bytes"):
        read_key_file(short)
    with pytest.raises(KeyFileError, match="no such file.*keygen"):
        read_key_file(tmp_path / "missing")


def test_config_is_checked_at_the_boundary(tmp_path: Path) -> None:
    files = key_files(tmp_path, "a")
    with pytest.raises(ValueError, match="key_files: expected a non-empty list"):
        EncryptionConfig(key_files=files[0])  # a str, not a list
    with pytest.raises(ValueError, match="unknown keys"):
        EncryptionConfig.parse({"key_files": files, "tenat": "x"})
    with pytest.raises(ValueError, match="tenant: expected a str or bytes"):
        open_store(f"lmdb://{tmp_path / 's'}", layout_fingerprint=FP, encryption={"key_files": files})
    with pytest.raises(TypeError, match="tenant"):
        EncryptionConfig(key_files=files, tenant=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------ round trips
def test_round_trip_scatter_and_digest(backend, tmp_path: Path) -> None:
    files = key_files(tmp_path, "a")
    keys = [make_key(i) for i in range(12)] + [make_key(i, kind=RecordKind.SNAPSHOT) for i in range(3)]
    with backend(encryption=enc(files)) as s:
        items = [item_for(k, N) for k in keys]
        whole = items[5].payload
        items[5] = item_for(keys[5], payload=[whole[:100], bytes(whole[100:4000]), whole[4000:]])  # in pieces
        assert s.put_many(items) == [True] * len(keys)
        assert s.put_many([item_for(keys[0], N)]) == [False]  # write-once, as plain
        got = read_all(s, keys)
        for k, out in zip(keys, got):
            np.testing.assert_array_equal(out, payload_for(k, N))
        pieces = [np.empty(7, np.uint8), np.empty(N - 7, np.uint8)]
        meta = s.get(keys[1], pieces)
        assert meta is not None and meta.token_digest == digest_for(keys[1])
        np.testing.assert_array_equal(np.concatenate(pieces), payload_for(keys[1], N))
        st = s.stats()
        assert st["encrypted"] and st["hits"] == len(keys) + 1 and st["auth_failures"] == 0
        # a token digest other than the record's: a miss, counted corrupt and removed (as plain)
        assert s.get(keys[2], np.empty(N, np.uint8), token_digest=digest_for(keys[3])) is None
        assert s.stats()["corrupt"] == 1 and not s.contains(keys[2])


def test_a_batch_larger_than_a_chunk_is_read_pipelined_and_exact(tmp_path: Path) -> None:
    """30 x 600 KB: three chunks, opened on the pool while the next one is read; a missing
    record, one sealed under another key (at that key's name: absent here) and a planted
    envelope-sized blob at our name in the middle stay misses, every other byte is exact."""
    a, b = key_files(tmp_path, "a", "b")
    n = 600_000
    keys = [make_key(i) for i in range(30)]
    url = f"lmdb://{tmp_path / 's'}"
    with open_store(url, layout_fingerprint=FP, encryption=enc([b])) as s:
        s.put_many([item_for(keys[13], n)])  # sealed under another key
    with open_store(url, layout_fingerprint=FP, encryption={**enc([a]), "threads": 3}) as s:
        s.put_many([item_for(k, n) for i, k in enumerate(keys) if i not in (7, 13, 20)])
        planted = item_for(keys[20], payload=np.ones(n + ENVELOPE_OVERHEAD, np.uint8))
        s.inner.put_many([PutItem(s.name_of(keys[20]), planted.parent_hash, planted.token_digest, planted.payload)])
        got = read_all(s, keys, n)
        assert [i for i, g in enumerate(got) if g is None] == [7, 13, 20]
        for k, out in zip(keys, got):
            if out is not None:
                np.testing.assert_array_equal(out, payload_for(k, n))
        st = s.stats()
        assert (st["hits"], st["auth_failures"], st["auth_removed"]) == (27, 1, 1)  # the planted blob: removed


def test_no_plaintext_reaches_the_backend(tmp_path: Path) -> None:
    files = key_files(tmp_path, "a")
    keys = [make_key(i) for i in range(8)]
    payloads = [payload_for(k, N) for k in keys]
    for name, opts in (("plain", {}), ("sealed", {"encryption": enc(files)})):
        where = tmp_path / name
        with open_store(f"zarr://{where}", layout_fingerprint=FP, **opts) as s:
            s.put_many([item_for(k, N) for k in keys])
        names = keys if name == "plain" else [sealed_name(files, k) for k in keys]
        blob = b"".join(zpath(where, k).read_bytes() for k in names)
        # the check finds every payload in the plain store, none in the sealed one
        assert leaked_runs(blob, payloads) == (len(keys) if name == "plain" else 0)
    # nor the prefix hashes, token digests or parent hashes: names are keyed, the header masked
    sealed = zpath(tmp_path / "sealed", sealed_name(files, keys[0])).read_bytes()
    item = item_for(keys[0], N)
    assert item.token_digest not in sealed and item.parent_hash not in sealed and keys[0].block_hash not in sealed
    assert not any(zpath(tmp_path / "sealed", k).exists() for k in keys)
    assert len(sealed) == len(zpath(tmp_path / "plain", keys[0]).read_bytes()) + ENVELOPE_OVERHEAD


# ------------------------------------------------------------------ nothing unauthenticated is served
def test_wrong_key_and_wrong_tenant_get_misses_and_remove_nothing(backend, tmp_path: Path) -> None:
    a, b = key_files(tmp_path, "a", "b")
    keys = [make_key(i) for i in range(6)]
    with backend(encryption=enc([a])) as s:
        s.put_many([item_for(k, N) for k in keys])
    for files, tenant in (([b], "acme"), ([a], "other-tenant")):
        with backend(encryption=enc(files, tenant)) as s:  # their names are elsewhere: plain misses
            assert read_all(s, keys) == [None] * len(keys)
            st = s.stats()
            assert (st["hits"], st["misses"], st["auth_failures"], st["auth_removed"]) == (0, 6, 0, 0)
            assert len(s) == 6  # not theirs to remove
            assert s.verify(payload_bytes=SIZES)["foreign"] == 6  # a listing sees them: under no key given
    with backend(encryption=enc([a])) as s:  # the owner still reads them all
        assert all(o is not None for o in read_all(s, keys))


def test_forgeries_of_a_bucket_writer_are_misses(tmp_path: Path) -> None:
    """A writer with access to the files but no key: flipped ciphertext (checksum fixed),
    a ciphertext moved under another name (header relabelled, checksum fixed), a plain
    valid record, a plain record of the envelope's size, a raw copy, all at our names.
    All misses; the rest exact; every one removed (or, the raw copy, dropped by the
    backend), so that none squats its name: a put rewrites them all."""
    files = key_files(tmp_path, "a")
    where = tmp_path / "bucket"
    keys = [make_key(i) for i in range(10)]
    names = [sealed_name(files, k) for k in keys]
    url = f"zarr://{where}"
    with open_store(url, layout_fingerprint=FP, encryption=enc(files)) as s:
        s.put_many([item_for(k, N) for k in keys])
    raw = {k: zpath(where, n).read_bytes() for k, n in zip(keys, names)}
    zpath(where, names[0]).write_bytes(flip_ciphertext(raw[keys[0]]))
    zpath(where, names[1]).write_bytes(reencode(raw[keys[9]], key=names[1]))            # moved + relabelled
    zpath(where, names[2]).write_bytes(bytes(encode_record(key=names[2], parent_hash=bytes(32),
                                                           token_digest=digest_for(keys[2]), layout_fingerprint=FP,
                                                           payload=payload_for(keys[2], N))))  # plain, valid
    zpath(where, names[3]).write_bytes(reencode(raw[keys[3]], payload=np.zeros(N + ENVELOPE_OVERHEAD, np.uint8)))
    zpath(where, names[4]).write_bytes(raw[keys[8]])                                     # raw copy
    with open_store(url, layout_fingerprint=FP, encryption=enc(files)) as s:
        got = read_all(s, keys)
        assert [o is None for o in got] == [True] * 5 + [False] * 5
        for k, out in zip(keys[5:], got[5:]):
            np.testing.assert_array_equal(out, payload_for(k, N))
        st = s.stats()
        # the raw copy fails the backend's own key check (corrupt); the others authentication
        assert (st["auth_failures"], st["corrupt"], st["hits"]) == (4, 1, 5)
        # nothing at our names but an authentic envelope: the four are removed (the plain
        # record of another size too, once authenticated at its size and failing)
        assert st["auth_removed"] == 4
        assert [s.contains(k) for k in keys[:5]] == [False] * 5
        assert s.put_many([item_for(k, N) for k in keys[:5]]) == [True] * 5
        assert all(o is not None for o in read_all(s, keys[:5]))


def test_verify_checks_tags_and_repair_removes_only_what_no_key_holder_can_read(tmp_path: Path) -> None:
    a, b = key_files(tmp_path, "a", "b")
    where = tmp_path / "bucket"
    keys = [make_key(i) for i in range(6)]
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([a])) as s:
        s.put_many([item_for(k, N) for k in keys[:4]])
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([b])) as s:
        s.put_many([item_for(k, N) for k in keys[4:]])  # another key's records: foreign to a
    forged = zpath(where, sealed_name([a], keys[0]))
    forged.write_bytes(flip_ciphertext(forged.read_bytes()))
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([a])) as s:
        r = s.verify(payload_bytes=SIZES)
        assert (r["checked"], r["corrupt"], r["authenticated"], r["auth_failures"], r["foreign"]) == (6, 0, 3, 3, 2)
        assert r["key_records"] == {Keyring(EncryptionConfig(key_files=[a], tenant="x")).key_ids[0]: 3}
        assert len(s) == 6  # nothing removed without repair
        r = s.verify(repair=True, payload_bytes=SIZES)
        assert r["auth_removed"] == 1 and len(s) == 5 and not s.contains(keys[0])


# ------------------------------------------------------------------ rotation
def test_rotation_reads_old_writes_new_and_rekey_finishes(backend, tmp_path: Path) -> None:
    old, new = key_files(tmp_path, "old", "new")
    keys = [make_key(i) for i in range(20)]
    with backend(encryption=enc([old])) as s:
        s.put_many([item_for(k, N) for k in keys[:10]])
    with backend(encryption=enc([new, old])) as s:
        s.put_many([item_for(k, N) for k in keys[10:]])
        assert all(o is not None for o in read_all(s, keys))  # old records readable
        new_id, old_id = s.keyring.key_ids
        assert sorted(s.sample(keys, SIZES), key=str) == sorted([old_id and bytes.fromhex(old_id)] * 10
                                                                + [bytes.fromhex(new_id)] * 10, key=str)
        seen = []
        report = s.rekey(SIZES, batch=4, progress=lambda done, total, r: seen.append((done, total)))
        assert (report.checked, report.rekeyed, report.current, report.lost) == (20, 10, 10, 0)
        assert seen[-1] == (20, 20) and len(seen) == 5
        assert s.rekey(SIZES).rekeyed == 0  # done: a second run finds nothing to do
    with backend(encryption=enc([new])) as s:  # the old key can be retired
        for k, out in zip(keys, read_all(s, keys)):
            np.testing.assert_array_equal(out, payload_for(k, N))


# (a rekey killed at each step of a batch, then run again: tests/storage/test_rekey.py)


# ------------------------------------------------------------------ chains
def test_chain_seals_only_the_shared_level(tmp_path: Path) -> None:
    files = key_files(tmp_path, "a")
    keys = [make_key(i) for i in range(5)]
    levels = [f"lmdb://{tmp_path / 'local'}", f"zarr://{tmp_path / 'shared'}"]
    with open_store(levels, layout_fingerprint=FP, level_options=[{}, {"encryption": enc(files)}]) as chain:
        chain.put_many([item_for(k, N) for k in keys])
        assert chain.flush(uploads=True, timeout_s=60)
        st = chain.stats()
        assert [lvl["encrypted"] for lvl in st["levels"]] == [False, True] and st["auth_failures"] == 0
    blob = b"".join(zpath(tmp_path / "shared", sealed_name(files, k)).read_bytes() for k in keys)
    assert leaked_runs(blob, [payload_for(k, N) for k in keys]) == 0
    # a fresh node: empty local level, reads through the sealed shared one
    levels[0] = f"lmdb://{tmp_path / 'node2'}"
    with open_store(levels, layout_fingerprint=FP, encryption=None,
                    level_options=[{}, {"encryption": enc(files)}]) as chain:
        for k, out in zip(keys, read_all(chain, keys)):
            np.testing.assert_array_equal(out, payload_for(k, N))
    # the wrong tenant on the shared level: its names are elsewhere, so plain misses
    with open_store([f"lmdb://{tmp_path / 'node3'}", levels[1]], layout_fingerprint=FP,
                    encryption=enc(files, "intruder")) as chain:
        assert read_all(chain, keys) == [None] * 5
        assert (chain.stats()["misses"], chain.stats()["auth_failures"]) == (5, 0)
