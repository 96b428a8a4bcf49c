"""Operations on an S3-compatible object store (obstore): open it with bounded timeouts,
create-only puts, reads into the caller's buffers, streams, listings, and the mapping of
obstore's failures onto :mod:`.location`'s errors (see the package docstring)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
    UnknownConfigurationKeyError,
)
from obstore.store import S3Store

from ..format.record import as_byte_array
from .location import (
    _SECRET_OPTIONS,
    CREDENTIAL_ENV_VARS,
    DEFAULT_REGION,
    BucketNotFoundError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreUnavailable,
    S3Credentials,
    S3Location,
)

if TYPE_CHECKING:
    from obstore.store import S3Credential

__all__ = [
    "ObjectInfo",
    "delete",
    "exists",
    "get_bytes",
    "get_into",
    "get_parts_into",
    "get_stream",
    "list_keys",
    "list_objects",
    "open_object_store",
    "put_create_only",
    "put_replace",
    "stat",
]


# ------------------------------------------------------------------------------ open
def open_object_store(location: S3Location, *, timeout_s: float = 5.0, max_retries: int = 2,
                      **overrides: Any) -> S3Store:
    """An :class:`obstore.store.S3Store` for ``location`` (keys are relative to its prefix).

    ``timeout_s`` bounds one attempt (connect and the whole request) and the window in
    which failed attempts are retried (up to ``max_retries`` times, only for connection
    errors, 5xx, and timeouts of reads), so an operation against a dead or hung endpoint
    raises :class:`ObjectStoreUnavailable` after about ``timeout_s`` (at most twice it).
    ``overrides``: obstore ``S3Config`` keys that replace the location's settings.
    """
    if not isinstance(location, S3Location):
        raise TypeError(f"location: expected an S3Location (see parse_s3_url), got {type(location).__name__}")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 3600):
        raise ValueError(f"timeout_s: expected a number of seconds in (0, 3600], got {timeout_s!r}")
    if not (isinstance(max_retries, int) and 0 <= max_retries <= 10):
        raise ValueError(f"max_retries: expected an int in [0, 10], got {max_retries!r}")
    secret = _SECRET_OPTIONS & set(overrides)
    if secret:
        raise ValueError(f"overrides: credentials go into the location (parse_s3_url keywords), got "
                         f"{sorted(secret)}")
    timeout = timedelta(seconds=timeout_s)
    config: dict[str, Any] = {"region": location.region, "virtual_hosted_style_request": False}
    if location.endpoint is not None:
        # Both keys: obstore prefers AWS_ENDPOINT_URL_S3 from the environment over `endpoint`.
        config["endpoint"] = config["aws_endpoint_url_s3"] = location.endpoint
    config.update(location.options)
    config.update(overrides)
    client_options: dict[str, Any] = {"connect_timeout": timeout, "timeout": timeout,
                                      "allow_http": location.allow_http}
    retry_config: dict[str, Any] = {
        "max_retries": max_retries, "retry_timeout": timeout,
        "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timeout, "base": 2},
    }
    creds = location.credentials
    if creds is None and not config.get("skip_signature"):
        raise ObjectStoreAuthError(f"{location.url()}: no credentials and skip_signature is not set; "
                                   f"set {', '.join(CREDENTIAL_ENV_VARS[:2])}", op="open")
    try:
        return S3Store(location.bucket, prefix=location.prefix or None, config=config,  # type: ignore[arg-type]
                       client_options=client_options, retry_config=retry_config,  # type: ignore[arg-type]
                       credential_provider=None if creds is None else _StaticCredentials(creds))
    except UnknownConfigurationKeyError as e:
        raise ValueError(f"overrides: unknown obstore S3Config key: {e}") from None


class _StaticCredentials:
    """obstore credential callback holding the secret (not visible in ``repr``)."""

    __slots__ = ("_creds",)

    def __init__(self, creds: S3Credentials) -> None:
        self._creds = creds

    def __call__(self) -> S3Credential:
        return self._creds.as_obstore()

    def __repr__(self) -> str:
        return f"_StaticCredentials({self._creds!r})"


# ------------------------------------------------------------------------ operations
def put_create_only(store: S3Store, key: str, data: Any) -> bool:
    """Write ``data`` at ``key`` unless an object is there: True if written, False if not.

    One conditional PUT (``If-None-Match: *``, never multipart), atomic on the store:
    of any number of concurrent writers of ``key`` exactly one gets True and the object
    holds exactly its bytes. ``data``: bytes-like, numpy array or CPU torch tensor,
    C-contiguous (its raw bytes are written).
    """
    _check_key(key)
    payload = as_byte_array(data, name="data")
    try:
        obstore.put(store, key, payload, mode="create", use_multipart=False)
    except (AlreadyExistsError, PreconditionError):
        return False
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="put", key=key) from e
    return True


def put_replace(store: S3Store, key: str, data: Any) -> None:
    """Write ``data`` at ``key``, replacing what is there (one PUT, never multipart): only
    for ``zarr.json`` (a store's attributes change), never for a record."""
    _check_key(key)
    payload = as_byte_array(data, name="data")
    try:
        obstore.put(store, key, payload, mode="overwrite", use_multipart=False)
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="put", key=key) from e


