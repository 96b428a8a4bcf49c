"""Key files of tenant-encrypted records: master keys, tenant key files, and the tenant's secret.

A *master key* is a file of exactly 32 random bytes (``tiered-kv keygen PATH``). A
tenant's *secret* is HKDF-SHA256 of it (``info = "tiered_kv/tenant-key/v1" NUL tenant``,
64 bytes, the tenant NFC-normalized): every key of the tenant derives from it (see
:mod:`.crypto`). A *tenant key file* (``tiered-kv keygen --tenant T --from MASTER PATH``)
holds one tenant's secret and name, not the master key, so a node given it serves that
tenant and can derive no other's keys::

    offset  size  field                 (little-endian)
         0     4  magic                 b"TKVT"
         4     1  version               u8, = 1
         5     1  reserved              zero
         6     2  tenant length T       u16 (at most MAX_TENANT_BYTES)
         8     8  key id                the master key's id (public)
        16    64  tenant secret
        80     T  tenant                the tenant's bytes
      80+T    16  check                 SHA-256("tiered_kv/tenant-key-file/v1" NUL bytes [0, 80+T))[:16]

Reading a key file follows a symbolic link (Kubernetes mounts a secret as a chain of
them), then checks the file opened with ``fstat``: a regular file, owned by the running
user or root, that neither group nor others may access, of a key file's size. Writing one
never overwrites, never follows a link, checks every ``write`` and fsyncs the file and its
directory; a failure leaves no file.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import struct
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "KEY_FILE_BYTES",
    "KeyFile",
    "KeyFileError",
    "MAX_TENANT_BYTES",
    "SECRET_BYTES",
    "derive_tenant_secret",
    "key_id_of",
    "load_key_file",
    "read_key_file",
    "tenant_bytes",
    "write_key_file",
    "write_tenant_key_file",
]

KEY_FILE_BYTES = 32
#: A tenant's secret (the HKDF output every key of the tenant is derived from).
SECRET_BYTES = 64
#: Longest tenant name, in bytes (NFC UTF-8 for a str).
MAX_TENANT_BYTES = 1024

_TENANT_INFO = b"tiered_kv/tenant-key/v1\0"
_KEY_ID_LABEL = b"tiered_kv/key-id/v1\0"

#: Tenant key file: magic, version, reserved, tenant length, master key id, secret, tenant
#: bytes, then a 16-byte SHA-256 check of all that (a damaged or truncated file is refused).
_TENANT_FILE_MAGIC = b"TKVT"
_TENANT_FILE_VERSION = 1
_TENANT_FILE = struct.Struct("<4sBBH8s64s")
_TENANT_FILE_CHECK = b"tiered_kv/tenant-key-file/v1\0"
_MAX_KEY_FILE_BYTES = _TENANT_FILE.size + MAX_TENANT_BYTES + 16



class KeyFileError(ValueError):
    """A key file is missing, malformed, not this user's, others may access it, or it
    cannot serve the tenant asked for."""


# ------------------------------------------------------------------ tenants
def tenant_bytes(tenant: str | bytes) -> bytes:
    """A tenant name as the bytes keys are derived from: a str is NFC-normalized, then
    UTF-8 (so "é" typed precomposed or decomposed names one tenant); bytes as they are.
    At most :data:`MAX_TENANT_BYTES`."""
    if isinstance(tenant, str):
        raw = unicodedata.normalize("NFC", tenant).encode("utf-8")
    elif isinstance(tenant, (bytes, bytearray)):
        raw = bytes(tenant)
    else:
        raise TypeError(f"tenant: expected a str or bytes, got {type(tenant).__name__}")
    if len(raw) > MAX_TENANT_BYTES:
        raise ValueError(f"tenant: expected at most {MAX_TENANT_BYTES} bytes, got {len(raw)}")
    return raw


# ------------------------------------------------------------------ key files
def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The raw contents of key file ``path``: a master key (32 bytes) or a tenant key
    file; :func:`load_key_file` parses them.

    A symlink is followed (a Kubernetes secret mount is one); then the file opened is
    checked with ``fstat``: a regular file, owned by the running user or root, that
    neither its group nor others may read or write (mode ``0o600`` or stricter), of a
    key file's size. Raises :class:`KeyFileError` naming what is wrong.
    """
    p = Path(os.fspath(path)).expanduser()
    try:  # (O_NONBLOCK: a FIFO planted at the path must not hang the open)
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise KeyFileError(f"key file {p}: no such file (expected 32 random bytes; "
                           f"`tiered-kv keygen {p}` writes one)") from None
    except OSError as e:
        raise KeyFileError(f"key file {p}: cannot open it ({e.strerror}); expected a regular file "
                           f"readable by this user") from None
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the path names now
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"key file {p}: expected a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise KeyFileError(f"key file {p}: owned by uid {st.st_uid}; expected the running user "
                               f"(uid {os.geteuid()}) or root (chown it, or copy it as this user)")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise KeyFileError(f"key file {p}: mode {mode:04o} lets its group or others access it; "
                               f"expected owner-only (chmod 600 {p}; a Kubernetes secret: defaultMode 0400)")
        if st.st_size > _MAX_KEY_FILE_BYTES:
            raise KeyFileError(f"key file {p}: {st.st_size} bytes; expected exactly {KEY_FILE_BYTES} random "
                               f"bytes (or a tenant key file of `tiered-kv keygen --tenant`)")
        data = b""
        while len(data) <= _MAX_KEY_FILE_BYTES:
            chunk = os.read(fd, _MAX_KEY_FILE_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) != KEY_FILE_BYTES and not data.startswith(_TENANT_FILE_MAGIC):
        got = f"{len(data)} bytes" if len(data) <= _MAX_KEY_FILE_BYTES else "more"
        raise KeyFileError(f"key file {p}: expected exactly {KEY_FILE_BYTES} random bytes, got {got} (or a "
                           f"tenant key file of `tiered-kv keygen --tenant`)")
    return data


