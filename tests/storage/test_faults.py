"""storage/os/faults.py: the one fault-injection seam (hooks in-process, TIERED_KV_FAILPOINT
kills across processes), and that every component that has steps worth breaking reaches
it: an LMDB store's writes, a rekey's batches, a chain's journal."""

from __future__ import annotations

import enum
import multiprocessing as mp
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from storage_helpers import FP, item_for, make_key
from tiered_kv.storage import LmdbStore
from tiered_kv.storage.lmdb.group_commit import FaultPoint
from tiered_kv.storage.os.faults import FAILPOINT_ENV, Faults

FORK = mp.get_context("fork")


class _Point(enum.Enum):
    A = "a-point"


def test_a_hook_sees_every_point_with_its_info_and_can_fail_the_step() -> None:
    faults = Faults()
    faults.hit(_Point.A, 1)  # no hook: nothing happens
    seen: list[tuple[Any, Any]] = []
    faults.hook = lambda point, info: seen.append((point, info))
    faults.hit(_Point.A, "x")
    assert seen == [(_Point.A, "x")]

    def fail(point: Any, info: Any) -> None:
        raise OSError("injected")

    faults.hook = fail
    with pytest.raises(OSError, match="injected"):
        faults.hit(_Point.A)


def _hit_three_times(spec: str, numbered: bool) -> None:
    os.environ[FAILPOINT_ENV] = spec
    faults = Faults()
    for i in range(1, 4):
        faults.hit(_Point.A, n=10 + i if numbered else None)
    os._exit(7)


@pytest.mark.parametrize("spec,numbered,killed", [
    ("a-point:2", False, True),    # the second time the point is reached
    ("a-point:4", False, False),   # reached three times only
    ("a-point:12", True, True),    # the step numbered 12
    ("a-point:2", True, False),    # numbered steps are 11..13
    ("b-point:1", False, False),   # another point
])
def test_the_environment_kills_at_the_nth_hit_or_step(spec: str, numbered: bool, killed: bool) -> None:
    proc = FORK.Process(target=_hit_three_times, args=(spec, numbered))
    proc.start()
    proc.join(30)
    assert proc.exitcode == (-signal.SIGKILL if killed else 7)


def _put_with_failpoint(where: Path) -> None:
    os.environ[FAILPOINT_ENV] = "synced:1"
    with LmdbStore(where, layout_fingerprint=FP) as store:
        store.put_many([item_for(make_key(i), 1000) for i in range(3)])
    os._exit(7)


def test_an_lmdb_store_is_killed_at_its_first_group_sync_by_the_environment(tmp_path: Path) -> None:
    """The kill -9 points of a write are reachable from outside the process too: killed
    after the segment sync, before the index commit, the records are recovered at the
    next open."""
    where = tmp_path / "s"
    proc = FORK.Process(target=_put_with_failpoint, args=(where,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    with LmdbStore(where, layout_fingerprint=FP) as store:
        assert store.stats()["recovered_records"] == 3
        assert all(store.contains(make_key(i)) for i in range(3))


def test_an_lmdb_stores_points_in_the_order_of_a_write(tmp_path: Path) -> None:
    with LmdbStore(tmp_path / "s", layout_fingerprint=FP) as store:
        seen: list[FaultPoint] = []
        store.faults.hook = lambda point, info: seen.append(point)
        store.put_many([item_for(make_key(0), 1000), item_for(make_key(1), 1000)])
    assert seen == [FaultPoint.RESERVE, FaultPoint.STAGED, FaultPoint.STAGED, FaultPoint.APPENDED,
                    FaultPoint.ENQUEUED, FaultPoint.LEAD, FaultPoint.SYNCED, FaultPoint.INDEXING,
                    FaultPoint.INDEX_TXN, FaultPoint.INDEX_BATCH, FaultPoint.INDEXED, FaultPoint.CLOSING]
