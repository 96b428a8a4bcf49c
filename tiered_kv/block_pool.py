"""Allocator over integer block ids: refcounts, a prefix-hash cache and LRU eviction.

One :class:`BlockPool` hands out the ids of the GPU Classical blocks, of the snapshot
slots and of the host blocks. It is pure Python and never touches tensors: the pools
own the memory, this class only decides which id is free, who references it and which
immutable block is cached under which hash. Keeping it apart from torch lets it be
tested on CPU with tiny pools, asserting exact ids and eviction order.

Every id is in exactly one of three states::

                          allocate()
    free list  -------------------------------->  referenced
    (uncached,  <--------------------------------  (refcount > 0, cached or not)
     FIFO)        free() to 0, if uncached           |          ^
       ^                                 free() to 0 |          | incref(): a prefix-cache
       |                                   if cached v          | hit found by lookup()
       +-------- evict_lru() / uncache() ---------  evictable LRU
                                                    (cached, refcount 0, oldest first;
                                                     allocate() evicts from here too)

``allocate()`` takes the head of the free list, and only when that is empty evicts the
least-recently-released cached block: a cached block is worth keeping because a later
request with the same prefix can reuse it without recomputing it.

Failures follow the package's rule: running out of blocks returns ``None``, bad input
(an out-of-range id, a double free, caching an unreferenced block) raises ``ValueError``
naming what was expected, and :meth:`BlockPool.check_invariants` raises
``AssertionError`` when the bookkeeping itself is broken.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from types import MappingProxyType

__all__ = ["BlockPool", "EvictCallback"]

#: Called as ``on_evict(block_id, block_hash)`` when a cached block loses its hash
#: mapping to make room, before the id can be handed out again.
EvictCallback = Callable[[int, bytes], None]


class BlockPool:
    """Allocator over ids 0..num_blocks-1 with refcounts, a hash -> block map of cached
    immutable blocks, and LRU eviction of unreferenced cached blocks.

    Every operation is O(1) except :meth:`evictable` and :meth:`check_invariants`, which
    walk the pool. Not thread-safe: one owner (the scheduler) drives it.
    """

    def __init__(self, num_blocks: int, *, on_evict: EvictCallback | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        self.num_blocks: int = num_blocks
        #: Cached blocks evicted so far, by :meth:`allocate` or :meth:`evict_lru`.
        self.evictions: int = 0
        #: May be replaced at any time; see :data:`EvictCallback`.
        self.on_evict: EvictCallback | None = on_evict
        self._refcounts: list[int] = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        #: Read-only live view of the cached blocks, hash -> block id: ``h in pool.cached``
        #: asks whether a hash is cached as fast as a dict does, taking no reference and
        #: leaving the LRU order alone (a router's lookup asks it for every block).
        self.cached: Mapping[bytes, int] = MappingProxyType(self._hash_to_block)
        # Uncached blocks with refcount 0, handed out from the left, returned on the right.
        self._free: deque[int] = deque(range(num_blocks))
        # Cached blocks with refcount 0; first key = least recently released.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_used = 0

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, used={self.num_used}, "
            f"free={self.num_free}, evictable={self.num_evictable}, cached={self.num_cached})"
        )

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Uncached blocks with refcount 0."""
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Cached blocks with refcount 0 (reusable by hash, or evictable for space)."""
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """How many :meth:`allocate` calls can succeed from now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks with refcount > 0."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash, referenced or not."""
        return len(self._hash_to_block)

    # -------------------------------------------------------------- allocation
    def allocate(self) -> int | None:
        """Return a block with refcount 1, or ``None`` when every block is referenced.

        The head of the free list comes first (initially 0, 1, 2, ...); only when it is
        empty is the least-recently-released cached block evicted and reused.
        """
        if self._free:
            block_id = self._free.popleft()
        elif self._evictable:
            block_id = self._evict_oldest()
        else:
            return None
        self._refcounts[block_id] = 1
        self._num_used += 1
        return block_id

    def allocate_many(self, n: int) -> list[int] | None:
        """Allocate ``n`` blocks, or none at all.

        Returns ``None`` without changing anything (nothing evicted) when fewer than
        ``n`` blocks are available, so a caller never has to undo half an allocation.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate_many: expected a non-negative int, got {n!r}")
        if n > self.num_available:
            return None
        blocks: list[int] = []
        try:
            for _ in range(n):
                block_id = self.allocate()
                if block_id is None:
                    raise AssertionError(
                        f"allocate_many: {n} blocks were available, allocation {len(blocks)} failed"
                    )
                blocks.append(block_id)
        except BaseException:
            # Only an on_evict callback can raise here; give back what was taken.
            for block_id in blocks:
                self.free(block_id)
            raise
        return blocks

    def incref(self, block_id: int) -> None:
        """Take another reference to a referenced block or to a cached, unreferenced one.

        A cached block at refcount 0 leaves the evictable LRU (a prefix-cache hit).
        A free uncached block holds no data worth sharing, so taking it is an error:
        use :meth:`allocate`.
        """
        self._check_id("incref", block_id)
        refcount = self._refcounts[block_id]
        if refcount == 0:
            if self._hashes[block_id] is None:
                raise ValueError(
                    f"incref: expected a referenced or cached block, block {block_id} is free"
                )
            del self._evictable[block_id]
            self._num_used += 1
        self._refcounts[block_id] = refcount + 1

    def free(self, block_id: int) -> None:
        """Drop one reference to ``block_id``.

        At refcount 0 a cached block becomes the most recently used end of the evictable
        LRU (kept for reuse); an uncached block goes to the tail of the free list.
        """
        self._check_id("free", block_id)
        refcount = self._refcounts[block_id]
        if refcount == 0:
            raise ValueError(f"free: block {block_id} has refcount 0 (double free)")
        refcount -= 1
        self._refcounts[block_id] = refcount
        if refcount == 0:
            self._num_used -= 1
            if self._hashes[block_id] is None:
                self._free.append(block_id)
            else:
                self._evictable[block_id] = None

    # ------------------------------------------------------------------ cache
    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Register the referenced block ``block_id`` as holding the data of ``block_hash``.

        Returns ``False`` and changes nothing when ``block_hash`` already maps to another
        block: the first copy wins and the caller keeps its block as a private one.
        Re-caching a block under its own hash returns ``True``.
        """
        self._check_id("cache", block_id)
        self._check_hash("cache", block_hash)
        if self._refcounts[block_id] == 0:
            raise ValueError(f"cache: expected a referenced block, block {block_id} has refcount 0")
        current = self._hashes[block_id]
        if current is not None:
            if current == block_hash:
                return True
            raise ValueError(
                f"cache: block {block_id} is already cached under hash {current.hex()}, "
                f"expected it uncached or cached under {block_hash.hex()}"
            )
        if block_hash in self._hash_to_block:
            return False
        self._hashes[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def uncache(self, block_id: int) -> None:
        """Drop the hash mapping of a cached block (e.g. its data turned out stale).

        An unreferenced block moves from the evictable LRU to the tail of the free list;
        a referenced one stays with its owners and goes to the free list when released.
        ``on_evict`` is not called: the caller chose to drop it.
        """
        self._check_id("uncache", block_id)
        block_hash = self._hashes[block_id]
        if block_hash is None:
            raise ValueError(f"uncache: expected a cached block, block {block_id} is not cached")
        del self._hash_to_block[block_hash]
        self._hashes[block_id] = None
        if self._refcounts[block_id] == 0:
            del self._evictable[block_id]
            self._free.append(block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, or ``None`` on a miss.

        Takes no reference and leaves the LRU order alone: call :meth:`incref` to use it.
        """
        self._check_hash("lookup", block_hash)
        return self._hash_to_block.get(block_hash)

    def evict_lru(self) -> int | None:
        """Evict the least-recently-released cached block to the tail of the free list.

        Returns its id, or ``None`` when no cached block is unreferenced.
        """
        if not self._evictable:
            return None
        block_id = self._evict_oldest()
        self._free.append(block_id)
        return block_id

    # ------------------------------------------------------------- inspection
    def refcount(self, block_id: int) -> int:
        """Current number of references to ``block_id``."""
        self._check_id("refcount", block_id)
        return self._refcounts[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        """The hash ``block_id`` is cached under, or ``None`` if it is not cached."""
        self._check_id("block_hash", block_id)
        return self._hashes[block_id]

    def evictable(self) -> list[int]:
        """Evictable block ids, the next one to be evicted first."""
        return list(self._evictable)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent.

        Checked: every id is in exactly one of {free list, evictable LRU, referenced};
        no refcount is negative; free blocks are uncached and evictable ones cached; the
        hash map and the per-block hashes agree; the counts add up to ``num_blocks``.
        Raises explicitly rather than with ``assert`` so that ``python -O`` checks too.
        """
        n = self.num_blocks
        if len(self._refcounts) != n or len(self._hashes) != n:
            raise AssertionError(
                f"per-block arrays have {len(self._refcounts)}, {len(self._hashes)} entries, expected {n}"
            )
        for block_id, refcount in enumerate(self._refcounts):
            if refcount < 0:
                raise AssertionError(f"block {block_id} has negative refcount {refcount}")
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"free list holds duplicates: {list(self._free)}")
        evictable = set(self._evictable)
        referenced = {b for b, refcount in enumerate(self._refcounts) if refcount > 0}
        for name, group in (("free list", free), ("evictable LRU", evictable)):
            outside = [b for b in group if not 0 <= b < n]
            if outside:
                raise AssertionError(f"{name} holds out-of-range ids {outside}")
            if group & referenced:
                raise AssertionError(f"{name} holds referenced blocks {sorted(group & referenced)}")
        if free & evictable:
            raise AssertionError(f"blocks {sorted(free & evictable)} are both free and evictable")
        missing = set(range(n)) - free - evictable - referenced
        if missing:
            raise AssertionError(
                f"blocks {sorted(missing)} are neither free, evictable nor referenced (leaked)"
            )
        uncached_free = [b for b in free if self._hashes[b] is not None]
        if uncached_free:
            raise AssertionError(f"free-list blocks {uncached_free} are cached")
        uncached_evictable = [b for b in evictable if self._hashes[b] is None]
        if uncached_evictable:
            raise AssertionError(f"evictable blocks {uncached_evictable} are not cached")
        for block_hash, block_id in self._hash_to_block.items():
            if not 0 <= block_id < n or self._hashes[block_id] != block_hash:
                raise AssertionError(f"hash {block_hash.hex()} maps to block {block_id}, which disagrees")
        num_hashed = sum(h is not None for h in self._hashes)
        if num_hashed != len(self._hash_to_block):
            raise AssertionError(
                f"{num_hashed} blocks carry a hash but the map has {len(self._hash_to_block)}"
            )
        if self._num_used != len(referenced):
            raise AssertionError(
                f"num_used counter is {self._num_used}, {len(referenced)} blocks are referenced"
            )
        if self.num_free + self.num_evictable + self.num_used != n:
            raise AssertionError(
                f"free {self.num_free} + evictable {self.num_evictable} + used {self.num_used} != {n}"
            )

    # -------------------------------------------------------------- internals
    def _check_id(self, op: str, block_id: int) -> None:
        if (
            isinstance(block_id, bool)
            or not isinstance(block_id, int)
            or not 0 <= block_id < self.num_blocks
        ):
            raise ValueError(f"{op}: expected a block id in [0, {self.num_blocks}), got {block_id!r}")

    @staticmethod
    def _check_hash(op: str, block_hash: bytes) -> None:
        if not isinstance(block_hash, bytes):
            raise ValueError(f"{op}: expected block_hash as bytes, got {type(block_hash).__name__}")

    def _evict_oldest(self) -> int:
        """Take the oldest evictable block out of the cache; return it uncached at refcount 0.

        The hash mapping is dropped before ``on_evict`` runs, so the callback sees the
        block as no longer servable. The caller puts the id on the free list or hands it
        out; if the callback raises, the id goes to the free list so it is not leaked.
        """
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hashes[block_id]
        if block_hash is None:
            raise AssertionError(f"evictable block {block_id} has no hash")
        del self._hash_to_block[block_hash]
        self._hashes[block_id] = None
        self.evictions += 1
        if self.on_evict is not None:
            try:
                self.on_evict(block_id, block_hash)
            except BaseException:
                self._free.append(block_id)
                raise
        return block_id
