"""The reference model behind a small OpenAI-compatible completions endpoint.

``tiered-kv serve-reference`` runs it; tests and ``tiered-kv warm-start --endpoint`` talk
to it the way they talk to vLLM or SGLang. Standard library only (``http.server``)::

    POST /v1/completions   {"model", "prompt": str | [int, ...], "max_tokens", "stream",
                            "stream_options": {"include_usage": bool}}
    GET  /v1/models        {"object": "list", "data": [{"id": <served model>, ...}]}
    GET  /metrics          cache.metrics().to_prometheus() + the server's own counters
    GET  /health           200 "ok"

A string prompt is tokenized byte-level (:mod:`tiered_kv.tokenizer`); a list is token ids
in ``[0, 256)``. Decoding is greedy (``temperature``, ``top_p``, ``stop``, ... are accepted
and ignored: the reference model's weights are random, its text is not meant to be read).
Each choice carries ``token_ids`` (the generated ids, as vLLM's ``return_token_ids`` gives
them) besides ``text``, and ``usage.prompt_tokens_details.cached_tokens`` says how many
prompt tokens came from the cache (GPU pool or store), as OpenAI and vLLM report it.

The model and its cache are :class:`~.engine.ReferenceEngine`'s and the body's validation
:mod:`.protocol`'s (both re-exported here). Concurrency: requests are served on threads
and take their steps through the model in turns (see :mod:`.engine`): while others run,
a request waits at most one step of each for its next token. ``/health`` and
``/v1/models`` take no turn. After each completion the engine waits for the request's
store writes and persists the store's counters (:meth:`ReferenceEngine.sync_store`), so
``tiered-kv stats`` and ``warm-start --store`` see them as soon as the answer ends: a
stream does it before its final ``data: [DONE]``, a plain answer right after it is sent
(so that its time stays the first token's).

No client can hold the server (:mod:`._connection`):

* a request (line, headers, body) must arrive within ``request_timeout_s`` of connecting
  (one absolute deadline, not a timeout that restarts on every byte), else the connection
  is closed (408 when the body is late);
* a stream's bytes are queued and sent as the client takes them; what it leaves unread is
  bounded: more than ``stream_buffer_bytes``, or bytes of which it took none for
  ``send_timeout_s``, and the stream is cut (outcome ``cancelled``, reason
  ``unread_bytes`` / ``send_timeout``, the connection reset); a plain answer goes out
  within ``send_timeout_s``;
* between steps the request checks its connection: a client that left ends it (reason
  ``client_left``), and its turns go to the others;
* :meth:`_Server.stop` drains: it stops accepting, closes the connections whose request
  has not arrived yet, gives the requests in flight ``grace_s`` to finish, then cuts the
  rest (reason ``shutdown``): a cut stream ends with an error event and no ``[DONE]``, a
  cut plain request gets 503; never an answer that looks complete. It returns within
  about ``grace_s + 2 * cut_wait_s``.

Errors are OpenAI's JSON shape for every status, including http.server's own (a bad
request line, too many headers); a route with another method is 405 with ``Allow``.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ._connection import STREAM_BUFFER_BYTES, ClientGone, DeadlineReader, StreamSender, peer_gone
from .engine import Completion, ReferenceEngine, RequestCancelled
from .protocol import CompletionRequest, RequestError

__all__ = ["STREAM_BUFFER_BYTES", "Completion", "CompletionRequest", "ReferenceEngine", "RequestCancelled",
           "RequestError", "Stopped", "make_server"]

#: seconds from connecting by which a request (line, headers, body) must have arrived
REQUEST_TIMEOUT_S = 30.0
#: seconds an answer (or a stream's unsent rest) may take to go out to a slow client
SEND_TIMEOUT_S = 10.0
#: seconds :meth:`_Server.stop` lets the requests in flight finish before it cuts them
DRAIN_TIMEOUT_S = 30.0
#: seconds :meth:`_Server.stop` then waits for the cut requests to end (twice: before and
#: after it shuts their sockets down)
CUT_WAIT_S = 1.0

#: path -> the one method it takes and the handler method that answers it
_ROUTES: dict[str, tuple[str, str]] = {
    "/v1/completions": ("POST", "_completions"),
    "/v1/models": ("GET", "_models"),
    "/metrics": ("GET", "_metrics"),
    "/health": ("GET", "_health"),
}


class _Handler(BaseHTTPRequestHandler):
    """One HTTP/1.0 exchange per connection (streams end when the connection closes)."""

    server: _Server
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        # The whole request must arrive by one deadline: see DeadlineReader.
        self.rfile.close()
        self.rfile = io.BufferedReader(DeadlineReader(self.connection,
                                                      time.monotonic() + self.server.request_timeout_s))
        #: this connection's record with the server (its cut event, set by _Server.stop)
        self._conn = self.server.conn(self.request)
        #: the stream's sender once a stream started (errors then go into the stream)
        self._sender: StreamSender | None = None
        #: the completion's outcome, once counted (see _count)
        self._outcome: str | None = None

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        if self.server.log is not None:
            self.server.log(f"{self.address_string()} {format % args}")

    # ---------------------------------------------------------- responses
    def _send(self, status: HTTPStatus, body: bytes, content_type: str,
              headers: dict[str, str] | None = None) -> None:
        """Send a whole answer within the send timeout; :class:`ClientGone` if it cannot be."""
        try:
            self.connection.settimeout(self.server.send_timeout_s)  # sendall: one bound per call
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except OSError as exc:  # BrokenPipe, ConnectionReset, TimeoutError (a client not reading)
            raise ClientGone(f"{type(exc).__name__}: {exc}") from None

    def _send_json(self, status: HTTPStatus, obj: object, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send_error(self, err: RequestError, headers: dict[str, str] | None = None) -> None:
        self._send_json(err.status, err.body(), headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own rejections (a bad request line, too many headers, an unknown
        method) in OpenAI's error shape, like every other error."""
        status = HTTPStatus(code)
        self.close_connection = True
        self._send_error(RequestError(status, message or status.phrase, kind=status.phrase.replace(" ", "")))

    # ---------------------------------------------------------- routes
    def _route(self) -> None:
        if not self.server.begin(self.request):  # the server is draining and closed this connection
            self.close_connection = True
            return
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        route = _ROUTES.get(path)
        if route is None:
            known = ", ".join(f"{m} {p}" for p, (m, _) in _ROUTES.items())
            self._send_error(RequestError(HTTPStatus.NOT_FOUND, f"no route {self.command} {path}; expected {known}",
                                          kind="NotFoundError"))
        elif self.command != route[0]:
            self._send_error(RequestError(HTTPStatus.METHOD_NOT_ALLOWED,
                                          f"{path}: expected method {route[0]}, got {self.command}",
                                          kind="MethodNotAllowed"), headers={"Allow": route[0]})
        else:
            getattr(self, route[1])()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _route  # noqa: N815 (http.server's names)

    def _health(self) -> None:
        self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")

    def _models(self) -> None:
        engine = self.server.engine
        self._send_json(HTTPStatus.OK, {"object": "list", "data": [
            {"id": engine.served_model, "object": "model", "created": engine.created, "owned_by": "tiered-kv",
             "max_model_len": engine.max_model_len}]})

    def _metrics(self) -> None:
        text = self.server.engine.metrics().to_prometheus().encode()
        self._send(HTTPStatus.OK, text, "text/plain; version=0.0.4; charset=utf-8")

    def _completions(self) -> None:
        engine = self.server.engine
        try:
            request = CompletionRequest.parse(self._read_json(), served_model=engine.served_model)
            if request.stream:
                self._stream(request)
            else:
                done = engine.complete(request, cancelled=self._abandoned)
                self._count("ok")  # before the answer: a client that reads it sees it in /metrics
                self._send_json(HTTPStatus.OK, self._body(done))  # after the lock: see _send
        except RequestError as err:
            self._count("rejected" if err.status < 500 else "failed")
            self._send_error(err)
            return
        except RequestCancelled as exc:  # the request was closed; say so to the client if it can hear it
            self._count("cancelled", exc.reason)
            self._cancelled(exc)
            return
        except ClientGone:  # the answer could not go out: the client left or did not read it in time
            self._count("cancelled", "client_left")
            return
        except Exception as exc:  # a broken invariant: answer 500, keep the server up, say what
            self._count("failed")
            self.server.log_error(f"completion failed: {type(exc).__name__}: {exc}")
            err = RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}",
                               kind="InternalServerError")
            if self._sender is not None and self._sender.started:  # the 200 is out: end the stream with it
                self._sender.offer(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
                self._sender.drain(self.server.send_timeout_s)
            else:
                self._send_error(err)
            return
        if not request.stream:
            engine.sync_store()  # after the answer, which is the first token's time

    def _count(self, outcome: str, reason: str | None = None) -> None:
        """Count this request's outcome once: the first one counted stands (a completion
        whose client leaves while its answer goes out stays ``ok``)."""
        if self._outcome is None:
            self._outcome = outcome
            self.server.engine.count(outcome, reason)

    def _abandoned(self) -> str | None:
        """Why the request in progress should stop, or None: the server cut its connection
        (``shutdown``), or its client left (``client_left``)."""
        if self._conn.cut.is_set():
            return "shutdown"
        if (self._sender is not None and self._sender.broken) or peer_gone(self.connection):
            return "client_left"
        return None

    def _cancelled(self, exc: RequestCancelled) -> None:
        """End a cancelled completion's answer. Cut at shutdown: a stream gets an error
        event and no ``[DONE]``, a plain request 503, so neither looks complete. A slow
        reader's stream is reset at once (what it left unread is dropped). A client that
        left gets nothing."""
        sender = self._sender
        if exc.reason == "shutdown":
            err = RequestError(HTTPStatus.SERVICE_UNAVAILABLE,
                               f"the server is shutting down and cut this request at its drain deadline ({exc}); "
                               f"the answer is incomplete", kind="ServiceUnavailableError")
            with contextlib.suppress(ClientGone):
                if sender is not None and sender.started:
                    sender.offer(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
                    sender.drain(self.server.send_timeout_s)  # stop() shuts the socket if it takes too long
                else:
                    self._send_error(err)
        elif exc.reason in ("unread_bytes", "send_timeout"):
            assert sender is not None
            unread = sender.unread_bytes()
            sender.abandon()
            self.close_connection = True
            with contextlib.suppress(OSError):  # a reset: the kernel drops the unsent bytes too
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            limit = (f"more than {sender.max_unread_bytes} bytes unread" if exc.reason == "unread_bytes" else
                     f"no byte taken for {self.server.send_timeout_s:g} s")
            self.server.log_error(f"{self.address_string()}: stream cut after {exc}: {limit} "
                                  f"({unread} bytes unread)")

    def _read_json(self) -> object:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "expected a Content-Length header "
                                                           "with the body's size in bytes") from None
        if not 0 <= length <= self.server.max_body:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"body: expected at most {self.server.max_body} bytes, got {length}")
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            raise RequestError(HTTPStatus.REQUEST_TIMEOUT,
                               f"body: expected {length} bytes (Content-Length) within "
                               f"{self.server.request_timeout_s:g} s of connecting") from None
        except OSError as exc:
            raise ClientGone(f"{type(exc).__name__}: {exc}") from None
        if len(raw) < length:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"body: expected {length} bytes (Content-Length), got "
                                                       f"{len(raw)} before the client ended it")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"body: expected JSON, got invalid JSON ({exc})") from None
        except RecursionError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "body: expected JSON, got JSON nested too deeply "
                                                       "to read") from None

    def _body(self, done: Completion) -> dict[str, Any]:
        text = bytes(done.token_ids).decode("utf-8", errors="replace")
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.server.engine.served_model,
                "choices": [{"index": 0, "text": text, "token_ids": done.token_ids, "logprobs": None,
                             "finish_reason": "length"}],
                "usage": _usage(done)}

    def _stream(self, request: CompletionRequest) -> None:
        """Server-sent events: one ``data: {chunk}`` per token, then the usage chunk when
        ``stream_options.include_usage``, then ``data: [DONE]``.

        Tokens are queued on a :class:`StreamSender`, which sends what the client takes at
        once. Between tokens the stream stops if its client left more than the stream
        buffer unread or took nothing for the send timeout (see :meth:`_cancelled`). The
        end (the finish, usage and ``[DONE]``) goes out within the send timeout.
        """
        engine = self.server.engine
        sender = self._sender = StreamSender(self.connection, max_unread_bytes=self.server.stream_buffer_bytes)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            obj: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created,
                                   "model": engine.served_model, "choices": choices}
            if usage is not None:
                obj["usage"] = usage
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        def on_token(token: int) -> None:  # between this request's turns: queues, never blocks
            if not sender.started:  # the head goes out with the first token: errors before it are plain 4xx
                sender.start(self._stream_head())
            sender.offer(event([{"index": 0, "text": decoder.decode(bytes([token])), "token_ids": [token],
                                 "logprobs": None, "finish_reason": None}]))

        send_timeout_s = self.server.send_timeout_s
        done = engine.complete(request, on_token,
                               cancelled=lambda: self._abandoned() or sender.overrun(send_timeout_s))
        self._count("ok")  # every token is made; before [DONE], so a client that reads it sees it counted
        tail = decoder.decode(b"", final=True)
        sender.offer(event([{"index": 0, "text": tail, "token_ids": [], "logprobs": None, "finish_reason": "length"}]))
        if request.include_usage:
            sender.offer(event([], _usage(done)))
        # before the stream ends, so a client that reads the store's counters next sees this
        # request's (the first token went out long ago)
        engine.sync_store()
        sender.offer(b"data: [DONE]\n\n")
        if not sender.drain(self.server.send_timeout_s):
            raise ClientGone("the stream's client left or stopped reading")

    def _stream_head(self) -> bytes:
        self.log_request(HTTPStatus.OK)
        return (f"{self.protocol_version} 200 OK\r\nServer: {self.version_string()}\r\n"
                f"Date: {self.date_time_string()}\r\nContent-Type: text/event-stream\r\n"
                f"Cache-Control: no-cache\r\n\r\n").encode("latin-1")


