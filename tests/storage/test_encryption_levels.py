"""Encrypted levels fail closed and leave no unauthenticated byte behind (issue 23).

- the level records that it is sealed; a plain writer is refused; an earlier version's
  level (unkeyed names) is refused until ``rekey`` migrates it; a plain level is refused;
- at one of its names an encrypted reader accepts nothing but an envelope that
  authenticates as the record asked for: the rest is removed and counted;
- every read that fails authentication leaves the caller's buffer zeroed: LMDB rewritten
  by a disk attacker (record, xxh3 and index checksum), a backend where the tag is the
  only check, scatter outs, an exception in flight, a streamed read cut short or cancelled;
- lookups cost one request per record; rotation falls back to older names; listings map
  names back to keys through the envelope heads; rekey ``drop_old`` deletes what only an
  old key authenticates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

pytest.importorskip("cryptography", reason="encryption needs the cryptography package (the encryption extra)")

from encryption_helpers import (  # noqa: E402
    flip_ciphertext,
    key_files,
    read_lmdb_record,
    reencode,
    rewrite_lmdb_record,
    sealed_name,
    write_legacy_level,
)
from storage_helpers import FP, digest_for, item_for, make_key, payload_for  # noqa: E402
from tiered_kv.storage import (  # noqa: E402
    BlockStore,
    EncryptedLevelError,
    EncryptedStore,
    LmdbStore,
    PutItem,
    RecordKey,
    RecordKind,
    RecordMeta,
    StoreWriter,
    WriterKind,
    ZarrStore,
    open_store,
)
from tiered_kv.storage.encrypted.crypto import ENVELOPE_OVERHEAD, Keyring  # noqa: E402
from tiered_kv.storage.format.sealed_level import SEALED_LEVEL  # noqa: E402
from tiered_kv.storage.lmdb.rebuild import rebuild_index  # noqa: E402
from tiered_kv.storage.lmdb.schema import SEALED_FILE  # noqa: E402

N = 20_000
SIZES = {RecordKind.BLOCK: N, RecordKind.SNAPSHOT: N}


def enc(files: list[str], tenant: str = "acme") -> dict[str, Any]:
    return {"key_files": files, "tenant": tenant}


def read_all(store, keys, outs=None) -> list[np.ndarray | None]:
    outs = [np.full(N, 0x5A, np.uint8) for _ in keys] if outs is None else outs
    metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
    return [o if m is not None else None for m, o in zip(metas, outs)]


# ------------------------------------------------------------------ fail closed
@pytest.mark.parametrize("scheme", ["lmdb", "zarr"])
def test_a_sealed_level_refuses_plain_writers_and_says_how(tmp_path: Path, scheme: str) -> None:
    files = key_files(tmp_path, "a")
    url = f"{scheme}://{tmp_path / 'level'}"
    with open_store(url, layout_fingerprint=FP, encryption=enc(files)) as s:
        s.put_many([item_for(make_key(i), N) for i in range(3)])
        assert s.sealing == {"envelope": "tiered_kv/envelope/v2", "cipher": "XAES-256-GCM", "names": "keyed/v2"}
    if scheme == "zarr":
        attrs = json.loads((tmp_path / "level" / "zarr.json").read_text())["attributes"]["tiered_kv"]
        assert attrs["encryption"]["names"] == "keyed/v2"
    else:
        env = lmdb.open(str(tmp_path / "level"), max_dbs=4, readonly=True, lock=False)
        with env.begin() as txn:
            assert json.loads(bytes(txn.get(b"encryption", db=env.open_db(b"meta", txn=txn, create=False))))
        env.close()
    with pytest.raises(EncryptedLevelError, match="this level is encrypted .* A plain writer is refused: give the key"):
        open_store(url, layout_fingerprint=FP)  # a misconfigured node: would write plaintext
    with pytest.raises(EncryptedLevelError):
        (LmdbStore if scheme == "lmdb" else ZarrStore)(tmp_path / "level", layout_fingerprint=FP)
    with pytest.raises(TypeError, match="sealed: set by the encryption option"):
        open_store(url, layout_fingerprint=FP, sealed=True)
    with open_store(url, layout_fingerprint=None) as plain:  # maintenance needs no key: stats, verify, gc
        assert plain.sealing is not None and plain.verify()["corrupt"] == 0 and len(plain) == 3


def test_a_level_of_an_earlier_version_is_refused_until_rekey_migrates_it(tmp_path: Path) -> None:
    """Envelopes of version 1 under unkeyed names (as releases before this one wrote them):
    serving it would keep every prefix hash readable, so opening it names the migration;
    ``rekey`` (``migrate=True``) marks the level at once, then moves every record."""
    files = key_files(tmp_path, "a")
    where = tmp_path / "old"
    keys = [make_key(i) for i in range(7)] + [make_key(0, kind=RecordKind.SNAPSHOT)]
    writer = StoreWriter.of(WriterKind.CACHE, model="m", tenant="acme")  # (earlier versions recorded its hash)
    with ZarrStore(where, layout_fingerprint=FP, writer=writer) as plain:
        write_legacy_level(plain, files[0], "acme", [item_for(k, N) for k in keys])
    assert json.loads((where / "zarr.json").read_text())["attributes"]["tiered_kv"]["writer"]["tenant_sha256"]
    with pytest.raises(EncryptedLevelError, match=r"earlier version .*`tiered-kv rekey --store URL --key-file"):
        open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc(files))
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc(files), migrate=True) as s:
        assert s.sealing is not None  # marked at once: plain writers are refused from now on
        attrs = json.loads((where / "zarr.json").read_text())["attributes"]["tiered_kv"]
        assert attrs["encryption"] == s.sealing and attrs["writer"]["tenant_sha256"] is None  # the tenant hash dropped
        assert read_all(s, keys) == [None] * len(keys)  # not served under unkeyed names
        v = s.verify(payload_bytes=SIZES)
        assert (v["authenticated"], v["legacy"], v["auth_failures"]) == (8, 8, 0)
        d = s.describe()
        assert (d["sampled_legacy"], d["sampled_unauthentic"], d["sampled_foreign"]) == (8, 0, 0)
        report = s.rekey(SIZES, batch=3)
        assert (report.migrated, report.opened_old, report.failed, report.checked) == (8, 8, 0, 8)
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc(files)) as s:
        for k, out in zip(keys, read_all(s, keys)):
            np.testing.assert_array_equal(out, payload_for(k, N))
        assert not set(s.names()) & set(keys) and len(s) == 8
        assert s.rekey(SIZES).opened_old == 0  # nothing left to move


def test_a_plain_level_is_not_sealed_behind_its_writers_back(tmp_path: Path) -> None:
    files = key_files(tmp_path, "a")
    url = f"lmdb://{tmp_path / 'plain'}"
    with open_store(url, layout_fingerprint=FP) as s:
        s.put_many([item_for(make_key(i), N) for i in range(2)])
    with pytest.raises(EncryptedLevelError, match="holds plain .* records"):
        open_store(url, layout_fingerprint=FP, encryption=enc(files))
    with open_store(url, layout_fingerprint=FP) as s:  # left as it was
        assert s.sealing is None and len(s) == 2


def test_an_empty_or_unmarked_level_of_this_version_is_adopted(tmp_path: Path) -> None:
    """A store someone opened plain but never wrote, and a sealed LMDB store that records
    its sealing nowhere (sealed by a version before sealed-level.json, its index since
    rebuilt), are marked by the next encrypted open."""
    files = key_files(tmp_path, "a")
    url = f"lmdb://{tmp_path / 's'}"
    open_store(url, layout_fingerprint=FP).close()
    with open_store(url, layout_fingerprint=FP, encryption=enc(files)) as s:
        assert s.sealing is not None
        s.put_many([item_for(make_key(i), N) for i in range(3)])
    env = lmdb.open(str(tmp_path / "s"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.delete(b"encryption", db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(EncryptedLevelError):  # the directory's marker still refuses a plain writer
        open_store(url, layout_fingerprint=FP)
    (tmp_path / "s" / SEALED_FILE).unlink()
    with open_store(url, layout_fingerprint=FP) as s:
        assert s.sealing is None
    with open_store(url, layout_fingerprint=FP, encryption=enc(files)) as s:
        assert s.sealing is not None and all(o is not None for o in read_all(s, [make_key(i) for i in range(3)]))
    with pytest.raises(EncryptedLevelError):
        open_store(url, layout_fingerprint=FP)


@pytest.mark.parametrize("how", ["rebuild_index", "data.mdb removed, then verify --repair"])
def test_the_sealed_marker_survives_an_index_rebuild(tmp_path: Path, how: str) -> None:
    """Behaviour change: a sealed LMDB level's index rebuilt from its segment files keeps
    the sealed-level record (it is read back from sealed-level.json beside the segments),
    so a plain writer is refused right after the rebuild, not only after the next
    encrypted open; a maintenance open still works, and the records read back sealed."""
    files = key_files(tmp_path, "a")
    root = tmp_path / "s"
    url = f"lmdb://{root}"
    keys = [make_key(i) for i in range(4)]
    with open_store(url, layout_fingerprint=FP, encryption=enc(files)) as s:
        s.put_many([item_for(k, N) for k in keys])
    assert json.loads((root / SEALED_FILE).read_bytes()) == SEALED_LEVEL
    assert (root / SEALED_FILE).stat().st_mode & 0o777 == 0o600
    if how == "rebuild_index":
        assert rebuild_index(root, FP)["records"] == len(keys)
    else:
        from tiered_kv.cli.main import main

        (root / "data.mdb").unlink()
        assert main(["verify", "--store", str(root), "--repair"]) == 0
    env = lmdb.open(str(root), max_dbs=4, readonly=True)
    with env.begin() as txn:
        assert json.loads(bytes(txn.get(b"encryption", db=env.open_db(b"meta", txn=txn, create=False)))) \
            == SEALED_LEVEL
    env.close()
    with pytest.raises(EncryptedLevelError, match="opened without its keys"):
        open_store(url, layout_fingerprint=FP)
    with open_store(url, layout_fingerprint=None) as m:  # maintenance: no key needed
        assert m.sealing == SEALED_LEVEL and len(m) == len(keys)
    with open_store(url, layout_fingerprint=FP, encryption=enc(files)) as s:
        assert all(o is not None for o in read_all(s, keys))


def test_pollution_at_our_names_is_removed_and_counted(tmp_path: Path) -> None:
    """A plain record (a writer that bypassed the refusal), another tenant's envelope and an
    envelope of our own copied over another name, each at one of our names, and a plain
    record of another size: none squats the name; a put rewrites them all."""
    a, = key_files(tmp_path, "a")
    url = f"lmdb://{tmp_path / 's'}"
    keys = [make_key(i) for i in range(6)]
    with open_store(url, layout_fingerprint=FP, encryption=enc([a], "globex")) as other:
        other.put_many([item_for(keys[1], N)])
    with open_store(url, layout_fingerprint=FP, encryption=enc([a])) as s:
        s.put_many([item_for(keys[5], N)])
        inner = s.inner
        names = [s.name_of(k) for k in keys]
        env5 = np.empty(N + ENVELOPE_OVERHEAD, np.uint8)
        m5 = inner.get(names[5], env5)
        other_name = sealed_name([a], keys[1], tenant="globex")
        env_other = np.empty(N + ENVELOPE_OVERHEAD, np.uint8)
        m_other = inner.get(other_name, env_other)
        plain = item_for(keys[0], payload=np.ones(N + ENVELOPE_OVERHEAD, np.uint8))
        inner.put_many([
            PutItem(names[0], plain.parent_hash, plain.token_digest, plain.payload),                  # plain
            PutItem(names[1], m_other.parent_hash, m_other.token_digest, env_other),                # globex's
            PutItem(names[2], m5.parent_hash, m5.token_digest, env5),                               # ours, moved
            PutItem(names[3], plain.parent_hash, plain.token_digest, np.ones(N // 2, np.uint8)),    # other size
        ])
        got = read_all(s, keys[:5])
        assert all(g is None for g in got)
        st = s.stats()
        assert (st["auth_failures"], st["auth_removed"], st["misses"]) == (4, 4, 5)
        assert not any(inner.contains(n) for n in names[:4]) and inner.contains(other_name)  # theirs stays
        assert s.put_many([item_for(k, N) for k in keys[:5]]) == [True] * 5
        for k, out in zip(keys[:5], read_all(s, keys[:5])):
            np.testing.assert_array_equal(out, payload_for(k, N))
        # a caller asking with a wrong size gets a miss; the authentic record stays
        assert s.get(keys[0], np.empty(N - 1, np.uint8)) is None and s.contains(keys[0])


# ------------------------------------------------------------------ never unauthenticated bytes
@pytest.mark.parametrize("scatter", [False, True], ids=["one-out", "scatter"])
def test_a_disk_attacker_rewriting_lmdb_records_leaves_only_zeros(tmp_path: Path, scatter: bool) -> None:
    """The attacker rewrites a record (flipped ciphertext; another record's envelope with
    its header relabelled) together with its xxh3 in the segment and the index's copy, so
    that LMDB's own checks pass: the tag fails, and the caller's buffer holds zeros, not
    the malleated plaintext nor the other record's."""
    files = key_files(tmp_path, "a")
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(4)]
    with open_store(f"lmdb://{where}", layout_fingerprint=FP, encryption=enc(files)) as s:
        s.put_many([item_for(k, N) for k in keys])
        names = [s.name_of(k) for k in keys]
    rewrite_lmdb_record(where, names[0], flip_ciphertext(read_lmdb_record(where, names[0])))
    rewrite_lmdb_record(where, names[1], reencode(read_lmdb_record(where, names[3]), key=names[1]))
    with open_store(f"lmdb://{where}", layout_fingerprint=FP, encryption=enc(files)) as s:
        if scatter:
            outs = [[np.full(7, 0x5A, np.uint8), np.full(N - 7, 0x5A, np.uint8)] for _ in keys]
        else:
            outs = [np.full(N, 0x5A, np.uint8) for _ in keys]
        metas = s.get_many(keys, outs)
        flat = [np.concatenate(o) if scatter else o for o in outs]
        assert [m is None for m in metas] == [True, True, False, False]
        assert not flat[0].any() and not flat[1].any()
        np.testing.assert_array_equal(flat[2], payload_for(keys[2], N))
        assert s.stats()["auth_failures"] == 2 and s.stats()["corrupt"] == 0


