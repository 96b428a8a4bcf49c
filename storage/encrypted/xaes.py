"""XAES-256-GCM (C2SP): AES-256-GCM with a 192-bit nonce, a fresh subkey per nonce.

The envelopes of :mod:`.crypto` are sealed with it, so that random nonces put no practical
bound on how many records one key seals. Plain AES-GCM with random 96-bit nonces is
limited to 2^32 messages per key (NIST SP 800-38D, collision probability 2^-32), and the
messages sealed under one tenant key cannot be counted: many nodes seal, uploads are
retried, promotions and rekey seal again. XAES-256-GCM
(https://c2sp.org/XAES-256-GCM) derives a subkey from the key and the first 96 bits of
the nonce, and runs AES-256-GCM under that subkey with the last 96 bits as its nonce:

    L  = AES-256_K(0^128);  K1 = L << 1, xored with 0x87 when the top bit of L is set
    M1 = 00 01 58 00 || N[:12];  M2 = 00 02 58 00 || N[:12]
    Kx = AES-256_K(M1 xor K1) || AES-256_K(M2 xor K1)     (NIST SP 800-108r1 counter KDF, CMAC PRF)
    XAES-256-GCM(K, N, P, A) = AES-256-GCM(Kx, N[12:], P, A)

With nonces drawn at random, a subkey repeats only when the first 96 bits collide, and a
GCM nonce then only if the last 96 collide too: after 2^48 records (about 140 EB of
Flash blocks) the chance of a repeated (subkey, nonce) pair is below 2^-96. The test
vectors of the specification are checked by ``tests/storage/test_crypto_primitives.py``.

The bulk AES-256-GCM of :meth:`Xaes256Gcm.seal_into` and :meth:`Xaes256Gcm.open_into` is
:mod:`.gcm`'s (libcrypto through ctypes, the GIL released so reader threads decrypt in
parallel, where the system OpenSSL is not older than ``cryptography``'s; else ``cryptography``). The subkey derivation is two AES block encryptions (one ECB call of 32 bytes); the
encryptor is kept per thread, so sealing and opening cost one AES-GCM context per
envelope more than plain AES-GCM (a couple of microseconds against ~100 us of AES-GCM
for a 0.5 MB record).
"""

from __future__ import annotations

import threading
from typing import Any

from .gcm import backend

__all__ = ["NONCE_BYTES", "Xaes256Gcm"]

KEY_BYTES = 32
#: XAES-256-GCM nonce: 12 bytes select the subkey, 12 are the AES-GCM nonce under it.
NONCE_BYTES = 24
_M1 = b"\x00\x01X\x00"
_M2 = b"\x00\x02X\x00"


def _dbl(block: bytes) -> bytes:
    """The CMAC subkey doubling of a 16-byte block (NIST SP 800-38B, 6.1)."""
    v = int.from_bytes(block, "big") << 1
    if v >> 128:
        v = (v & ((1 << 128) - 1)) ^ 0x87
    return v.to_bytes(16, "big")


class Xaes256Gcm:
    """XAES-256-GCM under one 32-byte key: :meth:`aead` gives the AES-256-GCM of a nonce."""

    __slots__ = ("_key", "_p1", "_p2", "_k1_tail", "_local")

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_BYTES:
            raise ValueError(f"XAES-256-GCM key: expected {KEY_BYTES} bytes")
        self._key = bytes(key)
        self._local = threading.local()
        k1 = _dbl(self._ecb().update(bytes(16)))
        # M_i xor K1 = (prefix_i xor K1[:4]) || (N[:12] xor K1[4:]): the prefixes precomputed
        self._p1 = bytes(a ^ b for a, b in zip(_M1, k1[:4]))
        self._p2 = bytes(a ^ b for a, b in zip(_M2, k1[:4]))
        self._k1_tail = int.from_bytes(k1[4:], "big")

    def _ecb(self) -> Any:
        """This thread's AES-256-ECB encryptor under the key (ECB holds no state between
        blocks; an encryptor object may not be shared by threads)."""
        enc = getattr(self._local, "ecb", None)
        if enc is None:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

            enc = self._local.ecb = Cipher(algorithms.AES(self._key), modes.ECB()).encryptor()  # noqa: S305
        return enc

    def subkey(self, nonce: bytes) -> bytes:
        """The 32-byte AES-256-GCM key of ``nonce`` (24 bytes)."""
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"XAES-256-GCM nonce: expected {NONCE_BYTES} bytes, got {len(nonce)}")
        tail = (int.from_bytes(nonce[:12], "big") ^ self._k1_tail).to_bytes(12, "big")
        return self._ecb().update(b"".join((self._p1, tail, self._p2, tail)))

    def aead(self, nonce: bytes) -> tuple[Any, bytes]:
        """``(AESGCM under the subkey, its 12-byte nonce)`` of ``nonce``."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        return AESGCM(self.subkey(nonce)), bytes(nonce[12:])

    def seal_into(self, nonce: bytes, plaintext: Any, aad: bytes | None, out: Any) -> None:
        """Encrypt ``plaintext`` into ``out`` (its length + 16 bytes: ciphertext, then tag)
        with :func:`.gcm.backend` (the GIL released where it chose libcrypto)."""
        backend().encrypt_into(self.subkey(nonce), bytes(nonce[12:]), plaintext, aad, out)

    def open_into(self, nonce: bytes, ciphertext: Any, aad: bytes | None, out: Any) -> bool:
        """Decrypt ``ciphertext`` (with its tag) into ``out``; False when the tag fails, and
        ``out`` is then zeroed (:func:`.gcm.backend`, the GIL released where it chose libcrypto)."""
        return backend().decrypt_into(self.subkey(nonce), bytes(nonce[12:]), ciphertext, aad, out)

    def decryptor(self, nonce: bytes, aad: bytes) -> Any:
        """A streaming decryptor of one message (see :meth:`.crypto.TenantKeys.decryptor`)."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        d = Cipher(algorithms.AES(self.subkey(nonce)), modes.GCM(bytes(nonce[12:]))).decryptor()
        d.authenticate_additional_data(aad)
        return d

    def encrypt(self, nonce: bytes, plaintext: bytes, aad: bytes | None) -> bytes:
        """The ciphertext and tag of ``plaintext`` (for tests and small messages)."""
        aead, n = self.aead(nonce)
        return aead.encrypt(n, plaintext, aad)

    def decrypt(self, nonce: bytes, ciphertext: bytes, aad: bytes | None) -> bytes:
        """The plaintext of ``ciphertext``; raises ``cryptography.exceptions.InvalidTag``."""
        aead, n = self.aead(nonce)
        return aead.decrypt(n, ciphertext, aad)
