"""The Zarr store's prefix tree (storage/zarr/tree.py): eviction takes leaves first, a block
left without a child goes with it, the guard still holds, a scan links the records it
finds from their headers, records it cannot link evict in plain LRU order, and the store
reports what it evicts (``on_evict``), all as the LMDB store does (test_lmdb_tree.py).

Paths here: blocks chained by their parent hash (``b0 -> b1 -> b2``), snapshots keyed by
the hash of the block they were taken at, every record the same size, so ``max_bytes`` of
N records makes the N+1-th put evict exactly as many as the order says.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storage_helpers import FP
from tree_helpers import N, ONE, ROOT, block, chain, path_items
from tiered_kv.storage import PutItem, RecordKey, StoreFullError, ZarrStore
from tiered_kv.storage.api import GUARD_SCAN_MAX
from tiered_kv.storage.zarr.objects import object_name
from tiered_kv.storage.zarr.tree import RecordTree, parent_key

def held(store: ZarrStore) -> set[RecordKey]:
    return set(store)


def keys(items: Sequence[PutItem]) -> set[RecordKey]:
    return {i.key for i in items}


def read(store: ZarrStore, items: Sequence[PutItem]) -> None:
    metas = store.get_many([i.key for i in items], [np.empty(N, np.uint8) for _ in items])
    assert all(m is not None for m in metas)


def open_store(where: Any, bound: int | None, **kw: Any) -> ZarrStore:
    return ZarrStore(where, layout_fingerprint=FP, max_bytes=bound, **kw)


class _Guard:
    def __init__(self, keys: set[RecordKey]) -> None:
        self.keys = keys

    def __call__(self, keys: Sequence[RecordKey]) -> Collection[RecordKey]:
        return [k for k in keys if k in self.keys]


# ------------------------------------------------------------------------------ the tree alone
def test_the_tree_counts_children_and_moves_records_between_its_orders() -> None:
    p = chain("p", 2)
    b0, b1, s1 = RecordKey.block(p[0]), RecordKey.block(p[1]), RecordKey.snapshot(p[1])
    tree = RecordTree()
    tree.touch(s1, ONE, 1)
    tree.link(s1, parent_key(s1, p[0]))  # a snapshot's parent is its own block: b1, not stored yet
    assert tree.parent_of(s1) == b1 and tree.kids(b1) == 1 and tree.is_leaf(s1)
    tree.touch(b1, ONE, 2)  # stored after its child: interior at once
    tree.link(b1, parent_key(b1, p[0]))
    tree.touch(b0, ONE, 3)
    tree.link(b0, parent_key(b0, ROOT))
    assert not tree.is_leaf(b1) and not tree.is_leaf(b0) and tree.kids(b0) == 1 and tree.total == 3 * ONE
    assert list(tree.oldest_first()) == [s1, b1, b0]
    released: list[RecordKey] = []
    assert tree.remove(s1, released) is not None and released == [b1] and tree.is_leaf(b1)
    assert tree.remove(s1) is None and tree.total == 2 * ONE
    victims, kept = tree.evict(ONE, None)  # b1, the one leaf, then b0, left without a child
    assert [v.key for v in victims] == [b1, b0] and kept == 0 and len(tree) == 0 and tree.total == 0
    tree.restore(victims)
    assert list(tree.oldest_first()) == [b1, b0] and tree.is_leaf(b1) and not tree.is_leaf(b0)


# ------------------------------------------------------------------------------ eviction orders
def test_a_path_goes_from_its_end_back_to_its_last_snapshot(tmp_path: Path) -> None:
    """b0 (snapshot) -> b1 -> b2 (snapshot), written root first, so a flat LRU would take
    b0 first and strand the rest. Once a resume at b0 read b0 and its snapshot, the end
    snapshot is the least recently used leaf: it goes, then the blocks after the last
    snapshot left (b2, b1); b0 and its snapshot stay."""
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})
    other = block(chain("q", 1)[0], ROOT)
    with open_store(tmp_path / "s", 5 * ONE) as store:
        assert store.put_many(items) == [True] * 5
        read(store, items[:2])
        assert store.put_many([other]) == [True]
        assert held(store) == keys([items[0], items[1], other])  # b0, its snapshot, q0
        assert store.stats()["evictions"] == 3
        assert store.verify()["corrupt"] == 0


def test_an_interior_snapshot_goes_alone_when_it_is_the_oldest_leaf(tmp_path: Path) -> None:
    p = chain("p", 2)
    items = path_items(p, snaps_at={0, 1})  # b0, s0, b1, s1
    with open_store(tmp_path / "s", 4 * ONE) as store:
        store.put_many(items)
        read(store, [items[3], items[2], items[0]])  # a resume at b1's end: s0 untouched
        store.put_many([block(chain("q", 1)[0], ROOT)])
        assert held(store) == keys([items[0], items[2], items[3], block(chain("q", 1)[0], ROOT)])
        assert store.stats()["evictions"] == 1


def test_leaves_go_in_lru_order_across_paths(tmp_path: Path) -> None:
    """Two paths; the one read last stays whole, the other goes end first."""
    a, b = chain("a", 2), chain("b", 2)
    pa, pb = path_items(a, snaps_at={1}), path_items(b, snaps_at={1})
    c = block(chain("c", 1)[0], ROOT)
    with open_store(tmp_path / "s", 6 * ONE) as store:
        store.put_many(pa + pb)
        read(store, pa)  # a is now the more recent path
        store.put_many([c])  # evicts b's snapshot, then b1, b0
        assert held(store) == keys(pa) | {c.key}
        assert store.stats()["evictions"] == 3


def test_a_child_written_before_its_parent_still_holds_it(tmp_path: Path) -> None:
    """Links are counted whatever the order of the puts (the async writer may store a
    child first): the parent arriving later is interior at once."""
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})  # b0, b1, s1
    q = block(chain("q", 1)[0], ROOT)
    with open_store(tmp_path / "s", 3 * ONE) as store:
        store.put_many([items[2]])
        store.put_many([items[1]])
        store.put_many([items[0]])  # b0: the newest access, but interior
        store.put_many([q])  # s1 goes, then b1, then b0 with it
        assert held(store) == {q.key}


def test_gc_takes_leaves_first_too(tmp_path: Path) -> None:
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})  # b0 s0 b1 b2 s2
    with open_store(tmp_path / "s", 10 * ONE) as store:
        store.put_many(items)
        read(store, items[:2])  # a resume at b0: s2 is the least recently used leaf
        got = store.gc(2 * ONE)
        assert got["evicted"] == 3 and got["freed_bytes"] == 3 * ONE and held(store) == keys(items[:2])


def test_a_branch_point_stays_while_another_branch_holds_it(tmp_path: Path) -> None:
    """b0 -> b1 -> {x, y}: the older branch's end goes, and the walk up its path stops at
    b1, which still leads to the other branch."""
    p = chain("p", 2)
    x, y = block(chain("x", 1, p[1])[0], p[1]), block(chain("y", 1, p[1])[0], p[1])
    items = path_items(p, snaps_at=())
    with open_store(tmp_path / "s", 4 * ONE) as store:
        store.put_many([*items, x, y])
        store.put_many([block(chain("q", 1)[0], ROOT)])  # x, the oldest leaf, goes alone
        assert held(store) == keys([*items, y, block(chain("q", 1)[0], ROOT)])
        assert store.stats()["evictions"] == 1


# ------------------------------------------------------------------------------ the guard
def test_the_guard_holds_blocks_of_a_path_and_a_held_block_stays_as_a_leaf(tmp_path: Path) -> None:
    p = chain("p", 3)
    items = path_items(p, snaps_at={2})  # b0 b1 b2 s2
    q = [block(h, ROOT) for h in chain("q", 3)]
    with open_store(tmp_path / "s", 4 * ONE) as store:
        store.put_many(items)
        guard = _Guard({RecordKey.block(p[1])})
        store.eviction_guard = guard
        store.put_many([q[0]])  # s2, b2 go; b1 is held, so b0 (its parent) stays too
        assert held(store) == keys([items[0], items[1], q[0]])
        guard.keys = set()
        store.put_many([q[1]])  # (room for it)
        store.put_many([q[2]])  # b1 is the least recently used leaf now: it goes, and b0 with it
        assert held(store) == keys(q)


def test_a_put_still_raises_store_full_when_the_guard_holds_every_record(tmp_path: Path) -> None:
    """Nothing is evicted by the failed put, and the tree is as it was: once the guard
    lets go, the next put evicts in the order it would have."""
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})  # b0 b1 s1
    q = block(chain("q", 1)[0], ROOT)
    told: list[list[RecordKey]] = []
    with open_store(tmp_path / "s", 3 * ONE) as store:
        store.put_many(items)
        store.on_evict = told.append
        store.eviction_guard = _Guard({i.key for i in items})
        with pytest.raises(StoreFullError, match="eviction guard"):
            store.put_many([q])
        assert held(store) == keys(items) and told == [] and store.stats()["evictions"] == 0
        store.eviction_guard = None
        store.put_many([q])  # s1, then b1 and b0 with it
        assert held(store) == {q.key} and told == [[items[2].key, items[1].key, items[0].key]]


def test_only_when_the_guard_holds_every_leaf_does_an_interior_record_go(tmp_path: Path) -> None:
    """The interior records are the fallback: a put finds room rather than a
    StoreFullError while anything the guard does not hold could go (as before the tree)."""
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})  # b0 b1 s1
    with open_store(tmp_path / "s", 3 * ONE) as store:
        store.put_many(items)
        store.eviction_guard = _Guard({RecordKey.snapshot(p[1])})
        store.put_many([block(chain("q", 1)[0], ROOT)])  # the only leaf is held: b0, the oldest interior
        assert RecordKey.block(p[0]) not in held(store) and RecordKey.snapshot(p[1]) in held(store)


def test_the_guard_bound_is_the_shared_one() -> None:
    """Zarr and LMDB walk past at most GUARD_SCAN_MAX guarded records (api/eviction.py)."""
    tree = RecordTree()
    n = GUARD_SCAN_MAX + 10
    ks = [RecordKey.block(hashlib.sha256(i.to_bytes(4, "little")).digest()) for i in range(n)]
    for i, k in enumerate(ks):
        tree.touch(k, 1, i + 1)
    victims, kept = tree.evict(1, _Guard(set(ks[:GUARD_SCAN_MAX + 5])))
    assert victims == [] and kept == GUARD_SCAN_MAX and len(tree) == n


# ------------------------------------------------------------------------------ scans and links
def test_a_reopened_store_links_its_records_from_their_headers(tmp_path: Path) -> None:
    """A new handle has no links in memory: its scan reads each record's header (one
    pread, O_NOATIME), so it evicts leaves first at once; the header reads move no access
    time (the LRU order survives the open)."""
    where = tmp_path / "s"
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})  # b0 s0 b1 b2 s2
    other = block(chain("q", 1)[0], ROOT)
    with open_store(where, 5 * ONE) as store:
        store.put_many(items)
        read(store, items[:2])
    atimes = {i.key: os.stat(where / object_name(i.key)).st_atime_ns for i in items}
    with open_store(where, 5 * ONE) as store:
        assert {i.key: os.stat(where / object_name(i.key)).st_atime_ns for i in items} == atimes
        store.put_many([other])  # s2, then b2, b1 with it (plain LRU would take b1 first)
        assert held(store) == keys([items[0], items[1], other])


def test_records_that_cannot_be_linked_are_leaves_in_plain_lru_order(tmp_path: Path) -> None:
    """Where no header can be read (here: header reads off), the records a scan finds are
    unlinked leaves: plain LRU among them, as before the tree. Records put from then on
    are linked."""
    where = tmp_path / "s"
    p = chain("p", 3)
    items = path_items(p, snaps_at={2})  # b0 b1 b2 s2
    with open_store(where, 4 * ONE) as store:
        store.put_many(items)
    store = open_store(where, 4 * ONE)
    try:
        store._objects.reads_headers = False  # what a store that cannot read a header sees
        store._rescan()
        q = chain("q", 2)
        store.put_many([block(q[0], ROOT)])  # no links: b0 is the oldest, so it goes (plain LRU)
        assert RecordKey.block(p[0]) not in held(store)
        store.put_many([block(q[1], q[0])])  # new records are linked: q0 is interior, b1 goes
        assert RecordKey.block(p[1]) not in held(store) and RecordKey.block(q[0]) in held(store)
    finally:
        store.close()


def test_without_max_bytes_a_scan_reads_no_header(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where = tmp_path / "s"
    with open_store(where, None) as store:
        store.put_many(path_items(chain("p", 3), snaps_at={2}))
    from tiered_kv.storage.zarr import local

    calls: list[str] = []
    real = local.LocalObjects.read_header
    monkeypatch.setattr(local.LocalObjects, "read_header", lambda self, name: calls.append(name) or real(self, name))
    with open_store(where, None) as store:
        assert len(store) == 4 and calls == []
    with open_store(where, 10 * ONE) as store:
        assert len(calls) == 4  # the open's scan: one header each
        assert len(store) == 4 and len(calls) == 4  # later scans: the records are linked already


def test_a_scan_links_what_another_handle_wrote(tmp_path: Path) -> None:
    """Two handles on one directory: what the other wrote, this one's next scan finds and
    links from the headers, so its evictions take that path end first too."""
    where = tmp_path / "s"
    p = chain("p", 3)
    items = path_items(p, snaps_at={2})  # b0 b1 b2 s2
    mine = block(chain("m", 1)[0], ROOT)
    with open_store(where, 5 * ONE) as a, open_store(where, 5 * ONE) as b:
        a.put_many([mine])
        b.put_many(items)
        assert len(a) == 5  # a's scan: b's records, linked from their headers
        read(a, [mine])
        a.put_many([block(chain("n", 1)[0], ROOT)])  # s2, then b2, b1, b0 (plain LRU: b0 alone)
        assert held(a) == {mine.key, RecordKey.block(chain("n", 1)[0])}


def test_a_store_over_a_zarr_memory_store_links_by_byte_range_reads() -> None:
    """Any other zarr Store: the headers come from byte-range gets (here a MemoryStore
    shared by two handles; the second has no links of its own)."""
    from zarr.storage import MemoryStore

    mem = MemoryStore()
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})  # b0 s0 b1 b2 s2
    with open_store(mem, 5 * ONE) as first:
        first.put_many(items)
    with open_store(mem, 5 * ONE) as store:
        read(store, items[:2])  # (no stored access times here: the reads order them)
        read(store, items[2:])
        read(store, items[:2])
        store.put_many([block(chain("q", 1)[0], ROOT)])  # s2, then b2, b1
        assert held(store) == keys([items[0], items[1], block(chain("q", 1)[0], ROOT)])


def test_a_corrupt_header_leaves_its_record_unlinked(tmp_path: Path) -> None:
    where = tmp_path / "s"
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})  # b0 b1 s1
    with open_store(where, 3 * ONE) as store:
        store.put_many(items)
    path = where / object_name(items[1].key)  # b1: its magic broken
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"XXXX")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with open_store(where, 3 * ONE) as store:
        tree = store._tree
        assert tree.parent_of(items[1].key) is None and tree.parent_of(items[2].key) == items[1].key
        assert tree.parent_of(items[0].key) == RecordKey.block(ROOT) and tree.is_leaf(items[0].key)


# ------------------------------------------------------------------------------ on_evict
def test_the_store_reports_the_keys_each_eviction_took(tmp_path: Path) -> None:
    """``on_evict`` (off by default) is told, per put or gc, exactly the keys that left the
    store, once they are removed; a listener that raises is logged and the put still
    succeeds."""
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})  # b0 s0 b1 b2 s2
    q = block(chain("q", 1)[0], ROOT)
    told: list[tuple[list[RecordKey], set[RecordKey]]] = []
    with open_store(tmp_path / "s", 5 * ONE) as store:
        assert store.on_evict is None
        store.put_many(items)
        store.on_evict = lambda ks: told.append((ks, set(store)))
        read(store, items[:2])
        store.put_many([q])  # s2, then b2, b1 with it
        assert len(told) == 1
        got, present = told[0]
        assert got == [RecordKey.snapshot(p[2]), RecordKey.block(p[2]), RecordKey.block(p[1])]
        assert not present & set(got)
        told.clear()
        store.gc(ONE)  # of b0, s0 and q, two go
        assert len(told) == 1 and len(told[0][0]) == store.stats()["evictions"] - 3 == 2
        assert not set(told[0][0]) & set(store)
        store.on_evict = None
        store.put_many([block(chain("z", 1)[0], ROOT)])
        assert len(told) == 1


def test_a_listener_that_raises_is_logged_and_the_eviction_stands(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    items = [block(h, ROOT) for h in chain("r", 3)]

    def fails(ks: list[RecordKey]) -> None:
        raise RuntimeError("listener")

    with open_store(tmp_path / "s", 2 * ONE) as store:
        store.put_many(items[:2])
        store.on_evict = fails
        with caplog.at_level(logging.ERROR, logger="tiered_kv.storage.zarr.store"):
            assert store.put_many([items[2]]) == [True]
        assert "on_evict listener failed" in caplog.text
        assert held(store) == {items[1].key, items[2].key} and store.stats()["evictions"] == 1


def test_a_disk_tier_on_a_zarr_store_listens_for_its_evictions(tmp_path: Path, tiny_layout: Any) -> None:
    """The disk tier asks a store with ``on_evict`` to report (tiered_kv/disk.py), Zarr as
    LMDB, so the cache can prune memory blocks that led only to evicted records."""
    from tiered_kv.disk import DiskTier

    store = ZarrStore(tmp_path / "s", layout_fingerprint=tiny_layout.fingerprint, max_bytes=2 * ONE)
    tier = DiskTier(store, tiny_layout)
    try:
        assert store.on_evict is not None
        items = [block(h, ROOT) for h in chain("t", 3)]
        store.put_many(items[:2])  # (straight to the store: what the tier's writer thread does)
        store.put_many(items[2:])
        assert tier.take_evicted() == [items[0].key]
    finally:
        tier.close()
        store.close()
    assert store.on_evict is None
