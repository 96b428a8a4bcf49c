"""``tiered-kv prefetch``: a node warms its store from a shared one (a local Zarr directory,
and a SeaweedFS bucket). Source filled by ``warm-start``; in-process through ``main``."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tiered_kv import presets
from tiered_kv.cli.main import ExitCode, main
from tiered_kv.storage import LmdbStore, RecordKind, ZarrStore

TINY = presets.tiny()
PROMPTS = [
    {"id": "p1", "tokens": [(i * 7) % 256 for i in range(400)]},    # 3 full blocks
    {"id": "p2", "tokens": [(i * 7) % 256 for i in range(260)] + [1] * 40},  # shares 2 blocks with p1
    {"id": "p3", "tokens": [(i * 13) % 256 for i in range(140)]},   # 1 full block
]
SIZES = {RecordKind.BLOCK: TINY.block_bytes, RecordKind.SNAPSHOT: TINY.snapshot_bytes}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str, code: int = ExitCode.OK) -> dict:
    got, out, err = run_cli(capsys, *argv, "--json")
    assert got == code, err
    return json.loads(out)


def _payloads(store, keys) -> dict:
    out = {}
    for key in keys:
        buf = np.empty(SIZES[key.kind], np.uint8)
        assert store.get(key, buf) is not None
        out[key] = buf.tobytes()
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Zarr store filled by warm-start, its prompts file); do not modify the store."""
    root = tmp_path_factory.mktemp("prefetch")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["warm-start", "--store", f"zarr://{root / 'src'}", "--prompts", str(prompts)]) == 0
    return root / "src", prompts


