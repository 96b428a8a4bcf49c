"""The S3 access layer (``tiered_kv.storage.s3``) against a real SeaweedFS.

Tests marked ``s3`` use the session ``seaweedfs`` server (tests/seaweedfs.py), one bucket,
and a fresh key prefix per test; they are skipped only where the ``weed`` binary cannot
run. The URL / credential parsing tests need no server.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import time
import uuid
from typing import Any

import numpy as np
import pytest

pytest.importorskip("obstore", reason="obstore is not installed (pip install obstore)")

from seaweedfs import SeaweedFS  # noqa: E402  (the session fixture comes from conftest's pytest_plugins)
from tiered_kv.storage.errors import StoreError  # noqa: E402
from tiered_kv.storage.s3 import (  # noqa: E402
    BucketNotFoundError,
    ObjectStoreAuthError,
    ObjectStoreError,
    ObjectStoreUnavailable,
    S3Location,
    delete,
    exists,
    get_into,
    list_keys,
    open_object_store,
    parse_s3_url,
    put_create_only,
)

BUCKET = "tkv-test"
TIMEOUT_S = 2.0
SECRET = "s3cr3t-value-never-printed"
ENV = {"AWS_ACCESS_KEY_ID": "AKIDENVIRONMENT1", "AWS_SECRET_ACCESS_KEY": SECRET}


def payload(seed: int | tuple[int, ...], nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


# ----------------------------------------------------------------- no server needed
def test_parse_url_fields_and_defaults():
    loc = parse_s3_url("zarr+s3://kv-cache/models/v4/?endpoint=http://127.0.0.1:8333&region=eu-west-1",
                       env=ENV)
    assert (loc.bucket, loc.prefix, loc.endpoint, loc.region) == ("kv-cache", "models/v4",
                                                                  "http://127.0.0.1:8333", "eu-west-1")
    assert loc.allow_http  # loopback endpoint
    assert loc.credentials is not None and loc.credentials.access_key_id == "AKIDENVIRONMENT1"
    plain = parse_s3_url("s3://kv-cache", env=ENV)
    assert (plain.prefix, plain.endpoint, plain.region, plain.allow_http) == ("", None, "us-east-1", False)
    assert parse_s3_url(loc.url(), env=ENV) == loc
    assert pickle.loads(pickle.dumps(loc)) == loc


def test_parse_url_precedence_keyword_over_url_over_environment():
    env = {**ENV, "AWS_REGION": "env-region", "AWS_ENDPOINT_URL": "https://env.example:1"}
    assert parse_s3_url("zarr+s3://kv-cache", env=env).region == "env-region"
    assert parse_s3_url("zarr+s3://kv-cache", env=env).endpoint == "https://env.example:1"
    loc = parse_s3_url("zarr+s3://kv-cache?region=url-region&endpoint=https://url.example", env=env)
    assert (loc.region, loc.endpoint) == ("url-region", "https://url.example")
    loc = parse_s3_url("zarr+s3://kv-cache?region=url-region", env=env, region="kw-region",
                       access_key_id="AKIDKEYWORD00001", secret_access_key="kw-secret")
    assert loc.region == "kw-region"
    assert loc.credentials is not None and loc.credentials.access_key_id == "AKIDKEYWORD00001"
    assert loc.credentials.secret_access_key == "kw-secret"
    assert parse_s3_url("zarr+s3://kv-cache", env={**ENV, "AWS_DEFAULT_REGION": "dflt"}).region == "dflt"


def test_secrets_never_in_repr_url_or_store():
    loc = parse_s3_url("zarr+s3://kv-cache?endpoint=http://127.0.0.1:9", env={**ENV, "AWS_SESSION_TOKEN": "tok-123"})
    assert loc.credentials is not None and loc.credentials.session_token == "tok-123"
    store = open_object_store(loc)
    for text in (repr(loc), str(loc), loc.url(), repr(store), repr(store.config), repr(store.credential_provider)):
        assert SECRET not in text and "tok-123" not in text
        assert "AKIDENVIRONMENT1" not in text  # key id shown as ***ENT1 at most


@pytest.mark.parametrize(("url", "kw", "match"), [
    ("https://kv-cache/x", {}, "expected scheme"),
    ("zarr+s3:///x", {}, "BUCKET"),
    ("zarr+s3://Bad_Bucket", {}, "bucket: expected"),
    ("zarr+s3://kv-cache/a/../b", {}, "without '.' or '..'"),
    ("zarr+s3://kv-cache?secret_access_key=x", {}, "credentials do not go into URLs"),
    ("zarr+s3://kv-cache?bogus=1", {}, "unknown option"),
    ("zarr+s3://kv-cache?endpoint=ftp://h", {}, "endpoint: expected"),
    ("zarr+s3://kv-cache?endpoint=http://10.1.2.3:9000", {}, "allow_http=true"),
    ("zarr+s3://kv-cache?allow_http=maybe", {}, "allow_http: expected true or false"),
    ("zarr+s3://kv-cache", {"access_key_id": "only-key"}, "expected both"),
])
def test_parse_url_rejects_bad_input(url: str, kw: dict[str, Any], match: str):
    with pytest.raises(ValueError, match=match):
        parse_s3_url(url, env=ENV, **kw)


def test_plain_http_elsewhere_needs_allow_http():
    loc = parse_s3_url("zarr+s3://kv-cache?endpoint=http://10.1.2.3:9000&allow_http=true", env=ENV)
    assert loc.allow_http


def test_missing_credentials_name_the_environment_variables():
    with pytest.raises(ObjectStoreAuthError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") as e:
        parse_s3_url("zarr+s3://kv-cache", env={})
    assert isinstance(e.value, StoreError) and isinstance(e.value, PermissionError)
    with pytest.raises(ObjectStoreAuthError, match="AWS_SECRET_ACCESS_KEY not set"):
        parse_s3_url("zarr+s3://kv-cache", env={"AWS_ACCESS_KEY_ID": "AKIDONLY"})
    anon = parse_s3_url("zarr+s3://kv-cache?skip_signature=true", env={})
    assert anon.credentials is None and anon.options["skip_signature"] is True


def test_open_object_store_validates():
    loc = parse_s3_url("zarr+s3://kv-cache", env=ENV)
    with pytest.raises(TypeError, match="S3Location"):
        open_object_store("zarr+s3://kv-cache")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        open_object_store(loc, timeout_s=0)
    with pytest.raises(ValueError, match="credentials go into the location"):
        open_object_store(loc, secret_access_key="x")


@pytest.mark.parametrize(("text", "expected"), [
    ("Generic S3 error: Error performing PUT http://h/b/k in 2ms - Server returned non-2xx status code: "
     "503 Service Unavailable: <Error><Code>SlowDown</Code></Error>", ObjectStoreUnavailable),
    ("Generic S3 error: ... HTTP error: error sending request\n\nDebug source:\nGeneric {\n"
     "  inner: Http(\n    HttpError {\n      kind: Interrupted,\n", ObjectStoreUnavailable),
    ("Generic S3 error: ... non-2xx status code: 400 Bad Request: <Code>InvalidArgument</Code>", ObjectStoreError),
    ("Generic S3 error: ... non-2xx status code: 403 Forbidden: <Code>AccessDenied</Code>", ObjectStoreAuthError),
])
def test_error_mapping_of_obstore_messages(text: str, expected: type[Exception]):
    # The mapping reads obstore's message text (its exceptions carry no status code);
    # the live tests below cover connect, timeout, 403 and 404 from a real server.
    from obstore.exceptions import GenericError

    from tiered_kv.storage.s3.client import _translate

    store = open_object_store(parse_s3_url("zarr+s3://kv-cache?endpoint=http://127.0.0.1:9", env=ENV))
    err = _translate(GenericError(text), store, op="put", key="k")
    assert type(err) is expected
    assert "127.0.0.1:9 bucket kv-cache" in str(err) and err.key == "k"


# ------------------------------------------------------------------- against SeaweedFS
@pytest.fixture(scope="session")
def bucket(seaweedfs: SeaweedFS) -> str:
    seaweedfs.make_bucket(BUCKET)
    return BUCKET


@pytest.fixture
def location(seaweedfs: SeaweedFS, bucket: str) -> S3Location:
    """A fresh prefix in the test bucket, credentials given as keywords (env untouched)."""
    return parse_s3_url(seaweedfs.url(bucket, f"t-{uuid.uuid4().hex[:12]}"), env={},
                        access_key_id=seaweedfs.access_key, secret_access_key=seaweedfs.secret_key)


@pytest.mark.s3
def test_put_create_only_refuses_a_second_writer(location: S3Location):
    store = open_object_store(location, timeout_s=TIMEOUT_S)
    first, second = payload(1, 4096), payload(2, 4096)
    assert not exists(store, "blocks/ab/cd")
    assert put_create_only(store, "blocks/ab/cd", first) is True
    assert put_create_only(store, "blocks/ab/cd", second) is False
    assert put_create_only(store, "blocks/ab/cd", first) is False  # same bytes: still refused
    out = bytearray(8192)
    assert get_into(store, "blocks/ab/cd", out) == 4096
    assert bytes(out[:4096]) == first
    assert exists(store, "blocks/ab/cd")
    delete(store, "blocks/ab/cd")
    delete(store, "blocks/ab/cd")  # absent: not an error
    assert not exists(store, "blocks/ab/cd")
    assert put_create_only(store, "blocks/ab/cd", second) is True  # a deleted key can be written again
    assert get_into(store, "blocks/ab/cd", out) == 4096 and bytes(out[:4096]) == second


@pytest.mark.s3
@pytest.mark.parametrize("nbytes", [0, 1, 409_600, 3 * (1 << 20) + 7])
def test_get_into_round_trips_bytes_exactly(location: S3Location, nbytes: int):
    store = open_object_store(location, timeout_s=TIMEOUT_S)
    data = payload(nbytes, nbytes)
    src = np.frombuffer(data, dtype=np.uint8).copy()
    assert put_create_only(store, "rec", src) is True  # numpy in
    outs: list[Any] = [np.full(nbytes + 16, 0xEE, dtype=np.uint8), bytearray(b"\xee" * (nbytes + 16)),
                       memoryview(bytearray(b"\xee" * (nbytes + 16)))]
    for out in outs:
        assert get_into(store, "rec", out) == nbytes
        got = bytes(out)
        assert got[:nbytes] == data
        assert got[nbytes:] == b"\xee" * 16  # past the object: untouched
    assert get_into(store, "missing", bytearray(16)) is None


@pytest.mark.s3
def test_get_into_rejects_small_or_read_only_buffers(location: S3Location):
    store = open_object_store(location, timeout_s=TIMEOUT_S)
    put_create_only(store, "rec", payload(3, 1000))
    small = bytearray(b"\x01" * 999)
    with pytest.raises(ValueError, match="at least 1000 bytes"):
        get_into(store, "rec", small)
    assert small == bytearray(b"\x01" * 999)
    with pytest.raises(ValueError, match="writable"):
        get_into(store, "rec", bytes(2000))
    with pytest.raises(ValueError, match="key: expected a relative path"):
        get_into(store, "/abs", bytearray(10))


@pytest.mark.s3
def test_list_keys_is_relative_to_the_prefix_and_segment_wise(location: S3Location):
    store = open_object_store(location, timeout_s=TIMEOUT_S)
    keys = ["zarr.json", "blocks/ab/c1", "blocks/ab/c2", "blocks/abc/d", "snapshots/ab/e"]
    for i, k in enumerate(keys):
        assert put_create_only(store, k, payload(i, 10))
    assert sorted(list_keys(store)) == sorted(keys)
    assert sorted(list_keys(store, "blocks/")) == ["blocks/ab/c1", "blocks/ab/c2", "blocks/abc/d"]
    assert sorted(list_keys(store, "blocks/ab")) == ["blocks/ab/c1", "blocks/ab/c2"]
    assert list(list_keys(store, "nothing")) == []


@pytest.mark.s3
def test_missing_bucket_is_a_clear_error(seaweedfs: SeaweedFS):
    loc = parse_s3_url(seaweedfs.url("tkv-no-such-bucket"), env={},
                       access_key_id=seaweedfs.access_key, secret_access_key=seaweedfs.secret_key)
    store = open_object_store(loc, timeout_s=TIMEOUT_S)
    with pytest.raises(BucketNotFoundError, match="tkv-no-such-bucket"):
        get_into(store, "k", bytearray(10))
    with pytest.raises(BucketNotFoundError):
        put_create_only(store, "k", b"x")


@pytest.mark.s3
@pytest.mark.parametrize("which", ["secret", "access_key"])
def test_wrong_credentials_raise_a_clear_error(seaweedfs: SeaweedFS, bucket: str, which: str):
    key = seaweedfs.access_key if which == "secret" else "AKIDNOSUCHKEY000"
    loc = parse_s3_url(seaweedfs.url(bucket), env={}, access_key_id=key, secret_access_key=SECRET)
    store = open_object_store(loc, timeout_s=TIMEOUT_S)
    ops = [lambda: put_create_only(store, "k", b"x"), lambda: get_into(store, "k", bytearray(10)),
           lambda: exists(store, "k"), lambda: list(list_keys(store))]
    for op in ops:
        with pytest.raises(ObjectStoreAuthError, match="AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY") as e:
            op()
        assert SECRET not in str(e.value)
    # The same store with the right secret works: the failure was the credentials.
    good = parse_s3_url(seaweedfs.url(bucket), env={}, access_key_id=seaweedfs.access_key,
                        secret_access_key=seaweedfs.secret_key)
    assert get_into(open_object_store(good, timeout_s=TIMEOUT_S), f"absent-{uuid.uuid4().hex}",
                    bytearray(10)) is None


@pytest.mark.s3
def test_killed_store_is_unavailable_and_restart_brings_the_data_back(seaweedfs: SeaweedFS,
                                                                      location: S3Location):
    store = open_object_store(location, timeout_s=TIMEOUT_S)
    data = {f"blocks/{i:02x}/rec": payload(100 + i, 65_536) for i in range(4)}
    for k, v in data.items():
        assert put_create_only(store, k, v)
    seaweedfs.stop()
    try:
        ops = [lambda: get_into(store, "blocks/00/rec", bytearray(65_536)),
               lambda: put_create_only(store, "blocks/ff/new", b"x"),
               lambda: exists(store, "blocks/00/rec"), lambda: list(list_keys(store)),
               lambda: delete(store, "blocks/00/rec")]
        for op in ops:
            t0 = time.monotonic()
            with pytest.raises(ObjectStoreUnavailable, match="unavailable") as e:
                op()
            assert time.monotonic() - t0 < TIMEOUT_S + 1.0
            assert isinstance(e.value, ConnectionError) and isinstance(e.value, ObjectStoreError)
    finally:
        seaweedfs.restart()
    out = bytearray(65_536)
    for k, v in data.items():  # the same store object: it reconnects
        assert get_into(store, k, out) == len(v) and bytes(out) == v
    assert put_create_only(store, "blocks/00/rec", b"other") is False
    assert put_create_only(store, "blocks/ff/new", b"x") is True


@pytest.mark.s3
def test_hung_store_times_out_as_unavailable(seaweedfs: SeaweedFS, location: S3Location):
    store = open_object_store(location, timeout_s=1.0)
    assert put_create_only(store, "rec", b"abc")
    assert seaweedfs.pid is not None
    os.kill(seaweedfs.pid, signal.SIGSTOP)  # accepts connections (kernel backlog), never answers
    try:
        for op in (lambda: get_into(store, "rec", bytearray(3)), lambda: put_create_only(store, "new", b"x")):
            t0 = time.monotonic()
            with pytest.raises(ObjectStoreUnavailable, match="timeout"):
                op()
            assert time.monotonic() - t0 < 2.5
    finally:
        os.kill(seaweedfs.pid, signal.SIGCONT)
    out = bytearray(3)
    assert get_into(store, "rec", out) == 3 and out == b"abc"


# Racing writers: 16 processes create-only-put the same 8 keys, each with its own bytes.
N_WORKERS, N_KEYS, RACE_BYTES = 16, 8, 256 * 1024


def _race_worker(location: S3Location, keys: list[str], worker: int, barrier: Any, results: Any) -> None:
    try:
        # Generous: SeaweedFS serializes conditional PUTs of one key with a lock its waiters
        # poll about once a second, so a loser among 16 can wait several seconds.
        store = open_object_store(location, timeout_s=30.0)
        payloads = [payload((worker, i), RACE_BYTES) for i in range(len(keys))]
        barrier.wait(timeout=60)
        t0 = time.monotonic()
        won = [put_create_only(store, k, p) for k, p in zip(keys, payloads)]
        results.put((worker, won, time.monotonic() - t0))
    except BaseException as e:  # report, do not hang the parent
        results.put((worker, f"{type(e).__name__}: {e}", 0.0))


@pytest.mark.s3
def test_racing_processes_leave_one_intact_object_per_key(location: S3Location):
    # forkserver: children fork from a server that imported the modules but never started
    # obstore's runtime (a fork of a process that used obstore cannot use it), and do not
    # each pay for a fresh interpreter importing torch (spawn).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tiered_kv.storage.s3", "numpy"])
    keys = [f"blocks/{i:02x}/{uuid.uuid4().hex}" for i in range(N_KEYS)]
    barrier, results = ctx.Barrier(N_WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(location, keys, w, barrier, results), daemon=True)
             for w in range(N_WORKERS)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=180) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
    got = {w: won for w, won, _ in reports}
    errors = {w: r for w, r in got.items() if isinstance(r, str)}
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    store = open_object_store(location, timeout_s=TIMEOUT_S)
    out = np.empty(RACE_BYTES + 1, dtype=np.uint8)
    for i, key in enumerate(keys):
        winners = [w for w in range(N_WORKERS) if got[w][i]]
        assert len(winners) == 1, f"{key}: create-only put returned True to workers {winners}"
        assert get_into(store, key, out) == RACE_BYTES
        assert out[:RACE_BYTES].tobytes() == payload((winners[0], i), RACE_BYTES), \
            f"{key}: stored bytes are not the winner's (worker {winners[0]})"
    assert sorted(list_keys(store, "blocks/")) == sorted(keys)
    print(f"race: slowest worker took {max(t for _, _, t in reports):.1f} s for {N_KEYS} contended puts")