def _get(store: S3Store, key: str) -> Any:
    """Start a GET of ``key`` (an ``obstore.GetResult``), or None if there is no such
    object; a missing bucket and other failures raise their mapped errors."""
    try:
        return obstore.get(store, key)
    except FileNotFoundError as e:
        if "NoSuchBucket" in str(e):
            raise _bucket_missing(store, "get", key) from e
        return None
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="get", key=key) from e


def get_into(store: S3Store, key: str, out: Any) -> int | None:
    """Read the object at ``key`` into ``out``; its size in bytes, or None if absent.

    ``out``: writable bytearray, memoryview, numpy array or CPU torch tensor, C-contiguous,
    at least as large as the object (else ``ValueError``; ``out`` untouched). Bytes past
    the object's size are left as they were. If the transfer fails part-way, ``out``'s
    contents are unspecified.
    """
    _check_key(key)
    dest = as_byte_array(out, writable=True, name="out")
    result = _get(store, key)
    if result is None:
        return None
    size = int(result.meta["size"])
    if size > dest.nbytes:
        raise ValueError(f"out: expected at least {size} bytes for object {key!r}, got {dest.nbytes}")
    pos = 0
    try:
        for chunk in result.stream(min_chunk_size=1 << 20):
            n = len(chunk)
            if pos + n > size:
                raise ObjectStoreError(f"get {key!r}: the store sent more than the {size} bytes it announced",
                                       op="get", key=key)
            dest[pos:pos + n] = np.frombuffer(chunk, dtype=np.uint8)
            pos += n
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="get", key=key) from e
    if pos != size:
        raise ObjectStoreUnavailable(f"get {key!r}: transfer ended after {pos} of {size} bytes",
                                     op="get", key=key)
    return size


def get_bytes(store: S3Store, key: str) -> memoryview | None:
    """The whole object at ``key`` (a read-only buffer), or None if absent."""
    _check_key(key)
    result = _get(store, key)
    if result is None:
        return None
    try:
        data = result.bytes()
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="get", key=key) from e
    size = int(result.meta["size"])
    if len(data) != size:
        raise ObjectStoreUnavailable(f"get {key!r}: transfer ended after {len(data)} of {size} bytes",
                                     op="get", key=key)
    return memoryview(data)


