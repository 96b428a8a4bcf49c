"""Rotation of an encrypted level's keys: ``rekey`` moves the records sealed under older keys
(and those of an earlier version, with their unkeyed names) to the current key and its
names, losing nothing whenever it is killed (:mod:`.rekey_journal`); ``drop_old`` deletes
them instead (the old key was compromised: what it authenticates may be forged).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..api.counters import Counters
from ..api.store import BlockStore, PutItem
from ..errors import StoreError
from ..format.record import RecordKey, RecordKind
from ..os.faults import Faults
from .crypto import ENVELOPE_OVERHEAD, ENVELOPE_VERSION, HEAD_BYTES, LEGACY_ENVELOPE_VERSION, Keyring, Opened
from .envelopes import Opener, Outcome, Read, zero
from .reads import EnvelopeReads
from .rekey_journal import JOURNAL_NAME, RekeyJournal, RekeyPoint, ReplayResult, default_journal_path
from .seal import Sealer, joined
from .work import Workers

__all__ = ["RekeyReport", "Rekeying"]


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


class Rekeying:
    """The rekey machinery of one encrypted level (its journal, the replay of a journal a
    killed run left, the batches): the wrapper's parts it works with, passed in."""

    def __init__(self, inner: BlockStore, keyring: Keyring, opener: Opener, workers: Workers, counters: Counters,
                 reads: EnvelopeReads, sealer: Sealer, faults: Faults, *, layout_fingerprint: str, where: str,
                 path: object) -> None:
        self.inner = inner
        self.keyring = keyring
        self.opener = opener
        self.workers = workers
        self.counters = counters
        self.reads = reads
        self.sealer = sealer
        self.faults = faults
        self.layout_fingerprint = layout_fingerprint
        self.where = where
        self.path = path

    def replay_at_open(self, *, closed: bool, maintenance: bool, readonly: bool) -> ReplayResult:
        """Put back the records a rekey killed mid-batch left in the journal in this
        local store's directory (see :mod:`.rekey_journal`); nothing when there is none,
        when the store cannot be written here, or when a rekey running now holds it."""
        path = self.path
        if closed or maintenance or readonly or not isinstance(path, os.PathLike):
            return ReplayResult()
        rj = RekeyJournal(Path(path) / JOURNAL_NAME)
        if not rj.exists():
            return ReplayResult()
        with rj.holding(required=False) as held:
            result = rj.replay(self.inner, authentic=self.journaled_authentic) if held else ReplayResult()
        self.counters.add(rekey_restored=result.restored, rekey_lost=result.lost)
        return result

    def journaled_authentic(self, item: PutItem) -> bool | None:
        """Whether a journaled record (name, masked fields, envelope) is an envelope that
        authenticates under a key given as the record its name maps to; None when it is
        under no key given (the journal is left for a holder of that key)."""
        env = joined(item.payload)
        opened = self.keyring.identify(env[:HEAD_BYTES], item.parent_hash, item.token_digest)
        if opened is None:
            return None
        if opened.version != ENVELOPE_VERSION or env.nbytes < ENVELOPE_OVERHEAD:
            return False
        key = opened.keys.key_of(item.key)
        scratch = self.workers.arena("scratch", env.nbytes - ENVELOPE_OVERHEAD)[:env.nbytes - ENVELOPE_OVERHEAD]
        try:
            return self.keyring.open_into(opened, env[HEAD_BYTES:], self.opener.aad(opened, key), scratch)
        finally:
            scratch.fill(0)

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

    def rekey(self, payload_bytes: Mapping[RecordKind, int], *, batch: int, journal: str | os.PathLike[str] | None,
              drop_old: bool, progress: Callable[[int, int, RekeyReport], None] | None,
              take_replayed: Callable[[], ReplayResult]) -> RekeyReport:
        """:meth:`~.store.EncryptedStore.rekey` (its docstring says what it does);
        ``take_replayed()``: what the wrapper's open put back from a journal, reported once."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"batch: expected a positive int, got {batch!r}")
        rj = self.rekey_journal(journal)
        run = _Run(self, rj, drop_old=drop_old, progress=progress)
        with rj.holding(required=True):
            left = rj.replay(self.inner, authentic=self.journaled_authentic)
            if left.deferred:
                raise StoreError(f"{rj.path}: the journal of an interrupted rekey holds records under a key not "
                                 f"given here; run rekey again with the --key-file that run had (it is kept)")
            self.counters.add(rekey_restored=left.restored, rekey_lost=left.lost)
            at_open = take_replayed()
            run.report.restored, run.report.lost = left.restored + at_open.restored, left.lost + at_open.lost
            run.report.unchecked = self.reads.scan(payload_bytes, run.visit, remove=True, skip=run.skip, batch=batch,
                                                   progress=run.flush)
        return run.report

    def rewrite(self, batch: list[tuple[RecordKey, PutItem, bool]], rj: RekeyJournal, report: RekeyReport) -> None:
        """One batch of :meth:`rekey`: seal, journal, remove the old names, put, forget."""
        sealed = self.sealer.seal([item for _, item, _ in batch])
        for _, item, _ in batch:
            zero([joined(item.payload)])  # (the plaintext of the batch is not kept)
        rj.write(sealed, self.layout_fingerprint)
        n = rj.writes
        self.faults.hit(RekeyPoint.JOURNALED, n=n)
        try:
            for old, _, _ in batch:
                self.inner.delete(old)
            self.faults.hit(RekeyPoint.DELETED, n=n)
            written = self.inner.put_many(sealed)
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


class _Run:
    """One rekey run's scan: what each record read is (:meth:`visit`), and each batch
    rewritten or dropped once read (:meth:`flush`)."""

    def __init__(self, rekeying: Rekeying, rj: RekeyJournal, *, drop_old: bool,
                 progress: Callable[[int, int, RekeyReport], None] | None) -> None:
        self.rekeying = rekeying
        self.rj = rj
        self.drop_old = drop_old
        self.progress = progress
        self.report = RekeyReport()
        self.pending: list[tuple[RecordKey, PutItem, bool]] = []  # (old name, plaintext item, legacy)
        self.doomed: list[RecordKey] = []

    def skip(self, opened: Opened) -> bool:
        current = opened.gen == 0 and opened.version == ENVELOPE_VERSION
        return current or (self.drop_old and opened.gen > 0)

    def visit(self, name: RecordKey, r: Read, payload: np.ndarray) -> None:
        report = self.report
        report.checked += 1
        if r.outcome is Outcome.SKIPPED:
            assert r.opened is not None
            if r.opened.gen == 0 and r.opened.version == ENVELOPE_VERSION:
                report.current += 1
            else:
                self.doomed.append(name)
        elif r.outcome is Outcome.OK:
            assert r.meta is not None and r.key is not None and r.opened is not None
            self.pending.append((name, PutItem(r.key, r.meta.parent_hash, r.meta.token_digest, payload),
                                 r.opened.version == LEGACY_ENVELOPE_VERSION))
        elif r.outcome is Outcome.FOREIGN:
            report.foreign += 1
        elif r.outcome is Outcome.FORGED:
            report.failed += 1
        elif r.outcome is Outcome.OTHER_SIZE:
            report.unchecked += 1  # (of neither size a record of its kind has)
        else:
            report.absent += 1

    def flush(self, done: int, total: int) -> None:
        if self.pending:
            self.rekeying.rewrite(self.pending, self.rj, self.report)
            self.pending.clear()
        for name in self.doomed:
            self.report.dropped += self.rekeying.inner.delete(name)
        self.doomed.clear()
        if self.progress is not None:
            self.progress(done, total, self.report)
