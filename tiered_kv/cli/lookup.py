"""``tiered-kv lookup``: how many tokens of each prompt a store (or a chain) could resume, per level.

::

    tiered-kv lookup --store lmdb:///var/cache/kv --prompts prompts.jsonl
    tiered-kv lookup --store lmdb:///var/cache/kv --store "zarr+s3://kv/v4?endpoint=..." --hashes hashes.jsonl --json

The command-line form of :meth:`tiered_kv.TieredKVCache.lookup` (a serving process asks
its own cache, GPU and host tiers included; this asks the stores): for each prompt the
tokens resumable with level 0 (``disk``) and with the farther levels of a chain too
(``shared``), and the longest held block prefix. Nothing is read but the index: no
record, no access time. ``--prompts`` hashes each prompt as the cache does (the store's
layout, or the one ``--model`` and the overrides select; the model id its writer
recorded; ``--salt``). ``--hashes`` takes what a router keeps: a JSONL file, one
``{"id": ..., "hashes": ["<64 hex>", ...], "tokens": N}`` per line (``tokens``, the
prompt's length, optional: without it every block may be resumed).

JSON: ``{"store", "layout_fingerprint", "block_tokens", "prompts": [{"id", "tokens",
"resumable_tokens": {"disk": n, "shared": n}, "resident_tokens": {...}, "lookup_us"}]}``.

Exit codes: 0 ok, 2 bad arguments or input, 3 no store at ``--store``, 4 the store holds
another layout, 5 the store is locked.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from . import _common
from .main import ExitCode, UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "lookup",
        help="tokens of each prompt a store (or chain) could resume, per level, reading no record",
        description="For each prompt (or its block hashes, as a router keeps them): the tokens resumable from "
                    "the store's level 0 and with each farther level of a chain, from the index alone.",
        epilog="exit codes: 0 ok, 2 bad arguments, 3 store missing, 4 foreign-layout store, 5 store locked",
    )
    _common.add_store_arg(p, chain=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", metavar="FILE", help=_common.prompts_arg_help("prompts"))
    src.add_argument("--hashes", metavar="FILE",
                     help='block hashes: a JSONL file, one {"id": ..., "hashes": ["<64 hex>", ...], "tokens": N} '
                          "per line (tokens optional)")
    _common.add_layout_args(p, optional=True)
    p.add_argument("--salt", default="", metavar="S", help="tenant salt of the prefix hash (with --prompts)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _load_hashes(path: str) -> list[tuple[str, list[bytes], int | None]]:
    out = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UsageError(f"--hashes {path}: {e}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"--hashes {path} line {n}"
        try:
            obj = json.loads(line)
            hashes = [bytes.fromhex(h) for h in obj["hashes"]]
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f'{where}: expected {{"id": ..., "hashes": ["<64 hex>", ...]}}: {e}') from None
        if any(len(h) != 32 for h in hashes):
            raise UsageError(f"{where}: expected 32-byte hashes (64 hex digits)")
        tokens = obj.get("tokens")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise UsageError(f"{where}: tokens: expected a non-negative int")
        out.append((str(obj.get("id", n)), hashes, tokens))
    return out


def _run(args: argparse.Namespace) -> int:
    from ..lookup import ResumeIndex
    from ..prefix import PrefixHasher

    layout = _common.layout_option(args)
    locs = [_common.parse_store(text) for text in args.store]
    with _common.open_cli_store(locs, layout, readonly=True) as store:
        if args.prompts:
            hashing = _common.hashing_layout(layout, store.layout_fingerprint)
            hasher = PrefixHasher(hashing, model_id=_common.cache_model_id(store.stats().get("writer")),
                                  salt=args.salt)
            bt = hashing.block_tokens
            items = [(p.id, hasher.block_hashes(p.tokens[:len(p.tokens) - len(p.tokens) % bt]), len(p.tokens))
                     for p in _common.load_prompts(args.prompts)]
        else:
            found = layout or _common.preset_layout(store.layout_fingerprint)
            bt = found.block_tokens if found is not None else 128
            items = _load_hashes(args.hashes)
        index = ResumeIndex.of_store(store, bt)
        rows = []
        for pid, hashes, tokens in items:
            t0 = time.perf_counter()
            try:
                look = index.lookup(hashes, num_tokens=tokens)
            except ValueError as e:
                raise UsageError(f"{pid}: {e}") from None
            us = 1e6 * (time.perf_counter() - t0)
            d = look.to_dict()
            rows.append({"id": pid, "tokens": tokens, "full_blocks": len(hashes), "resumable_tokens": d["tokens"],
                         "resident_tokens": d["resident_tokens"], "blocks_by_tier": d["blocks_by_tier"],
                         "lookup_us": round(us, 1)})
        fingerprint = store.layout_fingerprint
    if args.json:
        _common.print_json({"store": _common.store_url(locs), "layout_fingerprint": fingerprint, "block_tokens": bt,
                            "prompts": rows})
        return ExitCode.OK
    levels = list(rows[0]["resumable_tokens"]) if rows else ["disk"]
    print(f"{' -> '.join(str(loc.url) for loc in locs)}  ({fingerprint}, block {bt} tokens)")
    print(f"{'id':<20} {'tokens':>8} " + " ".join(f"{'resume ' + lv:>14}" for lv in levels)
          + f" {'held':>8} {'lookup us':>10}")
    for r in rows:
        tokens = "-" if r["tokens"] is None else str(r["tokens"])
        print(f"{r['id']:<20} {tokens:>8} " + " ".join(f"{r['resumable_tokens'][lv]:>14}" for lv in levels)
              + f" {r['resident_tokens'][levels[-1]]:>8} {r['lookup_us']:>10.1f}")
    return ExitCode.OK
