"""Synthetic but verifiable KV bytes: every block and snapshot derived from its prefix hash.

No model runs in a replay, yet every hit must be checkable. So the bytes of block ``i`` of
a prompt are a function of its chained prefix hash ``h_i`` alone, and so is the State
snapshot at the boundary after it::

    block record  [block_bytes]     uint8 = tile(h_i) ^ block_mask     (parts csa_kv |
                                             indexer | hca_kv, layer-major, as a disk record)
    snapshot      [snapshot_bytes]  uint8 = tile(h_i) ^ snapshot_mask  (SWA ring | CSA overlap
                                             rows | indexer overlap rows), fp32 words made finite

``tile(h)`` repeats the 32-byte hash; the masks are fixed pseudo-random bytes (seed 0), so
two blocks' bytes differ wherever their hashes do, and a byte read from the wrong offset
differs too. The driver writes blocks through ``write_csa`` / ``write_hca`` and the State
through ``cache.state(request)`` before each boundary, so the cache's own snapshot policy
decides what is kept; :meth:`SyntheticKV.verify` reads a resumed prefix back through the
cache's read calls and its restored State, and compares byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..layout import KVLayout

__all__ = ["SyntheticKV", "VerifyResult"]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What one :meth:`SyntheticKV.verify` compared; ``bad_*`` must be zero."""

    blocks: int
    bad_blocks: int
    snapshots: int
    bad_snapshots: int


