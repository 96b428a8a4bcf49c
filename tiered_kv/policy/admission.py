"""Which records reach the disk tier: the disk admission filters.

Today every sealed block and every published snapshot is written through to the disk
(``all``). Most of them are never asked for again: a filter holds a record back until
the memory tiers have shown that it is reused, as Dynamo's KV block manager does, to
spare disk writes (SSD wear, store bandwidth). ::

    all           every record, written through when sealed / published (the default)
    second-hit    a record reaches the disk only once it has been hit in a memory tier
                  (a resume served it from the GPU or host tier); = ``hits:1``
    hits:N        only after N such hits
    seen-twice    second-hit, or when it is computed a second time (sealed / published
                  again: it was wanted again while no tier held it), a doorkeeper in
                  TinyLFU's sense: the first sighting is remembered (its hash), not written
    survived:N    second-hit, or once it has lived N requests (cache opens) in the memory
                  tiers: N opens after it was sealed / published, a record a memory tier
                  (GPU or host) still holds is written (a snapshot only when every block
                  before it is known on disk by then); one evicted sooner never is

A record held back is simply not on disk: a later resume that needs it there misses
(it is recomputed), never reads wrong bytes. Prefixes stay resumable: a snapshot is
admitted only together with every block before it that is not known to be on disk
(written here or read from there), queued ahead of it on the one writer thread, so a
snapshot on disk never lacks its blocks for want of admission (a block the store itself
evicted, or whose write failed, is a miss as before).

:class:`AdmissionFilter` holds the per-record hit counts and the records known to be on
disk, each bounded (LRU, ``max_tracked`` keys): a forgotten count starts again, a
forgotten "on disk" is at worst written once more (the store keeps one copy).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from ._spec import _int_after_colon

__all__ = ["ADMISSION_POLICIES", "AdmissionFilter", "AdmissionPolicy", "admission_policy"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionPolicy:
    """A disk admission filter (see the module docstring)."""

    #: memory-tier hits a record needs before it is written to disk (0: written through)
    hits: int
    #: also written when computed a second time (remembered by hash, bounded)
    seen_twice: bool = False
    #: also written once it has lived this many requests (opens) in a memory tier (None: never)
    survive: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hits, bool) or not isinstance(self.hits, int) or self.hits < 0:
            raise ValueError(f"admission policy: expected hits an int >= 0, got {self.hits!r}")
        s = self.survive
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"admission policy: expected survive None or an int >= 1, got {s!r}")
        if s is not None and self.hits == 0:
            raise ValueError("admission policy: survive needs hits >= 1 (with hits 0 every record is written through)")

    @property
    def label(self) -> str:
        if self.survive is not None:
            return f"survived:{self.survive}"
        if self.seen_twice:
            return "seen-twice"
        return {0: "all", 1: "second-hit"}.get(self.hits, f"hits:{self.hits}")

    @property
    def write_through(self) -> bool:
        return self.hits == 0


ADMISSION_POLICIES: dict[str, AdmissionPolicy] = {
    "all": AdmissionPolicy(hits=0), "second-hit": AdmissionPolicy(hits=1),
    "seen-twice": AdmissionPolicy(hits=1, seen_twice=True)}


def admission_policy(spec: str | AdmissionPolicy) -> AdmissionPolicy:
    """``all``, ``second-hit``, ``seen-twice``, ``hits:N`` or ``survived:N`` -> the
    :class:`AdmissionPolicy`."""
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
    raise ValueError(f"admission: expected 'all', 'second-hit', 'seen-twice', 'hits:N' or 'survived:N', got {spec!r}")


@dataclass(frozen=True, slots=True)
class Deferred:
    """A record held back by ``survived:N``, to be written if it is still in memory when due."""

    #: the request clock (opens) at which it is due
    due: int
    kind: str
    h: bytes
    #: a block's parent hash (a snapshot's: the root), and the digest of its (last) block's tokens
    parent: bytes
    digest: bytes
    #: a snapshot's blocks before it (each must be known on disk first); None for a block
    before: tuple[bytes, ...] | None = None


class AdmissionFilter:
    """The state of one cache's admission filter. Keys are ``(kind, hash)`` with kind
    ``"block"`` or ``"snapshot"``; pure Python, no tensors.

    * :meth:`at_write`: a record is sealed / published: write it now? (False counts a reject)
    * :meth:`hit`: a memory tier served it: write it now? (True at most once while known)
    * :meth:`on_disk`: it is on disk (written or read from there): never admitted again
    * :meth:`defer` / :meth:`tick` (``survived:N``): a record held back at seal / publish
      is remembered with what its write needs; each open advances the clock and returns
      the records due, which the cache writes when a memory tier still holds them
    """

    def __init__(self, policy: AdmissionPolicy, *, max_tracked: int = 1 << 18) -> None:
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 1:
            raise ValueError(f"max_tracked: expected an int >= 1, got {max_tracked!r}")
        self.policy = policy
        self.max_tracked = max_tracked
        self._hits: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._on_disk: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        #: seen-twice: records sealed / published once and held back
        self._seen: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        #: writes held back at seal / publish time
        self.rejects = 0
        #: records written later, on a hit (or, survived:N, having survived)
        self.admitted = 0
        #: survived:N: records held back, oldest first, and the request clock (opens)
        self._deferred: deque[Deferred] = deque()
        self.clock = 0
        #: survived:N: records due that no memory tier held any more (never written)
        self.expired = 0

    def at_write(self, kind: str, h: bytes, before: list[bytes] | None = None) -> bool:
        """A record is sealed / published: write it now? ``before``: for a snapshot, the
        hashes of the blocks before it (it is admitted only when each is known on disk)."""
        if self.policy.write_through:
            return True
        key = (kind, h)
        if self.policy.seen_twice and key in self._seen and key not in self._on_disk and (
                before is None or all(("block", b) in self._on_disk for b in before)):
            del self._seen[key]
            self.on_disk(kind, h)
            return True
        if self.policy.seen_twice:
            self._seen[key] = None
            self._seen.move_to_end(key)
            if len(self._seen) > self.max_tracked:
                self._seen.popitem(last=False)
        self.rejects += 1
        return False

    def defer(self, kind: str, h: bytes, parent: bytes, digest: bytes, before: list[bytes] | None = None) -> None:
        """``survived:N``: remember a record :meth:`at_write` held back, due N opens from now
        (bounded: past ``max_tracked`` the oldest is forgotten, i.e. never written)."""
        n = self.policy.survive
        if n is None:
            return
        self._deferred.append(Deferred(self.clock + n, kind, h, parent, digest,
                                       None if before is None else tuple(before)))
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
