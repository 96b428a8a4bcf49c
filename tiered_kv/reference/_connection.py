"""Socket I/O of the reference server that no client can stall.

Three pieces, each closing one way a client could hold a server thread (and with it the
model, or the shutdown) for as long as it likes:

* :class:`DeadlineReader` — the request is read against one absolute deadline. A socket
  timeout restarts on every byte, so a client sending a header line a second would hold
  its thread forever; the deadline does not move.
* :class:`StreamSender` — a stream's bytes are queued and sent without blocking the thread
  that makes them (it holds the model lock); the rest is sent after the lock is released,
  with a bounded wait. A client that stops reading slows only its own answer.
* :func:`peer_gone` — whether the client closed or reset the connection, asked between
  tokens so that an abandoned request stops instead of running to its end.

Standard library only (``socket``, ``select``); Linux and the BSDs (``poll``, ``MSG_DONTWAIT``).
"""

from __future__ import annotations

import io
import select
import socket
import time

__all__ = ["ClientGone", "DeadlineReader", "StreamSender", "peer_gone"]


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
    :meth:`drain` sends the rest, waiting at most ``timeout_s`` in all. Bytes the client has
    not taken yet stay queued in memory (at most one request's answer). Once a send fails
    (the client is gone) :attr:`broken` is set and later bytes are dropped.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pending = bytearray()
        #: the response's head is queued: errors from now on go into the stream
        self.started = False
        #: a send failed: the client is gone (or too slow); nothing more is sent
        self.broken = False

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

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
        self._pending.clear()
        return True

    def _fail(self) -> None:
        self.broken = True
        self._pending.clear()


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
