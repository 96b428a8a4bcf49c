"""cache.metrics(): per-tier counters and the Prometheus text format."""

from __future__ import annotations

import re
from pathlib import Path

from tiered_kv import TieredKVCache
from tiered_kv.hisparse import HiSparseConfig

from _util import random_tokens

LINE = re.compile(r'^[a-z_]+(\{([a-z_]+="[^"]*",?)*\})? -?[0-9.e+-]+$')


def test_metrics_cover_every_tier_and_render_as_prometheus(tmp_path: Path, tiny_layout, tiny_model) -> None:
    tokens = random_tokens(300, seed=41)
    with TieredKVCache(tiny_layout, num_blocks=8, num_state_slots=1, host_bytes=1 << 20,
                       hisparse=HiSparseConfig(device_buffer_entries=16), store=f"lmdb://{tmp_path / 's'}") as cache:
        for _ in range(2):
            req = cache.open(tokens)
            tiny_model.forward(cache, req, tokens[req.num_cached_tokens:])
            cache.close(req)
        cache.flush()
        m = cache.metrics()
        text = m.to_prometheus()
    assert m.get("tiered_kv_requests_total", event="opened") == 2
    assert m.get("tiered_kv_tokens_total", kind="cached") == 256
    assert m.get("tiered_kv_hits_total", tier="gpu", kind="block") == 2
    assert m.get("tiered_kv_bytes", tier="gpu") > 0 and m.get("tiered_kv_bytes", tier="host") > 0
    assert m.get("tiered_kv_bytes", tier="disk") > 0
    assert m.get("tiered_kv_bytes_moved_total", direction="disk_write") > 0
    assert m.get("tiered_kv_live_requests") == 0
    assert m.get("tiered_kv_misses_total", tier="hisparse_buffer", kind="csa_entry") > 0
    families = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            assert kind in ("counter", "gauge")
            families.add(name)
        elif not line.startswith("# HELP"):
            assert LINE.match(line), line
    assert {"tiered_kv_bytes", "tiered_kv_hits_total", "tiered_kv_evictions_total"} <= families
    assert 'tiered_kv_bytes{tier="disk"}' in m.as_dict()


def test_metrics_module_imports_no_cache_module() -> None:
    """metrics.py renders what the cache hands it (stats + TierGauges): it imports no
    module of the cache, so cache.py -> metrics.py is the only direction (no cycle, not
    even under TYPE_CHECKING)."""
    import ast

    import tiered_kv.metrics

    tree = ast.parse(Path(tiered_kv.metrics.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "collections.abc", "dataclasses"}, imported


def test_policy_counters_in_metrics_and_prometheus(tiny_layout) -> None:
    """Misses by reason, snapshot bytes per tier, stranding evictions and where snapshots
    were published (issue 22 item 4), on a branch that a third prompt resumes."""
    from tiered_kv import TieredKVCache
    from _util import random_tokens

    L, bt = tiny_layout, tiny_layout.block_tokens
    cache = TieredKVCache(L, num_blocks=32, num_state_slots=1, num_snapshots=8, snapshot_policy="branch",
                          eviction="leaf-lru", host_bytes=8 * L.block_bytes + 4 * L.snapshot_bytes)

    def serve(t: list[int]) -> None:
        r = cache.open(t)
        cache.reserve(r, len(t) - r.num_cached_tokens)
        p = r.num_cached_tokens
        while p < len(t):
            n = min(bt - p % bt, len(t) - p)
            cache.advance(r, t[p:p + n])
            p += n
        cache.close(r)

    base = random_tokens(6 * bt + 10, seed=1)
    serve(base)                                                # 6 blocks not cached, 10 tail tokens
    serve(base[:3 * bt] + random_tokens(3 * bt + 5, seed=2))   # 3 held but no snapshot, 3 not cached, 5
    serve(base[:3 * bt] + random_tokens(2 * bt + 7, seed=3))   # resumes 3 at the branch; 2 not cached, 7
    m = cache.metrics()
    assert m.get("tiered_kv_miss_tokens_total", reason="no_snapshot") == 3 * bt
    assert m.get("tiered_kv_miss_tokens_total", reason="not_cached") == 11 * bt
    assert m.get("tiered_kv_miss_tokens_total", reason="tail") == 22
    assert m.get("tiered_kv_snapshots_published_total", where="branch") == 1
    assert m.get("tiered_kv_snapshot_bytes", tier="gpu") == cache.snapshots.ids.num_cached * L.snapshot_bytes
    assert m.get("tiered_kv_snapshot_bytes", tier="host") == 0
    assert m.get("tiered_kv_stranding_evictions_total", tier="gpu") == 0
    text = m.to_prometheus()
    assert 'tiered_kv_miss_tokens_total{reason="no_snapshot"} 384' in text
    assert "# TYPE tiered_kv_stranding_evictions_total counter" in text
