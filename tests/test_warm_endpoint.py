"""``tiered-kv warm-start --endpoint`` against live servers on loopback.

End to end: two ``tiered-kv serve-reference`` processes in turn on one LMDB store; the
first is warmed cold, stopped with SIGTERM, the second answers the same prompts from the
store (store hits rise, cached tokens rise, TTFT drops) and its completions equal the
reference model's naive greedy decode. Then the client against servers that are down,
answer errors, or do not stream.
"""

from __future__ import annotations

import http.client
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_kv.cli.main import ExitCode, main
from tiered_kv.reference import ReferenceModel
from tiered_kv.tokenizer import encode

# Two prompts share a system prompt of 3+ blocks; a third is token ids; every prompt is
# 3-5 blocks of 128 byte-tokens, so a cold prefill costs several times a resumed one.
SYSTEM = ("You are the operator's assistant for a tiered KV cache: GPU pool, pinned host memory "
          "and a verified disk store keyed by a chained prefix hash. Every answer names the tier "
          "it is about, says what is checked on a read, and what a restart keeps. ") * 2
PROMPTS = [
    {"id": "ops-a", "text": SYSTEM + "Q: a restart happened; which prompts resume from disk, and why?"},
    {"id": "ops-b", "text": SYSTEM + "Q: the disk is full; what happens to writes and to the reads after?"},
    {"id": "ids", "tokens": [(i * 53 + 7) % 256 for i in range(450)]},
]
SERVER_START_S = 120


def write_prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def prompt_tokens(p: dict[str, Any]) -> list[int]:
    return encode(p["text"]) if "text" in p else p["tokens"]


class ServerProcess:
    """``tiered-kv serve-reference --port 0`` in a child process; ``url`` from its first line."""

    def __init__(self, store: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "tiered_kv.cli", "serve-reference", "--store", str(store), "--port", "0",
               "--num-blocks", "64", "--num-snapshots", "32", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.first_line = self._read_first_line()
        if "--json" in extra:
            info = json.loads(self.first_line)
            assert info["model"] == "tiered-kv-reference-tiny" and info["store"] == f"lmdb://{store}"
            self.url = info["url"]
        else:
            assert self.first_line.startswith("listening on http://127.0.0.1:"), self.first_line
            self.url = self.first_line.split()[2]
        assert self.url.startswith("http://127.0.0.1:")

    def _read_first_line(self) -> str:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=SERVER_START_S):
            self.proc.kill()
            pytest.fail(f"serve-reference printed nothing in {SERVER_START_S} s")
        line = self.proc.stdout.readline()
        if not line:
            _, err = self.proc.communicate(timeout=30)
            pytest.fail(f"serve-reference exited {self.proc.returncode} before listening: {err}")
        return line.strip()

    def complete(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens}))
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == 200, body
            return json.loads(body)
        finally:
            conn.close()

    def stop(self, sig: int | None = signal.SIGTERM) -> tuple[int, str]:
        """Send ``sig`` (None: none, it was sent) and wait for the exit; (code, stderr)."""
        if sig is not None:
            self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=30)


@pytest.fixture
def servers() -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    yield started
    for s in started:
        s.kill()


