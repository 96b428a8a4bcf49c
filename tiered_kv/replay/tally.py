"""Where every prompt token of a replay went: served by a tier, or computed for a reason.

Per request, with ``bt`` = block_tokens, ``L`` its prompt tokens, ``limit`` =
``(L - 1) // bt`` blocks (one token is always computed), all in blocks of the request's
prompt, counted from its start (see :mod:`tiered_kv.lookup` for ``resident`` and
``resumable``)::

    P   blocks the cache resumed (``open``'s num_cached_tokens / bt)
    R   blocks the lookup just before said it would resume (all tiers)
    A   held prefix: blocks [0, A) each in some tier, capped at limit
    M   seen prefix: blocks [0, M) all sealed by an earlier request of this node (or held
        when the replay started), capped at limit: what an unbounded cache would resume

    0 ........ P ........ R ........ A ........ M ........................ L tokens
    |  hit     | corrupt, | no       | evicted  | never seen (incl. the partial last block
    |  (tier   | unavail- | snapshot | (from X) |  and the one token always computed)
    |  of each | able or  |          |          |
    |  block)  | evicted  |          |          |

* **hit**, per tier: block i < P counts for the nearest tier that held it (the cache loads
  nearest first);
* R - P, when the open resumed fewer than the lookup promised just before
  (``Node._explain_short``): **corrupt** when a record failed the store's checks (the
  store counted it in ``corrupt`` or, encrypted, ``auth_failures``); **unavailable** when
  a far level timed out, was down or failed; **evicted from X** when a record of the
  difference went between the lookup and the read, and no tier holds it now: the store
  evicted it (for a put of the disk writer, or ``gc``) and the read was a plain miss
  (the cache counts it in ``disk_read_failures``, the store in ``misses``, not
  ``corrupt``), or the open found it gone before reading anything; X is the farthest
  tier it had reached, as below. A failed read is not by itself corruption: the LMDB
  store tells the two apart (a record whose index entry changed under the read is a
  miss). A difference that none of these explains (every record still held, nothing
  failed) is a broken invariant: the replay stops (AssertionError);
* **no snapshot**: A - R: the blocks were there, but no tier held a State snapshot at any
  boundary past R (what every-boundary resume would have added);
* **evicted from X**: M - A: block A had been seen, no tier holds it now; X is the farthest
  tier it had reached (GPU -> host on GPU eviction -> disk, written through at seal ->
  shared, uploaded behind), so X's eviction is what lost it;
* **never seen**: L - M blocks' tokens: the compulsory misses.

In a fleet the shared level is written by the other nodes while a node serves, so an
upload can land between the lookup and the open and the open resumes more than R: the
node then accounts with R = P (and A, M at least P), the blocks no tier of its own held and
the snapshot counted for the shared level, and ``late_tokens`` says how many tokens that was.

So ``hit + corrupt + unavailable + no_snapshot + evicted + never_seen = L`` exactly (the
evicted tokens of R - P and of M - A are one count per tier); the
trace maximum (an unbounded cache, every boundary resumable) is ``M``, and the
every-boundary hit rate of this run is ``A`` (what the same resident blocks would give if
every boundary had a snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..lookup import Tier

__all__ = ["REASONS", "Tally"]

#: Miss reasons, in report order.
REASONS = ("never_seen", "evicted_gpu", "evicted_host", "evicted_disk", "evicted_shared", "no_snapshot", "corrupt",
           "unavailable")


def _tiers() -> dict[str, int]:
    return {t.label: 0 for t in Tier}


@dataclass
class Tally:
    """Token and byte counts of one node (or a fleet: :meth:`add`)."""

    requests: int = 0
    prompt_tokens: int = 0
    #: tokens served, by the tier that held each block
    hit_tokens: dict[str, int] = field(default_factory=_tiers)
    #: tokens computed, by reason
    miss_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    #: tokens the held prefixes covered (every block boundary resumable)
    resident_tokens: int = 0
    #: tokens an unbounded cache would have served (the trace's maximum for this sequence)
    max_tokens: int = 0
    hit_requests: int = 0
    #: snapshots restored, by the tier they came from
    snapshot_hits: dict[str, int] = field(default_factory=_tiers)
    #: model bytes the hits loaded from each tier (blocks and snapshots)
    loaded_bytes: dict[str, int] = field(default_factory=_tiers)
    prefill_s_without_cache: float = 0.0
    prefill_s: float = 0.0
    load_s: float = 0.0
    verified_blocks: int = 0
    verified_snapshots: int = 0
    verified_requests: int = 0
    #: verified blocks by the tier each was served from
    verified_by_tier: dict[str, int] = field(default_factory=_tiers)
    #: tokens resumed beyond what the lookup just before the open said (a fleet's shared
    #: level only: another node's upload landed in between), and the requests it happened to
    late_tokens: int = 0
    late_requests: int = 0

    @property
    def hits(self) -> int:
        return sum(self.hit_tokens.values())

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.hits

    def rate(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def saved_s(self) -> float:
        """Prefill seconds the cache saved, net of loading the hits (cost model)."""
        return self.prefill_s_without_cache - self.prefill_s - self.load_s

    def check(self) -> None:
        """Raise AssertionError unless the tokens add up (hits + misses = prompt tokens)."""
        total = self.hits + sum(self.miss_tokens.values())
        if total != self.prompt_tokens:
            raise AssertionError(f"tally: hits {self.hits} + misses {sum(self.miss_tokens.values())} != prompt "
                                 f"tokens {self.prompt_tokens}")
        if not self.hits <= self.resident_tokens <= self.max_tokens:
            raise AssertionError(f"tally: expected hits {self.hits} <= every-boundary {self.resident_tokens} <= "
                                 f"maximum {self.max_tokens}")

    def add(self, other: Tally) -> None:
        """Add ``other``'s counts to this one (a fleet's total)."""
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if isinstance(value, dict):
                for k, v in value.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, name, mine + value)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(vars(self))
        d["hits"] = self.hits
        d["hit_rate"] = self.rate(self.hits)
        d["hit_rate_by_tier"] = {k: self.rate(v) for k, v in self.hit_tokens.items()}
        d["every_boundary_hit_rate"] = self.rate(self.resident_tokens)
        d["max_hit_rate"] = self.rate(self.max_tokens)
        d["miss_rate_by_reason"] = {k: self.rate(v) for k, v in self.miss_tokens.items()}
        d["computed_tokens"] = self.computed_tokens
        d["saved_s"] = self.saved_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Tally:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items() if k in names})
