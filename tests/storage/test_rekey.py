"""``EncryptedStore.rekey`` loses nothing: killed (SIGKILL) at every step of a batch, then
run again, every record is there, exact, under the new key (storage/rekey_journal.py).

The kills are deterministic: a failpoint (``TIERED_KV_FAILPOINT``) or a wrapped backend
call stops a forked rekey at one step of its third batch; no sleeps. The CLI's kill test
is in tests/test_cli_encryption.py, an object store's in tests/test_encryption_s3.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("cryptography", reason="encryption needs the cryptography package (the encryption extra)")

from encryption_helpers import key_files, leaked_runs  # noqa: E402
from storage_helpers import FP, digest_for, item_for, make_key, payload_for  # noqa: E402
from tiered_kv.storage import (  # noqa: E402
    EncryptedStore,
    RecordKind,
    StoreError,
    StoreFullError,
    StoreLockedError,
    ZarrStore,
    open_store,
)
from tiered_kv.storage.encrypted.rekey_journal import (  # noqa: E402
    FAILPOINT_ENV,
    JOURNAL_NAME,
    RekeyJournal,
    default_journal_path,
)

N = 20_000
SIZES = {RecordKind.BLOCK: N, RecordKind.SNAPSHOT: N}
KEYS = [make_key(i) for i in range(20)]
BATCH = 4
FORK = mp.get_context("fork")


def enc(files: list[str], tenant: str = "acme") -> dict[str, Any]:
    return {"key_files": files, "tenant": tenant}


def read_all(store, keys) -> list[np.ndarray | None]:
    outs = [np.empty(N, np.uint8) for _ in keys]
    metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
    return [o if m is not None else None for m, o in zip(metas, outs)]


def assert_exact(store, keys) -> None:
    for k, out in zip(keys, read_all(store, keys)):
        assert out is not None, f"{k!r} lost"
        np.testing.assert_array_equal(out, payload_for(k, N))


#: Where the third batch's rewrite is killed: how many of its 4 records are out of the
#: store then (neither under the old name nor the new), how many the journal puts back
#: (the new names that lack them: records move to new names, so the old copy of a record
#: may still be there too), and how many objects the store then holds (an old copy and a
#: new one of the same record until the rerun removes the old).
KILL_POINTS = {
    "partial": (0, 0, 20),      # journal written and fsynced, not yet renamed into place
    "journaled": (0, 4, 24),    # journal in place, nothing removed
    "mid-delete": (2, 4, 22),   # 2 of the 4 old records removed
    "deleted": (4, 4, 20),      # all 4 removed, none written
    "mid-put": (2, 2, 20),      # 2 of the 4 new records written
    "put": (0, 0, 20),          # all 4 written, the journal not yet deleted
}


def _rekey_killed_at(url: str, files: list[str], point: str) -> None:
    """Rekey ``url`` in batches of 4; SIGKILL at ``point`` of the third batch rewritten."""
    store = open_store(url, layout_fingerprint=FP, encryption=enc(files))
    inner = store.inner
    if point == "mid-delete":
        delete, calls = inner.delete, [0]

        def delete_then_die(key):  # batches 1 and 2 made 8 calls; die before the 11th
            calls[0] += 1
            if calls[0] == 2 * BATCH + 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return delete(key)

        inner.delete = delete_then_die
    elif point == "mid-put":
        put, calls = inner.put_many, [0]

        def put_half_then_die(items):
            calls[0] += 1
            if calls[0] == 3:
                put(items[:2])
                os.kill(os.getpid(), signal.SIGKILL)
            return put(items)

        inner.put_many = put_half_then_die
    else:
        os.environ[FAILPOINT_ENV] = f"rekey-{point}:3"
    store.rekey(SIZES, batch=BATCH)


def _kill_rekey(url: str, files: list[str], point: str) -> None:
    proc = FORK.Process(target=_rekey_killed_at, args=(url, files, point))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL, f"the rekey was not killed at {point} (exit {proc.exitcode})"


@pytest.mark.parametrize("point", list(KILL_POINTS))
@pytest.mark.parametrize("scheme", ["lmdb", "zarr"])
def test_rekey_killed_at_any_step_loses_nothing(tmp_path: Path, scheme: str, point: str) -> None:
    old, new = key_files(tmp_path, "old", "new")
    where = tmp_path / "store"
    url = f"{scheme}://{where}"
    with open_store(url, layout_fingerprint=FP, encryption=enc([old])) as s:
        s.put_many([item_for(k, N) for k in KEYS])
    _kill_rekey(url, [new, old], point)
    out, restored, stored = KILL_POINTS[point]
    journal = where / JOURNAL_NAME
    assert journal.is_file() == (point not in ("partial",))
    if point == "deleted":
        # the journal: owner-only, the batch sealed under the new key, no plaintext
        assert stat.S_IMODE(journal.stat().st_mode) == 0o600
        assert leaked_runs(journal.read_bytes(), [payload_for(k, N) for k in KEYS]) == 0
        # while a rekey holds the lock, an opener leaves the journal to it; a second rekey is refused
        with RekeyJournal(journal).holding(required=True):
            with open_store(url, layout_fingerprint=FP, encryption=enc([new, old])) as s:
                assert len(s) == 20 - out and s.stats()["rekey_restored"] == 0
                with pytest.raises(StoreLockedError, match="a rekey of this store is running"):
                    s.rekey(SIZES)
    # any encrypted open puts back what the killed run had out of the store: nothing lost
    with open_store(url, layout_fingerprint=FP, encryption=enc([new, old])) as s:
        assert s.stats()["rekey_restored"] == restored and len(s) == stored
        assert_exact(s, KEYS)
        report = s.rekey(SIZES, batch=BATCH)  # and the rerun finishes the job
        assert (report.restored, report.lost, report.absent, report.failed) == (restored, 0, 0, 0)
        done = 2 * BATCH + (0 if point == "partial" else BATCH)  # records already under the new names
        assert (report.checked, report.current, report.rekeyed) == (stored, done, 20 - done)
        assert report.opened_old == stored - done and len(s) == 20
    assert not journal.exists() and not (where / f"{JOURNAL_NAME}.partial").exists()
    with open_store(url, layout_fingerprint=FP, encryption=enc([new])) as s:  # the old key retired
        r = s.verify(payload_bytes=SIZES)
        assert (r["checked"], r["authenticated"], r["auth_failures"], r["corrupt"]) == (20, 20, 0, 0)
        assert_exact(s, KEYS)


def test_object_store_rekey_keeps_a_failed_batch_in_its_journal(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A store without a directory (here a zarr MemoryStore standing in for a bucket)
    journals to a local file; a batch whose rewrite fails stays there until the next
    run puts it back."""
    from zarr.storage import MemoryStore

    old, new = key_files(tmp_path, "old", "new")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    inner = ZarrStore(MemoryStore(), layout_fingerprint=FP)  # (adopted as a sealed level by the first wrapper)
    with EncryptedStore(inner, enc([old]), owned=False) as s:
        s.put_many([item_for(k, N) for k in KEYS])
    s = EncryptedStore(inner, enc([new, old]))
    default = s.rekey_journal()
    assert default.path == default_journal_path(inner.where)
    assert default.path.parent == tmp_path / "cache" / "tiered_kv" / "rekey"
    journal = tmp_path / "j" / "bucket.journal"
    put, calls = inner.put_many, [0]

    def put_fails_on_the_third_batch(items):
        calls[0] += 1
        if calls[0] == 3:
            raise StoreFullError("bucket quota exceeded")
        return put(items)

    inner.put_many = put_fails_on_the_third_batch
    with pytest.raises(StoreFullError) as info:
        s.rekey(SIZES, batch=BATCH, journal=journal)
    assert any(str(journal) in note for note in info.value.__notes__)
    assert len(s) == 20 - BATCH and journal.is_file()
    assert stat.S_IMODE(journal.stat().st_mode) == 0o600 and stat.S_IMODE(journal.parent.stat().st_mode) == 0o700
    del inner.put_many
    report = s.rekey(SIZES, batch=BATCH, journal=journal)
    assert (report.restored, report.current, report.rekeyed, report.lost) == (BATCH, 3 * BATCH, 20 - 3 * BATCH, 0)
    assert len(s) == 20 and not journal.exists() and not default.path.exists()
    assert_exact(s, KEYS)
    assert s.sample(KEYS, SIZES) == [bytes.fromhex(s.keyring.key_ids[0])] * 20
    s.close()


