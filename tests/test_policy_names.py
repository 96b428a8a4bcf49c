"""The policy-name parsers' integer arguments: one shared parser (policy/_spec.py), the
error texts each option has always given."""

from __future__ import annotations

import re

import pytest

from tiered_kv.policy import admission_policy, eviction_policy, snapshot_policy


@pytest.mark.parametrize("parse, spec, text", [
    (admission_policy, "hits:x", "admission 'hits:x': expected an integer after ':', got 'x'"),
    (admission_policy, "survived:", "admission 'survived:': expected an integer after ':', got ''"),
    (eviction_policy, "leaf-s3fifo:1.5", "eviction 'leaf-s3fifo:1.5': expected an integer percent after ':', got '1.5'"),
    (snapshot_policy, "interval:eight", "snapshot_policy 'interval:eight': expected an integer after ':', got 'eight'"),
    (snapshot_policy, "branch+interval:x", "snapshot_policy 'branch+interval:x': expected an integer after ':', got 'x'"),
])
def test_a_name_with_no_integer_after_its_colon_says_which_option_and_what(parse, spec, text) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        parse(spec)


@pytest.mark.parametrize("parse, spec, value", [
    (admission_policy, "hits:3", lambda p: p.hits == 3),
    (admission_policy, "survived:64", lambda p: p.hits == 1 and p.survive == 64),
    (eviction_policy, "leaf-s3fifo:60", lambda p: abs(p.small_fraction - 0.6) < 1e-9),
    (snapshot_policy, "interval:16", lambda p: p == snapshot_policy("interval:16")),
])
def test_the_integer_is_taken(parse, spec, value) -> None:
    assert value(parse(spec))


@pytest.mark.parametrize("parse, spec, text", [
    (admission_policy, "hits:0", "expected hits:N with N >= 1, got 0"),
    (eviction_policy, "leaf-s3fifo:100", "expected a small-queue percent in 1..99, got 100"),
    (snapshot_policy, "interval:0", "expected an interval >= 1, got 0"),
])
def test_each_parser_keeps_its_own_bounds(parse, spec, text) -> None:
    with pytest.raises(ValueError, match=re.escape(text)):
        parse(spec)
