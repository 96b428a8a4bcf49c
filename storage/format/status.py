"""The verdict of a native read of one record (:mod:`~tiered_kv.storage.os.fastread`'s
``read_verify_many``, ``VerifyBatch``, ``read_verify_rows``, ``verify_rows``): defined once.
The C helper (``storage/os/_fastread.c``) was compiled with its own copy, ``ST_*``: it
exports them, and the helper is used only if they equal these.
"""

from __future__ import annotations

import enum

__all__ = ["FAILED", "NATIVE_NAMES", "SHORT", "UNCACHED", "VERIFIED", "ReadStatus"]


class ReadStatus(enum.IntEnum):
    """One status byte per record."""

    VERIFIED = 0  # read whole and every check passed
    SHORT = 1     # not read whole (end of file, a read error, a segment gone): a miss
    FAILED = 2    # read whole, and a check failed (counted corrupt)
    UNCACHED = 3  # left unread (``cached_only``: not all in the page cache): read on the cold path


VERIFIED, SHORT, FAILED, UNCACHED = ReadStatus.VERIFIED, ReadStatus.SHORT, ReadStatus.FAILED, ReadStatus.UNCACHED
#: The C helper's constant of each status.
NATIVE_NAMES = {"ST_OK": VERIFIED, "ST_SHORT": SHORT, "ST_BAD": FAILED, "ST_UNCACHED": UNCACHED}
