"""Only the optional native helper lives here; everything else is in pyproject.toml.

``tiered_kv.storage.os._fastread`` (storage/os/_fastread.c) reads a record's parts and hashes
them with the GIL released. It is optional: where it cannot be compiled (no C compiler or
Python headers) the package installs without it and storage/os/fastread.py uses its Python
implementation, with the same results.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tiered_kv.storage.os._fastread", ["storage/os/_fastread.c"], optional=True,
                             extra_compile_args=["-O2"])])
