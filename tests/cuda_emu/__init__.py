"""The CUDA kernels of ``kernels/*.cu`` executed on the CPU, for tests.

A small CUDA emulator we own: ``cuda_emu.h`` (the CUDA C surface for g++) and
``runtime.cpp`` (a fiber per CUDA thread, counting barriers, 32-lane warp collectives,
exact-size poisoned dynamic shared memory, ``__trap``, deadlock reports; see their
headers). :func:`build` compiles one UNMODIFIED ``.cu`` file into a shared library;
:class:`EmuLauncher` is a launcher for :func:`tiered_kv.kernels.cuda_ops.launcher`, so a
launch goes through ``cuda_ops``' own grid, block, shared-memory and argument building and
runs here, on CPU tensors whose addresses stand in for device addresses::

    from cuda_emu import EmuLauncher
    with cuda_ops.launcher(EmuLauncher(order="random", seed=3)):
        cuda_ops.hisparse_swap_in(tables, state_slots, part, ids, host, None, out)   # CPU tensors

``tests/test_cuda_emu.py`` runs every kernel against its torch twin on random traces
(``cuda_emu/traces.py``, which ``bench/gpu_check.sh`` also runs on a real GPU).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["ORDERS", "EmuLaunchError", "EmuLauncher", "EmuModule", "build", "compiler", "sanitizer_preload"]

HERE = Path(__file__).resolve().parent
HEADER = HERE / "cuda_emu.h"
RUNTIME = HERE / "runtime.cpp"
KERNELS_DIR = HERE.parent.parent / "kernels"

#: thread (and block) order between synchronisation points: the runtime's mode numbers
ORDERS = {"in_order": 0, "reversed": 1, "random": 2}

_WARN = ["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas", "-Wno-unused-parameter"]
_FLAGS = ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-pthread", *_WARN]
_PLAIN = ["-O2"]
_SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]

_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\(\s*(\d+)[^)]*\)\s*)?(\w+)\s*\(')
_DYNAMIC_SHARED_RE = re.compile(r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([\w\s]+?)\s+(\w+)\s*\[\s*\]")
_SHARED_RE = re.compile(r"(\bextern\s+)?__shared__")


class EmuLaunchError(RuntimeError):
    """A launch the emulator refused or that failed: a trap, a deadlock, a warp that
    disagreed, a write past the dynamic shared memory, arguments that do not match the
    kernel's signature."""


