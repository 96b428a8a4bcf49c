"""Fail closed: a level records that it is sealed, and an encrypted opener checks what it
finds before it serves anything.

The level records that it is sealed (:mod:`~..format.sealed_level`); a plain writer is
refused at open. A level that records no sealing is adopted when it is empty or holds
envelopes of this version (its marker lost with a rebuilt LMDB index); one sealed by an
earlier version (unkeyed names) raises :class:`EncryptedLevelError` naming
``tiered-kv rekey`` (which migrates it: ``migrate=True``); one holding plain records
raises too.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..api.store import BlockStore
from ..errors import EncryptedLevelError
from .crypto import ENVELOPE_VERSION, LEGACY_ENVELOPE_VERSION, envelope_version

__all__ = ["adopt_level"]

#: Records an unmarked level's adoption reads to tell empty / this version / older / plain.
_ADOPT_SAMPLE = 8


def adopt_level(inner: BlockStore, *, migrate: bool, where: str) -> None:
    """Check (or record) that the backend ``inner`` is a sealed level of this version (see
    the module docstring); EncryptedLevelError when it is not one."""
    if inner.closed or inner.sealing is not None:
        return
    names = list(itertools.islice(iter(inner), _ADOPT_SAMPLE))
    versions: set[int | None] = set()
    sizes = inner.payload_sizes(names) if names else []
    for name, n in zip(names, sizes):
        if n is None:
            continue
        buf = np.empty(n, np.uint8)
        if inner.get(name, buf) is not None:
            versions.add(envelope_version(buf[:5]))
    if LEGACY_ENVELOPE_VERSION in versions and not migrate:
        raise EncryptedLevelError(
            f"{where}: sealed by an earlier version of tiered_kv, whose object names are the records' "
            f"unkeyed prefix hashes (a reader of the store can test guessed prompts against them). Migrate it "
            f"once: `tiered-kv rekey --store URL --key-file KEY --tenant T` moves every record to keyed "
            f"names under the current envelope format (serving may resume meanwhile: the level is marked at "
            f"once, and records not moved yet are misses)")
    if None in versions and not versions & {ENVELOPE_VERSION, LEGACY_ENVELOPE_VERSION}:
        raise EncryptedLevelError(
            f"{where}: holds plain (unsealed) records: a level is sealed from its creation. Open it "
            f"without encryption, or give the encrypted level a new path or bucket prefix")
    if inner.readonly or inner.maintenance:
        return
    try:
        inner.record_sealing()
    except NotImplementedError:
        pass  # a backend that cannot record it: plain writers are not refused there
