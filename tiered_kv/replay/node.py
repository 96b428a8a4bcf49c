"""One node of a replay: a real :class:`~tiered_kv.cache.TieredKVCache` served trace requests.

Per request (``bt`` = block_tokens)::

    tokens  = TokenMaker.prompt(i, request)            deterministic from the hash ids
    hashes  = cache.hasher.block_hashes(full blocks)   the cache's own prefix hashes
    look    = lookup(hashes)                           per-tier answer, nothing loaded
    req     = cache.open(tokens)                       the real prefix match and loads
    verify  (a sample)                                 resumed blocks + State read back
    cache.reserve(req, rest); write_csa / write_hca    synthetic entries of new blocks
    per block: write the State expected at its end, cache.advance(block's tokens)
                                                       seals, writes through to disk, and
                                                       snapshots by the cache's own policy
    cache.close(req)

and the request's tokens are attributed to tiers and miss reasons (:mod:`.tally`). The
cache runs the stand-in layout (:mod:`.standin`); byte figures are reported in the
model's bytes (stand-in bytes x scale).
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..lookup import ResumeIndex, ResumeLookup, Tier
from .config import ReplayConfig, TierPlan, plan_tiers
from .stranded import stranded
from .synth import SyntheticKV
from .tally import Tally
from .tokens import TokenMaker
from .trace import Trace, TraceRequest

__all__ = ["Node", "NodeResult", "Served", "fast_gil_switch", "shared_url_for"]

#: Counters of cache.stats() that explain a resume shorter than the lookup's (see
#: :meth:`Node._explain_short`). A record that failed the store's checks: corrupt (the
#: store unindexed it) or, encrypted, its tag did not verify.
_CORRUPT_COUNTERS = ("store_corrupt", "store_auth_failures")
#: a chain's far level timed out, was down or failed
_UNAVAILABLE_COUNTERS = ("store_timeouts", "store_level_unavailable", "store_level_errors")
#: a resume's read from the store failed, for any reason: one of the above, or a plain miss
#: (the record was gone: the store evicted it after the lookup, e.g. for a writer's put)
_READ_FAILURES = ("disk_read_failures",)


@dataclass(frozen=True, slots=True)
class Served:
    """One request's outcome on a node (tokens)."""

    index: int
    prompt_tokens: int
    hit_tokens: int
    resumable_tokens: int


@dataclass
class NodeResult:
    """What one node's replay measured."""

    name: str
    tally: Tally
    plan: TierPlan
    #: model bytes resident at the end: tier -> {"blocks": n, "snapshots": n} (bytes)
    resident: dict[str, dict[str, int]]
    #: model bytes moved between tiers: "gpu->host" ... -> {"blocks": bytes, "snapshots": bytes}
    moved: dict[str, dict[str, int]]
    #: model bytes resident but of no use to any resume, per tier (:mod:`.stranded`):
    #: {"unreachable": .., "no_snapshot": .., "unknown": .., "snapshots_unreachable": ..}
    stranded: dict[str, dict[str, int]]
    #: the cache's counters at the end (stand-in units)
    stats: dict[str, Any]
    wall_s: float
    #: the last failed write to the node's store (its count: ``stats["disk_write_errors"]``)
    last_write_error: str | None = None


#: GIL switch interval while a replay runs: the request loop and the disk writer thread
#: trade the GIL every 0.5 ms instead of 5 ms (measured: ~17 % less wall time for a
#: replay with a disk tier on this 2-core machine)
SWITCH_INTERVAL_S = 0.0005


