"""The cluster-wide prefix cache: ZarrStore in an S3 bucket, and the StoreChain in front of it.

* ``StoreChain`` semantics on local levels and a fault-injecting wrapper (no server needed):
  promotion, background uploads, timeouts, backoff and recovery, bounded queue, deferred
  open, verify / gc.
* Marked ``s3`` (the session SeaweedFS server of tests/seaweedfs.py): the block-store
  conformance suite on ``zarr+s3``; two serving processes with their own LMDB sharing one
  bucket; 16 processes racing to create the same records; the server killed (and hung)
  under a serving cache; wrong credentials; another layout or tenant in the bucket.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE / "storage"))  # the conformance suite and its helpers

from seaweedfs import SeaweedFS  # noqa: E402  (the session fixture comes from conftest's pytest_plugins)
from storage_helpers import FP, OTHER_FP, digest_for, item_for, make_key, payload_for  # noqa: E402
from test_storage_conformance import StoreConformance  # noqa: E402
from tiered_kv import TieredKVCache, presets  # noqa: E402
from tiered_kv.storage import (  # noqa: E402
    RecordKind,
    BlockStore,
    DeferredLevel,
    LayoutMismatchError,
    LmdbStore,
    PutItem,
    RecordKey,
    RecordMeta,
    StoreChain,
    StoreFullError,
    ZarrStore,
    encode_record,
    open_store,
    record_size,
)
from tiered_kv.storage.chain.store import ChainPoint  # noqa: E402

from _util import random_tokens  # noqa: E402

BUCKET = "tkv-shared"
N = 4096


# ====================================================================== chain, no server
class Faulty(BlockStore):
    """A store that delegates to ``inner``, but whose calls can be made to fail or hang.

    ``fail``: an exception every call raises while set (``fail_puts``: only ``put_many``).
    ``gate``: calls wait on it (clear it to hang them). ``calls``: how many calls reached
    the store.
    """

    def __init__(self, inner: BlockStore) -> None:
        self.inner = inner
        self.layout_fingerprint = inner.layout_fingerprint
        self.max_bytes = inner.max_bytes
        self.where = f"faulty({getattr(inner, 'where', inner)})"
        self.fail: BaseException | None = None
        self.fail_puts: BaseException | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.calls = 0
        self._closed = False

    def _enter(self) -> None:
        self.calls += 1
        self.gate.wait()
        if self.fail is not None:
            raise self.fail

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        self._enter()
        if self.fail_puts is not None:
            raise self.fail_puts
        return self.inner.put_many(items)

    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        self._enter()
        return self.inner.get_many(keys, outs, token_digests=token_digests)

    def contains(self, key: RecordKey) -> bool:
        self._enter()
        return self.inner.contains(key)

    def delete(self, key: RecordKey) -> bool:
        self._enter()
        return self.inner.delete(key)

    def __iter__(self) -> Iterator[RecordKey]:
        self._enter()
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        return self.inner.verify(repair=repair)

    def gc(self, max_bytes: int) -> dict[str, Any]:
        return self.inner.gc(max_bytes)

    def close(self) -> None:
        self._closed = True
        self.inner.close()


@pytest.fixture
def near(tmp_path: Path) -> Iterator[LmdbStore]:
    s = LmdbStore(tmp_path / "near", layout_fingerprint=FP, initial_map_size=8 << 20)
    yield s
    s.close()


@pytest.fixture
def far(tmp_path: Path) -> Iterator[Faulty]:
    f = Faulty(ZarrStore(tmp_path / "far", layout_fingerprint=FP))
    yield f
    f.gate.set()
    f.close()


def _chain(near: BlockStore, far: BlockStore | DeferredLevel, **kw: Any) -> StoreChain:
    kw.setdefault("timeout_s", 0.5)
    kw.setdefault("backoff_initial_s", 0.05)
    kw.setdefault("backoff_max_s", 0.2)
    return StoreChain([near, far], owned=[False, False], **kw)


def _out() -> np.ndarray:
    return np.full(N, 0xAA, np.uint8)


def test_chain_reads_nearest_first_and_promotes_far_hits(near: LmdbStore, far: Faulty) -> None:
    k_near, k_far, k_none = make_key(1), make_key(2), make_key(3)
    near.put_many([item_for(k_near, N)])
    far.inner.put_many([item_for(k_far, N)])
    with _chain(near, far) as chain:
        calls = far.calls
        out = _out()
        assert chain.get(k_near, out) is not None and far.calls == calls  # level 0 hit: far not asked
        metas = chain.get_many([k_far, k_none], [out, _out()], token_digests=[digest_for(k_far), None])
        assert metas[0] is not None and metas[1] is None
        np.testing.assert_array_equal(out, payload_for(k_far, N))
        assert chain.wait_uploads(5)                                      # promotions are write-behind
        assert near.contains(k_far)                                       # promoted
        s = chain.stats()
        assert (s["hits"], s["misses"], s["far_hits"], s["promotions"]) == (2, 1, 1, 1)
        assert (s["level1_hits"], s["level1_misses"], s["level0_promotions_in"]) == (1, 1, 1)
        assert chain.contains(k_far) and chain.contains(k_near) and not chain.contains(k_none)
        assert chain.wait_uploads(5)
        assert chain.stats()["uploads"] == 0  # a promoted record is not sent back where it came from


def test_chain_scatter_outs_from_level0_and_from_a_far_level(near: LmdbStore, far: Faulty) -> None:
    """Scatter-list outs: level 0 (LMDB) reads into the pieces; a far hit is copied into
    them from its private buffer and promoted whole; a wrong total is a ValueError."""
    k_near, k_far = make_key(11), make_key(12)
    near.put_many([item_for(k_near, N)])
    far.inner.put_many([item_for(k_far, N)])
    with _chain(near, far) as chain:
        assert chain.supports_scatter_reads
        outs = [[np.empty(N // 3, np.uint8), np.empty(N - N // 3, np.uint8)],
                [np.empty(7, np.uint8), np.empty(N - 7, np.uint8)]]
        metas = chain.get_many([k_near, k_far], outs)
        assert all(m is not None for m in metas)
        for key, out in zip((k_near, k_far), outs):
            np.testing.assert_array_equal(np.concatenate(out), payload_for(key, N))
        assert chain.wait_uploads(5) and near.contains(k_far)
        whole = _out()
        assert near.get(k_far, whole) is not None
        np.testing.assert_array_equal(whole, payload_for(k_far, N))
        with pytest.raises(ValueError, match=f"out: expected {N} bytes"):
            chain.get(k_near, [np.empty(N - 1, np.uint8)])


def test_chain_put_writes_level0_now_and_far_in_background(near: LmdbStore, far: Faulty) -> None:
    keys = [make_key(i, salt=b"up") for i in range(20)]
    with _chain(near, far, upload_batch=4) as chain:
        far.gate.clear()                                   # the far level hangs: put must not wait
        t0 = time.monotonic()
        assert chain.put_many([item_for(k, N) for k in keys]) == [True] * 20
        assert time.monotonic() - t0 < 10   # the far level hangs until the gate opens: no wait on it
        assert all(near.contains(k) for k in keys)
        far.gate.set()
        assert chain.wait_uploads(10)
        assert {k for k in far.inner} == set(keys)
        s = chain.stats()
        assert (s["uploads"], s["pending_uploads"], s["upload_failures"]) == (20, 0, 0)
        assert chain.put_many([item_for(keys[0], N)]) == [False]  # write-once through the chain
        assert chain.wait_uploads(10) and chain.stats()["uploads_existing"] == 1
        assert set(chain) == set(keys) and len(chain) == 20


def test_hung_far_level_times_out_then_is_skipped_then_recovers(near: LmdbStore, far: Faulty) -> None:
    key = make_key(7)
    far.inner.put_many([item_for(key, N)])
    with _chain(near, far, timeout_s=0.3) as chain:
        far.gate.clear()
        out = _out()
        t0 = time.monotonic()
        assert chain.get(key, out) is None                 # abandoned after timeout_s: a miss
        assert 0.25 < time.monotonic() - t0 < 0.3 + 5     # the bound, not the hang (+ a loaded CI)
        before = far.calls
        assert chain.get(key, _out()) is None and not chain.contains(key)
        assert far.calls == before                         # down: skipped, nothing waits on it
        s = chain.stats()
        assert (s["timeouts"], s["levels_down"]) == (1, 1) and s["level_unavailable"] >= 2
        assert "timed out" in s["levels"][1]["last_error"]
        calls = far.calls
        far.gate.set()                                     # the hung call finishes late ...
        chain.put_many([item_for(make_key(8), N)])
        assert chain.wait_uploads(10)                      # ... the probe brings the level back
        assert far.calls > calls
        assert (out == 0xAA).all()                         # and the late answer never reached `out`
        assert chain.get(key, out) is not None and chain.stats()["level1_recoveries"] >= 1


def test_failed_uploads_are_kept_and_retried(near: LmdbStore, far: Faulty) -> None:
    keys = [make_key(i, salt=b"retry") for i in range(3)]
    with _chain(near, far) as chain:
        far.fail = ConnectionError("object store unreachable (injected)")
        chain.put_many([item_for(k, N) for k in keys])
        assert not chain.wait_uploads(0.5)
        s = chain.stats()
        assert s["upload_failures"] >= 3 and s["pending_uploads"] == 3 and s["failed_uploads"] == 0
        assert "injected" in s["levels"][1]["last_error"]
        assert chain.get(keys[0], _out()) is not None      # level 0 serves meanwhile
        far.fail = None
        assert chain.wait_uploads(10)
        assert set(far.inner) == set(keys)
        s = chain.stats()
        assert s["uploads"] == 3 and s["upload_retries"] >= 3 and s["dropped_uploads"] == 0


def test_auth_failures_are_counted_and_retried(near: LmdbStore, far: Faulty) -> None:
    with _chain(near, far) as chain:
        far.fail = PermissionError("credentials refused (injected): set AWS_ACCESS_KEY_ID")
        chain.put_many([item_for(make_key(1), N)])
        assert not chain.wait_uploads(0.3)
        s = chain.stats()
        assert s["auth_errors"] >= 1 and "AWS_ACCESS_KEY_ID" in s["levels"][1]["last_error"]
        far.fail = None
        assert chain.wait_uploads(10) and chain.stats()["uploads"] == 1


def test_item_failures_give_up_after_max_attempts(near: LmdbStore, far: Faulty) -> None:
    with _chain(near, far, max_upload_attempts=3) as chain:
        far.fail_puts = StoreFullError("far level full (injected)")
        chain.put_many([item_for(make_key(i), N) for i in range(2)])
        assert chain.wait_uploads(10)                      # given up: the queue empties
        s = chain.stats()
        assert s["failed_uploads"] == 2 and s["uploads"] == 0 and near.contains(make_key(0))


def test_queue_bound_counts_dropped_uploads_and_keeps_local_copies(near: LmdbStore, far: Faulty) -> None:
    with _chain(near, far, max_pending_uploads=2, backoff_initial_s=30, backoff_max_s=30, journal=False) as chain:
        far.fail = ConnectionError("down (injected)")
        chain.get(make_key(99), _out())                    # marks the far level down for 30 s
        keys = [make_key(i, salt=b"bound") for i in range(5)]
        assert chain.put_many([item_for(k, N) for k in keys]) == [True] * 5
        s = chain.stats()
        assert (s["pending_uploads"], s["dropped_uploads"]) == (2, 3)
        assert all(near.contains(k) for k in keys)


def test_queue_bound_with_a_journal_defers_and_loses_nothing(near: LmdbStore, far: Faulty) -> None:
    with _chain(near, far, max_pending_uploads=2, backoff_initial_s=0.3, backoff_max_s=0.3) as chain:
        assert chain.journal_path == near.path / "upload-journal.mdb"
        far.fail = ConnectionError("down (injected)")
        chain.get(make_key(99), _out())                    # marks the far level down
        keys = [make_key(i, salt=b"bound") for i in range(5)]
        assert chain.put_many([item_for(k, N) for k in keys]) == [True] * 5
        s = chain.stats()
        assert (s["pending_uploads"], s["deferred_uploads"], s["dropped_uploads"]) == (2, 3, 0)
        assert s["journaled_uploads"] == 5
        far.fail = None
        assert chain.flush(uploads=True, timeout_s=10)     # the 3 deferred ones come back from the journal
        s = chain.stats()
        assert set(far.inner) == set(keys) and s["uploads"] == 5 and s["journaled_uploads"] == 0
        assert s["uploads_resumed"] == 3


def test_journal_resumes_owed_uploads_in_the_next_chain(near: LmdbStore, far: Faulty) -> None:
    keys = [make_key(i, salt=b"journal") for i in range(12)]
    far.fail = ConnectionError("down (injected)")
    chain = _chain(near, far, backoff_initial_s=30, backoff_max_s=30, close_timeout_s=0.2)
    with chain:
        chain.get(make_key(99), _out())                    # far level down: nothing uploads
        for i in range(0, 12, 4):
            chain.put_many([item_for(k, N) for k in keys[i:i + 4]])
        assert chain.flush() and not chain.flush(uploads=True, timeout_s=0.2)
        assert chain.stats()["journaled_uploads"] == 12
    assert chain.abandoned_uploads == 12
    near.delete(keys[0])                                    # evicted before anyone uploaded it
    far.fail = None
    with _chain(near, far) as chain:                        # the next process, same level 0
        assert chain.flush(uploads=True, timeout_s=10)
        s = chain.stats()
    assert set(far.inner) == set(keys[1:])
    assert (s["uploads"], s["uploads_resumed"], s["uploads_skipped"], s["journaled_uploads"]) == (11, 12, 1, 0)


def test_a_failed_journal_commit_keeps_the_local_write_and_the_upload(near: LmdbStore, far: Faulty) -> None:
    with _chain(near, far) as chain:
        def full(point: ChainPoint, info: Any) -> None:
            if point is ChainPoint.JOURNAL_ADD:
                raise StoreFullError("journal: disk full (injected)")

        chain.faults.hook = full
        key = make_key(1, salt=b"nojournal")
        assert chain.put_many([item_for(key, N)]) == [True] and near.contains(key)
        assert chain.flush(uploads=True, timeout_s=10) and far.inner.contains(key)
        s = chain.stats()
        assert s["journal_errors"] == 1 and "disk full" in chain.last_journal_error and s["uploads"] == 1


def test_two_chains_resuming_one_journal_upload_each_record_once(near: LmdbStore, far: Faulty) -> None:
    keys = [make_key(i, salt=b"twice") for i in range(40)]
    with _chain(near, far, journal=False):
        pass
    from tiered_kv.storage.chain.journal import UploadJournal, level_name

    with UploadJournal(near.path) as journal:              # as a killed process left it
        near.put_many([item_for(k, N) for k in keys])
        journal.add([level_name(far.where)], [(k, N) for k in keys])
    a, b = _chain(near, far, upload_batch=3), _chain(near, far, upload_batch=5)
    with a, b:
        assert a.flush(uploads=True, timeout_s=10) and b.flush(uploads=True, timeout_s=10)
        sa, sb = a.stats(), b.stats()
    assert set(far.inner) == set(keys) and far.inner.verify()["corrupt"] == 0
    assert sa["uploads"] + sb["uploads"] == 40             # each record created exactly once
    assert sa["uploads_resumed"] + sb["uploads_resumed"] >= 40 and sb["journaled_uploads"] == 0


def test_journal_off_without_a_local_directory(tmp_path: Path) -> None:
    import zarr

    mem = ZarrStore(zarr.storage.MemoryStore(), layout_fingerprint=FP)
    far = ZarrStore(tmp_path / "far", layout_fingerprint=FP)
    with StoreChain([mem, far]) as chain:
        assert chain.journal_path is None and chain.stats()["journal"] is None
    with pytest.raises(ValueError, match="no local directory"):
        StoreChain([mem, far], journal=True)
    with StoreChain([mem, far], journal=tmp_path) as chain:
        assert chain.journal_path == tmp_path / "upload-journal.mdb"
        assert (chain.journal_path.stat().st_mode & 0o777) == 0o600


def test_deferred_level_is_opened_in_the_background(near: LmdbStore, tmp_path: Path) -> None:
    attempts: list[int] = []

    def opener() -> BlockStore:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("not reachable yet (injected)")
        return ZarrStore(tmp_path / "late", layout_fingerprint=FP)

    chain = StoreChain([near, DeferredLevel("late-level", opener, "unreachable at start")], owned=[False, True],
                       timeout_s=0.5, backoff_initial_s=0.05, backoff_max_s=0.1)
    with chain:
        assert chain.get(make_key(1), _out()) is None      # not open: skipped
        chain.put_many([item_for(make_key(1), N)])
        assert chain.wait_uploads(10)
        assert len(attempts) == 3 and chain.levels()[1] is not None
        assert chain.get(make_key(1), _out()) is not None


def test_resync_re_sends_what_a_stopped_process_never_uploaded(near: LmdbStore, far: Faulty) -> None:
    keys = [make_key(i, salt=b"resync") for i in range(6)]
    near.put_many([item_for(k, N) for k in keys[:4]])        # written while no chain uploaded them
    far.inner.put_many([item_for(keys[0], N)])               # one of them reached the bucket anyway
    far.inner.put_many([item_for(keys[5], N)])               # and the bucket has one of its own
    with _chain(near, far) as chain:
        sizes = {RecordKind.BLOCK: N, RecordKind.SNAPSHOT: N}
        out = chain.resync(sizes)
        assert out == {"local_records": 4, "queued": 3, "present": 1, "levels_skipped": 0}
        assert chain.wait_uploads(10)
        assert {k for k in far.inner} == {keys[0], keys[1], keys[2], keys[3], keys[5]}
        far.fail = ConnectionError("down")                   # a level that is down is skipped
        assert chain.resync(sizes)["levels_skipped"] == 1


def test_chain_of_other_layouts_is_refused(near: LmdbStore, tmp_path: Path) -> None:
    other = ZarrStore(tmp_path / "other", layout_fingerprint=OTHER_FP)
    with pytest.raises(LayoutMismatchError, match=OTHER_FP):
        StoreChain([near, other], owned=[False, False])
    other.close()


def test_chain_verify_all_levels_and_gc_level0(near: LmdbStore, far: Faulty) -> None:
    with _chain(near, far) as chain:
        chain.put_many([item_for(make_key(i), N) for i in range(4)])
        assert chain.wait_uploads(10)
        v = chain.verify()
        assert (v["checked"], v["corrupt"], len(v["levels"])) == (8, 0, 2)
        g = chain.gc(2 * record_size(N))
        assert (g["evicted"], g["records"], g["level"]) == (2, 2, 0)
        assert len(near) == 2 and len(far.inner) == 4


def test_open_store_list_builds_a_chain_and_the_cache_uses_it(tmp_path: Path, tiny_layout, tiny_model) -> None:
    """Two "nodes" in one process sharing a local Zarr directory as the far level."""
    shared = f"zarr://{tmp_path / 'shared'}"
    tokens = random_tokens(300, seed=5)
    opts = {"timeout_s": 1.0, "level_options": [{"max_bytes": 1 << 30}, None]}
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=[f"lmdb://{tmp_path / 'a'}", shared],
                       store_options=opts) as cache:
        assert isinstance(cache.disk.store, StoreChain)
        req = cache.open(tokens)
        tiny_model.forward(cache, req, tokens)
        cache.close(req)
        cache.flush()
        assert cache.disk.store.wait_uploads(10)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=[f"lmdb://{tmp_path / 'b'}", shared],
                       store_options=opts) as cache:
        req = cache.open(tokens + [1, 2])
        assert req.num_cached_tokens == 256
        got = tiny_model.forward(cache, req, (tokens + [1, 2])[256:])
        assert (got - tiny_model.naive_logits(tokens + [1, 2])[256:]).abs().max().item() < 1e-4
        assert cache.disk.store.wait_uploads(10)
        s = cache.stats()
        assert s["blocks_from_disk"] == 2 and s["store_far_hits"] == 3 and s["store_promotions"] == 3
        cache.close(req)


def test_open_chain_validates(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one"):
        open_store([], layout_fingerprint=FP)
    with pytest.raises(ValueError, match="one dict"):
        open_store([f"lmdb://{tmp_path}/a"], layout_fingerprint=FP, level_options=[{}, {}])
    with pytest.raises(ValueError, match="timeout_s"):
        open_store([f"lmdb://{tmp_path}/b"], layout_fingerprint=FP, timeout_s=0)
    LmdbStore(tmp_path / "b", layout_fingerprint=FP).close()  # closed again after the failed open


# ====================================================================== against SeaweedFS
_SERVER: dict[str, SeaweedFS] = {}


@pytest.fixture
def server(seaweedfs: SeaweedFS) -> SeaweedFS:
    seaweedfs.make_bucket(BUCKET)
    _SERVER["s"] = seaweedfs
    return seaweedfs


def _prefix_url(server: SeaweedFS, tag: str = "t") -> str:
    return server.url(BUCKET, f"{tag}-{uuid.uuid4().hex[:12]}")


def _creds(server: SeaweedFS, **extra: Any) -> dict[str, Any]:
    return {"access_key_id": server.access_key, "secret_access_key": server.secret_key, **extra}


@pytest.fixture
def aws_env(server: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> SeaweedFS:
    """The server's credentials in the standard AWS variables (for this process and children)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return server


