"""The segment files read as the write-ahead log they are: every record that verifies.

Records are self-describing (header, xxh3-128 checksum, layout fingerprint), so the
records a dead writer appended past what the index covers (recovery.py), or every record
of every segment (rebuild.py), are found by scanning the bytes and verifying each record.
"""

from __future__ import annotations

import os
import struct

import numpy as np

from ..errors import CorruptRecordError, RecordCheck
from ..format.record import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    MAGIC,
    RecordKey,
    parse_header,
    record_size,
    verify_record_parts,
)
from .schema import PAYLOAD_BYTES, Location, parent_key_bytes

__all__ = ["next_magic", "scan_segment"]


def scan_segment(fd: int, seg: int, start: int, size: int, fingerprint: str
                  ) -> list[tuple[bytes, Location, bytes, bytes]]:
    """The verified records of ``[start, size)`` of segment ``seg``: (key bytes, location,
    checksum, the parent's key bytes: see :func:`.tree.parent_key_bytes`), in file order. Records lie back to back within 4 KiB-aligned batches; a
    record that fails a check, a punched hole (a deleted or evicted record: zeros), the
    padding of a batch, a torn write or garbage are skipped to the next record magic
    (so the records after a hole in the middle of a batch are found)."""
    out: list[tuple[bytes, Location, bytes, bytes]] = []
    pos = start
    while pos + HEADER_BYTES + CHECKSUM_BYTES <= size:
        head = os.pread(fd, HEADER_BYTES, pos)
        try:
            if head[:len(MAGIC)] != MAGIC:
                raise CorruptRecordError(RecordCheck.MAGIC, "")
            n = record_size(PAYLOAD_BYTES.unpack_from(head, HEADER_BYTES - 8)[0])
            parse_header(head, n)
            if pos + n > size:
                raise CorruptRecordError(RecordCheck.TRUNCATED, "")
            buf = np.frombuffer(os.pread(fd, n, pos), np.uint8)
            if buf.nbytes != n:
                raise CorruptRecordError(RecordCheck.TRUNCATED, "")
            parsed = parse_header(buf, n)
            key = RecordKey(parsed.kind, parsed.block_hash)
            verify_record_parts(buf[:HEADER_BYTES], buf[HEADER_BYTES:n - CHECKSUM_BYTES], buf[n - CHECKSUM_BYTES:],
                                parsed=parsed, expect_key=key, expect_fingerprint=fingerprint)
        except (CorruptRecordError, struct.error):
            pos = next_magic(fd, pos + 1, size)
            continue
        out.append((key.to_bytes(), Location(seg, pos, n), buf[-CHECKSUM_BYTES:].tobytes(),
                    parent_key_bytes(key.kind, key.block_hash, parsed.parent_hash)))
        pos += n
    return out


def next_magic(fd: int, pos: int, size: int) -> int:
    """Offset of the next record magic at or after ``pos`` in the file (``size`` if none)."""
    while pos < size:
        buf = os.pread(fd, min(1 << 20, size - pos), pos)
        if not buf:
            return size
        at = buf.find(MAGIC)
        if at >= 0:
            return pos + at
        if pos + len(buf) >= size:
            return size
        pos += len(buf) - (len(MAGIC) - 1)  # a magic across the chunk boundary is found next time
    return size
