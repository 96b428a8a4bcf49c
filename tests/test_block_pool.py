"""Tests of :class:`tiered_kv.block_pool.BlockPool`.

Tiny pools with exact block ids and exact eviction order first, then every
``ValueError`` case, then a Hypothesis state machine that drives a pool of 1..8 blocks
through random operations against a plain-list model of the same rules, and seeded
random walks through the same rules and model that reliably reach deep states.
"""

from __future__ import annotations

import ast
import inspect
import random
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tiered_kv.block_pool import BlockPool

H0, H1, H2, H3 = b"h0", b"h1", b"h2", b"h3"


def _recording_pool(num_blocks: int) -> tuple[BlockPool, list[tuple[int, bytes]]]:
    events: list[tuple[int, bytes]] = []
    pool = BlockPool(num_blocks, on_evict=lambda b, h: events.append((b, h)))
    return pool, events


def _cached_and_released(pool: BlockPool, hashes: list[bytes], release_order: list[int]) -> list[int]:
    """Allocate one block per hash, cache it, then free the blocks in ``release_order``."""
    blocks = pool.allocate_many(len(hashes))
    assert blocks is not None
    for block_id, block_hash in zip(blocks, hashes):
        assert pool.cache(block_id, block_hash)
    for block_id in release_order:
        pool.free(block_id)
    return blocks


def _snapshot(pool: BlockPool) -> tuple[object, ...]:
    """Everything observable through the public API, to assert that nothing changed."""
    ids = range(pool.num_blocks)
    return (
        tuple(pool.refcount(b) for b in ids),
        tuple(pool.block_hash(b) for b in ids),
        tuple(pool.evictable()),
        pool.num_free,
        pool.num_evictable,
        pool.num_used,
        pool.num_cached,
        pool.evictions,
    )


# ---------------------------------------------------------------- allocation
def test_fresh_pool_counts() -> None:
    pool = BlockPool(3)
    assert pool.num_blocks == 3
    assert (pool.num_free, pool.num_evictable, pool.num_available, pool.num_used, pool.num_cached) == (
        3, 0, 3, 0, 0,
    )
    assert pool.evictions == 0
    assert pool.evictable() == []
    assert [pool.refcount(b) for b in range(3)] == [0, 0, 0]
    assert [pool.block_hash(b) for b in range(3)] == [None, None, None]
    pool.check_invariants()


