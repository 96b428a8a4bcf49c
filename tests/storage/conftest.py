"""Fixtures of the storage tests."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A 4 MiB tmpfs mounted under tmp_path (a real full disk); skipped if not permitted."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
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
