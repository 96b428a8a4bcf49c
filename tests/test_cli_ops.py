"""Operator commands on a store filled by ``warm-start``: ``stats``, ``verify [--repair]``,
``gc``, ``ls``, and the documented exit codes (3 missing, 4 foreign layout, 5 locked, 2 bad
arguments). In-process through ``tiered_kv.cli.main.main``; tiny layout, short prompts."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import lmdb
import pytest

from tiered_kv import presets
from tiered_kv.cli.main import ExitCode, command_modules, main
from tiered_kv.storage import LmdbStore, RecordKind

from _util import lmdb_raw_read, lmdb_raw_write

TINY_FP = presets.tiny().fingerprint
PROMPTS = [
    {"id": "p1", "text": "The prefix cache keeps 128-token blocks. " * 8},                    # 328
    {"id": "p2", "text": "The prefix cache keeps 128-token blocks. " * 7 + "Then it diverges."},  # 304
    {"id": "p3", "tokens": [(i * 11) % 256 for i in range(140)]},
]
STORE_COMMANDS = ["stats", "verify", "gc", "ls"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == ExitCode.OK, err
    return json.loads(out)


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """(store dir, prompts file, the second warm-start's JSON report); do not modify the store."""
    root = tmp_path_factory.mktemp("ops")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    store = root / "store"
    for _ in range(2):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):  # (capsys is function-scoped)
            assert main(["warm-start", "--store", str(store), "--prompts", str(prompts), "--json"]) == 0
    return store, prompts, json.loads(out.getvalue())


@pytest.fixture()
def store_copy(filled: tuple[Path, Path, dict], tmp_path: Path) -> Path:
    """A private copy of the filled store, for commands that change it."""
    dst = tmp_path / "store"
    shutil.copytree(filled[0], dst)
    return dst


def _open_readonly(path: Path) -> LmdbStore:
    return LmdbStore(path, layout_fingerprint=TINY_FP, readonly=True)


