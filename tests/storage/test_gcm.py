"""AES-256-GCM through libcrypto (storage/encrypted/gcm.py): byte-identical to
``cryptography``'s AESGCM both ways, a flipped bit anywhere fails and leaves the output
zeroed, the buffers it takes (read-only numpy, memoryview, bytes), the fallback where
libcrypto cannot be loaded, and an encrypted store that works on either backend."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("cryptography", reason="encryption needs the cryptography package (the encryption extra)")

from cryptography.exceptions import InvalidTag  # noqa: E402
from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encryption_helpers import key_files  # noqa: E402
from storage_helpers import FP, item_for, make_key, payload_for  # noqa: E402
from tiered_kv.storage import EncryptedStore, LmdbStore  # noqa: E402
from tiered_kv.storage.encrypted import gcm  # noqa: E402
from tiered_kv.storage.encrypted.xaes import Xaes256Gcm  # noqa: E402

LIB = gcm.load(choice="libcrypto")
needs_libcrypto = pytest.mark.skipif(not isinstance(LIB, gcm.LibcryptoGcm), reason="libcrypto not loadable here")
BACKENDS = [pytest.param(LIB, id="libcrypto", marks=needs_libcrypto), pytest.param(gcm.CryptographyGcm(),
                                                                                     id="cryptography")]

N = 60_000
sizes = st.one_of(st.sampled_from([0, 1, 15, 16, 17, 4095, 4096, 65537]), st.integers(0, 3000))
aads = st.one_of(st.none(), st.just(b""), st.binary(min_size=1, max_size=300))


def _seal(be: gcm.GcmBackend, key: bytes, nonce: bytes, msg: bytes, aad: bytes | None) -> bytes:
    out = np.empty(len(msg) + 16, np.uint8)
    be.encrypt_into(key, nonce, np.frombuffer(msg, np.uint8), aad, out)
    return out.tobytes()


@needs_libcrypto
@settings(max_examples=150, deadline=None)
@given(n=sizes, aad=aads, data=st.data())
def test_libcrypto_is_byte_identical_to_cryptography_both_ways(n: int, aad: bytes | None, data: st.DataObject) -> None:
    key, nonce = data.draw(st.binary(min_size=32, max_size=32)), data.draw(st.binary(min_size=12, max_size=12))
    msg = os.urandom(n)
    ref = AESGCM(key).encrypt(nonce, msg, aad)
    ours = _seal(LIB, key, nonce, msg, aad)
    assert ours == ref
    out = np.full(n, 0xAA, np.uint8)
    assert LIB.decrypt_into(key, nonce, ref, aad, out) is True  # theirs opened by ours
    assert out.tobytes() == msg
    assert AESGCM(key).decrypt(nonce, ours, aad) == msg  # ours opened by theirs


@needs_libcrypto
@pytest.mark.parametrize("nonce_len", [8, 16, 24])
def test_nonces_other_than_96_bits_match_cryptography(nonce_len: int) -> None:
    key, nonce, msg = os.urandom(32), os.urandom(nonce_len), os.urandom(1000)
    ref = AESGCM(key).encrypt(nonce, msg, b"ad")
    assert _seal(LIB, key, nonce, msg, b"ad") == ref
    out = np.empty(1000, np.uint8)
    assert LIB.decrypt_into(key, nonce, ref, b"ad", out) and out.tobytes() == msg


@pytest.mark.parametrize("be", BACKENDS)
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 2000), where=st.sampled_from(["ciphertext", "tag", "aad", "nonce", "key"]),
       bit=st.integers(0, 1 << 20))
def test_a_flipped_bit_fails_and_leaves_the_output_zeroed(be: gcm.GcmBackend, n: int, where: str, bit: int) -> None:
    key, nonce, aad, msg = os.urandom(32), os.urandom(12), os.urandom(40), os.urandom(n)
    ct = bytearray(AESGCM(key).encrypt(nonce, msg, aad))
    parts = {"ciphertext": ct if n else None, "tag": ct, "aad": bytearray(aad), "nonce": bytearray(nonce),
             "key": bytearray(key)}
    target = parts[where]
    if target is None:  # (no ciphertext bytes to flip)
        target, where = ct, "tag"
    lo, hi = {"ciphertext": (0, n), "tag": (n, n + 16)}.get(where, (0, len(target)))
    target[lo + (bit >> 3) % (hi - lo)] ^= 1 << (bit & 7)
    out = np.full(n, 0x5A, np.uint8)
    assert be.decrypt_into(bytes(parts["key"]), bytes(parts["nonce"]), bytes(ct), bytes(parts["aad"]), out) is False
    assert not out.any()


@pytest.mark.parametrize("be", BACKENDS)
def test_buffers_read_only_numpy_memoryview_and_a_short_input(be: gcm.GcmBackend) -> None:
    key, nonce, msg = os.urandom(32), os.urandom(12), os.urandom(7777)
    ct = np.frombuffer(AESGCM(key).encrypt(nonce, msg, None), np.uint8)  # read-only, like a map
    assert not ct.flags.writeable
    big = np.zeros(8000, np.uint8)
    assert be.decrypt_into(key, nonce, memoryview(ct), None, memoryview(big)[100:100 + 7777])
    assert big[100:100 + 7777].tobytes() == msg and not big[:100].any() and not big[100 + 7777:].any()
    assert be.decrypt_into(key, nonce, ct[:15], None, np.empty(0, np.uint8)) is False  # shorter than a tag
    with pytest.raises(ValueError):
        be.decrypt_into(key, nonce, ct, None, np.empty(10, np.uint8))  # wrong output size


@needs_libcrypto
def test_threads_decrypt_concurrently_with_their_own_contexts() -> None:
    """Several threads sealing and opening at once (each its own cached context) get
    every message right."""
    key = os.urandom(32)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(50):
            nonce, msg = os.urandom(12), rng.integers(0, 256, int(rng.integers(0, 70000)), np.uint8).tobytes()
            ct = _seal(LIB, key, nonce, msg, b"t")
            out = np.empty(len(msg), np.uint8)
            if not LIB.decrypt_into(key, nonce, ct, b"t", out) or out.tobytes() != msg:
                errors.append(f"thread {seed}")

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_fallback_where_libcrypto_cannot_be_loaded(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=gcm.__name__):
        be = gcm.load("/nonexistent/libcrypto-missing.so", choice="libcrypto")
    assert isinstance(be, gcm.CryptographyGcm)
    assert [r.getMessage() for r in caplog.records if "libcrypto unavailable" in r.getMessage()]
    key, nonce, msg = os.urandom(32), os.urandom(12), os.urandom(300)
    assert _seal(be, key, nonce, msg, b"x") == AESGCM(key).encrypt(nonce, msg, b"x")


def test_auto_takes_libcrypto_only_when_not_older_than_cryptographys_openssl(monkeypatch: pytest.MonkeyPatch
                                                                           ) -> None:
    monkeypatch.setattr(gcm, "_cryptography_openssl", lambda: 0x7FFFFFFF)
    assert isinstance(gcm.load(choice="auto"), gcm.CryptographyGcm)
    assert isinstance(gcm.load(choice="cryptography"), gcm.CryptographyGcm)
    monkeypatch.setenv(gcm.ENV, "cryptography")
    assert isinstance(gcm.load(), gcm.CryptographyGcm)
    monkeypatch.setenv(gcm.ENV, "bogus")
    with pytest.raises(ValueError, match="TIERED_KV_AES_GCM"):
        gcm.load()
    if isinstance(LIB, gcm.LibcryptoGcm):
        monkeypatch.setattr(gcm, "_cryptography_openssl", lambda: 0)
        assert isinstance(gcm.load(choice="auto"), gcm.LibcryptoGcm)


@pytest.mark.parametrize("be", BACKENDS)
def test_xaes_open_and_seal_into_match_the_c2sp_vector(be: gcm.GcmBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C2SP XAES-256-GCM vector (msb1) through Xaes256Gcm.seal_into/open_into on
    this backend, and a forged byte rejected with the output zeroed."""
    monkeypatch.setattr(gcm, "_backend", be)
    x, nonce = Xaes256Gcm(b"\x03" * 32), b"ABCDEFGHIJKLMNOPQRSTUVWX"
    ct = bytes.fromhex("986ec1832593df5443a179437fd083bf3fdb41abd740a21f71eb769d")
    out = np.empty(len(ct), np.uint8)
    x.seal_into(nonce, np.frombuffer(b"XAES-256-GCM", np.uint8), b"c2sp.org/XAES-256-GCM", out)
    assert out.tobytes() == ct
    plain = np.empty(12, np.uint8)
    assert x.open_into(nonce, ct, b"c2sp.org/XAES-256-GCM", plain) and plain.tobytes() == b"XAES-256-GCM"
    forged = bytearray(ct)
    forged[3] ^= 1
    assert x.open_into(nonce, bytes(forged), b"c2sp.org/XAES-256-GCM", plain) is False and not plain.any()
    with pytest.raises(InvalidTag):
        x.decrypt(nonce, bytes(forged), b"c2sp.org/XAES-256-GCM")


@pytest.mark.parametrize("be", BACKENDS)
def test_an_encrypted_lmdb_store_round_trips_on_either_backend(be: gcm.GcmBackend, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Records sealed and read back (hot: decrypted from the map, on the pool) through the
    public store API, and read by the other backend too (the envelopes are the same bytes)."""
    other = gcm.CryptographyGcm() if be is LIB else LIB
    keys = [make_key(i) for i in range(40)]  # > 1 MiB: opened on the pool and the caller
    monkeypatch.setattr(gcm, "_backend", be)
    with EncryptedStore(LmdbStore(tmp_path / "s", layout_fingerprint=FP),
                        {"key_files": key_files(tmp_path, "a"), "tenant": "acme"}) as s:
        s.put_many([item_for(k, N) for k in keys])
        for side in (be, other, be):
            monkeypatch.setattr(gcm, "_backend", side)
            outs = [np.full(N, 0x5A, np.uint8) for _ in keys]
            assert all(m is not None for m in s.get_many(keys, outs))
            for k, out in zip(keys, outs):
                np.testing.assert_array_equal(out, payload_for(k, N))
