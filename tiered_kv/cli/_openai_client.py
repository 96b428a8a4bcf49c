"""A minimal client of an OpenAI-compatible completions server (vLLM, SGLang, ``serve-reference``).

Only standard fields are sent — ``model``, ``prompt``, ``max_tokens``, ``temperature``,
``stream``, ``stream_options.include_usage`` — and only standard fields are read:
``choices[].text``, ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``
(reported by OpenAI, by vLLM with ``--enable-prompt-tokens-details``, and by SGLang; absent
ones are ``None``). ``http.client`` directly: no proxy settings are applied, timing starts
at the request and nothing else is in the way.

Time to first token (TTFT) is measured here, on the client: from sending the request to
the first server-sent event that carries a choice. Streaming is tried first; a server that
rejects ``stream_options`` is asked again without it, and one that rejects ``stream`` (or
answers a stream request with plain JSON) is timed to its whole answer, which for
``max_tokens=1`` is the time to the first token plus one response's overhead
(:attr:`Mode.FULL`). The mode found on the first request is kept for the rest.
"""

from __future__ import annotations

import enum
import http.client
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["EndpointError", "EndpointUnreachable", "FirstToken", "Mode", "OpenAIClient"]


class EndpointError(Exception):
    """The endpoint answered something else than a completion (HTTP error, bad JSON)."""


class EndpointUnreachable(EndpointError):
    """No connection to the endpoint (refused, unknown host, connect timeout)."""


class Mode(enum.Enum):
    """How a completion is requested and timed."""

    #: ``stream`` with ``stream_options.include_usage``: TTFT at the first event, usage at the end
    STREAM_USAGE = "stream"
    #: ``stream`` only (the server rejected ``stream_options``): no usage
    STREAM = "stream-no-usage"
    #: not streamed: TTFT is the whole answer's time
    FULL = "full"


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstToken:
    """One ``max_tokens=1`` completion, timed."""

    #: seconds from sending the request to the first token (the whole answer in Mode.FULL)
    ttft_s: float
    #: seconds from sending the request to the end of the answer
    total_s: float
    mode: Mode
    text: str
    #: from ``usage`` when the server reports it, else None
    prompt_tokens: int | None
    cached_tokens: int | None


