"""Keys and sealing of tenant-encrypted records (AES-256-GCM); the store is :mod:`.encrypted`.

A level configured with ``encryption`` stores each payload as an *envelope* inside an
ordinary record (:mod:`.record`, its xxh3 checksum and identity checks unchanged)::

    offset  size  field                 (little-endian)
    ------  ----  --------------------------------------------------------------------
         0     4  magic                 b"TKVE"
         4     1  envelope version      u8, = ENVELOPE_VERSION
         5     3  reserved              zero
         8     8  key tag               blinded key id: keyed BLAKE2b(tenant key, nonce)[:8]
        16    12  nonce                 random, 96 bits, fresh for every record
        28     P  ciphertext            AES-256-GCM of the payload (P bytes)
      28+P    16  GCM tag

The record's ``parent_hash`` and ``token_digest`` header fields hold those values XORed
with a per-record mask (keyed BLAKE2b of the nonce): a bucket reader cannot confirm a
guessed block of tokens from its digest, nor link a record to its parent.

**Keys.** A *master key* is a file of exactly 32 random bytes, readable by its owner
only (``tiered-kv keygen PATH`` writes one). A tenant's keys are derived from it with
HKDF-SHA256 (``info = "tiered_kv/tenant-key/v1" NUL tenant``, 64 bytes): the first 32
are the AES-256-GCM key, the last 32 the *blinding key* of the key tags and masks.

**What the associated data binds.** The record's key (kind and prefix hash), its parent
hash and token digest, the layout fingerprint, the envelope head (magic, version, key
tag) and the tenant. So a ciphertext moved under another key, relabelled, read with
another layout or by another tenant fails its tag.

**Key ids.** :attr:`TenantKeys.key_id` names a master key to operators (stats, CLI):
``SHA-256("tiered_kv/key-id/v1" NUL master)[:8]``; it reveals nothing about the key and
is the same for every tenant and node. It is *not* stored in records: an envelope
carries a key tag instead, which a holder of the tenant's keys recognises (one keyed
hash per key it holds, no trial decryption: rotation needs no guessing) and which looks
random to anyone else, so a bucket reader cannot group records by tenant or by key.

**Nonces.** 96 random bits per record. NIST SP 800-38D bounds random-nonce GCM to
2^32 messages per key (collision probability below 2^-32): :data:`MAX_RECORDS_PER_KEY`
records per (master key, tenant). At 0.5 MB a record that is ~2 PB written per tenant
under one master key; rotate the master key (``key_files=[new, old]`` and ``tiered-kv
rekey``) well before that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import stat
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .record import RecordKey, fingerprint_field

__all__ = [
    "ENVELOPE_MAGIC",
    "ENVELOPE_OVERHEAD",
    "ENVELOPE_VERSION",
    "EncryptionConfig",
    "HEAD_BYTES",
    "KEY_FILE_BYTES",
    "KeyFileError",
    "Keyring",
    "MAX_RECORDS_PER_KEY",
    "TAG_BYTES",
    "TenantKeys",
    "read_key_file",
    "write_key_file",
]

KEY_FILE_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_TAG_BYTES = 8
ENVELOPE_MAGIC = b"TKVE"
ENVELOPE_VERSION = 1
_HEAD = struct.Struct("<4sB3s8s12s")
#: Bytes before the ciphertext: magic, version, reserved, key tag, nonce.
HEAD_BYTES = _HEAD.size  # 28
#: An envelope's size beyond its payload: head + GCM tag.
ENVELOPE_OVERHEAD = HEAD_BYTES + TAG_BYTES  # 44
#: Records sealed under one (master key, tenant) before the random-nonce bound of NIST
#: SP 800-38D (collision probability <= 2^-32) is reached.
MAX_RECORDS_PER_KEY = 2**32
#: Bytes of the masked header fields (parent hash, token digest).
MASK_BYTES = 64

_TENANT_INFO = b"tiered_kv/tenant-key/v1\0"
_KEY_ID_LABEL = b"tiered_kv/key-id/v1\0"
_AAD_LABEL = b"tiered_kv/record/v1\0"
_TAG_PERSON = b"tkv-key-tag"
_MASK_PERSON = b"tkv-header-mask"


class KeyFileError(ValueError):
    """A master key file is missing, has the wrong size, or others may read it."""


# ------------------------------------------------------------------ key files
def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The 32-byte master key in file ``path``.

    The file must be a regular file of exactly 32 bytes that neither its group nor
    others may read or write (mode ``0o600`` or stricter). Raises :class:`KeyFileError`
    naming what is wrong.
    """
    p = Path(os.fspath(path)).expanduser()
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise KeyFileError(f"key file {p}: no such file (expected 32 random bytes; "
                           f"`tiered-kv keygen {p}` writes one)") from None
    except OSError as e:
        raise KeyFileError(f"key file {p}: cannot open it ({e.strerror}); expected a regular file "
                           f"readable by this user") from None
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the path names now
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {p}: expected a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeyFileError(f"key file {p}: mode {mode:04o} lets its group or others access it; "
                               f"expected owner-only (chmod 600 {p})")
        data = os.read(fd, KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_FILE_BYTES:
        got = f"{len(data)} bytes" if len(data) <= KEY_FILE_BYTES else "more"
        raise KeyFileError(f"key file {p}: expected exactly {KEY_FILE_BYTES} random bytes, got {got}")
    return data


def write_key_file(path: str | os.PathLike[str]) -> str:
    """Create ``path`` (mode 0o600, never overwriting) holding 32 fresh random bytes;
    returns the new key's id (hex). FileExistsError if ``path`` exists."""
    p = Path(os.fspath(path)).expanduser()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        key = os.urandom(KEY_FILE_BYTES)
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    return key_id_of(key).hex()


def key_id_of(master: bytes) -> bytes:
    """The public 8-byte id of a master key (see the module docstring)."""
    return hashlib.sha256(_KEY_ID_LABEL + master).digest()[:8]


def tenant_bytes(tenant: str | bytes) -> bytes:
    """A tenant name as the bytes keys are derived from (str: UTF-8)."""
    if isinstance(tenant, str):
        return tenant.encode("utf-8")
    if isinstance(tenant, (bytes, bytearray)):
        return bytes(tenant)
    raise TypeError(f"tenant: expected a str or bytes, got {type(tenant).__name__}")


# ------------------------------------------------------------------ configuration
@dataclass(frozen=True, kw_only=True, slots=True)
class EncryptionConfig:
    """What a store level needs to seal and open records.

    ``key_files``: master key files, the current one first (new writes use it), then
    older ones still accepted for reading. ``tenant``: whose keys (derived from each
    master key); ``None`` until a caller supplies its default (a
    :class:`~tiered_kv.TieredKVCache` uses its ``salt``, the engine adapters their
    ``tenant``); a store cannot be opened with ``None``. ``threads``: threads that
    decrypt and encrypt the records of one call in parallel (default: the CPUs, up
    to 8).
    """

    key_files: tuple[str, ...]
    tenant: str | bytes | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        files = self.key_files
        if isinstance(files, (str, os.PathLike)) or not isinstance(files, Sequence) or not files:
            raise ValueError(f"encryption key_files: expected a non-empty list of key file paths "
                             f"(current key first), got {files!r}")
        object.__setattr__(self, "key_files", tuple(os.fspath(f) for f in files))
        if self.tenant is not None:
            tenant_bytes(self.tenant)
        t = self.threads
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t <= 0):
            raise ValueError(f"encryption threads: expected a positive int or None, got {t!r}")

    @classmethod
    def parse(cls, value: EncryptionConfig | Mapping[str, Any], *, name: str = "encryption") -> EncryptionConfig:
        """An :class:`EncryptionConfig` from itself or a dict ``{"key_files": [...],
        "tenant": ..., "threads": ...}`` (e.g. from a JSON engine config)."""
        if isinstance(value, EncryptionConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"{name}: expected an EncryptionConfig or a dict with key_files (and tenant), "
                            f"got {type(value).__name__}")
        unknown = set(value) - {"key_files", "tenant", "threads"}
        if unknown:
            raise ValueError(f"{name}: unknown keys {sorted(unknown)}; expected key_files, tenant, threads")
        if "key_files" not in value:
            raise ValueError(f"{name}: expected key_files: a list of master key files, current first")
        return cls(key_files=value["key_files"], tenant=value.get("tenant"), threads=value.get("threads"))

    def with_default_tenant(self, tenant: str | bytes) -> EncryptionConfig:
        """This config, with ``tenant`` filled in unless it names one already."""
        if self.tenant is not None:
            return self
        return EncryptionConfig(key_files=self.key_files, tenant=tenant, threads=self.threads)


