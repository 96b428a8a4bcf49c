"""``replay()``: one trace through one node's real tiers (the Python API of ``tiered-kv replay``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from .config import ReplayConfig
from .node import Node, fast_gil_switch
from .report import ReplayReport
from .trace import DEFAULT_BLOCK_TOKENS, Trace, load_trace

__all__ = ["replay"]


def replay(trace: Trace | str, config: ReplayConfig, *, limit: int | None = None,
           progress: Callable[[int, int], None] | None = None) -> ReplayReport:
    """Replay ``trace`` (a :class:`Trace`, ``bundled:NAME`` or a path) through one cache
    with the tiers and policies of ``config``; ``limit``: its first requests only.
    ``progress(done, total)`` is called after each request. While it runs, the GIL
    switch interval is 0.5 ms (see :data:`~tiered_kv.replay.node.SWITCH_INTERVAL_S`).

    >>> from tiered_kv.replay import Capacity, ReplayConfig, replay
    >>> cfg = ReplayConfig(hbm=Capacity.of_bytes(40 << 30), host=Capacity.of_bytes(512 << 30),
    ...                    disk=Capacity.of_bytes(4 << 40))
    >>> report = replay("bundled:conversation", cfg, limit=500)
    >>> print(report.text())
    """
    if not isinstance(config, ReplayConfig):
        raise TypeError(f"config: expected a ReplayConfig, got {type(config).__name__}")
    if not isinstance(trace, Trace):
        trace = load_trace(trace, block_tokens=DEFAULT_BLOCK_TOKENS, limit=limit)
    trace = trace.head(limit)
    t0 = time.perf_counter()
    with fast_gil_switch(), Node(config, trace.block_tokens, name="node0") as node:
        node.check_trace(trace)
        total = len(trace)
        node.run(enumerate(trace.requests), None if progress is None else (lambda i: progress(i, total)))
        result = node.finish()
    return ReplayReport(trace=trace.name, num_requests=len(trace), prompt_tokens=trace.prompt_tokens,
                        block_tokens=trace.block_tokens, config=config, nodes=[result],
                        wall_s=time.perf_counter() - t0)
