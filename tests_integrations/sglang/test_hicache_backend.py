"""tiered_kv as SGLang's HiCache L3, driven through SGLang 0.5.23's real classes.

The backend is created by SGLang's ``StorageBackendFactory`` (``dynamic``), registered
with SGLang's host pools built on CPU, and called the way ``CacheController`` /
``HybridCacheController`` call it: ``batch_set_v1`` after a backup, ``batch_exists`` to plan
a prefetch, ``batch_get_v1`` into freshly allocated host pages; the ``*_v2`` calls with
``PoolTransfer``s for DeepSeek V4's side pools. Every read is compared byte for byte with
what was written.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
from pathlib import Path

import _sglang_env as env
from _util import lmdb_raw_read, lmdb_raw_write  # tests/_util.py, put on sys.path by conftest
import pytest
import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageExtraInfo,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.observability.metrics_collector import StorageMetrics

from tiered_kv.integrations.sglang import ClearRefusedError, TieredKVHiCacheStorage
from tiered_kv.storage import LayoutMismatchError, open_store

HERE = Path(__file__).resolve().parent
PAGE = env.PAGE


def _backend(backends, store, pool, side=None, **cfg):
    b = env.create_backend(env.storage_config(store, **cfg), pool, side)
    backends.append(b)
    return b


def _store_and_reload(backend, pool, n, seed=1, key_seed=0):
    """Write n random pages, then read them into other host pages; returns both byte lists."""
    keys = env.page_keys(n, key_seed)
    src = pool.alloc(n * PAGE)
    env.fill_pages(pool, src, seed)
    assert backend.batch_set_v1(keys, src, HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * n
    dst = pool.alloc(n * PAGE)
    assert backend.batch_exists(keys) == n
    assert backend.batch_get_v1(keys, dst) == [True] * n
    return env.page_bytes(pool, src), env.page_bytes(pool, dst), keys, dst


def _corrupt(store_path: Path, record_key, offset_from_end: int = 40) -> None:
    """Flip one payload byte of a record in a closed LMDB store, in its segment file."""
    kb = record_key.to_bytes()
    raw = bytearray(lmdb_raw_read(store_path, kb))
    raw[len(raw) - offset_from_end] ^= 0xFF
    lmdb_raw_write(store_path, kb, bytes(raw))


# ---------------------------------------------------------------------- loading
def test_factory_loads_the_dynamic_backend(store_url, backends):
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool)
    assert isinstance(b, TieredKVHiCacheStorage)
    assert b.interface_v1 and b.model_id == "deepseek-ai/DeepSeek-V4-Flash"


def test_factory_wraps_it_in_sglangs_failure_injector_when_asked(store_url, backends, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool)
    assert isinstance(b, HiCacheStorageFailureInjector)
    keys = env.page_keys(2)
    idx = pool.alloc(2 * PAGE)
    assert b.batch_set_v1(keys, idx) == [False, False]
    assert b.batch_exists(keys) == 0
    # the injector forwards only HiCacheStorage's calls; of() reaches our counters behind it
    assert not hasattr(b, "counters")
    ours = TieredKVHiCacheStorage.of(b)
    assert ours.counters()["pages_written"] == 0 and ours.counters()["store.records"] == 0  # failed before us


def test_counters_are_reachable_behind_the_failure_injector(store_url, backends, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.0")  # wrapped, never failing
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool)
    assert isinstance(b, HiCacheStorageFailureInjector)
    written, read, _, _ = _store_and_reload(b, pool, 3)
    assert read == written
    c = TieredKVHiCacheStorage.of(b).counters()
    assert (c["pages_written"], c["pages_read"], c["store.records"]) == (3, 3, 3)
    assert TieredKVHiCacheStorage.of(TieredKVHiCacheStorage.of(b)) is TieredKVHiCacheStorage.of(b)
    with pytest.raises(TypeError, match="expected a TieredKVHiCacheStorage, or SGLang's failure injector"):
        TieredKVHiCacheStorage.of(object())


def test_config_errors_name_what_was_expected(tmp_path):
    cfg = env.storage_config(None)
    with pytest.raises(ValueError, match='expected "store"'):
        TieredKVHiCacheStorage(cfg, {})
    cfg = env.storage_config(f"lmdb://{tmp_path}/s", model=None)
    with pytest.raises(ValueError, match="model id"):
        TieredKVHiCacheStorage(cfg, {})


@pytest.mark.parametrize("key", ["snapshot_policy", "eviction"])
def test_cache_policy_options_are_refused_with_the_reason(tmp_path, key):
    cfg = env.storage_config(f"lmdb://{tmp_path}/s", **{key: "leaf-lru" if key == "eviction" else "branch"})
    with pytest.raises(ValueError, match=f"{key} select the policies of tiered_kv's own GPU and host tiers"):
        TieredKVHiCacheStorage(cfg, {})
    assert not (tmp_path / "s").exists()


def test_store_options_timeout_is_harmless_on_a_local_store(store_url, backends):
    """The chain example's ``store_options`` on a single LMDB store: accepted, no effect."""
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool, store_options={"timeout_s": 2.0, "max_bytes": 1 << 30})
    written, read, _, _ = _store_and_reload(b, pool, 2)
    assert read == written


