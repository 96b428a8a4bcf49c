"""Cache policies a replay can run, by name, so that runs can be compared by name.

A policy here is what the replay asks of :class:`~tiered_kv.cache.TieredKVCache`: the
keyword options that select it. Today the cache has one snapshot policy and one eviction
policy; a new policy is one entry in :data:`SNAPSHOT_POLICIES` or :data:`EVICTION_POLICIES`
(a name, an optional integer argument, the cache options), and ``tiered-kv replay
--snapshot-policy NAME[:ARG]`` / ``--eviction NAME`` selects it; a repeated option runs
each and prints them side by side.

Snapshot policies:

* ``interval:N`` (default ``interval:8``): the cache's own: a snapshot at each prompt's
  last two block boundaries (registered when the request closes) and one every ``N``
  blocks (``snapshot_interval``).
* ``branch``: where the prompt leaves the cached prefix tree, and at its last boundary
  (:mod:`tiered_kv.policy.snapshots`).
* ``branch+interval:N``: both, and every ``N`` blocks.

Eviction policies:

* ``lru``: the cache's own: each tier evicts its least recently released block (and,
  apart, snapshot), independently of the others.
* ``leaf-lru``: leaves first, and a block's snapshot goes with it
  (:mod:`tiered_kv.policy.eviction`).

Disk admission filters (``--admission NAME``, :mod:`tiered_kv.policy.admission`):

* ``all``: the cache's own: every sealed block and published snapshot is written through.
* ``second-hit``: a record reaches the disk once a memory tier has served it.
* ``hits:N``: after N such hits.
* ``seen-twice``: ``second-hit``, or when a record is computed a second time.
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
                  cache_options={"snapshot_interval": n})


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
    return Policy(label="lru", description="least recently released first, per tier")


def _leaf_lru(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"eviction policy leaf-lru: expected no argument, got {arg}")
    return Policy(label="leaf-lru", description="leaves first per tier, each block's snapshot evicted with it",
                  cache_options={"eviction": "leaf-lru"})


def _all(arg: int | None) -> Policy:
    if arg is not None:
        raise ValueError(f"admission policy all: expected no argument, got {arg}")
    return Policy(label="all", description="every record written through to disk")


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


def _hits(arg: int | None) -> Policy:
    if arg is None or arg < 1:
        raise ValueError(f"admission policy hits:N: expected N >= 1, got {arg}")
    return Policy(label=f"hits:{arg}", description=f"a record reaches the disk after {arg} memory-tier hits",
                  cache_options={"admission": f"hits:{arg}"})


#: name -> factory(optional integer argument)
SNAPSHOT_POLICIES: dict[str, Callable[[int | None], Policy]] = {
    "interval": _interval, "branch": _branch, "branch+interval": _branch_interval}
EVICTION_POLICIES: dict[str, Callable[[int | None], Policy]] = {"lru": _lru, "leaf-lru": _leaf_lru}
ADMISSION_POLICIES: dict[str, Callable[[int | None], Policy]] = {
    "all": _all, "second-hit": _second_hit, "seen-twice": _seen_twice, "hits": _hits}


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
