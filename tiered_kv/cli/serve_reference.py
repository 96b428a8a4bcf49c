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

SIGTERM or SIGINT stop it cleanly within about 5 s, whatever the clients do: no new
connections; the open ones get 2 s to finish, then each one left is cut (its request
stops at the next token, its socket is shut down); the store's pending writes are flushed
and it is closed; then a summary goes to stderr and it exits 0. More signals meanwhile are
ignored (SIGKILL stops it at once; the store stays consistent, only writes not yet made
are lost). No client can hold it up: a request must arrive within 30 s of connecting, an
answer go out within 10 s, and a client that leaves ends its request between tokens
(see :mod:`tiered_kv.reference.openai_server`).

Exit codes: 0 stopped cleanly; 1 the address is in use or cannot be bound, or the store
cannot be used; 2 bad arguments; 4 the store holds another layout; 5 the store is locked.
"""

from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import _common
from ._common import CommandFailed
from .main import ExitCode, UsageError

__all__ = ["add_parser", "run"]

#: the name ``/v1/models`` lists by default
DEFAULT_SERVED_MODEL = "tiered-kv-reference-tiny"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve-reference",
        help="serve the reference model over an OpenAI-compatible completions endpoint",
        description="Serve the reference model (tiny layout) behind POST /v1/completions, GET /v1/models, "
                    "GET /metrics and GET /health, with a TieredKVCache whose disk tier is --store. "
                    "Prints 'listening on URL ...' once ready; SIGTERM/SIGINT flush the store and stop.",
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
                   help="state-snapshot slots of the GPU pool (default %(default)s)")
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


def run(args: argparse.Namespace) -> int:
    return _common.run_guarded(args, _run)


def _run(args: argparse.Namespace) -> int:
    from .. import presets
    from ..device import resolve_device
    from ..reference.openai_server import ReferenceEngine, make_server
    from .warm_start import MODEL_SEED, _torch_threads, _warm_up

    if args.max_bytes == 0:
        raise UsageError("--max-bytes: expected a positive size, e.g. 8G, got 0")
    try:
        device = str(resolve_device(args.device))
    except ValueError as exc:
        raise UsageError(f"--device: {exc}") from None
    layout = presets.tiny()
    loc = _common.parse_store(args.store)
    store_options = {} if args.max_bytes is None else {"max_bytes": args.max_bytes}
    stop = threading.Event()
    # the handlers stay until the store is closed: a second signal cannot cut the flush short
    with _stop_on_signals(stop), _torch_threads(args.threads), _common.store_errors(loc, layout):
        engine = ReferenceEngine(layout, store=loc.url, served_model=args.served_model_name, seed=MODEL_SEED,
                                 num_blocks=args.num_blocks, num_snapshots=args.num_snapshots,
                                 snapshot_interval=args.snapshot_interval, salt=args.salt, device=device,
                                 store_options=store_options)
        try:
            _warm_up(engine.model, layout, device)  # the first request should not pay torch's start-up
            try:
                server = make_server(engine, args.host, args.port, log=_log if args.log_requests else None)
            except OSError as exc:
                hint = " (pick another --port, or 0 for a free one)" if exc.errno == errno.EADDRINUSE else ""
                raise CommandFailed(ExitCode.FAILURE, f"cannot listen on {args.host}:{args.port}: "
                                                      f"{exc.strerror or exc}{hint}") from None
            cut = _serve(server, loc.url, stop, as_json=args.json)
            counts = engine.metrics()
            stats = engine.store_stats()
        finally:
            engine.close()  # flushes the store's pending writes and counters, closes it
    cut_note = f", {cut} connection{'s' if cut != 1 else ''} cut at shutdown" if cut else ""
    print(f"serve-reference: stopped; {int(counts.get('tiered_kv_server_requests_total', outcome='ok'))} "
          f"completions{cut_note}, store {stats['records']} records, {stats.get('hits', 0)} hits this run",
          file=sys.stderr, flush=True)
    return ExitCode.OK


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` (instead of ending the process) inside the block.

    Once a stop was asked for, the process is on its way out: the signals stay ignored
    after the block too, so a second one cannot turn a clean exit into a traceback."""
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN if stop.is_set() else handler)


def _serve(server: Any, store_url: str, stop: threading.Event, *, as_json: bool = False) -> int:
    """Serve until ``stop`` is set; then stop within a bound (``server.stop``: the requests
    in flight get a grace period, then are cut). Returns the number of connections cut."""
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="serve-reference",
                              daemon=True)
    thread.start()
    try:
        if as_json:
            print(json.dumps({"url": server.url, "model": server.engine.served_model, "store": store_url}),
                  flush=True)
        else:
            print(f"listening on {server.url} model {server.engine.served_model} store {store_url}", flush=True)
        stop.wait()
    finally:
        cut = server.stop()
        thread.join()
    return cut


def _log(line: str) -> None:
    print(f"serve-reference: {line}", file=sys.stderr, flush=True)
