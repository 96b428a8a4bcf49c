"""Capacity planning: how many bytes one request of a layout needs, and how many fit.

Pure functions over a :class:`~tiered_kv.layout.KVLayout`; no torch, no allocation. The
``tiered-kv plan`` command prints a :class:`Plan`.

What one request holds on the GPU without offload (ARCHITECTURE §2)::

    bytes_per_request = classical_bytes            ceil(context / block_tokens) blocks
                                                   x block_bytes (csa_kv + indexer + hca_kv)
                      + state_bytes                one State slot (SWA ring + tails)
    max_requests      = floor(hbm_bytes / bytes_per_request)

``hbm_bytes`` is the GPU memory given to the KV cache (weights and activations already
taken off). ``snapshot_bytes`` is what each resume point costs in the host and disk tiers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .layout import KVLayout

__all__ = ["ClassicalParts", "GiB", "Plan", "build_plan", "format_bytes", "parse_size", "plan"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_MULTIPLIERS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": TiB}
#: ``<digits>[ ][k|K|M|G|T][iB]`` or ``<digits>[ ]B``; ``_`` may group digits.
_SIZE_RE = re.compile(r"(?P<num>\d+(?:_\d+)*)\s*(?:(?P<unit>[kKmMgGtT])(?P<ib>iB)?|(?P<b>B))?", re.ASCII)


def parse_size(value: str | int) -> int:
    """Parse a size with an optional binary suffix.

    ``"1048576"``, ``"1024K"``, ``"1M"``, ``"1MiB"`` and ``1048576`` all give 1048576.
    Suffixes are binary (k = K = 1024, M = 1024**2, G = 1024**3, T = 1024**4); ``KiB``,
    ``MiB``, ``GiB``, ``TiB`` and a bare ``B`` are accepted for byte counts. Decimal
    ``MB``/``GB``, fractions and negative values raise :class:`ValueError`.
    """
    if isinstance(value, bool):
        raise ValueError(f"size: expected an int or a string like '1M', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size: expected a non-negative int, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"size: expected an int or a string like '1M', got {type(value).__name__}")
    m = _SIZE_RE.fullmatch(value.strip())
    if m is None:
        raise ValueError(
            f"size: expected a non-negative integer with an optional binary suffix "
            f"(k, K, M, G, T or KiB, MiB, GiB, TiB), e.g. '1M' or '131072', got {value!r}"
        )
    unit = (m.group("unit") or "").lower()
    return int(m.group("num")) * _MULTIPLIERS[unit]


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit not above it, two decimals: ``"3.76 GiB"``."""
    if n < KiB:
        return f"{n} B"
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    raise AssertionError("unreachable")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClassicalParts:
    """Bytes of a request's Classical blocks, per part of a block (all layers)."""

    csa_kv: int
    indexer: int
    hca_kv: int

    @property
    def total(self) -> int:
        return self.csa_kv + self.indexer + self.hca_kv

    def to_dict(self) -> dict[str, int]:
        return {"csa_kv": self.csa_kv, "indexer": self.indexer, "hca_kv": self.hca_kv}


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The memory plan of one layout at one context length.

    Fields are inputs or exact byte counts; the totals are derived properties, so a plan
    cannot disagree with itself. :meth:`to_dict` is the ``--json`` form: every field and
    property, in table order. (Offload modes add optional sections; a plan without them
    keeps the same keys.)
    """

    model: str
    layout_fingerprint: str
    entry_format: str
    entry_bytes: int
    indexer_bytes: int
    num_layers: int
    num_csa_layers: int
    num_hca_layers: int
    context_tokens: int
    block_tokens: int
    num_blocks: int
    block_bytes: int
    classical_parts: ClassicalParts
    state_bytes: int
    snapshot_bytes: int
    hbm_bytes: int

    @property
    def classical_bytes(self) -> int:
        """Bytes of the Classical blocks of one request: ``num_blocks * block_bytes``."""
        return self.classical_parts.total

    @property
    def bytes_per_request(self) -> int:
        """GPU bytes of one request without offload: Classical blocks + one State slot."""
        return self.classical_bytes + self.state_bytes

    @property
    def max_requests(self) -> int:
        """Requests of ``context_tokens`` tokens whose KV fits in ``hbm_bytes``."""
        return self.hbm_bytes // self.bytes_per_request

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layout_fingerprint": self.layout_fingerprint,
            "entry_format": self.entry_format,
            "entry_bytes": self.entry_bytes,
            "indexer_bytes": self.indexer_bytes,
            "num_layers": self.num_layers,
            "num_csa_layers": self.num_csa_layers,
            "num_hca_layers": self.num_hca_layers,
            "context_tokens": self.context_tokens,
            "block_tokens": self.block_tokens,
            "num_blocks": self.num_blocks,
            "block_bytes": self.block_bytes,
            "classical_bytes": self.classical_bytes,
            "classical_bytes_by_part": self.classical_parts.to_dict(),
            "state_bytes": self.state_bytes,
            "snapshot_bytes": self.snapshot_bytes,
            "bytes_per_request": self.bytes_per_request,
            "hbm_bytes": self.hbm_bytes,
            "max_requests": self.max_requests,
        }


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return value


def build_plan(layout: KVLayout, context_tokens: int, *, hbm_bytes: int) -> Plan:
    """The memory plan of one request of ``context_tokens`` tokens under ``layout``.

    ``hbm_bytes`` is the GPU memory available to the KV cache; ``Plan.max_requests`` is
    how many such requests it holds without offload.
    """
    if not isinstance(layout, KVLayout):
        raise TypeError(f"layout: expected a KVLayout, got {type(layout).__name__}")
    context_tokens = _non_negative_int("context_tokens", context_tokens)
    hbm_bytes = _non_negative_int("hbm_bytes", hbm_bytes)
    parts = layout.classical_bytes_by_part(context_tokens)
    return Plan(
        model=layout.name,
        layout_fingerprint=layout.fingerprint,
        entry_format=layout.entry_format.value,
        entry_bytes=layout.entry_bytes,
        indexer_bytes=layout.indexer_bytes,
        num_layers=layout.num_layers,
        num_csa_layers=layout.num_csa_layers,
        num_hca_layers=layout.num_hca_layers,
        context_tokens=context_tokens,
        block_tokens=layout.block_tokens,
        num_blocks=layout.num_blocks_for(context_tokens),
        block_bytes=layout.block_bytes,
        classical_parts=ClassicalParts(**parts),
        state_bytes=layout.state_bytes,
        snapshot_bytes=layout.snapshot_bytes,
        hbm_bytes=hbm_bytes,
    )


def plan(layout: KVLayout, context_tokens: int, *, hbm_bytes: int) -> dict[str, Any]:
    """:func:`build_plan` as a plain JSON-able dict (:meth:`Plan.to_dict`)."""
    return build_plan(layout, context_tokens, hbm_bytes=hbm_bytes).to_dict()
