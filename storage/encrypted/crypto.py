"""Keys, key files and envelopes of tenant-encrypted records; the store is :mod:`.encrypted`.

A level configured with ``encryption`` stores each payload as an *envelope* inside an
ordinary record (:mod:`.record`: its header, xxh3 checksum and identity checks
unchanged), under a *keyed name* (:mod:`.names`) instead of the record's key::

    offset  size  field                 (little-endian)
    ------  ----  --------------------------------------------------------------------
         0     4  magic                 b"TKVE"
         4     1  envelope version      u8, = ENVELOPE_VERSION (2)
         5     3  reserved              zero
         8     8  key tag               keyed BLAKE2b(blinding key, nonce)[:8]
        16    24  nonce                 random, 192 bits, fresh for every envelope
        40     P  ciphertext            XAES-256-GCM of the payload (P bytes, :mod:`.xaes`)
      40+P    16  GCM tag

The record header's key field holds the keyed name, and its ``parent_hash`` and
``token_digest`` fields hold those values XORed with a per-envelope mask (keyed BLAKE2b
of the nonce): a bucket reader learns no prefix hash (not from the name, the parent link
or the digest) and cannot confirm a guessed block of tokens.

**Keys.** A *master key* is a file of exactly 32 random bytes (``tiered-kv keygen PATH``).
A tenant's *secret* is HKDF-SHA256 of it (``info = "tiered_kv/tenant-key/v1" NUL
tenant``, 64 bytes), and the tenant's keys are HKDF-SHA256 of the secret (``info =
"tiered_kv/tenant-keys/v2" NUL``, 96 bytes): the XAES-256-GCM key, the name key
(:mod:`.names`), and the *blinding key* of the key tags and masks. A *tenant key file*
(``tiered-kv keygen --tenant T --from MASTER PATH``) holds one tenant's secret and name,
not the master key: a node given it serves that tenant and can derive no other's keys.
Key files (their formats and checks) are :mod:`.key_files`.

**What the associated data binds** (each field of fixed width, the tenant
length-prefixed): the envelope head (magic, version, key tag; the nonce is bound by GCM
itself), the record's kind and *real* block hash (so the object's name, a permutation of
it under the key, is bound too), its parent hash and token digest, the layout
fingerprint and the tenant. So a ciphertext moved under another name or key, relabelled,
read with another layout or by another tenant fails its tag.

**Key ids.** :attr:`TenantKeys.key_id` names a master key to operators (stats, CLI):
``SHA-256("tiered_kv/key-id/v1" NUL master)[:8]``; it reveals nothing about the key, is
the same for every tenant and node, and a tenant key file carries its master's. It is
*not* stored in records: an envelope carries a key tag instead, which a holder of the
tenant's keys recognises (one keyed hash per key it holds) and which looks random to
anyone else, so a bucket reader cannot group records by tenant or by key.

**Nonces.** 192 random bits per envelope, XAES-256-GCM (:mod:`.xaes`): a subkey per
nonce, so no realistic volume of seals approaches a bound (after 2^48 envelopes under
one tenant key the chance of any repeated subkey and nonce pair is below 2^-96). Seals
cannot be counted across a fleet (many nodes seal, uploads are retried, promotions and
rekey seal again), so the bound is made unreachable rather than counted.

**Version 1** envelopes (earlier releases: 96-bit nonces, AES-256-GCM under the tenant
secret's first 32 bytes, records named by their unkeyed key) are only ever opened by
``rekey``, which moves them to version 2 under keyed names (see :mod:`.encrypted`).
"""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .key_files import (
    KEY_FILE_BYTES,
    SECRET_BYTES,
    KeyFile,
    KeyFileError,
    load_key_file,
    read_key_file,
    tenant_bytes,
    write_key_file,
    write_tenant_key_file,
)
from . import gcm
from .names import KeyedNames
from ..format.record import FINGERPRINT_BYTES, RecordKey, fingerprint_field
from .xaes import Xaes256Gcm

