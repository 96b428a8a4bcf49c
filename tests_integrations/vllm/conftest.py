"""Fixtures of the vLLM adapter's tests (helpers: _vllm_engine.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from _vllm_engine import Engine


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Engines a test opens; each is shut down at the end (its /dev/shm region freed)."""
    opened: list[Engine] = []
    yield opened
    for engine in opened:
        engine.close()
    leftovers = [e.region for e in opened if os.path.exists(e.region)]
    assert not leftovers, f"primary regions not freed: {leftovers}"
