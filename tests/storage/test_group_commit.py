"""Group commit of the LMDB store: concurrent ``put_many`` calls of one process share one
segment sync and one index commit, errors reach only the writers they belong to, and a
writer process killed (-9) at any step of a group loses nothing it acknowledged and
serves nothing torn.

Every step is reached through the store's fault points (``store.faults.hook``,
group_commit.FaultPoint), never by sleeping: groups are formed by holding the leader at
LEAD until the expected writers are queued; failures are raised at a point.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storage_helpers import FP, digest_for, item_for, make_key, payload_for, verify_all
from tiered_kv.storage import LmdbStore, StoreError, StoreFullError
from tiered_kv.storage.lmdb.group_commit import FaultPoint

FORK = mp.get_context("fork")
N = 50_000  # payload bytes of the in-process tests' records
WAIT_S = 60  # a bound for a hook's wait, so a broken test fails instead of hanging


class Hook:
    """A fault hook that counts the points reached and runs an action at some of them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.seen: Counter[FaultPoint] = Counter()
        self.actions: dict[FaultPoint, Callable[[Any], None]] = {}

    def __call__(self, point: FaultPoint, info: Any) -> None:
        with self.cond:
            self.seen[point] += 1
            self.cond.notify_all()
        action = self.actions.get(point)
        if action is not None:
            action(info)

    def wait(self, point: FaultPoint, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.seen[point] >= n, WAIT_S), f"{point} not reached {n} times"

    def group_of(self, n: int) -> Hook:
        """Hold the leader of the first group until ``n`` batches are queued."""
        first = threading.Lock()

        def lead(_: Any) -> None:
            if first.acquire(blocking=False):
                self.wait(FaultPoint.ENQUEUED, n)

        self.actions[FaultPoint.LEAD] = lead
        return self


def _keys(writer: int, n: int = 3, *, base: int = 0) -> list:
    return [make_key(base + 100 * writer + i) for i in range(n)]


def _run_writers(store: LmdbStore, batches: dict[str, list], size: int = N,
                 out: dict[str, Any] | None = None) -> dict[str, Any]:
    """put_many each named batch of keys in its own thread; returns name -> results or
    error (filled into ``out`` as each call returns)."""
    out = {} if out is None else out

    def write(name: str, keys: list) -> None:
        try:
            out[name] = store.put_many([item_for(k, size) for k in keys])
        except BaseException as e:  # collected for the test to check
            out[name] = e

    threads = [threading.Thread(target=write, args=(name, keys), name=name) for name, keys in batches.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return out


def _count_calls(monkeypatch: pytest.MonkeyPatch, obj: Any, name: str) -> list:
    calls: list = []
    real = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_concurrent_puts_share_one_sync_and_one_index_commit(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(9999), N)])  # the segment exists: its creation syncs too
        hook = Hook().group_of(4)
        store.faults.hook = hook
        syncs = _count_calls(monkeypatch, os, "fdatasync")
        batches = {f"w{w}": _keys(w) for w in range(4)}
        out = _run_writers(store, batches)
        assert out == {name: [True] * 3 for name in batches}
        # one segment sync, one index transaction, one group for 4 writers
        assert len(syncs) == 1 and hook.seen[FaultPoint.INDEX_TXN] == 1
        assert (hook.seen[FaultPoint.INDEXED], hook.seen[FaultPoint.ENQUEUED]) == (1, 4)
        sizes = {k: N for keys in batches.values() for k in keys} | {make_key(9999): N}
        assert verify_all(store, sizes=sizes) == 13


def test_each_put_returns_only_once_its_records_are_synced_and_indexed(tmp_path: Path) -> None:
    """At the group's SYNCED step no writer has returned and nothing of the group is
    indexed; at INDEXED all of it is, and still no writer has returned."""
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        hook = Hook().group_of(3)
        batches = {f"w{w}": _keys(w) for w in range(3)}
        keys = [k for ks in batches.values() for k in ks]
        out: dict[str, Any] = {}
        checks: list[tuple[str, list[bool], int]] = []

        def check(point: str) -> Callable[[Any], None]:
            return lambda _: checks.append((point, store.contains_many(keys), len(out)))

        hook.actions[FaultPoint.SYNCED] = check("synced")
        hook.actions[FaultPoint.INDEXED] = check("indexed")
        store.faults.hook = hook
        _run_writers(store, batches, out=out)
        assert checks == [("synced", [False] * 9, 0), ("indexed", [True] * 9, 0)]
        assert all(r == [True] * 3 for r in out.values())


