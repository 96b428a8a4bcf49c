"""The batched write path and block tables: batched writes store exactly what per-layer
writes store, block tables follow open / reserve / close, and the write + advance path
issues no op that would synchronize with a device.

Also the reference model on any device (``gpu`` tests run on CUDA only).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tiered_kv import TieredKVCache, presets
from tiered_kv.debug import HostSyncError, SyncDetector
from tiered_kv.hisparse import HiSparseConfig
from tiered_kv.reference import ReferenceModel
from tiered_kv.reference.serving import ServingLoop, Status, make_workload

from _util import FLASH_MINI, cache_tensors, random_tokens

HOST = 1 << 20


def make_cache(layout, *, hisparse: bool = False, device: str = "cpu", **kw) -> TieredKVCache:
    extra = {"host_bytes": HOST, "hisparse": HiSparseConfig(device_buffer_entries=2 * layout.top_k)} if hisparse else {}
    kw.setdefault("num_blocks", 24)
    kw.setdefault("num_state_slots", 4)
    return TieredKVCache(layout, device=device, **extra, **kw)


def random_bytes(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)


def pools(cache: TieredKVCache) -> tuple[torch.Tensor, ...]:
    cp = cache.classical
    return (cp.csa_kv.cpu(), cp.indexer.cpu(), cp.hca_kv.cpu())


def open_reserved(cache: TieredKVCache, n: int, tokens: int) -> list:
    reqs = [cache.open([i + 1]) for i in range(n)]
    for r in reqs:
        cache.reserve(r, tokens)
    return reqs


# --------------------------------------------------------- batched == per-layer
@pytest.mark.parametrize("hisparse", [False, True], ids=["plain", "hisparse"])
@pytest.mark.parametrize("order", ["consecutive", "reversed"])
def test_batched_writes_store_what_per_layer_writes_store(tiny_layout, hisparse: bool, order: str) -> None:
    """Random ragged batches (padding, runs split across blocks, shuffled ids) written in
    one call per kind give the same pool bytes as one call per layer and request."""
    L = tiny_layout
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(1)
    B, E = 3, L.csa_entries_per_block
    csa = list(L.csa_layers) if order == "consecutive" else list(reversed(L.csa_layers))
    hca = list(L.hca_layers) if order == "consecutive" else list(reversed(L.hca_layers))
    one, many = make_cache(L, hisparse=hisparse), make_cache(L, hisparse=hisparse)
    tokens = L.block_tokens if hisparse else 2 * L.block_tokens  # HiSparse: only the open block is writable
    r1, rb = open_reserved(one, B, tokens), open_reserved(many, B, tokens)
    for trial in range(4):
        counts = rng.integers(0, E + 1, size=B)
        m = int(counts.max())
        ids = np.full((B, m), -1, dtype=np.int64)
        for i, c in enumerate(counts):
            pick = rng.choice(tokens // L.csa_ratio, size=c, replace=False)
            ids[i, :c] = np.sort(pick) if trial % 2 == 0 else pick
        kv = random_bytes(g, len(csa), B, m, L.entry_bytes)
        keys = random_bytes(g, len(csa), B, m, L.indexer_bytes)
        many.write_csa(rb, csa, torch.from_numpy(ids), kv, keys)
        for i in range(B):
            c = int(counts[i])
            for j, layer in enumerate(csa):
                one.write_csa(r1[i], layer, torch.from_numpy(ids[i, :c]), kv[j, i, :c], keys[j, i, :c])
        hids = np.full((B, 2), -1, dtype=np.int64)
        hids[:, 0] = rng.integers(0, tokens // L.hca_ratio, size=B)
        hkv = random_bytes(g, len(hca), B, 2, L.entry_bytes)
        many.write_hca(rb, hca, hids.tolist(), hkv)  # nested lists are host ids too
        for i in range(B):
            for j, layer in enumerate(hca):
                one.write_hca(r1[i], layer, hids[i, :1], hkv[j, i, :1])
    for a, b in zip(pools(one), pools(many)):
        assert torch.equal(a, b)


def test_single_layer_list_and_one_request_batch_forms(tiny_layout) -> None:
    """write_csa(req, [layer], ...) and write_csa([req], layer, ...) add one axis each."""
    L = tiny_layout
    g = torch.Generator().manual_seed(2)
    a, b = make_cache(L), make_cache(L)
    (ra,), (rb,) = open_reserved(a, 1, 100), open_reserved(b, 1, 100)
    layer = L.csa_layers[1]
    ids = torch.arange(3, 9)
    kv, keys = random_bytes(g, 6, L.entry_bytes), random_bytes(g, 6, L.indexer_bytes)
    a.write_csa(ra, layer, ids, kv, keys)
    b.write_csa(rb, [layer], ids, kv[None], keys[None])
    b.write_csa([rb], layer, ids[None], kv[None], keys[None])
    for x, y in zip(pools(a), pools(b)):
        assert torch.equal(x, y)
    empty = torch.zeros(0, 0, L.entry_bytes, dtype=torch.uint8), torch.zeros(0, 0, L.indexer_bytes, dtype=torch.uint8)
    b.write_csa([], layer, np.zeros((0, 0), dtype=np.int64), *empty)  # an empty batch is a no-op


def test_many_runs_take_the_flat_index_path(tiny_layout) -> None:
    """More runs than the slice-copy path takes: one index_copy_ of flat rows, same bytes."""
    L = tiny_layout
    g = torch.Generator().manual_seed(3)
    a, b = make_cache(L), make_cache(L)
    (ra,), (rb,) = open_reserved(a, 1, 3 * L.block_tokens), open_reserved(b, 1, 3 * L.block_tokens)
    ids = torch.arange(0, 96, 2)  # 48 entries, every one its own run ... then twice that
    ids = torch.cat([ids, ids + 1])[torch.randperm(96, generator=g)]
    kv = random_bytes(g, L.num_csa_layers, 96, L.entry_bytes)
    keys = random_bytes(g, L.num_csa_layers, 96, L.indexer_bytes)
    a.write_csa([ra], L.csa_layers, ids[None], kv[:, None], keys[:, None])
    for j, layer in enumerate(L.csa_layers):
        for e in range(96):
            b.write_csa(rb, layer, ids[e:e + 1], kv[j, e:e + 1], keys[j, e:e + 1])
    for x, y in zip(pools(a), pools(b)):
        assert torch.equal(x, y)


def test_batched_write_errors(tiny_layout) -> None:
    L = tiny_layout
    cache = make_cache(L)
    r0, r1 = open_reserved(cache, 2, 64)
    csa, hca = list(L.csa_layers), list(L.hca_layers)
    kv = torch.zeros(len(csa), 2, 4, L.entry_bytes, dtype=torch.uint8)
    keys = torch.zeros(len(csa), 2, 4, L.indexer_bytes, dtype=torch.uint8)
    ids = torch.arange(8).view(2, 4)
    cache.write_csa([r0, r1], csa, ids, kv, keys)
    with pytest.raises(ValueError, match=r"expected ids in \[0, 32\); -1 = padding, got \[30, 33\] in row 1"):
        cache.write_csa([r0, r1], csa, torch.tensor([[0, 1, 2, 3], [30, 31, 32, 33]]), kv, keys)
    with pytest.raises(ValueError, match=r"expected ids in \[0, 32\), got \[-1, 2\]"):
        cache.write_csa(r0, csa, torch.tensor([-1, 0, 1, 2]), kv[:, 0], keys[:, 0])  # no padding in one row
    with pytest.raises(ValueError, match="expected a 2-D int64 tensor of entry ids"):
        cache.write_csa([r0, r1], csa, ids[0], kv, keys)
    with pytest.raises(ValueError, match=r"kv: expected shape \[3, 2, 4, 64\]"):
        cache.write_csa([r0, r1], csa + [csa[0]], ids, kv, keys)
    with pytest.raises(ValueError, match="expected a csa layer, got hca"):
        cache.write_csa([r0, r1], [csa[0], hca[0]], ids, kv, keys)
    with pytest.raises(ValueError, match="layers: expected at least one layer"):
        cache.write_hca([r0, r1], [], ids, kv[0])
    with pytest.raises(TypeError, match="requests: expected a Request or a sequence"):
        cache.write_hca(r0.request_id, hca, ids[0], kv[0, 0])
    cache.reserve(r1, 200)
    cache.advance(r1, list(range(128)))
    with pytest.raises(ValueError, match="block 0 of request 1 is sealed"):
        cache.write_csa([r0, r1], csa, ids, kv, keys)
    cache.close(r0)
    with pytest.raises(ValueError, match="closed"):
        cache.write_csa([r0, r1], csa, ids, kv, keys)


def _outcome(f, *args) -> str:
    try:
        f(*args)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_one_run_writes_match_the_general_path(tiny_layout) -> None:
    """One request's host int64 tensor of ids with a tuple of layers (the one-pass path of
    prefill) stores and refuses exactly what the same write does given its ids as a list
    (the general path): whole blocks, runs at an offset, later or reordered layers, and ids
    sealed, unreserved, repeated, out of order, or with tensors of the wrong shape or dtype."""
    L = tiny_layout
    g = torch.Generator().manual_seed(4)
    E, bt = L.csa_entries_per_block, L.block_tokens
    a, b = make_cache(L), make_cache(L)
    (ra,), (rb,) = open_reserved(a, 1, 2 * bt), open_reserved(b, 1, 2 * bt)
    csa, hca = tuple(L.csa_layers), tuple(L.hca_layers)
    cases = [torch.arange(0, E), torch.arange(3, 7), torch.arange(E - 1, E + 1), torch.arange(E, 2 * E),
             torch.arange(2 * E, 3 * E), torch.tensor([2, 2]), torch.tensor([5, 4]), torch.tensor([-1]),
             torch.zeros(0, dtype=torch.int64), torch.arange(E, 2 * E)]
    checked = 0
    for step, ids in enumerate(cases):
        if step == len(cases) - 1:  # block 0 sealed: its ids are refused, block 1's still written
            for c, r in ((a, ra), (b, rb)):
                c.advance(r, list(range(bt)))
            ids = torch.arange(0, 2)
        m = ids.numel()
        for layers in (csa, csa[1:], csa[::-1]):
            n = len(layers)
            kv, keys = random_bytes(g, n, m, L.entry_bytes), random_bytes(g, n, m, L.indexer_bytes)
            for args in ((kv, keys), (kv[:, :, :-1], keys), (kv, keys.to(torch.int8))):
                got = _outcome(a.write_csa, ra, layers, ids, *args)
                assert got == _outcome(b.write_csa, rb, list(layers), ids.tolist(), *args)
                checked += got == "ok"
        hid = ids[:1] // E
        hkv = random_bytes(g, len(hca), hid.numel(), L.entry_bytes)
        assert _outcome(a.write_hca, ra, hca, hid, hkv) == _outcome(b.write_hca, rb, list(hca), hid.tolist(), hkv)
        for x, y in zip(pools(a), pools(b)):
            assert torch.equal(x, y)
    assert checked >= 12  # (the writes that landed, each compared byte for byte)
    a.close(ra)
    b.close(rb)
    assert _outcome(a.write_csa, ra, csa, cases[0], kv, keys) == _outcome(b.write_csa, rb, list(csa), [0], kv, keys)


def test_hisparse_batched_write_only_to_the_open_block(tiny_layout) -> None:
    L = tiny_layout
    cache = make_cache(L, hisparse=True)
    (r,) = open_reserved(cache, 1, 2 * L.block_tokens)
    kv = torch.zeros(1, 1, 2, L.entry_bytes, dtype=torch.uint8)
    keys = torch.zeros(1, 1, 2, L.indexer_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="only the open block 0 of request 0 is writable, got entry 33"):
        cache.write_csa([r], [L.csa_layers[0]], torch.tensor([[1, 33]]), kv, keys)


# ------------------------------------------------------------------ block tables
def expected_table(reqs, width: int) -> torch.Tensor:
    rows = [r.block_ids[:width] + [-1] * (width - len(r.block_ids[:width])) for r in reqs]
    return torch.tensor(rows, dtype=torch.int32).view(len(reqs), width)


def test_block_table_follows_open_reserve_close_and_grows(tiny_layout) -> None:
    L = tiny_layout
    bt = L.block_tokens
    cache = make_cache(L, num_blocks=160, num_state_slots=3, snapshot_interval=1)
    tokens = random_tokens(3 * bt + 5, seed=4)
    a = cache.open(tokens)
    for start in range(0, len(tokens), bt):  # the bookkeeping of a forward pass (no KV needed here)
        cache.reserve(a, len(tokens[start:start + bt]))
        cache.advance(a, tokens[start:start + bt])
    b = cache.open(tokens)  # shares a's first 3 blocks
    c = cache.open([1, 2])
    assert b.block_ids == a.block_ids[:3]
    table = cache.block_table([a, b, c])
    assert table.dtype == torch.int32 and table.device == cache.device
    assert torch.equal(table, expected_table([a, b, c], 4))
    cache.reserve(c, 100 * L.block_tokens)  # past the initial 64 columns: the table grows
    assert len(c.block_ids) == 100
    assert torch.equal(cache.block_table([c, a]), expected_table([c, a], 100))
    out = torch.full((2, 120), 7, dtype=torch.int32)
    assert cache.block_table([b, c], max_blocks=120, out=out) is out
    assert torch.equal(out, expected_table([b, c], 120))
    assert torch.equal(cache.block_table(a, max_blocks=2), expected_table([a], 2))
    with pytest.raises(ValueError, match=r"out: expected int32 \[2, 5\]"):
        cache.block_table([a, b], max_blocks=5, out=out)
    with pytest.raises(ValueError, match="at most 160 blocks per request"):
        cache.block_table([a], max_blocks=161)
    cache.close(c)
    d = cache.open([9])  # takes c's slot: the row starts empty
    assert d.slot == c.slot
    assert torch.equal(cache.block_table([d], max_blocks=3), expected_table([d], 3))
    assert cache.block_table([], max_blocks=4).shape == (0, 4)
    for r in (a, b, d):
        cache.close(r)
    assert (cache.tables.host == -1).all() and (cache.tables.lengths == 0).all()


# ------------------------------------------------------------ sync detector
def test_sync_detector_flags_reads_of_cache_tensors_only(tiny_layout) -> None:
    """With ``owned``, reads fire on the cache's tensors and on values computed from them,
    never on host index tensors the caller passed."""
    cache = make_cache(tiny_layout)
    host_ids = torch.arange(5)
    with SyncDetector(cache.device, owned=cache_tensors(cache)) as d:
        assert host_ids.tolist() == [0, 1, 2, 3, 4]  # host-side placement: allowed
        with pytest.raises(HostSyncError, match="tolist"):
            cache.classical.hca_kv[0, 0, 0, :2].tolist()
        assert (host_ids > 2).nonzero().numel() == 2 and int(host_ids.max()) == 4  # host index math
        derived = cache.classical.hca_kv[0, 0].sum(-1)  # a value computed from cache state
        with pytest.raises(HostSyncError, match="nonzero"):
            (derived > 2).nonzero()
        with pytest.raises(HostSyncError):
            int(derived[0])
    assert len(d.fired) == 3


def fill_step(cache: TieredKVCache, reqs, k: int, g: torch.Generator, cuda_sync_debug: bool = False) -> None:
    """Block k of every request: reserve, one batched write per kind, advance (seals);
    with ``cuda_sync_debug`` those calls run under ``torch.cuda.set_sync_debug_mode("error")``."""
    L = cache.layout
    E, B, bt = L.csa_entries_per_block, len(reqs), L.block_tokens
    ids = torch.arange(k * E, (k + 1) * E).expand(B, E)
    hids = torch.full((B, 1), k, dtype=torch.int64)
    kv = random_bytes(g, L.num_csa_layers, B, E, L.entry_bytes).to(cache.device)
    keys = random_bytes(g, L.num_csa_layers, B, E, L.indexer_bytes).to(cache.device)
    hkv = random_bytes(g, L.num_hca_layers, B, 1, L.entry_bytes).to(cache.device)
    csa, hca = L.csa_layers, L.hca_layers
    tokens = [[(i * 7 + k * bt + t) % 50000 for t in range(bt)] for i in range(B)]
    if cuda_sync_debug:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with SyncDetector(cache.device, owned=cache_tensors(cache)) as d:
            for r in reqs:
                cache.reserve(r, bt)
            cache.write_csa(reqs, csa, ids, kv, keys)
            cache.write_hca(reqs, hca, hids, hkv)
            for r, t in zip(reqs, tokens):
                cache.advance(r, t[:bt // 2])
                cache.advance(r, t[bt // 2:])  # seals: hash, publish, snapshot
            cache.block_table(reqs)
    finally:
        if cuda_sync_debug:
            torch.cuda.set_sync_debug_mode(0)
    assert d.fired == [], d.fired
    for i, r in enumerate(reqs):
        assert r.num_sealed_blocks == k + 1
        b = r.block_ids[k]
        assert torch.equal(cache.classical.csa_kv[:, b], kv[:, i])
        assert torch.equal(cache.classical.hca_kv[:, b], hkv[:, i])


def test_batched_write_and_advance_issue_no_sync() -> None:
    cache = make_cache(FLASH_MINI, num_blocks=16, num_state_slots=3)
    reqs = [cache.open([i]) for i in range(3)]
    g = torch.Generator().manual_seed(5)
    for k in range(3):
        fill_step(cache, reqs, k, g)


def test_hisparse_batched_write_issues_no_sync(tiny_layout) -> None:
    """With HiSparse the writes and an advance inside the block are sync-free too (sealing
    mirrors the block to the host: that copy is the async-sealing work, not this path)."""
    L = tiny_layout
    cache = make_cache(L, hisparse=True)
    reqs = open_reserved(cache, 2, L.block_tokens)
    E = L.csa_entries_per_block
    g = torch.Generator().manual_seed(6)
    kv = random_bytes(g, L.num_csa_layers, 2, E, L.entry_bytes)
    keys = random_bytes(g, L.num_csa_layers, 2, E, L.indexer_bytes)
    with SyncDetector(cache.device, owned=cache_tensors(cache)) as d:
        cache.write_csa(reqs, L.csa_layers, torch.arange(E).expand(2, E), kv, keys)
        for r in reqs:
            cache.advance(r, [1] * 100)
    assert d.fired == [], d.fired
    for i, r in enumerate(reqs):
        assert torch.equal(cache.classical.csa_kv[:, r.slot], kv[:, i])


# ------------------------------------------------- the reference model, any device
def test_model_device_round_trip_on_cpu_is_bit_identical(tiny_layout, tiny_model) -> None:
    """Moving the model (weights re-placed through the device code path) changes nothing."""
    assert tiny_model.to("cpu") is tiny_model and tiny_model.device == torch.device("cpu")
    moved = copy.copy(tiny_model)
    moved._move(torch.device("cpu"))
    assert moved.layers is not tiny_model.layers
    tokens = random_tokens(300, seed=8)
    outs = []
    for model in (tiny_model, moved):
        cache = make_cache(tiny_layout)
        req = cache.open(tokens)
        outs.append(torch.cat([model.forward(cache, req, tokens[:200]), model.forward(cache, req, tokens[200:])]))
    assert torch.equal(outs[0], outs[1])
    loop = ServingLoop(tiny_model, make_cache(tiny_layout))
    assert loop.device == torch.device("cpu") and loop.model is tiny_model


def run_exactness(layout, device: str, hisparse: bool, model_device: str | None = None) -> torch.Tensor:
    model = ReferenceModel(layout, seed=3, device=model_device or device)
    tokens = random_tokens(2 * layout.block_tokens + 77, seed=9)
    cache = make_cache(layout, hisparse=hisparse, device=device, num_blocks=12, num_state_slots=2)
    req = cache.open(tokens)
    got = [model.forward(cache, req, tokens[:150]), model.forward(cache, req, tokens[150:300])]
    got += [model.forward(cache, req, tokens[i:i + 1]) for i in range(300, len(tokens))]
    got = torch.cat(got)
    naive = model.naive_logits(tokens)
    assert got.device == model.device
    assert (got - naive).abs().max().item() < 1e-4
    return got.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny", "flash-mini"])
def test_reference_model_on_cuda_cached_matches_naive_and_hisparse_is_bit_identical(name: str) -> None:
    layout = presets.tiny() if name == "tiny" else FLASH_MINI
    plain = run_exactness(layout, "cuda", hisparse=False)
    with_hisparse = run_exactness(layout, "cuda", hisparse=True)
    assert torch.equal(plain, with_hisparse)
    # a CPU model driving a CUDA cache: the bytes round-trip exactly, so the CPU logits come back
    assert torch.equal(run_exactness(layout, "cuda", hisparse=False, model_device="cpu"),
                       run_exactness(layout, "cpu", hisparse=False))


@pytest.mark.gpu
def test_batched_write_and_advance_on_cuda_never_sync() -> None:
    cache = make_cache(FLASH_MINI, device="cuda", num_blocks=16, num_state_slots=3)
    reqs = [cache.open([i]) for i in range(3)]
    g = torch.Generator().manual_seed(5)
    fill_step(cache, reqs, 0, g)  # warm-up (allocator, first launches)
    fill_step(cache, reqs, 1, g, cuda_sync_debug=True)
    torch.cuda.synchronize()
    assert torch.equal(cache.block_table(reqs).cpu(), expected_table(reqs, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("hisparse", [False, True], ids=["plain", "hisparse"])
def test_serving_loop_on_cuda(tiny_layout, hisparse: bool) -> None:
    L = tiny_layout
    extra = {"host_bytes": 8 * L.block_bytes + 4 * L.snapshot_bytes,
             "hisparse": HiSparseConfig(device_buffer_entries=2 * L.top_k)} if hisparse else \
        {"host_bytes": 4 * L.block_bytes + 4 * L.snapshot_bytes}
    cache = TieredKVCache(L, device="cuda", num_blocks=8, num_state_slots=3, num_snapshots=8,
                          snapshot_interval=2, **extra)
    model = ReferenceModel(L, seed=0)
    loop = ServingLoop(model, cache, prefill_chunk=128, device="cuda")
    assert loop.model.device.type == "cuda" and loop.model.embed.is_cuda
    requests = make_workload(24, seed=3, num_prefixes=4, prefix_tokens=(100, 300), suffix_tokens=(1, 40),
                             new_tokens=(1, 4), record_every=4)
    for r in requests:
        loop.submit(r)
    done = loop.run()
    assert len(done) == 24 and {r.status for r in done} <= {Status.DONE, Status.ABORTED}
    checked = 0
    for r in done:
        if r.record and r.logits:
            naive = model.naive_logits(r.tokens)
            for pos, row in r.logits.items():
                assert row.is_cuda
                assert (row.cpu() - naive[pos]).abs().max().item() < 1e-4
            checked += 1
    assert checked >= 3
    assert cache.stats()["blocks_used"] == 0
