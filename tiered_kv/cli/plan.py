"""``tiered-kv plan``: bytes per request and requests per GPU for a model preset.

::

    tiered-kv plan --model deepseek-v4-flash --context 1M
    tiered-kv plan --model deepseek-v4-pro --context 1M --entry-format bf16 --indexer-bytes 256 --json
    tiered-kv plan --model deepseek-v4-flash --context 1M --hisparse-buffer 2048

The table shows exact byte counts with binary units beside them; ``--json`` prints the
plan as one JSON object (:meth:`tiered_kv.planner.Plan.to_dict`). ``--hisparse-buffer N``
plans HiSparse (CSA offload, N device slots per request and CSA layer): GPU and host
bytes per request and how many requests fit; without it the JSON's HiSparse values are
``null`` (``hbm_bytes_per_request`` then equals ``bytes_per_request`` and
``host_bytes_per_request`` is 0).
"""

from __future__ import annotations

import argparse
import json
from fractions import Fraction
from typing import Any

from ..planner import GiB, Plan, build_plan, format_bytes, parse_size
from ..presets import PRESETS, get_preset
from . import _common
from .main import ExitCode, UsageError

__all__ = ["add_parser", "format_table", "run"]

#: ``--entry-format`` choices (``fp8`` is ``fp8_ds_mla``); see ``EntryFormat.parse``.
ENTRY_FORMATS = ("fp8", "bf16", "fp32")
DEFAULT_HBM_GIB = "80"


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
    p.add_argument("--context", type=_common.size_arg, default=parse_size("1M"), metavar="N",
                   help="context length in tokens; suffixes k/K/M/G are binary (default 1M)")
    p.add_argument("--entry-format", choices=ENTRY_FORMATS, default=None,
                   help="CSA/HCA/SWA entry format (default: the preset's; fp8 = fp8_ds_mla)")
    p.add_argument("--indexer-bytes", type=_common.positive_int, default=None, metavar="B",
                   help="bytes of one indexer key (default: the preset's, 132 = fp8)")
    p.add_argument("--block-tokens", type=_common.positive_int, default=None, metavar="T",
                   help="tokens per Classical block, a multiple of 128 (default 128)")
    p.add_argument("--hbm-gib", type=_gib_to_bytes, default=DEFAULT_HBM_GIB, metavar="G",
                   dest="hbm_bytes",
                   help="GPU memory given to the KV cache, GiB (default %(default)s)")
    p.add_argument("--hisparse-buffer", type=_common.positive_int, default=None, metavar="N",
                   dest="hisparse_buffer_entries",
                   help="plan HiSparse: CSA entry slots per request per CSA layer on the device, "
                        "at least the model's top-k (e.g. 4 x top-k)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        layout = get_preset(args.model, entry_format=args.entry_format,
                            indexer_bytes=args.indexer_bytes, block_tokens=args.block_tokens)
    except ValueError as exc:  # e.g. fp8 needs head_dim 512; block_tokens not a multiple of 128
        raise UsageError(str(exc)) from None
    n = args.hisparse_buffer_entries
    if n is not None and n < layout.top_k:
        raise UsageError(f"--hisparse-buffer: expected at least the model's top-k = {layout.top_k} "
                         f"(e.g. {4 * layout.top_k} = 4 x top-k), got {n}")
    result = build_plan(layout, args.context, hbm_bytes=args.hbm_bytes, hisparse_buffer_entries=n)
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
        *_hisparse_rows(p),
    ]
    name_w = max(len(r[0]) for r in rows)
    # Right-align numbers; the fingerprint and names are wider and stay left-aligned.
    num_w = max(len(r[1]) for r in rows if r[1].isdigit())
    lines = []
    for name, value, note in rows:
        cell = value.rjust(num_w) if value.isdigit() else value.ljust(num_w)
        lines.append(f"{name.ljust(name_w)}  {cell}  {note}".rstrip())
    return "\n".join(lines)


def _hisparse_rows(p: Plan) -> list[tuple[str, str, str]]:
    """HiSparse rows of the table (none without ``--hisparse-buffer``)."""
    hs = p.hisparse
    if hs is None:
        return []
    return [
        ("hisparse_buffer_entries", str(hs.buffer_entries), "CSA slots per request per CSA layer"),
        ("hbm_bytes_per_request", *_bytes(p.hbm_bytes_per_request)),
        ("  classical_no_csa_kv", *_bytes(p.classical_bytes - p.classical_parts.csa_kv)),
        ("  open_block_csa_kv", *_bytes(hs.open_block_csa_kv)),
        ("  device_buffer", *_bytes(hs.device_buffer)),
        ("  state_bytes", *_bytes(p.state_bytes)),
        ("max_requests_hisparse", str(p.max_requests_hisparse), "with HiSparse"),
        ("host_bytes_per_request", *_bytes(p.host_bytes_per_request)),
    ]


def _bytes(n: int) -> tuple[str, str]:
    return str(n), format_bytes(n)
