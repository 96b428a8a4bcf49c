"""``tiered-kv warm-start``: cold then warm runs on a store, the JSON report, prompt files,
the byte-level tokenizer and the progress bar. Tiny layout, short prompts."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from tiered_kv.cli._common import BUNDLED_PROMPTS, Progress, load_prompts
from tiered_kv.cli.main import ExitCode, main
from tiered_kv.tokenizer import VOCAB_SIZE, decode, encode

from _util import console_script

# shared by prompts "a" and "b": 2 full blocks of 128 byte-tokens, then they differ
SYSTEM = ("You are the on-call assistant for a KV-cache service. Answer briefly and name the tier "
          "(GPU pool, host memory, disk store) each answer is about. Prompts share this prefix, "
          "which is longer than two blocks of 128 byte-level tokens and shorter than three blocks. ")
assert 256 < len(SYSTEM.encode()) < 384 - 60


def _prompts() -> list[dict]:
    return [
        {"id": "a", "text": SYSTEM + "Q: why keep state snapshots?"},
        {"id": "b", "text": SYSTEM + "Q: what does verify check? Answer in one line, please."},
        {"id": 7, "tokens": [(i * 37) % 251 for i in range(200)]},
    ]


def write_prompts(path: Path, prompts: list[dict] | None = None) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in (prompts or _prompts())))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def warm_json(capsys: pytest.CaptureFixture[str], store: str, prompts: Path, *extra: str) -> dict:
    code, out, err = run_cli(capsys, "warm-start", "--store", store, "--prompts", str(prompts), "--json", *extra)
    assert code == ExitCode.OK, err
    return json.loads(out)


def test_warm_start_twice_second_run_hits_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl")
    store = str(tmp_path / "store")
    cold = warm_json(capsys, store, prompts)
    warm = warm_json(capsys, store, prompts)

    assert set(cold) >= {"store", "model", "layout_fingerprint", "prompts", "totals"}
    assert cold["model"] == "tiny" and cold["store"] == f"lmdb://{tmp_path / 'store'}"
    for run in (cold, warm):
        assert [p["id"] for p in run["prompts"]] == ["a", "b", "7"]
        for p in run["prompts"]:
            assert set(p) >= {"id", "tokens", "cached_tokens", "ttft_s"}
            assert p["ttft_s"] > 0 and 0 <= p["cached_tokens"] < p["tokens"]
        t = run["totals"]
        assert t["prompts"] == 3
        assert t["tokens"] == sum(p["tokens"] for p in run["prompts"])
        assert t["cached_tokens"] == sum(p["cached_tokens"] for p in run["prompts"])
        assert t["computed_tokens"] == t["tokens"] - t["cached_tokens"]
        assert t["ttft_s"] == pytest.approx(sum(p["ttft_s"] for p in run["prompts"]))
        assert t["write_errors"] == 0

    by_id = {p["id"]: p for p in cold["prompts"]}
    assert by_id["a"]["cached_tokens"] == 0
    assert by_id["b"]["cached_tokens"] == 256  # the shared system prompt, within the cold run
    assert cold["totals"]["records_before"] == 0 and cold["totals"]["records_written"] > 0
    assert cold["totals"]["records"] == cold["totals"]["records_written"]

    # warm: every prompt resumes at its last block boundary, read from the store
    for p in warm["prompts"]:
        assert p["cached_tokens"] == (p["tokens"] - 1) // 128 * 128 > 0
    assert warm["prompts"][0]["blocks_from_store"] == warm["prompts"][0]["cached_tokens"] // 128
    assert warm["totals"]["records_written"] == 0
    assert warm["totals"]["records"] == warm["totals"]["records_before"] == cold["totals"]["records"]
    assert warm["totals"]["computed_tokens"] < cold["totals"]["computed_tokens"]


def test_warm_start_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", _prompts()[:1])
    code, out, err = run_cli(capsys, "warm-start", "--store", str(tmp_path / "s"), "--prompts", str(prompts))
    assert code == 0 and err == ""  # stderr is no terminal here: no progress bar
    lines = out.splitlines()
    assert lines[0].startswith("warm-start: 1 prompts")
    row = next(line.split() for line in lines if line.split()[:1] == ["a"])
    assert row[1:4] == [str(len(SYSTEM) + len("Q: why keep state snapshots?")), "0", row[1]]
    assert any(line.split()[:1] == ["total"] for line in lines)
    assert "store: " in out


def test_salt_separates_tenants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", _prompts()[:1])
    store = str(tmp_path / "store")
    warm_json(capsys, store, prompts)
    other = warm_json(capsys, store, prompts, "--salt", "tenant-b")
    assert other["prompts"][0]["cached_tokens"] == 0 and other["salt"] == "tenant-b"
    again = warm_json(capsys, store, prompts, "--salt", "tenant-b")
    assert again["prompts"][0]["cached_tokens"] == 256


def test_console_script_warm_run_in_another_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Cold in this process, warm through the installed console script: the cache is the store."""
    prompts = write_prompts(tmp_path / "p.jsonl", _prompts()[:2])
    store = tmp_path / "store"
    warm_json(capsys, str(store), prompts)
    proc = subprocess.run([console_script(), "warm-start", "--store", f"lmdb://{store}", "--prompts",
                           str(prompts), "--json"], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [p["cached_tokens"] for p in report["prompts"]] == [256, 256]
    assert report["prompts"][0]["blocks_from_store"] == 2


def test_relative_store_path_is_resolved(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", _prompts()[2:])
    monkeypatch.chdir(tmp_path)
    report = warm_json(capsys, "rel/store", prompts)
    assert report["store"] == f"lmdb://{tmp_path / 'rel' / 'store'}"
    assert (tmp_path / "rel" / "store" / "data.mdb").is_file()


def test_zarr_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", _prompts()[2:])
    warm_json(capsys, f"zarr://{tmp_path / 'z'}", prompts)
    assert (tmp_path / "z" / "zarr.json").is_file()
    # a plain path holding a Zarr store opens as Zarr
    report = warm_json(capsys, str(tmp_path / "z"), prompts)
    assert report["store"].startswith("zarr://") and report["prompts"][0]["cached_tokens"] == 128


@pytest.mark.parametrize("model, extra", [("deepseek-v4-flash", []), ("deepseek-v4-pro", ["--entry-format", "bf16"])])
def test_non_tiny_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str,
                                extra: list[str]) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl")
    code, out, err = run_cli(capsys, "warm-start", "--store", str(tmp_path / "s"), "--prompts", str(prompts),
                             "--model", model, *extra)
    assert code == ExitCode.USAGE and out == ""
    assert "weights are random" in err and "--model tiny" in err
    assert not (tmp_path / "s").exists()


BAD_PROMPTS = [
    ("not json\n", "invalid JSON"),
    ('[1, 2]\n', "expected a JSON object"),
    ('{"id": "x"}\n', "exactly one of"),
    ('{"id": "x", "text": "hi", "tokens": [1]}\n', "exactly one of"),
    ('{"id": "x", "tokens": [1, 256]}\n', "tokens[1]"),
    ('{"id": "x", "tokens": "abc"}\n', "expected a list"),
    ('{"id": "x", "text": ""}\n', "is empty"),
    ('{"id": "x", "text": "a"}\n{"id": "x", "text": "b"}\n', "duplicate id"),
    ('{"id": true, "text": "a"}\n', "id: expected"),
    ("\n", "none"),
    # JSON can spell text that is not Unicode, and nesting no parser follows
    ('{"id": "x", "text": "ok \\ud800"}\n', "text: expected valid Unicode text, got a lone surrogate U+D800 at character 3"),
    ('{"id": "\\udfff", "text": "a"}\n', "id: expected valid Unicode text"),
    ('{"id": "x", "tokens": ' + "[" * 100_000 + "]" * 100_000 + "}\n", "JSON nested too deeply"),
    ('{"id": "x", "tokens": [' + "[" * 500 + "]" * 500 + "]}\n", "tokens[0]: expected an integer id"),
]


@pytest.mark.parametrize("content, message", BAD_PROMPTS)
def test_bad_prompt_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                 message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    code, _, err = run_cli(capsys, "warm-start", "--store", str(tmp_path / "s"), "--prompts", str(path))
    assert code == ExitCode.USAGE
    assert err.startswith("tiered-kv warm-start: error: --prompts") and message in err


def test_missing_prompt_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "warm-start", "--store", str(tmp_path / "s"), "--prompts", str(tmp_path / "no"))
    assert code == ExitCode.USAGE and "no such file" in err