def test_allocate_in_order_then_none() -> None:
    pool = BlockPool(3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.allocate() is None
    assert pool.allocate() is None
    assert [pool.refcount(b) for b in range(3)] == [1, 1, 1]
    assert (pool.num_free, pool.num_available, pool.num_used) == (0, 0, 3)
    pool.check_invariants()


def test_freed_uncached_blocks_go_to_free_list_tail() -> None:
    pool = BlockPool(4)
    assert pool.allocate() == 0
    pool.free(0)
    # 0 went behind 1, 2, 3.
    assert [pool.allocate() for _ in range(4)] == [1, 2, 3, 0]
    pool.free(2)
    pool.free(0)
    pool.free(3)
    assert [pool.allocate() for _ in range(3)] == [2, 0, 3]
    assert pool.allocate() is None
    pool.check_invariants()


def test_free_drops_one_reference_at_a_time() -> None:
    pool = BlockPool(2)
    assert pool.allocate() == 0
    pool.incref(0)
    pool.incref(0)
    assert pool.refcount(0) == 3
    pool.free(0)
    pool.free(0)
    assert pool.refcount(0) == 1
    assert pool.num_free == 1
    pool.free(0)
    assert pool.refcount(0) == 0
    assert pool.num_free == 2
    assert [pool.allocate(), pool.allocate()] == [1, 0]


# ---------------------------------------------------------------- eviction
def test_eviction_follows_release_order() -> None:
    pool, events = _recording_pool(3)
    _cached_and_released(pool, [H0, H1, H2], release_order=[2, 0, 1])
    assert pool.evictable() == [2, 0, 1]
    assert (pool.num_free, pool.num_evictable, pool.num_available, pool.num_cached) == (0, 3, 3, 3)

    assert pool.allocate() == 2
    assert events == [(2, H2)]
    assert pool.lookup(H2) is None
    assert pool.block_hash(2) is None
    assert pool.evictions == 1
    assert pool.evictable() == [0, 1]

    assert pool.allocate() == 0
    assert pool.allocate() == 1
    assert pool.allocate() is None
    assert events == [(2, H2), (0, H0), (1, H1)]
    assert pool.evictions == 3
    assert pool.num_cached == 0
    pool.check_invariants()


def test_free_list_is_used_before_evicting() -> None:
    pool, events = _recording_pool(3)
    assert [pool.allocate(), pool.allocate()] == [0, 1]
    assert pool.cache(0, H0)
    pool.free(0)
    pool.free(1)
    # Free list: 2, 1. Evictable: 0.
    assert [pool.allocate(), pool.allocate()] == [2, 1]
    assert events == []
    assert pool.lookup(H0) == 0
    assert pool.allocate() == 0
    assert events == [(0, H0)]
    pool.check_invariants()


def test_incref_of_evictable_block_leaves_lru_and_returns_as_mru() -> None:
    pool, events = _recording_pool(3)
    _cached_and_released(pool, [H0, H1, H2], release_order=[0, 1, 2])
    assert pool.evictable() == [0, 1, 2]

    pool.incref(0)  # a prefix-cache hit on the oldest block
    assert pool.refcount(0) == 1
    assert pool.evictable() == [1, 2]
    assert (pool.num_used, pool.num_evictable, pool.num_available) == (1, 2, 2)

    pool.free(0)
    assert pool.evictable() == [1, 2, 0]
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [1, 2, 0]
    assert events == [(1, H1), (2, H2), (0, H0)]
    pool.check_invariants()


def test_incref_of_referenced_cached_block_does_not_touch_lru() -> None:
    pool = BlockPool(3)
    _cached_and_released(pool, [H0, H1], release_order=[1])
    pool.incref(0)
    assert pool.refcount(0) == 2
    assert pool.evictable() == [1]
    pool.free(0)
    assert pool.evictable() == [1]
    pool.free(0)
    assert pool.evictable() == [1, 0]


def test_lookup_takes_no_reference_and_keeps_lru_order() -> None:
    pool = BlockPool(3)
    _cached_and_released(pool, [H0, H1, H2], release_order=[0, 1, 2])
    assert pool.lookup(H0) == 0
    assert pool.lookup(H1) == 1
    assert pool.lookup(H3) is None
    assert pool.refcount(0) == 0
    assert pool.evictable() == [0, 1, 2]
    assert pool.allocate() == 0


def test_on_evict_runs_before_the_id_is_reused() -> None:
    pool = BlockPool(2)
    _cached_and_released(pool, [H0, H1], release_order=[1, 0])
    seen: list[tuple[int, bytes, int | None, int, int, int]] = []

    def on_evict(block_id: int, block_hash: bytes) -> None:
        # The mapping is gone, the id is not yet handed out nor on the free list.
        seen.append((block_id, block_hash, pool.lookup(block_hash), pool.refcount(block_id),
                     pool.num_free, pool.num_used))

    pool.on_evict = on_evict  # set after construction
    assert pool.allocate() == 1
    assert seen == [(1, H1, None, 0, 0, 0)]
    assert pool.evict_lru() == 0
    assert seen == [(1, H1, None, 0, 0, 0), (0, H0, None, 0, 0, 1)]
    assert pool.num_free == 1


def test_evictions_counted_without_callback() -> None:
    pool = BlockPool(2)
    _cached_and_released(pool, [H0, H1], release_order=[0, 1])
    assert pool.on_evict is None
    assert pool.allocate() == 0
    assert pool.evict_lru() == 1
    assert pool.evictions == 2


def test_evict_lru_moves_oldest_to_free_list_tail() -> None:
    pool, events = _recording_pool(4)
    _cached_and_released(pool, [H0, H1, H2], release_order=[1, 2, 0])
    # Free list: 3. Evictable: 1, 2, 0.
    assert pool.evict_lru() == 1
    assert events == [(1, H1)]
    assert pool.evictions == 1
    assert pool.lookup(H1) is None
    assert pool.evictable() == [2, 0]
    assert (pool.num_free, pool.num_evictable, pool.num_cached) == (2, 2, 2)
    # The evicted block comes after 3 on the free list, and before any eviction.
    assert [pool.allocate(), pool.allocate()] == [3, 1]
    assert events == [(1, H1)]
    assert pool.allocate() == 2
    assert events == [(1, H1), (2, H2)]
    pool.check_invariants()


def test_evict_lru_with_nothing_evictable_returns_none() -> None:
    pool, events = _recording_pool(2)
    assert pool.evict_lru() is None
    assert pool.allocate() == 0
    assert pool.cache(0, H0)  # referenced, so not evictable
    assert pool.evict_lru() is None
    assert events == []
    assert pool.evictions == 0


def test_failing_on_evict_does_not_leak_the_block() -> None:
    pool = BlockPool(2)
    _cached_and_released(pool, [H0, H1], release_order=[0, 1])

    def boom(block_id: int, block_hash: bytes) -> None:
        raise RuntimeError(f"cannot evict {block_id}")

    pool.on_evict = boom
    with pytest.raises(RuntimeError, match="cannot evict 0"):
        pool.allocate()
    pool.check_invariants()
    assert pool.lookup(H0) is None
    assert (pool.num_free, pool.num_evictable, pool.num_used) == (1, 1, 0)
    pool.on_evict = None
    assert [pool.allocate(), pool.allocate()] == [0, 1]


# ----------------------------------------------------------- allocate_many
def test_allocate_many_exact_ids_free_list_first() -> None:
    pool, events = _recording_pool(4)
    _cached_and_released(pool, [H0, H1], release_order=[1, 0])
    # Free list: 2, 3. Evictable: 1, 0.
    assert pool.allocate_many(3) == [2, 3, 1]
    assert events == [(1, H1)]
    assert pool.allocate_many(1) == [0]
    assert pool.allocate_many(1) is None
    pool.check_invariants()


def test_allocate_many_zero_is_empty() -> None:
    pool = BlockPool(1)
    assert pool.allocate_many(0) == []
    assert pool.allocate() == 0
    assert pool.allocate_many(0) == []


def test_allocate_many_failure_changes_nothing() -> None:
    pool, events = _recording_pool(4)
    _cached_and_released(pool, [H0, H1], release_order=[1])
    # Free list: 2, 3. Evictable: 1. Referenced: 0. Available: 3.
    before = _snapshot(pool)
    assert pool.allocate_many(4) is None
    assert _snapshot(pool) == before
    assert events == []
    assert pool.lookup(H1) == 1
    # The order of the free list is untouched too.
    assert pool.allocate_many(3) == [2, 3, 1]


def test_allocate_many_rolls_back_when_on_evict_raises() -> None:
    pool = BlockPool(3)
    _cached_and_released(pool, [H0, H1], release_order=[0, 1])
    calls: list[int] = []

    def fail_second(block_id: int, block_hash: bytes) -> None:
        calls.append(block_id)
        if len(calls) == 2:
            raise RuntimeError("second eviction fails")

    pool.on_evict = fail_second
    with pytest.raises(RuntimeError):
        pool.allocate_many(3)
    pool.check_invariants()
    assert pool.num_used == 0
    assert pool.num_available == 3


# ------------------------------------------------------------------ cache
def test_cache_and_lookup() -> None:
    pool = BlockPool(2)
    assert pool.allocate() == 0
    assert pool.lookup(H0) is None
    assert pool.cache(0, H0) is True
    assert pool.lookup(H0) == 0
    assert pool.block_hash(0) == H0
    assert pool.num_cached == 1
    assert pool.num_evictable == 0  # still referenced
    pool.check_invariants()


def test_cache_duplicate_hash_returns_false_and_changes_nothing() -> None:
    pool = BlockPool(3)
    assert pool.allocate_many(2) == [0, 1]
    assert pool.cache(0, H0)
    before = _snapshot(pool)
    assert pool.cache(1, H0) is False
    assert _snapshot(pool) == before
    assert pool.lookup(H0) == 0
    assert pool.block_hash(1) is None
    # Block 1 stays a private block: freeing it puts it on the free list.
    pool.free(1)
    assert pool.evictable() == []
    assert pool.num_free == 2


def test_cache_duplicate_hash_of_evictable_block_returns_false() -> None:
    pool = BlockPool(2)
    _cached_and_released(pool, [H0], release_order=[0])
    assert pool.allocate() == 1
    assert pool.cache(1, H0) is False
    assert pool.evictable() == [0]


def test_recache_same_block_same_hash_returns_true() -> None:
    pool = BlockPool(2)
    assert pool.allocate() == 0
    assert pool.cache(0, H0)
    before = _snapshot(pool)
    assert pool.cache(0, H0) is True
    assert _snapshot(pool) == before


def test_cached_referenced_block_freed_becomes_evictable() -> None:
    pool = BlockPool(2)
    assert pool.allocate() == 0
    assert pool.cache(0, H0)
    pool.free(0)
    assert pool.evictable() == [0]
    assert pool.lookup(H0) == 0
    assert (pool.num_free, pool.num_evictable, pool.num_used, pool.num_cached) == (1, 1, 0, 1)


# ---------------------------------------------------------------- uncache
def test_uncache_unreferenced_block_returns_it_to_free_list_tail() -> None:
    pool, events = _recording_pool(4)
    _cached_and_released(pool, [H0, H1], release_order=[0, 1])
    # Free list: 2, 3. Evictable: 0, 1.
    pool.uncache(0)
    assert events == []  # dropping a mapping on purpose is not an eviction
    assert pool.evictions == 0
    assert pool.lookup(H0) is None
    assert pool.block_hash(0) is None
    assert pool.evictable() == [1]
    assert (pool.num_free, pool.num_evictable, pool.num_cached) == (3, 1, 1)
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [2, 3, 0]
    assert pool.allocate() == 1
    assert events == [(1, H1)]
    pool.check_invariants()


def test_uncache_referenced_block_keeps_it_referenced() -> None:
    pool = BlockPool(2)
    assert pool.allocate() == 0
    assert pool.cache(0, H0)
    pool.uncache(0)
    assert pool.refcount(0) == 1
    assert pool.lookup(H0) is None
    assert pool.num_cached == 0
    pool.free(0)
    assert pool.evictable() == []
    assert pool.num_free == 2
    assert [pool.allocate(), pool.allocate()] == [1, 0]


def test_uncached_hash_can_be_reused() -> None:
    pool = BlockPool(2)
    assert pool.allocate_many(2) == [0, 1]
    assert pool.cache(0, H0)
    assert pool.cache(1, H0) is False
    pool.uncache(0)
    assert pool.cache(1, H0) is True
    assert pool.lookup(H0) == 1
    assert pool.cache(0, H1) is True  # and the block can be cached again


# --------------------------------------------------------------- bad input
@pytest.mark.parametrize("num_blocks", [0, -1, 1.5, True, "3", None])
def test_init_rejects_non_positive_int(num_blocks: object) -> None:
    with pytest.raises(ValueError, match="num_blocks: expected a positive int"):
        BlockPool(num_blocks)  # type: ignore[arg-type]


@pytest.mark.parametrize("op", ["incref", "free", "uncache", "refcount", "block_hash"])
@pytest.mark.parametrize("block_id", [-1, 3, 100, 1.0, True, None])
def test_out_of_range_id_rejected(op: str, block_id: object) -> None:
    pool = BlockPool(3)
    pool.allocate_many(3)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=rf"{op}: expected a block id in \[0, 3\)"):
        getattr(pool, op)(block_id)
    assert _snapshot(pool) == before


