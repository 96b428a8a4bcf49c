"""AES-256-GCM of whole messages, with the GIL released: OpenSSL's libcrypto through ctypes.

Why: ``cryptography`` (50.x) holds the GIL inside ``AESGCM.decrypt_into`` and
``encrypt_into``, so the reader threads of an encrypted store open envelopes one at a time
(two threads decrypt at about one core's speed) while a plain read's native threads use
every core. A ctypes foreign call releases the GIL for its duration, so the bulk
``EVP_DecryptUpdate`` / ``EVP_EncryptUpdate`` of each envelope runs in parallel on all
the reader threads. The bytes are those of ``cryptography``'s ``AESGCM`` (the same
OpenSSL primitive): ciphertext followed by its 16-byte tag.

:func:`backend` gives :class:`LibcryptoGcm` where ``libcrypto`` (OpenSSL >= 1.1) loads and
is at least as new as the OpenSSL ``cryptography`` is built with, else
:class:`CryptographyGcm` (``cryptography``'s AESGCM, as before; see :func:`load`, and
``$TIERED_KV_AES_GCM``). Both have the same two methods:

    encrypt_into(key, nonce, plaintext, aad, out)      out: len(plaintext) + 16 bytes
    decrypt_into(key, nonce, ciphertext, aad, out) -> bool
                                                       ciphertext: with its tag; out:
                                                       len(ciphertext) - 16 bytes; False
                                                       when the tag fails, out zeroed

Buffers are anything with the buffer protocol (bytes, memoryview, 1-D contiguous uint8
numpy arrays, read-only maps included); their addresses are taken through numpy views held
in locals for the whole call, so no buffer is freed while OpenSSL reads or writes it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Any, Protocol

import numpy as np

__all__ = ["CryptographyGcm", "GcmBackend", "LibcryptoGcm", "backend", "load"]

log = logging.getLogger(__name__)

KEY_BYTES = 32
TAG_BYTES = 16
_CTRL_GCM_SET_IVLEN = 0x9
_CTRL_GCM_GET_TAG = 0x10
_CTRL_GCM_SET_TAG = 0x11
#: The largest piece one EVP_*Update call takes (its length is a C int).
_PIECE = 1 << 30
_MIN_VERSION = 0x10100000  # OpenSSL 1.1.0


class GcmBackend(Protocol):
    name: str

    def encrypt_into(self, key: bytes, nonce: bytes, plaintext: Any, aad: bytes | None, out: Any) -> None: ...

    def decrypt_into(self, key: bytes, nonce: bytes, ciphertext: Any, aad: bytes | None, out: Any) -> bool: ...


def _view(buf: Any, *, writable: bool = False) -> np.ndarray:
    """A flat uint8 view of ``buf`` (no copy); raises ValueError if it is not contiguous,
    or not writable when ``writable``."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if arr.dtype != np.uint8 or not arr.flags.c_contiguous:
        arr = np.frombuffer(memoryview(arr).cast("B"), np.uint8)  # (raises for a strided buffer)
    if writable and not arr.flags.writeable:
        raise ValueError("AES-GCM output buffer: expected a writable buffer")
    return arr.reshape(-1)


