"""Batched HiSparse swap-in (``cache.swap_in_batch``): equivalence with the per-request
algorithm, sync-freedom, duplicates / padding / eviction pressure, CUDA graphs.

The oracle is the per-request LRU swap-in as first written (sort the non-hit slots by
last use, stable), run request by request; the batched op must produce the same slots,
the same buffer bytes and the same LRU state, on CPU (torch implementation, static
shapes) and, where there is a GPU, with the CUDA kernel.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tiered_kv import TieredKVCache, kernels
from tiered_kv.debug import HostSyncError, SyncDetector
from tiered_kv.hisparse import HiSparseBuffers, HiSparseConfig
from tiered_kv.kernels import cuda_ops

from _util import FLASH_MINI, cache_tensors, random_tokens

HOST = 1 << 20
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
IMPLS_CUDA = pytest.mark.skipif(not cuda_ops.cupy_available(), reason="cupy is not importable")


# ------------------------------------------------------------------ the oracle
class Oracle:
    """The per-request algorithm, one (slot, part) at a time, on CPU tensors."""

    def __init__(self, S: int, C: int, N: int, entry_bytes: int) -> None:
        self.eos = torch.full((S, C, N), -1, dtype=torch.int64)
        self.last = torch.full((S, C, N), -1, dtype=torch.int64)
        self.buffer = torch.zeros(S, C, N, entry_bytes, dtype=torch.uint8)
        self.step = torch.zeros(S, C, dtype=torch.int64)
        self.hits = self.misses = 0

    def swap_in(self, slot: int, part: int, ids: list[int], rows: torch.Tensor) -> list[int]:
        """ids: one row (-1 padding, repeats allowed); rows: [len(ids), entry_bytes] bytes of each id."""
        eos, last = self.eos[slot, part], self.last[slot, part]
        self.step[slot, part] += 1
        first: dict[int, int] = {}
        for i, e in enumerate(ids):
            if e >= 0 and e not in first:
                first[e] = i
        resident = {int(e): s for s, e in enumerate(eos.tolist()) if e >= 0}
        hit_slots = {resident[e] for e in first if e in resident}
        score = last.clone()
        score[list(hit_slots)] = torch.iinfo(torch.int64).max
        order = torch.sort(score, stable=True).indices.tolist()
        misses = [e for e in first if e not in resident]
        slot_of = {e: resident[e] for e in first if e in resident}
        for e, v in zip(misses, order):
            slot_of[e] = v
            eos[v] = e
            self.buffer[slot, part, v] = rows[first[e]]
        for s in slot_of.values():
            last[s] = self.step[slot, part]
        self.hits += len(first) - len(misses)
        self.misses += len(misses)
        return [slot_of[e] if e >= 0 else -1 for e in ids]


def _mirror(num_blocks: int, C: int, E: int, entry_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 256, (num_blocks, C * E * entry_bytes + 17), dtype=torch.uint8, generator=g)
    return records[:, :C * E * entry_bytes].view(num_blocks, C * E, entry_bytes)  # strided like HostTier


def _trace(B: int, k: int, num_entries: int, steps: int, seed: int, *, dup: bool, pad: bool) -> list[torch.Tensor]:
    """Random [B, k] id batches with locality (hits), fresh ids (misses), padding and repeats."""
    g = torch.Generator().manual_seed(seed)
    out = []
    hot = torch.randint(0, num_entries, (B, 2 * k), generator=g)
    for _ in range(steps):
        ids = torch.where(torch.rand(B, k, generator=g) < 0.6,
                          hot.gather(1, torch.randint(0, 2 * k, (B, k), generator=g)),
                          torch.randint(0, num_entries, (B, k), generator=g))
        if not dup:  # unique per row: replace repeats by padding
            srt, perm = torch.sort(ids, dim=1, stable=True)
            rep = torch.zeros_like(srt, dtype=torch.bool)
            rep[:, 1:] = srt[:, 1:] == srt[:, :-1]
            ids = ids.scatter(1, perm, torch.where(rep, -1, srt))
        if pad:
            ids = torch.where(torch.rand(B, k, generator=g) < 0.15, -1, ids)
        out.append(ids)
    return out


def _run_equivalence(device: str, impl: str, *, B: int, k: int, N: int, dup: bool, pad: bool, seed: int) -> None:
    L = FLASH_MINI
    C, E, EB = L.num_csa_layers, L.csa_entries_per_block, L.entry_bytes
    S, max_blocks, HB = B + 2, 12, 40
    hs = HiSparseBuffers(L, HiSparseConfig(device_buffer_entries=N), S, torch.device(device), max_blocks=max_blocks)
    host = _mirror(HB, C, E, EB, seed)
    if device == "cuda":
        host = host.pin_memory() if cuda_ops.unsupported_reason(host=host.pin_memory()) is None else host.to(device)
    g = torch.Generator().manual_seed(seed + 1)
    table = torch.randint(0, HB, (S, max_blocks), generator=g)
    hs.host_block.copy_(table)
    slots_of_rows = torch.randperm(S, generator=g)[:B]
    oracle = Oracle(S, C, N, EB)
    state_slots = slots_of_rows.to(device)
    for step, ids in enumerate(_trace(B, k, max_blocks * E, 12, seed, dup=dup, pad=pad)):
        part = step % C
        got = kernels.hisparse_swap_in(hs.tables, state_slots, part, ids.to(device), host, impl=impl)
        for b in range(B):
            s = int(slots_of_rows[b])
            row = ids[b].tolist()
            hb = table[s][ids[b].clamp(min=0) // E]
            rows = host.cpu()[hb, part * E + ids[b].clamp(min=0) % E]
            want = oracle.swap_in(s, part, row, rows)
            assert got[b].cpu().tolist() == want, f"step {step} row {b}"
        assert torch.equal(hs.entry_of_slot.cpu(), oracle.eos)
        assert torch.equal(hs.last_used.cpu() >= 0, oracle.last >= 0)
        # lru is the stable argsort of last_used (exact LRU order, ties to the lower slot)
        assert torch.equal(hs.lru.cpu(), torch.sort(hs.last_used.cpu(), dim=2, stable=True).indices)
        assert torch.equal(hs.buffer.cpu(), oracle.buffer)
    assert hs.counters.cpu().tolist() == [oracle.hits, oracle.misses]


@pytest.mark.parametrize("dup,pad", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("B,k,N", [(1, 16, 16), (5, 12, 20), (8, 8, 32)])  # N == k: every step evicts
def test_batched_matches_per_request_oracle(B: int, k: int, N: int, dup: bool, pad: bool) -> None:
    _run_equivalence("cpu", "torch", B=B, k=k, N=N, dup=dup, pad=pad, seed=B * 100 + k + N)


@pytest.mark.gpu
@IMPLS_CUDA
@pytest.mark.parametrize("B,k,N", [(1, 16, 16), (5, 12, 20), (8, 8, 32), (3, 512, 2048)])
@pytest.mark.parametrize("impl", ["cuda", "torch"])
def test_batched_matches_oracle_on_cuda(B: int, k: int, N: int, impl: str) -> None:
    _run_equivalence("cuda", impl, B=B, k=k, N=N, dup=True, pad=True, seed=7 + B)


# ------------------------------------------------------------ sync-freedom
def test_sync_detector_fires_on_syncing_ops() -> None:
    x = torch.arange(8)
    for op in (lambda: x[3].item(), lambda: x.tolist(), lambda: x.nonzero(), lambda: torch.unique(x),
               lambda: x[x > 2], lambda: x.masked_select(x > 2), lambda: bool(x.any()), lambda: int(x[0])):
        with pytest.raises(HostSyncError), SyncDetector("cpu"):
            op()
    with SyncDetector("cpu") as d:  # static-shape ops pass
        torch.sort(x)
        torch.cumsum(x, 0)
        x[torch.tensor([1, 2])] = 5
        torch.where(x > 2, x, -1)
    assert d.fired == []
    other = torch.arange(3)
    with SyncDetector("meta"):  # only the watched device counts
        other.tolist()


def device_state(cache: TieredKVCache) -> list[torch.Tensor]:
    """What lives on the GPU in a deployment, HiSparse tables included: on a CPU the
    detector flags reads of these (and of values computed from them), while the checks of
    the caller's ids (on the CPU a ValueError, e.g. for an id below -1; on a GPU skipped
    unless TIERED_KV_DEBUG=1) go free."""
    hs = cache.hisparse
    assert hs is not None
    return cache_tensors(cache) + [hs.entry_of_slot, hs.last_used, hs.lru, hs.step, hs.host_block, hs.counters]


def _fill_through_engine_interface(cache: TieredKVCache, n_req: int, num_blocks: int) -> list:
    """Requests with ``num_blocks`` sealed blocks of random entries, written as an engine
    would (device tensors through reserve / write_csa / write_hca / advance)."""
    L, dev = cache.layout, cache.device
    g = torch.Generator(device=dev).manual_seed(0)
    E, bt = L.csa_entries_per_block, L.block_tokens
    reqs = []
    for i in range(n_req):
        r = cache.open([i])
        for blk in range(num_blocks):
            cache.reserve(r, bt)
            ids = torch.arange(blk * E, (blk + 1) * E)
            for layer in L.csa_layers:
                cache.write_csa(r, layer, ids, torch.randint(0, 256, (E, L.entry_bytes), dtype=torch.uint8,
                                                             device=dev, generator=g),
                                torch.randint(0, 256, (E, L.indexer_bytes), dtype=torch.uint8, device=dev,
                                              generator=g))
            for layer in L.hca_layers:
                cache.write_hca(r, layer, torch.tensor([blk]),
                                torch.randint(0, 256, (1, L.entry_bytes), dtype=torch.uint8, device=dev, generator=g))
            cache.advance(r, random_tokens(bt, seed=100 * i + blk))
        reqs.append(r)
    return reqs


def test_swap_in_batch_is_sync_free_on_cpu(tiny_layout, tiny_model) -> None:
    cache = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=4, host_bytes=HOST,
                          hisparse=HiSparseConfig(device_buffer_entries=16))
    reqs = _fill_through_engine_interface(cache, 3, 2)
    layer = tiny_layout.csa_layers[0]
    ids = torch.tensor([[0, 5, 9, 63, -1, 5, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8], [60, 61, -1, -1, 0, 1, 2, 40]])
    with SyncDetector(cache.device, owned=device_state(cache)) as d:
        for _ in range(3):
            slots = cache.swap_in_batch(reqs, layer, ids)
    assert d.fired == []
    assert slots.shape == ids.shape and (slots[ids < 0] == -1).all()
    assert slots[0, 1] == slots[0, 5]  # a repeated id has one slot


def test_swap_in_batch_returns_the_bytes_of_a_plain_cache(tiny_layout, tiny_model) -> None:
    """Each request's bytes through the batched path == read_csa of a cache without HiSparse."""
    L = tiny_layout
    cache = TieredKVCache(L, num_blocks=32, num_state_slots=4, host_bytes=HOST,
                          hisparse=HiSparseConfig(device_buffer_entries=2 * L.top_k))
    plain = TieredKVCache(L, num_blocks=32, num_state_slots=4)
    reqs, preqs = _fill_through_engine_interface(cache, 3, 3), _fill_through_engine_interface(plain, 3, 3)
    g = torch.Generator().manual_seed(3)
    for layer in L.csa_layers:
        c = L.part_index(layer)
        for _ in range(6):  # top-k picks with repeats from step to step: hits, misses, evictions
            sealed = [r.num_sealed_blocks * L.csa_entries_per_block for r in reqs]
            ids = torch.stack([torch.randperm(n, generator=g)[:L.top_k] for n in sealed])
            slots = cache.swap_in_batch(reqs, layer, ids)
            for b, (r, pr) in enumerate(zip(reqs, preqs)):
                assert torch.equal(cache.hisparse.buffer[r.slot, c, slots[b]], plain.read_csa(pr, layer, ids[b]))


