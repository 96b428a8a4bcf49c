"""Prefix hashes: deterministic across processes, chained, namespaced."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from tiered_kv import presets
from tiered_kv.prefix import PrefixHasher, token_digest, tokens_to_bytes

from _util import random_tokens


def test_chain_definition_and_partial_blocks() -> None:
    L = presets.tiny()
    h = PrefixHasher(L, model_id="m", salt="s")
    tokens = random_tokens(300)
    hashes = h.block_hashes(tokens)
    assert len(hashes) == 2  # the trailing 44 tokens form no full block
    root = hashlib.sha256(b"\0".join([b"tiered_kv.prefix.v1", b"m", L.fingerprint.encode(), b"s"])).digest()
    assert h.root == root
    h0 = hashlib.sha256(root + np.asarray(tokens[:128], dtype="<u4").tobytes()).digest()
    assert hashes[0] == h0 and hashes[1] == PrefixHasher.chain(h0, tokens_to_bytes(tokens[128:256]))
    # continuing from a parent gives the same chain
    assert h.block_hashes(tokens[128:256], parent=hashes[0]) == hashes[1:]


def test_namespace_separates_tenants_models_and_layouts() -> None:
    tokens = random_tokens(256)
    L = presets.tiny()
    base = PrefixHasher(L, salt="a").block_hashes(tokens)
    assert PrefixHasher(L, salt="a").block_hashes(tokens) == base
    assert PrefixHasher(L, salt="b").block_hashes(tokens) != base
    assert PrefixHasher(L, model_id="other", salt="a").block_hashes(tokens) != base
    assert PrefixHasher(presets.tiny(top_k=4), salt="a").block_hashes(tokens) != base


def test_hashes_agree_across_processes() -> None:
    code = ("from tiered_kv import presets; from tiered_kv.prefix import PrefixHasher; "
            "print(PrefixHasher(presets.deepseek_v4_flash(), salt='t').block_hashes(list(range(1024)))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip() for seed in ("1", "2")}
    here = PrefixHasher(presets.deepseek_v4_flash(), salt="t").block_hashes(list(range(1024)))[-1].hex()
    assert outs == {here}


def test_token_validation_and_digest() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        tokens_to_bytes([-1])
    with pytest.raises(ValueError, match="1-D"):
        tokens_to_bytes(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="integers"):
        tokens_to_bytes([0.5])
    assert token_digest([1, 2]) != token_digest([2, 1]) and len(token_digest([1])) == 32
