"""A fleet: N node processes, each with its own GPU, host and disk tiers, optionally all
sharing one level (an S3 bucket), and a router that places each request on one of them.

The router (this process) walks the trace in arrival order, one request at a time:

* ``random``: a node drawn uniformly (seeded);
* ``prefix``: every node is asked its :meth:`~tiered_kv.cache.TieredKVCache.lookup` for
  the prompt over its own tiers (nothing loaded; the shared level answers the same for
  every node, so it is not asked), and the request goes to the node that would resume the
  most tokens, among the nodes not above ``(1 + balance)`` times their fair share of the
  requests so far (ties: the node with fewer requests, then the lower index). Without that
  bound (``balance = inf``) every request sharing the trace's common first block lands on
  one node; real routers bound imbalance the same way (Mooncake's Conductor weighs queue
  time, SGLang's cache-aware router a balance threshold).

The chosen node serves the request through its real cache (:class:`~.node.Node`) before the
next is routed, so each lookup sees every earlier request; uploads to the shared level go
on in the nodes' background as in production (a block is on the shared level once its
upload lands, typically well before the next request that needs it). Each node reports
its own tally; the fleet's maximum is that of one unbounded cache for the whole trace.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import random
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..prefix import PrefixHasher
from .config import ReplayConfig, plan_tiers
from .node import SWITCH_INTERVAL_S, Node, NodeResult, shared_url_for
from .report import ReplayReport
from .tokens import TokenMaker
from .trace import Trace

__all__ = ["ROUTES", "fleet_replay"]

ROUTES = ("random", "prefix")


@dataclass(frozen=True, slots=True)
class _NodeSpec:
    config: ReplayConfig
    block_tokens: int
    name: str
    shared_url: str | None


def _node_main(spec: _NodeSpec, conn: Any) -> None:
    """A node process: serve the router's commands over ``conn`` until "close"."""
    node = None
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # (this process only replays)
    try:
        node = Node(spec.config, spec.block_tokens, name=spec.name, shared_url=spec.shared_url)
        conn.send(("ready", None))
        while True:
            cmd, index, request = conn.recv()
            if cmd == "lookup":  # the node's own tiers: the shared level is the same for every node
                conn.send(("ok", node.prepare(index, request, upto=node.local_tier).tokens()))
            elif cmd == "serve":
                conn.send(("ok", node.serve(index, request)))
            elif cmd == "finish":
                conn.send(("ok", node.finish()))
            elif cmd == "close":
                break
            else:
                raise ValueError(f"node {spec.name}: unknown command {cmd!r}")
    except BaseException as e:  # noqa: BLE001 - reported to the router, which raises it
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except (OSError, BrokenPipeError):
            pass
    finally:
        if node is not None:
            node.close()
        conn.close()


class _Fleet:
    """The node processes and the pipes to them."""

    def __init__(self, specs: list[_NodeSpec]) -> None:
        ctx = mp.get_context("spawn")  # (torch and threads: no fork)
        self.conns = []
        self.procs = []
        try:
            for spec in specs:
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=_node_main, args=(spec, theirs), name=f"tiered-kv-{spec.name}", daemon=True)
                p.start()
                theirs.close()
                self.conns.append(ours)
                self.procs.append(p)
            for i in range(len(specs)):
                self._recv(i)
        except BaseException:
            self.close()
            raise

    def _recv(self, i: int) -> Any:
        try:
            status, value = self.conns[i].recv()
        except EOFError:
            raise RuntimeError(f"fleet: node {i} exited (exit code {self.procs[i].exitcode})") from None
        if status == "error":
            raise RuntimeError(f"fleet: node {i} failed: {value}")
        return value

    def call(self, i: int, cmd: str, index: int = -1, request: Any = None) -> Any:
        self.conns[i].send((cmd, index, request))
        return self._recv(i)

    def call_all(self, cmd: str, index: int = -1, request: Any = None) -> list[Any]:
        for c in self.conns:
            c.send((cmd, index, request))
        return [self._recv(i) for i in range(len(self.conns))]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close", -1, None))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
                p.join(timeout=30)
        for c in self.conns:
            c.close()


def fleet_replay(trace: Trace, config: ReplayConfig, *, nodes: int, route: str, balance: float = 0.2,
                 seed: int = 0, limit: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> ReplayReport:
    """Replay ``trace`` over ``nodes`` node processes with ``config``'s tiers each (a shared
    level, when ``config.shared_url`` is given, under one fresh sub-prefix for the fleet),
    routing by ``route`` (:data:`ROUTES`)."""
    if route not in ROUTES:
        raise ValueError(f"route: expected one of {', '.join(ROUTES)}, got {route!r}")
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes: expected a positive int, got {nodes!r}")
    if not (balance >= 0):
        raise ValueError(f"balance: expected a number >= 0 (inf: no bound), got {balance!r}")
    trace = trace.head(limit)
    bt = trace.block_tokens
    plan = plan_tiers(config, bt)  # checked here, before any process starts
    longest = max(r.input_length for r in trace)
    if -(-longest // bt) > plan.gpu_blocks:
        raise ValueError(f"hbm: {config.hbm.describe()} holds {plan.gpu_blocks} blocks; the trace's longest prompt "
                         f"({longest:,} tokens) needs {-(-longest // bt)}: give a larger --hbm")
    run = uuid.uuid4().hex[:12]
    shared = None if config.shared_url is None else shared_url_for(config.shared_url, f"fleet-{run}")
    specs = [_NodeSpec(config=config, block_tokens=bt, name=f"node{i}", shared_url=shared) for i in range(nodes)]
    rng = random.Random(seed)
    assigned = [0] * nodes
    t0 = time.perf_counter()
    fleet = _Fleet(specs)
    try:
        for i, req in enumerate(trace.requests):
            if route == "random":
                n = rng.randrange(nodes)
            else:
                resumable = fleet.call_all("lookup", i, req)
                cap = math.inf if math.isinf(balance) else max(1, math.ceil((i + 1) / nodes * (1 + balance)))
                candidates = [k for k in range(nodes) if assigned[k] < cap] or list(range(nodes))
                n = max(candidates, key=lambda k: (resumable[k], -assigned[k], -k))
            fleet.call(n, "serve", i, req)
            assigned[n] += 1
            if progress is not None:
                progress(i + 1, len(trace))
        results: list[NodeResult] = fleet.call_all("finish")
    finally:
        fleet.close()
    return ReplayReport(trace=trace.name, num_requests=len(trace), prompt_tokens=trace.prompt_tokens,
                        block_tokens=bt, config=config, nodes=results, wall_s=time.perf_counter() - t0,
                        route=route, fleet_max_tokens=fleet_max_tokens(trace, plan.standin.layout, config.salt),
                        extra={"nodes_count": nodes, "balance": balance, "seed": seed})


def fleet_max_tokens(trace: Trace, layout: Any, salt: str) -> int:
    """Tokens one unbounded cache would serve over the whole trace (every boundary
    resumable; one token per prompt always computed)."""
    maker, hasher, bt = TokenMaker(trace.block_tokens), PrefixHasher(layout, salt=salt), trace.block_tokens
    seen: set[bytes] = set()
    total = 0
    for i, r in enumerate(trace.requests):
        arr = maker.prompt_array(i, r)
        hashes = hasher.block_hashes(arr[:arr.size - arr.size % bt])
        limit = min(len(hashes), (arr.size - 1) // bt)
        k = 0
        while k < limit and hashes[k] in seen:
            k += 1
        total += k * bt
        seen.update(hashes)
    return total