def test_an_unknown_store_option_lists_the_valid_ones(store_url):
    cfg = env.storage_config(store_url, store_options={"max_byte": 1 << 30})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['max_byte'\]; expected some of \[.*'max_bytes'"):
        TieredKVHiCacheStorage(cfg, {})


def test_a_store_of_another_layout_is_refused(tmp_path):
    open_store(f"lmdb://{tmp_path}/kv", layout_fingerprint="tiny-other").close()
    with pytest.raises(LayoutMismatchError):
        TieredKVHiCacheStorage(env.storage_config(f"lmdb://{tmp_path}/kv"), {})


def test_the_cli_opens_the_backends_store_and_names_its_writer(store_url, backends, capsys):
    """``tiered-kv stats / verify / gc`` with no layout option on the store the backend
    wrote; ``stats`` names the SGLang adapter, the model and a hash of the tenant."""
    from tiered_kv.cli.main import main
    from tiered_kv.storage import tenant_hash

    pool = env.mla_host_pool()
    b = env.create_backend(env.storage_config(store_url, tenant="team-secret"), pool, None)
    _store_and_reload(b, pool, 4)
    b.close()
    assert main(["stats", "--store", store_url, "--json"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out)
    assert stats["layout_fingerprint"] == "sglang-hicache-v1" and stats["records"] == 4
    writer = stats["writer"]
    assert (writer["writer"], writer["model"]) == ("sglang-adapter", "deepseek-ai/DeepSeek-V4-Flash")
    assert writer["tenant_sha256"] == tenant_hash("team-secret") and "team-secret" not in out
    assert main(["verify", "--store", store_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 4
    assert main(["gc", "--store", store_url, "--max-bytes", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 0


# ---------------------------------------------------------------------- v1 zero-copy
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_v1_round_trip_through_mla_host_pool(store_url, backends, layout):
    pool = env.mla_host_pool(layout)
    b = _backend(backends, store_url, pool)
    written, read, _, _ = _store_and_reload(b, pool, 5)
    assert read == written
    assert len({p for p in written}) == 5  # the pages differ: a mix-up would show
    c = b.counters()
    assert c["pages_written"] == 5 and c["pages_read"] == 5 and c["store.records"] == 5


def test_layer_first_pages_are_written_and_read_in_place(tmp_path, backends, monkeypatch):
    """A layer_first page (one host buffer per layer) goes to the store as the list of its
    buffers and comes back as a scatter list of them: no bounce buffer on either side.
    The record holds the buffers back to back, and a flipped byte in it is a miss."""
    import numpy as np

    pool = env.mla_host_pool("layer_first")
    b = _backend(backends, f"lmdb://{tmp_path / 'kv'}", pool)
    seen: dict[str, list] = {}
    put_many, get_many = b.store.put_many, b.store.get_many

    def spy_put(items):
        seen["put"] = [item.payload for item in items]
        return put_many(items)

    def spy_get(keys, outs, **kw):
        seen["get"] = list(outs)
        return get_many(keys, outs, **kw)

    monkeypatch.setattr(b.store, "put_many", spy_put)
    monkeypatch.setattr(b.store, "get_many", spy_get)
    written, read, keys, _ = _store_and_reload(b, pool, 3)
    assert read == written
    host = pool.kv_buffer.view(torch.uint8).numpy()
    for name in ("put", "get"):
        assert len(seen[name]) == 3
        for page in seen[name]:
            assert isinstance(page, list) and len(page) == env.LAYERS
            assert all(np.shares_memory(piece, host) for piece in page), f"{name}: a copy, not the pool's pages"
    first, second = b.record_keys(keys[:2])
    b.close()
    record = np.frombuffer(lmdb_raw_read(tmp_path / "kv", first.to_bytes()), np.uint8)
    assert record[144:-16].tobytes() == b"".join(p.tobytes() for p in seen["put"][0])
    _corrupt(tmp_path / "kv", second, offset_from_end=16 + 1000)  # mid-payload
    b = _backend(backends, f"lmdb://{tmp_path / 'kv'}", pool)
    assert b.batch_get_v1(keys, pool.alloc(3 * PAGE)) == [True, False, True]


@pytest.mark.parametrize("pool_kind", ["mla", "mha"])
@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_page_views_are_the_buffers_the_pool_reports(store_url, backends, pool_kind, layout):
    """Each page's scatter list is exactly the host pool's buffers of that page, as
    ``get_page_buffer_meta`` reports them (address and size, in order): 1-D writable
    views, never copies, whatever runs of equal strides they were built from."""
    pool = env.mla_host_pool(layout) if pool_kind == "mla" else env.mha_host_pool(layout)
    b = _backend(backends, store_url, pool, is_mla=pool_kind == "mla")
    pool.alloc(PAGE)                     # so the pages below do not start at slot 0
    idx = pool.alloc(4 * PAGE)
    idx = torch.cat([idx[2 * PAGE:], idx[:2 * PAGE]])   # pages out of address order
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    pages = b._page_views(b._binding(PoolName.KV), env.page_keys(4), idx)
    pieces = [piece for page in pages for piece in page]
    assert [p.ctypes.data for p in pieces] == [int(x) for x in ptrs]
    assert [p.nbytes for p in pieces] == [int(x) for x in sizes]
    assert all(p.ndim == 1 and p.flags.c_contiguous and p.flags.writeable for p in pieces)
    assert all(page.nbytes == sum(p.nbytes for p in page) for page in pages)


def test_page_pieces_join_only_buffers_of_one_size_at_one_stride():
    """Runs of buffers (one strided view each) are found on every page alike; any other
    arrangement falls back to one view per buffer, at the same addresses."""
    import numpy as np

    from tiered_kv.integrations.sglang import _buffer_runs, _page_pieces

    host = np.zeros(1 << 16, np.uint8)
    base = host.ctypes.data
    # MHA layer_first-like: K of 3 layers at stride 4096, then V of 3 layers at stride 4096
    ptrs = np.array([[base + o + page * 64 for o in (0, 4096, 8192, 20000, 24096, 28192)]
                     for page in range(3)], np.int64)
    sizes = (64,) * 6
    assert _buffer_runs(ptrs, sizes) == [(0, 3, 4096), (3, 6, 4096)]
    # one page with another step between buffers 1 and 2: those two are no longer joined
    odd = ptrs.copy()
    odd[1, 2] += 128
    assert _buffer_runs(odd, sizes) == [(0, 2, 4096), (2, 3, 0), (3, 6, 4096)]
    # buffers of different sizes, or overlapping ones (a step below the size), stand alone
    assert _buffer_runs(ptrs, (64, 64, 32, 64, 64, 64)) == [(0, 2, 4096), (2, 3, 0), (3, 6, 4096)]
    assert _buffer_runs(ptrs[:, :3], (8192,) * 3) == [(0, 1, 0), (1, 2, 0), (2, 3, 0)]
    for p, s in ((ptrs, sizes), (odd, sizes), (ptrs[:, :3], (8192,) * 3)):
        pages = _page_pieces(p, s)
        got = [[(v.ctypes.data, v.nbytes) for v in page] for page in pages]
        assert got == [[(int(a), n) for a, n in zip(row, s)] for row in p]
        assert all(np.shares_memory(v, host) for page in pages for v in page)


def test_a_pool_reporting_other_buffer_sizes_is_refused(store_url, backends, monkeypatch):
    """The sizes of every page's buffers are checked against the bound layout, not only
    the first page's: a mismatch is a ValueError, nothing is read or written."""
    pool = env.mla_host_pool("layer_first")
    b = _backend(backends, store_url, pool)
    idx = pool.alloc(2 * PAGE)
    meta = pool.get_page_buffer_meta

    def short_last_buffer(indices):
        ptrs, sizes = meta(indices)
        return ptrs, list(sizes[:-1]) + [sizes[-1] - 1]

    monkeypatch.setattr(pool, "get_page_buffer_meta", short_last_buffer)
    with pytest.raises(ValueError, match="expected 3 buffers"):
        b.batch_set_v1(env.page_keys(2), idx)
    assert b.counters()["store.records"] == 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_mha_tp_ranks_keep_their_own_heads_apart(store_url, backends, layout):
    """An MHA model's TP ranks store the same page keys with different bytes (their own
    heads); each reads back its own. K and V are separate buffers of each page."""
    n = 3
    keys = env.page_keys(n)
    pools = [env.mha_host_pool(layout) for _ in range(2)]
    ranks = [_backend(backends, store_url, pool, is_mla=False, tp_rank=r, tp_size=2)
             for r, pool in enumerate(pools)]
    written = []
    for r, (b, pool) in enumerate(zip(ranks, pools)):
        src = pool.alloc(n * PAGE)
        env.fill_pages(pool, src, 100 + r)
        assert b.batch_set_v1(keys, src) == [True] * n
        written.append(env.page_bytes(pool, src))
    assert written[0] != written[1]
    for r, (b, pool) in enumerate(zip(ranks, pools)):
        dst = pool.alloc(n * PAGE)
        assert b.batch_get_v1(keys, dst) == [True] * n
        assert env.page_bytes(pool, dst) == written[r]
    assert ranks[0].counters()["store.records"] == 2 * n
    # both ranks share this process's one handle on the store; closing one keeps the other's
    ranks[0].close()
    assert ranks[1].batch_exists(keys) == n and not ranks[1].store.closed


def test_batch_exists_counts_leading_pages(store_url, backends):
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool)
    keys = env.page_keys(8)
    idx = pool.alloc(8 * PAGE)
    env.fill_pages(pool, idx, 3)
    assert b.batch_set_v1(keys[:5], idx[:5 * PAGE]) == [True] * 5
    assert b.batch_set_v1(keys[6:], idx[6 * PAGE:]) == [True] * 2  # page 5 missing
    assert b.batch_exists(keys) == 5
    assert b.batch_exists(keys[6:]) == 2
    assert b.batch_exists(env.page_keys(3, seed=9)) == 0
    c = b.counters()   # the three queries: 8 + 2 + 3 pages asked, 5 + 2 found, the others not cached
    assert (c["lookup_pages"], c["lookup_pages_hit"], c["lookup_pages_no_state"],
            c["lookup_pages_not_cached"]) == (13, 7, 0, 6)
    assert b.exists(keys[0]) and not b.exists(keys[5])


def test_rewrite_of_a_stored_page_is_a_success_that_keeps_the_first_bytes(store_url, backends):
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool)
    written, _, keys, _ = _store_and_reload(b, pool, 2)
    other = pool.alloc(2 * PAGE)
    env.fill_pages(pool, other, 77)
    assert b.batch_set_v1(keys, other) == [True, True]  # write-once: already stored
    dst = pool.alloc(2 * PAGE)
    assert b.batch_get_v1(keys, dst) == [True, True]
    assert env.page_bytes(pool, dst) == written
    assert b.counters()["pages_already_stored"] == 2


def test_a_corrupt_record_is_a_failed_page_never_bytes(tmp_path, backends):
    url = f"lmdb://{tmp_path / 'kv'}"
    pool = env.mla_host_pool()
    b = env.create_backend(env.storage_config(url), pool)
    written, _, keys, _ = _store_and_reload(b, pool, 4)
    bad = b.record_keys([keys[2]])[0]
    b.close()
    _corrupt(tmp_path / "kv", bad)

    b = _backend(backends, url, pool)  # a restart over the damaged store
    dst = pool.alloc(4 * PAGE)
    ok = b.batch_get_v1(keys, dst)
    assert ok == [True, True, False, True]
    assert env.page_bytes(pool, dst)[:2] == written[:2]
    c = b.counters()
    assert c["pages_missed"] == 1 and c["store.corrupt"] == 1
    assert b.batch_exists(keys) == 2  # the corrupt record was removed: SGLang re-fetches from page 2
    # ... and the page can be stored again
    src = pool.alloc(4 * PAGE)
    env.fill_pages(pool, src, 1)
    assert b.batch_set_v1(keys, src) == [True] * 4
    assert b.batch_exists(keys) == 4


def test_pages_of_another_model_tenant_or_mha_shard_are_invisible(store_url, backends):
    pool = env.mla_host_pool()
    a = _backend(backends, store_url, pool, tenant="a")
    _, _, keys, _ = _store_and_reload(a, pool, 3)
    a.close()
    for cfg in ({"tenant": "b"}, {"tenant": "a", "model": "other/model"},
                {"tenant": "a", "is_mla": False, "tp_rank": 1, "tp_size": 2}):
        other = _backend(backends, store_url, env.mla_host_pool(), **cfg)
        assert other.batch_exists(keys) == 0, cfg
        other.close()
    again = _backend(backends, store_url, pool, tenant="a")
    assert again.batch_exists(keys) == 3


def test_a_different_host_layout_does_not_read_the_pages(store_url, backends):
    pool = env.mla_host_pool("page_first")
    a = _backend(backends, store_url, pool)
    _, _, keys, _ = _store_and_reload(a, pool, 2)
    a.close()
    b = _backend(backends, store_url, env.mla_host_pool("layer_first"))
    assert b.batch_exists(keys) == 0  # its page bytes are ordered differently


def _controller(backend):
    """SGLang's ``HiCacheController`` with only its storage side set up (no GPU pools, no
    threads): its own ``_page_backup`` / ``_storage_hit_query`` / ``_page_transfer`` then
    run against the backend exactly as its backup and prefetch threads run them, including
    the split into ``STORAGE_BATCH_SIZE`` batches, ``interface_v1`` selecting the zero-copy
    calls."""
    ctrl = HiCacheController.__new__(HiCacheController)
    ctrl.storage_backend = backend
    ctrl.page_size = PAGE
    ctrl.page_get_func = ctrl._page_get_zero_copy
    ctrl.page_set_func = ctrl._page_set_zero_copy
    ctrl.prefetch_sync_queue = queue.Queue()
    return ctrl


def test_sglangs_controller_backs_up_queries_and_prefetches_across_batches(tmp_path, backends):
    n = STORAGE_BATCH_SIZE + 6  # crosses one storage batch boundary
    url = f"lmdb://{tmp_path / 'kv'}"
    pool = env.mla_host_pool(device_tokens=n * PAGE)
    b = env.create_backend(env.storage_config(url), pool)
    ctrl = _controller(b)
    tokens = torch.randint(0, 50_000, (n * PAGE,), generator=torch.Generator().manual_seed(3)).tolist()
    src = pool.alloc(n * PAGE)
    env.fill_pages(pool, src, 12)
    written = env.page_bytes(pool, src)
    backup = StorageOperation(src, tokens, hash_value=get_hash_str(tokens, None, page_size=PAGE), prefix_keys=[])
    ctrl._page_backup(backup)
    assert backup.completed_tokens == n * PAGE

    def prefetch() -> tuple[int, int, list[bytes]]:
        op = PrefetchOperation("req-1", tokens, prefix_keys=[])
        hashes, hit_tokens = ctrl._storage_hit_query(op)
        op.hash_value, op.host_indices = hashes, pool.alloc(len(hashes) * PAGE)
        done = ctrl._page_transfer(op)
        got = env.page_bytes(pool, op.host_indices[:done * PAGE])
        pool.free(op.host_indices)
        return hit_tokens, done, got

    hit_tokens, done, got = prefetch()
    assert (hit_tokens, done) == (n * PAGE, n) and got == written
    bad = b.record_keys([backup.hash_value[STORAGE_BATCH_SIZE + 2]])[0]
    b.close()
    _corrupt(tmp_path / "kv", bad)
    ctrl = _controller(_backend(backends, url, pool))  # a restart over the damaged store
    hit_tokens, done, got = prefetch()
    # the query trusts presence; the verified read stops the prefetch at the corrupt page
    assert hit_tokens == n * PAGE and done == STORAGE_BATCH_SIZE + 2
    assert got == written[:done]


# ---------------------------------------------------------------------- failures
def test_under_sglangs_failure_injector_a_true_page_always_holds_the_right_bytes(store_url, backends):
    pool = env.mla_host_pool()
    inner = _backend(backends, store_url, pool)
    flaky = HiCacheStorageFailureInjector(inner, random_delay_limit=0.0, failure_prob=0.3)
    n = 6
    keys = env.page_keys(n)
    src = pool.alloc(n * PAGE)
    env.fill_pages(pool, src, 5)
    expected = env.page_bytes(pool, src)
    for _ in range(20):  # writes fail at random; retry like the next backup would
        flaky.batch_set_v1(keys, src)
    inner.batch_set_v1(keys, src)  # a write that got through
    saw_failure = saw_success = False
    for _ in range(20):
        dst = pool.alloc(n * PAGE)
        hits = flaky.batch_exists(keys)
        ok = flaky.batch_get_v1(keys[:hits], dst[:hits * PAGE])
        got = env.page_bytes(pool, dst)
        for i, page_ok in enumerate(ok):
            if page_ok:
                assert got[i] == expected[i]
        saw_failure |= hits < n or not all(ok)
        saw_success |= hits == n and all(ok)
        pool.free(dst)
    assert saw_failure and saw_success


def test_a_closed_or_failing_store_gives_failed_pages_not_exceptions(store_url, backends):
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool)
    keys = env.page_keys(3)
    idx = pool.alloc(3 * PAGE)
    b.store.close()  # the store goes away under the server
    assert b.batch_set_v1(keys, idx) == [False] * 3
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, idx) == [False] * 3
    assert b.counters()["store_errors"] == 3


def test_a_bounded_store_evicts_old_pages_and_keeps_serving(tmp_path, backends):
    pool = env.mla_host_pool()
    page = PAGE * env.LAYERS * (env.KV_LORA + env.ROPE) * 2
    url = f"lmdb://{tmp_path / 'kv'}"
    b = _backend(backends, url, pool, store_options={"max_bytes": 4 * (page + 1024)})
    keys = env.page_keys(6)
    idx = pool.alloc(6 * PAGE)
    env.fill_pages(pool, idx, 2)
    for i in range(6):  # one backup per page, as decode extends the sequence
        assert b.batch_set_v1(keys[i:i + 1], idx[i * PAGE:(i + 1) * PAGE]) == [True]
    assert b.batch_exists(keys) == 0  # the first pages were evicted
    assert b.batch_exists(keys[2:]) == 4
    dst = pool.alloc(4 * PAGE)
    assert b.batch_get_v1(keys[2:], dst) == [True] * 4
    assert env.page_bytes(pool, dst) == env.page_bytes(pool, idx[2 * PAGE:])


def test_clear_is_refused_and_sglang_reports_the_failure(store_url, backends, caplog):
    """SGLang 0.5.23's clear path (POST /hicache/storage-backend/clear): StorageAttachment.clear
    -> HybridCacheController.clear_storage_backend -> backend.clear(). The controller ignores
    a returned False and answers True ("cleared successfully"); our refusal raises, so
    SGLang's own code logs the failure and reports False. Nothing is deleted."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment

    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool)
    _, _, keys, _ = _store_and_reload(b, pool, 2)
    controller_state = SimpleNamespace(enable_storage=True, storage_backend=b)  # what the method reads
    controller = SimpleNamespace(clear_storage_backend=lambda: HybridCacheController.clear_storage_backend(
        controller_state))
    attachment = SimpleNamespace(_cache=SimpleNamespace(cache_controller=controller))
    with caplog.at_level("ERROR"):
        assert StorageAttachment.clear(attachment) is False
    assert "Failed to clear hierarchical cache storage backend: tiered_kv HiCache storage refuses clear()" in \
        caplog.text and "nothing was deleted (2 records)" in caplog.text
    with pytest.raises(ClearRefusedError, match="may be shared"):
        b.clear()
    assert b.batch_exists(keys) == 2 and b.counters()["store.records"] == 2


def _sglang_clear(backend):
    """SGLang 0.5.23's own clear path, as the endpoint runs it; returns what it reports."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment

    controller_state = SimpleNamespace(enable_storage=True, storage_backend=backend)
    controller = SimpleNamespace(clear_storage_backend=lambda: HybridCacheController.clear_storage_backend(
        controller_state))
    return StorageAttachment.clear(SimpleNamespace(_cache=SimpleNamespace(cache_controller=controller)))


def test_allowed_clear_empties_the_store_and_sglang_reports_it(store_url, backends, caplog):
    """With "allow_clear": true, SGLang's clear really empties the store, so its "cleared"
    answer is true; pages written afterwards are stored and read as usual."""
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool, allow_clear=True)
    _, _, keys, _ = _store_and_reload(b, pool, 3)
    with caplog.at_level("WARNING"):
        assert _sglang_clear(b) is True
    assert "tiered_kv HiCache storage cleared: 3 records" in caplog.text
    assert b.batch_exists(keys) == 0 and b.counters()["store.records"] == 0
    src, dst, _, _ = _store_and_reload(b, pool, 2, seed=5, key_seed=7)
    assert src == dst


def test_allowed_clear_on_a_chain_empties_level_0_only(tmp_path, backends, caplog):
    """On a chain only the node's own level is emptied: the shared level keeps the fleet's
    pages, and the backend reads them back from there."""
    near, far = f"lmdb://{tmp_path / 'near'}", f"zarr://{tmp_path / 'shared'}"
    pool = env.mla_host_pool()
    b = _backend(backends, [near, far], pool, allow_clear=True)
    src, _, keys, _ = _store_and_reload(b, pool, 2)
    assert b.store.flush(uploads=True, timeout_s=60)
    with caplog.at_level("WARNING"):
        assert _sglang_clear(b) is True
    assert "level 0 of the chain; shared levels are kept" in caplog.text
    dst = pool.alloc(2 * PAGE)
    assert b.batch_get_v1(keys, dst) == [True] * 2
    assert env.page_bytes(pool, dst) == src


def test_allow_clear_must_be_a_boolean(store_url):
    with pytest.raises(ValueError, match="allow_clear.*expected true or false"):
        env.create_backend(env.storage_config(store_url, allow_clear="yes"), env.mla_host_pool())


# ---------------------------------------------------------------------- v2: pools
def _v2_transfers(pools, keys, indices, policies=None):
    policies = policies or {}
    return [PoolTransfer(name=PoolName(name), host_indices=indices[name], keys=keys,
                         hit_policy=policies.get(name, PoolHitPolicy.ALL_PAGES)) for name in pools]


def test_v2_deepseek_v4_pools_round_trip_and_stay_apart(store_url, backends):
    anchor, side = env.v4_pools()
    b = _backend(backends, store_url, anchor, side)
    n = 4
    keys = env.page_keys(n)
    src = {name: pool.alloc(n * PAGE) for name, pool in side.items()}
    for i, (name, pool) in enumerate(side.items()):
        env.fill_pages(pool, src[name], 10 + i)
    # the KV anchor holds no bytes: its v1 calls succeed without storing anything
    assert b.batch_set_v1(keys, anchor.alloc(n * PAGE)) == [True] * n
    result = b.batch_set_v2(_v2_transfers(side, keys, src))
    assert result == {PoolName(name): [True] * n for name in side}
    assert b.counters()["store.records"] == n * len(side)  # same page keys, one record per pool

    exists = b.batch_exists_v2(keys, _v2_transfers(side, keys, src))
    assert exists.kv_hit_pages == n and exists.restorable_prefix_pages == list(range(1, n + 1))
    dst = {name: pool.alloc(n * PAGE) for name, pool in side.items()}
    assert b.batch_get_v2(_v2_transfers(side, keys, dst)) == {PoolName(name): [True] * n for name in side}
    for name, pool in side.items():
        assert env.page_bytes(pool, dst[name]) == env.page_bytes(pool, src[name]), name


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v2_missing_pages_shrink_the_hit_per_pool_policy(store_url, backends, layout):
    c4 = PoolName.DEEPSEEK_V4_C4.value
    state = PoolName.DEEPSEEK_V4_C4_STATE.value
    anchor = env.LogicalHostPool(size=24 * PAGE, page_size=PAGE)
    side = {c4: env.v4_paged_pool(c4, 584, layout), state: env.v4_paged_pool(state, 256, layout)}
    b = _backend(backends, store_url, anchor, side)
    n = 6
    keys = env.page_keys(n)
    idx = {name: pool.alloc(n * PAGE) for name, pool in side.items()}
    for name, pool in side.items():
        env.fill_pages(pool, idx[name], 1)
    # C4 pages 0..4 stored; the state pool only at pages 1 and 3 (a state every other page)
    b.batch_set_v2([PoolTransfer(name=PoolName(c4), host_indices=idx[c4][:5 * PAGE], keys=keys[:5])])
    for p in (1, 3):
        b.batch_set_v2([PoolTransfer(name=PoolName(state), host_indices=idx[state][p * PAGE:(p + 1) * PAGE],
                                     keys=keys[p:p + 1])])
    transfers = [PoolTransfer(name=PoolName(c4), keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES),
                 PoolTransfer(name=PoolName(state), keys=keys[:1], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
    r = b.batch_exists_v2(keys, transfers)
    # KV anchor: all 6; C4: 5 leading pages; state (window 1): stop points 2 and 4
    assert r.restorable_prefix_pages == [2, 4]
    assert r.kv_hit_pages == 4
    # misses by reason (issue 22): page 5 is in no C4 record (not cached); page 4 is held by
    # every KV pool but no state lets SGLang resume after it (the cache's no_snapshot)
    c = b.counters()
    assert (c["lookup_pages"], c["lookup_pages_hit"], c["lookup_pages_no_state"],
            c["lookup_pages_not_cached"]) == (6, 4, 1, 1)
    assert r.extra_pool_hit_pages[PoolName(c4)] == 5 and r.extra_pool_hit_pages[PoolName(state)] == 4
    dst = side[state].alloc(PAGE)
    assert b.batch_get_v2([PoolTransfer(name=PoolName(state), host_indices=dst, keys=keys[3:4])]) == \
        {PoolName(state): [True]}
    assert env.page_bytes(side[state], dst) == env.page_bytes(side[state], idx[state][3 * PAGE:4 * PAGE])


def test_v2_kv_derived_sidecar_reads_with_the_kv_indices(store_url, backends):
    """``CacheController._page_transfer_kv_batch``: an indexer sidecar read with the KV
    pool's host indices, after the KV read."""
    pool = env.mla_host_pool()
    indexer = env.v4_paged_pool(PoolName.INDEXER.value, 132, pages=32)
    b = _backend(backends, store_url, pool, {PoolName.INDEXER.value: indexer})
    n = 3
    keys = env.page_keys(n)
    src = pool.alloc(n * PAGE)
    env.fill_pages(pool, src, 4)
    env.fill_pages(indexer, src, 5)
    assert b.batch_set_v1(keys, src) == [True] * n
    assert b.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=src, keys=keys)]) == \
        {PoolName.INDEXER: [True] * n}
    dst = pool.alloc(n * PAGE)
    assert b.batch_get_v1(keys, dst) == [True] * n
    assert b.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=dst, keys=keys)]) == \
        {PoolName.INDEXER: [True] * n}
    assert env.page_bytes(pool, dst) == env.page_bytes(pool, src)
    assert env.page_bytes(indexer, dst) == env.page_bytes(indexer, src)


