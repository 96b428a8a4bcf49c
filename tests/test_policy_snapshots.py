"""Snapshot placement policies (tiered_kv.policy.snapshots): branch points, exactly.

The oracle: a request that resumes from a snapshot published at a branch point gives the
next-token logits of a full recompute, with that snapshot served by each tier in turn
(GPU, host, disk, a shared level behind the disk).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiered_kv import TieredKVCache
from tiered_kv.policy import PromptEnds, SnapshotPolicy, snapshot_policy

from _util import random_tokens, serve_once

TOL = 1e-4



def _paths(bt: int) -> tuple[list[int], list[int], list[int]]:
    """A 6-block path, a prompt leaving it at boundary 3, a third prompt that shares the
    same 3 blocks and then goes its own way."""
    base = random_tokens(6 * bt + 10, seed=1)
    branch = base[:3 * bt] + random_tokens(3 * bt + 5, seed=2)
    third = base[:3 * bt] + random_tokens(2 * bt + 7, seed=3)
    return base, branch, third


def test_names_parse_to_policies() -> None:
    assert snapshot_policy("interval:8") == SnapshotPolicy.intervals(8)
    assert snapshot_policy("branch") == SnapshotPolicy(interval=None, branch_points=True, ends=PromptEnds.LAST)
    assert snapshot_policy("branch+interval:16").interval == 16
    assert snapshot_policy("branch+interval:16").label == "branch+interval:16"
    for bad in ("branch:3", "branch+interval", "interval:0", "lru", "interval:x"):
        with pytest.raises(ValueError, match="snapshot_policy"):
            snapshot_policy(bad)
    with pytest.raises(TypeError):
        snapshot_policy(8)  # type: ignore[arg-type]


def test_prompt_ends_keep_the_boundary_before_only_for_a_prompt_ending_on_one() -> None:
    p = SnapshotPolicy.branch()
    assert p.publish_at_close([5, 6], 6 * 128 + 3, 128) == [6]
    assert p.publish_at_close([5, 6], 6 * 128, 128) == [5, 6]
    assert SnapshotPolicy.intervals(8).publish_at_close([5, 6], 6 * 128 + 3, 128) == [5, 6]


def test_interval_policy_is_unchanged(tiny_layout, tiny_model) -> None:
    bt = tiny_layout.block_tokens
    base, branch, third = _paths(bt)
    cache = TieredKVCache(tiny_layout, num_blocks=32, num_state_slots=1, snapshot_policy="interval:8")  # the original
    for t in (base, branch):
        serve_once(tiny_model, cache, t)
    P, _ = serve_once(tiny_model, cache, third)
    assert P == 0 and cache.stats()["snapshots_branch"] == 0  # no snapshot at boundary 3


def test_branch_point_is_published_and_resumed(tiny_layout, tiny_model) -> None:
    bt = tiny_layout.block_tokens
    base, branch, third = _paths(bt)
    cache = TieredKVCache(tiny_layout, num_blocks=32, num_state_slots=1, num_snapshots=8,
                          snapshot_policy="branch")
    assert serve_once(tiny_model, cache, base)[0] == 0
    s = cache.stats()
    assert s["snapshots_registered"] == 1 and s["snapshots_branch"] == 0  # the prompt's last boundary only
    assert serve_once(tiny_model, cache, branch)[0] == 0  # no snapshot at 3 yet: computes, publishes it passing
    assert cache.stats()["snapshots_branch"] == 1
    P, got = serve_once(tiny_model, cache, third)
    assert P == 3 * bt
    assert (got - tiny_model.naive_logits(third)[P:]).abs().max().item() < TOL
    # a prompt extending the path past its last snapshot leaves it at the path's end
    longer = base + random_tokens(3 * bt, seed=4)
    assert serve_once(tiny_model, cache, longer)[0] == 6 * bt


def _fill(model, cache: TieredKVCache, n: int, bt: int) -> None:
    """Unrelated prompts that push the GPU's blocks and snapshots down to the host."""
    for i in range(n):
        serve_once(model, cache, random_tokens(5 * bt + 1, seed=100 + i))


#: the tier serving the snapshot ("hbm": the GPU tier; a "gpu" id would mark the test as needing CUDA)
TIERS = ["hbm", "host", "disk", "shared"]


@pytest.mark.parametrize("tier", TIERS)
def test_resume_from_a_branch_point_gives_the_full_recompute_logits(tier: str, tmp_path: Path, tiny_layout,
                                                                     tiny_model) -> None:
    bt = tiny_layout.block_tokens
    base, branch, third = _paths(bt)
    naive = tiny_model.naive_logits(third)
    opts: dict = {"snapshot_policy": "branch", "num_state_slots": 1}
    if tier == "host":
        opts.update(num_blocks=8, num_snapshots=2, host_bytes=64 * tiny_layout.block_bytes
                    + 16 * tiny_layout.snapshot_bytes, host_snapshot_fraction=0.5)
    else:
        opts.update(num_blocks=32)
    near, far = f"lmdb://{tmp_path / 'near'}", f"lmdb://{tmp_path / 'far'}"
    if tier == "disk":
        opts["store"] = near
    if tier == "shared":
        opts["store"] = [near, far]
    with TieredKVCache(tiny_layout, **opts) as cache:
        for t in (base, branch):
            serve_once(tiny_model, cache, t)
        assert cache.stats()["snapshots_branch"] == 1
        if tier == "host":
            _fill(tiny_model, cache, 3, bt)
        if tier in ("hbm", "host"):
            before = cache.stats()
            P, got = serve_once(tiny_model, cache, third)
            after = cache.stats()
        else:
            cache.flush(uploads=True, timeout_s=60)
    if tier in ("disk", "shared"):
        if tier == "shared":  # a node with an empty disk of its own, sharing the far level
            opts["store"] = [f"lmdb://{tmp_path / 'near2'}", far]
        with TieredKVCache(tiny_layout, **opts) as cache:
            before = cache.stats()
            P, got = serve_once(tiny_model, cache, third)
            after = cache.stats()
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after if isinstance(after[k], int)}
    assert P == 3 * bt  # resumed exactly at the branch point
    assert (got - naive[P:]).abs().max().item() < TOL
    assert moved["snapshot_hits"] == 1
    served = {"host": moved["snapshots_from_host"], "disk": moved["snapshots_from_disk"]}
    if tier == "hbm":
        assert served == {"host": 0, "disk": 0}
    elif tier == "host":
        assert served == {"host": 1, "disk": 0} and moved["blocks_from_host"] > 0
    else:
        assert served == {"host": 0, "disk": 1} and moved["blocks_from_disk"] == 3
        if tier == "shared":
            assert moved["store_far_hits"] >= 4  # three blocks and the snapshot came from the far level
