"""``serve-reference`` against clients that misbehave: none of them can hang the server.

Requests share the model in turns: between two steps of a request every other request
takes at most one (checked on the order of the model's steps, not on the clock), a long
prompt's prefill holds no one up, and interleaved answers equal lone ones. Slow clients
are cut by the request's absolute deadline; a stream whose client leaves more than its
buffer unread, or takes nothing for the send timeout, is cut and counted, and 20 of them
leave the server's memory flat; an abandoned request stops between tokens; bad bodies and
methods get JSON errors naming what was sent; clients that leave cause no traceback;
SIGTERM drains: requests in flight finish, those left at the deadline are cut and told so,
and slow clients never hold the exit past it. The tests wait on events and the server's
own bookkeeping, never on the clock: a generous bound tells a hang from a slow machine.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_kv import presets
from tiered_kv.cli import serve_reference as cli
from tiered_kv.reference import _connection, openai_server
from tiered_kv.reference import engine as engine_module
from tiered_kv.reference._turns import TurnLock
from tiered_kv.reference.openai_server import (
    ReferenceEngine,
    RequestCancelled,
    Stopped,
    _Handler,
    make_server,
)
from tiered_kv.reference.protocol import CompletionRequest

SERVED = "ref-test"
#: a hang detector, far above anything a working server needs on a loaded machine
HANG_S = 60.0
#: a request body (JSON) of one completion
BODY = json.dumps({"prompt": "abc", "max_tokens": 1}).encode()

if sys.platform != "linux":  # poll, MSG_DONTWAIT, tiny socket buffers
    pytestmark = pytest.mark.skip(reason="Linux only")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model runs one token per few ms on one thread; two threads on a loaded
    two-core machine spin against each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Server:
    """An in-process server on a free loopback port. :attr:`ended` records each
    completion's end (its exception, or None), :attr:`counted` each request's outcome as
    the server counts it; :meth:`wait` waits for either."""

    def __init__(self, store: Path, engine_options: dict[str, Any] | None = None, **server_options: Any) -> None:
        self.engine = ReferenceEngine(presets.tiny(), store=f"lmdb://{store}", served_model=SERVED, seed=0,
                                      **{"num_blocks": 64, "num_snapshots": 16, **(engine_options or {})})
        #: (cache request id, tokens) of each model step, in the order they ran (under the lock)
        self.steps: list[tuple[int, int]] = []
        forward = self.engine.model.forward

        def stepping(cache: Any, req: Any, tokens: Any) -> Any:
            self.steps.append((req.request_id, len(tokens)))
            return forward(cache, req, tokens)

        self.engine.model.forward = stepping  # type: ignore[method-assign]
        self.ended: list[BaseException | None] = []
        self.counted: list[str] = []
        #: each counted outcome's reason (a cancelled one's), in order
        self.reasons: list[str | None] = []
        self._changed = threading.Condition()
        complete, count = self.engine.complete, self.engine.count

        def completing(*args: Any, **kwargs: Any) -> Any:
            try:
                done = complete(*args, **kwargs)
            except BaseException as exc:
                self._note(self.ended, exc)
                raise
            self._note(self.ended, None)
            return done

        def counting(outcome: str, reason: str | None = None) -> None:
            count(outcome, reason)
            self.reasons.append(reason)
            self._note(self.counted, outcome)

        self.engine.complete = completing  # type: ignore[method-assign]
        self.engine.count = counting  # type: ignore[method-assign]
        self.httpd = make_server(self.engine, "127.0.0.1", 0, **server_options)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.host, self.port = self.httpd.server_address[:2]
        self.stopped = False

    def _note(self, into: list[Any], item: Any) -> None:
        with self._changed:
            into.append(item)
            self._changed.notify_all()

    def wait(self, what: list[Any], n: int) -> None:
        """Wait until ``what`` (:attr:`ended` or :attr:`counted`) holds ``n`` items."""
        with self._changed:
            assert self._changed.wait_for(lambda: len(what) >= n, timeout=HANG_S), f"{what} did not reach {n}"

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        sock = socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(HANG_S)
        sock.connect((self.host, self.port))
        return sock

    def raw(self, data: bytes, *, half_close: bool = True) -> tuple[int, dict[str, str], bytes]:
        """Send ``data`` as it is; the parsed answer."""
        with self.connect() as sock:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            return parse_response(read_all(sock))

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=HANG_S)
        try:
            conn.request(method, path, body=body)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def post_json(self, body: dict[str, Any]) -> tuple[int, dict[str, Any] | list[str]]:
        """POST a completion: (status, the JSON answer) or, for a stream, (status, its events)."""
        status, _, raw = self.request("POST", "/v1/completions", json.dumps(body).encode())
        return status, (sse_events(raw) if body.get("stream") and status == 200 else json.loads(raw))

    def cancelled(self, reason: str) -> int:
        return int(self.engine.metrics().get("tiered_kv_server_cancelled_total", reason=reason))

    def outcomes(self) -> dict[str, int]:
        m = self.engine.metrics()
        return {o: int(m.get("tiered_kv_server_requests_total", outcome=o))
                for o in ("ok", "rejected", "failed", "cancelled")}

    def stop(self, **options: Any) -> int:
        self.stopped = True
        cut = self.httpd.stop(**options)
        self.thread.join()
        return cut

    def close(self) -> None:
        if not self.stopped:
            self.stop()
        self.engine.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "store")
    yield s
    s.close()


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def sse_events(raw: bytes) -> list[str]:
    """A stream's whole events (what follows ``data: ``), from its body or its whole
    response; a cut stream's last, partial event is left out."""
    if raw.startswith(b"HTTP/"):
        raw = raw.partition(b"\r\n\r\n")[2]
    whole = raw.decode("utf-8", "replace").split("\n\n")[:-1]
    return [e[len("data: "):] for e in whole if e.startswith("data: ")]


