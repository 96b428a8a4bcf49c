"""The copy engine: batched block and tensor copies between the device and host tiers.

On CUDA each copy runs on a side stream — one for device-to-host (offload), one for
host-to-device (load) — ordered after everything already enqueued on the *producing*
(current) stream, and returns a :class:`CopyHandle` whose event marks completion::

    current stream   ..[kernels that wrote the blocks]──●──[more compute]─────────●wait──[attention]
                                                        │ wait_stream              │ handle.make_stream_wait()
    d2h / h2d stream                                    └─●start─[gather+copy]─●end┘
                                                                              │
    host: poll() sees `end` done -> latency, drop tensor refs, run done-callbacks

Lifetimes by construction: a pending handle holds references to its source and
destination tensors (and anything passed to :meth:`CopyHandle.keep_alive`), and the
engine holds every pending handle, so GPU memory cannot be recycled and a host buffer
cannot be dropped while a copy still reads or writes it. *Reusing* a block id or a host
buffer is the caller's decision: do it from :meth:`CopyHandle.add_done_callback`
(callbacks run in :meth:`CopyEngine.poll`, :meth:`CopyEngine.synchronize` or
:meth:`CopyHandle.wait`, on the calling thread). Nothing here sleeps or spins.

On CPU (no CUDA) the API is the same; every copy runs synchronously in the call and its
handle is complete on return (latency = wall time of the call).

Counters: ``bytes_d2h`` (offloads and device->host copies), ``bytes_h2d`` (loads and
host->device copies), ``bytes_local`` (copies within one side), ``copies``; they count
at submission. Latencies count at completion (:meth:`CopyEngine.stats`).

Not thread-safe: one engine is driven by one thread (the scheduler's).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiered_kv import kernels
from tiered_kv.device import resolve_device

__all__ = ["CopyEngine", "CopyHandle", "CopyKind", "CopyStats"]

#: How many recent per-copy latencies :class:`CopyEngine` keeps for :meth:`~CopyEngine.stats`.
RECENT_LATENCIES = 4096


class CopyKind(enum.Enum):
    """Direction of a copy, as far as the tiers are concerned."""

    D2H = "d2h"  # device -> host (offload)
    H2D = "h2d"  # host -> device (load)
    LOCAL = "local"  # within one side (device -> device, or host -> host)


@dataclass(frozen=True, kw_only=True, slots=True)
class CopyStats:
    """A snapshot of a :class:`CopyEngine`'s counters."""

    copies: int
    completed: int
    pending: int
    bytes_d2h: int
    bytes_h2d: int
    bytes_local: int
    #: Sum and max over completed copies, seconds.
    latency_total_s: float
    latency_max_s: float
    #: The last :data:`RECENT_LATENCIES` latencies, oldest first, seconds.
    recent_latencies_s: tuple[float, ...]

    @property
    def latency_mean_s(self) -> float:
        return self.latency_total_s / self.completed if self.completed else 0.0


