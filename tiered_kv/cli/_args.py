"""The command-line arguments the store commands share: ``--store``, the layout options
(``--model`` and the ``--entry-format`` / ``--indexer-bytes`` / ``--block-tokens``
overrides, as ``plan`` has them), and argparse types for counts, seconds and sizes."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from ..presets import PRESETS, get_preset
from .main import UsageError

if TYPE_CHECKING:
    from ..layout import KVLayout

__all__ = ["ENTRY_FORMATS", "add_layout_args", "add_store_arg", "layout_from_args", "layout_option", "positive_int",
           "seconds_arg", "size_arg"]

#: ``--entry-format`` choices (``fp8`` is ``fp8_ds_mla``), as ``plan`` has them.
ENTRY_FORMATS = ("fp8", "bf16", "fp32")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def seconds_arg(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (``--timeout``). ``inf`` and ``nan``
    are refused: sockets and waits take no infinite timeout, so say a long one instead."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0 (e.g. 86400 for a day), "
                                         f"got {text!r}")
    return value


def size_arg(text: str) -> int:
    """argparse type: a byte count with an optional binary suffix (``512M``, ``2GiB``)."""
    from ..planner import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_store_arg(p: argparse.ArgumentParser, *, creates: bool = False, required: bool = True,
                  note: str = "", chain: bool = False) -> None:
    """``--store URL``; ``chain``: it may be repeated (a chain, nearest first), and
    ``args.store`` is then a list."""
    what = "created if missing" if creates else "must exist"
    more = "; repeat it for a chain, nearest first (e.g. the node's LMDB, then the bucket)" if chain else ""
    p.add_argument("--store", required=required, metavar="URL", action="append" if chain else "store",
                   help=f"the prefix-cache store ({what}): lmdb:///abs/path, zarr:///abs/path, "
                        f"zarr+s3://bucket/prefix?endpoint=..., or a plain path (LMDB; relative paths are "
                        f"resolved){more}{note}")


def add_layout_args(p: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """``--model`` and the layout overrides: they select the layout fingerprint the store
    must have been created with. ``optional``: for commands that compute no KV; without
    any of them the store's own layout is used (:func:`layout_option`)."""
    if optional:
        p.add_argument("--model", choices=sorted(PRESETS), default=None,
                       help="model preset whose KV layout the store must hold (default: whatever layout "
                            "the store holds; give it, or an override below, only to check that)")
    else:
        p.add_argument("--model", choices=sorted(PRESETS), default="tiny",
                       help="model preset whose KV layout the store holds (default %(default)s)")
    p.add_argument("--entry-format", choices=ENTRY_FORMATS, default=None,
                   help="CSA/HCA/SWA entry format (default: the preset's; fp8 = fp8_ds_mla)")
    p.add_argument("--indexer-bytes", type=positive_int, default=None, metavar="B",
                   help="bytes of one indexer key (default: the preset's)")
    p.add_argument("--block-tokens", type=positive_int, default=None, metavar="T",
                   help="tokens per Classical block, a multiple of 128 (default 128)")


def layout_from_args(args: argparse.Namespace) -> KVLayout:
    try:
        return get_preset(args.model or "tiny", entry_format=args.entry_format,
                          indexer_bytes=args.indexer_bytes, block_tokens=args.block_tokens)
    except ValueError as exc:  # e.g. fp8 needs head_dim 512; block_tokens not a multiple of 128
        raise UsageError(str(exc)) from None


def layout_option(args: argparse.Namespace) -> KVLayout | None:
    """The layout the options select (``--model`` defaults to ``tiny`` when only an
    override is given), or None when no layout option was given: the store decides."""
    if all(getattr(args, name) is None for name in ("model", "entry_format", "indexer_bytes", "block_tokens")):
        return None
    return layout_from_args(args)
