"""``tiered-kv ls``: which resume points of each prompt the store holds.

::

    tiered-kv ls --store .demo/store --prompts bundled
    tiered-kv ls --store lmdb:///var/cache/kv --prompts prompts.jsonl --salt tenant-a --json

A resume point is a block boundary P (a multiple of the block size, 128 tokens) where the
store holds every block of ``[0, P)`` and the state snapshot at P (docs/architecture.md §3). For
each prompt ``ls`` lists them and the one ``cache.open`` would use on a cold cache: the
longest, leaving at least one token to compute. That is the ``cached_tokens`` a
``warm-start`` of the same prompt reports. Only presence is checked (records are not
read, so no access time changes); ``verify`` checks the contents.

Prompts are hashed in the namespace the cache uses: the layout (the store's, or the one
``--model`` and the overrides select, which the store must hold), the model id the store's
writer recorded (a tiered_kv cache's; else the preset's name) and the tenant ``--salt``.

An encrypted store names its records by keyed names (a prompt's hash tells nothing
without the key): give ``--key-file`` (see :mod:`._keys`; the tenant defaults to the
``--salt``, as a cache's does); without it ``ls`` of a sealed store is refused (exit 2)
rather than report every prompt absent.

JSON: ``{"store", "model", "layout_fingerprint", "salt", "prompts": [{"id", "tokens",
"full_blocks", "blocks_in_store", "resume_points", "cached_tokens"}]}``.

Exit codes: 0 ok, 2 bad arguments or prompts, 3 no store at ``--store``, 4 the store holds
another layout, 5 the store is locked.
"""

from __future__ import annotations

import argparse
from typing import Any

from . import _common, _keys
from ._common import Prompt
from .main import ExitCode, UsageError

__all__ = ["add_parser", "resume_points", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "ls",
        help="the resume points each prompt would hit in a store",
        description="For each prompt, the resume points (block boundaries with every block before "
                    "them and a state snapshot in the store) and the one a cache would resume at.",
        epilog="exit codes: 0 ok, 2 bad arguments, 3 store missing, 4 foreign-layout store, 5 store locked",
    )
    _common.add_store_arg(p)
    p.add_argument("--prompts", required=True, metavar="FILE", help=_common.prompts_arg_help("prompts"))
    _common.add_layout_args(p, optional=True)
    p.add_argument("--salt", default="", metavar="S",
                   help="tenant salt of the prefix hash, as given to warm-start (default: none)")
    _keys.add_key_args(p, tenant_default="the --salt, as a cache's")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    from ..prefix import PrefixHasher

    layout = _common.layout_option(args)
    loc = _common.parse_store(args.store)
    prompts = _common.load_prompts(args.prompts)
    encryption = _keys.encryption_from_args(args, default_tenant=args.salt)
    with _common.open_cli_store(loc, layout, readonly=True, encryption=encryption) as store:
        if encryption is None and store.sealing is not None:
            raise UsageError(f"--key-file: {loc.path} is an encrypted store: its records are under keyed names, "
                             f"so a prompt's presence can only be checked with its key (--key-file, and --tenant "
                             f"unless it is the --salt)")
        layout = _common.hashing_layout(layout, store.layout_fingerprint)
        hasher = PrefixHasher(layout, model_id=_common.cache_model_id(store.stats().get("writer")), salt=args.salt)
        rows = [resume_points(store, hasher, p) for p in prompts]
    if args.json:
        _common.print_json({"store": loc.url, "model": layout.name, "layout_fingerprint": layout.fingerprint,
                            "salt": args.salt, "prompts": rows})
        return ExitCode.OK
    print(f"{loc.url}  ({layout.name} {layout.fingerprint}, block {layout.block_tokens} tokens"
          + (f", salt {args.salt!r})" if args.salt else ")"))
    print(f"{'id':<20} {'tokens':>7} {'blocks':>9} {'cached':>7}  resume points (tokens)")
    for r in rows:
        blocks = f"{r['blocks_in_store']}/{r['full_blocks']}"
        points = " ".join(map(str, r["resume_points"])) or "-"
        print(f"{r['id']:<20} {r['tokens']:>7} {blocks:>9} {r['cached_tokens']:>7}  {points}")
    return ExitCode.OK


def resume_points(store: Any, hasher: Any, prompt: Prompt) -> dict[str, Any]:
    """The store's resume points of ``prompt`` and the one ``cache.open`` would use.

    ``blocks_in_store``: leading full blocks the store holds (a chain: a missing block
    ends it); ``resume_points``: the boundaries among them with a snapshot;
    ``cached_tokens``: the longest resume point below ``len(tokens)``, else 0.
    """
    from ..storage import RecordKey

    bt = hasher.layout.block_tokens
    hashes = hasher.block_hashes(prompt.tokens)
    present = 0
    points: list[int] = []
    for k, h in enumerate(hashes, start=1):
        if not store.contains(RecordKey.block(h)):
            break
        present = k
        if store.contains(RecordKey.snapshot(h)):
            points.append(k * bt)
    usable = [p for p in points if p < len(prompt.tokens)]
    return {"id": prompt.id, "tokens": len(prompt.tokens), "full_blocks": len(hashes),
            "blocks_in_store": present, "resume_points": points,
            "cached_tokens": usable[-1] if usable else 0}