def test_batched_equals_per_request_swap_in_through_the_cache(tiny_layout, tiny_model) -> None:
    L = tiny_layout

    def build() -> tuple[TieredKVCache, list]:
        cache = TieredKVCache(L, num_blocks=32, num_state_slots=4, host_bytes=HOST,
                              hisparse=HiSparseConfig(device_buffer_entries=L.top_k))
        return cache, _fill_through_engine_interface(cache, 3, 3)

    (a, ra), (b, rb) = build(), build()
    g = torch.Generator().manual_seed(5)
    layer = L.csa_layers[1]
    for _ in range(8):
        ids = torch.stack([torch.randperm(r.num_sealed_blocks * L.csa_entries_per_block, generator=g)[:L.top_k]
                           for r in ra])
        batched = a.swap_in_batch(ra, layer, ids)
        single = torch.stack([b.swap_in(r, layer, ids[i]) for i, r in enumerate(rb)])
        assert torch.equal(batched, single)
        assert torch.equal(a.hisparse.buffer, b.hisparse.buffer)
    assert a.stats()["hisparse_misses"] == b.stats()["hisparse_misses"] > 0


def test_swap_in_batch_boundary_errors(tiny_layout, tiny_model, monkeypatch) -> None:
    L = tiny_layout
    cache = TieredKVCache(L, num_blocks=16, num_state_slots=4, host_bytes=HOST,
                          hisparse=HiSparseConfig(device_buffer_entries=L.top_k))
    reqs = _fill_through_engine_interface(cache, 2, 2)
    layer = L.csa_layers[0]
    with pytest.raises(ValueError, match="at most device_buffer_entries = 8"):
        cache.swap_in_batch(reqs, layer, torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[B=2, k\]"):
        cache.swap_in_batch(reqs, layer, torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="distinct requests"):
        cache.swap_in_batch([reqs[0], reqs[0]], layer, torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="expected a csa layer"):
        cache.swap_in_batch(reqs, L.hca_layers[0], torch.zeros(2, 4, dtype=torch.int64))
    open_block = reqs[0].num_sealed_blocks * L.csa_entries_per_block  # not sealed: no host record
    bad = torch.tensor([[open_block, -1], [0, 1]])
    monkeypatch.setenv("TIERED_KV_DEBUG", "1")
    with pytest.raises(ValueError, match="not in a sealed block"):
        cache.swap_in_batch(reqs, layer, bad)
    with pytest.raises(ValueError, match=">= 0 or -1"):
        cache.swap_in_batch(reqs, layer, torch.tensor([[-2, 0], [0, 1]]))
    monkeypatch.delenv("TIERED_KV_DEBUG")
    with pytest.raises(IndexError):  # without the debug checks the CPU gather still refuses it
        cache.swap_in_batch(reqs, layer, bad)


@pytest.mark.slow
def test_logits_bit_identical_through_batched_decode(tiny_layout, tiny_model) -> None:
    """A decode step of 3 requests whose CSA reads go through one swap_in_batch per layer."""
    from test_hisparse import run

    L = tiny_layout
    tokens = random_tokens(420, seed=21)
    plain = TieredKVCache(L, num_blocks=8, num_state_slots=1)
    want = run(tiny_model, plain, tokens, 390, 30)

    class Batched(TieredKVCache):
        """read_csa's sealed entries via swap_in_batch with padding to a fixed k."""

        def read_csa(self, request, layer, entry_ids):  # type: ignore[override]
            ids = torch.as_tensor(entry_ids, dtype=torch.int64)
            E = self.layout.csa_entries_per_block
            sealed = ids // E < request.num_sealed_blocks
            if self.hisparse is None or ids.numel() > self.hisparse.capacity or not bool(sealed.any()):
                return super().read_csa(request, layer, entry_ids)
            k = self.hisparse.capacity
            padded = torch.full((1, k), -1, dtype=torch.int64)
            padded[0, :ids.numel()] = torch.where(sealed, ids, -1)
            slots = self.swap_in_batch([request], layer, padded)[0, :ids.numel()]
            out = super().read_csa(request, layer, torch.where(sealed, 0, ids).clamp(min=0)) if (~sealed).any() \
                else torch.empty(ids.numel(), L.entry_bytes, dtype=torch.uint8)
            out[sealed] = self.hisparse.buffer[request.slot, L.part_index(layer), slots[sealed]]
            return out

    cache = Batched(L, num_blocks=8, num_state_slots=1, host_bytes=HOST,
                    hisparse=HiSparseConfig(device_buffer_entries=2 * L.top_k))
    got = run(tiny_model, cache, tokens, 390, 30)
    assert torch.equal(got, want)
    assert cache.stats()["hisparse_misses"] > 0


# ---------------------------------------------------------------------- GPU
@pytest.mark.gpu
@IMPLS_CUDA
def test_swap_in_batch_cuda_no_sync_and_graph_replay(tiny_layout, tiny_model) -> None:
    """set_sync_debug_mode('error') around the batched swap-in; capture + replay = eager bytes."""
    L = FLASH_MINI
    N, k, B = 64, 32, 4

    def build():
        hs = HiSparseBuffers(L, HiSparseConfig(device_buffer_entries=N), B, torch.device("cuda"), max_blocks=8)
        hs.host_block.copy_(torch.arange(B * 8).view(B, 8) % 20)
        return hs

    C, E, EB = L.num_csa_layers, L.csa_entries_per_block, L.entry_bytes
    host = _mirror(20, C, E, EB, 3).pin_memory()
    steps = _trace(B, k, 8 * E, 6, 9, dup=True, pad=True)
    eager, graphed = build(), build()
    slots = torch.arange(B, device="cuda")
    static_ids = torch.full((B, k), -1, dtype=torch.int64, device="cuda")
    static_out = torch.empty(B, k, dtype=torch.int64, device="cuda")
    # warm-up (compiles the kernel) on a side stream, as torch.cuda.graph requires
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernels.hisparse_swap_in(build().tables, slots, 0, static_ids, host, out=static_out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernels.hisparse_swap_in(graphed.tables, slots, 0, static_ids, host, out=static_out)
    uploaded = [ids.cuda() for ids in steps]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for dev_ids in uploaded:
            want = kernels.hisparse_swap_in(eager.tables, slots, 0, dev_ids, host)
            static_ids.copy_(dev_ids)
            graph.replay()
            torch.cuda.set_sync_debug_mode(0)  # comparing reads the result back
            assert torch.equal(static_out, want)
            torch.cuda.set_sync_debug_mode("error")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(graphed.buffer, eager.buffer)
    assert torch.equal(graphed.lru, eager.lru) and torch.equal(graphed.entry_of_slot, eager.entry_of_slot)


@pytest.mark.parametrize("device", DEVICES)
def test_swap_in_batch_sync_free_engine_interface(tiny_layout, device: str) -> None:
    """Blocks written as an engine would; then a swap-in step under both sync checks."""
    L = tiny_layout
    cache = TieredKVCache(L, device=device, num_blocks=16, num_state_slots=4, host_bytes=HOST,
                          hisparse=HiSparseConfig(device_buffer_entries=16))
    reqs = _fill_through_engine_interface(cache, 3, 2)
    ids = torch.tensor([[0, 5, 9, 63, -1, 5, 31, 2], [1, 2, 3, 4, 5, 6, 7, 8], [60, 61, -1, -1, 0, 1, 2, 40]],
                       device=device)
    layer = L.csa_layers[1]
    cache.swap_in_batch(reqs, layer, ids)  # first call builds the (static) slot tensor
    cuda = device == "cuda"
    with SyncDetector(cache.device, owned=None if cuda else device_state(cache)) as d:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            slots = cache.swap_in_batch(reqs, layer, ids)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    assert d.fired == []
    c = L.part_index(layer)
    host = cache.host.csa_rows()
    E = L.csa_entries_per_block
    for b, r in enumerate(reqs):  # the buffer holds the host mirror's bytes of each id
        for j, e in enumerate(ids[b].tolist()):
            if e < 0:
                assert int(slots[b, j]) == -1
                continue
            hid = cache._host_of_block[r.block_ids[e // E]]
            assert torch.equal(cache.hisparse.buffer[r.slot, c, int(slots[b, j])].cpu(), host[hid, c * E + e % E])


def test_debug_env_is_off_by_default() -> None:
    assert kernels.debug_checks() is (os.environ.get("TIERED_KV_DEBUG", "") not in ("", "0"))


def test_launch_state_is_cached_per_pool() -> None:
    """The copy engine's segment table is built once per pool, not per call."""
    parts = [torch.zeros(3, 4, 2, 8, dtype=torch.uint8), torch.zeros(2, 4, 1, 8, dtype=torch.uint8)]
    n1, seg1 = cuda_ops._segments(parts, torch.device("cpu"))
    n2, seg2 = cuda_ops._segments(parts, torch.device("cpu"))
    assert seg1 is seg2 and n1 == n2 == 5  # one run per (layer, block): 3 + 2 layers
    assert seg1.tolist() == [list(r) for r in cuda_ops.segment_table(parts)]


class Recorder:
    """A ``cuda_ops`` launcher that records each launch instead of running it (the launch
    contract without a GPU; tests/test_cuda_emu.py runs the kernels themselves)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, device, source, name, grid, block, args, shared_mem) -> None:
        self.calls.append((name, grid, block, args, shared_mem))


def _tables(S: int = 3, C: int = 2, N: int = 16, EB: int = 12, *, row_pad: int = 0) -> kernels.HiSparseTables:
    rows = torch.zeros((S * C * N + 1) * (EB + row_pad), dtype=torch.uint8).view(S * C * N + 1, EB + row_pad)
    return kernels.HiSparseTables(
        buffer_rows=rows[:, :EB], entry_of_slot=torch.full((S, C, N), -1), last_used=torch.full((S, C, N), -1),
        lru=torch.arange(N).repeat(S, C, 1), step=torch.zeros(S, C, dtype=torch.int64),
        host_block=torch.zeros(S, 8, dtype=torch.int64), counters=torch.zeros(2, dtype=torch.int64),
        entries_per_block=4)


def _record(t: kernels.HiSparseTables, k: int = 4, host: torch.Tensor | None = None) -> tuple:
    C, EB = t.entry_of_slot.shape[1], t.buffer_rows.shape[1]
    host = torch.zeros(5, C * 4, EB, dtype=torch.uint8) if host is None else host
    rec = Recorder()
    with cuda_ops.launcher(rec):
        cuda_ops.hisparse_swap_in(t, torch.tensor([1]), 0, torch.zeros(1, k, dtype=torch.int64), host, None,
                                  torch.empty(1, k, dtype=torch.int64))
    (call,) = rec.calls
    return call


def test_batched_kernel_work_area_in_shared_or_global_memory() -> None:
    """Any N runs the kernel: the work area sits in shared memory while it fits, else in a
    global scratch (one 16-byte aligned area per request); never the syncing twin."""
    assert cuda_ops.hisparse_work_bytes(2048, 512) < 64 * 1024  # Flash, N = 4 x top-k
    name, grid, block, args, shared = _record(_tables(N=2048), k=512)
    assert name == "tkv_hisparse_swap_in" and shared == cuda_ops.hisparse_work_bytes(2048, 512)
    assert grid == (1,) and block == (1024,)
    name, _, _, args, shared = _record(_tables(S=2, C=1, N=16384), k=512)
    assert name == "tkv_hisparse_swap_in_global" and shared == 0
    stride = int(args[-1])
    assert stride >= cuda_ops.hisparse_work_bytes(16384, 512) and stride % 16 == 0
    assert cuda_ops.unsupported_reason() == "cupy is not importable" or cuda_ops.cupy_available()


def test_launch_arguments_are_those_of_the_call() -> None:
    """Issue 14's stale cache: tables sharing buffer, entry_of_slot, host_block and host but
    not lru / last_used / step / counters (or N) get their own addresses and sizes."""
    a = _tables()
    b = kernels.HiSparseTables(buffer_rows=a.buffer_rows, entry_of_slot=a.entry_of_slot, host_block=a.host_block,
                               last_used=a.last_used.clone(), lru=a.lru.clone(), step=a.step.clone(),
                               counters=a.counters.clone(), entries_per_block=a.entries_per_block)
    host = torch.zeros(5, 8, 12, dtype=torch.uint8)
    args_a, args_b = _record(a, host=host)[3], _record(b, host=host)[3]
    order = ["last_used", "lru", "step", "counters"]  # arguments 8..11 (see tkv_hisparse_swap_in)
    assert [int(x) for x in args_a[8:12]] == [getattr(a, n).data_ptr() for n in order]
    assert [int(x) for x in args_b[8:12]] == [getattr(b, n).data_ptr() for n in order]
    assert int(args_a[7]) == int(args_b[7]) == a.entry_of_slot.data_ptr()
    c = _tables(S=3, C=2, N=24)  # another N, same everything else where it can be
    assert int(_record(c, host=host)[3][6]) == 24


def test_padded_buffer_rows_pass_stride_and_entry_size() -> None:
    args = _record(_tables(row_pad=5))[3]
    assert int(args[13]) == 17 and int(args[14]) == 12  # row stride, entry bytes (issue 14: one value for both)


@pytest.mark.parametrize("case", ["lru_strided", "step_shape", "rows_count", "rows_bytes_stride", "rows_overlap",
                                  "dtype", "entries_per_block"])
def test_tables_refuse_a_layout_the_kernel_cannot_address(case: str) -> None:
    t = _tables()
    fields = {f: getattr(t, f) for f in ("buffer_rows", "entry_of_slot", "last_used", "lru", "step", "host_block",
                                         "counters", "entries_per_block")}
    S, C, N = t.entry_of_slot.shape
    bad, match = {
        "lru_strided": ({"lru": torch.arange(N).repeat(S, C, 2)[..., ::2]}, "lru: expected a contiguous tensor"),
        "step_shape": ({"step": torch.zeros(S, C + 1, dtype=torch.int64)}, r"step: expected shape \[3, 2\]"),
        "rows_count": ({"buffer_rows": torch.zeros(S * C * N, 12, dtype=torch.uint8)}, "S \\* C \\* N \\+ 1 = 97"),
        "rows_bytes_stride": ({"buffer_rows": torch.zeros(S * C * N + 1, 24, dtype=torch.uint8)[:, ::2]},
                              "unit stride in the bytes dim"),
        "rows_overlap": ({"buffer_rows": torch.zeros(S * C * N * 4 + 20, dtype=torch.uint8).as_strided(
            (S * C * N + 1, 12), (4, 1))}, "rows that do not overlap"),
        "dtype": ({"last_used": torch.zeros(S, C, N, dtype=torch.int32)}, "last_used: expected dtype torch.int64"),
        "entries_per_block": ({"entries_per_block": 0}, "entries_per_block: expected an int >= 1"),
    }[case]
    with pytest.raises(ValueError, match=match):
        kernels.HiSparseTables(**{**fields, **bad})


def test_ids_below_padding_raise_on_cpu(tiny_layout, tiny_model) -> None:
    """-1 is padding; -5 is a broken id: the CPU refuses it naming what it expected (issue 16),
    the kernel traps on it (tests/test_cuda_emu.py)."""
    cache = TieredKVCache(tiny_layout, num_blocks=16, num_state_slots=4, host_bytes=HOST,
                          hisparse=HiSparseConfig(device_buffer_entries=16))
    reqs = _fill_through_engine_interface(cache, 2, 2)
    layer = tiny_layout.csa_layers[0]
    with pytest.raises(ValueError, match=r"ids: expected entry ids >= 0 or -1 \(padding\), got -5"):
        cache.swap_in_batch(reqs, layer, torch.tensor([[0, -5], [1, 2]]))
    assert cache.hisparse.step.sum() == 0  # refused before anything ran
    t = _tables()
    for impl in ("torch", "auto"):
        with pytest.raises(ValueError, match="got -2"):
            kernels.hisparse_swap_in(t, torch.tensor([0]), 0, torch.tensor([[-2, 1]]),
                                     torch.zeros(5, 8, 12, dtype=torch.uint8), impl=impl)


def test_debug_checks_the_tables_invariants(monkeypatch) -> None:
    """TIERED_KV_DEBUG=1: every LRU row of the batch is a permutation, and an entry sits in
    at most one slot of its row (both implementations rely on it)."""
    host = torch.zeros(5, 8, 12, dtype=torch.uint8)
    ids = torch.tensor([[0, 1]])
    monkeypatch.setenv("TIERED_KV_DEBUG", "1")
    t = _tables()
    kernels.hisparse_swap_in(t, torch.tensor([1]), 0, ids, host, impl="torch")  # valid tables pass
    t.lru[1, 1, 3] = t.lru[1, 1, 4]
    kernels.hisparse_swap_in(t, torch.tensor([1]), 0, ids, host, impl="torch")  # part 1: not this call's rows
    with pytest.raises(ValueError, match=r"tables.lru\[1, 1\]: expected a permutation of the 16 slots"):
        kernels.hisparse_swap_in(t, torch.tensor([1]), 1, ids, host, impl="torch")
    t = _tables()
    t.entry_of_slot[2, 0, 5] = t.entry_of_slot[2, 0, 9] = 77
    with pytest.raises(ValueError, match=r"tables.entry_of_slot\[2, 0\]: expected each entry in at most one "
                                         r"slot, got entry 77 in two"):
        kernels.hisparse_swap_in(t, torch.tensor([0, 2]), 0, torch.tensor([[0, 1], [2, 3]]), host, impl="torch")
    monkeypatch.delenv("TIERED_KV_DEBUG")
    kernels.hisparse_swap_in(t, torch.tensor([0]), 0, ids, host, impl="torch")  # unchecked without it


def test_warns_once_when_a_gpu_cannot_run_the_kernel(monkeypatch) -> None:
    """A GPU without CuPy: the cache says so once, when built, not silently per step."""
    from tiered_kv import hisparse

    monkeypatch.setattr(cuda_ops, "cupy_available", lambda: False)
    with pytest.warns(RuntimeWarning, match="synchronises the host with the device at every decode step"):
        hisparse.warn_if_decode_syncs(torch.device("cuda", 0))
    monkeypatch.setattr(cuda_ops, "cupy_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hisparse.warn_if_decode_syncs(torch.device("cuda", 0))
        hisparse.warn_if_decode_syncs(torch.device("cpu"))
    seen: list[torch.device] = []
    monkeypatch.setattr(hisparse, "warn_if_decode_syncs", seen.append)
    hs = HiSparseBuffers(FLASH_MINI, HiSparseConfig(device_buffer_entries=8), 2, torch.device("cpu"))
    hs.swap_in_batch(hs.slot_tensor((0,)), 0, torch.tensor([[0, 1]]), torch.zeros(3, 32, FLASH_MINI.entry_bytes,
                                                                                   dtype=torch.uint8),
                     host_rows=torch.tensor([[0, 1]]))
    assert seen == [torch.device("cpu")]  # called by the constructor, once; never by a step


@pytest.mark.gpu
@IMPLS_CUDA
def test_cache_swap_in_batch_graph_capture_matches_eager(tiny_layout) -> None:
    """docs/api.md's recipe: capture cache.swap_in_batch of every CSA layer, replay per step."""
    L = tiny_layout

    def build() -> tuple[TieredKVCache, list]:
        cache = TieredKVCache(L, device="cuda", num_blocks=16, num_state_slots=4, host_bytes=HOST,
                              hisparse=HiSparseConfig(device_buffer_entries=16))
        return cache, _fill_through_engine_interface(cache, 3, 3)

    (eager, re), (graphed, rg) = build(), build()
    k = 12
    static_ids = {layer: torch.full((3, k), -1, dtype=torch.int64, device="cuda") for layer in L.csa_layers}
    static_out = {layer: torch.empty(3, k, dtype=torch.int64, device="cuda") for layer in L.csa_layers}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, builds the slot tensor, caches addresses
        for layer in L.csa_layers:
            graphed.swap_in_batch(rg, layer, static_ids[layer], out=static_out[layer])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in L.csa_layers:
            graphed.swap_in_batch(rg, layer, static_ids[layer], out=static_out[layer])
    for step in _trace(3, k, 3 * L.csa_entries_per_block, 5, 11, dup=True, pad=True):
        ids = step.cuda()
        for layer in L.csa_layers:
            static_ids[layer].copy_(ids)
        graph.replay()
        for layer in L.csa_layers:
            assert torch.equal(static_out[layer], eager.swap_in_batch(re, layer, ids))
    assert torch.equal(graphed.hisparse.buffer, eager.hisparse.buffer)
