"""``open()`` resuming a long prefix from disk: batched reads through the staging ring or
the host tier, corruption mid-range, a pool smaller than the prefix, and (GPU-marked)
disk -> CUDA with and without a host tier.

The batch size and depth are lowered so that a 7-block prefix takes 4 batches through a
2-slot ring (every slot is read into again after its copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiered_kv import TieredKVCache, presets
from tiered_kv.storage import RecordKey

from _util import random_tokens
from test_disk_tier import _fill, _flip_lmdb_record

#: 900 tokens: 7 full blocks; with one more token, all 7 are resumable
TOKENS = random_tokens(900, seed=21)


def _small_batches(cache: TieredKVCache, *, copy_engine: bool = False, staging: bool = False) -> TieredKVCache:
    """2 blocks per batch, 2 in flight; ``copy_engine``: the CUDA path's split on CPU (the
    reader threads only read, this thread loads through the copy engine); ``staging``:
    through the staging ring rather than straight into the CPU pools."""
    cache.resume_batch_blocks = 2
    cache.resume_read_depth = 2
    if copy_engine:
        cache.resume_copy_on_readers = False
    if staging:
        cache.resume_read_into_pools = False
    return cache


@pytest.fixture(scope="module")
def store_url(tmp_path_factory: pytest.TempPathFactory, tiny_layout, tiny_model) -> str:
    """A store holding TOKENS' 7 blocks, with a snapshot at every block boundary."""
    url = f"lmdb://{tmp_path_factory.mktemp('resume') / 's'}"
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, snapshot_interval=1) as cache:
        _fill(cache, tiny_model, TOKENS)
    return url


@pytest.mark.parametrize("copy_engine", [False, True], ids=["readers-copy", "copy-engine"])
@pytest.mark.parametrize("host_bytes", [None, 64 << 20, "3 records"], ids=["no-host", "host", "tiny-host"])
def test_batched_resume_gives_the_logits_of_a_full_recompute(store_url: str, tiny_layout, tiny_model,
                                                             host_bytes, copy_engine: bool) -> None:
    if host_bytes == "3 records":  # fewer host records than the prefix: they are recycled
        host_bytes = 3 * tiny_layout.block_bytes + int(0.25 * 3 * tiny_layout.block_bytes) + 1
    prompt = TOKENS + [7]
    with _small_batches(TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=store_url,
                                      host_bytes=host_bytes), copy_engine=copy_engine) as cache:
        req = cache.open(prompt)
        assert req.num_cached_tokens == 896
        s = cache.stats()
        assert s["blocks_from_disk"] == 7 and s["snapshots_from_disk"] == 1
        assert s["disk_read_failures"] == 0 and s["disk_read_hits"] == 8
        got = tiny_model.forward(cache, req, prompt[896:])
        want = tiny_model.naive_logits(prompt)[896:]
        assert (got - want).abs().max().item() < 1e-4
        cache.close(req)
        again = cache.open(prompt)  # now from the GPU tier: no more disk reads
        assert again.num_cached_tokens == 896 and cache.stats()["disk_reads"] == s["disk_reads"]
        cache.close(again)


@pytest.mark.parametrize("copy_engine", [False, True], ids=["readers-copy", "copy-engine"])
def test_batched_resume_with_hisparse_is_bit_identical(store_url: str, tiny_layout, tiny_model,
                                                        copy_engine: bool) -> None:
    """Disk -> host mirror (the CSA part stays there) + the rest into the pool, in batches."""
    from tiered_kv.hisparse import HiSparseConfig

    prompt = TOKENS + [7]
    plain = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1)
    want = tiny_model.forward(plain, plain.open(prompt), prompt)[896:]
    with _small_batches(TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=store_url,
                                      host_bytes=1 << 20, hisparse=HiSparseConfig(device_buffer_entries=16)),
                        copy_engine=copy_engine) as cache:
        req = cache.open(prompt)
        assert req.num_cached_tokens == 896 and cache.stats()["blocks_from_disk"] == 7
        assert torch.equal(tiny_model.forward(cache, req, prompt[896:]), want)
        cache.close(req)


