"""The ``tiered-kv`` command line (``tiered_kv.cli.main.main``)."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
