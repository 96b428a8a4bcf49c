"""The ``tiered-kv`` command line: in-process through ``main`` and once as installed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiered_kv.cli import main
from tiered_kv.cli.main import COMMANDS, ExitCode, build_parser, command_modules

from _util import console_script

FLASH_1M_CLASSICAL = 4037279744
PRO_BF16_1M_CLASSICAL = 10326376448


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_flash_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", "--model", "deepseek-v4-flash", "--context", "1048576")
    assert code == 0 and err == ""
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert rows["classical_bytes"][:3] == [str(FLASH_1M_CLASSICAL), "3.76", "GiB"]
    assert rows["model"] == ["deepseek-v4-flash"]
    assert rows["num_blocks"] == ["8192"]
    assert rows["max_requests"][0] == "21"
    for part in ("csa_kv", "indexer", "hca_kv"):
        assert part in rows


def test_plan_default_context_is_1m(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--model", "deepseek-v4-flash", "--json")
    assert code == 0
    assert json.loads(out)["context_tokens"] == 1 << 20


def test_plan_pro_bf16_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", "--model", "deepseek-v4-pro", "--context", "1M",
                             "--entry-format", "bf16", "--indexer-bytes", "256", "--json")
    assert code == 0 and err == ""
    p = json.loads(out)
    assert p["classical_bytes"] == PRO_BF16_1M_CLASSICAL
    assert p["entry_format"] == "bf16"
    assert p["context_tokens"] == 1 << 20
    assert sum(p["classical_bytes_by_part"].values()) == p["classical_bytes"]


def test_plan_options_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--model", "tiny", "--context", "1k", "--block-tokens",
                           "256", "--entry-format", "bf16", "--hbm-gib", "0.5", "--json")
    assert code == 0
    p = json.loads(out)
    assert (p["model"], p["entry_format"], p["block_tokens"]) == ("tiny", "bf16", 256)
    assert p["num_blocks"] == 4
    assert p["hbm_bytes"] == 1 << 29
    assert p["max_requests"] == (1 << 29) // p["bytes_per_request"]


def test_plan_hisparse_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plan", "--model", "deepseek-v4-flash", "--context", "1M",
                             "--hisparse-buffer", "2048")
    assert code == 0 and err == ""
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert rows["hisparse_buffer_entries"][0] == "2048"
    assert rows["hbm_bytes_per_request"][:3] == ["863275264", "823.28", "MiB"]
    assert rows["open_block_csa_kv"][0] == str(21 * 32 * 584)
    assert rows["device_buffer"][0] == str(21 * 2048 * 584)
    assert rows["max_requests"][0] == "21"
    assert rows["max_requests_hisparse"][0] == "99"
    assert rows["host_bytes_per_request"][0] == str(FLASH_1M_CLASSICAL)


def test_plan_without_hisparse_has_no_hisparse_rows(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--model", "deepseek-v4-flash")
    assert code == 0
    assert "hisparse" not in out and "host_bytes_per_request" not in out


@pytest.mark.parametrize("model, n, hbm, max_hisparse", [
    ("deepseek-v4-flash", "2048", 863275264, 99),
    ("deepseek-v4-pro", "4096", 1281991168, 67),
])
def test_plan_hisparse_json(capsys: pytest.CaptureFixture[str], model: str, n: str, hbm: int,
                            max_hisparse: int) -> None:
    code, out, err = run_cli(capsys, "plan", "--model", model, "--context", "1M",
                             "--hisparse-buffer", n, "--json")
    assert code == 0 and err == ""
    p = json.loads(out)
    assert p["hisparse_buffer_entries"] == int(n)
    assert p["hbm_bytes_per_request"] == hbm
    assert p["max_requests_hisparse"] == max_hisparse
    assert p["host_bytes_per_request"] == p["classical_bytes"]
    assert p["max_requests"] == p["hbm_bytes"] // p["bytes_per_request"]


def test_plan_json_without_hisparse_has_null_values(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--model", "deepseek-v4-flash", "--json")
    assert code == 0
    p = json.loads(out)
    assert p["max_requests_hisparse"] is None and p["hisparse_buffer_entries"] is None
    assert p["hbm_bytes_per_request"] == p["bytes_per_request"]
    assert p["host_bytes_per_request"] == 0


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "deepseek-v4-flash", "--hisparse-buffer", "511"],
     "--hisparse-buffer: expected at least the model's top-k = 512"),
    (["plan", "--model", "deepseek-v4-pro", "--hisparse-buffer", "1000"],
     "--hisparse-buffer: expected at least the model's top-k = 1024"),
    (["plan", "--model", "deepseek-v4-flash", "--hisparse-buffer", "0"], "argument --hisparse-buffer"),
    (["plan", "--model", "deepseek-v4-flash", "--hisparse-buffer", "4x"], "argument --hisparse-buffer"),

    (["plan", "--model", "tiny", "--entry-format", "fp8"], "expected head_dim 512, got 16"),
    (["plan", "--model", "deepseek-v4-flash", "--block-tokens", "100"], "multiple of"),
    (["plan", "--model", "deepseek-v4-flash", "--context", "1.5M"], "argument --context"),
    (["plan", "--model", "deepseek-v4-flash", "--context", "-5"], "argument --context"),
    (["plan", "--model", "deepseek-v4-flash", "--hbm-gib", "0"], "argument --hbm-gib"),
    (["plan", "--model", "deepseek-v4-flash", "--indexer-bytes", "x"], "argument --indexer-bytes"),
    (["plan", "--model", "deepseek-v4-flash", "--entry-format", "fp16"], "invalid choice"),
    (["plan", "--model", "llama"], "invalid choice"),
    (["plan"], "--model"),
    (["no-such-command"], "invalid choice"),
    ([], "COMMAND"),
])
def test_bad_arguments_exit_2_with_message(capsys: pytest.CaptureFixture[str], argv: list[str],
                                           message: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == ExitCode.USAGE == 2
    assert out == ""
    assert message in err
    assert "error:" in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--help")
    assert code == 0
    assert "--context" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out == f"tiered-kv {version('tiered-kv')}\n"


def test_every_command_module_is_registered() -> None:
    names = [m.__name__.rsplit(".", 1)[1] for m in command_modules()]
    assert "plan" in names
    assert "main" not in names


def test_the_command_table_lists_every_command_module_with_its_own_help() -> None:
    """COMMANDS (what ``tiered-kv --help`` shows without importing a command) names every
    public module of tiered_kv.cli, and each command's help is the one its module gives."""
    import argparse
    import pkgutil

    import tiered_kv.cli

    public = {m.name for m in pkgutil.iter_modules(tiered_kv.cli.__path__) if not m.name.startswith("_")}
    assert {c.module for c in COMMANDS.values()} == public - {"main"}
    full = build_parser()  # every command's own sub-parser
    listed = build_parser([])  # stand-ins only
    for parser in (full, listed):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert list(action.choices) == list(COMMANDS)
        assert {c.dest: c.help for c in action._choices_actions} == {n: c.help for n, c in COMMANDS.items()}
    assert full.format_help() == listed.format_help()


def test_console_script_json() -> None:
    proc = subprocess.run(
        [console_script(), "plan", "--model", "deepseek-v4-flash", "--context", "1M", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    for key in ("model", "layout_fingerprint", "entry_format", "context_tokens", "block_tokens",
                "num_blocks", "block_bytes", "classical_bytes", "classical_bytes_by_part",
                "state_bytes", "snapshot_bytes", "bytes_per_request", "hbm_bytes", "max_requests"):
        assert key in p
    assert p["classical_bytes"] == FLASH_1M_CLASSICAL


def test_console_script_bad_argument_exits_2() -> None:
    proc = subprocess.run(
        [console_script(), "plan", "--model", "tiny", "--entry-format", "fp8"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "tiered-kv plan: error:" in proc.stderr and "head_dim 512" in proc.stderr


def test_python_dash_m() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tiered_kv.cli", "plan", "--model", "tiny", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == "tiny"