def test_v2_a_corrupt_side_pool_record_fails_only_that_page(tmp_path, backends):
    url = f"lmdb://{tmp_path / 'kv'}"
    anchor, side = env.v4_pools()
    name = PoolName.DEEPSEEK_V4_C4_INDEXER.value
    b = env.create_backend(env.storage_config(url), anchor, side)
    keys = env.page_keys(3)
    src = side[name].alloc(3 * PAGE)
    env.fill_pages(side[name], src, 8)
    b.batch_set_v2([PoolTransfer(name=PoolName(name), host_indices=src, keys=keys)])
    bad = b.record_keys(keys[1:2], pool=name)[0]
    b.close()
    _corrupt(tmp_path / "kv", bad)
    b = _backend(backends, url, anchor, side)
    dst = side[name].alloc(3 * PAGE)
    assert b.batch_get_v2([PoolTransfer(name=PoolName(name), host_indices=dst, keys=keys)]) == \
        {PoolName(name): [True, False, True]}


# ---------------------------------------------------------------------- legacy calls
def test_legacy_calls_round_trip_flat_pages(store_url, backends):
    """``CacheController._generic_page_set/_get``: flat pages via get_data_page /
    set_from_flat_data_page (SGLang's path without ``interface_v1``)."""
    pool = env.mla_host_pool("layer_first")
    b = _backend(backends, store_url, pool, interface_v1=False)
    n = 3
    keys = env.page_keys(n)
    src = pool.alloc(n * PAGE)
    env.fill_pages(pool, src, 6)
    assert b.batch_set(keys, [pool.get_data_page(src[i * PAGE]) for i in range(n)]) is True
    assert b.batch_exists(keys) == n and b.exists(keys[1])
    got = b.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    dst = pool.alloc(n * PAGE)
    for i, page in enumerate(got):
        assert page is not None
        pool.set_from_flat_data_page(dst[i * PAGE], page)
    assert env.page_bytes(pool, dst) == env.page_bytes(pool, src)
    assert b.get(env.page_keys(1, seed=5)[0], pool.get_dummy_flat_data_page()) is None