@pytest.mark.parametrize("host_bytes", [None, 64 << 20], ids=["no-host", "host"])
def test_corrupt_block_mid_range_resumes_at_the_last_good_block(tmp_path: Path, tiny_layout, tiny_model,
                                                                host_bytes) -> None:
    url = f"lmdb://{tmp_path / 's'}"
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, snapshot_interval=1) as cache:
        _fill(cache, tiny_model, TOKENS)
        hashes = cache.hasher.block_hashes(TOKENS)
    _flip_lmdb_record(tmp_path / "s", RecordKey.block(hashes[4]).to_bytes())  # in the 3rd batch of 2
    prompt = TOKENS + [7]
    with _small_batches(TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url,
                                      host_bytes=host_bytes)) as cache:
        req = cache.open(prompt)
        assert req.num_cached_tokens == 4 * 128  # blocks 0-3 and the snapshot after block 3
        s = cache.stats()
        assert s["disk_read_failures"] == 1 and s["store_corrupt"] == 1 and s["blocks_from_disk"] == 4
        got = tiny_model.forward(cache, req, prompt[512:])
        assert (got - tiny_model.naive_logits(prompt)[512:]).abs().max().item() < 1e-4
        cache.close(req)


@pytest.mark.parametrize("native", [True, False], ids=["native-rows", "python-rows"])
def test_parallel_open_stops_before_a_corrupt_record_mid_set(tmp_path: Path, tiny_layout, tiny_model,
                                                             monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """Default settings, CPU pools: the whole range is one row read, spread over the
    store's threads. A corrupt record mid-set is a counted miss: the blocks before it are
    kept (with the logits of a full recompute), those after it were read but never cached."""
    from tiered_kv.storage.os import fastread

    if native and fastread.native_read_verify_rows is None:
        pytest.skip("native helper not built")
    monkeypatch.setattr(fastread, "read_verify_rows", fastread.native_read_verify_rows if native else None)
    url = f"lmdb://{tmp_path / 's'}"
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, snapshot_interval=1) as cache:
        _fill(cache, tiny_model, TOKENS)
        hashes = cache.hasher.block_hashes(TOKENS)
    _flip_lmdb_record(tmp_path / "s", RecordKey.block(hashes[4]).to_bytes())
    prompt = TOKENS + [7]
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url) as cache:
        assert cache.resume_batch_blocks is None
        store, calls = cache.disk.store, []
        real = store.get_rows
        store.get_rows = lambda keys, rows, **kw: calls.append(len(keys)) or real(keys, rows, **kw)
        req = cache.open(prompt)
        assert calls == [7]  # one read for the whole range
        assert req.num_cached_tokens == 4 * 128  # blocks 0-3 and the snapshot after block 3
        s = cache.stats()
        assert s["disk_read_failures"] == 1 and s["store_corrupt"] == 1 and s["blocks_from_disk"] == 4
        assert cache.blocks.num_used == 4  # blocks 4-6 went back uncached
        cache.blocks.check_invariants()
        got = tiny_model.forward(cache, req, prompt[512:])
        assert (got - tiny_model.naive_logits(prompt)[512:]).abs().max().item() < 1e-4
        cache.close(req)


def test_block_missing_mid_range_ends_the_load_there(tmp_path: Path, tiny_layout, tiny_model) -> None:
    """Presence is not asked block by block: the read of a missing block ends the load."""
    url = f"lmdb://{tmp_path / 's'}"
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, snapshot_interval=1) as cache:
        _fill(cache, tiny_model, TOKENS)
        hashes = cache.hasher.block_hashes(TOKENS)
        assert cache.disk.store.delete(RecordKey.block(hashes[5]))
    prompt = TOKENS + [7]
    with _small_batches(TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url)) as cache:
        req = cache.open(prompt)
        assert req.num_cached_tokens == 5 * 128
        s = cache.stats()
        assert s["blocks_from_disk"] == 5 and s["disk_read_failures"] == 1 and s["store_corrupt"] == 0
        got = tiny_model.forward(cache, req, prompt[640:])
        assert (got - tiny_model.naive_logits(prompt)[640:]).abs().max().item() < 1e-4
        cache.close(req)
        cache.blocks.check_invariants()
        # the snapshot after block 7, read while the blocks were (then unused), left no slot taken
        assert cache.snapshots.ids.num_used == 0
        cache.snapshots.ids.check_invariants()


