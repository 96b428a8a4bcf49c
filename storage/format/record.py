"""The on-disk record: one immutable block or state snapshot, self-describing and verified.

One record is one contiguous byte string; every backend stores it unchanged::

    offset  size  field                 (little-endian)
    ------  ----  --------------------------------------------------------------------
         0     4  magic                 b"TKVR"
         4     2  format version        u16, = FORMAT_VERSION
         6     1  record kind           u8, RecordKind (1 block, 2 snapshot)
         7     1  flags                 u8, must be 0 (reserved)
         8    32  layout fingerprint    ascii, zero-padded (KVLayout.fingerprint)
        40    32  block hash            the chained prefix hash this record is keyed by
        72    32  parent hash           the previous block's hash (h_{i-1})
       104    32  token digest          prefix.token_digest(this block's token ids)
       136     8  payload length        u64, = P
       144     P  payload               the block / snapshot bytes
     144+P    16  checksum              xxh3-128 of bytes [0, 144+P), canonical (big-endian)

The payload starts at a 16-byte-aligned offset. Decoding checks, in this order: length
(header present, payload within the buffer), magic, version, kind, flags, no trailing
bytes, checksum, then the identity fields against what the caller expects (fingerprint,
key, token digest). :func:`decode_record` checks a record held in one buffer (e.g. LMDB's
zero-copy view); :func:`parse_header` + :func:`verify_record_parts` check one read in
parts, e.g. a file streamed straight into the caller's buffer. Any failure raises :class:`CorruptRecordError` naming the check;
nothing stored is ever executed or unpickled: the payload is copied as raw bytes.

Buffers: a *payload* may be any C-contiguous bytes-like object, numpy array or CPU torch
tensor (its bytes are taken as they are), or a list or tuple of them: the pieces of one
payload, in order (e.g. a page spread over a host pool's per-layer buffers: written with
no join copy, see :func:`encode_record_into`). An *out* buffer for a read is a writable
C-contiguous bytearray, memoryview, numpy array or CPU torch tensor (pinned or not) whose
size in bytes equals the payload length, or a *scatter list*: a list or tuple of such
buffers whose sizes add up to the payload length, filled in order (e.g. the rows of a
pool a block's parts live in: the payload lands there with no staging copy).
"""

from __future__ import annotations

import enum
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptRecordError, RecordCheck

__all__ = [
    "CHECKSUM_BYTES",
    "FINGERPRINT_BYTES",
    "FORMAT_VERSION",
    "HASH_BYTES",
    "HEADER_BYTES",
    "HEADER_FIELDS",
    "HEADER_LAYOUT",
    "EXPECT_UNHASHED",
    "HEADER_OFFSETS",
    "KEY_BYTES",
    "MAGIC",
    "RecordHeader",
    "RecordKey",
    "RecordKind",
    "RecordMeta",
    "as_byte_array",
    "OutSegments",
    "PartsVerifier",
    "as_out_segments",
    "check_identity",
    "decode_record",
    "encode_record",
    "encode_record_into",
    "fingerprint_field",
    "parse_header",
    "payload_views",
    "record_parts",
    "record_size",
    "verify_record_parts",
    "write_segments",
]

MAGIC = b"TKVR"
FORMAT_VERSION = 1
#: Bytes of every hash a record holds: its key's prefix hash, the parent hash and the token
#: digest (256-bit hashes; the cache's prefix hasher, tiered_kv.prefix, makes them this wide).
HASH_BYTES = 32
FINGERPRINT_BYTES = 32
CHECKSUM_BYTES = 16
#: The record header, field by field in file order (name, struct code, little-endian): its
#: one definition. The struct, the offsets below and the native reader's constants (checked
#: against :data:`HEADER_LAYOUT` when it loads, :mod:`~tiered_kv.storage.os.fastread`) all
#: come from it.
HEADER_FIELDS = (("magic", "4s"), ("version", "H"), ("kind", "B"), ("flags", "B"),
                 ("fingerprint", f"{FINGERPRINT_BYTES}s"), ("block_hash", f"{HASH_BYTES}s"),
                 ("parent_hash", f"{HASH_BYTES}s"), ("token_digest", f"{HASH_BYTES}s"), ("payload_length", "Q"))
