"""Stranded bytes: blocks and snapshots a tier holds that no resume can use.

A prefix cache's block is useful only on a path: resuming at boundary k needs every block
of ``[0, k)`` in some tier and the State snapshot at k. So, over the union of every tier
(a resume loads from any of them), with the prefix tree the replay saw (each block's
parent)::

    reachable(b)   every block before b on its path is held (b's ancestors)
    useful(b)      reachable(b), b held, and a snapshot is held at b or at some useful
                   descendant of b (a boundary at or after b that a resume can reach)

A held block that is not useful is **stranded**: ``unreachable`` when a block before it
is missing (evicted first: a flat LRU per tier evicts a path's start before its end when
the start is older), ``no_snapshot`` when its path is whole but no snapshot at or after
it is held. A held snapshot is stranded when its blocks are not all held. Issue 22's
eviction policies aim at zero.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["stranded"]


def stranded(parent: Mapping[bytes, bytes | None], blocks: Mapping[str, set[bytes]],
             snapshots: Mapping[str, set[bytes]]) -> dict[str, dict[str, int]]:
    """Per tier: ``{"unreachable": n, "no_snapshot": n, "unknown": n}`` blocks and
    ``{"snapshots_unreachable": n}``. ``parent``: each block's parent hash (None at the
    root) for every block the replay sealed or resumed; a held block missing from it
    (e.g. in a store warmed before the replay) is ``unknown``."""
    held = set().union(*blocks.values()) if blocks else set()
    snap_held = set().union(*snapshots.values()) if snapshots else set()
    reach: dict[bytes, bool] = {}

    def reachable(h: bytes) -> bool:
        path = []
        x: bytes | None = h
        ok = True
        while x is not None:
            known = reach.get(x)
            if known is not None:
                ok = known
                break
            path.append(x)
            p = parent.get(x, b"")
            if p == b"":  # not in the tree: its ancestors are unknown
                ok = False
                break
            x = p
            if x is not None and x not in held:
                ok = False
                break
        for y in path:  # every block on the walk shares the answer of the first known one
            reach[y] = ok
        return ok

    # a block is useful when a held snapshot lies at it or below it on a reachable path:
    # walk up from every reachable held snapshot, marking its held ancestors useful
    useful: set[bytes] = set()
    for s in snap_held:
        if s in held and s in parent and reachable(s):
            x: bytes | None = s
            while x is not None and x not in useful:
                useful.add(x)
                x = parent.get(x)
    out: dict[str, dict[str, int]] = {}
    for tier, hs in blocks.items():
        counts = {"unreachable": 0, "no_snapshot": 0, "unknown": 0}
        for h in hs:
            if h in useful:
                continue
            if h not in parent:
                counts["unknown"] += 1
            elif not reachable(h):
                counts["unreachable"] += 1
            else:
                counts["no_snapshot"] += 1
        out[tier] = counts
    for tier, ss in snapshots.items():
        bad = sum(1 for s in ss if not (s in held and s in parent and reachable(s)))
        out.setdefault(tier, {"unreachable": 0, "no_snapshot": 0, "unknown": 0})["snapshots_unreachable"] = bad
    return out
