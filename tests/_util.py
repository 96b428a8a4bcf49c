"""Small helpers shared by tests (importable as ``_util``: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch


def random_tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
