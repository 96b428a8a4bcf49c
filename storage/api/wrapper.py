"""A store that wraps another (in zarr-python's ``WrapperStore`` manner): every capability and
every call it does not change goes to the store it wraps, generically.

A wrapper (an encrypted level, :class:`~tiered_kv.storage.encrypted.EncryptedStore`) changes
what it must (how records are written and read, what names they are stored under) and
declares the capabilities it changes as class attributes; the rest of
:class:`~.store.BlockStore` (its flags, layout, bounds, directory, sealing, maintenance
calls...) is the inner store's, so a capability added to the interface reaches every
wrapper without one copy per wrapper::

    class Sealing(StoreWrapper):
        supports_streamed_reads = False      # (it reads whole records: declared, not forwarded)

        def put_many(self, items): return self.inner.put_many([seal(i) for i in items])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..format.record import RecordKey, RecordMeta
from ..format.rows import RowScatter
from .eviction import EvictionGuard
from .store import BlockStore, PayloadSink, PutItem, check_open

__all__ = ["FORWARDED", "StoreWrapper"]

#: What a wrapper reads of its inner store unless it declares its own.
FORWARDED = ("supports_multiprocess", "supports_shared_writers", "supports_mmap_reads", "supports_scatter_reads",
             "supports_eviction_guard", "supports_row_reads", "supports_streamed_reads", "supports_recent",
             "layout_fingerprint", "max_bytes", "maintenance", "readonly", "path", "sealing", "index_rebuild")


def _forward(name: str) -> property:
    def get(self: StoreWrapper) -> Any:
        return getattr(self._inner, name)

    get.__doc__ = f"The inner store's ``{name}``."
    return property(get)


class StoreWrapper(BlockStore):
    """``inner`` with the calls a subclass overrides changed, and everything else forwarded
    (see the module docstring). ``owned``: :meth:`close` closes ``inner`` too."""

    def __init__(self, inner: BlockStore, *, owned: bool = True) -> None:
        if not isinstance(inner, BlockStore):
            raise TypeError(f"inner: expected an open BlockStore, got {type(inner).__name__}")
        self._inner = inner
        self._owned = owned
        self._closed = inner.closed

    @property
    def inner(self) -> BlockStore:
        """The store this one wraps."""
        return self._inner

    @property
    def where(self) -> str:  # type: ignore[override]
        return self._inner.where

    @property  # type: ignore[override]
    def eviction_guard(self) -> EvictionGuard | None:
        return self._inner.eviction_guard

    @eviction_guard.setter
    def eviction_guard(self, guard: EvictionGuard | None) -> None:
        self._inner.eviction_guard = guard

    # ------------------------------------------------------------------ the calls, forwarded
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        check_open(self._closed, self.where)
        return self._inner.put_many(items)

    def get_many(self, keys: Sequence[RecordKey], outs: Sequence[Any], *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[RecordMeta | None]:
        check_open(self._closed, self.where)
        return self._inner.get_many(keys, outs, token_digests=token_digests)

    def get_rows(self, keys: Sequence[RecordKey], rows: RowScatter, *,
                 token_digests: Sequence[bytes | None] | None = None) -> list[bool]:
        check_open(self._closed, self.where)
        return self._inner.get_rows(keys, rows, token_digests=token_digests)

    def read_each(self, keys: Sequence[RecordKey], payload_bytes: Sequence[int],
                  open_sink: Callable[[int, RecordMeta], PayloadSink]) -> list[Any]:
        check_open(self._closed, self.where)
        return self._inner.read_each(keys, payload_bytes, open_sink)

    def contains(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        return self._inner.contains(key)

    def contains_many(self, keys: Sequence[RecordKey]) -> list[bool]:
        check_open(self._closed, self.where)
        return self._inner.contains_many(keys)

    def delete(self, key: RecordKey) -> bool:
        check_open(self._closed, self.where)
        return self._inner.delete(key)

    def payload_sizes(self, keys: Sequence[RecordKey]) -> list[int | None]:
        check_open(self._closed, self.where)
        return self._inner.payload_sizes(keys)

    def name_of(self, key: RecordKey) -> RecordKey:
        return self._inner.name_of(key)

    def names(self) -> Iterator[RecordKey]:
        check_open(self._closed, self.where)
        return self._inner.names()

    def recent(self, n: int) -> list[RecordKey]:
        check_open(self._closed, self.where)
        return self._inner.recent(n)

    def record_sealing(self) -> None:
        self._inner.record_sealing()

    def __iter__(self) -> Iterator[RecordKey]:
        check_open(self._closed, self.where)
        return iter(self._inner)

    def __len__(self) -> int:
        check_open(self._closed, self.where)
        return len(self._inner)

    def stats(self) -> dict[str, Any]:
        check_open(self._closed, self.where)
        return self._inner.stats()

    def verify(self, *, repair: bool = False) -> dict[str, Any]:
        check_open(self._closed, self.where)
        return self._inner.verify(repair=repair)

    def gc(self, max_bytes: int) -> dict[str, Any]:
        check_open(self._closed, self.where)
        return self._inner.gc(max_bytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self._inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"


for _name in FORWARDED:
    setattr(StoreWrapper, _name, _forward(_name))
del _name
