"""Which records an eviction takes: least recently used first, past those a guard holds.

Every backend that evicts (LMDB, Zarr) walks its records in LRU order and takes them with
:func:`select_victims`, so the order, the guard (:attr:`~.store.BlockStore.eviction_guard`:
a chain's level 0 keeps the records whose upload is pending) and the bound on how far a
put walks past guarded records are the same everywhere.

Both keep a prefix tree of their records (LMDB: storage/lmdb/tree.py, in its index; Zarr:
storage/zarr/tree.py, in memory) and evict leaves first with :func:`evict_leaves_first`:
the least recently used leaf the guard does not hold, then the blocks that led only to it
up its path, and an interior record only when the guard holds every leaf. What an
eviction took goes to the store's ``on_evict`` through :func:`tell_evicted`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TypeVar

from ..format.record import RecordKey

__all__ = ["GUARD_SCAN_MAX", "EvictListener", "EvictionGuard", "evict_leaves_first", "select_victims", "tell_evicted"]

#: Which of some eviction candidates (``RecordKey`` s, least recently used first) must stay:
#: returns that subset. Called inside the evicting store's write path, so it must be quick
#: and must not call back into that store.
EvictionGuard = Callable[[Sequence[RecordKey]], Collection[RecordKey]]
#: Candidates handed to an eviction guard per call.
_GUARD_BATCH = 256
#: Guarded records an eviction walks past before it gives up (a put then raises
#: StoreFullError): bounds the cost of a put when level 0 is full of pending uploads.
GUARD_SCAN_MAX = 1 << 16

log = logging.getLogger(__name__)

#: Told the keys of the records an eviction took (a store's ``on_evict``).
EvictListener = Callable[[list[RecordKey]], None]


def tell_evicted(listener: EvictListener | None, keys: list[RecordKey]) -> None:
    """Hand ``keys`` (what an eviction took, already removed) to a store's ``on_evict``
    ``listener``, when set and there are any, on the calling thread. A listener that
    raises is logged, never the store's error: the records are gone either way."""
    if listener is None or not keys:
        return
    try:
        listener(keys)
    except Exception:
        log.exception("the store's on_evict listener failed (the records are evicted all the same)")


H = TypeVar("H")


def select_victims(candidates: Iterable[tuple[H, RecordKey | None, int]], excess: int,
                   guard: EvictionGuard | None, *, max_records: int | None = None) -> tuple[list[H], int, int]:
    """Pick records to evict: ``candidates`` are ``(handle, key, bytes)`` least recently
    used first (``key`` None: never guarded, e.g. a stored key that is not a RecordKey);
    taken in order, skipping those ``guard`` holds, until their bytes reach ``excess`` or
    ``max_records`` were taken. Returns ``(handles taken, bytes taken, guarded records
    walked past)``; the walk gives up after :data:`GUARD_SCAN_MAX` guarded records."""
    taken: list[H] = []
    freed = kept = 0
    it = iter(candidates)
    while freed < excess and (max_records is None or len(taken) < max_records) and kept < GUARD_SCAN_MAX:
        batch = list(itertools.islice(it, _GUARD_BATCH if guard is not None else 1))
        if not batch:
            break
        held = guard([key for _, key, _ in batch if key is not None]) if guard is not None else ()
        for handle, key, size in batch:
            if key is not None and key in held:
                kept += 1
                continue
            taken.append(handle)
            freed += size
            if freed >= excess or (max_records is not None and len(taken) >= max_records):
                break
    return taken, freed, kept


def evict_leaves_first(orders: Sequence[Callable[[], Iterable[tuple[H, RecordKey | None, int]]]], excess: int,
                       remove: Callable[[H, list[H]], int | None], guard: EvictionGuard | None, *,
                       key_of: Callable[[H], RecordKey | None],
                       max_records: int | None = None) -> tuple[list[H], int, int]:
    """Evict leaves first over a store's prefix tree until ``excess`` bytes are freed or
    ``max_records`` records were evicted.

    ``orders``: the store's order tables, the leaves (records with no resident child)
    first, then the interior records; each called for its candidates, ``(handle, key,
    bytes)`` least recently used first (as :func:`select_victims` takes them), and walked
    only while the tables before it freed too little (so an interior record goes only when
    the guard holds every leaf, or too few are left). ``remove(handle, released)``:
    removes that record from the store's index if it is still there and returns its
    bytes (None: gone already, taken along with a path), appending to ``released`` its
    resident parent when it was that parent's last child. A released parent (a block with
    no snapshot and no block after it left: no resume can use it) is removed at once, and
    so on up the path, unless the guard holds it (it stays, a leaf) or ``max_records`` is
    reached. Returns ``(handles evicted in order, bytes freed, guarded records walked
    past)``; the caller decides whether too few bytes left is an error
    (StoreFullError when ``kept`` and a put needed room)."""
    evicted: list[H] = []
    freed = kept = 0
    released: list[H] = []

    def done() -> bool:
        return freed >= excess or (max_records is not None and len(evicted) >= max_records)

    for walk in orders:
        if done():
            continue
        left = None if max_records is None else max_records - len(evicted)
        victims, _, walked_past = select_victims(walk(), excess - freed, guard, max_records=left)
        kept += walked_past
        for handle in victims:
            if done():
                break  # (the blocks taken with a path made room already)
            size = remove(handle, released)
            if size is None:
                continue  # taken with a path meanwhile
            freed += size
            evicted.append(handle)
            while released and (max_records is None or len(evicted) < max_records):
                parent = released.pop()
                if guard is not None:
                    key = key_of(parent)
                    if key is not None and key in guard([key]):
                        continue
                size = remove(parent, released)
                if size is not None:
                    freed += size
                    evicted.append(parent)
            released.clear()
    return evicted, freed, kept
