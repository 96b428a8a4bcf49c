"""tiered_kv/integrations/_adapter.py, what the vLLM and SGLang adapters share, without an
engine: the key namespaces their docstrings define (the stored keys of existing stores
depend on them byte for byte), the store options, and URLs without their query."""

from __future__ import annotations

import hashlib

import pytest

from tiered_kv.integrations._adapter import block_key, display_url, namespace_root, open_options
from tiered_kv.storage import EncryptionConfig, RecordKey


def test_namespace_root_and_block_key_are_the_documented_hashes() -> None:
    root = namespace_root(b"tiered_kv.vllm.v1", "deepseek-ai/DeepSeek-V4-Flash", "team-a", "vllm-0123")
    assert root == hashlib.sha256(b"tiered_kv.vllm.v1\0deepseek-ai/DeepSeek-V4-Flash\0team-a\0vllm-0123").digest()
    assert namespace_root(b"t", "", "") == hashlib.sha256(b"t\0\0").digest()
    key = bytes(range(36))
    assert block_key(root, key) == RecordKey.block(hashlib.sha256(root + key).digest())


def test_open_options_seal_for_the_adapters_tenant_unless_a_config_names_one() -> None:
    assert open_options(None, tenant="t") == {}
    plain = {"max_bytes": 1 << 30}
    assert open_options(plain, tenant="t") == plain and plain == {"max_bytes": 1 << 30}  # (a new dict)
    got = open_options({"level_options": [None, {"encryption": {"key_files": ["/k"], "tenant": "own"}}]},
                       tenant="t", encryption={"key_files": ["/k"]})
    assert got["encryption"] == EncryptionConfig(key_files=("/k",), default_tenant="t")  # (a tenant key file names its own)
    assert got["level_options"][0] is None
    assert got["level_options"][1]["encryption"] == EncryptionConfig(key_files=("/k",), tenant="own")
    with pytest.raises(ValueError, match=r"extra_config\['encryption'\]: unknown keys"):
        open_options({}, tenant="t", encryption={"key_file": "/k"}, name="extra_config['encryption']")


def test_display_url_drops_the_query_of_each_url() -> None:
    assert display_url("lmdb:///var/cache/kv") == "lmdb:///var/cache/kv"
    assert display_url(["lmdb:///a", "zarr+s3://b/p?endpoint=http://x&secret_access_key=s"]) == \
        "lmdb:///a,zarr+s3://b/p"