def stream_tokens(events: list[str]) -> list[int]:
    return [t for e in events if e.startswith("{") for c in json.loads(e).get("choices", []) for t in c["token_ids"]]


def finish_reasons(events: list[str]) -> list[str]:
    return [c["finish_reason"] for e in events if e.startswith("{") for c in json.loads(e).get("choices", [])
            if c["finish_reason"] is not None]


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as a close)."""
    chunks = []
    try:
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def wait_until(predicate: Any, what: str) -> None:
    """Wait for the server's own bookkeeping to reach a state (a hang detector bounds it)."""
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {HANG_S} s: {what}"
        time.sleep(0.01)


def post(body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: "
            + str(n).encode() + b"\r\n\r\n" + body)


class Trickler:
    """A client that sends a request's headers one short line every ``interval_s``, forever:
    each byte restarts a per-read socket timeout. :attr:`closed` is set when the server
    closes the connection."""

    def __init__(self, host: str, port: int, interval_s: float = 0.2) -> None:
        self.sock = socket.create_connection((host, port), timeout=HANG_S)
        self.interval_s = interval_s
        self.closed = threading.Event()
        #: time.monotonic() when the server closed the connection
        self.closed_at: float | None = None
        self.lines_sent = 0
        self._quit = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        line = b"POST /v1/completions HTTP/1.0\r\n"
        try:
            while not self._quit.is_set():
                self.sock.sendall(line)
                self.lines_sent += 1
                line = b"X-Slow: %d\r\n" % self.lines_sent
                readable, _, _ = select.select([self.sock], [], [], self.interval_s)  # the pace, and the close
                if readable and not self.sock.recv(1 << 16):
                    break
        except OSError:  # reset or broken pipe: closed by the server as well
            pass
        if not self._quit.is_set():
            self.closed_at = time.monotonic()
            self.closed.set()

    def close(self) -> None:
        self._quit.set()
        self.thread.join(HANG_S)
        self.sock.close()


# ---------------------------------------------------------------- sharing the model
def fair(steps: list[tuple[int, int]]) -> bool:
    """Whether between two consecutive steps of any request, every other request took at
    most one step."""
    last: dict[int, int] = {}
    for i, (rid, _) in enumerate(steps):
        if rid in last:
            between = [r for r, _ in steps[last[rid] + 1:i]]
            if len(between) != len(set(between)):
                return False
        last[rid] = i
    return True


def test_the_turn_lock_hands_turns_round_robin_whatever_each_threads_pace() -> None:
    """Four threads take 25 turns each; one does slow work between its turns. The order
    is strict round-robin: a seat's place is taken when its turn ends, so a fast thread
    cannot take two turns while a slow one is away. A one-shot ``with lock`` waits its turn."""
    lock = TurnLock()
    order: list[int] = []

    def run(i: int) -> None:
        seat = lock.seat()
        try:
            for _ in range(25):
                with seat:
                    order.append(i)
                if i == 0:
                    time.sleep(0.002)  # the slow one
        finally:
            seat.leave()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    with lock:  # every thread queues its first turn behind this one
        for t in threads:
            t.start()
        wait_until(lambda: lock.waiting() == 4, "four seats queued")
    for t in threads:
        t.join(HANG_S)
    assert order == [0, 1, 2, 3] * 25
    with lock:
        assert lock.locked()
    assert not lock.locked() and lock.waiting() == 0


#: prompts of different lengths; the last two share a 300-token prefix
SHARED = "A prefix that two prompts share, long enough to fill blocks of the cache. " * 4
MIX = [("lone and short", 30, True), (SHARED[:300] + " and one suffix", 12, False),
       (SHARED[:300] + " and another, longer suffix", 45, True)]