__all__ = [
    "ENVELOPE_MAGIC",
    "ENVELOPE_OVERHEAD",
    "ENVELOPE_VERSION",
    "EncryptionConfig",
    "HEAD_BYTES",
    "KEY_FILE_BYTES",
    "KeyFile",
    "KeyFileError",
    "Keyring",
    "LEGACY_ENVELOPE_OVERHEAD",
    "TAG_BYTES",
    "TenantKeys",
    "load_key_file",
    "read_key_file",
    "tenant_bytes",
    "write_key_file",
    "write_tenant_key_file",
]

TAG_BYTES = 16
KEY_TAG_BYTES = 8
ENVELOPE_MAGIC = b"TKVE"
ENVELOPE_VERSION = 2
NONCE_BYTES = 24
_HEAD = struct.Struct("<4sB3s8s24s")
#: Bytes before the ciphertext: magic, version, reserved, key tag, nonce.
HEAD_BYTES = _HEAD.size  # 40
#: An envelope's size beyond its payload: head + GCM tag.
ENVELOPE_OVERHEAD = HEAD_BYTES + TAG_BYTES  # 56
#: Version 1 (earlier releases): a 96-bit nonce; read only by rekey, to migrate.
LEGACY_ENVELOPE_VERSION = 1
_LEGACY_HEAD = struct.Struct("<4sB3s8s12s")
LEGACY_HEAD_BYTES = _LEGACY_HEAD.size  # 28
LEGACY_ENVELOPE_OVERHEAD = LEGACY_HEAD_BYTES + TAG_BYTES  # 44
#: Bytes of the masked header fields (parent hash, token digest).
MASK_BYTES = 64
#: Names a tenant key keeps computed (about 200 bytes each).
_NAME_CACHE = 1 << 16
_KEYS_INFO = b"tiered_kv/tenant-keys/v2\0"
_AAD_LABEL = b"tiered_kv/record/v2\0"
_LEGACY_AAD_LABEL = b"tiered_kv/record/v1\0"
_TAG_PERSON = b"tkv-key-tag-v2"
_MASK_PERSON = b"tkv-mask-v2"
_LEGACY_TAG_PERSON = b"tkv-key-tag"
_LEGACY_MASK_PERSON = b"tkv-header-mask"

