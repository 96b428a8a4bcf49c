"""Scatter-list outs for a backend that reads a record into one buffer only (Zarr, S3)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..format.record import RecordKey, RecordMeta, as_out_segments, write_segments

if TYPE_CHECKING:
    from .store import BlockStore

__all__ = ["scatter_via_temporaries"]

GetMany = TypeVar("GetMany", bound=Callable[..., list[Any]])


def scatter_via_temporaries(get_many: GetMany) -> GetMany:
    """Scatter-list outs for a backend without native scatter reads (Zarr, S3).

    Decorates a ``get_many(self, keys, outs, *, token_digests=None)`` that takes single
    buffers: each scatter-list out is replaced by one temporary of the pieces' total
    size (a wrong total is then the backend's own ValueError), and a hit's payload is
    copied from it into the pieces. Other outs pass through untouched.
    """
    @functools.wraps(get_many)
    def wrapper(self: BlockStore, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        outs = list(outs)
        pieces = {i: as_out_segments(o, name=f"outs[{i}]") for i, o in enumerate(outs)
                  if isinstance(o, (list, tuple))}
        for i, segs in pieces.items():
            outs[i] = np.empty(segs.nbytes, np.uint8)
        metas = get_many(self, keys, outs, token_digests=token_digests)
        for i, segs in pieces.items():
            if metas[i] is not None:
                write_segments(segs, outs[i])
        return metas

    return wrapper  # type: ignore[return-value]
