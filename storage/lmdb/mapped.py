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

Lifetime. One read-only ``MAP_SHARED`` map per segment a call touches, spanning its
records, made under the store's shared lock (``close`` waits for the ``with`` block) and
released when the block ends: the list given out is emptied then, and each map is
closed once nothing refers to it (a view that escaped keeps its map alive: Python's
buffer protocol never lets one dangle). Segment files are append-only, and the only
bytes this library ever cuts off a segment are ones no index entry covers, so what a
map covers stays in the file: a hole punched meanwhile (a delete, an eviction, gc)
reads as zeros and fails the caller's tag; a segment unlinked meanwhile stays readable
through the map until it is released.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import numpy as np

from ..api.store import MappedPayload, check_open
from ..format.record import CHECKSUM_BYTES, HEADER_BYTES, RecordKey, record_size
from ..os import libc
from .read_tasks import extents
from .schema import Location, unpack_entry
from .store_reads import StoreReads

__all__ = ["MappedReads"]


class MappedReads:
    """:meth:`map_unhashed` over one open store's index and segment files."""

    def __init__(self, reads: StoreReads) -> None:
        self.reads = reads

    @contextmanager
    def map_unhashed(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int]
                     ) -> Iterator[list[MappedPayload | None]]:
        """See :meth:`~tiered_kv.storage.api.store.BlockStore.map_unhashed` and the
        module docstring."""
        reads, index = self.reads, self.reads.index
        out: list[MappedPayload | None] = [None] * len(keys)
        kbs = [key.to_bytes() for key in keys]
        values = reads.lookup(kbs)
        by_seg: dict[int, list[tuple[int, Location, bytes]]] = {}
        for i, value in enumerate(values):
            found = None if value is None else unpack_entry(value)
            if found is not None and found[0].length == record_size(payload_bytes[i]):
                by_seg.setdefault(found[0].segment, []).append((i, found[0], found[1]))
        maps: list[mmap.mmap] = []
        try:
            with index.rw.shared():
                check_open(index.closed, str(index.path))
                for seg, group in sorted(by_seg.items()):
                    m = self._map_segment(seg, group, keys, out)
                    if m is not None:
                        maps.append(m)
                hits = sum(x is not None for x in out)
                if hits:
                    reads.segments.reads.paths["hot"] += hits
                    reads.settle(kbs, values, [], out, hits=hits, misses=0)
                yield out
        finally:
            out.clear()  # (the views go with it: then each map closes)
            for m in maps:
                try:
                    m.close()
                except BufferError:
                    pass  # a view escaped: its map is released with the last one

    def _map_segment(self, seg: int, group: list[tuple[int, Location, bytes]], keys: Sequence[RecordKey],
                     out: list[MappedPayload | None]) -> mmap.mmap | None:
        """Map segment ``seg``'s records of ``group`` (index in the call, location, the
        index's checksum) that its file covers and the page cache holds; fills ``out``
        with those that pass their checks. Returns the map (None: nothing mapped)."""
        group.sort(key=lambda job: job[1].offset)
        engine = self.reads.segments.reads
        verifier = self.reads.parts_verifier()
        with ExitStack() as held:
            try:
                fd = held.enter_context(engine.files.use(seg, direct=False))
                size = os.fstat(fd).st_size
            except OSError:
                return None  # gone (gc) or unreadable: the ordinary read makes them misses
            covered = [job for job in group if job[1].end <= size]
            if not covered:
                return None
            whole = libc.cached_pages(fd, covered[0][1].offset, covered[-1][1].end - covered[0][1].offset)
            if whole is None:
                return None  # (no cachestat: not known to be cached, read the ordinary way)
            if whole[0] >= whole[1]:  # the common hot case: one question for them all
                hot = covered
            else:
                hot = []
                for a, b in extents([loc for _, loc, _ in covered]):
                    start, end = covered[a][1].offset, covered[b - 1][1].end
                    cached = libc.cached_pages(fd, start, end - start)
                    if cached is not None and cached[0] >= cached[1]:
                        hot += covered[a:b]
            if not hot:
                return None
            base = libc.align_down(hot[0][1].offset)
            m = mmap.mmap(fd, hot[-1][1].end - base, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=base)
        view = np.frombuffer(m, np.uint8)
        for i, loc, checksum in hot:
            at, end = loc.offset - base, loc.end - base
            meta = verifier.verify(m[at:at + HEADER_BYTES], b"", m[end - CHECKSUM_BYTES:end], key=keys[i],
                                   record_bytes=loc.length, checksum=checksum, hashed=False)
            if meta is not None:
                out[i] = MappedPayload(meta, view[at + HEADER_BYTES:end - CHECKSUM_BYTES])
        return m
