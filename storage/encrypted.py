"""A block store whose records a bucket can hold but neither read nor forge.

:class:`EncryptedStore` wraps any :class:`~.base.BlockStore` (LMDB, Zarr on a directory,
Zarr on S3, one level of a chain): each payload is sealed with AES-256-GCM under the
tenant's key before it reaches the backend, which stores the envelope (see
:mod:`.crypto`) as the payload of an ordinary record, checksum and all. So the backend's
own guarantees (write-once, verified reads, eviction, crash recovery, kill -9) hold
unchanged, and the wrapper adds authentication::

    open_store("zarr+s3://kv/v4?endpoint=...", layout_fingerprint=fp,
               encryption={"key_files": ["/etc/tiered-kv/key-2026", "/etc/tiered-kv/key-2025"],
                           "tenant": "acme"})

Reads. On a backend that streams (``supports_streamed_reads``: a Zarr store on S3), each
envelope is opened on the backend's I/O thread as its response arrives, decrypted
straight into the caller's buffer (or the pieces of a scatter list), with no staging
copy: :meth:`~.base.BlockStore.read_each` and :class:`_EnvelopeSink`. The record's xxh3
checksum is not computed there: the GCM tag, checked on every read, covers every byte
the checksum covers (the header's identity fields through the associated data), so it
would be a second pass over the bytes for nothing; plain records keep it. On the other
backends (LMDB, a local directory) the envelopes of one call are read, checksum-verified,
in chunks of at most 8 MiB into reusable per-thread arenas, and opened on several
threads (AES-GCM in ``cryptography`` >= 50 runs without the GIL), pipelined: while the
pool opens one chunk, the calling thread reads the next. Each envelope is decrypted
straight from the arena into the caller's buffer; a scatter-list out is decrypted into a
per-thread scratch buffer and copied into its pieces. A read that fails its tag leaves
the out buffer zeroed on the streamed path (unspecified, as for any miss, on the other).

Nothing unauthenticated is ever served. Each of these is a miss, counted as
``auth_failures`` in :meth:`EncryptedStore.stats`, never bytes and never an exception:
a tag that does not verify (forged or damaged bytes, a ciphertext moved under another
key, another tenant's or layout's record), an envelope under a key this store does not
hold (unknown key tag, e.g. the wrong key file), and anything that is not an envelope
(a plain record on an encrypted level, or a record of another size). A record whose tag
fails under a key *this store holds* can be read by nobody (every holder of that key
would fail the same way), so it is removed (``auth_removed``) and a later put rewrites
it; records under keys it does not hold are left alone (another key file or tenant may
read them). A token-digest mismatch on an authentic record is ``corrupt``, as on a plain
store, and removed too.

Writes seal each payload under the current key (random 96-bit nonce; the bound per key
is in :mod:`.crypto`) into a reusable per-thread arena, on several threads for a batch,
then hand the envelopes to the backend in one ``put_many``.

Rotation: :meth:`EncryptedStore.rekey` rewrites the records under an older key under the
current one. It loses nothing, whenever it is killed: each batch's new envelopes are made
durable in a journal (:mod:`.rekey_journal`) before the old records are removed, and
the next run, or the next encrypted open of a local store, puts back what is missing.

Differences from a plain store a caller can see: a read whose out buffer has the wrong
size for the stored record is a miss (the stored size of a foreign record says nothing),
not a ValueError; :meth:`EncryptedStore.verify` also authenticates every record when it
knows the payload size of each kind (``payload_bytes``, else the sizes this handle has
seen).
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .base import BlockStore, PutItem, Unread, check_open
from .crypto import ENVELOPE_OVERHEAD, HEAD_BYTES, TAG_BYTES, EncryptionConfig, Keyring, Opened
from .errors import StoreError
from .record import RecordKey, RecordKind, RecordMeta, as_out_segments, payload_views, write_segments
from .rekey_journal import JOURNAL_NAME, RekeyJournal, ReplayResult, default_journal_path, failpoint

__all__ = ["EncryptedStore", "RekeyReport"]

#: Envelopes read per backend call (and the bound of a kept per-thread arena): reads are
#: pipelined chunk by chunk, so a chunk is small enough to overlap with the next one.
_CHUNK_BYTES = 8 << 20
#: Below this many bytes in a call, (de)crypt on the calling thread only.
_PARALLEL_MIN_BYTES = 1 << 20
T = TypeVar("T")
J = TypeVar("J")


class _Outcome(enum.Enum):
    OK = "ok"
    ABSENT = "absent"        # no record (or a corrupt one the backend dropped)
    FOREIGN = "foreign"      # not an envelope under a key of ours: kept
    FORGED = "forged"        # the tag fails under a key of ours: removed
    DIGEST = "digest"        # authentic, but another token digest than asked: corrupt, removed
    SKIPPED = "skipped"      # (rekey) already under the current key: not decrypted


@dataclass(slots=True)
class _Read:
    outcome: _Outcome
    meta: RecordMeta | None = None
    key_id: bytes | None = None


#: A backend read of a record of another size than the envelope asked for.
_WRONG_SIZE: Any = object()
_ABSENT = _Read(_Outcome.ABSENT)


@dataclass
class RekeyReport:
    """What :meth:`EncryptedStore.rekey` did (also the ``tiered-kv rekey --json`` object)."""

    checked: int = 0       # records read
    rekeyed: int = 0       # rewritten under the current key
    current: int = 0       # already under the current key
    foreign: int = 0       # under no key given (another tenant, another key file) or not envelopes
    failed: int = 0        # failed their tag under a key given (removed)
    absent: int = 0        # gone between listing and reading
    unchecked: int = 0     # of a kind whose payload size is unknown
    restored: int = 0      # put back from the journal of a run killed mid-batch
    lost: int = 0          # in that journal but damaged (checksum): not put back, later misses

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class _Counters:
    NAMES = ("hits", "misses", "auth_failures", "auth_removed", "corrupt", "rekey_restored", "rekey_lost")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values = dict.fromkeys(self.NAMES, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                self.values[k] += v

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self.values)


def _joined(payload: Any) -> np.ndarray:
    """A payload as one 1-D uint8 array: a payload of pieces is joined (one copy; AES-GCM
    seals one buffer)."""
    views, _ = payload_views(payload)
    return views[0] if len(views) == 1 else np.concatenate(views) if views else np.empty(0, np.uint8)


class _EnvelopeSink:
    """Opens one envelope as a streaming backend hands it over (a
    :class:`~.base.PayloadSink`, on the backend's I/O thread), straight into the caller's
    out buffer: no staging copy, no second pass over the bytes.

    The GCM tag covers every byte the record's xxh3 checksum covers (the ciphertext; the
    envelope head and the record header's key, parent hash, token digest and layout
    fingerprint through the associated data), so the backend skips the checksum
    (:meth:`~.base.BlockStore.read_each`) and a sealed read makes one pass over the
    bytes, as a plain read's copy does.

    An envelope that arrives in one chunk into a one-piece out (an object store's
    response usually is one chunk) is opened in one call of the key's cached AES-GCM
    context. Otherwise the head names the key and nonce, each ciphertext chunk is
    decrypted into the out pieces as it arrives (a streaming GCM decryptor) and the tag,
    last, decides. Plaintext is written before the tag is checked: when it fails, or the
    read does not finish (:meth:`discard`), the out pieces are zeroed, so no
    unauthenticated byte is left in a buffer, let alone served."""

    __slots__ = ("_store", "_key", "_meta", "_segs", "_digest", "_skip", "_head", "_found", "_dec", "_tag",
                 "_left", "_piece", "_pos", "_wrote", "_read")

    def __init__(self, store: EncryptedStore, key: RecordKey, meta: RecordMeta, segs: Any,
                 digest: bytes | None, skip_current: bool) -> None:
        self._store = store
        self._key = key
        self._meta = meta            # the backend's header fields (parent hash, digest: masked)
        self._segs = segs            # OutSegments: where the plaintext goes, in order
        self._digest = digest
        self._skip = skip_current
        self._head = bytearray()
        self._found: Opened | None = None
        self._dec: Any = None        # the streaming GCM decryptor, once the head named a key of ours
        self._tag = bytearray()
        self._left = segs.nbytes     # ciphertext bytes still to come
        self._piece = 0              # the out piece, and the offset in it, of the next byte
        self._pos = 0
        self._wrote = False
        self._read: _Read | None = None  # the outcome, once decided

    def write(self, chunk: np.ndarray) -> bool:
        if self._dec is None:
            if not self._head and len(self._segs) == 1 and chunk.nbytes == self._segs.nbytes + ENVELOPE_OVERHEAD:
                self._open_whole(chunk)
                return False
            take = HEAD_BYTES - len(self._head)
            self._head += memoryview(chunk[:take])
            chunk = chunk[take:]
            if len(self._head) < HEAD_BYTES:
                return True
            aad = self._identify(self._head)
            if aad is None:
                return False
            assert self._found is not None
            self._dec = self._found.keys.decryptor(self._found.nonce, aad)
        n = min(self._left, chunk.nbytes)
        if n:
            self._decrypt(chunk[:n])
            self._left -= n
            chunk = chunk[n:]
        if chunk.nbytes:
            self._tag += memoryview(chunk)
        return True

    def _identify(self, head: Any) -> bytes | None:
        """The associated data of the envelope whose head is ``head``; None (decided:
        FOREIGN or SKIPPED) when it is not ours to open."""
        store, m = self._store, self._meta
        found = store.keyring.identify(head, m.parent_hash, m.token_digest)
        if found is None:
            self._read = _Read(_Outcome.FOREIGN)
            return None
        if self._skip and found.keys is store.keyring.current:
            self._read = _Read(_Outcome.SKIPPED, key_id=found.keys.key_id)
            return None
        self._found = found
        return store.keyring.aad(bytes(head[:HEAD_BYTES]), self._key, found.parent_hash, found.token_digest,
                                 store.layout_fingerprint)

    def _open_whole(self, env: np.ndarray) -> None:
        """The whole envelope at once, into the one out piece."""
        from cryptography.exceptions import InvalidTag

        aad = self._identify(env[:HEAD_BYTES])
        if aad is None:
            return
        found = self._found
        assert found is not None
        self._wrote = True
        try:
            found.keys.aead.decrypt_into(found.nonce, env[HEAD_BYTES:], aad, self._segs[0])
        except InvalidTag:
            self._decide(found, authentic=False)
        else:
            self._decide(found, authentic=True)

    def _decrypt(self, data: np.ndarray) -> None:
        self._wrote = True
        segs = self._segs
        while data.nbytes:
            dst = segs[self._piece]
            room = dst.nbytes - self._pos
            if not room:
                self._piece += 1
                self._pos = 0
                continue
            n = min(room, data.nbytes)
            self._dec.update_into(data[:n], dst[self._pos:self._pos + n])
            self._pos += n
            data = data[n:]

    def _decide(self, found: Opened, *, authentic: bool) -> None:
        if not authentic:
            self.discard()
            self._read = _Read(_Outcome.FORGED, key_id=found.keys.key_id)
        elif self._digest is not None and bytes(self._digest) != found.token_digest:
            self._read = _Read(_Outcome.DIGEST, key_id=found.keys.key_id)
        else:
            meta = RecordMeta(key=self._key, parent_hash=found.parent_hash, token_digest=found.token_digest,
                              layout_fingerprint=self._store.layout_fingerprint, payload_bytes=self._segs.nbytes)
            self._read = _Read(_Outcome.OK, meta, found.keys.key_id)

    def finish(self) -> _Read:
        from cryptography.exceptions import InvalidTag

        if self._read is None:
            found = self._found
            assert found is not None and self._left == 0 and len(self._tag) == TAG_BYTES  # (the backend's sizes)
            try:
                self._dec.finalize_with_tag(bytes(self._tag))
            except InvalidTag:
                self._decide(found, authentic=False)
            else:
                self._decide(found, authentic=True)
        assert self._read is not None
        return self._read

    def discard(self) -> None:
        """Zero the out pieces unless they hold an authenticated payload (a tag that
        failed, or a read that raised before the tag)."""
        if self._wrote and (self._read is None or self._read.outcome is not _Outcome.OK):
            for seg in self._segs:
                seg.fill(0)


class EncryptedStore(BlockStore):
    """``inner`` with every payload sealed under ``encryption`` (see the module docstring).

    Args:
        inner: the backend (an open store of any kind).
        encryption: an :class:`~.crypto.EncryptionConfig` or its dict (the tenant is
            required here), or a :class:`~.crypto.Keyring` built from one.
        owned: close ``inner`` on :meth:`close` (default True).
    """

    supports_mmap_reads = False
    supports_scatter_reads = True  # scatter-list outs are filled here, not by the backend

    def __init__(self, inner: BlockStore, encryption: EncryptionConfig | Mapping[str, Any] | Keyring, *,
                 owned: bool = True) -> None:
        if not isinstance(inner, BlockStore):
            raise TypeError(f"inner: expected an open BlockStore, got {type(inner).__name__}")
        if isinstance(inner, EncryptedStore):
            raise ValueError("inner: already an EncryptedStore (records would be sealed twice)")
        self.keyring = encryption if isinstance(encryption, Keyring) else Keyring(EncryptionConfig.parse(encryption))
        self.config = self.keyring.config
        self._inner = inner
        self._owned = owned
        self.layout_fingerprint = inner.layout_fingerprint
        self.max_bytes = inner.max_bytes
        self.supports_multiprocess = inner.supports_multiprocess
        self.supports_shared_writers = inner.supports_shared_writers
        self.supports_eviction_guard = inner.supports_eviction_guard  # (the guard goes to the backend)
        self.maintenance = inner.maintenance  # (the backend refuses the envelopes' puts then)
        self.threads = self.config.threads or max(1, min(8, os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._local = threading.local()
        self._counters = _Counters()
        self._sizes: dict[RecordKind, int] = {}  # payload size of each kind, as seen
        self._closed = inner.closed
        self._replayed = self._replay_rekey_journal()  # (reported by this handle's next rekey)

    # ------------------------------------------------------------------ what it wraps
    @property
    def inner(self) -> BlockStore:
        """The backend holding the envelopes."""
        return self._inner

    @property
    def path(self) -> Any:
        """The backend's directory (None for an object store): the chain's journal lives there."""
        return getattr(self._inner, "path", None)

    @property
    def readonly(self) -> bool:
        return bool(getattr(self._inner, "readonly", False))

    @property
    def where(self) -> str:
        return str(getattr(self._inner, "where", None) or getattr(self._inner, "path", None) or repr(self._inner))

    @property  # type: ignore[override]
    def eviction_guard(self) -> Any:
        """The backend's (records are evicted there, under the same keys)."""
        return self._inner.eviction_guard

    @eviction_guard.setter
    def eviction_guard(self, guard: Any) -> None:
        self._inner.eviction_guard = guard

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        """The plaintext payload sizes (the backend's envelope sizes less the envelope
        overhead; None: absent, or too short to be an envelope)."""
        check_open(self._closed, self.where)
        return [None if n is None or n < ENVELOPE_OVERHEAD else n - ENVELOPE_OVERHEAD
                for n in self._inner.payload_sizes(keys)]

    def recent(self, n: int) -> list[RecordKey]:
        """The backend's :meth:`~.zarr_store.ZarrStore.recent` (Zarr backends only)."""
        recent = getattr(self._inner, "recent", None)
        if recent is None:
            raise TypeError(f"recent: the backend {type(self._inner).__name__} keeps no write or access order")
        return recent(n)

    def _replay_rekey_journal(self) -> ReplayResult:
        """Put back the records a rekey killed mid-batch left in the journal in this
        local store's directory (see :mod:`.rekey_journal`); nothing when there is none,
        when the store cannot be written here, or when a rekey running now holds it."""
        path = self.path
        if self._closed or self.maintenance or self.readonly or not isinstance(path, os.PathLike):
            return ReplayResult()
        rj = RekeyJournal(Path(path) / JOURNAL_NAME)
        if not rj.exists():
            return ReplayResult()
        with rj.holding(required=False) as held:
            result = rj.replay(self._inner) if held else ReplayResult()
        self._counters.add(rekey_restored=result.restored, rekey_lost=result.lost)
        return result

    # ------------------------------------------------------------------ threads and buffers
    def _parallel(self, fn: Callable[[J], T], jobs: Sequence[J], nbytes: int) -> list[T]:
        """``[fn(job) for job in jobs]``, spread over the pool and the calling thread when
        the work is large enough to gain from it."""
        if self.threads == 1 or len(jobs) < 2 or nbytes < _PARALLEL_MIN_BYTES:
            return [fn(j) for j in jobs]
        pool = self._get_pool()
        groups = min(self.threads, len(jobs))
        out: list[Any] = [None] * len(jobs)

        def run(g: int) -> None:
            for i in range(g, len(jobs), groups):
                out[i] = fn(jobs[i])

        futures = [pool.submit(run, g) for g in range(1, groups)]
        try:
            run(0)
        finally:
            for f in futures:
                f.result()
        return out

    def _submit(self, fn: Callable[[J], T], jobs: Sequence[J]) -> list[Future[list[T]]]:
        """``fn`` over ``jobs`` on the pool only (the calling thread goes on reading):
        futures of interleaved groups, one per pool thread."""
        if not jobs:
            return []
        if self.threads == 1:
            f: Future[list[T]] = Future()
            f.set_result([fn(j) for j in jobs])
            return [f]
        pool = self._get_pool()
        groups = min(self.threads - 1, len(jobs))
        return [pool.submit(lambda g=g: [fn(jobs[i]) for i in range(g, len(jobs), groups)]) for g in range(groups)]

    @staticmethod
    def _gather(futures: list[Future[list[T]]]) -> list[T]:
        out: list[T] = []
        for f in futures:
            out += f.result()
        return out

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="tiered_kv.crypto")
            return self._pool

    def _arena(self, name: str, nbytes: int) -> np.ndarray:
        """A per-thread reusable buffer of at least ``nbytes`` (grown as needed, kept
        while at most the chunk bound; a larger one is allocated for this call only)."""
        buf = getattr(self._local, name, None)
        if buf is not None and buf.nbytes >= nbytes:
            return buf
        buf = np.empty(max(nbytes, 1 << 20), np.uint8)
        if nbytes <= _CHUNK_BYTES:
            setattr(self._local, name, buf)
        return buf

    @staticmethod
    def _chunks(sizes: list[int]) -> Iterator[list[int]]:
        """Indices of ``sizes`` in runs whose total stays within the chunk bound."""
        run: list[int] = []
        total = 0
        for i, n in enumerate(sizes):
            if run and total + n > _CHUNK_BYTES:
                yield run
                run, total = [], 0
            run.append(i)
            total += n
        if run:
            yield run

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        check_open(self._closed, self.where)
        items = self._check_put_items(items)
        if not items:
            return []
        return self._inner.put_many(self._seal(items))

    def _seal(self, items: list[PutItem]) -> list[PutItem]:
        """``items`` sealed under the current key: the backend's put items, their payloads
        the envelopes (views of this thread's put arena: valid until its next seal)."""
        bodies = [_joined(item.payload) for item in items]
        sizes = [b.nbytes + ENVELOPE_OVERHEAD for b in bodies]
        offs = [0, *itertools.accumulate(sizes)]
        arena = self._arena("put_arena", offs[-1])
        fp = self.layout_fingerprint

        def seal(i: int) -> PutItem:
            item = items[i]
            env = arena[offs[i]:offs[i + 1]]
            parent, digest = self.keyring.seal_into(env, bodies[i], key=item.key, parent_hash=item.parent_hash,
                                                    token_digest=item.token_digest, layout_fingerprint=fp)
            return PutItem(item.key, parent, digest, env)

        sealed = self._parallel(seal, range(len(items)), offs[-1])
        for item, body in zip(items, bodies):
            self._sizes.setdefault(item.key.kind, body.nbytes)
        return sealed

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, self.where)
        keys, segs, digests = self._check_get_args(keys, outs, token_digests, scatter=True)
        reads = self._read(keys, segs, digests)
        metas = [r.meta for r in reads]
        self._count(reads)
        return metas

    def _count(self, reads: list[_Read]) -> None:
        hits = sum(r.outcome is _Outcome.OK for r in reads)
        auth = sum(r.outcome in (_Outcome.FOREIGN, _Outcome.FORGED) for r in reads)
        corrupt = sum(r.outcome is _Outcome.DIGEST for r in reads)
        self._counters.add(hits=hits, misses=len(reads) - hits, auth_failures=auth, corrupt=corrupt)

    def _read(self, keys: list[RecordKey], segs: list[Any], digests: list[bytes | None], *,
              skip_current: bool = False, remove: bool = True) -> list[_Read]:
        """Read, authenticate and decrypt each record into ``segs[i]`` (OutSegments).
        ``remove``: remove the records no holder of their key can read (FORGED, DIGEST).
        ``skip_current``: leave records under the current key undecrypted (``SKIPPED``)."""
        if self._inner.supports_streamed_reads:
            reads = self._read_streamed(keys, segs, digests, skip_current)
        else:
            reads = self._read_chunked(keys, segs, digests, skip_current)
        if remove and not self.readonly:
            removed = 0
            for key, r in zip(keys, reads):
                if r.outcome in (_Outcome.FORGED, _Outcome.DIGEST):
                    try:
                        gone = self._inner.delete(key)
                    except (StoreError, OSError):
                        gone = False  # still a miss on every read; the next reader tries again
                    removed += gone and r.outcome is _Outcome.FORGED
            self._counters.add(auth_removed=removed)
        return reads

    def _read_streamed(self, keys: list[RecordKey], segs: list[Any], digests: list[bytes | None],
                       skip_current: bool) -> list[_Read]:
        """:meth:`_read` on a backend that streams (an object store): each envelope is
        opened on the backend's I/O thread as its response arrives, the ciphertext
        decrypted chunk by chunk straight into the caller's buffer (see
        :class:`_EnvelopeSink`); nothing is staged, nothing hashed twice."""
        sinks: list[_EnvelopeSink | None] = [None] * len(keys)

        def open_sink(i: int, meta: RecordMeta) -> _EnvelopeSink:
            sinks[i] = sink = _EnvelopeSink(self, keys[i], meta, segs[i], digests[i], skip_current)
            return sink

        try:
            results = self._inner.read_each(keys, [s.nbytes + ENVELOPE_OVERHEAD for s in segs], open_sink)
        except BaseException:
            for sink in sinks:
                if sink is not None:
                    sink.discard()
            raise
        reads = []
        for key, seg, r in zip(keys, segs, results):
            if r is Unread.ABSENT:
                r = _ABSENT
            elif r is Unread.OTHER_SIZE:
                r = _Read(_Outcome.FOREIGN)  # (the stored size of a foreign record says nothing)
            elif r.outcome is _Outcome.OK:
                self._sizes.setdefault(key.kind, seg.nbytes)
            reads.append(r)
        return reads

    def _read_chunked(self, keys: list[RecordKey], segs: list[Any], digests: list[bytes | None],
                      skip_current: bool) -> list[_Read]:
        """:meth:`_read` on a backend that reads whole records (LMDB, a local directory).

        Pipelined over chunks of at most ``_CHUNK_BYTES`` of envelopes, two arenas per
        thread: while the pool opens chunk k, this thread reads chunk k+1 into the other
        arena; the last chunk is opened by the pool and this thread together."""
        reads = [_ABSENT] * len(keys)
        env_sizes = [s.nbytes + ENVELOPE_OVERHEAD for s in segs]

        def open_one(job: tuple[int, np.ndarray, RecordMeta]) -> tuple[int, _Read]:
            i, env, m = job
            return i, self._open(keys[i], env, m, segs[i], digests[i], skip_current)

        chunks = list(self._chunks(env_sizes))
        inflight: list[Future[list[tuple[int, _Read]]]] = []
        for n, chunk in enumerate(chunks):
            offs = [0, *itertools.accumulate(env_sizes[i] for i in chunk)]
            arena = self._arena(f"get_arena{n % 2}", offs[-1])
            envs = [arena[offs[j]:offs[j + 1]] for j in range(len(chunk))]
            jobs = []
            for i, env, m in zip(chunk, envs, self._inner_get([keys[i] for i in chunk], envs)):
                if m is _WRONG_SIZE:
                    reads[i] = _Read(_Outcome.FOREIGN)
                elif m is not None:
                    jobs.append((i, env, m))
            done = self._gather(inflight)  # chunk n-1 opened: its arena is free for chunk n+1
            if n == len(chunks) - 1:
                done += self._parallel(open_one, jobs, sum(env_sizes[i] for i, _, _ in jobs))
            else:
                inflight = self._submit(open_one, jobs)
            for i, r in done:
                reads[i] = r
                if r.outcome is _Outcome.OK:
                    self._sizes.setdefault(keys[i].kind, segs[i].nbytes)
        return reads

    def _inner_get(self, keys: list[RecordKey], envs: list[np.ndarray]) -> list[Any]:
        """The backend's verified reads of the envelopes; ``_WRONG_SIZE`` for a record of
        another size (the backend raises ValueError for the batch: asked one by one)."""
        try:
            return self._inner.get_many(keys, envs)
        except ValueError:
            out: list[Any] = []
            for key, env in zip(keys, envs):
                try:
                    out.append(self._inner.get(key, env))
                except ValueError:
                    out.append(_WRONG_SIZE)
            return out

    def _open(self, key: RecordKey, env: np.ndarray, m: RecordMeta, seg: Any, digest: bytes | None,
              skip_current: bool) -> _Read:
        from cryptography.exceptions import InvalidTag

        found: Opened | None = self.keyring.identify(env[:HEAD_BYTES], m.parent_hash, m.token_digest)
        if found is None:
            return _Read(_Outcome.FOREIGN)
        if skip_current and found.keys is self.keyring.current:
            return _Read(_Outcome.SKIPPED, key_id=found.keys.key_id)
        aad = self.keyring.aad(env[:HEAD_BYTES].tobytes(), key, found.parent_hash, found.token_digest,
                               self.layout_fingerprint)
        data = env[HEAD_BYTES:]
        single = len(seg) == 1
        dst = seg[0] if single else self._arena("scratch", seg.nbytes)[:seg.nbytes]
        try:
            found.keys.aead.decrypt_into(found.nonce, data, aad, dst)
        except InvalidTag:
            return _Read(_Outcome.FORGED, key_id=found.keys.key_id)
        if digest is not None and bytes(digest) != found.token_digest:
            return _Read(_Outcome.DIGEST, key_id=found.keys.key_id)
        if not single:
            write_segments(seg, dst)
        meta = RecordMeta(key=key, parent_hash=found.parent_hash, token_digest=found.token_digest,
                          layout_fingerprint=self.layout_fingerprint, payload_bytes=seg.nbytes)
        return _Read(_Outcome.OK, meta, found.keys.key_id)

    # ------------------------------------------------------------------ the rest of the API
    def contains(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        return self._inner.contains(key)

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        check_open(self._closed, self.where)
        return self._inner.contains_many(keys)

    def delete(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        return self._inner.delete(key)

    def __iter__(self) -> Iterator[RecordKey]:
        check_open(self._closed, self.where)
        return iter(self._inner)

    def __len__(self) -> int:
        check_open(self._closed, self.where)
        return len(self._inner)

    def stats(self) -> dict[str, Any]:
        """The backend's stats, with ``hits`` / ``misses`` / ``corrupt`` as this
        wrapper sees them (an envelope that fails authentication is a backend hit but a
        miss here), plus ``encrypted`` (True), ``encryption`` (the cipher), ``key_id``
        (the current key's id), ``key_ids`` (every key accepted, current first),
        ``auth_failures``, ``auth_removed``, and ``rekey_restored`` / ``rekey_lost``
        (records this handle put back from, or found damaged in, a rekey journal that
        a run killed mid-batch left: see :meth:`rekey`)."""
        check_open(self._closed, self.where)
        out = dict(self._inner.stats())
        mine = self._counters.as_dict()
        out["backend_hits"] = out.get("hits")
        out["hits"], out["misses"] = mine["hits"], mine["misses"]
        out["corrupt"] = int(out.get("corrupt") or 0) + mine["corrupt"]
        out.update(encrypted=True, encryption="aes-256-gcm", key_id=self.keyring.key_ids[0],
                   key_ids=self.keyring.key_ids, auth_failures=mine["auth_failures"],
                   auth_removed=mine["auth_removed"], rekey_restored=mine["rekey_restored"],
                   rekey_lost=mine["rekey_lost"])
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if self._owned:
            self._inner.close()

    def __repr__(self) -> str:
        return f"EncryptedStore({self._inner!r}, key {self.keyring.key_ids[0]})"

    # ------------------------------------------------------------------ maintenance
    def gc(self, max_bytes: int) -> dict[str, Any]:
        check_open(self._closed, self.where)
        return self._inner.gc(max_bytes)

    def verify(self, *, repair: bool = False,
               payload_bytes: Mapping[RecordKind, int] | None = None) -> dict[str, Any]:
        """The backend's :meth:`~.base.BlockStore.verify` (checksums, layout, keys), then
        every record authenticated: read and its tag checked (``payload_bytes``: the
        payload size of each kind, default the sizes this handle has seen; records of
        another kind are ``unchecked``).

        Adds ``authenticated`` (records whose tag verified), ``auth_failures`` and
        ``auth_failed_keys`` (hex keys, as ``corrupt_keys``), ``foreign`` (of them: under
        a key not given, or not envelopes; never removed), ``unchecked``, and
        ``key_records`` (records per key id). With ``repair`` the backend removes its
        corrupt records and the records whose tag fails under a key given are removed
        (``auth_removed``)."""
        check_open(self._closed, self.where)
        result = dict(self._inner.verify(repair=repair))
        sizes = dict(self._sizes if payload_bytes is None else payload_bytes)
        per_key: dict[str, int] = {}
        failed: list[str] = []
        counts = {"authenticated": 0, "foreign": 0, "unchecked": 0, "auth_removed": 0}

        def visit(key: RecordKey, r: _Read, payload: np.ndarray) -> None:
            if r.outcome is _Outcome.OK:
                assert r.key_id is not None
                counts["authenticated"] += 1
                per_key[r.key_id.hex()] = per_key.get(r.key_id.hex(), 0) + 1
            elif r.outcome in (_Outcome.FOREIGN, _Outcome.FORGED):
                failed.append(key.to_bytes().hex())
                counts["foreign"] += r.outcome is _Outcome.FOREIGN
                counts["auth_removed"] += r.outcome is _Outcome.FORGED and repair

        counts["unchecked"] = self._scan(sizes, visit, remove=repair)
        return {**result, **counts, "auth_failures": len(failed), "auth_failed_keys": failed,
                "key_records": per_key}

    def _scan(self, sizes: Mapping[RecordKind, int], visit: Callable[[RecordKey, _Read, np.ndarray], None], *,
              remove: bool, skip_current: bool = False, batch: int = 64,
              progress: Callable[[int, int], None] | None = None) -> int:
        """Read every record of a kind in ``sizes``, ``batch`` per call, and call
        ``visit(key, read, payload buffer)``; returns how many records were of another
        kind. ``remove``: as :meth:`_read`."""
        keys = list(self._inner)
        todo = [k for k in keys if k.kind in sizes]
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            bufs = [np.empty(sizes[k.kind], np.uint8) for k in chunk]
            reads = self._read(chunk, [as_out_segments(b) for b in bufs], [None] * len(chunk),
                               skip_current=skip_current, remove=remove)
            for key, r, buf in zip(chunk, reads, bufs):
                visit(key, r, buf)
            if progress is not None:
                progress(start + len(chunk), len(todo))
        return len(keys) - len(todo)

    def sample(self, keys: Sequence[RecordKey], payload_bytes: Mapping[RecordKind, int]) -> list[bytes | None]:
        """The id of the key each record of ``keys`` (of a kind in ``payload_bytes``)
        opens under; None where it is not authentic under a key given. Reads, removes
        nothing, counts nothing."""
        keys = [k for k in keys if k.kind in payload_bytes]
        segs = [as_out_segments(np.empty(payload_bytes[k.kind], np.uint8)) for k in keys]
        reads = self._read(keys, segs, [None] * len(keys), remove=False)
        return [r.key_id if r.outcome is _Outcome.OK else None for r in reads]

    def rekey_journal(self, journal: str | os.PathLike[str] | None = None) -> RekeyJournal:
        """The journal :meth:`rekey` keeps its batch in flight in (see
        :mod:`.rekey_journal`): ``rekey-journal`` in the backend's directory for a local
        store (``journal`` must then be None: every opener of the store finds it there);
        for an object store ``journal``, default a file under the user's cache directory
        named by a hash of the store's URL."""
        path = self.path
        if isinstance(path, os.PathLike):
            if journal is not None:
                raise ValueError(f"journal: expected None for a local store (its journal is "
                                 f"{Path(path) / JOURNAL_NAME}, where every opener finds it), got {journal!r}")
            return RekeyJournal(Path(path) / JOURNAL_NAME)
        if journal is None:
            return RekeyJournal(default_journal_path(self.where))
        if not isinstance(journal, (str, os.PathLike)):
            raise TypeError(f"journal: expected a file path or None, got {type(journal).__name__}")
        return RekeyJournal(journal)

    def rekey(self, payload_bytes: Mapping[RecordKind, int], *, batch: int = 16,
              journal: str | os.PathLike[str] | None = None,
              progress: Callable[[int, int, RekeyReport], None] | None = None) -> RekeyReport:
        """Rewrite every record sealed under an older key given (``key_files[1:]``) under
        the current one (``key_files[0]``), losing none, whenever the process dies.

        Each batch of ``batch`` records is read, authenticated and decrypted, sealed
        under the current key, and the new envelopes written durably to the rekey journal
        (:meth:`rekey_journal`; ``journal``: its path, for an object store); only then
        are the old records removed and the new ones written (a write-once store has no
        overwrite), and the journal deleted. A run first puts back whatever the journal
        of a run killed mid-batch holds and the store lacks (``restored``), and so does
        every encrypted open of a local store. So a process killed at any point (kill
        -9 included) loses no record, and none is ever served but authenticated.

        Resumable: records already under the current key are skipped without
        decrypting, so a run stopped at any point and run again finishes the job. One
        run per store at a time (:class:`StoreLockedError` otherwise). A failure writing
        the store (full, unreachable) raises and leaves the batch in the journal, for
        the next run or open to put back. ``progress(done, total, report)`` is called
        after each batch."""
        check_open(self._closed, self.where)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        rj = self.rekey_journal(journal)
        report = RekeyReport()
        pending: list[PutItem] = []

        def visit(key: RecordKey, r: _Read, payload: np.ndarray) -> None:
            report.checked += 1
            if r.outcome is _Outcome.SKIPPED:
                report.current += 1
            elif r.outcome is _Outcome.OK:
                assert r.meta is not None
                pending.append(PutItem(key, r.meta.parent_hash, r.meta.token_digest, payload))
            elif r.outcome is _Outcome.FOREIGN:
                report.foreign += 1
            elif r.outcome is _Outcome.FORGED:
                report.failed += 1
            else:
                report.absent += 1

        def flush(done: int, total: int) -> None:
            if pending:
                self._rewrite(self._seal(pending), rj, report)
                pending.clear()
            if progress is not None:
                progress(done, total, report)

        with rj.holding(required=True):
            left = rj.replay(self._inner)
            self._counters.add(rekey_restored=left.restored, rekey_lost=left.lost)
            at_open, self._replayed = self._replayed, ReplayResult()
            report.restored, report.lost = left.restored + at_open.restored, left.lost + at_open.lost
            report.unchecked = self._scan(payload_bytes, visit, remove=True, skip_current=True, batch=batch,
                                          progress=flush)
        return report

    def _rewrite(self, sealed: list[PutItem], rj: RekeyJournal, report: RekeyReport) -> None:
        """One batch of :meth:`rekey`: journal, remove, put, forget (see there)."""
        rj.write(sealed, self.layout_fingerprint)
        n = rj.writes
        failpoint("rekey-journaled", n)
        try:
            for item in sealed:
                self._inner.delete(item.key)
            failpoint("rekey-deleted", n)
            written = self._inner.put_many(sealed)
        except BaseException as e:
            e.add_note(f"rekey: the batch being rewritten ({len(sealed)} records) is kept in {rj.path}; the "
                       f"next rekey (or, for a local store, any encrypted open) puts back what is missing")
            raise
        failpoint("rekey-put", n)
        rj.clear()
        report.rekeyed += sum(written)  # (False: another writer stored it meanwhile)
