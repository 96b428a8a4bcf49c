"""Chained prefix hashes of 128-token-aligned blocks (docs/architecture.md §4).

``h_i = sha256(h_{i-1} || token_ids of block i)`` with ``h_{-1} = sha256(namespace)``,
where the namespace binds the model id, the layout fingerprint and a tenant salt. No
seed and no Python ``hash()``: the same tokens give the same 32-byte hashes in every
process and after restarts, while different tenants or layouts never share a hash.
Token ids are hashed as little-endian uint32.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Iterator, Sequence

import numpy as np

from .layout import KVLayout
from .storage.format.record import HASH_BYTES

__all__ = ["HASH_BYTES", "PrefixHasher", "block_token_digests", "checked_token_bytes", "digest_token_bytes",
           "token_array", "token_digest", "tokens_to_bytes", "uint32_array_bytes"]

_MAX_TOKEN = 2**32 - 1
#: A C ``unsigned int`` array is little-endian uint32 here (then its bytes are the hashed ones).
_NATIVE_LE_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def token_array(token_ids: list[int]) -> np.ndarray:
    """``[n] uint32`` of ids already checked to lie in ``[0, 2**32)`` (e.g. by
    ``as_token_list``): converted once per prompt, so that its block hashes and token
    digests (:func:`tokens_to_bytes` of slices of it) take no list conversion each."""
    if array.array("I").itemsize == 4:  # 4x faster than numpy's conversion of a list
        return np.frombuffer(array.array("I", token_ids), np.uint32)
    return np.array(token_ids, np.uint32)


def tokens_to_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; ids must lie in ``[0, 2**32)``."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids: expected a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token_ids: expected integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN:
        raise ValueError(f"token_ids: expected ids in [0, 2**32), got min {arr.min()}, max {arr.max()}")
    return arr.astype("<u4", copy=False).tobytes()


def checked_token_bytes(token_ids: list[int]) -> bytes:
    """:func:`tokens_to_bytes` of a list of ints already checked to lie in ``[0, 2**32)``
    (e.g. by ``as_token_list``): one C conversion, no numpy (the cache does this for every
    block it seals)."""
    if _NATIVE_LE_U32:  # the C array's bytes are already the little-endian uint32 ones
        return array.array("I", token_ids).tobytes()
    return token_array(token_ids).astype("<u4", copy=False).tobytes()


def uint32_array_bytes(ids: array.array) -> bytes:
    """:func:`tokens_to_bytes` of ids already in a C unsigned-int array of 4-byte items
    (as :func:`tiered_kv.request.checked_tokens` returns them): the array's bytes where
    they are little-endian, else byte-swapped."""
    if _NATIVE_LE_U32:
        return ids.tobytes()
    swapped = array.array("I", ids)
    swapped.byteswap()
    return swapped.tobytes()


def token_digest(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """32-byte digest of a block's own token ids (stored in records, checked on read)."""
    return digest_token_bytes(tokens_to_bytes(token_ids))


def digest_token_bytes(data: bytes) -> bytes:
    """:func:`token_digest` of ids already given as their :func:`tokens_to_bytes`."""
    return hashlib.sha256(b"tokens\0" + data).digest()


def block_token_digests(token_ids: Sequence[int] | np.ndarray, block_tokens: int) -> list[bytes]:
    """:func:`token_digest` of each full ``block_tokens`` block of ``token_ids``, converting
    the ids once (a long prompt's blocks are digested together when it is resumed)."""
    data = tokens_to_bytes(token_ids)
    step = 4 * block_tokens
    sha256 = hashlib.sha256
    return [sha256(b"tokens\0" + data[i:i + step]).digest() for i in range(0, len(data) - step + 1, step)]


class PrefixHasher:
    """Computes the chained block hashes of token sequences for one namespace.

    >>> h = PrefixHasher(layout, model_id="deepseek-v4-flash", salt="tenant-a")
    >>> hashes = h.block_hashes(token_ids)   # one 32-byte hash per *full* block
    """

    def __init__(self, layout: KVLayout, *, model_id: str | None = None, salt: str | bytes = b"") -> None:
        self.layout = layout
        self.model_id = model_id if model_id is not None else layout.name
        salt_b = salt.encode() if isinstance(salt, str) else bytes(salt)
        ns = b"\0".join([b"tiered_kv.prefix.v1", self.model_id.encode(), layout.fingerprint.encode(), salt_b])
        #: ``h_{-1}``: the root every chain in this namespace starts from.
        self.root: bytes = hashlib.sha256(ns).digest()

    @staticmethod
    def chain(parent: bytes, block_tokens: bytes) -> bytes:
        """``H(parent || token bytes of one block)``."""
        h = hashlib.sha256(parent)
        h.update(block_tokens)
        return h.digest()

    def iter_block_hashes(self, token_ids: Sequence[int] | np.ndarray, *,
                          parent: bytes | None = None) -> Iterator[bytes]:
        """Yield the hash of each full block of ``token_ids``, lazily (stop early on a miss)."""
        data = tokens_to_bytes(token_ids)
        step = 4 * self.layout.block_tokens
        h = self.root if parent is None else parent
        sha256 = hashlib.sha256
        for start in range(0, len(data) - step + 1, step):
            # one concatenation beats two update() calls: this loop is Python-bound
            h = sha256(h + data[start:start + step]).digest()
            yield h

    def block_hashes(self, token_ids: Sequence[int] | np.ndarray, *,
                     parent: bytes | None = None) -> list[bytes]:
        """The hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
        return list(self.iter_block_hashes(token_ids, parent=parent))