def test_corrupt_last_snapshot_resumes_the_prefix_before_it(tmp_path: Path, tiny_layout, tiny_model) -> None:
    """The snapshot is read while the blocks are; when it fails verification the open
    falls back to the next resume point, and the snapshot slot it took goes back."""
    url = f"lmdb://{tmp_path / 's'}"
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url, snapshot_interval=1) as cache:
        _fill(cache, tiny_model, TOKENS)
        hashes = cache.hasher.block_hashes(TOKENS)
    _flip_lmdb_record(tmp_path / "s", RecordKey.snapshot(hashes[6]).to_bytes())
    prompt = TOKENS + [7]
    with _small_batches(TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=url)) as cache:
        req = cache.open(prompt)
        assert req.num_cached_tokens == 6 * 128
        s = cache.stats()
        assert s["store_corrupt"] == 1 and s["snapshots_from_disk"] == 1 and s["disk_read_failures"] == 1
        got = tiny_model.forward(cache, req, prompt[768:])
        assert (got - tiny_model.naive_logits(prompt)[768:]).abs().max().item() < 1e-4
        cache.close(req)
        assert cache.snapshots.ids.num_used == 0
        cache.snapshots.ids.check_invariants()
        cache.blocks.check_invariants()


def test_store_error_mid_range_is_raised_and_gives_the_blocks_back(store_url: str, tiny_layout) -> None:
    with _small_batches(TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=2, store=store_url)) as cache:
        store, calls = cache.disk.store, []
        real = store.get_rows  # the blocks' reads (straight into the pool rows)

        def failing(keys, rows, **kw):
            calls.append(len(keys))
            if len(calls) == 2:
                raise OSError("EIO (injected)")
            return real(keys, rows, **kw)

        store.get_rows = failing
        with pytest.raises(OSError, match="injected"):
            cache.open(TOKENS + [7])
        assert cache.blocks.num_used == 0  # nothing loaded is left referenced (batch 0: cached, free)
        assert cache.states.num_free == 2
        assert cache.snapshots.ids.num_used == 0  # the snapshot read meanwhile: slot given back
        cache.blocks.check_invariants()
        store.get_rows = real
        req = cache.open(TOKENS + [7])  # the store works again: everything resumes
        assert req.num_cached_tokens == 896
        cache.close(req)


def test_pool_smaller_than_the_prefix_resumes_what_fits(store_url: str, tiny_layout) -> None:
    with _small_batches(TieredKVCache(tiny_layout, num_blocks=5, num_state_slots=1, store=store_url)) as cache:
        req = cache.open(TOKENS + [7])
        assert req.num_cached_tokens == 5 * 128
        assert cache.blocks.num_used == 5
        cache.close(req)
        cache.blocks.check_invariants()


