"""URLs to stores: which backend a URL names, and the stores :func:`open_store` and
:func:`open_chain` open for them (the ``urls`` layer, above the backends and wrappers).

:func:`resolve` is the one answer to "which backend is this URL?", for :func:`open_store`,
:func:`open_chain` and the CLI's ``--store`` alike:

=====================================  =================================================
``lmdb:///abs/path``                   :class:`LmdbStore` in that directory
``zarr:///abs/path``                   :class:`ZarrStore` in that directory
``zarr+s3://bucket/prefix?...``        :class:`ZarrStore` in the bucket
a plain path                           a Zarr directory (``zarr.json`` at its root) opens
                                       as :class:`ZarrStore`; anything else (an LMDB
                                       store, an empty or missing directory) as
                                       :class:`LmdbStore`
=====================================  =================================================

A relative path, plain or after ``lmdb://`` / ``zarr://``, is resolved against the working
directory, and a leading ``~`` is the user's home. The Zarr-directory rule exists so that a
path to a Zarr store never gets an LMDB store created inside it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .api import BlockStore
from .format.writer import StoreWriter

if TYPE_CHECKING:
    from .chain.store import StoreChain

__all__ = ["LOCAL_BACKENDS", "OBJECT_STORE_BACKENDS", "ZARR_MARKER", "StoreSpec", "StoreTarget", "backend",
           "open_chain", "open_store", "resolve"]

_PACKAGE = __name__.rpartition(".")[0]

#: URL scheme -> (module, class) of its backend: local paths (``scheme:///abs/path``) and
#: object stores (``scheme://bucket/prefix?...``); ``tiered_kv.storage.SCHEMES`` and
#: ``OBJECT_STORE_SCHEMES`` are these with the classes imported.
LOCAL_BACKENDS = {"lmdb": ("lmdb", "LmdbStore"), "zarr": ("zarr", "ZarrStore")}
OBJECT_STORE_BACKENDS = {"zarr+s3": ("zarr", "ZarrStore")}


#: The object at the root of every Zarr store: a plain path holding it is a Zarr directory.
ZARR_MARKER = "zarr.json"


def backend(where: tuple[str, str]) -> type[BlockStore]:
    """The backend class of a table entry (its module imported now)."""
    module, name = where
    return getattr(importlib.import_module(f"{_PACKAGE}.{module}"), name)


@dataclasses.dataclass(frozen=True)
class StoreTarget:
    """Which backend a URL names and where (:func:`resolve`)."""

    #: the backend's URL scheme: a key of :data:`LOCAL_BACKENDS` or :data:`OBJECT_STORE_BACKENDS`
    scheme: str
    #: a local store's absolute directory; an object store's URL as given
    location: str

    @property
    def remote(self) -> bool:
        """An object store (no local directory)."""
        return self.scheme in OBJECT_STORE_BACKENDS

    @property
    def url(self) -> str:
        """The canonical URL (``lmdb:///abs/path``; an object store's as given)."""
        return self.location if self.remote else f"{self.scheme}://{self.location}"

    def backend(self) -> type[BlockStore]:
        """The backend class (its module imported now)."""
        return backend((OBJECT_STORE_BACKENDS if self.remote else LOCAL_BACKENDS)[self.scheme])


def resolve(url: str | os.PathLike[str]) -> StoreTarget:
    """The backend ``url`` names and where (the table in the module docstring).

    ValueError for an empty URL or an unknown scheme; TypeError for what is not a str or
    path. Nothing is opened (a plain path's directory is only looked into for
    ``zarr.json``)."""
    s = os.fspath(url)
    if not isinstance(s, str):
        raise TypeError(f"url: expected a str or path, got {type(url).__name__}")
    if not s:
        raise ValueError(f"url: expected {_accepted()} or a plain path, got ''")
    if "://" not in s:
        path = _local_path(s)
        return StoreTarget("zarr" if os.path.isfile(os.path.join(path, ZARR_MARKER)) else "lmdb", path)
    scheme, _, rest = s.partition("://")
    if scheme in OBJECT_STORE_BACKENDS:
        return StoreTarget(scheme, s)
    if scheme not in LOCAL_BACKENDS:
        raise ValueError(f"url: expected {_accepted()} or a plain path, got scheme {scheme!r} in "
                         f"{s.split('?', 1)[0]!r}")
    if not rest:
        raise ValueError(f"url: expected a path after {scheme}://, e.g. {scheme}:///var/cache/kv")
    return StoreTarget(scheme, _local_path(rest))


def _accepted() -> str:
    return ", ".join([f"{name}:///abs/path" for name in LOCAL_BACKENDS]
                     + [f"{name}://bucket/prefix?endpoint=URL" for name in OBJECT_STORE_BACKENDS])


def _local_path(text: str) -> str:
    """``text`` as an absolute path (``~`` expanded, relative to the working directory)."""
    return os.path.abspath(os.path.expanduser(text))


StoreSpec = str | os.PathLike[str] | BlockStore


def open_store(url: StoreSpec | Sequence[StoreSpec], *, layout_fingerprint: str | None,
               writer: StoreWriter | None = None, migrate: bool = False, **options: Any) -> BlockStore:
    """Open (creating if needed) the block store at ``url``.

    ``lmdb:///abs/path`` -> :class:`LmdbStore`, ``zarr:///abs/path`` -> :class:`ZarrStore`,
    a plain path -> :class:`ZarrStore` where it holds a Zarr store (``zarr.json``), else
    :class:`LmdbStore` (see :func:`resolve`), ``zarr+s3://bucket/prefix?endpoint=...`` ->
    :class:`ZarrStore` in the bucket (credentials from ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` or the ``access_key_id`` / ``secret_access_key`` options).
    ``options`` go to the backend (e.g. ``max_bytes``, ``timeout_s``), except
    ``encryption``: an :class:`EncryptionConfig` or its dict (``{"key_files": [current,
    older...], "tenant": "..."}``) seals every record under the tenant's key and names it
    by a keyed name (:class:`EncryptedStore` around the backend; see docs/shared-store.md).
    A level created so records that it is sealed, and opening it for writing without
    ``encryption`` raises :class:`EncryptedLevelError`; ``migrate=True`` (with
    ``encryption``) opens a level sealed by an earlier version, with unkeyed names, for
    ``rekey`` to migrate (otherwise EncryptedLevelError names that command). An unknown
    option is a :class:`TypeError` that lists the backend's. ``timeout_s`` bounds calls to
    an object store; a local store (LMDB, a Zarr directory) makes none and accepts it
    without effect, so one set of options serves a local store and a chain alike.

    ``layout_fingerprint``: the layout the records are written in; the store is created
    with it, and an existing store of another raises :class:`LayoutMismatchError`. None:
    a *maintenance open* of an existing store (missing: FileNotFoundError), bound to the
    fingerprint it holds; reading, ``stats``, ``verify``, ``gc`` and ``delete`` work,
    ``put_many`` raises :class:`StoreError` (a writer must know its layout).
    ``writer``: who writes, recorded when the store is created (:class:`StoreWriter`;
    ``stats()["writer"]`` shows it).

    A list (nearest first) opens a :class:`StoreChain` (see :func:`open_chain`).
    """
    if writer is not None:
        options["writer"] = writer
    if isinstance(url, (list, tuple)):
        return open_chain(url, layout_fingerprint=layout_fingerprint, **options)
    if isinstance(url, BlockStore):
        raise TypeError("url: expected a URL or path (an open BlockStore is used as it is)")
    if "sealed" in options:
        raise TypeError("sealed: set by the encryption option (a sealed level is opened with its keys)")
    encryption = options.pop("encryption", None)
    if encryption is not None:
        from .encrypted.crypto import EncryptionConfig, Keyring
        from .encrypted.store import EncryptedStore

        keyring = Keyring(EncryptionConfig.parse(encryption))  # checked before anything is created
        if options.get("writer") is not None:  # (an encrypted level records no hash of its tenant)
            options["writer"] = dataclasses.replace(options["writer"], tenant_sha256=None)
        inner = _open_backend(url, layout_fingerprint, {**options, "sealed": True})
        try:
            return EncryptedStore(inner, keyring, migrate=migrate)
        except BaseException:
            inner.close()
            raise
    if migrate:
        raise ValueError("migrate: expected with encryption (it opens a sealed level of an earlier version)")
    return _open_backend(url, layout_fingerprint, options)


def _open_backend(url: StoreSpec, layout_fingerprint: str | None, options: dict[str, Any]) -> BlockStore:
    """The backend :func:`resolve` names for ``url`` (a str or path), opened."""
    target = resolve(url)  # type: ignore[arg-type]  (an open BlockStore was refused before)
    if target.remote:
        return target.backend()(target.location, layout_fingerprint=layout_fingerprint, **options)
    return _open_local(target.backend(), target.location, layout_fingerprint, options)


#: options that bound calls to an object store: accepted by a local store, without effect
_REMOTE_ONLY_OPTIONS = ("timeout_s",)


def _open_local(backend: type[BlockStore], path: str, layout_fingerprint: str | None,
                options: dict[str, Any]) -> BlockStore:
    """``backend(path, ...)`` for a local store, its options checked by name first."""
    options = dict(options)
    for name in _REMOTE_ONLY_OPTIONS:
        value = options.pop(name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < math.inf):
            raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
    params = inspect.signature(backend).parameters
    valid = sorted(n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
                   and n != "layout_fingerprint")
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"{backend.__name__} at {path}: unknown option(s) {unknown}; expected some of "
                        f"{sorted([*valid, *_REMOTE_ONLY_OPTIONS, 'encryption'])}")
    return backend(path, layout_fingerprint=layout_fingerprint, **options)


