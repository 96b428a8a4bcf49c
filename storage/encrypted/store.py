"""A block store whose records a bucket can hold but neither read, forge, nor name.

:class:`EncryptedStore` wraps any :class:`~.base.BlockStore` (LMDB, Zarr on a directory,
Zarr on S3, one level of a chain): each payload is sealed under the tenant's key
(XAES-256-GCM, :mod:`.crypto`) before it reaches the backend, which stores the envelope
as the payload of an ordinary record, checksum and all, under a *keyed name*
(:mod:`.names`). So the backend's own guarantees (write-once, verified reads, eviction,
crash recovery, kill -9) hold unchanged, and the wrapper adds secrecy of content and
names, and authentication::

    open_store("zarr+s3://kv/v4?endpoint=...", layout_fingerprint=fp,
               encryption={"key_files": ["/etc/tiered-kv/key-2026", "/etc/tiered-kv/key-2025"],
                           "tenant": "acme"})

**Names.** A record of key ``k`` is stored under ``name = P(k)``, a keyed permutation of
its kind and block hash under the tenant's name key of the current master key; a reader
without the key learns no prefix hash from a listing and cannot test a guessed prompt.
The backends see names only (they stay ignorant of all this: an LMDB level's index
keys, its segment headers, a Zarr level's object paths are names). A lookup is one
request per record under the current key; with older keys given (a rotation in
progress) a record missing there is looked for under each older key's name too, so
during a rotation a miss costs one more request per older key until ``rekey`` moved the
records. A listing (:meth:`names`) is of names; :meth:`__iter__` yields record keys, for
which each record's envelope head is read (which key sealed it decides its key).
The level's eviction guard (a chain's pending uploads) is asked about the keys of the
names the backend would evict, mapped back with no read.

**Fail closed.** The level records that it is sealed (:mod:`.sealed_level`); a plain
writer is refused at open. At one of its names this store accepts only an envelope that
authenticates, under the key that name belongs to, as the record asked for; anything
else there (a plain record, another tenant's or key's envelope copied over, a forgery,
a record of another size that does not authenticate) is removed and counted, so
pollution cannot squat a name. A level that records no sealing is adopted when it is
empty or holds envelopes of this version (its marker lost with a rebuilt LMDB index);
one sealed by an earlier version (unkeyed names) raises :class:`EncryptedLevelError`
naming ``tiered-kv rekey`` (which migrates it: ``migrate=True``); one holding plain
records raises too.

**Reads.** On a backend that streams (``supports_streamed_reads``: a Zarr store on S3),
each envelope is opened on the backend's I/O thread as its response arrives, decrypted
straight into the caller's buffer (or the pieces of a scatter list), with no staging
copy (:meth:`~.base.BlockStore.read_each`, :class:`~.envelope_reads.EnvelopeSink`); the
record's xxh3 is not computed there, the tag covers every byte it covers. On the other backends (LMDB,
a local directory) the envelopes of one call are read, checksum-verified, in chunks of at
most 8 MiB into reusable per-thread arenas, and opened on several threads, pipelined.

**Nothing unauthenticated is left behind.** AES-GCM implementations write plaintext
before they check the tag. Every read that does not end authentic (a failed tag, another
record's envelope, a transfer cut short, a read cancelled or raising in flight) leaves
the caller's out buffer zeroed (every piece of a scatter list), on every path; an
absent record leaves it untouched. Each failure is a miss, counted as ``auth_failures``
in :meth:`EncryptedStore.stats`, never bytes and never an exception. A token-digest
mismatch on an authentic record is ``corrupt``, as on a plain store, and removed too.

**Writes** seal each payload under the current key (192-bit random nonce, a subkey per
envelope: :mod:`.xaes`) into a reusable per-thread arena, on several threads for a
batch, then hand the envelopes to the backend under their names in one ``put_many``.

**Rotation**: :meth:`EncryptedStore.rekey` moves the records under older keys (and the
records of an earlier version, with their unkeyed names) to the current key and its
names, losing nothing whenever it is killed (:mod:`.rekey_journal`); ``drop_old``
deletes them instead (the old key was compromised: what it authenticates may be forged).

Differences from a plain store a caller can see: a read whose out buffer has the wrong
size for the stored record is a miss (the record is authenticated at its own size and
kept if authentic), not a ValueError; :meth:`len` counts every object of the level (other
tenants' too, on a shared prefix); :meth:`EncryptedStore.verify` also authenticates every
record when it knows the payload size of each kind (``payload_bytes``, else the sizes
this handle has seen).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..api import BlockStore, EvictionGuard, PutItem, Unread, check_open
from .crypto import (
    ENVELOPE_OVERHEAD,
    ENVELOPE_VERSION,
    HEAD_BYTES,
    LEGACY_ENVELOPE_OVERHEAD,
    LEGACY_ENVELOPE_VERSION,
    EncryptionConfig,
    Keyring,
    Opened,
    envelope_version,
)
from .envelopes import EnvelopeSink, Opener, Outcome, Read, Skip, Target, zero
from ..errors import EncryptedLevelError, StoreError
from ..format.record import RecordKey, RecordKind, RecordMeta, as_out_segments, payload_views, write_segments
from ..os.faults import Faults
from .rekey_journal import JOURNAL_NAME, RekeyJournal, RekeyPoint, ReplayResult, default_journal_path

__all__ = ["EncryptedStore", "RekeyReport"]

#: Envelopes read per backend call (and the bound of a kept per-thread arena): reads are
#: pipelined chunk by chunk, so a chunk is small enough to overlap with the next one.
_CHUNK_BYTES = 8 << 20
#: Below this many bytes in a call, (de)crypt on the calling thread only.
_PARALLEL_MIN_BYTES = 1 << 20
#: A record of another size than asked, at one of our names, is authenticated at its own
#: size up to this many bytes (above: a miss, kept: too large to read to find out).
_OTHER_SIZE_MAX = 256 << 20
#: Records an unmarked level's adoption reads to tell empty / this version / older / plain.
_ADOPT_SAMPLE = 8
T = TypeVar("T")
J = TypeVar("J")


#: A backend read of a record of another size than the envelope asked for.
_WRONG_SIZE: Any = object()


@dataclass
class RekeyReport:
    """What :meth:`EncryptedStore.rekey` did (also the ``tiered-kv rekey --json`` object)."""

    checked: int = 0       # records read
    rekeyed: int = 0       # rewritten under the current key and its names (from an older key)
    migrated: int = 0      # rewritten from an earlier version's envelopes and unkeyed names
    dropped: int = 0       # under an older key, deleted (drop_old)
    current: int = 0       # already under the current key
    foreign: int = 0       # under no key given (another tenant, another key file)
    failed: int = 0        # failed authentication, or not an envelope (removed)
    absent: int = 0        # gone between listing and reading
    unchecked: int = 0     # of a kind whose payload size is unknown
    restored: int = 0      # put back from the journal of a run killed mid-batch
    lost: int = 0          # in that journal but damaged or not authentic: not put back, later misses

    @property
    def opened_old(self) -> int:
        """Records found under an older key or an earlier version (whatever became of them)."""
        return self.rekeyed + self.migrated + self.dropped + self._old_present

    _old_present: int = field(default=0, repr=False)  # old ones whose new name held a record already

    def as_dict(self) -> dict[str, int]:
        out = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        out["opened_old"] = self.opened_old
        return out


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


class EncryptedStore(BlockStore):
    """``inner`` with every payload sealed under ``encryption`` and every record under a
    keyed name (see the module docstring).

    Args:
        inner: the backend (an open store of any kind; open an existing sealed level
            with ``sealed=True``, as :func:`~tiered_kv.storage.open_store` does).
        encryption: an :class:`~.crypto.EncryptionConfig` or its dict, or a
            :class:`~.crypto.Keyring` built from one.
        owned: close ``inner`` on :meth:`close` (default True).
        migrate: open a level sealed by an earlier version (unkeyed names) anyway, to
            migrate it with :meth:`rekey` (which ``tiered-kv rekey`` does); the level is
            recorded sealed at once, so plain writers are refused from then on.
    """

    supports_mmap_reads = False
    supports_scatter_reads = True  # scatter-list outs are filled here, not by the backend

    def __init__(self, inner: BlockStore, encryption: EncryptionConfig | Mapping[str, Any] | Keyring, *,
                 owned: bool = True, migrate: bool = False) -> None:
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
        self._guard: EvictionGuard | None = None
        self._opener = Opener(self)
        #: the fault points of its rekey batches (:class:`~.rekey_journal.RekeyPoint`): a test seam
        self.faults = Faults()
        self._closed = inner.closed
        self._adopt_level(migrate)
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

    @property
    def sealing(self) -> dict[str, str] | None:  # type: ignore[override]
        return self._inner.sealing

    @property  # type: ignore[override]
    def eviction_guard(self) -> EvictionGuard | None:
        """The guard given (the backend is given one that maps its names back to keys)."""
        return self._guard

    @eviction_guard.setter
    def eviction_guard(self, guard: EvictionGuard | None) -> None:
        self._guard = guard
        self._inner.eviction_guard = None if guard is None else self._names_guard

    def _names_guard(self, names: Sequence[RecordKey]) -> set[RecordKey]:
        """The backend's eviction guard: which of ``names`` the guard given holds. Each
        name is mapped back to a key under every key given, with no read (a name is a
        permutation of its key): whichever key generation wrote it, its key is among them,
        and the others are random keys no guard holds (but with probability 2^-256)."""
        guard = self._guard
        if guard is None:
            return set()
        candidates: dict[RecordKey, list[RecordKey]] = {}
        for name in names:
            for k in self.keyring.keys:
                candidates.setdefault(k.key_of(name), []).append(name)
        held = guard(list(candidates))
        return {name for key in held for name in candidates.get(key, ())}

    # ------------------------------------------------------------------ names
    def name_of(self, key: RecordKey) -> RecordKey:
        """The name ``key``'s record is stored under with the current key."""
        return self.keyring.current.name(key)

    def names(self) -> Iterator[RecordKey]:
        """The stored names (a listing of the backend: one request per 1000 on S3)."""
        check_open(self._closed, self.where)
        return iter(self._inner)

    def __iter__(self) -> Iterator[RecordKey]:
        """The keys of the records under a key given, in this version's format: each
        record's envelope head is read (which key sealed it decides the key its name maps
        back to; a name alone would map to some key under every key given)."""
        check_open(self._closed, self.where)
        return iter(self._keys_of(list(self._inner)))

    def __len__(self) -> int:
        """Objects in the level: records of every key and tenant (a listing counts them)."""
        check_open(self._closed, self.where)
        return len(self._inner)

    def _keys_of(self, names: list[RecordKey]) -> list[RecordKey]:
        """The keys of the records at ``names`` that are this version's envelopes under a
        key given (their heads read: nothing decrypted, nothing removed)."""
        out: list[RecordKey] = []
        sizes = self._inner.payload_sizes(names)
        todo = [(n, s) for n, s in zip(names, sizes) if s is not None and s >= ENVELOPE_OVERHEAD]
        for start in range(0, len(todo), 64):
            chunk = todo[start:start + 64]
            targets = [Target(n, None, None, as_out_segments(np.empty(s - ENVELOPE_OVERHEAD, np.uint8)), None,
                               lambda opened: True) for n, s in chunk]
            for r in self._read_targets(targets, [s for _, s in chunk]):
                if r.outcome is Outcome.SKIPPED and r.opened is not None and r.key is not None \
                        and r.opened.version == ENVELOPE_VERSION:
                    out.append(r.key)
        return out

    def recent(self, n: int) -> list[RecordKey]:
        """The keys of the backend's :meth:`~.zarr.ZarrStore.recent` ``n`` names
        (Zarr backends only) that are records under a key given."""
        recent = getattr(self._inner, "recent", None)
        if recent is None:
            raise TypeError(f"recent: the backend {type(self._inner).__name__} keeps no write or access order")
        return self._keys_of(list(recent(n)))

    # ------------------------------------------------------------------ the level
    def _adopt_level(self, migrate: bool) -> None:
        """Check (or record) that the backend is a sealed level of this version (see the
        module docstring); EncryptedLevelError when it is not one."""
        inner = self._inner
        if self._closed or inner.sealing is not None:
            return
        names = list(itertools.islice(iter(inner), _ADOPT_SAMPLE))
        versions: set[int | None] = set()
        sizes = inner.payload_sizes(names) if names else []
        for name, n in zip(names, sizes):
            if n is None:
                continue
            buf = np.empty(n, np.uint8)
            if inner.get(name, buf) is not None:
                versions.add(envelope_version(buf[:5]))
        if LEGACY_ENVELOPE_VERSION in versions and not migrate:
            raise EncryptedLevelError(
                f"{self.where}: sealed by an earlier version of tiered_kv, whose object names are the records' "
                f"unkeyed prefix hashes (a reader of the store can test guessed prompts against them). Migrate it "
                f"once: `tiered-kv rekey --store URL --key-file KEY --tenant T` moves every record to keyed "
                f"names under the current envelope format (serving may resume meanwhile: the level is marked at "
                f"once, and records not moved yet are misses)")
        if None in versions and not versions & {ENVELOPE_VERSION, LEGACY_ENVELOPE_VERSION}:
            raise EncryptedLevelError(
                f"{self.where}: holds plain (unsealed) records: a level is sealed from its creation. Open it "
                f"without encryption, or give the encrypted level a new path or bucket prefix")
        if getattr(inner, "readonly", False) or inner.maintenance:
            return
        try:
            inner.record_sealing()
        except NotImplementedError:
            pass  # a backend that cannot record it: plain writers are not refused there

    # ------------------------------------------------------------------ journal
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
            result = rj.replay(self._inner, authentic=self._journaled_authentic) if held else ReplayResult()
        self._counters.add(rekey_restored=result.restored, rekey_lost=result.lost)
        return result

    def _journaled_authentic(self, item: PutItem) -> bool | None:
        """Whether a journaled record (name, masked fields, envelope) is an envelope that
        authenticates under a key given as the record its name maps to; None when it is
        under no key given (the journal is left for a holder of that key)."""
        env = _joined(item.payload)
        opened = self.keyring.identify(env[:HEAD_BYTES], item.parent_hash, item.token_digest)
        if opened is None:
            return None
        if opened.version != ENVELOPE_VERSION or env.nbytes < ENVELOPE_OVERHEAD:
            return False
        key = opened.keys.key_of(item.key)
        scratch = self._arena("scratch", env.nbytes - ENVELOPE_OVERHEAD)[:env.nbytes - ENVELOPE_OVERHEAD]
        try:
            return self.keyring.open_into(opened, env[HEAD_BYTES:], self._opener.aad(opened, key), scratch)
        finally:
            scratch.fill(0)

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
            _wait_all(futures)
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
        """``items`` sealed under the current key: the backend's put items, under their
        names, their payloads the envelopes (views of this thread's put arena: valid until
        its next seal)."""
        bodies = [_joined(item.payload) for item in items]
        sizes = [b.nbytes + ENVELOPE_OVERHEAD for b in bodies]
        offs = [0, *itertools.accumulate(sizes)]
        arena = self._arena("put_arena", offs[-1])
        fp = self.layout_fingerprint
        current = self.keyring.current

        def seal(i: int) -> PutItem:
            item = items[i]
            env = arena[offs[i]:offs[i + 1]]
            parent, digest = self.keyring.seal_into(env, bodies[i], key=item.key, parent_hash=item.parent_hash,
                                                    token_digest=item.token_digest, layout_fingerprint=fp)
            return PutItem(current.name(item.key), parent, digest, env)

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
        self._count(reads)
        return [r.meta for r in reads]

    def _count(self, reads: list[Read]) -> None:
        hits = sum(r.outcome is Outcome.OK for r in reads)
        auth = sum(r.outcome in (Outcome.FOREIGN, Outcome.FORGED) for r in reads)
        corrupt = sum(r.outcome is Outcome.DIGEST for r in reads)
        self._counters.add(hits=hits, misses=len(reads) - hits, auth_failures=auth, corrupt=corrupt)

    def _read(self, keys: list[RecordKey], segs: list[Any], digests: list[bytes | None], *,
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
            for i, r in zip(todo, self._read_targets(targets, [segs[i].nbytes + ENVELOPE_OVERHEAD for i in todo])):
                reads[i] = r
            todo = [i for i in todo if reads[i].outcome is Outcome.ABSENT]
        for i, r in enumerate(reads):
            if r.outcome is Outcome.OTHER_SIZE:
                reads[i] = self._other_size(keys[i], segs[i], r)
        if remove:
            self._remove(reads)
        return reads

    def _remove(self, reads: Sequence[Read]) -> None:
        """Delete what no reader can use (FORGED, DIGEST) where it was read."""
        if self.readonly:
            return
        removed = 0
        for r in reads:
            if r.outcome in (Outcome.FORGED, Outcome.DIGEST) and r.name is not None:
                try:
                    gone = self._inner.delete(r.name)
                except (StoreError, OSError):
                    gone = False  # still a miss on every read; the next reader tries again
                removed += gone and r.outcome is Outcome.FORGED
        self._counters.add(auth_removed=removed)

    def _other_size(self, key: RecordKey, segs: Any, r: Read) -> Read:
        """A record of another size than asked at ``key``'s name: authenticated at its own
        size. Authentic: a miss, kept (the caller asked for the wrong size); else FORGED
        (removed: pollution cannot squat the name). The caller's out is zeroed."""
        zero(segs)
        assert r.name is not None
        n = self._inner.payload_sizes([r.name])[0]
        if n is None:
            return Read(Outcome.ABSENT, name=r.name)
        if n < ENVELOPE_OVERHEAD:
            return Read(Outcome.FORGED, name=r.name)
        if n - ENVELOPE_OVERHEAD > _OTHER_SIZE_MAX:
            return r
        gen = next(g for g, k in enumerate(self.keyring.keys) if k.name(key) == r.name)
        scratch = np.zeros(n - ENVELOPE_OVERHEAD, np.uint8)
        try:
            got = self._read_targets([Target(r.name, key, gen, as_out_segments(scratch), None, None)], [n])[0]
        finally:
            scratch.fill(0)
        if got.outcome is Outcome.OK:
            return Read(Outcome.OTHER_SIZE, opened=got.opened, key=key, name=r.name)
        return got if got.outcome is not Outcome.OTHER_SIZE else r

    def _read_targets(self, targets: list[Target], env_sizes: list[int]) -> list[Read]:
        """Each target's record read at envelope size ``env_sizes[i]`` and opened."""
        if self._inner.supports_streamed_reads:
            return self._read_streamed(targets, env_sizes)
        return self._read_chunked(targets, env_sizes)

    def _read_streamed(self, targets: list[Target], env_sizes: list[int]) -> list[Read]:
        """:meth:`_read_targets` on a backend that streams (an object store): each envelope
        opened on the backend's I/O thread as its response arrives (see
        :class:`EnvelopeSink`); nothing is staged, nothing hashed twice."""
        sinks: list[EnvelopeSink | None] = [None] * len(targets)
        lock = threading.Lock()
        cancelled = False

        def open_sink(i: int, meta: RecordMeta) -> EnvelopeSink:
            sink = EnvelopeSink(self._opener, targets[i], meta, env_sizes[i])
            with lock:
                sinks[i] = sink
                if cancelled:  # (an I/O thread still going after the call was given up)
                    sink.discard()
            return sink

        try:
            results = self._inner.read_each([t.name for t in targets], env_sizes, open_sink)
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
                self._sizes.setdefault(t.name.kind, t.segs.nbytes)
            reads.append(r)
        return reads

    def _read_chunked(self, targets: list[Target], env_sizes: list[int]) -> list[Read]:
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
            return i, self._open(targets[i], env, m)

        chunks = list(self._chunks(env_sizes))
        inflight: list[Future[list[tuple[int, Read]]]] = []
        try:
            for n, chunk in enumerate(chunks):
                offs = [0, *itertools.accumulate(env_sizes[i] for i in chunk)]
                arena = self._arena(f"get_arena{n % 2}", offs[-1])
                envs = [arena[offs[j]:offs[j + 1]] for j in range(len(chunk))]
                jobs = []
                for i, env, m in zip(chunk, envs, self._inner_get([targets[i].name for i in chunk], envs)):
                    if m is _WRONG_SIZE:
                        reads[i] = Read(Outcome.OTHER_SIZE, name=targets[i].name)
                    elif m is not None:
                        jobs.append((i, env, m))
                done = self._gather(inflight)  # chunk n-1 opened: its arena is free for chunk n+1
                inflight = []
                if n == len(chunks) - 1:
                    done += self._parallel(open_one, jobs, sum(env_sizes[i] for i, _, _ in jobs))
                else:
                    inflight = self._submit(open_one, jobs)
                for i, r in done:
                    reads[i] = r
                    if r.outcome is Outcome.OK:
                        self._sizes.setdefault(targets[i].name.kind, targets[i].segs.nbytes)
        except BaseException:
            _drain(inflight)
            for t, r in zip(targets, reads):
                if t.key is not None and r.outcome is not Outcome.OK:
                    zero(t.segs)
            raise
        return reads

    def _inner_get(self, names: list[RecordKey], envs: list[np.ndarray]) -> list[Any]:
        """The backend's verified reads of the envelopes; ``_WRONG_SIZE`` for a record of
        another size (the backend raises ValueError for the batch: asked one by one)."""
        try:
            return self._inner.get_many(names, envs)
        except ValueError:
            out: list[Any] = []
            for name, env in zip(names, envs):
                try:
                    out.append(self._inner.get(name, env))
                except ValueError:
                    out.append(_WRONG_SIZE)
            return out

    def _open(self, t: Target, env: np.ndarray, m: RecordMeta) -> Read:
        """One whole envelope (read and checksum-verified by the backend) opened into the
        target's out; the out is zeroed unless the outcome is authentic, an exception in
        flight included."""
        try:
            r = self._open_checked(t, env, m)
        except BaseException:
            zero(t.segs)
            raise
        if r.outcome is not Outcome.OK and (t.key is not None or r.outcome is not Outcome.SKIPPED):
            zero(t.segs)
        return r

    def _open_checked(self, t: Target, env: np.ndarray, m: RecordMeta) -> Read:
        decided, opened, key = self._opener.identify(t, env[:HEAD_BYTES], m, env.nbytes)
        if decided is not None:
            return decided
        assert opened is not None and key is not None
        segs = t.segs
        single = len(segs) == 1
        dst = segs[0] if single else self._arena("scratch", segs.nbytes)[:segs.nbytes]
        try:
            ok = self.keyring.open_into(opened, env[opened.head_bytes:], self._opener.aad(opened, key), dst)
            r = self._opener.decided(t, opened, key, ok)
            if r.outcome is Outcome.OK and not single:
                write_segments(segs, dst)
        finally:
            if not single:
                dst.fill(0)  # (the scratch held plaintext: authentic or not, it is not left)
        return r

    # ------------------------------------------------------------------ listing reads
    def _read_names(self, names: list[RecordKey], payload_bytes: list[int], *, skip: Skip | None = None
                    ) -> tuple[list[Read], list[np.ndarray]]:
        """Read what each listed name holds, as a record of ``payload_bytes[i]`` (this
        version's envelope, else an earlier version's of that payload size), into fresh
        buffers: ``(reads, buffers)``. Removes nothing."""
        bufs = [np.empty(n, np.uint8) for n in payload_bytes]
        targets = [Target(name, None, None, as_out_segments(b), None, skip) for name, b in zip(names, bufs)]
        reads = self._read_targets(targets, [n + ENVELOPE_OVERHEAD for n in payload_bytes])
        legacy = [i for i, r in enumerate(reads) if r.outcome is Outcome.OTHER_SIZE]
        if legacy:
            got = self._read_targets([targets[i] for i in legacy],
                                     [payload_bytes[i] + LEGACY_ENVELOPE_OVERHEAD for i in legacy])
            for i, r in zip(legacy, got):
                reads[i] = r
        return reads, bufs

    def _scan(self, sizes: Mapping[RecordKind, int], visit: Callable[[RecordKey, Read, np.ndarray], None], *,
              remove: bool, skip: Skip | None = None, batch: int = 64,
              progress: Callable[[int, int], None] | None = None) -> int:
        """Read every stored name of a kind in ``sizes``, ``batch`` per call, and call
        ``visit(name, read, payload buffer)``; returns how many were of another kind.
        ``remove``: delete what is not an envelope and what fails its tag under a key
        given (FORGED: nobody can read it); envelopes under keys not given are kept."""
        names = list(self.names())
        todo = [n for n in names if n.kind in sizes]
        for start in range(0, len(todo), batch):
            chunk = todo[start:start + batch]
            reads, bufs = self._read_names(chunk, [sizes[n.kind] for n in chunk], skip=skip)
            if remove:
                self._remove([r for r in reads if r.outcome is Outcome.FORGED])
            for name, r, buf in zip(chunk, reads, bufs):
                visit(name, r, buf)
            if progress is not None:
                progress(start + len(chunk), len(todo))
        return len(names) - len(todo)

    # ------------------------------------------------------------------ the rest of the API
    def contains(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        return any(self._inner.contains(k.name(key)) for k in self.keyring.keys)

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        """One request per key under the current key's names; where absent, one more per
        older key given."""
        check_open(self._closed, self.where)
        keys = list(keys)
        found = [False] * len(keys)
        todo = list(range(len(keys)))
        for k in self.keyring.keys:
            if not todo:
                break
            for i, hit in zip(todo, self._inner.contains_many([k.name(keys[i]) for i in todo])):
                found[i] = hit
            todo = [i for i in todo if not found[i]]
        return found

    def delete(self, key: RecordKey) -> bool:
        """Remove ``key``'s record under every key given's name."""
        check_open(self._closed, self.where)
        gone = False
        for k in self.keyring.keys:
            gone = self._inner.delete(k.name(key)) or gone
        return gone

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        """The plaintext payload sizes (the backend's envelope sizes at the names, current
        key first, less the envelope overhead; None: absent, or too short to be one)."""
        check_open(self._closed, self.where)
        keys = list(keys)
        out: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for k in self.keyring.keys:
            if not todo:
                break
            for i, n in zip(todo, self._inner.payload_sizes([k.name(keys[i]) for i in todo])):
                out[i] = None if n is None or n < ENVELOPE_OVERHEAD else n - ENVELOPE_OVERHEAD
            todo = [i for i in todo if out[i] is None]
        return out

    def stats(self) -> dict[str, Any]:
        """The backend's stats, with ``hits`` / ``misses`` / ``corrupt`` as this
        wrapper sees them (an envelope that fails authentication is a backend hit but a
        miss here), plus ``encrypted`` (True), ``encryption`` (the cipher), ``names``
        (``"keyed"``), ``key_id`` (the current key's id), ``key_ids`` (every key
        accepted, current first), ``auth_failures``, ``auth_removed``, and
        ``rekey_restored`` / ``rekey_lost`` (records this handle put back from, or found
        damaged in, a rekey journal that a run killed mid-batch left: see :meth:`rekey`)."""
        check_open(self._closed, self.where)
        out = dict(self._inner.stats())
        mine = self._counters.as_dict()
        out["backend_hits"] = out.get("hits")
        out["hits"], out["misses"] = mine["hits"], mine["misses"]
        out["corrupt"] = int(out.get("corrupt") or 0) + mine["corrupt"]
        out.update(encrypted=True, encryption="xaes-256-gcm", names="keyed", sealing=self.sealing,
                   key_id=self.keyring.key_ids[0], key_ids=self.keyring.key_ids,
                   auth_failures=mine["auth_failures"], auth_removed=mine["auth_removed"],
                   rekey_restored=mine["rekey_restored"], rekey_lost=mine["rekey_lost"])
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
        """The backend's :meth:`~.base.BlockStore.verify` (checksums, layout, names), then
        every record authenticated: what each stored name holds is read and its tag
        checked as the record its name maps to (``payload_bytes``: the payload size of
        each kind, default the sizes this handle has seen; records of another kind are
        ``unchecked``).

        Adds ``authenticated`` (records whose tag verified), ``auth_failures`` and
        ``auth_failed_keys`` (the stored names in hex, as ``corrupt_keys``: the key of a
        record that does not authenticate is not known), of them ``foreign`` (envelopes
        under a key not given: never removed) and the rest (not envelopes, or failing
        their tag under a key given), ``legacy`` (an earlier version's envelopes, which
        ``rekey`` migrates), ``unchecked``, and ``key_records`` (records per key id). With
        ``repair`` the backend removes its corrupt records and what fails authentication
        but the foreign ones is removed (``auth_removed``)."""
        check_open(self._closed, self.where)
        result = dict(self._inner.verify(repair=repair))
        sizes = dict(self._sizes if payload_bytes is None else payload_bytes)
        per_key: dict[str, int] = {}
        failed: list[str] = []
        counts = {"authenticated": 0, "foreign": 0, "legacy": 0, "unchecked": 0, "auth_removed": 0}

        def visit(name: RecordKey, r: Read, payload: np.ndarray) -> None:
            if r.outcome is Outcome.OK:
                assert r.key_id is not None and r.opened is not None
                counts["authenticated"] += 1
                counts["legacy"] += r.opened.version == LEGACY_ENVELOPE_VERSION
                per_key[r.key_id.hex()] = per_key.get(r.key_id.hex(), 0) + 1
            elif r.outcome in (Outcome.FOREIGN, Outcome.FORGED):
                failed.append(name.to_bytes().hex())
                counts["foreign"] += r.outcome is Outcome.FOREIGN
                counts["auth_removed"] += r.outcome is Outcome.FORGED and repair and not self.readonly
            elif r.outcome is Outcome.OTHER_SIZE:
                counts["unchecked"] += 1
            payload.fill(0)

        counts["unchecked"] += self._scan(sizes, visit, remove=repair)
        return {**result, **counts, "auth_failures": len(failed), "auth_failed_keys": failed,
                "key_records": per_key}

    def sample(self, keys: Sequence[RecordKey], payload_bytes: Mapping[RecordKind, int]) -> list[bytes | None]:
        """The id of the key each record of ``keys`` (of a kind in ``payload_bytes``)
        opens under; None where it is not authentic under a key given. Reads, removes
        nothing, counts nothing."""
        keys = [k for k in keys if k.kind in payload_bytes]
        segs = [as_out_segments(np.empty(payload_bytes[k.kind], np.uint8)) for k in keys]
        reads = self._read(keys, segs, [None] * len(keys), remove=False)
        return [r.key_id if r.outcome is Outcome.OK else None for r in reads]

    def describe(self, sample: int = 16) -> dict[str, Any]:
        """What ``tiered-kv stats`` shows of a level it has the keys of: of the first
        ``sample`` stored names, read at their stored sizes, how many open under each key
        id (``sampled_by_key``), how many are under no key given (``sampled_foreign``),
        not envelopes or failing their tag (``sampled_unauthentic``), and an earlier
        version's (``sampled_legacy``). Removes nothing."""
        check_open(self._closed, self.where)
        names = list(itertools.islice(self.names(), sample))
        sizes = self._inner.payload_sizes(names)
        per_key: dict[str, int] = {}
        counts = {"sampled": len(names), "sampled_foreign": 0, "sampled_unauthentic": 0, "sampled_legacy": 0}
        for n in sorted({s for s in sizes if s is not None and s >= ENVELOPE_OVERHEAD}):  # one call per size
            group = [name for name, s in zip(names, sizes) if s == n]
            reads, bufs = self._read_names(group, [n - ENVELOPE_OVERHEAD] * len(group))
            older = [i for i, r in enumerate(reads) if r.outcome is Outcome.OTHER_SIZE]  # (version 1: 44 bytes)
            for i, r in zip(older, self._read_targets(
                    [Target(group[i], None, None, as_out_segments(np.empty(n - LEGACY_ENVELOPE_OVERHEAD, np.uint8)),
                            None, None) for i in older], [n] * len(older))):
                reads[i] = r
            for r, b in zip(reads, bufs):
                b.fill(0)
                if r.outcome is Outcome.OK and r.opened is not None:
                    per_key[r.opened.keys.key_id.hex()] = per_key.get(r.opened.keys.key_id.hex(), 0) + 1
                    counts["sampled_legacy"] += r.opened.version == LEGACY_ENVELOPE_VERSION
                elif r.outcome is Outcome.FOREIGN:
                    counts["sampled_foreign"] += 1
                elif r.outcome is Outcome.FORGED:
                    counts["sampled_unauthentic"] += 1
        return {**counts, "sampled_by_key": per_key}

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
            return RekeyJournal(Path(path) / JOURNAL_NAME, faults=self.faults)
        if journal is None:
            return RekeyJournal(default_journal_path(self.where), faults=self.faults)
        if not isinstance(journal, (str, os.PathLike)):
            raise TypeError(f"journal: expected a file path or None, got {type(journal).__name__}")
        return RekeyJournal(journal, faults=self.faults)

    def rekey(self, payload_bytes: Mapping[RecordKind, int], *, batch: int = 16,
              journal: str | os.PathLike[str] | None = None, drop_old: bool = False,
              progress: Callable[[int, int, RekeyReport], None] | None = None) -> RekeyReport:
        """Move every record sealed under an older key given (``key_files[1:]``), and
        every record of an earlier version (unkeyed names), to the current key
        (``key_files[0]``) and its names, losing none, whenever the process dies.
        ``drop_old``: delete the records under older keys instead (use it when an old key
        was compromised: a record that authenticates only under it may be a forgery).

        Each batch of ``batch`` records is read, authenticated and decrypted, sealed
        under the current key, and the new envelopes written durably to the rekey journal
        (:meth:`rekey_journal`; ``journal``: its path, for an object store); only then
        are the old records removed and the new ones written (a write-once store has no
        overwrite), and the journal deleted. A run first puts back whatever the journal
        of a run killed mid-batch holds and the store lacks (``restored``; each journaled
        envelope authenticated first), and so does every encrypted open of a local store.
        So a process killed at any point (kill -9 included) loses no record, and none is
        ever served but authenticated.

        Resumable: records already under the current key are skipped without
        decrypting, so a run stopped at any point and run again finishes the job. One
        run per store at a time (:class:`StoreLockedError` otherwise). A failure writing
        the store (full, unreachable) raises and leaves the batch in the journal, for
        the next run or open to put back. ``progress(done, total, report)`` is called
        after each batch. :attr:`RekeyReport.opened_old` says how many records were found
        under an older key or version: 0 means there were none (or the keys or tenant
        given are not theirs)."""
        check_open(self._closed, self.where)
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        rj = self.rekey_journal(journal)
        report = RekeyReport()
        pending: list[tuple[RecordKey, PutItem, bool]] = []  # (old name, plaintext item, legacy)
        doomed: list[RecordKey] = []

        def skip(opened: Opened) -> bool:
            current = opened.gen == 0 and opened.version == ENVELOPE_VERSION
            return current or (drop_old and opened.gen > 0)

        def visit(name: RecordKey, r: Read, payload: np.ndarray) -> None:
            report.checked += 1
            if r.outcome is Outcome.SKIPPED:
                assert r.opened is not None
                if r.opened.gen == 0 and r.opened.version == ENVELOPE_VERSION:
                    report.current += 1
                else:
                    doomed.append(name)
            elif r.outcome is Outcome.OK:
                assert r.meta is not None and r.key is not None and r.opened is not None
                pending.append((name, PutItem(r.key, r.meta.parent_hash, r.meta.token_digest, payload),
                                r.opened.version == LEGACY_ENVELOPE_VERSION))
            elif r.outcome is Outcome.FOREIGN:
                report.foreign += 1
            elif r.outcome is Outcome.FORGED:
                report.failed += 1
            elif r.outcome is Outcome.OTHER_SIZE:
                report.unchecked += 1  # (of neither size a record of its kind has)
            else:
                report.absent += 1

        def flush(done: int, total: int) -> None:
            if pending:
                self._rewrite(pending, rj, report)
                pending.clear()
            for name in doomed:
                report.dropped += self._inner.delete(name)
            doomed.clear()
            if progress is not None:
                progress(done, total, report)

        with rj.holding(required=True):
            left = rj.replay(self._inner, authentic=self._journaled_authentic)
            if left.deferred:
                raise StoreError(f"{rj.path}: the journal of an interrupted rekey holds records under a key not "
                                 f"given here; run rekey again with the --key-file that run had (it is kept)")
            self._counters.add(rekey_restored=left.restored, rekey_lost=left.lost)
            at_open, self._replayed = self._replayed, ReplayResult()
            report.restored, report.lost = left.restored + at_open.restored, left.lost + at_open.lost
            report.unchecked = self._scan(payload_bytes, visit, remove=True, skip=skip, batch=batch,
                                          progress=flush)
        return report

    def _rewrite(self, batch: list[tuple[RecordKey, PutItem, bool]], rj: RekeyJournal, report: RekeyReport) -> None:
        """One batch of :meth:`rekey`: seal, journal, remove the old names, put, forget."""
        sealed = self._seal([item for _, item, _ in batch])
        for _, item, _ in batch:
            zero([_joined(item.payload)])  # (the plaintext of the batch is not kept)
        rj.write(sealed, self.layout_fingerprint)
        n = rj.writes
        self.faults.hit(RekeyPoint.JOURNALED, n=n)
        try:
            for old, _, _ in batch:
                self._inner.delete(old)
            self.faults.hit(RekeyPoint.DELETED, n=n)
            written = self._inner.put_many(sealed)
        except BaseException as e:
            e.add_note(f"rekey: the batch being rewritten ({len(sealed)} records) is kept in {rj.path}; the "
                       f"next rekey (or, for a local store, any encrypted open) puts back what is missing")
            raise
        self.faults.hit(RekeyPoint.PUT, n=n)
        rj.clear()
        for (_, _, legacy), ok in zip(batch, written):  # (False: another writer stored it meanwhile)
            if not ok:
                report._old_present += 1
            elif legacy:
                report.migrated += 1
            else:
                report.rekeyed += 1


def _drain(futures: Sequence[Future[Any]]) -> None:
    """Wait for every future, their exceptions dropped (one is being raised already)."""
    for f in futures:
        try:
            f.result()
        except BaseException:  # noqa: BLE001,S110
            pass


def _wait_all(futures: Sequence[Future[Any]]) -> None:
    """Wait for every future, then raise the first exception among them (if any)."""
    first: BaseException | None = None
    for f in futures:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001  (re-raised below, after the others finished)
            first = first or e
    if first is not None:
        raise first
