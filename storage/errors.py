"""Errors of the disk tier.

Three kinds of failure (STYLE §5): a cache miss is ``None``, never an exception; bad
input is a :class:`ValueError` / :class:`TypeError` naming what was expected; a store
that cannot do what was asked (full, locked, bound to another layout) raises one of the
classes below. A damaged record is never an exception of the store: it is a miss,
counted as ``corrupt`` in :meth:`BlockStore.stats`. :class:`CorruptRecordError` is what
:func:`~tiered_kv.storage.record.decode_record` raises to say which check failed.
"""

from __future__ import annotations

import enum

__all__ = [
    "CorruptRecordError",
    "EncryptedLevelError",
    "IndexDamagedError",
    "LayoutMismatchError",
    "RecordCheck",
    "StoreError",
    "StoreFullError",
    "StoreLockedError",
]


class StoreError(Exception):
    """Base class of every error a block store raises on purpose."""


class StoreFullError(StoreError):
    """A put did not fit: the disk, the LMDB map or ``max_bytes`` is exhausted.

    Raised by ``put_many``. Nothing already stored is harmed and reads keep working; which
    records of the failed call were stored is backend-specific (LMDB: none of them, the
    call is one transaction; Zarr: each record is atomic, a prefix of the call may be).
    """


class StoreLockedError(StoreError):
    """The store cannot be opened here: it is already open in this process.

    LMDB forbids a second environment handle on the same files in one process (closing
    one would drop the other's locks); share the open store object instead.
    """


class EncryptedLevelError(StoreError):
    """The level is sealed (created with ``encryption``) and was opened without its keys
    for writing, or it cannot be opened as it is with them: sealed by an earlier version
    (unkeyed object names: ``tiered-kv rekey`` migrates it), or holding plain records.

    A plain writer would leave plaintext under names an encrypted reader never asks for
    (a write-once store can never seal them afterwards), so it is refused at open. A
    maintenance open (``layout_fingerprint=None``: stats, verify, gc) needs no key."""


class IndexDamagedError(StoreError):
    """An LMDB store's index (``data.mdb``) is damaged: truncated, zeroed, empty or gone
    while segment files hold records. ``problem`` says what was found (one line).

    The records are intact in the segment files, which are the store's write-ahead log:
    ``tiered-kv verify --repair --store PATH`` (or a writable open, when no other process
    has the store open) rebuilds the index from them.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: the index (data.mdb) is damaged: {problem}. The records are intact in "
                         f"the segment files; rebuild the index from them with `tiered-kv verify --repair "
                         f"--store {path}`")


class LayoutMismatchError(StoreError, ValueError):
    """The store was created for another KV layout than the caller's.

    ``LayoutMismatchError(where, stored, requested)`` names both fingerprints;
    ``LayoutMismatchError(message)`` takes a ready message.
    """

    def __init__(self, where: str, stored: str | None = None, requested: str | None = None) -> None:
        self.where = where
        self.stored = stored
        self.requested = requested
        if stored is None or requested is None:
            super().__init__(where)
            return
        super().__init__(
            f"{where}: store holds records of layout fingerprint {stored!r}, "
            f"opened with layout fingerprint {requested!r}; open it with the layout it was "
            f"created for, or use another path for this layout"
        )


class RecordCheck(enum.Enum):
    """The record-format checks, in the order :func:`decode_record` applies them."""

    TRUNCATED = "truncated"            # shorter than header + checksum, or than its payload
    MAGIC = "magic"
    VERSION = "version"
    KIND = "kind"
    FLAGS = "flags"
    TRAILING_BYTES = "trailing_bytes"  # longer than header + payload + checksum
    CHECKSUM = "checksum"
    FINGERPRINT = "fingerprint"
    KEY = "key"                        # record kind or block hash differ from the key asked for
    TOKEN_DIGEST = "token_digest"


class CorruptRecordError(StoreError, ValueError):
    """A stored record failed a check; ``check`` says which one."""

    def __init__(self, check: RecordCheck, detail: str) -> None:
        self.check = check
        self.detail = detail
        super().__init__(f"corrupt record: {check.value} check failed: {detail}")