_HEADER = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS))
HEADER_BYTES = _HEADER.size  # 144
#: Byte offset of each header field.
HEADER_OFFSETS = {name: struct.calcsize("<" + "".join(code for _, code in HEADER_FIELDS[:i]))
                  for i, (name, _) in enumerate(HEADER_FIELDS)}
#: Bytes of :meth:`RecordKey.to_bytes`: 1 kind byte + the 32-byte hash.
KEY_BYTES = 1 + HASH_BYTES


class RecordKind(enum.IntEnum):
    """What a record holds."""

    BLOCK = 1      # one Classical block: all layers' parts of ``block_tokens`` tokens
    SNAPSHOT = 2   # the State at a resume point


def _check_hash(name: str, value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)) or len(value) != HASH_BYTES:
        got = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray, memoryview)) else repr(value)
        raise ValueError(f"{name}: expected {HASH_BYTES} bytes, got {got}")
    return bytes(value)


@dataclass(frozen=True, slots=True)
class RecordKey:
    """Identity of a record: its kind and the chained prefix hash of its block."""

    kind: RecordKind
    block_hash: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RecordKind):
            raise ValueError(f"kind: expected a RecordKind, got {self.kind!r}")
        object.__setattr__(self, "block_hash", _check_hash("block_hash", self.block_hash))

    @classmethod
    def block(cls, block_hash: bytes) -> RecordKey:
        return cls(RecordKind.BLOCK, block_hash)

    @classmethod
    def snapshot(cls, block_hash: bytes) -> RecordKey:
        return cls(RecordKind.SNAPSHOT, block_hash)

    def to_bytes(self) -> bytes:
        """``KEY_BYTES`` bytes: the kind byte, then the hash."""
        return bytes((self.kind,)) + self.block_hash

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> RecordKey:
        data = bytes(data)
        if len(data) != KEY_BYTES:
            raise ValueError(f"record key: expected {KEY_BYTES} bytes, got {len(data)}")
        try:
            kind = RecordKind(data[0])
        except ValueError:
            raise ValueError(f"record key: expected kind byte in {[int(k) for k in RecordKind]}, "
                             f"got {data[0]}") from None
        return cls(kind, data[1:])

    def __repr__(self) -> str:
        return f"RecordKey({self.kind.name}, {self.block_hash.hex()[:16]}…)"


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """What a verified record says about itself (returned by reads)."""

    key: RecordKey
    parent_hash: bytes
    token_digest: bytes
    layout_fingerprint: str
    payload_bytes: int
    format_version: int = FORMAT_VERSION

    @property
    def record_bytes(self) -> int:
        """Stored size: header + payload + checksum."""
        return record_size(self.payload_bytes)


def record_size(payload_bytes: int) -> int:
    """Bytes of a record holding ``payload_bytes`` bytes of payload."""
    return HEADER_BYTES + payload_bytes + CHECKSUM_BYTES


def fingerprint_field(layout_fingerprint: str) -> bytes:
    """The fixed-width header field for a fingerprint (ValueError if it does not fit)."""
    if not isinstance(layout_fingerprint, str) or not layout_fingerprint:
        raise ValueError(f"layout_fingerprint: expected a non-empty str, got {layout_fingerprint!r}")
    try:
        raw = layout_fingerprint.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError(f"layout_fingerprint: expected ascii, got {layout_fingerprint!r}") from None
    if len(raw) > FINGERPRINT_BYTES or b"\0" in raw:
        raise ValueError(f"layout_fingerprint: expected at most {FINGERPRINT_BYTES} ascii characters "
                         f"without NUL, got {len(raw)}: {layout_fingerprint!r}")
    return raw.ljust(FINGERPRINT_BYTES, b"\0")


