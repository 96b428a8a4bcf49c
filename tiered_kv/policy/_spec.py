"""What the policy-name parsers share: the integer after a name's colon (``hits:2``,
``leaf-s3fifo:60``, ``interval:8``), with one error text for all three."""

from __future__ import annotations

__all__ = ["_int_after_colon"]


def _int_after_colon(what: str, spec: str, arg: str, *, noun: str = "an integer") -> int:
    """``int(arg)``, the part of policy name ``spec`` after its ``:``; a ValueError that
    names ``what`` (the option: ``admission``, ``eviction``, ``snapshot_policy``) and
    ``spec`` when it is not one (``noun``: what was expected, e.g. "an integer percent").
    Range checks stay with each parser: their bounds differ."""
    try:
        return int(arg)
    except ValueError:
        raise ValueError(f"{what} {spec!r}: expected {noun} after ':', got {arg!r}") from None
