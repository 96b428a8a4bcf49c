"""The wheel holds exactly one top-level package, ``tiered_kv``, with ``kernels/`` and
``storage/`` installed as ``tiered_kv.kernels`` and ``tiered_kv.storage`` (docs/architecture.md §6).

The wheel is built offline with the interpreter's own setuptools
(``pip wheel --no-deps --no-build-isolation --no-index``) from a copy of the source tree,
so the check neither needs PyPI nor writes ``build/`` or ``*.egg-info`` into the checkout.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Source folder -> its import path in the installed wheel (pyproject ``package-dir``).
PACKAGE_DIRS = {"tiered_kv": "tiered_kv", "kernels": "tiered_kv/kernels", "storage": "tiered_kv/storage"}
REQUIRED = ("tiered_kv/__init__.py", "tiered_kv/kernels/__init__.py",
            "tiered_kv/storage/__init__.py", "tiered_kv/py.typed",
            # the bundled Mooncake traces, their license and attribution (tiered-kv replay)
            "tiered_kv/replay/data/conversation_trace.jsonl.xz", "tiered_kv/replay/data/synthetic_trace.jsonl.xz",
            "tiered_kv/replay/data/LICENSE-APACHE", "tiered_kv/replay/data/NOTICE.md")
#: (``.venv*``: the project's venv and the engines' and LMCache's, GBs each: ``make venv-vllm``...)
_NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", ".mypy_cache", "results")


def _require_build_backend() -> None:
    """``--no-build-isolation`` builds with this interpreter's setuptools; check it can."""
    try:
        setuptools_version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"setuptools is not installed in {sys.prefix}; run `make venv`")
    major, minor = (int(x) for x in setuptools_version.split(".")[:2])
    has_wheel = importlib.util.find_spec("wheel") is not None
    if (major, minor) < (70, 1) and not has_wheel:  # bdist_wheel moved into setuptools in 70.1
        pytest.fail(f"setuptools {setuptools_version} needs the `wheel` package to build wheels; "
                    "run `make venv`")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the source tree: the files the wheel is built from (others edit ROOT)."""
    src = tmp_path_factory.mktemp("wheel") / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    return src


@pytest.fixture(scope="module")
def wheel(src: Path) -> Iterator[zipfile.ZipFile]:
    _require_build_backend()
    out = src.parent / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("tiered_kv-*.whl"))
    assert len(wheels) == 1, f"expected one tiered_kv wheel in {out}, got {wheels}"
    with zipfile.ZipFile(wheels[0]) as zf:
        yield zf


def test_wheel_has_required_files(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    missing = [f for f in REQUIRED if f not in names]
    assert not missing, f"wheel lacks {missing}"


def test_wheel_has_only_tiered_kv_at_top_level(wheel: zipfile.ZipFile) -> None:
    top = {name.split("/", 1)[0] for name in wheel.namelist()}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert len(dist_info) == 1
    assert top - dist_info == {"tiered_kv"}
    top_level_txt = wheel.read(f"{dist_info.pop()}/top_level.txt").decode().split()
    assert top_level_txt == ["tiered_kv"]


def test_wheel_has_every_source_module_and_kernel(src: Path, wheel: zipfile.ZipFile) -> None:
    """Every ``.py`` (and CUDA source) of the package folders lands at its import path:
    a new subpackage missing from pyproject's ``packages`` list fails here."""
    names = set(wheel.namelist())
    expected = []
    for folder, target in PACKAGE_DIRS.items():
        for path in sorted((src / folder).rglob("*")):
            rel = path.relative_to(src / folder)
            if path.suffix in {".py", ".cu", ".cuh"} and "__pycache__" not in rel.parts:
                expected.append(f"{target}/{rel.as_posix()}")
    missing = [f for f in expected if f not in names]
    assert not missing, f"wheel lacks {missing} (add the subpackage to pyproject's packages list)"


def test_wheel_declares_console_script(wheel: zipfile.ZipFile) -> None:
    entry_points = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    text = wheel.read(entry_points).decode()
    assert "[console_scripts]" in text
    assert "tiered-kv = tiered_kv.cli:main" in text
