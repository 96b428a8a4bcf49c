"""The cache's side of the disk tier: write-behind to a :class:`BlockStore`, reads on demand.

Full blocks and registered snapshots are written *behind* the request by one background
thread, so the request path never waits on disk; :meth:`DiskTier.flush` waits for every
write submitted so far. That thread writes whatever is queued when it starts a batch in
one ``put_many`` (one store sync per batch, not per record). A write that fails (full disk, full map, an I/O error) is
counted and its message kept; the data stays in the GPU and host tiers and the cache
keeps serving. A run of failures logs one warning, not one per record. Writes are bounded: past ``max_pending`` queued writes a submit waits
for the oldest one (back-pressure, never a dropped record).

Reads come in batches: :meth:`DiskTier.read_many` is one ``get_many`` (one transaction
or one round of concurrent requests) straight into the caller's buffers, and
:meth:`DiskTier.read_async` runs one on a small pool of reader threads, so that
``open()`` reads the next batch of a long prefix while it copies the last one into the
pools (see :mod:`tiered_kv.tiering`).

Exit: a disk tier still open when the interpreter exits is closed then (its queued writes
land, a store it opened is closed), before Python's thread pools stop accepting work: see
:mod:`tiered_kv.storage.at_exit`. After :meth:`DiskTier.close` a submit raises
:class:`DiskTierClosedError`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from .layout import KVLayout
from .policy.admission import DEFAULT_ADMISSION, AdmissionFilter, AdmissionPolicy, admission_policy
from .storage.os.threads import started_pool

__all__ = ["DiskTier", "DiskTierClosedError"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class DiskTierClosedError(RuntimeError):
    """A write or read was asked of a disk tier after :meth:`DiskTier.close`."""


class DiskTier:
    """A :class:`tiered_kv.storage.BlockStore` behind a write-behind thread.

    Args:
        store: an open store, or a URL for :func:`tiered_kv.storage.open_store`
            (``lmdb:///path``, ``zarr:///path``, ``zarr+s3://bucket/prefix?endpoint=...``),
            or a list of them, nearest first (``["lmdb:///local", "zarr+s3://..."]``): a
            :class:`tiered_kv.storage.StoreChain` whose first level is written here and
            the farther ones in the chain's background (see ``docs/shared-store.md``). A
            store opened here is closed by :meth:`close`.
        layout: the cache's layout (the store must have been created for it).
        max_pending: queued writes before a submit waits for the oldest.
        read_threads: threads of :meth:`read_async` (batches read concurrently).
        store_options: options of :func:`~tiered_kv.storage.open_store`; for a list, the
            chain's (``timeout_s``, ``backoff_max_s``, ...) and ``level_options``, one
            dict per level.
        writer: who writes (a :class:`~tiered_kv.storage.StoreWriter`), recorded by a
            store created here.
        admission: the disk admission filter (:mod:`tiered_kv.policy.admission`):
            ``"all"`` (every record written through, the default), ``"retraced"``,
            ``"second-hit"``, ``"seen-twice"``, ``"hits:N"`` or ``"survived:N"``. The
            cache asks :attr:`admission` before it submits a record
            and again when a memory tier serves one; rejects are counted in :meth:`stats`.
    """

    def __init__(self, store: Any, layout: KVLayout, *, max_pending: int = 64,
                 store_options: dict[str, Any] | None = None, read_threads: int = 2,
                 writer: Any | None = None, admission: str | AdmissionPolicy = DEFAULT_ADMISSION) -> None:
        from .storage import BlockStore, open_store
        from .storage.os.at_exit import close_at_exit

        self._owns_store = not isinstance(store, BlockStore)
        if self._owns_store:
            options = dict(store_options or {})
            if writer is not None:
                options.setdefault("writer", writer)
            store = open_store(store, layout_fingerprint=layout.fingerprint, **options)
        elif store.layout_fingerprint != layout.fingerprint:
            from .storage import LayoutMismatchError
            raise LayoutMismatchError(f"store: expected layout fingerprint {layout.fingerprint}, "
                                      f"the store holds {store.layout_fingerprint}")
        self.store = store
        self.layout = layout
        #: which records reach this tier (the cache asks it at seal / publish and on hits)
        self.admission = AdmissionFilter(admission_policy(admission))
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending <= 0:
            raise ValueError(f"max_pending: expected a positive int, got {max_pending!r}")
        self.max_pending = max_pending
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or read_threads <= 0:
            raise ValueError(f"read_threads: expected a positive int, got {read_threads!r}")
        self.read_threads = read_threads
        # (started now, not by the first read: see tiered_kv.storage.thread_pool)
        self._readers: ThreadPoolExecutor | None = started_pool(read_threads, "tiered-kv-read")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered-kv-disk")
        self._pending: deque[Future[None]] = deque()
        #: writes not yet taken by the writer thread: (item, ready, its future)
        self._queue: deque[tuple[Any, Callable[[], None] | None, Future[None]]] = deque()
        self._queue_lock = threading.Lock()
        self._draining = False  # a _drain job is queued or running
        #: keys submitted whose write has not finished (landed or failed), under _queue_lock
        self._in_flight: dict[Any, int] = {}
        self._lock = threading.Lock()
        self.writes = 0
        self.write_errors = 0
        self.write_bytes = 0
        self.last_write_error: str | None = None
        #: called on the writer thread with the key of each record whose write failed (after
        #: it is counted); e.g. a trace replay, to know which records never reached the store
        self.on_write_failed: Callable[[Any], None] | None = None
        self._failing = 0  # writes failed since the last one that succeeded
        self.reads = 0
        self.read_hits = 0
        self.read_bytes = 0
        self._closed = False
        #: keys the store reported evicted (by this handle's puts: on the writer thread),
        #: not yet taken by the cache (:meth:`take_evicted`, on the cache's thread); bounded:
        #: past it the oldest reports are dropped (their memory blocks are not pruned)
        self._evicted: deque[Any] = deque(maxlen=self.max_tracked_evicted)
        #: keys taken by :meth:`take_evicted` that the store still lacks (not submitted
        #: again since), oldest first, at most ``max_tracked_evicted``
        self._gone: OrderedDict[Any, None] = OrderedDict()
        self._listens = self._listen_for_evictions()
        #: closes this tier at interpreter exit if close() was not called (see the module docstring)
        self._at_exit = close_at_exit(self.close)

    # ------------------------------------------------------ store evictions
    def _listen_for_evictions(self) -> bool:
        """Ask the store to report the keys it evicts (a store with ``on_evict``, the LMDB
        store, and nobody listening yet). A :class:`~tiered_kv.storage.StoreChain` reports
        nothing: what its first level evicts its farther levels still hold."""
        if getattr(self.store, "on_evict", False) is not None:
            return False
        self.store.on_evict = self._evicted.extend
        return True

    #: store-evicted keys remembered by :meth:`evicted_from_store` (the oldest forgotten first)
    max_tracked_evicted = 1 << 18

    def take_evicted(self) -> list[Any]:
        """The keys of the records the store evicted since the last call and does not hold
        again (neither stored nor on their way since), oldest first. This handle's
        evictions only: another process's, sharing the store, are never seen. For the
        cache's thread (the writer thread only appends to the queue); the keys taken are
        remembered (:meth:`evicted_from_store`) until submitted again."""
        out = []
        while True:
            try:
                out.append(self._evicted.popleft())
            except IndexError:
                break
        if not out:
            return out
        out = [k for k, held in zip(out, self.holds_many(out)) if not held]
        for k in out:
            self._gone[k] = None
            self._gone.move_to_end(k)
        while len(self._gone) > self.max_tracked_evicted:
            self._gone.popitem(last=False)
        return out

    def evicted_from_store(self, key: Any) -> bool:
        """The store reported ``key`` evicted (:meth:`take_evicted`) and it was not
        submitted since."""
        return key in self._gone

    # ----------------------------------------------------------------- writes
    def submit(self, key: Any, parent_hash: bytes, token_digest: bytes, payload: torch.Tensor,
               ready: Callable[[], None] | None = None) -> None:
        """Queue one record write. ``payload`` is a CPU uint8 tensor the caller no longer
        changes; ``ready`` (e.g. a copy handle's ``wait``) is called on the writer thread
        before the payload is read.

        The writer thread takes every write queued when it starts a batch (up to
        ``max_pending``) into one ``put_many``: one sync of the store for the batch instead
        of one per record (on LMDB a record's ``fdatasync`` costs milliseconds). Order,
        back-pressure and accounting are per record as before; a batch that fails is
        written again record by record, so each failure is counted for its own record."""
        from .storage import PutItem

        item = PutItem(key=key, parent_hash=parent_hash, token_digest=token_digest, payload=payload)
        self._check_open("submit")
        self._gone.pop(key, None)
        while len(self._pending) >= self.max_pending:
            self._pending.popleft().result()
        done: Future[None] = Future()
        with self._queue_lock:
            self._queue.append((item, ready, done))
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
            start, self._draining = not self._draining, True
        if start:
            self._executor.submit(self._drain)
        self._pending.append(done)

    def _drain(self) -> None:
        """Writer thread: write queued records in batches until the queue is empty."""
        while True:
            with self._queue_lock:
                n = min(len(self._queue), self.max_pending)
                batch = [self._queue.popleft() for _ in range(n)]
                if not batch:
                    self._draining = False
                    return
            try:
                self._write_batch(batch)
            finally:
                with self._queue_lock:
                    for item, _, _ in batch:
                        n = self._in_flight.pop(item.key, 1) - 1
                        if n:
                            self._in_flight[item.key] = n
                for _, _, done in batch:
                    if not done.done():
                        done.set_result(None)

    def _write_batch(self, batch: list[tuple[Any, Callable[[], None] | None, Future[None]]]) -> None:
        items = []
        for item, ready, done in batch:
            try:
                if ready is not None:
                    ready()
            except Exception as exc:  # this record's copy failed: counted, the others go on
                self._write_failed(exc, item.key)
                done.set_result(None)
                continue
            items.append(item)
        if not items:
            return
        if len(items) > 1:
            try:
                written = self.store.put_many(items)
            except Exception:  # written again one by one below, so each failure is counted for its record
                written = None
            if written is not None:
                self._wrote(items, written)
                return
        for item in items:
            self._write(item)

    def _write(self, item: Any) -> None:
        try:
            written = self.store.put_many([item])
        except Exception as exc:  # counted and surfaced in stats; the data is still cached above
            self._write_failed(exc, item.key)
            return
        self._wrote([item], written)

    def _wrote(self, items: list[Any], written: list[bool]) -> None:
        with self._lock:
            for item, ok in zip(items, written):
                if ok:
                    self.writes += 1
                    self.write_bytes += int(item.payload.numel())
            failed, self._failing = self._failing, 0
        if failed:
            log.warning("disk writes succeed again, after %d failed (counted in disk_write_errors)", failed)

    def _write_failed(self, exc: Exception, key: Any) -> None:
        """Count a failed write. One warning per run of failures (a full disk fails every
        write until space is freed: one line, not one per record); the count and the last
        error are in :meth:`stats`, and the next write that succeeds logs how many failed.
        :attr:`on_write_failed` is told the record's key."""
        with self._lock:
            self.write_errors += 1
            self.last_write_error = f"{type(exc).__name__}: {exc}"
            first = self._failing == 0
            self._failing += 1
        if self.on_write_failed is not None:
            self.on_write_failed(key)
        if first:
            log.warning("disk write failed: %s; the records stay in the GPU and host tiers; further failures "
                        "are counted (disk_write_errors), not logged, until a write succeeds", exc)

    def flush(self, *, uploads: bool = False, timeout_s: float | None = None) -> bool:
        """Wait until every write submitted so far has finished (or failed and been counted).

        ``uploads=True``: for a :class:`tiered_kv.storage.StoreChain`, then wait until its
        uploads to the farther levels are done too (:meth:`~tiered_kv.storage.StoreChain.flush`);
        False if ``timeout_s`` passed first. True otherwise.
        """
        self._check_open("flush")
        while self._pending:
            self._pending.popleft().result()
        from .storage import StoreChain

        if isinstance(self.store, StoreChain):
            return self.store.flush(uploads=uploads, timeout_s=timeout_s)
        return True

    # ------------------------------------------------------------------ reads
    def holds_many(self, keys: list[Any]) -> list[bool]:
        """Each key's record is on its way (submitted, not finished) or in the store. A
        store that cannot answer is taken to hold none (at worst a record is written
        again; the store keeps one copy)."""
        with self._queue_lock:
            out = [k in self._in_flight for k in keys]
        ask = [k for k, ok in zip(keys, out) if not ok]
        if not ask:
            return out
        try:
            found = iter(self.contains_many(ask))
        except Exception:  # (a failing store: counted where its reads and writes fail)
            found = iter([False] * len(ask))
        return [ok or next(found) for ok in out]

    def contains_many(self, keys: list[Any]) -> list[bool]:
        """Presence of each key, asked in one batch (concurrent on object stores)."""
        return [bool(f) for f in self.store.contains_many(keys)] if keys else []

    def read(self, key: Any, out: torch.Tensor, token_digest: bytes | None = None) -> bool:
        """Read one record's payload into ``out`` (CPU uint8); False on a miss or a bad record."""
        return self.read_many([key], [out], [token_digest])[0]

    def read_many(self, keys: Sequence[Any], outs: Sequence[torch.Tensor],
                  token_digests: Sequence[bytes | None] | None = None) -> list[bool]:
        """Read records into ``outs`` in one ``get_many``; one bool per key (False: a miss
        or a record that failed verification, counted by the store).

        ``outs[i]``: a contiguous CPU uint8 tensor of the payload's size (pinned or not),
        or a scatter list (list of such tensors / uint8 numpy arrays, sizes adding up to
        it: e.g. a pool block's rows), written in place; on a miss its contents are
        unspecified. Thread-safe.
        """
        if not keys:
            return []
        metas = self.store.get_many(list(keys), list(outs), token_digests=token_digests)
        ok = [m is not None for m in metas]
        with self._lock:
            self.reads += len(keys)
            self.read_hits += sum(ok)
            self.read_bytes += sum(m.payload_bytes for m in metas if m is not None)
        return ok

    def read_rows(self, keys: Sequence[Any], rows: Any, token_digests: Sequence[bytes | None] | None = None
                  ) -> list[bool]:
        """Read records into the pieces ``rows`` (a :class:`tiered_kv.storage.RowScatter`
        of ``len(keys)`` records: e.g. pool rows) gives them, in one ``get_rows``; one bool
        per key, as :meth:`read_many`. Thread-safe."""
        if not keys:
            return []
        ok = self.store.get_rows(list(keys), rows, token_digests=token_digests)
        with self._lock:
            self.reads += len(keys)
            self.read_hits += sum(ok)
            self.read_bytes += sum(ok) * rows.nbytes
        return ok

    def read_async(self, keys: Sequence[Any], outs: Sequence[torch.Tensor],
                   token_digests: Sequence[bytes | None] | None = None,
                   ready: Callable[[], None] | None = None) -> Future[list[bool]]:
        """:meth:`read_many` on a reader thread. ``ready`` (e.g. a copy handle's
        ``wait_event``: the last reader of ``outs`` is done) is called there first.

        A caller that drops the future must still wait for it before reusing ``outs``.
        """
        def job() -> list[bool]:
            if ready is not None:
                ready()
            return self.read_many(keys, outs, token_digests)

        return self.run_reader(job)

    def run_reader(self, job: Callable[[], T]) -> Future[T]:
        """Run ``job`` (which reads through :meth:`read_many`, and may copy what it read
        into place) on one of the ``read_threads`` reader threads."""
        if self._readers is None:
            self._readers = started_pool(self.read_threads, "tiered-kv-read")
        return self._readers.submit(job)

    # ------------------------------------------------------------------ admin
    def stats(self) -> dict[str, Any]:
        store = self.store.stats()
        return {
            "disk_writes": self.writes, "disk_write_errors": self.write_errors,
            "disk_write_bytes": self.write_bytes, "disk_reads": self.reads, "disk_read_hits": self.read_hits,
            "disk_read_bytes": self.read_bytes, "disk_pending_writes": sum(not f.done() for f in self._pending),
            "admission_rejects": self.admission.rejects, "admission_admitted": self.admission.admitted,
            "admission_expired": self.admission.expired,
            **{f"store_{k}": v for k, v in store.items() if isinstance(v, (int, float))},
        }

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise DiskTierClosedError(f"{what}: the disk tier is closed (after close() or the cache's "
                                      f"shutdown()); expected an open one")

    def close(self) -> None:
        """Flush pending writes, stop the writer thread, close a store opened from a URL.
        Idempotent."""
        if self._closed:
            return
        self._at_exit.cancel()
        self.flush()
        self._closed = True
        self._executor.shutdown(wait=True)
        if self._readers is not None:
            self._readers.shutdown(wait=True)
        if self._listens and self.store.on_evict == self._evicted.extend:
            self.store.on_evict = None
        if self._owns_store:
            self.store.close()