def _check(key: bytes, nonce: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError(f"AES-256-GCM key: expected {KEY_BYTES} bytes, got {len(key)}")
    if not 8 <= len(nonce) <= 128:
        raise ValueError(f"AES-GCM nonce: expected 8 to 128 bytes, got {len(nonce)}")


class LibcryptoGcm:
    """AES-256-GCM through libcrypto's EVP API (see the module docstring). One cipher
    context per thread, kept for the thread's life and re-keyed per message."""

    name = "libcrypto"

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, ci, cp = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
        version = getattr(lib, "OpenSSL_version_num", None)
        if version is None:
            raise OSError("libcrypto before OpenSSL 1.1 (no OpenSSL_version_num)")
        version.restype, version.argtypes = ctypes.c_ulong, []
        self.version = int(version())
        if self.version < _MIN_VERSION:
            raise OSError(f"libcrypto version {self.version:#x} < 1.1")
        for fname, res, args in (
            ("EVP_CIPHER_CTX_new", vp, []),
            ("EVP_CIPHER_CTX_free", None, [vp]),
            ("EVP_aes_256_gcm", vp, []),
            ("EVP_CipherInit_ex", ci, [vp, vp, vp, vp, vp, ci]),
            ("EVP_CipherUpdate", ci, [vp, vp, cp, vp, ci]),
            ("EVP_DecryptFinal_ex", ci, [vp, vp, cp]),
            ("EVP_EncryptFinal_ex", ci, [vp, vp, cp]),
            ("EVP_CIPHER_CTX_ctrl", ci, [vp, ci, ci, vp]),
        ):
            f = getattr(lib, fname)
            f.restype, f.argtypes = res, args
        self._lib = lib
        cipher = None
        fetch = getattr(lib, "EVP_CIPHER_fetch", None)  # OpenSSL 3: fetched once, not per init
        if fetch is not None:
            fetch.restype, fetch.argtypes = vp, [vp, ctypes.c_char_p, ctypes.c_char_p]
            cipher = fetch(None, b"AES-256-GCM", None)
        self._cipher = cipher or lib.EVP_aes_256_gcm()
        if not self._cipher:
            raise OSError("libcrypto: no AES-256-GCM cipher")
        self._local = threading.local()

    def _ctx(self) -> _Ctx:
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self._local.ctx = _Ctx(self._lib)
        return ctx

    def _init(self, ctx: int, key: bytes, nonce: bytes, enc: int) -> None:
        lib = self._lib
        ok = lib.EVP_CipherInit_ex(ctx, self._cipher, None, None, None, enc)
        if ok == 1 and len(nonce) != 12:
            ok = lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_SET_IVLEN, len(nonce), None)
        if ok == 1:
            ok = lib.EVP_CipherInit_ex(ctx, None, None, key, nonce, -1)
        if ok != 1:
            raise RuntimeError("libcrypto: AES-256-GCM init failed")

    def _update(self, ctx: int, out: int | None, src: np.ndarray) -> None:
        """Feed ``src`` (AAD when ``out`` is None, else data written at address ``out``)."""
        lib, n = self._lib, ctypes.c_int(0)
        base, size = src.ctypes.data, src.nbytes
        for off in range(0, size, _PIECE):
            piece = min(_PIECE, size - off)
            if lib.EVP_CipherUpdate(ctx, None if out is None else out + off, ctypes.byref(n), base + off,
                                    piece) != 1:
                raise RuntimeError("libcrypto: AES-256-GCM update failed")

    def encrypt_into(self, key: bytes, nonce: bytes, plaintext: Any, aad: bytes | None, out: Any) -> None:
        _check(key, nonce)
        src, dst = _view(plaintext), _view(out, writable=True)
        if dst.nbytes != src.nbytes + TAG_BYTES:
            raise ValueError(f"AES-GCM encrypt: output must be {src.nbytes + TAG_BYTES} bytes, got {dst.nbytes}")
        a = _view(aad) if aad else None
        ctx = self._ctx().ptr
        lib, n, tag = self._lib, ctypes.c_int(0), ctypes.create_string_buffer(TAG_BYTES)
        self._init(ctx, bytes(key), bytes(nonce), 1)
        if a is not None:
            self._update(ctx, None, a)
        if src.nbytes:
            self._update(ctx, dst.ctypes.data, src)
        if lib.EVP_EncryptFinal_ex(ctx, tag, ctypes.byref(n)) != 1 or \
                lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_GET_TAG, TAG_BYTES, tag) != 1:
            raise RuntimeError("libcrypto: AES-256-GCM finalize failed")
        ctypes.memmove(dst.ctypes.data + src.nbytes, tag, TAG_BYTES)

    def decrypt_into(self, key: bytes, nonce: bytes, ciphertext: Any, aad: bytes | None, out: Any) -> bool:
        _check(key, nonce)
        src, dst = _view(ciphertext), _view(out, writable=True)
        if src.nbytes < TAG_BYTES:
            return False
        body = src.nbytes - TAG_BYTES
        if dst.nbytes != body:
            raise ValueError(f"AES-GCM decrypt: output must be {body} bytes, got {dst.nbytes}")
        a = _view(aad) if aad else None
        ctx = self._ctx().ptr
        lib, n = self._lib, ctypes.c_int(0)
        tag = ctypes.create_string_buffer(ctypes.string_at(src.ctypes.data + body, TAG_BYTES), TAG_BYTES)
        ok = False
        try:
            self._init(ctx, bytes(key), bytes(nonce), 0)
            if a is not None:
                self._update(ctx, None, a)
            if body:
                self._update(ctx, dst.ctypes.data, src[:body])
            final = ctypes.create_string_buffer(TAG_BYTES)
            ok = lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_SET_TAG, TAG_BYTES, tag) == 1 and \
                lib.EVP_DecryptFinal_ex(ctx, final, ctypes.byref(n)) == 1
            return ok
        finally:
            if not ok and body:
                ctypes.memset(dst.ctypes.data, 0, body)  # nothing unauthenticated is left


