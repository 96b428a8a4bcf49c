"""Fixtures of the vLLM adapter's tests (helpers: _vllm_engine.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The project's SeaweedFS test server (tests/seaweedfs.py) and its session fixture ``seaweedfs``.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
pytest_plugins = ["seaweedfs"]

from _vllm_engine import Engine  # noqa: E402


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test opens; each is shut down at the end (its /dev/shm region freed)."""
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        engine.close()
    leftovers = [e.region for e in opened if os.path.exists(e.region)]
    assert not leftovers, f"primary regions not freed: {leftovers}"
