"""``make test-cuda-emu``: the CUDA kernels of ``kernels/*.cu``, unmodified, executed on the CPU.

Each ``.cu`` is compiled with g++ against the emulator of ``tests/cuda_emu`` (a fiber per
CUDA thread, counting barriers, 32-lane warp collectives, exact-size poisoned dynamic
shared memory, ``__trap``, deadlock reports) and launched through ``cuda_ops``' own
grid / block / shared-memory / argument building (``cuda_ops.launcher``), every argument
checked against the kernel's compiled signature. What runs here:

- the CI set of random multi-step traces of every kernel against its torch twin
  (``cuda_emu/traces.py``; ``bench/gpu_check.sh`` runs the same traces on a GPU), thread
  order in order, reversed or seeded-random by trace;
- the traces of every kernel in an AddressSanitizer + UBSan build (a subprocess);
- positive controls (``cuda_emu/controls.py``): broken copies of the kernels that must fail;
- the emulator's own promises (``cuda_emu/selftest.cu``) and the launch contract.

Skipped, with the reason in pytest's summary, where no C++17 compiler exists. The full
trace set (10x) runs with ``make test-cuda-emu FULL=1`` (TKV_EMU_FULL=1), not in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import cuda_emu
from cuda_emu import ORDERS, EmuLauncher, EmuLaunchError, EmuModule
from cuda_emu.controls import CONTROLS, write_control
from cuda_emu.traces import COUNTS, ENTRY_BYTES, KERNELS, Trace, TraceMismatch, make_traces, run_trace
from tiered_kv import kernels
from tiered_kv.kernels import cuda_ops, torch_ops

CXX = cuda_emu.compiler()
pytestmark = pytest.mark.skipif(
    CXX is None, reason="no C++17 compiler (c++, g++, clang++ or $CXX): the CUDA kernels were NOT executed "
                        "(tests/test_cuda_emu.py, make test-cuda-emu, is SKIPPED)")
TESTS = Path(__file__).resolve().parent
ORDER_NAMES = list(ORDERS)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The twins' tensors are small: one intra-op thread is faster than two, and far
    faster on a loaded machine, where idle OpenMP threads spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def emulated(trace: Trace, **launcher_args: object) -> EmuLauncher:
    """Run ``trace`` with the kernels in the emulator (order by trace index); returns the launcher."""
    launcher = EmuLauncher(order=ORDER_NAMES[trace.index % 3], seed=trace.seed, **launcher_args)  # type: ignore[arg-type]
    with cuda_ops.launcher(launcher):
        run_trace(trace, "cpu")
    return launcher


CI_TRACES = [t for family in KERNELS for t in make_traces(family, COUNTS["ci"][family])]


# ------------------------------------------------------------------ the traces
def test_every_kernel_is_traced() -> None:
    traced = {name for names in KERNELS.values() for name in names}
    assert traced == {name for names in cuda_ops.KERNEL_NAMES.values() for name in names}


def test_ci_set_covers_the_issue_sizes() -> None:
    """The CI set is meaningful: every size class of issue 14 is in it."""
    hs = [t.params for t in CI_TRACES if t.family == "hisparse"]
    assert {p["B"] for p in hs} == set(range(1, 17))
    assert any(p["N"] == 16384 for p in hs) and any(1024 < p["N"] < 16384 for p in hs)
    assert any(p["k"] == p["N"] > 1 for p in hs) and any(p["k"] > 1024 for p in hs)
    assert {p["entry_bytes"] for p in hs} == set(ENTRY_BYTES)
    assert any(p["row_pad"] for p in hs) and any(p["host_pad"] for p in hs) and any(p["offset"] % 2 for p in hs)
    assert {p["explicit_rows"] for p in hs} == {True, False} and {p["dup"] for p in hs} == {True, False}
    assert {p["global"] for p in hs} == {True, False}
    pads = [p["pad"] for p in hs if p["pad"]]
    assert min(pads) < 0.1 and max(pads) > 0.9 and any(p["pad"] == 0 for p in hs)
    assert {t.index % 3 for t in CI_TRACES} == {0, 1, 2}  # in order, reversed, random
    sw = [t.params for t in CI_TRACES if t.family == "swap_in"]
    assert {p["three_d"] for p in sw} == {True, False}
    gs = [t.params for t in CI_TRACES if t.family == "gather_scatter"]
    assert {part["storage"] for p in gs for part in p["parts"]} == {"contiguous", "block_major", "padded", "offset"}


@pytest.mark.parametrize("trace", CI_TRACES, ids=lambda t: f"{t.family}-{t.index}")
def test_kernel_matches_torch_twin(trace: Trace) -> None:
    emulated(trace)


@pytest.mark.skipif(not os.environ.get("TKV_EMU_FULL"), reason="the full trace set: make test-cuda-emu FULL=1")
@pytest.mark.parametrize("family", list(KERNELS))
def test_full_trace_set(family: str) -> None:
    for trace in make_traces(family, COUNTS["full"][family])[COUNTS["ci"][family]:]:
        emulated(trace)


def test_large_n_runs_the_global_work_area_kernel() -> None:
    """N = 16,384 (tables far past shared memory) runs on the GPU path: the global variant."""
    params = dict(make_traces("hisparse", 1)[0].params)
    params.update({"N": 16384, "k": 600, "B": 3, "S": 4, "C": 2, "id_space": 40000, "steps": 2, "prefill": True,
                   "hot": 0.5, "pad": 0.1, "dup": True, "explicit_rows": False, "global": False})
    launcher = emulated(Trace("hisparse", 0, 4242, params))
    assert launcher.launches == {"tkv_hisparse_swap_in_global": 2}
    small = dict(params, N=64, k=32, id_space=200)
    assert emulated(Trace("hisparse", 0, 4243, small)).launches == {"tkv_hisparse_swap_in": 2}


# ------------------------------------------------------------------ positive controls
@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_positive_control_fails(name: str, tmp_path: Path) -> None:
    """A broken copy of a kernel, launched the same way, must make the harness fail."""
    control = CONTROLS[name]
    source, path = write_control(name, tmp_path)
    failures: list[str] = []
    for trace in make_traces(control.family, 40):
        if trace.family == "hisparse" and (trace.params["global"] or trace.params["N"] > 2048):
            continue  # controls target the shared-memory kernel; keep them quick
        try:
            emulated(trace, sources={source: path})
        except (TraceMismatch, EmuLaunchError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            break
    assert failures, f"control {name} ({control.why}) passed every trace: the harness cannot see it"
    if control.expect == "mismatch":
        assert failures[0].startswith("TraceMismatch"), failures[0]
    elif control.expect != "any":
        assert failures[0].startswith("EmuLaunchError") and control.expect in failures[0], failures[0]


def test_controls_apply_to_the_current_sources(tmp_path: Path) -> None:
    for name in CONTROLS:
        _, path = write_control(name, tmp_path)
        assert path.read_text() != (cuda_emu.KERNELS_DIR / CONTROLS[name].source).read_text()


# ------------------------------------------------------------------ ASan + UBSan
def _sanitized(*args: str) -> subprocess.CompletedProcess[str]:
    preload = cuda_emu.sanitizer_preload()
    if preload is None:
        pytest.skip(f"{CXX} has no AddressSanitizer runtime (libasan)")
    env = dict(os.environ, LD_PRELOAD=preload, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
               UBSAN_OPTIONS="print_stacktrace=1", PYTHONPATH=os.pathsep.join(
                   [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run([sys.executable, "-m", "cuda_emu.sanitized", *args], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=900)


def test_traces_clean_under_asan_and_ubsan() -> None:
    proc = _sanitized("--traces", "6")
    assert proc.returncode == 0 and "traces clean" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.parametrize("name,report", [("shared_layout_overflow", "AddressSanitizer: use-after-poison"),
                                         ("copy_width", "runtime error: store to misaligned address")])
def test_sanitizer_build_catches_control(name: str, report: str) -> None:
    proc = _sanitized("--control", name, "--traces", "20")
    assert proc.returncode != 0 and report in proc.stderr, proc.stdout[-3000:] + proc.stderr[-6000:]


# ------------------------------------------------------------------ the emulator's promises
@pytest.fixture(scope="module")
def selftest() -> EmuModule:
    return EmuModule(TESTS / "cuda_emu" / "selftest.cu")


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


@pytest.mark.parametrize("order", ORDER_NAMES)
@pytest.mark.parametrize("d,width", [(1, 32), (3, 32), (2, 8), (5, 16)])
def test_shuffles_follow_cuda_semantics(selftest: EmuModule, order: str, d: int, width: int) -> None:
    n = 64  # two warps
    out = torch.zeros(n * 4, dtype=torch.int32)
    selftest.launch("emu_shuffles", (1,), (n,), (_ptr(out), np.int32(d), np.int32(width)), order=order, seed=d)
    got = out.view(n, 4).tolist()
    for t in range(n):
        lane, base = t % 32, t - t % 32
        seg = lane - lane % width
        src = {"idx": seg + ((lane * 7) % 32) % width,
               "up": lane - d if lane - d >= seg else lane,
               "down": lane + d if lane + d < seg + width else lane,
               "xor": lane ^ d if (lane ^ d) < seg + width else lane}
        assert got[t] == [100 + base + src[k] for k in ("idx", "up", "down", "xor")], (t, got[t])


def test_votes_and_wide_shuffles(selftest: EmuModule) -> None:
    n = 40  # a full warp and a partial one of 8 lanes
    out = torch.zeros(n * 3, dtype=torch.int32)
    wide = torch.zeros(n, dtype=torch.int64)
    with pytest.raises(EmuLaunchError, match=r"mask 0xffffffff naming lanes 0xffffff00 that this block \(40"):
        selftest.launch("emu_votes", (1,), (n,), (_ptr(out), _ptr(wide), np.int32(3)))
    selftest.launch("emu_votes", (1,), (32,), (_ptr(out), _ptr(wide), np.int32(3)), order="random", seed=1)
    ballot = sum(1 << t for t in range(32) if t % 3 == 0)  # bit 31 clear: fits the int32 output
    assert out.view(-1, 3)[:32].tolist() == [[ballot, 1, 0]] * 32
    assert wide[:32].tolist() == [min(t + 1, 31) << 40 for t in range(32)]


def test_warp_lanes_must_agree(selftest: EmuModule) -> None:
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(EmuLaunchError, match="warp 0 disagrees: .* __shfl_down_sync"):
        selftest.launch("emu_shfl_disagree", (1,), (32,), (_ptr(out),))


def test_barrier_in_divergent_code_is_reported(selftest: EmuModule) -> None:
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(EmuLaunchError, match="a barrier in divergent code"):
        selftest.launch("emu_divergent_barrier", (1,), (64,), (_ptr(out),))


@pytest.mark.parametrize("order", ORDER_NAMES)
def test_partial_barrier_is_a_reported_deadlock(selftest: EmuModule, order: str) -> None:
    out = torch.zeros(256, dtype=torch.int32)
    with pytest.raises(EmuLaunchError, match=r"deadlock in block \(0,0,0\) of emu_partial_barrier: 255 of 256 "
                                             r"threads wait at __syncthreads .* 1 threads ended without reaching it "
                                             r"\[threads 17\]"):
        selftest.launch("emu_partial_barrier", (1,), (256,), (_ptr(out), np.int32(17)), order=order)


def test_warp_waiting_for_an_exited_lane_is_a_reported_deadlock(selftest: EmuModule) -> None:
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(EmuLaunchError, match=r"deadlock .* warp 0: lanes 0xffffffdf wait .* \[lane 5 ended\]"):
        selftest.launch("emu_warp_lane_exits", (1,), (32,), (_ptr(out),))


def test_dynamic_shared_memory_is_poisoned_and_exact(selftest: EmuModule) -> None:
    n = 100
    out = torch.zeros(2 * n, dtype=torch.uint8)
    selftest.launch("emu_shared_bytes", (2,), (64,), (_ptr(out), np.int32(n), np.int32(n - 1)), n)
    assert out.tolist() == [0xA5] * (2 * n)  # both blocks start poisoned (block 0 wrote byte n-1)
    with pytest.raises(EmuLaunchError, match=r"block \(0,0,0\) wrote byte 100 of dynamic shared memory, past the "
                                             r"100 bytes the launch asked for"):
        selftest.launch("emu_shared_bytes", (1,), (64,), (_ptr(out), np.int32(n), np.int32(n)), n)


def test_thread_order_differs_by_mode(selftest: EmuModule) -> None:
    n, blocks = 96, 2
    orders = {}
    for order in ORDER_NAMES:
        seq = torch.zeros(2 * n * blocks, dtype=torch.int32)
        counter = torch.zeros(1, dtype=torch.int32)
        total = torch.zeros(1, dtype=torch.int64)
        selftest.launch("emu_order", (blocks,), (n,), (_ptr(seq), _ptr(counter), _ptr(total)), order=order, seed=7)
        assert int(total) == sum(range(n * blocks))  # atomics add up whatever the interleaving
        orders[order] = seq.tolist()
    first = orders["in_order"][:n]
    assert first == list(range(n))  # block 0 first, threads in order
    assert orders["reversed"][:n] == list(range(2 * n - 1, n - 1, -1))  # last block first, threads reversed
    rnd = orders["random"]
    assert sorted(rnd[:2 * n]) == sorted(orders["in_order"][:2 * n]) or sorted(rnd[:2 * n]) == sorted(
        orders["reversed"][:2 * n])
    assert rnd[:n] not in (first, orders["reversed"][:n]) and rnd[n:2 * n] != rnd[:n]


def test_endless_kernel_thread_ends_the_process_not_a_hang() -> None:
    code = ("import sys, numpy as np, torch; sys.path.insert(0, %r); from cuda_emu import EmuModule; "
            "m = EmuModule(%r); out = torch.zeros(32, dtype=torch.int32); "
            "m.launch('emu_endless', (1,), (32,), (np.uint64(out.data_ptr()),))" % (str(TESTS),
                                                                                      str(TESTS / "cuda_emu" / "selftest.cu")))
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, TKV_EMU_TIMEOUT_S="2"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "the launch of emu_endless ran over 2 s" in proc.stderr, proc.stderr[-2000:]


def test_trap_fails_the_launch_naming_block_and_thread(selftest: EmuModule) -> None:
    out = torch.zeros(4 * 64, dtype=torch.int32)
    with pytest.raises(EmuLaunchError, match=r"__trap\(\) in block \(2,0,0\) thread \(33,0,0\) \(selftest.cu:\d+\)"):
        selftest.launch("emu_trap", (4,), (64,), (_ptr(out), np.int32(2), np.int32(33)), order="random", seed=5)


def test_syncthreads_reductions(selftest: EmuModule) -> None:
    out = torch.zeros(3, dtype=torch.int32)
    selftest.launch("emu_sync_reduce", (1,), (100,), (_ptr(out), np.int32(7)), order="random", seed=2)
    assert out.tolist() == [15, 0, 1]
    selftest.launch("emu_sync_reduce", (1,), (100,), (_ptr(out), np.int32(1)))
    assert out.tolist() == [100, 1, 1]


def test_grid_and_block_coordinates(selftest: EmuModule) -> None:
    grid, block = (3, 2, 2), (8, 4, 2)
    per = 8 * 4 * 2
    out = torch.zeros(12 * per, dtype=torch.int64)
    selftest.launch("emu_coordinates", grid, block, (_ptr(out),), order="random", seed=3)
    want = [(bz << 48) | (by << 40) | (bx << 32) | (tz << 20) | (ty << 10) | tx
            for bz in range(2) for by in range(2) for bx in range(3)
            for tz in range(2) for ty in range(4) for tx in range(8)]
    assert out.tolist() == want


def test_launch_limits_are_enforced(selftest: EmuModule) -> None:
    out = torch.zeros(2048, dtype=torch.int64)
    with pytest.raises(EmuLaunchError, match=r"more threads than its __launch_bounds__\(256\)"):
        selftest.launch("emu_coordinates", (1,), (512,), (_ptr(out),))
    with pytest.raises(EmuLaunchError, match="expected 1..1024 threads"):
        selftest.launch("emu_trap", (1,), (2048,), (_ptr(out), np.int32(0), np.int32(0)))
    with pytest.raises(EmuLaunchError, match="y and z in 1..65535"):
        selftest.launch("emu_trap", (1, 70000), (32,), (_ptr(out), np.int32(0), np.int32(0)))
    with pytest.raises(EmuLaunchError, match="more than a block may have"):
        selftest.launch("emu_shared_bytes", (1,), (32,), (_ptr(out), np.int32(0), np.int32(-1)), 300_000)


# ------------------------------------------------------------------ the launch contract
def test_arguments_are_checked_against_the_kernel_signature(selftest: EmuModule) -> None:
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(EmuLaunchError, match="takes 3 arguments, the launch passed 2"):
        selftest.launch("emu_trap", (1,), (32,), (_ptr(out), np.int32(0)))
    with pytest.raises(EmuLaunchError, match=r"argument 1 of emu_trap: the kernel takes int \(4 B\), the launch "
                                             r"passed a signed integer of 8 B"):
        selftest.launch("emu_trap", (1,), (32,), (_ptr(out), np.int64(0), np.int32(0)))
    with pytest.raises(EmuLaunchError, match=r"argument 0 of emu_trap: the kernel takes int\* \(8 B\), the launch "
                                             r"passed a signed integer"):
        selftest.launch("emu_trap", (1,), (32,), (np.int64(out.data_ptr()), np.int32(0), np.int32(0)))
    with pytest.raises(EmuLaunchError, match="expected a numpy scalar"):
        selftest.launch("emu_trap", (1,), (32,), (out, np.int32(0), np.int32(0)))


def _tables(S: int = 3, C: int = 2, N: int = 16, EB: int = 12, *, row_pad: int = 0, E: int = 4,
            max_blocks: int = 8) -> kernels.HiSparseTables:
    store = torch.randint(0, 256, ((S * C * N + 1) * (EB + row_pad),), dtype=torch.uint8)
    return kernels.HiSparseTables(
        buffer_rows=store.view(S * C * N + 1, EB + row_pad)[:, :EB],
        entry_of_slot=torch.full((S, C, N), -1), last_used=torch.full((S, C, N), -1),
        lru=torch.arange(N).repeat(S, C, 1), step=torch.zeros(S, C, dtype=torch.int64),
        host_block=torch.arange(S * max_blocks).view(S, max_blocks) % 5, counters=torch.zeros(2, dtype=torch.int64),
        entries_per_block=E)


def _host(C: int = 2, E: int = 4, EB: int = 12, blocks: int = 5) -> torch.Tensor:
    return torch.randint(0, 256, (blocks, C * E, EB), dtype=torch.uint8)


def test_tables_sharing_buffers_get_their_own_launch_arguments() -> None:
    """The stale-cache defect of issue 14: two tables sharing buffer, entry_of_slot,
    host_block and host but not lru/last_used/step/counters. Each swap-in must update
    its own tables (a cache keyed on the shared four wrote B's step into A's)."""
    a = _tables()
    b = kernels.HiSparseTables(buffer_rows=a.buffer_rows, entry_of_slot=a.entry_of_slot, host_block=a.host_block,
                               last_used=a.last_used.clone(), lru=a.lru.clone(), step=a.step.clone(),
                               counters=a.counters.clone(), entries_per_block=a.entries_per_block)
    host = _host()
    ids = torch.tensor([[0, 1, 2, 3]])
    slots, out = torch.tensor([1]), torch.empty(1, 4, dtype=torch.int64)
    with cuda_ops.launcher(EmuLauncher()):
        cuda_ops.hisparse_swap_in(a, slots, 0, ids, host, None, out)
        assert a.step[1, 0] == 1 and a.counters.tolist() == [0, 4]
        cuda_ops.hisparse_swap_in(b, slots, 0, ids, host, None, out)
    assert b.step[1, 0] == 1 and b.counters.tolist() == [4, 0]  # all hits: a already filled the shared buffer
    assert a.step[1, 0] == 1 and a.counters.tolist() == [0, 4]  # untouched by b's launch
    assert b.last_used[1, 0, :4].tolist() == [1] * 4 and a.last_used[1, 0, :4].tolist() == [1] * 4


def test_padded_buffer_rows_copy_the_entry_only() -> None:
    """Row stride and entry size are separate arguments: a padded row gets its entry's
    bytes and its padding is never written (issue 14: the kernel copied stride bytes)."""
    t = _tables(row_pad=5)
    store = t.buffer_rows.untyped_storage()
    before = torch.empty(0, dtype=torch.uint8).set_(store).clone()
    host = _host()
    ids = torch.tensor([[5, 6, -1, 7]])
    out = torch.empty(1, 4, dtype=torch.int64)
    with cuda_ops.launcher(EmuLauncher()):
        cuda_ops.hisparse_swap_in(t, torch.tensor([2]), 1, ids, host, None, out)
    after = torch.empty(0, dtype=torch.uint8).set_(store).view(-1, 17)
    assert torch.equal(after[:, 12:], before.view(-1, 17)[:, 12:])  # padding intact
    base = (2 * 2 + 1) * 16
    for j, e in enumerate([5, 6, 7]):
        slot = int(out[0, [0, 1, 3][j]])
        hb = int(t.host_block[2, e // 4])
        assert torch.equal(after[base + slot, :12], host[hb, 1 * 4 + e % 4])


@pytest.mark.parametrize("case", ["unmapped_block", "id_below_padding", "explicit_row_negative"])
def test_broken_ids_trap_naming_block_and_thread(case: str) -> None:
    """What the CPU refuses with a ValueError (and TIERED_KV_DEBUG=1 on a GPU), the kernel
    refuses with a trap that names where."""
    t = _tables()
    host = _host()
    ids = torch.tensor([[0, 1], [2, 3]])
    rows = None
    if case == "unmapped_block":
        t.host_block[2, 1] = -1
        ids = torch.tensor([[0, 1], [2, 5]])  # row 1 (State slot 2): entry 5 is in block 1
    elif case == "id_below_padding":
        ids = torch.tensor([[0, 1], [2, -5]])
    else:
        rows = torch.tensor([[0, 1], [2, -3]])
    with cuda_ops.launcher(EmuLauncher()), pytest.raises(EmuLaunchError, match=r"__trap\(\) in block \(1,0,0\) "
                                                                               r"thread \(\d+,0,0\)"):
        cuda_ops.hisparse_swap_in(t, torch.tensor([0, 2]), 0, ids, host, rows, torch.empty(2, 2, dtype=torch.int64))
    if case == "id_below_padding":  # the twin refuses it too (without reading ids back)
        with pytest.raises(IndexError):
            torch_ops.hisparse_swap_in(t, torch.tensor([0, 2]), 0, ids, host, None,
                                       torch.empty(2, 2, dtype=torch.int64))


def test_signature_view_matches_the_launcher() -> None:
    """The launcher's numpy types line up with the compiled signature, argument by argument."""
    mod = EmuModule(cuda_emu.KERNELS_DIR / "hisparse_swap_in.cu")
    sig = mod.signatures["tkv_hisparse_swap_in"]
    assert len(sig) == len(cuda_ops._HISPARSE_TYPES)
    for i, (param, dtype) in enumerate(zip(sig, cuda_ops._HISPARSE_TYPES)):
        assert param.size == np.dtype(dtype).itemsize, i
        assert (param.kind == "p") == (dtype is np.uint64), (i, param)
    glob = mod.signatures["tkv_hisparse_swap_in_global"]
    assert glob[:len(sig)] == sig and [p.kind for p in glob[len(sig):]] == ["p", "i"]
