"""Block movers against a naive per-element reference (exact bytes), plus error cases.

The torch implementation runs everywhere; the CUDA one is compared with its torch twin
on a GPU (``gpu`` marker). The CUDA launchers' address arithmetic (the segment table)
is also checked here on CPU by emulating the kernel byte for byte through ``ctypes``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tiered_kv import kernels
from tiered_kv.device import cuda_available
from tiered_kv.kernels import cuda_ops, torch_ops

NUM_BLOCKS = 6

#: Part shapes [L, E, B] (num_blocks is shared); V4-like has CSA / indexer / HCA parts.
PART_SPECS = {
    "v4_like": [(3, 4, 9), (3, 4, 5), (2, 1, 9)],
    "zero_layer_part": [(2, 4, 8), (0, 4, 8), (1, 1, 16)],
    "one_byte": [(1, 1, 1)],
    "wide_aligned": [(2, 2, 32), (1, 3, 16)],
}

#: How each part is stored: contiguous, or a non-contiguous view of a bigger tensor.
STORAGES = ["contiguous", "padded_bytes", "strided_blocks", "block_major", "entry_major"]

ID_CASES = {
    "empty": [],
    "one": [4],
    "all_sorted": list(range(NUM_BLOCKS)),
    "unsorted": [5, 0, 3, 2],
}
GATHER_ONLY_ID_CASES = {"duplicates": [5, 0, 5, 2, 2, 1, 3]}


def make_part(shape: tuple[int, int, int], storage: str, seed: int) -> torch.Tensor:
    """A random ``[L, NUM_BLOCKS, E, B]`` uint8 part stored as ``storage`` says."""
    L, E, B = shape
    g = torch.Generator().manual_seed(seed)

    def rnd(*size: int) -> torch.Tensor:
        return torch.randint(0, 256, size, dtype=torch.uint8, generator=g)

    if storage == "contiguous":
        part = rnd(L, NUM_BLOCKS, E, B)
    elif storage == "padded_bytes":  # rows of B bytes inside rows of B + 7
        part = rnd(L, NUM_BLOCKS, E, B + 7)[..., 3:3 + B]
    elif storage == "strided_blocks":  # every other block of a pool twice the size
        part = rnd(L, 2 * NUM_BLOCKS, E, B)[:, ::2]
    elif storage == "block_major":  # stored [num_blocks, L, E, B], viewed [L, num_blocks, ...]
        part = rnd(NUM_BLOCKS, L, E, B).permute(1, 0, 2, 3)
    elif storage == "entry_major":  # stored [L, E, num_blocks, B]
        part = rnd(L, E, NUM_BLOCKS, B).permute(0, 2, 1, 3)
    else:
        raise AssertionError(storage)
    assert part.shape == (L, NUM_BLOCKS, E, B)
    return part


def make_parts(spec: str, storage: str, seed: int = 0) -> list[torch.Tensor]:
    return [make_part(s, storage, seed + i) for i, s in enumerate(PART_SPECS[spec])]


# ------------------------------------------------------------------ naive reference
def ref_record_bytes(parts: list[np.ndarray]) -> int:
    return sum(p.shape[0] * p.shape[2] * p.shape[3] for p in parts)


def ref_gather(parts: list[np.ndarray], ids: list[int]) -> np.ndarray:
    """The layout contract, one byte at a time."""
    out = np.zeros((len(ids), ref_record_bytes(parts)), dtype=np.uint8)
    for i, b in enumerate(ids):
        offset = 0
        for p in parts:
            L, _, E, B = p.shape
            for layer in range(L):
                for e in range(E):
                    for k in range(B):
                        out[i, offset + (layer * E + e) * B + k] = p[layer, b, e, k]
            offset += L * E * B
    return out


def ref_scatter(records: np.ndarray, ids: list[int], parts: list[np.ndarray]) -> None:
    for i, b in enumerate(ids):
        offset = 0
        for p in parts:
            L, _, E, B = p.shape
            for layer in range(L):
                for e in range(E):
                    for k in range(B):
                        p[layer, b, e, k] = records[i, offset + (layer * E + e) * B + k]
            offset += L * E * B


def ref_swap_in(host: np.ndarray, rows: list[int], buffer: np.ndarray, slots: list[int]) -> None:
    for r, s in zip(rows, slots):
        for k in range(host.shape[1]):
            buffer[s, k] = host[r, k]


def ids_tensor(ids: list[int], noncontig: bool = False) -> torch.Tensor:
    if not noncontig:
        return torch.tensor(ids, dtype=torch.int64)
    wide = torch.full((2 * len(ids),), -1, dtype=torch.int64)
    wide[::2] = torch.tensor(ids, dtype=torch.int64)
    return wide[::2]


def records_out(n: int, nbytes: int, noncontig: bool) -> torch.Tensor:
    if not noncontig:
        return torch.full((n, nbytes), 0xAB, dtype=torch.uint8)
    return torch.full((n, nbytes + 5), 0xAB, dtype=torch.uint8)[:, 2:2 + nbytes]


# ------------------------------------------------------------------------- gather
@pytest.mark.parametrize("noncontig_io", [False, True], ids=["contig_io", "noncontig_io"])
@pytest.mark.parametrize("ids_name", [*ID_CASES, *GATHER_ONLY_ID_CASES])
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("spec", PART_SPECS)
def test_gather_matches_reference(spec: str, storage: str, ids_name: str, noncontig_io: bool) -> None:
    parts = make_parts(spec, storage)
    ids = {**ID_CASES, **GATHER_ONLY_ID_CASES}[ids_name]
    nbytes = kernels.record_bytes(parts)
    out = records_out(len(ids), nbytes, noncontig_io)

    result = kernels.gather_blocks(parts, ids_tensor(ids, noncontig_io), out, impl="torch")

    assert result is out
    expected = ref_gather([p.numpy() for p in parts], ids)
    np.testing.assert_array_equal(out.numpy(), expected)


def test_record_bytes_flash_fp8() -> None:
    parts = [torch.empty(21, 2, 32, 584, dtype=torch.uint8), torch.empty(21, 2, 32, 132, dtype=torch.uint8),
             torch.empty(20, 2, 1, 584, dtype=torch.uint8)]
    assert kernels.record_bytes(parts) == 492_832


# ------------------------------------------------------------------------ scatter
@pytest.mark.parametrize("noncontig_io", [False, True], ids=["contig_io", "noncontig_io"])
@pytest.mark.parametrize("ids_name", ID_CASES)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("spec", PART_SPECS)
def test_scatter_matches_reference(spec: str, storage: str, ids_name: str, noncontig_io: bool) -> None:
    parts = make_parts(spec, storage, seed=10)
    ids = ID_CASES[ids_name]
    nbytes = kernels.record_bytes(parts)
    g = torch.Generator().manual_seed(1)
    records = records_out(len(ids), nbytes, noncontig_io)
    records.copy_(torch.randint(0, 256, records.shape, dtype=torch.uint8, generator=g))
    expected = [p.numpy().copy() for p in parts]
    ref_scatter(records.numpy(), ids, expected)

    kernels.scatter_blocks(records, ids_tensor(ids, noncontig_io), parts, impl="torch")

    for got, want in zip(parts, expected):
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("spec", PART_SPECS)
def test_round_trip_scatter_gather(spec: str, storage: str) -> None:
    parts = make_parts(spec, storage, seed=20)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))
    records = torch.empty(NUM_BLOCKS, kernels.record_bytes(parts), dtype=torch.uint8)
    kernels.gather_blocks(parts, ids, records)
    restored = [torch.zeros_like(p) for p in parts]

    kernels.scatter_blocks(records, ids, restored)

    for got, want in zip(restored, parts):
        assert torch.equal(got, want)


def test_round_trip_subset_leaves_other_blocks() -> None:
    parts = make_parts("v4_like", "contiguous", seed=30)
    ids = torch.tensor([4, 1])
    records = kernels.gather_blocks(parts, ids, torch.empty(2, kernels.record_bytes(parts), dtype=torch.uint8))
    target = [torch.zeros_like(p) for p in parts]
    kernels.scatter_blocks(records, ids, target)
    for got, want in zip(target, parts):
        assert torch.equal(got[:, [4, 1]], want[:, [4, 1]])
        assert not got[:, [0, 2, 3, 5]].any()


# ------------------------------------------------------------------------ swap-in
@pytest.mark.parametrize("entry_bytes", [1, 9, 584])
@pytest.mark.parametrize("noncontig", [False, True], ids=["contig", "noncontig"])
@pytest.mark.parametrize("m", [0, 1, 7])
def test_swap_in_matches_reference(entry_bytes: int, noncontig: bool, m: int) -> None:
    g = torch.Generator().manual_seed(entry_bytes + m)
    num_rows, num_slots = 11, 9
    if noncontig:
        host = torch.randint(0, 256, (num_rows, entry_bytes + 3), dtype=torch.uint8, generator=g)[:, 1:1 + entry_bytes]
        buffer = torch.zeros(num_slots * 2, entry_bytes, dtype=torch.uint8)[::2]
    else:
        host = torch.randint(0, 256, (num_rows, entry_bytes), dtype=torch.uint8, generator=g)
        buffer = torch.zeros(num_slots, entry_bytes, dtype=torch.uint8)
    rows = torch.randint(0, num_rows, (m,), generator=g).tolist()  # repeats allowed
    slots = torch.randperm(num_slots, generator=g)[:m].tolist()
    expected = buffer.numpy().copy()
    ref_swap_in(host.numpy(), rows, expected, slots)

    kernels.swap_in(host, ids_tensor(rows, noncontig), buffer, ids_tensor(slots, noncontig), impl="torch")

    np.testing.assert_array_equal(buffer.numpy(), expected)


# ------------------------------------------------------------------------- errors
def _parts() -> list[torch.Tensor]:
    return make_parts("v4_like", "contiguous")


def _out(n: int, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
    return torch.empty(n, kernels.record_bytes(parts or _parts()), dtype=torch.uint8)


ERROR_CASES = {
    "parts_empty": (lambda: kernels.record_bytes([]), "parts: expected at least one part"),
    "part_dtype": (
        lambda: kernels.record_bytes([_parts()[0], _parts()[1].to(torch.int8)]),
        r"parts\[1\]: expected dtype torch.uint8",
    ),
    "part_ndim": (lambda: kernels.record_bytes([torch.empty(2, 3, 4, dtype=torch.uint8)]), r"parts\[0\]: expected 4-D"),
    "part_num_blocks": (
        lambda: kernels.record_bytes([torch.empty(1, 6, 2, 2, dtype=torch.uint8), torch.empty(1, 5, 2, 2, dtype=torch.uint8)]),
        r"parts\[1\]: expected num_blocks 6",
    ),
    "part_device": (
        lambda: kernels.record_bytes([torch.empty(1, 6, 2, 2, dtype=torch.uint8),
                                      torch.empty(1, 6, 2, 2, dtype=torch.uint8, device="meta")]),
        r"parts\[1\]: expected device cpu",
    ),
    "out_dtype": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0]), _out(1).to(torch.float32)),
        "out: expected dtype torch.uint8",
    ),
    "out_record_bytes": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0]), torch.empty(1, 7, dtype=torch.uint8)),
        r"out: expected shape \[n=1, record_bytes=\d+\], got \[1, 7\] \(record_bytes mismatch\)",
    ),
    "out_rows": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0, 1]), _out(3)),
        r"out: expected shape \[n=2",
    ),
    "out_device": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0]), _out(1).to("meta")),
        "out: expected a tensor on cpu",
    ),
    "ids_dtype": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0], dtype=torch.int32), _out(1)),
        "block_ids: expected dtype torch.int64",
    ),
    "ids_ndim": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([[0]]), _out(1)),
        r"block_ids: expected 1-D \[n\]",
    ),
    "ids_device": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0], device="meta"), _out(1)),
        "block_ids: expected a tensor on cpu",
    ),
    "ids_too_big": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0, NUM_BLOCKS]), _out(2)),
        rf"block_ids: expected ids in \[0, {NUM_BLOCKS}\) \(num_blocks of the parts\), got {NUM_BLOCKS}",
    ),
    "ids_negative": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([-1]), _out(1)),
        r"block_ids: expected ids in \[0, 6\) .*got -1",
    ),
    "impl_unknown": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0]), _out(1), impl="triton"),
        "impl: expected one of 'auto', 'torch', 'cuda', got 'triton'",
    ),
    "impl_cuda_on_cpu": (
        lambda: kernels.gather_blocks(_parts(), torch.tensor([0]), _out(1), impl="cuda"),
        r"impl='cuda': not runnable here: parts\[0\] is on cpu",
    ),
    "scatter_duplicates": (
        lambda: kernels.scatter_blocks(_out(2), torch.tensor([3, 3]), _parts()),
        r"block_ids: expected unique ids \(each block is written by one record\)",
    ),
    "scatter_records_shape": (
        lambda: kernels.scatter_blocks(torch.empty(2, 3, dtype=torch.uint8), torch.tensor([0, 1]), _parts()),
        r"records: expected shape \[n=2, record_bytes=\d+\], got \[2, 3\] \(record_bytes mismatch\)",
    ),
    "scatter_records_dtype": (
        lambda: kernels.scatter_blocks(_out(1).to(torch.int16), torch.tensor([0]), _parts()),
        "records: expected dtype torch.uint8",
    ),
    "scatter_ids_range": (
        lambda: kernels.scatter_blocks(_out(1), torch.tensor([99]), _parts()),
        r"block_ids: expected ids in \[0, 6\)",
    ),
    "scatter_impl_cuda_on_cpu_empty": (
        lambda: kernels.scatter_blocks(_out(0), torch.tensor([], dtype=torch.int64), _parts(), impl="cuda"),
        "impl='cuda': not runnable here",
    ),
    "swap_entry_bytes": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8), torch.tensor([0]),
                                torch.empty(2, 9, dtype=torch.uint8), torch.tensor([0])),
        "host: expected entry_bytes 9 like buffer, got shape",
    ),
    "swap_count": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8), torch.tensor([0, 1]),
                                torch.empty(2, 8, dtype=torch.uint8), torch.tensor([0])),
        r"slots: expected as many ids as host_rows \(2\), got 1",
    ),
    "swap_rows_range": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8), torch.tensor([4]),
                                torch.empty(2, 8, dtype=torch.uint8), torch.tensor([0])),
        r"host_rows: expected ids in \[0, 4\) \(rows of host\), got 4",
    ),
    "swap_slots_range": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8), torch.tensor([0]),
                                torch.empty(2, 8, dtype=torch.uint8), torch.tensor([2])),
        r"slots: expected ids in \[0, 2\) \(slots of buffer\), got 2",
    ),
    "swap_slots_unique": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8), torch.tensor([0, 1]),
                                torch.empty(2, 8, dtype=torch.uint8), torch.tensor([1, 1])),
        r"slots: expected unique ids",
    ),
    "swap_host_dtype": (
        lambda: kernels.swap_in(torch.empty(4, 2, dtype=torch.float32), torch.tensor([0]),
                                torch.empty(2, 8, dtype=torch.uint8), torch.tensor([0])),
        "host: expected dtype torch.uint8",
    ),
    "swap_buffer_ndim": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8), torch.tensor([0]),
                                torch.empty(2, 8, 1, dtype=torch.uint8), torch.tensor([0])),
        r"buffer: expected 2-D \[num_slots, entry_bytes\]",
    ),
    "swap_host_device": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8, device="meta"), torch.tensor([0]),
                                torch.empty(2, 8, dtype=torch.uint8), torch.tensor([0])),
        r"host: expected a tensor on cpu or cpu \(the buffer's device\), got meta",
    ),
    "swap_impl_cuda_on_cpu": (
        lambda: kernels.swap_in(torch.empty(4, 8, dtype=torch.uint8), torch.tensor([0]),
                                torch.empty(2, 8, dtype=torch.uint8), torch.tensor([0]), impl="cuda"),
        "impl='cuda': not runnable here: buffer is on cpu",
    ),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_input_raises_value_error(case: str) -> None:
    call, message = ERROR_CASES[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_non_tensor_raises_type_error() -> None:
    with pytest.raises(TypeError, match="block_ids: expected a torch.Tensor"):
        kernels.gather_blocks(_parts(), [0, 1], _out(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="parts: expected a sequence of tensors"):
        kernels.record_bytes(torch.empty(1, 1, 1, 1, dtype=torch.uint8))  # type: ignore[arg-type]


def test_check_ids_false_skips_host_checks() -> None:
    parts = _parts()
    ids = torch.tensor([2, 2])
    records = kernels.gather_blocks(parts, torch.tensor([1, 1]), _out(2))
    kernels.scatter_blocks(records, ids, parts, check_ids=False)  # equal records: well defined
    assert torch.equal(parts[0][:, 2], parts[0][:, 1])


# ------------------------------------------------- CUDA launcher arithmetic (CPU)
def emulate_block_kernel(rows: list[tuple[int, int, int, int]], ids: list[int], records: torch.Tensor,
                         to_records: bool) -> None:
    """What ``tkv_gather_blocks`` / ``tkv_scatter_blocks`` do, on CPU memory via ctypes."""
    for i, b in enumerate(ids):
        rec = records.data_ptr() + i * records.stride(0)
        for base, block_stride, run_bytes, record_offset in rows:
            pool = base + b * block_stride
            src, dst = (pool, rec + record_offset) if to_records else (rec + record_offset, pool)
            ctypes.memmove(dst, src, run_bytes)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("spec", PART_SPECS)
def test_segment_table_addresses_the_layout(spec: str, storage: str) -> None:
    parts = make_parts(spec, storage, seed=40)
    ids = [5, 0, 5, 3]
    nbytes = kernels.record_bytes(parts)
    out = records_out(len(ids), nbytes, noncontig=True)
    rows = cuda_ops.segment_table(parts)

    emulate_block_kernel(rows, ids, out, to_records=True)

    np.testing.assert_array_equal(out.numpy(), ref_gather([p.numpy() for p in parts], ids))
    restored = [torch.zeros_like(p) for p in parts]
    emulate_block_kernel(cuda_ops.segment_table(restored), [5, 0, 3], out[[0, 1, 3]], to_records=False)
    for got, want in zip(restored, parts):
        assert torch.equal(got[:, [5, 0, 3]], want[:, [5, 0, 3]])


def test_segment_table_merges_contiguous_runs() -> None:
    flash = [torch.empty(21, 4, 32, 584, dtype=torch.uint8), torch.empty(21, 4, 32, 132, dtype=torch.uint8),
             torch.empty(20, 4, 1, 584, dtype=torch.uint8), torch.empty(0, 4, 32, 584, dtype=torch.uint8)]
    rows = cuda_ops.segment_table(flash)
    assert len(rows) == 21 + 21 + 20  # one run per layer, none for the empty part
    assert [r[2] for r in rows[:1] + rows[21:22] + rows[42:43]] == [32 * 584, 32 * 132, 584]
    assert rows[-1][3] + rows[-1][2] == 492_832
    block_major = torch.empty(4, 3, 2, 8, dtype=torch.uint8).permute(1, 0, 2, 3)
    assert len(cuda_ops.segment_table([block_major])) == 1


def test_auto_on_cpu_never_imports_cupy() -> None:
    # CPU tensors are rejected for CUDA before cupy is looked at.
    reason = cuda_ops.unsupported_reason(parts=_parts(), records=_out(1))
    assert reason is not None and "cpu" in reason


# ----------------------------------------------------------------- GPU: CUDA vs torch
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")


def _require_cupy() -> None:
    if not cuda_ops.cupy_available():
        pytest.skip("cupy is not installed; the CUDA implementation cannot run")


@gpu
@needs_cuda
@pytest.mark.parametrize("ids_name", [*ID_CASES, *GATHER_ONLY_ID_CASES])
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("spec", PART_SPECS)
def test_cuda_gather_matches_torch(spec: str, storage: str, ids_name: str) -> None:
    _require_cupy()
    parts = [make_part_on_cuda(p) for p in make_parts(spec, storage)]
    ids = ids_tensor({**ID_CASES, **GATHER_ONLY_ID_CASES}[ids_name])
    nbytes = kernels.record_bytes(parts)
    want = kernels.gather_blocks(parts, ids, torch.zeros(len(ids), nbytes, dtype=torch.uint8, device="cuda"), impl="torch")
    got = kernels.gather_blocks(parts, ids, torch.zeros(len(ids), nbytes, dtype=torch.uint8, device="cuda"), impl="cuda")
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    pinned = torch.zeros(len(ids), nbytes, dtype=torch.uint8, pin_memory=True)
    kernels.gather_blocks(parts, ids, pinned, impl="cuda")
    torch.cuda.synchronize()
    assert torch.equal(pinned, want.cpu())


def make_part_on_cuda(cpu_view: torch.Tensor) -> torch.Tensor:
    """The same non-contiguous view, of a CUDA copy of the underlying storage."""
    base = torch.empty(0, dtype=torch.uint8)
    base.set_(cpu_view.untyped_storage())
    dev = base.cuda()
    return dev.as_strided(cpu_view.shape, cpu_view.stride(), cpu_view.storage_offset())


@gpu
@needs_cuda
@pytest.mark.parametrize("ids_name", ID_CASES)
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("spec", PART_SPECS)
def test_cuda_scatter_matches_torch(spec: str, storage: str, ids_name: str) -> None:
    _require_cupy()
    ids = ids_tensor(ID_CASES[ids_name])
    want_parts = [make_part_on_cuda(p) for p in make_parts(spec, storage, seed=50)]
    got_parts = [make_part_on_cuda(p) for p in make_parts(spec, storage, seed=50)]
    g = torch.Generator().manual_seed(2)
    records = torch.randint(0, 256, (len(ids), kernels.record_bytes(want_parts)), dtype=torch.uint8, generator=g)
    kernels.scatter_blocks(records.cuda(), ids, want_parts, impl="torch")
    kernels.scatter_blocks(records.pin_memory(), ids, got_parts, impl="cuda")
    torch.cuda.synchronize()
    for got, want in zip(got_parts, want_parts):
        assert torch.equal(got, want)



@pytest.mark.parametrize("entry_bytes", [9, 584])
def test_swap_in_from_strided_3d_host_view(entry_bytes: int) -> None:
    """The CSA part of block-contiguous records: ``records[:, :R*E].view(B, R, E)``."""
    g = torch.Generator().manual_seed(entry_bytes)
    num_blocks, rows_per_block, extra = 5, 4, 13  # each record has 13 more bytes after the rows
    records = torch.randint(0, 256, (num_blocks, rows_per_block * entry_bytes + extra), dtype=torch.uint8,
                            generator=g)
    host = records[:, :rows_per_block * entry_bytes].view(num_blocks, rows_per_block, entry_bytes)
    rows = [0, 7, 19, 7, 12]
    slots = [4, 0, 2, 1, 3]
    buffer = torch.zeros(6, entry_bytes, dtype=torch.uint8)
    kernels.swap_in(host, torch.tensor(rows), buffer, torch.tensor(slots), impl="torch")
    for r, s in zip(rows, slots):
        assert torch.equal(buffer[s], host[r // rows_per_block, r % rows_per_block])
    with pytest.raises(ValueError, match=r"expected ids in \[0, 20\)"):
        kernels.swap_in(host, torch.tensor([20]), buffer, torch.tensor([0]), impl="torch")

@gpu
@needs_cuda
@pytest.mark.parametrize("entry_bytes", [1, 9, 584, 1024])
@pytest.mark.parametrize("m", [0, 1, 100, 2048])
def test_cuda_swap_in_matches_torch(entry_bytes: int, m: int) -> None:
    _require_cupy()
    g = torch.Generator().manual_seed(m)
    num_rows, num_slots = 4096, 2048
    host = torch.randint(0, 256, (num_rows, entry_bytes), dtype=torch.uint8, generator=g).pin_memory()
    rows = torch.randint(0, num_rows, (m,), generator=g)
    slots = torch.randperm(num_slots, generator=g)[:m]
    want = torch.zeros(num_slots, entry_bytes, dtype=torch.uint8, device="cuda")
    got = torch.zeros_like(want)
    kernels.swap_in(host, rows, want, slots, impl="torch")
    kernels.swap_in(host, rows.cuda(), got, slots.cuda(), impl="cuda")
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    # a host mirror sliced from a wider pinned tensor (rows not 16-byte aligned)
    wide = torch.randint(0, 256, (num_rows, entry_bytes + 3), dtype=torch.uint8, generator=g).pin_memory()
    kernels.swap_in(wide[:, 1:1 + entry_bytes], rows, want, slots, impl="torch")
    kernels.swap_in(wide[:, 1:1 + entry_bytes], rows, got, slots, impl="cuda")
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    # a strided 3-D view: 16 rows per block inside records with a 13-byte tail
    recs = torch.randint(0, 256, (num_rows // 16, 16 * entry_bytes + 13), dtype=torch.uint8, generator=g).pin_memory()
    view = recs[:, :16 * entry_bytes].view(num_rows // 16, 16, entry_bytes)
    kernels.swap_in(view, rows, want, slots, impl="torch")
    kernels.swap_in(view, rows.cuda(), got, slots.cuda(), impl="cuda")
    torch.cuda.synchronize()
    assert torch.equal(got, want)


@gpu
@needs_cuda
def test_auto_picks_cuda_for_cuda_tensors() -> None:
    _require_cupy()
    parts = [p.cuda() for p in _parts()]
    assert cuda_ops.unsupported_reason(parts=parts, records=_out(1).cuda()) is None
    assert "unpinned" in (cuda_ops.unsupported_reason(host=torch.empty(2, 2, dtype=torch.uint8),
                                                      buffer=torch.empty(2, 2, dtype=torch.uint8, device="cuda")) or "")


def test_torch_ops_is_what_auto_runs_on_cpu() -> None:
    parts = _parts()
    ids = torch.tensor([1, 4])
    a, b = _out(2), _out(2)
    kernels.gather_blocks(parts, ids, a)  # auto
    torch_ops.gather_blocks(parts, ids, b)
    assert torch.equal(a, b)