def get_stream(store: S3Store, key: str) -> tuple[int, Iterator[np.ndarray]] | None:
    """Start reading the object at ``key``: its size and its bytes as they arrive, in
    order (1-D uint8 views, at most about 1 MiB apiece), or None if absent.

    The chunks add up to exactly the size announced: a transfer that ends short or runs
    long raises (:class:`ObjectStoreUnavailable`, :class:`ObjectStoreError`) from the
    iterator, as do failures of the store. Closing the iterator early drops the rest of
    the response."""
    _check_key(key)
    result = _get(store, key)
    if result is None:
        return None
    size = int(result.meta["size"])

    def chunks() -> Iterator[np.ndarray]:
        got = 0
        try:
            for chunk in result.stream(min_chunk_size=1 << 20):
                src = np.frombuffer(chunk, dtype=np.uint8)
                if got + src.nbytes > size:
                    raise ObjectStoreError(f"get {key!r}: the store sent more than the {size} bytes it announced",
                                           op="get", key=key)
                got += src.nbytes
                yield src
        except (BaseError, OSError) as e:
            raise _translate(e, store, op="get", key=key) from e
        if got != size:
            raise ObjectStoreUnavailable(f"get {key!r}: transfer ended after {got} of {size} bytes",
                                         op="get", key=key)

    return size, chunks()


def get_parts_into(store: S3Store, key: str, outs: Sequence[Any]) -> int | None:
    """Read the object at ``key`` into ``outs`` back to back; its size, or None if absent.

    ``outs``: writable C-contiguous buffers (bytearray, numpy, CPU torch tensor...). They
    are filled only when the object's size equals their total size; otherwise nothing is
    read (the response is dropped) and the object's size is returned, so the caller can
    tell "another size" from "absent". If the transfer fails part-way, the contents of
    ``outs`` are unspecified.
    """
    dests = [as_byte_array(o, writable=True, name=f"outs[{i}]") for i, o in enumerate(outs)]
    total = sum(d.nbytes for d in dests)
    started = get_stream(store, key)
    if started is None:
        return None
    size, chunks = started
    if size != total:
        chunks.close()
        return size
    views = [d for d in dests if d.nbytes]
    pos = 0  # offset in views[0]
    for src in chunks:
        while src.nbytes:
            dst = views[0]
            n = min(src.nbytes, dst.nbytes - pos)
            dst[pos:pos + n] = src[:n]
            src = src[n:]
            pos += n
            if pos == dst.nbytes:
                views.pop(0)
                pos = 0
    return size


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a HEAD or a listing says about one object."""

    key: str
    size: int
    #: last-modified time, ns since the epoch (the store's clock; S3: second or ms resolution)
    last_modified_ns: int


def _info(meta: Any) -> ObjectInfo:
    lm = meta.get("last_modified")
    ns = 0 if lm is None else int(lm.timestamp()) * 1_000_000_000 + lm.microsecond * 1000
    return ObjectInfo(key=meta["path"], size=int(meta["size"]), last_modified_ns=ns)


def stat(store: S3Store, key: str) -> ObjectInfo | None:
    """Size and last-modified time of the object at ``key`` (one HEAD), or None if absent."""
    _check_key(key)
    try:
        meta = obstore.head(store, key)
    except FileNotFoundError:
        return None
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="head", key=key) from e
    return _info(meta)


def list_objects(store: S3Store, prefix: str = "") -> Iterator[ObjectInfo]:
    """:class:`ObjectInfo` of every object under ``prefix``, lazily (see :func:`list_keys`)."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    try:
        for batch in obstore.list(store, prefix.strip("/") or None, chunk_size=1000):
            for meta in batch:
                yield _info(meta)
    except FileNotFoundError as e:
        if "NoSuchBucket" in str(e):
            raise _bucket_missing(store, "list", prefix) from e
        return
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="list", key=prefix) from e


def exists(store: S3Store, key: str) -> bool:
    """Whether an object is at ``key`` (one HEAD request)."""
    _check_key(key)
    try:
        obstore.head(store, key)
    except FileNotFoundError:
        return False
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="head", key=key) from e
    return True


def delete(store: S3Store, key: str) -> None:
    """Delete the object at ``key``; deleting an absent key is not an error (S3 semantics)."""
    _check_key(key)
    try:
        obstore.delete(store, key)
    except FileNotFoundError:
        return
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="delete", key=key) from e


