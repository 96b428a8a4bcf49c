"""How far each tier could resume a prompt, asked without loading anything (for routers).

A router that places a request on one of several engines wants to know, per engine, how
many of the prompt's tokens its cache would serve and from where, *before* choosing:
the GPU, the host, the local disk and the shared level differ in what a hit costs.
:meth:`ResumeIndex.lookup` answers that from each tier's index only: no record is read,
no reference taken, no LRU order changed (block pools are asked with ``lookup``, stores
with ``contains``; neither touches access order), so asking it is free of side effects.

Definitions (``bt`` = ``block_tokens``; tiers ordered nearest first, GPU < host < disk <
shared, each answer *cumulative*: "with this tier and the nearer ones")::

    limit              blocks a prompt of num_tokens may resume: (num_tokens - 1) // bt
                       (one token is always recomputed), at most the hashes given
    resident[t]        the longest prefix of blocks each held by some tier <= t
                       (the hit if every block boundary were resumable)
    resumable[t]       the longest k <= min(resident[t], limit) such that a tier <= t
                       holds the State snapshot at k: what ``TieredKVCache.open`` resumes
                       with tiers <= t (absent failures: a record failing verification
                       makes it resume less, a miss it counts)
    block_tiers[i]     the nearest tier holding block i, for i < resident[farthest]
    snapshot_tier[t]   the nearest tier holding the snapshot at resumable[t]

A cache's disk tier that is a :class:`~tiered_kv.storage.StoreChain` counts its level 0
as ``disk`` and its farther levels as ``shared``; a far level that is down answers "not
held" (the cache would skip it too). Costs: one dict lookup per block for each memory
tier until the prefix ends there, and one ``contains_many`` per batch of blocks (8, 32,
128, ... keys) for a store level; snapshots are asked from the longest candidate down.
``bench/lookup.py`` measures it (128K-token prompts).

    >>> look = cache.lookup(prompt_tokens)           # or cache.lookup(block_hashes=hashes)
    >>> look.tokens(Tier.HOST)                       # tokens resumable from GPU + host
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .storage import BlockStore

__all__ = ["ResumeIndex", "ResumeLookup", "Tier"]

#: Store keys asked per ``contains_many`` call while a prefix goes on (then 4x more each).
_FIRST_BATCH = 8
_MAX_BATCH = 512


class Tier(enum.IntEnum):
    """A cache tier, nearest first."""

    GPU = 0
    HOST = 1
    DISK = 2
    SHARED = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeLookup:
    """What :meth:`ResumeIndex.lookup` found (see the module docstring for definitions)."""

    block_tokens: int
    #: full blocks asked about (hashes given, or full blocks of the prompt)
    num_blocks: int
    #: most blocks a resume may cover (one token is always recomputed)
    limit_blocks: int
    #: the tiers asked, nearest first
    tiers: tuple[Tier, ...]
    #: per tier (cumulative): longest prefix of blocks held (snapshots ignored)
    resident_blocks: dict[Tier, int]
    #: per tier (cumulative): blocks a resume covers
    resumable_blocks: dict[Tier, int]
    #: nearest tier of each block of the longest held prefix
    block_tiers: tuple[Tier, ...]
    #: per tier: the nearest tier holding the snapshot at ``resumable_blocks[tier]`` (None: no resume)
    snapshot_tiers: dict[Tier, Tier | None]

    def tokens(self, tier: Tier | None = None) -> int:
        """Tokens resumable with ``tier`` and the nearer ones (default: every tier)."""
        return self.blocks(tier) * self.block_tokens

    def blocks(self, tier: Tier | None = None) -> int:
        """Blocks resumable with ``tier`` and the nearer ones (default: every tier)."""
        if not self.tiers:
            return 0
        return self.resumable_blocks[self.tiers[-1] if tier is None else tier]

    def resident_tokens(self, tier: Tier | None = None) -> int:
        """Tokens of the longest held block prefix (every boundary resumable), capped at the limit."""
        if not self.tiers:
            return 0
        n = self.resident_blocks[self.tiers[-1] if tier is None else tier]
        return min(n, self.limit_blocks) * self.block_tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"tokens": {tier: n}, "resident_tokens": {...}, ...}``."""
        bt = self.block_tokens
        return {
            "block_tokens": bt, "num_blocks": self.num_blocks, "limit_blocks": self.limit_blocks,
            "tokens": {t.label: self.resumable_blocks[t] * bt for t in self.tiers},
            "resident_tokens": {t.label: min(self.resident_blocks[t], self.limit_blocks) * bt for t in self.tiers},
            "blocks_by_tier": {t.label: self.block_tiers[:self.blocks()].count(t) for t in self.tiers},
            "snapshot_tier": {t.label: (None if s is None else s.label) for t, s in self.snapshot_tiers.items()},
        }