@pytest.mark.s3
@pytest.mark.usefixtures("aws_env")
class TestZarrS3Store(StoreConformance):
    """The conformance suite on ``zarr+s3``: ``where`` is ``bucket/prefix?endpoint=...``."""

    scheme: ClassVar[str] = "zarr+s3"
    local: ClassVar[bool] = False  # no local files, no kill -9 / fork tests

    def new_where(self, tmp_path: Path, name: str = "store") -> Any:
        return _prefix_url(_SERVER["s"], "c").removeprefix("zarr+s3://")

    def open(self, where: Any, **options: Any) -> BlockStore:
        options.setdefault("layout_fingerprint", FP)
        return ZarrStore(f"zarr+s3://{where}", timeout_s=5.0, **options)

    def _raw(self, where: Any) -> Any:
        from tiered_kv.storage.s3 import open_object_store, parse_s3_url

        return open_object_store(parse_s3_url(f"zarr+s3://{where}"))

    @staticmethod
    def _name(key: RecordKey) -> str:
        h = key.block_hash.hex()
        return f"{'blocks' if key.kind.name == 'BLOCK' else 'snapshots'}/{h[:2]}/{h[2:]}"

    def raw_read(self, where: Any, key: RecordKey) -> bytes:
        import obstore

        return bytes(obstore.get(self._raw(where), self._name(key)).bytes())

    def raw_write(self, where: Any, key: RecordKey, data: bytes) -> None:
        import obstore

        obstore.put(self._raw(where), self._name(key), data)  # a plain overwrite, as a bad writer would

    #: a bucket keeps no access times: a reopened store evicts in write order
    #: (see test_reopened_bucket_evicts_oldest_written)
    persists_access_order = False

    def test_full_disk(self) -> None:  # type: ignore[override]
        pytest.skip("an object store has no local disk to fill")

    def test_group_is_plain_zarr_and_keys_match_the_local_layout(self, where: Any) -> None:
        import zarr

        with self.open(where) as store:
            store.put_many([item_for(make_key(0), 100)])
        objects = self._raw(where)
        group = zarr.open_group(zarr.storage.ObjectStore(objects, read_only=True), mode="r")
        assert group.attrs["tiered_kv"]["layout_fingerprint"] == FP
        assert self.raw_read(where, make_key(0))[144:244] == payload_for(make_key(0), 100).tobytes()
        with ZarrStore(zarr.storage.ObjectStore(objects), layout_fingerprint=FP) as store:  # zarr's wrapper
            assert len(store) == 1 and store.stats()["backend"] == "zarr+s3"

    def test_reopened_bucket_evicts_oldest_written(self, where: Any) -> None:
        n = 1000
        with self.open(where) as store:
            store.put_many([item_for(make_key(0), n)])
        time.sleep(1.1)  # S3 last-modified times have one-second resolution on some stores
        with self.open(where) as store:
            store.put_many([item_for(make_key(1), n)])
        with self.open(where, max_bytes=2 * record_size(n)) as store:  # lists at open
            store.put_many([item_for(make_key(2), n)])
            assert set(store) == {make_key(1), make_key(2)} and store.stats()["evictions"] == 1


