"""Tenant-encrypted records in a shared S3 bucket (SeaweedFS), against a bucket adversary.

Tenant A seals its records under keyed names; a client holding the bucket's credentials
but no key (who learns no record key from a listing) then overwrites two of those objects
with records under valid checksums, copies a third over another name (relabelled,
checksum fixed) and deletes a fourth. A reads the first three as authentication failures
(removed) and the fourth as a plain miss; the rest are exact. No object in the bucket
holds a 64-byte run of any payload, nor is named by a record key; the wrong key and
another tenant read only misses; a sync to a sealed bucket and a prefetch from it keep records sealed there; a
rekey of the bucket killed mid-batch loses nothing (its journal is a local file).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("obstore", reason="obstore is not installed (pip install obstore)")
pytest.importorskip("cryptography", reason="encryption needs the cryptography package")

import obstore  # noqa: E402

from seaweedfs import SeaweedFS  # noqa: E402
from tiered_kv.cli import main as cli_main  # noqa: E402
from tiered_kv.storage import EncryptionConfig, RecordKind, encode_record, open_store  # noqa: E402
from tiered_kv.storage.encrypted.crypto import ENVELOPE_OVERHEAD, HEAD_BYTES, Keyring, write_key_file  # noqa: E402
from tiered_kv.storage.format.record import HEADER_BYTES, parse_header  # noqa: E402
from tiered_kv.storage.s3 import get_bytes, list_keys, open_object_store, parse_s3_url  # noqa: E402
from tiered_kv.storage.zarr.objects import object_name  # noqa: E402

BUCKET = "tkv-crypto"
FP = "kvl1-test-0123456789abcdef0123"
N = 50_000


def _key(i: int):
    import hashlib

    from tiered_kv.storage import RecordKey

    return RecordKey.block(hashlib.sha256(b"s3-crypto %d" % i).digest())


def _item(key, n: int = N):
    import hashlib

    from tiered_kv.storage import PutItem

    payload = np.random.default_rng(int.from_bytes(key.block_hash[:8], "little")).integers(0, 256, n, dtype=np.uint8)
    return PutItem(key, hashlib.sha256(b"parent" + key.block_hash).digest(),
                   hashlib.sha256(b"tokens" + key.block_hash).digest(), payload)


@pytest.fixture
def server(seaweedfs: SeaweedFS) -> SeaweedFS:
    seaweedfs.make_bucket(BUCKET)
    return seaweedfs


@pytest.fixture
def url(server: SeaweedFS) -> str:
    return server.url(BUCKET, f"crypto-{uuid.uuid4().hex[:12]}")


def _stored(enc: dict[str, Any], key):
    """The key ``key``'s record is stored under in a bucket sealed with ``enc`` (its keyed
    name: what its header and object path say, and what a lister sees)."""
    return Keyring(EncryptionConfig(key_files=enc["key_files"], tenant=enc["tenant"])).current.name(key)


def _name(enc: dict[str, Any], key) -> str:
    """The object name of ``key``'s record in a bucket sealed with ``enc``."""
    return object_name(_stored(enc, key))


def _creds(server: SeaweedFS) -> dict[str, Any]:
    return {"access_key_id": server.access_key, "secret_access_key": server.secret_key}