@functools.cache
def compiler() -> str | None:
    """A C++17 compiler (``$CXX``, else c++ / g++ / clang++) that builds the runtime, or None."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        path = shutil.which(name)
        if path is None:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "probe.cpp"
            src.write_text("#include <utility>\nint main() { return std::index_sequence<1>::size() - 1; }\n")
            proc = subprocess.run([path, "-std=c++17", str(src), "-o", str(Path(tmp) / "probe")],
                                  capture_output=True, timeout=120)
            if proc.returncode == 0:
                return path
    return None


def sanitizer_preload() -> str | None:
    """The ASan runtime to LD_PRELOAD into a process that loads a sanitized module
    (it must come first in the library list), or None where the compiler has none."""
    cxx = compiler()
    if cxx is None:
        return None
    proc = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=60)
    path = proc.stdout.strip()
    return path if proc.returncode == 0 and os.path.isabs(path) and os.path.exists(path) else None


def _cache_dir() -> Path:
    d = Path(os.environ.get("TKV_EMU_CACHE", Path(tempfile.gettempdir()) / f"tiered_kv_cuda_emu-{os.getuid()}"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.cache
def _compiler_id(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout


def _run_compiler(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"cuda_emu: compiling failed:\n{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")


def _cached(key_parts: list[str], name: str, make: Any) -> Path:
    """``make(path)`` once per content key; later calls (and later test runs) reuse it."""
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:24]
    out = _cache_dir() / f"{key}-{name}"
    if not out.exists():
        tmp = out.with_name(f".{out.name}.{os.getpid()}")
        make(tmp)
        os.replace(tmp, out)
    return out


def _wrapper(source: Path) -> str:
    """The translation unit: header, the source itself (unmodified), registrations."""
    text = source.read_text()
    kernels = [name for _, name in _KERNEL_RE.findall(text)]
    if not kernels:
        raise ValueError(f"{source}: expected at least one extern \"C\" __global__ kernel")
    for m in _SHARED_RE.finditer(text):
        if m.group(1) is None:
            line = text.count("\n", 0, m.start()) + 1
            raise ValueError(f"{source}:{line}: static __shared__ arrays are not emulated (a block-scope static "
                             "would be shared by every block); only `extern __shared__ T name[]`")
    shared = dict((name, " ".join(ctype.split())) for ctype, name in _DYNAMIC_SHARED_RE.findall(text))
    lines = ['#include "cuda_emu.h"', f'#include "{source}"']
    lines += [f"TKV_EMU_SHARED({ctype}, {name})" for name, ctype in shared.items()]
    lines += [f"TKV_EMU_KERNEL({name})" for name in kernels]
    return "\n".join(lines) + "\n"


def build(source: Path, *, sanitize: bool = False) -> Path:
    """Compile ``source`` (a ``.cu`` file, unmodified) and the runtime into a shared library;
    ``sanitize``: with AddressSanitizer and UndefinedBehaviorSanitizer (load it in a process
    started with :func:`sanitizer_preload` in ``LD_PRELOAD``)."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("cuda_emu: no C++17 compiler (set CXX, or install g++)")
    source = Path(source).resolve()
    flags = _FLAGS + (_SANITIZE if sanitize else _PLAIN)
    ident = [_compiler_id(cxx), " ".join(flags), HEADER.read_text()]
    runtime = _cached([*ident, RUNTIME.read_text()], "runtime.o", lambda out: _run_compiler(
        [cxx, *flags, f"-I{HERE}", "-c", str(RUNTIME), "-o", str(out)]))
    wrapper = _wrapper(source)

    def link(out: Path) -> None:
        cpp = out.with_suffix(".cpp")
        cpp.write_text(wrapper)
        try:
            _run_compiler([cxx, *flags, f"-I{HERE}", "-shared", str(cpp), str(runtime), "-o", str(out)])
        finally:
            cpp.unlink(missing_ok=True)

    return _cached([*ident, RUNTIME.read_text(), wrapper, source.read_text()], source.stem + ".so", link)


@dataclass(frozen=True)
class _Param:
    kind: str
    size: int
    type: str


class EmuModule:
    """One built ``.cu``: its kernels' signatures (as the compiler sees them) and launches."""

    def __init__(self, source: Path, *, sanitize: bool = False) -> None:
        self.source = Path(source)
        self.path = build(self.source, sanitize=sanitize)
        self._lib = ctypes.CDLL(str(self.path))
        self._lib.tkv_emu_error.restype = ctypes.c_char_p
        self._lib.tkv_emu_signatures.restype = ctypes.c_char_p
        self._lib.tkv_emu_launch.restype = ctypes.c_int
        self._lib.tkv_emu_launch.argtypes = [
            ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint), ctypes.c_ulonglong,
            ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint), ctypes.c_char_p,
            ctypes.c_int, ctypes.c_ulonglong]
        self.signatures: dict[str, list[_Param]] = {}
        for line in self._lib.tkv_emu_signatures().decode().splitlines():
            name, _, params = line.partition("(")
            self.signatures[name] = [_Param(p[0], int(p[1:].split(" ", 1)[0]), p.split(" ", 1)[1])
                                     for p in params.rstrip(")").split(", ") if p]
        text = self.source.read_text()
        #: kernel -> its __launch_bounds__ maximum threads per block (absent: 1024)
        self.launch_bounds = {name: int(bound) for bound, name in _KERNEL_RE.findall(text) if bound}

    def launch(self, kernel: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
               shared_mem: int = 0, *, order: str = "in_order", seed: int = 0) -> None:
        if kernel not in self.signatures:
            raise EmuLaunchError(f"{self.source.name} has no kernel {kernel!r} (it has {sorted(self.signatures)})")
        g = [int(x) for x in grid] + [1] * (3 - len(grid))
        b = [int(x) for x in block] + [1] * (3 - len(block))
        if len(g) != 3 or len(b) != 3:
            raise EmuLaunchError(f"{kernel}: expected grid and block of 1-3 dims, got {grid}, {block}")
        bound = self.launch_bounds.get(kernel)
        if bound is not None and b[0] * b[1] * b[2] > bound:
            raise EmuLaunchError(f"{kernel}: block {tuple(b)} has more threads than its __launch_bounds__({bound})")
        values = [_scalar(kernel, i, a) for i, a in enumerate(args)]
        buffers = [ctypes.create_string_buffer(v.tobytes(), max(v.itemsize, 16)) for v in values]
        ptrs = (ctypes.c_void_p * max(len(buffers), 1))(*[ctypes.cast(x, ctypes.c_void_p) for x in buffers])
        sizes = (ctypes.c_uint * max(len(values), 1))(*[v.itemsize for v in values])
        kinds = "".join(v.dtype.kind for v in values).encode()
        rc = self._lib.tkv_emu_launch(kernel.encode(), (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b),
                                      int(shared_mem), len(values), ptrs, sizes, kinds, ORDERS[order], seed)
        if rc != 0:
            raise EmuLaunchError(f"{kernel}: {self._lib.tkv_emu_error().decode()}")