def default_tenant(options: Mapping[str, Any] | None, tenant: str | bytes) -> dict[str, Any] | None:
    """Store options with every ``encryption`` config (top level and each of
    ``level_options``) given ``tenant`` where it has none (the cache's salt, an adapter's
    tenant). Returns a new dict; ``None`` stays None."""
    if options is None:
        return None
    out = dict(options)
    if out.get("encryption") is not None:
        out["encryption"] = EncryptionConfig.parse(out["encryption"]).with_default_tenant(tenant)
    levels = out.get("level_options")
    if isinstance(levels, (list, tuple)):
        fixed = []
        for lvl in levels:
            if isinstance(lvl, Mapping) and lvl.get("encryption") is not None:
                lvl = {**lvl, "encryption": EncryptionConfig.parse(lvl["encryption"],
                                                                   name="level_options[].encryption")
                       .with_default_tenant(tenant)}
            fixed.append(lvl)
        out["level_options"] = fixed
    return out


# ------------------------------------------------------------------ keys
@dataclass(frozen=True, eq=False, slots=True)
class TenantKeys:
    """One master key's keys for one tenant."""

    key_id: bytes          # public id of the master key (8 bytes)
    source: str            # the key file it came from (for messages)
    aead: Any = field(repr=False)          # AESGCM under the tenant's AES key
    blind_key: bytes = field(repr=False)   # keys the key tags and header masks
    aes_key: bytes = field(repr=False)     # the tenant's AES key (for streamed decryption)

    def key_tag(self, nonce: bytes) -> bytes:
        """The key tag of an envelope with ``nonce``."""
        return hashlib.blake2b(nonce, key=self.blind_key, digest_size=KEY_TAG_BYTES, person=_TAG_PERSON).digest()

    def mask(self, nonce: bytes) -> bytes:
        """The 64-byte mask of the header's parent hash and token digest."""
        return hashlib.blake2b(nonce, key=self.blind_key, digest_size=MASK_BYTES, person=_MASK_PERSON).digest()

    def decryptor(self, nonce: bytes, aad: bytes) -> Any:
        """A streaming AES-256-GCM decryptor of one envelope, its associated data fed:
        ``update_into(ciphertext piece, out piece)`` as the pieces arrive, then
        ``finalize_with_tag(tag)``, which raises InvalidTag unless every byte (and the
        associated data) is authentic. What it wrote before then is not yet authentic."""
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        d = Cipher(algorithms.AES(self.aes_key), modes.GCM(nonce)).decryptor()
        d.authenticate_additional_data(aad)
        return d