@dataclass(frozen=True, slots=True)
class KeyFile:
    """A parsed key file: a master key (``master``), or one tenant's secret (``tenant``,
    ``secret``: a tenant key file). ``key_id``: the master key's id."""

    source: str
    key_id: bytes
    master: bytes | None = field(default=None, repr=False)
    tenant: bytes | None = None
    secret: bytes | None = field(default=None, repr=False)

    def tenant_secret(self, tenant: bytes) -> bytes:
        """The secret of ``tenant``; a tenant key file serves its own tenant only."""
        if self.master is not None:
            return derive_tenant_secret(self.master, tenant)
        if not hmac.compare_digest(tenant, self.tenant or b""):
            raise KeyFileError(f"key file {self.source}: a tenant key file of tenant {_show(self.tenant)}; it "
                               f"cannot serve tenant {_show(tenant)} (derive that tenant's with `tiered-kv keygen "
                               f"--tenant ... --from MASTER`)")
        assert self.secret is not None
        return self.secret


def _show(tenant: bytes | None) -> str:
    try:
        return repr((tenant or b"").decode("utf-8"))
    except UnicodeDecodeError:
        return repr(tenant)


def load_key_file(path: str | os.PathLike[str]) -> KeyFile:
    """The key file at ``path`` (checked by :func:`read_key_file`), parsed."""
    data = read_key_file(path)
    source = os.fspath(path)
    if len(data) == KEY_FILE_BYTES:
        return KeyFile(source=source, key_id=key_id_of(data), master=data)
    if len(data) < _TENANT_FILE.size + 16:
        raise KeyFileError(f"key file {source}: a truncated tenant key file ({len(data)} bytes)")
    magic, version, reserved, n, key_id, secret = _TENANT_FILE.unpack_from(data)
    body = data[:len(data) - 16]
    check = hashlib.sha256(_TENANT_FILE_CHECK + body).digest()[:16]
    if version != _TENANT_FILE_VERSION or reserved or len(data) != _TENANT_FILE.size + n + 16 \
            or not hmac.compare_digest(check, data[len(data) - 16:]):
        raise KeyFileError(f"key file {source}: a damaged tenant key file, or of another version (expected "
                           f"version {_TENANT_FILE_VERSION}); write it again with `tiered-kv keygen --tenant`")
    return KeyFile(source=source, key_id=key_id, tenant=data[_TENANT_FILE.size:_TENANT_FILE.size + n], secret=secret)


def _create_key_file(path: Path, data: bytes) -> None:
    """Create ``path`` (0o600, never overwriting, never through a symlink) holding
    ``data``, durably: the file and its directory fsynced. A failure leaves no file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                if n <= 0:
                    raise OSError(errno.EIO, f"short write to {path}")
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_key_file(path: str | os.PathLike[str]) -> str:
    """Create ``path`` (mode 0o600, never overwriting) holding 32 fresh random bytes, a
    master key; returns its id (hex). FileExistsError if ``path`` exists."""
    key = os.urandom(KEY_FILE_BYTES)
    _create_key_file(Path(os.fspath(path)).expanduser(), key)
    return key_id_of(key).hex()


def write_tenant_key_file(path: str | os.PathLike[str], master_file: str | os.PathLike[str],
                          tenant: str | bytes) -> str:
    """Create ``path`` (0o600, never overwriting) holding ``tenant``'s secret derived
    from the master key in ``master_file``: a node given it serves that tenant only.
    Returns the master key's id (hex), which the file carries."""
    source = load_key_file(master_file)
    if source.master is None:
        raise KeyFileError(f"key file {os.fspath(master_file)}: a tenant key file; expected a master key "
                           f"(32 random bytes) to derive from")
    t = tenant_bytes(tenant)
    body = _TENANT_FILE.pack(_TENANT_FILE_MAGIC, _TENANT_FILE_VERSION, 0, len(t), source.key_id,
                             derive_tenant_secret(source.master, t)) + t
    _create_key_file(Path(os.fspath(path)).expanduser(), body + hashlib.sha256(_TENANT_FILE_CHECK + body).digest()[:16])
    return source.key_id.hex()


def key_id_of(master: bytes) -> bytes:
    """The public 8-byte id of a master key (see the module docstring)."""
    return hashlib.sha256(_KEY_ID_LABEL + master).digest()[:8]


def derive_tenant_secret(master: bytes, tenant: bytes) -> bytes:
    """HKDF-SHA256 of ``master`` for ``tenant`` (see the module docstring)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    if not isinstance(master, (bytes, bytearray)) or len(master) != KEY_FILE_BYTES:
        raise ValueError(f"master key: expected {KEY_FILE_BYTES} bytes")
    return HKDF(algorithm=hashes.SHA256(), length=SECRET_BYTES, salt=None,
                info=_TENANT_INFO + tenant).derive(bytes(master))