def _scalar(kernel: str, index: int, a: Any) -> np.ndarray:
    """A launch argument as CuPy would pass it: numpy scalars as they are, Python ints as
    int64, floats as float64, bools as bool; anything else is refused."""
    if isinstance(a, np.generic):
        return np.asarray(a)
    if isinstance(a, bool):
        return np.asarray(a, dtype=np.bool_)
    if isinstance(a, int):
        return np.asarray(a, dtype=np.int64)
    if isinstance(a, float):
        return np.asarray(a, dtype=np.float64)
    raise EmuLaunchError(f"argument {index} of {kernel}: expected a numpy scalar or a Python number, "
                         f"got {type(a).__name__}")


class EmuLauncher:
    """A ``cuda_ops`` launcher (see :func:`tiered_kv.kernels.cuda_ops.launcher`) that runs
    each launch in the emulator.

    order: ``in_order``, ``reversed`` or ``random`` (seeded by ``seed``, a new seed per
    launch). sources: ``.cu`` files by name that replace those of ``kernels/`` (the
    positive controls launch broken copies through the very same launchers).
    """

    def __init__(self, *, order: str = "in_order", seed: int = 0, sanitize: bool = False,
                 sources: Mapping[str, Path] | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"order: expected one of {sorted(ORDERS)}, got {order!r}")
        self.order, self.seed, self.sanitize = order, seed, sanitize
        self.sources = dict(sources or {})
        self.launches: dict[str, int] = {}
        self._modules: dict[str, EmuModule] = {}

    def module(self, source_name: str) -> EmuModule:
        mod = self._modules.get(source_name)
        if mod is None:
            path = self.sources.get(source_name, KERNELS_DIR / source_name)
            mod = self._modules[source_name] = _module(Path(path), self.sanitize)
        return mod

    def __call__(self, device: torch.device, source_name: str, kernel_name: str, grid: tuple[int, ...],
                 block: tuple[int, ...], args: tuple[Any, ...], shared_mem: int = 0) -> None:
        if device.type != "cpu":
            raise EmuLaunchError(f"{kernel_name}: the emulator runs on CPU tensors, got device {device}")
        seed = self.seed * 1_000_003 + sum(self.launches.values())
        self.module(source_name).launch(kernel_name, grid, block, args, shared_mem, order=self.order, seed=seed)
        self.launches[kernel_name] = self.launches.get(kernel_name, 0) + 1


@functools.cache
def _module(path: Path, sanitize: bool) -> EmuModule:
    # One loaded library per (source, build): dlopen'ing a path twice returns the same handle.
    return EmuModule(path, sanitize=sanitize)