def test_requests_take_steps_in_turn_and_answer_what_a_lone_request_does(tmp_path: Path) -> None:
    """Three requests (streams and a plain one) run at once: the model's steps alternate
    between them, each waits at most one step of each other for its next token, and each
    answer is token for token what the same request gets alone on a fresh server."""
    lone = lone_answers(tmp_path / "lone", [{"prompt": p, "max_tokens": n} for p, n, _ in MIX])
    s = Server(tmp_path / "store")
    got: dict[int, tuple[int, Any]] = {}
    try:
        threads = [threading.Thread(target=lambda i=i, p=p, n=n, st=st: got.__setitem__(
            i, s.post_json({"prompt": p, "max_tokens": n, "stream": st}))) for i, (p, n, st) in enumerate(MIX)]
        with s.engine.lock:  # all three are admitted and queued before any takes a step
            for t in threads:
                t.start()
            wait_until(lambda: s.engine.lock.waiting() == 3, "three requests queued for the model")
        for t in threads:
            t.join(HANG_S)
    finally:
        s.close()
    answers = []
    for i, (_, _, st) in enumerate(MIX):
        status, body = got[i]
        assert status == 200, body
        answers.append(stream_tokens(body) if st else body["choices"][0]["token_ids"])
    assert answers == lone
    assert fair(s.steps), s.steps
    assert len({rid for rid, _ in s.steps[:3]}) == 3  # they did interleave: three requests in the first three steps


def lone_answers(store: Path, requests: list[dict[str, Any]]) -> list[list[int]]:
    """Each request's tokens from a fresh engine, one request at a time, no HTTP."""
    engine = ReferenceEngine(presets.tiny(), store=f"lmdb://{store}", served_model=SERVED, seed=0,
                             num_blocks=64, num_snapshots=16)
    try:
        return [engine.complete(CompletionRequest.parse(r, served_model=SERVED)).token_ids for r in requests]
    finally:
        engine.close()


def test_a_request_resumed_from_a_running_requests_blocks_answers_what_it_does_alone(tmp_path: Path) -> None:
    """A stream over a 600-token prompt is decoding when a request for the same prompt and
    50 more tokens arrives: that one resumes from the running request's sealed blocks
    (512 tokens cached) while both take turns, and both answer what they do alone."""
    prefix = [(11 * i + 3) % 256 for i in range(600)]
    first_req = {"prompt": prefix, "max_tokens": 200, "stream": True}
    second_req = {"prompt": prefix + [(5 * i) % 256 for i in range(50)], "max_tokens": 8}
    lone = lone_answers(tmp_path / "lone", [first_req, second_req])
    s = Server(tmp_path / "store")
    sock = s.connect()
    try:
        sock.sendall(post(json.dumps(first_req).encode()))
        head = sock.recv(12)
        assert head == b"HTTP/1.0 200"  # the first token is out: the prompt's blocks are sealed
        got: list[tuple[int, Any]] = []
        second = threading.Thread(target=lambda: got.append(s.post_json(second_req)))
        with s.engine.lock:  # the first is still decoding (200 tokens): both queue for their turns
            second.start()
            wait_until(lambda: s.engine.lock.waiting() == 2, "both requests queued for the model")
        second.join(HANG_S)
        first = stream_tokens(sse_events(head + read_until_closed(sock)))
    finally:
        sock.close()
        s.close()
    (status, body), = got
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
    rids = [rid for rid, _ in s.steps]
    a, b = dict.fromkeys(rids)  # the first request's id, then the second's
    last_a = max(i for i, r in enumerate(rids) if r == a)
    assert rids.index(b) < last_a and fair(s.steps)  # the second ran while the first was decoding, in turns
    assert [first, body["choices"][0]["token_ids"]] == lone


def test_a_long_prompt_does_not_hold_a_short_request_up(tmp_path: Path) -> None:
    """A 3,000-token prompt prefills a chunk per turn: a short request queued behind its
    first chunk is answered after that one chunk, not after the whole prefill."""
    s = Server(tmp_path / "store")
    got: dict[str, tuple[int, Any]] = {}
    long_prompt = [(7 * i) % 256 for i in range(3000)]
    try:
        long = threading.Thread(target=lambda: got.__setitem__("long", s.post_json(
            {"prompt": long_prompt, "max_tokens": 1})))
        short = threading.Thread(target=lambda: got.__setitem__("short", s.post_json(
            {"prompt": "hi", "max_tokens": 1})))
        with s.engine.lock:
            long.start()
            wait_until(lambda: s.engine.lock.waiting() == 1, "the long request queued")
            short.start()
            wait_until(lambda: s.engine.lock.waiting() == 2, "the short request queued behind it")
        long.join(HANG_S)
        short.join(HANG_S)
    finally:
        s.close()
    assert got["long"][0] == got["short"][0] == 200
    (first, n_first), (second, n_second) = s.steps[:2]
    assert n_first == engine_module.PREFILL_CHUNK and n_second == 2 and first != second  # one chunk, then the short one
    chunks = [n for rid, n in s.steps if rid == first]
    assert sum(chunks) == 3000 and len(chunks) == 12 and max(chunks) <= engine_module.PREFILL_CHUNK


