"""Random multi-step traces of every CUDA kernel against its torch twin.

The same traces run in two places:

- CI, on the CPU: ``tests/test_cuda_emu.py`` executes the unmodified ``kernels/*.cu`` in the
  emulator of ``tests/cuda_emu`` (``cuda_ops.launcher(EmuLauncher(...))``), on CPU tensors;
- a GPU, when one is lent: ``bench/gpu_check.sh`` runs this file as a script, the real
  kernels launched by CuPy on CUDA tensors, host memory pinned.

Either way a step goes through ``cuda_ops``' own launch building (``cuda_ops.swap_in``,
``gather_blocks``, ``scatter_blocks``, ``hisparse_swap_in``) and through the torch twin
(``torch_ops``) on CPU copies of the same tensors; after every step everything the kernel
may write is compared, bytes and tables alike::

    python tests/cuda_emu/traces.py --device cuda            # the CI set on a GPU (needs CuPy)
    python tests/cuda_emu/traces.py --device cuda --set full
    python tests/cuda_emu/traces.py --device cpu --emulate   # the same script, kernels in the emulator

Only torch, numpy and tiered_kv are imported, so the file runs outside pytest.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from tiered_kv import kernels
from tiered_kv.kernels import cuda_ops, torch_ops

__all__ = ["COUNTS", "KERNELS", "Trace", "TraceMismatch", "make_traces", "run_trace"]

#: kernel family -> the .cu kernels its traces launch
KERNELS = {
    "hisparse": ("tkv_hisparse_swap_in", "tkv_hisparse_swap_in_global"),
    "swap_in": ("tkv_swap_in",),
    "gather_scatter": ("tkv_gather_blocks", "tkv_scatter_blocks"),
}
#: traces per family: the CI set (every commit) and the full set (make test-cuda-emu-full)
COUNTS = {
    "ci": {"hisparse": 150, "swap_in": 40, "gather_scatter": 40},
    "full": {"hisparse": 1500, "swap_in": 300, "gather_scatter": 300},
}
ENTRY_BYTES = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 24, 31, 64, 132, 584)  # every word-width class, Flash's 584
POISON = 0xA5


class TraceMismatch(AssertionError):
    """The kernel and its torch twin disagree after a step."""


@dataclass(frozen=True)
class Trace:
    """One trace: a kernel family, its index in the set and the parameters drawn for it."""

    family: str
    index: int
    seed: int
    params: dict[str, Any] = field(compare=False)

    def __str__(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.family}#{self.index} (seed {self.seed}: {shown})"


def make_traces(family: str, count: int, *, base_seed: int = 0) -> list[Trace]:
    """``count`` traces of ``family``, the same on every machine (seeded)."""
    draw = {"hisparse": _hisparse_params, "swap_in": _swap_in_params, "gather_scatter": _gather_scatter_params}[family]
    out = []
    for i in range(count):
        seed = base_seed * 1_000_003 + {"hisparse": 1, "swap_in": 2, "gather_scatter": 3}[family] * 100_000 + i
        out.append(Trace(family, i, seed, draw(random.Random(seed), i)))
    return out


def run_trace(trace: Trace, device: torch.device | str) -> int:
    """Run ``trace`` with the kernels on ``device`` against the twin on the CPU; returns the
    number of steps. Raises :class:`TraceMismatch` at the first difference."""
    device = torch.device(device)
    run = {"hisparse": _run_hisparse, "swap_in": _run_swap_in, "gather_scatter": _run_gather_scatter}[trace.family]
    return run(trace, device)


# ------------------------------------------------------------------ helpers
def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bytes(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _to(t: torch.Tensor, device: torch.device, *, host: bool = False) -> torch.Tensor:
    """A copy of CPU tensor ``t`` (a view of a flat storage) for the kernel side: same
    storage offset and strides, on ``device``, or in pinned memory for ``host`` memory on
    a GPU; on the CPU (the emulator) a plain copy."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    if device.type == "cpu":
        copy = flat.clone()
    elif host:
        copy = flat.pin_memory()
    else:
        copy = flat.to(device)
    return copy.as_strided(t.shape, t.stride(), t.storage_offset())


