"""Fault injection: the one seam through which tests make a step of the storage code fail,
wait, or kill the process, at an exact point instead of sleeping and hoping.

Code that has steps worth breaking names them (an enum per component: the LMDB store's
group commit and index, :class:`~tiered_kv.storage.lmdb.group_commit.FaultPoint`; a
rekey's batch, :class:`~tiered_kv.storage.encrypted.rekey_journal.RekeyPoint`; a chain's
journal, :class:`~tiered_kv.storage.chain.store.ChainPoint`) and calls
:meth:`Faults.hit` on the :class:`Faults` of the object doing the step (a store's
``faults``). Two ways to act there:

- **a hook** (in-process tests): ``store.faults.hook = fn``; ``fn(point, info)`` is called
  at every point the object reaches, on the thread that reaches it, and may block, raise
  (the step fails as if it failed by itself) or kill the process;
- **the environment** (tests that run a command in another process):
  ``TIERED_KV_FAILPOINT=<point>:<n>`` kills the process with SIGKILL the ``n``-th time
  (1 first) it reaches ``<point>`` (the enum's value, e.g. ``rekey-deleted:2``,
  ``synced:1``), or when a point numbers its steps itself (a rekey's batches), at step
  ``n``.

Unset (production), a point costs one attribute check and one environment lookup.
"""

from __future__ import annotations

import enum
import os
import signal
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["FAILPOINT_ENV", "Faults", "Hook", "failpoint"]

#: The environment variable of the kill points (see the module docstring).
FAILPOINT_ENV = "TIERED_KV_FAILPOINT"

#: ``hook(point, info)``: what a test runs at each fault point an object reaches.
Hook = Callable[[enum.Enum, Any], None]

_hits: Counter[str] = Counter()  # times each point was reached in this process (for FAILPOINT_ENV)
_hits_lock = threading.Lock()


class Faults:
    """The fault points of one object: a test sets :attr:`hook`; the object calls
    :meth:`hit` at each of its points."""

    __slots__ = ("hook",)

    def __init__(self) -> None:
        #: called at each point reached (None in production)
        self.hook: Hook | None = None

    def hit(self, point: enum.Enum, info: Any = None, *, n: int | None = None) -> None:
        """``point`` is reached (``info``: what it concerns, for the hook; ``n``: the
        step's own number, matched by ``TIERED_KV_FAILPOINT`` instead of a count)."""
        hook = self.hook
        if hook is not None:
            hook(point, info)
        failpoint(str(point.value), n)


def failpoint(name: str, n: int | None = None) -> None:
    """Kill this process (SIGKILL) if ``TIERED_KV_FAILPOINT`` is ``"<name>:<n>"``: ``n``
    the step number given, or else the number of times ``name`` was reached in this
    process (this time included)."""
    spec = os.environ.get(FAILPOINT_ENV)
    if not spec or spec.rpartition(":")[0] != name:
        return
    if n is None:
        with _hits_lock:
            _hits[name] += 1
            n = _hits[name]
    if spec == f"{name}:{n}":
        os.kill(os.getpid(), signal.SIGKILL)