def list_keys(store: S3Store, prefix: str = "") -> Iterator[str]:
    """Keys under ``prefix`` (relative to the store's prefix), lazily, in the store's order.

    Prefixes match whole path segments: ``"blocks/ab"`` lists ``blocks/ab/...`` but not
    ``blocks/abc/...``. Errors surface while iterating.
    """
    if not isinstance(prefix, str):
        raise TypeError(f"prefix: expected a str, got {type(prefix).__name__}")
    try:
        for batch in obstore.list(store, prefix.strip("/") or None, chunk_size=1000):
            for meta in batch:
                yield meta["path"]
    except FileNotFoundError as e:
        if "NoSuchBucket" in str(e):
            raise _bucket_missing(store, "list", prefix) from e
        return
    except (BaseError, OSError) as e:
        raise _translate(e, store, op="list", key=prefix) from e


def _check_key(key: object) -> None:
    if not isinstance(key, str):
        raise TypeError(f"key: expected a str, got {type(key).__name__}")
    if not key or key.startswith("/") or key.endswith("/") or any(s in ("", ".", "..") for s in key.split("/")):
        raise ValueError(f"key: expected a relative path of non-empty segments without '.' or '..', got {key!r}")


# ------------------------------------------------------------------ error mapping
# obstore reports the HTTP failure only in its message text ("Debug source" part):
#   HttpError { kind: Connect | Timeout | Request | Interrupted | Decode | Unknown, ... }
#   Server returned non-2xx status code: 503 Service Unavailable: <xml...<Code>X</Code>...>
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_S3_CODE = re.compile(r"<Code>([^<]{1,64})</Code>")
_TRANSIENT_KINDS = frozenset({"Connect", "Timeout", "Request", "Interrupted", "Decode"})


def _where(store: S3Store) -> str:
    cfg = store.config
    endpoint = cfg.get("endpoint") or f"AWS S3 ({cfg.get('region', DEFAULT_REGION)})"
    prefix = f"/{store.prefix}" if store.prefix else ""
    return f"{endpoint} bucket {cfg.get('bucket')}{prefix}"


def _bucket_missing(store: S3Store, op: str, key: str) -> BucketNotFoundError:
    return BucketNotFoundError(f"{op} {key!r}: bucket {store.config.get('bucket')!r} does not exist at "
                               f"{_where(store)}; create it first", op=op, key=key)


def _translate(e: BaseException, store: S3Store, *, op: str, key: str) -> ObjectStoreError:
    text = str(e)
    head = text.split("\n\nDebug source:", 1)[0]
    head = head if len(head) <= 600 else head[:600] + "..."
    code_m = _S3_CODE.search(text)
    code = code_m.group(1) if code_m else None
    status_m = _STATUS.search(text)
    status = int(status_m.group(1)) if status_m else None
    kind_m = _HTTP_KIND.search(text)
    where = _where(store)
    if isinstance(e, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403):
        return ObjectStoreAuthError(
            f"{op} {key!r} at {where}: the store rejected the request ({code or status}); check the "
            f"credentials in {', '.join(CREDENTIAL_ENV_VARS)} (or the access_key_id / secret_access_key "
            f"keywords) and that this identity may {op} in the bucket", op=op, key=key)
    if code == "NoSuchBucket":
        return _bucket_missing(store, op, key)
    if (kind_m is not None and kind_m.group(1) in _TRANSIENT_KINDS) or (status is not None and status >= 500) \
            or isinstance(e, (ConnectionError, TimeoutError)):
        what = kind_m.group(1).lower() if kind_m else f"HTTP {status}" if status else type(e).__name__
        return ObjectStoreUnavailable(f"{op} {key!r}: object store {where} unavailable ({what}): {head}",
                                      op=op, key=key)
    return ObjectStoreError(f"{op} {key!r} at {where} failed: {head}", op=op, key=key)