@contextlib.contextmanager
def fast_gil_switch() -> Iterator[None]:
    """Lower ``sys.setswitchinterval`` to :data:`SWITCH_INTERVAL_S` for a block; restore it."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL_S))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def shared_url_for(url: str, run: str) -> str:
    """``url`` with ``run`` appended to its bucket prefix (before any ``?query``)."""
    base, sep, query = url.partition("?")
    return f"{base.rstrip('/')}/{run}{sep}{query}"


class Node:
    """A cache with the tiers of ``config``, serving requests of a ``block_tokens`` trace."""

    def __init__(self, config: ReplayConfig, block_tokens: int, *, name: str = "node", run_id: str | None = None,
                 shared_url: str | None = None) -> None:
        from .. import TieredKVCache

        self.config = config
        self.name = name
        self.plan = plan_tiers(config, block_tokens)
        self.bt = block_tokens
        L = self.plan.standin.layout
        self._tmp: Path | None = None
        store, options = self._store_spec(config, shared_url, run_id or uuid.uuid4().hex[:12])
        policy = {**config.snapshot().cache_options, **config.eviction().cache_options,
                  **config.admission().cache_options}
        self.cache = TieredKVCache(L, num_blocks=self.plan.gpu_blocks, num_state_slots=1,
                                   num_snapshots=self.plan.gpu_snapshots, host_bytes=self.plan.host_bytes,
                                   host_snapshot_fraction=config.snapshot_fraction, store=store,
                                   store_options=options, salt=config.salt, disk_max_pending=config.disk_queue,
                                   **policy)
        from ..storage import StoreChain

        store_obj = self.cache.disk.store if self.cache.disk is not None else None
        self._chain = store_obj if isinstance(store_obj, StoreChain) else None
        self.index = ResumeIndex.of_cache(self.cache, store_tier=Tier.DISK if config.disk is not None else Tier.SHARED)
        self.synth = SyntheticKV(L)
        self.tokens = TokenMaker(block_tokens)
        self.tally = Tally()
        #: every block this node sealed or resumed -> its parent's hash (None at the root)
        self._parent: dict[bytes, bytes | None] = {}
        self._deepest = max(self.index.tiers)
        self._reached_host: set[bytes] | None = None
        #: blocks whose write to the node's store failed (a full disk): they never reached it
        self._disk_failed: set[bytes] = set()
        self._snapshot_offloads = 0
        self._hook_evictions()
        self._failures = self._failure_counts()
        self._verified_tiers: set[str] = set()
        self._pending: tuple[int, list[int], list[bytes], ResumeLookup] | None = None
        self._t0 = time.perf_counter()

    # ------------------------------------------------------------------ set-up
    def _store_spec(self, config: ReplayConfig, shared_url: str | None, run_id: str) -> tuple[Any, dict | None]:
        shared = shared_url if shared_url is not None else config.shared_url
        far = None if shared is None else (shared if shared_url is not None
                                           else shared_url_for(shared, f"replay-{run_id}"))
        if config.disk is None:  # (None: no store) a node writing straight to the shared level
            return far, None if far is None else {"timeout_s": config.shared_timeout_s}
        url = config.disk_url
        if url is None:
            self._tmp = Path(tempfile.mkdtemp(prefix=f"tkv-replay-{self.name}-", dir=config.workdir))
            url = f"lmdb://{self._tmp / 'disk'}"
        disk_options = {"max_bytes": self.plan.disk_max_bytes}
        if far is None:
            return url, disk_options
        return [url, far], {"level_options": [disk_options, {}], "timeout_s": config.shared_timeout_s,
                            **config.chain_options}

    def _hook_evictions(self) -> None:
        """Learn what moves down the tiers, to tell which tier lost a block: the pools'
        ``on_evict`` and the disk tier's ``on_write_failed`` are public hooks."""
        cache = self.cache
        if cache.disk is not None:
            from ..storage import RecordKind

            failed = self._disk_failed

            def write_failed(key: Any) -> None:  # (the writer thread; a set's add is atomic)
                if key.kind is RecordKind.BLOCK:
                    failed.add(key.block_hash)

            cache.disk.on_write_failed = write_failed
        host = cache.host
        if host is None:
            return
        self._reached_host = reached = set()
        on_block = cache.blocks.on_evict
        held = host.blocks.cached

        def block_evicted(b: int, h: bytes) -> None:
            on_block(b, h)  # type: ignore[misc]
            if h in held:
                reached.add(h)

        cache.blocks.on_evict = block_evicted
        on_snap = cache.snapshots.ids.on_evict
        snaps = host.snapshots.cached if host.snapshots is not None else {}

        def snapshot_evicted(sid: int, h: bytes) -> None:
            before = h in snaps
            on_snap(sid, h)  # type: ignore[misc]
            if not before and h in snaps:
                self._snapshot_offloads += 1

        cache.snapshots.ids.on_evict = snapshot_evicted

    def check_trace(self, trace: Trace) -> None:
        """ValueError when the GPU pool cannot hold the trace's longest prompt."""
        longest = max(r.input_length for r in trace)
        need = -(-longest // self.bt)
        if need > self.plan.gpu_blocks:
            raise ValueError(f"hbm: {self.config.hbm.describe()} holds {self.plan.gpu_blocks} blocks; the trace's "
                             f"longest prompt ({longest:,} tokens) needs {need} at once: give a larger --hbm")

    # ------------------------------------------------------------------ serving
    @property
    def local_tier(self) -> Tier:
        """The farthest tier of this node's own (not the shared level)."""
        return max(t for t in self.index.tiers if t is not Tier.SHARED)

    def prepare(self, index: int, request: TraceRequest, *, upto: Tier | None = None) -> ResumeLookup:
        """Make request ``index``'s tokens and hashes and look it up (what a router asks;
        ``upto``: only the tiers up to this one)."""
        if self._chain is not None:  # far hits of the last open being promoted into level 0: let them land,
            self._chain.flush()  # so the lookup sees the tiers the open will (promotions only, not uploads)
        if self.config.sync_disk and self.cache.disk is not None:
            self.cache.disk.flush()  # every write queued so far lands first: figures independent of its timing
        arr = self.tokens.prompt_array(index, request)
        full = arr.size // self.bt
        hashes = self.cache.hasher.block_hashes(arr[:full * self.bt])
        look = self.index.lookup(hashes, num_tokens=int(arr.size), upto=upto)
        self._pending = (index, arr.tolist(), hashes, look)
        return look

    def serve(self, index: int, request: TraceRequest) -> Served:
        """Serve request ``index`` through the cache and account for its tokens."""
        if self._pending is None or self._pending[0] != index:
            self.prepare(index, request)
        assert self._pending is not None
        _, tokens, hashes, look = self._pending
        self._pending = None
        if look.tiers != self.index.tiers:  # a router's partial lookup: the whole one accounts
            look = self.index.lookup(hashes, num_tokens=len(tokens))
        cache, bt = self.cache, self.bt
        n = len(tokens)
        limit = look.limit_blocks
        predicted = look.blocks()
        held = min(look.resident_blocks[look.tiers[-1]], limit)
        seen, parent = 0, self._parent
        while seen < limit and hashes[seen] in parent:
            seen += 1
        seen = max(seen, held)
        req = cache.open(tokens)
        P = req.num_cached_tokens // bt
        t = self.tally
        short, said = predicted - P, predicted
        late = short < 0
        if late:
            if Tier.SHARED not in self.index.tiers:
                raise AssertionError(f"{self.name} request {index}: open resumed {P} blocks, the lookup said "
                                     f"{predicted}")
            # other nodes write the shared level as this one serves: an upload landed between
            # the lookup and the open (tally.py); account for what the open resumed
            t.late_tokens += (P - predicted) * bt
            t.late_requests += 1
            predicted = P
            held = max(held, P)
            seen = max(seen, held)
        elif short:
            t.miss_tokens[self._explain_short(index, P, predicted, look, hashes)] += short * bt
        tiers = _block_tiers(look, P)
        if P and self._should_verify(tiers):
            self._verify(req, hashes[:P], tiers)
        cache.reserve(req, n - P * bt)
        full = len(hashes)
        self.synth.write_blocks(cache, req, P, hashes[P:full])
        write_state, advance = self.synth.write_state, cache.advance
        for k in range(P, -(-n // bt)):
            if k < full:
                write_state(cache, req, hashes[k])
            advance(req, tokens[k * bt:(k + 1) * bt])
        cache.close(req)
        for i in range(seen, len(hashes)):  # (those before seen are known)
            parent.setdefault(hashes[i], hashes[i - 1] if i else None)
        self._account(look, n, P, predicted, held, seen, hashes, tiers, late)
        return Served(index=index, prompt_tokens=n, hit_tokens=P * bt, resumable_tokens=said * bt)

    def run(self, requests: Iterable[tuple[int, TraceRequest]],
            progress: Callable[[int], None] | None = None) -> None:
        for i, (index, request) in enumerate(requests, 1):
            self.serve(index, request)
            if progress is not None:
                progress(i)

    # ------------------------------------------------------------------ accounting
    def _account(self, look: ResumeLookup, n: int, P: int, predicted: int, held: int, seen: int,
                 hashes: list[bytes], tiers: tuple[Tier, ...], late: bool) -> None:
        t, bt, cost = self.tally, self.bt, self.config.cost
        model = self.plan.standin.model
        t.requests += 1
        t.prompt_tokens += n
        t.resident_tokens += held * bt
        t.max_tokens += seen * bt
        t.miss_tokens["no_snapshot"] += (held - predicted) * bt
        if seen > held:
            t.miss_tokens[f"evicted_{self._evicted_from(hashes[held]).label}"] += (seen - held) * bt
        t.miss_tokens["never_seen"] += n - seen * bt
        t.prefill_s_without_cache += cost.prefill_s(n)
        t.prefill_s += cost.prefill_s(n - P * bt)
        if not P:
            return
        t.hit_requests += 1
        load = 0.0
        for tier, k in _counts(tiers).items():
            t.hit_tokens[tier.label] += k * bt
            t.loaded_bytes[tier.label] += k * model.block_bytes
            load += cost.load_s(tier, k * model.block_bytes)
        if late:  # what made the longer resume possible landed on the shared level
            snap = Tier.SHARED
        else:
            snap = look.snapshot_tiers[look.tiers[-1]] if P == predicted else Tier.DISK
        assert snap is not None
        t.snapshot_hits[snap.label] += 1
        t.loaded_bytes[snap.label] += model.snapshot_bytes
        t.load_s += load + cost.load_s(snap, model.snapshot_bytes)

    def _evicted_from(self, h: bytes) -> Tier:
        """The farthest tier block ``h`` had reached (all of them pass the GPU; with a disk
        every sealed block is written through, unless that write failed or the admission
        filter has not let it through, and uploaded to a shared level behind it)."""
        adm = self.cache.disk.admission if self.cache.disk is not None else None
        if (self._deepest >= Tier.DISK and h not in self._disk_failed
                and (adm is None or adm.policy.write_through or adm.known_on_disk("block", h))):
            return self._deepest
        if self._reached_host is not None and h in self._reached_host:
            return Tier.HOST
        return Tier.GPU

    def _failure_counts(self) -> dict[str, int]:
        stats = self.cache.stats()
        return {k: int(stats.get(k) or 0) for k in (*_CORRUPT_COUNTERS, *_UNAVAILABLE_COUNTERS, *_READ_FAILURES)}

    def _explain_short(self, index: int, got: int, predicted: int, look: ResumeLookup, hashes: list[bytes]) -> str:
        """Why the open resumed ``got`` blocks where the lookup said ``predicted``, from the
        counters that moved since the last time and the records now held:

        * ``corrupt``: a record failed the store's checks (``store_corrupt``,
          ``store_auth_failures``);
        * ``unavailable``: a far level timed out, was down or failed;
        * ``evicted_X``: a record of the shortfall (a block in ``[got, predicted)``, else the
          snapshot at ``predicted``) is held by no tier now: X, the farthest tier it had
          reached (:meth:`_evicted_from`), lost it between the lookup and the read. The
          store evicted it (the read failed as a plain miss, which the cache counts in
          ``disk_read_failures`` and the store in ``misses``, not ``corrupt``), or before
          the open asked for it (nothing was read: no counter moved), or the open's own
          allocations evicted a memory copy the disk did not hold;
        * a read failure with nothing lost (the record was evicted, then written again
          since): evicted from the store's tier.

        Anything else is a broken invariant: AssertionError."""
        now = self._failure_counts()
        moved = {k for k in now if now[k] > self._failures[k]}
        self._failures = now
        if moved & set(_CORRUPT_COUNTERS):
            return "corrupt"
        if moved & set(_UNAVAILABLE_COUNTERS):
            return "unavailable"
        lost = self._lost_tier(look, hashes, got, predicted)
        if lost is not None:
            return f"evicted_{lost.label}"
        if moved & set(_READ_FAILURES):
            return f"evicted_{self._deepest.label}"
        raise AssertionError(f"{self.name} request {index}: open resumed {got} blocks, the lookup said {predicted}, "
                             f"no read failed and every record of the difference is still held")

    def _lost_tier(self, look: ResumeLookup, hashes: list[bytes], got: int, predicted: int) -> Tier | None:
        """The tier that lost the first record of the shortfall no tier holds now: a block
        of ``hashes[got:predicted]``, else the snapshot at ``predicted``; None when every
        one is still held."""
        for h in hashes[got:predicted]:
            if not self._holds("block", h):
                return self._evicted_from(h)
        h = hashes[predicted - 1]
        if self._holds("snapshot", h):
            return None
        adm = self.cache.disk.admission if self.cache.disk is not None else None
        if self._deepest >= Tier.DISK and (adm is None or adm.policy.write_through
                                           or adm.known_on_disk("snapshot", h)):
            return self._deepest
        near = look.snapshot_tiers[look.tiers[-1]]
        return Tier.GPU if near is None else near

    def _holds(self, kind: str, h: bytes) -> bool:
        """Some tier of this node holds record ``h`` of ``kind`` now (a memory pool, or the store)."""
        c = self.cache
        if kind == "block":
            pools = [c.blocks] + ([c.host.blocks] if c.host is not None else [])
        else:
            pools = [c.snapshots.ids] + ([c.host.snapshots] if c.host is not None and c.host.snapshots is not None
                                         else [])
        if any(p.lookup(h) is not None for p in pools):
            return True
        if c.disk is None:
            return False
        from ..storage import RecordKey

        key = RecordKey.block(h) if kind == "block" else RecordKey.snapshot(h)
        return bool(c.disk.contains_many([key])[0])

    # ------------------------------------------------------------------ verification
    def _should_verify(self, tiers: tuple[Tier, ...]) -> bool:
        every = self.config.verify_every
        if not every:
            return False
        labels = {t.label for t in tiers}
        return (self.tally.hit_requests % every == 0) or not labels <= self._verified_tiers

    def _verify(self, req: Any, hashes: list[bytes], tiers: tuple[Tier, ...]) -> None:
        got = self.synth.verify(self.cache, req, hashes)
        if got.bad_blocks or got.bad_snapshots:
            raise AssertionError(f"{self.name}: wrong bytes served: {got.bad_blocks} of {got.blocks} blocks and "
                                 f"{got.bad_snapshots} snapshot(s) differ from what was written")
        t = self.tally
        t.verified_requests += 1
        t.verified_blocks += got.blocks
        t.verified_snapshots += got.snapshots
        for tier, k in _counts(tiers).items():
            t.verified_by_tier[tier.label] += k
            self._verified_tiers.add(tier.label)

    # ------------------------------------------------------------------ the end
    def finish(self, *, uploads_timeout_s: float = 600.0) -> NodeResult:
        """Flush (uploads to a shared level too), count what each tier holds, tell what moved."""
        self.cache.flush(uploads=self.config.shared_url is not None, timeout_s=uploads_timeout_s)
        self.tally.check()
        stats = self.cache.stats()
        blocks, snaps = self._held()
        model = self.plan.standin.model
        B, S = model.block_bytes, model.snapshot_bytes
        resident = {t: {"blocks": len(blocks[t]) * B, "snapshots": len(snaps[t]) * S} for t in blocks}
        lost = {t: {k: v * (S if k.startswith("snapshots") else B) for k, v in counts.items()}
                for t, counts in stranded(self._parent, blocks, snaps).items()}
        return NodeResult(name=self.name, tally=self.tally, plan=self.plan, resident=resident,
                          moved=self._moved(stats), stranded=lost,
                          last_write_error=None if self.cache.disk is None else self.cache.disk.last_write_error,
                          stats={k: v for k, v in stats.items() if isinstance(v, (int, float))},
                          wall_s=time.perf_counter() - self._t0)

    def _held(self) -> tuple[dict[str, set[bytes]], dict[str, set[bytes]]]:
        """The block and snapshot hashes each tier holds now: tier -> set."""
        c = self.cache
        blocks = {"gpu": set(c.blocks.cached)}
        snaps = {"gpu": set(c.snapshots.ids.cached)}
        if c.host is not None:
            blocks["host"] = set(c.host.blocks.cached)
            snaps["host"] = set(c.host.snapshots.cached) if c.host.snapshots is not None else set()
        if c.disk is not None:
            from ..storage import RecordKind, StoreChain

            store = c.disk.store
            levels = store.levels() if isinstance(store, StoreChain) else [store]
            names = ("disk", "shared") if self.config.disk is not None else ("shared",)
            for name, level in zip(names, levels):
                if level is None:
                    continue
                keys = list(level)
                blocks[name] = {k.block_hash for k in keys if k.kind is RecordKind.BLOCK}
                snaps[name] = {k.block_hash for k in keys if k.kind is RecordKind.SNAPSHOT}
        return blocks, snaps

    def _moved(self, s: dict[str, Any]) -> dict[str, dict[str, int]]:
        model, L = self.plan.standin.model, self.plan.standin.layout
        B, S = model.block_bytes, model.snapshot_bytes
        out: dict[str, dict[str, int]] = {}
        if self.cache.host is not None:
            out["gpu->host"] = {"blocks": s["blocks_offloaded"] * B, "snapshots": self._snapshot_offloads * S}
            out["host->gpu"] = {"blocks": s["blocks_from_host"] * B, "snapshots": s["snapshots_from_host"] * S}
        if self.cache.disk is not None:
            # writes are counted together: solve for the two kinds from count and bytes
            n, nbytes = s["disk_writes"], s["disk_write_bytes"]
            snaps = (nbytes - n * L.block_bytes) // (L.snapshot_bytes - L.block_bytes)
            store = "disk" if self.config.disk is not None else "shared"
            out[f"gpu->{store}"] = {"blocks": (n - snaps) * B, "snapshots": snaps * S}
            out[f"{store}->memory"] = {"blocks": s["blocks_from_disk"] * B, "snapshots": s["snapshots_from_disk"] * S}
            if "store_uploads" in s:
                out["disk->shared"] = {"records": int(s["store_uploads"])}
                out["shared->disk"] = {"records": int(s.get("store_far_hits", 0))}
        return out

    def close(self) -> None:
        """Shut the cache down and remove a disk store this node made."""
        try:
            self.cache.shutdown()
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _block_tiers(look: ResumeLookup, P: int) -> tuple[Tier, ...]:
    """The tier each of the ``P`` resumed blocks came from: the lookup's, and the shared
    level for blocks past its held prefix (they landed there after it: a fleet's race)."""
    tiers = look.block_tiers[:P]
    return tiers + (Tier.SHARED,) * (P - len(tiers))


def _counts(tiers: tuple[Tier, ...]) -> dict[Tier, int]:
    out: dict[Tier, int] = {}
    for t in tiers:
        out[t] = out.get(t, 0) + 1
    return out