class CopyHandle:
    """One submitted copy. Complete once its end event has fired (always, on CPU).

    ``done()`` asks without blocking; ``wait()`` blocks this thread until the copy is
    done; ``make_stream_wait(stream)`` makes a CUDA stream wait for it without
    blocking the host (do this before a kernel reads what a load wrote).
    """

    __slots__ = ("kind", "nbytes", "_engine", "_start", "_end", "_keep", "_callbacks",
                 "_finished", "_latency_s")

    def __init__(
        self,
        *,
        engine: CopyEngine,
        kind: CopyKind,
        nbytes: int,
        keep: tuple[Any, ...],
        start: torch.cuda.Event | None,
        end: torch.cuda.Event | None,
    ) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self._engine = engine
        self._start = start
        self._end = end
        self._keep: list[Any] = list(keep)
        self._callbacks: list[Callable[[CopyHandle], None]] = []
        self._finished = False
        self._latency_s: float | None = None

    def __repr__(self) -> str:
        state = "finished" if self._finished else "pending"
        return f"CopyHandle({self.kind.value}, {self.nbytes} B, {state})"

    # ------------------------------------------------------------------ status
    def done(self) -> bool:
        """Whether the copy has completed on the device (non-blocking query)."""
        return self._finished or self._end is None or self._end.query()

    def wait(self) -> None:
        """Block until the copy has completed, then finish it (refs dropped, callbacks run)."""
        if not self._finished:
            if self._end is not None:
                self._end.synchronize()
            self._finish()

    def wait_event(self) -> None:
        """Block until the copy has completed *without* finishing the handle.

        Safe from another thread (e.g. a disk writer waiting for its payload to land in
        host memory): it only synchronizes the end event; the engine's own thread still
        finishes the handle in :meth:`CopyEngine.poll`.
        """
        if self._end is not None:
            self._end.synchronize()

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream of the engine's device) wait for
        this copy, on the device; the host does not block. No-op on CPU."""
        if self._end is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self._engine.device)
        stream.wait_event(self._end)

    @property
    def finished(self) -> bool:
        """Whether completion has been observed (latency known, refs dropped, callbacks run)."""
        return self._finished

    @property
    def latency_s(self) -> float | None:
        """Seconds the copy took (CUDA: event time on its stream), once finished."""
        return self._latency_s

    # --------------------------------------------------------------- lifetimes
    def add_done_callback(self, fn: Callable[[CopyHandle], None]) -> None:
        """Call ``fn(handle)`` once the copy is finished; at once if it already is."""
        if self._finished:
            fn(self)
        else:
            self._callbacks.append(fn)

    def keep_alive(self, *objs: Any) -> None:
        """Hold references to ``objs`` until the copy is finished."""
        if not self._finished:
            self._keep.extend(objs)

    def _finish(self, latency_s: float | None = None) -> None:
        if self._finished:
            return
        if latency_s is None and self._start is not None and self._end is not None:
            latency_s = self._start.elapsed_time(self._end) / 1e3
        self._latency_s = latency_s
        self._finished = True
        self._keep.clear()
        self._engine._account_finished(self)
        callbacks, self._callbacks = self._callbacks, []
        errors: list[BaseException] = []
        for fn in callbacks:
            try:
                fn(self)
            except Exception as exc:  # run the others, then re-raise the first
                errors.append(exc)
        if errors:
            raise errors[0]


class CopyEngine:
    """Batches block and tensor copies between ``device`` and host memory.

    ``device``: ``"cpu"`` (synchronous copies) or a CUDA device (side streams, events).
    On CUDA, host tensors must be pinned (:func:`tiered_kv.device.empty_host`), so that
    the copies are asynchronous and the engine can order them with events.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = resolve_device(device)
        self._cuda = self.device.type == "cuda"
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        if self._cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        self._pending: deque[CopyHandle] = deque()
        self.copies = 0
        self.completed = 0
        self.bytes_d2h = 0
        self.bytes_h2d = 0
        self.bytes_local = 0
        self._latency_total_s = 0.0
        self._latency_max_s = 0.0
        self._recent: deque[float] = deque(maxlen=RECENT_LATENCIES)

    def __repr__(self) -> str:
        return f"CopyEngine({self.device}, copies={self.copies}, pending={len(self._pending)})"

    def __enter__(self) -> CopyEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.synchronize()

    # ------------------------------------------------------------------ copies
    def offload_blocks(self, parts: Sequence[torch.Tensor], block_ids: torch.Tensor,
                       host_out: torch.Tensor) -> CopyHandle:
        """Gather blocks into host records (device -> host).

        parts: ``[L_p, num_blocks, E_p, B_p] uint8`` on the engine's device.
        block_ids: ``[n] int64`` (CPU preferred: checking them needs no device sync).
        host_out: ``[n, record_bytes] uint8`` CPU, pinned on CUDA; valid once the handle
        is done. The blocks must not be overwritten (nor their ids reused) before then.
        """
        self._check_on_device("parts[0]", parts[0] if len(parts) else None)
        self._check_host("host_out", host_out)
        return self._submit(
            CopyKind.D2H, host_out.numel(), (parts, block_ids, host_out),
            lambda: kernels.gather_blocks(parts, block_ids, host_out),
        )

    def load_blocks(self, host_records: torch.Tensor, block_ids: torch.Tensor,
                    parts: Sequence[torch.Tensor]) -> CopyHandle:
        """Scatter host records into blocks (host -> device), the inverse of
        :meth:`offload_blocks`. Call ``handle.make_stream_wait()`` before a kernel reads
        the blocks; keep ``host_records`` unchanged until the handle is done."""
        self._check_host("host_records", host_records)
        self._check_on_device("parts[0]", parts[0] if len(parts) else None)
        return self._submit(
            CopyKind.H2D, host_records.numel(), (host_records, block_ids, parts),
            lambda: kernels.scatter_blocks(host_records, block_ids, parts),
        )

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """``dst.copy_(src)`` for tensors of one shape and dtype, each on the engine's
        device or on the CPU (pinned on CUDA)."""
        for name, t in (("dst", dst), ("src", src)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"dst: expected shape {list(src.shape)} and dtype {src.dtype} like src, "
                f"got {list(dst.shape)} {dst.dtype}"
            )
        for name, t in (("dst", dst), ("src", src)):
            if t.device.type == "cpu":
                self._check_host(name, t)
            else:
                self._check_on_device(name, t)
        src_host, dst_host = src.device.type == "cpu", dst.device.type == "cpu"
        if self._cuda and not src_host and dst_host:
            kind = CopyKind.D2H
        elif self._cuda and src_host and not dst_host:
            kind = CopyKind.H2D
        else:
            kind = CopyKind.LOCAL
        nbytes = src.numel() * src.element_size()
        non_blocking = self._cuda
        return self._submit(kind, nbytes, (dst, src),
                            lambda: dst.copy_(src, non_blocking=non_blocking))

    # -------------------------------------------------------------- completion
    @property
    def pending(self) -> int:
        """Submitted copies whose completion has not been observed yet."""
        return sum(1 for h in self._pending if not h.finished)

    def poll(self) -> int:
        """Finish every copy that has completed (non-blocking); return how many.

        Finishing records the latency, drops the tensor references and runs the
        handle's done-callbacks.
        """
        still: deque[CopyHandle] = deque()
        finished = 0
        errors: list[BaseException] = []
        while self._pending:
            handle = self._pending.popleft()
            if handle.finished:
                continue
            if not handle.done():
                still.append(handle)
                continue
            finished += 1
            try:
                handle._finish()
            except Exception as exc:  # keep polling the rest, then re-raise
                errors.append(exc)
        self._pending = still
        if errors:
            raise errors[0]
        return finished

    def synchronize(self) -> None:
        """Block until every submitted copy is done, then finish them all."""
        for stream in (self._d2h, self._h2d):
            if stream is not None:
                stream.synchronize()
        self.poll()

    def stats(self) -> CopyStats:
        return CopyStats(
            copies=self.copies,
            completed=self.completed,
            pending=self.pending,
            bytes_d2h=self.bytes_d2h,
            bytes_h2d=self.bytes_h2d,
            bytes_local=self.bytes_local,
            latency_total_s=self._latency_total_s,
            latency_max_s=self._latency_max_s,
            recent_latencies_s=tuple(self._recent),
        )

    # --------------------------------------------------------------- internals
    def _check_on_device(self, name: str, t: torch.Tensor | None) -> None:
        if t is None:
            return  # kernels' own validation reports the empty parts list
        if isinstance(t, torch.Tensor) and t.device != self.device:
            raise ValueError(f"{name}: expected a tensor on the engine's device {self.device}, got {t.device}")

    def _check_host(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor):
            return  # kernels' validation reports the type
        if t.device.type != "cpu":
            raise ValueError(f"{name}: expected a host (cpu) tensor, got {t.device}")
        if self._cuda and not t.is_pinned():
            raise ValueError(
                f"{name}: expected pinned host memory on a CUDA engine (allocate it with "
                "tiered_kv.device.empty_host(..., pinned=True))"
            )

    def _submit(self, kind: CopyKind, nbytes: int, keep: tuple[Any, ...],
                work: Callable[[], object]) -> CopyHandle:
        if not self._cuda:
            t0 = time.perf_counter()
            work()
            latency = time.perf_counter() - t0
            handle = CopyHandle(engine=self, kind=kind, nbytes=nbytes, keep=(), start=None, end=None)
            self._account_submitted(kind, nbytes)
            handle._finish(latency)
            return handle

        stream = self._d2h if kind is CopyKind.D2H else self._h2d
        assert stream is not None
        # Ordered after the kernels that produced the data (and, for a load, after the
        # readers of the blocks about to be overwritten).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            work()
            end.record(stream)
        handle = CopyHandle(engine=self, kind=kind, nbytes=nbytes, keep=keep, start=start, end=end)
        self._account_submitted(kind, nbytes)
        self._pending.append(handle)
        return handle

    def _account_submitted(self, kind: CopyKind, nbytes: int) -> None:
        self.copies += 1
        if kind is CopyKind.D2H:
            self.bytes_d2h += nbytes
        elif kind is CopyKind.H2D:
            self.bytes_h2d += nbytes
        else:
            self.bytes_local += nbytes

    def _account_finished(self, handle: CopyHandle) -> None:
        self.completed += 1
        latency = handle.latency_s or 0.0
        self._latency_total_s += latency
        self._latency_max_s = max(self._latency_max_s, latency)
        self._recent.append(latency)
