"""The CLI on encrypted levels with keyed names (issue 23): tenant key files
(``keygen --tenant --from``), rekey that cannot mislead (tenant required, a run that opens
nothing under the old key fails, ``--drop-old``, the migration of an earlier version's
store), ``ls`` / ``gc`` / ``sync`` given the key, and plain writers refused."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography", reason="encryption needs the cryptography package")

from tiered_kv.cli import main  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "storage"))
from encryption_helpers import write_legacy_level  # noqa: E402


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def _warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str, Path]:
    """A store warmed with the bundled prompts, sealed under master k1 for tenant "acme",
    and the same records plain (for a store of an earlier version)."""
    root = tmp_path_factory.mktemp("keyed")
    k1, k2 = str(root / "k1"), str(root / "k2")
    assert main(["keygen", k1]) == 0 and main(["keygen", k2]) == 0
    env = os.environ.pop("TIERED_KV_KEY_FILE", None)
    try:
        assert main(["warm-start", "--store", str(root / "store"), "--prompts", "bundled", "--salt", "acme",
                     "--key-file", k1, "--json"]) == 0
        assert main(["warm-start", "--store", str(root / "plain"), "--prompts", "bundled", "--salt", "acme",
                     "--json"]) == 0
    finally:
        if env is not None:
            os.environ["TIERED_KV_KEY_FILE"] = env
    return root / "store", k1, k2, root / "plain"


@pytest.fixture
def sealed(_warmed, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str, str]:
    monkeypatch.delenv("TIERED_KV_KEY_FILE", raising=False)
    store, k1, k2, _ = _warmed
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    capsys.readouterr()
    return copy, k1, k2


def _records(store: Path, capsys) -> int:
    assert main(["stats", "--store", str(store), "--json"]) == 0
    return _json(capsys)["records"]


def test_a_tenant_key_file_serves_its_tenant_and_no_other(sealed, capsys, tmp_path: Path) -> None:
    store, k1, _ = sealed
    acme = tmp_path / "acme.key"
    assert main(["keygen", "--tenant", "acme", "--from", k1, str(acme)]) == 0
    assert "tenant 'acme' key file" in capsys.readouterr().out
    assert stat.S_IMODE(acme.stat().st_mode) == 0o600
    n = _records(store, capsys)
    # the node holds the tenant file only: it reads the tenant's records, the tenant taken from the file
    assert main(["verify", "--store", str(store), "--key-file", str(acme), "--json"]) == 0
    assert _json(capsys)["authenticated"] == n
    assert main(["warm-start", "--store", str(store), "--prompts", "bundled", "--salt", "acme",
                 "--key-file", str(acme), "--json"]) == 0
    assert _json(capsys)["totals"]["cached_tokens"] > 0
    # and it cannot serve another tenant
    assert main(["verify", "--store", str(store), "--key-file", str(acme), "--tenant", "globex"]) == 2
    assert "a tenant key file of tenant 'acme'; it cannot serve tenant 'globex'" in capsys.readouterr().err
    assert main(["warm-start", "--store", str(store), "--prompts", "bundled", "--salt", "acme",
                 "--key-file", str(acme), "--tenant", "globex"]) == 2
    assert "cannot serve tenant 'globex'" in capsys.readouterr().err
    assert main(["keygen", "--tenant", "acme", str(tmp_path / "x.key")]) == 2
    assert "--tenant and --from: expected both" in capsys.readouterr().err
    assert main(["keygen", "--tenant", "acme", "--from", str(acme), str(tmp_path / "y.key")]) == 2
    assert "expected a master key" in capsys.readouterr().err


def test_rekey_needs_the_tenant_and_fails_when_it_opens_nothing_under_the_old_key(sealed, capsys) -> None:
    store, k1, k2 = sealed
    n = _records(store, capsys)
    assert main(["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1]) == 2
    assert "--tenant: expected the tenant" in capsys.readouterr().err
    # the wrong tenant: nothing opens, exit 1, and the old key must not be retired
    assert main(["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1, "--tenant", "acme-typo",
                 "--json"]) == 1
    out = capsys.readouterr()
    r = json.loads(out.out)
    assert (r["opened_old"], r["foreign"], r["rekeyed"]) == (0, n, 0)
    assert "no record opened under the old key(s)" in out.err and "do not retire the old key" in out.err
    # the right tenant: every record moved; a rerun opens none under the old key but finds the rotation done
    assert main(["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1, "--tenant", "acme",
                 "--json"]) == 0
    assert _json(capsys)["rekeyed"] == n
    assert main(["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1, "--tenant", "acme",
                 "--json"]) == 0
    assert (lambda r: (r["opened_old"], r["current"]))(_json(capsys)) == (0, n)


def test_rekey_drop_old_deletes_instead_of_laundering(sealed, capsys) -> None:
    store, k1, k2 = sealed
    n = _records(store, capsys)
    assert main(["rekey", "--store", str(store), "--key-file", k2, "--old-key-file", k1, "--tenant", "acme",
                 "--drop-old", "--json"]) == 0
    r = _json(capsys)
    assert (r["dropped"], r["rekeyed"], r["drop_old"]) == (n, 0, True)
    assert _records(store, capsys) == 0


def test_an_earlier_versions_store_is_refused_then_migrated_by_rekey(_warmed, tmp_path: Path, capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The records of a plain store rewritten as an earlier release's encrypted store held
    them (version-1 envelopes, unkeyed names): the CLI refuses it naming rekey; rekey with
    the same key migrates it; a cache then resumes from it."""
    from tiered_kv import presets
    from tiered_kv.storage import LmdbStore, PutItem, open_store

    monkeypatch.delenv("TIERED_KV_KEY_FILE", raising=False)
    _, k1, _, plain = _warmed
    layout = presets.tiny()
    old = tmp_path / "old"
    items = []
    with open_store(f"lmdb://{plain}", layout_fingerprint=layout.fingerprint, readonly=True) as src:
        for key in src:
            out = np.empty(src.payload_sizes([key])[0], np.uint8)
            m = src.get(key, out)
            items.append(PutItem(key, m.parent_hash, m.token_digest, out))
    with LmdbStore(old, layout_fingerprint=layout.fingerprint) as dst:
        write_legacy_level(dst, k1, "acme", items)
    capsys.readouterr()
    assert main(["stats", "--store", str(old), "--key-file", k1, "--tenant", "acme"]) == 2
    assert "earlier version of tiered_kv" in capsys.readouterr().err
    assert main(["rekey", "--store", str(old), "--key-file", k1, "--tenant", "acme", "--json"]) == 0
    r = _json(capsys)
    assert (r["migrated"], r["opened_old"], r["failed"]) == (len(items), len(items), 0)
    assert main(["verify", "--store", str(old), "--key-file", k1, "--tenant", "acme", "--json"]) == 0
    v = _json(capsys)
    assert (v["authenticated"], v["legacy"]) == (len(items), 0)
    assert main(["warm-start", "--store", str(old), "--prompts", "bundled", "--salt", "acme", "--key-file", k1,
                 "--json"]) == 0
    assert _json(capsys)["totals"]["cached_tokens"] > 0


