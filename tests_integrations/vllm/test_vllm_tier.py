"""TieredKVTier inside vLLM 0.33's real tiering manager (see conftest.Engine for what runs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from tiered_kv.integrations import vllm as vllm_tier
from tiered_kv.integrations.vllm import TieredKVTier, TieredKVTierInfo, TieredKVTierMetrics, VllmKeyMapper
from tiered_kv.storage import LayoutMismatchError, LmdbStore, StoreChain, record_size

from _util import lmdb_raw_read, lmdb_raw_write  # tests/_util.py, put on sys.path by conftest
from seaweedfs import SeaweedFS  # tests/seaweedfs.py, put on sys.path by conftest
from _vllm_engine import CHUNK_BYTES, TIER_MODULE, Engine, chunk_bytes, chunk_keys, offload_config

HERE = Path(__file__).parent
TIER = "1:TieredKVTier"


def tiered(name: str) -> str:
    """Our counter's name without the ``vllm:`` prefix."""
    return getattr(TieredKVTierMetrics, name).removeprefix("vllm:")


def test_vllm_loads_the_tier_from_its_config() -> None:
    config = {"type": "TieredKVTier", "module_path": TIER_MODULE, "store": "lmdb:///unused"}
    assert SecondaryTierFactory.get_tier_class(config) is TieredKVTier
    extra = {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [config]}
    keys = TieringOffloadingSpec.config_info_keys(extra)
    assert set(TieredKVTierInfo.config_info_keys()) <= set(keys) and "tier" in keys
    metrics = TieringOffloadingSpec.build_metric_definitions(extra)
    assert TieredKVTierMetrics.CHUNKS_LOADED in metrics
    assert metrics[TieredKVTierMetrics.JOB_ERRORS].labelnames == ("error",)


@pytest.mark.parametrize("scheme", ["lmdb", "zarr"])
def test_store_evict_load_back_exact_bytes(tmp_path: Path, engines: list[Engine], scheme: str) -> None:
    engine = Engine(f"{scheme}://{tmp_path / 'store'}", num_chunks=8, tenant="team-a")
    engines.append(engine)
    first, second, third = chunk_keys("a", 4), chunk_keys("b", 4), chunk_keys("c", 4)
    assert engine.store(first) == first
    engine.wait_jobs()
    assert engine.store(second) == second
    engine.wait_jobs()
    assert engine.store(third) == third        # 12 chunks through an 8-chunk primary tier:
    engine.wait_jobs()                         # LRU evicts the first request's chunks
    assert not any(engine.primary_holds(k) for k in first)
    assert len(engine.tier.store) == 12

    got = engine.load(first)                   # secondary -> primary promotion, then "GPU"
    assert got == {k: chunk_bytes(k) for k in first}
    assert all(engine.primary_holds(k) for k in first)

    assert engine.counter(tiered("CHUNKS_STORED")) == 12
    assert engine.counter(tiered("CHUNKS_LOADED")) == 4
    assert engine.counter("kv_offload_tiering_write_bytes", TIER) == 12 * CHUNK_BYTES
    assert engine.counter("kv_offload_tiering_read_bytes", TIER) == 4 * CHUNK_BYTES
    assert engine.counter("kv_offload_tiering_chunk_hits", TIER) == 4
    assert engine.counter("kv_offload_tiering_promotion_job_failures", TIER) == 0
    with engine.manager.lock:
        (_, info) = engine.manager.config_info()
    assert info["tier"] == TIER and info["tiered_kv_tenant"] == "team-a"
    assert info["tiered_kv_store"] == f"{scheme}://{tmp_path / 'store'}"
    assert info["tiered_kv_layout"] == engine.tier.keys.layout_fingerprint


