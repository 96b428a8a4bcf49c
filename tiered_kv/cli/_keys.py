"""Encryption options of the store commands, and what ``stats`` says about a store's sealing.

* ``--key-file PATH`` (or the environment variable ``TIERED_KV_KEY_FILE``: one path, or
  several separated by ``:``, the current key first): the key the store's records are
  sealed under; new records are sealed under it. A master key (``tiered-kv keygen``), or
  a tenant key file (``tiered-kv keygen --tenant T --from MASTER``), which names its
  tenant and serves no other.
* ``--old-key-file PATH`` (repeatable): older keys still accepted for reading.
* ``--tenant NAME``: whose keys (default: the tenant of a tenant key file given; else the
  command's ``--salt`` where it has one, as a cache defaults its tenant to its salt; else
  ``""``; ``rekey`` has no default).

Without a key file the store is opened plain (a sealed level then only for what needs
no key: ``stats``, ``verify`` of the checksums, ``gc``). A bad key file (missing, not a
key file, not this user's, readable by group or others, of another tenant) is a usage
error (exit 2) naming what is wrong.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from .main import UsageError

if TYPE_CHECKING:
    from ..storage import BlockStore, EncryptionConfig

__all__ = ["ENV_KEY_FILE", "add_key_args", "describe_encryption", "encryption_from_args"]

ENV_KEY_FILE = "TIERED_KV_KEY_FILE"


def add_key_args(p: argparse.ArgumentParser, *, what: str = "the store", tenant_default: str = "''") -> None:
    g = p.add_argument_group("encryption (tenant-sealed records)")
    g.add_argument("--key-file", metavar="PATH", default=None,
                   help=f"master key file (32 random bytes, owner-only) sealing the records of {what}: "
                        f"reads are authenticated and decrypted, writes sealed under it (default: "
                        f"${ENV_KEY_FILE}, whose ':'-separated list gives the current key first)")
    g.add_argument("--old-key-file", metavar="PATH", action="append", default=[],
                   help="an older master key still accepted for reading (repeatable)")
    g.add_argument("--tenant", default=None, metavar="NAME",
                   help=f"tenant whose keys are derived from the master key (default {tenant_default})")


def encryption_from_args(args: argparse.Namespace, *, default_tenant: str = "",
                         require_tenant: str | None = None) -> EncryptionConfig | None:
    """The :class:`~tiered_kv.storage.EncryptionConfig` the options give (key files read
    and checked now), or None when no key file is given. ``require_tenant``: the tenant
    has no default (the message says why): ``--tenant`` or a tenant key file must name it."""
    from ..storage import EncryptionConfig, KeyFileError
    from ..storage.encrypted.crypto import Keyring, load_key_file

    files: list[str] = []
    if args.key_file:
        files = [args.key_file]
    elif os.environ.get(ENV_KEY_FILE):
        files = [f for f in os.environ[ENV_KEY_FILE].split(os.pathsep) if f]
    if not files:
        if args.old_key_file:
            raise UsageError(f"--old-key-file: expected --key-file (or ${ENV_KEY_FILE}) too: the current key")
        if args.tenant is not None:
            raise UsageError(f"--tenant: expected --key-file (or ${ENV_KEY_FILE}) too: a tenant names whose "
                             f"keys seal the records")
        return None
    files += list(args.old_key_file)
    try:
        named = [t for t in (load_key_file(f).tenant for f in files) if t is not None]
        tenant = args.tenant if args.tenant is not None else named[0] if named else default_tenant
        if require_tenant is not None and args.tenant is None and not named:
            raise UsageError(f"--tenant: expected the tenant whose records {require_tenant} (no default: a wrong "
                             f"tenant opens nothing)")
        config = EncryptionConfig(key_files=files, tenant=tenant)
        Keyring(config)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from None
    except ValueError as exc:  # e.g. a tenant name too long
        raise UsageError(f"--tenant: {exc}") from None
    return config


def describe_encryption(store: BlockStore, *, sample: int = 16) -> dict[str, Any]:
    """What ``stats`` reports about sealing: ``encrypted`` (True when the level records that
    it is sealed or holds envelopes, False, None when the store is empty and says
    nothing), ``sealing`` (what the level records), and either the keys given
    (``key_id``, ``key_ids``, ``names`` ``"keyed"``, ``auth_failures`` and, of ``sample``
    stored records read, how many open under each key: see
    :meth:`~tiered_kv.storage.EncryptedStore.describe`) or, without keys, how many of the
    ``sample`` records read are sealed envelopes and how many plain.

    Records are read at their stored sizes (:meth:`~tiered_kv.storage.BlockStore.payload_sizes`),
    so a store of any layout is described."""
    import itertools

    import numpy as np

    from ..storage import EncryptedStore
    from ..storage.encrypted.crypto import ENVELOPE_MAGIC

    if isinstance(store, EncryptedStore):
        s = store.stats()
        return {"encrypted": True, "sealing": store.sealing, "names": "keyed", "key_id": s["key_id"],
                "key_ids": s["key_ids"], "auth_failures": s["auth_failures"], **store.describe(sample)}
    keys = list(itertools.islice(store.names(), sample))
    sizes = store.payload_sizes(keys)
    present = [(key, n) for key, n in zip(keys, sizes) if n is not None]
    sealed = plain = 0
    for key, n in present:
        buf = np.empty(n, np.uint8)
        if store.get(key, buf) is None:
            continue
        if bytes(buf[:len(ENVELOPE_MAGIC)]) == ENVELOPE_MAGIC:
            sealed += 1
        else:
            plain += 1
    marked = store.sealing
    encrypted = True if marked is not None else None if not keys or not (sealed or plain) else sealed > 0
    return {"encrypted": encrypted, "sealing": marked, "sampled": len(keys), "sampled_sealed": sealed,
            "sampled_plain": plain}