# ----------------------------------------------------------------------- two nodes
def _node(phase: str, local: Path, shared: str, server: SeaweedFS) -> dict[str, Any]:
    env = {**os.environ, **server.env(), "PYTHONPATH": str(HERE)}
    env.pop("AWS_SESSION_TOKEN", None)
    out = subprocess.run([sys.executable, str(HERE / "_node_worker.py"), phase, str(local), shared],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.s3
def test_node_b_warm_starts_from_what_node_a_put_in_the_bucket(server: SeaweedFS, tmp_path: Path) -> None:
    shared = _prefix_url(server, "nodes")
    a = _node("compute", tmp_path / "node-a", shared, server)
    assert a["uploads_landed"] and a["disk_write_errors"] == 0
    # 3 blocks + the snapshot at the prompt's last boundary (the default policy, branch+interval:32),
    # all uploaded
    assert a["store_uploads"] == a["store_level0_records"] >= 4
    b = _node("warm", tmp_path / "node-b", shared, server)        # its own, empty LMDB
    assert b["cached"] == 384 and b["err"] < 1e-4
    assert b["blocks_from_disk"] == 3 and b["snapshots_from_disk"] == 1
    assert b["store_far_hits"] == 4 and b["store_level1_hits"] == 4
    assert b["store_promotions"] == 4 and b["store_level0_records"] >= 4  # now local on node B too
    print(f"node B: {b['cached']} tokens cached from the bucket; time to first token "
          f"warm {b['ttft_warm_s'] * 1e3:.0f} ms, cold {b['ttft_cold_s'] * 1e3:.0f} ms")


# ----------------------------------------------------------------------- racing writers
RACERS, RACE_KEYS, RACE_BYTES = 16, 6, 64 * 1024


def _race_payload(worker: int, i: int) -> np.ndarray:
    return np.random.default_rng((worker, i)).integers(0, 256, RACE_BYTES, dtype=np.uint8)


def _racer(url: str, creds: dict[str, Any], worker: int, barrier: Any, results: Any) -> None:
    try:
        # Generous timeout: SeaweedFS serializes contended conditional PUTs of one key.
        store = ZarrStore(url, layout_fingerprint=FP, timeout_s=30.0, **creds)
        items = [item_for(make_key(i, salt=b"race"), payload=_race_payload(worker, i)) for i in range(RACE_KEYS)]
        barrier.wait(timeout=120)
        results.put((worker, store.put_many(items)))
        store.close()
    except BaseException as e:  # report, do not hang the parent
        results.put((worker, f"{type(e).__name__}: {e}"))


@pytest.mark.s3
def test_racing_processes_leave_exactly_one_intact_record_each(server: SeaweedFS) -> None:
    url, creds = _prefix_url(server, "race"), _creds(server)
    ZarrStore(url, layout_fingerprint=FP, **creds).close()  # the group exists before the race
    ctx = mp.get_context("forkserver")  # children never inherit an obstore runtime
    ctx.set_forkserver_preload(["tiered_kv.storage", "numpy"])
    barrier, results = ctx.Barrier(RACERS), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(url, creds, w, barrier, results), daemon=True) for w in range(RACERS)]
    for p in procs:
        p.start()
    try:
        reports = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
    errors = {w: r for w, r in reports.items() if isinstance(r, str)}
    assert not errors, errors
    keys = [make_key(i, salt=b"race") for i in range(RACE_KEYS)]
    with ZarrStore(url, layout_fingerprint=FP, **creds) as store:
        assert set(store) == set(keys)
        assert store.verify() == {"checked": RACE_KEYS, "corrupt": 0, "removed": 0, "corrupt_keys": []}
        for i, key in enumerate(keys):
            winners = [w for w, won in reports.items() if won[i]]
            assert len(winners) == 1, f"{key!r}: put_many returned True to workers {winners}"
            out = np.empty(RACE_BYTES, np.uint8)
            assert store.get(key, out, token_digest=digest_for(key)) is not None
            np.testing.assert_array_equal(out, _race_payload(winners[0], i))  # the winner's bytes, whole


