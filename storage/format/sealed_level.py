"""The record that a level is sealed: written when an encrypted level is created, read by every opener.

A level created with ``encryption`` (:class:`~.encrypted.EncryptedStore`) records it
where every opener of the backend reads it before anything else: Zarr in ``zarr.json``
(``attributes["tiered_kv"]["encryption"]``, written with the group, create-only), LMDB
in its ``meta`` sub-database (``b"encryption"``, in the transaction that creates the
store) and in ``sealed-level.json`` beside its segment files, so that an index rebuilt
from the segments keeps it (``storage/lmdb/schema.py`` ``SEALED_FILE``). The value is :data:`SEALED_LEVEL`: which envelope format and naming the level
holds, nothing about keys or tenants::

    {"envelope": "tiered_kv/envelope/v2", "cipher": "XAES-256-GCM", "names": "keyed/v2"}

A backend opened for writing without ``sealed=True`` (a store or node configured without
the key, ``tiered-kv sync`` without ``--key-file``) raises :class:`EncryptedLevelError`:
its plain records would squat names and never be sealed afterwards. A maintenance open
(``layout_fingerprint=None``: ``stats``, ``verify``, ``gc``) reads the level without its
key. The backends only store and check the record: sealing is the wrapper's, which also
records the fact on a level that lacks it (an empty level, a rebuilt LMDB index, a level
``rekey`` migrates from the unkeyed names of an earlier version).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import EncryptedLevelError, StoreError

__all__ = ["SEALED_LEVEL", "check_opener", "parse_sealing"]

#: What a sealed level records (see the module docstring).
SEALED_LEVEL: dict[str, str] = {"envelope": "tiered_kv/envelope/v2", "cipher": "XAES-256-GCM",
                                "names": "keyed/v2"}


def parse_sealing(raw: Any, where: str) -> dict[str, str] | None:
    """The recorded value (a dict, or its JSON bytes), None when absent; StoreError for a
    value this version does not know (a newer envelope or naming: upgrade tiered_kv)."""
    if raw is None:
        return None
    if isinstance(raw, (bytes, bytearray, memoryview)):
        try:
            raw = json.loads(bytes(raw))
        except (ValueError, UnicodeDecodeError):
            raise StoreError(f"{where}: the level's encryption record is not JSON: the store is damaged") from None
    if raw != SEALED_LEVEL:
        raise StoreError(f"{where}: sealed with {raw!r}; this version of tiered_kv reads {SEALED_LEVEL!r} "
                         f"(upgrade tiered_kv to open it)")
    return dict(raw)


def check_opener(sealing: dict[str, str] | None, *, sealed: bool, maintenance: bool, where: str) -> None:
    """Refuse a plain opener (``sealed`` False) that would write into a sealed level."""
    if sealing is not None and not sealed and not maintenance:
        raise EncryptedLevelError(
            f"{where}: this level is encrypted (created with encryption; its records are sealed envelopes under "
            f"keyed names) and was opened without its keys. A plain writer is refused: give the key "
            f"(open_store(..., encryption={{'key_files': [...], 'tenant': ...}}); the CLI: --key-file and --tenant; "
            f"a chain: that level's level_options encryption)")


def sealing_json() -> bytes:
    return json.dumps(SEALED_LEVEL, sort_keys=True).encode()