def test_the_cli_opens_the_tiers_store_and_names_its_writer(tmp_path: Path, engines: list[Engine],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``tiered-kv stats / verify / gc`` with no layout option on the store the tier wrote;
    ``stats`` names the vLLM adapter, the model and a hash of the tenant."""
    from tiered_kv.cli.main import main
    from tiered_kv.storage import tenant_hash

    store = f"lmdb://{tmp_path / 'store'}"
    engine = Engine(store, num_chunks=4, tenant="team-secret")
    engines.append(engine)
    engine.store(chunk_keys("cli", 4))
    engine.wait_jobs()
    engine.close()
    assert main(["stats", "--store", store, "--json"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out)
    assert stats["layout_fingerprint"] == engine.tier.keys.layout_fingerprint and stats["records"] == 4
    writer = stats["writer"]
    assert (writer["writer"], writer["model"]) == ("vllm-adapter", engine.tier.keys.model_id)
    assert writer["tenant_sha256"] == tenant_hash("team-secret") and "team-secret" not in out
    assert main(["verify", "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checked"] == 4
    assert main(["gc", "--store", store, "--max-bytes", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["records"] == 0


def test_chunks_already_stored_are_not_written_twice(tmp_path: Path, engines: list[Engine]) -> None:
    store = f"lmdb://{tmp_path / 'store'}"
    engine = Engine(store, num_chunks=4)
    engines.append(engine)
    keys = chunk_keys("dup", 4)
    engine.store(keys)
    engine.wait_jobs()
    engine.close()
    again = Engine(store, num_chunks=4)        # a restart: empty primary, same store
    engines.append(again)
    again.store(keys)
    again.wait_jobs()
    assert again.counter(tiered("CHUNKS_STORED")) == 0
    assert again.counter(tiered("CHUNKS_PRESENT")) == 4


def _corrupt(path: Path, key_bytes: bytes) -> None:
    """Flip one payload byte of the record under ``key_bytes``, in its segment file."""
    value = bytearray(lmdb_raw_read(path, key_bytes))
    value[len(value) // 2] ^= 0xFF
    lmdb_raw_write(path, key_bytes, bytes(value))


def test_restart_then_corrupt_record_is_a_failed_key(tmp_path: Path, engines: list[Engine],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_tier, "STORE_STATS_INTERVAL_S", 0.0)   # every get_stats reads the store's
    path = tmp_path / "store"
    writer = Engine(f"lmdb://{path}", num_chunks=8)
    engines.append(writer)
    keys = chunk_keys("restart", 6)
    writer.store(keys)
    writer.wait_jobs()
    mapper = writer.tier.keys
    writer.close()                             # engine stops; the store stays
    _corrupt(path, mapper.record_key(keys[2]).to_bytes())

    reader = Engine(f"lmdb://{path}", num_chunks=8)
    engines.append(reader)
    got = reader.load(keys)
    assert got[keys[2]] is None                # never the corrupt bytes: vLLM recomputes it
    assert {k: v for k, v in got.items() if k != keys[2]} == {k: chunk_bytes(k) for k in keys if k != keys[2]}
    assert not reader.primary_holds(keys[2])
    assert reader.counter("kv_offload_tiering_promotion_job_failures", TIER) >= 1
    assert reader.counter(tiered("LOAD_MISSES")) == 1
    assert reader.tier.store.stats()["corrupt"] == 1
    assert reader.counter(tiered("STORE_CORRUPT")) == 1   # the miss's reason, through the tier's counters
    assert reader.load([keys[2]]) == {keys[2]: None}   # the bad record was removed: a plain miss now


def test_store_gone_mid_run_fails_jobs_and_engine_goes_on(tmp_path: Path, engines: list[Engine]) -> None:
    engine = Engine(f"lmdb://{tmp_path / 'store'}", num_chunks=8)
    engines.append(engine)
    stored = chunk_keys("before", 4)
    engine.store(stored)
    engine.wait_jobs()
    engine.tier.store.close()                  # the store goes away under the running engine

    later = chunk_keys("after", 2)
    engine.store(later)                        # the cascade job fails, reported to vLLM
    engine.wait_jobs()
    assert engine.counter("kv_offload_tiering_cascade_job_failures", TIER) == 1
    assert engine.counter(tiered("JOB_ERRORS"), "closed") == 1
    assert all(engine.primary_holds(k) for k in later)      # the primary tier still serves them
    assert engine.load(later) == {k: chunk_bytes(k) for k in later}
    # chunks only the store had: the lookup fails, answered MISS (recompute), no hang
    assert engine.store(chunk_keys("evict", 8))  # push `stored` out of the primary tier
    engine.wait_jobs()
    assert engine.load(stored) == {k: None for k in stored}
    assert engine.counter(tiered("LOOKUP_ERRORS")) >= 1
    assert engine.counter("kv_offload_tiering_promotion_job_failures", TIER) == 0


def test_tenants_and_models_never_read_each_others_chunks(tmp_path: Path, engines: list[Engine]) -> None:
    store = f"lmdb://{tmp_path / 'store'}"
    keys = chunk_keys("shared-prompt", 3)      # the same vLLM keys in every deployment
    a = Engine(store, tenant="a")
    engines.append(a)
    a.store(keys)
    a.wait_jobs()
    a.close()
    for tenant, model in [("b", "org/tiny-model"), ("a", "org/other-model")]:
        other = Engine(store, tenant=tenant, model=model)
        engines.append(other)
        assert other.load(keys) == {k: None for k in keys}
        other.close()
    a_again = Engine(store, tenant="a")
    engines.append(a_again)
    assert a_again.load(keys) == {k: chunk_bytes(k) for k in keys}


def test_key_mapping_is_stable_and_namespaced() -> None:
    fields = {"dtype": "bfloat16", "chunk_bytes": CHUNK_BYTES}
    m = VllmKeyMapper.create(model_id="m", tenant="t", layout_fields=fields)
    assert m == VllmKeyMapper.create(model_id="m", tenant="t", layout_fields=dict(reversed(fields.items())))
    assert m.layout_fingerprint.startswith("vllm-") and len(m.layout_fingerprint) == 32
    key = chunk_keys("k", 1)[0]
    others = [VllmKeyMapper.create(model_id="m", tenant="u", layout_fields=fields),
              VllmKeyMapper.create(model_id="n", tenant="t", layout_fields=fields),
              VllmKeyMapper.create(model_id="m", tenant="t", layout_fields={**fields, "dtype": "fp8"})]
    assert len({m.record_key(key)} | {o.record_key(key) for o in others}) == 4
    assert m.record_key(key) != m.record_key(chunk_keys("k", 1, group=1)[0])   # KV-cache groups apart
    with pytest.raises(ValueError, match="model_id"):
        VllmKeyMapper.create(model_id="", tenant="t", layout_fields=fields)


def test_layout_mismatch_refuses_the_store(tmp_path: Path, engines: list[Engine]) -> None:
    store = f"lmdb://{tmp_path / 'store'}"
    engines.append(Engine(store))
    engines[0].close()
    config = offload_config({"store": store})
    config = type(config)(**{**config.__dict__, "worker_kv_bytes_per_block": 2 * 6144})
    with pytest.raises(LayoutMismatchError, match="layout fingerprint") as e:
        TieringOffloadingSpec(config).get_manager()
    # the message says what this engine writes and why formats differ
    assert f"{4 * 6144} bytes per chunk" in str(e.value) and "tensor-parallel size 1" in str(e.value)
    assert "MLA models included" in str(e.value) and "of its own" in str(e.value)
    assert e.value.stored == engines[0].tier.keys.layout_fingerprint != e.value.requested


def test_another_tensor_parallel_size_is_refused_with_the_reason(tmp_path: Path, engines: list[Engine]) -> None:
    """The same model at TP 2 (not parallelism-agnostic, as MLA is not) writes another chunk
    format: it cannot share the TP-1 engine's store, and the error says why."""
    store = f"lmdb://{tmp_path / 'store'}"
    engines.append(Engine(store))
    engines[0].close()
    config = offload_config({"store": store})
    parallel = type(config.parallel)(**{**config.parallel.__dict__, "tp_size": 2, "is_parallelism_agnostic": False})
    config = type(config)(**{**config.__dict__, "parallel": parallel})
    with pytest.raises(LayoutMismatchError, match="tensor-parallel size 2 \\(one copy per rank"):
        TieringOffloadingSpec(config).get_manager()


def test_the_caches_counters_through_the_tier(tmp_path: Path, engines: list[Engine],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22 item 4: hits (chunks loaded), misses by reason (not cached: lookup_misses),
    and the store's evictions, as vLLM counters of the tier."""
    monkeypatch.setattr(vllm_tier, "STORE_STATS_INTERVAL_S", 0.0)
    engine = Engine(f"lmdb://{tmp_path / 'store'}", num_chunks=4, max_bytes=6 * record_size(CHUNK_BYTES))
    engines.append(engine)
    keys = chunk_keys("counters", 8)
    for batch in (keys[:4], keys[4:]):       # 8 chunks into a store bounded at 6: 2 evicted
        engine.store(batch)
        engine.wait_jobs()
    left = len(engine.tier.store)
    assert left <= 6
    got = engine.load(keys[:4] + chunk_keys("never stored", 2))   # none in the primary tier now
    hits = sum(v is not None for v in got.values())
    assert hits == 4 - (8 - left) and all(got[k] == chunk_bytes(k) for k in keys[:4] if got[k] is not None)
    engine.step()
    assert engine.counter(tiered("CHUNKS_LOADED")) == hits
    assert engine.counter(tiered("LOOKUP_MISSES")) == 6 - hits     # evicted or never stored: not cached
    assert engine.counter(tiered("STORE_EVICTIONS")) == 8 - left
    assert engine.counter(tiered("STORE_CORRUPT")) == 0
    metrics = TieredKVTier.build_metric_definitions({})
    assert {TieredKVTierMetrics.LOOKUP_MISSES, TieredKVTierMetrics.STORE_CORRUPT,
            TieredKVTierMetrics.STORE_EVICTIONS} <= set(metrics)


@pytest.mark.parametrize("key", ["snapshot_policy", "eviction"])
def test_cache_policy_options_are_refused_with_the_reason(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match=f"{key} select the policies of tiered_kv's own GPU and host tiers"):
        Engine(f"lmdb://{tmp_path / 'store'}", **{key: "leaf-lru" if key == "eviction" else "branch"})
    assert not (tmp_path / "store").exists()


def test_an_unknown_tier_option_lists_the_valid_keys(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['timeout_s'\]; expected some of \[") as e:
        Engine(f"lmdb://{tmp_path / 'store'}", timeout_s=2.0)   # belongs in store_options
    for key in ("'store'", "'store_options'", "'tenant'", "'model_id'", "'type'", "'module_path'"):
        assert key in str(e.value)
    assert not (tmp_path / "store").exists()


def test_store_options_timeout_is_harmless_on_a_local_store(tmp_path: Path, engines: list[Engine]) -> None:
    """The chain example's ``store_options`` on a single LMDB store: accepted, no effect."""
    engine = Engine(f"lmdb://{tmp_path / 'store'}", store_options={"timeout_s": 2.0})
    engines.append(engine)
    keys = chunk_keys("timeout", 3)
    engine.store(keys)
    engine.wait_jobs()
    assert isinstance(engine.tier.store, LmdbStore)
    assert engine.tier.store.contains_many([engine.tier.keys.record_key(k) for k in keys]) == [True] * 3


def test_model_id_defaults_to_the_model_path_so_set_it_on_every_node(tmp_path: Path, engines: list[Engine]) -> None:
    """One model loaded from two paths: by default two namespaces; with one model_id, one."""
    store = f"lmdb://{tmp_path / 'store'}"
    keys = chunk_keys("same-model", 2)
    here = Engine(store, model="/models/v4-flash")
    engines.append(here)
    assert here.tier.keys.model_id == "/models/v4-flash"
    here.store(keys)
    here.wait_jobs()
    here.close()
    there = Engine(store, model="/mnt/weights/v4-flash")
    engines.append(there)
    assert there.load(keys) == {k: None for k in keys}   # shares nothing
    there.close()
    for model in ("/models/v4-flash", "/mnt/weights/v4-flash"):
        node = Engine(store, model=model, model_id="deepseek-v4-flash")
        engines.append(node)
        if model.startswith("/models"):
            node.store(keys)
            node.wait_jobs()
        else:
            assert node.load(keys) == {k: chunk_bytes(k) for k in keys}
        node.close()


@pytest.mark.slow  # ~15 s: the second process imports vLLM
def test_two_processes_on_one_store_and_a_killed_writer(tmp_path: Path, engines: list[Engine]) -> None:
    """A second engine process writes while this one reads, then is SIGKILLed mid-write:
    every chunk of the store is then whole or absent."""
    path = tmp_path / "store"
    reader = Engine(f"lmdb://{path}", num_chunks=16)   # open first, stays open throughout
    engines.append(reader)
    engine_id = f"tkv-test-writer-{uuid.uuid4().hex[:12]}"
    child = subprocess.Popen([sys.executable, str(HERE / "_writer.py"), f"lmdb://{path}", engine_id],
                             stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline() if child.stdout else ""
        assert line.strip() == "batch-0 stored", f"writer said {line!r}"
        first = chunk_keys("writer-0", 4)
        assert reader.load(first) == {k: chunk_bytes(k) for k in first}
        line = child.stdout.readline() if child.stdout else ""
        assert line.strip() == "batch-1 stored", f"writer said {line!r}"
    finally:
        child.kill()                            # mid-write: it keeps storing batches until killed
        child.wait(timeout=30)
        Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").unlink(missing_ok=True)  # vLLM's, left by the kill
    assert child.returncode == -9
    keys = [k for b in range(200) for k in chunk_keys(f"writer-{b}", 4)]
    seen = [k for k in keys if reader.tier.store.contains(reader.tier.keys.record_key(k))]
    assert set(first) <= set(seen)             # acknowledged before the kill: indexed
    newest = seen[-8:]                         # written around the kill: whole, or absent
    assert reader.load(newest) == {k: chunk_bytes(k) for k in newest}
    reader.close()
    # Reopening runs recovery: records the writer fsynced into its segment but had not yet
    # indexed when it was killed come back too (how many depends on where the kill landed).
    # The contract: nothing the reader saw is lost, and every record now present verifies
    # and reads back exactly.
    mapper = reader.tier.keys
    with LmdbStore(path, layout_fingerprint=mapper.layout_fingerprint) as store:
        report = store.verify()
        present = [k for k in keys if store.contains(mapper.record_key(k))]
        assert set(seen) <= set(present)
        assert report["corrupt"] == 0 and report["checked"] == len(present)
        outs = [np.empty(CHUNK_BYTES, np.uint8) for _ in present]
        metas = store.get_many([mapper.record_key(k) for k in present], outs)
        assert all(m is not None for m in metas)
        assert [o.tobytes() for o in outs] == [chunk_bytes(k) for k in present]


@pytest.mark.s3
@pytest.mark.slow  # ~15 s: a SeaweedFS server, frozen then killed, then restarted
def test_object_store_dies_mid_job(tmp_path: Path, engines: list[Engine], seaweedfs: SeaweedFS) -> None:
    """Zarr on S3: the server freezes with jobs in flight, then is SIGKILLed. The scheduler
    never waits on it, the jobs fail (counted), lookups answer MISS; after a restart the
    chunks stored before are all back, byte for byte."""
    seaweedfs.make_bucket("vllm-tier")
    url = seaweedfs.url("vllm-tier", f"t-{uuid.uuid4().hex[:12]}")
    creds = {"access_key_id": seaweedfs.access_key, "secret_access_key": seaweedfs.secret_key, "timeout_s": 2.0}
    engine = Engine(url, num_chunks=8, store_options=creds)
    engines.append(engine)
    before = chunk_keys("s3-before", 4)
    engine.store(before)
    engine.wait_jobs()
    assert engine.counter(tiered("CHUNKS_STORED")) == 4

    os.kill(seaweedfs.pid, signal.SIGSTOP)     # frozen: requests hang until the timeout
    try:
        t0 = time.monotonic()
        engine.store(chunk_keys("s3-during", 8))   # pushes `before` out of the primary tier too
        assert time.monotonic() - t0 < 1.0, "the scheduler waited on the store"
        assert engine.manager.has_pending_work()   # the cascade job is in flight, stuck
    finally:
        seaweedfs.stop()                        # SIGKILL, mid-job
    engine.wait_jobs()
    assert engine.counter("kv_offload_tiering_cascade_job_failures", TIER) == 1
    assert engine.counter(tiered("JOB_ERRORS"), "unavailable") == 1
    assert engine.load(before) == {k: None for k in before}     # store down: recompute
    engine.close()

    seaweedfs.restart()
    again = Engine(url, num_chunks=8, store_options=creds)
    engines.append(again)
    assert again.load(before) == {k: chunk_bytes(k) for k in before}


def test_chain_bounds_the_near_level_and_serves_from_the_far_one(tmp_path: Path, engines: list[Engine]) -> None:
    """``store`` as a list: a small LMDB (``max_bytes`` = 5 records) in front of a Zarr
    directory standing in for the shared bucket."""
    near, far = tmp_path / "near", tmp_path / "far"
    engine = Engine([f"lmdb://{near}", f"zarr://{far}"], num_chunks=4, max_bytes=5 * record_size(CHUNK_BYTES))
    engines.append(engine)
    chain = engine.tier.store
    assert isinstance(chain, StoreChain)
    keys = chunk_keys("chain", 8)
    for batch in (keys[:4], keys[4:]):          # the second evicts the first from the primary tier
        engine.store(batch)
        engine.wait_jobs()
        assert chain.wait_uploads(timeout_s=30)
    near_level, far_level = chain.levels()
    assert near_level is not None and far_level is not None
    assert len(near_level) == 5 and len(far_level) == 8
    assert engine.load(keys[:4]) == {k: chunk_bytes(k) for k in keys[:4]}   # 3 of them from the far level


def test_a_requests_lookups_and_loads_are_batched(tmp_path: Path, engines: list[Engine],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    engine = Engine(f"lmdb://{tmp_path / 'store'}", num_chunks=8)
    engines.append(engine)
    keys = chunk_keys("batched", 6)
    engine.store(keys)
    engine.wait_jobs()
    engine.store(chunk_keys("evictor", 8))
    engine.wait_jobs()
    store = engine.tier.store
    batches: list[int] = []
    real = store.contains_many

    def counting(record_keys):  # type: ignore[no-untyped-def]
        batches.append(len(record_keys))
        return real(record_keys)

    loads: list[int] = []
    real_get = store.get_many

    def counting_get(record_keys, outs, **kw):  # type: ignore[no-untyped-def]
        loads.append(len(record_keys))
        return real_get(record_keys, outs, **kw)

    monkeypatch.setattr(store, "contains_many", counting)
    monkeypatch.setattr(store, "get_many", counting_get)
    assert engine.load(keys) == {k: chunk_bytes(k) for k in keys}
    assert batches == [6]                       # one lookup round trip for the request's 6 chunks
    assert loads == [6]                         # and one load job (vLLM batches a step's promotions)


def test_an_encrypted_tier_seals_chunks_and_a_wrong_key_only_misses(tmp_path: Path, engines: list[Engine]) -> None:
    """``encryption`` in the tier config (through vLLM's own config path): chunks sealed for
    the tier's tenant; the files hold no chunk bytes; a restart with the key reads them
    exactly; another key finds none of them (vLLM recomputes), never bytes or an exception."""
    from tiered_kv.storage.encrypted.crypto import write_key_file

    key, other = tmp_path / "fleet.key", tmp_path / "other.key"
    write_key_file(key)
    write_key_file(other)
    store = f"zarr://{tmp_path / 'store'}"
    keys = chunk_keys("sealed", 4)
    a = Engine(store, num_chunks=8, tenant="team-a", encryption={"key_files": [str(key)]})
    engines.append(a)
    assert a.store(keys) == keys
    a.wait_jobs()
    st = a.tier.store.stats()
    assert st["encrypted"] and st["puts"] == 4
    a.close()
    blob = b"".join(p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file())
    for k in keys:
        data = chunk_bytes(k)
        assert not any(data[i:i + 64] in blob for i in range(0, len(data) - 64, 997))
    b = Engine(store, num_chunks=8, tenant="team-a", encryption={"key_files": [str(key)]})
    engines.append(b)
    assert b.load(keys) == {k: chunk_bytes(k) for k in keys}
    b.close()
    c = Engine(store, num_chunks=8, tenant="team-a", encryption={"key_files": [str(other)]})
    engines.append(c)
    assert c.load(keys) == {k: None for k in keys}
    # another key's names are elsewhere: its lookups find nothing, so nothing is even loaded
    assert c.tier.store.stats()["auth_failures"] == 0
    assert c.counter(tiered("LOAD_MISSES")) == 0


def _evicted(engine: Engine, seed: str, n: int) -> list:
    """``n`` chunks stored, then pushed out of the 8-chunk primary tier: only the store has them."""
    keys = chunk_keys(seed, n)
    engine.store(keys)
    engine.wait_jobs()
    engine.store(chunk_keys(f"{seed}-evictor", 8))
    engine.wait_jobs()
    assert not any(engine.primary_holds(k) for k in keys)
    return keys


def test_a_lookup_reads_ahead_what_the_load_then_copies(tmp_path: Path, engines: list[Engine],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks a lookup finds are read (verified) on the read-ahead thread as soon as it
    answers; the load job copies them into the rows vLLM allotted and reads nothing itself."""
    engine = Engine(f"lmdb://{tmp_path / 'store'}", num_chunks=8)
    engines.append(engine)
    keys = _evicted(engine, "ahead", 6)
    store = engine.tier.store
    readers: list[tuple[str, int]] = []
    real_get = store.get_many

    def spy(record_keys, outs, **kw):  # type: ignore[no-untyped-def]
        readers.append((threading.current_thread().name, len(record_keys)))
        return real_get(record_keys, outs, **kw)

    monkeypatch.setattr(store, "get_many", spy)
    assert engine.load(keys) == {k: chunk_bytes(k) for k in keys}
    assert [(name.startswith("tiered_kv_read_ahead"), n) for name, n in readers] == [(True, 6)]
    assert engine.counter(tiered("CHUNKS_LOADED")) == 6
    assert engine.counter(tiered("CHUNKS_READ_AHEAD")) == 6
    assert engine.counter(tiered("READ_AHEAD_DROPPED")) == 0
    assert store.stats()["hits"] == 6                   # each chunk read once


@pytest.mark.parametrize("staging_chunks", [0, 2])
def test_without_room_to_read_ahead_the_load_reads_the_store(tmp_path: Path, engines: list[Engine],
                                                             staging_chunks: int) -> None:
    """``read_ahead_bytes`` bounds the staging rows (0: no read-ahead): chunks a lookup could
    not read ahead are read by the load straight into their rows, the same bytes."""
    engine = Engine(f"lmdb://{tmp_path / 'store'}", num_chunks=8, read_ahead_bytes=staging_chunks * CHUNK_BYTES)
    engines.append(engine)
    assert (engine.tier.read_ahead is None) == (staging_chunks == 0)
    keys = _evicted(engine, "bounded", 6)
    assert engine.load(keys) == {k: chunk_bytes(k) for k in keys}
    assert engine.counter(tiered("CHUNKS_LOADED")) == 6
    assert engine.counter(tiered("CHUNKS_READ_AHEAD")) == staging_chunks
    assert engine.tier.store.stats()["hits"] == 6


def test_read_ahead_bytes_must_be_a_non_negative_int(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="read_ahead_bytes: expected an int >= 0"):
        Engine(f"lmdb://{tmp_path / 'store'}", read_ahead_bytes=-1)
