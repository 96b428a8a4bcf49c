"""``tiered-kv serve-reference``'s server in-process: completions equal the naive greedy
decode, streaming, usage, /v1/models, /metrics, /health and the errors it answers."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_kv import presets
from tiered_kv.reference import ReferenceModel
from tiered_kv.reference.openai_server import ReferenceEngine, make_server
from tiered_kv.tokenizer import encode

SERVED = "ref-test"
PROMPT = "The tiered cache keeps full blocks in the store and resumes prompts from them. " * 3


def naive_greedy(model: ReferenceModel, tokens: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from full recomputes (no cache)."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(model.naive_logits(tokens + out)[-1])))
    return out


class Server:
    """An in-process server on a free loopback port."""

    def __init__(self, store: Path, **engine_options: Any) -> None:
        self.engine = ReferenceEngine(presets.tiny(), store=f"lmdb://{store}", served_model=SERVED, seed=0,
                                      **engine_options)
        self.httpd = make_server(self.engine, "127.0.0.1", 0)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        self.host, self.port = self.httpd.server_address[:2]

    def request(self, method: str, path: str, body: object = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
            conn.request(method, path, body=data)
            resp = conn.getresponse()
            return resp.status, dict(resp.getheaders()), resp.read()
        finally:
            conn.close()

    def complete(self, **body: Any) -> dict[str, Any]:
        status, _, raw = self.request("POST", "/v1/completions", body)
        assert status == 200, raw
        return json.loads(raw)

    def stop(self) -> None:
        self.httpd.stop()
        self.thread.join()
        self.engine.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "store", num_blocks=64, num_snapshots=16)
    yield s
    s.stop()


def test_completion_is_the_naive_greedy_decode(server: Server, tiny_model: ReferenceModel) -> None:
    tokens = encode(PROMPT)
    want = naive_greedy(tiny_model, tokens, 3)
    by_text = server.complete(model=SERVED, prompt=PROMPT, max_tokens=3)
    assert by_text["object"] == "text_completion" and by_text["model"] == SERVED
    (choice,) = by_text["choices"]
    assert choice["token_ids"] == want and choice["finish_reason"] == "length"
    assert choice["text"] == bytes(want).decode("utf-8", errors="replace")
    assert by_text["usage"]["prompt_tokens"] == len(tokens) and by_text["usage"]["completion_tokens"] == 3
    assert by_text["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # the same prompt as token ids (a batch of one): its full blocks now come from the GPU pool
    by_ids = server.complete(prompt=[tokens], max_tokens=3)
    assert by_ids["choices"][0]["token_ids"] == want
    cached = by_ids["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == len(tokens) // 128 * 128 > 0


def test_stream_sends_one_event_per_token_then_usage_and_done(server: Server, tiny_model: ReferenceModel) -> None:
    tokens = encode(PROMPT)[:200]
    status, headers, raw = server.request("POST", "/v1/completions", {
        "prompt": tokens, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    events = [line[len("data: "):] for line in raw.decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert ids == naive_greedy(tiny_model, tokens, 4)
    assert [len(c["choices"]) for c in chunks] == [1, 1, 1, 1, 1, 0]  # 4 tokens, the finish, the usage
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 200, "completion_tokens": 4, "total_tokens": 204,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == bytes(ids).decode("utf-8", "replace")


def test_models_health_and_metrics(server: Server) -> None:
    status, _, raw = server.request("GET", "/v1/models")
    assert status == 200
    (model,) = json.loads(raw)["data"]
    assert model["id"] == SERVED and model["max_model_len"] == 64 * 128
    assert server.request("GET", "/health")[:1] == (200,)

    server.complete(prompt=PROMPT, max_tokens=2)
    server.complete(prompt=PROMPT, max_tokens=1)
    status, headers, raw = server.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = dict(line.rsplit(" ", 1) for line in raw.decode().splitlines() if not line.startswith("#"))
    n = len(encode(PROMPT))
    cached = n // 128 * 128
    assert samples['tiered_kv_server_requests_total{outcome="ok"}'] == "2"
    assert samples['tiered_kv_server_tokens_total{kind="prompt"}'] == str(2 * n)
    assert samples['tiered_kv_server_tokens_total{kind="cached"}'] == str(cached)
    # the first request computes its prompt and feeds back 1 of its 2 tokens; the second its tail
    assert samples['tiered_kv_server_tokens_total{kind="computed"}'] == str(n + 1 + n - cached)
    assert samples['tiered_kv_tokens_total{kind="cached"}'] == str(cached)  # the cache's own metrics
    assert 'tiered_kv_bytes{tier="disk"}' in samples


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"prompt": [1, 2, 256]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "a", "n": 2}, 400, "n"),
    ({"prompt": "a", "stream": "yes"}, 400, "stream"),
    ({"prompt": "a", "model": "other"}, 404, "model"),
    ({"prompt": "a" * 64 * 128}, 400, "max_tokens"),  # longer than the pool holds
])
def test_bad_requests_get_openai_errors(server: Server, body: dict, status: int, param: str) -> None:
    got, _, raw = server.request("POST", "/v1/completions", body)
    err = json.loads(raw)["error"]
    assert (got, err["param"], err["code"]) == (status, param, status)
    assert err["message"]


def test_bad_json_and_unknown_routes(server: Server) -> None:
    got, _, raw = server.request("POST", "/v1/completions", b"{not json")
    assert got == 400 and "invalid JSON" in json.loads(raw)["error"]["message"]
    assert server.request("GET", "/v1/nope")[0] == 404
    assert server.request("POST", "/v1/chat/completions", {"prompt": "a"})[0] == 404
    # the server still answers, and counted what it rejected
    server.complete(prompt="a", max_tokens=1)
    assert server.engine.metrics().get("tiered_kv_server_requests_total", outcome="rejected") == 1  # the bad JSON


def test_closed_engine_answers_503(tmp_path: Path) -> None:
    s = Server(tmp_path / "store", num_blocks=8, num_snapshots=4)
    try:
        s.engine.close()
        got, _, raw = s.request("POST", "/v1/completions", {"prompt": "a"})
        assert got == 503 and "shutting down" in json.loads(raw)["error"]["message"]
    finally:
        s.stop()


def test_port_in_use_exits_1_and_closes_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tiered_kv.cli.main import main
    from tiered_kv.storage import open_store

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve-reference", "--store", str(tmp_path / "store"), "--port", str(port),
                     "--num-blocks", "8", "--num-snapshots", "4"])
    err = capsys.readouterr().err
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    # the store was closed: this process can open it again
    open_store(f"lmdb://{tmp_path / 'store'}", layout_fingerprint=presets.tiny().fingerprint).close()


@pytest.mark.parametrize(("args", "message"), [
    (["--max-running", "16", "--num-snapshots", "16"], "--max-running: expected fewer than --num-snapshots (16"),
    (["--stream-buffer", "0"], "--stream-buffer: expected a positive size"),
    (["--drain-timeout", "-1"], "--drain-timeout: expected a finite number of seconds > 0"),
    (["--send-timeout", "inf"], "--send-timeout: expected a finite number of seconds > 0"),
    (["--prefill-chunk", "0"], "--prefill-chunk: expected a positive integer"),
])
def test_bad_serving_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                    message: str) -> None:
    from tiered_kv.cli.main import main

    code = main(["serve-reference", "--store", str(tmp_path / "store"), *args])
    assert code == 2 and message in capsys.readouterr().err.replace("argument ", "")


def test_client_leaving_mid_stream_leaves_no_request_open(server: Server, tiny_model: ReferenceModel) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 40, "stream": True}).encode()
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert sock.recv(64).startswith(b"HTTP/1.0 200")  # the first token is out; hang up
    # the server goes on: the next completion is exact and no request stayed open
    assert server.complete(prompt="abc", max_tokens=2)["choices"][0]["token_ids"] == \
        naive_greedy(tiny_model, encode("abc"), 2)
    with server.engine.lock:
        assert server.engine.cache.stats()["live_requests"] == 0


def test_failure_mid_stream_ends_the_stream_with_an_error_event(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken invariant after the first token: the client reads an error event, not a
    second HTTP status line; the server counts it as failed and goes on."""
    real = server.engine.model.forward
    calls = []

    def forward(cache: Any, req: Any, tokens: Any) -> torch.Tensor:
        calls.append(len(tokens))
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real(cache, req, tokens)

    monkeypatch.setattr(server.engine.model, "forward", forward)
    status, _, raw = server.request("POST", "/v1/completions", {"prompt": "abc", "max_tokens": 5, "stream": True})
    events = [json.loads(e[len("data: "):]) for e in raw.decode().split("\n\n") if e]
    assert status == 200 and [len(e.get("choices", [])) for e in events] == [1, 1, 0]
    assert events[-1]["error"]["message"] == "RuntimeError: injected" and events[-1]["error"]["code"] == 500
    assert server.engine.metrics().get("tiered_kv_server_requests_total", outcome="failed") == 1
    monkeypatch.undo()
    assert len(server.complete(prompt="abc", max_tokens=2)["choices"][0]["token_ids"]) == 2