# ----------------------------------------------------------------------- the bucket goes away
def _fill(cache: TieredKVCache, model: Any, tokens: list[int]) -> float:
    """Serve ``tokens`` (prefill); returns the seconds ``open`` took (where far calls happen)."""
    t0 = time.monotonic()
    req = cache.open(tokens)
    opened = time.monotonic() - t0
    model.forward(cache, req, tokens[req.num_cached_tokens:])
    cache.close(req)
    cache.flush()
    return opened


@pytest.mark.s3
def test_killed_object_store_local_serving_continues_and_uploads_resume(
        server: SeaweedFS, tmp_path: Path, tiny_layout, tiny_model) -> None:
    timeout_s = 1.0
    bound_s = timeout_s + 2.0   # the chain's bound plus local work on a loaded CI machine
    shared = _prefix_url(server, "kill")
    # The bucket client's own timeout is far longer than the chain's, so a call to the
    # frozen server can only end by the chain's bound (counted as a timeout), never by the
    # client giving up at the same moment (an error).
    opts = {"timeout_s": timeout_s, "backoff_initial_s": 0.2, "backoff_max_s": 1.0,
            "level_options": [{"max_bytes": 1 << 30}, {**_creds(server), "timeout_s": 30.0}]}
    prompts = [random_tokens(300, seed=30 + i) for i in range(4)]
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, snapshot_interval=1,
                       store=[f"lmdb://{tmp_path / 'local'}", shared], store_options=opts) as cache:
        chain = cache.disk.store
        _fill(cache, tiny_model, prompts[0])
        assert chain.wait_uploads(30)

        # Hung server (SIGSTOP: connections accepted, never answered): bounded by timeout_s.
        assert server.pid is not None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            assert _fill(cache, tiny_model, prompts[1]) < bound_s
            assert chain.stats()["timeouts"] >= 1
        finally:
            os.kill(server.pid, signal.SIGCONT)

        server.stop()  # killed: connections refused
        try:
            for p in prompts[2:]:
                assert _fill(cache, tiny_model, p) < bound_s
            # prompt 0's blocks left the GPU pool (8 blocks); they come back from the local LMDB
            before = cache.stats()["blocks_from_disk"]
            t0 = time.monotonic()
            req = cache.open(prompts[0] + [7])
            assert time.monotonic() - t0 < bound_s
            assert req.num_cached_tokens == 256 and cache.stats()["blocks_from_disk"] > before
            got = tiny_model.forward(cache, req, (prompts[0] + [7])[256:])
            assert (got - tiny_model.naive_logits(prompts[0] + [7])[256:]).abs().max().item() < 1e-4
            cache.close(req)
            s = cache.stats()
            assert s["store_pending_uploads"] > 0 and s["store_levels_down"] == 1
            assert s["store_upload_failures"] + s["store_level_unavailable"] > 0
            assert not chain.wait_uploads(0.2)
        finally:
            server.restart()
        assert chain.wait_uploads(60)                      # the queued uploads land
        s = cache.stats()
        assert s["store_pending_uploads"] == 0 and s["store_levels_down"] == 0 and s["store_failed_uploads"] == 0
        local = set(chain.levels()[0])
    with ZarrStore(shared, layout_fingerprint=tiny_layout.fingerprint, **_creds(server)) as bucket:
        assert local <= set(bucket)                        # everything node-local is in the bucket
        assert bucket.verify()["corrupt"] == 0