def test_ls_and_gc_on_keyed_names(sealed, capsys, tmp_path: Path) -> None:
    store, k1, _ = sealed
    assert main(["ls", "--store", str(store), "--prompts", "bundled", "--salt", "acme"]) == 2
    assert "is an encrypted store: its records are under keyed names" in capsys.readouterr().err
    assert main(["ls", "--store", str(store), "--prompts", "bundled", "--salt", "acme", "--key-file", k1,
                 "--json"]) == 0
    rows = _json(capsys)["prompts"]
    assert all(r["blocks_in_store"] == r["full_blocks"] for r in rows) and any(r["resume_points"] for r in rows)
    assert main(["gc", "--store", str(store), "--max-bytes", "0", "--key-file", k1, "--tenant", "acme",
                 "--json"]) == 0
    assert _json(capsys)["records"] == 0


def test_gc_of_an_encrypted_level_with_owed_uploads_needs_the_key(tmp_path: Path, capsys) -> None:
    """An encrypted level 0 whose journal owes uploads: the journal names record keys, the
    store evicts keyed names, so gc without the key cannot tell what to keep: refused; with
    it, the owed records are kept."""
    from storage_helpers import FP, item_for, make_key

    from tiered_kv.storage import StoreChain, ZarrStore, open_store
    from tiered_kv.storage.encrypted.crypto import write_key_file

    key = tmp_path / "k"
    write_key_file(key)
    enc = {"key_files": [str(key)], "tenant": "acme"}
    near = open_store(f"lmdb://{tmp_path / 'near'}", layout_fingerprint=FP, encryption=enc)
    far = ZarrStore(tmp_path / "far", layout_fingerprint=FP)
    far.put_many = lambda items: (_ for _ in ()).throw(ConnectionError("far level down (test)"))  # type: ignore
    chain = StoreChain([near, far], close_timeout_s=0.5, owned=[True, True])
    chain.put_many([item_for(make_key(i), 5000) for i in range(4)])
    chain.close()
    capsys.readouterr()
    assert main(["gc", "--store", str(tmp_path / "near"), "--max-bytes", "0"]) == 2
    assert "upload journal owes 4 uploads" in capsys.readouterr().err
    assert main(["gc", "--store", str(tmp_path / "near"), "--max-bytes", "0", "--key-file", str(key),
                 "--tenant", "acme", "--json"]) == 0
    r = _json(capsys)
    assert (r["evicted"], r["records"], r["journaled_uploads"]) == (0, 4, 4)


def test_sync_to_a_sealed_level_without_the_key_is_refused(sealed, capsys, tmp_path: Path) -> None:
    store, k1, _ = sealed
    shared = tmp_path / "shared"
    assert main(["sync", "--store", str(store), "--shared", f"zarr://{shared}", "--key-file", k1, "--tenant", "acme",
                 "--encrypt-local", "--json"]) == 0
    r = _json(capsys)
    assert r["done"] and r["queued"] == r["local_records"] > 0
    # the same again: the shared level's listing is of keyed names, compared by name: nothing owed
    assert main(["sync", "--store", str(store), "--shared", f"zarr://{shared}", "--key-file", k1, "--tenant", "acme",
                 "--encrypt-local", "--json"]) == 0
    assert (lambda r: (r["queued"], r["present"]))(_json(capsys)) == (0, r["local_records"])
    plain = tmp_path / "plain-local"
    assert main(["warm-start", "--store", str(plain), "--prompts", "bundled", "--json"]) == 0
    capsys.readouterr()
    assert main(["sync", "--store", str(plain), "--shared", f"zarr://{shared}"]) == 2
    assert "this level is encrypted" in capsys.readouterr().err