@pytest.mark.parametrize("scatter", [False, True], ids=["one-out", "scatter"])
def test_bit_rot_in_a_sealed_lmdb_record_is_a_counted_corrupt_miss_and_leaves_zeros(tmp_path: Path,
                                                                                   scatter: bool) -> None:
    """LMDB reads a sealed record without hashing it (the tag is its check): a flipped
    ciphertext bit whose xxh3 was NOT rewritten fails the tag, leaves zeros in the caller's
    buffer, and, the backend's checksum then confirming the damage, is a corrupt record
    (counted, dropped), not a forgery."""
    files = key_files(tmp_path, "a")
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(3)]
    with open_store(f"lmdb://{where}", layout_fingerprint=FP, encryption=enc(files)) as s:
        s.put_many([item_for(k, N) for k in keys])
        name = s.name_of(keys[0])
    seg = next((where / "segments").iterdir())
    raw = bytearray(seg.read_bytes())
    record = read_lmdb_record(where, name)
    at = raw.find(record) + len(record) // 2   # a ciphertext byte; the stored checksum left as it was
    raw[at] ^= 0x01
    seg.write_bytes(bytes(raw))
    with open_store(f"lmdb://{where}", layout_fingerprint=FP, encryption=enc(files)) as s:
        outs = ([[np.full(9, 0x5A, np.uint8), np.full(N - 9, 0x5A, np.uint8)] for _ in keys] if scatter
                else [np.full(N, 0x5A, np.uint8) for _ in keys])
        metas = s.get_many(keys, outs)
        flat = [np.concatenate(o) if scatter else o for o in outs]
        assert [m is None for m in metas] == [True, False, False]
        assert not flat[0].any()
        np.testing.assert_array_equal(flat[1], payload_for(keys[1], N))
        st = s.stats()
        assert st["corrupt"] == 1 and st["auth_failures"] == 0 and not s.contains(keys[0])