def write_random_prompt(cache: TieredKVCache, tokens: list[int], seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run ``tokens`` through ``cache`` with random KV bytes in place of a model; returns
    each full block's record and the snapshot at the last block boundary (CPU copies)."""
    g = torch.Generator().manual_seed(seed)
    bt = cache.layout.block_tokens
    req = cache.open(tokens)
    assert req.num_cached_tokens == 0
    cache.reserve(req, len(tokens))
    st = cache.state(req)
    records, snap = [], None
    for k in range(len(tokens) // bt):
        b = req.block_ids[k]
        for part in cache.classical.parts:
            part[:, b] = torch.randint(0, 256, part[:, b].shape, dtype=torch.uint8, generator=g).to(part.device)
        st.swa.copy_(torch.randint(0, 256, st.swa.shape, dtype=torch.uint8, generator=g))
        for tail in (st.csa_tail, st.idx_tail):
            tail.copy_(torch.randn(tail.shape, generator=g))
        records.append(cache.classical.read_block(b).cpu())
        cache.advance(req, tokens[k * bt:(k + 1) * bt])
        snap = cache.states.snapshot(req.slot).cpu()
    cache.close(req)
    cache.flush()
    assert snap is not None
    return records, snap


def _resume_and_compare(url: str, layout, tokens: list[int], records: list[torch.Tensor], snap: torch.Tensor,
                        device: str, host_bytes: int | None, copy_engine: bool = False,
                        staging: bool = False) -> None:
    with _small_batches(TieredKVCache(layout, device=device, num_blocks=8, num_state_slots=1, store=url,
                                      host_bytes=host_bytes), copy_engine=copy_engine, staging=staging) as cache:
        req = cache.open(tokens + [1])
        assert req.num_cached_tokens == len(records) * layout.block_tokens
        assert cache.stats()["blocks_from_disk"] == len(records)
        for b, want in zip(req.block_ids, records):
            assert torch.equal(cache.classical.read_block(b).cpu(), want)
        assert torch.equal(cache.states.snapshot(req.slot).cpu(), snap)
        cache.close(req)


def _random_prompt_store(tmp_path: Path, layout) -> tuple[str, list[int], list[torch.Tensor], torch.Tensor]:
    url = f"lmdb://{tmp_path / 's'}"
    tokens = random_tokens(5 * layout.block_tokens, seed=3)
    with TieredKVCache(layout, num_blocks=8, num_state_slots=1, store=url, snapshot_interval=1) as cache:
        records, snap = write_random_prompt(cache, tokens, seed=1)
    return url, tokens, records, snap


@pytest.mark.parametrize("copy_engine", [False, True], ids=["readers-copy", "copy-engine"])
@pytest.mark.parametrize("host_bytes", [None, 8 << 20], ids=["no-host", "host"])
def test_resumed_bytes_equal_what_was_written(tmp_path: Path, host_bytes: int | None, copy_engine: bool) -> None:
    """Byte-exact on the fp8_ds_mla records path, CPU (no host tier, readers-copy: read
    straight into the pools through scatter lists)."""
    from _util import FLASH_MINI

    url, tokens, records, snap = _random_prompt_store(tmp_path, FLASH_MINI)
    _resume_and_compare(url, FLASH_MINI, tokens, records, snap, "cpu", host_bytes, copy_engine)


def test_resumed_bytes_through_the_cpu_staging_ring(tmp_path: Path) -> None:
    """``resume_read_into_pools = False``: the staging ring path on CPU stays byte-exact."""
    from _util import FLASH_MINI

    url, tokens, records, snap = _random_prompt_store(tmp_path, FLASH_MINI)
    _resume_and_compare(url, FLASH_MINI, tokens, records, snap, "cpu", None, staging=True)


@pytest.mark.gpu
@pytest.mark.parametrize("host_bytes", [None, 8 << 20], ids=["no-host", "host"])
def test_disk_to_cuda_with_and_without_a_host_tier(tmp_path: Path, host_bytes: int | None) -> None:
    """Disk -> pinned staging (or pinned host records) -> CUDA pools, snapshot included."""
    from _util import FLASH_MINI

    url, tokens, records, snap = _random_prompt_store(tmp_path, FLASH_MINI)
    _resume_and_compare(url, FLASH_MINI, tokens, records, snap, "cuda", host_bytes)


@pytest.mark.gpu
def test_disk_to_cuda_flash_preset(tmp_path: Path) -> None:
    layout = presets.deepseek_v4_flash()
    url, tokens, records, snap = _random_prompt_store(tmp_path, layout)
    _resume_and_compare(url, layout, tokens, records, snap, "cuda", None)


@pytest.mark.parametrize("host_bytes,copy_engine,staging,want", [
    (None, False, False, "PoolRows"),
    (None, False, True, "StagingRing"),
    (None, True, False, "StagingRing"),   # the CUDA path's split, on CPU
    (1 << 20, False, False, "HostRecords"),
    (1 << 20, True, False, "HostRecords"),
])
def test_resume_destination_by_configuration(store_url: str, tiny_layout, host_bytes, copy_engine: bool,
                                             staging: bool, want: str) -> None:
    """One destination object per configuration, kept between opens (the ring and the
    pool views are made once); a new ring when its shape changes."""
    from tiered_kv import resume_reader

    with _small_batches(TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=store_url,
                                      host_bytes=host_bytes), copy_engine=copy_engine, staging=staging) as cache:
        req = cache.open(TOKENS + [7])
        dest = cache._resume_dest
        assert type(dest).__name__ == want
        cache.close(req)
        assert resume_reader.choose_destination(cache, dest) is dest
        if isinstance(dest, resume_reader.StagingRing):
            cache.resume_batch_blocks = 3
            ring = resume_reader.choose_destination(cache, dest)
            assert ring is not dest and tuple(ring.ring.shape[:2]) == (2, 3)


def test_resume_settings_are_checked(store_url: str, tiny_layout) -> None:
    with TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=1, store=store_url) as cache:
        cache.resume_read_depth = 0
        with pytest.raises(ValueError, match="resume_read_depth: expected a positive int, got 0"):
            cache.open(TOKENS + [7])
        cache.resume_read_depth, cache.resume_batch_blocks = 3, 0
        with pytest.raises(ValueError, match="resume_batch_blocks: expected a positive int or None, got 0"):
            cache.open(TOKENS + [7])
