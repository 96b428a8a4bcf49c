"""``tiered-kv replay``: replay a production request trace through the real tiers.

::

    tiered-kv replay --trace bundled:conversation --model deepseek-v4-flash --hbm 40G --host 512G --disk 4T
    tiered-kv replay --trace bundled:synthetic --hbm-tokens 3M --json
    tiered-kv replay --trace bundled:conversation --sweep hbm-tokens=1M,3M,10M --host-tokens 10M --png fig9.png
    tiered-kv replay --trace bundled:conversation --hbm-tokens 3M --nodes 10 --route random --route prefix \\
        --shared 'zarr+s3://kv/replay?endpoint=http://127.0.0.1:8333&allow_http=true'

The trace is Mooncake's format (``bundled:conversation``, ``bundled:synthetic`` or a
``.jsonl[.gz|.xz]`` file); see docs/replay.md for what is measured and how each miss is
attributed. Capacities are the target model's bytes (``--hbm 40G``, binary suffixes) or
tokens of Classical blocks (``--hbm-tokens 3M``, decimal suffixes); the cache runs a
stand-in layout scaled by one factor, which the report prints.

The shared level (``--shared URL``) is any store URL, normally an S3 bucket:
``zarr+s3://BUCKET/PREFIX?endpoint=URL[&region=R][&allow_http=true]`` with the
credentials in ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``; each run writes under a
fresh ``PREFIX/replay-<id>`` (or ``fleet-<id>``) and leaves it there.

Several ``--snapshot-policy`` / ``--eviction`` values replay once per combination and
print a comparison. ``--sweep TIER=CAP,...`` (``hbm``, ``host``, ``disk``, or the
``-tokens`` forms) replays at each capacity, HBM only and then with each further tier
given. ``--nodes N`` replays over N node processes; with ``--shared`` each routing runs
with and without the shared level.

Exit codes: 0 ok; 1 the replay found wrong bytes or broke an invariant; 2 bad arguments
or a malformed trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

from ..planner import format_bytes
from ..policy.admission import DEFAULT_ADMISSION
from ..policy.eviction import DEFAULT_EVICTION
from ..policy.snapshots import DEFAULT_SNAPSHOT_POLICY
from ..presets import PRESETS
from . import _common
from ._common import Progress
from .main import ExitCode, UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "replay",
        help="replay a Mooncake request trace through the real tiers: hits per tier, miss reasons",
        description="Replay a request trace (Mooncake format) through a real TieredKVCache with GPU, host, "
                    "disk and shared tiers; report the hit rate per tier beside the trace maximum, why each "
                    "miss missed, bytes resident and moved, and the prefill time saved.",
        epilog="exit codes: 0 ok, 1 wrong bytes served or a broken invariant, 2 bad arguments or trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", required=True, metavar="FILE|bundled:NAME",
                   help="the trace: bundled:conversation, bundled:synthetic, or a Mooncake .jsonl[.gz|.xz] file")
    p.add_argument("--limit", type=_common.positive_int, metavar="N", help="replay only the first N requests")
    p.add_argument("--block-tokens", type=_common.positive_int, default=512, metavar="T",
                   help="tokens per hash id of the trace, and the cache's block size (default %(default)s)")
    p.add_argument("--model", choices=sorted(PRESETS), default="deepseek-v4-flash",
                   help="the model whose bytes the capacities are (default %(default)s)")
    for tier, default in (("hbm", "40G"), ("host", None), ("disk", None)):
        g = p.add_mutually_exclusive_group()
        g.add_argument(f"--{tier}", type=_common.size_arg, metavar="SIZE",
                       help=f"{tier} capacity in model bytes (binary suffix: 40G = 40 GiB)"
                            + (f"; default {default} unless --{tier}-tokens" if default else ""))
        g.add_argument(f"--{tier}-tokens", type=_tokens_arg, metavar="N",
                       help=f"{tier} capacity in tokens of Classical blocks plus the snapshot share "
                            f"(decimal suffix: 3M = 3,000,000)")
    p.add_argument("--disk-store", metavar="URL",
                   help="where the disk tier lives: any store URL (default: a fresh LMDB directory, removed after)")
    p.add_argument("--shared", metavar="URL",
                   help="the level every node shares (behind its disk with --disk, else its only store): "
                        "zarr+s3://BUCKET/PREFIX?endpoint=URL (credentials in AWS_ACCESS_KEY_ID / "
                        "AWS_SECRET_ACCESS_KEY) or any store URL")
    p.add_argument("--snapshot-fraction", type=float, default=0.25, metavar="F",
                   help="share of each memory tier given to snapshots (default %(default)s, the host tier's)")
    p.add_argument("--snapshot-policy", action="append", metavar="NAME[:N]",
                   help=f"snapshot policy (default {DEFAULT_SNAPSHOT_POLICY}, the cache's own); repeat to compare")
    p.add_argument("--eviction", action="append", metavar="NAME",
                   help=f"eviction policy (default {DEFAULT_EVICTION}, the cache's own): lru, leaf-lru, "
                        f"leaf-s3fifo[:SMALL%%]; repeat to compare")
    p.add_argument("--admission", action="append", metavar="NAME[:N]",
                   help=f"disk admission filter (default {DEFAULT_ADMISSION}, the cache's own): all, second-hit, "
                        f"hits:N, seen-twice, retraced, survived:N; repeat to compare")
    p.add_argument("--scale", type=_common.positive_int, metavar="N",
                   help="force the stand-in layout's scale (default: the largest exact one)")
    p.add_argument("--verify-every", type=int, default=16, metavar="N",
                   help="read back and check every N-th hit byte for byte (and the first from each tier); 0: never")
    p.add_argument("--salt", default="", help="tenant salt of the prefix hashes (default none)")
    p.add_argument("--workdir", metavar="DIR", help="where made-up disk stores go (default: the temporary directory)")
    p.add_argument("--sync-disk", action="store_true",
                   help="let the disk writer land every queued write before each request's lookup: deterministic "
                        "disk figures (without it they depend on the writer thread's timing by a few blocks)")
    cost = p.add_argument_group("cost model (defaults and their sources are printed with the report)")
    cost.add_argument("--prefill-tokens-per-s", type=float, metavar="R")
    cost.add_argument("--host-gbps", type=float, metavar="R", help="host -> GPU GB/s")
    cost.add_argument("--disk-gbps", type=float, metavar="R", help="disk -> host GB/s")
    cost.add_argument("--shared-gbps", type=float, metavar="R", help="shared level -> host GB/s")
    p.add_argument("--sweep", metavar="TIER=CAP,...",
                   help="replay at each capacity of one tier: hbm=10G,40G or hbm-tokens=1M,3M,10M (host, disk too)")
    p.add_argument("--nodes", type=_common.positive_int, metavar="N", help="replay over N node processes (a fleet)")
    p.add_argument("--route", action="append", choices=("random", "prefix"),
                   help="fleet routing (default: both); repeat for several")
    p.add_argument("--balance", type=float, default=0.2, metavar="B",
                   help="prefix routing: a node takes at most (1 + B) x its fair share of requests (default "
                        "%(default)s; inf: no bound)")
    p.add_argument("--seed", type=int, default=0, help="random routing's seed (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--png", metavar="FILE", help="also draw the result into this PNG (needs matplotlib)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    return p


def _tokens_arg(text: str) -> int:
    from ..replay.config import parse_tokens

    try:
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace) -> int:
    from ..replay import load_trace

    try:
        trace = load_trace(args.trace, block_tokens=args.block_tokens, limit=args.limit)
        configs = _configs(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        if args.sweep:
            return _run_sweep(args, trace, configs[0])
        if args.nodes:
            return _run_fleet(args, trace, configs[0])
        return _run_single(args, trace, configs)
    except AssertionError as e:  # wrong bytes served, or an accounting invariant broken
        print(f"tiered-kv replay: error: {e}", file=sys.stderr)
        return ExitCode.FAILURE


# ---------------------------------------------------------------- configuration
def _capacity(args: argparse.Namespace, tier: str, default: str | None = None) -> Any:
    from ..planner import parse_size
    from ..replay import Capacity

    size, tokens = getattr(args, tier), getattr(args, f"{tier}_tokens")
    if tokens is not None:
        return Capacity.of_tokens(tokens)
    if size is not None:
        return Capacity.of_bytes(size)
    return Capacity.of_bytes(parse_size(default)) if default else None


def _configs(args: argparse.Namespace) -> list[Any]:
    from ..replay import CostModel, ReplayConfig

    cost = CostModel.defaults().with_overrides(prefill_tokens_per_s=args.prefill_tokens_per_s,
                                               host_gbps=args.host_gbps, disk_gbps=args.disk_gbps,
                                               shared_gbps=args.shared_gbps)
    if args.verify_every < 0:
        raise ValueError(f"--verify-every: expected N >= 0, got {args.verify_every}")
    base = ReplayConfig(model=args.model, hbm=_capacity(args, "hbm", "40G"), host=_capacity(args, "host"),
                        disk=_capacity(args, "disk"), disk_url=args.disk_store, shared_url=args.shared,
                        snapshot_fraction=args.snapshot_fraction, scale=args.scale, verify_every=args.verify_every,
                        salt=args.salt, cost=cost, workdir=args.workdir, sync_disk=args.sync_disk)
    out = []
    for snap in args.snapshot_policy or [DEFAULT_SNAPSHOT_POLICY]:
        for ev in args.eviction or [DEFAULT_EVICTION]:
            for adm in args.admission or [DEFAULT_ADMISSION]:
                out.append(dataclasses.replace(base, snapshot_policy=snap, eviction_policy=ev, admission_policy=adm))
    if len(out) > 1 and (args.sweep or args.nodes):
        raise ValueError("--sweep / --nodes: give one --snapshot-policy, one --eviction and one --admission")
    return out


def _progress(args: argparse.Namespace, total: int) -> tuple[Progress, Any]:
    bar = Progress(total, enabled=args.progress)

    def update(done: int, total: int = total) -> None:
        if done == total or done % 25 == 0:
            bar.update(done, f"{done:,}/{total:,} requests")

    return bar, update


# ---------------------------------------------------------------- modes
def _run_single(args: argparse.Namespace, trace: Any, configs: list[Any]) -> int:
    from ..replay import replay

    reports = []
    for cfg in configs:
        bar, update = _progress(args, len(trace))
        try:
            reports.append(replay(trace, cfg, progress=update))
        except ValueError as e:
            raise UsageError(str(e)) from None
        finally:
            bar.close()
    if args.png:
        from ..replay.plot import plot_report

        plot_report(reports[0], args.png)
    named = bool(args.snapshot_policy or args.eviction or args.admission)  # a policy asked for: its row too
    return _print(args, reports, reports[0].to_dict() if len(reports) == 1 else
                  {"policies": [r.to_dict() for r in reports]},
                  _policy_table(reports) if len(reports) > 1 or named else None)


def _print(args: argparse.Namespace, reports: list[Any], as_json: dict[str, Any], table: str | None) -> int:
    """Print ``as_json`` (``--json``) or each report's text and ``table``."""
    if args.json:
        _common.print_json(as_json)
        return ExitCode.OK
    for r in reports:
        print(r.text())
        print()
    if table is not None:
        print(table)
    if args.png:
        print(f"wrote {args.png}")
    return ExitCode.OK