# ----------------------------------------------------------------------- durable uploads
def _upload_worker(phase: str, local: Path, shared: str, server: SeaweedFS) -> subprocess.Popen[str]:
    env = {**os.environ, **server.env(), "PYTHONPATH": str(HERE)}
    env.pop("AWS_SESSION_TOKEN", None)
    return subprocess.Popen([sys.executable, str(HERE / "_upload_worker.py"), phase, str(local), shared],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen[str], rc: int = 0) -> dict[str, Any]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == rc, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.s3
@pytest.mark.slow
def test_uploads_owed_by_a_killed_writer_reach_the_bucket_without_sync(
        server: SeaweedFS, tmp_path: Path, tiny_layout) -> None:
    local, shared = tmp_path / "node", _prefix_url(server, "killed")
    wrote = _result(_upload_worker("write", local, shared, server), rc=-signal.SIGKILL)
    assert wrote["uploads"] == 0 and wrote["journaled_uploads"] == wrote["local"] > 0

    with LmdbStore(local, layout_fingerprint=tiny_layout.fingerprint) as store:   # one record evicted since
        gone = next(iter(store))
        store.delete(gone)
        kept = set(store)
    resumers = [_upload_worker("resume", local, shared, server) for _ in range(2)]  # two at once
    results = [_result(p) for p in resumers]
    assert all(r["done"] and r["failed_uploads"] == 0 for r in results)
    assert sum(r["uploads"] for r in results) == len(kept)   # create-only: each record sent once
    assert sum(r["uploads_skipped"] for r in results) >= 1 and results[-1]["journaled_uploads"] == 0
    with ZarrStore(shared, layout_fingerprint=tiny_layout.fingerprint, **_creds(server)) as bucket:
        assert set(bucket) == kept and bucket.verify()["corrupt"] == 0


