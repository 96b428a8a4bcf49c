"""The KV layout of a DeepSeek-V4-style model: what is cached and how many bytes it takes.

A :class:`KVLayout` is a frozen description; every pool, store and planner derives its
sizes from it, and its :attr:`KVLayout.fingerprint` tags every record written to disk so
that data of one layout is never served to another.

Vocabulary (see ``docs/architecture.md`` §1–§3)::

    layer kinds     SWA_ONLY | CSA (4:1 compressed, top-k read) | HCA (128:1, dense read)
    Classical       immutable compressed entries, one block = ``block_tokens`` tokens of
                    *all* layers: per CSA layer ``block_tokens/csa_ratio`` CSA entries and
                    as many indexer keys, per HCA layer ``block_tokens/hca_ratio`` entries
    State           per request: SWA ring (``window`` entries x every layer) and every
                    compressor's fp32 tail (kv rows + score rows)
    snapshot        the State at a resume point (a multiple of ``block_tokens``): the SWA
                    ring and the first half of the CSA / indexer overlap rows

Compressor tails (fp32, per layer, kv and score each)::

    CSA      [2 * csa_ratio, 2 * head_dim]     rows 0..r-1: previous group, r..2r-1: current
    indexer  [2 * csa_ratio, 2 * indexer_dim]  same scheme, for the lightning-indexer keys
    HCA      [hca_ratio, head_dim]             the current, not yet complete group
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import functools
from dataclasses import asdict, dataclass

__all__ = ["EntryFormat", "KVLayout", "LayerKind", "TAIL_BYTES_PER_VALUE"]

#: Compressor tails are kept in fp32.
TAIL_BYTES_PER_VALUE = 4


class LayerKind(enum.Enum):
    """What one attention layer keeps besides its SWA window."""

    SWA_ONLY = "swa_only"
    CSA = "csa"
    HCA = "hca"


class EntryFormat(enum.Enum):
    """Storage format of one compressed (CSA / HCA) or SWA entry of ``head_dim`` values."""

    #: DeepSeek's fp8 MLA cache entry: 448 fp8 + 64 bf16 RoPE values + 7 scale bytes + 1 pad.
    FP8_DS_MLA = "fp8_ds_mla"
    BF16 = "bf16"
    #: Exact fp32 entries; for tests and the reference model.
    FP32 = "fp32"

    def entry_bytes(self, head_dim: int) -> int:
        """Bytes of one entry of ``head_dim`` values in this format."""
        if self is EntryFormat.FP8_DS_MLA:
            if head_dim != 512:
                raise ValueError(f"entry_format fp8_ds_mla: expected head_dim 512, got {head_dim}")
            return 584
        if self is EntryFormat.BF16:
            return 2 * head_dim
        return 4 * head_dim

    @classmethod
    def parse(cls, value: str | EntryFormat) -> EntryFormat:
        """Accept an enum member, its value (``"bf16"``) or the short CLI name ``"fp8"``."""
        if isinstance(value, EntryFormat):
            return value
        aliases = {"fp8": cls.FP8_DS_MLA}
        if value in aliases:
            return aliases[value]
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(["fp8", *(m.value for m in cls)])
            raise ValueError(f"entry_format: expected one of {choices}, got {value!r}") from None


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class KVLayout:
    """Frozen description of a model's KV cache.

    All byte properties are exact; ``classical_bytes(n)`` and friends are what a pool of
    that layout allocates.
    """

    #: A short model name, part of the fingerprint (e.g. ``"deepseek-v4-flash"``).
    name: str
    layer_kinds: tuple[LayerKind, ...]
    entry_format: EntryFormat
    head_dim: int = 512
    #: Dimension of one lightning-indexer key and bytes of one stored key.
    indexer_dim: int = 128
    indexer_bytes: int = 132
    window: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    block_tokens: int = 128
    top_k: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty str, got {self.name!r}")
        if not isinstance(self.layer_kinds, tuple) or not self.layer_kinds:
            raise ValueError(f"layer_kinds: expected a non-empty tuple of LayerKind, got {self.layer_kinds!r}")
        for i, kind in enumerate(self.layer_kinds):
            if not isinstance(kind, LayerKind):
                raise ValueError(f"layer_kinds[{i}]: expected a LayerKind, got {kind!r}")
        if not isinstance(self.entry_format, EntryFormat):
            raise ValueError(f"entry_format: expected an EntryFormat, got {self.entry_format!r}")
        for name in ("head_dim", "indexer_dim", "indexer_bytes", "window", "csa_ratio",
                     "hca_ratio", "block_tokens", "top_k"):
            _positive(name, getattr(self, name))
        self.entry_format.entry_bytes(self.head_dim)  # validates fp8 head_dim
        align = math.lcm(self.csa_ratio, self.hca_ratio)
        if self.block_tokens % align:
            raise ValueError(
                f"block_tokens: expected a multiple of lcm(csa_ratio, hca_ratio) = {align}, "
                f"got {self.block_tokens}"
            )

    # ------------------------------------------------------------------ layers
    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def _layers_of(self, kind: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is kind)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        """Global indices of the CSA layers, in order."""
        return self._layers_of(LayerKind.CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        """Global indices of the HCA layers, in order."""
        return self._layers_of(LayerKind.HCA)

    @property
    def num_csa_layers(self) -> int:
        return len(self.csa_layers)

    @property
    def num_hca_layers(self) -> int:
        return len(self.hca_layers)

    def part_index(self, layer: int) -> int:
        """Index of global ``layer`` among the layers of its kind (its row in a pool part)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")
        kind = self.layer_kinds[layer]
        return self._layers_of(kind).index(layer)

    # ------------------------------------------------------------- entry sizes
    @property
    def entry_bytes(self) -> int:
        """Bytes of one CSA, HCA or SWA entry."""
        return self.entry_format.entry_bytes(self.head_dim)

    @property
    def csa_entries_per_block(self) -> int:
        return self.block_tokens // self.csa_ratio

    @property
    def hca_entries_per_block(self) -> int:
        return self.block_tokens // self.hca_ratio

    # ----------------------------------------------------------- block bytes
    @property
    def csa_kv_block_bytes(self) -> int:
        """Bytes of one block's CSA KV part, all CSA layers."""
        return self.num_csa_layers * self.csa_entries_per_block * self.entry_bytes

    @property
    def indexer_block_bytes(self) -> int:
        """Bytes of one block's indexer-key part, all CSA layers."""
        return self.num_csa_layers * self.csa_entries_per_block * self.indexer_bytes

    @property
    def hca_kv_block_bytes(self) -> int:
        """Bytes of one block's HCA KV part, all HCA layers."""
        return self.num_hca_layers * self.hca_entries_per_block * self.entry_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one Classical block (all parts, all layers)."""
        return self.csa_kv_block_bytes + self.indexer_block_bytes + self.hca_kv_block_bytes

    def num_blocks_for(self, num_tokens: int) -> int:
        """Classical blocks that hold ``num_tokens`` tokens (the last may be partly filled)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: expected >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_tokens)

    def classical_bytes_by_part(self, num_tokens: int) -> dict[str, int]:
        """Bytes of the Classical blocks that hold ``num_tokens`` tokens, per part."""
        n = self.num_blocks_for(num_tokens)
        return {
            "csa_kv": n * self.csa_kv_block_bytes,
            "indexer": n * self.indexer_block_bytes,
            "hca_kv": n * self.hca_kv_block_bytes,
        }

    def classical_bytes(self, num_tokens: int) -> int:
        """Bytes of the Classical blocks that hold ``num_tokens`` tokens."""
        return self.num_blocks_for(num_tokens) * self.block_bytes

    # ------------------------------------------------------------ state bytes
    @property
    def swa_bytes(self) -> int:
        """Bytes of one request's SWA ring: ``[num_layers, window, entry_bytes]``."""
        return self.num_layers * self.window * self.entry_bytes

    @property
    def csa_tail_shape(self) -> tuple[int, int, int]:
        """Per CSA layer: ``[2 (kv, score), 2 * csa_ratio, 2 * head_dim]`` fp32."""
        return (2, 2 * self.csa_ratio, 2 * self.head_dim)

    @property
    def indexer_tail_shape(self) -> tuple[int, int, int]:
        """Per CSA layer: ``[2 (kv, score), 2 * csa_ratio, 2 * indexer_dim]`` fp32."""
        return (2, 2 * self.csa_ratio, 2 * self.indexer_dim)

    @property
    def hca_tail_shape(self) -> tuple[int, int, int]:
        """Per HCA layer: ``[2 (kv, score), hca_ratio, head_dim]`` fp32."""
        return (2, self.hca_ratio, self.head_dim)

    @property
    def tail_bytes(self) -> int:
        """Bytes of every compressor tail of one request."""
        per_csa = math.prod(self.csa_tail_shape) + math.prod(self.indexer_tail_shape)
        per_hca = math.prod(self.hca_tail_shape)
        return TAIL_BYTES_PER_VALUE * (self.num_csa_layers * per_csa + self.num_hca_layers * per_hca)

    @property
    def state_bytes(self) -> int:
        """Bytes of one State slot: SWA ring + every compressor tail."""
        return self.swa_bytes + self.tail_bytes

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the State at a resume point.

        At a multiple of ``block_tokens`` every compressor boundary coincides: HCA tails
        and the current CSA rows are empty, and of the previous CSA / indexer group only
        the first half of each row is ever read again (the overlap). So a snapshot is the
        SWA ring plus ``[2, csa_ratio, head_dim]`` and ``[2, csa_ratio, indexer_dim]`` fp32
        per CSA layer.
        """
        overlap = 2 * self.csa_ratio * (self.head_dim + self.indexer_dim)
        return self.swa_bytes + TAIL_BYTES_PER_VALUE * self.num_csa_layers * overlap

    # ------------------------------------------------------------ fingerprint
    def to_dict(self) -> dict[str, object]:
        """Plain JSON-able description (enums as their values)."""
        d = asdict(self)
        d["layer_kinds"] = [k.value for k in self.layer_kinds]
        d["entry_format"] = self.entry_format.value
        return d

    @property
    def fingerprint(self) -> str:
        """Stable id of this layout: equal in every process, changes when any field changes."""
        return _fingerprint(self)


@functools.lru_cache(maxsize=256)
def _fingerprint(layout: KVLayout) -> str:
    blob = json.dumps({"v": 1, **layout.to_dict()}, sort_keys=True, separators=(",", ":"))
    return "kvl1-" + hashlib.sha256(blob.encode()).hexdigest()[:24]
