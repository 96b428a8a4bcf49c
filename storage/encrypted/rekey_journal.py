"""The rekey journal: the batch of records :meth:`EncryptedStore.rekey` is rewriting.

A write-once store has no overwrite, so ``rekey`` removes each record sealed under an old
key and writes it again under the new one. Between the two the record is nowhere in the
store: a process killed there (kill -9, OOM, power loss) would lose it. So each batch
goes::

    seal the batch under the new key (the envelopes that will be stored)
    write them to the journal, fsync, rename into place, fsync the directory
    delete the batch's records from the store
    put the new envelopes
    delete the journal

and whoever next takes the journal's lock puts back every journaled record the store
lacks: the next ``rekey`` run (always), and, for a store with a directory, any process
that opens it encrypted (:class:`~.encrypted.EncryptedStore` replays at open). At every
instant each record is in the store (under the old key or the new), in the journal, or
both; and whatever is put back is exactly what the run would have put, checksummed.

File format (little-endian)::

    offset  size  field
         0     4  magic            b"TKVJ"
         4     2  version          u16, = JOURNAL_VERSION
         6     2  reserved         zero
         8     8  record count     u64
        16     …  the records back to back, each in the record format of :mod:`.record`
                  (header with key, masked parent hash and token digest, layout
                  fingerprint; payload = the envelope sealed under the new key; xxh3-128)

It is written whole to ``<journal>.partial`` (0o600), fsynced, and renamed over the
journal, so the journal is complete or absent, never torn; a partial file is the trace of
a run killed before it removed anything, and is discarded. A journaled record whose
checksum fails (damaged media), or whose envelope does not authenticate under the
opener's keys (the journal is in the store's directory: whoever can write there could
plant one), is not put back and is counted ``lost``: a later miss, never wrong bytes. A
journal whose envelopes are under a key the opener does not hold is left in place for a
holder of that key (``deferred``). It holds only what the store holds: ciphertext under the new key and
headers whose parent hash and token digest are masked, so it reveals nothing more than
the store does; still it is owner-only (0o600, its directories 0o700).

Where: a store with a directory (LMDB, a Zarr directory) keeps it there, as
``rekey-journal``, so that every process opening the store finds it. An object store's is
a local file: the ``journal`` argument (``tiered-kv rekey --journal PATH``), by default
``$XDG_CACHE_HOME/tiered_kv/rekey/<sha256 of the store's URL, 16 hex>.journal``
(``~/.cache`` without ``XDG_CACHE_HOME``); the next ``rekey`` of that store on the same
machine (or given the same ``--journal``) replays it.

The journal, its temporary and its lock are opened without following symbolic links
(``O_NOFOLLOW``): a link planted at one of those paths is refused, never written through.

Lock: ``<journal>.lock``, an ``flock`` (released by the kernel when its holder dies, kill
-9 included). A ``rekey`` run holds it throughout (a second run of the same store raises
:class:`~.errors.StoreLockedError`); an opener that replays takes it for the replay, and
skips the replay when a run holds it (the run replays, or whoever comes after it).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import hashlib
import os
import stat
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..api import BlockStore, PutItem
from ..os.faults import FAILPOINT_ENV, Faults, failpoint
from ..os.files import create_private_file, fsync_dir, mkdir_private
from ..errors import CorruptRecordError, StoreError, StoreLockedError
from ..format.record import HEADER_BYTES, RecordKey, decode_record, parse_header, record_parts, record_size

__all__ = [
    "FAILPOINT_ENV",
    "JOURNAL_NAME",
    "JOURNAL_VERSION",
    "RekeyJournal",
    "RekeyPoint",
    "ReplayResult",
    "default_journal_path",
    "failpoint",
]

#: File name of the journal inside a local store's directory.
JOURNAL_NAME = "rekey-journal"
JOURNAL_MAGIC = b"TKVJ"
JOURNAL_VERSION = 1
_HEAD = struct.Struct("<4sHHQ")
_PAYLOAD_LEN = struct.Struct("<Q")
_PAYLOAD_LEN_AT = HEADER_BYTES - _PAYLOAD_LEN.size  # the record header's last field
#: Journaled records put back per backend call.
_REPLAY_CHUNK_BYTES = 8 << 20
_IOV_MAX = 512


class RekeyPoint(enum.Enum):
    """The steps of a rekey batch where the wrapper's faults are hit (``store.faults``; as
    ``TIERED_KV_FAILPOINT=<value>:<n>``, ``n`` is the batch: e.g. ``rekey-deleted:2``, the
    second batch rewritten, after its old records were removed)."""

    PARTIAL = "rekey-partial"      # the batch written and fsynced to the temporary, not renamed
    JOURNALED = "rekey-journaled"  # the journal in place, nothing removed
    DELETED = "rekey-deleted"      # the batch's old records removed, none written
    PUT = "rekey-put"              # the new records written, the journal not yet deleted


def default_journal_path(where: str) -> Path:
    """The journal of the object store at ``where`` (its URL as the store names it) when
    none is given: under the user's cache directory, named by a hash of the URL."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = hashlib.sha256(where.encode()).hexdigest()[:16]
    return Path(base) / "tiered_kv" / "rekey" / f"{name}.journal"


