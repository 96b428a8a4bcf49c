"""Positive controls: broken copies of the kernels that the emulator harness must FAIL.

Each control is a text patch applied to a copy of a ``kernels/*.cu`` source at test time
(the patch must apply exactly once, or the control itself is broken). Launching the copy
through the very same ``cuda_ops`` launchers must then fail: a trace whose kernel result
differs from the torch twin, or a launch the emulator stops (a deadlock, a warp that
disagrees, a write past the dynamic shared memory, a sanitizer report).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import KERNELS_DIR

__all__ = ["CONTROLS", "Control", "write_control"]


@dataclass(frozen=True)
class Control:
    source: str  # the kernels/ file patched
    old: str  # text that must occur exactly once
    new: str
    family: str  # the trace family that exercises it
    expect: str  # what catches it: "mismatch" (trace vs twin), a phrase of the emulator's error, or "any"
    why: str


CONTROLS: dict[str, Control] = {
    # hash inserts and lookups race: a thread looks its entries up before others inserted theirs
    "removed_barrier": Control(
        "hisparse_swap_in.cu", "        hof[i] = at;\n    }\n    __syncthreads();\n", "        hof[i] = at;\n    }\n",
        "hisparse", "mismatch", "the barrier between hashing the ids and looking residents up, removed"),
    # the owner of a repeated id becomes whichever of its positions wrote last: with threads
    # in order that is its LAST position, and its miss takes a victim out of order (reversed
    # thread order hides it: the thread order variation is what finds it)
    "changed_atomic": Control(
        "hisparse_swap_in.cu", "atomicMin(&hpos[at], i);", "atomicExch(&hpos[at], i);",
        "hisparse", "mismatch", "atomicMin -> atomicExch on the first position of each id"),
    # flag[0] aliases lru[n - 1]: the LRU order is corrupted
    "shared_layout_overlap": Control(
        "hisparse_swap_in.cu", "int* flag = lru + n;", "int* flag = lru + n - 1;",
        "hisparse", "mismatch", "off-by-one in the work-area layout: two arrays overlap by one element"),
    # wsum ends 4 bytes past the work area: caught by the exact-size dynamic shared memory
    "shared_layout_overflow": Control(
        "hisparse_swap_in.cu", "int* wsum = mlist + kk;", "int* wsum = mlist + kk + 1;",
        "hisparse", "past the", "off-by-one in the work-area layout: the last array ends past the launch's size"),
    # the block scan's warp-0 shuffle names half the warp while all 32 lanes call it
    "warp_mask": Control(
        "hisparse_swap_in.cu", "const int v = __shfl_up_sync(0xffffffffu, w, d);",
        "const int v = __shfl_up_sync(0x0000ffffu, w, d);",
        "hisparse", "leaves it out", "a shuffle mask that leaves out lanes which call it"),
    # a barrier only part of the block reaches
    "partial_barrier": Control(
        "hisparse_swap_in.cu", "    __syncthreads();\n    // 1. hash the ids\n",
        "    if (t == 7) return;\n    __syncthreads();\n    // 1. hash the ids\n",
        "hisparse", "deadlock", "one thread returns before a __syncthreads: a deadlock on a GPU"),
    # 16-byte words where only 8-byte alignment holds: the last 8 bytes of a run are dropped,
    # or the misaligned 16-byte access faults (as on a GPU); the sanitizer build reports it
    "copy_width": Control(
        "gather_scatter.cu", "    if ((a & 15) == 0) {\n        tkv_copy_words<uint4>",
        "    if ((a & 7) == 0) {\n        tkv_copy_words<uint4>",
        "gather_scatter", "any", "the copy helper picks 16-byte words for 8-byte aligned runs"),
    # the copy half drops the last byte of every row
    "swap_in_short_copy": Control(
        "swap_in.cu", "tkv_copy_run(buffer + s * buffer_row_stride, src, entry_bytes, lane, 32);",
        "tkv_copy_run(buffer + s * buffer_row_stride, src, entry_bytes - 1, lane, 32);",
        "swap_in", "mismatch", "an off-by-one in the copy length of tkv_swap_in"),
}


def write_control(name: str, directory: Path) -> tuple[str, Path]:
    """Write the broken copy of control ``name`` into ``directory``; returns (the source
    name it replaces, its path). Raises if the patch does not apply exactly once."""
    c = CONTROLS[name]
    text = (KERNELS_DIR / c.source).read_text()
    count = text.count(c.old)
    if count != 1:
        raise AssertionError(f"control {name}: expected the patched text exactly once in {c.source}, found it "
                             f"{count} times (the kernel changed: update the control)")
    path = Path(directory) / name / c.source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.replace(c.old, c.new))
    return c.source, path
