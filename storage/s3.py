"""Object-store access for records on an S3-compatible store (AWS S3, SeaweedFS, MinIO...).

The plumbing the Zarr backend uses when its group lives in a bucket: parse a store URL,
open an :class:`obstore.store.S3Store` with bounded timeouts, and the five operations a
content-addressed, write-once record store needs::

    loc = parse_s3_url("zarr+s3://kv-cache/deepseek?endpoint=http://127.0.0.1:8333")
    store = open_object_store(loc, timeout_s=5.0)
    put_create_only(store, "blocks/ab/cdef...", record_bytes)   # True: written, False: exists
    get_into(store, "blocks/ab/cdef...", pinned_uint8)          # bytes read, or None if absent
    exists(store, key); delete(store, key); list_keys(store, "blocks/")

and, for the Zarr backend's records: :func:`stat` (one HEAD: size and last-modified time),
:func:`list_objects` (the same for every key under a prefix), :func:`get_bytes` (a whole
object), :func:`get_parts_into` (an object scattered into several buffers, e.g. a
record's header, the caller's payload buffer and the checksum) and :func:`get_stream`
(an object's bytes as they arrive, e.g. to decrypt each chunk straight into place).

URL: ``zarr+s3://BUCKET[/PREFIX][?endpoint=URL&region=R&allow_http=true&OPTION=VALUE...]``
(``s3://`` is accepted too). Each setting comes from, first to last: a keyword of
:func:`parse_s3_url`, the URL's query, the standard AWS environment variable:

==============  ==========================================================
endpoint        ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` (none: AWS's regional endpoint)
region          ``AWS_REGION``, ``AWS_DEFAULT_REGION`` (default ``us-east-1``)
credentials     ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` [+ ``AWS_SESSION_TOKEN``];
                keywords ``access_key_id`` / ``secret_access_key`` / ``session_token``.
                Never in the URL: URLs end up in logs.
allow_http      default: true only for a loopback endpoint (127.0.0.0/8, ::1, localhost)
==============  ==========================================================

Requests are path-style (``endpoint/bucket/key``), which SeaweedFS and MinIO need.
Credentials reach obstore through a credential callback, so obstore's own reading of the
environment cannot mix in a stray ``AWS_SESSION_TOKEN``, and the secret never appears in
``store.config`` or any ``repr``.

Failures (STYLE §5): an absent object is ``None`` / ``False``; bad input is a
``ValueError`` / ``TypeError``; the store failing raises a subclass of
:class:`ObjectStoreError` (a :class:`~tiered_kv.storage.errors.StoreError`):

- :class:`ObjectStoreUnavailable` (also a ``ConnectionError``): endpoint unreachable,
  timed out, connection dropped, or HTTP 5xx. Transient: a cache counts these and backs off.
- :class:`ObjectStoreAuthError` (also a ``PermissionError``): credentials missing or
  rejected; the message names the environment variables.
- :class:`BucketNotFoundError`: the bucket does not exist.
- :class:`ObjectStoreError` itself: anything else the store refused.

Write-once: :func:`put_create_only` is a single-part conditional PUT (``If-None-Match: *``).
Stores that implement it (AWS S3 since 2024-08, MinIO; SeaweedFS 4.48 checked by
tests/test_s3_backend.py) let exactly one of any number of racing writers of a key
succeed; the others get ``False``. SeaweedFS serializes racing conditional PUTs of one key
with a lock its waiters poll about once a second: under contention a put can take
seconds, and with a short ``timeout_s`` a loser may see :class:`ObjectStoreUnavailable`
instead of ``False`` (the object is then written, by someone).
"""

from __future__ import annotations

import enum
import ipaddress
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

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

from .errors import StoreError
from .format.record import as_byte_array

if TYPE_CHECKING:
    from obstore.store import S3Credential

