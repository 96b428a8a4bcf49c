"""Where a request snapshots its State: the snapshot placement policies.

A V4 prefix is resumable only at a block boundary that has a State snapshot, and a
snapshot costs about as much as 1.85 Classical blocks (Flash: 3.48 MiB against 1.88
MiB). A policy decides at which boundaries a request *publishes* one (registers it
under the boundary's prefix hash, shared with later requests, written through to disk)::

    interval:N          every N blocks from the prompt's start, and the prompt's last
                        two boundaries (the cache's original policy)
    branch              the boundary where the prompt leaves the cached path (below), and
                        the prompt's last boundary (with the one before it when the
                        request ends exactly on a boundary: the same prompt sent again
                        resumes there, one token being always recomputed)
    branch+interval:N   both

**Branch points.** ``open()`` matches the longest resumable prefix, P blocks; the
prompt's blocks past it may still be cached (in any tier) up to block ``d`` without a
snapshot at ``d``: ``d`` is where the prompt's path leaves the cached prefix tree (block
``d`` is cached nowhere). When ``P < d`` and the prompt goes on past ``d`` the request
recomputes ``[P, d)`` and, passing boundary ``d``, publishes its State there: the next
request that shares the prefix up to ``d`` (on either branch) resumes exactly at ``d``.
A prompt that extends a cached path past its last snapshot is the same case (the path's
end is where it leaves it). This is Marconi's (MLSys 2025) speculative insertion found
with the cache's own lookup: no extra state is kept.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ._spec import _int_after_colon

__all__ = ["DEFAULT_SNAPSHOT_POLICY", "PromptEnds", "SnapshotPolicy", "snapshot_policy"]

#: The cache's default placement (issue 22): snapshots where a prompt leaves the cached
#: prefix tree, at its end and every 32 blocks. On both bundled Mooncake traces it keeps
#: >= 95 % of the every-boundary hit rate with snapshot bytes <= 15 % of the Classical
#: bytes (docs/policies.md); ``interval:8``, the original default, spends 0.29-0.36.
DEFAULT_SNAPSHOT_POLICY = "branch+interval:32"


class PromptEnds(enum.Enum):
    """Which of a request's last boundaries are published when it closes."""

    #: the last two boundaries, always (the original policy)
    LAST_TWO = "last-two"
    #: the last boundary; the one before too only when the request ends on a boundary
    LAST = "last"


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotPolicy:
    """A snapshot placement policy (see the module docstring)."""

    #: publish every ``interval`` blocks (None: no interval snapshots)
    interval: int | None
    #: publish at the boundary where the prompt leaves the cached prefix tree
    branch_points: bool
    ends: PromptEnds

    def __post_init__(self) -> None:
        if self.interval is not None and (isinstance(self.interval, bool) or not isinstance(self.interval, int)
                                          or self.interval < 1):
            raise ValueError(f"snapshot policy: expected interval None or an int >= 1, got {self.interval!r}")
        if not isinstance(self.ends, PromptEnds):
            raise TypeError(f"snapshot policy: expected ends a PromptEnds, got {type(self.ends).__name__}")

    @classmethod
    def intervals(cls, n: int) -> SnapshotPolicy:
        """The original policy: every ``n`` blocks and the last two boundaries."""
        return cls(interval=n, branch_points=False, ends=PromptEnds.LAST_TWO)

    @classmethod
    def branch(cls, interval: int | None = None) -> SnapshotPolicy:
        """Branch points and prompt ends (and every ``interval`` blocks when given)."""
        return cls(interval=interval, branch_points=True, ends=PromptEnds.LAST)

    @property
    def label(self) -> str:
        if not self.branch_points:
            return f"interval:{self.interval}"
        return "branch" if self.interval is None else f"branch+interval:{self.interval}"

    def at_interval(self, num_blocks: int) -> bool:
        """Whether the boundary after ``num_blocks`` blocks is an interval boundary."""
        return self.interval is not None and num_blocks % self.interval == 0

    def publish_at_close(self, pending: list[int], num_tokens: int, block_tokens: int) -> list[int]:
        """Of the boundaries ``pending`` (block counts, ascending) whose private snapshots
        a closing request holds, those to publish; ``num_tokens``: the request's length."""
        if self.ends is PromptEnds.LAST_TWO or not pending:
            return pending
        last = pending[-1]
        keep_before = num_tokens % block_tokens == 0 and num_tokens // block_tokens == last
        return [k for k in pending if k == last or (keep_before and k == last - 1)]


def snapshot_policy(spec: str | SnapshotPolicy) -> SnapshotPolicy:
    """``interval:N``, ``branch`` or ``branch+interval:N`` -> the :class:`SnapshotPolicy`."""
    if isinstance(spec, SnapshotPolicy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"snapshot_policy: expected a str like 'interval:8' or 'branch', got {type(spec).__name__}")
    name, sep, arg = spec.partition(":")
    n: int | None = None
    if sep:
        n = _int_after_colon("snapshot_policy", spec, arg)
        if n < 1:
            raise ValueError(f"snapshot_policy {spec!r}: expected an interval >= 1, got {n}")
    if name == "interval":
        return SnapshotPolicy.intervals(8 if n is None else n)
    if name == "branch" and not sep:
        return SnapshotPolicy.branch()
    if name == "branch+interval" and n is not None:
        return SnapshotPolicy.branch(n)
    raise ValueError(f"snapshot_policy: expected 'interval:N', 'branch' or 'branch+interval:N', got {spec!r}")
