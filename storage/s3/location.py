"""Where an S3 prefix is and how to reach it: ``zarr+s3://`` URLs parsed, credentials and
options resolved (keywords, then the URL's query, then the AWS environment variables),
and the errors of an object store. Imports no obstore: a URL is checked without it."""

from __future__ import annotations

import enum
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import StoreError

if TYPE_CHECKING:
    from obstore.store import S3Credential

__all__ = [
    "CREDENTIAL_ENV_VARS",
    "SCHEMES",
    "BucketNotFoundError",
    "ObjectStoreAuthError",
    "ObjectStoreError",
    "ObjectStoreUnavailable",
    "S3Credentials",
    "S3Location",
    "parse_s3_url",
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
    query = _query_options(parts.query, options)

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


def _query_options(raw: str, options: Mapping[str, Any]) -> dict[str, str]:
    """The URL query's options (``raw``), checked: no credentials, none twice, and no
    option unknown there or among the keywords ``options``."""
    query: dict[str, str] = {}
    try:
        pairs = parse_qsl(raw, keep_blank_values=True, strict_parsing=bool(raw))
    except ValueError:
        raise ValueError(f"url: expected a query of NAME=VALUE pairs joined by '&', got {raw!r}") from None
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
    return query


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
