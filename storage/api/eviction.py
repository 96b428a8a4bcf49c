"""Which records an eviction takes: least recently used first, past those a guard holds.

Every backend that evicts (LMDB, Zarr) walks its records in LRU order and takes them with
:func:`select_victims`, so the order, the guard (:attr:`~.store.BlockStore.eviction_guard`:
a chain's level 0 keeps the records whose upload is pending) and the bound on how far a
put walks past guarded records are the same everywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TypeVar

from ..format.record import RecordKey

__all__ = ["GUARD_SCAN_MAX", "EvictionGuard", "select_victims"]

#: Which of some eviction candidates (``RecordKey`` s, least recently used first) must stay:
#: returns that subset. Called inside the evicting store's write path, so it must be quick
#: and must not call back into that store.
EvictionGuard = Callable[[Sequence[RecordKey]], Collection[RecordKey]]
#: Candidates handed to an eviction guard per call.
_GUARD_BATCH = 256
#: Guarded records an eviction walks past before it gives up (a put then raises
#: StoreFullError): bounds the cost of a put when level 0 is full of pending uploads.
GUARD_SCAN_MAX = 1 << 16


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
