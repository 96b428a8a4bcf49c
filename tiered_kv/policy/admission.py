"""Which records reach the disk tier: the disk admission filters.

Today every sealed block and every published snapshot is written through to the disk
(``all``). Most of them are never asked for again: a filter holds a record back until
the memory tiers have shown that it is reused, as Dynamo's KV block manager does, to
spare disk writes (SSD wear, store bandwidth). The filters decide on **snapshots**; a
block reaches the disk only along with a snapshot at or after it on its path::

    all           every record, written through when sealed / published (the default)
    second-hit    a snapshot reaches the disk only once it has been hit in a memory tier
                  (a resume served it from the GPU or host tier); = ``hits:1``
    hits:N        only after N such hits
    seen-twice    second-hit, or when it is computed a second time (published again: it
                  was wanted again while no tier held it), a doorkeeper in TinyLFU's
                  sense: the first sighting is remembered (its hash), not written
    survived:N    second-hit, or once it has lived N requests (cache opens) in the memory
                  tiers: N opens after it was published, a snapshot a memory tier (GPU or
                  host) still holds is written, if each block before it is still in a
                  memory tier or known on disk; one evicted sooner never is
    retraced      seen-twice, or a snapshot published by a request after it recomputed
                  (sealed again) a block at which an earlier request published a snapshot
                  that was held back and is not on disk: the request retraced a path that
                  was wanted again when no tier could serve it, so the path it extends is
                  written with its snapshots, blocks and all. seen-twice waits for the same
                  snapshot to be published twice, which a conversation's next turn (whose
                  prompt ends further on) never does

Coherent path segments: a snapshot admitted takes along every block before it that is
not known to be on disk (written here or read from there), queued ahead of it on the one
writer thread; a block is never admitted alone. So the disk never holds a block that
the filter wrote without a snapshot at or after it (such a block is dead weight: no
resume can use it), nor a snapshot without its blocks (a block the store itself evicted,
or whose write failed, is a miss as before). A record held back is simply not on disk: a
later resume that needs it there misses (it is recomputed), never reads wrong bytes.

:class:`AdmissionFilter` holds the per-record hit counts and the records known to be on
disk, each bounded (LRU, ``max_tracked`` keys): a forgotten count starts again, a
forgotten "on disk" is at worst written once more (the store keeps one copy).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from ._spec import _int_after_colon

__all__ = ["ADMISSION_POLICIES", "DEFAULT_ADMISSION", "AdmissionFilter", "AdmissionPolicy", "admission_policy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionPolicy:
    """A disk admission filter (see the module docstring)."""

    #: memory-tier hits a record needs before it is written to disk (0: written through)
    hits: int
    #: also written when computed a second time (remembered by hash, bounded)
    seen_twice: bool = False
    #: also written once it has lived this many requests (opens) in a memory tier (None: never)
    survive: int | None = None
    #: also written: a snapshot its request published after it recomputed a block at
    #: which a snapshot was held back before (``retraced``). Needs ``seen_twice``.
    retrace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.hits, bool) or not isinstance(self.hits, int) or self.hits < 0:
            raise ValueError(f"admission policy: expected hits an int >= 0, got {self.hits!r}")
        s = self.survive
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"admission policy: expected survive None or an int >= 1, got {s!r}")
        if s is not None and self.hits == 0:
            raise ValueError("admission policy: survive needs hits >= 1 (with hits 0 every record is written through)")
        if self.retrace and not self.seen_twice:
            raise ValueError("admission policy: retrace needs seen_twice (its memory of held-back snapshots)")

    @property
    def label(self) -> str:
        if self.survive is not None:
            return f"survived:{self.survive}"
        if self.retrace:
            return "retraced"
        if self.seen_twice:
            return "seen-twice"
        return {0: "all", 1: "second-hit"}.get(self.hits, f"hits:{self.hits}")

    @property
    def write_through(self) -> bool:
        return self.hits == 0


#: The cache's default: every record written through, so that a prompt served once is on
#: disk for the next process (a restart, a second server on the store, a warm start).
#: ``retraced`` hits as often or more on both bundled traces whole and writes 71-75 % fewer
#: bytes (docs/policies.md, "At half the trace maximum"), but holds back what was served
#: once: the replays measure no restart, so the default stays write-through.
DEFAULT_ADMISSION = "all"

ADMISSION_POLICIES: dict[str, AdmissionPolicy] = {
    "all": AdmissionPolicy(hits=0), "second-hit": AdmissionPolicy(hits=1),
    "seen-twice": AdmissionPolicy(hits=1, seen_twice=True),
    "retraced": AdmissionPolicy(hits=1, seen_twice=True, retrace=True)}


def admission_policy(spec: str | AdmissionPolicy) -> AdmissionPolicy:
    """``all``, ``second-hit``, ``seen-twice``, ``retraced``, ``hits:N`` or ``survived:N``
    -> the :class:`AdmissionPolicy`."""
    if isinstance(spec, AdmissionPolicy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"admission: expected a str like 'all' or 'second-hit', got {type(spec).__name__}")
    if spec in ADMISSION_POLICIES:
        return ADMISSION_POLICIES[spec]
    name, sep, arg = spec.partition(":")
    if name in ("hits", "survived") and sep:
        n = _int_after_colon("admission", spec, arg)
        if n < 1:
            raise ValueError(f"admission {spec!r}: expected {name}:N with N >= 1, got {n}")
        return AdmissionPolicy(hits=n) if name == "hits" else AdmissionPolicy(hits=1, survive=n)
    raise ValueError("admission: expected 'all', 'second-hit', 'seen-twice', 'retraced', 'hits:N' or "
                     f"'survived:N', got {spec!r}")


@dataclass(frozen=True, slots=True)
class Deferred:
    """A snapshot held back by ``survived:N``, to be written (with its blocks) if it is
    still in memory when due."""

    #: the request clock (opens) at which it is due
    due: int
    kind: str
    h: bytes
    #: a block's parent hash (a snapshot's: the root), and the digest of its (last) block's tokens
    parent: bytes
    digest: bytes
    #: the blocks before the snapshot, each ``(hash, parent hash, token digest)``: those
    #: not on disk when it is due are written ahead of it if still held in memory
    before: tuple[tuple[bytes, bytes, bytes], ...] = ()


class AdmissionFilter:
    """The state of one cache's admission filter. Keys are ``(kind, hash)`` with kind
    ``"block"`` or ``"snapshot"``; pure Python, no tensors.

    * :meth:`at_write`: a record is sealed / published: write it now? (False counts a reject)
    * :meth:`retraces` (``retraced``): a block sealed again where a snapshot was held
      back: the request's snapshots after that point are written
    * :meth:`hit`: a memory tier served it: write it now? (True at most once while known)
    * :meth:`on_disk`: it is on disk (written or read from there): never admitted again
    * :meth:`defer` / :meth:`tick` (``survived:N``): a snapshot held back at publish is
      remembered with what its write (and its blocks') needs; each open advances the
      clock and returns the snapshots due, which the cache writes when a memory tier
      still holds them and each block before them
    """

    def __init__(self, policy: AdmissionPolicy, *, max_tracked: int = 1 << 18) -> None:
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 1:
            raise ValueError(f"max_tracked: expected an int >= 1, got {max_tracked!r}")
        self.policy = policy
        self.max_tracked = max_tracked
        self._hits: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._on_disk: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        #: seen-twice: snapshots published once and held back
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        #: writes held back at seal / publish time
        self.rejects = 0
        #: records written later: a snapshot on a hit (seen-twice: also at its second
        #: publish; survived:N: also having survived) and the blocks it takes along
        self.admitted = 0
        #: survived:N: snapshots held back, oldest first, and the request clock (opens)
        self._deferred: deque[Deferred] = deque()
        self.clock = 0
        #: survived:N: snapshots due that no memory tier held any more, or whose blocks
        #: were neither in memory nor known on disk (never written)
        self.expired = 0

    def at_write(self, kind: str, h: bytes, *, retraced: bool = False) -> bool:
        """A record is sealed / published: write it now? (False counts a reject.) A block
        never is unless written through: it goes along with an admitted snapshot after it.
        A snapshot admitted here (``seen-twice``: published a second time; ``retraced``:
        also when ``retraced``, the caller's verdict on its request, which sealed a block
        :meth:`retraces` before it; counted in :attr:`admitted`) is written with
        every block before it not known on disk (the caller's part: :meth:`admit` each)."""
        if self.policy.write_through:
            return True
        key = (kind, h)
        if kind == "snapshot" and self.policy.seen_twice:
            if (key in self._seen or (retraced and self.policy.retrace)) and key not in self._on_disk:
                self._seen.pop(key, None)
                self.admit(kind, h)
                return True
            self._seen[key] = None
            self._seen.move_to_end(key)
            if len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
        self.rejects += 1
        return False

    def retraces(self, h: bytes) -> bool:
        """``retraced``: a block ``h`` is sealed (computed) again; True when
        an earlier request published a snapshot at it that was held back and is not on
        disk: the sealing request retraces a path that was computed before and that no
        tier could serve, so its later snapshots are to be written (``retraced``)."""
        if not self.policy.retrace:
            return False
        key = ("snapshot", h)
        return key in self._seen and key not in self._on_disk

    def defer(self, h: bytes, parent: bytes, digest: bytes,
              before: Sequence[tuple[bytes, bytes, bytes]] = ()) -> None:
        """``survived:N``: remember a snapshot :meth:`at_write` held back, due N opens from
        now, with ``before``: the blocks before it, each ``(hash, parent, digest)``
        (bounded: past ``max_tracked`` the oldest is forgotten, i.e. never written)."""
        n = self.policy.survive
        if n is None:
            return
        self._deferred.append(Deferred(self.clock + n, "snapshot", h, parent, digest, tuple(before)))
        if len(self._deferred) > self.max_tracked:
            self._deferred.popleft()

    def tick(self) -> list[Deferred]:
        """One more request opened: the deferred records now due (not known on disk), oldest
        first. The caller writes those a memory tier still holds (:meth:`admit`) and counts
        the others (:attr:`expired`)."""
        self.clock += 1
        q = self._deferred
        due: list[Deferred] = []
        while q and q[0].due <= self.clock:
            d = q.popleft()
            if (d.kind, d.h) not in self._on_disk:
                due.append(d)
        return due

    def known_on_disk(self, kind: str, h: bytes) -> bool:
        return (kind, h) in self._on_disk

    def on_disk(self, kind: str, h: bytes) -> None:
        if self.policy.write_through:
            return
        key = (kind, h)
        self._hits.pop(key, None)
        self._on_disk[key] = None
        self._on_disk.move_to_end(key)
        if len(self._on_disk) > self.max_tracked:
            self._on_disk.popitem(last=False)

    def hit(self, kind: str, h: bytes) -> bool:
        """Count one memory-tier hit; True when this one admits the record (the caller
        writes it and it is then known on disk)."""
        if self.policy.write_through:
            return False
        key = (kind, h)
        if key in self._on_disk:
            self._on_disk.move_to_end(key)
            return False
        n = self._hits.pop(key, 0) + 1
        if n < self.policy.hits:
            self._hits[key] = n
            if len(self._hits) > self.max_tracked:
                self._hits.popitem(last=False)
            return False
        self.admit(kind, h)
        return True

    def admit(self, kind: str, h: bytes) -> None:
        """The record is being written now (on a hit, or forced: a snapshot's blocks)."""
        self.admitted += 1
        self.on_disk(kind, h)