def _policy_table(reports: list[Any]) -> str:
    lines = [f"{'snapshot policy':<20} {'eviction':<12} {'admission':<12} {'hit rate':>9} {'every boundary':>15} "
             f"{'of it':>7} {'max':>8} {'snap/block bytes: memory':>25} {'all tiers':>10} {'stranded':>10} "
             f"{'disk written':>13} {'disk read':>10} {'rejects':>8} {'admitted':>9} {'expired':>8}"]
    for r in reports:
        t, res = r.total, r.resident()

        def ratio(tiers: tuple[str, ...] | None, res: dict = res) -> float:
            blocks = sum(v.get("blocks", 0) for k, v in res.items() if tiers is None or k in tiers)
            snaps = sum(v.get("snapshots", 0) for k, v in res.items() if tiers is None or k in tiers)
            return snaps / blocks if blocks else 0.0

        stranded = sum(sum(v.values()) for v in r.stranded().values())
        of_it = t.hits / t.resident_tokens if t.resident_tokens else 0.0
        io, adm = r.store_bytes(), r.admission() or {"rejected": 0, "admitted": 0, "expired": 0}
        written, read = ("-", "-") if io is None else (format_bytes(io["written"]), format_bytes(io["read"]))
        lines.append(f"{r.config.snapshot().label:<20} {r.config.eviction().label:<12} {r.config.admission().label:<12} "
                     f"{100 * t.rate(t.hits):8.2f}% {100 * t.rate(t.resident_tokens):14.2f}% {100 * of_it:6.1f}% "
                     f"{100 * t.rate(t.max_tokens):7.2f}% {ratio(('gpu', 'host')):>25.3f} {ratio(None):>10.3f} "
                     f"{format_bytes(stranded):>10} {written:>13} {read:>10} {adm['rejected']:>8} "
                     f"{adm['admitted']:>9} {adm['expired']:>8}")
    return "\n".join(lines)