def test_legacy_calls_with_deepseek_v4s_logical_kv_anchor(store_url, backends):
    """Without ``interface_v1`` SGLang moves DeepSeek V4's KV anchor pages with the legacy
    calls; they hold no bytes, so they succeed without touching the store."""
    anchor, side = env.v4_pools()
    b = _backend(backends, store_url, anchor, side, interface_v1=False)
    keys = env.page_keys(3)
    pages = [anchor.get_dummy_flat_data_page() for _ in keys]
    assert b.batch_set(keys, pages) is True
    assert b.batch_exists(keys) == 3
    assert all(p is not None for p in b.batch_get(keys, pages))
    assert b.counters()["store.records"] == 0


# ---------------------------------------------------------------------- store kinds
def test_a_chain_writes_through_to_its_far_level(tmp_path, backends):
    """``store`` as a list: a local LMDB in front of a shared Zarr store; a server that
    only sees the shared store reads the pages back."""
    near, far = f"lmdb://{tmp_path / 'near'}", f"zarr://{tmp_path / 'far'}"
    pool = env.mla_host_pool()
    b = env.create_backend(env.storage_config([near, far]), pool)
    written, _, keys, _ = _store_and_reload(b, pool, 3)
    assert b.store.wait_uploads(30)
    b.close()
    other = _backend(backends, far, pool)
    dst = pool.alloc(3 * PAGE)
    assert other.batch_exists(keys) == 3
    assert other.batch_get_v1(keys, dst) == [True] * 3
    assert env.page_bytes(pool, dst) == written


