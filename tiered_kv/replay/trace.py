"""Request traces in the Mooncake format, and the two bundled with the package.

One JSON object per line (Mooncake FAST'25 release, ``FAST25-release/traces``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 2353, 2354]}

``hash_ids`` are remapped prefix-block hashes, one per ``block_tokens`` (512) prompt tokens,
the last block possibly partial: two requests that share their first n ids share their
first ``n * block_tokens`` prompt tokens. A prompt longer than its ids cover goes on with
tokens unique to the request (see :mod:`tiered_kv.replay.tokens`).

``load_trace("bundled:conversation")`` reads a trace shipped in this package
(``tiered_kv/replay/data``, xz-compressed, Apache-2.0, attribution in ``NOTICE.md``
there); any other value is a path to a ``.jsonl``, ``.jsonl.gz`` or ``.jsonl.xz`` file.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO

__all__ = ["BUNDLED", "BUNDLED_PREFIX", "DEFAULT_BLOCK_TOKENS", "Trace", "TraceRequest", "bundled_notice",
           "load_trace"]

#: The block size of the Mooncake traces' ``hash_ids``.
DEFAULT_BLOCK_TOKENS = 512
#: ``--trace bundled:NAME`` selects a trace shipped with the package.
BUNDLED_PREFIX = "bundled:"
#: Bundled traces: name -> file in ``tiered_kv/replay/data``.
BUNDLED: dict[str, str] = {
    "conversation": "conversation_trace.jsonl.xz",
    "synthetic": "synthetic_trace.jsonl.xz",
}
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival, prompt and output lengths, prefix-block ids."""

    #: arrival, in milliseconds since the trace's first request
    timestamp_ms: int
    input_length: int
    output_length: int
    #: one id per ``block_tokens`` prompt tokens (the last block may be partial)
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """A request sequence, in arrival order."""

    #: what it was loaded from (``bundled:conversation`` or a path)
    name: str
    requests: tuple[TraceRequest, ...]
    #: tokens per hash id
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    def head(self, n: int | None) -> Trace:
        """The first ``n`` requests (all of them for None)."""
        if n is None or n >= len(self.requests):
            return self
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n: expected a positive int or None, got {n!r}")
        return Trace(name=self.name, requests=self.requests[:n], block_tokens=self.block_tokens)

    def select(self, indices: Sequence[int]) -> Trace:
        """The requests at ``indices`` (in that order): a node's share of a fleet."""
        return Trace(name=self.name, requests=tuple(self.requests[i] for i in indices),
                     block_tokens=self.block_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        """Distinct hash ids (full or partial blocks)."""
        return len({h for r in self.requests for h in r.hash_ids})


def load_trace(spec: str | os.PathLike[str], *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               limit: int | None = None) -> Trace:
    """Read a Mooncake-format trace: ``bundled:NAME`` (:data:`BUNDLED`) or a file path.

    ``block_tokens``: tokens per hash id (512 in Mooncake's traces). ``limit``: read only
    the first ``limit`` requests. Raises ValueError naming the line of a malformed request.
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ValueError(f"block_tokens: expected a positive int, got {block_tokens!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit: expected a positive int or None, got {limit!r}")
    name = os.fspath(spec)
    with _open_text(name) as f:
        requests = tuple(_parse(f, name, block_tokens, limit))
    if not requests:
        raise ValueError(f"trace {name}: expected at least one request, the file has none")
    return Trace(name=name, requests=requests, block_tokens=block_tokens)


def bundled_notice() -> str:
    """The attribution and license notice of the bundled traces (``data/NOTICE.md``)."""
    return resources.files(__package__).joinpath("data", "NOTICE.md").read_text(encoding="utf-8")


def _open_text(name: str) -> IO[str]:
    if name.startswith(BUNDLED_PREFIX):
        key = name[len(BUNDLED_PREFIX):]
        if key not in BUNDLED:
            raise ValueError(f"trace: expected bundled:NAME with NAME one of {', '.join(sorted(BUNDLED))}, "
                             f"got {name!r}")
        import lzma

        data = resources.files(__package__).joinpath("data", BUNDLED[key])
        return lzma.open(data.open("rb"), "rt", encoding="utf-8")  # type: ignore[return-value]
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"trace: expected a Mooncake .jsonl file (or bundled:NAME), no file at {name!r}")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    if path.suffix == ".xz":
        import lzma

        return lzma.open(path, "rt", encoding="utf-8")  # type: ignore[return-value]
    return open(path, encoding="utf-8")  # noqa: SIM115 - closed by the caller's with


def _parse(lines: IO[str], name: str, block_tokens: int, limit: int | None) -> Iterator[TraceRequest]:
    n = 0
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"trace {name}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: expected a JSON object, got invalid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or any(k not in obj for k in _FIELDS):
            raise ValueError(f"{where}: expected an object with {', '.join(_FIELDS)}")
        ts, n_in, n_out, ids = (obj[k] for k in _FIELDS)
        for field, value in (("timestamp", ts), ("input_length", n_in), ("output_length", n_out)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: {field}: expected a non-negative int, got {value!r}")
        if n_in < 1:
            raise ValueError(f"{where}: input_length: expected at least 1 token, got {n_in}")
        if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
            raise ValueError(f"{where}: hash_ids: expected a list of non-negative ints")
        if len(ids) > -(-n_in // block_tokens):
            raise ValueError(f"{where}: hash_ids: {len(ids)} ids of {block_tokens} tokens for a prompt of {n_in} "
                             f"tokens, expected at most {-(-n_in // block_tokens)} (is the block size "
                             f"{block_tokens}?)")
        yield TraceRequest(timestamp_ms=ts, input_length=n_in, output_length=n_out, hash_ids=tuple(ids))
        n += 1
        if limit is not None and n >= limit:
            return