# ------------------------------------------------------------------ buffers
def _torch_tensor_bytes(t: Any, *, writable: bool, name: str) -> np.ndarray:
    if t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")
    if writable and t.requires_grad:
        raise ValueError(f"{name}: expected a tensor without requires_grad")
    import torch  # already imported: t is a tensor

    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def as_byte_array(buf: Any, *, writable: bool = False, name: str = "buffer") -> np.ndarray:
    """A 1-D uint8 numpy view of ``buf``'s bytes, sharing its memory (never a copy).

    ``buf``: bytes-like, numpy array or CPU torch tensor, C-contiguous. With
    ``writable=True`` the buffer must be writable (an *out* buffer for a read).
    """
    torch_mod = sys.modules.get("torch")
    if torch_mod is not None and isinstance(buf, torch_mod.Tensor):
        return _torch_tensor_bytes(buf, writable=writable, name=name)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous numpy array, got strides {buf.strides}")
        if writable and not buf.flags.writeable:
            raise ValueError(f"{name}: expected a writable numpy array")
        return buf.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(buf)
    except TypeError:
        raise TypeError(f"{name}: expected a bytes-like object, numpy array or CPU torch tensor, "
                        f"got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous buffer")
    if writable and mv.readonly:
        raise ValueError(f"{name}: expected a writable buffer (bytearray, memoryview of one, numpy "
                         f"array or torch tensor), got read-only {type(buf).__name__}")
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)


_U8 = np.dtype(np.uint8)


class OutSegments(list):
    """The pieces of one out buffer: 1-D writable uint8 views, in payload order, and their
    total size ``nbytes`` (counted once, as they are checked)."""

    __slots__ = ("nbytes",)

    def __init__(self, segs: list[np.ndarray], nbytes: int) -> None:
        super().__init__(segs)
        self.nbytes = nbytes


def as_out_segments(out: Any, *, name: str = "out") -> OutSegments:
    """An out buffer for a read as its list of writable 1-D uint8 views, in payload order.

    ``out``: one buffer (see :func:`as_byte_array`) -> one view; a list or tuple of buffers
    (a scatter list) -> one view each (``name[j]`` in errors); an :class:`OutSegments`
    (made by this function, so already checked) -> itself, e.g. a pool block's rows kept
    for every read into that block. Never copies.
    """
    if type(out) is OutSegments:
        return out
    if isinstance(out, (list, tuple)):
        segs = []
        n = 0
        for j, buf in enumerate(out):
            if type(buf) is np.ndarray and buf.dtype is _U8 and buf.ndim == 1:  # the fast path
                flags = buf.flags  # (one flags object: building it is most of the check's cost)
                if flags.c_contiguous and flags.writeable:
                    segs.append(buf)
                    n += buf.size
                    continue
            seg = as_byte_array(buf, writable=True, name=f"{name}[{j}]")
            segs.append(seg)
            n += seg.size
        return OutSegments(segs, n)
    if type(out) is np.ndarray and out.dtype is _U8 and out.ndim == 1:  # the fast path
        flags = out.flags
        if flags.c_contiguous and flags.writeable:
            return OutSegments([out], out.size)
    seg = as_byte_array(out, writable=True, name=name)
    return OutSegments([seg], seg.size)


def write_segments(segs: list[np.ndarray], src: np.ndarray) -> None:
    """Copy ``src`` (1-D uint8) into the scatter list ``segs``, in order (sizes must add up)."""
    off = 0
    for seg in segs:
        n = seg.nbytes
        np.copyto(seg, src[off:off + n])
        off += n


# ------------------------------------------------------------------ encoding
def _pack_header(*, key: RecordKey, parent_hash: bytes, token_digest: bytes,
                 layout_fingerprint: str, payload_bytes: int) -> bytes:
    if not isinstance(key, RecordKey):
        raise TypeError(f"key: expected a RecordKey, got {type(key).__name__}")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, int(key.kind), 0, fingerprint_field(layout_fingerprint),
                        key.block_hash, _check_hash("parent_hash", parent_hash),
                        _check_hash("token_digest", token_digest), payload_bytes)


