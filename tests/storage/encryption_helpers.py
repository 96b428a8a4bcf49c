"""Helpers of the encryption tests: key files, a bucket writer's forgeries, plaintext search."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tiered_kv.storage import EncryptionConfig, RecordKey, encode_record
from tiered_kv.storage.encrypted.crypto import Keyring, write_key_file
from tiered_kv.storage.format.record import CHECKSUM_BYTES, HEADER_BYTES, parse_header


def key_files(tmp_path: Path, *names: str) -> list[str]:
    """Fresh master key files (0o600) under ``tmp_path``, one per name."""
    out = []
    for name in names:
        path = tmp_path / f"{name}.key"
        if not path.exists():
            write_key_file(path)
        out.append(str(path))
    return out


def sealed_name(files: list[str], key: RecordKey, tenant: str = "acme") -> RecordKey:
    """The keyed name ``key``'s record has on a level sealed under ``files[0]`` for
    ``tenant`` (where a bucket writer would have to put a forgery)."""
    return Keyring(EncryptionConfig(key_files=files, tenant=tenant)).current.name(key)


def reencode(raw: bytes, *, key: RecordKey | None = None, payload: bytes | np.ndarray | None = None) -> bytes:
    """What a bucket writer without keys can do: ``raw`` (a stored record) relabelled as
    ``key`` and/or with another payload, under a valid xxh3 checksum."""
    parsed = parse_header(raw, len(raw))
    body = np.frombuffer(raw[HEADER_BYTES:len(raw) - CHECKSUM_BYTES], np.uint8) if payload is None else payload
    return bytes(encode_record(key=key or RecordKey(parsed.kind, parsed.block_hash), parent_hash=parsed.parent_hash,
                               token_digest=parsed.token_digest,
                               layout_fingerprint=parsed.fingerprint.rstrip(b"\0").decode("ascii"), payload=body))


def flip_ciphertext(raw: bytes) -> bytes:
    """``raw`` with one ciphertext byte flipped, under a valid checksum again."""
    body = bytearray(raw[HEADER_BYTES:len(raw) - CHECKSUM_BYTES])
    body[len(body) // 2] ^= 0x01
    return reencode(raw, payload=np.frombuffer(bytes(body), np.uint8))


def leaked_runs(blob: bytes, payloads: list[np.ndarray], run: int = 64) -> int:
    """How many of ``payloads`` have a ``run``-byte stretch that appears in ``blob``.

    Any run-byte match contains an aligned run/2-byte window of the blob: index the
    blob's windows at stride run/2, then slide over every payload position."""
    half = run // 2
    windows = {blob[i:i + half] for i in range(0, len(blob) - half + 1, half)}
    found = 0
    for p in payloads:
        data = p.tobytes()
        for q in range(0, len(data) - half + 1):
            if data[q:q + half] in windows and _contains_run(blob, data, q, run):
                found += 1
                break
    return found


def _contains_run(blob: bytes, data: bytes, q: int, run: int) -> bool:
    """Whether some ``run``-byte stretch of ``data`` around position ``q`` is in ``blob``."""
    lo = max(0, q - run)
    return any(data[s:s + run] in blob for s in range(lo, min(q, len(data) - run) + 1))


def rewrite_lmdb_record(path: Path, name: RecordKey, new_record: bytes) -> None:
    """What an attacker with write access to an LMDB store's disk can do: replace the
    record stored under ``name`` by ``new_record`` (same size, a valid xxh3 checksum:
    see :func:`reencode`) in its segment file, and the index entry's copy of the
    checksum with the new one, so that every check but the tag passes."""
    import lmdb

    from tiered_kv.storage.lmdb import pack_entry, unpack_entry
    from tiered_kv.storage.lmdb.segments import segment_name

    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    try:
        db = env.open_db(b"records")
        with env.begin(write=True) as txn:
            loc, _ = unpack_entry(txn.get(name.to_bytes(), db=db))
            assert loc.length == len(new_record), "a rewrite keeps the record's size"
            seg = path / "segments" / segment_name(loc.segment)
            with open(seg, "r+b") as f:
                f.seek(loc.offset)
                f.write(new_record)
                f.flush()
                os.fsync(f.fileno())
            txn.put(name.to_bytes(), pack_entry(loc, new_record[-CHECKSUM_BYTES:]), db=db)
    finally:
        env.close()


def read_lmdb_record(path: Path, name: RecordKey) -> bytes:
    """The bytes of the record stored under ``name`` in an LMDB store's segment file."""
    import lmdb

    from tiered_kv.storage.lmdb import unpack_entry
    from tiered_kv.storage.lmdb.segments import segment_name

    env = lmdb.open(str(path), max_dbs=4, subdir=True, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            loc, _ = unpack_entry(txn.get(name.to_bytes(), db=env.open_db(b"records", txn=txn, create=False)))
    finally:
        env.close()
    with open(path / "segments" / segment_name(loc.segment), "rb") as f:
        f.seek(loc.offset)
        return f.read(loc.length)


def seal_legacy(master: bytes, tenant: bytes, *, key: RecordKey, parent_hash: bytes, token_digest: bytes,
                layout_fingerprint: str, payload: np.ndarray) -> tuple[bytes, bytes, np.ndarray]:
    """A version-1 envelope, as releases before keyed names wrote them (written from the
    format they documented, independently of storage/crypto.py): AES-256-GCM under the
    first half of HKDF(master, "tiered_kv/tenant-key/v1" NUL tenant), a 96-bit nonce, a
    28-byte head. Returns the masked (parent hash, token digest) and the envelope."""
    import hashlib
    import struct

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    from tiered_kv.storage.format.record import fingerprint_field

    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None,
               info=b"tiered_kv/tenant-key/v1\0" + tenant).derive(master)
    nonce = os.urandom(12)
    tag = hashlib.blake2b(nonce, key=okm[32:], digest_size=8, person=b"tkv-key-tag").digest()
    head = struct.pack("<4sB3s8s12s", b"TKVE", 1, bytes(3), tag, nonce)
    aad = b"".join((b"tiered_kv/record/v1\0", head[:16], bytes((int(key.kind),)), key.block_hash, parent_hash,
                    token_digest, fingerprint_field(layout_fingerprint), tenant))
    body = AESGCM(okm[:32]).encrypt(nonce, bytes(payload), aad)
    mask = hashlib.blake2b(nonce, key=okm[32:], digest_size=64, person=b"tkv-header-mask").digest()

    def xor(a: bytes, b: bytes) -> bytes:
        return bytes(x ^ y for x, y in zip(a, b))

    return xor(parent_hash, mask[:32]), xor(token_digest, mask[32:]), np.frombuffer(head + body, np.uint8)


def write_legacy_level(store, master_file: str, tenant: str, items) -> None:
    """Put ``items`` into ``store`` (a plain, unmarked backend) as an earlier release's
    encrypted level held them: version-1 envelopes under the records' unkeyed keys."""
    from tiered_kv.storage import PutItem

    master = Path(master_file).read_bytes()
    out = []
    for it in items:
        parent, digest, env = seal_legacy(master, tenant.encode(), key=it.key, parent_hash=it.parent_hash,
                                          token_digest=it.token_digest, layout_fingerprint=store.layout_fingerprint,
                                          payload=np.ascontiguousarray(it.payload).view(np.uint8).reshape(-1))
        out.append(PutItem(it.key, parent, digest, env))
    store.put_many(out)
