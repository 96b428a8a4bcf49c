"""How an encrypted level opens what it reads: the envelope head's meaning for a read, the
tag's verdict, and the streamed sink that decrypts an object store's response in place.

Shared by every read path of :class:`~.store.EncryptedStore` (:mod:`.reads`) (the whole-record path of
local backends and the streamed path of object stores), so that both decide alike what
is authentic where it was read, and both leave nothing unauthenticated behind: see that
module's docstring for the rules; :class:`EnvelopeSink` for the streamed path.
"""

from __future__ import annotations

import enum
import hmac
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.record import RecordKey, RecordMeta
from .crypto import ENVELOPE_VERSION, HEAD_BYTES, LEGACY_ENVELOPE_VERSION, TAG_BYTES, Keyring, Opened, envelope_version

__all__ = ["EnvelopeSink", "Opener", "Outcome", "Read", "Skip", "Target", "digest_ok", "zero"]


class Outcome(enum.Enum):
    OK = "ok"
    ABSENT = "absent"          # no record (or a corrupt one the backend dropped)
    FOREIGN = "foreign"        # (a listing's read) an envelope under a key not given: kept
    FORGED = "forged"          # not authentic where it is (see encrypted.py): removed
    DIGEST = "digest"          # authentic, but another token digest than asked: corrupt, removed
    SKIPPED = "skipped"        # identified by its head, not decrypted (rekey, listings)
    OTHER_SIZE = "other size"  # authentic at another size than asked (a caller's size): kept
    INCOMPLETE = "incomplete"  # a streamed transfer that ended before its tag: a miss, kept


@dataclass(slots=True)
class Read:
    outcome: Outcome
    meta: RecordMeta | None = None
    opened: Opened | None = None   # the envelope head, when it named a key of ours
    key: RecordKey | None = None   # the record's key (a listing's read: from the name and head)
    name: RecordKey | None = None  # where it was read

    @property
    def key_id(self) -> bytes | None:
        return None if self.opened is None else self.opened.keys.key_id


#: Decide on an identified envelope without decrypting it (rekey, listings): True = skip.
Skip = Callable[[Opened], bool]


def zero(segs: Sequence[np.ndarray]) -> None:
    for seg in segs:
        seg.fill(0)


def digest_ok(asked: bytes | None, found: bytes) -> bool:
    return asked is None or hmac.compare_digest(bytes(asked), found)


class Target:
    """What one read is for: the record ``key`` (None: whatever a listed ``name`` holds,
    its key taken from the name and the key that sealed it) under key generation ``gen``
    (the one ``name`` belongs to; None with ``key`` None), the caller's out ``segs``, the
    token digest asked, and ``skip`` (see :data:`Skip`)."""

    __slots__ = ("name", "key", "gen", "segs", "digest", "skip")

    def __init__(self, name: RecordKey, key: RecordKey | None, gen: int | None, segs: Any, digest: bytes | None,
                 skip: Skip | None) -> None:
        self.name, self.key, self.gen, self.segs, self.digest, self.skip = name, key, gen, segs, digest, skip


class Opener:
    """The decision every read path shares: what an envelope head means for a target, its
    associated data, and the outcome of a tag."""

    def __init__(self, keyring: Keyring, layout_fingerprint: str) -> None:
        self.keyring = keyring
        self.fingerprint = layout_fingerprint

    def identify(self, t: Target, head: Any, meta: RecordMeta, env_bytes: int) -> tuple[Read | None, Opened | None,
                                                                                        RecordKey | None]:
        """``(decided read or None, opened head, the record's key)``: None read = decrypt it."""
        opened = self.keyring.identify(head, meta.parent_hash, meta.token_digest)
        if opened is None:
            if t.key is None and envelope_version(head) in (ENVELOPE_VERSION, LEGACY_ENVELOPE_VERSION):
                return Read(Outcome.FOREIGN, name=t.name), None, None  # another tenant's or key's: kept
            return Read(Outcome.FORGED, name=t.name), None, None
        if t.key is None:
            key = opened.keys.key_of(t.name) if opened.version == ENVELOPE_VERSION else t.name
        else:
            key = t.key
            if opened.gen != t.gen or opened.version != ENVELOPE_VERSION:
                return Read(Outcome.FORGED, opened=opened, name=t.name), None, None  # not this name's envelope
        if env_bytes != t.segs.nbytes + opened.overhead:  # (its version has another overhead than assumed)
            if t.key is None:  # a listing's read: a record of another payload size, kept
                return Read(Outcome.OTHER_SIZE, opened=opened, name=t.name), None, None
            return Read(Outcome.FORGED, opened=opened, name=t.name), None, None
        if t.skip is not None and t.skip(opened):
            return Read(Outcome.SKIPPED, opened=opened, key=key, name=t.name), opened, key
        return None, opened, key

    def aad(self, opened: Opened, key: RecordKey) -> bytes:
        return self.keyring.aad(opened, key, self.fingerprint)

    def decided(self, t: Target, opened: Opened, key: RecordKey, authentic: bool) -> Read:
        if not authentic:
            return Read(Outcome.FORGED, opened=opened, key=key, name=t.name)
        if not digest_ok(t.digest, opened.token_digest):
            return Read(Outcome.DIGEST, opened=opened, key=key, name=t.name)
        meta = RecordMeta(key=key, parent_hash=opened.parent_hash, token_digest=opened.token_digest,
                          layout_fingerprint=self.fingerprint, payload_bytes=t.segs.nbytes)
        return Read(Outcome.OK, meta, opened, key, t.name)


