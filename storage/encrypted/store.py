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
record's xxh3 is not computed there, the tag covers every byte it covers. On LMDB the
envelopes the page cache holds are decrypted straight from a map of their segment file
(:meth:`~.base.BlockStore.map_unhashed`); the others, and those of other local backends,
are read checked but not hashed, in chunks of at most 8 MiB into reusable per-thread
arenas, and opened on several threads, pipelined.

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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..api.counters import Counters
from ..api.eviction import EvictionGuard
from ..api.store import BlockStore, PayloadSink, PutItem, check_open
from ..api.wrapper import StoreWrapper
from ..format.record import RecordKey, RecordKind, RecordMeta, as_out_segments
from ..format.rows import RowScatter
from ..os.faults import Faults
from .crypto import ENVELOPE_OVERHEAD, LEGACY_ENVELOPE_OVERHEAD, LEGACY_ENVELOPE_VERSION, EncryptionConfig, Keyring
from .envelopes import Opener, Outcome, Read, Target
from .level import adopt_level
from .reads import EnvelopeReads
from .rekey import RekeyReport, Rekeying
from .rekey_journal import RekeyJournal, ReplayResult
from .seal import Sealer
from .work import Workers

__all__ = ["EncryptedStore", "RekeyReport"]


#: The counters of an encrypted level (this handle), on top of its backend's.
_COUNTERS = ("hits", "misses", "auth_failures", "auth_removed", "corrupt", "rekey_restored", "rekey_lost")


