"""Which objects a ZarrStore's target names: a local directory (a path, ``file://`` URL or
``zarr.storage.LocalStore``), an S3-compatible bucket prefix (a ``zarr+s3://`` URL, an
:class:`~tiered_kv.storage.s3.S3Location`, an obstore ``S3Store`` or a zarr ``ObjectStore``
over one), or any other zarr Store."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .bucket import _s3, s3_objects
from .generic import ZarrApiObjects
from .local import LocalObjects
from .objects import IoPool, Objects

__all__ = ["local_dir", "make_objects", "object_store"]


def make_objects(url_or_path: Any, stale_partial_s: float, io: IoPool,
                  s3_options: dict[str, Any]) -> Objects:
    objects = object_store(url_or_path, s3_options)
    if objects is not None:
        return objects
    if s3_options:
        raise ValueError(f"options {sorted(s3_options)}: expected only with an object store "
                         f"(zarr+s3:// URL, S3Location or S3Store), got {url_or_path!r}")
    if isinstance(url_or_path, (str, os.PathLike)):
        s = os.fspath(url_or_path)
        if "://" in s:
            scheme, _, rest = s.partition("://")
            if scheme != "file":
                raise ValueError(f"url_or_path: expected a local path, file:// URL or zarr+s3:// URL "
                                 f"(pass a zarr Store instance for other stores), got {s!r}")
            s = rest
        return LocalObjects(Path(os.path.abspath(s)), stale_partial_s=stale_partial_s, io=io)
    try:
        from zarr.abc.store import Store
        from zarr.storage import LocalStore
    except ImportError:  # pragma: no cover - zarr is a dependency
        raise TypeError("url_or_path: a zarr Store needs zarr installed") from None
    if isinstance(url_or_path, LocalStore):
        return LocalObjects(Path(url_or_path.root).absolute(), stale_partial_s=stale_partial_s, io=io)
    if isinstance(url_or_path, Store):
        return ZarrApiObjects(url_or_path)
    raise TypeError(f"url_or_path: expected a path, file:// URL or zarr Store, got "
                    f"{type(url_or_path).__name__}")

def object_store(target: Any, s3_options: dict[str, Any]) -> Objects | None:
    """The S3 objects of ``target`` if it names an S3 bucket prefix, else None."""
    if isinstance(target, str) and target.startswith("zarr+s3://"):
        return s3_objects(target, s3_options)
    if _s3 is None:
        return None
    if isinstance(target, _s3.S3Location | _s3.S3Store):
        return s3_objects(target, s3_options)
    inner = getattr(target, "store", None)  # zarr.storage.ObjectStore over an obstore store
    if isinstance(inner, _s3.S3Store) and type(target).__name__ == "ObjectStore":
        return s3_objects(inner, s3_options)
    return None


def local_dir(url_or_path: Any) -> Path | None:
    """The directory a local ``url_or_path`` (path or ``file://`` URL) names; None otherwise."""
    if not isinstance(url_or_path, (str, os.PathLike)):
        return None
    s = os.fspath(url_or_path)
    if "://" in s:
        scheme, _, rest = s.partition("://")
        if scheme != "file":
            return None
        s = rest
    return Path(os.path.abspath(s))
