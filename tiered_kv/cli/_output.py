"""What the store commands print: JSON, ISO times, a progress bar on a terminal's stderr,
and a logger silenced while a command reports the same failures itself."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import TextIO

__all__ = ["Progress", "iso_time", "print_json", "quiet_logger"]


@contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Drop the warnings of logger ``name`` meanwhile (a command that reports the same
    failures in its own summary line)."""
    import logging

    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def print_json(obj: object) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


def iso_time(ns: int | None) -> str | None:
    """Nanoseconds since the epoch -> ``2025-01-31T02:40:00Z`` (None stays None)."""
    if ns is None:
        return None
    t = datetime.fromtimestamp(ns / 1e9, tz=timezone.utc)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


class Progress:
    """A one-line progress bar on ``stream`` (stderr) when it is a terminal; silent otherwise.

    ``println`` prints a result line to stdout without tearing the bar (the bar is
    cleared first and redrawn after).
    """

    def __init__(self, total: int, *, stream: TextIO | None = None, enabled: bool | None = None,
                 width: int = 28) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.total = max(total, 1)
        self.width = width
        self._line = ""

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * min(done, self.total) // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        self._line = f"[{bar}] {100 * min(done, self.total) // self.total:3d}%  {note}"
        self._draw()

    def println(self, line: str) -> None:
        if self.enabled:
            self._clear()
        print(line, flush=True)
        if self.enabled and self._line:
            self._draw()

    def close(self) -> None:
        if self.enabled:
            self._clear()
        self._line = ""

    def _draw(self) -> None:
        self.stream.write("\r\x1b[K" + self._line)
        self.stream.flush()

    def _clear(self) -> None:
        self.stream.write("\r\x1b[K")
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
