"""bench/disk.py and its peer drivers (bench/peers/) on tiny data: every contender reads back
the bytes written, a peer that cannot run is reported as not run (no figure), and the ratios
are ours over theirs. Not a timing test: no figure is compared with a threshold."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("write_gbps", "cold_read_gbps", "hot_read_gbps")
#: not a whole number of pages: vLLM's tier pads each chunk to pages, the others do not
PAYLOAD = 5000


@pytest.fixture(scope="module")
def disk():
    """bench/disk.py as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_disk", ROOT / "bench" / "disk.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_run(disk, tmp_path: Path, peers: dict[str, Path]) -> dict:
    workdir = tmp_path / "work"
    workdir.mkdir()
    return disk.run(4, 2, 1, workdir, payload_bytes=PAYLOAD, peers=peers)


def test_missing_peers_are_reported_not_run_without_a_figure(disk, tmp_path: Path) -> None:
    # vLLM: its venv's interpreter is missing; LMCache: the driver runs, but its import fails
    # (this venv has no lmcache).
    res = tiny_run(disk, tmp_path, {"vllm_fs": tmp_path / "no-venv" / "bin" / "python",
                                    "lmcache_disk": Path(sys.executable)})
    rows = res["rows"]
    assert "not found (make venv-vllm)" in rows["vllm_fs"]["not_run"]
    assert "lmcache" in rows["lmcache_disk"]["not_run"]
    for peer in ("vllm_fs", "lmcache_disk"):
        assert "median" not in rows[peer] and "runs" not in rows[peer]
        for ours in ("lmdb", "zarr"):
            assert res["ratios"][ours][peer] == f"not run: {rows[peer]['not_run']}"
    assert res["targets"]["lmcache_disk"]["verdict"] == "not measured"
    # our stores and the baselines ran, with one figure per metric and round
    for name in ("raw", "ceiling", "lmdb", "zarr"):
        assert len(rows[name]["runs"]) == 1 and all(rows[name]["median"][m] > 0 for m in METRICS)
    assert rows["lmdb_files"]["median"]["write_gbps"] is None  # reads only
    assert res["ratios"]["lmdb"]["raw"]["hot_read_gbps"] == pytest.approx(
        rows["lmdb"]["median"]["hot_read_gbps"] / rows["raw"]["median"]["hot_read_gbps"])
    text = disk.table(res)
    for peer in ("vllm_fs", "lmcache_disk"):
        (line,) = [ln for ln in text.splitlines() if ln.startswith(rows[peer]["label"])]
        assert line.split("not run: ")[0].strip() == rows[peer]["label"]  # no figure before it


def test_the_ceiling_is_its_fastest_raw_method(disk, tmp_path: Path) -> None:
    """Every raw write and cold-read method of the ceiling is measured each round (each
    read checked against the bytes written), and the ceiling's figures are those of the
    method with the highest median, which the table marks."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    res = disk.run(4, 2, 3, workdir, payload_bytes=PAYLOAD, peers={})
    row = res["rows"]["ceiling"]
    for key, methods, metric, chosen in (("write_methods", disk.CEILING_WRITES, "write_gbps", row["methods"]["write"]),
                                         ("cold_methods", disk.CEILING_READS, "cold_read_gbps", row["methods"]["cold"])):
        assert all(set(r[key]) == set(methods) and all(v > 0 for v in r[key].values()) for r in row["runs"])
        medians = {m: sorted(r[key][m] for r in row["runs"])[1] for m in methods}
        assert medians[chosen] == max(medians.values())
        assert [r[metric] for r in row["runs"]] == [r[key][chosen] for r in row["runs"]]
        assert row["median"][metric] == medians[chosen]
    text = disk.table(res)
    assert f" *write, {row['methods']['write']}" in text and f" *cold, {row['methods']['cold']}" in text
    assert "LMDB cold / ceiling, each round" in text


def test_ratios_and_targets_are_ours_over_theirs(disk) -> None:
    med = lambda w, c, h: {"write_gbps": w, "cold_read_gbps": c, "hot_read_gbps": h}  # noqa: E731
    rows = {
        "raw": {"kind": "baseline", "median": med(1.0, 2.0, 4.0)},
        "lmdb_files": {"kind": "baseline", "median": med(None, 2.0, 5.0)},
        "zarr_files": {"kind": "baseline", "median": med(None, 1.0, 1.0)},
        "lmcache_disk": {"kind": "peer", "median": med(2.0, 1.0, 3.0)},
        "vllm_fs": {"kind": "peer", "not_run": "gone"},
        "lmdb": {"kind": "ours", "median": med(1.5, 1.0, 3.0)},
    }
    r = disk.ratios(rows, "lmdb")
    assert set(r) == {"raw", "lmdb_files", "lmcache_disk", "vllm_fs"}  # not zarr's files, not ours
    assert r["raw"] == med(1.5, 0.5, 0.75)
    assert r["lmdb_files"] == med(None, 0.5, 0.6)
    assert r["lmcache_disk"] == med(0.75, 1.0, 1.0)
    assert r["vllm_fs"] == "not run: gone"
    t = disk.targets(rows)
    assert t["lmcache_disk"] == {"target": 1.0, "ratio": 1.0, "verdict": "meets"}
    assert t["lmdb_files"] == {"target": 0.8, "ratio": 0.6, "verdict": "misses"}


def _installed_peers() -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "bench" / "peers"))
    try:
        from peer_launch import PEERS
    finally:
        sys.path.remove(str(ROOT / "bench" / "peers"))
    return {p.name: p.python() for p in PEERS if p.python().exists()}


@pytest.mark.slow
def test_peer_drivers_measure_the_same_bytes(disk, tmp_path: Path) -> None:
    """Each peer whose venv exists (make venv-vllm, make venv-lmcache) runs a round through
    its own write and read calls; its driver compares what it read with the bytes written."""
    peers = _installed_peers()
    if not peers:
        pytest.skip("no peer venv here (make venv-vllm / make venv-lmcache)")
    res = tiny_run(disk, tmp_path, peers)
    for name in peers:
        row = res["rows"][name]
        assert "not_run" not in row, row.get("not_run")
        assert len(row["runs"]) == 1 and all(row["median"][m] > 0 for m in METRICS)
        assert row["durability"] and "no fsync" in row["durability"] and "no checksum" in row["durability"]
        assert all(isinstance(v, float) for v in res["ratios"]["lmdb"][name].values())
    assert "not run" not in disk.table(res)
