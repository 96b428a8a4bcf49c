"""The LMDB store directories open in this process.

LMDB forbids a second environment handle on the same files in one process (closing one
would drop the other's locks), and a rebuild of the index must not run under an open
one: both claim the directory here first (:class:`~tiered_kv.storage.errors.StoreLockedError`
when it is taken).
"""

from __future__ import annotations

from ..os.locks import OpenRegistry

__all__ = ["REGISTRY"]

#: The store directories (by device and inode) open in this process.
REGISTRY = OpenRegistry()