def test_the_next_group_syncs_while_one_commits_its_index_and_commits_stay_in_order(tmp_path: Path) -> None:
    """Group 1 ({w0}) holds the index stage until group 2 ({w1}) is synced: the two
    stages overlap, and group 2's index commit still comes after group 1's."""
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        hook = Hook()
        store.faults.hook = hook
        order: list[str] = []
        overlap: list[list[bool]] = []
        out: dict[str, Any] = {}
        second = threading.Thread(target=lambda: _run_writers(store, {"w1": _keys(1)}, out=out))

        def indexing(group: list) -> None:
            name = "w0" if group[0].kbs[0] == _keys(0)[0].to_bytes() else "w1"
            if name == "w0":
                second.start()
                hook.wait(FaultPoint.SYNCED, 2)  # group 2 synced while group 1 holds the index stage
            order.append(name)

        hook.actions[FaultPoint.SYNCED] = lambda _: overlap.append(store.contains_many(_keys(0)))
        hook.actions[FaultPoint.INDEXING] = indexing
        _run_writers(store, {"w0": _keys(0)}, out=out)
        second.join(WAIT_S)
        assert overlap == [[False] * 3, [False] * 3]  # at group 2's sync, group 1 is not indexed yet
        assert order == ["w0", "w1"]
        assert out == {"w0": [True] * 3, "w1": [True] * 3}
        assert verify_all(store, sizes={k: N for k in _keys(0) + _keys(1)}) == 6


def test_a_full_disk_fails_only_the_writer_that_does_not_fit(tmp_path: Path) -> None:
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP) as store:
        def reserve(length: int) -> None:
            if length > 1 << 20:  # the big batch: no room for it
                raise OSError(errno.ENOSPC, "injected: no space left")

        hook = Hook().group_of(2)
        hook.actions[FaultPoint.RESERVE] = reserve
        store.faults.hook = hook
        out = _run_writers(store, {"small0": _keys(0), "big": _keys(1, 30), "small2": _keys(2)})
        assert out["small0"] == out["small2"] == [True] * 3
        assert isinstance(out["big"], StoreFullError) and "disk full" in str(out["big"])
        assert set(store) == set(_keys(0) + _keys(2))
    with LmdbStore(where, layout_fingerprint=FP) as store:  # nothing of the big batch comes back
        assert store.stats()["recovered_records"] == 0
        assert verify_all(store, sizes={k: N for k in _keys(0) + _keys(2)}) == 6


def test_an_index_commit_failing_for_one_writer_fails_only_that_writer(tmp_path: Path) -> None:
    """The group's index transaction fails because of one batch (here: injected at its
    entries): each batch is then indexed alone, and only that one fails; its bytes are
    punched, so a reopen does not bring them back."""
    where = tmp_path / "s"
    poison = _keys(1)[0].to_bytes()
    with LmdbStore(where, layout_fingerprint=FP) as store:
        def index_batch(kbs: list[bytes]) -> None:
            if poison in kbs:
                raise StoreFullError("injected: no room for these index entries")

        hook = Hook().group_of(3)
        hook.actions[FaultPoint.INDEX_BATCH] = index_batch
        store.faults.hook = hook
        out = _run_writers(store, {f"w{w}": _keys(w) for w in range(3)})
        assert out["w0"] == out["w2"] == [True] * 3
        assert isinstance(out["w1"], StoreFullError) and "injected" in str(out["w1"])
        assert hook.seen[FaultPoint.INDEX_TXN] == 1 + 3  # the group's, then one per batch
        assert set(store) == set(_keys(0) + _keys(2))
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 0 and len(store) == 6


