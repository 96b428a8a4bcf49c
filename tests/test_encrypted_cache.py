"""The cache over an encrypted store: exact resumes (reference model), the tenant
defaulting to the salt, no object named by a prompt's unkeyed prefix hash, auth failures
(a disk attacker's rewrite) as misses in stats and Prometheus metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cryptography", reason="encryption needs the cryptography package")

from _util import random_tokens  # noqa: E402
from tiered_kv import TieredKVCache  # noqa: E402
from tiered_kv.storage import RecordKey, RecordKind, open_store  # noqa: E402
from tiered_kv.storage.encrypted.crypto import write_key_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "storage"))
from encryption_helpers import flip_ciphertext, read_lmdb_record, rewrite_lmdb_record  # noqa: E402


def _key(tmp_path: Path, name: str = "fleet.key") -> str:
    path = tmp_path / name
    write_key_file(path)
    return str(path)


@pytest.mark.parametrize("levels", ["one", "chain"])
def test_resume_through_an_encrypted_store_matches_full_recompute(tmp_path: Path, tiny_layout, tiny_model,
                                                                  levels: str) -> None:
    key = _key(tmp_path)
    tokens = random_tokens(300, seed=21)
    if levels == "one":
        store: object = f"lmdb://{tmp_path / 'sealed'}"
        options: dict = {"encryption": {"key_files": [key]}}  # tenant: the cache's salt
    else:  # only the shared level sealed; a second node with an empty local level reads through it
        store = [f"lmdb://{tmp_path / 'node-a'}", f"zarr://{tmp_path / 'shared'}"]
        options = {"level_options": [{}, {"encryption": {"key_files": [key]}}]}
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=store, salt="acme",
                       store_options=options) as cache:
        req = cache.open(tokens)
        tiny_model.forward(cache, req, tokens)
        cache.close(req)
        cache.flush(uploads=levels == "chain")
    if levels == "chain":
        store = [f"lmdb://{tmp_path / 'node-b'}", f"zarr://{tmp_path / 'shared'}"]
    ext = tokens + [7, 8, 9]
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=store, salt="acme",
                       store_options=options) as cache:
        req = cache.open(ext)
        assert req.num_cached_tokens == 256  # resumed from the sealed records
        got = tiny_model.forward(cache, req, ext[256:])
        want = tiny_model.naive_logits(ext)[256:]
        assert (got - want).abs().max().item() < 1e-4
        cache.close(req)
        m = cache.metrics()
        assert m.get("tiered_kv_auth_failures_total", tier="disk") == 0
        assert m.get("tiered_kv_hits_total", tier="disk", kind="block") == 2
        hashes = cache.hasher.block_hashes(tokens)
    # the records were sealed for the tenant "acme" (the salt): that tenant opens them...
    sealed = f"lmdb://{tmp_path / 'sealed'}" if levels == "one" else f"zarr://{tmp_path / 'shared'}"
    for tenant, hit in (("acme", True), ("", False)):
        with open_store(sealed, layout_fingerprint=tiny_layout.fingerprint,
                        encryption={"key_files": [key], "tenant": tenant}) as s:
            out = np.empty(tiny_layout.block_bytes, np.uint8)
            assert (s.get(RecordKey.block(hashes[0]), out) is not None) is hit


def test_wrong_tenant_is_a_counted_miss_and_the_cache_recomputes(tmp_path: Path, tiny_layout, tiny_model) -> None:
    key = _key(tmp_path)
    url = f"lmdb://{tmp_path / 's'}"
    tokens = random_tokens(300, seed=22)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, salt="acme",
                       store_options={"encryption": {"key_files": [key]}}) as cache:
        req = cache.open(tokens)
        tiny_model.forward(cache, req, tokens)
        cache.close(req)
        cache.flush()
    # same salt (same prefix hashes) but sealed for another tenant: its names are others, so
    # every lookup misses, and the cache recomputes exactly
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, salt="acme",
                       store_options={"encryption": {"key_files": [key], "tenant": "mallory"}}) as cache:
        req = cache.open(tokens + [1])
        assert req.num_cached_tokens == 0
        got = tiny_model.forward(cache, req, tokens + [1])
        want = tiny_model.naive_logits(tokens + [1])
        assert (got - want).abs().max().item() < 1e-4
        cache.close(req)
        s = cache.stats()
        assert s["store_auth_failures"] == 0 and s["store_hits"] == 0
    # an attacker with the disk rewrites every record with flipped ciphertext, its xxh3 and the
    # index's copy of it fixed: only the tag is left to catch it; each read is a counted miss
    where = tmp_path / "s"
    with open_store(url, layout_fingerprint=None) as plain:  # (a maintenance open needs no key)
        names = list(plain.names())
    for name in names:
        rewrite_lmdb_record(where, name, flip_ciphertext(read_lmdb_record(where, name)))
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=url, salt="acme",
                       store_options={"encryption": {"key_files": [key]}}) as cache:
        req = cache.open(tokens + [1])
        assert req.num_cached_tokens == 0
        got = tiny_model.forward(cache, req, tokens + [1])
        assert (got - want).abs().max().item() < 1e-4
        cache.close(req)
        s = cache.stats()
        assert s["store_auth_failures"] >= 1 and s["store_hits"] == 0
        text = cache.metrics().to_prometheus()
        assert 'tiered_kv_auth_failures_total{tier="disk"} %d' % s["store_auth_failures"] in text


@pytest.mark.parametrize("levels", ["lmdb", "chain"])
def test_no_object_is_named_by_the_unkeyed_prefix_chain(tmp_path: Path, tiny_layout, tiny_model, levels: str) -> None:
    """A reader of the level who hashes a guessed prompt (the unkeyed chain: model id,
    layout, salt, tokens) finds no object by that name, on the node's LMDB and in the
    shared Zarr level alike; the level records that it is sealed, and no tenant hash."""
    key = _key(tmp_path)
    tokens = random_tokens(600, seed=23)
    if levels == "lmdb":
        store: object = f"lmdb://{tmp_path / 'sealed'}"
        options: dict = {"encryption": {"key_files": [key]}}
    else:
        store = [f"lmdb://{tmp_path / 'node'}", f"zarr://{tmp_path / 'shared'}"]
        options = {"encryption": {"key_files": [key]}}  # every level sealed
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=store, salt="acme",
                       store_options=options) as cache:
        req = cache.open(tokens)
        tiny_model.forward(cache, req, tokens)
        cache.close(req)
        cache.flush(uploads=levels == "chain")
        hashes = cache.hasher.block_hashes(tokens)
    guessed = {RecordKey(kind, h) for h in hashes for kind in RecordKind}
    urls = [store] if isinstance(store, str) else store
    for u in urls:
        with open_store(u, layout_fingerprint=None) as s:  # what anyone with read access lists
            names = set(s.names())
            assert names and not names & guessed
            assert s.sealing is not None
            writer = s.stats()["writer"]
            assert writer is not None and writer.get("tenant_sha256") is None
    if levels == "chain":
        shared = tmp_path / "shared"
        meta = json.loads((shared / "zarr.json").read_text())["attributes"]["tiered_kv"]
        assert meta["encryption"]["names"] == "keyed/v2" and meta["writer"]["tenant_sha256"] is None
        files = {p.relative_to(shared).as_posix() for p in shared.rglob("*") if p.is_file()}
        for h in hashes:
            assert not any(h.hex()[2:] in f for f in files)
