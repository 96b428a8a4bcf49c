"""The operator commands open any store with no layout option (issue 16, item 4): stores
written in the vLLM adapter's and the SGLang adapter's formats (their fingerprints, keys
and, for SGLang, pages of several sizes), on LMDB, Zarr, a SeaweedFS bucket and a chain;
every store records its writer (kind, model, a hash of the tenant, never the tenant) and
``stats`` shows it.

The engines are not needed: a store is written through the store API exactly as each
adapter writes it (tiered_kv/integrations/vllm.py and sglang.py: fingerprint format, key
mapping, record fields, writer record), by the helpers below.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tiered_kv import TieredKVCache, presets
from tiered_kv.cli.main import ExitCode, main
from tiered_kv.storage import (
    PutItem,
    RecordKey,
    StoreError,
    StoreWriter,
    WriterKind,
    open_store,
    tenant_hash,
)
from tiered_kv.storage.chain.journal import UploadJournal


@dataclass(frozen=True)
class EngineStore:
    """How one adapter writes its store."""

    kind: WriterKind
    fingerprint: str
    model: str
    tenant: str
    #: payload bytes of the records, cycled (SGLang: pages of several pools)
    sizes: tuple[int, ...]

    @property
    def writer(self) -> StoreWriter:
        return StoreWriter.of(self.kind, model=self.model, tenant=self.tenant)

    def items(self, n: int) -> list[PutItem]:
        """``n`` records keyed and filled as the adapter does."""
        tag = b"tiered_kv.vllm.v1" if self.kind is WriterKind.VLLM else b"tiered_kv.sglang.v1"
        root = hashlib.sha256(b"\0".join([tag, self.model.encode(), self.tenant.encode(),
                                          self.fingerprint.encode()])).digest()
        out = []
        for i in range(n):
            engine_key = hashlib.sha256(b"engine block %d" % i).digest() + i.to_bytes(4, "little")
            rng = np.random.default_rng(i)
            out.append(PutItem(RecordKey.block(hashlib.sha256(root + engine_key).digest()), root,
                               hashlib.sha256(b"vllm.offload_key\0" + engine_key).digest(),
                               rng.integers(0, 256, self.sizes[i % len(self.sizes)], dtype=np.uint8)))
        return out


#: vLLM: "vllm-" + 27 hex digits of the chunk format's hash; one chunk size
VLLM = EngineStore(WriterKind.VLLM, "vllm-" + hashlib.sha256(b"chunk format").hexdigest()[:27],
                   "meta-llama/Llama-3.1-8B-Instruct", "team-a", (4096,))
#: SGLang: one fingerprint for any model; pages of a KV pool and of a smaller indexer pool
SGLANG = EngineStore(WriterKind.SGLANG, "sglang-hicache-v1", "deepseek-ai/DeepSeek-V4-Flash", "team-b",
                     (6144, 1056))
ENGINES = {"vllm": VLLM, "sglang": SGLANG}
N = 12


def write_engine_store(url: str, engine: EngineStore, n: int = N) -> list[PutItem]:
    items = engine.items(n)
    with open_store(url, layout_fingerprint=engine.fingerprint, writer=engine.writer) as store:
        assert store.put_many(items) == [True] * n
    return items


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str, code: int = ExitCode.OK) -> dict:
    got, out, err = cli(capsys, *argv, "--json")
    assert got == code, err
    return json.loads(out)


def assert_writer(recorded: dict | None, engine: EngineStore) -> None:
    assert recorded is not None
    assert (recorded["writer"], recorded["model"]) == (engine.kind.value, engine.model)
    assert recorded["tenant_sha256"] == tenant_hash(engine.tenant) and engine.tenant not in json.dumps(recorded)


# ------------------------------------------------------------------ stats / verify / gc
@pytest.mark.parametrize("backend", ["lmdb", "zarr"])
@pytest.mark.parametrize("engine_name", sorted(ENGINES))
def test_stats_verify_gc_on_an_engine_store_without_a_layout(engine_name: str, backend: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    engine = ENGINES[engine_name]
    url = f"{backend}://{tmp_path / 'store'}"
    items = write_engine_store(url, engine)

    stats = cli_json(capsys, "stats", "--store", url)
    assert (stats["layout_fingerprint"], stats["records"], stats["blocks"]) == (engine.fingerprint, N, N)
    # an engine's records are blocks (pages, chunks): its snapshot bytes are 0
    assert (stats["block_bytes"], stats["snapshot_bytes"], stats["snapshot_block_ratio"]) == (
        sum(item.payload.nbytes for item in items), 0, 0.0)
    assert stats["model"] is None  # no tiered_kv preset has this layout
    assert_writer(stats["writer"], engine)
    code, table, err = cli(capsys, "stats", "--store", url)
    assert code == 0 and err == "" and engine.tenant not in table
    assert {"vllm": "vLLM adapter", "sglang": "SGLang adapter"}[engine_name] in table and engine.model in table

    verify = cli_json(capsys, "verify", "--store", url)
    assert (verify["checked"], verify["corrupt"], verify["removed"]) == (N, 0, 0)

    half = stats["bytes"] // 2
    gc = cli_json(capsys, "gc", "--store", url, "--max-bytes", str(half))
    assert gc["evicted"] > 0 and gc["bytes"] <= half and gc["records"] == N - gc["evicted"]
    with open_store(url, layout_fingerprint=engine.fingerprint) as store:  # what is left reads back exactly
        for item in items:
            out = np.empty(item.payload.nbytes, np.uint8)
            if store.get(item.key, out, token_digest=item.token_digest) is not None:
                np.testing.assert_array_equal(out, item.payload)

    # a layout option checks the store's: a tiered_kv preset is not an engine's layout
    code, out, err = cli(capsys, "stats", "--store", url, "--model", "tiny")
    assert code == ExitCode.FOREIGN_LAYOUT and engine.fingerprint in err and out == ""
    code, _, err = cli(capsys, "ls", "--store", url, "--prompts", "bundled")
    assert code == ExitCode.USAGE and "not a tiered_kv preset" in err


def test_a_cache_records_its_writer_and_stats_shows_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"lmdb://{tmp_path / 'store'}"
    with TieredKVCache(presets.tiny(), store=url, salt="tenant-secret", model_id="tiny-v2"):
        pass
    stats = cli_json(capsys, "stats", "--store", url)
    assert stats["model"] == "tiny" and stats["writer"]["writer"] == "tiered_kv-cache"
    assert stats["writer"]["model"] == "tiny-v2" and stats["writer"]["tenant_sha256"] == tenant_hash("tenant-secret")
    code, table, _ = cli(capsys, "stats", "--store", url)
    assert "tiered_kv cache, model tiny-v2" in table and "tenant-secret" not in table


# ------------------------------------------------------------------ chain
def test_stats_verify_gc_on_a_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    near, far = f"lmdb://{tmp_path / 'near'}", f"zarr://{tmp_path / 'far'}"
    items = write_engine_store(near, VLLM)
    write_engine_store(far, VLLM, n=N // 2)  # the bucket holds half of them
    stats = cli_json(capsys, "stats", "--store", near, "--store", far)
    assert stats["store"] == [near, far] and stats["layout_fingerprint"] == VLLM.fingerprint
    assert [level["records"] for level in stats["levels"]] == [N, N // 2]
    assert_writer(stats["levels"][1]["writer"], VLLM)
    code, table, _ = cli(capsys, "stats", "--store", near, "--store", far)
    assert code == 0 and "level1" in table and "vLLM adapter" in table

    verify = cli_json(capsys, "verify", "--store", near, "--store", far)
    assert verify["checked"] == N + N // 2 and verify["corrupt"] == 0

    # gc collects level 0 only, and keeps what the upload journal still owes a far level
    owed = [item.key for item in items[:3]]
    with UploadJournal(tmp_path / "near") as journal:
        journal.add(["zarr+s3://fleet/kv"], [(key, 4096) for key in owed])
    gc = cli_json(capsys, "gc", "--store", near, "--store", far, "--max-bytes", "0")
    assert (gc["evicted"], gc["records"], gc["journaled_uploads"]) == (N - 3, 3, 3)
    with open_store(near, layout_fingerprint=None) as store:
        assert set(store) == set(owed)
    with open_store(far, layout_fingerprint=None) as store:
        assert len(store) == N // 2

    # a chain of two layouts is refused, naming both
    other = f"zarr://{tmp_path / 'other'}"
    write_engine_store(other, SGLANG, n=1)
    code, _, err = cli(capsys, "stats", "--store", near, "--store", other)
    assert code == ExitCode.FOREIGN_LAYOUT and VLLM.fingerprint in err and SGLANG.fingerprint in err


# ------------------------------------------------------------------ sync / prefetch
def test_sync_and_prefetch_move_an_sglang_store_of_mixed_page_sizes(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    local, shared, node = (f"lmdb://{tmp_path / 'local'}", f"zarr://{tmp_path / 'shared'}",
                           f"lmdb://{tmp_path / 'node'}")
    items = write_engine_store(local, SGLANG)
    sync = cli_json(capsys, "sync", "--store", local, "--shared", shared)
    assert (sync["queued"], sync["uploaded"], sync["done"]) == (N, N, True)
    stats = cli_json(capsys, "stats", "--store", shared)
    assert stats["layout_fingerprint"] == SGLANG.fingerprint and stats["records"] == N
    assert_writer(stats["writer"], SGLANG)  # created by sync with the local store's writer record

    report = cli_json(capsys, "prefetch", "--from", shared, "--to", node, "--recent", str(N))
    assert (report["copied"], report["corrupt"], report["layout_fingerprint"]) == (N, 0, SGLANG.fingerprint)
    with open_store(node, layout_fingerprint=None) as store:
        assert_writer(store.stats()["writer"], SGLANG)
        for item in items:  # every page, at its own size, exactly
            out = np.empty(item.payload.nbytes, np.uint8)
            assert store.get(item.key, out, token_digest=item.token_digest) is not None
            np.testing.assert_array_equal(out, item.payload)
    code, _, err = cli(capsys, "prefetch", "--from", shared, "--to", f"lmdb://{tmp_path / 'x'}",
                       "--prompts", "bundled")
    assert code == ExitCode.USAGE and "--recent" in err


# ------------------------------------------------------------------ the store API
def test_a_maintenance_open_reads_and_never_writes_or_creates(tmp_path: Path) -> None:
    for scheme in ("lmdb", "zarr"):
        missing = tmp_path / f"missing-{scheme}"
        with pytest.raises(FileNotFoundError, match="without a layout fingerprint"):
            open_store(f"{scheme}://{missing}", layout_fingerprint=None)
        assert not missing.exists()
        url = f"{scheme}://{tmp_path / scheme}"
        items = write_engine_store(url, VLLM, n=2)
        with open_store(url, layout_fingerprint=None) as store:
            assert store.maintenance and store.layout_fingerprint == VLLM.fingerprint
            out = np.empty(4096, np.uint8)
            assert store.get(items[0].key, out) is not None
            with pytest.raises(StoreError, match="maintenance open.*needs the layout"):
                store.put_many(VLLM.items(3)[2:])
            assert store.payload_sizes([items[1].key, RecordKey.block(bytes(32))]) == [4096, None]


@pytest.mark.s3
def test_stats_verify_gc_on_a_bucket_without_a_layout(seaweedfs, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    seaweedfs.make_bucket("any-store")
    url = seaweedfs.url("any-store", "vllm-fleet")
    write_engine_store(url, VLLM)
    stats = cli_json(capsys, "stats", "--store", url)
    assert (stats["records"], stats["layout_fingerprint"]) == (N, VLLM.fingerprint)
    assert_writer(stats["writer"], VLLM)
    assert cli_json(capsys, "verify", "--store", url)["checked"] == N
    assert cli_json(capsys, "gc", "--store", url, "--max-bytes", "0")["records"] == 0
