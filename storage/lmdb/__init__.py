"""The LMDB backend: an LMDB index over append-only, self-verifying segment files.

One directory per store (the layout: :mod:`.store`). LMDB is the index; the records
live in segment files, which are the store's write-ahead log (WiscKey-style):

==================  ======================================================================
store.py            :class:`LmdbStore`, the facade over the parts below
schema.py           sub-databases, meta keys, codecs, the directory layout (written once)
environment.py      the LMDB environment: opened once its index file checked whole
pages.py            ``data.mdb`` read without mapping it: is the index whole?
access.py           access times, the LRU order, lifetime counters
segments.py         the segment files: ownership, appends, reclaiming space
open_files.py       read descriptors of segment files, shared (an LRU)
claims.py           the store directories open in this process
reads.py            the read engine of the segment files (read_strategies.py: one small
                    object per strategy; read_tasks.py: what they share)
store_reads.py      lookups and the bookkeeping every read does (get_many and get_rows)
writes.py           put_many staged, appended, synced and indexed; deletes
group_commit.py     concurrent writers of one process share one sync and one index commit
recovery.py         what writers that died appended past their segments' indexed end
scan.py             the segment files read as the write-ahead log they are
rebuild.py          the index rebuilt from the segment files
maintenance.py      verify (and repair), gc, reclaiming space, the index reserve
==================  ======================================================================
"""

from __future__ import annotations

from .rebuild import rebuild_index
from .store import DEFAULT_MAX_BYTES, STORE_FORMAT_VERSION, LmdbStore, pack_entry, unpack_entry

__all__ = ["DEFAULT_MAX_BYTES", "STORE_FORMAT_VERSION", "LmdbStore", "pack_entry", "rebuild_index", "unpack_entry"]
