"""The copy engine (and the device helpers it stands on).

CPU: copies are synchronous, handles complete at once. The pending-handle machinery
(poll, callbacks, released references, event latencies) is exercised on CPU with a
stand-in event; the real CUDA path runs under the ``gpu`` marker.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tiered_kv import kernels
from tiered_kv.device import cuda_available, empty_host, pin_memory_supported, resolve_device
from tiered_kv.transfer import CopyEngine, CopyHandle, CopyKind

NUM_BLOCKS = 8


def make_parts(device: str | torch.device = "cpu", seed: int = 0) -> list[torch.Tensor]:
    """A miniature V4 pool: CSA KV, indexer keys, HCA KV, plus an empty part."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, NUM_BLOCKS, 4, 24), (3, NUM_BLOCKS, 4, 12), (0, NUM_BLOCKS, 4, 24), (2, NUM_BLOCKS, 1, 24)]
    return [torch.randint(0, 256, s, dtype=torch.uint8, generator=g).to(device) for s in shapes]


# ---------------------------------------------------------------------- device.py
def test_cuda_available_matches_torch_and_is_cached() -> None:
    assert cuda_available() is torch.cuda.is_available()
    assert cuda_available() is cuda_available()


@pytest.mark.parametrize("spec", ["cpu", torch.device("cpu")])
def test_resolve_cpu(spec: str | torch.device) -> None:
    assert resolve_device(spec) == torch.device("cpu")


@pytest.mark.skipif(cuda_available(), reason="checks the error raised without CUDA")
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", torch.device("cuda", 0)])
def test_resolve_cuda_without_cuda_raises(spec: str | torch.device) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device(spec)


@pytest.mark.parametrize("spec", ["meta", "not-a-device"])
def test_resolve_bad_device_raises(spec: str) -> None:
    with pytest.raises(ValueError, match="device: expected"):
        resolve_device(spec)


def test_resolve_device_type_error() -> None:
    with pytest.raises(TypeError, match="device: expected a str or torch.device"):
        resolve_device(0)  # type: ignore[arg-type]


def test_pin_memory_supported() -> None:
    assert pin_memory_supported("cpu") is False
    assert pin_memory_supported(torch.device("cuda", 0)) is cuda_available()


def test_empty_host_shapes_and_pinning() -> None:
    t = empty_host((3, 5), torch.float32, pinned=True)
    assert t.shape == (3, 5) and t.dtype == torch.float32 and t.device.type == "cpu"
    assert t.is_pinned() is cuda_available()
    b = empty_host(64, torch.int32, pinned=False)
    assert b.shape == (16,) and not b.is_pinned()
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        empty_host(6, torch.int32, pinned=False)
    with pytest.raises(ValueError, match="non-negative sizes"):
        empty_host((2, -1), pinned=False)


# ------------------------------------------------------------------ CPU round trip
def test_cpu_offload_load_round_trip_is_exact() -> None:
    parts = make_parts()
    ids = torch.tensor([5, 0, 7, 2])
    nbytes = kernels.record_bytes(parts)
    host = empty_host((len(ids), nbytes), pinned=True)
    restored = [torch.zeros_like(p) for p in parts]
    with CopyEngine("cpu") as engine:
        off = engine.offload_blocks(parts, ids, host)
        assert off.done() and off.finished and off.kind is CopyKind.D2H
        load = engine.load_blocks(host, ids, restored)
        assert load.done() and load.kind is CopyKind.H2D

    for got, want in zip(restored, parts):
        assert torch.equal(got[:, ids], want[:, ids])
        untouched = [b for b in range(NUM_BLOCKS) if b not in ids.tolist()]
        assert not got[:, untouched].any()
    # the host record is the layout contract: part by part, layer-major
    expected0 = torch.cat([p[:, 5].reshape(-1) for p in parts])
    assert torch.equal(host[0], expected0)


def test_cpu_counters_and_stats() -> None:
    parts = make_parts()
    nbytes = kernels.record_bytes(parts)
    engine = CopyEngine("cpu")
    host = empty_host((3, nbytes), pinned=False)
    engine.offload_blocks(parts, torch.tensor([1, 2, 3]), host)
    engine.load_blocks(host[:2], torch.tensor([4, 5]), parts)
    engine.copy(torch.empty(10, dtype=torch.float64), torch.ones(10, dtype=torch.float64))

    assert engine.copies == 3
    assert engine.bytes_d2h == 3 * nbytes
    assert engine.bytes_h2d == 2 * nbytes
    assert engine.bytes_local == 80
    stats = engine.stats()
    assert stats.copies == 3 and stats.completed == 3 and stats.pending == 0
    assert len(stats.recent_latencies_s) == 3
    assert all(t >= 0 for t in stats.recent_latencies_s)
    assert stats.latency_max_s == max(stats.recent_latencies_s)
    assert stats.latency_total_s == pytest.approx(sum(stats.recent_latencies_s))
    assert stats.latency_mean_s == pytest.approx(stats.latency_total_s / 3)
    assert engine.poll() == 0
    engine.synchronize()