def test_prefetch_prompts_copies_what_the_cache_would_hit_and_resumes(
        source: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, prompts = source
    dest = tmp_path / "node"
    ls_src = run_json(capsys, "ls", "--store", f"zarr://{src}", "--prompts", str(prompts))
    got = run_json(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(dest), "--prompts", str(prompts))
    with ZarrStore(src, layout_fingerprint=TINY.fingerprint) as s:
        everything = set(s)
        want = _payloads(s, everything)
    # p2 shares p1's first two blocks: every record of the source is hit by some prompt, once
    assert (got["wanted"], got["present"], got["copied"], got["corrupt"], got["absent"]) == \
        (len(everything), 0, len(everything), 0, 0)
    with LmdbStore(dest, layout_fingerprint=TINY.fingerprint) as d:
        assert set(d) == everything and _payloads(d, everything) == want
    ls_dest = run_json(capsys, "ls", "--store", str(dest), "--prompts", str(prompts))
    assert ls_dest["prompts"] == ls_src["prompts"] and ls_dest["prompts"][0]["cached_tokens"] == 384

    again = run_json(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(dest), "--prompts", str(prompts))
    assert (again["present"], again["copied"]) == (len(everything), 0)
    with LmdbStore(dest, layout_fingerprint=TINY.fingerprint) as d:   # a run stopped half-way
        dropped = sorted(d, key=lambda k: k.block_hash)[:3]
        for key in dropped:
            d.delete(key)
    resumed = run_json(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(dest), "--prompts", str(prompts))
    assert (resumed["present"], resumed["copied"]) == (len(everything) - 3, 3)

    # the warmed node serves the prompts from its own store: warm-start computes only the tails
    warm = run_json(capsys, "warm-start", "--store", str(dest), "--prompts", str(prompts))
    assert [p["cached_tokens"] for p in warm["prompts"]] == [384, 256, 128]
    assert warm["totals"]["records_written"] == 0


def test_prefetch_prompts_stops_at_the_first_block_the_source_lacks(
        source: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(PROMPTS[0]) + "\n")
    ls = run_json(capsys, "ls", "--store", f"zarr://{src}", "--prompts", str(one))
    assert ls["prompts"][0]["blocks_in_store"] == 3
    from tiered_kv.prefix import PrefixHasher
    from tiered_kv.storage import RecordKey

    hashes = PrefixHasher(TINY).block_hashes(PROMPTS[0]["tokens"])
    with ZarrStore(src, layout_fingerprint=TINY.fingerprint) as s:
        assert s.delete(RecordKey.block(hashes[1]))
    got = run_json(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(tmp_path / "n"), "--prompts", str(one))
    with LmdbStore(tmp_path / "n", layout_fingerprint=TINY.fingerprint) as d:
        assert set(d) == {RecordKey.block(hashes[0]), RecordKey.snapshot(hashes[0])} and got["copied"] == 2


def test_prefetch_skips_and_counts_corrupt_records(
        source: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    victim = sorted((src / "blocks").rglob("*"))[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(data)
    got = run_json(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(tmp_path / "n"),
                   "--prompts", str(source[1]), code=ExitCode.FAILURE)
    assert got["corrupt"] == 1 and got["copied"] == got["wanted"] - 1 and got["absent"] == 0
    code, _, err = run_cli(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(tmp_path / "m"),
                           "--prompts", str(source[1]))
    assert code == ExitCode.OK, err   # the bad record was removed from the source by the read


def test_prefetch_recent(source: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    with ZarrStore(src, layout_fingerprint=TINY.fingerprint) as s:
        keys = sorted(s, key=lambda k: k.block_hash)
        for key in keys[:4]:                       # these four are the most recently used
            s.get(key, np.empty(SIZES[key.kind], np.uint8))
        assert set(s.recent(4)) == set(keys[:4]) and s.recent(4)[0] == keys[3]
    got = run_json(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(tmp_path / "n"), "--recent", "4")
    assert (got["wanted"], got["copied"], got["selection"]) == (4, 4, "recent 4")
    with LmdbStore(tmp_path / "n", layout_fingerprint=TINY.fingerprint) as d:
        assert set(d) == set(keys[:4])


def test_prefetch_exit_codes(source: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src, prompts = source
    code, _, err = run_cli(capsys, "prefetch", "--from", str(tmp_path / "nope"), "--to", str(tmp_path / "n"),
                           "--prompts", str(prompts))
    assert code == ExitCode.STORE_MISSING and "no prefix-cache store" in err
    code, _, err = run_cli(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(tmp_path / "n"),
                           "--prompts", str(prompts), "--entry-format", "bf16", "--model", "tiny", "--indexer-bytes", "16")
    assert code == ExitCode.FOREIGN_LAYOUT, err
    code, _, err = run_cli(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(tmp_path / "n"))
    assert code == ExitCode.USAGE and "--prompts" in err
    code, _, err = run_cli(capsys, "prefetch", "--from", f"zarr://{src}", "--to", str(tmp_path / "n"),
                           "--prompts", str(prompts), "--recent", "3")
    assert code == ExitCode.USAGE
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["warm-start", "--store", str(tmp_path / "lmdb"), "--prompts", str(prompts)]) == 0
    code, _, err = run_cli(capsys, "prefetch", "--from", str(tmp_path / "lmdb"), "--to", str(tmp_path / "n"),
                           "--recent", "3")
    assert code == ExitCode.USAGE and "Zarr source" in err
    code, out, _ = run_cli(capsys, "prefetch", "--help")
    assert code == 0 and "exit codes" in out


@pytest.mark.s3
def test_prefetch_from_a_bucket(seaweedfs, source: tuple[Path, Path], tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    seaweedfs.make_bucket("prefetch")
    url = seaweedfs.url("prefetch", "fleet")
    src, prompts = source
    with ZarrStore(src, layout_fingerprint=TINY.fingerprint) as s, \
            ZarrStore(url, layout_fingerprint=TINY.fingerprint) as bucket:   # the fleet's bucket
        everything = set(s)
        want = _payloads(s, everything)
        from tiered_kv.storage import PutItem

        for key, payload in want.items():
            meta = s.get(key, np.empty(SIZES[key.kind], np.uint8))
            bucket.put(PutItem(key, meta.parent_hash, meta.token_digest, np.frombuffer(payload, np.uint8)))
    got = run_json(capsys, "prefetch", "--from", url, "--to", str(tmp_path / "n"), "--prompts", str(prompts))
    assert (got["wanted"], got["copied"], got["corrupt"]) == (len(everything), len(everything), 0)
    with LmdbStore(tmp_path / "n", layout_fingerprint=TINY.fingerprint) as d:
        assert _payloads(d, everything) == want
    recent = run_json(capsys, "prefetch", "--from", url, "--to", str(tmp_path / "m"), "--recent", "1000")
    assert (recent["wanted"], recent["copied"]) == (len(everything), len(everything))
    again = run_json(capsys, "prefetch", "--from", url, "--to", str(tmp_path / "m"), "--recent", "1000")
    assert (again["present"], again["copied"]) == (len(everything), 0)