# ------------------------------------------------------------------ configuration
@dataclass(frozen=True, kw_only=True, slots=True)
class EncryptionConfig:
    """What a store level needs to seal and open records.

    ``key_files``: key files (master keys or tenant key files), the current one first
    (new writes use it), then older ones still accepted for reading. ``tenant``: whose
    keys (derived from each master key); ``None`` until a caller supplies its default
    (a :class:`~tiered_kv.TieredKVCache` uses its ``salt``, the engine adapters their
    ``tenant``), or taken from tenant key files; a store cannot be opened with neither.
    ``threads``: threads that decrypt and encrypt the records of one call in parallel
    (default: the CPUs, up to 8). ``default_tenant``: the tenant when neither ``tenant``
    nor a tenant key file names one (set by :meth:`with_default_tenant`).
    """

    key_files: tuple[str, ...]
    tenant: str | bytes | None = None
    threads: int | None = None
    default_tenant: str | bytes | None = None

    def __post_init__(self) -> None:
        files = self.key_files
        if isinstance(files, (str, os.PathLike)) or not isinstance(files, Sequence) or not files:
            raise ValueError(f"encryption key_files: expected a non-empty list of key file paths "
                             f"(current key first), got {files!r}")
        object.__setattr__(self, "key_files", tuple(os.fspath(f) for f in files))
        for name in ("tenant", "default_tenant"):
            if getattr(self, name) is not None:
                tenant_bytes(getattr(self, name))
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
        """This config, with ``tenant`` the default: used unless it names one, or a tenant
        key file among its key files does (which then serves its own tenant)."""
        if self.tenant is not None:
            return self
        return EncryptionConfig(key_files=self.key_files, threads=self.threads, default_tenant=tenant)


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
    """One master key's keys for one tenant (see the module docstring)."""

    key_id: bytes          # public id of the master key (8 bytes)
    source: str            # the key file it came from (for messages)
    xaes: Xaes256Gcm = field(repr=False)        # seals and opens envelopes
    names: KeyedNames = field(repr=False)       # keyed object names
    blind_key: bytes = field(repr=False)        # keys the key tags and header masks
    legacy_aead: Any = field(repr=False)        # version-1 envelopes (AES-256-GCM), for rekey
    legacy_key: bytes = field(repr=False)
    legacy_blind: bytes = field(repr=False)
    #: names computed lately (a hot prefix is looked up again and again): key -> name
    _names: dict[RecordKey, RecordKey] = field(default_factory=dict, repr=False)
    #: keyed BLAKE2b states of the key tag and the mask, copied per envelope (the key block
    #: is absorbed once, not per call)
    _tag_state: Any = field(default=None, repr=False)
    _mask_state: Any = field(default=None, repr=False)

    @classmethod
    def of(cls, secret: bytes, *, key_id: bytes, source: str = "") -> TenantKeys:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        if len(secret) != SECRET_BYTES:
            raise ValueError(f"tenant secret: expected {SECRET_BYTES} bytes")
        okm = HKDF(algorithm=hashes.SHA256(), length=96, salt=None, info=_KEYS_INFO).derive(bytes(secret))
        blind = okm[64:]
        return cls(key_id=key_id, source=source, xaes=Xaes256Gcm(okm[:32]), names=KeyedNames(okm[32:64]),
                   blind_key=blind, legacy_aead=AESGCM(secret[:32]), legacy_key=bytes(secret[:32]),
                   legacy_blind=bytes(secret[32:]),
                   _tag_state=hashlib.blake2b(key=blind, digest_size=KEY_TAG_BYTES, person=_TAG_PERSON),
                   _mask_state=hashlib.blake2b(key=blind, digest_size=MASK_BYTES, person=_MASK_PERSON))

    def key_tag(self, nonce: bytes) -> bytes:
        """The key tag of an envelope with ``nonce``: BLAKE2b-64 keyed by the blinding key."""
        h = self._tag_state.copy()
        h.update(nonce)
        return h.digest()

    def mask(self, nonce: bytes) -> bytes:
        """The 64-byte mask of the header's parent hash and token digest: BLAKE2b-512
        keyed by the blinding key."""
        h = self._mask_state.copy()
        h.update(nonce)
        return h.digest()

    def legacy_key_tag(self, nonce: bytes) -> bytes:
        return hashlib.blake2b(nonce, key=self.legacy_blind, digest_size=KEY_TAG_BYTES,
                               person=_LEGACY_TAG_PERSON).digest()

    def legacy_mask(self, nonce: bytes) -> bytes:
        return hashlib.blake2b(nonce, key=self.legacy_blind, digest_size=MASK_BYTES,
                               person=_LEGACY_MASK_PERSON).digest()

    def name(self, key: RecordKey) -> RecordKey:
        """The keyed name ``key``'s record is stored under with these keys (the last
        :data:`_NAME_CACHE` computed are kept: a dict lookup instead of four rounds)."""
        name = self._names.get(key)
        if name is None:
            name = RecordKey(key.kind, self.names.name(int(key.kind), key.block_hash))
            if len(self._names) >= _NAME_CACHE:
                self._names.clear()
            self._names[key] = name
        return name

    def key_of(self, name: RecordKey) -> RecordKey:
        """The record key whose name under these keys is ``name``."""
        return RecordKey(name.kind, self.names.key_of(int(name.kind), name.block_hash))


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


@dataclass(frozen=True, slots=True)
class Opened:
    """An envelope head that names a key of ours: its keys (``gen``: their index in the
    keyring, 0 = current), envelope ``version``, nonce, head bytes and the unmasked
    parent hash and token digest (not yet authenticated: the tag decides)."""

    keys: TenantKeys
    gen: int
    version: int
    nonce: bytes
    head: bytes
    parent_hash: bytes
    token_digest: bytes

    @property
    def head_bytes(self) -> int:
        return len(self.head)

    @property
    def overhead(self) -> int:
        return self.head_bytes + TAG_BYTES


