"""Small helpers shared by tests (importable as ``_util``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tiered_kv.layout import EntryFormat, KVLayout, LayerKind

#: DeepSeek's fp8_ds_mla entries (584 B) and fp8 indexer keys (132 B), V4-Flash dims, 4 layers
FLASH_MINI = KVLayout(name="flash-mini", layer_kinds=(LayerKind.SWA_ONLY, LayerKind.CSA, LayerKind.HCA, LayerKind.CSA),
                      entry_format=EntryFormat.FP8_DS_MLA, head_dim=512, indexer_dim=128, indexer_bytes=132, top_k=8)


def cache_tensors(cache) -> list[torch.Tensor]:
    """The tensors a :class:`~tiered_kv.TieredKVCache` keeps on its device in a real
    deployment (pools, State, snapshots, block tables; with HiSparse its buffer and the
    pinned host records it reads): what ``SyncDetector(owned=...)`` watches on a CPU."""
    cp, st = cache.classical, cache.states
    out = [cp.csa_kv, cp.indexer, cp.hca_kv, st.swa, st.csa_tail, st.idx_tail, st.hca_tail,
           cache.snapshots.data, cache.tables.device_table]
    if cache.hisparse is not None:
        out += [cache.hisparse.buffer, cache.host.records]
    return out


def random_tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def serve_once(model, cache, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """Open, compute the rest of ``tokens`` in one chunk, close: (tokens resumed, logits of
    the rest), what the policy tests compare with a full recompute."""
    req = cache.open(tokens)
    P = req.num_cached_tokens
    logits = model.forward(cache, req, tokens[P:])
    cache.close(req)
    return P, logits


# ------------------------------------------------------------------ raw LMDB-store access
def lmdb_raw_read(path: Path, kb: bytes) -> bytes:
    """The stored record of key bytes ``kb`` in the LMDB store at ``path`` (closed), read
    straight from its segment file."""
    import lmdb

    from tiered_kv.storage.lmdb import unpack_entry
    from tiered_kv.storage.lmdb.segments import segment_name

    env = lmdb.open(str(path), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            loc, _ = unpack_entry(txn.get(kb, db=env.open_db(b"records", txn=txn, create=False)))
    finally:
        env.close()
    with open(path / "segments" / segment_name(loc.segment), "rb") as f:
        f.seek(loc.offset)
        return f.read(loc.length)


def lmdb_raw_write(path: Path, kb: bytes, data: bytes) -> None:
    """Make key bytes ``kb`` of the LMDB store at ``path`` (closed) hold ``data``, as a bad
    disk or a foreign writer would: overwritten in place when it fits, else appended to a
    segment file of its own and indexed there (the index keeps the old checksum)."""
    import lmdb

    from tiered_kv.storage.lmdb import pack_entry, unpack_entry
    from tiered_kv.storage.lmdb.segments import Location, segment_name

    env = lmdb.open(str(path), max_dbs=4, map_size=1 << 30)
    try:
        with env.begin(write=True) as txn:
            db = env.open_db(b"records", txn=txn, create=False)
            loc, checksum = unpack_entry(txn.get(kb, db=db))
            if len(data) <= loc.length:
                with open(path / "segments" / segment_name(loc.segment), "r+b") as f:
                    f.seek(loc.offset)
                    f.write(data)
                new = Location(loc.segment, loc.offset, len(data))
            else:
                new = Location(0xFFFFFF00 + len(list((path / "segments").glob("ffffff*"))), 0, len(data))
                seg = path / "segments" / segment_name(new.segment)
                seg.write_bytes(data)
                seg.chmod(0o600)
            txn.put(kb, pack_entry(new, checksum), db=db)
    finally:
        env.close()


def console_script() -> str:
    """The installed ``tiered-kv`` next to this interpreter (the venv's), else on PATH."""
    local = Path(sys.executable).parent / "tiered-kv"
    found = str(local) if local.exists() else shutil.which("tiered-kv")
    if found is None:
        pytest.fail("the tiered-kv console script is not installed (pip install -e .)")
    return found
