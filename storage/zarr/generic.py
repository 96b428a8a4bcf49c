"""Records of a ZarrStore under any other zarr Store (e.g. ``MemoryStore`` in tests), through
the zarr Store API: ``set_if_not_exists`` and ``get``. Two racing writers of one key may
both report True there (the store keeps one of the two, both valid); access times live in
the store's in-memory index only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..format.record import HEADER_BYTES, RecordKey, RecordMeta, decode_record
from .objects import DIR_KINDS, META_KEY, Objects, key_of

__all__ = ["ZarrApiObjects"]


class ZarrApiObjects(Objects):
    """Records under any zarr Store, through the zarr Store API (sync wrappers)."""

    local = False
    #: headers by a byte-range ``get`` (every zarr v3 Store takes ``byte_range``)
    reads_headers = True

    def __init__(self, store: Any) -> None:
        from zarr.abc.store import RangeByteRequest
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync

        self.store = store
        self._sync = sync
        self._proto = default_buffer_prototype()
        self._header_range = RangeByteRequest(0, HEADER_BYTES)

    def read_header(self, name: str) -> bytes | None:
        buf = self._sync(self.store.get(name, prototype=self._proto, byte_range=self._header_range))
        if buf is None:
            return None
        header = buf.to_bytes()
        return header if len(header) == HEADER_BYTES else None

    def _get(self, name: str) -> np.ndarray | None:
        buf = self._sync(self.store.get(name, prototype=self._proto))
        return None if buf is None else buf.as_numpy_array().view(np.uint8).reshape(-1)

    def _put(self, name: str, data: bytes) -> None:
        self._sync(self.store.set_if_not_exists(name, self._proto.buffer.from_bytes(data)))

    def read_meta(self) -> bytes | None:
        arr = self._get(META_KEY)
        return None if arr is None else arr.tobytes()

    def create_meta(self, data: bytes) -> None:
        self._put(META_KEY, data)

    def replace_meta(self, data: bytes) -> None:
        self._sync(self.store.set(META_KEY, self._proto.buffer.from_bytes(data)))

    def write_new(self, name: str, parts: Sequence[Any]) -> bool:
        if self.exists(name):
            return False
        self._put(name, b"".join(memoryview(p).cast("B") for p in parts))
        return True

    def read_whole(self, name: str) -> np.ndarray | None:
        return self._get(name)

    def read_into(self, name: str, key: RecordKey, fingerprint: str, digest: bytes | None,
                  out: np.ndarray) -> RecordMeta | None:
        arr = self._get(name)
        if arr is None:
            return None
        return decode_record(arr, expect_key=key, expect_fingerprint=fingerprint,
                             expect_token_digest=digest, out=out)

    def exists(self, name: str) -> bool:
        return bool(self._sync(self.store.exists(name)))

    def size_of(self, name: str) -> int | None:
        arr = self._get(name)  # (the zarr Store API has no size query that every store answers)
        return None if arr is None else int(arr.nbytes)

    def remove(self, name: str) -> bool:
        if not self.exists(name):
            return False
        self._sync(self.store.delete(name))
        return True

    def touch(self, name: str, ns: int) -> None:
        pass  # object stores: access times live in the in-memory index only

    def scan(self) -> list[tuple[RecordKey, int, int]]:
        async def listing() -> list[str]:
            return [name for kind_dir in DIR_KINDS async for name in self.store.list_prefix(kind_dir + "/")]

        found = []
        for name in self._sync(listing()):
            parts = name.split("/")
            key = key_of(*parts) if len(parts) == 3 else None
            if key is not None:
                found.append((key, int(self._sync(self.store.getsize(name))), 0))
        return found

