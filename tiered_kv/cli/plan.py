"""``tiered-kv plan``: bytes per request and requests per GPU for a model preset.

::

    tiered-kv plan --model deepseek-v4-flash --context 1M
    tiered-kv plan --model deepseek-v4-pro --context 1M --entry-format bf16 --indexer-bytes 256 --json

The table shows exact byte counts with binary units beside them; ``--json`` prints the
plan as one JSON object (:meth:`tiered_kv.planner.Plan.to_dict`).
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from typing import Any

from ..planner import GiB, Plan, build_plan, format_bytes, parse_size
from ..presets import PRESETS, get_preset
from .main import ExitCode, UsageError

__all__ = ["add_parser", "format_table", "run"]

#: ``--entry-format`` choices (``fp8`` is ``fp8_ds_mla``); see ``EntryFormat.parse``.
ENTRY_FORMATS = ("fp8", "bf16", "fp32")
DEFAULT_HBM_GIB = "80"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _gib_to_bytes(text: str) -> int:
    """``"80"`` or ``"141.5"`` GiB -> whole bytes (rounded down)."""
    try:
        gib = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a number of GiB, e.g. 80, got {text!r}") from None
    if gib <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of GiB, got {text!r}")
    return int(gib * GiB)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="bytes per request and requests per GPU for a model preset",
        description="Exact KV-cache bytes of one request (Classical blocks + State slot) "
                    "and how many requests fit in the GPU memory given to the cache.",
    )
    p.add_argument("--model", required=True, choices=sorted(PRESETS), help="model preset")
    p.add_argument("--context", type=_size, default=parse_size("1M"), metavar="N",
                   help="context length in tokens; suffixes k/K/M/G are binary (default 1M)")
    p.add_argument("--entry-format", choices=ENTRY_FORMATS, default=None,
                   help="CSA/HCA/SWA entry format (default: the preset's; fp8 = fp8_ds_mla)")
    p.add_argument("--indexer-bytes", type=_positive_int, default=None, metavar="B",
                   help="bytes of one indexer key (default: the preset's, 132 = fp8)")
    p.add_argument("--block-tokens", type=_positive_int, default=None, metavar="T",
                   help="tokens per Classical block, a multiple of 128 (default 128)")
    p.add_argument("--hbm-gib", type=_gib_to_bytes, default=DEFAULT_HBM_GIB, metavar="G",
                   dest="hbm_bytes",
                   help="GPU memory given to the KV cache, GiB (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        layout = get_preset(args.model, entry_format=args.entry_format,
                            indexer_bytes=args.indexer_bytes, block_tokens=args.block_tokens)
    except ValueError as exc:  # e.g. fp8 needs head_dim 512; block_tokens not a multiple of 128
        raise UsageError(str(exc)) from None
    result = build_plan(layout, args.context, hbm_bytes=args.hbm_bytes)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(format_table(result))
    return ExitCode.OK


def format_table(p: Plan) -> str:
    """The plan as an aligned table: name, exact value, and binary units for byte counts."""
    rows: list[tuple[str, str, str]] = [
        ("model", p.model, ""),
        ("layout_fingerprint", p.layout_fingerprint, ""),
        ("entry_format", p.entry_format, f"{p.entry_bytes} B/entry, indexer key {p.indexer_bytes} B"),
        ("layers", str(p.num_layers), f"{p.num_csa_layers} CSA, {p.num_hca_layers} HCA"),
        ("context_tokens", str(p.context_tokens), ""),
        ("block_tokens", str(p.block_tokens), ""),
        ("num_blocks", str(p.num_blocks), ""),
        ("block_bytes", *_bytes(p.block_bytes)),
        ("classical_bytes", *_bytes(p.classical_bytes)),
        *((f"  {name}", *_bytes(n)) for name, n in p.classical_parts.to_dict().items()),
        ("state_bytes", *_bytes(p.state_bytes)),
        ("snapshot_bytes", *_bytes(p.snapshot_bytes)),
        ("bytes_per_request", *_bytes(p.bytes_per_request)),
        ("hbm_bytes", *_bytes(p.hbm_bytes)),
        ("max_requests", str(p.max_requests), "without offload"),
    ]
    name_w = max(len(r[0]) for r in rows)
    # Right-align numbers; the fingerprint and names are wider and stay left-aligned.
    num_w = max(len(r[1]) for r in rows if r[1].isdigit())
    lines = []
    for name, value, note in rows:
        cell = value.rjust(num_w) if value.isdigit() else value.ljust(num_w)
        lines.append(f"{name.ljust(name_w)}  {cell}  {note}".rstrip())
    return "\n".join(lines)


def _bytes(n: int) -> tuple[str, str]:
    return str(n), format_bytes(n)
