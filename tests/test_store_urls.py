"""One URL resolver: ``--store X`` and ``open_store(X)`` open the same backend, at the same
place, for every URL form docs/api.md and docs/cli.md name (storage/urls.py resolve)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiered_kv import presets
from tiered_kv.cli._common import parse_store
from tiered_kv.cli.main import ExitCode, main
from tiered_kv.storage import LmdbStore, ZarrStore, open_chain, open_store
from tiered_kv.storage.urls import resolve

FP = presets.tiny().fingerprint


def _cli_stats(capsys: pytest.CaptureFixture[str], *stores: str) -> dict:
    argv = ["stats"]
    for s in stores:
        argv += ["--store", s]
    code = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    return json.loads(out)


def _forms(tmp_path: Path) -> dict[str, tuple[str, str, Path]]:
    """form -> (what is typed, the backend, the directory), each store created first by
    what names it explicitly."""
    return {
        "lmdb:///abs": (f"lmdb://{tmp_path / 'a'}", "lmdb", tmp_path / "a"),
        "zarr:///abs": (f"zarr://{tmp_path / 'b'}", "zarr", tmp_path / "b"),
        "plain path, an LMDB store": (str(tmp_path / "c"), "lmdb", tmp_path / "c"),
        "plain path, a Zarr directory": (str(tmp_path / "d"), "zarr", tmp_path / "d"),
        "relative plain path": ("rel/e", "lmdb", tmp_path / "rel" / "e"),
        "relative after lmdb://": ("lmdb://rel/f", "lmdb", tmp_path / "rel" / "f"),
        "relative after zarr://": ("zarr://rel/g", "zarr", tmp_path / "rel" / "g"),
        "~ for the home directory": ("~/h", "lmdb", tmp_path / "home" / "h"),
    }


@pytest.mark.parametrize("form", list(_forms(Path("/x"))))
def test_store_option_and_open_store_open_the_same_backend(form: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    typed, backend, directory = _forms(tmp_path)[form]
    with open_store(f"{backend}://{directory}", layout_fingerprint=FP):  # the store is there
        pass

    target = resolve(typed)
    assert (target.scheme, Path(target.location)) == (backend, directory)
    loc = parse_store(typed)
    assert (loc.backend.value, loc.path, loc.url) == (backend, directory, target.url)
    with open_store(typed, layout_fingerprint=None) as store:
        assert type(store) is {"lmdb": LmdbStore, "zarr": ZarrStore}[backend]
        assert store.path == directory
        opened = store.stats()
    stats = _cli_stats(capsys, typed)
    assert (stats["backend"], stats["path"], stats["layout_fingerprint"]) == (opened["backend"], opened["path"], FP)
    with open_chain([typed], layout_fingerprint=None) as chain:  # (open_chain resolves the same way)
        assert chain.stats()["levels"][0]["where"] == opened["path"]


def test_a_new_plain_path_is_an_lmdb_store_and_a_zarr_directory_never_gets_one(tmp_path: Path) -> None:
    """The Zarr-directory decision: a plain path holding zarr.json opens as Zarr (no LMDB
    files are created in it); any other plain path opens (or creates) an LMDB store."""
    with open_store(tmp_path / "new", layout_fingerprint=FP) as s:
        assert isinstance(s, LmdbStore)
    with open_store(f"zarr://{tmp_path / 'z'}", layout_fingerprint=FP):
        pass
    with open_store(tmp_path / "z", layout_fingerprint=FP) as s:
        assert isinstance(s, ZarrStore)
    assert not (tmp_path / "z" / "data.mdb").exists()


@pytest.mark.parametrize(("typed", "match"), [
    ("", "expected lmdb:///abs/path"),
    ("s3://bucket/p", "got scheme 's3'"),
    ("lmdb://", r"expected a path after lmdb://"),
])
def test_bad_urls_are_refused_alike(typed: str, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=match):
        open_store(typed, layout_fingerprint=FP)
    code = main(["stats", "--store", typed])
    assert code == ExitCode.USAGE and "--store:" in capsys.readouterr().err


def test_an_object_store_url_resolves_alike(seaweedfs, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    seaweedfs.make_bucket("urls")
    url = seaweedfs.url("urls", "resolver")
    assert resolve(url).scheme == parse_store(url).backend.value == "zarr+s3"
    with open_store(url, layout_fingerprint=FP) as store:
        assert type(store) is ZarrStore
        where = store.stats()["path"]
    stats = _cli_stats(capsys, url)
    assert (stats["backend"], stats["path"]) == ("zarr+s3", where)
