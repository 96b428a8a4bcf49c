"""``python -m tiered_kv.cli``: the same as the ``tiered-kv`` command."""
from __future__ import annotations

from .main import main

raise SystemExit(main())
