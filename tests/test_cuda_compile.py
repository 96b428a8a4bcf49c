"""Every CUDA source compiles standalone with ``nvcc -c``, wherever nvcc is installed.

The kernels are compiled at run time by NVRTC on GPU machines only, so without this
test a syntax error would reach CI unnoticed on CPU-only runners. Skipped only when no
nvcc can be found (PATH, then ``/usr/local/cuda*/bin``).
"""

from __future__ import annotations

import glob
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tiered_kv.kernels.cuda_ops import CUDA_SOURCES, KERNEL_NAMES

#: Hopper (H100/H200), the deployment target; accepted by CUDA 12 and 13 alike.
ARCH = "sm_90"


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    candidates = sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)
    return candidates[0] if candidates else None


NVCC = find_nvcc()


def test_cuda_sources_are_all_listed() -> None:
    kernels_dir = CUDA_SOURCES[0].parent
    assert sorted(CUDA_SOURCES) == sorted(kernels_dir.glob("*.cu"))
    assert sorted(p.name for p in CUDA_SOURCES) == sorted(KERNEL_NAMES)
    assert all(p.is_file() for p in CUDA_SOURCES)


def test_shared_copy_helper_is_identical() -> None:
    """The word-copy helper is duplicated (each .cu stands alone); keep the copies equal."""
    pattern = re.compile(r"// ---- shared copy helper.*?// ---- end shared copy helper ----", re.S)
    helpers = {p.name: pattern.search(p.read_text()) for p in CUDA_SOURCES}
    assert all(helpers.values()), f"helper markers missing in {[k for k, v in helpers.items() if not v]}"
    assert len({m.group(0) for m in helpers.values() if m}) == 1


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH or in /usr/local/cuda*/bin")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(source: Path, tmp_path: Path) -> None:
    assert NVCC is not None
    obj = tmp_path / (source.stem + ".o")
    # Same language level as the NVRTC build (cuda_ops._NVRTC_OPTIONS); warnings fail too.
    cmd = [NVCC, f"-arch={ARCH}", "-std=c++17", "--Werror", "all-warnings", "-c", str(source), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    assert obj.stat().st_size > 0


@pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH or in /usr/local/cuda*/bin")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.name)
def test_entry_points_are_extern_c(source: Path, tmp_path: Path) -> None:
    """The launchers look kernels up by their plain C names (no C++ mangling)."""
    assert NVCC is not None
    ptx = tmp_path / (source.stem + ".ptx")
    proc = subprocess.run([NVCC, f"-arch={ARCH}", "-std=c++17", "-ptx", str(source), "-o", str(ptx)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx.read_text()))
    assert entries == set(KERNEL_NAMES[source.name])
