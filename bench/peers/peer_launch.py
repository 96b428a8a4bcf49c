"""The bench's side of a peer: start a driver in its peer's own venv and talk to it.

A peer that cannot run (its venv's interpreter missing, an import failing, a round failing)
is a :class:`PeerProcess` whose ``not_run`` says why (with the last lines the driver wrote to
its standard error, kept in ``<workdir>.log`` while the run lasts); it never yields a figure.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: seconds a driver may take to import its peer and build the workload (vLLM's import is
#: slow on a loaded 2-core machine), and to run one round
SETUP_TIMEOUT_S = 900.0
ROUND_TIMEOUT_S = 900.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Peer:
    """A peer store, measured by ``driver`` under the interpreter of ``venv``."""

    name: str          #: key in the results
    label: str         #: shown before the driver has said its version
    driver: str        #: file under bench/peers/
    venv: str          #: the venv, relative to the repository root
    make_target: str   #: what builds that venv

    def python(self, root: Path = ROOT) -> Path:
        return root / self.venv / "bin" / "python"


PEERS: tuple[Peer, ...] = (
    Peer(name="vllm_fs", label="vLLM FS tier", driver="vllm_fs.py", venv=".venv-vllm", make_target="venv-vllm"),
    Peer(name="lmcache_disk", label="LMCache local disk", driver="lmcache_disk.py", venv=".venv-lmcache",
         make_target="venv-lmcache"),
)


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class PeerProcess:
    """One driver process. ``info`` once it is ready; ``not_run`` (why) once it cannot go
    on. ``runs``: the rounds it has completed."""

    def __init__(self, peer: Peer, python: Path, *, records: int, payload_bytes: int, batch: int,
                 workdir: Path) -> None:
        self.peer = peer
        self.info: dict[str, Any] | None = None
        self.not_run: str | None = None
        self.runs: list[dict[str, Any]] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._buf = b""
        if not python.exists():
            self.not_run = f"{python} not found (make {peer.make_target})"
            return
        workdir.mkdir(parents=True)
        self._stderr_path = workdir.with_suffix(".log")
        self._stderr = open(self._stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [str(python), str(HERE / peer.driver), "--records", str(records), "--payload-bytes", str(payload_bytes),
             "--batch", str(batch), "--dir", str(workdir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def running(self) -> bool:
        return self.not_run is None and self._proc is not None

    def wait_ready(self, timeout_s: float = SETUP_TIMEOUT_S) -> None:
        """Wait for the driver's ready line (its peer imported, the workload built)."""
        if not self.running or self.info is not None:
            return
        msg = self._receive(timeout_s, "setting up")
        if msg is not None:
            self.info = msg.get("ready")
            if self.info is None:
                self._fail(f"unexpected reply {msg!r}")

    def round(self, keep: bool = True) -> None:
        """One round (write, cold read, hot read); kept in ``runs`` unless a warm-up."""
        if not self.running:
            return
        self.wait_ready()
        if not self.running:
            return
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(b"round\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._fail("the driver exited")
            return
        msg = self._receive(ROUND_TIMEOUT_S, f"round {len(self.runs) + 1}")
        if msg is None:
            return
        if "round" not in msg:
            self._fail(f"unexpected reply {msg!r}")
        elif keep:
            self.runs.append(msg["round"])

    def close(self) -> None:
        if self._proc is None:
            return
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(b"quit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()
        self._proc = None

    # ----------------------------------------------------------- helpers
    def _fail(self, why: str) -> None:
        self.not_run = why
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _receive(self, timeout_s: float, doing: str) -> dict[str, Any] | None:
        """The driver's next JSON line, or None (and ``not_run`` set) if it failed."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"no answer {doing} within {timeout_s:.0f} s; it wrote: {_tail(self._stderr_path)}")
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._proc.wait()
                self._stderr.flush()
                self._fail(f"the driver exited ({self._proc.returncode}) {doing}: {_tail(self._stderr_path)}")
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            self._fail(f"{msg['error']} ({doing})")
            return None
        return msg
