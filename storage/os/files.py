"""Owner-only files and directories, whatever the umask, and durable directory entries.

Every file and directory a store creates is 0o600 / 0o700 (the block-store contract,
:mod:`~tiered_kv.storage.api.store`): the mode is set explicitly after creation, since
``os.mkdir`` and ``os.open`` apply the umask.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["create_private_file", "fsync_dir", "mkdir_private", "open_private_file"]


def mkdir_private(path: Path) -> bool:
    """Create directory ``path`` (its parents too) as 0o700 whatever the umask.

    Returns True if ``path`` was created here. Parents created here are 0o700 as well.
    """
    if path.is_dir():
        return False
    if not path.parent.is_dir():
        mkdir_private(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    os.chmod(path, 0o700)
    return True


def create_private_file(path: Path) -> int | None:
    """Create ``path`` exclusively as 0o600 and return its fd open for writing, or None
    if it already exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return None
    os.fchmod(fd, 0o600)
    return fd


def open_private_file(path: Path) -> int:
    """Open ``path`` for reading and writing, creating it as 0o600 whatever the umask
    (an existing file of this user is made 0o600 too); returns its fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and st.st_mode & 0o777 != 0o600:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (files created, renamed, unlinked) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