def _flat(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` (padding included), on the CPU."""
    storage = t.untyped_storage()
    out = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    return out.cpu()


def _same(trace: Trace, step: int, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got = got.cpu()
    if got.shape == want.shape and torch.equal(got, want):
        return
    if got.shape != want.shape:
        raise TraceMismatch(f"{trace}: step {step}: {what}: shape {list(got.shape)} != twin {list(want.shape)}")
    at = tuple((got != want).nonzero()[0].tolist())
    count = int((got != want).sum())
    raise TraceMismatch(f"{trace}: step {step}: {what} differs at {count} places, first {list(at)}: "
                        f"kernel {got[at].item()} != twin {want[at].item()}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _poisoned_scratch(nbytes: int, device: torch.device) -> torch.Tensor:
    # The global work areas start as poison, like shared memory in the emulator: a kernel
    # that reads a byte before writing it computes garbage and the comparison fails.
    return torch.full((nbytes,), POISON, dtype=torch.uint8, device=device)


# ------------------------------------------------------------------ batched HiSparse swap-in
#: the most bytes of buffer rows a trace allocates (twice: kernel and twin)
BUFFER_BUDGET = 24 << 20


def _hisparse_params(r: random.Random, index: int) -> dict[str, Any]:
    size = r.choices(["tiny", "small", "medium", "large"], weights=[3, 5, 4, 2])[0]
    if index % 25 == 24:
        size = "huge"  # N = 16,384 once in every 25 traces: the global work area's home ground
    N = {"tiny": r.randint(1, 8), "small": r.randint(9, 128), "medium": r.randint(129, 1024),
         "large": r.randint(1025, 4096), "huge": 16384}[size]
    if r.random() < 0.15:
        k = N if N <= 4096 or r.random() < 0.3 else r.randint(1, N)
    else:
        k = r.randint(1, min(N, 2048))
    C = r.randint(1, 3)
    E = r.choice([1, 2, 3, 8, 32])
    id_space = max(k, r.choice([k, N, 2 * N, 4 * N]))
    B = r.randint(1, 6 if size == "huge" else 16)
    S = B + r.randint(0, 3)
    entry_bytes = r.choice(ENTRY_BYTES)
    while (S * C * N + 1) * (entry_bytes + 9) > BUFFER_BUDGET:  # big N: fewer layers, then smaller entries
        if C > 1:
            C -= 1
        else:
            entry_bytes = ENTRY_BYTES[max(0, ENTRY_BYTES.index(entry_bytes) - 1)]
    return {
        "N": N, "k": k, "B": B, "S": S, "C": C, "E": E,
        "id_space": id_space, "host_blocks": r.randint(1, 48),
        "entry_bytes": entry_bytes, "row_pad": r.choice([0, 0, r.randint(1, 9)]),
        "host_pad": r.choice([0, 0, r.randint(1, 13)]), "host_block_pad": r.randint(0, 17),
        "offset": r.choice([0, 0, r.randint(1, 15)]), "explicit_rows": r.random() < 0.5,
        "dup": r.random() < 0.5, "pad": 0.0 if r.random() < 0.2 else round(r.uniform(0.05, 0.95), 2),
        "hot": round(r.uniform(0.0, 0.9), 2), "prefill": r.random() < 0.5, "steps": r.randint(3, 6),
        "global": hisparse_is_global(N, k) or r.random() < 0.25,
    }


def hisparse_is_global(n: int, k: int) -> bool:
    """Whether the launcher picks the global-memory work area for these sizes."""
    return cuda_ops.hisparse_shared_bytes(n, k) == 0


class _Tables:
    """One side's HiSparse tables (the kernel's on ``device``, the twin's on the CPU)."""

    def __init__(self, t: kernels.HiSparseTables, store: torch.Tensor) -> None:
        self.t, self.store = t, store  # store: the flat storage under buffer_rows


def _run_hisparse(trace: Trace, device: torch.device) -> int:
    p = trace.params
    N, k, B, S, C, E, EB = p["N"], p["k"], p["B"], p["S"], p["C"], p["E"], p["entry_bytes"]
    g = _generator(trace.seed)
    r = random.Random(trace.seed)
    max_blocks = -(-p["id_space"] // E)
    HB, rpb = p["host_blocks"], C * E
    # host [HB, rpb, EB]: rows padded by host_pad, blocks by host_block_pad, odd offsets
    row_stride = EB + p["host_pad"]
    block_stride = rpb * row_stride + p["host_block_pad"]
    host_store = _bytes(p["offset"] + HB * block_stride + 8, g)
    host = host_store[p["offset"]:].as_strided((HB, rpb, EB), (block_stride, row_stride, 1))
    # buffer rows [S*C*N + 1, EB] with row stride EB + row_pad, the last row the twin's sink
    R, RS = S * C * N + 1, EB + p["row_pad"]
    buf_store = _bytes(p["offset"] + R * RS + 8, g)
    rows = buf_store[p["offset"]:].as_strided((R, EB), (RS, 1))
    host_block = torch.randint(0, HB, (S, max_blocks), generator=g)
    mul, add_s, add_c = r.randrange(1, 1 << 30) * 2 + 1, r.randrange(1 << 20), r.randrange(1 << 20)

    def host_row(s: int | torch.Tensor, c: int, e: torch.Tensor, explicit: bool) -> torch.Tensor:
        """Flat host row of entries ``e`` of State slot(s) ``s``, CSA part ``c``."""
        if explicit:  # any fixed map id -> row, unrelated to the tables
            return (e * mul + torch.as_tensor(s) * add_s + c * add_c) % (HB * rpb)
        return host_block[s, e // E] * rpb + c * E + e % E

    eos = torch.full((S, C, N), -1, dtype=torch.int64)
    last = torch.full((S, C, N), -1, dtype=torch.int64)
    step = torch.zeros(S, C, dtype=torch.int64)
    if p["prefill"]:  # a lived-in state: resident entries whose buffer rows hold their bytes
        for s in range(S):
            for c in range(C):
                m0 = r.randint(0, min(N, p["id_space"]))
                slots = torch.randperm(N, generator=g)[:m0]
                ents = torch.randperm(p["id_space"], generator=g)[:m0]
                eos[s, c, slots] = ents
                step[s, c] = r.randint(1, 40)
                last[s, c, slots] = torch.randint(0, int(step[s, c]), (m0,), generator=g)
                src = host_row(s, c, ents, p["explicit_rows"])
                rows[(s * C + c) * N + slots] = host[src // rpb, src % rpb]
    lru = torch.sort(last, dim=2, stable=True).indices  # the stable argsort of last_used
    counters = torch.randint(0, 1000, (2,), dtype=torch.int64, generator=g)

    def tables(dev: torch.device) -> _Tables:
        store = buf_store.clone() if dev.type == "cpu" else _to(buf_store, dev)
        br = store[p["offset"]:].as_strided((R, EB), (RS, 1))
        t = kernels.HiSparseTables(buffer_rows=br, entry_of_slot=eos.to(dev, copy=True),
                                   last_used=last.to(dev, copy=True), lru=lru.to(dev, copy=True),
                                   step=step.to(dev, copy=True), host_block=host_block.to(dev, copy=True),
                                   counters=counters.to(dev, copy=True), entries_per_block=E)
        return _Tables(t, store)

    twin, kern = tables(torch.device("cpu")), tables(device)
    khost = _to(host, device, host=True) if device.type == "cuda" else host
    state = torch.randperm(S, generator=g)[:B]
    kstate = state.to(device)
    sink = slice(p["offset"] + (R - 1) * RS, p["offset"] + (R - 1) * RS + EB)
    patch = mock.patch.object(cuda_ops, "_scratch", _poisoned_scratch)
    force = mock.patch.object(cuda_ops, "_MAX_SHARED_BYTES", 0) if p["global"] else contextlib.nullcontext()
    with patch, force:
        for st in range(p["steps"]):
            c = r.randrange(C)
            ids = _hisparse_ids(twin.t.entry_of_slot[state, c], k, p, g)
            hr = host_row(state[:, None], c, ids.clamp(min=0), p["explicit_rows"]) if p["explicit_rows"] else None
            if hr is not None:
                hr = torch.where(ids >= 0, hr, -7)  # padded positions: junk the kernel must ignore
            want = torch.full((B, k), -99, dtype=torch.int64)
            torch_ops.hisparse_swap_in(twin.t, state, c, ids, host, hr, want)
            got = torch.full((B, k), -99, dtype=torch.int64, device=device)
            cuda_ops.hisparse_swap_in(kern.t, kstate, c, ids.to(device), khost,
                                      None if hr is None else hr.to(device), got)
            _sync(device)
            _same(trace, st, "slots", got, want)
            for name in ("entry_of_slot", "last_used", "lru", "step", "counters"):
                _same(trace, st, name, getattr(kern.t, name), getattr(twin.t, name))
            kbytes, tbytes = _flat(kern.store), _flat(twin.store)
            kbytes[sink] = tbytes[sink]  # the twin parks padded positions in its sink row
            _same(trace, st, "buffer bytes (padding included)", kbytes, tbytes)
    return p["steps"]


def _hisparse_ids(resident: torch.Tensor, k: int, p: dict[str, Any], g: torch.Generator) -> torch.Tensor:
    """[B, k] ids: resident entries (hits) with probability ``hot``, fresh ones otherwise,
    repeats removed unless ``dup``, then ``pad`` of the positions set to -1."""
    B, N = resident.shape
    fresh = torch.randint(0, p["id_space"], (B, k), generator=g)
    pick = resident.gather(1, torch.randint(0, N, (B, k), generator=g))
    hot = (torch.rand(B, k, generator=g) < p["hot"]) & (pick >= 0)
    ids = torch.where(hot, pick, fresh)
    if p["dup"]:  # make repeats likely: copy some positions from earlier ones
        src = torch.randint(0, k, (B, k), generator=g)
        src = torch.minimum(src, torch.arange(k))
        ids = torch.where(torch.rand(B, k, generator=g) < 0.2, ids.gather(1, src), ids)
    else:
        srt, perm = torch.sort(ids, dim=1, stable=True)
        rep = torch.zeros_like(srt, dtype=torch.bool)
        rep[:, 1:] = srt[:, 1:] == srt[:, :-1]
        ids = ids.scatter(1, perm, torch.where(rep, -1, srt))
    if p["pad"]:
        ids = torch.where(torch.rand(B, k, generator=g) < p["pad"], -1, ids)
    return ids


# ------------------------------------------------------------------ swap_in (the copy half)
def _swap_in_params(r: random.Random, index: int) -> dict[str, Any]:
    return {
        "entry_bytes": r.choice(ENTRY_BYTES), "three_d": r.random() < 0.5, "num_rows": r.randint(1, 600),
        "rows_per_block": r.randint(1, 40), "num_slots": r.randint(1, 400), "row_pad": r.choice([0, r.randint(1, 9)]),
        "host_pad": r.choice([0, r.randint(1, 13)]), "block_pad": r.randint(0, 17),
        "offset": r.choice([0, r.randint(1, 15)]), "steps": r.randint(3, 6), "host_on_device": r.random() < 0.3,
    }


def _run_swap_in(trace: Trace, device: torch.device) -> int:
    p = trace.params
    g = _generator(trace.seed)
    EB, off = p["entry_bytes"], p["offset"]
    HS = EB + p["host_pad"]
    if p["three_d"]:
        rpb = p["rows_per_block"]
        nb = -(-p["num_rows"] // rpb)
        bs = rpb * HS + p["block_pad"]
        store = _bytes(off + nb * bs + 8, g)
        host = store[off:].as_strided((nb, rpb, EB), (bs, HS, 1))
        num_rows = nb * rpb
    else:
        num_rows = p["num_rows"]
        store = _bytes(off + num_rows * HS + 8, g)
        host = store[off:].as_strided((num_rows, EB), (HS, 1))
    slots_n, BS = p["num_slots"], EB + p["row_pad"]
    buf_store = _bytes(off + slots_n * BS + 8, g)
    buffer = buf_store[off:].as_strided((slots_n, EB), (BS, 1))
    khost = _to(host, device, host=not p["host_on_device"]) if device.type == "cuda" else host
    kbuf = _to(buffer, device)
    for st in range(p["steps"]):
        m = int(torch.randint(0, min(slots_n, 300) + 1, (1,), generator=g))
        slots = torch.randperm(slots_n, generator=g)[:m]
        rows = torch.randint(0, num_rows, (m,), generator=g)
        torch_ops.swap_in(host, rows, buffer, slots)
        if m:  # as the public op: nothing is launched for no rows
            cuda_ops.swap_in(khost, rows.to(khost.device), kbuf, slots.to(device))
        _sync(device)
        _same(trace, st, f"buffer bytes after {m} rows", _flat(kbuf), _flat(buffer))
    return p["steps"]


# ------------------------------------------------------------------ gather / scatter of blocks
def _gather_scatter_params(r: random.Random, index: int) -> dict[str, Any]:
    parts = []
    for _ in range(r.randint(1, 3)):
        parts.append({"L": r.choice([0, 1, 1, 2, 3]), "E": r.randint(1, 4), "B": r.choice((1, 2, 3, 4, 8, 12, 17, 40)),
                      "storage": r.choice(["contiguous", "block_major", "padded", "offset"])})
    if all(part["L"] == 0 for part in parts):
        parts[0]["L"] = 1
    return {"parts": parts, "num_blocks": r.randint(1, 24), "steps": r.randint(3, 6),
            "record_pad": r.choice([0, r.randint(1, 9)]), "offset": r.choice([0, r.randint(1, 15)]),
            "records_on_host": r.random() < 0.5}


def _make_part(spec: dict[str, Any], num_blocks: int, g: torch.Generator) -> torch.Tensor:
    L, E, Bb = spec["L"], spec["E"], spec["B"]
    if spec["storage"] == "block_major":  # [num_blocks, L, E, B] storage, viewed [L, num_blocks, E, B]
        return _bytes(num_blocks * L * E * Bb, g).view(num_blocks, L, E, Bb).transpose(0, 1)
    if spec["storage"] == "padded":  # each entry padded by 3 bytes
        return _bytes(L * num_blocks * E * (Bb + 3), g).view(L, num_blocks, E, Bb + 3)[..., :Bb]
    if spec["storage"] == "offset":  # odd storage offset: byte-wide copies
        return _bytes(L * num_blocks * E * Bb + 1, g)[1:].view(L, num_blocks, E, Bb)
    return _bytes(L * num_blocks * E * Bb, g).view(L, num_blocks, E, Bb)


def _run_gather_scatter(trace: Trace, device: torch.device) -> int:
    p = trace.params
    g = _generator(trace.seed)
    nb = p["num_blocks"]
    parts = [_make_part(spec, nb, g) for spec in p["parts"]]
    kparts = [_to(part, device) for part in parts]
    R = sum(q.shape[0] * q.shape[2] * q.shape[3] for q in parts)
    for st in range(p["steps"]):
        gather = st % 2 == 0 or int(torch.randint(0, 2, (1,), generator=g)) == 0
        if gather:  # any ids, repeats allowed
            n = int(torch.randint(0, 17, (1,), generator=g))
            ids = torch.randint(0, nb, (n,), generator=g)
        else:  # unique ids
            n = int(torch.randint(0, nb + 1, (1,), generator=g))
            ids = torch.randperm(nb, generator=g)[:n]
        RS, off = R + p["record_pad"], p["offset"]
        rec_store = _bytes(off + n * RS + 8, g)
        records = rec_store[off:].as_strided((n, R), (RS, 1))
        on_host = p["records_on_host"] and device.type == "cuda"
        krecords = _to(records, device, host=on_host)
        if gather:
            torch_ops.gather_blocks(parts, ids, records)
            if n:
                cuda_ops.gather_blocks(kparts, ids.to(device), krecords)
            _sync(device)
            _same(trace, st, f"records of {n} gathered blocks (padding included)", _flat(krecords), _flat(records))
        else:
            torch_ops.scatter_blocks(records, ids, parts)
            if n:
                cuda_ops.scatter_blocks(krecords, ids.to(device), kparts)
            _sync(device)
            for i, (kp, tp) in enumerate(zip(kparts, parts)):
                _same(trace, st, f"part {i} after scattering {n} blocks (padding included)", _flat(kp), _flat(tp))
    return p["steps"]


# ------------------------------------------------------------------ script (GPU)
@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def run_set(families: list[str], which: str, device: torch.device,
            wrap: Callable[[Trace], contextlib.AbstractContextManager[Any]] = lambda t: _nothing(),
            out: Any = sys.stdout) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Every trace of the ``which`` set of ``families``; returns per-family figures and failures."""
    table: dict[str, dict[str, float]] = {}
    failures: list[str] = []
    for family in families:
        row = table[family] = {"traces": 0, "steps": 0, "failed": 0, "seconds": 0.0}
        t0 = time.perf_counter()
        for trace in make_traces(family, COUNTS[which][family]):
            try:
                with wrap(trace):
                    row["steps"] += run_trace(trace, device)
            except Exception as exc:  # report every failing trace, then fail the run
                row["failed"] += 1
                failures.append(f"{type(exc).__name__}: {exc}")
            row["traces"] += 1
        row["seconds"] = time.perf_counter() - t0
        print(f"  {family:<15} {row['traces']:>6} traces {row['steps']:>6} steps {row['failed']:>4} failed "
              f"{row['seconds']:>8.1f} s   kernels: {', '.join(KERNELS[family])}", file=out, flush=True)
    return table, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda: the real kernels (default); cpu: needs --emulate")
    ap.add_argument("--emulate", action="store_true", help="run the kernels in tests/cuda_emu's CPU emulator")
    ap.add_argument("--set", choices=sorted(COUNTS), default="ci", dest="which")
    ap.add_argument("--family", action="append", choices=sorted(KERNELS), help="only these (default: all)")
    ap.add_argument("--json", type=Path, help="write the per-family table here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    wrap: Callable[[Trace], contextlib.AbstractContextManager[Any]] = lambda t: _nothing()
    if args.emulate:
        if device.type != "cpu":
            ap.error("--emulate runs on the CPU: use --device cpu")
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the cuda_emu package
        from cuda_emu import ORDERS, EmuLauncher, compiler

        if compiler() is None:
            print("traces: no C++17 compiler for the emulator; nothing run")
            return 3
        orders = list(ORDERS)
        wrap = lambda t: cuda_ops.launcher(EmuLauncher(order=orders[t.index % 3], seed=t.seed))  # noqa: E731
        torch.set_num_threads(1)
    elif device.type == "cpu":
        ap.error("the kernels need a GPU, or --emulate")
    elif not torch.cuda.is_available():
        print("traces: no CUDA device; nothing run")
        return 3
    elif not cuda_ops.cupy_available():
        print("traces: cupy is not importable, so the CUDA kernels cannot run; nothing run")
        return 3
    where = "the CPU emulator" if args.emulate else f"{torch.cuda.get_device_name(device)} (CuPy)"
    print(f"traces: the {args.which} set, kernels on {where} launched by cuda_ops, twins (torch_ops) on the CPU")
    table, failures = run_set(args.family or list(KERNELS), args.which, device, wrap)
    for f in failures[:20]:
        print("FAILED", f)
    total = sum(int(r["traces"]) for r in table.values())
    print(f"traces: {total} traces, {len(failures)} failed")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"set": args.which, "kernels_on": where, "families": table,
                                         "failures": failures[:50]}, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
