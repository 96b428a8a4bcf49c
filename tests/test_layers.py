"""The architecture of the package, as ``.importlinter`` declares it (docs/architecture.md §6):
the layers of ``tiered_kv.storage``, storage importing nothing of the core, and no import
circles anywhere in ``tiered_kv``.

import-linter finds a package's modules by walking its directory, and ``tiered_kv.storage``
and ``tiered_kv.kernels`` are installed from the top-level ``storage/`` and ``kernels/``
folders (setuptools ``package-dir``), outside ``tiered_kv/``. So the check runs on a tree of
symbolic links that puts them where their names say, with nothing copied.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _linked_tree(where: Path) -> Path:
    """``where/tiered_kv``: links to every entry of tiered_kv/, plus storage/ and kernels/."""
    pkg = where / "tiered_kv"
    pkg.mkdir(parents=True)
    for entry in (ROOT / "tiered_kv").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "storage").symlink_to(ROOT / "storage")
    (pkg / "kernels").symlink_to(ROOT / "kernels")
    return where


def _lint_imports() -> Path:
    exe = Path(sys.executable).parent / "lint-imports"
    if not exe.exists():
        pytest.fail("import-linter is not installed in this environment: it is in the test extra "
                    "(`make venv` installs '.[test,bench]')")
    return exe


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    tree = _linked_tree(tmp_path / "tree")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([str(_lint_imports()), str(ROOT / ".importlinter"), "--no-cache"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and proc.stdout.count("KEPT") == 3, proc.stdout[-3000:]


def test_a_broken_layer_is_caught(tmp_path: Path) -> None:
    """The check can fail: a copy of the storage package where the format layer imports a
    backend breaks the layers contract (and makes a circle)."""
    tree = _linked_tree(tmp_path / "tree")
    (tree / "tiered_kv" / "storage").unlink()
    storage = tree / "tiered_kv" / "storage"
    storage.mkdir()
    for entry in (ROOT / "storage").iterdir():
        if entry.name not in ("format", "__pycache__"):
            (storage / entry.name).symlink_to(entry)
    fmt = storage / "format"
    fmt.mkdir()
    for entry in (ROOT / "storage" / "format").glob("*.py"):
        (fmt / entry.name).symlink_to(entry)
    (fmt / "rows.py").unlink()
    (fmt / "rows.py").write_text((ROOT / "storage" / "format" / "rows.py").read_text()
                                 + "\nfrom ..lmdb import store  # a layer upward\n")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([str(_lint_imports()), str(ROOT / ".importlinter"), "--no-cache"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "tiered_kv.storage.format.rows -> tiered_kv.storage.lmdb.store" in proc.stdout
