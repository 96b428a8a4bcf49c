"""``tiered-kv serve-reference``: the reference model behind an OpenAI-compatible endpoint.

::

    tiered-kv serve-reference --store .demo/store                # http://127.0.0.1:8000
    tiered-kv serve-reference --store lmdb:///tmp/kv --port 0    # a free port

It serves ``POST /v1/completions`` (``prompt`` a string, tokenized byte-level, or a list
of token ids; ``max_tokens``; ``stream``), ``GET /v1/models``, ``GET /metrics``
(Prometheus text: the cache's metrics and the server's) and ``GET /health``, with a
:class:`~tiered_kv.TieredKVCache` whose disk tier is ``--store`` (created if missing; the
``tiny`` layout, as ``warm-start`` writes it). See :mod:`tiered_kv.reference.openai_server`.
It exists so that ``tiered-kv warm-start --endpoint`` and its tests run against a real
HTTP server on any machine.

Once listening it prints one line on stdout, for people and scripts alike::

    listening on http://127.0.0.1:43127 model tiered-kv-reference-tiny store lmdb:///tmp/kv

(with ``--json``: ``{"url": ..., "model": ..., "store": ...}``), and nothing else on stdout.

Requests share the model in turns (a prefill chunk or a decode token each): while others
run, a request waits at most one step of each for its next token (``--max-running``
admitted at once, ``--prefill-chunk`` tokens per prefill step).

SIGTERM or SIGINT drain it: no new connections, the open ones whose request has not
arrived yet are closed, the requests in flight get ``--drain-timeout`` seconds (default
30) to finish, then each one left is cut (a stream gets an error event and no ``[DONE]``,
a plain request 503); the store's pending writes are flushed and it is closed; then a
summary goes to stderr and it exits 0, within about ``--drain-timeout`` + 3 s whatever
the clients do. More signals meanwhile are ignored (SIGKILL stops it at once; the store
stays consistent, only writes not yet made are lost). No client can hold it up: a request
must arrive within 30 s of connecting, a client that leaves ends its request between
tokens, and a stream whose client leaves more than ``--stream-buffer`` bytes unread (1M),
or takes none of them for ``--send-timeout`` seconds (10), is cut and counted
(``tiered_kv_server_cancelled_total{reason="unread_bytes"|"send_timeout"}``); see
:mod:`tiered_kv.reference.openai_server`.

Exit codes: 0 stopped cleanly; 1 the address is in use or cannot be bound, or the store
cannot be used; 2 bad arguments; 4 the store holds another layout; 5 the store is locked.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from . import _common
from ._common import CommandFailed
from .main import ExitCode, UsageError

# the server's defaults (tiered_kv.reference's, which imports torch: the parser does not;
# tests/test_serve_reference_clients.py checks that they agree)
MAX_RUNNING = 32
PREFILL_CHUNK = 256
STREAM_BUFFER_BYTES = 1 << 20
SEND_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 30.0

__all__ = ["add_parser", "run"]

#: the name ``/v1/models`` lists by default
DEFAULT_SERVED_MODEL = "tiered-kv-reference-tiny"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve-reference",
        help="serve the reference model over an OpenAI-compatible completions endpoint",
        description="Serve the reference model (tiny layout) behind POST /v1/completions, GET /v1/models, "
                    "GET /metrics and GET /health, with a TieredKVCache whose disk tier is --store. "
                    "Prints 'listening on URL ...' once ready; SIGTERM/SIGINT drain the requests in flight "
                    "(--drain-timeout), flush the store and stop.",
        epilog="exit codes: 0 stopped cleanly, 1 cannot bind or use the store, 2 bad arguments, "
               "4 foreign-layout store, 5 store locked",
    )
    _common.add_store_arg(p, creates=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=_port, default=8000,
                   help="TCP port; 0 picks a free one (default %(default)s)")
    p.add_argument("--served-model-name", default=DEFAULT_SERVED_MODEL, metavar="NAME",
                   help="the model name /v1/models lists and requests name (default %(default)s)")
    p.add_argument("--num-blocks", type=_common.positive_int, default=1024, metavar="N",
                   help="Classical blocks of the GPU pool; a request holds at most N x 128 tokens "
                        "(default %(default)s)")
    p.add_argument("--num-snapshots", type=_snapshots, default=256, metavar="N",
                   help="state-snapshot slots of the GPU pool; more than --max-running (default %(default)s)")
    p.add_argument("--max-running", type=_common.positive_int, default=None, metavar="N",
                   help=f"requests admitted at once, taking steps in turn; more wait (default "
                        f"{MAX_RUNNING}, or --num-snapshots - 1 if less)")
    p.add_argument("--prefill-chunk", type=_common.positive_int, default=PREFILL_CHUNK, metavar="TOKENS",
                   help="prompt tokens per prefill step at most, so that a long prompt does not hold the "
                        "others up (default %(default)s)")
    p.add_argument("--stream-buffer", type=_stream_buffer, default=STREAM_BUFFER_BYTES, metavar="SIZE",
                   help="bytes a stream's client may leave unread (queued here or in the socket) before "
                        "the stream is cut, e.g. 256K (default 1M)")
    p.add_argument("--send-timeout", type=_common.seconds_arg, default=SEND_TIMEOUT_S, metavar="S",
                   help="seconds an answer may take to go out, and a stream's client may take no byte of "
                        "what waits for it before the stream is cut (default %(default)g)")
    p.add_argument("--drain-timeout", type=_drain_seconds, default=DRAIN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM/SIGINT, seconds the requests in flight get to finish before they are "
                        "cut (default %(default)g; 0 cuts them at once)")
    p.add_argument("--snapshot-interval", type=_common.positive_int, default=1, metavar="N",
                   help="store a state snapshot every N blocks (default %(default)s, as warm-start)")
    p.add_argument("--salt", default="", metavar="S", help="tenant salt of the prefix hash (default: none)")
    p.add_argument("--max-bytes", type=_common.size_arg, default=None, metavar="SIZE",
                   help="bound of the store's records (LRU-evicted), e.g. 8G (default: the backend's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default %(default)s)")
    p.add_argument("--threads", type=_common.positive_int, default=1, metavar="N",
                   help="torch intra-op threads (default %(default)s)")
    p.add_argument("--log-requests", action="store_true", help="log one line per HTTP request on stderr")
    p.add_argument("--json", action="store_true",
                   help='print the listening line as one JSON object: {"url", "model", "store"}')
    return p


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number in [0, 65535], got {port}")
    return port


def _snapshots(text: str) -> int:
    n = _common.positive_int(text)
    if n < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 (one request's + one shared), got {n}")
    return n


def _stream_buffer(text: str) -> int:
    n = _common.size_arg(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, e.g. 1M, got {text!r}")
    return n


def _drain_seconds(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return _common.seconds_arg(text)


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    from .. import presets
    from ..device import resolve_device
    from ..reference.openai_server import ReferenceEngine, make_server
    from .warm_start import MODEL_SEED, _torch_threads, _warm_up

    if args.max_bytes == 0:
        raise UsageError("--max-bytes: expected a positive size, e.g. 8G, got 0")
    if args.max_running is not None and args.max_running >= args.num_snapshots:
        raise UsageError(f"--max-running: expected fewer than --num-snapshots ({args.num_snapshots}: one per "
                         f"running request + one shared), got {args.max_running}")
    try:
        device = str(resolve_device(args.device))
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    layout = presets.tiny()
    loc = _common.parse_store(args.store)
    store_options = {} if args.max_bytes is None else {"max_bytes": args.max_bytes}
    stop = threading.Event()
    # the handlers stay until the store is closed: a second signal cannot cut the flush short
    with _stop_on_signals(stop) as wait_for_stop, _torch_threads(args.threads), _common.store_errors(loc, layout):
        engine = ReferenceEngine(layout, store=loc.url, served_model=args.served_model_name, seed=MODEL_SEED,
                                 num_blocks=args.num_blocks, num_snapshots=args.num_snapshots,
                                 snapshot_interval=args.snapshot_interval, salt=args.salt, device=device,
                                 store_options=store_options, max_running=args.max_running,
                                 prefill_chunk=args.prefill_chunk)
        try:
            _warm_up(engine.model, layout, device)  # the first request should not pay torch's start-up
            try:
                server = make_server(engine, args.host, args.port, log=_log if args.log_requests else None,
                                     send_timeout_s=args.send_timeout, stream_buffer_bytes=args.stream_buffer)
            except OSError as exc:
                hint = " (pick another --port, or 0 for a free one)" if exc.errno == errno.EADDRINUSE else ""
                raise CommandFailed(ExitCode.FAILURE, f"cannot listen on {args.host}:{args.port}: "
                                                      f"{exc.strerror or exc}{hint}") from None
            stopped = _serve(server, loc.url, wait_for_stop, args.drain_timeout, as_json=args.json)
            counts = engine.metrics()
            stats = engine.store_stats()
        finally:
            engine.close()  # flushes the store's pending writes and counters, closes it
    slow = int(counts.get("tiered_kv_server_cancelled_total", reason="unread_bytes")
               + counts.get("tiered_kv_server_cancelled_total", reason="send_timeout"))
    notes = [f"{n} {what}{'s' if n != 1 else ''}{rest}" for n, what, rest in (
        (stopped.cut, "request", " cut at the drain deadline"),
        (stopped.closed, "connection", " closed before a request arrived"),
        (slow, "stream", " of slow readers cut")) if n]
    print(f"serve-reference: stopped; {int(counts.get('tiered_kv_server_requests_total', outcome='ok'))} "
          f"completions{''.join(', ' + n for n in notes)}, store {stats['records']} records, "
          f"{stats.get('hits', 0)} hits this run", file=sys.stderr, flush=True)
    return ExitCode.OK


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[Callable[[], None]]:
    """SIGTERM and SIGINT set ``stop`` (instead of ending the process) inside the block,
    which gets a function that waits for it.

    Python runs signal handlers in the main thread only, and only once it runs Python code
    again; the kernel may deliver the signal to any thread, and then a main thread blocked
    on a lock (``stop.wait()``) would never wake. So the main thread waits in ``select`` on
    the signal module's wakeup socket, which a signal wakes whichever thread caught it.

    Once a stop was asked for, the process is on its way out: the signals stay ignored
    after the block too, so a second one cannot turn a clean exit into a traceback."""
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    old_fd = signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)

    def wait() -> None:
        while not stop.is_set():
            select.select([wake_r], [], [])  # the handler runs right after, in this thread
            with contextlib.suppress(BlockingIOError):
                wake_r.recv(4096)

    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield wait
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if stop.is_set() else handler)
        signal.set_wakeup_fd(old_fd)
        wake_r.close()
        wake_w.close()


def _serve(server: Any, store_url: str, wait_for_stop: Callable[[], None], drain_timeout_s: float, *,
           as_json: bool = False) -> Any:
    """Serve until ``wait_for_stop()`` returns; then drain within a bound (``server.stop``:
    the requests in flight get ``drain_timeout_s``, then are cut). Returns what
    ``server.stop`` did."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="serve-reference",
                              daemon=True)
    thread.start()
    try:
        if as_json:
            print(json.dumps({"url": server.url, "model": server.engine.served_model, "store": store_url}),
                  flush=True)
        else:
            print(f"listening on {server.url} model {server.engine.served_model} store {store_url}", flush=True)
        wait_for_stop()
    finally:
        stopped = server.stop(grace_s=drain_timeout_s)
        thread.join()
    return stopped


def _log(line: str) -> None:
    print(f"serve-reference: {line}", file=sys.stderr, flush=True)