def payload_views(payload: Any, *, name: str = "payload") -> tuple[list[np.ndarray], int]:
    """A payload as its list of 1-D uint8 views (never a copy) and its total bytes.

    ``payload``: one buffer (see :func:`as_byte_array`), or a list or tuple of them (the
    pieces of a payload that lives in several places, e.g. one per layer of a host pool's
    page), taken in order (``name[j]`` in errors).
    """
    if isinstance(payload, (list, tuple)):
        views = []
        n = 0
        for j, p in enumerate(payload):
            if type(p) is np.ndarray and p.dtype is _U8 and p.ndim == 1 and p.flags.c_contiguous:
                views.append(p)  # the fast path (e.g. views of a host pool's pages)
            else:
                p = as_byte_array(p, name=f"{name}[{j}]")
                views.append(p)
            n += p.size
        return views, n
    view = as_byte_array(payload, name=name)
    return [view], view.nbytes


def record_parts(*, key: RecordKey, parent_hash: bytes, token_digest: bytes, layout_fingerprint: str,
                 payload: Any) -> tuple[bytes, np.ndarray, bytes]:
    """The record as ``(header, payload bytes view, checksum)`` without copying the payload
    (a payload of several pieces is joined: one copy; :func:`encode_record_into` takes
    the pieces as they are).

    Writing the three parts back to back (e.g. ``os.writev``) gives the same bytes as
    :func:`encode_record`.
    """
    views, nbytes = payload_views(payload)
    header = _pack_header(key=key, parent_hash=parent_hash, token_digest=token_digest,
                          layout_fingerprint=layout_fingerprint, payload_bytes=nbytes)
    h = xxhash.xxh3_128(header)
    for v in views:
        h.update(v)
    body = views[0] if len(views) == 1 else np.concatenate(views) if views else np.empty(0, np.uint8)
    return header, body, h.digest()


def encode_record_into(buf: Any, *, key: RecordKey, parent_hash: bytes, token_digest: bytes,
                       layout_fingerprint: str, payload: Any) -> int:
    """Write the record into the start of writable ``buf``; returns its size in bytes.

    ``payload``: one buffer or a list of pieces (see :func:`payload_views`), copied
    into place back to back; the checksum is then taken over the bytes as they lie in
    ``buf`` (exactly what is stored, while they are in the CPU cache)."""
    views, nbytes = payload_views(payload)
    header = _pack_header(key=key, parent_hash=parent_hash, token_digest=token_digest,
                          layout_fingerprint=layout_fingerprint, payload_bytes=nbytes)
    dst = as_byte_array(buf, writable=True, name="buf")
    size = record_size(nbytes)
    if dst.nbytes < size:
        raise ValueError(f"buf: expected at least {size} bytes, got {dst.nbytes}")
    end = HEADER_BYTES + nbytes
    dst[:HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)
    if len(views) == 1:
        np.copyto(dst[HEADER_BYTES:end], views[0])
    elif views:
        np.concatenate(views, out=dst[HEADER_BYTES:end])  # the pieces back to back, one call
    dst[end:size] = np.frombuffer(xxhash.xxh3_128(dst[:end]).digest(), dtype=np.uint8)
    return size


def encode_record(*, key: RecordKey, parent_hash: bytes, token_digest: bytes, layout_fingerprint: str,
                  payload: Any) -> bytearray:
    """The record as one new contiguous buffer (one copy of the payload)."""
    n = payload_views(payload)[1]
    out = bytearray(record_size(n))
    encode_record_into(out, key=key, parent_hash=parent_hash, token_digest=token_digest,
                       layout_fingerprint=layout_fingerprint, payload=payload)
    return out


