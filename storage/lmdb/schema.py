"""The LMDB store's files, defined once: where records lie, and the segment files' names.

(The index's sub-databases, meta keys and codecs join this module with the split of the
store along its seams.)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SEGMENT_SUFFIX", "Location", "parse_segment_name", "segment_name"]

SEGMENT_SUFFIX = ".seg"


def segment_name(seg_id: int) -> str:
    """The file name of segment ``seg_id`` (8 hex digits, then ``.seg``)."""
    return f"{seg_id:08x}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    """The id of the segment file ``name``; None for any other file."""
    if not name.endswith(SEGMENT_SUFFIX) or len(name) != 8 + len(SEGMENT_SUFFIX):
        return None
    try:
        return int(name[:8], 16)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Location:
    """Where one record lies: segment id, byte offset, record bytes."""

    segment: int
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length