@dataclass
class ReplayResult:
    """What :meth:`RekeyJournal.replay` did with the records of a journal left behind."""

    restored: int = 0   # journaled records the store lacked: put back
    present: int = 0    # already in the store (under the old key or the new)
    lost: int = 0       # journaled records whose checksum or tag failed: not put back
    deferred: bool = False  # under a key the opener does not hold: left in place, nothing put back


class RekeyJournal:
    """The journal file at ``path`` (see the module docstring), its lock and its
    temporary. ``writes`` counts :meth:`write` calls (the batch number of the fault
    points); ``faults``: where :data:`RekeyPoint.PARTIAL` is hit (the rekeying store's)."""

    def __init__(self, path: str | os.PathLike[str], *, faults: Faults | None = None) -> None:
        self.path = Path(path)
        self.faults = Faults() if faults is None else faults
        if self.path.is_dir():
            raise ValueError(f"journal: expected a file path (created if needed), got the directory {self.path}")
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.partial_path = self.path.with_name(self.path.name + ".partial")
        self.writes = 0

    def exists(self) -> bool:
        """Whether a journal (complete: a batch may be out of the store) is there (a link
        there counts: :meth:`replay` refuses it)."""
        return self.path.is_symlink() or self.path.is_file()

    @contextlib.contextmanager
    def holding(self, *, required: bool) -> Iterator[bool]:
        """Hold the journal's lock while inside. Yields True once held; when another
        process (or handle) holds it: ``required`` raises :class:`StoreLockedError`,
        else yields False (the holder owns the journal)."""
        mkdir_private(self.path.parent)
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreError(f"{self.lock_path}: a symbolic link; the rekey journal's lock must be a file "
                                 f"(remove the link)") from None
            raise
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if required:
                    raise StoreLockedError(f"{self.lock_path}: a rekey of this store is running in another "
                                           f"process (or a process opening the store is putting back a killed "
                                           f"rekey's batch, for a moment); run one rekey at a time") from None
                yield False
                return
            yield True
        finally:
            os.close(fd)  # (releases the lock)

    def write(self, items: Sequence[PutItem], layout_fingerprint: str) -> None:
        """Make ``items`` (the batch sealed under the new key, as it will be stored) the
        journal, durably: written to the temporary, fsynced, renamed over the journal, the
        directory fsynced. The caller holds the lock."""
        self.writes += 1
        mkdir_private(self.path.parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.partial_path)  # a run killed while journaling left it: nothing was removed then
        fd = create_private_file(self.partial_path)
        if fd is None:
            raise StoreError(f"{self.partial_path}: created by someone else while this rekey holds the lock")
        try:
            bufs: list[object] = [_HEAD.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0, len(items))]
            for item in items:
                bufs += record_parts(key=item.key, parent_hash=item.parent_hash, token_digest=item.token_digest,
                                     layout_fingerprint=layout_fingerprint, payload=item.payload)
            _write_all(fd, bufs)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.faults.hit(RekeyPoint.PARTIAL, n=self.writes)
        os.replace(self.partial_path, self.path)
        fsync_dir(self.path.parent)  # durable before any record is removed

    def clear(self) -> None:
        """Delete the journal (its batch is in the store). Not fsynced: a journal that
        comes back after a power loss only puts back records the store holds already."""
        for p in (self.path, self.partial_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def replay(self, store: BlockStore, *,
               authentic: Callable[[PutItem], bool | None] | None = None) -> ReplayResult:
        """Put every journaled record ``store`` lacks (a write-once put leaves the ones it
        has alone), then delete the journal. The caller holds the lock. ``authentic``
        checks each journaled record (its envelope) before it is put back: False = not
        put back (``lost``), None = under a key not held (nothing is put back and the
        journal is kept: ``deferred``). Raises :class:`StoreError` when the file is not a
        rekey journal (left in place)."""
        result = ReplayResult()
        if not self.exists():
            self.clear()  # (a partial file: its run removed nothing)
            return result
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreError(f"{self.path}: a symbolic link, not a rekey journal; remove it") from None
            raise
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise StoreError(f"{self.path}: not a regular file, not a rekey journal; remove it")
            chunks = self._read_items(f, store.layout_fingerprint, result, authentic)
        if result.deferred:
            return result
        for chunk in chunks:
            written = store.put_many(chunk)
            result.restored += sum(written)
            result.present += len(written) - sum(written)
        self.clear()
        return result

    def _read_items(self, f: Any, fp: str, result: ReplayResult,
                    authentic: Callable[[PutItem], bool | None] | None) -> list[list[PutItem]]:
        """The journal's checksum-verified (and, with ``authentic``, authenticated)
        records, in chunks of about ``_REPLAY_CHUNK_BYTES``; the others are counted in
        ``result.lost``, or set ``result.deferred``."""
        head = f.read(_HEAD.size)
        if len(head) != _HEAD.size or _HEAD.unpack(head)[:3] != (JOURNAL_MAGIC, JOURNAL_VERSION, 0):
            raise StoreError(f"{self.path}: not a rekey journal of this version (expected magic "
                             f"{JOURNAL_MAGIC!r}, version {JOURNAL_VERSION}); move it away")
        count = _HEAD.unpack(head)[3]
        left = os.fstat(f.fileno()).st_size - _HEAD.size
        chunks: list[list[PutItem]] = [[]]
        chunk_bytes = good = 0
        for _ in range(count):
            if left < HEADER_BYTES:
                break  # the rest is missing: lost
            rec_head = f.read(HEADER_BYTES)
            size = record_size(_PAYLOAD_LEN.unpack_from(rec_head, _PAYLOAD_LEN_AT)[0])
            if size > left:
                break  # a damaged length: nothing after it can be found
            buf = np.empty(size, np.uint8)
            buf[:HEADER_BYTES] = np.frombuffer(rec_head, np.uint8)
            if f.readinto(memoryview(buf)[HEADER_BYTES:]) != size - HEADER_BYTES:
                break
            left -= size
            try:
                parsed = parse_header(buf, size)
                key = RecordKey(parsed.kind, parsed.block_hash)
                meta = decode_record(buf, expect_key=key, expect_fingerprint=fp)
            except CorruptRecordError:
                continue  # lost: never put back unverified
            payload = buf[HEADER_BYTES:HEADER_BYTES + meta.payload_bytes]
            item = PutItem(key, meta.parent_hash, meta.token_digest, payload)
            ok = True if authentic is None else authentic(item)
            if ok is None:
                result.deferred = True
                return []
            if not ok:
                continue  # lost: never put back unauthenticated
            good += 1
            chunks[-1].append(item)
            chunk_bytes += size
            if chunk_bytes >= _REPLAY_CHUNK_BYTES:
                chunks.append([])
                chunk_bytes = 0
        result.lost = count - good
        return [c for c in chunks if c]

    def __repr__(self) -> str:
        return f"RekeyJournal({str(self.path)!r})"


def _write_all(fd: int, bufs: Sequence[object]) -> None:
    """Write ``bufs`` (bytes-like, in order) to ``fd`` completely, with ``writev``."""
    views = [memoryview(b).cast("B") for b in bufs]  # type: ignore[arg-type]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i:i + _IOV_MAX])
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
