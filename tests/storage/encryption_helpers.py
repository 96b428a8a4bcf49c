"""Helpers of the encryption tests: key files, a bucket writer's forgeries, plaintext search."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from tiered_kv.storage import EncryptionConfig, RecordKey, encode_record
from tiered_kv.storage.crypto import Keyring, write_key_file
from tiered_kv.storage.record import CHECKSUM_BYTES, HEADER_BYTES, parse_header


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

    from tiered_kv.storage.lmdb_store import pack_entry, unpack_entry
    from tiered_kv.storage.segments import segment_name

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

    from tiered_kv.storage.lmdb_store import unpack_entry
    from tiered_kv.storage.segments import segment_name

    env = lmdb.open(str(path), max_dbs=4, subdir=True, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            loc, _ = unpack_entry(txn.get(name.to_bytes(), db=env.open_db(b"records", txn=txn, create=False)))
    finally:
        env.close()
    with open(path / "segments" / segment_name(loc.segment), "rb") as f:
        f.seek(loc.offset)
        return f.read(loc.length)