def envelope_version(head: Any) -> int | None:
    """The version of an envelope whose first bytes are ``head`` (None: not an envelope)."""
    raw = bytes(head[:5])
    if len(raw) < 5 or raw[:4] != ENVELOPE_MAGIC:
        return None
    return raw[4]


class Keyring:
    """A tenant's keys under each configured key file: the current one seals, all open.

    Raises :class:`KeyFileError` for a bad key file (or one that cannot serve the tenant)
    and ImportError (naming the extra to install) without the ``cryptography`` package.
    """

    def __init__(self, config: EncryptionConfig) -> None:
        if importlib.util.find_spec("cryptography") is None:
            raise ImportError("encryption needs the cryptography package: pip install 'tiered-kv[encryption]'")
        files = [load_key_file(path) for path in config.key_files]
        self.config = config
        self.tenant = self._tenant(config, files)
        self._fp_fields: dict[str, bytes] = {}
        keys: list[TenantKeys] = []
        seen: set[bytes] = set()
        for f in files:
            if f.key_id not in seen:  # the same key given twice is one key
                seen.add(f.key_id)
                keys.append(TenantKeys.of(f.tenant_secret(self.tenant), key_id=f.key_id, source=f.source))
        self.keys = keys
        self.current = keys[0]

    @staticmethod
    def _tenant(config: EncryptionConfig, files: list[KeyFile]) -> bytes:
        """The tenant given, else the one the tenant key files name (they must agree), else
        the default (a cache's salt)."""
        named = {f.tenant for f in files if f.tenant is not None}
        if config.tenant is not None:
            return tenant_bytes(config.tenant)  # (a tenant file of another tenant raises when used)
        if len(named) == 1:
            return named.pop()
        if len(named) > 1:
            raise KeyFileError(f"key files {list(config.key_files)}: tenant key files of different tenants; "
                               f"expected one tenant")
        if config.default_tenant is not None:
            return tenant_bytes(config.default_tenant)
        raise ValueError("encryption tenant: expected a str or bytes naming whose keys seal the records "
                         "(TieredKVCache defaults it to its salt; open_store needs it given, or a tenant key "
                         "file that names it)")

    @property
    def key_ids(self) -> list[str]:
        """The key ids (hex), current first."""
        return [k.key_id.hex() for k in self.keys]

    def _fp(self, layout_fingerprint: str) -> bytes:
        fp = self._fp_fields.get(layout_fingerprint)
        if fp is None:
            fp = self._fp_fields[layout_fingerprint] = fingerprint_field(layout_fingerprint)
        return fp

    # ------------------------------------------------------------------ envelopes
    def aad(self, opened: Opened, key: RecordKey, layout_fingerprint: str) -> bytes:
        """The associated data of the envelope ``opened`` names, as record ``key`` (the
        real key, not its name); see the module docstring."""
        return self._aad(opened.version, opened.head, key, opened.parent_hash, opened.token_digest,
                         self._fp(layout_fingerprint))

    def _aad(self, version: int, head: bytes, key: RecordKey, parent_hash: bytes, token_digest: bytes,
             fp: bytes) -> bytes:
        head16, h = bytes(head[:16]), key.block_hash
        for what, value, width in (("envelope head", head16, 16), ("block hash", h, 32),
                                   ("parent hash", parent_hash, 32), ("token digest", token_digest, 32),
                                   ("layout fingerprint", fp, FINGERPRINT_BYTES)):
            if len(value) != width:
                raise ValueError(f"associated data: {what}: expected {width} bytes, got {len(value)}")
        kind = bytes((int(key.kind),))
        if version == LEGACY_ENVELOPE_VERSION:
            return b"".join((_LEGACY_AAD_LABEL, head16, kind, h, parent_hash, token_digest, fp, self.tenant))
        return b"".join((_AAD_LABEL, head16, kind, h, parent_hash, token_digest, fp,
                         struct.pack("<H", len(self.tenant)), self.tenant))

    def seal_into(self, env: np.ndarray, payload: np.ndarray, *, key: RecordKey, parent_hash: bytes,
                  token_digest: bytes, layout_fingerprint: str) -> tuple[bytes, bytes]:
        """Seal ``payload`` (1-D uint8, P bytes) under the current key into ``env``
        (1-D uint8, P + ENVELOPE_OVERHEAD bytes) as the record of ``key`` (its real key).
        Returns the masked (parent hash, token digest) the record's header stores."""
        k = self.current
        nonce = os.urandom(NONCE_BYTES)
        head = _HEAD.pack(ENVELOPE_MAGIC, ENVELOPE_VERSION, bytes(3), k.key_tag(nonce), nonce)
        env[:HEAD_BYTES] = np.frombuffer(head, np.uint8)
        aad = self._aad(ENVELOPE_VERSION, head, key, parent_hash, token_digest, self._fp(layout_fingerprint))
        k.xaes.seal_into(nonce, payload, aad, env[HEAD_BYTES:])
        mask = k.mask(nonce)
        return _xor(parent_hash, mask[:32]), _xor(token_digest, mask[32:])

    def identify(self, head: Any, parent_masked: bytes, digest_masked: bytes) -> Opened | None:
        """The key of ours an envelope head names, with its unmasked header fields; None
        when the head is not an envelope or names no key this keyring holds. Version-1
        heads are recognised too (``version`` says which)."""
        version = envelope_version(head)
        if version == ENVELOPE_VERSION:
            raw = bytes(head[:HEAD_BYTES])
            if len(raw) != HEAD_BYTES:
                return None
            _, _, reserved, tag, nonce = _HEAD.unpack(raw)
            if reserved != bytes(3):
                return None
            for gen, k in enumerate(self.keys):
                if hmac.compare_digest(k.key_tag(nonce), tag):
                    mask = k.mask(nonce)
                    return Opened(k, gen, version, nonce, raw, _xor(parent_masked, mask[:32]),
                                  _xor(digest_masked, mask[32:]))
            return None
        if version == LEGACY_ENVELOPE_VERSION:
            raw = bytes(head[:LEGACY_HEAD_BYTES])
            if len(raw) != LEGACY_HEAD_BYTES:
                return None
            _, _, reserved, tag, nonce = _LEGACY_HEAD.unpack(raw)
            if reserved != bytes(3):
                return None
            for gen, k in enumerate(self.keys):
                if hmac.compare_digest(k.legacy_key_tag(nonce), tag):
                    mask = k.legacy_mask(nonce)
                    return Opened(k, gen, version, nonce, raw, _xor(parent_masked, mask[:32]),
                                  _xor(digest_masked, mask[32:]))
        return None

    @staticmethod
    def open_into(opened: Opened, ciphertext: Any, aad: bytes, out: Any) -> bool:
        """Decrypt ``ciphertext`` (with its tag) into ``out``; False when the tag fails, and
        ``out`` is then zeroed. The bulk AES-GCM is :func:`.gcm.backend`'s: libcrypto through
        ctypes (the GIL released, reader threads in parallel) where the system OpenSSL is not
        older than ``cryptography``'s, else ``cryptography`` (holds the GIL)."""
        if opened.version == LEGACY_ENVELOPE_VERSION:
            return gcm.backend().decrypt_into(opened.keys.legacy_key, opened.nonce, ciphertext, aad, out)
        return opened.keys.xaes.open_into(opened.nonce, ciphertext, aad, out)

    @staticmethod
    def decryptor(opened: Opened, aad: bytes) -> Any:
        """A streaming decryptor of one envelope, its associated data fed:
        ``update_into(ciphertext piece, out piece)`` as the pieces arrive, then
        ``finalize_with_tag(tag)``, which raises InvalidTag unless every byte (and the
        associated data) is authentic. What it wrote before then is not yet authentic."""
        if opened.version == LEGACY_ENVELOPE_VERSION:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

            d = Cipher(algorithms.AES(opened.keys.legacy_key), modes.GCM(opened.nonce)).decryptor()
            d.authenticate_additional_data(aad)
            return d
        return opened.keys.xaes.decryptor(opened.nonce, aad)
