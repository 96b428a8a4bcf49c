"""How the reference server's requests share the one model: in turns, and by admission.

Two pieces, both standard library only:

* :class:`TurnLock` — the model lock, taken in turns, round-robin. A request holds it for
  one step (a prefill chunk or one decode token) and then goes to the back of the line,
  so that between two steps of one request every other request takes at most one. A
  plain ``threading.Lock`` gives no such bound: the thread that releases it is the likely
  one to take it again, and a long request would run to its end while the others wait.
* :class:`Admission` — how many requests run at once (one cache State slot each) and how
  many GPU-pool blocks they may hold together (each its worst case), so that a running
  request never runs out of blocks halfway. A request that does not fit waits; one that
  fits is admitted even if an earlier, bigger one still waits (first fit: a short request
  is not held behind a long one).

Neither knows about HTTP or the model: :mod:`.engine` uses them.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Admission", "Seat", "TurnLock"]


class TurnLock:
    """A lock whose holders take turns in the order they queued (round-robin).

    A thread that takes the lock many times, one step at a time, holds a :class:`Seat`
    (:meth:`seat`): ``with seat:`` waits for its turn; leaving the block queues the seat
    again *at once* at the back of the line and hands the lock to the seat at the front.
    Because a seat's place is taken when its turn ends, not when its thread next asks,
    the order is strict: between two turns of a seat, every other seat has at most one
    (however slowly each thread gets back to the lock). :meth:`Seat.leave` gives the
    place up.

    ``with lock:`` is one turn of a seat made for it (metrics, flushes, tests): it waits
    behind the seats queued before it, like any of them.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        #: the seat whose turn it is (it may not have entered yet), or None: the lock is free
        self._owner: Seat | None = None
        #: seats waiting for a turn, in order
        self._queue: deque[Seat] = deque()
        self._one_shot = threading.local()

    def seat(self) -> Seat:
        """A place in the rotation for a thread that takes many turns."""
        return Seat(self)

    def locked(self) -> bool:
        """Whether some seat has the turn (or the lock was handed to one not yet in)."""
        with self._mutex:
            return self._owner is not None

    def waiting(self) -> int:
        """Seats queued for a turn (not counting the one that has it)."""
        with self._mutex:
            return len(self._queue)

    def __enter__(self) -> TurnLock:
        seat = Seat(self)
        seat.__enter__()
        stack = self._one_shot.__dict__.setdefault("seats", [])
        stack.append(seat)
        return self

    def __exit__(self, *exc: object) -> None:
        seat = self._one_shot.seats.pop()
        seat.end(again=False)

    # ------------------------------------------------- under self._mutex
    def _hand_on(self) -> None:
        """The turn ended: give it to the seat at the front, if any."""
        self._owner = None
        if self._queue:
            nxt = self._queue.popleft()
            self._owner = nxt
            nxt._gate.release()


class Seat:
    """One thread's place in a :class:`TurnLock`'s rotation (see there).

    ``with seat:`` is one turn; on leaving the block the seat is queued again at once.
    :meth:`leave` gives its place up (call it when the thread takes no more turns; a
    seat that is handed the turn while away passes it on).
    """

    __slots__ = ("_lock", "_gate", "_queued", "_inside")

    def __init__(self, lock: TurnLock) -> None:
        self._lock = lock
        #: held while it is not this seat's turn; released by whoever hands it the turn
        self._gate = threading.Lock()
        self._gate.acquire()
        #: in the queue, or the owner
        self._queued = False
        self._inside = False

    def _enqueue(self) -> None:  # under the lock's mutex
        lock = self._lock
        self._queued = True
        if lock._owner is None:
            lock._owner = self
            self._gate.release()
        else:
            lock._queue.append(self)

    def __enter__(self) -> Seat:
        """Wait for this seat's turn (queue at the back if it is not queued yet)."""
        if self._inside:
            raise RuntimeError("a Seat's turn was entered twice (turns do not nest)")
        with self._lock._mutex:
            if not self._queued:
                self._enqueue()
        self._gate.acquire()  # the turn is ours once the gate opens
        self._inside = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.end(again=True)

    def end(self, *, again: bool) -> None:
        """End this seat's turn: queue again at the back (``again``), or leave; the turn
        goes to the seat at the front."""
        lock = self._lock
        with lock._mutex:
            if lock._owner is not self or not self._inside:
                raise RuntimeError("a Seat ended a turn it does not have")
            self._inside = False
            self._queued = False
            if again:
                self._queued = True
                lock._queue.append(self)
            lock._hand_on()

    def leave(self) -> None:
        """Give this seat's place up (outside a turn); idempotent."""
        lock = self._lock
        with lock._mutex:
            if self._inside:
                raise RuntimeError("a Seat left in the middle of its turn")
            if not self._queued:
                return
            self._queued = False
            if lock._owner is self:  # handed the turn while away: take the gate back, pass it on
                self._gate.acquire()
                lock._hand_on()
            else:
                lock._queue.remove(self)


class Admission:
    """Requests admitted at once: at most ``slots`` of them, holding at most ``blocks``
    GPU-pool blocks together.

    :meth:`admit` waits until the request fits. Waiters are admitted in arrival order,
    except that one that does not fit yet lets later ones that fit go first: a short
    request never waits behind a long one for blocks it does not need. (A very large
    request can therefore wait as long as smaller ones keep the pool busy.)
    """

    def __init__(self, *, slots: int, blocks: int) -> None:
        if slots < 1 or blocks < 1:
            raise ValueError(f"Admission: expected slots >= 1 and blocks >= 1, got {slots} and {blocks}")
        self.slots = slots
        self.blocks = blocks
        self._changed = threading.Condition()
        #: waiters in arrival order: (ticket, blocks needed)
        self._queue: list[tuple[object, int]] = []
        self.running = 0
        self.blocks_held = 0

    def _fits(self, need: int) -> bool:
        return self.running < self.slots and self.blocks_held + need <= self.blocks

    def _may_enter(self, ticket: object) -> bool:
        for t, need in self._queue:
            if t is ticket:
                return self._fits(need)
            if self._fits(need):  # an earlier waiter fits: it goes first
                return False
        raise AssertionError("an Admission ticket is not in the queue")

    @contextmanager
    def admit(self, need: int, check: Callable[[], None], poll_s: float = 0.1) -> Iterator[None]:
        """Hold a place and ``need`` blocks for the block's duration, waiting until they
        are free. While it waits, ``check()`` is called every ``poll_s`` seconds: an
        exception from it gives the place up and propagates (the client left, say)."""
        if not 1 <= need <= self.blocks:
            raise ValueError(f"need: expected 1..{self.blocks} blocks, got {need}")
        ticket = object()
        with self._changed:
            self._queue.append((ticket, need))
            try:
                while not self._may_enter(ticket):
                    if not self._changed.wait(timeout=poll_s):
                        check()
            finally:  # admitted or not, this waiter leaves the queue
                self._queue = [(t, n) for t, n in self._queue if t is not ticket]
                self._changed.notify_all()  # the next waiter may be first now
            self.running += 1
            self.blocks_held += need
        try:
            yield
        finally:
            with self._changed:
                self.running -= 1
                self.blocks_held -= need
                self._changed.notify_all()

    def queued(self) -> int:
        """Requests waiting to be admitted."""
        with self._changed:
            return len(self._queue)