# ----------------------------------------------------------------------- credentials
@pytest.mark.s3
def test_wrong_credentials_clear_error_and_no_data_loss(server: SeaweedFS, tmp_path: Path, tiny_layout,
                                                         tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered_kv.storage.s3 import ObjectStoreAuthError, open_object_store, parse_s3_url

    local, shared = f"lmdb://{tmp_path / 'local'}", _prefix_url(server, "creds")
    tokens = random_tokens(300, seed=40)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=local) as cache:
        _fill(cache, tiny_model, tokens)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(ObjectStoreAuthError, match="AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY") as e:
        TieredKVCache(tiny_layout, store=[local, shared])
    assert "not-the-secret" not in str(e.value)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(ObjectStoreAuthError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY not set"):
        TieredKVCache(tiny_layout, store=[local, shared])

    # Credentials refused while running (e.g. rotated): served locally, counted, retried.
    opts = {"timeout_s": 2.0, "backoff_initial_s": 0.1, "backoff_max_s": 0.5,
            "level_options": [None, _creds(server)]}
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, store=[local, shared],
                       store_options=opts) as cache:
        req = cache.open(tokens + [1])
        assert req.num_cached_tokens == 256                # the local level kept everything
        cache.close(req)
        objects = cache.disk.store.levels()[1]._objects    # rotate the credentials under the store
        good = objects.store
        objects.store = open_object_store(parse_s3_url(shared, env={}, access_key_id=server.access_key,
                                                       secret_access_key="rotated-away"))
        _fill(cache, tiny_model, random_tokens(300, seed=41))
        assert not cache.disk.store.wait_uploads(0.5)
        s = cache.stats()
        assert s["store_auth_errors"] >= 1 and s["store_pending_uploads"] > 0
        assert "AWS_SECRET_ACCESS_KEY" in cache.disk.store.stats()["levels"][1]["last_error"]
        objects.store = good
        assert cache.disk.store.wait_uploads(30)
        assert cache.stats()["store_failed_uploads"] == 0


