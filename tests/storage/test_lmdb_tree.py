"""The LMDB store's prefix tree (storage/lmdb/tree.py): eviction takes leaves first, a block
left without a child goes with it, the guard still holds, and stores without the tree
(written before it) open and evict in plain LRU order.

Paths here: blocks chained by their parent hash (``b0 -> b1 -> b2``), snapshots keyed by
the hash of the block they were taken at, every record the same size, so ``max_bytes`` of
N records makes the N+1-th put evict exactly as many as the order says.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import lmdb
import numpy as np
import pytest

from storage_helpers import FP
from tree_helpers import N, ONE, ROOT, block, chain, path_items
from tiered_kv.storage import LmdbStore, PutItem, RecordKey, StoreFullError

def held(store: LmdbStore) -> set[tuple[str, int]]:
    return {(k.kind.name, k.block_hash[:4].hex()) for k in store}  # type: ignore[misc]


def names(items: Sequence[PutItem]) -> set[tuple[str, int]]:
    return {(i.key.kind.name, i.key.block_hash[:4].hex()) for i in items}  # type: ignore[misc]


def read(store: LmdbStore, items: Sequence[PutItem]) -> None:
    metas = store.get_many([i.key for i in items], [np.empty(N, np.uint8) for _ in items])
    assert all(m is not None for m in metas)


def test_a_path_goes_from_its_end_back_to_its_last_snapshot(tmp_path: Path) -> None:
    """b0 (snapshot) -> b1 -> b2 (snapshot), written root first, so a flat LRU would take
    b0 first and strand the rest. Once a resume at b0 read b0 and its snapshot, the end
    snapshot is the least recently used leaf: it goes, then the blocks after the last
    snapshot left (b2, b1); b0 and its snapshot stay."""
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})
    other = block(chain("q", 1)[0], ROOT)
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=5 * ONE) as store:
        assert store.put_many(items) == [True] * 5
        read(store, items[:2])
        assert store.put_many([other]) == [True]
        assert held(store) == names([items[0], items[1], other])  # b0, its snapshot, q0
        assert store.stats()["evictions"] == 3
        assert store.verify()["index_problems"] == []


def test_an_interior_snapshot_goes_alone_when_it_is_the_oldest_leaf(tmp_path: Path) -> None:
    """A snapshot with blocks after it is a leaf of the tree: when it is the least recently
    used leaf it goes alone (the path stays whole, resumable at its end)."""
    p = chain("p", 2)
    items = path_items(p, snaps_at={0, 1})  # b0, s0, b1, s1
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=4 * ONE) as store:
        store.put_many(items)
        read(store, [items[3], items[2], items[0]])  # a resume at b1's end: s0 untouched
        store.put_many([block(chain("q", 1)[0], ROOT)])
        assert RecordKey.snapshot(p[0]) not in set(store)
        assert {RecordKey.block(p[0]), RecordKey.block(p[1]), RecordKey.snapshot(p[1])} <= set(store)
        assert store.stats()["evictions"] == 1


def test_leaves_go_in_lru_order_across_paths(tmp_path: Path) -> None:
    """Two paths; the one read last stays whole, the other goes end first."""
    a, b = chain("a", 2), chain("b", 2)
    pa, pb = path_items(a, snaps_at={1}), path_items(b, snaps_at={1})
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=6 * ONE) as store:
        store.put_many(pa + pb)
        read(store, pa)  # a is now the more recent path
        store.put_many([block(chain("c", 1)[0], ROOT)])  # evicts b's snapshot, then b1, b0
        assert held(store) == names(pa) | names([block(chain("c", 1)[0], ROOT)])
        assert store.stats()["evictions"] == 3


def test_a_child_written_before_its_parent_still_holds_it(tmp_path: Path) -> None:
    """Links are counted whatever the order of the puts (the async writer may store a
    child first): the parent arriving later is parked at once."""
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})  # b0, b1, s1
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=3 * ONE) as store:
        store.put_many([items[2]])
        store.put_many([items[1]])
        store.put_many([items[0]])  # b0: the newest access, but the only interior record left is b0
        store.put_many([block(chain("q", 1)[0], ROOT)])  # s1 goes, then b1, then b0 with it
        assert held(store) == names([block(chain("q", 1)[0], ROOT)])


def test_gc_takes_leaves_first_too(tmp_path: Path) -> None:
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})  # b0 s0 b1 b2 s2
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=10 * ONE) as store:
        store.put_many(items)
        read(store, items[:2])  # a resume at b0: s2 is the least recently used leaf
        got = store.gc(2 * ONE)
        assert got["evicted"] == 3 and held(store) == names(items[:2])


class _Guard:
    def __init__(self, keys: set[RecordKey]) -> None:
        self.keys = keys

    def __call__(self, keys: Sequence[RecordKey]) -> Collection[RecordKey]:
        return [k for k in keys if k in self.keys]


def test_the_guard_holds_blocks_of_a_path_and_a_held_block_stays_as_a_leaf(tmp_path: Path) -> None:
    """A guarded block (its upload pending) is not taken with the path's end; it stays,
    a leaf now, and is the next to go once the guard lets it."""
    p = chain("p", 3)
    items = path_items(p, snaps_at={2})  # b0 b1 b2 s2
    q = [block(h, ROOT) for h in chain("q", 3)]
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=4 * ONE) as store:
        store.put_many(items)
        guard = _Guard({RecordKey.block(p[1])})
        store.eviction_guard = guard
        store.put_many([q[0]])  # s2, b2 go; b1 is held, so b0 (its parent) stays too
        assert held(store) == names([items[0], items[1], q[0]])
        guard.keys = set()
        store.put_many([q[1]])  # (room for it)
        store.put_many([q[2]])  # b1 is the least recently used leaf now: it goes, and b0 with it
        assert held(store) == names(q)


def test_a_put_still_raises_store_full_when_the_guard_holds_every_record(tmp_path: Path) -> None:
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=3 * ONE) as store:
        store.put_many(items)
        store.eviction_guard = _Guard({i.key for i in items})
        with pytest.raises(StoreFullError, match="eviction guard"):
            store.put_many([block(chain("q", 1)[0], ROOT)])
        assert held(store) == names(items)


def test_only_when_the_guard_holds_every_leaf_does_an_interior_record_go(tmp_path: Path) -> None:
    """The parked records are the fallback: a put finds room rather than a StoreFullError
    while anything the guard does not hold could go (as before the tree)."""
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})  # b0 b1 s1
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=3 * ONE) as store:
        store.put_many(items)
        store.eviction_guard = _Guard({RecordKey.snapshot(p[1])})
        store.put_many([block(chain("q", 1)[0], ROOT)])  # the only leaf is held: b0, the oldest parked
        assert RecordKey.block(p[0]) not in set(store)
        assert store.verify()["index_problems"] == []


def _drop_tree(where: Path) -> None:
    """Make ``where`` what a store written before the tree is: no parked, parent, kids."""
    env = lmdb.open(str(where), max_dbs=8)
    try:
        with env.begin(write=True) as txn:
            lru = env.open_db(b"lru", txn=txn, create=False)
            parked = env.open_db(b"parked", txn=txn, create=False)
            for k, _ in list(txn.cursor(db=parked)):  # every record back in the one LRU
                txn.put(bytes(k), b"", db=lru)
            for name in (b"parked", b"parent", b"kids"):
                txn.drop(env.open_db(name, txn=txn, create=False), delete=True)
    finally:
        env.close()


def test_a_store_written_before_the_tree_opens_and_evicts_in_plain_lru_order(tmp_path: Path) -> None:
    where = tmp_path / "s"
    p = chain("p", 3)
    items = path_items(p, snaps_at={2})  # b0 b1 b2 s2
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=4 * ONE) as store:
        store.put_many(items)
    _drop_tree(where)
    with LmdbStore(where, layout_fingerprint=FP, readonly=True) as store:  # readonly: no tree, reads fine
        read(store, items)
        assert store.verify()["index_problems"] == []
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=4 * ONE) as store:
        assert store.verify()["index_problems"] == []  # the tree's tables are created empty
        q = chain("q", 2)
        store.put_many([block(q[0], ROOT)])  # no links: b0 is the oldest, so it goes (plain LRU)
        assert RecordKey.block(p[0]) not in set(store)
        store.put_many([block(q[1], q[0])])  # new records are linked: q0 is parked, b1 goes
        assert RecordKey.block(p[1]) not in set(store) and RecordKey.block(q[0]) in set(store)
        assert store.verify()["index_problems"] == []


def test_verify_finds_a_wrong_count_and_repair_recounts_the_tree(tmp_path: Path) -> None:
    where = tmp_path / "s"
    p = chain("p", 2)
    items = path_items(p, snaps_at={1})
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=3 * ONE) as store:
        store.put_many(items)
    env = lmdb.open(str(where), max_dbs=8)
    try:  # what an older version writing the store would leave: b1's last child gone, b1 parked
        with env.begin(write=True) as txn:
            kids = env.open_db(b"kids", txn=txn, create=False)
            txn.put(RecordKey.block(p[1]).to_bytes(), (7).to_bytes(4, "little"), db=kids)
    finally:
        env.close()
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=3 * ONE) as store:
        got = store.verify()
        assert any(line.startswith("kids: a count that disagrees") for line in got["index_problems"])
        store.verify(repair=True)
        assert store.verify()["index_problems"] == []
        store.put_many([block(chain("q", 1)[0], ROOT)])  # the repaired tree: s1 goes, then b1, b0
        assert held(store) == names([block(chain("q", 1)[0], ROOT)])


def test_a_rebuilt_index_has_the_tree(tmp_path: Path) -> None:
    where = tmp_path / "s"
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=5 * ONE) as store:
        store.put_many(items)
    (where / "data.mdb").unlink()
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=5 * ONE) as store:
        assert store.index_rebuild is not None and held(store) == names(items)
        assert store.verify()["index_problems"] == []
        read(store, items[:2])
        store.put_many([block(chain("q", 1)[0], ROOT)])  # s2 goes, with b2 and b1
        assert held(store) == names([items[0], items[1], block(chain("q", 1)[0], ROOT)])


_WRITER = """
import hashlib, sys
import numpy as np
sys.path.insert(0, sys.argv[3])
from storage_helpers import FP, digest_for, payload_for
from tree_helpers import N, ONE, ROOT, block, chain, path_items, snap
from tiered_kv.storage import LmdbStore, PutItem, RecordKey
where, order = sys.argv[1], sys.argv[2]
root = hashlib.sha256(b"namespace").digest()
with LmdbStore(where, layout_fingerprint=FP, max_bytes=int(sys.argv[4])) as store:
    for n in range(40):
        hashes, p = [], root
        for i in range(6):
            p = hashlib.sha256(p + f"path{n % 25}-{i}".encode()).digest()
            hashes.append(p)
        items = []
        for i, h in enumerate(hashes):
            key = RecordKey.block(h)
            parent = hashes[i - 1] if i else root
            items.append(PutItem(key, parent_hash=parent, token_digest=digest_for(key), payload=payload_for(key, 64)))
            if i in (2, 5):
                key = RecordKey.snapshot(h)
                items.append(PutItem(key, parent_hash=parent, token_digest=digest_for(key), payload=payload_for(key, 64)))
        if order == "leaves-first":
            items.reverse()
        for k in range(0, len(items), 3):  # several transactions per path, racing the other writer
            store.put_many(items[k:k + 3])