def open_chain(levels: Sequence[StoreSpec], *, layout_fingerprint: str | None,
               level_options: Sequence[dict[str, Any] | None] | None = None, writer: StoreWriter | None = None,
               **chain_options: Any) -> StoreChain:
    """Open a :class:`StoreChain` over ``levels`` (nearest first): URLs / paths, or open
    stores (used as they are and not closed by the chain).

    ``layout_fingerprint`` and ``writer`` as in :func:`open_store`, for every level opened
    here (None: a maintenance open of every level, none of them created).

    ``level_options[i]``: options of level ``i``'s :func:`open_store`; an object-store level
    gets ``timeout_s`` = the chain's unless given. ``encryption`` among ``chain_options``
    applies to every level opened from a URL whose options do not set their own
    (``"encryption": None`` there keeps that level plain). ``chain_options``: :class:`StoreChain`'s
    (``timeout_s``, ``max_pending_uploads``, ``backoff_max_s``...). Level 0 must open;
    a farther level that cannot be reached now (a ``ConnectionError``, e.g.
    :class:`~tiered_kv.storage.s3.ObjectStoreUnavailable`) is opened later in the background,
    while wrong credentials, a missing bucket or another layout raise here.
    """
    from .chain.store import DEFAULT_TIMEOUT_S, DeferredLevel, StoreChain

    levels = list(levels)
    if not levels:
        raise ValueError("levels: expected at least one store URL")
    opts_list = [None] * len(levels) if level_options is None else list(level_options)
    if len(opts_list) != len(levels):
        raise ValueError(f"level_options: expected one dict (or None) per level ({len(levels)}), "
                         f"got {len(opts_list)}")
    timeout_s = chain_options.get("timeout_s", DEFAULT_TIMEOUT_S)
    encryption = chain_options.pop("encryption", None)
    opened: list[BlockStore | DeferredLevel] = []
    owned: list[bool] = []
    try:
        for i, (spec, opts) in enumerate(zip(levels, opts_list)):
            if opts is not None and not isinstance(opts, dict):
                raise TypeError(f"level_options[{i}]: expected a dict or None, got {type(opts).__name__}")
            if isinstance(spec, BlockStore):
                if opts:
                    raise ValueError(f"level_options[{i}]: expected none for an open store")
                opened.append(spec)
                owned.append(False)
                continue
            if isinstance(spec, (list, tuple)):
                raise TypeError(f"levels[{i}]: expected a URL, path or open store, got a nested list")
            url = os.fspath(spec)
            kwargs = dict(opts or {})
            if encryption is not None and "encryption" not in kwargs:
                kwargs["encryption"] = encryption
            if resolve(url).remote:
                kwargs.setdefault("timeout_s", timeout_s)
            opener = functools.partial(open_store, url, layout_fingerprint=layout_fingerprint, writer=writer,
                                       **kwargs)
            owned.append(True)
            if i == 0:
                opened.append(opener())
                continue
            try:
                opened.append(opener())
            except ConnectionError as e:  # unreachable now: the chain opens it when it answers
                opened.append(DeferredLevel(where=url.split("?", 1)[0], opener=opener, error=str(e)))
        return StoreChain(opened, owned=owned, **chain_options)
    except BaseException:
        for store, own in zip(opened, owned):
            if own and isinstance(store, BlockStore):
                store.close()
        raise
