"""Tenant-encrypted levels: a wrapper that seals every record for one tenant and names it
by a keyed name, so a bucket can hold the records but neither read, forge, nor name them.

==================  ======================================================================
store.py            :class:`EncryptedStore`, the wrapper (its module docstring: names,
                    fail-closed levels, reads, writes, rotation)
crypto.py           keys of a tenant, the envelope format, sealing and opening
key_files.py        master keys and tenant key files
xaes.py             XAES-256-GCM (a subkey per 192-bit nonce)
names.py            the keyed permutation that names records
envelopes.py        opening envelopes as they are read (outcomes, streamed sinks)
rekey_journal.py    the batch ``rekey`` is rewriting, kept so that a kill loses nothing
==================  ======================================================================
"""

from __future__ import annotations

from .store import EncryptedStore, RekeyReport

__all__ = ["EncryptedStore", "RekeyReport"]