def derive_tenant_keys(master: bytes, tenant: str | bytes, *, source: str = "") -> TenantKeys:
    """HKDF-SHA256 of ``master`` for ``tenant`` (see the module docstring)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if not isinstance(master, (bytes, bytearray)) or len(master) != KEY_FILE_BYTES:
        raise ValueError(f"master key: expected {KEY_FILE_BYTES} bytes")
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None,
               info=_TENANT_INFO + tenant_bytes(tenant)).derive(bytes(master))
    return TenantKeys(key_id=key_id_of(bytes(master)), source=source, aead=AESGCM(okm[:32]), blind_key=okm[32:],
                      aes_key=okm[:32])


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


@dataclass(frozen=True, slots=True)
class Opened:
    """An envelope head that names a key of ours: its keys, nonce and the unmasked
    parent hash and token digest (not yet authenticated: the tag decides)."""

    keys: TenantKeys
    nonce: bytes
    parent_hash: bytes
    token_digest: bytes


class Keyring:
    """A tenant's keys under each configured master key: the current one seals, all open.

    Raises :class:`KeyFileError` for a bad key file and ImportError (naming the extra to
    install) without the ``cryptography`` package.
    """

    def __init__(self, config: EncryptionConfig) -> None:
        if config.tenant is None:
            raise ValueError("encryption tenant: expected a str or bytes naming whose keys seal the records "
                             "(TieredKVCache defaults it to its salt; open_store needs it given)")
        if importlib.util.find_spec("cryptography") is None:
            raise ImportError("encryption needs the cryptography package: pip install 'tiered-kv[encryption]'")
        self.config = config
        self._fp_fields: dict[str, bytes] = {}
        self.tenant = tenant_bytes(config.tenant)
        keys: list[TenantKeys] = []
        seen: set[bytes] = set()
        for path in config.key_files:
            k = derive_tenant_keys(read_key_file(path), self.tenant, source=path)
            if k.key_id not in seen:  # the same key given twice is one key
                seen.add(k.key_id)
                keys.append(k)
        self.keys = keys
        self.current = keys[0]

    @property
    def key_ids(self) -> list[str]:
        """The key ids (hex), current first."""
        return [k.key_id.hex() for k in self.keys]

    # ------------------------------------------------------------------ envelopes
    def aad(self, head: bytes, key: RecordKey, parent_hash: bytes, token_digest: bytes,
            layout_fingerprint: str) -> bytes:
        """The associated data of a record (see the module docstring); ``head``: the
        envelope head (its nonce is bound by GCM itself and left out)."""
        fp = self._fp_fields.get(layout_fingerprint)
        if fp is None:
            fp = self._fp_fields[layout_fingerprint] = fingerprint_field(layout_fingerprint)
        return b"".join((_AAD_LABEL, head[:16], bytes((int(key.kind),)), key.block_hash, parent_hash,
                         token_digest, fp, self.tenant))

    def seal_into(self, env: np.ndarray, payload: np.ndarray, *, key: RecordKey, parent_hash: bytes,
                  token_digest: bytes, layout_fingerprint: str) -> tuple[bytes, bytes]:
        """Seal ``payload`` (1-D uint8, P bytes) under the current key into ``env``
        (1-D uint8, P + ENVELOPE_OVERHEAD bytes). Returns the masked (parent hash, token
        digest) the record's header stores."""
        k = self.current
        nonce = os.urandom(NONCE_BYTES)
        head = _HEAD.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, bytes(3), k.key_tag(nonce), nonce)
        env[:HEAD_BYTES] = np.frombuffer(head, np.uint8)
        aad = self.aad(head, key, parent_hash, token_digest, layout_fingerprint)
        k.aead.encrypt_into(nonce, payload, aad, env[HEAD_BYTES:])
        mask = k.mask(nonce)
        return _xor(parent_hash, mask[:32]), _xor(token_digest, mask[32:])

    def identify(self, head: Any, parent_masked: bytes, digest_masked: bytes) -> Opened | None:
        """The key of ours an envelope head names, with its unmasked header fields; None
        when the head is not an envelope or names no key this keyring holds."""
        raw = bytes(head[:HEAD_BYTES])
        if len(raw) != HEAD_BYTES:
            return None
        magic, version, reserved, tag, nonce = _HEAD.unpack(raw)
        if magic != ENVELOPE_MAGIC or version != ENVELOPE_VERSION or reserved != bytes(3):
            return None
        for k in self.keys:
            if k.key_tag(nonce) == tag:
                mask = k.mask(nonce)
                return Opened(k, nonce, _xor(parent_masked, mask[:32]), _xor(digest_masked, mask[32:]))
        return None