@pytest.mark.parametrize("block_id", [-1, 3, 1.0, True])
def test_cache_out_of_range_id_rejected(block_id: object) -> None:
    pool = BlockPool(3)
    with pytest.raises(ValueError, match=r"cache: expected a block id in \[0, 3\)"):
        pool.cache(block_id, H0)  # type: ignore[arg-type]


def test_double_free_rejected_and_changes_nothing() -> None:
    pool = BlockPool(3)
    assert pool.allocate() == 0
    pool.free(0)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=r"free: block 0 has refcount 0 \(double free\)"):
        pool.free(0)
    assert _snapshot(pool) == before
    with pytest.raises(ValueError, match=r"free: block 2 has refcount 0 \(double free\)"):
        pool.free(2)  # never allocated
    assert [pool.allocate(), pool.allocate(), pool.allocate()] == [1, 2, 0]


def test_double_free_of_evictable_block_rejected() -> None:
    pool = BlockPool(2)
    _cached_and_released(pool, [H0], release_order=[0])
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=r"block 0 has refcount 0 \(double free\)"):
        pool.free(0)
    assert _snapshot(pool) == before


def test_incref_of_free_uncached_block_rejected() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="incref: expected a referenced or cached block, block 1 is free"):
        pool.incref(1)
    assert pool.allocate() == 0
    pool.free(0)
    with pytest.raises(ValueError, match="block 0 is free"):
        pool.incref(0)
    assert pool.num_used == 0