class _RawStore(BlockStore):
    """A backend that checks nothing: what a local store looks like once the GCM tag is
    the only check of a sealed record (the cold-reads issue drops xxh3 for them)."""

    supports_scatter_reads = False

    def __init__(self) -> None:
        self.layout_fingerprint = FP
        self.max_bytes = None
        self._closed = False
        self.data: dict[RecordKey, tuple[bytes, bytes, np.ndarray]] = {}

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        out = []
        for it in items:
            out.append(it.key not in self.data)
            self.data.setdefault(it.key, (it.parent_hash, it.token_digest, np.array(it.payload, np.uint8).copy()))
        return out

    def get_many(self, keys, outs, *, token_digests=None) -> list[RecordMeta | None]:
        metas: list[RecordMeta | None] = []
        for key, out in zip(keys, outs):
            if key not in self.data:
                metas.append(None)
                continue
            parent, digest, payload = self.data[key]
            if payload.nbytes != out.nbytes:
                raise ValueError("size")
            out[:] = payload
            metas.append(RecordMeta(key=key, parent_hash=parent, token_digest=digest, layout_fingerprint=FP,
                                    payload_bytes=payload.nbytes))
        return metas

    def payload_sizes(self, keys):
        return [self.data[k][2].nbytes if k in self.data else None for k in keys]

    def contains(self, key: RecordKey) -> bool:
        return key in self.data

    def delete(self, key: RecordKey) -> bool:
        return self.data.pop(key, None) is not None

    def __iter__(self) -> Iterator[RecordKey]:
        return iter(list(self.data))

    def __len__(self) -> int:
        return len(self.data)

    def stats(self) -> dict[str, Any]:
        return {"records": len(self.data)}

    def close(self) -> None:
        self._closed = True

    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        return {"checked": len(self.data), "corrupt": 0, "removed": 0, "corrupt_keys": []}

    def gc(self, max_bytes: int) -> dict[str, Any]:
        return {"evicted": 0, "freed_bytes": 0, "bytes": 0, "records": len(self.data)}


