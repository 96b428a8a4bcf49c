"""Module paths of ``tiered_kv.storage`` from before its layers (issue 24), kept importable.

The storage package was flat: ``tiered_kv.storage.lmdb_store``, ``.segments``,
``.record``... Its modules now live in one sub-package per layer (``os/``, ``format/``,
``api/``, ``lmdb/``, ``zarr/``, ``s3/``, ``encrypted/``, ``chain/``; see
docs/architecture.md §6). Code written against the old paths (another branch, an
engine's plug-in, a notebook) keeps working: importing an old path gives the module
that now holds, or re-exports, what the old one held, the very same module object (so
``isinstance`` checks and ``monkeypatch`` of its names behave as before)::

    import tiered_kv.storage.lmdb_store as m     # m is tiered_kv.storage.lmdb
    from tiered_kv.storage.record import RecordKey   # the same class as format.record's

New code imports the new paths. :data:`MOVED` is the whole table; a test checks that
each old path still gives every name its old ``__all__`` listed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["MOVED", "install"]

#: old module (relative to tiered_kv.storage) -> the module that now holds its names
MOVED: dict[str, str] = {
    "at_exit": "os.at_exit",
    "base": "api",
    "counters": "api.counters",
    "crypto": "encrypted.crypto",
    "envelope_reads": "encrypted.envelopes",
    "fastread": "os.fastread",
    "group_commit": "lmdb.group_commit",
    "journal": "chain.journal",
    "key_files": "encrypted.key_files",
    "lmdb_file": "lmdb.pages",
    "lmdb_rebuild": "lmdb.rebuild",
    "lmdb_store": "lmdb",
    "names": "encrypted.names",
    "record": "format.record",
    "rekey_journal": "encrypted.rekey_journal",
    "rows": "format.rows",
    "sealed_level": "format.sealed_level",
    "segments": "lmdb.segments",
    "thread_pool": "os.threads",
    "writer": "format.writer",
    "xaes": "encrypted.xaes",
    "zarr_api": "zarr.generic",
    "zarr_local": "zarr.local",
    "zarr_objects": "zarr.objects",
    "zarr_s3": "zarr.bucket",
    "zarr_store": "zarr",
}

_PACKAGE = __name__.rpartition(".")[0]  # tiered_kv.storage


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as the new module itself."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != _PACKAGE or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(f"{_PACKAGE}.{MOVED[spec.name.rpartition('.')[2]]}")
        spec.loader_state = module.__spec__  # (the import system sets the old path's spec on it next)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # its own spec back


_FINDER = _MovedModules()


def install() -> None:
    """Make the old paths importable (idempotent; ``tiered_kv.storage`` calls it)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