def test_bundled_prompts() -> None:
    prompts = load_prompts(BUNDLED_PROMPTS)
    assert 6 <= len(prompts) <= 12
    assert all(300 <= len(p.tokens) <= 1500 for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)
    # they share prefixes of at least one full block, so warm runs show cached tokens
    firsts = [tuple(p.tokens[:128]) for p in prompts]
    assert len(set(firsts)) < len(firsts)


def test_tokenizer() -> None:
    text = "KV café — ok"
    ids = encode(text)
    assert ids[:2] == [75, 86] and len(ids) == len(text.encode())
    assert all(0 <= t < VOCAB_SIZE for t in ids)
    assert decode(ids) == text
    assert decode(ids[:7], errors="replace").endswith("\ufffd")  # é cut in half
    with pytest.raises(UnicodeDecodeError):
        decode(ids[:7])
    with pytest.raises(TypeError, match="expected a str"):
        encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"token_ids\[1\]: expected a byte-level token id in \[0, 256\)"):
        decode([1, 256])
    with pytest.raises(TypeError, match="expected an int"):
        decode([1.0])  # type: ignore[list-item]


def test_progress_bar_only_on_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    bar = Progress(10, stream=stream, enabled=True, width=10)
    bar.update(5, "half")
    bar.println("a result line")
    bar.close()
    assert "\r\x1b[K[#####-----]  50%  half" in stream.getvalue()
    assert stream.getvalue().endswith("\r\x1b[K")
    assert capsys.readouterr().out == "a result line\n"
    quiet = io.StringIO()  # not a terminal: no bar
    bar = Progress(10, stream=quiet)
    bar.update(5, "half")
    bar.println("line")
    bar.close()
    assert quiet.getvalue() == ""