def test_cpu_handle_api() -> None:
    engine = CopyEngine(torch.device("cpu"))
    src = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    dst = torch.zeros_like(src)
    handle = engine.copy(dst, src)
    assert torch.equal(dst, src)
    assert handle.kind is CopyKind.LOCAL and handle.nbytes == 24
    assert handle.done() and handle.finished and handle.latency_s is not None
    handle.wait()
    handle.make_stream_wait()
    handle.keep_alive(object())
    seen: list[CopyHandle] = []
    handle.add_done_callback(seen.append)  # already complete: runs at once
    assert seen == [handle]


def test_callback_errors_propagate() -> None:
    engine = CopyEngine("cpu")
    handle = engine.copy(torch.zeros(2), torch.ones(2))
    with pytest.raises(RuntimeError, match="boom"):
        handle.add_done_callback(lambda h: (_ for _ in ()).throw(RuntimeError("boom")))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e: e.copy(torch.zeros(3), torch.zeros(4)), r"dst: expected shape \[4\] and dtype torch.float32"),
        (lambda e: e.copy(torch.zeros(3, dtype=torch.int8), torch.zeros(3)), "dtype torch.float32 like src"),
        (lambda e: e.copy(torch.zeros(3, device="meta"), torch.zeros(3)), "dst: expected a tensor on the engine's device cpu"),
        (lambda e: e.offload_blocks(make_parts(), torch.tensor([0]), torch.empty(1, 3, dtype=torch.uint8)),
         "record_bytes mismatch"),
        (lambda e: e.offload_blocks(make_parts(), torch.tensor([0]), torch.empty(1, 3, dtype=torch.uint8, device="meta")),
         r"host_out: expected a host \(cpu\) tensor"),
        (lambda e: e.load_blocks(torch.empty(1, 3, dtype=torch.uint8), torch.tensor([0]), make_parts()),
         "records: expected shape"),
        (lambda e: e.offload_blocks([p.to("meta") for p in make_parts()], torch.tensor([0]),
                                    torch.empty(1, 3, dtype=torch.uint8)),
         r"parts\[0\]: expected a tensor on the engine's device cpu"),
    ],
)
def test_bad_input_raises(call, message: str) -> None:
    engine = CopyEngine("cpu")
    with pytest.raises(ValueError, match=message):
        call(engine)
    assert engine.copies == 0


def test_type_errors() -> None:
    with pytest.raises(TypeError, match="src: expected a torch.Tensor"):
        CopyEngine("cpu").copy(torch.zeros(1), [0.0])  # type: ignore[arg-type]


# ------------------------------------------- pending handles, with a stand-in event
class FakeEvent:
    """Quacks like a timing ``torch.cuda.Event`` whose completion the test controls."""

    def __init__(self, ms: float = 0.0) -> None:
        self.fired = False
        self.ms = ms
        self.synchronized = 0

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.synchronized += 1
        self.fired = True

    def elapsed_time(self, end: FakeEvent) -> float:
        assert end.fired
        return end.ms


def pending_handle(engine: CopyEngine, keep: tuple, ms: float) -> tuple[CopyHandle, FakeEvent]:
    end = FakeEvent(ms)
    handle = CopyHandle(engine=engine, kind=CopyKind.D2H, nbytes=100, keep=keep, start=FakeEvent(), end=end)
    engine._account_submitted(CopyKind.D2H, 100)
    engine._pending.append(handle)
    return handle, end


def test_poll_finishes_completed_handles_only() -> None:
    engine = CopyEngine("cpu")
    src = torch.ones(4)
    src_ref = weakref.ref(src)
    first, first_end = pending_handle(engine, (src,), ms=2.0)
    second, second_end = pending_handle(engine, (), ms=5.0)
    del src
    gc.collect()
    calls: list[str] = []
    first.add_done_callback(lambda h: calls.append("first"))
    second.add_done_callback(lambda h: calls.append("second"))

    assert engine.poll() == 0 and engine.pending == 2
    assert src_ref() is not None  # the handle keeps the source alive
    assert not first.done() and first.latency_s is None

    second_end.fired = True  # completion order need not be submission order
    assert engine.poll() == 1
    assert calls == ["second"] and second.latency_s == pytest.approx(0.005)
    assert engine.pending == 1 and src_ref() is not None

    first_end.fired = True
    assert engine.poll() == 1
    gc.collect()
    assert src_ref() is None  # released once the copy is done
    assert calls == ["second", "first"]
    stats = engine.stats()
    assert stats.completed == 2 and stats.pending == 0
    assert stats.latency_max_s == pytest.approx(0.005)
    assert stats.latency_total_s == pytest.approx(0.007)
    assert engine.poll() == 0


