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

**Leaves first** (``leaf_first=True``, the ``leaf-lru`` eviction policy of
:mod:`tiered_kv.policy.eviction`): a block cached with its ``parent`` hash counts as a
child of that hash, and a cached block with a cached child in this pool is not evicted
while the child remains: evicting it would strand the child (no resume reaches a block
whose predecessor is gone). When the LRU head has a child it is *parked* (out of the LRU,
still evictable), and when its last child leaves the pool it goes back to the LRU's head:
it was older than every block in the LRU when parked and than every block released since,
so the order is LRU among the blocks that can go. Each release parks a block at most once:
O(1) amortised. Only when every evictable block is parked (children all referenced: a
caller that holds a block's suffix without its prefix) is the oldest parked one evicted,
counted in ``stranding_evictions``::

    evictable LRU (leaves, and blocks not yet seen at the head)     parked (with children)
    oldest ---------------------------------------------> newest    {b: waiting for its last
      ^ the head: evicted if childless, else parked -------------->  child to leave}
      +---------------- a parked block whose last child left -------+

**Small, main and ghost queues** (``small_fraction=f``, the ``leaf-s3fifo`` policy; after
S3-FIFO, Yang et al., SOSP 2023): a block released that was never reused waits in the
*small* queue (the LRU above); a block that was reused (a lookup took it again, it was
loaded from a lower tier, or cached under a hash evicted lately from the small queue: a
*ghost*) goes to the *main* queue when released. While the small queue holds at least
``f * num_blocks`` blocks (or the main one is empty) eviction takes from it, else from
the main queue, so blocks used once leave soon and make way for none of those reused.
Blocks evicted from the small queue are remembered by hash (``num_blocks`` at most):
computed again, they go to the main queue. Both queues are in release order and leaves
first applies to both (the parked blocks are shared; one unparked returns to the head of
its own queue). S3-FIFO's queues are FIFOs with lazy promotion; here a release is what
enqueues, which is the order a refcounted pool sees.

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

    def __init__(self, num_blocks: int, *, on_evict: EvictCallback | None = None, leaf_first: bool = False,
                 small_fraction: float | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive int, got {num_blocks!r}")
        if small_fraction is not None and (isinstance(small_fraction, bool)
                                           or not isinstance(small_fraction, (int, float))
                                           or not 0.0 < small_fraction < 1.0):
            raise ValueError(f"small_fraction: expected None or a float in (0, 1), got {small_fraction!r}")
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
        #: Leaves first: evict no block while a block cached after it remains (see above).
        self.leaf_first: bool = bool(leaf_first)
        #: Evictions that took a block while a block cached after it (given with ``parent``)
        #: remained in this pool: that block is stranded here. Counted under every order;
        #: a ``leaf_first`` pool does it only when every evictable block has a child.
        self.stranding_evictions: int = 0
        # each cached block's parent hash (None: not given, or the root); cached blocks per
        # parent hash; leaf_first: evictable blocks with children, oldest first
        self._parents: list[bytes | None] = [None] * num_blocks
        self._children: dict[bytes, int] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()
        #: Inside ``on_evict``: the parent hash the evicted block was cached with (None
        #: outside a callback, or none given), so a lower tier can keep the path.
        self.evicted_parent: bytes | None = None
        #: Small / main / ghost queues (see above); None: one LRU.
        self.small_fraction: float | None = None if small_fraction is None else float(small_fraction)
        self._small_target = 0 if small_fraction is None else max(1, round(small_fraction * num_blocks))
        # evictable blocks that were reused (small_fraction: the main queue), oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        # per block: reused since it was cached (a lookup took it again, loaded, or a ghost)
        self._hot: list[bool] = [False] * num_blocks
        # hashes evicted from the small queue, oldest first (at most num_blocks)
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        #: Inside ``on_evict``: whether the evicted block had been reused (for a lower tier).
        self.evicted_hot: bool = False

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
        return len(self._evictable) + len(self._main) + len(self._parked)

    @property
    def num_available(self) -> int:
        """How many :meth:`allocate` calls can succeed from now: free plus evictable."""
        return len(self._free) + len(self._evictable) + len(self._main) + len(self._parked)

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
        elif self._evictable or self._main or self._parked:
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

        A cached block at refcount 0 leaves the evictable LRU (a prefix-cache hit); a
        cached block taken again counts as reused (the main queue, with ``small_fraction``).
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
            self._unlink(block_id)
            self._num_used += 1
        if self._hashes[block_id] is not None:
            self._hot[block_id] = True
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
            elif self._hot[block_id] and self.small_fraction is not None:
                self._main[block_id] = None
            else:
                self._evictable[block_id] = None

    # ------------------------------------------------------------------ cache
    def cache(self, block_id: int, block_hash: bytes, parent: bytes | None = None, *, reused: bool = False) -> bool:
        """Register the referenced block ``block_id`` as holding the data of ``block_hash``.

        Returns ``False`` and changes nothing when ``block_hash`` already maps to another
        block: the first copy wins and the caller keeps its block as a private one.
        Re-caching a block under its own hash returns ``True``. ``parent``: the hash of the
        block before it on its path (None: the path's first block, or unknown), which a
        ``leaf_first`` pool keeps from being evicted while this block is cached (every
        pool counts an eviction that strands a cached child: ``stranding_evictions``).
        ``reused``: the block is a reuse (loaded from a lower tier, or evicted from one
        that had seen it reused), so it goes to the main queue (``small_fraction``).
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
        if self.small_fraction is not None and self._ghost.pop(block_hash, 0) is None:
            reused = True  # evicted from the small queue lately and wanted again
        self._hot[block_id] = bool(reused)
        if parent is not None:
            if not isinstance(parent, bytes):
                raise ValueError(f"cache: expected parent as bytes or None, got {type(parent).__name__}")
            self._parents[block_id] = parent
            self._children[parent] = self._children.get(parent, 0) + 1
        return True

    def parent_hash(self, block_id: int) -> bytes | None:
        """The parent hash cached ``block_id`` was given (None: none given, or not cached)."""
        self._check_id("parent_hash", block_id)
        return self._parents[block_id] if self._hashes[block_id] is not None else None

    def num_children(self, block_hash: bytes) -> int:
        """Blocks cached in this pool with parent ``block_hash``."""
        return self._children.get(block_hash, 0)

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
        self._hot[block_id] = False
        if self._refcounts[block_id] == 0:
            self._unlink(block_id)
            self._free.append(block_id)
        self._drop_child(block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, or ``None`` on a miss.

        Takes no reference and leaves the LRU order alone: call :meth:`incref` to use it.
        """
        self._check_hash("lookup", block_hash)
        return self._hash_to_block.get(block_hash)

    def evict_hash(self, block_hash: bytes) -> bool:
        """Evict the unreferenced block cached under ``block_hash`` (``on_evict`` runs, as
        for an eviction to make room) to the tail of the free list. False when no block
        is cached under it or it is referenced (nothing changes)."""
        self._check_hash("evict_hash", block_hash)
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None or self._refcounts[block_id]:
            return False
        self._unlink(block_id)
        if self._children.get(block_hash):
            self.stranding_evictions += 1
        del self._hash_to_block[block_hash]
        self._hashes[block_id] = None
        self.evictions += 1
        self.evicted_parent = self._parents[block_id]
        self.evicted_hot, self._hot[block_id] = self._hot[block_id], False
        self._drop_child(block_id)
        try:
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
        finally:
            self.evicted_parent = None
            self.evicted_hot = False
            self._free.append(block_id)
        return True

    def evict_lru(self) -> int | None:
        """Evict the least-recently-released cached block to the tail of the free list.

        Returns its id, or ``None`` when no cached block is unreferenced.
        """
        if not self._evictable and not self._main and not self._parked:
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
        """Evictable block ids: the LRU, the next one to be evicted first (of a ``leaf_first``
        pool: the next one to reach its head; a block with cached children there is parked),
        then the main queue's (``small_fraction``), then the parked blocks, oldest first."""
        return [*self._evictable, *self._main, *self._parked]

    def in_main(self, block_id: int) -> bool:
        """Whether evictable ``block_id`` waits in the main queue (``small_fraction``)."""
        self._check_id("in_main", block_id)
        return block_id in self._main

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
        if set(self._parked) & evictable:
            raise AssertionError(f"blocks {sorted(set(self._parked) & evictable)} are both parked and in the LRU")
        if set(self._main) & (evictable | set(self._parked)):
            raise AssertionError(f"blocks {sorted(set(self._main) & (evictable | set(self._parked)))} are in the "
                                 f"main queue and elsewhere")
        if self._main and self.small_fraction is None:
            raise AssertionError(f"blocks {list(self._main)} are in a main queue of a one-queue pool")
        not_hot = [b for b in self._main if not self._hot[b]]
        if not_hot:
            raise AssertionError(f"main-queue blocks {not_hot} were never reused")
        if len(self._ghost) > self.num_blocks:
            raise AssertionError(f"the ghost queue holds {len(self._ghost)} hashes, more than {self.num_blocks}")
        evictable |= set(self._parked) | set(self._main)
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
        counts: dict[bytes, int] = {}
        for b, h in enumerate(self._hashes):
            p = self._parents[b]
            if h is None and p is not None:
                raise AssertionError(f"block {b} is not cached but keeps a parent hash")
            if p is not None:
                counts[p] = counts.get(p, 0) + 1
        if counts != self._children:
            raise AssertionError(f"child counts {self._children} disagree with the cached blocks' parents {counts}")
        for b in self._parked:
            h = self._hashes[b]
            if h is None or not self._children.get(h):
                raise AssertionError(f"parked block {b} has no cached child")
        if self.num_free + self.num_evictable + self.num_used != n:
            raise AssertionError(
                f"free {self.num_free} + evictable {self.num_evictable} + used {self.num_used} != {n}"
            )

    # -------------------------------------------------------------- internals
    def _check_id(self, op: str, block_id: int) -> None:
        if type(block_id) is int and 0 <= block_id < self.num_blocks:
            return  # the common case, in one expression (every operation checks its id)
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
        if self.leaf_first:
            block_id = self._oldest_leaf()
        else:
            block_id, _ = self._queue_to_evict().popitem(last=False)
        block_hash = self._hashes[block_id]
        if block_hash is None:
            raise AssertionError(f"evictable block {block_id} has no hash")
        if not self.leaf_first and self._children.get(block_hash):
            self.stranding_evictions += 1
        del self._hash_to_block[block_hash]
        self._hashes[block_id] = None
        self.evictions += 1
        self.evicted_parent = self._parents[block_id]
        self.evicted_hot, self._hot[block_id] = self._hot[block_id], False
        if self.small_fraction is not None and not self.evicted_hot:  # (out of the small queue): a ghost
            self._ghost[block_hash] = None
            if len(self._ghost) > self.num_blocks:
                self._ghost.popitem(last=False)
        self._drop_child(block_id)
        if self.on_evict is not None:
            try:
                self.on_evict(block_id, block_hash)
            except BaseException:
                self._free.append(block_id)
                raise
            finally:
                self.evicted_parent = None
                self.evicted_hot = False
        self.evicted_parent = None
        self.evicted_hot = False
        return block_id

    def _queue_to_evict(self) -> OrderedDict[int, None]:
        """The queue eviction takes from: the small one (``_evictable``) while it holds at
        least its target or the main one is empty; else the main one."""
        if not self._main or (self._evictable and len(self._evictable) >= self._small_target):
            return self._evictable
        return self._main

    def _unlink(self, block_id: int) -> None:
        """Take evictable ``block_id`` out of whichever queue holds it (LRU, main, parked)."""
        if self._evictable.pop(block_id, 0) is None:
            return
        if self._main.pop(block_id, 0) is None:
            return
        del self._parked[block_id]

    def _oldest_leaf(self) -> int:
        """Take the evictable block to evict out of the LRU (or the parked set): the LRU's
        oldest childless block, parking those with children on the way (with
        ``small_fraction``: of the queue to evict from, then of the other one)."""
        children, hashes = self._children, self._hashes
        first = self._queue_to_evict()
        for queue in (first, self._main if first is self._evictable else self._evictable):
            while queue:
                block_id = next(iter(queue))
                h = hashes[block_id]
                del queue[block_id]
                if h is None or not children.get(h):
                    return block_id
                self._parked[block_id] = None
        self.stranding_evictions += 1  # every evictable block has a cached child (all referenced)
        block_id, _ = self._parked.popitem(last=False)
        return block_id

    def _drop_child(self, block_id: int) -> None:
        """``block_id`` left the cache: it no longer holds its parent; a parked parent whose
        last child it was goes back to the LRU's head."""
        p = self._parents[block_id]
        if p is None:
            return
        self._parents[block_id] = None
        # a count that is missing or already 0 (bookkeeping gone wrong, which
        # check_invariants reports) reads as "no child left": the count only orders
        # evictions, a lookup never trusts it, so a wrong one costs order, never bytes
        left = self._children.get(p, 0) - 1
        if left > 0:
            self._children[p] = left
            return
        self._children.pop(p, None)
        pid = self._hash_to_block.get(p)
        if pid is not None and pid in self._parked:
            del self._parked[pid]
            queue = self._main if self._hot[pid] and self.small_fraction is not None else self._evictable
            queue[pid] = None
            queue.move_to_end(pid, last=False)
