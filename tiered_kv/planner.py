"""Capacity planning: how many bytes one request of a layout needs, and how many fit.

Pure functions over a :class:`~tiered_kv.layout.KVLayout`; no torch, no allocation. The
``tiered-kv plan`` command prints a :class:`Plan`.

What one request holds on the GPU without offload (docs/architecture.md §2)::

    bytes_per_request = classical_bytes            ceil(context / block_tokens) blocks
                                                   x block_bytes (csa_kv + indexer + hca_kv)
                      + state_bytes                one State slot (SWA ring + tails)
    max_requests      = floor(hbm_bytes / bytes_per_request)

With HiSparse (docs/architecture.md §4; ``hisparse_buffer_entries`` = N CSA slots per request
and CSA layer) the sealed blocks' CSA KV lives in the host mirror; the GPU keeps the
rest of each block, the CSA part of the one open block (the block being filled), the
State slot and the device buffer::

    hbm_bytes_per_request  = classical_bytes - csa_kv           indexer keys + HCA entries
                           + num_csa_layers * E * entry_bytes   the open block's CSA part
                           + state_bytes                        one State slot
                           + num_csa_layers * N * entry_bytes   the device buffer
    max_requests_hisparse  = floor(hbm_bytes / hbm_bytes_per_request)
    host_bytes_per_request = classical_bytes                    the host mirror keeps whole
                                                                block records (all parts)

    (E = csa_entries_per_block = block_tokens / csa_ratio)

Without HiSparse ``hbm_bytes_per_request == bytes_per_request``,
``host_bytes_per_request == 0`` and ``max_requests_hisparse`` is ``None`` (JSON ``null``:
every plan has the same keys).

``hbm_bytes`` is the GPU memory given to the KV cache (weights and activations already
taken off). ``snapshot_bytes`` is what each resume point costs in the host and disk tiers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .layout import KVLayout

__all__ = ["ClassicalParts", "GiB", "HiSparseParts", "Plan", "build_plan", "format_bytes", "parse_size",
           "plan"]

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
class HiSparseParts:
    """GPU bytes of one request's CSA KV with HiSparse, in place of ``ClassicalParts.csa_kv``.

    ``open_block_csa_kv`` is ``[num_csa_layers, E, entry_bytes]`` (the block being filled
    stays on the GPU until it is sealed and mirrored); ``device_buffer`` is
    ``[num_csa_layers, buffer_entries, entry_bytes]``.
    """

    #: N, CSA entry slots per request and CSA layer on the device.
    buffer_entries: int
    open_block_csa_kv: int
    device_buffer: int

    @property
    def total(self) -> int:
        return self.open_block_csa_kv + self.device_buffer

    def to_dict(self) -> dict[str, int]:
        return {"open_block_csa_kv": self.open_block_csa_kv, "device_buffer": self.device_buffer}


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The memory plan of one layout at one context length.

    Fields are inputs or exact byte counts; the totals are derived properties, so a plan
    cannot disagree with itself. :meth:`to_dict` is the ``--json`` form: every field and
    property, in table order. An offload mode is an optional section (``hisparse``); a
    plan without it has the same keys, with ``null`` where a value needs the mode.
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
    #: HiSparse (CSA offload to the host mirror), or None without it.
    hisparse: HiSparseParts | None = None

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

    @property
    def hbm_bytes_per_request(self) -> int:
        """GPU bytes of one request in the planned mode: :attr:`bytes_per_request` without
        HiSparse; with it, the sealed blocks' CSA KV is replaced by the open block's CSA
        part and the device buffer."""
        if self.hisparse is None:
            return self.bytes_per_request
        return self.classical_bytes - self.classical_parts.csa_kv + self.hisparse.total + self.state_bytes

    @property
    def max_requests_hisparse(self) -> int | None:
        """Requests that fit in ``hbm_bytes`` with HiSparse; None without HiSparse."""
        if self.hisparse is None:
            return None
        return self.hbm_bytes // self.hbm_bytes_per_request

    @property
    def host_bytes_per_request(self) -> int:
        """Pinned host bytes of one request: with HiSparse the mirror holds the context's
        whole block records (``classical_bytes``); 0 without."""
        return 0 if self.hisparse is None else self.classical_bytes

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
            "hisparse_buffer_entries": None if self.hisparse is None else self.hisparse.buffer_entries,
            "hisparse_bytes_by_part": None if self.hisparse is None else self.hisparse.to_dict(),
            "hbm_bytes_per_request": self.hbm_bytes_per_request,
            "max_requests_hisparse": self.max_requests_hisparse,
            "host_bytes_per_request": self.host_bytes_per_request,
        }


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return value


def _hisparse_parts(layout: KVLayout, buffer_entries: object) -> HiSparseParts:
    n = buffer_entries
    if isinstance(n, bool) or not isinstance(n, int) or n < layout.top_k:
        raise ValueError(f"hisparse_buffer_entries: expected an int >= top_k = {layout.top_k}, got {n!r}")
    return HiSparseParts(
        buffer_entries=n,
        open_block_csa_kv=layout.csa_kv_block_bytes,
        device_buffer=layout.num_csa_layers * n * layout.entry_bytes,
    )


def build_plan(layout: KVLayout, context_tokens: int, *, hbm_bytes: int,
               hisparse_buffer_entries: int | None = None) -> Plan:
    """The memory plan of one request of ``context_tokens`` tokens under ``layout``.

    ``hbm_bytes`` is the GPU memory available to the KV cache; ``Plan.max_requests`` is
    how many such requests it holds without offload. ``hisparse_buffer_entries`` (N, at
    least the layout's top-k, like :class:`tiered_kv.hisparse.HiSparseConfig`) adds the
    HiSparse section: ``Plan.max_requests_hisparse`` is how many fit with it.
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
        hisparse=None if hisparse_buffer_entries is None else _hisparse_parts(layout, hisparse_buffer_entries),
    )


def plan(layout: KVLayout, context_tokens: int, *, hbm_bytes: int,
         hisparse_buffer_entries: int | None = None) -> dict[str, Any]:
    """:func:`build_plan` as a plain JSON-able dict (:meth:`Plan.to_dict`)."""
    return build_plan(layout, context_tokens, hbm_bytes=hbm_bytes,
                      hisparse_buffer_entries=hisparse_buffer_entries).to_dict()
