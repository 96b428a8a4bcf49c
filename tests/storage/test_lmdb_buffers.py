"""A closed LMDB store gives back its O_DIRECT buffers, even while its owner keeps it.

Each writing thread stages its batches in a page-aligned buffer of at least 8 MiB, and
each reading thread has a bounce buffer of at least 1 MiB (storage/lmdb/segments.py,
reads.py). They are thread-local to the store's segment files, so before this they
lived as long as the store object: a server that closes a store and keeps the object (a
cache's disk tier, a CLI session) held tens of MB per closed store."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np

from tiered_kv.storage import LmdbStore
from tiered_kv.storage.lmdb import reads as reads_mod
from tiered_kv.storage.lmdb import segments as segments_mod

from storage_helpers import FP, item_for, make_key, verify_all


def _track(monkeypatch) -> list[weakref.ref]:
    made: list[weakref.ref] = []

    def tracked(nbytes: int, _real=segments_mod.aligned_buffer) -> np.ndarray:
        buf = _real(nbytes)
        made.append(weakref.ref(buf))
        return buf

    monkeypatch.setattr(segments_mod, "aligned_buffer", tracked)
    monkeypatch.setattr(reads_mod, "aligned_buffer", tracked)
    return made


def test_close_drops_staging_and_bounce_buffers(tmp_path, monkeypatch):
    made = _track(monkeypatch)
    store = LmdbStore(tmp_path / "s", layout_fingerprint=FP)
    keys = [make_key(i) for i in range(8)]

    def write_and_read(part: list) -> None:
        store.put_many([item_for(k, 70_000) for k in part])
        store._segments.reads.bounce(70_000)  # what an O_DIRECT read of this thread takes

    threads = [threading.Thread(target=write_and_read, args=(keys[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    write_and_read([])
    assert verify_all(store, sizes={k: 70_000 for k in keys}) == 8
    assert any(ref() is not None for ref in made), "the store staged nothing: the test checks nothing"

    store.close()
    gc.collect()
    alive = [ref() for ref in made if ref() is not None]
    assert not alive, f"{len(alive)} buffers ({sum(b.nbytes for b in alive)} B) outlive close()"
    assert store is not None  # (still referenced: the buffers went with close, not with the object)


def test_reopened_store_allocates_afresh(tmp_path):
    store = LmdbStore(tmp_path / "s", layout_fingerprint=FP)
    store.put_many([item_for(make_key(1), 70_000)])
    store.close()
    again = LmdbStore(tmp_path / "s", layout_fingerprint=FP)
    try:
        again.put_many([item_for(make_key(2), 70_000)])
        assert verify_all(again, sizes={make_key(1): 70_000, make_key(2): 70_000}) == 2
    finally:
        again.close()