def _parse_sweep(text: str) -> tuple[str, list[Any]]:
    from ..planner import parse_size
    from ..replay import Capacity
    from ..replay.config import parse_tokens

    name, sep, values = text.partition("=")
    tier, _, unit = name.partition("-")
    if not sep or tier not in ("hbm", "host", "disk") or unit not in ("", "tokens") or not values:
        raise UsageError(f"--sweep: expected TIER=CAP,CAP,... with TIER one of hbm, host, disk, hbm-tokens, "
                         f"host-tokens, disk-tokens, got {text!r}")
    try:
        caps = [Capacity.of_tokens(parse_tokens(v)) if unit else Capacity.of_bytes(parse_size(v))
                for v in values.split(",")]
    except ValueError as e:
        raise UsageError(f"--sweep: {e}") from None
    return tier, caps


def _run_sweep(args: argparse.Namespace, trace: Any, base: Any) -> int:
    from ..replay.sweep import sweep

    tier, caps = _parse_sweep(args.sweep)
    if tier != "hbm" and getattr(base, tier) is None:
        raise UsageError(f"--sweep {tier}: give --{tier} or --{tier}-tokens too (it is replaced at each point)")
    out = Progress(1, enabled=args.progress)
    try:
        result = sweep(trace, base, tier=tier, capacities=caps, progress=out.println if not args.json else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.png:
        from ..replay.plot import PAPER_RANGE_AT_3M, plot_sweep

        # Mooncake's published range belongs beside its own traces' HBM sweeps only
        paper = PAPER_RANGE_AT_3M if tier == "hbm" and str(args.trace).startswith("bundled:") else None
        plot_sweep(result, args.png, paper_range=paper)
    if args.json:
        _common.print_json(result.to_dict())
    else:
        print(result.text())
        if args.png:
            print(f"wrote {args.png}")
    return ExitCode.OK


def _run_fleet(args: argparse.Namespace, trace: Any, base: Any) -> int:
    from ..replay.fleet import fleet_replay

    routes = args.route or ["random", "prefix"]
    shared = [False, True] if base.shared_url is not None else [False]
    balance = args.balance
    if not (balance >= 0) or math.isnan(balance):
        raise UsageError(f"--balance: expected a number >= 0 (inf: no bound), got {balance}")
    reports = []
    for route in routes:
        for with_shared in shared:
            cfg = base if with_shared else dataclasses.replace(base, shared_url=None)
            bar, update = _progress(args, len(trace))
            try:
                reports.append(fleet_replay(trace, cfg, nodes=args.nodes, route=route, balance=balance,
                                            seed=args.seed, progress=update))
            except ValueError as e:
                raise UsageError(str(e)) from None
            finally:
                bar.close()
    if args.png:
        from ..replay.plot import plot_fleet

        plot_fleet(reports, args.png)
    return _print(args, reports, {"fleet": [r.to_dict() for r in reports]}, fleet_table(reports))


def fleet_table(reports: list[Any]) -> str:
    """One line per fleet replay: routing, shared level, hit rates, per-node spread."""
    lines = [f"{'route':<8} {'shared':<7} {'nodes':>5} {'hit rate':>9} {'gpu':>7} {'host':>7} {'disk':>7} "
             f"{'shared':>7} {'fleet max':>10} {'node min':>9} {'node max':>9}"]
    for r in reports:
        t = r.total
        rates = [n.tally.rate(n.tally.hits) for n in r.nodes]
        fm = r.fleet_max_tokens / r.prompt_tokens if r.fleet_max_tokens else 0.0
        lines.append(f"{r.route:<8} {('yes' if r.config.shared_url else 'no'):<7} {len(r.nodes):>5} "
                     f"{100 * t.rate(t.hits):8.2f}% "
                     + " ".join(f"{100 * t.rate(t.hit_tokens[k]):6.2f}%" for k in ("gpu", "host", "disk", "shared"))
                     + f" {100 * fm:9.2f}% {100 * min(rates):8.2f}% {100 * max(rates):8.2f}%")
    return "\n".join(lines)
