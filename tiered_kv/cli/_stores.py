"""Stores on the command line: ``--store`` parsed into a :class:`StoreLocation` (the backend
chosen by :func:`tiered_kv.storage.urls.resolve`, as ``open_store`` chooses it), stores
opened for a command (:func:`open_cli_store`: a repeated ``--store`` is a chain, nearest
first), and store errors turned into the documented exit codes (:func:`store_errors`:
missing 3, foreign layout 4, locked 5, unreadable 1)."""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._failures import CommandFailed
from ._layouts import _options_for, layout_options
from .main import ExitCode, UsageError

if TYPE_CHECKING:
    from ..layout import KVLayout
    from ..storage import BlockStore

__all__ = ["Backend", "StoreLocation", "index_damaged_message", "missing_store", "open_cli_store", "parse_store",
           "report_index_rebuild", "store_errors", "store_url"]


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