def test_a_local_store_keeps_its_journal_in_its_directory(tmp_path: Path) -> None:
    (k,) = key_files(tmp_path, "k")
    with open_store(f"lmdb://{tmp_path / 'store'}", layout_fingerprint=FP, encryption=enc([k])) as s:
        assert s.rekey_journal().path == tmp_path / "store" / JOURNAL_NAME
        with pytest.raises(ValueError, match="journal: expected None for a local store"):
            s.rekey_journal(tmp_path / "elsewhere")
        with pytest.raises(ValueError, match="batch: expected a positive int"):
            s.rekey(SIZES, batch=0)
    with pytest.raises(ValueError, match="journal: expected a file path"):
        RekeyJournal(tmp_path)


def test_replay_puts_back_only_verified_records(tmp_path: Path) -> None:
    """A damaged journal record is counted lost, never put back; a file that is not a
    journal is an error (left in place)."""
    from zarr.storage import MemoryStore

    items = [item_for(k, 1000) for k in KEYS[:3]]
    rj = RekeyJournal(tmp_path / "j")
    with rj.holding(required=True) as held:
        assert held
        rj.write(items, FP)
        raw = bytearray(rj.path.read_bytes())
        raw[16 + (144 + 1000 + 16) + 500] ^= 1  # a payload byte of the second record
        rj.path.write_bytes(bytes(raw))
        store = ZarrStore(MemoryStore(), layout_fingerprint=FP)
        store.put_many(items[2:])
        result = rj.replay(store)
        assert (result.restored, result.present, result.lost) == (1, 1, 1)
        assert not rj.path.exists() and sorted(store, key=str) == sorted([items[0].key, items[2].key], key=str)
        out = np.empty(1000, np.uint8)
        assert store.get(items[0].key, out) is not None
        np.testing.assert_array_equal(out, items[0].payload)
        # records that do not authenticate are not put back either; under a key not held,
        # nothing is put back and the journal is kept for a holder of that key
        rj.write(items, FP)
        result = rj.replay(ZarrStore(MemoryStore(), layout_fingerprint=FP),
                           authentic=lambda item: item.key != items[1].key)
        assert (result.restored, result.lost, result.deferred) == (2, 1, False)
        rj.write(items, FP)
        empty = ZarrStore(MemoryStore(), layout_fingerprint=FP)
        result = rj.replay(empty, authentic=lambda item: None)
        assert result.deferred and result.restored == 0 and rj.path.exists() and len(empty) == 0
        rj.path.write_bytes(b"not a journal at all")
        with pytest.raises(StoreError, match="not a rekey journal"):
            rj.replay(store)
        assert rj.path.exists()
        # a link planted at the journal's path is refused, never read through
        elsewhere = tmp_path / "elsewhere"
        rj.path.rename(elsewhere)
        os.symlink(elsewhere, rj.path)
        with pytest.raises(StoreError, match="symbolic link"):
            rj.replay(store)
