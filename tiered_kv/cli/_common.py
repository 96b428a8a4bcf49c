"""Helpers shared by the store commands (``warm-start``, ``stats``, ``verify``, ``gc``, ``ls``).

* ``--store URL`` parsing (:func:`parse_store`): ``lmdb:///abs/path``, ``zarr:///abs/path`` or
  a plain path (relative paths are resolved against the working directory; a plain path
  that holds a Zarr store opens as Zarr, anything else as LMDB).
* The layout options (:func:`add_layout_args`, :func:`layout_from_args`): ``--model`` plus
  ``--entry-format`` / ``--indexer-bytes`` / ``--block-tokens`` overrides, as ``plan`` has.
  Commands that compute no KV (``stats``, ``verify``, ``gc``, ``ls``, ``sync``,
  ``prefetch``) take them optionally (:func:`layout_option`): without them the store is
  opened for whatever layout it holds (a maintenance open: it is never written then,
  see :func:`tiered_kv.storage.open_store`), with them the store must hold that layout.
* Store errors -> documented exit codes (:func:`store_errors`, :func:`open_cli_store`,
  :func:`run_guarded`): missing 3, foreign layout 4, locked 5, unreadable 1. A repeated
  ``--store`` (``stats``, ``verify``, ``gc``) opens a chain, nearest first.
* Prompt files (:func:`load_prompts`): JSONL of ``{"id", "tokens"}`` or ``{"id", "text"}``.
* A small progress bar (:class:`Progress`) drawn on stderr when it is a terminal.

Module-level imports stay light (no torch, no stores): every command module is imported
on every ``tiered-kv`` invocation.
"""

from __future__ import annotations

import argparse
import enum
import functools
import itertools
import json
import math
import os
import reprlib
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ..presets import PRESETS, get_preset
from .main import ExitCode, UsageError

if TYPE_CHECKING:
    from ..layout import KVLayout
    from ..storage import BlockStore

__all__ = [
    "BUNDLED_PROMPTS",
    "CommandFailed",
    "Progress",
    "Prompt",
    "StoreLocation",
    "add_layout_args",
    "add_store_arg",
    "iso_time",
    "layout_from_args",
    "load_prompts",
    "open_cli_store",
    "parse_store",
    "print_json",
    "run_guarded",
    "store_errors",
]

#: ``--entry-format`` choices (``fp8`` is ``fp8_ds_mla``), as ``plan`` has them.
ENTRY_FORMATS = ("fp8", "bf16", "fp32")
#: ``--prompts`` value that selects the prompt set shipped with the package.
BUNDLED_PROMPTS = "bundled"
_MAX_TOKEN = 2**32 - 1