__all__ = [
    "CREDENTIAL_ENV_VARS",
    "SCHEMES",
    "BucketNotFoundError",
    "ObjectInfo",
    "ObjectStoreAuthError",
    "ObjectStoreError",
    "ObjectStoreUnavailable",
    "S3Credentials",
    "S3Location",
    "delete",
    "exists",
    "get_bytes",
    "get_into",
    "get_parts_into",
    "get_stream",
    "list_keys",
    "list_objects",
    "open_object_store",
    "parse_s3_url",
    "put_create_only",
    "stat",
]

#: URL schemes :func:`parse_s3_url` accepts.
SCHEMES = ("zarr+s3", "s3")
#: The environment variables credentials are read from, named in error messages.
CREDENTIAL_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
DEFAULT_REGION = "us-east-1"

# Options a URL query or keyword may set, besides endpoint / region / allow_http and the
# credentials: obstore S3Config keys that carry no secret, with the type they parse to.
_BOOL_OPTIONS = frozenset({
    "skip_signature", "virtual_hosted_style_request", "unsigned_payload", "disable_tagging",
    "s3_express", "request_payer",
})
_STR_OPTIONS = frozenset({
    "checksum_algorithm", "server_side_encryption", "sse_kms_key_id", "conditional_put",
})
_SECRET_OPTIONS = frozenset({"access_key_id", "secret_access_key", "session_token", "token",
                             "sse_customer_key_base64"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


# ---------------------------------------------------------------------------- errors
class ObjectStoreError(StoreError):
    """The object store refused or failed an operation (not: the object is absent)."""

    def __init__(self, message: str, *, op: str = "", key: str | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.key = key


class ObjectStoreUnavailable(ObjectStoreError, ConnectionError):
    """The endpoint could not be reached in time: refused, timed out, dropped, or HTTP 5xx.

    Transient by nature: nothing was learned about the object. A cache counts these and
    backs off instead of treating them as misses of its own making.
    """


class ObjectStoreAuthError(ObjectStoreError, PermissionError):
    """Credentials are missing, or the store rejected them (or lacks a permission)."""


class BucketNotFoundError(ObjectStoreError):
    """The bucket does not exist on the endpoint."""


class _CredentialSource(enum.Enum):
    KEYWORD = "keyword arguments"
    ENVIRONMENT = "environment (" + ", ".join(CREDENTIAL_ENV_VARS) + ")"


# ------------------------------------------------------------------------ location
@dataclass(frozen=True, kw_only=True, slots=True)
class S3Credentials:
    """Static credentials. ``repr`` shows the last 4 characters of the key id only."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    source: _CredentialSource = _CredentialSource.ENVIRONMENT

    def __repr__(self) -> str:
        token = None if self.session_token is None else "***"
        return (f"S3Credentials(access_key_id={_mask(self.access_key_id)!r}, secret_access_key='***', "
                f"session_token={token!r}, source={self.source.name.lower()!r})")

    def as_obstore(self) -> S3Credential:
        return {"access_key_id": self.access_key_id, "secret_access_key": self.secret_access_key,
                "token": self.session_token, "expires_at": None}


@dataclass(frozen=True, kw_only=True, slots=True)
class S3Location:
    """Where a record store lives in an S3-compatible object store.

    ``prefix``: key prefix inside the bucket, without leading or trailing ``/`` (``""``:
    the bucket root). ``endpoint``: ``scheme://host[:port]``, ``None`` for AWS's regional
    endpoint. ``options``: further obstore ``S3Config`` settings (no secrets).
    ``credentials``: ``None`` only with ``options["skip_signature"]`` (anonymous).
    """

    bucket: str
    prefix: str
    endpoint: str | None
    region: str
    allow_http: bool
    options: Mapping[str, str | bool] = field(default_factory=lambda: MappingProxyType({}))
    credentials: S3Credentials | None = None

    def url(self) -> str:
        """The location as a ``zarr+s3://`` URL (never with credentials)."""
        query = []
        if self.endpoint is not None:
            query.append(f"endpoint={self.endpoint}")
        query.append(f"region={self.region}")
        if self.allow_http:
            query.append("allow_http=true")
        query += [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(self.options.items())]
        path = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return f"zarr+s3://{path}?{'&'.join(query)}"

    def __repr__(self) -> str:
        return (f"S3Location(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint={self.endpoint!r}, "
                f"region={self.region!r}, allow_http={self.allow_http}, options={dict(self.options)!r}, "
                f"credentials={self.credentials!r})")

    def __reduce__(self) -> Any:  # slots + frozen: pickle by keywords (processes open their own store)
        return (_rebuild_location, (self.bucket, self.prefix, self.endpoint, self.region, self.allow_http,
                                    dict(self.options), self.credentials))


def _rebuild_location(bucket: str, prefix: str, endpoint: str | None, region: str, allow_http: bool,
                      options: dict[str, str | bool], credentials: S3Credentials | None) -> S3Location:
    return S3Location(bucket=bucket, prefix=prefix, endpoint=endpoint, region=region, allow_http=allow_http,
                      options=MappingProxyType(options), credentials=credentials)


def _mask(value: str) -> str:
    return "***" + value[-4:] if len(value) > 8 else "***"


def parse_s3_url(url: str, *, env: Mapping[str, str] | None = None, **options: Any) -> S3Location:
    """Parse ``zarr+s3://bucket/prefix?endpoint=...&region=...&allow_http=true``.

    ``options`` override the URL and the environment: ``endpoint``, ``region``,
    ``allow_http``, ``access_key_id``, ``secret_access_key``, ``session_token``, and the
    obstore settings ``skip_signature``, ``virtual_hosted_style_request``,
    ``unsigned_payload``, ``disable_tagging``, ``s3_express``, ``request_payer``,
    ``checksum_algorithm``, ``server_side_encryption``, ``sse_kms_key_id``,
    ``conditional_put``. ``env`` defaults to ``os.environ``.

    Raises ``ValueError`` for a malformed URL or option and :class:`ObjectStoreAuthError`
    when no credentials are found (unless ``skip_signature=true``).
    """
    if not isinstance(url, str):
        raise TypeError(f"url: expected a str, got {type(url).__name__}")
    environ: Mapping[str, str] = os.environ if env is None else env
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"url: expected scheme {' or '.join(s + '://' for s in SCHEMES)}, got {url!r}")
    bucket = parts.netloc
    if not bucket or "@" in bucket or ":" in bucket:
        raise ValueError(f"url: expected zarr+s3://BUCKET/PREFIX (no user, password or port in the "
                         f"bucket part), got {_redact_query(url)!r}")
    _check_bucket(bucket)
    prefix = _clean_prefix(parts.path)
    if parts.fragment:
        raise ValueError(f"url: expected no #fragment, got {_redact_query(url)!r}")

    query: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ValueError(f"url: expected a query of NAME=VALUE pairs joined by '&', got {parts.query!r}") from None
    for k, v in pairs:
        if k in _SECRET_OPTIONS:
            raise ValueError(f"url: credentials do not go into URLs (they end up in logs): got {k}=...; "
                             f"set {', '.join(CREDENTIAL_ENV_VARS)} or pass {k}= as a keyword")
        if k in query:
            raise ValueError(f"url: option {k!r} given twice")
        query[k] = v
    unknown = set(query) - {"endpoint", "region", "allow_http"} - _BOOL_OPTIONS - _STR_OPTIONS
    unknown |= set(options) - {"endpoint", "region", "allow_http"} - _BOOL_OPTIONS - _STR_OPTIONS \
        - {"access_key_id", "secret_access_key", "session_token"}
    if unknown:
        known = sorted({"endpoint", "region", "allow_http"} | _BOOL_OPTIONS | _STR_OPTIONS)
        raise ValueError(f"unknown option(s) {sorted(unknown)}; expected some of {known}")

    def pick(name: str, *env_vars: str) -> Any:
        if options.get(name) is not None:
            return options[name]
        if name in query:
            return query[name]
        for var in env_vars:
            if environ.get(var):
                return environ[var]
        return None

    endpoint = pick("endpoint", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    endpoint = None if endpoint is None else _check_endpoint(str(endpoint))
    region = str(pick("region", "AWS_REGION", "AWS_DEFAULT_REGION") or DEFAULT_REGION)
    loopback = endpoint is not None and _is_loopback(urlsplit(endpoint).hostname or "")
    allow_raw = pick("allow_http")
    allow_http = loopback if allow_raw is None else _parse_bool("allow_http", allow_raw)
    if endpoint is not None and endpoint.startswith("http://") and not allow_http:
        raise ValueError(f"endpoint: {endpoint} is plain http to a non-loopback host (data and request "
                         f"signatures in clear text); use https, or pass allow_http=true to accept it")

    extra: dict[str, str | bool] = {}
    for name in sorted(_BOOL_OPTIONS | _STR_OPTIONS):
        value = pick(name)
        if value is None:
            continue
        extra[name] = _parse_bool(name, value) if name in _BOOL_OPTIONS else str(value)

    credentials = None if extra.get("skip_signature") else _resolve_credentials(options, environ)
    return S3Location(bucket=bucket, prefix=prefix, endpoint=endpoint, region=region, allow_http=allow_http,
                      options=MappingProxyType(extra), credentials=credentials)


def _resolve_credentials(options: Mapping[str, Any], environ: Mapping[str, str]) -> S3Credentials:
    key, secret = options.get("access_key_id"), options.get("secret_access_key")
    if key is not None or secret is not None:
        if not key or not secret:
            raise ValueError("access_key_id and secret_access_key: expected both as keywords, got only "
                             + ("access_key_id" if key else "secret_access_key"))
        return S3Credentials(access_key_id=str(key), secret_access_key=str(secret),
                             session_token=options.get("session_token") or None,
                             source=_CredentialSource.KEYWORD)
    key, secret = environ.get("AWS_ACCESS_KEY_ID"), environ.get("AWS_SECRET_ACCESS_KEY")
    if key and secret:
        return S3Credentials(access_key_id=key, secret_access_key=secret,
                             session_token=options.get("session_token") or environ.get("AWS_SESSION_TOKEN") or None,
                             source=_CredentialSource.ENVIRONMENT)
    missing = [v for v, x in (("AWS_ACCESS_KEY_ID", key), ("AWS_SECRET_ACCESS_KEY", secret)) if not x]
    raise ObjectStoreAuthError(
        f"no S3 credentials: {' and '.join(missing)} not set. Set AWS_ACCESS_KEY_ID and "
        f"AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials), pass "
        f"access_key_id= / secret_access_key= keywords, or skip_signature=true for a public bucket",
        op="open")


def _check_bucket(bucket: str) -> None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket):
        raise ValueError(f"bucket: expected 3-63 characters of a-z, 0-9, '.', '-' starting and ending "
                         f"with a letter or digit, got {bucket!r}")


def _clean_prefix(path: str) -> str:
    prefix = path.strip("/")
    if not prefix:
        return ""
    segments = prefix.split("/")
    if any(s in ("", ".", "..") for s in segments):
        raise ValueError(f"url: expected a prefix of non-empty path segments without '.' or '..', "
                         f"got {path!r}")
    return prefix


def _check_endpoint(endpoint: str) -> str:
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.username or parts.password:
        raise ValueError(f"endpoint: expected http[s]://host[:port] (path-style requests add the "
                         f"bucket), got {endpoint!r}")
    return f"{parts.scheme}://{parts.netloc}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parse_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"{name}: expected true or false, got {value!r}")


def _redact_query(url: str) -> str:
    return url.split("?", 1)[0]


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
