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

Concurrency: requests are served on threads, but the cache is single-threaded, so one
lock (:attr:`ReferenceEngine.lock`) serializes every use of the model and the cache;
``/health`` and ``/v1/models`` do not take it. After each completion the engine waits
for the request's store writes and persists the store's counters
(:meth:`ReferenceEngine.sync_store`), so ``tiered-kv stats`` and ``warm-start --store``
see them as soon as the answer ends: a stream does it before its final ``data: [DONE]``,
a plain answer right after it is sent (so that its time stays the first token's).
"""

from __future__ import annotations

import codecs
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch

from ..cache import TieredKVCache
from ..metrics import Metric, MetricsSnapshot
from ..tokenizer import VOCAB_SIZE, encode
from .model import ReferenceModel

if TYPE_CHECKING:
    from ..layout import KVLayout

__all__ = ["Completion", "CompletionRequest", "ReferenceEngine", "RequestError", "make_server"]

#: OpenAI's default ``max_tokens`` for completions
DEFAULT_MAX_TOKENS = 16


class RequestError(Exception):
    """A request the server rejects: ``status`` and an OpenAI-style error body."""

    def __init__(self, status: HTTPStatus, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": int(self.status)}}


@dataclass(frozen=True, kw_only=True, slots=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    prompt_tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool

    @classmethod
    def parse(cls, body: object, *, served_model: str) -> CompletionRequest:
        """Validate a decoded JSON body; :class:`RequestError` (400, or 404 for another
        model) names the field and what was expected."""
        if not isinstance(body, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"expected a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and model != served_model:
            raise RequestError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist; this server "
                                                     f"serves `{served_model}`", param="model",
                               kind="NotFoundError")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            tokens = encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < VOCAB_SIZE), None)
            if bad is not None:
                raise RequestError(HTTPStatus.BAD_REQUEST, f"prompt: expected token ids in [0, {VOCAB_SIZE}) "
                                                           f"(byte-level vocabulary), got {bad}", param="prompt")
            tokens = list(prompt)
        else:
            raise RequestError(HTTPStatus.BAD_REQUEST, "prompt: expected one prompt, a string or a list of "
                                                       f"token ids, got {_kind(prompt)}", param="prompt")
        if not tokens:
            raise RequestError(HTTPStatus.BAD_REQUEST, "prompt: expected at least one token, got an empty prompt",
                               param="prompt")
        max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"max_tokens: expected an integer >= 1, got {max_tokens!r}",
                               param="max_tokens")
        for name, allowed in (("n", 1), ("best_of", 1), ("echo", False)):
            if name in body and body[name] not in (None, allowed):
                raise RequestError(HTTPStatus.BAD_REQUEST, f"{name}: this server supports only {allowed!r}, "
                                                           f"got {body[name]!r}", param=name)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stream: expected true or false, got {stream!r}",
                               param="stream")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, f"stream_options: expected an object, got {_kind(options)}",
                               param="stream_options")
        return cls(prompt_tokens=tokens, max_tokens=max_tokens, stream=stream,
                   include_usage=bool(options.get("include_usage", False)))


def _kind(x: object) -> str:
    return "a list of strings or lists (a batch: send one prompt per request)" if isinstance(x, list) \
        else type(x).__name__


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """What one completion did."""

    prompt_tokens: int
    #: prompt tokens served from the cache (GPU pool or store)
    cached_tokens: int
    token_ids: list[int]
    #: seconds from taking the model to the first generated token
    ttft_s: float


class ReferenceEngine:
    """The reference model and a :class:`TieredKVCache` over a store, behind one lock.

    Args:
        layout: the cache's layout (the reference model runs it; ``presets.tiny()``).
        store: the store URL (or chain) of the cache's disk tier.
        num_blocks, num_snapshots, snapshot_interval, salt, device, store_options: the
            cache's (one State slot: requests run one at a time).
        seed: the reference model's weights (cached KV is valid only for the weights
            that made it).
        served_model: the name ``/v1/models`` lists and requests must name.
    """

    def __init__(self, layout: KVLayout, *, store: object, served_model: str, seed: int = 0, num_blocks: int = 1024,
                 num_snapshots: int = 256, snapshot_interval: int = 1, salt: str = "", device: str = "cpu",
                 store_options: dict[str, Any] | None = None) -> None:
        self.layout = layout
        self.served_model = served_model
        self.model = ReferenceModel(layout, seed=seed)
        self.cache = TieredKVCache(layout, device=device, num_blocks=num_blocks, num_state_slots=1,
                                   num_snapshots=num_snapshots, snapshot_interval=snapshot_interval,
                                   salt=salt, store=store, store_options=store_options)
        #: every use of the model and the cache holds this
        self.lock = threading.Lock()
        #: tokens one request may hold (prompt + generated): the GPU pool's blocks
        self.max_model_len = num_blocks * layout.block_tokens
        self.created = int(time.time())
        self._counts = dict.fromkeys(("requests_ok", "requests_rejected", "requests_failed", "prompt_tokens",
                                      "cached_tokens", "computed_tokens", "generated_tokens"), 0)
        self._ttft_s = 0.0
        self._closed = False

    def complete(self, request: CompletionRequest, on_token: Callable[[int], None] | None = None) -> Completion:
        """Prefill the prompt (from its longest cached prefix) and decode greedily.

        ``on_token(id)`` is called with each generated token as it is made (streaming);
        an exception it raises (a client gone) ends the request, which is still closed.
        """
        tokens = request.prompt_tokens
        need = len(tokens) + request.max_tokens
        if need > self.max_model_len:
            raise RequestError(HTTPStatus.BAD_REQUEST,
                               f"prompt ({len(tokens)} tokens) + max_tokens ({request.max_tokens}) = {need} "
                               f"tokens: expected at most {self.max_model_len} (the server's --num-blocks "
                               f"{self.max_model_len // self.layout.block_tokens} x {self.layout.block_tokens})",
                               param="max_tokens")
        out: list[int] = []
        with self.lock:
            if self._closed:
                raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down",
                                   kind="ServiceUnavailableError")
            t0 = time.perf_counter()
            req = self.cache.open(tokens)
            cached, ttft = req.num_cached_tokens, 0.0
            try:
                logits = self.model.forward(self.cache, req, tokens[cached:])[-1]
                for i in range(request.max_tokens):
                    nxt = int(torch.argmax(logits))
                    out.append(nxt)
                    if i == 0:
                        ttft = time.perf_counter() - t0
                    if on_token is not None:
                        on_token(nxt)
                    if i + 1 < request.max_tokens:
                        logits = self.model.forward(self.cache, req, [nxt])[-1]
            finally:
                self.cache.close(req)
                c = self._counts
                c["prompt_tokens"] += len(tokens)
                c["cached_tokens"] += cached
                # the last generated token is never fed back
                c["computed_tokens"] += len(tokens) - cached + max(len(out) - 1, 0)
                c["generated_tokens"] += len(out)
                self._ttft_s += ttft
        return Completion(prompt_tokens=len(tokens), cached_tokens=cached, token_ids=out, ttft_s=ttft)

    def count(self, outcome: str) -> None:
        """Count a finished request: ``ok``, ``rejected`` (4xx) or ``failed`` (5xx)."""
        with self.lock:
            self._counts[f"requests_{outcome}"] += 1

    def sync_store(self) -> None:
        """Wait for the store writes submitted so far and persist the store's counters
        (``BlockStore.stats()`` writes an LMDB handle's pending counter deltas)."""
        with self.lock:
            if not self._closed:
                self.cache.flush()
                self.cache.stats()

    def metrics(self) -> MetricsSnapshot:
        """The cache's metrics plus the server's request and token counters."""
        with self.lock:
            snap = self.cache.metrics()
            c = dict(self._counts)
            ttft = self._ttft_s
        reqs = Metric("tiered_kv_server_requests_total", "counter", "Completion requests by outcome.")
        for outcome in ("ok", "rejected", "failed"):
            reqs.add(c[f"requests_{outcome}"], outcome=outcome)
        toks = Metric("tiered_kv_server_tokens_total", "counter",
                      "Tokens of completions: prompt, cached (prompt tokens from the cache), computed "
                      "(run through the model), generated.")
        for kind in ("prompt", "cached", "computed", "generated"):
            toks.add(c[f"{kind}_tokens"], kind=kind)
        first = Metric("tiered_kv_server_ttft_seconds_total", "counter",
                       "Seconds from taking the model to the first token, summed over completions "
                       "(divide by the ok requests for the mean).").add(ttft)
        return MetricsSnapshot([*snap.metrics, reqs, toks, first])

    def close(self) -> None:
        """Flush the store writes and close the store (idempotent); later requests get 503."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.cache.shutdown()

    def store_stats(self) -> dict[str, Any]:
        """The store's own stats (records, bytes, counters)."""
        with self.lock:
            assert self.cache.disk is not None
            return self.cache.disk.store.stats()


# ---------------------------------------------------------------- HTTP
class _Handler(BaseHTTPRequestHandler):
    """One HTTP/1.0 exchange per connection (streams end when the connection closes)."""

    server: _Server
    protocol_version = "HTTP/1.0"
    #: the 200 and the first event of a stream are out (errors then go into the stream)
    _streaming = False
    #: seconds a silent client may hold its thread (a stuck client cannot block shutdown)
    timeout = 60
    #: the largest request body accepted
    max_body = 16 << 20

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        if self.server.log is not None:
            self.server.log(f"{self.address_string()} {format % args}")

    # ---------------------------------------------------------- responses
    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_json(self, status: HTTPStatus, obj: object) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _send_error(self, err: RequestError) -> None:
        self._send_json(err.status, err.body())

    # ---------------------------------------------------------- routes
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        engine = self.server.engine
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/health":
            self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")
        elif path == "/v1/models":
            self._send_json(HTTPStatus.OK, {"object": "list", "data": [
                {"id": engine.served_model, "object": "model", "created": engine.created, "owned_by": "tiered-kv",
                 "max_model_len": engine.max_model_len}]})
        elif path == "/metrics":
            text = engine.metrics().to_prometheus().encode()
            self._send(HTTPStatus.OK, text, "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send_error(RequestError(HTTPStatus.NOT_FOUND, f"no route GET {path}; expected /v1/models, "
                                                                f"/metrics or /health", kind="NotFoundError"))

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        if path != "/v1/completions":
            self._send_error(RequestError(HTTPStatus.NOT_FOUND, f"no route POST {path}; expected /v1/completions",
                                          kind="NotFoundError"))
            return
        engine = self.server.engine
        self._streaming = False
        try:
            request = CompletionRequest.parse(self._read_json(), served_model=engine.served_model)
            if request.stream:
                self._stream(request)
            else:
                done = engine.complete(request)
                self._send_json(HTTPStatus.OK, self._body(done))
        except RequestError as err:
            engine.count("rejected" if err.status < 500 else "failed")
            self._send_error(err)
            return
        except (BrokenPipeError, ConnectionResetError):
            engine.count("failed")  # the client left mid-stream; its request was closed
            return
        except Exception as exc:  # a broken invariant: answer 500, keep the server up, say what
            engine.count("failed")
            self.server.log_error(f"completion failed: {type(exc).__name__}: {exc}")
            err = RequestError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}",
                               kind="InternalServerError")
            if self._streaming:  # the 200 and some tokens are out: end the stream with the error
                self.wfile.write(b"data: " + json.dumps(err.body()).encode() + b"\n\n")
            else:
                self._send_error(err)
            return
        engine.count("ok")
        if not request.stream:
            engine.sync_store()  # after the answer, which is the first token's time

    def _read_json(self) -> object:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise RequestError(HTTPStatus.LENGTH_REQUIRED, "expected a Content-Length header") from None
        if not 0 <= length <= self.max_body:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"body: expected at most {self.max_body} bytes, got {length}")
        try:
            return json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, f"body: expected JSON, got invalid JSON ({exc})") from None

    def _body(self, done: Completion) -> dict[str, Any]:
        text = bytes(done.token_ids).decode("utf-8", errors="replace")
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.server.engine.served_model,
                "choices": [{"index": 0, "text": text, "token_ids": done.token_ids, "logprobs": None,
                             "finish_reason": "length"}],
                "usage": _usage(done)}

    def _stream(self, request: CompletionRequest) -> None:
        """Server-sent events: one ``data: {chunk}`` per token, then the usage chunk when
        ``stream_options.include_usage``, then ``data: [DONE]``."""
        engine = self.server.engine
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> None:
            obj: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created,
                                   "model": engine.served_model, "choices": choices}
            if usage is not None:
                obj["usage"] = usage
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()

        def on_token(token: int) -> None:
            if not self._streaming:  # headers go out with the first token: errors before it are plain 4xx
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                self._streaming = True
            chunk([{"index": 0, "text": decoder.decode(bytes([token])), "token_ids": [token],
                    "logprobs": None, "finish_reason": None}])

        done = engine.complete(request, on_token)
        tail = decoder.decode(b"", final=True)
        chunk([{"index": 0, "text": tail, "token_ids": [], "logprobs": None, "finish_reason": "length"}])
        if request.include_usage:
            chunk([], _usage(done))
        # before the stream ends, so a client that reads the store's counters next sees this
        # request's (the first token went out long ago)
        engine.sync_store()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def _usage(done: Completion) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": len(done.token_ids),
            "total_tokens": done.prompt_tokens + len(done.token_ids),
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


class _Server(ThreadingHTTPServer):
    """A thread per connection; :meth:`server_close` waits for the ones in flight."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, address: tuple[str, int], engine: ReferenceEngine,
                 log: Callable[[str], None] | None) -> None:
        self.engine = engine
        self.log = log
        super().__init__(address, _Handler)

    def log_error(self, message: str) -> None:
        if self.log is not None:
            self.log(message)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = host if isinstance(host, str) else host.decode()
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def make_server(engine: ReferenceEngine, host: str = "127.0.0.1", port: int = 0, *,
                log: Callable[[str], None] | None = None) -> _Server:
    """A bound (not yet serving) HTTP server for ``engine``; ``port`` 0 picks a free port
    (``server.url`` says which). Run ``serve_forever()`` on a thread; ``shutdown()`` then
    ``server_close()`` stop it and wait for requests in flight. ``log`` receives one line
    per request (None: quiet)."""
    if ":" in host:
        import socket

        class _Server6(_Server):
            address_family = socket.AF_INET6

        return _Server6((host, port), engine, log)
    return _Server((host, port), engine, log)