def test_cache_unreferenced_block_rejected() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="cache: expected a referenced block, block 0 has refcount 0"):
        pool.cache(0, H0)
    # An evictable (cached, refcount 0) block is not referenced either.
    _cached_and_released(pool, [H1], release_order=[0])
    with pytest.raises(ValueError, match="block 0 has refcount 0"):
        pool.cache(0, H1)
    assert pool.num_cached == 1


def test_cache_under_second_hash_rejected() -> None:
    pool = BlockPool(2)
    assert pool.allocate() == 0
    assert pool.cache(0, H0)
    before = _snapshot(pool)
    with pytest.raises(ValueError, match=f"cache: block 0 is already cached under hash {H0.hex()}"):
        pool.cache(0, H1)
    assert _snapshot(pool) == before
    assert pool.lookup(H1) is None


@pytest.mark.parametrize("bad_hash", ["h0", bytearray(b"h0"), 7, None])
def test_non_bytes_hash_rejected(bad_hash: object) -> None:
    pool = BlockPool(2)
    assert pool.allocate() == 0
    with pytest.raises(ValueError, match="cache: expected block_hash as bytes"):
        pool.cache(0, bad_hash)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lookup: expected block_hash as bytes"):
        pool.lookup(bad_hash)  # type: ignore[arg-type]
    assert pool.num_cached == 0


def test_uncache_of_uncached_block_rejected() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="uncache: expected a cached block, block 0 is not cached"):
        pool.uncache(0)
    assert pool.allocate() == 0
    with pytest.raises(ValueError, match="block 0 is not cached"):
        pool.uncache(0)
    assert pool.cache(0, H0)
    pool.uncache(0)
    with pytest.raises(ValueError, match="block 0 is not cached"):
        pool.uncache(0)


