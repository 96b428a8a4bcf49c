"""Socket I/O of the reference server that no client can stall.

Three pieces, each closing one way a client could hold a server thread (and with it the
model, or the shutdown) for as long as it likes:

* :class:`DeadlineReader` — the request is read against one absolute deadline. A socket
  timeout restarts on every byte, so a client sending a header line a second would hold
  its thread forever; the deadline does not move.
* :class:`StreamSender` — a stream's bytes are queued and sent without blocking the thread
  that makes them; the rest is sent at the end, with a bounded wait. What the client
  leaves unread is bounded: :meth:`StreamSender.overrun` says when it left more than
  ``max_unread_bytes`` unread, or took nothing for the send timeout, and the stream is
  then cut. A client that stops reading holds neither the model nor unbounded memory.
* :func:`peer_gone` — whether the client closed or reset the connection, asked between
  tokens so that an abandoned request stops instead of running to its end.

Standard library only (``socket``, ``select``, ``fcntl``); Linux and the BSDs (``poll``,
``MSG_DONTWAIT``). On Linux the socket's send queue counts as unread too (``SIOCOUTQ``);
elsewhere only the bytes queued here do.
"""

from __future__ import annotations

import io
import select
import socket
import struct
import time
from collections.abc import Callable

try:
    import fcntl
    import termios

    _SIOCOUTQ: int | None = termios.TIOCOUTQ  # Linux: SIOCOUTQ == TIOCOUTQ
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _SIOCOUTQ = None

__all__ = ["STREAM_BUFFER_BYTES", "ClientGone", "DeadlineReader", "StreamSender", "peer_gone"]

#: a stream's bytes its client may leave unread before the stream is cut, by default
STREAM_BUFFER_BYTES = 1 << 20


class ClientGone(Exception):
    """The client closed or reset the connection, or took longer than its send timeout
    to read the answer: nothing more can be sent to it."""


class DeadlineReader(io.RawIOBase):
    """The bytes of ``sock`` until the absolute ``deadline`` (a :func:`time.monotonic` time).

    Each read waits at most until the deadline; after it, reads raise :class:`TimeoutError`.
    Wrap it in :class:`io.BufferedReader` for ``readline``/``read(n)``.
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self.deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive by its deadline")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class StreamSender:
    """One response stream's bytes, sent without ever blocking :meth:`offer`'s caller.

    :meth:`offer` queues bytes and sends what the socket takes at once (non-blocking);
    :meth:`drain` sends the rest, waiting at most ``timeout_s`` in all. Once a send fails
    (the client is gone) :attr:`broken` is set and later bytes are dropped.

    *Unread* bytes are those queued here plus, on Linux, those in the socket's send queue
    that the client's side has not acknowledged (``SIOCOUTQ``): what this server holds
    for a client that does not read. The stream's producer asks :meth:`overrun` between
    tokens and stops when it says so: more than ``max_unread_bytes`` unread, or unread
    bytes of which the client took none for ``send_timeout_s``. So a stalled client
    costs at most ``max_unread_bytes`` (and one event) of memory here.
    """

    def __init__(self, sock: socket.socket, *, max_unread_bytes: int = STREAM_BUFFER_BYTES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_unread_bytes < 1:
            raise ValueError(f"max_unread_bytes: expected >= 1, got {max_unread_bytes}")
        self._sock = sock
        self._pending = bytearray()
        self.max_unread_bytes = max_unread_bytes
        self._clock = clock
        #: bytes handed to the socket so far, and how many of them the client has taken
        self._handed = 0
        self._taken = 0
        #: when the client last took a byte (or nothing was unread)
        self._taken_at = clock()
        self._outq_works = _SIOCOUTQ is not None
        #: the response's head is queued: errors from now on go into the stream
        self.started = False
        #: a send failed: the client is gone (or too slow); nothing more is sent
        self.broken = False

    @property
    def pending_bytes(self) -> int:
        """Bytes queued here, not yet handed to the socket."""
        return len(self._pending)

    def unread_bytes(self) -> int:
        """Bytes queued here plus the socket's send queue (Linux; elsewhere 0 there)."""
        return len(self._pending) + self._handed - self._taken_now()

    def _taken_now(self) -> int:
        """Bytes handed to the socket that the client's side has acknowledged."""
        if not self._outq_works:
            return self._handed
        try:
            queued = struct.unpack("i", fcntl.ioctl(self._sock.fileno(), _SIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # not a TCP socket, or closed: count the socket's queue as taken
            self._outq_works = False
            return self._handed
        return self._handed - queued

    def overrun(self, send_timeout_s: float) -> str | None:
        """Why the stream should be cut now, or None: ``"unread_bytes"`` when more than
        ``max_unread_bytes`` are unread, ``"send_timeout"`` when bytes are unread and the
        client took none of them for ``send_timeout_s`` seconds."""
        if self.broken:
            return None  # the client is gone: the caller sees `broken`
        now = self._clock()
        taken = self._taken_now()
        unread = len(self._pending) + self._handed - taken
        if taken > self._taken or unread == 0:
            self._taken, self._taken_at = taken, now
        if unread > self.max_unread_bytes:
            return "unread_bytes"
        if unread and now - self._taken_at > send_timeout_s:
            return "send_timeout"
        return None

    def start(self, head: bytes) -> None:
        """Queue the response's status line and headers."""
        self.started = True
        self.offer(head)

    def offer(self, data: bytes) -> None:
        """Queue ``data`` and send what the socket takes now; never blocks."""
        if self.broken:
            return
        self._pending += data
        try:
            self._sock.settimeout(0.0)
            while self._pending:
                sent = self._sock.send(self._pending)
                del self._pending[:sent]
                self._handed += sent
        except (BlockingIOError, InterruptedError):
            pass  # the client's window is full: the rest goes at the next offer or drain
        except OSError:
            self._fail()

    def drain(self, timeout_s: float) -> bool:
        """Send everything queued within ``timeout_s`` seconds; False (and :attr:`broken`)
        if the client is gone or did not take it in time."""
        if self.broken:
            return False
        try:
            self._sock.settimeout(timeout_s)  # sendall: one bound for the whole call
            self._sock.sendall(self._pending)
        except OSError:  # BrokenPipe, ConnectionReset, TimeoutError
            self._fail()
            return False
        self._handed += len(self._pending)
        self._pending.clear()
        return True

    def abandon(self) -> None:
        """Drop what is queued and send nothing more (the stream was cut)."""
        self._fail()

    def _fail(self) -> None:
        self.broken = True
        self._pending = bytearray()  # a fresh one: the old one's memory goes back at once


def peer_gone(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed or reset the connection; never blocks.

    A request's client sends nothing after its body, so a socket that reads as the end of
    the stream (or an error) means the client left. Bytes it did send (a pipelined
    request) are left unread.
    """
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        ready = poller.poll(0)
    except (OSError, ValueError):  # closed here already
        return True
    if not ready:
        return False
    if ready[0][1] & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