"""


def test_two_processes_writing_one_store_keep_one_consistent_tree(tmp_path: Path) -> None:
    """The tree lives in the index's write transactions: two processes writing the same
    paths in opposite orders (children before parents in one of them), both evicting,
    leave a tree that verify finds consistent (counts equal the links, every access
    entry in the order table its count says), and records that all verify."""
    import subprocess
    import sys

    where = tmp_path / "s"
    helpers = str(Path(__file__).parent)
    bound = str(40 * ONE)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(where), order, helpers, bound])
             for order in ("root-first", "leaves-first")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    with LmdbStore(where, layout_fingerprint=FP, max_bytes=40 * ONE) as store:
        s = store.stats()
        assert s["lifetime_evictions"] > 0 and 0 < s["records"] <= 40
        got = store.verify()
        assert got["index_problems"] == [] and got["corrupt"] == 0


def test_the_store_reports_the_keys_each_eviction_took_after_it_committed(tmp_path: Path) -> None:
    """``on_evict`` (off by default) is told, per put or gc, exactly the keys that left the
    index, once the transaction committed (they are gone when it runs); a listener that
    raises is logged and the put still succeeds."""
    p = chain("p", 3)
    items = path_items(p, snaps_at={0, 2})  # b0 s0 b1 b2 s2
    q = block(chain("q", 1)[0], ROOT)
    told: list[tuple[list[RecordKey], set[RecordKey]]] = []
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP, max_bytes=5 * ONE) as store:
        assert store.on_evict is None
        store.put_many(items)
        store.on_evict = lambda keys: told.append((keys, set(store)))
        read(store, items[:2])
        store.put_many([q])  # s2, then b2, b1 with it
        assert len(told) == 1
        keys, present = told[0]
        assert len(keys) == 3 and set(keys) == {RecordKey.snapshot(p[2]), RecordKey.block(p[2]), RecordKey.block(p[1])}
        assert not present & set(keys)
        told.clear()
        store.gc(ONE)  # of b0, s0 and q, two go
        assert len(told) == 1 and len(told[0][0]) == store.stats()["evictions"] - 3
        assert not set(told[0][0]) & set(store)

        def fails(keys: list[RecordKey]) -> None:
            raise RuntimeError("listener")

        store.on_evict = fails
        assert store.put_many([block(chain("r", 1)[0], ROOT), block(chain("r2", 1)[0], ROOT)]) == [True, True]
        store.on_evict = None
