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