class SyntheticKV:
    """Expected bytes of blocks and snapshots of one layout, and the writes and checks."""

    def __init__(self, layout: KVLayout) -> None:
        L = layout
        self.layout = L
        rng = np.random.default_rng(0)
        self._block_mask = rng.integers(0, 256, L.block_bytes, dtype=np.uint8)
        self._snap_mask = rng.integers(0, 256, L.snapshot_bytes, dtype=np.uint8)
        E, Eh = L.csa_entries_per_block, L.hca_entries_per_block
        self._csa = (L.num_csa_layers, E, L.entry_bytes)
        self._idx = (L.num_csa_layers, E, L.indexer_bytes)
        self._hca = (L.num_hca_layers, Eh, L.entry_bytes)
        r = L.csa_ratio
        self._swa = (L.num_layers, L.window, L.entry_bytes)
        self._csa_overlap = (L.num_csa_layers, 2, r, L.head_dim)
        self._idx_overlap = (L.num_csa_layers, 2, r, L.indexer_dim)
        #: the snapshot's fp32 overlap rows start here (their words are made finite)
        self._fp32_from = L.swa_bytes
        self._views: dict[int, tuple[object, object | None, object | None]] = {}
        self._swa_end = int(np.prod(self._swa))
        self._csa_end = self._swa_end + 4 * int(np.prod(self._csa_overlap))

    # ---------------------------------------------------------------- expected bytes
    def blocks(self, hashes: list[bytes]) -> np.ndarray:
        """Expected records of the blocks with these hashes: ``[len(hashes), block_bytes]`` uint8."""
        return self._derive(hashes, self._block_mask)

    def snapshot(self, h: bytes) -> np.ndarray:
        """Expected snapshot at the boundary after the block with hash ``h``: ``[snapshot_bytes]`` uint8."""
        out = self._derive([h], self._snap_mask)[0]
        out[self._fp32_from + 3::4] &= 0x3F  # top two bits of each little-endian fp32 word: finite
        return out

    def _derive(self, hashes: list[bytes], mask: np.ndarray) -> np.ndarray:
        n = mask.size
        reps = -(-n // 32)
        tiled = np.frombuffer(b"".join(h * reps for h in hashes), dtype=np.uint8).reshape(len(hashes), 32 * reps)
        return tiled[:, :n] ^ mask

    def _split(self, records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Records ``[m, block_bytes]`` -> csa kv ``[n_csa, m*E, eb]``, indexer keys
        ``[n_csa, m*E, ib]``, hca kv ``[n_hca, m*Eh, eb]`` (entries of consecutive blocks)."""
        m = records.shape[0]
        a = int(np.prod(self._csa))
        b = a + int(np.prod(self._idx))
        csa = records[:, :a].reshape(m, *self._csa).transpose(1, 0, 2, 3).reshape(self._csa[0], -1, self._csa[2])
        idx = records[:, a:b].reshape(m, *self._idx).transpose(1, 0, 2, 3).reshape(self._idx[0], -1, self._idx[2])
        hca = records[:, b:].reshape(m, *self._hca).transpose(1, 0, 2, 3).reshape(self._hca[0], -1, self._hca[2])
        return csa, idx, hca

    # ---------------------------------------------------------------------- writes
    def write_blocks(self, cache: object, request: object, first: int, hashes: list[bytes]) -> None:
        """Write blocks ``first, first + 1, ...`` (hashes ``hashes``) of ``request``: every
        CSA and HCA entry, in one ``write_csa`` and one ``write_hca`` call."""
        if not hashes:
            return
        L = self.layout
        csa, idx, hca = (torch.from_numpy(np.ascontiguousarray(x)) for x in self._split(self.blocks(hashes)))
        m = len(hashes)
        if L.num_csa_layers:
            E = L.csa_entries_per_block
            ids = np.arange(first * E, (first + m) * E, dtype=np.int64)
            cache.write_csa(request, list(L.csa_layers), ids, csa, idx)  # type: ignore[attr-defined]
        if L.num_hca_layers:
            Eh = L.hca_entries_per_block
            ids = np.arange(first * Eh, (first + m) * Eh, dtype=np.int64)
            cache.write_hca(request, list(L.hca_layers), ids, hca)  # type: ignore[attr-defined]

    def write_state(self, cache: object, request: object, h: bytes) -> None:
        """Make ``request``'s State the snapshot expected at the boundary after block ``h``
        (the rest of the State, which a snapshot does not keep, is left as it is)."""
        snap = self.snapshot(h)
        a, b = self._swa_end, self._csa_end
        slot = request.slot  # type: ignore[attr-defined]
        views = self._views.get(slot)
        if views is None:  # a slot's views of the State pool, kept (the pool is never reallocated)
            views = self._views[slot] = self._state_views(cache.state(request))  # type: ignore[attr-defined]
        swa, csa, idx = views
        if isinstance(swa, np.ndarray):  # CPU pools: numpy views, no torch op per copy
            swa[...] = snap[:a].reshape(self._swa)
            if csa is not None:
                csa[...] = snap[a:b].view(np.float32).reshape(self._csa_overlap)
                idx[...] = snap[b:].view(np.float32).reshape(self._idx_overlap)
            return
        t = torch.from_numpy(snap).to(swa.device)
        swa.copy_(t[:a].view(self._swa))
        if csa is not None:  # (clone: an fp32 view needs 4-byte alignment)
            csa.copy_(t[a:b].clone().view(torch.float32).view(self._csa_overlap))
            idx.copy_(t[b:].clone().view(torch.float32).view(self._idx_overlap))

    def _state_views(self, view: object) -> tuple[object, object | None, object | None]:
        """(SWA ring, CSA overlap rows, indexer overlap rows) of a State view: numpy views
        of the pool on CPU, tensors elsewhere."""
        L, r = self.layout, self.layout.csa_ratio
        swa = view.swa  # type: ignore[attr-defined]
        csa = view.csa_tail[:, :, :r, :L.head_dim] if L.num_csa_layers else None  # type: ignore[attr-defined]
        idx = view.idx_tail[:, :, :r, :L.indexer_dim] if L.num_csa_layers else None  # type: ignore[attr-defined]
        if swa.device.type == "cpu":
            return swa.numpy(), (None if csa is None else csa.numpy()), (None if idx is None else idx.numpy())
        return swa, csa, idx

    # ---------------------------------------------------------------------- checks
    def verify(self, cache: object, request: object, hashes: list[bytes]) -> VerifyResult:
        """Read the ``len(hashes)`` resumed blocks of ``request`` back through the cache
        (``read_csa``, ``read_indexer_keys``, ``read_hca``) and its restored State, and
        compare them with the expected bytes."""
        L = self.layout
        n = len(hashes)
        if n == 0:
            return VerifyResult(0, 0, 0, 0)
        csa, idx, hca = self._split(self.blocks(hashes))
        bad = np.zeros(n, dtype=bool)
        E, Eh = L.csa_entries_per_block, L.hca_entries_per_block
        for c, layer in enumerate(L.csa_layers):
            got_kv = cache.read_csa(request, layer, torch.arange(n * E)).numpy()  # type: ignore[attr-defined]
            got_keys = cache.read_indexer_keys(request, layer, n * E).numpy()  # type: ignore[attr-defined]
            bad |= (got_kv != csa[c]).reshape(n, -1).any(axis=1) | (got_keys != idx[c]).reshape(n, -1).any(axis=1)
        for k, layer in enumerate(L.hca_layers):
            got = cache.read_hca(request, layer, n * Eh).numpy()  # type: ignore[attr-defined]
            bad |= (got != hca[k]).reshape(n, -1).any(axis=1)
        states = cache.states  # type: ignore[attr-defined]
        got_snap = states.snapshot(request.slot).cpu().numpy()  # type: ignore[attr-defined]
        bad_snap = int(not np.array_equal(got_snap, self.snapshot(hashes[-1])))
        return VerifyResult(blocks=n, bad_blocks=int(bad.sum()), snapshots=1, bad_snapshots=bad_snap)