@pytest.mark.parametrize("scatter", [False, True], ids=["one-out", "scatter"])
def test_when_the_tag_is_the_only_check_a_flipped_byte_leaves_only_zeros(tmp_path: Path, scatter: bool) -> None:
    files = key_files(tmp_path, "a")
    raw = _RawStore()
    s = EncryptedStore(raw, enc(files), owned=False)
    keys = [make_key(i) for i in range(3)]
    s.put_many([item_for(k, N) for k in keys])
    for i, at in ((0, 40 + N // 2), (1, N + ENVELOPE_OVERHEAD - 1)):  # a ciphertext byte; the tag
        raw.data[s.name_of(keys[i])][2][at] ^= 0x01
    outs = ([[np.full(100, 0x5A, np.uint8), np.full(N - 100, 0x5A, np.uint8)] for _ in keys] if scatter
            else [np.full(N, 0x5A, np.uint8) for _ in keys])
    metas = s.get_many(keys, outs)
    flat = [np.concatenate(o) if scatter else o for o in outs]
    assert [m is None for m in metas] == [True, True, False]
    assert not flat[0].any() and not flat[1].any()
    np.testing.assert_array_equal(flat[2], payload_for(keys[2], N))
    assert s.stats()["auth_removed"] == 2 and len(raw) == 1


def test_an_exception_in_flight_leaves_no_plaintext(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decryption writes its output, then raises (not InvalidTag: e.g. MemoryError):
    the exception reaches the caller, and the out holds no byte of what was written."""
    files = key_files(tmp_path, "a")
    raw = _RawStore()
    s = EncryptedStore(raw, enc(files), owned=False)
    keys = [make_key(i) for i in range(2)]
    s.put_many([item_for(k, N) for k in keys])

    def write_then_raise(opened, ciphertext, aad, out) -> bool:
        out[:] = 0x77
        raise MemoryError("while decrypting (test)")

    monkeypatch.setattr(Keyring, "open_into", staticmethod(write_then_raise))
    outs = [np.full(N, 0x5A, np.uint8) for _ in keys]
    with pytest.raises(MemoryError):
        s.get_many(keys, outs)
    assert not any(o.any() for o in outs)


def test_a_streamed_envelope_cut_short_or_cancelled_leaves_only_zeros(tmp_path: Path) -> None:
    """The sink of a streamed read: a transfer that ends before the tag is a miss (an
    explicit check, no assertion), a discard (the read given up) zeroes the out and no
    later write lands, and an envelope fed in odd pieces opens exactly."""
    from tiered_kv.storage.encrypted.envelopes import EnvelopeSink, Outcome, Target

    files = key_files(tmp_path, "a")
    raw = _RawStore()
    s = EncryptedStore(raw, enc(files), owned=False)
    key = make_key(1)
    s.put_many([item_for(key, N)])
    name = s.name_of(key)
    parent, digest, env = raw.data[name]
    meta = RecordMeta(key=name, parent_hash=parent, token_digest=digest, layout_fingerprint=FP,
                      payload_bytes=env.nbytes)
    from tiered_kv.storage.format.record import as_out_segments

    def sink(out: np.ndarray) -> EnvelopeSink:
        return EnvelopeSink(s._opener, Target(name, key, 0, as_out_segments(out), None, None), meta, env.nbytes)

    out = np.full(N, 0x5A, np.uint8)
    k = sink(out)
    for a, b in ((0, 3), (3, 41), (41, 5000), (5000, env.nbytes)):
        assert k.write(env[a:b]) or b == env.nbytes
    assert k.finish().outcome is Outcome.OK
    np.testing.assert_array_equal(out, payload_for(key, N))
    out = np.full(N, 0x5A, np.uint8)
    k = sink(out)
    k.write(env[:40])
    k.write(env[40:N // 2])
    assert out[:100].any()  # plaintext written before the tag could be checked
    r = k.finish()  # the transfer ended here
    assert r.outcome is Outcome.INCOMPLETE and not out.any()
    out = np.full(N, 0x5A, np.uint8)
    k = sink(out)
    k.write(env[:40])
    k.write(env[40:N // 2])
    k.discard()  # the read was given up (an exception, a timeout)
    assert not out.any()
    assert k.write(env[N // 2:]) is False and not out.any()  # nothing lands after a discard
    assert k.finish().outcome is Outcome.INCOMPLETE


# ------------------------------------------------------------------ lookups, listings, rotation
class _Counting(ZarrStore):
    """A Zarr store that counts the requests of record reads and presence checks."""

    calls = 0

    def get_many(self, keys, outs, *, token_digests=None):
        type(self).calls += len(keys)
        return super().get_many(keys, outs, token_digests=token_digests)

    def contains_many(self, keys):
        type(self).calls += len(keys)
        return super().contains_many(keys)


def test_one_request_per_record_and_a_rotation_falls_back_to_older_names(tmp_path: Path) -> None:
    old, new = key_files(tmp_path, "old", "new")
    where = tmp_path / "z"
    keys = [make_key(i) for i in range(6)]
    with EncryptedStore(_Counting(where, layout_fingerprint=FP), enc([old])) as s:
        s.put_many([item_for(k, N) for k in keys])
        _Counting.calls = 0
        assert all(o is not None for o in read_all(s, keys)) and s.contains_many(keys) == [True] * 6
        assert _Counting.calls == 12  # one request per record and per presence check
    with EncryptedStore(_Counting(where, layout_fingerprint=FP, sealed=True), enc([new, old])) as s:
        s.put_many([item_for(k, N) for k in keys[:2]])  # new writes: under the new key's names
        _Counting.calls = 0
        assert all(o is not None for o in read_all(s, keys))
        assert _Counting.calls == 6 + 4  # the 4 records still under old names: one more request each
        assert sorted(s.sample(keys, SIZES), key=str) == sorted([bytes.fromhex(s.keyring.key_ids[0])] * 2
                                                                + [bytes.fromhex(s.keyring.key_ids[1])] * 4, key=str)
        assert sorted(s, key=str) == sorted(keys + keys[:2], key=str)  # listed: each copy, mapped back
        assert len(s) == 8 and s.delete(keys[0]) and not s.contains(keys[0])  # every copy removed


def test_a_listing_yields_our_keys_only_on_a_prefix_shared_by_tenants(tmp_path: Path) -> None:
    a, = key_files(tmp_path, "a")
    where = tmp_path / "shared"
    ours, theirs = [make_key(i) for i in range(4)], [make_key(i, salt=b"g") for i in range(3)]
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([a], "globex")) as g:
        g.put_many([item_for(k, N) for k in theirs])
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([a])) as s:
        s.put_many([item_for(k, N) for k in ours])
        assert sorted(s, key=str) == sorted(ours, key=str) and len(s) == 7
        assert sorted(s.recent(10), key=str) == sorted(ours, key=str)
        v = s.verify(repair=True, payload_bytes=SIZES)
        assert (v["authenticated"], v["foreign"], v["auth_removed"]) == (4, 3, 0)  # theirs are never removed
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([a], "globex")) as g:
        assert all(o is not None for o in read_all(g, theirs))


def test_rekey_drop_old_deletes_what_only_the_old_key_authenticates(tmp_path: Path) -> None:
    old, new = key_files(tmp_path, "old", "new")
    url = f"lmdb://{tmp_path / 's'}"
    keys = [make_key(i) for i in range(8)]
    with open_store(url, layout_fingerprint=FP, encryption=enc([old])) as s:
        s.put_many([item_for(k, N) for k in keys[:5]])  # (an attacker with the old key could have planted these)
    with open_store(url, layout_fingerprint=FP, encryption=enc([new, old])) as s:
        s.put_many([item_for(k, N) for k in keys[5:]])
        report = s.rekey(SIZES, batch=2, drop_old=True)
        assert (report.dropped, report.rekeyed, report.current, report.opened_old) == (5, 0, 3, 5)
        assert len(s) == 3 and s.sample(keys, SIZES) == [None] * 5 + [bytes.fromhex(s.keyring.key_ids[0])] * 3


def test_a_journaled_envelope_that_does_not_authenticate_is_not_put_back(tmp_path: Path) -> None:
    """The rekey journal sits in the store's directory: a record planted there under a
    valid checksum (another record's envelope relabelled) is counted lost, never stored."""
    from tiered_kv.storage.encrypted.rekey_journal import JOURNAL_NAME, RekeyJournal

    old, new = key_files(tmp_path, "old", "new")
    where = tmp_path / "s"
    keys = [make_key(i) for i in range(3)]
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([new])) as s:
        sealed = s._seal([item_for(k, N) for k in keys])
        planted = [sealed[0], sealed[1], PutItem(sealed[2].key, sealed[0].parent_hash, sealed[0].token_digest,
                                                 np.array(sealed[0].payload))]  # 0's envelope as 2's
        rj = RekeyJournal(where / JOURNAL_NAME)
        with rj.holding(required=True):
            rj.write(planted, FP)
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([new])) as s:  # (replays at open)
        st = s.stats()
        assert (st["rekey_restored"], st["rekey_lost"]) == (2, 1)
        got = read_all(s, keys)
        assert [g is None for g in got] == [False, False, True]
    # under a key this opener does not hold: left for a holder of that key
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([new])) as s:
        sealed = s._seal([item_for(make_key(9), N)])
        with RekeyJournal(where / JOURNAL_NAME).holding(required=True):
            RekeyJournal(where / JOURNAL_NAME).write(sealed, FP)
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([old])) as s:
        assert s.stats()["rekey_restored"] == 0 and (where / JOURNAL_NAME).exists()
    with open_store(f"zarr://{where}", layout_fingerprint=FP, encryption=enc([new])) as s:
        assert s.stats()["rekey_restored"] == 1 and not (where / JOURNAL_NAME).exists()