@pytest.mark.parametrize("n", [-1, 1.0, True, None])
def test_allocate_many_rejects_bad_count(n: object) -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="allocate_many: expected a non-negative int"):
        pool.allocate_many(n)  # type: ignore[arg-type]
    assert pool.num_free == 2


# -------------------------------------------------------------- invariants
def _corrupt_negative_refcount(pool: BlockPool) -> None:
    pool._refcounts[2] = -1


def _corrupt_leak(pool: BlockPool) -> None:
    pool._free.remove(2)


def _corrupt_double_listed(pool: BlockPool) -> None:
    pool._free.append(1)


def _corrupt_hash_map(pool: BlockPool) -> None:
    pool._hash_to_block[H1] = 0


def _corrupt_evictable_uncached(pool: BlockPool) -> None:
    pool._hashes[1] = None


def _corrupt_used_counter(pool: BlockPool) -> None:
    pool._num_used += 1


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_negative_refcount,
        _corrupt_leak,
        _corrupt_double_listed,
        _corrupt_hash_map,
        _corrupt_evictable_uncached,
        _corrupt_used_counter,
    ],
)
def test_check_invariants_detects_corruption(corrupt: Callable[[BlockPool], None]) -> None:
    pool = BlockPool(4)
    _cached_and_released(pool, [H0, H1], release_order=[1])
    # Referenced: 0 (cached). Evictable: 1. Free: 2, 3.
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_module_imports_neither_torch_nor_numpy() -> None:
    import tiered_kv.block_pool as block_pool

    tree = ast.parse(inspect.getsource(block_pool))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            imported.add(node.module.split(".")[0])
    assert "__future__" in imported
    assert not imported & {"torch", "numpy"}


# ------------------------------------------------------------ state machine
_HASHES = [b"h%d" % i for i in range(5)]
#: (kind, index) for :meth:`BlockPoolMachine._pick_id`: kind 0 (one in four) means any id.
_PICKS = st.tuples(st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=63))


