"""``tiered-kv prefetch``: warm a node's local store from a shared one before it serves.

::

    tiered-kv prefetch --from "zarr+s3://kv/v4?endpoint=https://..." --to lmdb:///var/cache/kv \\
        --prompts prompts.jsonl
    tiered-kv prefetch --from "zarr+s3://kv/v4?endpoint=https://..." --to /var/cache/kv --recent 5000 --json

Which records:

- ``--prompts FILE``: the records a cache would hit for those prompts. Each prompt is
  hashed as the cache hashes it (the source's layout, or the one ``--model`` and the
  overrides select; the model id the source's writer recorded, else the preset's name; the
  tenant ``--salt``); its blocks are taken in order up to the first one the source lacks (a
  cache resumes a contiguous prefix only), with the state snapshot at every one of those
  blocks the source has. Needs a source of a tiered_kv preset layout (an engine's store
  has no prompts to hash here: use ``--recent``).
- ``--recent N``: the N most recent records of the source: most recently written on an
  object store (last-modified), most recently accessed on a local Zarr directory. Needs a
  Zarr source (``zarr://`` or ``zarr+s3://``).

No layout option is needed: the source's layout is used, and the destination is created
with it and the source's writer record (``--model`` only checks the source's). Records are
copied at their own size, so an engine's store (pages of several sizes) copies too.

Resumable: records the destination holds already are skipped (``present``), so a run
stopped half-way (or run again) copies only the rest. Verified: every record is read
through the source store, which checks its checksum, layout fingerprint and (with
``--prompts``) its tokens' digest; a bad record is counted (``corrupt``), not copied (and
removed from the source, as any reader of the store does), and the run goes on. Records
are copied in batches of ``--batch`` (one ``get_many`` from the source, one ``put_many``
into the destination, which is durable when it returns). The destination is created if
missing. A progress bar is drawn on stderr when it is a terminal.

Encrypted stores: with ``--key-file`` (see :mod:`._keys`) the source's records are
authenticated and opened for ``--tenant`` (default: ``--salt``); one that fails is a miss
(``auth_failures``), never copied; ``--encrypt-local`` seals the destination's records
under the same keys too (else they land plain on the node, which holds the key anyway).

JSON: ``{"from", "to", "model", "layout_fingerprint", "salt", "selection", "wanted",
"present", "absent", "copied", "copied_bytes", "corrupt", "write_errors",
"last_write_error", "auth_failures", "wall_s"}``: ``wanted`` records selected; ``present`` of them already
in the destination; ``absent`` gone from the source since selected (or, with ``--prompts``,
snapshots the source never had are not counted anywhere); ``copied`` (``copied_bytes`` of
payload) now in the destination.

Exit codes: 0 every wanted record is in the destination (or absent from the source);
1 some records were corrupt in the source or could not be written (the message says how
many), or a store is unreachable; 2 bad arguments or prompts, or ``--recent`` with a
source that is not Zarr; 3 no store at ``--from``; 4 a store holds another layout;
5 the destination is locked.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..planner import format_bytes
from . import _common, _keys
from ._common import CommandFailed, Progress, Prompt
from .main import ExitCode, UsageError

if TYPE_CHECKING:
    from ..layout import KVLayout
    from ..storage import BlockStore, RecordKey

__all__ = ["add_parser", "prefetch", "run", "select_prompt_records"]

#: records asked of the source per presence check
_PRESENCE_BATCH = 512


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "prefetch",
        help="copy the records a prompt set would hit (or the most recent ones) from a shared store",
        description="Warm a local store from a shared one: copy the records the prompts would hit "
                    "(--prompts) or the N most recent records (--recent), skipping those the "
                    "destination has, verifying every record read.",
        epilog="exit codes: 0 ok, 1 corrupt records skipped or writes failed, 2 bad arguments, "
               "3 source store missing, 4 foreign-layout store, 5 destination locked",
    )
    p.add_argument("--from", dest="source", required=True, metavar="URL",
                   help="the store to copy from (must exist): zarr+s3://bucket/prefix?endpoint=..., "
                        "zarr:///abs/path, lmdb:///abs/path or a plain path")
    p.add_argument("--to", dest="dest", required=True, metavar="URL",
                   help="the store to warm (created if missing): lmdb:///abs/path, zarr:///abs/path "
                        "or a plain path")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompts", metavar="FILE", help=_common.prompts_arg_help("prompts whose records to copy"))
    which.add_argument("--recent", type=_common.positive_int, metavar="N",
                       help="copy the N most recent records of the source (a Zarr store)")
    _common.add_layout_args(p, optional=True)
    p.add_argument("--salt", default="", metavar="S",
                   help="tenant salt of the prefix hash, as the serving cache uses (default: none)")
    p.add_argument("--batch", type=_common.positive_int, default=16, metavar="N",
                   help="records per source read and destination write (default %(default)s)")
    _keys.add_key_args(p, what="the source", tenant_default="the --salt")
    p.add_argument("--encrypt-local", action="store_true",
                   help="seal the destination's records under the same keys too")
    p.add_argument("--max-bytes", type=_common.size_arg, default=None, metavar="SIZE",
                   help="bound of the destination's records when it is created here (default: the backend's)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    layout = _common.layout_option(args)
    source = _common.parse_store(args.source)
    dest = _common.parse_store(args.dest)
    if dest.backend.remote:
        raise UsageError("--to: expected a local store (lmdb:///abs/path, zarr:///abs/path or a path): "
                         "prefetch warms a node's own store")
    if source.url == dest.url:
        raise UsageError(f"--from and --to: expected two different stores, got {source.url} twice")
    if args.recent is not None and source.backend is _common.Backend.LMDB:
        raise UsageError(f"--recent: expected a Zarr source (zarr:// or zarr+s3://), whose listing has "
                         f"write or access times; {source.url} is LMDB: select its records with --prompts")
    if args.max_bytes == 0:
        raise UsageError("--max-bytes: expected a positive size, e.g. 8G, got 0")
    prompts = _common.load_prompts(args.prompts) if args.prompts is not None else None
    encryption = _keys.encryption_from_args(args, default_tenant=args.salt)
    if args.encrypt_local and encryption is None:
        raise UsageError(f"--encrypt-local: expected --key-file (or ${_keys.ENV_KEY_FILE}) too")
    report = prefetch(layout, source, dest, prompts=prompts, recent=args.recent, salt=args.salt,
                      batch=args.batch, max_bytes=args.max_bytes, verbose=not args.json,
                      encryption=encryption, encrypt_local=args.encrypt_local)
    if args.json:
        _common.print_json(report)
    problems = []
    if report["corrupt"]:
        problems.append(f"{report['corrupt']} corrupt{' or unauthentic' if report['auth_failures'] else ''} "
                        f"records in {source.path} were skipped")
    if report["write_errors"]:
        problems.append(f"{report['write_errors']} records could not be written to {dest.path} "
                        f"(last error: {report['last_write_error']})")
    if problems:
        raise CommandFailed(ExitCode.FAILURE, "; ".join(problems) + "; the others were copied")
    return ExitCode.OK


@dataclass
class _Counts:
    wanted: int = 0
    present: int = 0
    absent: int = 0
    copied: int = 0
    copied_bytes: int = 0
    corrupt: int = 0
    write_errors: int = 0
    last_write_error: str | None = None
    digests: dict[Any, bytes | None] = field(default_factory=dict)


def prefetch(layout: KVLayout | None, source: _common.StoreLocation, dest: _common.StoreLocation, *,
             prompts: list[Prompt] | None = None, recent: int | None = None, salt: str = "", batch: int = 16,
             max_bytes: int | None = None, verbose: bool = True, encryption: Any = None,
             encrypt_local: bool = False) -> dict[str, Any]:
    """Copy the selected records of ``source`` into ``dest`` (see the module docstring);
    return the report (the ``--json`` object). Exactly one of ``prompts`` and ``recent``.
    ``layout`` None: the source's. ``encryption``: the source's EncryptionConfig (and the
    destination's with ``encrypt_local``)."""
    from ..storage import StoreWriter, open_store

    if (prompts is None) == (recent is None):
        raise ValueError("prompts, recent: expected exactly one of them")
    t0 = time.perf_counter()
    counts = _Counts()
    with _common.open_cli_store(source, layout, readonly=True, encryption=encryption) as src:
        fingerprint = src.layout_fingerprint
        writer_info = src.stats().get("writer")
        hashing = _common.hashing_layout(layout, fingerprint) if prompts is not None else None
        with _common.store_errors(dest, layout, expected=f"the layout of {source.path}, the source"):
            options: dict[str, Any] = {} if max_bytes is None else {"max_bytes": max_bytes}
            if encrypt_local:
                options["encryption"] = encryption
            dst = open_store(dest.url, layout_fingerprint=fingerprint, writer=StoreWriter.from_dict(writer_info),
                             **options)
            try:
                with _common.store_errors(source, layout):
                    if prompts is not None:
                        assert hashing is not None
                        keys, counts.digests = select_prompt_records(src, hashing, prompts, salt=salt,
                                                                     model_id=_common.cache_model_id(writer_info))
                    else:
                        assert recent is not None
                        keys = src.recent(recent)  # (a Zarr source: checked by _run)
                counts.wanted = len(keys)
                if not keys and encryption is not None:
                    _check_keys_open_some(src, source)
                todo = _missing(dst, keys)
                counts.present = len(keys) - len(todo)
                if verbose:
                    print(f"prefetch: {source.url} -> {dest.url}: {counts.wanted} records selected, "
                          f"{counts.present} already there, {len(todo)} to copy")
                sizing = hashing or layout or _common.preset_layout(fingerprint)  # None: an engine's store
                _copy(src, dst, sizing, todo, counts, batch, source, verbose)
                auth_failures = int(src.stats().get("auth_failures") or 0)
            finally:
                dst.close()
    wall = time.perf_counter() - t0
    if verbose:
        print(f"  copied {counts.copied} records ({format_bytes(counts.copied_bytes)}) in {wall:.1f} s; "
              f"{counts.absent} absent, {counts.corrupt} corrupt, {counts.write_errors} not written")
    return {"from": source.url, "to": dest.url, "model": _common.model_of(layout, fingerprint),
            "layout_fingerprint": fingerprint,
            "salt": salt, "selection": "prompts" if prompts is not None else f"recent {recent}",
            "wanted": counts.wanted, "present": counts.present, "absent": counts.absent, "copied": counts.copied,
            "copied_bytes": counts.copied_bytes, "corrupt": counts.corrupt, "write_errors": counts.write_errors,
            "last_write_error": counts.last_write_error, "auth_failures": auth_failures, "wall_s": wall}


def select_prompt_records(store: BlockStore, layout: KVLayout, prompts: list[Prompt], *, salt: str = "",
                          model_id: str | None = None) -> tuple[list[RecordKey], dict[RecordKey, bytes | None]]:
    """The records of ``store`` a cache would hit for ``prompts``, in prompt order (no
    duplicates), and each one's token digest (checked when it is read).

    Per prompt: its full blocks up to the first one ``store`` lacks, and the snapshot of
    each of those blocks that ``store`` has (hashed as the cache does: ``model_id``
    (default: the layout's name), tenant ``salt``)."""
    from ..prefix import PrefixHasher, token_digest
    from ..storage import RecordKey

    hasher = PrefixHasher(layout, model_id=model_id, salt=salt)
    bt = layout.block_tokens
    digests: dict[RecordKey, bytes | None] = {}
    per_prompt: list[list[RecordKey]] = []
    for prompt in prompts:
        row = []
        for k, h in enumerate(hasher.block_hashes(prompt.tokens)):
            d = token_digest(prompt.tokens[k * bt:(k + 1) * bt])
            for key in (RecordKey.block(h), RecordKey.snapshot(h)):
                digests[key] = d
                row.append(key)
        per_prompt.append(row)
    candidates = list(dict.fromkeys(key for row in per_prompt for key in row))
    present: dict[RecordKey, bool] = {}
    for i in range(0, len(candidates), _PRESENCE_BATCH):
        chunk = candidates[i:i + _PRESENCE_BATCH]
        present.update(zip(chunk, store.contains_many(chunk)))
    selected: dict[RecordKey, None] = {}
    for row in per_prompt:
        for block, snapshot in zip(row[0::2], row[1::2]):
            if not present[block]:
                break  # the prefix ends here: later blocks cannot be hit
            selected[block] = None
            if present[snapshot]:
                selected[snapshot] = None
    keys = list(selected)
    return keys, {key: digests[key] for key in keys}


def _check_keys_open_some(src: Any, source: _common.StoreLocation) -> None:
    """Nothing was selected from an encrypted source: if what it holds opens under none of
    the keys given, say so (a wrong key or tenant finds no name of its own: an empty
    selection would look like prompts the source never cached)."""
    described = src.describe(8)
    if described["sampled"] and not described["sampled_by_key"]:
        raise CommandFailed(ExitCode.FAILURE, f"{source.path}: no record there opens under the keys given "
                                              f"({described['sampled']} sampled): check --key-file and --tenant "
                                              f"(default: the --salt)")


def _missing(store: BlockStore, keys: list[RecordKey]) -> list[RecordKey]:
    out: list[RecordKey] = []
    for i in range(0, len(keys), _PRESENCE_BATCH):
        chunk = keys[i:i + _PRESENCE_BATCH]
        out += [key for key, there in zip(chunk, store.contains_many(chunk)) if not there]
    return out


def _copy(src: BlockStore, dst: BlockStore, layout: KVLayout | None, keys: list[RecordKey], counts: _Counts,
          batch: int, source: _common.StoreLocation, verbose: bool) -> None:
    """Read ``keys`` from ``src`` (verified) and write them to ``dst``, ``batch`` at a time.
    Buffers are sized by ``layout`` when known, else by each record's stored size."""
    import numpy as np

    from ..storage import PutItem, RecordKind, StoreError

    sizes = None if layout is None else {RecordKind.BLOCK: layout.block_bytes,
                                         RecordKind.SNAPSHOT: layout.snapshot_bytes}
    progress = Progress(len(keys), enabled=None if verbose else False)
    done = misses = 0
    with _common.store_errors(source, layout):
        corrupt_before = _corrupt(src)
    try:
        for i in range(0, len(keys), batch):
            chunk = keys[i:i + batch]
            with _common.store_errors(source, layout):
                if sizes is None:  # an unknown layout: each record's own size (None: gone meanwhile)
                    found = [(key, n) for key, n in zip(chunk, src.payload_sizes(chunk)) if n is not None]
                else:
                    found = [(key, sizes[key.kind]) for key in chunk]
                chunk = [key for key, _ in found]
                bufs = [np.empty(n, dtype=np.uint8) for _, n in found]
                metas = src.get_many(chunk, bufs, token_digests=[counts.digests.get(key) for key in chunk])
            misses += len(keys[i:i + batch]) - len(chunk)
            misses += sum(m is None for m in metas)
            items = [PutItem(m.key, m.parent_hash, m.token_digest, buf) for m, buf in zip(metas, bufs) if m is not None]
            if items:
                try:
                    dst.put_many(items)
                except StoreError as exc:  # e.g. the destination is full: count, keep what fits
                    counts.write_errors += len(items)
                    counts.last_write_error = f"{type(exc).__name__}: {exc}"
                else:
                    counts.copied += len(items)
                    counts.copied_bytes += sum(int(item.payload.nbytes) for item in items)
            done += min(batch, len(keys) - i)
            progress.update(done, f"{done}/{len(keys)} records, {format_bytes(counts.copied_bytes)}")
    finally:
        progress.close()
    if misses:  # a miss is a record gone since it was selected, or a bad one (the store counts those)
        with _common.store_errors(source, layout):
            counts.corrupt = min(misses, _corrupt(src) - corrupt_before)
        counts.absent = misses - counts.corrupt


def _corrupt(store: BlockStore) -> int:
    """The store's count of corrupt records read (asked before and after the copy: a local
    Zarr store lists its directory for ``stats()``)."""
    s = store.stats()
    return int(s.get("corrupt") or 0) + int(s.get("auth_failures") or 0)  # (encrypted: unauthentic too)