def test_wait_finishes_and_poll_skips_it() -> None:
    engine = CopyEngine("cpu")
    handle, end = pending_handle(engine, (), ms=1.0)
    seen: list[CopyHandle] = []
    handle.add_done_callback(seen.append)
    handle.wait()
    assert end.synchronized == 1 and seen == [handle] and handle.finished
    handle.wait()  # idempotent
    assert end.synchronized == 1 and seen == [handle]
    assert engine.poll() == 0 and engine.pending == 0 and engine.completed == 1


def test_poll_runs_every_callback_then_raises() -> None:
    engine = CopyEngine("cpu")
    bad, bad_end = pending_handle(engine, (), ms=1.0)
    good, good_end = pending_handle(engine, (), ms=1.0)
    ran: list[str] = []
    bad.add_done_callback(lambda h: (_ for _ in ()).throw(RuntimeError("callback failed")))
    good.add_done_callback(lambda h: ran.append("good"))
    bad_end.fired = good_end.fired = True
    with pytest.raises(RuntimeError, match="callback failed"):
        engine.poll()
    assert ran == ["good"] and engine.pending == 0


# ---------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")


@gpu
@needs_cuda
@pytest.mark.parametrize("impl_cuda", [False, True], ids=["torch_kernels", "cuda_kernels"])
def test_cuda_round_trip_ordered_by_events(impl_cuda: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered_kv.kernels import cuda_ops

    if impl_cuda and not cuda_ops.cupy_available():
        pytest.skip("cupy is not installed")
    if not impl_cuda:
        monkeypatch.setattr(cuda_ops, "unsupported_reason", lambda **_: "forced torch")
    parts = [torch.zeros_like(p) for p in make_parts("cuda")]
    want = make_parts("cuda", seed=3)
    ids = torch.tensor([6, 1, 3])
    nbytes = kernels.record_bytes(parts)
    host = empty_host((len(ids), nbytes), pinned=True)
    assert host.is_pinned()
    engine = CopyEngine("cuda")
    # produced on the current stream, not synchronized: the engine must order after it
    torch.cuda._sleep(20_000_000)
    for p, w in zip(parts, want):
        p.copy_(w)
    off = engine.offload_blocks(parts, ids, host)
    off.wait()
    assert off.finished and off.latency_s is not None and off.latency_s > 0
    assert torch.equal(host, kernels.gather_blocks(want, ids, torch.empty_like(host, device="cuda")).cpu())

    restored = [torch.zeros_like(p) for p in parts]
    load = engine.load_blocks(host, ids, restored)
    load.make_stream_wait()  # the current stream reads only after the load
    for got, w in zip(restored, want):
        assert torch.equal(got[:, ids.cuda()], w[:, ids.cuda()])
    engine.synchronize()
    assert load.finished and engine.pending == 0
    assert engine.bytes_d2h == engine.bytes_h2d == len(ids) * nbytes


@gpu
@needs_cuda
def test_cuda_handle_keeps_source_until_polled() -> None:
    engine = CopyEngine("cuda")
    src = torch.randn(1 << 22, device="cuda")
    dst = empty_host(src.shape, src.dtype, pinned=True)
    src_ref = weakref.ref(src)
    torch.cuda._sleep(50_000_000)  # keep the copy pending for a while
    handle = engine.copy(dst, src)
    released: list[bool] = []
    handle.add_done_callback(lambda h: released.append(True))
    del src
    gc.collect()
    assert src_ref() is not None or handle.finished
    engine.synchronize()
    gc.collect()
    assert src_ref() is None and released == [True]
    assert handle.kind is CopyKind.D2H and engine.bytes_d2h == dst.numel() * 4


@gpu
@needs_cuda
def test_cuda_engine_rejects_unpinned_host() -> None:
    engine = CopyEngine("cuda")
    with pytest.raises(ValueError, match="expected pinned host memory"):
        engine.copy(torch.zeros(4), torch.zeros(4, device="cuda"))
