"""The Classical pool: immutable compressed entries, one block id for every layer's part.

Tensors (all ``uint8``, on the pool's device)::

    csa_kv   [num_csa_layers, num_blocks, block_tokens / csa_ratio, entry_bytes]
    indexer  [num_csa_layers, num_blocks, block_tokens / csa_ratio, indexer_bytes]
    hca_kv   [num_hca_layers, num_blocks, block_tokens / hca_ratio, entry_bytes]

Block ``b`` of a request covers tokens ``[b_idx * block_tokens, (b_idx + 1) * block_tokens)``
of its sequence; CSA entry ``j`` of a request lives in block ``block_table[j // E]`` at
offset ``j % E`` with ``E = block_tokens / csa_ratio`` (HCA likewise).

The record of a block (its disk / host form) is the concatenation of the three parts'
``[layers, entries, bytes]`` slices in the order ``csa_kv, indexer, hca_kv``.
"""

from __future__ import annotations

import torch

from .layout import KVLayout

__all__ = ["ClassicalPool"]


class ClassicalPool:
    """Device tensors of the Classical blocks of one layout."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device, *,
                 csa_blocks: int | None = None) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: expected a positive int, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        L = layout
        #: Blocks of the CSA KV part: ``num_blocks``, or with HiSparse one *open* block
        #: per State slot (sealed blocks' CSA entries then live in the host tier).
        self.csa_blocks = num_blocks if csa_blocks is None else csa_blocks
        #: ``[num_csa_layers, csa_blocks, csa_entries_per_block, entry_bytes]`` uint8
        self.csa_kv = torch.zeros(L.num_csa_layers, self.csa_blocks, L.csa_entries_per_block,
                                  L.entry_bytes, dtype=torch.uint8, device=device)
        #: ``[num_csa_layers, num_blocks, csa_entries_per_block, indexer_bytes]`` uint8
        self.indexer = torch.zeros(L.num_csa_layers, num_blocks, L.csa_entries_per_block,
                                   L.indexer_bytes, dtype=torch.uint8, device=device)
        #: ``[num_hca_layers, num_blocks, hca_entries_per_block, entry_bytes]`` uint8
        self.hca_kv = torch.zeros(L.num_hca_layers, num_blocks, L.hca_entries_per_block,
                                  L.entry_bytes, dtype=torch.uint8, device=device)

    @property
    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The parts in record order: ``(csa_kv, indexer, hca_kv)``."""
        if self.csa_blocks != self.num_blocks:
            raise ValueError("parts: the CSA part is per State slot (HiSparse); use rest_parts")
        return (self.csa_kv, self.indexer, self.hca_kv)

    @property
    def rest_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The parts that follow the CSA part in a record: ``(indexer, hca_kv)``."""
        return (self.indexer, self.hca_kv)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in (self.csa_kv, self.indexer, self.hca_kv))

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block as its record: ``[block_bytes]`` uint8 (a copy)."""
        return torch.cat([p[:, block_id].reshape(-1) for p in self.parts])

    def write_block(self, block_id: int, record: torch.Tensor) -> None:
        """Fill one block from its record ``[block_bytes]`` uint8."""
        if record.dtype != torch.uint8 or record.shape != (self.layout.block_bytes,):
            raise ValueError(f"record: expected uint8 [{self.layout.block_bytes}], "
                             f"got {record.dtype} {list(record.shape)}")
        offset = 0
        for part in self.parts:
            view = part[:, block_id]
            n = view.numel()
            view.copy_(record[offset:offset + n].view(view.shape))
            offset += n
