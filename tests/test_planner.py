"""tiered_kv.planner: exact byte counts of the presets, max_requests, parse_size."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tiered_kv import presets
from tiered_kv.planner import GiB, Plan, build_plan, format_bytes, parse_size, plan

CTX_1M = 1 << 20
HBM_80G = 80 * GiB

PLAN_KEYS = {
    "model", "layout_fingerprint", "entry_format", "context_tokens", "block_tokens",
    "num_blocks", "block_bytes", "classical_bytes", "classical_bytes_by_part", "state_bytes",
    "snapshot_bytes", "bytes_per_request", "hbm_bytes", "max_requests",
}


def test_flash_fp8_1m_classical_bytes() -> None:
    p = plan(presets.deepseek_v4_flash(), CTX_1M, hbm_bytes=HBM_80G)
    expected = 21 * 262144 * 584 + 20 * 8192 * 584 + 21 * 262144 * 132
    assert expected == 4037279744
    assert p["classical_bytes"] == expected
    assert p["classical_bytes_by_part"] == {
        "csa_kv": 21 * 262144 * 584, "indexer": 21 * 262144 * 132, "hca_kv": 20 * 8192 * 584,
    }
    assert p["num_blocks"] == 8192
    assert p["model"] == "deepseek-v4-flash"
    assert p["entry_format"] == "fp8_ds_mla"


def test_pro_bf16_indexer256_1m_classical_bytes() -> None:
    layout = presets.deepseek_v4_pro(entry_format="bf16", indexer_bytes=256)
    p = plan(layout, CTX_1M, hbm_bytes=HBM_80G)
    expected = 30 * 262144 * 1024 + 31 * 8192 * 1024 + 30 * 262144 * 256
    assert expected == 10326376448
    assert p["classical_bytes"] == expected
    assert p["classical_bytes_by_part"] == {
        "csa_kv": 30 * 262144 * 1024, "indexer": 30 * 262144 * 256, "hca_kv": 31 * 8192 * 1024,
    }


@pytest.mark.parametrize("layout", [
    presets.deepseek_v4_flash(),
    presets.deepseek_v4_pro(),
    presets.deepseek_v4_pro(entry_format="bf16", indexer_bytes=256, block_tokens=256),
    presets.tiny(),
], ids=lambda layout: f"{layout.name}-{layout.entry_format.value}-{layout.block_tokens}")
@pytest.mark.parametrize("context", [0, 1, 127, 128, 129, 1000, CTX_1M])
def test_plan_is_consistent(layout, context: int) -> None:
    p = plan(layout, context, hbm_bytes=HBM_80G)
    assert PLAN_KEYS <= p.keys()
    assert p["layout_fingerprint"] == layout.fingerprint
    assert p["block_tokens"] == layout.block_tokens
    assert p["num_blocks"] == -(-context // layout.block_tokens)
    assert p["num_blocks"] * layout.block_tokens >= context
    assert sum(p["classical_bytes_by_part"].values()) == p["classical_bytes"]
    assert p["classical_bytes"] == p["num_blocks"] * p["block_bytes"]
    assert p["classical_bytes"] == layout.classical_bytes(context)
    assert p["state_bytes"] == layout.state_bytes
    assert p["snapshot_bytes"] == layout.snapshot_bytes
    assert p["bytes_per_request"] == p["classical_bytes"] + p["state_bytes"]
    assert p["max_requests"] == HBM_80G // p["bytes_per_request"]
    json.dumps(p)  # JSON-able as is


def test_max_requests_is_floor_of_hbm_over_request_bytes() -> None:
    layout = presets.deepseek_v4_flash()
    per_request = plan(layout, CTX_1M, hbm_bytes=0)["bytes_per_request"]
    assert per_request == 4037279744 + layout.state_bytes
    assert plan(layout, CTX_1M, hbm_bytes=HBM_80G)["max_requests"] == 21
    assert plan(layout, CTX_1M, hbm_bytes=per_request * 3)["max_requests"] == 3
    assert plan(layout, CTX_1M, hbm_bytes=per_request * 3 - 1)["max_requests"] == 2
    assert plan(layout, CTX_1M, hbm_bytes=per_request - 1)["max_requests"] == 0
    assert plan(layout, CTX_1M, hbm_bytes=0)["max_requests"] == 0


def test_build_plan_is_frozen_and_matches_dict() -> None:
    p = build_plan(presets.tiny(), 300, hbm_bytes=GiB)
    assert isinstance(p, Plan)
    assert p.to_dict() == plan(presets.tiny(), 300, hbm_bytes=GiB)
    assert p.bytes_per_request == p.classical_bytes + p.state_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.hbm_bytes = 0  # type: ignore[misc]


@pytest.mark.parametrize("context, hbm, name", [
    (-1, GiB, "context_tokens"),
    (1.5, GiB, "context_tokens"),
    ("1M", GiB, "context_tokens"),
    (True, GiB, "context_tokens"),
    (128, -1, "hbm_bytes"),
    (128, 80.0, "hbm_bytes"),
])
def test_plan_rejects_bad_numbers(context: object, hbm: object, name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}: expected a non-negative int"):
        plan(presets.tiny(), context, hbm_bytes=hbm)  # type: ignore[arg-type]


def test_plan_rejects_non_layout() -> None:
    with pytest.raises(TypeError, match="KVLayout"):
        plan("deepseek-v4-flash", CTX_1M, hbm_bytes=GiB)  # type: ignore[arg-type]


@pytest.mark.parametrize("text, expected", [
    ("0", 0),
    ("1", 1),
    ("131072", 131072),
    ("1_048_576", 1048576),
    ("1k", 1024),
    ("1K", 1024),
    ("128k", 131072),
    ("1M", 1048576),
    ("1m", 1048576),
    ("2G", 2 * GiB),
    ("1T", 1 << 40),
    ("1KiB", 1024),
    ("1MiB", 1048576),
    ("80GiB", 80 * GiB),
    ("512B", 512),
    (" 1M ", 1048576),
    ("1 M", 1048576),
    (1048576, 1048576),
    (0, 0),
])
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", "M", "-1", "-1M", "1.5M", "1e6", "1MB", "1GB", "1kb", "1Mi", "1 Mi B", "1P", "one",
    "0x10", "1M1", "1,024",
])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"size: expected .*'1M'"):
        parse_size(text)


@pytest.mark.parametrize("value", [-1, True, 1.0, None, b"1M"])
def test_parse_size_rejects_non_strings(value: object) -> None:
    with pytest.raises(ValueError, match="size: expected"):
        parse_size(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (492832, "481.28 KiB"),
    (4037279744, "3.76 GiB"), (80 * GiB, "80.00 GiB"), (3 << 40, "3.00 TiB"),
])
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text
