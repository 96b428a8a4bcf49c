"""How an encrypted level writes: each payload sealed under the current key (192-bit random
nonce, a subkey per envelope: :mod:`.xaes`) into a reusable per-thread arena, on several
threads for a batch, as the backend's put item under the record's keyed name."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..api.store import PutItem
from ..format.record import RecordKind, payload_views
from .crypto import ENVELOPE_OVERHEAD, Keyring
from .work import Workers

__all__ = ["Sealer", "joined"]


def joined(payload: Any) -> np.ndarray:
    """A payload as one 1-D uint8 array: a payload of pieces is joined (one copy; AES-GCM
    seals one buffer)."""
    views, _ = payload_views(payload)
    return views[0] if len(views) == 1 else np.concatenate(views) if views else np.empty(0, np.uint8)


class Sealer:
    """Seals the put items of one encrypted level. ``sizes``: the payload size of each
    record kind, as seen (shared with the level's reads)."""

    def __init__(self, keyring: Keyring, workers: Workers, sizes: dict[RecordKind, int], *,
                 layout_fingerprint: str) -> None:
        self.keyring = keyring
        self.workers = workers
        self.sizes = sizes
        self.layout_fingerprint = layout_fingerprint

    def seal(self, items: list[PutItem]) -> list[PutItem]:
        """``items`` sealed under the current key: the backend's put items, under their
        names, their payloads the envelopes (views of this thread's put arena: valid until
        its next seal)."""
        bodies = [joined(item.payload) for item in items]
        sizes = [b.nbytes + ENVELOPE_OVERHEAD for b in bodies]
        offs = [0, *itertools.accumulate(sizes)]
        arena = self.workers.arena("put_arena", offs[-1])
        fp = self.layout_fingerprint
        current = self.keyring.current

        def seal(i: int) -> PutItem:
            item = items[i]
            env = arena[offs[i]:offs[i + 1]]
            parent, digest = self.keyring.seal_into(env, bodies[i], key=item.key, parent_hash=item.parent_hash,
                                                    token_digest=item.token_digest, layout_fingerprint=fp)
            return PutItem(current.name(item.key), parent, digest, env)

        sealed = self.workers.parallel(seal, range(len(items)), offs[-1])
        for item, body in zip(items, bodies):
            self.sizes.setdefault(item.key.kind, body.nbytes)
        return sealed
