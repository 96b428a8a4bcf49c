"""Read a stored record's parts and hash them in one step: the inner loop of verified reads.

:func:`read_and_hash` ``(fd, offset, bufs) -> (bytes read, digest or None)`` fills the
writable buffers ``bufs`` (a record's header, the caller's payload pieces, its stored
checksum: in file order) from ``fd`` at ``offset`` and returns the canonical xxh3-128 of
every buffer but the last, the value the record's checksum must equal (None when the file
ended first). Two implementations, with the same results:

- native (``storage/os/_fastread.c``, built by ``pip install`` where a C compiler exists): one
  call does the ``preadv`` and the hashing with the GIL released, whatever the number of
  pieces. It uses xxHash's own streaming functions as exported by the python-xxhash module
  already loaded in the process (its x86 dispatcher's update, which picks AVX2 or AVX-512
  at run time, where it exports one), bound through ctypes and checked against
  python-xxhash before first use;
- Python: ``os.preadv`` (GIL released) then python-xxhash, piece by piece (the GIL is
  released only for pieces over 64 KiB).

Natively, :data:`read_verify_many` also reads and checks a whole batch of records in one
call (the header checks of :class:`~tiered_kv.storage.record.PartsVerifier` included), the
GIL released once, spread over helper threads of its own (kept between calls) that take
the next record as they finish one; :data:`VerifyBatch` does the same for records handed
over one at a time, so that the helpers read the first ones while the caller prepares the
next. Each record is read in runs of 128 KiB, each hashed right after it is read, while it
is in the CPU's cache.

:data:`NATIVE` says which one is in use; ``TIERED_KV_NATIVE=0`` in the environment forces
the Python one (tests run both).
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from ..format.record import HEADER_LAYOUT
from ..format.status import FAILED, NATIVE_NAMES, SHORT, UNCACHED, VERIFIED
from .preadv import preadv_all

__all__ = ["FAILED", "NATIVE", "SHORT", "UNCACHED", "VERIFIED", "VerifyBatch", "digest_parts", "layout_mismatches",
           "native_VerifyBatch",
           "native_read_and_hash", "native_read_verify_many", "native_verify_copy_many", "python_read_and_hash", "read_and_hash",
           "read_verify_many", "verify_copy_many"]

_XXH3_SYMBOLS = ("XXH3_createState", "XXH3_freeState", "XXH3_128bits_reset", "XXH3_128bits_update",
                 "XXH3_128bits_digest")


def digest_parts(parts: Sequence[Any]) -> bytes:
    """The canonical xxh3-128 of ``parts`` (buffers) hashed in order."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def _self_test(fn: Callable[[int, int, Sequence[Any]], tuple[int, bytes | None]]) -> bool:
    """Whether ``fn`` reads and hashes like os.preadv + python-xxhash, short reads included."""
    import numpy as np

    data = np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8)
    fd = os.memfd_create("tiered-kv-fastread-check") if hasattr(os, "memfd_create") else -1
    if fd < 0:
        return False
    try:
        os.write(fd, data.tobytes())
        cuts = [0, 144, 145, 70_000, 199_984, 200_000]
        bufs = [np.zeros(b - a, np.uint8) for a, b in zip(cuts, cuts[1:])]
        got, digest = fn(fd, 0, bufs)
        whole = got == data.nbytes and digest == xxhash.xxh3_128(data[:-16]).digest()
        whole = whole and all(np.array_equal(b, data[a:a + b.nbytes]) for a, b in zip(cuts, bufs))
        got, digest = fn(fd, 100, [np.zeros(144, np.uint8), np.zeros(200_000, np.uint8), np.zeros(16, np.uint8)])
        return whole and got == data.nbytes - 100 and digest is None
    finally:
        os.close(fd)


def layout_mismatches(ext: Any) -> list[str]:
    """What the native module ``ext`` was compiled with that differs from the Python
    definitions: the header layout (:data:`~..format.record.HEADER_LAYOUT`) and the read
    statuses (:mod:`~..format.status`); empty when it reads this format."""
    want = {**HEADER_LAYOUT, **{name: int(status) for name, status in NATIVE_NAMES.items()}}
    return [f"{name} = {getattr(ext, name, None)} (Python: {value})" for name, value in want.items()
            if getattr(ext, name, None) != value]


def _bind_native() -> Callable[[int, int, Sequence[Any]], tuple[int, bytes | None]] | None:
    """The native read_and_hash, bound to python-xxhash's exported xxh3 functions; None
    where the module was not built, was built for another record format (with a warning:
    :func:`layout_mismatches`), the symbols are not exported, or the check fails."""
    try:
        from . import _fastread  # type: ignore[attr-defined]
        from xxhash import _xxhash
    except ImportError:
        return None
    mismatches = layout_mismatches(_fastread)
    if mismatches:
        warnings.warn(f"tiered_kv.storage: the native read helper ({_fastread.__file__}) was built for another "
                      f"record format ({'; '.join(mismatches)}): using the Python read path (rebuild it: "
                      f"pip install -e .)", RuntimeWarning, stacklevel=2)
        return None
    try:
        lib = ctypes.CDLL(_xxhash.__file__)  # already loaded: the same handle, nothing new mapped
        names = list(_XXH3_SYMBOLS)
        if hasattr(lib, "XXH3_128bits_update_dispatch"):  # x86: picks AVX2 / AVX-512 at run time
            names[3] = "XXH3_128bits_update_dispatch"
        addresses = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
        _fastread.bind_xxh3(*addresses)
    except (OSError, AttributeError, TypeError, ValueError):
        return None
    fn = _fastread.read_and_hash
    try:
        return fn if _self_test(fn) else None
    except OSError:
        return None