def warm(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main(["warm-start", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == ExitCode.OK, err
    return json.loads(out)


def naive_greedy(model: ReferenceModel, tokens: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(torch.argmax(model.naive_logits(tokens + out)[-1])))
    return out


@pytest.mark.slow
def test_second_server_on_the_same_store_answers_from_disk(
        tmp_path: Path, servers: list[ServerProcess], tiny_model: ReferenceModel,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    lengths = [len(prompt_tokens(p)) for p in PROMPTS]
    assert all(3 * 128 < n < 5 * 128 for n in lengths)

    first = ServerProcess(store)
    servers.append(first)
    cold = warm(capsys, "--endpoint", first.url, "--prompts", str(prompts), "--store", str(store))
    code, err = first.stop()
    assert code == 0, err
    assert "stopped; 3 completions" in err

    second = ServerProcess(store)
    servers.append(second)
    warmed = warm(capsys, "--endpoint", second.url, "--prompts", str(prompts), "--store", str(store))
    # a prompt this server never saw, whose system prompt the store holds: resumed from disk
    fresh = SYSTEM + "Q: and what does verify check?"
    fresh_answer = second.complete(fresh, max_tokens=2)
    answers = [second.complete(p.get("text", p.get("tokens")), max_tokens=1) for p in PROMPTS]
    code, err = second.stop(signal.SIGINT)
    assert code == 0, err

    for run, url in ((cold, first.url), (warmed, second.url)):
        assert run["endpoint"] == url + "/v1" and run["model"] == "tiered-kv-reference-tiny"
        assert run["mode"] == "stream" and run["store"] == f"lmdb://{store}" and run["summary"] is None
        (p,) = run["passes"]
        assert [r["id"] for r in p["prompts"]] == [q["id"] for q in PROMPTS]
        assert [r["prompt_tokens"] for r in p["prompts"]] == lengths
        assert all(0 < r["ttft_s"] <= r["total_s"] for r in p["prompts"])
    (c,), (w,) = cold["passes"], warmed["passes"]

    # cold: nothing on disk; ops-b reuses ops-a's system prompt from the GPU pool; records written
    assert c["store"]["records_before"] == 0 and c["store"]["hits"] == 0
    assert c["store"]["puts"] == c["store"]["records_added"] == c["store"]["records"] > 0
    assert [r["cached_tokens"] for r in c["prompts"]] == [0, len(encode(SYSTEM)) // 128 * 128, 0]
    # warm: every prompt resumes at its last full block, read from the store; nothing new written
    assert [r["cached_tokens"] for r in w["prompts"]] == [n // 128 * 128 for n in lengths]
    assert w["store"]["hits"] > 0 and w["store"]["misses"] == 0 and w["store"]["corrupt"] == 0
    assert w["store"]["records_added"] == 0 and w["store"]["records"] == c["store"]["records"]
    assert w["totals"]["computed_tokens"] < c["totals"]["computed_tokens"] / 3
    # (That the time to first token drops with it is a timing, measured by
    # bench/endpoint_warm_start.py, not asserted here: a loaded CI machine can stall any run.)

    # the second server's completions (over KV read from disk) are the naive greedy decode
    assert fresh_answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(encode(SYSTEM)) // 128 * 128
    assert fresh_answer["choices"][0]["token_ids"] == naive_greedy(tiny_model, encode(fresh), 2)
    for p, answer in zip(PROMPTS, answers):
        assert answer["choices"][0]["token_ids"] == naive_greedy(tiny_model, prompt_tokens(p), 1), p["id"]


@pytest.mark.slow
def test_passes_text_output_and_stats_after_shutdown(tmp_path: Path, servers: list[ServerProcess],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    server = ServerProcess(store, "--json", "--drain-timeout", "2")
    servers.append(server)
    code = main(["warm-start", "--endpoint", server.url, "--prompts", str(prompts), "--passes", "2",
                 "--store", str(store)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"3 prompts x 2 passes -> {server.url}/v1" in out
    assert out.count("  pass ") == 2 and "mean time to first token: pass 1" in out

    # SIGTERM while a stream too long for the shutdown's drain deadline is in flight: the
    # stream is cut (a prefix of its tokens, no [DONE]), the server still exits 0 and
    # flushes its store (the new tokens also sealed blocks, written at shutdown)
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "x" * 100, "max_tokens": 8000, "stream": True}))
    resp = conn.getresponse()
    first = resp.readline()
    assert first.startswith(b"data: {")
    server.proc.send_signal(signal.SIGTERM)
    try:
        rest = resp.read().decode()
    except http.client.IncompleteRead as exc:  # the cut ends the stream mid-event
        rest = exc.partial.decode()
    conn.close()
    events = [e.strip() for e in [first.decode(), *rest.split("\n\n")] if e.strip()]
    assert "data: [DONE]" not in events and 0 < len(events) < 8000
    server.proc.send_signal(signal.SIGINT)  # a second signal: ignored, the flush goes on
    code, err = server.stop(None)
    assert code == 0 and "stopped; 6 completions, 1 request cut at the drain deadline" in err, err
    # the server flushed its store at SIGTERM: every record there and verified
    assert main(["verify", "--store", str(store)]) == 0
    assert "0 corrupt" in capsys.readouterr().out
    code = main(["stats", "--store", str(store), "--json"])
    stats = json.loads(capsys.readouterr().out)
    assert code == 0 and stats["records"] > 0 and stats["lifetime_puts"] == stats["records"]


# ---------------------------------------------------------------- the client's errors
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_down_exits_6_naming_the_url(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code = main(["warm-start", "--endpoint", url, "--prompts", str(write_prompts(tmp_path / "p.jsonl"))])
    err = capsys.readouterr().err
    assert code == ExitCode.ENDPOINT_UNREACHABLE == 6
    assert f"cannot connect to {url}/v1" in err and "refused" in err.lower()


@pytest.mark.parametrize(("argv", "expected"), [
    (["--endpoint", "ftp://x:1"], "--endpoint: expected http://host:port"),
    (["--endpoint", "http://127.0.0.1:1", "--salt", "t"], "--salt: applies to the reference model's"),
    (["--passes", "2", "--store", "s"], "--passes: expected together with --endpoint"),
    ([], "--store: expected a store URL (required unless --endpoint)"),
])
def test_option_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                              expected: str) -> None:
    code = main(["warm-start", "--prompts", str(write_prompts(tmp_path / "p.jsonl")), *argv])
    assert code == ExitCode.USAGE and expected in capsys.readouterr().err


def test_bad_prompt_line_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "ok", "text": "fine"}\n{"id": "broken", "text": \n')
    code = main(["warm-start", "--endpoint", "http://127.0.0.1:1", "--prompts", str(bad)])
    assert code == ExitCode.USAGE and "line 2: expected a JSON object, got invalid JSON" in capsys.readouterr().err


class _Stub(BaseHTTPRequestHandler):
    """A completions server of another make: behaviour set per test on the server object."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, obj: object) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:  # noqa: N802
        if self.server.models is None:  # type: ignore[attr-defined]
            self._json(404, {"detail": "Not Found"})
        else:
            self._json(200, {"object": "list", "data": [{"id": m} for m in self.server.models]})  # type: ignore[attr-defined]

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)  # type: ignore[attr-defined]
        status, answer = self.server.answer(body)  # type: ignore[attr-defined]
        if isinstance(answer, list):  # server-sent events, chunked as uvicorn (vLLM, SGLang) sends them
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            for item in answer:
                if isinstance(item, float):
                    time.sleep(item)
                    continue
                data = f"data: {item if isinstance(item, str) else json.dumps(item)}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        elif isinstance(answer, bytes):
            self.send_response(status)
            self.send_header("Connection", "close")
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(answer)
        else:
            self._json(status, answer)


class _StubServer(ThreadingHTTPServer):
    """The stub's server. A client that hangs up mid-answer (the CLI stops reading at the
    first malformed event) is not an error of the stub: socketserver's default would print
    that traceback into the stderr the tests read."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture
def stub() -> Iterator[ThreadingHTTPServer]:
    srv = _StubServer(("127.0.0.1", 0), _Stub)
    srv.models = ["stub-model"]  # type: ignore[attr-defined]
    srv.seen = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _stub_url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_server_without_streaming_is_timed_to_its_whole_answer(
        tmp_path: Path, stub: ThreadingHTTPServer, capsys: pytest.CaptureFixture[str]) -> None:
    def answer(body: dict[str, Any]) -> tuple[int, Any]:
        if "stream" in body:
            return 400, {"error": {"message": "streaming is not supported"}}
        time.sleep(0.02)  # a measurable answer time
        return 200, {"choices": [{"text": "x"}]}  # no usage

    stub.answer = answer  # type: ignore[attr-defined]
    report = warm(capsys, "--endpoint", _stub_url(stub) + "/v1/", "--prompts",
                  str(write_prompts(tmp_path / "p.jsonl")), "--passes", "2")
    assert report["mode"] == "full" and report["model"] == "stub-model"
    seen = stub.seen  # type: ignore[attr-defined]
    # the first prompt tried stream+usage, then stream, then plain; the rest went plain at once
    assert [("stream" in b, "stream_options" in b) for b in seen[:3]] == [(True, True), (True, False), (False, False)]
    assert all("stream" not in b for b in seen[3:]) and len(seen) == 2 + 2 * len(PROMPTS)
    assert all(b["max_tokens"] == 1 and b["model"] == "stub-model" for b in seen)
    assert [b["prompt"] for b in seen[2:5]] == [p.get("text", p.get("tokens")) for p in PROMPTS]
    for p in report["passes"]:
        assert p["totals"]["cached_tokens"] is None and p["totals"]["computed_tokens"] is None
        assert all(r["ttft_s"] == r["total_s"] >= 0.02 for r in p["prompts"])
    assert report["summary"]["speedup"] == pytest.approx(
        report["summary"]["first_mean_ttft_s"] / report["summary"]["last_mean_ttft_s"])


def test_ttft_is_the_first_event_of_a_chunked_stream(tmp_path: Path, stub: ThreadingHTTPServer,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    events: list[Any] = [0.05, {"choices": [{"index": 0, "text": "A", "finish_reason": None}]}, 0.3,
                         {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                         {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                                   "prompt_tokens_details": {"cached_tokens": 8}}},
                         "[DONE]"]
    stub.answer = lambda body: (200, events)  # type: ignore[attr-defined]
    report = warm(capsys, "--endpoint", _stub_url(stub), "--prompts", str(write_prompts(tmp_path / "p.jsonl")))
    assert report["mode"] == "stream"
    for row in report["passes"][0]["prompts"]:
        assert 0.05 <= row["ttft_s"] < row["total_s"] - 0.25  # the first token, not the whole answer
        assert (row["prompt_tokens"], row["cached_tokens"]) == (9, 8)


@pytest.mark.parametrize(("models", "answer", "code", "expected"), [
    (["m"], (500, {"error": {"message": "engine dead"}}), ExitCode.FAILURE, "HTTP 500 Internal Server Error: engine dead"),
    (["m"], (200, b"{truncated"), ExitCode.FAILURE, "expected a JSON answer"),
    (None, (200, {}), ExitCode.FAILURE, "/models: HTTP 404 Not Found: Not Found (name the model with --served-model)"),
    ([], (200, {}), ExitCode.FAILURE, "lists no model; name one with --served-model"),
    # malformed streams and answers: one line naming what was expected, never a traceback
    (["m"], (200, [{"choices": 5}, "[DONE]"]), ExitCode.FAILURE,
     'expected an event with "choices": a list of objects, got \'{"choices": 5}\''),
    (["m"], (200, [{"choices": {"text": "x"}}, "[DONE]"]), ExitCode.FAILURE, '"choices": a list of objects'),
    (["m"], (200, [{"choices": ["x"]}, "[DONE]"]), ExitCode.FAILURE, '"choices": a list of objects'),
    (["m"], (200, ["[" * 100_000 + "]" * 100_000]), ExitCode.FAILURE, "expected a JSON event in the stream"),
    (["m"], (200, b"[" * 100_000 + b"]" * 100_000), ExitCode.FAILURE, "expected a JSON answer"),
])
def test_http_errors_exit_1_naming_the_url(tmp_path: Path, stub: ThreadingHTTPServer,
                                           capsys: pytest.CaptureFixture[str], models: list[str] | None,
                                           answer: tuple[int, Any], code: int, expected: str) -> None:
    stub.models = models  # type: ignore[attr-defined]
    stub.answer = lambda body: answer  # type: ignore[attr-defined]
    got = main(["warm-start", "--endpoint", _stub_url(stub), "--prompts", str(write_prompts(tmp_path / "p.jsonl"))])
    err = capsys.readouterr().err
    assert got == code and f"{_stub_url(stub)}/v1" in err and expected in err, err
    assert err.startswith("tiered-kv warm-start: error: ") and err.count("\n") == 1, err


def test_served_model_skips_the_models_route(tmp_path: Path, stub: ThreadingHTTPServer,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    stub.models = None  # type: ignore[attr-defined]
    stub.answer = lambda body: (200, {"choices": [{"text": "y"}], "usage": {  # type: ignore[attr-defined]
        "prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}})
    report = warm(capsys, "--endpoint", _stub_url(stub), "--prompts", str(write_prompts(tmp_path / "p.jsonl")),
                  "--served-model", "mine")
    assert report["model"] == "mine" and all(b["model"] == "mine" for b in stub.seen)  # type: ignore[attr-defined]
    t = report["passes"][0]["totals"]
    assert (t["prompt_tokens"], t["cached_tokens"], t["computed_tokens"]) == (30, 12, 18)


def test_store_counters_need_an_existing_store(tmp_path: Path, stub: ThreadingHTTPServer,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    stub.answer = lambda body: (200, {"choices": [{"text": "y"}]})  # type: ignore[attr-defined]
    code = main(["warm-start", "--endpoint", _stub_url(stub), "--prompts", str(write_prompts(tmp_path / "p.jsonl")),
                 "--store", str(tmp_path / "none")])
    assert code == ExitCode.STORE_MISSING and "no prefix-cache store" in capsys.readouterr().err


def test_store_of_another_layout_still_gives_its_counters(tmp_path: Path) -> None:
    """An engine's store holds its own layout; warm-start reads only the counters."""
    from tiered_kv import presets
    from tiered_kv.cli._common import parse_store
    from tiered_kv.cli._warm_endpoint import read_store_counters
    from tiered_kv.storage import open_store

    flash = presets.get_preset("deepseek-v4-flash")
    open_store(f"lmdb://{tmp_path / 's'}", layout_fingerprint=flash.fingerprint).close()
    got = read_store_counters(parse_store(str(tmp_path / "s")), presets.tiny())
    assert got == {"records": 0, "hits": 0, "misses": 0, "corrupt": 0, "puts": 0}


if os.name != "posix":  # signals and selectors on pipes
    pytestmark = pytest.mark.skip(reason="POSIX only")
