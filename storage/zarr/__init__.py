"""The Zarr backend: the same records as raw objects of a Zarr v3 group, on a local
directory, an S3-compatible bucket or any zarr Store; shareable by uncoordinated writers.

==============  ===========================================================================
store.py        :class:`ZarrStore`, the store (the group's layout: its module docstring)
objects.py      the object layer under it: record names, group metadata, the I/O pool and
                the interface of where the objects live
local.py        objects as files under a local directory
bucket.py       objects in an S3-compatible bucket (through :mod:`tiered_kv.storage.s3`)
generic.py      objects under any other zarr Store, through the zarr Store API
==============  ===========================================================================
"""

from __future__ import annotations

from .store import STORE_FORMAT_VERSION, ZarrStore

__all__ = ["STORE_FORMAT_VERSION", "ZarrStore"]