# ------------------------------------------------------------------ decoding
@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The fields of a header that passed the structural checks (not yet the checksum)."""

    kind: RecordKind
    fingerprint: bytes  # the padded field
    block_hash: bytes
    parent_hash: bytes
    token_digest: bytes
    payload_bytes: int


def parse_header(header: Any, record_bytes: int) -> RecordHeader:
    """Structural checks of a header, for a stored record ``record_bytes`` long.

    ``header``: at least the first ``HEADER_BYTES`` bytes of the record. Checks length,
    magic, version, kind, flags, and that the payload length agrees with ``record_bytes``.
    """
    if record_bytes < HEADER_BYTES + CHECKSUM_BYTES:
        raise CorruptRecordError(RecordCheck.TRUNCATED,
                                 f"{record_bytes} bytes, shorter than header + checksum "
                                 f"({HEADER_BYTES + CHECKSUM_BYTES})")
    magic, version, kind, flags, fp, bh, ph, td, plen = _HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise CorruptRecordError(RecordCheck.MAGIC, f"expected {MAGIC!r}, got {magic!r}")
    if version != FORMAT_VERSION:
        raise CorruptRecordError(RecordCheck.VERSION, f"expected format version {FORMAT_VERSION}, got {version}")
    try:
        kind_e = RecordKind(kind)
    except ValueError:
        raise CorruptRecordError(RecordCheck.KIND, f"expected a kind in {[int(k) for k in RecordKind]}, "
                                                   f"got {kind}") from None
    if flags != 0:
        raise CorruptRecordError(RecordCheck.FLAGS, f"expected flags 0, got {flags:#04x}")
    expected = record_size(plen)
    if expected > record_bytes:
        raise CorruptRecordError(RecordCheck.TRUNCATED,
                                 f"header says payload of {plen} bytes ({expected} in all), "
                                 f"record has {record_bytes}")
    if expected < record_bytes:
        raise CorruptRecordError(RecordCheck.TRAILING_BYTES,
                                 f"{record_bytes - expected} bytes after the checksum "
                                 f"(payload {plen} bytes, record {record_bytes})")
    return RecordHeader(kind_e, fp, bh, ph, td, plen)


def verify_record_parts(header: Any, payload: Any, checksum: Any, *, parsed: RecordHeader,
                        expect_key: RecordKey, expect_fingerprint: str,
                        expect_token_digest: bytes | None = None) -> RecordMeta:
    """Checksum and identity checks of a record read in parts (header, payload, checksum).

    ``parsed`` is :func:`parse_header` of ``header``; ``payload`` is the payload as read
    (possibly already in the caller's out buffer), one buffer or a list of them in order
    (a scatter list: hashed segment by segment, never concatenated).
    """
    h = xxhash.xxh3_128(memoryview(header)[:HEADER_BYTES])
    if isinstance(payload, list):
        for seg in payload:
            h.update(seg)
    else:
        h.update(payload)
    got = h.digest()
    if got != bytes(checksum):
        raise CorruptRecordError(RecordCheck.CHECKSUM,
                                 f"stored xxh3-128 {bytes(checksum).hex()}, computed {got.hex()}")
    return check_identity(parsed, expect_key=expect_key, expect_fingerprint=expect_fingerprint,
                          expect_token_digest=expect_token_digest)


def check_identity(parsed: RecordHeader, *, expect_key: RecordKey, expect_fingerprint: str,
                   expect_token_digest: bytes | None = None) -> RecordMeta:
    """The identity checks of a parsed header (fingerprint, key, token digest when given)
    and the record's meta; CorruptRecordError naming the first that fails.

    No checksum: :func:`verify_record_parts` runs these after it. On its own this is the
    header check of a record whose payload authenticates itself (a sealed envelope, see
    :meth:`~tiered_kv.storage.api.store.BlockStore.read_each`)."""
    if parsed.fingerprint != fingerprint_field(expect_fingerprint):
        stored = parsed.fingerprint.rstrip(b"\0").decode("ascii", "replace")
        raise CorruptRecordError(RecordCheck.FINGERPRINT,
                                 f"expected layout {expect_fingerprint!r}, record has {stored!r}")
    if parsed.kind is not expect_key.kind or parsed.block_hash != expect_key.block_hash:
        raise CorruptRecordError(RecordCheck.KEY,
                                 f"expected {expect_key!r}, record is "
                                 f"{RecordKey(parsed.kind, parsed.block_hash)!r}")
    if expect_token_digest is not None and parsed.token_digest != _check_hash(
            "expect_token_digest", expect_token_digest):
        raise CorruptRecordError(RecordCheck.TOKEN_DIGEST,
                                 f"expected {bytes(expect_token_digest).hex()[:16]}…, "
                                 f"record has {parsed.token_digest.hex()[:16]}…")
    return RecordMeta(key=expect_key, parent_hash=parsed.parent_hash, token_digest=parsed.token_digest,
                      layout_fingerprint=expect_fingerprint, payload_bytes=parsed.payload_bytes)


#: Offsets of the header's fields after the fingerprint: block hash, parent hash, token
#: digest, payload length (see the module docstring).
_HASH_AT, _PARENT_AT, _DIGEST_AT, _LENGTH_AT = (HEADER_OFFSETS[name] for name in (
    "block_hash", "parent_hash", "token_digest", "payload_length"))
#: What the native reader (``storage/os/_fastread.c``) was compiled with must equal this
#: (its module constants of these names): the header's size, where the identity it compares
#: in one piece ends (magic to block hash), where the token digest and the payload length
#: are, and the checksum's size.
HEADER_LAYOUT = {"HEADER_BYTES": HEADER_BYTES, "ID_BYTES": _PARENT_AT, "DIGEST_AT": _DIGEST_AT,
                 "LENGTH_AT": _LENGTH_AT, "DIGEST_BYTES": CHECKSUM_BYTES, "EXPECT_UNHASHED": 0x55}
#: The byte that ends an :meth:`PartsVerifier.expectation` of a record whose payload
#: authenticates itself (``hashed=False``: every check but the xxh3, which is not computed).
EXPECT_UNHASHED = HEADER_LAYOUT["EXPECT_UNHASHED"]
_LEAD = struct.Struct("<" + "".join(code for _, code in HEADER_FIELDS[:4]))  # magic, version, kind, flags
_PAYLOAD_LENGTH = struct.Struct("<Q")


class PartsVerifier:
    """Verify records read in parts (header, payload pieces, checksum) with few Python
    steps per record: the fields a reader knows in advance are compared as bytes, and the
    checksum was computed while reading (:mod:`~tiered_kv.storage.os.fastread`).

    Accepts exactly the records :func:`parse_header` + :func:`verify_record_parts` accept
    (magic, version, kind, flags, length, checksum, fingerprint, key, token digest), and
    also checks the stored checksum against ``checksum`` (e.g. the index's copy). Made
    once per read call for one fingerprint; thread-safe (it keeps no per-record state).
    """

    __slots__ = ("fingerprint", "_fp_field", "_lead")

    def __init__(self, layout_fingerprint: str) -> None:
        self._fp_field = fingerprint_field(layout_fingerprint)
        self.fingerprint = layout_fingerprint
        #: kind -> the header's first 8 bytes a record of that kind must have
        self._lead = {kind: _LEAD.pack(MAGIC, FORMAT_VERSION, kind, 0) for kind in RecordKind}

    def verify(self, header: bytes, digest: bytes | None, tail: Any, *, key: RecordKey, record_bytes: int,
               checksum: bytes | None = None, token_digest: bytes | None = None,
               hashed: bool = True) -> RecordMeta | None:
        """The record's meta if it verifies, else None (any check failed).

        ``header``: its ``HEADER_BYTES`` bytes (bytes: sliced and compared cheaply);
        ``digest``: the canonical xxh3-128 of header + payload as read (see
        :func:`~tiered_kv.storage.os.fastread.read_and_hash`; None: not read whole);
        ``tail``: its stored checksum; ``record_bytes``: its stored size; ``checksum``:
        what the stored one must also equal (e.g. the index's copy; None: not checked).
        ``hashed=False``: for a payload that authenticates itself (a sealed envelope, whose
        GCM tag the caller checks): ``digest`` is not compared, every other check is made."""
        payload_bytes = record_bytes - HEADER_BYTES - CHECKSUM_BYTES
        if digest is None or payload_bytes < 0 or len(header) != HEADER_BYTES:
            return None
        if (header[:8] != self._lead[key.kind] or header[8:_HASH_AT] != self._fp_field
                or header[_HASH_AT:_PARENT_AT] != key.block_hash
                or header[_LENGTH_AT:] != _PAYLOAD_LENGTH.pack(payload_bytes)):
            return None
        stored = tail.tobytes() if type(tail) is np.ndarray else bytes(tail)
        if (hashed and stored != digest) or (checksum is not None and stored != checksum):
            return None
        digest_field = header[_DIGEST_AT:_LENGTH_AT]
        if token_digest is not None and digest_field != token_digest:
            return None
        return RecordMeta(key, header[_PARENT_AT:_DIGEST_AT], digest_field, self.fingerprint, payload_bytes)

    def expectation(self, key: RecordKey, record_bytes: int, checksum: bytes,
                    token_digest: bytes | None = None, *, hashed: bool = True) -> bytes:
        """What :func:`~tiered_kv.storage.os.fastread.read_verify_many` checks a record of
        ``key``, ``record_bytes`` long, against: the header's first 72 bytes (magic,
        version, kind, flags, fingerprint, block hash), its payload length (8 B), the
        index's ``checksum`` (16 B) and, when given, the ``token_digest`` (32 B);
        ``hashed=False``: then :data:`EXPECT_UNHASHED` (1 B): no xxh3 (see :meth:`verify`)."""
        return b"".join((self._lead[key.kind], self._fp_field, key.block_hash,
                         _PAYLOAD_LENGTH.pack(record_bytes - HEADER_BYTES - CHECKSUM_BYTES), checksum,
                         token_digest or b"", b"" if hashed else bytes((EXPECT_UNHASHED,))))

    def meta(self, header: bytes, key: RecordKey, record_bytes: int) -> RecordMeta:
        """The meta of a record of ``key`` whose ``header`` was verified (natively)."""
        return RecordMeta(key, header[_PARENT_AT:_DIGEST_AT], header[_DIGEST_AT:_LENGTH_AT], self.fingerprint,
                          record_bytes - HEADER_BYTES - CHECKSUM_BYTES)


def decode_record(buf: Any, *, expect_key: RecordKey, expect_fingerprint: str,
                  expect_token_digest: bytes | None = None, out: Any = None) -> RecordMeta:
    """Verify the record in ``buf`` and copy its payload into ``out`` (when given).

    ``buf``: the whole stored record (bytes-like or numpy; e.g. LMDB's zero-copy buffer).
    ``out``: writable buffer of exactly the payload size (see the module docstring); it is
    written only after every check passed. Raises :class:`CorruptRecordError` (which
    check failed) or ``ValueError`` if ``out`` has the wrong size for a valid record.
    """
    src = as_byte_array(buf, name="buf")
    parsed = parse_header(src, src.nbytes)
    end = HEADER_BYTES + parsed.payload_bytes
    payload = src[HEADER_BYTES:end]
    meta = verify_record_parts(src[:HEADER_BYTES], payload, src[end:], parsed=parsed,
                               expect_key=expect_key, expect_fingerprint=expect_fingerprint,
                               expect_token_digest=expect_token_digest)
    if out is not None:
        dst = as_byte_array(out, writable=True, name="out")
        if dst.nbytes != parsed.payload_bytes:
            raise ValueError(f"out: expected {parsed.payload_bytes} bytes (the stored payload of "
                             f"{expect_key!r}), got {dst.nbytes}")
        np.copyto(dst, payload)
    return meta