class BlockPoolMachine(RuleBasedStateMachine):
    """Random operations on a pool of 1..8 blocks, checked against a list-based model.

    The model keeps the free list and the evictable LRU as plain lists, so it predicts
    the exact id every allocation returns and the exact ``on_evict`` sequence. Every id
    argument is drawn mostly from the blocks where the operation succeeds and otherwise
    from ``-1..num_blocks`` (out-of-range ids, double frees, increfs of free blocks), so
    both the success and the ``ValueError`` paths run often.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.events: list[tuple[int, bytes]] = []

    @initialize(num_blocks=st.integers(min_value=1, max_value=8))
    def init_pool(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, on_evict=lambda b, h: self.events.append((b, h)))
        self.n = num_blocks
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free_q = list(range(num_blocks))
        self.lru: list[int] = []  # oldest first
        self.evictions = 0
        # Blocks passed over by evictions: only evictions from an LRU of two or more
        # blocks tell oldest-first from any other order.
        self.eviction_choices = 0
        self.expected_events: list[tuple[int, bytes]] = []

    # ----------------------------------------------------------- model ops
    def _pick_id(self, pick: tuple[int, int], useful: list[int]) -> int:
        """Mostly one of ``useful``, else any id in ``-1..num_blocks`` (one past each end).

        ``pick`` comes from :data:`_PICKS`; mapping it here is much cheaper than
        ``st.data()`` draws, which dominated the run time.
        """
        kind, index = pick
        if useful and kind > 0:
            return useful[index % len(useful)]
        return index % (self.n + 2) - 1

    def _valid(self, block_id: int) -> bool:
        return 0 <= block_id < self.n

    def _model_evict_oldest(self) -> int:
        self.eviction_choices += len(self.lru) - 1
        block_id = self.lru.pop(0)
        block_hash = self.hash_of[block_id]
        assert block_hash is not None
        del self.by_hash[block_hash]
        self.hash_of[block_id] = None
        self.evictions += 1
        self.expected_events.append((block_id, block_hash))
        return block_id

    def _model_allocate(self) -> int | None:
        if self.free_q:
            block_id = self.free_q.pop(0)
        elif self.lru:
            block_id = self._model_evict_oldest()
        else:
            return None
        self.refs[block_id] = 1
        return block_id

    def _expect_value_error(self, op: str, *args: object) -> None:
        """Bad input raises and leaves the pool exactly as it was."""
        assert self.pool is not None
        before = _snapshot(self.pool)
        with pytest.raises(ValueError):
            getattr(self.pool, op)(*args)
        assert _snapshot(self.pool) == before

    # --------------------------------------------------------------- rules
    @rule(cache_as=st.none() | st.sampled_from(_HASHES))
    def allocate(self, cache_as: bytes | None) -> None:
        assert self.pool is not None
        block_id = self._model_allocate()
        assert self.pool.allocate() == block_id
        if block_id is not None and cache_as is not None:
            # Allocate-fill-commit, the scheduler's common path, so cached blocks abound.
            self._cache(block_id, cache_as)

    @rule(count=st.integers(min_value=0, max_value=5))
    def allocate_many(self, count: int) -> None:
        assert self.pool is not None
        if count > len(self.free_q) + len(self.lru):
            before = _snapshot(self.pool)
            assert self.pool.allocate_many(count) is None
            assert _snapshot(self.pool) == before  # all-or-nothing: nothing evicted
        else:
            assert self.pool.allocate_many(count) == [self._model_allocate() for _ in range(count)]

    @rule(pick=_PICKS)
    def incref(self, pick: tuple[int, int]) -> None:
        assert self.pool is not None
        # Useful: evictable blocks (a prefix-cache hit) and referenced ones.
        block_id = self._pick_id(pick, self.lru + [b for b in range(self.n) if self.refs[b]])
        if not self._valid(block_id) or (self.refs[block_id] == 0 and self.hash_of[block_id] is None):
            self._expect_value_error("incref", block_id)
            return
        if self.refs[block_id] == 0:
            self.lru.remove(block_id)
        self.refs[block_id] += 1
        self.pool.incref(block_id)

    @rule(pick=_PICKS, times=st.integers(min_value=1, max_value=3))
    def free(self, pick: tuple[int, int], times: int) -> None:
        # Freeing the same block several times in a row releases shared blocks to the
        # LRU often, and runs into double frees.
        block_id = self._pick_id(pick, [b for b in range(self.n) if self.refs[b]])
        for _ in range(times):
            self._free(block_id)

    def _free(self, block_id: int) -> None:
        assert self.pool is not None
        if not self._valid(block_id) or self.refs[block_id] == 0:
            self._expect_value_error("free", block_id)  # a double free changes nothing
            return
        self.refs[block_id] -= 1
        if self.refs[block_id] == 0:
            (self.free_q if self.hash_of[block_id] is None else self.lru).append(block_id)
        self.pool.free(block_id)

    @rule(pick=_PICKS, block_hash=st.sampled_from(_HASHES))
    def cache(self, pick: tuple[int, int], block_hash: bytes) -> None:
        self._cache(self._pick_id(pick, [b for b in range(self.n) if self.refs[b]]), block_hash)

    def _cache(self, block_id: int, block_hash: bytes) -> None:
        assert self.pool is not None
        if not self._valid(block_id) or self.refs[block_id] == 0:
            self._expect_value_error("cache", block_id, block_hash)
            return
        current = self.hash_of[block_id]
        if current is not None and current != block_hash:
            self._expect_value_error("cache", block_id, block_hash)
            return
        if current is None and block_hash in self.by_hash:
            expected = False
        else:
            expected = True
            self.hash_of[block_id] = block_hash
            self.by_hash[block_hash] = block_id
        assert self.pool.cache(block_id, block_hash) is expected

    @rule(pick=_PICKS)
    def uncache(self, pick: tuple[int, int]) -> None:
        assert self.pool is not None
        block_id = self._pick_id(pick, sorted(self.by_hash.values()))
        block_hash = self.hash_of[block_id] if self._valid(block_id) else None
        if block_hash is None:
            self._expect_value_error("uncache", block_id)
            return
        del self.by_hash[block_hash]
        self.hash_of[block_id] = None
        if self.refs[block_id] == 0:
            self.lru.remove(block_id)
            self.free_q.append(block_id)
        self.pool.uncache(block_id)

    @rule(block_hash=st.sampled_from(_HASHES))
    def lookup(self, block_hash: bytes) -> None:
        assert self.pool is not None
        before = _snapshot(self.pool)
        assert self.pool.lookup(block_hash) == self.by_hash.get(block_hash)
        assert _snapshot(self.pool) == before  # no reference taken, LRU order kept

    @rule()
    def evict_lru(self) -> None:
        assert self.pool is not None
        expected = None
        if self.lru:
            expected = self._model_evict_oldest()
            self.free_q.append(expected)
        assert self.pool.evict_lru() == expected

    def teardown(self) -> None:
        # Steer generation towards runs that evict from a long LRU: those need the free
        # list drained and several cached blocks released, which random rules rarely do.
        if self.pool is not None:
            target(float(self.eviction_choices), label="blocks passed over by evictions")

    # ------------------------------------------------------------ invariant
    @invariant()
    def agrees_with_model(self) -> None:
        if self.pool is None:
            return
        pool = self.pool
        pool.check_invariants()
        used = sum(r > 0 for r in self.refs)
        assert all(r >= 0 for r in self.refs)
        assert len(self.free_q) + len(self.lru) + used == self.n  # no leak in the model
        assert [pool.refcount(b) for b in range(self.n)] == self.refs
        assert [pool.block_hash(b) for b in range(self.n)] == self.hash_of
        assert pool.evictable() == self.lru
        assert (pool.num_free, pool.num_evictable, pool.num_used, pool.num_cached) == (
            len(self.free_q), len(self.lru), used, len(self.by_hash),
        )
        assert pool.num_available == len(self.free_q) + len(self.lru)
        assert pool.num_free + pool.num_evictable + pool.num_used == pool.num_blocks == self.n
        assert all(pool.lookup(h) == self.by_hash.get(h) for h in _HASHES)
        assert pool.evictions == self.evictions
        assert self.events == self.expected_events


TestBlockPoolMachine = BlockPoolMachine.TestCase
# 80 runs of up to 50 steps: about 4000 operations (around a hundred evictions),
# a few seconds on a slow core. Runs must be long-ish: an eviction needs the free list
# drained first.
TestBlockPoolMachine.settings = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("seed", range(16))
def test_seeded_random_walk_agrees_with_model(seed: int) -> None:
    """The machine's rules and model, driven by a seeded, weighted random walk.

    Hypothesis spends many of its runs on short or few-rule sequences, so the states
    that tell eviction orders apart (free list drained, several cached blocks released)
    come up only now and then. These walks favour allocate / cache / free and reach
    them on every seed; they are deterministic and shrink nothing.
    """
    rng = random.Random(seed)
    num_blocks = 1 + seed % 8
    machine = BlockPoolMachine()
    machine.init_pool(num_blocks=num_blocks)

    def pick() -> tuple[int, int]:
        return rng.randrange(4), rng.randrange(64)

    steps: list[tuple[float, Callable[[], None]]] = [
        (4, lambda: machine.allocate(cache_as=rng.choice([None, *_HASHES]))),
        (1, lambda: machine.allocate_many(count=rng.randrange(4))),
        (1, lambda: machine.incref(pick=pick())),
        (4, lambda: machine.free(pick=pick(), times=rng.randrange(1, 3))),
        (1, lambda: machine.cache(pick=pick(), block_hash=rng.choice(_HASHES))),
        (0.5, lambda: machine.uncache(pick=pick())),
        (0.5, lambda: machine.lookup(block_hash=rng.choice(_HASHES))),
        (0.5, machine.evict_lru),
    ]
    weights = [w for w, _ in steps]
    for _ in range(500):
        rng.choices(steps, weights)[0][1]()
        machine.agrees_with_model()
    if num_blocks >= 2:
        assert machine.eviction_choices > 0, "the walk never evicted from an LRU of 2+ blocks"



# ------------------------------------------------------------ leaves first
def _cached(pool: BlockPool, h: bytes, parent: bytes | None) -> int:
    b = pool.allocate()
    assert b is not None and pool.cache(b, h, parent)
    return b


def test_leaf_first_parks_a_parent_until_its_last_child_goes() -> None:
    # a path a -> b -> c, released start first (the order a flat LRU evicts a path's start in)
    pool = BlockPool(4, leaf_first=True)
    a, b, c = _cached(pool, b"a", None), _cached(pool, b"b", b"a"), _cached(pool, b"c", b"b")
    x = _cached(pool, b"x", None)  # another path, released last
    for blk in (a, b, c, x):
        pool.free(blk)
    evicted: list[bytes] = []
    pool.on_evict = lambda _b, h: evicted.append(h)
    assert [pool.allocate() for _ in range(4)] == [c, b, a, x]
    assert evicted == [b"c", b"b", b"a", b"x"]  # leaves first; the parked parents back at the head
    assert pool.stranding_evictions == 0
    pool.check_invariants()


def test_plain_lru_evicts_the_path_start_first() -> None:
    pool = BlockPool(3)
    a, b, c = _cached(pool, b"a", None), _cached(pool, b"b", b"a"), _cached(pool, b"c", b"b")
    for blk in (a, b, c):
        pool.free(blk)
    assert [pool.allocate() for _ in range(3)] == [a, b, c]


def test_leaf_first_keeps_lru_order_among_leaves_and_a_hit_unparks() -> None:
    pool = BlockPool(5, leaf_first=True)
    a, b = _cached(pool, b"a", None), _cached(pool, b"b", b"a")
    y, z = _cached(pool, b"y", None), _cached(pool, b"z", None)
    for blk in (a, y, b, z):  # LRU: a (parent of b), y, b, z
        pool.free(blk)
    assert pool.evict_lru() == y  # a parked (b is cached after it), y the oldest leaf
    assert pool.evictable() == [b, z, a]
    pool.incref(a)  # a hit on the parked block takes it out; released, it is the newest
    pool.free(a)
    assert pool.evictable() == [b, z, a]
    assert [pool.evict_lru() for _ in range(3)] == [b, z, a]
    pool.check_invariants()


def test_leaf_first_with_every_child_referenced_evicts_a_parent_and_counts_it() -> None:
    pool = BlockPool(2, leaf_first=True)
    a = _cached(pool, b"a", None)
    b = _cached(pool, b"b", b"a")  # b stays referenced (a suffix held without its prefix)
    pool.free(a)
    assert pool.num_available == 1
    assert pool.allocate() == a and pool.stranding_evictions == 1
    assert pool.num_children(b"a") == 1  # b still counts under its parent's hash
    pool.check_invariants()


def test_leaf_first_uncache_and_evict_hash_release_the_parent() -> None:
    pool = BlockPool(3, leaf_first=True)
    a, b = _cached(pool, b"a", None), _cached(pool, b"b", b"a")
    pool.free(a)
    pool.free(b)
    assert pool.parent_hash(b) == b"a" and pool.num_children(b"a") == 1
    assert not pool.evict_hash(b"nope")
    seen: list[bytes] = []
    pool.on_evict = lambda _b, h: seen.append(h)
    assert pool.evict_hash(b"b") and seen == [b"b"] and pool.num_children(b"a") == 0
    pool.uncache(a)
    assert pool.num_cached == 0 and pool.num_free == 3
    pool.check_invariants()


# ------------------------------------------------ small / main / ghost queues (leaf-s3fifo)
def test_s3fifo_used_once_leaves_before_reused_and_leaves_first_holds_in_both_queues() -> None:
    # 10 blocks, small queue target 2: a path a -> b reused (main), then one-off leaves x, y, z
    pool = BlockPool(10, leaf_first=True, small_fraction=0.2)
    a, b = _cached(pool, b"a", None), _cached(pool, b"b", b"a")
    pool.free(b)
    pool.free(a)
    for blk in (a, b):  # a lookup takes the path again: reused
        pool.incref(blk)
    pool.free(b)
    pool.free(a)
    x, y, z = _cached(pool, b"x", None), _cached(pool, b"y", None), _cached(pool, b"z", None)
    for blk in (x, y, z):
        pool.free(blk)
    assert pool.evictable() == [x, y, z, b, a] and pool.in_main(a) and pool.in_main(b) and not pool.in_main(x)
    evicted: list[bytes] = []
    pool.on_evict = lambda _b, h: evicted.append(h)
    # the small queue holds 3 >= 2: x, then y; at 1 < 2 the main queue: a is parked (b is
    # cached after it), b goes, a returns to the main queue's head and goes; then z
    assert [pool.evict_lru() for _ in range(5)] == [x, y, b, a, z]
    assert evicted == [b"x", b"y", b"b", b"a", b"z"] and pool.stranding_evictions == 0
    pool.check_invariants()


def test_s3fifo_a_ghost_computed_again_goes_to_the_main_queue() -> None:
    pool = BlockPool(4, leaf_first=True, small_fraction=0.25)
    x = _cached(pool, b"x", None)
    pool.free(x)
    assert pool.evict_lru() == x  # used once: out of the small queue, remembered as a ghost
    again = _cached(pool, b"x", None)  # computed again soon after: reused
    fresh = _cached(pool, b"n", None)
    pool.free(again)
    pool.free(fresh)
    assert pool.in_main(again) and not pool.in_main(fresh)
    assert pool.evict_lru() == fresh  # the small queue (1 >= target 1) goes first
    marked = _cached(pool, b"m", None)  # cached as loaded from a lower tier: reused
    pool.uncache(marked)
    pool.free(marked)
    loaded = pool.allocate()
    assert loaded is not None and pool.cache(loaded, b"m", None, reused=True)
    pool.free(loaded)
    assert pool.in_main(loaded)
    pool.check_invariants()


def test_s3fifo_tells_a_lower_tier_whether_the_evicted_block_was_reused() -> None:
    pool = BlockPool(2, leaf_first=True, small_fraction=0.5)
    seen: list[tuple[bytes, bool]] = []
    pool.on_evict = lambda _b, h: seen.append((h, pool.evicted_hot))
    a = _cached(pool, b"a", None)
    pool.free(a)
    pool.incref(a)
    pool.free(a)
    o = _cached(pool, b"o", None)
    pool.free(o)
    assert pool.evict_lru() == o and pool.evict_lru() == a
    assert seen == [(b"o", False), (b"a", True)] and not pool.evicted_hot
    with pytest.raises(ValueError, match="small_fraction"):
        BlockPool(2, small_fraction=1.0)
