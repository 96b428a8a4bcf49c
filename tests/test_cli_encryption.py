"""The CLI on an encrypted store: keygen, --key-file / TIERED_KV_KEY_FILE, --tenant,
stats and verify with and without keys, rekey (rotation, resumed run, killed with -9 and
run again), bad key files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("cryptography", reason="encryption needs the cryptography package")

from tiered_kv.cli import main  # noqa: E402

from _util import console_script  # noqa: E402


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def _warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """A store warmed once with the bundled prompts, sealed under k1 for tenant "acme"."""
    root = tmp_path_factory.mktemp("sealed")
    k1, k2 = str(root / "k1"), str(root / "k2")
    assert main(["keygen", k1]) == 0 and main(["keygen", k2]) == 0
    assert main(["keygen", k1]) == 1  # never overwritten
    store = root / "store"
    env = os.environ.pop("TIERED_KV_KEY_FILE", None)
    try:
        assert main(["warm-start", "--store", str(store), "--prompts", "bundled", "--salt", "acme",
                     "--key-file", k1, "--json"]) == 0
    finally:
        if env is not None:
            os.environ["TIERED_KV_KEY_FILE"] = env
    return store, k1, k2


@pytest.fixture
def sealed(_warmed, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str, str]:
    """A copy of the warmed store (each test may change it) and the two key files."""
    monkeypatch.delenv("TIERED_KV_KEY_FILE", raising=False)
    store, k1, k2 = _warmed
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    for key in (k1, k2):
        os.chmod(key, 0o600)  # (a test makes one group-readable)
    capsys.readouterr()
    return copy, k1, k2


def test_stats_and_verify_with_and_without_keys(sealed, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    store, k1, k2 = sealed
    assert main(["stats", "--store", str(store), "--json"]) == 0
    s = _json(capsys)
    assert s["encryption"]["encrypted"] is True and s["encryption"]["sampled_sealed"] == 16
    assert main(["stats", "--store", str(store), "--key-file", k1, "--tenant", "acme", "--json"]) == 0
    e = _json(capsys)["encryption"]
    assert e["sampled_by_key"] == {e["key_id"]: 16} and e["key_ids"] == [e["key_id"]]
    n = s["records"]
    # verify checks tags: the wrong tenant (default '') fails them all, exit 1, nothing removed
    assert main(["verify", "--store", str(store), "--key-file", k1, "--json"]) == 1
    r = _json(capsys)
    assert (r["authenticated"], r["auth_failures"], r["foreign"]) == (0, n, n)
    assert main(["verify", "--store", str(store), "--key-file", k1, "--repair", "--json"]) == 1
    assert _json(capsys)["auth_removed"] == 0  # another tenant's records are never removed
    monkeypatch.setenv("TIERED_KV_KEY_FILE", k1)
    assert main(["verify", "--store", str(store), "--tenant", "acme", "--json"]) == 0
    assert _json(capsys)["authenticated"] == n
    # the wrong key: the same as the wrong tenant
    assert main(["verify", "--store", str(store), "--key-file", k2, "--tenant", "acme"]) == 1
    assert "no record opened under the keys given" in capsys.readouterr().out


def test_rekey_rotates_and_a_second_run_finds_nothing_left(sealed, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    store, k1, k2 = sealed
    assert main(["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1, "--tenant", "acme",
                 "--batch", "5", "--json"]) == 0
    r = _json(capsys)
    n = r["checked"]
    assert n > 0 and (r["rekeyed"], r["current"], r["foreign"], r["failed"]) == (n, 0, 0, 0)
    assert r["old_key_ids"] and r["key_id"] not in r["old_key_ids"]
    # resumable: run again, everything is current; the list form of TIERED_KV_KEY_FILE
    monkeypatch.setenv("TIERED_KV_KEY_FILE", os.pathsep.join([k2, k1]))
    assert main(["rekey", "--store", str(store), "--old-key-file", k1, "--tenant", "acme", "--json"]) == 0
    r = _json(capsys)
    assert (r["rekeyed"], r["current"]) == (0, n)
    monkeypatch.delenv("TIERED_KV_KEY_FILE")
    assert main(["verify", "--store", str(store), "--key-file", k2, "--tenant", "acme", "--json"]) == 0
    assert _json(capsys)["key_records"] == {r["key_id"]: n}  # the old key can be retired
    # and a cache with the new key resumes from the rewritten records
    assert main(["warm-start", "--store", str(store), "--prompts", "bundled", "--salt", "acme",
                 "--key-file", k2, "--json"]) == 0
    report = _json(capsys)
    assert report["totals"]["cached_tokens"] > 0


def test_rekey_killed_mid_batch_then_run_again_loses_nothing(sealed, capsys) -> None:
    """``tiered-kv rekey`` killed (SIGKILL, at a failpoint) after removing its second
    batch and before writing it again: the batch is in the journal; run again, it is
    put back and every record ends under the new key."""
    store, k1, k2 = sealed
    assert main(["stats", "--store", str(store), "--json"]) == 0
    n = _json(capsys)["records"]
    args = ["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1, "--tenant", "acme",
            "--batch", "5", "--json"]
    env = {**os.environ, "TIERED_KV_FAILPOINT": "rekey-deleted:2"}
    proc = subprocess.run([console_script(), *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    journal = store / "rekey-journal"
    assert journal.is_file() and stat.S_IMODE(journal.stat().st_mode) == 0o600
    assert main(["stats", "--store", str(store), "--json"]) == 0  # (a plain open puts nothing back)
    assert _json(capsys)["records"] == n - 5
    assert main(args) == 0
    r = _json(capsys)
    assert (r["checked"], r["restored"], r["current"], r["rekeyed"], r["lost"]) == (n, 5, 10, n - 10, 0)
    assert r["journal"] == str(journal) and not journal.exists()
    assert main(["verify", "--store", str(store), "--key-file", k2, "--tenant", "acme", "--json"]) == 0
    v = _json(capsys)
    assert (v["checked"], v["authenticated"], v["key_records"]) == (n, n, {r["key_id"]: n})


def test_bad_key_options_are_usage_errors(sealed, capsys, tmp_path: Path) -> None:
    store, k1, k2 = sealed
    os.chmod(k1, 0o640)
    assert main(["stats", "--store", str(store), "--key-file", k1]) == 2
    assert "chmod 600" in capsys.readouterr().err
    assert main(["stats", "--store", str(store), "--key-file", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["stats", "--store", str(store), "--tenant", "acme"]) == 2
    assert "--tenant: expected --key-file" in capsys.readouterr().err
    os.chmod(k1, 0o600)
    assert main(["rekey", "--store", str(store), "--key-file", k1]) == 2  # rekey has no default tenant
    assert "--tenant: expected the tenant whose records to move (no default" in capsys.readouterr().err
    assert main(["rekey", "--store", str(store), "--key-file", k1, "--tenant", "acme", "--drop-old"]) == 2
    assert "--drop-old: expected --old-key-file" in capsys.readouterr().err
    rekey = ["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1, "--tenant", "acme"]
    assert main([*rekey, "--journal", str(tmp_path / "j")]) == 2
    assert "--journal: journal: expected None for a local store" in capsys.readouterr().err
    from tiered_kv.storage.encrypted.rekey_journal import RekeyJournal

    with RekeyJournal(store / "rekey-journal").holding(required=True):  # another rekey is running
        assert main(rekey) == 5
    assert "a rekey of this store is running in another process" in capsys.readouterr().err