#: The native implementation where it was built and passed its check, else None.
native_read_and_hash = _bind_native()
NATIVE = native_read_and_hash is not None and os.environ.get("TIERED_KV_NATIVE", "1") != "0"


def python_read_and_hash(fd: int, offset: int, bufs: Sequence[Any]) -> tuple[int, bytes | None]:
    """:data:`read_and_hash` in Python: ``os.preadv``, then python-xxhash."""
    want = sum(b.nbytes for b in bufs)
    got = preadv_all(fd, list(bufs), offset, want)
    if got < want:
        return got, None
    return got, digest_parts(bufs[:-1])


#: ``read_verify_many(items) -> list[int]`` (native only; None otherwise): for each
#: ``(fd, offset, bufs, expect)`` read the record's parts and check them in one call for
#: the whole batch (the GIL released throughout): the header's known fields, its stored
#: checksum against the index's and against the xxh3-128 of header + payload, its token
#: digest; ``expect`` is :meth:`~tiered_kv.storage.record.PartsVerifier.expectation`.
#: Status :data:`VERIFIED`, :data:`SHORT` (not read whole: end of file, read error) or
#: :data:`FAILED` (a check failed). The same verdicts as read_and_hash + PartsVerifier.verify.
read_verify_many: Callable[[Sequence[tuple[int, int, Sequence[Any], bytes]]], list[int]] | None = None

#: ``read_and_hash(fd, offset, bufs) -> (bytes read, digest or None)``: fill ``bufs``
#: (writable 1-D uint8 buffers, the last one 16 bytes) from ``fd`` at ``offset`` and return
#: the canonical xxh3-128 of all but the last buffer, or None when the file ended first.
#: OSError on a read error. The native implementation where :data:`NATIVE`, else Python.
read_and_hash: Callable[[int, int, Sequence[Any]], tuple[int, bytes | None]] = (
    native_read_and_hash if NATIVE and native_read_and_hash is not None else python_read_and_hash)
#: The native read_verify_many where the helper was built and bound, else None.
native_read_verify_many: Callable[[Sequence[tuple[int, int, Sequence[Any], bytes]]], list[int]] | None = None
if native_read_and_hash is not None:
    from . import _fastread  # type: ignore[attr-defined]

    native_read_verify_many = _fastread.read_verify_many
#: ``VerifyBatch(capacity, threads=1, cached_only=False)`` (native only; None otherwise):
#: :data:`read_verify_many` fed one record at a time (``add(fd, offset, bufs, expect)``,
#: then ``finish() -> list[int]``), so that helper threads read and check the first records
#: while the caller prepares the next ones. ``cached_only``: a record whose pages are not
#: all in the page cache is not read (status :data:`UNCACHED`: the caller reads it on its
#: cold path). The same verdicts as read_verify_many.
VerifyBatch: Any = None
native_VerifyBatch: Any = None
if native_read_and_hash is not None:
    native_VerifyBatch = _fastread.VerifyBatch
if NATIVE:
    read_verify_many = native_read_verify_many
    VerifyBatch = native_VerifyBatch

#: ``read_verify_rows(dests, dest_of, lengths, offsets, where, expects) -> bytes`` (native
#: only; None otherwise): :data:`read_verify_many` for a batch whose payloads land in a few
#: large buffers, given as a :class:`~tiered_kv.storage.rows.RowScatter` (no buffer object
#: per piece); ``where``: ``[n, 2] int64`` (fd, offset); one status byte per record.
native_read_verify_rows: Callable[..., bytes] | None = (
    getattr(_fastread, "read_verify_rows", None) if native_read_and_hash is not None else None)
read_verify_rows: Callable[..., bytes] | None = native_read_verify_rows if NATIVE else None
#: ``verify_rows(src, at, dests, dest_of, lengths, offsets, expects) -> bytes`` (native only;
#: None otherwise): :data:`read_verify_rows` for records already in memory at ``at`` of
#: ``src`` (a cold read's O_DIRECT bounce buffer); a record is copied out once verified.
native_verify_rows: Callable[..., bytes] | None = (
    getattr(_fastread, "verify_rows", None) if native_read_and_hash is not None else None)
verify_rows: Callable[..., bytes] | None = native_verify_rows if NATIVE else None
#: ``verify_copy_many(src, items) -> list[int]`` (native only; None otherwise):
#: :data:`read_verify_many` for records already in memory (a cold read's O_DIRECT bounce
#: buffer): each ``(at, bufs, expect)`` copied from ``src[at:]`` into ``bufs`` and checked,
#: the copy and the hash fused (one pass over the bytes); the same statuses.
native_verify_copy_many: Callable[[Any, Sequence[tuple[int, Sequence[Any], bytes]]], list[int]] | None = (
    getattr(_fastread, "verify_copy_many", None) if native_read_and_hash is not None else None)
verify_copy_many: Callable[[Any, Sequence[tuple[int, Sequence[Any], bytes]]], list[int]] | None = (
    native_verify_copy_many if NATIVE else None)
