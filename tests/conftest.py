"""Shared fixtures: the tiny layout, the reference model, token streams."""

from __future__ import annotations

import pytest

from tiered_kv import presets
from tiered_kv.device import cuda_available
from tiered_kv.reference import ReferenceModel

#: the session-scoped ``seaweedfs`` fixture (one S3 server for every s3-marked test)
pytest_plugins = ["seaweedfs"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_layout():
    return presets.tiny()


@pytest.fixture(scope="session")
def tiny_model(tiny_layout) -> ReferenceModel:
    return ReferenceModel(tiny_layout, seed=0)