def test_a_one_token_request_is_answered_while_a_100k_token_stream_runs(tmp_path: Path) -> None:
    """A stream of 100,000 tokens (its client reading) holds no one: a one-token request
    sent while it runs is answered within 2 s, and its answer is the lone one."""
    s = Server(tmp_path / "store", {"num_blocks": 1024})
    sock = s.connect()
    received = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 16):
                received.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    try:
        sock.sendall(post(json.dumps({"prompt": "abc", "max_tokens": 100_000, "stream": True}).encode()))
        reader.start()
        wait_until(lambda: received.count(b"\n\n") > 20, "the long stream's first tokens")
        t0 = time.monotonic()
        status, body = s.post_json({"prompt": "hi", "max_tokens": 1})
        took = time.monotonic() - t0
        assert status == 200 and len(body["choices"][0]["token_ids"]) == 1
        assert took <= 2.0, f"a one-token request took {took:.1f} s beside a long stream"
        print(f"one-token request beside a 100k-token stream: {took * 1e3:.0f} ms")
        sock.shutdown(socket.SHUT_RDWR)  # the long stream's client leaves: it is cancelled between tokens
        s.wait(s.counted, 2)
        assert sorted(s.counted) == ["cancelled", "ok"] and "client_left" in s.reasons
        assert s.engine.metrics().get("tiered_kv_server_tokens_total", kind="generated") < 100_000
    finally:
        sock.close()
        reader.join(HANG_S)
        s.close()


# ---------------------------------------------------------------- slow clients
def test_a_trickling_client_is_cut_by_the_request_deadline(tmp_path: Path) -> None:
    """One header line every 0.2 s would restart a 3 s socket timeout forever; the request's
    absolute deadline (3 s) closes the connection."""
    s = Server(tmp_path / "store", request_timeout_s=3.0)
    slow = Trickler(s.host, s.port)
    try:
        assert slow.closed.wait(HANG_S), "the server kept a trickling client past its request deadline"
        assert s.request("GET", "/health")[0] == 200  # and goes on serving
    finally:
        slow.close()
        s.close()


def test_a_body_that_never_comes_gets_408_at_the_deadline(tmp_path: Path) -> None:
    s = Server(tmp_path / "store", request_timeout_s=3.0)
    try:
        with s.connect() as sock:
            sock.sendall(post(BODY[:5], length=len(BODY)))  # then wait for the answer, sending nothing more
            status, _, raw = parse_response(read_all(sock))
        err = json.loads(raw)["error"]
        assert status == 408 == err["code"] and f"expected {len(BODY)} bytes (Content-Length) within 3 s" in \
            err["message"]
    finally:
        s.close()


