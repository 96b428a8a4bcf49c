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

from obstore.store import S3Store  # the store the operations take (re-exported: isinstance checks)

from .client import (
    ObjectInfo,
    delete,
    exists,
    get_bytes,
    get_into,
    get_parts_into,
    get_stream,
    list_keys,
    list_objects,
    open_object_store,
    put_create_only,
    put_replace,
    stat,
)
from .location import (
    CREDENTIAL_ENV_VARS,
    SCHEMES,
    BucketNotFoundError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreUnavailable,
    S3Credentials,
    S3Location,
    parse_s3_url,
)

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
    "S3Store",
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
    "put_replace",
    "stat",
]
