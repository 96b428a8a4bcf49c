"""A damaged LMDB index (``data.mdb``): detected before LMDB can fault on it, reported in
one line that names the fix, and rebuilt from the segment files (the write-ahead log).

Each kind of damage (truncated to 10,000 bytes, a zeroed page, 0 bytes, deleted) is done
to a store whose segments also hold bytes that must never come back: a record whose
payload was flipped (fails its checksum), a torn tail, and a deleted record (its hole
punched). After the rebuild every record that verifies is back and reads exactly, and
nothing else is indexed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import lmdb
import numpy as np
import pytest

from storage_helpers import FP, OTHER_FP, item_for, make_key, payload_size, verify_all
from tiered_kv.storage import IndexDamagedError, LayoutMismatchError, LmdbStore, StoreLockedError, record_size
from tiered_kv.storage.lmdb.pages import DbRecord, IndexDamage, walk_index
from tiered_kv.storage.lmdb import unpack_entry
from tiered_kv.storage.format.record import HEADER_BYTES
from tiered_kv.storage.lmdb.segments import segment_name

FORK = mp.get_context("fork")
DAMAGES = ["truncated", "zeroed_page", "empty", "deleted"]
#: records written; key 3 is deleted, key 5's payload is flipped in its segment
WRITTEN = range(60)
DELETED, FLIPPED = 3, 5


def _flip_payload(where: Path, key) -> None:
    env = lmdb.open(str(where), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            loc, _ = unpack_entry(txn.get(key.to_bytes(), db=env.open_db(b"records", txn=txn, create=False)))
    finally:
        env.close()
    with open(where / "segments" / segment_name(loc.segment), "r+b") as f:
        f.seek(loc.offset + HEADER_BYTES)
        b = f.read(1)
        f.seek(loc.offset + HEADER_BYTES)
        f.write(bytes([b[0] ^ 0xFF]))


def build_store(where: Path, fingerprint: str = FP) -> set:
    """A store of several segments; returns the keys a rebuild must bring back."""
    keys = [make_key(i) for i in WRITTEN]
    with LmdbStore(where, layout_fingerprint=fingerprint, segment_bytes=256 << 10) as store:
        for i in range(0, len(keys), 10):
            assert all(store.put_many([item_for(k) for k in keys[i:i + 10]]))
        assert store.delete(keys[DELETED])
    _flip_payload(where, keys[FLIPPED])
    with open(where / "segments" / segment_name(1), "ab") as f:
        f.write(b"TKVR" + bytes(5000))  # a torn tail: a header start and nothing valid
    assert len(list((where / "segments").glob("*.seg"))) >= 3
    return {k for i, k in enumerate(keys) if i not in (DELETED, FLIPPED)}


def damage(where: Path, how: str) -> None:
    data = where / "data.mdb"
    if how == "truncated":
        os.truncate(data, 10_000)
    elif how == "zeroed_page":
        # the root page of the ``records`` tree: zeroing it leaves LMDB reading node
        # offsets out of a page of zeros (an assertion abort or garbage), never an error
        page = _records_root(where)
        with open(data, "r+b") as f:
            f.seek(page * 4096)
            f.write(bytes(4096))
    elif how == "empty":
        os.truncate(data, 0)
    else:
        data.unlink()


def _records_root(where: Path) -> int:
    """The root page of the ``records`` tree (its MDB_db record in the main database)."""
    env = lmdb.open(str(where), max_dbs=4, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            return DbRecord.parse(bytes(txn.get(b"records", db=env.open_db(None, txn=txn)))).root
    finally:
        env.close()


@pytest.fixture
def store_and_keys(tmp_path: Path) -> tuple[Path, set]:
    where = tmp_path / "s"
    return where, build_store(where)


@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_index_is_refused_in_one_line_then_rebuilt(store_and_keys: tuple[Path, set], how: str) -> None:
    where, keep = store_and_keys
    damage(where, how)
    for options in ({"readonly": True}, {"repair_index": False}):
        with pytest.raises(IndexDamagedError) as info:
            LmdbStore(where, layout_fingerprint=FP, **options)
        message = str(info.value)
        assert "\n" not in message and f"tiered-kv verify --repair --store {where}" in message
    assert not list(where.glob("damaged-index-*"))  # refusing changed nothing
    with LmdbStore(where, layout_fingerprint=FP) as store:  # a writable open rebuilds it
        rebuilt = store.index_rebuild
        assert rebuilt is not None and rebuilt["records"] == len(keep)
        assert set(store) == keep  # nothing unverified (flipped, torn, deleted) is indexed
        assert verify_all(store) == len(keep)  # and every record reads back exactly
        got = store.verify()
        assert (got["checked"], got["corrupt"], got["index_problems"]) == (len(keep), 0, [])
        assert store.stats()["bytes"] == sum(record_size(payload_size(k)) for k in keep)
        assert store.put_many([item_for(make_key(1000))]) == [True]  # and it takes writes
    moved = list(where.glob("damaged-index-*/data.mdb"))
    assert len(moved) == (0 if how == "deleted" else 1)  # the evidence is kept, never deleted
    with LmdbStore(where, layout_fingerprint=FP, readonly=True) as store:
        assert len(store) == len(keep) + 1 and store.index_rebuild is None


def test_the_rebuilt_index_accounts_bytes_and_lru(store_and_keys: tuple[Path, set]) -> None:
    where, keep = store_and_keys
    with LmdbStore(where, layout_fingerprint=FP, readonly=True) as store:
        before = store.stats()["bytes"]
    damage(where, "truncated")
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["bytes"] == before - _flipped_bytes()
        assert store.gc(0)["evicted"] == len(keep)  # every record is in the LRU index
        assert len(store) == 0 and store.stats()["bytes"] == 0


def _flipped_bytes() -> int:
    return record_size(payload_size(make_key(FLIPPED)))


def test_the_walk_finds_every_page_that_would_fault(tmp_path: Path) -> None:
    """Zeroing any page the index reaches is reported, naming the page; zeroing a free
    page (one no tree reaches) is harmless and passes."""
    where = tmp_path / "s"
    build_store(where)
    data = where / "data.mdb"
    walk = walk_index(data)
    pages = data.stat().st_size // 4096
    original = data.read_bytes()
    found = 0
    for page in range(2, pages, max(1, pages // 40)):
        with open(data, "r+b") as f:
            f.seek(page * 4096)
            f.write(bytes(4096))
        try:
            walk_index(data)
        except IndexDamage as e:
            found += 1
            assert f"page {page}" in str(e)
        data.write_bytes(original)
    assert found and walk.entries["records"] == len(WRITTEN) - 1


def test_rebuild_refuses_while_another_process_has_the_store_open(store_and_keys: tuple[Path, set]) -> None:
    where, keep = store_and_keys
    ready, done = FORK.Event(), FORK.Event()

    def hold() -> None:
        with LmdbStore(where, layout_fingerprint=FP, readonly=True):
            ready.set()
            done.wait(60)

    proc = FORK.Process(target=hold)
    proc.start()
    try:
        assert ready.wait(60)
        damage(where, "deleted")
        with pytest.raises(StoreLockedError, match="another process has this store open"):
            LmdbStore(where, layout_fingerprint=FP)
        assert not (where / "data.mdb").exists()  # nothing was changed
    finally:
        done.set()
        proc.join(60)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert set(store) == keep


def test_rebuild_refuses_a_store_of_another_layout(store_and_keys: tuple[Path, set]) -> None:
    where, _ = store_and_keys
    damage(where, "zeroed_page")
    with pytest.raises(LayoutMismatchError):
        LmdbStore(where, layout_fingerprint=OTHER_FP)
    assert not list(where.glob("damaged-index-*"))


def test_bad_entries_of_every_sub_database_are_reported_then_fixed(store_and_keys: tuple[Path, set]) -> None:
    """``records`` is not the only sub-database: entries of ``atime``, ``lru`` and
    ``meta`` that lost their format are index problems, never a clean "0 corrupt"."""
    where, keep = store_and_keys
    env = lmdb.open(str(where), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True) as txn:
        atime, lru, meta = (env.open_db(n, txn=txn, create=False) for n in (b"atime", b"lru", b"meta"))
        victim = next(iter(sorted(k.to_bytes() for k in keep)))
        txn.put(victim, b"\x01\x02", db=atime)  # an access entry cut short
        txn.put(b"\x00" * 5, b"", db=lru)       # an LRU key of the wrong length
        txn.put(b"counters", b"\x07", db=meta)
    env.close()
    with LmdbStore(where, layout_fingerprint=FP, readonly=True) as store:
        got = store.verify()
        assert got["corrupt"] == 1 and len(got["index_problems"]) >= 3  # (the flipped record)
        assert any(p.startswith("atime:") for p in got["index_problems"])
        assert any(p.startswith("lru:") for p in got["index_problems"])
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.verify(repair=True)["index_problems"]
        again = store.verify()
        assert again["index_problems"] == [] and again["corrupt"] == 0
        assert store.gc(0)["evicted"] == len(keep)


def test_a_meta_value_of_the_wrong_length_is_damage_not_a_struct_error(store_and_keys: tuple[Path, set]) -> None:
    where, keep = store_and_keys
    env = lmdb.open(str(where), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"record_bytes", b"\x01\x02\x03", db=env.open_db(b"meta", txn=txn, create=False))
    env.close()
    with pytest.raises(IndexDamagedError, match="expected 8"):
        LmdbStore(where, layout_fingerprint=FP, readonly=True)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.index_rebuild is not None and set(store) == keep
        assert verify_all(store) == len(keep)


def test_a_new_store_and_an_empty_directory_are_not_damage(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "new", layout_fingerprint=FP) as store:
        assert store.index_rebuild is None and len(store) == 0
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "data.mdb").write_bytes(b"")  # a creator died before LMDB initialized it
    with LmdbStore(tmp_path / "bare", layout_fingerprint=FP) as store:
        assert store.index_rebuild is None
        assert store.put_many([item_for(make_key(1))]) == [True]
    with pytest.raises(FileNotFoundError):
        LmdbStore(tmp_path / "nothing", layout_fingerprint=FP, readonly=True)


def test_reads_through_a_verified_index_never_fault(store_and_keys: tuple[Path, set]) -> None:
    where, keep = store_and_keys
    with LmdbStore(where, layout_fingerprint=FP, readonly=True) as store:
        keys = sorted(keep, key=lambda k: k.block_hash)
        outs = [np.empty(payload_size(k), np.uint8) for k in keys]
        assert all(m is not None for m in store.get_many(keys, outs))


# ----------------------------------------------------------------------------- the CLI
def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from tiered_kv.cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def tiny_store(tmp_path: Path) -> tuple[Path, set]:
    """A store of the CLI's default layout (``--model tiny``)."""
    from tiered_kv import presets

    where = tmp_path / "tiny"
    return where, build_store(where, presets.tiny().fingerprint)