# ---------------------------------------------------------------- stalled and abandoned
def test_a_client_that_stops_reading_blocks_no_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's bytes are queued, never sent under the model lock: with its client
    reading nothing (the smallest socket buffers on both ends), the stream still finishes
    making its tokens (~12 KB unread is within its 1 MiB buffer), the next request is
    answered, and the stalled client gets its whole stream once it reads again (its send
    timeout is long here)."""
    setup = _Handler.setup

    def small_send_buffer(self: _Handler) -> None:
        setup(self)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)  # the kernel's minimum

    monkeypatch.setattr(_Handler, "setup", small_send_buffer)
    server = Server(tmp_path / "store", send_timeout_s=HANG_S)
    n = 60  # ~12 KB of events: several times what the two socket buffers hold (~2.5 KB)
    stalled = server.connect(rcvbuf=1)
    try:
        stalled.sendall(post(json.dumps({"prompt": "abc", "max_tokens": n, "stream": True}).encode()))
        server.wait(server.ended, 1)  # every token made while the client read nothing
        assert server.ended == [None]
        other = server.request("POST", "/v1/completions", BODY)
        assert other[0] == 200 and len(json.loads(other[2])["choices"][0]["token_ids"]) == 1
        raw = read_all(stalled)  # now read: the whole stream is there
    finally:
        stalled.close()
        server.close()
    events = [e for e in raw.partition(b"\r\n\r\n")[2].decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    tokens = [t for e in events[:-1] for c in json.loads(e[6:])["choices"] for t in c["token_ids"]]
    assert len(tokens) == n and tokens[:1] == json.loads(other[2])["choices"][0]["token_ids"]


def test_an_abandoned_request_is_cancelled_between_tokens(server: Server) -> None:
    n = 2000  # minutes of decoding if it ran to its end
    with server.connect() as sock:
        sock.sendall(post(json.dumps({"prompt": "abc", "max_tokens": n}).encode()))
    server.wait(server.counted, 1)
    assert isinstance(server.ended[0], RequestCancelled) and server.counted == ["cancelled"]
    m = server.engine.metrics()
    assert server.outcomes() == {"ok": 0, "rejected": 0, "failed": 0, "cancelled": 1}
    assert m.get("tiered_kv_server_tokens_total", kind="generated") < n
    with server.engine.lock:
        assert server.engine.cache.stats()["live_requests"] == 0
    assert server.request("POST", "/v1/completions", BODY)[0] == 200  # the model is free


# ---------------------------------------------------------------- slow readers: bounded
def test_a_stream_left_unread_past_its_buffer_is_cut_and_counted(tmp_path: Path) -> None:
    """A client that reads nothing of a 100,000-token stream (a tiny receive window): once
    more than the stream buffer (8 KiB here) is unread, the stream stops generating, is
    cancelled (reason ``unread_bytes``) and its connection reset; it never looks complete."""
    s = Server(tmp_path / "store", {"num_blocks": 1024}, stream_buffer_bytes=8 << 10, send_timeout_s=HANG_S)
    stalled = s.connect(rcvbuf=1)
    try:
        stalled.sendall(post(json.dumps({"prompt": "abc", "max_tokens": 100_000, "stream": True}).encode()))
        s.wait(s.counted, 1)
        assert s.counted == ["cancelled"] and s.reasons == ["unread_bytes"]
        assert s.cancelled("unread_bytes") == 1 and s.outcomes()["cancelled"] == 1
        # it stopped at about 8 KiB of events (~200 bytes each) plus the client's window
        assert s.engine.metrics().get("tiered_kv_server_tokens_total", kind="generated") < 1000
        events = sse_events(read_until_closed(stalled))
        assert "[DONE]" not in events and not finish_reasons(events)
        with s.engine.lock:
            assert s.engine.cache.stats()["live_requests"] == 0
        assert s.request("POST", "/v1/completions", BODY)[0] == 200  # and the model is free
    finally:
        stalled.close()
        s.close()


def test_a_stream_whose_client_takes_nothing_is_cut_at_the_send_timeout(tmp_path: Path) -> None:
    """The buffer is large (1 MiB), but the client takes no byte for the send timeout
    (1 s here): the stream is cut (reason ``send_timeout``) long before its 100,000 tokens."""
    s = Server(tmp_path / "store", {"num_blocks": 1024}, send_timeout_s=1.0)
    stalled = s.connect(rcvbuf=1)
    try:
        stalled.sendall(post(json.dumps({"prompt": "abc", "max_tokens": 100_000, "stream": True}).encode()))
        s.wait(s.counted, 1)
        assert s.counted == ["cancelled"] and s.reasons == ["send_timeout"] and s.cancelled("send_timeout") == 1
        assert s.engine.metrics().get("tiered_kv_server_tokens_total", kind="generated") < 100_000
        assert "[DONE]" not in sse_events(read_until_closed(stalled))
    finally:
        stalled.close()
        s.close()


def test_the_stream_buffer_bounds_memory_with_20_stalled_clients(tmp_path: Path) -> None:
    """``serve-reference --stream-buffer 4K``: 20 clients ask for 20,000-token streams at
    once and read nothing. Each stream is cut after about 4 KiB unread (unbounded, each
    would queue ~4 MB of events: 80 MB), every one is counted, and the server's resident
    memory after them is within a few MiB of before."""
    proc, port = start_cli_server(tmp_path, "--stream-buffer", "4K", "--num-blocks", "4096")
    clients: list[socket.socket] = []
    try:
        warm = http_post(port, {"prompt": "abc", "max_tokens": 200, "stream": True})
        assert warm[0] == 200 and "[DONE]" in sse_events(warm[1])
        before = rss_bytes(proc.pid)
        for _ in range(20):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
            sock.settimeout(HANG_S)
            sock.connect(("127.0.0.1", port))
            sock.sendall(post(json.dumps({"prompt": "abc", "max_tokens": 20_000, "stream": True}).encode()))
            clients.append(sock)
        wait_until(lambda: metric(port, "tiered_kv_server_cancelled_total", reason="unread_bytes") == 20,
                   "the 20 stalled streams cut")
        after = rss_bytes(proc.pid)
        generated = metric(port, "tiered_kv_server_tokens_total", kind="generated") - 200
        for sock in clients:
            assert "[DONE]" not in sse_events(read_until_closed(sock))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        stop_cli_server(proc)
        for sock in clients:
            sock.close()
    assert proc.returncode == 0 and "20 streams of slow readers cut" in err, err
    assert generated < 20 * 500  # ~50 events each, against 20 x 20,000 unbounded
    print(f"RSS before {before / 2**20:.1f} MiB, after 20 stalled streams {after / 2**20:.1f} MiB; "
          f"{generated} tokens made for them")
    assert after - before < 16 << 20


# ---------------------------------------------------------------- bad input
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize(("body", "param", "message"), [
    (b'{"prompt": "ok \\ud800"}', "prompt", "expected valid Unicode text, got a lone surrogate U+D800 at character 3"),
    (b'{"prompt": ' + DEEP + b"}", None, "JSON nested too deeply"),
    (b'{"prompt": "a", "max_tokens": ' + b"[" * 500 + b"]" * 500 + b"}", "max_tokens",
     "max_tokens: expected an integer >= 1, got a list of lists: [[[[["),
    (b'{"prompt": "a", "model": "' + b"m" * 100_000 + b'"}', "model", "does not exist"),
])
def test_bad_bodies_get_400_json(server: Server, body: bytes, param: str | None, message: str) -> None:
    status, _, raw = server.raw(post(body))
    err = json.loads(raw)["error"]
    code = 404 if param == "model" else 400
    assert (status, err["code"], err["param"]) == (code, code, param) and message in err["message"]
    assert len(err["message"]) < 500  # a bad value is shown short


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": [True]}, "prompt", "got a list of booleans: [true]"),
    ({"prompt": [1.5]}, "prompt", "got a list of floats: [1.5]"),
    ({"prompt": [1, True, 2.5]}, "prompt", "got a list of integers, booleans and floats: [1, true, 2.5]"),
    ({"prompt": {"text": "hi"}}, "prompt", 'got an object: {"text": "hi"}'),
    ({"prompt": ["a", "b"]}, "prompt", 'got a list of strings: ["a", "b"] (a batch of 2 prompts: send one '
                                       "prompt per request)"),
    ({"prompt": [[1], [2]]}, "prompt", "got a list of lists: [[1], [2]] (a batch of 2 prompts"),
    ({"prompt": [None]}, "prompt", "got a list of nulls: [null]"),
    ({"prompt": 7}, "prompt", "got an integer: 7"),
    ({"prompt": None}, "prompt", "got null"),
    ({"max_tokens": 3}, "prompt", 'got none (the body has no "prompt")'),
    ({"prompt": "x", "stream_options": [1]}, "stream_options", "stream_options: expected an object, got a list "
                                                               "of integers: [1]"),
    ({"prompt": "x", "stream_options": [True]}, "stream_options", "got a list of booleans: [true]"),
    ({"prompt": "x", "stream_options": []}, "stream_options", "got an empty list"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options",
     'stream_options.include_usage: expected true or false, got a string: "yes"'),
    ({"prompt": "x", "stream": 1}, "stream", "stream: expected true or false, got an integer: 1"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "max_tokens: expected an integer >= 1, got a float: 1.5"),
    ({"prompt": "x", "n": True}, "n", "n: this server supports only 1, got a boolean: true"),
    ({"prompt": "x", "echo": 0}, "echo", "echo: this server supports only false, got an integer: 0"),
    ({"prompt": "x", "model": ["m"]}, "model", "model: expected a string"),
    ([{"prompt": "x"}], None, 'body: expected a JSON object, got a list of objects: [{"prompt": "x"}]'),
])
def test_type_errors_name_what_was_sent(server: Server, body: object, param: str | None, message: str) -> None:
    status, _, raw = server.raw(post(json.dumps(body).encode()))
    err = json.loads(raw)["error"]
    assert (status, err["code"], err["param"]) == (400, 400, param) and message in err["message"], err["message"]


def test_a_body_shorter_than_its_content_length_gets_400(server: Server) -> None:
    status, _, raw = server.raw(post(BODY, length=len(BODY) + 10))  # then the client ends its side
    err = json.loads(raw)["error"]
    assert status == 400 and f"expected {len(BODY) + 10} bytes (Content-Length), got {len(BODY)}" in err["message"]
    assert server.outcomes()["rejected"] == 1


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("PUT", "/v1/completions", "POST"),
    ("DELETE", "/v1/completions", "POST"),
    ("PATCH", "/v1/models", "GET"),
    ("GET", "/v1/completions", "POST"),
    ("POST", "/health", "GET"),
])
def test_a_wrong_method_gets_405_json(server: Server, method: str, path: str, allow: str) -> None:
    status, headers, raw = server.request(method, path, BODY if method != "GET" else None)
    err = json.loads(raw)["error"]
    assert (status, headers["Allow"], err["code"]) == (405, allow, 405)
    assert err["message"] == f"{path}: expected method {allow}, got {method}"


@pytest.mark.parametrize(("request_line", "status"), [
    (b"FROB /v1/completions HTTP/1.0", 501),  # a method http.server does not know
    (b"GET /" + b"x" * 70_000 + b" HTTP/1.0", 414),
    (b"GET /health HTTP/1.0" + b"".join(b"\r\nX-%d: 1" % i for i in range(120)), 431),  # too many headers
])
def test_http_servers_own_rejections_are_json(server: Server, request_line: bytes, status: int) -> None:
    got, headers, raw = server.raw(request_line + b"\r\n\r\n")
    assert got == status and headers["Content-Type"] == "application/json"
    assert json.loads(raw)["error"]["code"] == status


# ---------------------------------------------------------------- clients that leave
def test_clients_that_leave_early_print_no_traceback(server: Server, capfd: pytest.CaptureFixture[str]) -> None:
    """Clients leave in every phase: mid-headers, before the answer of a plain request, in
    the middle of a stream, and with a reset (SO_LINGER 0). The server logs nothing on
    stderr, and every connection ends by itself (stop finds none left to cut)."""
    def reset(sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        sock.close()

    for _ in range(3):
        with server.connect() as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Le")
        with server.connect() as sock:
            sock.sendall(post(json.dumps({"prompt": "abc", "max_tokens": 3}).encode()))
        sock = server.connect()
        sock.sendall(post(json.dumps({"prompt": "abc", "max_tokens": 500, "stream": True}).encode()))
        assert sock.recv(64).startswith(b"HTTP/1.0 200")
        reset(sock)
        sock = server.connect()
        sock.sendall(post(json.dumps({"prompt": "abcd", "max_tokens": 3}).encode()))
        reset(sock)
    # Each connection ends by itself. On a loaded machine the server may not yet have
    # accepted the last ones, or their threads not yet seen the client go, when the loop
    # ends: one answered request on a connection of its own (accepted after every earlier
    # one: one accept loop, in order) and then no connection left (a hang fails) says so.
    assert server.request("GET", "/health")[0] == 200
    wait_until(lambda: server.httpd.open_connections() == 0, "every connection ended by itself")
    assert server.stop(grace_s=HANG_S) == Stopped(closed=0, cut=0)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error" not in err, err
    assert server.outcomes()["cancelled"] >= 3  # at least the streams; the plain ones may have finished


# ---------------------------------------------------------------- shutdown
def test_stop_cuts_whatever_the_clients_do(server: Server) -> None:
    """Two trickling clients, one idle connection and a request whose client never reads:
    stop() closes the three without a whole request at once and cuts the request after
    the grace period; each thread ends, each client sees the close, the request is
    cancelled and the engine is free."""
    slow = [Trickler(server.host, server.port) for _ in range(2)]
    idle = server.connect()
    stalled = server.connect(rcvbuf=1)  # last: its answer says the others were accepted (in order)
    stalled.sendall(post(json.dumps({"prompt": "abc", "max_tokens": 2000, "stream": True}).encode()))
    assert stalled.recv(12) == b"HTTP/1.0 200"  # generating
    try:
        # the tricklers and the idle connection sent no whole request: closed at once
        assert server.stop(grace_s=0.2, cut_wait_s=HANG_S) == Stopped(closed=3, cut=1)
        assert server.httpd.open_connections() == 0  # every connection's thread ended
        assert all(t.closed.wait(HANG_S) for t in slow)
        idle.settimeout(HANG_S)
        assert idle.recv(1) == b""
        server.wait(server.ended, 1)
        assert isinstance(server.ended[0], RequestCancelled)
        with server.engine.lock:
            assert server.engine.cache.stats()["live_requests"] == 0
    finally:
        for t in slow:
            t.close()
        idle.close()
        stalled.close()


def start_cli_server(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], int]:
    """``tiered-kv serve-reference`` in a child process on a free port: (process, port)."""
    cmd = [sys.executable, "-m", "tiered_kv.cli", "serve-reference", "--store", str(tmp_path / "store"),
           "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on http://127.0.0.1:"):
        stop_cli_server(proc)
        pytest.fail(f"serve-reference did not start: {line!r} {proc.stderr and proc.stderr.read()}")
    return proc, int(line.split()[2].rsplit(":", 1)[1])


def stop_cli_server(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def http_post(port: int, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode())
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def metric(port: int, name: str, **labels: str) -> float:
    """One sample of the server's ``/metrics``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{want} not in /metrics")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_sigterm_lets_the_requests_in_flight_finish(tmp_path: Path) -> None:
    """SIGTERM while a stream and a plain request run: the server stops accepting (a new
    connection is refused while they are still in flight), both finish whole (every
    token, the finish reason, ``[DONE]``), and it exits 0 having cut nothing."""
    proc, port = start_cli_server(tmp_path, "--send-timeout", str(HANG_S))  # default --drain-timeout 30
    stream = socket.socket()
    stream.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # it stays in flight until read
    plain = socket.socket()
    try:
        for sock, body in ((stream, {"prompt": "abc", "max_tokens": 200, "stream": True}),
                           (plain, {"prompt": "abcd", "max_tokens": 150})):
            sock.settimeout(HANG_S)
            sock.connect(("127.0.0.1", port))
            sock.sendall(post(json.dumps(body).encode()))
        wait_until(lambda: metric(port, "tiered_kv_server_requests", state="running") == 2, "both running")
        proc.send_signal(signal.SIGTERM)

        def refused() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=HANG_S).close()
            except (ConnectionRefusedError, ConnectionResetError):  # reset: the listener closed mid-handshake
                return True
            return False

        wait_until(refused, "new connections refused")
        assert proc.poll() is None  # still draining: the stream has not been read
        events = sse_events(read_until_closed(stream))
        status, _, raw = parse_response(read_until_closed(plain))
        _, err = proc.communicate(timeout=HANG_S)
    finally:
        stop_cli_server(proc)
        stream.close()
        plain.close()
    assert len(stream_tokens(events)) == 200 and finish_reasons(events) == ["length"] and events[-1] == "[DONE]"
    assert status == 200 and len(json.loads(raw)["choices"][0]["token_ids"]) == 150
    assert proc.returncode == 0 and "2 completions" in err and "cut" not in err and "Traceback" not in err, err