def test_a_failed_sync_fails_its_group_and_rewrites_a_writer_appended_behind_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fdatasync fails (EIO) for the group {w0, w1}, while w2 has appended behind it in the
    same segment: w0 and w1 get the error and none of their records is indexed; w2's
    pages may have been in the failed writeback, so w2 is written again, to a new
    segment, and stored."""
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP) as store:
        hook = Hook().group_of(2)
        store.faults.hook = hook
        late: dict[str, Any] = {}
        real = os.fdatasync
        failed = []

        def fdatasync(fd: int) -> None:
            if not failed:
                failed.append(fd)
                t = threading.Thread(target=lambda: late.update(_run_writers(store, {"w2": _keys(2)})))
                t.start()
                hook.wait(FaultPoint.APPENDED, 3)  # w2 wrote its records behind the group
                late["thread"] = t
                raise OSError(errno.EIO, "injected fdatasync failure")
            real(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        out = _run_writers(store, {"w0": _keys(0), "w1": _keys(1)})
        late["thread"].join(WAIT_S)
        assert all(isinstance(out[w], OSError) and "injected" in str(out[w]) for w in ("w0", "w1"))
        assert late["w2"] == [True] * 3
        assert set(store) == set(_keys(2)) and store.stats()["segments"] == 2
        assert verify_all(store, sizes={k: N for k in _keys(2)}) == 3
    with LmdbStore(where, layout_fingerprint=FP) as store:  # the failed bytes are not resurrected
        assert store.stats()["recovered_records"] == 0 and set(store) == set(_keys(2))


def test_close_fails_queued_writers_and_finishes_the_group_in_commit(tmp_path: Path) -> None:
    where = tmp_path / "s"
    store = LmdbStore(where, layout_fingerprint=FP)
    hook = Hook()
    synced = threading.Event()

    def hold(_: Any) -> None:  # the first group waits in its commit until close() began
        if not synced.is_set():
            synced.set()
            hook.wait(FaultPoint.CLOSING, 1)

    hook.actions[FaultPoint.SYNCED] = hold
    store.faults.hook = hook
    out: dict[str, Any] = {}
    first = threading.Thread(target=lambda: out.update(_run_writers(store, {"w0": _keys(0)})))
    first.start()
    assert synced.wait(WAIT_S)
    second = threading.Thread(target=lambda: out.update(_run_writers(store, {"w1": _keys(1)})))
    second.start()
    hook.wait(FaultPoint.ENQUEUED, 2)
    store.close()
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert out["w0"] == [True] * 3
    assert isinstance(out["w1"], StoreError) and "closed" in str(out["w1"])
    with pytest.raises(StoreError, match="closed"):
        store.put_many([item_for(make_key(7), N)])
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 0
        assert verify_all(store, sizes={k: N for k in _keys(0)}) == 3


def test_segment_end_never_passes_a_range_still_being_written(tmp_path: Path) -> None:
    """w0 reserves its range first and is held while staging; w1 appends behind it and
    commits. The index's segment_end must stop at w0's range: if an OS crash then takes
    w0's later index commit, the recovery scan still finds w0's synced records."""
    where = tmp_path / "s"
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(9999), N)])
        hook = Hook()
        w1_indexed = threading.Event()
        snapshot: list[bytes] = []

        def staged(j: int) -> None:
            if threading.current_thread().name == "w0" and j == 0:
                threading.Thread(target=lambda: _run_writers(store, {"w1": _keys(1)})).start()
                assert w1_indexed.wait(WAIT_S)

        def indexed(_: Any) -> None:
            if not w1_indexed.is_set():
                snapshot.append((where / "data.mdb").read_bytes())  # the index before w0's commit
                w1_indexed.set()

        hook.actions[FaultPoint.STAGED] = staged
        hook.actions[FaultPoint.INDEXED] = indexed
        store.faults.hook = hook
        assert _run_writers(store, {"w0": _keys(0)}) == {"w0": [True] * 3}
        assert w1_indexed.is_set()
    (where / "data.mdb").write_bytes(snapshot[0])  # w0's index commit lost (an OS crash)
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 3
        assert verify_all(store, sizes={k: N for k in [make_key(9999), *_keys(0), *_keys(1)]}) == 7


# ------------------------------------------------------------------ kill -9 mid-group
KILL_N = 700_000  # records of the killed round: 4 per writer, so 2 MiB chunks are written mid-staging
ROUND0 = 1000     # key base of the acknowledged round


def _kill(*_: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _group_writer(where: Path, point: str, ack_fd: int) -> None:
    """Child process: a round of 4 writers sharing one group, acknowledged on ``ack_fd``;
    then a round of 4 writers killed at ``point``."""
    store = LmdbStore(where, layout_fingerprint=FP)

    def write(base: int, w: int, size: int, n: int) -> None:
        keys = _keys(w, n, base=base)
        assert store.put_many([item_for(k, size) for k in keys]) == [True] * n
        os.write(ack_fd, f"{base} {w}\n".encode())

    def round_(base: int, size: int, n: int, hook: Hook, writers: range = range(4)) -> list[threading.Thread]:
        store.faults.hook = hook
        threads = [threading.Thread(target=write, args=(base, w, size, n), name=f"w{w}") for w in writers]
        for t in threads:
            t.start()
        return threads

    for t in round_(ROUND0, N, 2, Hook().group_of(4)):
        t.join()
    hook = Hook()
    if point == "staged":  # the first writer at its 4th record: the others anywhere in their append
        hook.actions[FaultPoint.STAGED] = lambda j: _kill() if j == 3 else None
    elif point == "appended":  # the first writer done writing: the others still writing
        hook.actions[FaultPoint.APPENDED] = _kill
    elif point == "overlap":  # group {w0, w1} synced, w2 and w3 written behind it, not synced
        go = threading.Event()
        hook.group_of(2)

        def synced(_: Any) -> None:
            go.set()
            hook.wait(FaultPoint.APPENDED, 4)
            _kill()

        hook.actions[FaultPoint.SYNCED] = synced
        round_(0, KILL_N, 4, hook, range(2))
        assert go.wait(WAIT_S)
        round_(0, KILL_N, 4, hook, range(2, 4))
    else:
        hook.group_of(4)
        at = {"lead": FaultPoint.LEAD, "synced": FaultPoint.SYNCED, "indexed": FaultPoint.INDEXED}[point]
        if at is FaultPoint.LEAD:
            hook.actions[at] = lambda info: (hook.wait(FaultPoint.ENQUEUED, 4), _kill())
        else:
            hook.actions[at] = _kill
    if point != "overlap":
        round_(0, KILL_N, 4, hook)
    threading.Event().wait(WAIT_S)  # killed before this ends
    os._exit(3)


def _read_back(store: LmdbStore, keys: list, size: int) -> list[bool]:
    """Each key's record: True if present and exact, False if a miss; anything else fails."""
    outs = [np.empty(size, np.uint8) for _ in keys]
    metas = store.get_many(keys, outs, token_digests=[digest_for(k) for k in keys])
    for key, meta, out in zip(keys, metas, outs):
        if meta is not None:
            np.testing.assert_array_equal(out, payload_for(key, size))
    return [m is not None for m in metas]