# ----------------------------------------------------------------------- layouts and tenants
@pytest.mark.s3
def test_other_layout_or_tenant_is_never_served(server: SeaweedFS, tmp_path: Path, tiny_layout,
                                                 tiny_model) -> None:
    shared = _prefix_url(server, "tenants")
    opts = {"timeout_s": 2.0, "level_options": [None, _creds(server)]}
    tokens = random_tokens(300, seed=50)

    def node(name: str, **kw: Any) -> TieredKVCache:
        layout = kw.pop("layout", tiny_layout)
        return TieredKVCache(layout, num_blocks=8, num_state_slots=1, store=[f"lmdb://{tmp_path / name}", shared],
                             store_options=opts, **kw)

    with node("a", salt="tenant-a") as cache:
        _fill(cache, tiny_model, tokens)
        assert cache.disk.store.wait_uploads(30)
    with node("b", salt="tenant-b") as cache:             # same tokens, other tenant: nothing
        req = cache.open(tokens)
        assert req.num_cached_tokens == 0 and cache.stats()["store_far_hits"] == 0
        cache.close(req)
    with node("c", salt="tenant-a") as cache:             # same tenant on a fresh node: served
        req = cache.open(tokens)
        assert req.num_cached_tokens == 256
        cache.close(req)
    other = presets.tiny(top_k=4)
    with pytest.raises(LayoutMismatchError, match=other.fingerprint):
        node("d", layout=other)
    LmdbStore(tmp_path / "d", layout_fingerprint=other.fingerprint).close()  # its local level was released

    # A record of another fingerprint planted under a key of this layout is a miss, and removed.
    key = make_key(1, salt=b"planted")
    planted = encode_record(key=key, parent_hash=bytes(32), token_digest=digest_for(key),
                            layout_fingerprint=OTHER_FP, payload=payload_for(key, N))
    import obstore
    from tiered_kv.storage.s3 import open_object_store, parse_s3_url

    h = key.block_hash.hex()
    raw = open_object_store(parse_s3_url(shared, env={}, **_creds(server)))
    assert obstore.put(raw, f"blocks/{h[:2]}/{h[2:]}", bytes(planted))
    with ZarrStore(shared, layout_fingerprint=tiny_layout.fingerprint, **_creds(server)) as bucket:
        assert bucket.get(key, np.empty(N, np.uint8)) is None
        assert bucket.stats()["corrupt"] == 1 and not bucket.contains(key)
    with pytest.raises(LayoutMismatchError):
        ZarrStore(shared, layout_fingerprint=OTHER_FP, **_creds(server))
    with pytest.raises(ValueError, match="only with an object store"):
        ZarrStore(tmp_path / "x", layout_fingerprint=FP, timeout_s=1.0)