class OpenAIClient:
    """Completions against ``url``: ``http://host:port`` or ``http://host:port/v1``.

    ``timeout_s`` bounds connecting and each wait for data.
    """

    def __init__(self, url: str, *, timeout_s: float = 300.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url: expected http://host:port or https://host:port (optionally with /v1), "
                             f"got {url!r}")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"url: expected a port number in {url!r}") from None
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = port
        path = parts.path.rstrip("/")
        self.prefix = path if path.endswith("/v1") else path + "/v1"
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        #: ``http://host:port/v1``: what messages name
        self.url = f"{self.scheme}://{netloc}{'' if port is None else f':{port}'}{self.prefix}"
        self.timeout_s = timeout_s
        self.mode: Mode | None = None

    # ------------------------------------------------------------ requests
    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def _request(self, method: str, route: str, body: dict[str, Any] | None = None
                 ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connect()
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json, text/event-stream"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            if isinstance(exc, TimeoutError):
                reason = f"no connection within {self.timeout_s:g} s (--timeout)"
            else:
                reason = _reason(exc)
            raise EndpointUnreachable(f"cannot connect to {self.url}: {reason}; is the server running, "
                                      f"and is this its address?") from None
        try:
            conn.request(method, self.prefix + route, body=data, headers=headers)
            return conn, conn.getresponse()
        except TimeoutError:
            conn.close()
            raise EndpointError(f"{self.url}{route}: no answer within {self.timeout_s:g} s (--timeout)") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise EndpointError(f"{self.url}{route}: the connection broke: {_reason(exc)}") from None

    def _read_json(self, resp: http.client.HTTPResponse, what: str) -> Any:
        raw = self._read(resp)
        try:
            return _loads(raw)
        except ValueError:
            raise EndpointError(f"{self.url}{what}: expected a JSON answer, got {_preview(raw)}") from None

    def _read(self, resp: http.client.HTTPResponse) -> bytes:
        try:
            return resp.read()
        except TimeoutError:
            raise EndpointError(f"{self.url}: the answer stopped for {self.timeout_s:g} s (--timeout)") from None
        except (OSError, http.client.HTTPException) as exc:
            raise EndpointError(f"{self.url}: the connection broke mid-answer: {_reason(exc)}") from None

    def _check_status(self, resp: http.client.HTTPResponse, what: str) -> None:
        if 200 <= resp.status < 300:
            return
        raise EndpointError(f"{self.url}{what}: HTTP {resp.status} {resp.reason}: {_error_message(self._read(resp))}")

    # ------------------------------------------------------------ the API
    def models(self) -> list[str]:
        """The ids ``GET /v1/models`` lists."""
        conn, resp = self._request("GET", "/models")
        try:
            self._check_status(resp, "/models")
            body = self._read_json(resp, "/models")
        finally:
            conn.close()
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise EndpointError(f"{self.url}/models: expected {{\"data\": [{{\"id\": ...}}, ...]}}, got "
                                f"{_show_json(body)}")
        return [m["id"] for m in data]

    def first_token(self, prompt: str | list[int], model: str) -> FirstToken:
        """Complete ``prompt`` with ``max_tokens=1`` and time its first token.

        The first call finds the mode (see the module docstring); raises
        :class:`EndpointUnreachable` or :class:`EndpointError` naming the URL.
        """
        modes = [self.mode] if self.mode is not None else list(Mode)
        for i, mode in enumerate(modes):
            try:
                got = self._complete(prompt, model, mode)
            except _Rejected as exc:
                if i + 1 < len(modes):
                    continue  # try the next, plainer mode
                raise EndpointError(str(exc)) from None
            self.mode = got.mode
            return got
        raise AssertionError("unreachable: the last mode raises or returns")

    def _complete(self, prompt: str | list[int], model: str, mode: Mode) -> FirstToken:
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if mode is not Mode.FULL:
            body["stream"] = True
        if mode is Mode.STREAM_USAGE:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        conn, resp = self._request("POST", "/completions", body)
        try:
            if resp.status in (400, 422) and mode is not Mode.FULL:
                raise _Rejected(f"{self.url}/completions: HTTP {resp.status}: {_error_message(self._read(resp))}")
            self._check_status(resp, "/completions")
            if resp.getheader("Content-Type", "").startswith("text/event-stream"):
                return self._read_stream(resp, t0, mode)
            answer = self._read_json(resp, "/completions")  # not streamed (asked or not)
            total = time.perf_counter() - t0
            return self._first_token(answer, ttft=total, total=total, mode=Mode.FULL)
        finally:
            conn.close()

    def _read_stream(self, resp: http.client.HTTPResponse, t0: float, mode: Mode) -> FirstToken:
        """Read server-sent events to ``[DONE]`` (or the end); TTFT at the first choice."""
        ttft: float | None = None
        text = ""
        usage: Any = None
        while True:
            try:
                line = resp.readline()
            except TimeoutError:
                raise EndpointError(f"{self.url}/completions: the stream stopped for {self.timeout_s:g} s "
                                    f"(--timeout)") from None
            except (OSError, http.client.HTTPException) as exc:
                raise EndpointError(f"{self.url}/completions: the stream broke: {_reason(exc)}") from None
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            try:
                event = _loads(data)
            except ValueError:
                raise EndpointError(f"{self.url}/completions: expected a JSON event in the stream, got "
                                    f"{_preview(data)}") from None
            if not isinstance(event, dict):
                raise EndpointError(f"{self.url}/completions: expected a JSON object event, got {_preview(data)}")
            if "error" in event:
                raise EndpointError(f"{self.url}/completions: the stream reported an error: "
                                    f"{_error_message(data)}")
            choices = event.get("choices")
            if choices is None:
                choices = []
            if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                raise EndpointError(f"{self.url}/completions: expected an event with \"choices\": a list of "
                                    f"objects, got {_preview(data)}")
            if choices and ttft is None:
                ttft = time.perf_counter() - t0
            for c in choices:
                text += str(c.get("text") or "")
            if event.get("usage"):
                usage = event["usage"]
        total = time.perf_counter() - t0
        if ttft is None:
            raise EndpointError(f"{self.url}/completions: the stream ended without a token")
        return FirstToken(ttft_s=ttft, total_s=total, mode=mode, text=text, **_usage_counts(usage))

    def _first_token(self, answer: Any, *, ttft: float, total: float, mode: Mode) -> FirstToken:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise EndpointError(f"{self.url}/completions: expected {{\"choices\": [{{\"text\": ...}}]}}, got "
                                f"{_show_json(answer)}")
        return FirstToken(ttft_s=ttft, total_s=total, mode=mode, text=str(choices[0].get("text") or ""),
                          **_usage_counts(answer.get("usage")))


class _Rejected(Exception):
    """The server rejected the request's form (400/422): try a plainer mode."""


def _usage_counts(usage: Any) -> dict[str, int | None]:
    prompt = cached = None
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            prompt = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached = details["cached_tokens"]
    return {"prompt_tokens": prompt, "cached_tokens": cached}


def _error_message(raw: bytes) -> str:
    """The ``error.message`` (or ``message`` / ``detail``) of an error body, else a preview."""
    try:
        body = _loads(raw)
    except ValueError:
        return _preview(raw)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            for key in ("message", "detail"):
                if isinstance(err.get(key), str):
                    return err[key]
        if isinstance(err, str):
            return err
    return _preview(raw)


def _loads(raw: bytes) -> Any:
    """``json.loads``; ValueError for anything that is not a JSON document it can read: bad
    JSON, bad UTF-8 (both ValueErrors already) or nesting too deep for the parser."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _show_json(obj: Any) -> str:
    """A preview of a decoded JSON answer for a message."""
    try:
        return _preview(json.dumps(obj).encode())
    except (RecursionError, ValueError):
        return "a JSON value nested too deeply to show"


def _preview(raw: bytes, limit: int = 200) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    if not text:
        return "an empty body"
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
