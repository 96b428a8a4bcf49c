"""The LMDB backend: an LMDB index over append-only, self-verifying segment files.

One directory per store (the layout: :mod:`.store`). LMDB is the index; the records
live in segment files, which are the store's write-ahead log (WiscKey-style):

==================  ======================================================================
store.py            :class:`LmdbStore`, the store
segments.py         the segment files: ownership, appends, reads, reclaiming space
group_commit.py     concurrent writers of one process share one sync and one index commit
pages.py            ``data.mdb`` read without mapping it: is the index whole?
rebuild.py          the index rebuilt from the segment files
==================  ======================================================================
"""

from __future__ import annotations

from .rebuild import rebuild_index
from .store import DEFAULT_MAX_BYTES, STORE_FORMAT_VERSION, LmdbStore, pack_entry, unpack_entry

__all__ = ["DEFAULT_MAX_BYTES", "STORE_FORMAT_VERSION", "LmdbStore", "pack_entry", "rebuild_index", "unpack_entry"]