@pytest.mark.parametrize("how", DAMAGES)
def test_cli_reports_a_damaged_index_in_one_line_and_verify_repair_rebuilds_it(
        tiny_store: tuple[Path, set], how: str, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tiered_kv.cli.main import ExitCode

    where, keep = tiny_store
    damage(where, how)
    for command in ("stats", "verify"):
        code, out, err = run_cli(capsys, command, "--store", str(where))
        assert code == ExitCode.FAILURE and out == ""
        assert err.count("\n") == 1 and "damaged" in err
        assert f"`tiered-kv verify --repair --store {where}`" in err
    code, out, err = run_cli(capsys, "verify", "--store", str(where), "--repair")
    assert code == ExitCode.OK, err
    assert "the index was damaged" in out and f"{len(keep)} records" in out
    code, out, err = run_cli(capsys, "stats", "--store", str(where), "--json")
    assert code == ExitCode.OK and json.loads(out)["records"] == len(keep)
    code, out, _ = run_cli(capsys, "verify", "--store", str(where), "--json")
    got = json.loads(out)
    assert code == ExitCode.OK and (got["checked"], got["corrupt"], got["index_problems"]) == (len(keep), 0, [])


def test_cli_verify_reports_bad_index_entries_and_never_a_clean_zero(
        tiny_store: tuple[Path, set], capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_kv.cli.main import ExitCode

    where, keep = tiny_store
    env = lmdb.open(str(where), max_dbs=4, map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(b"\x00" * 5, b"", db=env.open_db(b"lru", txn=txn, create=False))
    env.close()
    code, out, _ = run_cli(capsys, "verify", "--store", str(where))
    assert code == ExitCode.FAILURE and "index    lru:" in out and "--repair" in out
    assert run_cli(capsys, "verify", "--store", str(where), "--repair")[0] == ExitCode.OK
    code, out, _ = run_cli(capsys, "verify", "--store", str(where))
    assert code == ExitCode.OK and "index" not in out.split("removed", 1)[1]


def test_cli_gc_on_a_damaged_index_rebuilds_it_first(tiny_store: tuple[Path, set],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    where, keep = tiny_store
    damage(where, "truncated")
    code, out, err = run_cli(capsys, "gc", "--store", str(where), "--max-bytes", "1G")
    assert code == 0 and "rebuilt it from the segment files" in err and f"{len(keep)} records" in out


def _snapshot(where: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in where.rglob("*") if p.is_file()}


def test_cli_verify_works_on_a_read_only_mount(tiny_store: tuple[Path, set], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A read-only bind mount of the store (EROFS: LMDB opens without its lock file);
    not being root, a directory without write permission stands in for it."""
    import subprocess

    where, keep = tiny_store
    view = tmp_path / "ro"
    if os.geteuid() == 0:
        view.mkdir()
        r = subprocess.run(["mount", "--bind", str(where), str(view)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot bind-mount: {r.stderr.strip()}")
        try:
            if subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], capture_output=True).returncode:
                pytest.skip("cannot remount the bind mount read-only")
            _verify_read_only(view, keep, capsys)
        finally:
            subprocess.run(["umount", str(view)], capture_output=True)
    else:
        view = where
        for p in [where, *where.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
        try:
            _verify_read_only(view, keep, capsys)
        finally:
            for p in [where, *where.rglob("*")]:
                p.chmod(p.stat().st_mode | 0o200)


def _verify_read_only(view: Path, keep: set, capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_kv.cli.main import ExitCode

    with pytest.raises(OSError):
        (view / "probe").write_bytes(b"")  # really not writable
    before = _snapshot(view)
    code, out, err = run_cli(capsys, "verify", "--store", str(view))
    assert code == ExitCode.FAILURE, err  # the flipped record, reported and left in place
    assert f"checked {len(keep) + 1} records, 1 corrupt, 0 removed" in out
    assert _snapshot(view) == before
    code, _, err = run_cli(capsys, "verify", "--store", str(view), "--repair")
    assert code != ExitCode.OK and err.count("\n") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
def test_verify_as_a_user_who_cannot_write_the_store(tiny_store: tuple[Path, set],
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """lock.mdb cannot be opened for writing (EACCES, not EROFS: LMDB itself gives up):
    the read-only open goes on without the lock file, and nothing is written.

    The child runs as uid 65534, which may not be able to read the checkout or the venv
    (a clone under /root): everything it runs is imported before it drops privileges (the
    same command, run as root first), and an import after that fails the test wherever
    the checkout lives (exit 98, the names printed) instead of only where it is unreadable."""
    from tiered_kv.cli.main import ExitCode

    import importlib.abc
    import shutil
    import sys
    import tempfile
    import traceback

    store, keep = tiny_store
    run_cli(capfd, "verify", "--store", str(store), "--json")  # what the child runs, as root: its imports
    nobody = 65534
    top = Path(tempfile.mkdtemp(prefix="tkv-ro-"))  # under /tmp: pytest's own dirs are root-only
    try:
        where = top / "store"
        shutil.copytree(store, where)
        for p in [top, where, *where.rglob("*")]:
            os.chown(p, nobody, nobody)
            p.chmod(p.stat().st_mode & ~0o222)
        before = _snapshot(where)
        pid = os.fork()
        if pid == 0:  # the child: exit status = the CLI's exit code, 98 for a late import, 99 for anything else
            code = 99
            late: list[str] = []

            class NoLateImports(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path, target=None):  # (a module already imported never gets here)
                    late.append(name)
                    raise ImportError(f"{name}: imported after dropping privileges")

            try:
                from tiered_kv.cli.main import main

                sys.meta_path.insert(0, NoLateImports())
                os.setgid(nobody)
                os.setuid(nobody)
                code = main(["verify", "--store", str(where), "--json"])
            except BaseException:
                traceback.print_exc()
            finally:
                if late:
                    print(f"imported after dropping privileges: {late}", file=sys.stderr)
                    code = 98
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out, err = capfd.readouterr()
        after = _snapshot(where)
    finally:
        shutil.rmtree(top)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == ExitCode.FAILURE, out + err  # 1: the flipped record
    assert '"checked": %d' % (len(keep) + 1) in out and '"corrupt": 1' in out
    assert after == before


def test_a_rebuilt_store_keeps_owner_only_files(store_and_keys: tuple[Path, set]) -> None:
    import stat

    where, _ = store_and_keys
    damage(where, "zeroed_page")
    old = os.umask(0o277)
    try:
        LmdbStore(where, layout_fingerprint=FP).close()
    finally:
        os.umask(old)
    for p in [where / "data.mdb", where / "lock.mdb", where / "index.reserve",
              *where.glob("damaged-index-*"), *where.glob("damaged-index-*/*")]:
        assert stat.S_IMODE(p.stat().st_mode) == (0o700 if p.is_dir() else 0o600), p


def test_rebuild_index_refuses_a_store_open_in_this_process(store_and_keys: tuple[Path, set]) -> None:
    """LMDB's lock cannot tell this process's own handle apart: the in-process registry
    does, so the index is never swapped under an open environment."""
    from tiered_kv.storage.lmdb.rebuild import rebuild_index

    where, keep = store_and_keys
    with LmdbStore(where, layout_fingerprint=FP) as store:
        with pytest.raises(StoreLockedError):
            rebuild_index(where, FP)
        assert set(store) == keep | {make_key(FLIPPED)}
    got = rebuild_index(where, None)  # closed: fine, and the layout is read from the records
    assert got["records"] == len(keep) and got["moved_to"]
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert set(store) == keep


def test_a_maintenance_open_rebuilds_with_the_layout_the_records_carry(store_and_keys: tuple[Path, set]) -> None:
    """``layout_fingerprint=None`` (what the CLI opens with when no layout option is
    given): the rebuild takes the layout from the records themselves."""
    where, keep = store_and_keys
    damage(where, "deleted")
    with pytest.raises(IndexDamagedError):
        LmdbStore(where, layout_fingerprint=None, readonly=True)
    with LmdbStore(where, layout_fingerprint=None) as store:
        assert store.layout_fingerprint == FP and store.index_rebuild["records"] == len(keep)
        assert verify_all(store) == len(keep)