class _MemoryTier:
    """A GPU or host tier: the read-only views of its block and snapshot pools."""

    def __init__(self, tier: Tier, blocks: BlockPool, snapshots: BlockPool | None) -> None:
        self.tier = tier
        self.blocks: Mapping[bytes, int] = blocks.cached
        self.snapshots: Mapping[bytes, int] = snapshots.cached if snapshots is not None else {}


class _StoreTier:
    """A store (or one level of a chain): asked in batches of raw hashes."""

    def __init__(self, tier: Tier, store: BlockStore, level: int | None) -> None:
        self.tier = tier
        self._store = store
        self._level = level  # a StoreChain's level, or None for a plain store

    def held(self, kind: Any, hashes: Sequence[bytes]) -> list[bool]:
        """Whether the store holds a record of ``kind`` under each hash (False for all
        when a chain's far level is down)."""
        if not hashes:
            return []
        if self._level is None:
            return self._store.contains_hashes(kind, hashes)
        got = self._store.contains_at(self._level, kind, hashes)  # type: ignore[attr-defined]
        return [False] * len(hashes) if got is None else got


class ResumeIndex:
    """The tiers of one cache (or a store chain), asked read-only.

    Build it with :meth:`of_cache` (what ``TieredKVCache.lookup`` uses) or
    :meth:`of_store` (a store or chain alone: ``tiered-kv lookup``).
    """

    def __init__(self, block_tokens: int, tiers: Sequence[_MemoryTier | _StoreTier]) -> None:
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
            raise ValueError(f"block_tokens: expected a positive int, got {block_tokens!r}")
        self.block_tokens = block_tokens
        self._tiers = list(tiers)
        self.tiers: tuple[Tier, ...] = tuple(t.tier for t in self._tiers)

    @classmethod
    def of_cache(cls, cache: Any, *, store_tier: Tier = Tier.DISK) -> ResumeIndex:
        """The GPU pools, the host tier and the disk store (chain levels apart) of a
        :class:`~tiered_kv.cache.TieredKVCache`. ``store_tier``: what a store that is not a
        chain counts as (``Tier.SHARED`` for a node that writes straight to a bucket)."""
        tiers: list[_MemoryTier | _StoreTier] = [_MemoryTier(Tier.GPU, cache.blocks, cache.snapshots.ids)]
        if cache.host is not None:
            tiers.append(_MemoryTier(Tier.HOST, cache.host.blocks, cache.host.snapshots))
        if cache.disk is not None:
            tiers.extend(_store_tiers(cache.disk.store, store_tier))
        return cls(cache.layout.block_tokens, tiers)

    @classmethod
    def of_store(cls, store: BlockStore, block_tokens: int, *, store_tier: Tier = Tier.DISK) -> ResumeIndex:
        """A store alone (``store_tier``, default disk), or a chain (level 0 disk, the
        farther levels shared)."""
        return cls(block_tokens, _store_tiers(store, store_tier))

    def lookup(self, block_hashes: Sequence[bytes], *, num_tokens: int | None = None,
               upto: Tier | None = None) -> ResumeLookup:
        """Per tier, how much of the prefix with these block hashes is held and resumable.

        ``block_hashes``: the chained hashes of the prompt's full blocks, in order (as
        :meth:`~tiered_kv.prefix.PrefixHasher.block_hashes` gives them). ``num_tokens``:
        the prompt's length, for the rule that one token is always recomputed (None: the
        prompt is taken to go on past the last hash, so every block may be resumed).
        ``upto``: ask only the tiers up to this one (e.g. ``Tier.DISK``: a router choosing
        among nodes that share one bucket need not ask the bucket once per node).
        """
        hashes = list(block_hashes)
        if not set(map(type, hashes)) <= {bytes}:
            i, h = next((i, h) for i, h in enumerate(hashes) if not isinstance(h, bytes))
            raise TypeError(f"block_hashes[{i}]: expected bytes, got {type(h).__name__}")
        bt = self.block_tokens
        limit = len(hashes)
        if num_tokens is not None:
            if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
                raise ValueError(f"num_tokens: expected a non-negative int or None, got {num_tokens!r}")
            if num_tokens < len(hashes) * bt:
                raise ValueError(f"num_tokens: {len(hashes)} block hashes cover {len(hashes) * bt} tokens, "
                                 f"expected num_tokens >= that, got {num_tokens}")
            limit = min(limit, max(0, num_tokens - 1) // bt)
        if upto is not None and not isinstance(upto, Tier):
            raise TypeError(f"upto: expected a Tier or None, got {type(upto).__name__}")
        return _Lookup(self, hashes, limit, upto).run()


def _store_tiers(store: BlockStore, plain: Tier) -> list[_MemoryTier | _StoreTier]:
    from .storage import StoreChain

    if plain not in (Tier.DISK, Tier.SHARED):
        raise ValueError(f"store_tier: expected Tier.DISK or Tier.SHARED, got {plain!r}")
    if isinstance(store, StoreChain):
        return [_StoreTier(Tier.DISK if i == 0 else Tier.SHARED, store, i) for i in range(len(store.levels()))]
    return [_StoreTier(plain, store, None)]


class _Lookup:
    """One lookup. Memory tiers are asked block by block (dict lookups); each store level
    in batches, only for the blocks (boundaries) no nearer tier holds, its answers kept."""

    def __init__(self, index: ResumeIndex, hashes: list[bytes], limit: int, upto: Tier | None) -> None:
        self.hashes = hashes
        self.limit = limit
        self.block_tokens = index.block_tokens
        tiers = [t for t in index._tiers if upto is None or t.tier <= upto]
        self.tiers = tuple(t.tier for t in tiers)
        self.memory = [t for t in tiers if isinstance(t, _MemoryTier)]
        self.stores = [t for t in tiers if isinstance(t, _StoreTier)]
        if tiers != [*self.memory, *self.stores]:
            raise AssertionError("tiers: memory tiers must come before store tiers")
        #: from the first block no memory tier holds: the nearest memory tier of each block
        self._mem: list[Tier | None] = []
        self._mem_from = 0
        # per store level: {block index: held?} / {boundary: held?}
        self._blocks: list[dict[int, bool]] = [{} for _ in self.stores]
        self._snaps: list[dict[int, bool]] = [{} for _ in self.stores]

    def run(self) -> ResumeLookup:
        from .storage import RecordKind

        hashes, n = self.hashes, len(self.hashes)
        resident: dict[Tier, int] = {}
        where: list[Tier] = []
        pos = 0
        for j, mem in enumerate(self.memory):  # extend the prefix with the memory tiers <= j
            if j == 0:
                first = mem.blocks
                while pos < n and hashes[pos] in first:
                    pos += 1
                where = [mem.tier] * pos
            else:
                maps = [(m.blocks, m.tier) for m in self.memory[:j + 1]]
                while pos < n:
                    h = hashes[pos]
                    for blocks, tier in maps:
                        if h in blocks:
                            where.append(tier)
                            break
                    else:
                        break
                    pos += 1
            resident[mem.tier] = pos
        if self.stores:
            self._mem_from = pos
            if len(self.memory) == 1:
                first, tier0 = self.memory[0].blocks, self.memory[0].tier
                self._mem = [tier0 if h in first else None for h in hashes[pos:]]
            else:
                self._mem = [self._in_memory(h) for h in hashes[pos:]]
        mem, base = self._mem, self._mem_from
        for j, store in enumerate(self.stores):
            known = self._blocks[j]
            if j == 0:  # the nearest store level: a batch asked, then its slice scanned
                tier, done = store.tier, False
                while pos < n and not done:
                    stop = self._store_batch(0, pos)
                    for t in mem[pos - base:stop - base]:
                        if t is None:
                            if not known[pos]:
                                done = True
                                break
                            t = tier
                        where.append(t)
                        pos += 1
                resident[tier] = pos
                continue
            while pos < n:
                t = mem[pos - base]
                if t is None:
                    for k in range(j):  # a nearer store level first
                        if self._store_block(k, pos):
                            t = self.stores[k].tier
                            break
                    else:
                        got = known.get(pos)
                        if got is None:
                            got = self._store_block(j, pos)
                        if not got:
                            break
                        t = store.tier
                where.append(t)
                pos += 1
            resident[store.tier] = pos
        resumable: dict[Tier, int] = {}
        snap_tier: dict[Tier, Tier | None] = {}
        for tier in self.tiers:
            k, t = self._longest_snapshot(min(resident[tier], self.limit), tier, RecordKind.SNAPSHOT)
            resumable[tier] = k
            snap_tier[tier] = t
        return ResumeLookup(block_tokens=self.block_tokens, num_blocks=n, limit_blocks=self.limit,
                            tiers=self.tiers, resident_blocks=resident, resumable_blocks=resumable,
                            block_tiers=tuple(where), snapshot_tiers=snap_tier)

    # ---------------------------------------------------------------- blocks
    def _in_memory(self, h: bytes) -> Tier | None:
        for m in self.memory:
            if h in m.blocks:
                return m.tier
        return None

    def _store_block(self, j: int, i: int) -> bool:
        known = self._blocks[j]
        got = known.get(i)
        if got is not None:
            return got
        self._store_batch(j, i)
        return known[i]

    def _store_batch(self, j: int, i: int) -> int:
        """Ask store level ``j`` about block ``i`` and the blocks after it up to the batch's
        end (returned), those no nearer tier holds; each answer is kept."""
        from .storage import RecordKind

        known = self._blocks[j]
        # ask a batch of the blocks after i too (the prefix likely goes on), only those no
        # nearer tier holds; the batch grows 4x per batch asked
        size = min(_MAX_BATCH, _FIRST_BATCH * 4 ** min(len(known) // _FIRST_BATCH, 4))
        mem, base = self._mem, self._mem_from
        nearer = self._blocks[:j]
        stop = min(len(self.hashes), i + size)
        if nearer:
            want = [b for b in range(i, stop) if b not in known and (b == i or (
                mem[b - base] is None and not any(k.get(b) for k in nearer)))]
        else:
            want = [b for b in range(i, stop) if b not in known and (b == i or mem[b - base] is None)]
        if want:
            hashes = self.hashes
            known.update(zip(want, self.stores[j].held(RecordKind.BLOCK, [hashes[b] for b in want])))
        return stop

    # ------------------------------------------------------------- snapshots
    def _longest_snapshot(self, top: int, upto: Tier, kind: Any) -> tuple[int, Tier | None]:
        """The longest k <= ``top`` whose snapshot a tier <= ``upto`` holds, and the nearest
        such tier; (0, None) if none. Boundaries are asked longest first, in batches of 1,
        4, 16, 64, 64, ... (a prompt resumed whole costs a store one key)."""
        memory = [m for m in self.memory if m.tier <= upto]
        stores = [j for j, s in enumerate(self.stores) if s.tier <= upto]
        k, size = top, 1
        while k > 0:
            batch = list(range(k, max(0, k - size), -1))  # k, k-1, ... (longest first)
            near, near_tier = 0, None  # the longest boundary of the batch a memory tier holds
            for b in batch:
                h = self.hashes[b - 1]
                near_tier = next((mem.tier for mem in memory if h in mem.snapshots), None)
                if near_tier is not None:
                    near = b
                    break
            # only boundaries longer than that can beat it; each store level is asked for
            # those no nearer level holds
            remaining = batch if near == 0 else batch[:batch.index(near)]
            best: tuple[int, Tier] | None = None
            for j in stores:
                if not remaining:
                    break
                self._ask_snapshots(j, remaining, kind)
                held = [b for b in remaining if self._snaps[j][b]]
                if held and (best is None or held[0] > best[0]):
                    best = (held[0], self.stores[j].tier)
                remaining = [b for b in remaining if not self._snaps[j][b] and (best is None or b > best[0])]
            if best is not None:
                return best
            if near:
                return near, near_tier
            k = batch[-1] - 1
            size = min(4 * size, 64)
        return 0, None

    def _ask_snapshots(self, j: int, boundaries: list[int], kind: Any) -> None:
        known = self._snaps[j]
        todo = [b for b in boundaries if b not in known]
        if todo:
            for b, f in zip(todo, self.stores[j].held(kind, [self.hashes[b - 1] for b in todo])):
                known[b] = f
