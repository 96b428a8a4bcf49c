"""Keyed object names of an encrypted level: a keyed permutation of (kind, block hash).

A plain store names each record by its key, the chained prefix hash of its block
(``sha256(root || tokens)``). The root is built from the model id, the layout fingerprint
and the tenant's salt: public or guessable, so whoever can list a bucket of unkeyed names
can hash a guessed system prompt or document and test whether a tenant sent it. An
:class:`~.encrypted.EncryptedStore` stores each record under a *keyed name* instead::

    name = P_k(kind, block hash)        k: the tenant's name key (HKDF, see crypto.py)

``P_k`` is a keyed pseudorandom permutation of 256-bit blocks, tweaked by the record kind:
a balanced Feistel network of four rounds over the two 128-bit halves, each round
function keyed BLAKE2b-128 of the half (a PRF), with the round number and the kind in its
salt. Four rounds of a PRF give a strong pseudorandom permutation (Luby and Rackoff,
1988; the advantage of a distinguisher making q queries is below q^2 / 2^127). So:

- without ``k`` a name is indistinguishable from random: a bucket reader learns no prefix
  hash, cannot test a guessed prompt, and cannot link a block to its parent by name;
- names are deterministic, so a lookup is one request, and writers of one tenant and key
  that compute the same block name the same object (write-once dedup across a fleet);
- unlike an HMAC, it is invertible by the holder of ``k``: the store maps a listed name
  back to its record key with no read (for its eviction guard; see ``key_of``).

Each key generation (master key) and tenant has its own ``k``, so rotating the master key
moves records to new names (``tiered-kv rekey``), and tenants sharing a bucket prefix
never collide.
"""

from __future__ import annotations

import hashlib

__all__ = ["KeyedNames"]

_PERSON = b"tkv-names-v2"
_ROUNDS = 4
_HALF = 16


class KeyedNames:
    """The permutation ``P_k`` of one name key (32 bytes); thread-safe."""

    __slots__ = ("_rounds",)

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
            raise ValueError("name key: expected 32 bytes")
        # round functions, per record kind (0..255) on demand: BLAKE2b states with the key
        # absorbed, copied per call
        self._rounds: dict[int, list[hashlib._Hash]] = {}
        for kind in (1, 2):
            self._tables(bytes(key), kind)

    def _tables(self, key: bytes, kind: int) -> list[hashlib._Hash]:
        table = [hashlib.blake2b(key=key, digest_size=_HALF, person=_PERSON, salt=bytes((i, kind)) + bytes(14))
                 for i in range(_ROUNDS)]
        self._rounds[kind] = table
        return table

    def _table(self, kind: int) -> list[hashlib._Hash]:
        table = self._rounds.get(int(kind))
        if table is None:
            raise ValueError(f"record kind: expected one of {sorted(self._rounds)}, got {kind!r}")
        return table

    def name(self, kind: int, block_hash: bytes) -> bytes:
        """The 32-byte name of the record ``(kind, block_hash)``."""
        if len(block_hash) != 2 * _HALF:
            raise ValueError(f"block hash: expected {2 * _HALF} bytes, got {len(block_hash)}")
        left, right = int.from_bytes(block_hash[:_HALF], "little"), bytes(block_hash[_HALF:])
        for f in self._table(kind):
            h = f.copy()
            h.update(right)
            left, right = int.from_bytes(right, "little"), (left ^ int.from_bytes(h.digest(), "little")).to_bytes(
                _HALF, "little")
        return left.to_bytes(_HALF, "little") + right

    def key_of(self, kind: int, name: bytes) -> bytes:
        """The block hash whose name is ``name`` (the inverse of :meth:`name`)."""
        if len(name) != 2 * _HALF:
            raise ValueError(f"name: expected {2 * _HALF} bytes, got {len(name)}")
        left, right = bytes(name[:_HALF]), int.from_bytes(name[_HALF:], "little")
        for f in reversed(self._table(kind)):
            h = f.copy()
            h.update(left)
            left, right = (right ^ int.from_bytes(h.digest(), "little")).to_bytes(_HALF, "little"), int.from_bytes(
                left, "little")
        return left + right.to_bytes(_HALF, "little")
