"""How an encrypted level reads: each record at its name under the current key (then under
the older keys given), read whole from a local backend or streamed from an object store,
opened, authenticated, and never left unauthenticated in a caller's buffer.

On a backend that streams (``supports_streamed_reads``: a Zarr store on S3), each envelope
is opened on the backend's I/O thread as its response arrives, decrypted straight into the
caller's buffer (or the pieces of a scatter list), with no staging copy
(:class:`~.envelopes.EnvelopeSink`); the record's xxh3 is not computed there, the tag covers
every byte it covers. On a backend that maps records in place
(:meth:`~tiered_kv.storage.api.store.BlockStore.map_unhashed`: LMDB, for what the page
cache holds) each envelope is decrypted straight from the map of its segment file into the
caller's buffer, on several threads, chunk by chunk as they are mapped
(:meth:`EnvelopeReads.read_mapped`): one pass over the bytes, as a plain read's copy. The
rest (cold records, other local backends) is read, checked but not hashed (the tag covers
what the checksum covers), in chunks of at most 8 MiB into reusable per-thread arenas, and
opened on several threads, pipelined (:meth:`EnvelopeReads.read_chunked`).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import ExitStack
from typing import Any

import numpy as np

from ..api.counters import Counters
from ..api.store import BlockStore, Unread
from ..errors import StoreError
from ..format.record import RecordKey, RecordKind, RecordMeta, as_out_segments, write_segments
from .crypto import ENVELOPE_OVERHEAD, ENVELOPE_VERSION, HEAD_BYTES, LEGACY_ENVELOPE_OVERHEAD, Keyring
from .envelopes import EnvelopeSink, Opener, Outcome, Read, Skip, Target, zero
from .work import Workers, drain

__all__ = ["EnvelopeReads"]

#: A record of another size than asked, at one of our names, is authenticated at its own
#: size up to this many bytes (above: a miss, kept: too large to read to find out).
_OTHER_SIZE_MAX = 256 << 20
#: A backend read of a record of another size than the envelope asked for.
_WRONG_SIZE: Any = object()


class EnvelopeReads:
    """The reads of one encrypted level over its backend ``inner`` (see the module
    docstring). ``sizes``: the payload size of each record kind, as seen (shared with the
    wrapper: its writes and ``verify`` use it); ``counters``: the wrapper's."""

    def __init__(self, inner: BlockStore, keyring: Keyring, opener: Opener, workers: Workers, counters: Counters,
                 sizes: dict[RecordKind, int]) -> None:
        self.inner = inner
        self.keyring = keyring
        self.opener = opener
        self.workers = workers
        self.counters = counters
        self.sizes = sizes

    @property
    def readonly(self) -> bool:
        return self.inner.readonly

    def keys_of(self, names: list[RecordKey]) -> list[RecordKey]:
        """The keys of the records at ``names`` that are this version's envelopes under a
        key given (their heads read: nothing decrypted, nothing removed)."""
        out: list[RecordKey] = []
        sizes = self.inner.payload_sizes(names)
        todo = [(n, s) for n, s in zip(names, sizes) if s is not None and s >= ENVELOPE_OVERHEAD]
        for start in range(0, len(todo), 64):
            chunk = todo[start:start + 64]
            targets = [Target(n, None, None, as_out_segments(np.empty(s - ENVELOPE_OVERHEAD, np.uint8)), None,
                               lambda opened: True) for n, s in chunk]
            for r in self.read_targets(targets, [s for _, s in chunk]):
                if r.outcome is Outcome.SKIPPED and r.opened is not None and r.key is not None \
                        and r.opened.version == ENVELOPE_VERSION:
                    out.append(r.key)
        return out

    def count(self, reads: list[Read]) -> None:
        hits = sum(r.outcome is Outcome.OK for r in reads)
        auth = sum(r.outcome in (Outcome.FOREIGN, Outcome.FORGED) for r in reads)
        corrupt = sum(r.outcome is Outcome.DIGEST for r in reads)
        self.counters.add(hits=hits, misses=len(reads) - hits, auth_failures=auth, corrupt=corrupt)

    def read(self, keys: list[RecordKey], segs: list[Any], digests: list[bytes | None], *,
              remove: bool = True) -> list[Read]:
        """Read, authenticate and decrypt record ``keys[i]`` into ``segs[i]``
        (OutSegments): at its name under the current key, then, where absent, under each
        older key's. ``remove``: remove what is not authentic at our names (FORGED,
        DIGEST)."""
        reads = [Read(Outcome.ABSENT)] * len(keys)
        todo = list(range(len(keys)))
        for gen, k in enumerate(self.keyring.keys):
            if not todo:
                break
            targets = [Target(k.name(keys[i]), keys[i], gen, segs[i], digests[i], None) for i in todo]
            for i, r in zip(todo, self.read_targets(targets, [segs[i].nbytes + ENVELOPE_OVERHEAD for i in todo])):
                reads[i] = r
            todo = [i for i in todo if reads[i].outcome is Outcome.ABSENT]
        for i, r in enumerate(reads):
            if r.outcome is Outcome.OTHER_SIZE:
                reads[i] = self.other_size(keys[i], segs[i], r)
        if remove:
            self.remove(reads)
        return reads

    def remove(self, reads: Sequence[Read]) -> None:
        """Delete what no reader can use (FORGED, DIGEST) where it was read."""
        if self.readonly:
            return
        removed = 0
        for r in reads:
            if r.outcome in (Outcome.FORGED, Outcome.DIGEST) and r.name is not None:
                try:
                    gone = self.inner.delete(r.name)
                except (StoreError, OSError):
                    gone = False  # still a miss on every read; the next reader tries again
                removed += gone and r.outcome is Outcome.FORGED
        self.counters.add(auth_removed=removed)

    def other_size(self, key: RecordKey, segs: Any, r: Read) -> Read:
        """A record of another size than asked at ``key``'s name: authenticated at its own
        size. Authentic: a miss, kept (the caller asked for the wrong size); else FORGED
        (removed: pollution cannot squat the name). The caller's out is zeroed."""
        zero(segs)
        assert r.name is not None
        n = self.inner.payload_sizes([r.name])[0]
        if n is None:
            return Read(Outcome.ABSENT, name=r.name)
        if n < ENVELOPE_OVERHEAD:
            return Read(Outcome.FORGED, name=r.name)
        if n - ENVELOPE_OVERHEAD > _OTHER_SIZE_MAX:
            return r
        gen = next(g for g, k in enumerate(self.keyring.keys) if k.name(key) == r.name)
        scratch = np.zeros(n - ENVELOPE_OVERHEAD, np.uint8)
        try:
            got = self.read_targets([Target(r.name, key, gen, as_out_segments(scratch), None, None)], [n])[0]
        finally:
            scratch.fill(0)
        if got.outcome is Outcome.OK:
            return Read(Outcome.OTHER_SIZE, opened=got.opened, key=key, name=r.name)
        return got if got.outcome is not Outcome.OTHER_SIZE else r

    def read_targets(self, targets: list[Target], env_sizes: list[int]) -> list[Read]:
        """Each target's record read at envelope size ``env_sizes[i]`` and opened."""
        if self.inner.supports_streamed_reads:
            return self.read_streamed(targets, env_sizes)
        return self.read_chunked(targets, env_sizes)

    def read_streamed(self, targets: list[Target], env_sizes: list[int]) -> list[Read]:
        """:meth:`_read_targets` on a backend that streams (an object store): each envelope
        opened on the backend's I/O thread as its response arrives (see
        :class:`EnvelopeSink`); nothing is staged, nothing hashed twice."""
        sinks: list[EnvelopeSink | None] = [None] * len(targets)
        lock = threading.Lock()
        cancelled = False

        def open_sink(i: int, meta: RecordMeta) -> EnvelopeSink:
            sink = EnvelopeSink(self.opener, targets[i], meta, env_sizes[i])
            with lock:
                sinks[i] = sink
                if cancelled:  # (an I/O thread still going after the call was given up)
                    sink.discard()
            return sink

        try:
            results = self.inner.read_each([t.name for t in targets], env_sizes, open_sink)
        except BaseException:
            with lock:
                cancelled = True
                started = list(sinks)
            for i, sink in enumerate(started):
                if sink is not None:
                    sink.discard()
                elif targets[i].key is not None:
                    zero(targets[i].segs)
            raise
        reads = []
        for t, r in zip(targets, results):
            if r is Unread.ABSENT:
                r = Read(Outcome.ABSENT, name=t.name)
            elif r is Unread.OTHER_SIZE:
                r = Read(Outcome.OTHER_SIZE, name=t.name)
            elif r.outcome is Outcome.OK:
                self.sizes.setdefault(t.name.kind, t.segs.nbytes)
            reads.append(r)
        return reads

    def read_chunked(self, targets: list[Target], env_sizes: list[int]) -> list[Read]:
        """:meth:`_read_targets` on a backend that reads whole records (LMDB, a local
        directory).

        Pipelined over chunks of at most ``_CHUNK_BYTES`` of envelopes, two arenas per
        thread: while the pool opens chunk k, this thread reads chunk k+1 into the other
        arena; the last chunk is opened by the pool and this thread together. A failure
        (the backend raising) waits for the chunk in flight first: no pool thread is left
        writing into a caller's buffer."""
        reads = [Read(Outcome.ABSENT, name=t.name) for t in targets]

        def open_one(job: tuple[int, np.ndarray, RecordMeta]) -> tuple[int, Read]:
            i, env, m = job
            return i, self.open(targets[i], env, m)

        inflight: list[Future[list[tuple[int, Read]]]] = []
        try:
            rest = self.read_mapped(targets, env_sizes, reads, open_one)
            chunks = [[rest[j] for j in c] for c in self.workers.chunks([env_sizes[i] for i in rest])]
            for n, chunk in enumerate(chunks):
                offs = [0, *itertools.accumulate(env_sizes[i] for i in chunk)]
                arena = self.workers.arena(f"get_arena{n % 2}", offs[-1])
                envs = [arena[offs[j]:offs[j + 1]] for j in range(len(chunk))]
                jobs = []
                for i, env, m in zip(chunk, envs, self.inner_get([targets[i].name for i in chunk], envs)):
                    if m is _WRONG_SIZE:
                        reads[i] = Read(Outcome.OTHER_SIZE, name=targets[i].name)
                    elif m is not None:
                        jobs.append((i, env, m))
                done = self.workers.gather(inflight)  # chunk n-1 opened: its arena is free for chunk n+1
                inflight = []
                if n == len(chunks) - 1:
                    done += self.workers.parallel(open_one, jobs, sum(env_sizes[i] for i, _, _ in jobs))
                else:
                    inflight = self.workers.submit(open_one, jobs)
                for i, r in done:
                    reads[i] = r
                    if r.outcome is Outcome.OK:
                        self.sizes.setdefault(targets[i].name.kind, targets[i].segs.nbytes)
        except BaseException:
            drain(inflight)
            for t, r in zip(targets, reads):
                if t.key is not None and r.outcome is not Outcome.OK:
                    zero(t.segs)
            raise
        self.recheck_forged(targets, env_sizes, reads)
        return reads

    def read_mapped(self, targets: list[Target], env_sizes: list[int], reads: list[Read],
                    open_one: Callable[[tuple[int, np.ndarray, RecordMeta]], tuple[int, Read]]) -> list[int]:
        """The envelopes the backend maps in place
        (:meth:`~tiered_kv.storage.api.store.BlockStore.map_unhashed`: those the page cache
        holds, checked but not hashed) opened straight from the map into the targets' outs:
        one pass over the bytes, no copy into an arena. Mapped chunk by chunk (at most
        ``CHUNK_BYTES`` each), the pool opening the first chunk's while this thread maps and
        checks the next, then joining in (:meth:`~.work.Workers.stream`). Sets their
        ``reads``; returns the indices of the others (read by :meth:`read_chunked`)."""
        rest: list[int] = []
        with ExitStack() as held:  # (every chunk's views, until all are opened)

            def batches() -> Iterator[list[tuple[int, np.ndarray, RecordMeta]]]:
                for chunk in self.workers.chunks(env_sizes):
                    mapped = held.enter_context(self.inner.map_unhashed([targets[i].name for i in chunk],
                                                                        [env_sizes[i] for i in chunk]))
                    batch = []
                    for i, m in zip(chunk, mapped):
                        if m is None:
                            rest.append(i)
                        else:
                            batch.append((i, m.payload, m.meta))
                    yield batch

            for i, r in self.workers.stream(open_one, batches(), sum(env_sizes)):
                reads[i] = r
                if r.outcome is Outcome.OK:
                    self.sizes.setdefault(targets[i].name.kind, targets[i].segs.nbytes)
        return rest

    def recheck_forged(self, targets: list[Target], env_sizes: list[int], reads: list[Read]) -> None:
        """The envelopes read unhashed whose tag failed, read again with the backend's
        checksum: one the backend finds corrupt (bit rot, a torn write: it counts it and
        drops it, as a hashed read would have) is a plain miss, not a forgery; one whose
        checksum holds stays FORGED (written without our key). Their outs are already
        zeroed. Runs only when a tag failed."""
        for i, r in enumerate(reads):
            if r.outcome is not Outcome.FORGED:
                continue
            env = np.empty(env_sizes[i], np.uint8)
            try:
                again = self.inner.get_many([targets[i].name], [env])[0]
            except ValueError:
                continue  # (another size now: leave the verdict)
            if again is None:
                reads[i] = Read(Outcome.ABSENT, name=targets[i].name)

    def inner_get(self, names: list[RecordKey], envs: list[np.ndarray]) -> list[Any]:
        """The backend's reads of the envelopes, checked but for the payload's checksum
        (:meth:`~tiered_kv.storage.api.store.BlockStore.get_many_unhashed`: each envelope's
        GCM tag is checked when it is opened, and a failing one leaves the caller's buffer
        zeroed); ``_WRONG_SIZE`` for a record of another size (the backend raises
        ValueError for the batch: asked one by one)."""
        try:
            return self.inner.get_many_unhashed(names, envs)  # (each envelope's tag is its check)
        except ValueError:
            out: list[Any] = []
            for name, env in zip(names, envs):
                try:
                    out.append(self.inner.get(name, env))
                except ValueError:
                    out.append(_WRONG_SIZE)
            return out

    def open(self, t: Target, env: np.ndarray, m: RecordMeta) -> Read:
        """One whole envelope (read and checksum-verified by the backend) opened into the
        target's out; the out is zeroed unless the outcome is authentic, an exception in
        flight included."""
        try:
            r = self.open_checked(t, env, m)
        except BaseException:
            zero(t.segs)
            raise
        if r.outcome is not Outcome.OK and (t.key is not None or r.outcome is not Outcome.SKIPPED):
            zero(t.segs)
        return r

    def open_checked(self, t: Target, env: np.ndarray, m: RecordMeta) -> Read:
        decided, opened, key = self.opener.identify(t, env[:HEAD_BYTES], m, env.nbytes)
        if decided is not None:
            return decided
        assert opened is not None and key is not None
        segs = t.segs
        single = len(segs) == 1
        dst = segs[0] if single else self.workers.arena("scratch", segs.nbytes)[:segs.nbytes]
        try:
            ok = self.keyring.open_into(opened, env[opened.head_bytes:], self.opener.aad(opened, key), dst)
            r = self.opener.decided(t, opened, key, ok)
            if r.outcome is Outcome.OK and not single:
                write_segments(segs, dst)
        finally:
            if not single:
                dst.fill(0)  # (the scratch held plaintext: authentic or not, it is not left)
        return r

    # ------------------------------------------------------------------ listing reads
    def read_names(self, names: list[RecordKey], payload_bytes: list[int], *, skip: Skip | None = None
                    ) -> tuple[list[Read], list[np.ndarray]]:
        """Read what each listed name holds, as a record of ``payload_bytes[i]`` (this
        version's envelope, else an earlier version's of that payload size), into fresh
        buffers: ``(reads, buffers)``. Removes nothing."""
        bufs = [np.empty(n, np.uint8) for n in payload_bytes]
        targets = [Target(name, None, None, as_out_segments(b), None, skip) for name, b in zip(names, bufs)]
        reads = self.read_targets(targets, [n + ENVELOPE_OVERHEAD for n in payload_bytes])
        legacy = [i for i, r in enumerate(reads) if r.outcome is Outcome.OTHER_SIZE]
        if legacy:
            got = self.read_targets([targets[i] for i in legacy],
                                     [payload_bytes[i] + LEGACY_ENVELOPE_OVERHEAD for i in legacy])
            for i, r in zip(legacy, got):
                reads[i] = r
        return reads, bufs

    def scan(self, sizes: Mapping[RecordKind, int], visit: Callable[[RecordKey, Read, np.ndarray], None], *,
              remove: bool, skip: Skip | None = None, batch: int = 64,
              progress: Callable[[int, int], None] | None = None) -> int:
        """Read every stored name of a kind in ``sizes``, ``batch`` per call, and call
        ``visit(name, read, payload buffer)``; returns how many were of another kind.
        ``remove``: delete what is not an envelope and what fails its tag under a key
        given (FORGED: nobody can read it); envelopes under keys not given are kept."""
        names = list(self.inner)
        todo = [n for n in names if n.kind in sizes]
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            reads, bufs = self.read_names(chunk, [sizes[n.kind] for n in chunk], skip=skip)
            if remove:
                self.remove([r for r in reads if r.outcome is Outcome.FORGED])
            for name, r, buf in zip(chunk, reads, bufs):
                visit(name, r, buf)
            if progress is not None:
                progress(start + len(chunk), len(todo))
        return len(names) - len(todo)
