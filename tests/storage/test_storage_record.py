"""The record format: layout, every check of decode_record, buffers."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from storage_helpers import FP, OTHER_FP, digest_for, make_key, payload_for
from tiered_kv.storage import CorruptRecordError, RecordCheck, RecordKey, RecordKind, decode_record, encode_record
from tiered_kv.storage.os.fastread import digest_parts
from tiered_kv.storage.format.record import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    KEY_BYTES,
    MAGIC,
    PartsVerifier,
    encode_record_into,
    record_parts,
    record_size,
)

KEY = make_key(1)
PARENT = bytes(range(32))


def _record(n: int = 1000, *, key: RecordKey = KEY, fp: str = FP) -> bytearray:
    return encode_record(key=key, parent_hash=PARENT, token_digest=digest_for(key), layout_fingerprint=fp,
                         payload=payload_for(key, n))


def _check(buf: bytes | bytearray, **kw: object) -> RecordCheck:
    with pytest.raises(CorruptRecordError) as e:
        decode_record(buf, expect_key=kw.pop("key", KEY), expect_fingerprint=kw.pop("fp", FP), **kw)  # type: ignore[arg-type]
    assert e.value.check.value in str(e.value)
    return e.value.check


def test_header_layout() -> None:
    rec = _record(1000)
    assert HEADER_BYTES == 144 and len(rec) == record_size(1000) == 144 + 1000 + CHECKSUM_BYTES
    magic, version, kind, flags = struct.unpack_from("<4sHBB", rec)
    assert (magic, version, kind, flags) == (MAGIC, 1, int(RecordKind.BLOCK), 0)
    assert rec[8:40] == FP.encode().ljust(32, b"\0")
    assert rec[40:72] == KEY.block_hash and rec[72:104] == PARENT and rec[104:136] == digest_for(KEY)
    assert struct.unpack_from("<Q", rec, 136)[0] == 1000
    assert bytes(rec[144:1144]) == payload_for(KEY, 1000).tobytes()


def test_roundtrip_and_parts() -> None:
    rec = _record(5000)
    out = np.empty(5000, np.uint8)
    meta = decode_record(rec, expect_key=KEY, expect_fingerprint=FP, expect_token_digest=digest_for(KEY), out=out)
    np.testing.assert_array_equal(out, payload_for(KEY, 5000))
    assert meta.parent_hash == PARENT and meta.payload_bytes == 5000 and meta.record_bytes == len(rec)
    header, body, checksum = record_parts(key=KEY, parent_hash=PARENT, token_digest=digest_for(KEY),
                                          layout_fingerprint=FP, payload=payload_for(KEY, 5000))
    assert header + body.tobytes() + checksum == bytes(rec)
    big = bytearray(len(rec) + 10)
    assert encode_record_into(big, key=KEY, parent_hash=PARENT, token_digest=digest_for(KEY),
                              layout_fingerprint=FP, payload=payload_for(KEY, 5000)) == len(rec)
    assert big[:len(rec)] == rec
    assert decode_record(rec, expect_key=KEY, expect_fingerprint=FP).payload_bytes == 5000  # no out


@pytest.mark.parametrize("out", [bytearray(64), np.empty(64, np.uint8), np.empty(16, np.float32),
                                 torch.empty(64, dtype=torch.uint8), torch.empty(32, dtype=torch.float16)],
                         ids=["bytearray", "numpy", "numpy_f32", "torch", "torch_f16"])
def test_out_buffers(out: object) -> None:
    decode_record(_record(64), expect_key=KEY, expect_fingerprint=FP, out=out)
    raw = out.view(torch.uint8).numpy() if isinstance(out, torch.Tensor) else np.asarray(memoryview(out)).view(np.uint8)
    np.testing.assert_array_equal(raw.reshape(-1), payload_for(KEY, 64))


def test_out_wrong_size_is_value_error_not_corruption() -> None:
    with pytest.raises(ValueError, match="out: expected 64 bytes") as e:
        decode_record(_record(64), expect_key=KEY, expect_fingerprint=FP, out=bytearray(63))
    assert not isinstance(e.value, CorruptRecordError)


@pytest.mark.parametrize("offset,check", [
    (0, RecordCheck.MAGIC), (3, RecordCheck.MAGIC), (4, RecordCheck.VERSION), (6, RecordCheck.KIND),
    (7, RecordCheck.FLAGS), (8, RecordCheck.CHECKSUM), (39, RecordCheck.CHECKSUM), (40, RecordCheck.CHECKSUM),
    (100, RecordCheck.CHECKSUM), (130, RecordCheck.CHECKSUM), (136, RecordCheck.TRAILING_BYTES),
    (137, RecordCheck.TRUNCATED),
    (143, RecordCheck.TRUNCATED), (144, RecordCheck.CHECKSUM), (600, RecordCheck.CHECKSUM),
    (-16, RecordCheck.CHECKSUM), (-1, RecordCheck.CHECKSUM),
])
def test_bit_flip_names_the_check(offset: int, check: RecordCheck) -> None:
    rec = _record(1000)
    rec[offset] ^= 0x80
    assert _check(rec) is check


def test_payload_length_smaller_is_trailing_bytes() -> None:
    rec = _record(1000)
    struct.pack_into("<Q", rec, 136, 999)
    assert _check(rec) is RecordCheck.TRAILING_BYTES


def test_length_checks() -> None:
    rec = bytes(_record(1000))
    assert _check(b"") is RecordCheck.TRUNCATED
    assert _check(rec[:HEADER_BYTES - 1]) is RecordCheck.TRUNCATED
    assert _check(rec[:HEADER_BYTES + CHECKSUM_BYTES]) is RecordCheck.TRUNCATED
    assert _check(rec[:-1]) is RecordCheck.TRUNCATED
    assert _check(rec + b"\0") is RecordCheck.TRAILING_BYTES
    huge = bytearray(rec)
    struct.pack_into("<Q", huge, 136, 2**64 - 1)  # never allocates or reads past the buffer
    assert _check(huge) is RecordCheck.TRUNCATED


def test_identity_checks() -> None:
    assert _check(_record(10, fp=OTHER_FP)) is RecordCheck.FINGERPRINT
    assert _check(_record(10), key=make_key(2)) is RecordCheck.KEY
    assert _check(_record(10), key=make_key(1, kind=RecordKind.SNAPSHOT)) is RecordCheck.KEY
    assert _check(_record(10), expect_token_digest=digest_for(make_key(2))) is RecordCheck.TOKEN_DIGEST
    out = np.zeros(10, np.uint8)
    _check(_record(10), key=make_key(2), out=out)
    assert not out.any(), "out must not be written when a check fails"


def test_fingerprint_field() -> None:
    with pytest.raises(ValueError, match="at most 32"):
        _record(10, fp="x" * 33)
    with pytest.raises(ValueError, match="ascii"):
        _record(10, fp="kvl1-é")
    _record(10, fp="y" * 32)


def test_record_key() -> None:
    key = make_key(3, kind=RecordKind.SNAPSHOT)
    raw = key.to_bytes()
    assert len(raw) == KEY_BYTES and raw[0] == 2 and RecordKey.from_bytes(raw) == key
    with pytest.raises(ValueError, match="expected 33 bytes"):
        RecordKey.from_bytes(raw[:-1])
    with pytest.raises(ValueError, match="kind byte"):
        RecordKey.from_bytes(b"\x07" + raw[1:])
    with pytest.raises(ValueError, match="kind"):
        RecordKey(1, bytes(32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="32 bytes"):
        RecordKey(RecordKind.BLOCK, bytes(31))


def test_payload_must_be_contiguous() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        _record_from(np.arange(100, dtype=np.uint8)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        _record_from(torch.arange(100, dtype=torch.uint8)[::2])


def _record_from(payload: object) -> bytearray:
    return encode_record(key=KEY, parent_hash=PARENT, token_digest=PARENT, layout_fingerprint=FP, payload=payload)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_no_damaged_record_decodes(data: st.DataObject) -> None:
    """Any change of the bytes (mutation, truncation, extension) fails a check."""
    n = data.draw(st.integers(0, 300))
    rec = bytes(_record(n))
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(rec) - 1))
        bad = bytearray(rec)
        bad[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        bad = bytearray(rec[: data.draw(st.integers(0, len(rec) - 1))])
    elif how == "extend":
        bad = bytearray(rec + data.draw(st.binary(min_size=1, max_size=40)))
    else:
        i = data.draw(st.integers(0, len(rec) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=64))
        bad = bytearray(rec[:i] + chunk + rec[i + len(chunk):])
        if bytes(bad) == rec:
            return
    with pytest.raises(CorruptRecordError):
        decode_record(bad, expect_key=KEY, expect_fingerprint=FP)


def _parts_verdict(rec: bytes, **kw: object) -> tuple[object, object]:
    """(decode_record's meta or the check it failed, PartsVerifier's meta or None) of ``rec``
    read in parts: header, payload in three pieces, checksum."""
    key, fp, digest = kw.get("key", KEY), kw.get("fp", FP), kw.get("digest", digest_for(KEY))
    try:
        slow: object = decode_record(rec, expect_key=key, expect_fingerprint=fp, expect_token_digest=digest)
    except CorruptRecordError as e:
        slow = e.check
    body = np.frombuffer(rec, np.uint8)[HEADER_BYTES:len(rec) - CHECKSUM_BYTES]
    pieces = [body[:7], body[7:400], body[400:]]
    computed = digest_parts([rec[:HEADER_BYTES], *pieces])
    fast = PartsVerifier(fp).verify(bytes(rec[:HEADER_BYTES]), computed, rec[len(rec) - CHECKSUM_BYTES:], key=key,
                                    record_bytes=len(rec), checksum=kw.get("checksum"), token_digest=digest)
    return slow, fast


def test_parts_verifier_accepts_what_decode_record_accepts() -> None:
    rec = bytes(_record(1000))
    slow, fast = _parts_verdict(rec)
    assert fast == slow  # the same RecordMeta
    assert _parts_verdict(rec, digest=None)[1] == slow
    assert _parts_verdict(rec, checksum=rec[-CHECKSUM_BYTES:])[1] == slow
    assert isinstance(fast.parent_hash, bytes) and isinstance(fast.token_digest, bytes)


@settings(max_examples=150, deadline=None)
@given(pos=st.integers(0, record_size(1000) - 1), bit=st.integers(0, 7))
def test_parts_verifier_rejects_every_flipped_bit(pos: int, bit: int) -> None:
    """Any single bit flipped anywhere in the record: both checks reject it (the parent
    hash is covered by the checksum only)."""
    rec = bytearray(_record(1000))
    rec[pos] ^= 1 << bit
    slow, fast = _parts_verdict(bytes(rec))
    assert isinstance(slow, RecordCheck) and fast is None


@pytest.mark.parametrize("case", ["other_key", "other_kind", "other_fp", "other_digest", "index_checksum",
                                  "short", "long"])
def test_parts_verifier_rejects_what_decode_record_rejects(case: str) -> None:
    rec = bytes(_record(1000))
    kw: dict[str, object] = {}
    if case == "other_key":
        kw["key"] = make_key(2)
    elif case == "other_kind":
        kw["key"] = RecordKey.snapshot(KEY.block_hash)
    elif case == "other_fp":
        kw["fp"] = OTHER_FP
    elif case == "other_digest":
        kw["digest"] = bytes(32)
    elif case == "index_checksum":  # the record verifies, but the index holds another checksum
        kw["checksum"] = bytes(CHECKSUM_BYTES)
    elif case == "short":
        rec = rec[:-1]
    else:
        rec = rec + b"\0"
    slow, fast = _parts_verdict(rec, **kw)
    assert fast is None
    assert case == "index_checksum" or isinstance(slow, RecordCheck)
