"""storage/journal.py: the durable list of uploads a StoreChain owes its far levels, and a
writer killed with SIGKILL whose uploads the next chain sends (no server needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from storage_helpers import FP, item_for, make_key

from tiered_kv.storage import LmdbStore, StoreChain, ZarrStore, journal
from tiered_kv.storage.chain.journal import JOURNAL_FILE, UploadJournal, level_name

N = 4096


def test_add_scan_remove_count(tmp_path: Path) -> None:
    keys = [make_key(i, salt=b"j") for i in range(10)]
    with UploadJournal(tmp_path) as j:
        assert (tmp_path / JOURNAL_FILE).stat().st_mode & 0o777 == 0o600
        j.add(["a", "b"], [(k, 100 + i) for i, k in enumerate(keys)])    # one transaction, two levels
        j.add(["a"], [(keys[0], 100)])                                     # again: still one entry
        assert (j.count("a"), j.count("b"), j.count("never")) == (10, 10, 0)
        got = j.scan("a", limit=4)
        assert [k for k, _ in got] == sorted(keys, key=lambda k: k.to_bytes())[:4]
        rest = j.scan("a", after=got[-1][0], limit=100)
        assert len(rest) == 6 and {k for k, _ in got + rest} == set(keys)
        assert dict(got + rest)[keys[3]] == 103
        assert j.remove("a", keys[:3] + [make_key(99)]) == 3
        assert j.levels() == {"a": 7, "b": 10}
        with pytest.raises(ValueError, match="limit"):
            j.scan("a", limit=0)
    with UploadJournal(tmp_path) as j:                                     # reopened: all still there
        assert j.levels() == {"a": 7, "b": 10}
    assert level_name("zarr+s3://bkt/p?endpoint=http://h:1") == "zarr+s3://bkt/p"


@pytest.mark.parametrize("umask", [0o000, 0o277])
def test_journal_files_are_owner_only_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    """The journal and LMDB's lock file beside it are 0o600 like every file of a store
    (LMDB creates its lock file subject to the umask: 0o400 under 0o277, unless created first)."""
    old = os.umask(umask)
    try:
        j = UploadJournal(tmp_path)
        j.add(["far"], [(make_key(0), 100)])
        j.close()
    finally:
        os.umask(old)
    for name in (JOURNAL_FILE, f"{JOURNAL_FILE}-lock"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600, name


def test_handles_share_one_environment_and_the_map_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(journal, "_INITIAL_MAP", 64 << 10)
    a, b = UploadJournal(tmp_path), UploadJournal(tmp_path)               # same file, one process
    keys = [make_key(i, salt=b"grow") for i in range(3000)]               # ~ 3000 x 80 B: > 64 KiB
    for i in range(0, 3000, 500):
        a.add(["x"], [(k, 1) for k in keys[i:i + 500]])
    a.close()
    assert b.count("x") == 3000                                           # b still open after a closed
    b.close()
    b.close()                                                             # idempotent
    with pytest.raises(ValueError, match="existing directory"):
        UploadJournal(tmp_path / "missing")


WRITER = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    from storage_helpers import FP, item_for, make_key
    from tiered_kv.storage import DeferredLevel, LmdbStore, StoreChain

    def unreachable():
        raise ConnectionError("far level unreachable (injected)")

    near = LmdbStore(sys.argv[1], layout_fingerprint=FP)
    chain = StoreChain([near, DeferredLevel(sys.argv[2], unreachable)], backoff_initial_s=3600)
    for i in range(0, 24, 8):
        chain.put_many([item_for(make_key(k, salt=b"killed"), 4096) for k in range(i, i + 8)])
    assert chain.flush()
    print(chain.stats()["journaled_uploads"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_uploads_of_a_killed_writer_are_sent_by_the_next_chain(tmp_path: Path) -> None:
    local, far_dir = tmp_path / "local", tmp_path / "far"
    here = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", WRITER, str(local), str(far_dir), str(here)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -9, out.stderr[-2000:]
    assert out.stdout.split() == ["24"]
    keys = {make_key(k, salt=b"killed") for k in range(24)}
    with LmdbStore(local, layout_fingerprint=FP) as near, ZarrStore(far_dir, layout_fingerprint=FP) as far:
        assert set(near) == keys and len(far) == 0
        with StoreChain([near, far], owned=[False, False]) as chain:      # nothing but opening it
            assert chain.flush(uploads=True, timeout_s=30)
            s = chain.stats()
        assert set(far) == keys and far.verify()["corrupt"] == 0
        assert (s["uploads"], s["uploads_resumed"], s["journaled_uploads"]) == (24, 24, 0)
        for key in keys:
            assert far.get(key, bytearray(N)) is not None


def test_chain_stats_name_the_journal(tmp_path: Path) -> None:
    near = LmdbStore(tmp_path / "near", layout_fingerprint=FP)
    far = ZarrStore(tmp_path / "far", layout_fingerprint=FP)
    with StoreChain([near, far]) as chain:
        chain.put_many([item_for(make_key(1), N)])
        assert chain.flush(uploads=True, timeout_s=10)
        s = chain.stats()
        assert s["journal"] == os.fspath(tmp_path / "near" / JOURNAL_FILE)
        assert s["journal_errors"] == 0 and s["levels"][1]["journaled_uploads"] == 0
    with UploadJournal(tmp_path / "near") as j:
        assert j.levels() == {}
    json.dumps(s)  # stats stay JSON-serialisable