# ---------------------------------------------------------------------- metrics
def test_get_stats_reports_sglangs_storage_metrics(store_url, backends):
    pool = env.mla_host_pool()
    b = _backend(backends, store_url, pool, metrics=True)
    _store_and_reload(b, pool, 3)
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3]
    assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
    assert b.get_stats().prefetch_pgs == []  # drained


# ---------------------------------------------------------------------- processes
def _expected_pages(seed: int, n: int) -> list[bytes]:
    """The page bytes _worker.py writes for pages [0, n) of chain ``seed``."""
    pool = env.mla_host_pool()
    idx = torch.arange(0, PAGE)
    out = []
    for page in range(n):
        env.fill_pages(pool, idx, seed * 1000 + page)
        out.append(env.page_bytes(pool, idx)[0])
    return out


@pytest.mark.slow
def test_two_processes_share_one_store_across_a_restart(store_url):
    # two server processes write into one LMDB store at the same time: one the head of a
    # chain, the other its tail
    procs = [subprocess.Popen([sys.executable, str(HERE / "_worker.py"), store_url, "write", *a],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONWARNINGS": "ignore"})
             for a in (["1", "0", "4"], ["1", "4", "3"])]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"written": int(p.args[-1])}
    # both have exited (the restart); a new server process finds the whole chain, byte-exact
    pool = env.mla_host_pool()
    b = env.create_backend(env.storage_config(store_url), pool)
    try:
        keys = env.page_keys(8, 1)
        assert b.batch_exists(keys) == 7
        dst = pool.alloc(7 * PAGE)
        assert b.batch_get_v1(keys[:7], dst) == [True] * 7
        assert env.page_bytes(pool, dst) == _expected_pages(1, 7)
    finally:
        b.close()


