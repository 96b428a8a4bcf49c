"""Cache policies a replay can run, by name, so that runs can be compared by name.

A policy here is what the replay asks of :class:`~tiered_kv.cache.TieredKVCache`: the
keyword options that select it. A new policy is one entry in :data:`SNAPSHOT_POLICIES` or :data:`EVICTION_POLICIES`
(a name, an optional integer argument, the cache options), and ``tiered-kv replay
--snapshot-policy NAME[:ARG]`` / ``--eviction NAME`` selects it; a repeated option runs
each and prints them side by side.

Snapshot policies:

* ``branch+interval:N`` (default ``branch+interval:32``, the cache's own): where the
  prompt leaves the cached prefix tree, at its last boundary and every ``N`` blocks
  (:mod:`tiered_kv.policy.snapshots`).
* ``branch``: the same without intervals.
* ``interval:N`` (``interval`` alone: ``interval:8``): the cache's original policy: a
  snapshot at each prompt's last two block boundaries (registered when the request
  closes) and one every ``N`` blocks (``snapshot_interval``).

Eviction policies:

* ``leaf-lru`` (the cache's own): leaves first, and a block's snapshot goes with it
  (:mod:`tiered_kv.policy.eviction`).
* ``leaf-s3fifo[:P]``: the same over S3-FIFO's small (P %, default 10) / main / ghost queues.
* ``lru``: the original: each tier evicts its least recently released block (and,
  apart, snapshot), independently of the others.

Disk admission filters (``--admission NAME``, :mod:`tiered_kv.policy.admission`):

* ``all``: the cache's own: every sealed block and published snapshot is written through.
* ``second-hit``: a record reaches the disk once a memory tier has served it.
* ``hits:N``: after N such hits.
* ``seen-twice``: ``second-hit``, or when a record is computed a second time.
* ``survived:N``: ``second-hit``, or once a record has lived N requests in a memory tier.
* ``retraced``: ``seen-twice``, or a snapshot of a request that recomputed a block where a
  snapshot was held back before (it retraced a known path).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ADMISSION_POLICIES", "EVICTION_POLICIES", "SNAPSHOT_POLICIES", "Policy", "admission_policy", "eviction_policy", "snapshot_policy"]


@dataclass(frozen=True, slots=True)
class Policy:
    """A named policy and the cache options that select it."""

    #: its name with its argument, as given on the command line (``interval:8``)
    label: str
    description: str
    cache_options: dict[str, Any] = field(default_factory=dict)


def _interval(arg: int | None) -> Policy:
    n = 8 if arg is None else arg
    if n < 1:
        raise ValueError(f"snapshot policy interval:N: expected N >= 1, got {n}")
    return Policy(label=f"interval:{n}",
                  description=f"snapshots at each prompt's last two block boundaries and every {n} blocks",
                  cache_options={"snapshot_policy": f"interval:{n}"})


def _branch(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"snapshot policy branch: expected no argument (branch+interval:N for intervals too), got {arg}")
    return Policy(label="branch", description="snapshots where a prompt leaves the cached prefix tree and at its end",
                  cache_options={"snapshot_policy": "branch"})


def _branch_interval(arg: int | None) -> Policy:
    if arg is None or arg < 1:
        raise ValueError(f"snapshot policy branch+interval:N: expected N >= 1, got {arg}")
    return Policy(label=f"branch+interval:{arg}",
                  description=f"snapshots at branch points, at prompt ends and every {arg} blocks",
                  cache_options={"snapshot_policy": f"branch+interval:{arg}"})


def _lru(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"eviction policy lru: expected no argument, got {arg}")
    return Policy(label="lru", description="least recently released first, per tier",
                  cache_options={"eviction": "lru"})


def _leaf_lru(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"eviction policy leaf-lru: expected no argument, got {arg}")
    return Policy(label="leaf-lru", description="leaves first per tier, each block's snapshot evicted with it",
                  cache_options={"eviction": "leaf-lru"})


def _leaf_s3fifo(arg: int | None) -> Policy:
    if arg is not None and not 1 <= arg <= 99:
        raise ValueError(f"eviction policy leaf-s3fifo:P: expected a small-queue percent P in 1..99, got {arg}")
    label = "leaf-s3fifo" if arg is None else f"leaf-s3fifo:{arg}"
    return Policy(label=label, description=f"leaves first over S3-FIFO's small ({10 if arg is None else arg} %) / "
                                           f"main / ghost queues", cache_options={"eviction": label})


def _all(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"admission policy all: expected no argument, got {arg}")
    return Policy(label="all", description="every record written through to disk",
                  cache_options={"admission": "all"})  # (named: whatever the cache's default)


def _second_hit(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"admission policy second-hit: expected no argument (hits:N for more), got {arg}")
    return Policy(label="second-hit", description="a record reaches the disk once a memory tier served it",
                  cache_options={"admission": "second-hit"})


def _seen_twice(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"admission policy seen-twice: expected no argument, got {arg}")
    return Policy(label="seen-twice", description="second-hit, or a record computed a second time",
                  cache_options={"admission": "seen-twice"})


def _retraced(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"admission policy retraced: expected no argument, got {arg}")
    return Policy(label="retraced", description="seen-twice, or the snapshots of a request that recomputed a "
                                                "block where a snapshot was held back before",
                  cache_options={"admission": "retraced"})


def _survived(arg: int | None) -> Policy:
    if arg is None or arg < 1:
        raise ValueError(f"admission policy survived:N: expected N >= 1 requests, got {arg}")
    return Policy(label=f"survived:{arg}", description=f"a record reaches the disk once hit, or once it has lived "
                                                       f"{arg} requests in a memory tier",
                  cache_options={"admission": f"survived:{arg}"})


def _hits(arg: int | None) -> Policy:
    if arg is None or arg < 1:
        raise ValueError(f"admission policy hits:N: expected N >= 1, got {arg}")
    return Policy(label=f"hits:{arg}", description=f"a record reaches the disk after {arg} memory-tier hits",
                  cache_options={"admission": f"hits:{arg}"})


#: name -> factory(optional integer argument)
SNAPSHOT_POLICIES: dict[str, Callable[[int | None], Policy]] = {
    "interval": _interval, "branch": _branch, "branch+interval": _branch_interval}
EVICTION_POLICIES: dict[str, Callable[[int | None], Policy]] = {
    "lru": _lru, "leaf-lru": _leaf_lru, "leaf-s3fifo": _leaf_s3fifo}
ADMISSION_POLICIES: dict[str, Callable[[int | None], Policy]] = {
    "all": _all, "second-hit": _second_hit, "seen-twice": _seen_twice, "retraced": _retraced,
    "hits": _hits, "survived": _survived}


def snapshot_policy(spec: str) -> Policy:
    """``NAME[:N]`` -> the snapshot :class:`Policy` (ValueError naming the choices)."""
    return _parse(spec, SNAPSHOT_POLICIES, "snapshot policy")


def eviction_policy(spec: str) -> Policy:
    """``NAME[:N]`` -> the eviction :class:`Policy`."""
    return _parse(spec, EVICTION_POLICIES, "eviction policy")


def admission_policy(spec: str) -> Policy:
    """``all``, ``second-hit`` or ``hits:N`` -> the disk admission :class:`Policy`."""
    return _parse(spec, ADMISSION_POLICIES, "admission policy")


def _parse(spec: str, table: dict[str, Callable[[int | None], Policy]], what: str) -> Policy:
    if not isinstance(spec, str):
        raise TypeError(f"{what}: expected a str like 'NAME' or 'NAME:N', got {type(spec).__name__}")
    name, sep, arg = spec.partition(":")
    if name not in table:
        raise ValueError(f"{what}: expected one of {', '.join(sorted(table))} (NAME or NAME:N), got {spec!r}")
    value: int | None = None
    if sep:
        try:
            value = int(arg)
        except ValueError:
            raise ValueError(f"{what} {spec!r}: expected an integer after ':', got {arg!r}") from None
    return table[name](value)