def test_sigterm_cuts_what_is_left_at_the_drain_deadline_and_says_so(tmp_path: Path) -> None:
    """``--drain-timeout 2``, SIGTERM with three trickling clients and an idle connection
    (no whole request yet), a stream read by its client, a plain request, a stream whose
    client reads nothing and a request waiting for blocks, none of which can finish in
    2 s. The tricklers and the idle one are closed at once; at the deadline the read
    stream ends with an error event (no finish reason, no ``[DONE]``), the plain and the
    waiting request get 503; the process exits 0 soon after the deadline."""
    drain_s = 2.0
    proc, port = start_cli_server(tmp_path, "--drain-timeout", str(drain_s), "--send-timeout", str(HANG_S))
    slow = [Trickler("127.0.0.1", port) for _ in range(3)]
    idle = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
    socks = {name: socket.socket() for name in ("read", "plain", "stalled", "waiting")}
    socks["stalled"].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
    received = bytearray()

    def read() -> None:
        with contextlib.suppress(OSError):
            while chunk := socks["read"].recv(1 << 16):
                received.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    try:
        # the pool's 1024 blocks: 235 + 235 + 8 running; the waiting one needs 626 more
        for name, body in (("read", {"prompt": "abc", "max_tokens": 30_000, "stream": True}),
                           ("plain", {"prompt": "abc", "max_tokens": 30_000}),
                           ("stalled", {"prompt": "abc", "max_tokens": 1000, "stream": True}),
                           ("waiting", {"prompt": "abc", "max_tokens": 80_000})):
            socks[name].settimeout(HANG_S)
            socks[name].connect(("127.0.0.1", port))
            socks[name].sendall(post(json.dumps(body).encode()))
        reader.start()
        wait_until(lambda: (metric(port, "tiered_kv_server_requests", state="running"),
                            metric(port, "tiered_kv_server_requests", state="waiting")) == (3, 1),
                   "three running, one waiting")
        wait_until(lambda: b"token_ids" in received, "the read stream's first token")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_S)
        took = time.monotonic() - t0
        reader.join(HANG_S)
        answers = {name: parse_response(read_until_closed(socks[name])) for name in ("plain", "waiting")}
        stalled = sse_events(read_until_closed(socks["stalled"]))
    finally:
        stop_cli_server(proc)
        for t in slow:
            t.close()
        idle.close()
        for sock in socks.values():
            sock.close()
    assert proc.returncode == 0, err
    assert "4 requests cut at the drain deadline, 4 connections closed before a request arrived" in err, err
    assert "Traceback" not in err, err
    assert all(t.closed_at is not None and t.closed_at - t0 < drain_s for t in slow)  # never held up to the deadline
    events = sse_events(bytes(received))
    assert stream_tokens(events) and not finish_reasons(events) and "[DONE]" not in events
    last = json.loads(events[-1])["error"]
    assert last["code"] == 503 and "drain deadline" in last["message"] and "incomplete" in last["message"]
    for name, (status, _, raw) in answers.items():
        assert status == 503 and "shutting down" in json.loads(raw)["error"]["message"], (name, raw)
    assert "[DONE]" not in stalled and not finish_reasons(stalled)
    assert drain_s <= took < drain_s + 15  # it waited for them, then cut them: ~1 s after the deadline
    print(f"SIGTERM to exit with --drain-timeout {drain_s:g}: {took:.1f} s")


def test_the_cli_defaults_are_the_servers() -> None:
    """The CLI's parser names the server's defaults without importing torch."""
    assert (cli.MAX_RUNNING, cli.PREFILL_CHUNK, cli.STREAM_BUFFER_BYTES, cli.SEND_TIMEOUT_S, cli.DRAIN_TIMEOUT_S) == (
        engine_module.MAX_RUNNING, engine_module.PREFILL_CHUNK, _connection.STREAM_BUFFER_BYTES,
        openai_server.SEND_TIMEOUT_S, openai_server.DRAIN_TIMEOUT_S)