def test_an_encrypted_backend_seals_pages_and_a_wrong_key_only_fails_pages(tmp_path, backends):
    """``encryption`` in extra_config: pages sealed for the backend's tenant; the store's
    files hold no page bytes; a restart with the key reads them exactly; another key gets
    failed pages (SGLang recomputes: its names are elsewhere), never bytes or an exception."""
    from tiered_kv.storage.encrypted.crypto import write_key_file

    key, other = tmp_path / "fleet.key", tmp_path / "other.key"
    write_key_file(key)
    write_key_file(other)
    url = f"zarr://{tmp_path / 'kv'}"
    pool = env.mla_host_pool()
    b = _backend(backends, url, pool, tenant="t", encryption={"key_files": [str(key)]})
    written, read, keys, _ = _store_and_reload(b, pool, 3)
    assert read == written and b.store.stats()["encrypted"]
    b.close()
    blob = b"".join(p.read_bytes() for p in (tmp_path / "kv").rglob("*") if p.is_file())
    for page in written:
        assert not any(page[i:i + 64] in blob for i in range(0, len(page) - 64, 499))
    again = _backend(backends, url, pool, tenant="t", encryption={"key_files": [str(key)]})
    dst = pool.alloc(3 * PAGE)
    assert again.batch_get_v1(keys, dst) == [True] * 3 and env.page_bytes(pool, dst) == written
    again.close()
    wrong = _backend(backends, url, pool, tenant="t", encryption={"key_files": [str(other)]})
    assert wrong.batch_get_v1(keys, pool.alloc(3 * PAGE)) == [False] * 3
    # (another key's records are under other keyed names: plain misses, nothing removed)
    st = wrong.store.stats()
    assert (st["auth_failures"], st["hits"], st["records"]) == (0, 0, 3)