class EncryptedStore(StoreWrapper):
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

    # What it changes of the backend's capabilities (the rest is the backend's, forwarded:
    # the layout, bounds, directory, sealing, maintenance, multi-process and guard flags).
    supports_mmap_reads = False
    supports_scatter_reads = True  # scatter-list outs are filled here, not by the backend
    supports_row_reads = False  # (get_rows goes through get_many: every record is opened)
    supports_streamed_reads = False  # (it opens envelopes; it hands no raw payload to a sink)

    def __init__(self, inner: BlockStore, encryption: EncryptionConfig | Mapping[str, Any] | Keyring, *,
                 owned: bool = True, migrate: bool = False) -> None:
        if isinstance(inner, EncryptedStore):
            raise ValueError("inner: already an EncryptedStore (records would be sealed twice)")
        super().__init__(inner, owned=owned)
        self.keyring = encryption if isinstance(encryption, Keyring) else Keyring(EncryptionConfig.parse(encryption))
        self.config = self.keyring.config
        self._workers = Workers(self.config.threads)
        self.threads = self._workers.threads
        self._counters = Counters(_COUNTERS)
        self._sizes: dict[RecordKind, int] = {}  # payload size of each kind, as seen
        self._guard: EvictionGuard | None = None
        self._on_evict: Callable[[list[RecordKey]], None] | None = None
        self._opener = Opener(self.keyring, self.layout_fingerprint)
        #: the fault points of its rekey batches (:class:`~.rekey_journal.RekeyPoint`): a test seam
        self.faults = Faults()
        self._reads = EnvelopeReads(inner, self.keyring, self._opener, self._workers, self._counters, self._sizes)
        self._sealer = Sealer(self.keyring, self._workers, self._sizes, layout_fingerprint=self.layout_fingerprint)
        self._rekeying = Rekeying(inner, self.keyring, self._opener, self._workers, self._counters, self._reads,
                                  self._sealer, self.faults, layout_fingerprint=self.layout_fingerprint,
                                  where=self.where, path=self.path)
        adopt_level(inner, migrate=migrate, where=self.where)
        self._replayed = self._rekeying.replay_at_open(  # (reported by this handle's next rekey)
            closed=self._closed, maintenance=self.maintenance, readonly=self.readonly)

    # ------------------------------------------------------------------ what it wraps
    @property  # type: ignore[override]
    def eviction_guard(self) -> EvictionGuard | None:
        """The guard given (the backend is given one that maps its names back to keys)."""
        return self._guard

    @eviction_guard.setter
    def eviction_guard(self, guard: EvictionGuard | None) -> None:
        self._guard = guard
        self._inner.eviction_guard = None if guard is None else self._names_guard

    @property
    def on_evict(self) -> Callable[[list[RecordKey]], None] | None:
        """Told the keys of the records the backend's evictions took, with the backend's
        contract (:attr:`.LmdbStore.on_evict`, :attr:`.ZarrStore.on_evict`): once they are
        gone, on the evicting thread. The backend reports names; each is mapped back to a
        key with no read, under every key given (as the eviction guard's are), so the key
        of the record is among those reported and the others are random keys that no
        cache holds. ``AttributeError`` (as for a store without the attribute) where the
        backend reports nothing, so that a listener knows it would never be told."""
        if getattr(self._inner, "on_evict", False) is False:
            raise AttributeError(f"{self.where}: the backend ({type(self._inner).__name__}) reports no evictions")
        return self._on_evict

    @on_evict.setter
    def on_evict(self, listener: Callable[[list[RecordKey]], None] | None) -> None:
        if getattr(self._inner, "on_evict", False) is False:
            raise AttributeError(f"{self.where}: the backend ({type(self._inner).__name__}) reports no evictions")
        self._on_evict = listener
        self._inner.on_evict = None if listener is None else self._names_evicted

    def _names_evicted(self, names: list[RecordKey]) -> None:
        """The backend's eviction listener: the names it evicted, told as keys."""
        listener = self._on_evict
        if listener is not None:
            listener(self._keys_of_names(names))

    def _keys_of_names(self, names: Sequence[RecordKey]) -> list[RecordKey]:
        """Every key each of ``names`` maps back to, under every key given (no read)."""
        return [k.key_of(name) for name in names for k in self.keyring.keys]

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
        return iter(self._reads.keys_of(list(self._inner)))

    def __len__(self) -> int:
        """Objects in the level: records of every key and tenant (a listing counts them)."""
        return super().__len__()

    def recent(self, n: int) -> list[RecordKey]:
        """The keys of the backend's :meth:`~.zarr.ZarrStore.recent` ``n`` names
        (Zarr backends only) that are records under a key given."""
        if not self._inner.supports_recent:
            raise TypeError(f"recent: the backend {type(self._inner).__name__} keeps no write or access order")
        return self._reads.keys_of(list(self._inner.recent(n)))

    def get_rows(self, keys: Sequence[RecordKey], rows: RowScatter, *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[bool]:
        """Through :meth:`get_many`, as any store without native row reads (never the
        backend's: it would hand over envelopes)."""
        return BlockStore.get_rows(self, keys, rows, token_digests=token_digests)

    def read_each(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int],
                  open_sink: Callable[[int, RecordMeta], PayloadSink]) -> list[Any]:
        """Not supported (``supports_streamed_reads`` is False): the backend streams, this
        level opens what it streams."""
        return BlockStore.read_each(self, keys, payload_bytes, open_sink)

    # ------------------------------------------------------------------ writes
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        check_open(self._closed, self.where)
        items = self._check_put_items(items)
        if not items:
            return []
        return self._inner.put_many(self._seal(items))

    def _seal(self, items: list[PutItem]) -> list[PutItem]:
        """``items`` sealed under the current key (see :class:`~.seal.Sealer`)."""
        return self._sealer.seal(items)

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, self.where)
        keys, segs, digests = self._check_get_args(keys, outs, token_digests, scatter=True)
        reads = self._reads.read(keys, segs, digests)
        self._reads.count(reads)
        return [r.meta for r in reads]

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
        self._workers.close()
        super().close()

    def __repr__(self) -> str:
        return f"EncryptedStore({self._inner!r}, key {self.keyring.key_ids[0]})"

    # ------------------------------------------------------------------ maintenance
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

        counts["unchecked"] += self._reads.scan(sizes, visit, remove=repair)
        return {**result, **counts, "auth_failures": len(failed), "auth_failed_keys": failed,
                "key_records": per_key}

    def sample(self, keys: Sequence[RecordKey], payload_bytes: Mapping[RecordKind, int]) -> list[bytes | None]:
        """The id of the key each record of ``keys`` (of a kind in ``payload_bytes``)
        opens under; None where it is not authentic under a key given. Reads, removes
        nothing, counts nothing."""
        keys = [k for k in keys if k.kind in payload_bytes]
        segs = [as_out_segments(np.empty(payload_bytes[k.kind], np.uint8)) for k in keys]
        reads = self._reads.read(keys, segs, [None] * len(keys), remove=False)
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
            reads, bufs = self._reads.read_names(group, [n - ENVELOPE_OVERHEAD] * len(group))
            older = [i for i, r in enumerate(reads) if r.outcome is Outcome.OTHER_SIZE]  # (version 1: 44 bytes)
            for i, r in zip(older, self._reads.read_targets(
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
        return self._rekeying.rekey_journal(journal)

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
        return self._rekeying.rekey(payload_bytes, batch=batch, journal=journal, drop_old=drop_old, progress=progress,
                                    take_replayed=self._take_replayed)

    def _take_replayed(self) -> ReplayResult:
        """What this handle's open put back from a rekey journal (reported by one rekey)."""
        at_open, self._replayed = self._replayed, ReplayResult()
        return at_open