# ---------------------------------------------------------------- failures
class CommandFailed(Exception):
    """A store command cannot go on; ``code`` is its :class:`ExitCode`."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_guarded(args: argparse.Namespace, body: Callable[[argparse.Namespace], int]) -> int:
    """Run ``body(args)``; a :class:`CommandFailed` is printed as ``<prog>: error: ...``
    and becomes its exit code (a :class:`UsageError` goes on to ``main``: exit 2)."""
    try:
        return int(body(args))
    except BrokenPipeError:  # stdout closed early (``tiered-kv stats | head``): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail
        return int(ExitCode.FAILURE)
    except CommandFailed as exc:
        parser = getattr(args, "_parser", None)
        prog = parser.prog if parser is not None else "tiered-kv"
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return int(exc.code)


# ---------------------------------------------------------------- arguments
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


def layout_options(layout: KVLayout) -> str:
    """The command-line options that select ``layout``, e.g. ``--model tiny --entry-format bf16``."""
    return _options_for(layout.fingerprint) or f"--model {layout.name}"


def _options_for(fingerprint: str) -> str | None:
    """Options of a preset layout with this fingerprint (None if no common variant has it)."""
    found = _preset_variant(fingerprint)
    return found[1] if found is not None else None


def preset_layout(fingerprint: str) -> KVLayout | None:
    """The preset layout (a common variant) with this fingerprint, None if there is none
    (e.g. a store of the vLLM or SGLang adapter)."""
    found = _preset_variant(fingerprint)
    return found[0] if found is not None else None


@functools.lru_cache(maxsize=64)
def _preset_variant(fingerprint: str) -> tuple[KVLayout, str] | None:
    variants = itertools.product(sorted(PRESETS), (None, *ENTRY_FORMATS), (None, 16, 32, 68, 132, 256),
                                 (None, 256))
    for name, fmt, ib, bt in variants:
        try:
            layout = get_preset(name, entry_format=fmt, indexer_bytes=ib, block_tokens=bt)
        except ValueError:  # not a valid variant of this preset (e.g. tiny with fp8)
            continue
        if layout.fingerprint == fingerprint:
            opts = [f"--model {name}"]
            opts += [f"--entry-format {fmt}"] if fmt else []
            opts += [f"--indexer-bytes {ib}"] if ib else []
            opts += [f"--block-tokens {bt}"] if bt else []
            return layout, " ".join(opts)
    return None


def hashing_layout(layout: KVLayout | None, fingerprint: str) -> KVLayout:
    """The layout prompts are hashed with (``--prompts`` of ``ls`` / ``prefetch``): the
    options', else the preset layout the store holds; UsageError for an engine's store."""
    if layout is not None:
        return layout
    found = preset_layout(fingerprint)
    if found is None:
        raise UsageError(f"--prompts: the store holds layout {fingerprint}, not a tiered_kv preset (e.g. a "
                         f"vLLM or SGLang adapter's store), so prompts cannot be hashed here; give the layout "
                         f"with --model and the overrides (prefetch: or select records with --recent N)")
    return found


def cache_model_id(writer: dict[str, Any] | None) -> str | None:
    """The model id a tiered_kv cache salted its keys with, as its store recorded it (None:
    not recorded, or another writer: the preset's name is used)."""
    if writer and writer.get("writer") == "tiered_kv-cache" and isinstance(writer.get("model"), str):
        return writer["model"]
    return None


def layout_hint(fingerprint: str, writer: dict[str, Any] | None) -> str:
    """What selects ``fingerprint``: a preset's options, else where such layouts come from."""
    options = _options_for(fingerprint)
    if options is not None:
        return options
    if writer and writer.get("writer") in ("vllm-adapter", "sglang-adapter"):
        return "an engine's layout (see writer)"
    return "not a tiered_kv preset"


def describe_writer(info: dict[str, Any] | None) -> str:
    """A store's writer record (:mod:`tiered_kv.storage.format.writer`) in a few words."""
    if not info:
        return "not recorded (created before writers were recorded, or by a maintenance tool)"
    names = {"tiered_kv-cache": "tiered_kv cache", "vllm-adapter": "vLLM adapter",
             "sglang-adapter": "SGLang adapter"}
    kind = names.get(str(info.get("writer")), str(info.get("writer")))
    tenant = info.get("tenant_sha256")
    parts = [kind, f"model {info.get('model')}", f"tenant sha256 {tenant}" if tenant else "no tenant recorded"]
    if info.get("recorded_at"):
        parts.append(f"since {info['recorded_at']}")
    return ", ".join(parts)


# ---------------------------------------------------------------- store location
class Backend(enum.Enum):
    """A store backend, by its URL scheme."""

    LMDB = "lmdb"
    ZARR = "zarr"
    #: a Zarr group on an S3-compatible object store (``zarr+s3://bucket/prefix?...``)
    ZARR_S3 = "zarr+s3"

    @property
    def marker(self) -> str:
        """The file (or object) every store of this backend has at its root."""
        return "data.mdb" if self is Backend.LMDB else "zarr.json"

    @property
    def remote(self) -> bool:
        return self is Backend.ZARR_S3


@dataclass(frozen=True)
class StoreLocation:
    """Where a store lives: its backend and absolute directory (or, for an object store,
    its URL; :attr:`path` then shows the bucket and prefix in messages)."""

    backend: Backend
    path: Path | str
    #: what the user typed, for messages
    given: str

    @property
    def url(self) -> str:
        """The URL :func:`tiered_kv.storage.open_store` takes (``lmdb:///abs/path``)."""
        if self.backend.remote:
            return self.given
        return f"{self.backend.value}://{self.path}"

    @property
    def marker(self) -> str:
        return self.backend.marker

    def exists(self) -> bool:
        """Whether a store of this backend is there (its marker file or object)."""
        if not self.backend.remote:
            root = Path(self.path)
            if self.backend is Backend.LMDB and _has_segment_files(root):
                return True  # its index (data.mdb) may be gone: `verify --repair` rebuilds it
            return (root / self.marker).is_file()
        from ..storage import s3

        with _object_store_errors(self):
            objects = s3.open_object_store(s3.parse_s3_url(self.given))
            return s3.exists(objects, self.marker)


def _has_segment_files(root: Path) -> bool:
    try:
        return any(name.endswith(".seg") for name in os.listdir(root / "segments"))
    except OSError:
        return False


def parse_store(text: str) -> StoreLocation:
    """``--store`` -> :class:`StoreLocation`, the backend chosen by
    :func:`tiered_kv.storage.urls.resolve` (what ``open_store`` uses); UsageError for an
    unknown scheme or a file."""
    from ..storage.urls import resolve

    if not text:
        raise UsageError("--store: expected lmdb:///abs/path, zarr:///abs/path or a path, got ''")
    try:
        target = resolve(text)
    except ValueError as exc:
        raise UsageError(f"--store: {str(exc).removeprefix('url: ')}") from None
    if target.remote:
        from ..storage import s3

        try:
            where = s3.parse_s3_url(text)
        except ValueError as exc:
            raise UsageError(f"--store: {exc}") from None
        shown = f"s3://{where.bucket}/{where.prefix}".rstrip("/")
        return StoreLocation(backend=Backend(target.scheme), path=shown, given=text)
    path = Path(target.location)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--store: expected a store directory, got the file {path}")
    return StoreLocation(backend=Backend(target.scheme), path=path, given=text)


class _NoObjectStoreError(Exception):
    """Stands for the object-store errors where obstore is not installed (never raised)."""


@contextmanager
def _object_store_errors(loc: StoreLocation) -> Iterator[None]:
    """Object-store failures as a command failure naming what to check (no secrets)."""
    try:
        from ..storage.s3 import BucketNotFoundError, ObjectStoreAuthError, ObjectStoreUnavailable
    except ImportError:  # no obstore (the optional `s3` extra): no object store can be in use
        yield
        return
    try:
        yield
    except BucketNotFoundError as exc:
        raise CommandFailed(ExitCode.STORE_MISSING, f"{loc.path}: {exc}") from None
    except ObjectStoreAuthError as exc:
        raise CommandFailed(ExitCode.FAILURE, f"{loc.path}: credentials refused: {exc}") from None
    except ObjectStoreUnavailable as exc:
        raise CommandFailed(ExitCode.FAILURE, f"{loc.path}: object store unreachable: {exc}") from None


def missing_store(loc: StoreLocation) -> CommandFailed:
    return CommandFailed(
        ExitCode.STORE_MISSING,
        f"no prefix-cache store at {loc.path} (no {loc.marker} there); check --store, or create "
        f"and fill one with `tiered-kv warm-start --store {loc.given} --prompts FILE`")


def index_damaged_message(loc: StoreLocation, problem: str) -> str:
    """One line: what is wrong with an LMDB store's index and the command that fixes it."""
    return (f"{loc.path}: the index (data.mdb) is damaged: {problem}. The records are intact in the "
            f"segment files; rebuild the index from them with `tiered-kv verify --repair --store {loc.given}`")


def report_index_rebuild(loc: StoreLocation, store: Any) -> None:
    """One line on stderr when opening ``store`` for writing rebuilt its damaged index."""
    rebuilt = store.index_rebuild
    if rebuilt:
        print(f"{loc.path}: the index was damaged ({rebuilt['problem']}); rebuilt it from the segment "
              f"files: {rebuilt['records']} records (the damaged index is kept at {rebuilt['moved_to']})",
              file=sys.stderr)


@contextmanager
def store_errors(loc: StoreLocation, layout: KVLayout | None, *, expected: str = "") -> Iterator[None]:
    """Turn the errors of opening or using the store at ``loc`` into :class:`CommandFailed`
    with the documented exit codes. ``layout``: the one the options selected (None: none
    was, the fingerprint came from another store, which ``expected`` names)."""
    import lmdb

    from ..storage import EncryptedLevelError, IndexDamagedError, LayoutMismatchError, StoreError, StoreLockedError
    try:
        from ..storage.s3 import ObjectStoreError
    except ImportError:  # no obstore (the optional `s3` extra): nothing raises it
        ObjectStoreError = _NoObjectStoreError  # noqa: N806

    try:
        with _object_store_errors(loc):
            yield
    except IndexDamagedError as exc:
        raise CommandFailed(ExitCode.FAILURE, index_damaged_message(loc, exc.problem)) from None
    except ObjectStoreError as exc:
        raise CommandFailed(ExitCode.FAILURE, f"{loc.path}: object store error: {exc}") from None
    except LayoutMismatchError as exc:
        stored = exc.stored or "another layout"
        hint = _options_for(stored) if exc.stored else None
        written = f" (written with {hint})" if hint else ""
        if layout is not None:
            wanted = (f"the options select {layout.fingerprint} ({layout_options(layout)}); pass the options "
                      f"the store was created with (or none: the store's own layout is used), or use another "
                      f"--store for this layout")
        else:
            wanted = (f"{exc.requested or 'another layout'} was expected{f' ({expected})' if expected else ''}: "
                      f"these stores hold records of different layouts")
        raise CommandFailed(ExitCode.FOREIGN_LAYOUT,
                            f"{loc.path}: the store holds layout fingerprint {stored}{written}, but {wanted}") from None
    except StoreLockedError as exc:
        raise CommandFailed(ExitCode.STORE_LOCKED, f"{loc.path}: store is locked: {exc}") from None
    except EncryptedLevelError as exc:  # (a sealed level opened without its key, or not as it is)
        raise CommandFailed(ExitCode.USAGE, str(exc)) from None
    except lmdb.LockError as exc:
        raise CommandFailed(ExitCode.STORE_LOCKED,
                            f"{loc.path}: store is locked by another process (LMDB: {exc}); "
                            f"retry when it is done") from None
    except FileNotFoundError:
        raise missing_store(loc) from None
    except BrokenPipeError:  # stdout closed (e.g. piped into head): not the store's fault
        raise
    except (StoreError, lmdb.Error, OSError) as exc:
        raise CommandFailed(ExitCode.FAILURE, f"{loc.path}: cannot use the store: {exc}") from None


@contextmanager
def open_cli_store(locs: StoreLocation | Sequence[StoreLocation], layout: KVLayout | None, *,
                   readonly: bool = False, encryption: Any = None, migrate: bool = False) -> Iterator[BlockStore]:
    """Open the existing store at ``locs`` (several: a chain, nearest first) for ``layout``
    (exit 3 when there is none).

    ``layout`` None: whatever layout the store holds (a maintenance open: nothing is
    written, see :func:`tiered_kv.storage.open_store`); the farther levels of a chain must
    hold level 0's. ``readonly`` opens LMDB stores without writing (no access times
    recorded); other backends ignore it. A chain is opened without its upload journal, so
    inspecting it uploads nothing (the node's own process does that). ``encryption``: an
    EncryptionConfig (see :mod:`._keys`) seals and opens the records of a single store
    (a chain's levels may be sealed differently: UsageError); ``migrate``: with it, open a
    level sealed by an earlier version (``rekey``).
    """
    from ..storage import StoreChain, open_store

    levels = [locs] if isinstance(locs, StoreLocation) else list(locs)
    if encryption is not None and len(levels) > 1:
        raise UsageError("--key-file: expected one --store: the levels of a chain may be sealed differently; "
                         "check each level on its own")
    for loc in levels:
        if not loc.exists():
            raise missing_store(loc)
    opened: list[BlockStore] = []
    try:
        fingerprint = None if layout is None else layout.fingerprint
        for i, loc in enumerate(levels):
            expected = "" if i == 0 else f"the layout of {levels[0].path}, the chain's level 0"
            with store_errors(loc, layout, expected=expected):
                options: dict[str, Any] = {"readonly": True} if readonly and loc.backend is Backend.LMDB else {}
                if encryption is not None:
                    options["encryption"] = encryption
                    options["migrate"] = migrate
                opened.append(open_store(loc.url, layout_fingerprint=fingerprint, **options))
            fingerprint = opened[0].layout_fingerprint
        store = opened[0] if len(opened) == 1 else StoreChain(opened, journal=False)
    except BaseException:
        for level in opened:
            level.close()
        raise
    with store_errors(levels[0], layout):
        try:
            yield store
        finally:
            store.close()


def store_url(locs: StoreLocation | Sequence[StoreLocation]) -> str | list[str]:
    """``--store`` as the JSON output names it: a URL, or for a chain the list of them."""
    if isinstance(locs, StoreLocation):
        return locs.url
    return locs[0].url if len(locs) == 1 else [loc.url for loc in locs]


def model_of(layout: KVLayout | None, fingerprint: str) -> str | None:
    """The preset name of the layout the command used: the options', else the store's
    (None for a layout no preset has, e.g. an engine's store)."""
    if layout is not None:
        return layout.name
    found = preset_layout(fingerprint)
    return found.name if found is not None else None


# ---------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Prompt:
    """One prompt of a prompt file."""

    id: str
    tokens: list[int]
    #: the line's ``text`` (``tokens`` are its bytes); None for a line of ``tokens``. What
    #: ``warm-start --endpoint`` sends, so the server tokenizes it with its own tokenizer.
    text: str | None = None


def prompts_arg_help(what: str) -> str:
    return (f"{what}: a JSONL file, one {{\"id\": ..., \"tokens\": [...]}} or {{\"id\": ..., "
            f"\"text\": \"...\"}} per line (text is tokenized byte-level: UTF-8 bytes as ids); "
            f"'{BUNDLED_PROMPTS}' for the demo set shipped with tiered_kv, '-' for stdin")


def load_prompts(spec: str, *, vocab_size: int | None = None) -> list[Prompt]:
    """Read the prompts of ``--prompts spec``; UsageError naming the line on bad input.

    ``vocab_size``: token ids must be below it (the model's vocabulary), else any uint32.
    """
    from ..tokenizer import encode

    name, text = _read_prompt_source(spec)
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--prompts {name} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: expected a JSON object, got invalid JSON ({exc.msg})") from None
        except RecursionError:
            raise UsageError(f"{where}: expected a JSON object, got JSON nested too deeply to read") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        pid = obj.get("id", f"#{n}")
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise UsageError(f"{where}: id: expected a string or integer, got {show(pid)}")
        pid = str(pid)
        _check_unicode(f"{where}: id", pid)
        if pid in seen:
            raise UsageError(f"{where}: duplicate id {pid!r}")
        seen.add(pid)
        has_tokens, has_text = "tokens" in obj, "text" in obj
        if has_tokens == has_text:
            raise UsageError(f"{where}: expected exactly one of \"tokens\" or \"text\", got "
                             f"{'both' if has_tokens else 'neither'}")
        if has_text:
            if not isinstance(obj["text"], str):
                raise UsageError(f"{where}: text: expected a string, got {type(obj['text']).__name__}")
            _check_unicode(f"{where}: text", obj["text"])
            tokens = encode(obj["text"])
        else:
            tokens = _check_tokens(where, obj["tokens"], vocab_size)
        if not tokens:
            raise UsageError(f"{where}: prompt {pid!r} is empty; expected at least one token")
        prompts.append(Prompt(id=pid, tokens=tokens, text=obj["text"] if has_text else None))
    if not prompts:
        raise UsageError(f"--prompts {name}: expected at least one prompt, the file has none")
    return prompts


def _read_prompt_source(spec: str) -> tuple[str, str]:
    if spec == BUNDLED_PROMPTS:
        from importlib.resources import files

        return f"{BUNDLED_PROMPTS} (tiered_kv/data/prompts.jsonl)", \
            files("tiered_kv").joinpath("data").joinpath("prompts.jsonl").read_text(encoding="utf-8")
    if spec == "-":
        return "<stdin>", sys.stdin.read()
    path = Path(spec).expanduser()
    try:
        return spec, path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--prompts: no such file {spec!r} (expected a JSONL file, "
                         f"'{BUNDLED_PROMPTS}' or '-')") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prompts: cannot read {spec!r}: {exc}") from None


def _check_tokens(where: str, tokens: object, vocab_size: int | None) -> list[int]:
    if not isinstance(tokens, list):
        raise UsageError(f"{where}: tokens: expected a list of integers, got {type(tokens).__name__}")
    hi = _MAX_TOKEN if vocab_size is None else vocab_size - 1
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= hi:
            raise UsageError(f"{where}: tokens[{i}]: expected an integer id in [0, {hi + 1}), got {t!r}"
                             + ("" if vocab_size is None else f" (the reference model's vocabulary is "
                                                              f"{vocab_size}; use \"text\" for byte-level ids)"))
    return tokens


def _check_unicode(where: str, text: str) -> None:
    """UsageError if ``text`` cannot be UTF-8 (a lone surrogate such as ``"\\ud800"``, which
    JSON escapes can spell): it could be neither tokenized nor printed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UsageError(f"{where}: expected valid Unicode text, got a lone surrogate "
                         f"U+{ord(text[exc.start]):04X} at character {exc.start}") from None


_SHOW = reprlib.Repr()
_SHOW.maxstring = _SHOW.maxother = 60


def show(value: object) -> str:
    """A short repr of a bad value for a message: bounded in length and nesting (a value
    from a file may be megabytes long or nested thousands deep)."""
    return _SHOW.repr(value)


# ---------------------------------------------------------------- output
@contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Drop the warnings of logger ``name`` meanwhile (a command that reports the same
    failures in its own summary line)."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


def iso_time(ns: int | None) -> str | None:
    """Nanoseconds since the epoch -> ``2025-01-31T02:40:00Z`` (None stays None)."""
    if ns is None:
        return None
    t = datetime.fromtimestamp(ns / 1e9, tz=timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class Progress:
    """A one-line progress bar on ``stream`` (stderr) when it is a terminal; silent otherwise.

    ``println`` prints a result line to stdout without tearing the bar (the bar is
    cleared first and redrawn after).
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 28) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.total = max(total, 1)
        self.width = width
        self._line = ""

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * min(done, self.total) // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        self._line = f"[{bar}] {100 * min(done, self.total) // self.total:3d}%  {note}"
        self._draw()

    def println(self, line: str) -> None:
        if self.enabled:
            self._clear()
        print(line, flush=True)
        if self.enabled and self._line:
            self._draw()

    def close(self) -> None:
        if self.enabled:
            self._clear()
        self._line = ""

    def _draw(self) -> None:
        self.stream.write("\r\x1b[K" + self._line)
        self.stream.flush()

    def _clear(self) -> None:
        self.stream.write("\r\x1b[K")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
