"""Fixtures of the SGLang adapter tests (run in .venv-sglang: ``make test-sglang``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # _util: raw store access
import _sglang_env  # noqa: E402,F401  (installs the torchvision placeholder before sglang imports)


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"lmdb://{tmp_path / 'kv'}"


@pytest.fixture
def backends():
    """Closes every backend a test opened."""
    opened = []
    yield opened
    for b in opened:
        try:
            b.close()
        except Exception:  # already closed by the test
            pass