@pytest.mark.parametrize("point", ["staged", "appended", "lead", "synced", "indexed", "overlap"])
def test_writers_killed_mid_group(tmp_path: Path, point: str) -> None:
    """kill -9 at each step of a group (several threads writing): after reopening, every
    acknowledged record is present and exact, every other record is exact or a miss, and
    nothing is corrupt. Records written completely before the kill (from ``lead`` on, and
    in ``overlap`` the group behind the synced one) are all recovered."""
    where = tmp_path / "s"
    LmdbStore(where, layout_fingerprint=FP).close()
    ack_r, ack_w = os.pipe()
    proc = FORK.Process(target=_group_writer, args=(where, point, ack_w))
    proc.start()
    os.close(ack_w)
    proc.join(120)
    with os.fdopen(ack_r) as f:
        acked = {tuple(map(int, line.split())) for line in f}
    assert proc.exitcode == -signal.SIGKILL, f"writer exit code {proc.exitcode}"
    assert {(ROUND0, w) for w in range(4)} <= acked
    with LmdbStore(where, layout_fingerprint=FP) as store:
        recovered = store.stats()["recovered_records"]
        assert all(_read_back(store, [k for w in range(4) for k in _keys(w, 2, base=ROUND0)], N))
        killed = {w: _read_back(store, _keys(w, 4), KILL_N) for w in range(4)}
        for w in range(4):
            if (0, w) in acked:
                assert all(killed[w]), f"writer {w}: acknowledged, not all present"
        if point in ("lead", "synced", "indexed", "overlap"):
            assert all(all(v) for v in killed.values()), killed
            assert recovered == (0 if point == "indexed" else 16)
        report = store.verify()
        assert report["corrupt"] == 0 and store.stats()["corrupt"] == 0
    with LmdbStore(where, layout_fingerprint=FP) as store:  # recovered once: nothing more to scan
        assert store.stats()["recovered_records"] == 0
