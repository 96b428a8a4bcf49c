"""Helpers of the storage tests: deterministic keys, payloads and checks."""

from __future__ import annotations

import hashlib

import numpy as np

from tiered_kv.storage import PutItem, RecordKey, RecordKind

FP = "kvl1-test-0123456789abcdef0123"
OTHER_FP = "kvl1-other-0123456789abcdef012"
#: Payload sizes chosen from a key's hash (see payload_size).
SIZES = (0, 1, 4097, 65_536, 130_001)


def make_key(i: int, *, salt: bytes = b"", kind: RecordKind = RecordKind.BLOCK) -> RecordKey:
    return RecordKey(kind, hashlib.sha256(salt + i.to_bytes(8, "little")).digest())


def payload_size(key: RecordKey, sizes: tuple[int, ...] = SIZES) -> int:
    return sizes[key.block_hash[0] % len(sizes)]


def payload_for(key: RecordKey, size: int | None = None) -> np.ndarray:
    """The payload a test stores under ``key``: random bytes seeded by the hash."""
    n = payload_size(key) if size is None else size
    rng = np.random.default_rng(int.from_bytes(key.block_hash[:8], "little"))
    return rng.integers(0, 256, n, dtype=np.uint8)


def digest_for(key: RecordKey) -> bytes:
    return hashlib.sha256(b"tokens" + key.block_hash).digest()


def item_for(key: RecordKey, size: int | None = None, payload: np.ndarray | None = None) -> PutItem:
    return PutItem(key, parent_hash=hashlib.sha256(b"parent" + key.block_hash).digest(),
                   token_digest=digest_for(key), payload=payload_for(key, size) if payload is None else payload)


def verify_all(store, *, sizes: dict[RecordKey, int] | None = None) -> int:
    """Read every record of ``store`` and check it against its deterministic payload.

    Returns the number of records; asserts every one is a hit with the right bytes."""
    keys = list(store)
    outs = [np.empty(payload_size(k) if sizes is None else sizes[k], np.uint8) for k in keys]
    metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
    for key, meta, out in zip(keys, metas, outs):
        assert meta is not None, f"{key!r} listed but not readable"
        np.testing.assert_array_equal(out, payload_for(key, out.nbytes))
    return len(keys)


def row_impls() -> list[str]:
    """The row-read implementations this build has: "python" (get_many with views) and,
    where the extension is built, "native"."""
    from tiered_kv.storage.os import fastread

    return ["python"] + (["native"] if fastread.native_read_verify_rows is not None else [])


def use_row_impl(name: str, monkeypatch) -> str:
    """Make row reads take implementation ``name`` (of :func:`row_impls`) for one test."""
    from tiered_kv.storage.os import fastread

    monkeypatch.setattr(fastread, "read_verify_rows", fastread.native_read_verify_rows if name == "native" else None)
    return name
