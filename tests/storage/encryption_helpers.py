"""Helpers of the encryption tests: key files, a bucket writer's forgeries, plaintext search."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from storage_helpers import FP
from tiered_kv.storage import RecordKey, encode_record
from tiered_kv.storage.crypto import write_key_file
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


def reencode(raw: bytes, *, key: RecordKey | None = None, payload: bytes | np.ndarray | None = None) -> bytes:
    """What a bucket writer without keys can do: ``raw`` (a stored record) relabelled as
    ``key`` and/or with another payload, under a valid xxh3 checksum."""
    parsed = parse_header(raw, len(raw))
    body = np.frombuffer(raw[HEADER_BYTES:len(raw) - CHECKSUM_BYTES], np.uint8) if payload is None else payload
    return bytes(encode_record(key=key or RecordKey(parsed.kind, parsed.block_hash), parent_hash=parsed.parent_hash,
                               token_digest=parsed.token_digest, layout_fingerprint=FP, payload=body))


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