def _usage(done: Completion) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": len(done.token_ids),
            "total_tokens": done.prompt_tokens + len(done.token_ids),
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


#: SO_LINGER on, 0 s: close() resets the connection and drops what is unsent
_LINGER_RESET = b"\x01\x00\x00\x00\x00\x00\x00\x00"


@dataclass(frozen=True, slots=True)
class Stopped:
    """What :meth:`_Server.stop` did to the connections still open when it was called."""

    #: connections whose request had not arrived yet: closed at once
    closed: int
    #: connections whose request was still in flight at the drain deadline: cut
    cut: int


class _Conn:
    """The server's record of one open connection."""

    __slots__ = ("cut", "busy")

    def __init__(self) -> None:
        #: set by stop(): the request stops at its next step, or the connection is closed
        self.cut = threading.Event()
        #: its request has arrived (it is in flight): stop() lets it finish, up to the deadline
        self.busy = False


class _Server(ThreadingHTTPServer):
    """A daemon thread per connection; :meth:`stop` drains them and ends them all within a
    bound, whatever the clients do (see the module docstring)."""

    daemon_threads = True
    block_on_close = False
    #: the largest request body accepted
    max_body = 16 << 20

    def __init__(self, address: tuple[str, int], engine: ReferenceEngine, log: Callable[[str], None] | None, *,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, send_timeout_s: float = SEND_TIMEOUT_S,
                 stream_buffer_bytes: int = STREAM_BUFFER_BYTES) -> None:
        for name, value in (("request_timeout_s", request_timeout_s), ("send_timeout_s", send_timeout_s)):
            if not 0 < value < float("inf"):
                raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
        if isinstance(stream_buffer_bytes, bool) or not isinstance(stream_buffer_bytes, int) \
                or stream_buffer_bytes < 1:
            raise ValueError(f"stream_buffer_bytes: expected an integer >= 1, got {stream_buffer_bytes!r}")
        self.engine = engine
        self.log = log
        self.request_timeout_s = request_timeout_s
        self.send_timeout_s = send_timeout_s
        self.stream_buffer_bytes = stream_buffer_bytes
        #: open connections -> their record
        self._live: dict[socket.socket, _Conn] = {}
        self._live_changed = threading.Condition()
        #: stop() was called: no request starts any more
        self._draining = False
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._live_changed:
            self._live[request] = _Conn()
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._live_changed:
            self._live.pop(request, None)
            self._live_changed.notify_all()

    def conn(self, request: Any) -> _Conn:
        """The record of the open connection ``request``."""
        with self._live_changed:
            return self._live.setdefault(request, _Conn())

    def begin(self, request: Any) -> bool:
        """The request of connection ``request`` has arrived: mark it in flight. False when
        the server is draining and closed the connection first (the client got no answer,
        so it may safely send the request again, elsewhere)."""
        with self._live_changed:
            conn = self._live.setdefault(request, _Conn())
            if conn.cut.is_set():
                return False
            conn.busy = True
            return True

    def open_connections(self) -> int:
        with self._live_changed:
            return len(self._live)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that left or stalled is no error of the server's: one log line (with
        ``log``), no traceback. Anything else is a bug: its traceback goes to stderr."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ClientGone, ConnectionError, TimeoutError)):
            if self.log is not None:
                self.log(f"{client_address[0]}: connection ended early: {type(exc).__name__}: {exc}")
            return
        super().handle_error(request, client_address)

    def stop(self, grace_s: float = DRAIN_TIMEOUT_S, cut_wait_s: float = CUT_WAIT_S) -> Stopped:
        """Drain and stop, within about ``grace_s + 2 * cut_wait_s`` seconds whatever the
        clients do.

        Call it from another thread than :meth:`serve_forever`'s. New connections are
        refused, and the open ones whose request has not arrived yet (idle, or sending
        slowly) are closed at once. The requests in flight get ``grace_s`` seconds to
        finish. Each one left then is cut: it stops at its next step and says so (a
        stream's error event, a 503; see ``_Handler._cancelled``); ``cut_wait_s`` later the
        sockets still open are shut down, which wakes a thread blocked reading or
        sending. Threads that still run ``cut_wait_s`` after that are daemon threads,
        left behind.
        """
        self.shutdown()      # serve_forever returns: no more accepts
        self.server_close()  # the listening socket is closed (the handler threads are not joined)
        with self._live_changed:
            self._draining = True
            idle = [sock for sock, conn in self._live.items() if not conn.busy]
            for sock in idle:
                self._live[sock].cut.set()  # begin() now refuses it
        for sock in idle:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._live_changed:
            self._live_changed.wait_for(lambda: not self._live, timeout=grace_s)
            left = [(sock, conn) for sock, conn in self._live.items() if sock not in idle]
            for _, conn in left:
                conn.cut.set()
            self._live_changed.wait_for(lambda: not self._live, timeout=cut_wait_s)  # they say why, and end
            stuck = list(self._live)
        for sock in stuck:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._live_changed:
            self._live_changed.wait_for(lambda: not self._live, timeout=cut_wait_s)
        return Stopped(closed=len(idle), cut=len(left))

    def log_error(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host if isinstance(host, str) else host.decode()
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def make_server(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0, *,
                log: Callable[[str], None] | None = None, request_timeout_s: float = REQUEST_TIMEOUT_S,
                send_timeout_s: float = SEND_TIMEOUT_S, stream_buffer_bytes: int = STREAM_BUFFER_BYTES) -> _Server:
    """A bound (not yet serving) HTTP server for ``engine``; ``port`` 0 picks a free port
    (``server.url`` says which). Run ``serve_forever()`` on a thread; ``stop()`` drains
    and ends it within a bound (see :meth:`_Server.stop`). ``log`` receives one line per
    request (None: quiet). ``request_timeout_s``: the deadline of each request's arrival;
    ``send_timeout_s``: how long an answer may take to go out, and how long a stream's
    client may take no byte of what waits for it; ``stream_buffer_bytes``: how many bytes
    a stream's client may leave unread before the stream is cut."""
    options = {"request_timeout_s": request_timeout_s, "send_timeout_s": send_timeout_s,
               "stream_buffer_bytes": stream_buffer_bytes}
    if ":" in host:
        class _Server6(_Server):
            address_family = socket.AF_INET6

        return _Server6((host, port), engine, log, **options)
    return _Server((host, port), engine, log, **options)