# ----------------------------------------------------------------------------- stats
def test_stats_matches_the_store(filled: tuple[Path, Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    store_dir = filled[0]
    s = run_json(capsys, "stats", "--store", str(store_dir))
    with _open_readonly(store_dir) as store:
        direct = store.stats()
        kinds = [k.kind for k in store]
    assert s["store"] == f"lmdb://{store_dir}" and s["layout_fingerprint"] == TINY_FP
    assert s["records"] == direct["records"] == len(kinds) > 0
    assert s["bytes"] == direct["bytes"] > 0
    assert s["blocks"] == kinds.count(RecordKind.BLOCK) and s["snapshots"] == kinds.count(RecordKind.SNAPSHOT)
    assert s["blocks"] + s["snapshots"] == s["records"]
    for key in ("hits", "misses", "corrupt", "evictions"):
        assert s[key] == 0  # counters of the store object the command opened
    assert s["oldest_access_ns"] == direct["oldest_access_ns"] <= s["newest_access_ns"]
    assert s["oldest_access"].endswith("Z") and s["newest_access"] >= s["oldest_access"]
    assert filled[2]["totals"]["records"] == s["records"]
    # payload bytes by kind: what the snapshot policy costs on the store
    layout = presets.tiny()
    assert s["block_bytes"] == s["blocks"] * layout.block_bytes
    assert s["snapshot_bytes"] == s["snapshots"] * layout.snapshot_bytes > 0
    assert s["snapshot_block_ratio"] == round(s["snapshot_bytes"] / s["block_bytes"], 4)


def test_stats_table(filled: tuple[Path, Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "stats", "--store", f"lmdb://{filled[0]}")
    assert code == 0 and err == ""
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    with _open_readonly(filled[0]) as store:
        n, nbytes = len(store), store.stats()["bytes"]
    assert rows["records"][0] == str(n) and rows["bytes"][0] == str(nbytes)
    assert rows["layout_fingerprint"][0] == TINY_FP
    for key in ("hits", "misses", "corrupt", "evictions", "oldest_access", "newest_access"):
        assert key in rows
    layout = presets.tiny()
    blocks, snaps = int(rows["records"][1]), int(rows["records"][3])  # "N blocks, M snapshots"
    assert rows["block_bytes"][0] == str(blocks * layout.block_bytes)
    assert rows["snapshot_bytes"][0] == str(snaps * layout.snapshot_bytes)
    assert f"{snaps * layout.snapshot_bytes / (blocks * layout.block_bytes):.3f} of the block bytes" in out


# ----------------------------------------------------------------------------- verify
def _corrupt_one_record(path: Path) -> str:
    """Flip one payload byte of the first record, straight in LMDB; returns its key as
    ``verify`` names it."""
    env = lmdb.open(str(path), max_dbs=4, subdir=True, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            key = bytes(next(iter(txn.cursor(db=env.open_db(b"records", txn=txn, create=False))))[0])
    finally:
        env.close()
    value = bytearray(lmdb_raw_read(path, key))
    value[len(value) // 2] ^= 0xFF  # a payload byte, in the segment file
    lmdb_raw_write(path, key, bytes(value))
    kind = "block" if key[0] == RecordKind.BLOCK else "snapshot"
    return f"{kind}:{bytes(key[1:]).hex()}"


def test_verify_clean_store(filled: tuple[Path, Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, "verify", "--store", str(filled[0]))
    with _open_readonly(filled[0]) as store:
        n = len(store)
    assert (r["checked"], r["corrupt"], r["removed"], r["corrupt_keys"]) == (n, 0, 0, [])
    code, out, _ = run_cli(capsys, "verify", "--store", str(filled[0]))
    assert code == 0 and f"checked {n} records, 0 corrupt" in out


def test_verify_finds_then_repairs_corruption(store_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with _open_readonly(store_copy) as store:
        n = len(store)
    bad = _corrupt_one_record(store_copy)

    code, out, _ = run_cli(capsys, "verify", "--store", str(store_copy), "--json")
    r = json.loads(out)
    assert code == ExitCode.FAILURE
    assert (r["checked"], r["corrupt"], r["removed"], r["corrupt_keys"]) == (n, 1, 0, [bad])
    code, out, _ = run_cli(capsys, "verify", "--store", str(store_copy))
    assert code == ExitCode.FAILURE and bad in out and "--repair" in out
    with _open_readonly(store_copy) as store:
        assert len(store) == n  # without --repair nothing is removed

    r = run_json(capsys, "verify", "--store", str(store_copy), "--repair")
    assert (r["corrupt"], r["removed"], r["corrupt_keys"]) == (1, 1, [bad])
    r = run_json(capsys, "verify", "--store", str(store_copy))
    assert (r["checked"], r["corrupt"]) == (n - 1, 0)


# ----------------------------------------------------------------------------- gc
def test_gc_shrinks_to_the_bound(store_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = run_json(capsys, "stats", "--store", str(store_copy))
    bound = before["bytes"] // 2
    r = run_json(capsys, "gc", "--store", str(store_copy), "--max-bytes", str(bound))
    assert r["max_bytes"] == bound and r["evicted"] > 0
    assert r["bytes"] <= bound and r["freed_bytes"] == before["bytes"] - r["bytes"]
    after = run_json(capsys, "stats", "--store", str(store_copy))
    assert (after["bytes"], after["records"]) == (r["bytes"], r["records"])
    assert after["records"] == before["records"] - r["evicted"]

    code, out, _ = run_cli(capsys, "gc", "--store", str(store_copy), "--max-bytes", "0")
    assert code == 0 and "evicted" in out
    assert run_json(capsys, "stats", "--store", str(store_copy))["records"] == 0


def test_gc_size_suffixes(store_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, "gc", "--store", str(store_copy), "--max-bytes", "64k")
    assert r["max_bytes"] == 65536 and r["bytes"] <= 65536


# ----------------------------------------------------------------------------- ls
def test_ls_agrees_with_the_warm_run(filled: tuple[Path, Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    store_dir, prompts, report = filled
    r = run_json(capsys, "ls", "--store", str(store_dir), "--prompts", str(prompts))
    assert r["layout_fingerprint"] == TINY_FP and r["salt"] == ""
    got = {p["id"]: p for p in r["prompts"]}
    for warm in report["prompts"]:
        row = got[warm["id"]]
        assert row["cached_tokens"] == warm["cached_tokens"] > 0
        assert row["tokens"] == warm["tokens"]
        assert row["resume_points"] == [128 * k for k in range(1, row["tokens"] // 128 + 1)]
        assert row["blocks_in_store"] == row["full_blocks"] == row["tokens"] // 128
    code, out, _ = run_cli(capsys, "ls", "--store", str(store_dir), "--prompts", str(prompts))
    assert code == 0
    assert next(line for line in out.splitlines() if line.startswith("p1")).split()[1:] == \
        ["328", "2/2", "256", "128", "256"]


def test_ls_other_salt_finds_nothing(filled: tuple[Path, Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, "ls", "--store", str(filled[0]), "--prompts", str(filled[1]), "--salt", "tenant-x")
    assert all(p["cached_tokens"] == 0 and p["resume_points"] == [] for p in r["prompts"])


def test_ls_after_gc_sees_fewer_resume_points(store_copy: Path, filled: tuple[Path, Path, dict],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    run_json(capsys, "gc", "--store", str(store_copy), "--max-bytes", "0")
    r = run_json(capsys, "ls", "--store", str(store_copy), "--prompts", str(filled[1]))
    assert all(p["blocks_in_store"] == 0 and p["cached_tokens"] == 0 for p in r["prompts"])


# ----------------------------------------------------------------------------- exit codes
def _args(command: str, store: str, prompts: Path) -> list[str]:
    extra = {"gc": ["--max-bytes", "1M"], "ls": ["--prompts", str(prompts)]}.get(command, [])
    return [command, "--store", store, *extra]


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_missing_store_exits_3(command: str, tmp_path: Path, filled: tuple[Path, Path, dict],
                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nothing-here"
    code, out, err = run_cli(capsys, *_args(command, str(missing), filled[1]))
    assert code == ExitCode.STORE_MISSING and out == ""
    assert f"tiered-kv {command}: error: no prefix-cache store at {missing}" in err
    assert not missing.exists()  # looking does not create it


@pytest.mark.parametrize("command", [*STORE_COMMANDS, "warm-start"])
def test_foreign_layout_exits_4(command: str, filled: tuple[Path, Path, dict],
                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = _args(command, str(filled[0]), filled[1])
    if command == "warm-start":
        argv += ["--prompts", str(filled[1])]
    code, out, err = run_cli(capsys, *argv, "--entry-format", "bf16")
    bf16_fp = presets.tiny(entry_format="bf16").fingerprint
    assert code == ExitCode.FOREIGN_LAYOUT and out == ""
    assert TINY_FP in err and bf16_fp in err  # both fingerprints named
    assert "written with --model tiny" in err


def test_foreign_model_exits_4(filled: tuple[Path, Path, dict], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "stats", "--store", str(filled[0]), "--model", "deepseek-v4-flash")
    assert code == ExitCode.FOREIGN_LAYOUT
    assert TINY_FP in err and presets.deepseek_v4_flash().fingerprint in err


@pytest.mark.parametrize("command", [*STORE_COMMANDS, "warm-start"])
def test_locked_store_exits_5(command: str, filled: tuple[Path, Path, dict],
                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = _args(command, str(filled[0]), filled[1])
    if command == "warm-start":
        argv += ["--prompts", str(filled[1])]
    with LmdbStore(filled[0], layout_fingerprint=TINY_FP):  # this process holds the store
        code, out, err = run_cli(capsys, *argv)
    assert code == ExitCode.STORE_LOCKED and out == ""
    assert "store is locked" in err
    assert run_cli(capsys, "stats", "--store", str(filled[0]))[0] == 0  # released


BAD_ARGS = [
    (["gc", "--store", "{store}"], "--max-bytes"),
    (["gc", "--store", "{store}", "--max-bytes", "1.5G"], "size"),
    (["gc", "--store", "{store}", "--max-bytes", "-1"], "size"),
    (["stats", "--store", "s3://bucket/kv"], "scheme 's3'"),
    (["stats", "--store", "{store}", "--model", "gpt"], "invalid choice"),
    (["stats", "--store", "{store}", "--indexer-bytes", "0"], "positive integer"),
    (["stats", "--store", "{store}", "--block-tokens", "100"], "block_tokens"),
    (["stats", "--store", "{store}", "--model", "tiny", "--entry-format", "fp8"], "fp8"),
    (["stats", "--store", "{prompts}"], "expected a store directory"),
    (["verify", "--store", "{store}", "--repiar"], "unrecognized arguments"),
    (["ls", "--store", "{store}"], "--prompts"),
    (["stats"], "--store"),
    (["warm-start", "--store", "{store}", "--prompts", "{prompts}", "--max-bytes", "0"], "positive size"),
    (["warm-start", "--store", "{store}", "--prompts", "{prompts}", "--device", "tpu"], "--device"),
    # the OS takes no infinite timeout: a finite one, named in the message
    (["warm-start", "--endpoint", "http://127.0.0.1:1", "--prompts", "{prompts}", "--timeout", "inf"],
     "--timeout: expected a finite number of seconds > 0"),
    (["sync", "--store", "{store}", "--shared", "{store}-shared", "--timeout", "inf"],
     "--timeout: expected a finite number of seconds > 0"),
    (["sync", "--store", "{store}", "--shared", "{store}-shared", "--timeout", "nan"], "--timeout"),
    (["sync", "--store", "{store}", "--shared", "{store}-shared", "--timeout", "-1"], "--timeout"),
]


@pytest.mark.parametrize("argv, message", BAD_ARGS)
def test_bad_arguments_exit_2(argv: list[str], message: str, filled: tuple[Path, Path, dict],
                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(store=filled[0], prompts=filled[1]) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == ExitCode.USAGE and out == ""
    assert message in err


@pytest.mark.parametrize("line, message", [
    ('{"id": "x", "text": "\\ud800"}', "text: expected valid Unicode text, got a lone surrogate U+D800"),
    ('{"id": "x", "tokens": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply"),
])
def test_ls_bad_prompt_text_exits_2(line: str, message: str, filled: tuple[Path, Path, dict], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(line + "\n")
    code, out, err = run_cli(capsys, "ls", "--store", str(filled[0]), "--prompts", str(prompts))
    assert code == ExitCode.USAGE and out == ""
    assert err == f"tiered-kv ls: error: --prompts {prompts} line 1: {err.split(' line 1: ', 1)[1]}"
    assert message in err and err.count("\n") == 1  # one line, no traceback


def test_commands_are_registered_and_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    names = {m.__name__.rsplit(".", 1)[1] for m in command_modules()}
    assert {"warm_start", "stats", "verify", "gc", "ls", "plan"} <= names
    assert not any(n.startswith("_") for n in names)
    for command in ("warm-start", *STORE_COMMANDS):
        code, out, _ = run_cli(capsys, command, "--help")
        assert code == 0 and "--store" in out and "exit codes" in out


@pytest.mark.s3
def test_operator_commands_on_a_bucket(seaweedfs, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    """warm-start, stats, verify, gc and ls take a zarr+s3:// URL too."""
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    seaweedfs.make_bucket("cli-ops")
    url = seaweedfs.url("cli-ops", "fleet-a")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "tokens": list(range(200))}) + "\n")
    code, _, err = run_cli(capsys, "stats", "--store", url)
    assert code == ExitCode.STORE_MISSING, err
    first = run_json(capsys, "warm-start", "--store", url, "--prompts", str(prompts), "--json")
    assert first["prompts"][0]["cached_tokens"] == 0
    stats = run_json(capsys, "stats", "--store", url, "--json")
    assert stats["records"] >= 2
    verify = run_json(capsys, "verify", "--store", url, "--json")
    assert verify["checked"] == stats["records"] and verify["corrupt"] == 0
    ls = run_json(capsys, "ls", "--store", url, "--prompts", str(prompts), "--json")
    assert ls["prompts"][0]["cached_tokens"] == 128
    gc = run_json(capsys, "gc", "--store", url, "--max-bytes", "0", "--json")
    assert gc["records"] == 0
    code, _, err = run_cli(capsys, "stats", "--store", "zarr+s3://cli-ops/x?endpoint=ftp://nope")
    assert code == ExitCode.USAGE and "--store" in err


def test_sync_uploads_what_the_shared_store_lacks(capsys, tmp_path: Path) -> None:
    """sync lists both stores and uploads the local records the shared one lacks."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "tokens": [i % 256 for i in range(300)]}) + "\n")
    local, shared = tmp_path / "local", f"zarr://{tmp_path / 'shared'}"
    run_json(capsys, "warm-start", "--store", str(local), "--prompts", str(prompts))
    records = run_json(capsys, "stats", "--store", str(local))["records"]
    first = run_json(capsys, "sync", "--store", str(local), "--shared", shared)
    assert first["local_records"] == records and first["queued"] == records and first["done"]
    assert run_json(capsys, "stats", "--store", shared)["records"] == records
    again = run_json(capsys, "sync", "--store", str(local), "--shared", shared)
    assert (again["queued"], again["present"]) == (0, records)
    code, _, err = run_cli(capsys, "sync", "--store", str(tmp_path / "nope"), "--shared", shared)
    assert code == ExitCode.STORE_MISSING