def _keyfile(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    write_key_file(path)
    return str(path)


def _read(store, items) -> list[np.ndarray | None]:
    outs = [np.empty(it.payload.nbytes, np.uint8) for it in items]
    metas = store.get_many([it.key for it in items], outs, token_digests=[it.token_digest for it in items])
    return [o if m is not None else None for o, m in zip(outs, metas)]


def _bucket_objects(server: SeaweedFS, url: str) -> dict[str, bytes]:
    """Every object under the store's prefix, as an adversary with the credentials lists it."""
    raw = open_object_store(parse_s3_url(url, **_creds(server)))
    return {name: bytes(get_bytes(raw, name)) for name in list_keys(raw)}


def _leaks(blobs: list[bytes], payloads: list[np.ndarray], run: int = 64) -> int:
    """Payloads with a ``run``-byte stretch inside some blob (every such stretch contains
    an aligned run/2 window of the blob: index those, slide over the payloads)."""
    half = run // 2
    found = 0
    for blob in blobs:
        windows = {blob[i:i + half] for i in range(0, len(blob) - half + 1, half)}
        for p in payloads:
            data = p.tobytes()
            if any(data[q:q + half] in windows and any(data[s:s + run] in blob
                                                       for s in range(max(0, q - run), min(q, len(data) - run) + 1))
                   for q in range(len(data) - half + 1)):
                found += 1
    return found


@pytest.mark.s3
def test_bucket_adversary_gets_misses_and_reads_nothing(server: SeaweedFS, url: str, tmp_path: Path) -> None:
    key_a = _keyfile(tmp_path, "a.key")
    enc_a = {"key_files": [key_a], "tenant": "tenant-a"}
    items = [_item(_key(i)) for i in range(10)]
    with open_store(url, layout_fingerprint=FP, encryption=enc_a, **_creds(server)) as store:
        assert store.put_many(items) == [True] * 10

    # -- the adversary: bucket credentials, no key ---------------------------------
    objects = _bucket_objects(server, url)
    names = [_name(enc_a, it.key) for it in items]
    assert set(names) <= set(objects) and not {object_name(it.key) for it in items} & set(objects)
    assert _leaks(list(objects.values()), [it.payload for it in items]) == 0     # reads nothing
    bucket = open_object_store(parse_s3_url(url, **_creds(server)))
    # 1. a plain record under a valid checksum, of the plain payload's size
    forged_plain = encode_record(key=_stored(enc_a, items[0].key), parent_hash=items[0].parent_hash,
                                 token_digest=items[0].token_digest, layout_fingerprint=FP,
                                 payload=np.zeros(N, np.uint8))
    obstore.put(bucket, names[0], bytes(forged_plain))
    # 2. a record of the envelope's size, bytes of its own, valid checksum
    stolen = objects[names[1]]
    hdr = parse_header(stolen, len(stolen))
    head = stolen[HEADER_BYTES:HEADER_BYTES + HEAD_BYTES]
    forged_env = encode_record(key=_stored(enc_a, items[1].key), parent_hash=hdr.parent_hash,
                               token_digest=hdr.token_digest, layout_fingerprint=FP,
                               payload=np.frombuffer(head + bytes(N + ENVELOPE_OVERHEAD - HEAD_BYTES), np.uint8))
    obstore.put(bucket, names[1], bytes(forged_env))
    # 3. record 9's object copied under key 2, its header relabelled, its checksum fixed
    src = objects[names[9]]
    hdr = parse_header(src, len(src))
    moved = encode_record(key=_stored(enc_a, items[2].key), parent_hash=hdr.parent_hash, token_digest=hdr.token_digest,
                          layout_fingerprint=FP, payload=np.frombuffer(src[HEADER_BYTES:-16], np.uint8))
    obstore.put(bucket, names[2], bytes(moved))
    # 4. deleted
    obstore.delete(bucket, names[3])

    # -- tenant A reads ----------------------------------------------------------------
    with open_store(url, layout_fingerprint=FP, encryption=enc_a, **_creds(server)) as store:
        got = _read(store, items)
        assert [g is None for g in got] == [True] * 4 + [False] * 6
        for it, out in zip(items[4:], got[4:]):
            np.testing.assert_array_equal(out, it.payload)
        s = store.stats()
        assert (s["auth_failures"], s["misses"], s["hits"], s["corrupt"]) == (3, 4, 6, 0)
        # nothing but an authentic envelope may hold one of A's names: the plain record
        # (authenticated at its own size), the copied head and the moved envelope are
        # removed, and A's next put restores them all
        assert s["auth_removed"] == 3
        assert store.put_many(items[:4]) == [True] * 4
        assert all(g is not None for g in _read(store, items[:4]))

    # -- the wrong key and another tenant: only misses ------------------------------
    for enc in ({"key_files": [_keyfile(tmp_path, "b.key")], "tenant": "tenant-a"},
                {"key_files": [key_a], "tenant": "tenant-b"}):
        with open_store(url, layout_fingerprint=FP, encryption=enc, **_creds(server)) as store:
            assert _read(store, items) == [None] * 10  # their names are elsewhere: plain misses
            assert store.stats()["hits"] == 0 and store.stats()["auth_failures"] == 0
            assert len(store) == 10  # none of them removed
    # and nothing in the bucket leaks after all of it
    assert _leaks(list(_bucket_objects(server, url).values()), [it.payload for it in items]) == 0


@pytest.mark.s3
def test_sync_to_and_prefetch_from_a_sealed_bucket(server: SeaweedFS, url: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The CLI between encrypted levels: ``sync`` seals what it uploads, ``prefetch`` opens
    what it copies (into a sealed local store with --encrypt-local), ``verify`` checks tags."""
    from tiered_kv import presets

    layout = presets.tiny()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    key = _keyfile(tmp_path, "fleet.key")
    monkeypatch.setenv("TIERED_KV_KEY_FILE", key)
    local = tmp_path / "node-a"
    assert cli_main(["warm-start", "--store", str(local), "--prompts", "bundled", "--salt", "acme", "--json"]) == 0
    # node A's local store is sealed (TIERED_KV_KEY_FILE, tenant = the salt); sync uploads sealed
    assert cli_main(["sync", "--store", str(local), "--shared", url, "--tenant", "acme", "--encrypt-local",
                     "--json"]) == 0
    with pytest.raises(Exception, match="this level is encrypted"):  # no plain opener of a sealed level
        open_store(f"lmdb://{local}", layout_fingerprint=layout.fingerprint, readonly=True)
    payloads = []
    with open_store(f"lmdb://{local}", layout_fingerprint=layout.fingerprint, readonly=True,
                    encryption={"key_files": [key], "tenant": "acme"}) as sealed:
        keys = list(sealed)  # (each name mapped back to its key: the envelope's head says under which key)
        assert keys and not set(keys) & set(sealed.names())
        for k in keys:
            out = np.empty(layout.block_bytes if k.kind is RecordKind.BLOCK else layout.snapshot_bytes, np.uint8)
            assert sealed.get(k, out) is not None
            payloads.append(out)
    assert _leaks(list(_bucket_objects(server, url).values()), payloads[:6]) == 0
    capsys.readouterr()
    assert cli_main(["verify", "--store", url, "--tenant", "acme", "--json"]) == 0
    assert '"authenticated": %d' % len(keys) in capsys.readouterr().out
    # node B prefetches from the sealed bucket into its own sealed store
    node_b = tmp_path / "node-b"
    assert cli_main(["prefetch", "--from", url, "--to", str(node_b), "--prompts", "bundled", "--salt", "acme",
                     "--encrypt-local", "--json"]) == 0
    with open_store(f"lmdb://{node_b}", layout_fingerprint=layout.fingerprint, readonly=True,
                    encryption={"key_files": [key], "tenant": "acme"}) as store:
        assert set(store) == set(keys)
        for k, want in zip(keys, payloads):
            out = np.empty(want.nbytes, np.uint8)
            assert store.get(k, out) is not None
            np.testing.assert_array_equal(out, want)
    # without the key, prefetch gets only misses from the bucket: nothing copied, exit 1
    monkeypatch.delenv("TIERED_KV_KEY_FILE")
    assert cli_main(["prefetch", "--from", url, "--to", str(tmp_path / "node-c"), "--prompts", "bundled",
                     "--salt", "acme", "--key-file", _keyfile(tmp_path, "wrong.key"), "--json"]) == 1


@pytest.mark.s3
def test_rekey_of_a_bucket_killed_mid_batch_then_run_again_loses_nothing(
        server: SeaweedFS, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``tiered-kv rekey`` of a bucket, killed (SIGKILL) after removing its second batch:
    the batch waits in the default local journal (under $XDG_CACHE_HOME, owner-only);
    run again on the same machine, it is put back and every record is under the new key."""
    from tiered_kv import presets

    layout = presets.tiny()
    old, new = _keyfile(tmp_path, "old.key"), _keyfile(tmp_path, "new.key")
    items = [_item(_key(100 + i), layout.block_bytes) for i in range(12)]
    with open_store(url, layout_fingerprint=layout.fingerprint, encryption={"key_files": [old], "tenant": "acme"},
                    **_creds(server)) as s:
        assert s.put_many(items) == [True] * 12
    env = {**os.environ, **server.env(), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("TIERED_KV_KEY_FILE", None)
    args = ["rekey", "--store", url, "--key-file", new, "--old-key-file", old, "--tenant", "acme", "--batch", "4",
            "--json"]
    proc = subprocess.run([sys.executable, "-m", "tiered_kv.cli", *args],
                          env={**env, "TIERED_KV_FAILPOINT": "rekey-deleted:2"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    journals = list((tmp_path / "cache" / "tiered_kv" / "rekey").glob("*.journal"))
    assert len(journals) == 1 and stat.S_IMODE(journals[0].stat().st_mode) == 0o600
    assert len(_bucket_objects(server, url)) == 1 + 12 - 4  # zarr.json + the records left
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli_main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["restored"], r["current"], r["rekeyed"], r["lost"], r["journal"]) == (4, 8, 4, 0, str(journals[0]))
    assert not journals[0].exists()
    with open_store(url, layout_fingerprint=layout.fingerprint, encryption={"key_files": [new], "tenant": "acme"},
                    **_creds(server)) as s:
        for it, out in zip(items, _read(s, items)):
            assert out is not None
            np.testing.assert_array_equal(out, it.payload)


# ---------------------------------------------------------------- the streamed read path
# On S3 a sealed read opens each envelope on the I/O thread as its response arrives,
# straight into the caller's buffer, and skips the record's xxh3 (the GCM tag covers the
# same bytes): BlockStore.read_each. These tests pin that path (the staging path is made
# to fail) and cut the responses into odd pieces, so heads, ciphertext and tags straddle
# chunk boundaries and scatter-list pieces.
def _streamed_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered_kv.storage.zarr.bucket import S3Objects

    def staged(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a sealed read took the staging path (S3Objects.read_into), not read_each")

    monkeypatch.setattr(S3Objects, "read_into", staged)


def _rechunk(monkeypatch: pytest.MonkeyPatch, sizes: tuple[int, ...], *, cut_after: int | None = None,
             names: set[str] | None = None) -> None:
    """S3 responses handed over in pieces of ``sizes`` (cycled); with ``cut_after``, the
    responses of ``names`` fail (store unavailable) after that many bytes."""
    from tiered_kv.storage.s3 import ObjectStoreUnavailable
    from tiered_kv.storage.zarr.bucket import S3Objects

    real = S3Objects.read_stream

    def read_stream(self: S3Objects, name: str):
        started = real(self, name)
        if started is None:
            return None
        size, chunks = started
        data = np.concatenate(list(chunks))

        def pieces():
            pos, k = 0, 0
            while pos < size:
                if cut_after is not None and (names is None or name in names) and pos >= cut_after:
                    raise ObjectStoreUnavailable(f"get {name!r}: connection dropped (test)", op="get", key=name)
                n = sizes[k % len(sizes)]
                yield data[pos:pos + n]
                pos, k = pos + n, k + 1

        return size, pieces()

    monkeypatch.setattr(S3Objects, "read_stream", read_stream)


def _scatter(n: int) -> list[np.ndarray]:
    """An out of uneven pieces (one empty) adding up to ``n`` bytes, filled with 0xAB."""
    cuts = [0, 5, 5, 4099, n // 2 + 3, n - 17, n]
    return [np.full(b - a, 0xAB, np.uint8) for a, b in zip(cuts, cuts[1:])]


@pytest.mark.s3
@pytest.mark.parametrize("chunks", [None, (1, 27, 29, 4096, 65521), (200_000,)], ids=["as-sent", "odd", "wide"])
@pytest.mark.parametrize("scatter", [False, True], ids=["one-out", "scatter"])
def test_streamed_sealed_reads_land_in_place_and_forgeries_are_zeroed_counted_misses(
        server: SeaweedFS, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        chunks: tuple[int, ...] | None, scatter: bool) -> None:
    """Through read_each: authentic envelopes decrypt exactly into the caller's buffer
    (one piece or a scatter list, however the response is cut); a flipped ciphertext byte
    under the stale checksum, one under a fixed checksum and a damaged tag are each an
    auth failure and a miss whose out buffer is left zeroed (no unauthenticated plaintext,
    no byte claimed as a hit), and are removed so a put restores them."""
    enc = {"key_files": [_keyfile(tmp_path, "a.key")], "tenant": "tenant-a"}
    items = [_item(_key(100 + i)) for i in range(6)]
    with open_store(url, layout_fingerprint=FP, encryption=enc, **_creds(server)) as store:
        assert store.put_many(items) == [True] * 6
    objects = _bucket_objects(server, url)
    bucket = open_object_store(parse_s3_url(url, **_creds(server)))
    names = [_name(enc, it.key) for it in items]
    stale = bytearray(objects[names[0]])           # 1. ciphertext flipped, checksum left stale
    stale[HEADER_BYTES + 28 + N // 2] ^= 0x10
    fixed = _reencoded(objects[names[1]], flip_at=28 + N // 3)   # 2. flipped, checksum fixed
    tag = _reencoded(objects[names[2]], flip_at=N + ENVELOPE_OVERHEAD - 1)  # 3. tag damaged
    for name, blob in zip(names, (stale, fixed, tag)):
        obstore.put(bucket, name, bytes(blob))

    _streamed_only(monkeypatch)
    if chunks is not None:
        _rechunk(monkeypatch, chunks)
    with open_store(url, layout_fingerprint=FP, encryption=enc, **_creds(server)) as store:
        assert store.inner.supports_streamed_reads
        outs = [_scatter(N) if scatter else np.full(N, 0xAB, np.uint8) for _ in items]
        metas = store.get_many([it.key for it in items], outs, token_digests=[it.token_digest for it in items])
        got = [np.concatenate(o) if scatter else o for o in outs]
        assert [m is None for m in metas] == [True] * 3 + [False] * 3
        for it, m, out in zip(items[3:], metas[3:], got[3:]):
            np.testing.assert_array_equal(out, it.payload)
            assert (m.parent_hash, m.token_digest, m.payload_bytes) == (it.parent_hash, it.token_digest, N)
        for out in got[:3]:
            assert not out.any()  # zeroed: neither plaintext of a forgery nor the old bytes
        s = store.stats()
        assert (s["hits"], s["misses"], s["auth_failures"], s["auth_removed"], s["corrupt"]) == (3, 3, 3, 3, 0)
        assert store.put_many(items[:3]) == [True] * 3
        assert all(o is not None for o in _read(store, items))


def _reencoded(raw: bytes, *, flip_at: int) -> bytes:
    """Stored record ``raw`` with byte ``flip_at`` of its envelope flipped, checksum fixed."""
    hdr = parse_header(raw, len(raw))
    body = bytearray(raw[HEADER_BYTES:-16])
    body[flip_at] ^= 0x01
    from tiered_kv.storage import RecordKey

    return bytes(encode_record(key=RecordKey(hdr.kind, hdr.block_hash), parent_hash=hdr.parent_hash,
                               token_digest=hdr.token_digest, layout_fingerprint=FP,
                               payload=np.frombuffer(bytes(body), np.uint8)))


@pytest.mark.s3
@pytest.mark.parametrize("scatter", [False, True], ids=["one-out", "scatter"])
def test_a_sealed_read_cut_off_mid_transfer_raises_and_leaves_no_plaintext(
        server: SeaweedFS, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scatter: bool) -> None:
    """The store drops a response half-way through the ciphertext: the read raises the
    store's error (as a plain read does), and the half decrypted before the tag could be
    checked is zeroed in the caller's buffer."""
    from tiered_kv.storage.s3 import ObjectStoreUnavailable

    enc = {"key_files": [_keyfile(tmp_path, "a.key")], "tenant": "tenant-a"}
    items = [_item(_key(200 + i)) for i in range(3)]
    with open_store(url, layout_fingerprint=FP, encryption=enc, **_creds(server)) as store:
        store.put_many(items)
    _streamed_only(monkeypatch)
    _rechunk(monkeypatch, (4096,), cut_after=N // 2, names={_name(enc, items[1].key)})
    with open_store(url, layout_fingerprint=FP, encryption=enc, **_creds(server)) as store:
        outs = [_scatter(N) if scatter else np.full(N, 0xAB, np.uint8) for _ in items]
        with pytest.raises(ObjectStoreUnavailable, match="connection dropped"):
            store.get_many([it.key for it in items], outs)
        cut = np.concatenate(outs[1]) if scatter else outs[1]
        assert not cut.any()
        assert store.stats()["hits"] == 0


@pytest.mark.s3
def test_read_each_checks_headers_and_streams_payloads_in_order(server: SeaweedFS, url: str) -> None:
    """The backend half of the streamed path, on a plain S3 store: each stored record of
    the size asked reaches its sink whole and in order, with its header's meta; an absent
    record, one of another size (kept) and one whose header fails its checks (removed,
    counted corrupt) are Unread and open no sink."""
    from tiered_kv.storage import ZarrStore
    from tiered_kv.storage.api import Unread

    items = [_item(_key(300 + i)) for i in range(5)]
    items[3] = _item(_key(303), n=N - 8)
    with ZarrStore(url, layout_fingerprint=FP, **_creds(server)) as store:
        store.put_many(items[:4])
        bucket = open_object_store(parse_s3_url(url, **_creds(server)))
        src = _bucket_objects(server, url)[object_name(items[0].key)]
        obstore.put(bucket, object_name(items[2].key), src)  # 0's record under 2's name: its key check fails

        class Collect:
            def __init__(self, meta) -> None:
                self.meta, self.parts = meta, []

            def write(self, chunk: np.ndarray) -> bool:
                self.parts.append(chunk.copy())
                return True

            def finish(self):
                return self.meta, np.concatenate(self.parts)

        opened: list[int] = []

        def open_sink(i: int, meta):
            opened.append(i)
            return Collect(meta)

        got = store.read_each([it.key for it in items], [N] * 5, open_sink)
        assert sorted(opened) == [0, 1]
        for it, (meta, data) in zip(items[:2], got[:2]):
            np.testing.assert_array_equal(data, it.payload)
            assert (meta.key, meta.parent_hash, meta.token_digest) == (it.key, it.parent_hash, it.token_digest)
        assert got[2:] == [Unread.ABSENT, Unread.OTHER_SIZE, Unread.ABSENT]
        st = store.stats()
        assert (st["hits"], st["corrupt"], st["misses"]) == (2, 1, 3)
        assert not store.contains(items[2].key) and store.contains(items[3].key)