class _Ctx:
    """One EVP_CIPHER_CTX, freed when its thread's local storage goes."""

    __slots__ = ("_free", "ptr")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.ptr = lib.EVP_CIPHER_CTX_new()
        if not self.ptr:
            raise MemoryError("libcrypto: EVP_CIPHER_CTX_new failed")
        self._free = lib.EVP_CIPHER_CTX_free

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._free(ptr)


class CryptographyGcm:
    """AES-256-GCM through ``cryptography``'s AESGCM (holds the GIL in the bulk call):
    the fallback where libcrypto cannot be loaded."""

    name = "cryptography"

    def encrypt_into(self, key: bytes, nonce: bytes, plaintext: Any, aad: bytes | None, out: Any) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        _check(key, nonce)
        AESGCM(bytes(key)).encrypt_into(bytes(nonce), plaintext, aad, out)

    def decrypt_into(self, key: bytes, nonce: bytes, ciphertext: Any, aad: bytes | None, out: Any) -> bool:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        _check(key, nonce)
        dst = _view(out, writable=True)
        if _view(ciphertext).nbytes < TAG_BYTES:
            return False
        try:
            AESGCM(bytes(key)).decrypt_into(bytes(nonce), ciphertext, aad, dst)
        except InvalidTag:
            dst.fill(0)  # (cryptography writes the output before it checks the tag)
            return False
        return True


#: Environment variable choosing the backend: ``libcrypto``, ``cryptography`` or ``auto``
#: (unset: auto).
ENV = "TIERED_KV_AES_GCM"


def _cryptography_openssl() -> int:
    """The OpenSSL version ``cryptography`` is built with (0 if unknown)."""
    try:
        from cryptography.hazmat.backends.openssl import backend as ossl

        return int(ossl.openssl_version_number())
    except Exception:  # noqa: BLE001  (unknown: libcrypto is taken)
        return 0


def load(name: str | None = None, choice: str | None = None) -> GcmBackend:
    """The AES-256-GCM backend ``choice`` asks (default: ``$TIERED_KV_AES_GCM``, else auto):

    - ``libcrypto``: :class:`LibcryptoGcm` over the libcrypto ``name`` (default: the
      system's); where it cannot be loaded (or is older than OpenSSL 1.1),
      :class:`CryptographyGcm`, with one warning;
    - ``cryptography``: :class:`CryptographyGcm`;
    - ``auto``: libcrypto only when its OpenSSL is at least as new as the one
      ``cryptography`` is built with, else cryptography. Why: an older libcrypto can lack
      the newer GCM kernels, and then loses more per core than releasing the GIL wins back
      (measured on the dev machine: the system's OpenSSL 3.0.19 decrypts at about 3 GB/s a
      core, cryptography's bundled 4.0.3 at about 8, so two threads of the former are
      slower than one of the latter; bench/encryption.py prints both).
    """
    choice = (choice or os.environ.get(ENV, "") or "auto").strip().lower()
    if choice not in ("auto", "libcrypto", "cryptography"):
        raise ValueError(f"${ENV}: expected auto, libcrypto or cryptography, got {choice!r}")
    if choice == "cryptography":
        return CryptographyGcm()
    try:
        path = name or ctypes.util.find_library("crypto")
        if path is None:
            raise OSError("no libcrypto found")
        lib = LibcryptoGcm(ctypes.CDLL(path))
    except (OSError, AttributeError) as e:
        log.warning("AES-GCM: libcrypto unavailable (%s); using cryptography's AESGCM, which holds the "
                    "GIL: encrypted reads decrypt on one core at a time", e)
        return CryptographyGcm()
    theirs = _cryptography_openssl()
    if choice == "auto" and lib.version < theirs:
        log.info("AES-GCM: cryptography's AESGCM (its OpenSSL %#x is newer than libcrypto's %#x, whose GCM "
                 "may be slower per core; $%s=libcrypto to use it, the GIL released)", theirs, lib.version, ENV)
        return CryptographyGcm()
    return lib


_backend: GcmBackend | None = None
_lock = threading.Lock()


def backend() -> GcmBackend:
    """The process's AES-256-GCM (loaded on first use)."""
    global _backend
    if _backend is None:
        with _lock:
            if _backend is None:
                _backend = load()
    return _backend
