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
    "hisparse_buffer_entries", "hisparse_bytes_by_part", "hbm_bytes_per_request",
    "max_requests_hisparse", "host_bytes_per_request",
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
    # without HiSparse: same keys, the GPU holds everything, nothing on the host
    assert p["hbm_bytes_per_request"] == p["bytes_per_request"]
    assert p["host_bytes_per_request"] == 0
    assert p["max_requests_hisparse"] is None
    assert p["hisparse_buffer_entries"] is None and p["hisparse_bytes_by_part"] is None
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


def test_flash_fp8_1m_hisparse_2048_by_hand() -> None:
    """HiSparse with N = 2048 = 4 x top-512 slots: every term written out."""
    layout = presets.deepseek_v4_flash()
    p = plan(layout, CTX_1M, hbm_bytes=HBM_80G, hisparse_buffer_entries=2048)
    blocks, csa_layers, hca_layers, E = 8192, 21, 20, 32  # E = 128 tokens / 4
    entry, key = 584, 132
    indexer = csa_layers * blocks * E * key  # 726,663,168: indexer keys stay on the GPU
    hca = hca_layers * blocks * 1 * entry  # 95,682,560: HCA entries stay on the GPU
    open_block = csa_layers * E * entry  # 392,448: the block being filled keeps its CSA part
    buffer = csa_layers * 2048 * entry  # 25,116,672: the device buffer
    state = layout.state_bytes
    # SWA ring 43 x 128 x 584, CSA tails 21 x (2*8*1024 + 2*8*256) fp32, HCA tails 20 x 2*128*512 fp32
    assert state == 43 * 128 * 584 + 4 * (21 * (2 * 8 * 1024 + 2 * 8 * 256) + 20 * 2 * 128 * 512) == 15_420_416
    hbm = indexer + hca + open_block + state + buffer
    assert hbm == 863_275_264  # 823.28 MiB, against 3.77 GiB without HiSparse
    assert p["hisparse_buffer_entries"] == 2048
    assert p["hisparse_bytes_by_part"] == {"open_block_csa_kv": open_block, "device_buffer": buffer}
    assert p["hbm_bytes_per_request"] == hbm
    assert p["hbm_bytes_per_request"] == p["classical_bytes"] - p["classical_bytes_by_part"]["csa_kv"] \
        + open_block + state + buffer
    assert p["max_requests_hisparse"] == 80 * 2**30 // hbm == 99
    assert p["max_requests"] == 21  # unchanged: the plan without offload
    # the host mirror keeps whole block records: csa_kv + indexer + hca_kv of every block
    assert p["host_bytes_per_request"] == blocks * 492_832 == 4_037_279_744


def test_pro_fp8_1m_hisparse_4096() -> None:
    layout = presets.deepseek_v4_pro()
    p = plan(layout, CTX_1M, hbm_bytes=HBM_80G, hisparse_buffer_entries=4096)
    blocks, E, entry = 8192, 32, 584
    hbm = (30 * blocks * E * 132 + 31 * blocks * entry  # indexer + HCA
           + 30 * E * entry + layout.state_bytes + 30 * 4096 * entry)  # open block, State, buffer
    assert p["hbm_bytes_per_request"] == hbm == 1_281_991_168
    assert p["max_requests_hisparse"] == HBM_80G // hbm == 67
    assert p["max_requests"] == 14
    assert p["host_bytes_per_request"] == p["classical_bytes"] == blocks * 705_464


@pytest.mark.parametrize("layout", [presets.deepseek_v4_flash(), presets.deepseek_v4_pro(), presets.tiny()],
                         ids=lambda layout: layout.name)
@pytest.mark.parametrize("context", [0, 1, 127, 128, 129, CTX_1M])
@pytest.mark.parametrize("mult", [1, 4])
def test_hisparse_plan_is_consistent(layout, context: int, mult: int) -> None:
    n = mult * layout.top_k
    p = build_plan(layout, context, hbm_bytes=HBM_80G, hisparse_buffer_entries=n)
    assert p.hisparse is not None and p.hisparse.buffer_entries == n
    assert p.hbm_bytes_per_request == (p.bytes_per_request - p.classical_parts.csa_kv
                                       + layout.csa_kv_block_bytes
                                       + layout.num_csa_layers * n * layout.entry_bytes)
    assert p.max_requests_hisparse == HBM_80G // p.hbm_bytes_per_request
    assert p.host_bytes_per_request == p.classical_bytes
    # the plan without offload is unchanged by the HiSparse section
    plain = build_plan(layout, context, hbm_bytes=HBM_80G)
    assert p.max_requests == plain.max_requests and p.bytes_per_request == plain.bytes_per_request
    d = p.to_dict()
    assert d.keys() == plain.to_dict().keys()
    json.dumps(d)


def test_hisparse_pays_off_only_with_context() -> None:
    """At 1M the buffer is far smaller than the CSA KV it replaces; at one block it is not."""
    layout = presets.deepseek_v4_flash()
    long = build_plan(layout, CTX_1M, hbm_bytes=HBM_80G, hisparse_buffer_entries=2048)
    assert long.max_requests_hisparse is not None and long.max_requests_hisparse > 4 * long.max_requests
    short = build_plan(layout, 128, hbm_bytes=HBM_80G, hisparse_buffer_entries=2048)
    assert short.hbm_bytes_per_request > short.bytes_per_request


@pytest.mark.parametrize("n", [511, 0, -1, True, 2048.0, "2048"])
def test_hisparse_rejects_buffer_below_top_k(n: object) -> None:
    with pytest.raises(ValueError, match="hisparse_buffer_entries: expected an int >= top_k = 512"):
        plan(presets.deepseek_v4_flash(), CTX_1M, hbm_bytes=HBM_80G, hisparse_buffer_entries=n)  # type: ignore[arg-type]


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
