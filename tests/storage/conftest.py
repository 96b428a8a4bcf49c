"""Fixtures of the storage tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``4m``) mounted at ``mnt`` (a real full disk); the test is
    skipped where mounting is not permitted."""
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs for the full-disk test: {e}")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for the full-disk test (needs root or CAP_SYS_ADMIN): "
                    f"{r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs mounted under tmp_path (a real full disk); skipped if not permitted."""
    with mounted_tmpfs(tmp_path / "tmpfs", "4m") as mnt:
        yield mnt


@pytest.fixture
def tmpfs_8m(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs mounted under tmp_path; skipped if not permitted."""
    with mounted_tmpfs(tmp_path / "tmpfs8", "8m") as mnt:
        yield mnt