class EnvelopeSink:
    """Opens one envelope as a streaming backend hands it over (a
    :class:`~.base.PayloadSink`, on the backend's I/O thread), straight into the target's
    out pieces: no staging copy, no second pass over the bytes.

    An envelope that arrives in one chunk into a one-piece out (an object store's response
    usually is one chunk) is opened in one call; otherwise the head names the key and
    nonce, each ciphertext chunk is decrypted into the out pieces as it arrives (a
    streaming GCM decryptor) and the tag, last, decides. Plaintext is written before the
    tag is checked: unless the outcome is authentic the out pieces are zeroed, whether
    the tag failed, the transfer ended short (:meth:`finish` without the whole envelope:
    an explicit check, not an assertion) or the read was cancelled (:meth:`discard`). A
    lock orders each write with :meth:`discard`: once it returns, no byte lands."""

    __slots__ = ("_opener", "_t", "_meta", "_env_bytes", "_lock", "_cancelled", "_head", "_found", "_key",
                 "_dec", "_tag", "_left", "_piece", "_pos", "_wrote", "_read")

    def __init__(self, opener: Opener, t: Target, meta: RecordMeta, env_bytes: int) -> None:
        self._opener = opener
        self._t = t
        self._meta = meta              # the backend's header fields (parent hash, digest: masked)
        self._env_bytes = env_bytes    # the envelope's size, as the backend will hand it over
        self._lock = threading.Lock()
        self._cancelled = False
        self._head = bytearray()
        self._found: Opened | None = None
        self._key: RecordKey | None = None
        self._dec: Any = None          # the streaming decryptor, once the head named a key of ours
        self._tag = bytearray()
        self._left = 0                 # ciphertext bytes still to come, once the head is read
        self._piece = 0                # the out piece, and the offset in it, of the next byte
        self._pos = 0
        self._wrote = False
        self._read: Read | None = None  # the outcome, once decided

    def write(self, chunk: np.ndarray) -> bool:
        with self._lock:
            if self._cancelled or self._read is not None:
                return False
            try:
                return self._write(chunk)
            except BaseException:
                self._zero()
                raise

    def _write(self, chunk: np.ndarray) -> bool:
        if self._dec is None:
            segs = self._t.segs
            if not self._head and len(segs) == 1 and chunk.nbytes == self._env_bytes:
                self._open_whole(chunk)
                return False
            while True:  # the version byte (offset 4) says how long the head is
                want = 5 if len(self._head) < 5 else self._head_bytes()
                take = want - len(self._head)
                if take <= 0:
                    break
                self._head += memoryview(chunk[:take])
                chunk = chunk[take:]
                if len(self._head) < want:
                    return True
            decided, opened, key = self._opener.identify(self._t, self._head, self._meta, self._env_bytes)
            if decided is not None:
                self._decide(decided)
                return False
            assert opened is not None and key is not None
            self._found, self._key = opened, key
            self._dec = self._opener.keyring.decryptor(opened, self._opener.aad(opened, key))
            self._left = segs.nbytes
        n = min(self._left, chunk.nbytes)
        if n:
            self._decrypt(chunk[:n])
            self._left -= n
            chunk = chunk[n:]
        if chunk.nbytes:
            if len(self._tag) + chunk.nbytes > TAG_BYTES:
                self._decide(Read(Outcome.FORGED, name=self._t.name))  # (more than the envelope)
                return False
            self._tag += memoryview(chunk)
        return True

    def _head_bytes(self) -> int:
        """The head's size, from the version byte (anything else: read as a v2 head, which
        then names no key)."""
        return 28 if self._head[4] == LEGACY_ENVELOPE_VERSION else HEAD_BYTES

    def _open_whole(self, env: np.ndarray) -> None:
        """The whole envelope at once, into the one out piece."""
        decided, opened, key = self._opener.identify(self._t, env[:HEAD_BYTES], self._meta, self._env_bytes)
        if decided is not None:
            self._decide(decided)
            return
        assert opened is not None and key is not None
        self._wrote = True
        ok = self._opener.keyring.open_into(opened, env[opened.head_bytes:], self._opener.aad(opened, key),
                                            self._t.segs[0])
        self._decide(self._opener.decided(self._t, opened, key, ok))

    def _decrypt(self, data: np.ndarray) -> None:
        self._wrote = True
        segs = self._t.segs
        while data.nbytes:
            dst = segs[self._piece]
            room = dst.nbytes - self._pos
            if not room:
                self._piece += 1
                self._pos = 0
                continue
            n = min(room, data.nbytes)
            self._dec.update_into(data[:n], dst[self._pos:self._pos + n])
            self._pos += n
            data = data[n:]

    def _decide(self, read: Read) -> None:
        self._read = read
        if read.outcome is not Outcome.OK:
            self._zero()

    def _zero(self) -> None:
        if self._t.key is not None or self._wrote:  # (a listing's scratch buffer: only if written)
            zero(self._t.segs)

    def finish(self) -> Read:
        from cryptography.exceptions import InvalidTag

        with self._lock:
            if self._read is None:
                found, key = self._found, self._key
                if self._cancelled or found is None or key is None or self._left or len(self._tag) != TAG_BYTES:
                    self._decide(Read(Outcome.INCOMPLETE, name=self._t.name))  # (cut short, or cancelled)
                else:
                    try:
                        self._dec.finalize_with_tag(bytes(self._tag))
                    except InvalidTag:
                        authentic = False
                    else:
                        authentic = True
                    self._decide(self._opener.decided(self._t, found, key, authentic))
            assert self._read is not None
            return self._read

    def discard(self) -> None:
        """Cancel: no byte lands after this returns; the out pieces are zeroed unless they
        hold an authenticated payload."""
        with self._lock:
            self._cancelled = True
            if self._read is None or self._read.outcome is not Outcome.OK:
                self._zero()
