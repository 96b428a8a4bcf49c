"""Records read in place: payloads as read-only views of the page cache, for a caller that
authenticates them itself (:meth:`~tiered_kv.storage.api.store.BlockStore.map_unhashed`).

An encrypted level's hot read is then one pass over the bytes: AES-GCM reads the envelope
where the page cache holds it and writes the plaintext into the caller's buffer. Through
:meth:`~.store_reads.StoreReads.get_many` it would be two: the envelope copied out of the
page cache into a buffer, then decrypted from there.

What a mapped record has passed: the index lookup (one read transaction), its segment
file still covering it (``fstat``), every page of its run in the page cache
(``cachestat``: a mapped read never waits for the disk; what is not cached goes the
ordinary way, read ahead or ``O_DIRECT``), and every check of ``get_many_unhashed``
(:meth:`~tiered_kv.storage.format.record.PartsVerifier.verify` with ``hashed=False``:
structure, fingerprint, key, length, the stored checksum against the index's). A record
failing any of them is not mapped: the caller reads it with ``get_many_unhashed``, which
counts and unindexes what is corrupt.

Lifetime. Each segment a read touches is mapped once, read-only and ``MAP_SHARED``, over
the file as it then is, and the map is kept for the next reads (its page-table entries
too: a hot read then neither maps nor faults; at most :data:`MAX_MAPS`, least recently
used dropped first; mapped again larger when a record lies past its end, as the active
segment grows). A map is never closed under a reader: the store drops its reference
(eviction from the cache, a segment found unlinked, ``close``) and the map is released
once no view refers to it (Python's buffer protocol: a view can never dangle). The list
a read gets is emptied when its ``with`` block ends. The lookups, maps and checks run
under the store's shared lock (``close`` waits for them); the views need no lock, so the
``with`` blocks of several reads may nest (an encrypted level maps chunk after chunk
while it decrypts the first). Segment files are append-only, and the only bytes
this library ever cuts off a segment are ones no index entry covers, so a record a map
shows stays in the file while it is indexed: a hole punched meanwhile (a delete, an
eviction, gc) reads as zeros and fails the caller's tag. Only bytes within the file's
size at the moment of the read (``fstat``) are touched: a record past the end of a torn
file is not mapped. (A file cut short by someone else *during* a read would fault the
process, as it would LMDB's own map of its index.)
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from ..api.store import MappedPayload, check_open
from ..format.record import CHECKSUM_BYTES, HEADER_BYTES, RecordKey, record_size
from ..os import libc
from .read_tasks import extents
from .schema import Location, segment_name, unpack_entry
from .store_reads import StoreReads

__all__ = ["MAX_MAPS", "SWEEP_S", "MappedReads"]


#: How often the kept maps are checked against the files (a segment another process's gc
#: unlinked is let go then; this process's gc and verify drop every map at once).
SWEEP_S = 10.0
#: Segment maps a store keeps (each spans its file: virtual address space only, the page
#: cache's pages are shared, not copied).
MAX_MAPS = 64


class _Map:
    """One segment's map: the file's inode (a segment is never rewritten in place, but
    make sure), its length, and a ``[length] uint8`` read-only view of it."""

    __slots__ = ("ino", "length", "mm", "view")

    def __init__(self, fd: int, ino: int, length: int) -> None:
        self.ino, self.length = ino, length
        self.mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.view = np.frombuffer(self.mm, np.uint8)


class MappedReads:
    """:meth:`map_unhashed` over one open store's index and segment files, with the maps
    of the segments read lately (see the module docstring)."""

    def __init__(self, reads: StoreReads) -> None:
        self.reads = reads
        self._maps: OrderedDict[int, _Map] = OrderedDict()
        self._lock = threading.Lock()
        self._swept = time.monotonic()

    def close(self) -> None:
        """Drop every map (each is released once no view of it is left)."""
        with self._lock:
            self._maps.clear()

    def _sweep(self) -> None:
        """Every :data:`SWEEP_S`: drop the maps of segments unlinked or replaced since (so
        that no map keeps a removed segment's disk space)."""
        if time.monotonic() - self._swept < SWEEP_S:
            return
        self._swept = time.monotonic()
        folder = self.reads.segments.reads.files.folder
        with self._lock:
            kept = list(self._maps.items())
        for seg, m in kept:
            try:
                gone = os.stat(folder / segment_name(seg)).st_ino != m.ino
            except OSError:
                gone = True
            if gone:
                self._forget(seg)

    @contextmanager
    def map_unhashed(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int]
                     ) -> Iterator[list[MappedPayload | None]]:
        """See :meth:`~tiered_kv.storage.api.store.BlockStore.map_unhashed` and the
        module docstring."""
        reads, index = self.reads, self.reads.index
        self._sweep()
        out: list[MappedPayload | None] = [None] * len(keys)
        kbs = [key.to_bytes() for key in keys]
        values = reads.lookup(kbs)
        by_seg: dict[int, list[tuple[int, Location, bytes]]] = {}
        for i, value in enumerate(values):
            found = None if value is None else unpack_entry(value)
            if found is not None and found[0].length == record_size(payload_bytes[i]):
                by_seg.setdefault(found[0].segment, []).append((i, found[0], found[1]))
        with index.rw.shared():
            check_open(index.closed, str(index.path))
            for seg, group in sorted(by_seg.items()):
                self._map_segment(seg, group, keys, out)
            hits = sum(x is not None for x in out)
            if hits:
                reads.segments.reads.paths["hot"] += hits
                reads.settle(kbs, values, [], out, hits=hits, misses=0)
        try:
            yield out
        finally:
            out.clear()  # (the views go with it)

    def _map_segment(self, seg: int, group: list[tuple[int, Location, bytes]], keys: Sequence[RecordKey],
                     out: list[MappedPayload | None]) -> None:
        """Fill ``out`` with segment ``seg``'s records of ``group`` (index in the call,
        location, the index's checksum) that its file covers, the page cache holds and
        that pass their checks."""
        group.sort(key=lambda job: job[1].offset)
        engine = self.reads.segments.reads
        verifier = self.reads.parts_verifier()
        try:
            with engine.files.use(seg, direct=False) as fd:
                st = os.fstat(fd)
                if st.st_nlink == 0:  # unlinked by gc: nothing of it is indexed any more
                    self._forget(seg)
                    return
                hot = self._cached([job for job in group if job[1].end <= st.st_size], fd)
                if not hot:
                    return
                m = self._map_of(seg, fd, st.st_ino, st.st_size, hot[-1][1].end)
        except OSError:
            return  # gone (gc) or unreadable: the ordinary read makes them misses
        mm, view = m.mm, m.view
        for i, loc, checksum in hot:
            at, end = loc.offset, loc.end
            meta = verifier.verify(mm[at:at + HEADER_BYTES], b"", mm[end - CHECKSUM_BYTES:end], key=keys[i],
                                   record_bytes=loc.length, checksum=checksum, hashed=False)
            if meta is not None:
                out[i] = MappedPayload(meta, view[at + HEADER_BYTES:end - CHECKSUM_BYTES])

    @staticmethod
    def _cached(covered: list[tuple[int, Location, bytes]], fd: int) -> list[tuple[int, Location, bytes]]:
        """The records of ``covered`` (file order) whose run of records the page cache
        holds in full: one ``cachestat`` for them all when it holds the whole span (the
        hot case), else one per run (:func:`~.read_tasks.extents`)."""
        if not covered:
            return []
        whole = libc.cached_pages(fd, covered[0][1].offset, covered[-1][1].end - covered[0][1].offset)
        if whole is None:
            return []  # (no cachestat: not known to be cached, read the ordinary way)
        if whole[0] >= whole[1]:
            return covered
        hot = []
        for a, b in extents([loc for _, loc, _ in covered]):
            start, end = covered[a][1].offset, covered[b - 1][1].end
            cached = libc.cached_pages(fd, start, end - start)
            if cached is not None and cached[0] >= cached[1]:
                hot += covered[a:b]
        return hot

    def _map_of(self, seg: int, fd: int, ino: int, size: int, need: int) -> _Map:
        """Segment ``seg``'s map, covering at least ``need`` bytes (the file is ``size``
        long now): the kept one, else a new one over the whole file."""
        with self._lock:
            m = self._maps.get(seg)
            if m is not None and m.ino == ino and m.length >= need:
                self._maps.move_to_end(seg)
                return m
        m = _Map(fd, ino, size)
        with self._lock:
            self._maps[seg] = m  # (replacing a shorter one: readers of it keep theirs)
            self._maps.move_to_end(seg)
            while len(self._maps) > MAX_MAPS:
                self._maps.popitem(last=False)
        return m

    def _forget(self, seg: int) -> None:
        with self._lock:
            self._maps.pop(seg, None)
