"""Hot-path guards: catch operations that make the host wait for the device.

A decode step must not synchronize with the GPU: every ``.item()``, ``nonzero()``,
boolean-mask index or device-to-host copy stalls the CPU until the queue drains, breaks
CUDA-graph capture, and hides in innocuous-looking code. :class:`SyncDetector` fails at
the first such operation on tensors of a *watched* device::

    with SyncDetector(cache.device):
        slots = cache.swap_in_batch(requests, layer, ids)   # raises HostSyncError if it syncs

It works without a GPU: watch ``"cpu"`` and it flags the very operations that would sync
on a GPU (values read back into Python, data-dependent output shapes), so CPU CI proves a
path sync-free before it ever runs on a device. On a GPU, ``torch.cuda.set_sync_debug_mode
("error")`` is the runtime's own check of the same property; the gpu tests use both.

Flagged (on a watched tensor):
  * reading values into Python: ``item``, ``tolist``, ``numpy``, ``bool()``/``int()``/
    ``float()``/``index()`` (``aten::_local_scalar_dense``, ``aten::equal``, ``is_nonzero``)
  * data-dependent shapes: ``nonzero``/``argwhere``, ``unique*``, ``masked_select``,
    boolean-mask indexing and index-put, ``repeat_interleave`` with tensor repeats
  * copies from a watched CUDA device to the CPU
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["HostSyncError", "SyncDetector"]


class HostSyncError(AssertionError):
    """An operation that synchronizes the host with the device ran under :class:`SyncDetector`."""


_aten = torch.ops.aten
#: aten overload packets that read device values back or produce data-dependent shapes
_SYNCING_OPS = {
    _aten._local_scalar_dense, _aten.item, _aten.equal, _aten.allclose, _aten.is_nonzero,
    _aten.nonzero, _aten.argwhere, _aten.masked_select,
    _aten.unique_dim, _aten._unique, _aten._unique2, _aten.unique_consecutive, _aten.unique_dim_consecutive,
}
#: ops that sync only with boolean (mask) indices
_MASK_INDEXED = {_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_}
_TENSOR_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _tensors(args: Iterable[Any]) -> list[torch.Tensor]:
    return [a for a in tree_leaves(list(args)) if isinstance(a, torch.Tensor)]


class _Taint:
    """Storages holding cache state, or values computed from it (``owned`` mode).

    Outputs of an op with a tainted input are tainted too, and kept alive until the
    detector exits so that a freed address is never reused by an untainted tensor."""

    def __init__(self, owned: Iterable[torch.Tensor]) -> None:
        self.ptrs = {t.untyped_storage().data_ptr() for t in owned}
        self._keep: list[Any] = []

    def has(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.ptrs

    def spread(self, inputs: list[torch.Tensor], out: Any) -> None:
        if any(self.has(t) for t in inputs):
            outs = _tensors([out])
            self.ptrs.update(t.untyped_storage().data_ptr() for t in outs)
            self._keep.append(outs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, watch: torch.device, fired: list[str], taint: _Taint | None) -> None:
        super().__init__()
        self.watch = watch
        self.fired = fired
        self.taint = taint

    def _watched(self, ts: list[torch.Tensor]) -> bool:
        return any(t.device == self.watch and (self.taint is None or self.taint.has(t)) for t in ts)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        ts = _tensors((args, kwargs))
        why = None
        if packet in _SYNCING_OPS and self._watched(ts):
            why = f"aten::{packet.__name__} on a {self.watch} tensor"
        elif packet in _MASK_INDEXED and self._watched(ts):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                why = f"aten::{packet.__name__} with a boolean mask (data-dependent shape)"
        elif packet is _aten.repeat_interleave and ts and isinstance(args[0], torch.Tensor) \
                and self._watched(ts) and (len(args) < 2 or isinstance(args[1], torch.Tensor)):
            why = "aten::repeat_interleave with tensor repeats (data-dependent shape)"
        elif self.watch.type != "cpu" and packet in (_aten._to_copy, _aten.copy_) and self._watched(ts):
            dst_cpu = (kwargs.get("device") == torch.device("cpu") if packet is _aten._to_copy
                       else args[0].device.type == "cpu")
            if dst_cpu:
                why = f"aten::{packet.__name__} from {self.watch} to the CPU"
        if why is not None:
            self.fired.append(why)
            raise HostSyncError(f"host sync under SyncDetector: {why}")
        out = func(*args, **kwargs)
        if self.taint is not None:
            self.taint.spread(ts, out)
        return out


class _Function(TorchFunctionMode):
    def __init__(self, watch: torch.device, fired: list[str], taint: _Taint | None) -> None:
        super().__init__()
        self.watch = watch
        self.fired = fired
        self.taint = taint

    def _flagged(self, t: torch.Tensor) -> bool:
        return t.device == self.watch and (self.taint is None or self.taint.has(t))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _TENSOR_METHODS and args and isinstance(args[0], torch.Tensor) and self._flagged(args[0]):
            why = f"Tensor.{name}() on a {self.watch} tensor"
            self.fired.append(why)
            raise HostSyncError(f"host sync under SyncDetector: {why}")
        return func(*args, **kwargs)


class SyncDetector:
    """Context manager that raises :class:`HostSyncError` at the first host-syncing op on
    tensors of ``device`` (default: CUDA if available, else CPU). ``fired`` lists what
    fired (also when the error was caught inside the block).

    ``owned``: on the CPU, host-side index arithmetic (checking entry ids the caller
    passed as host tensors) is legitimate and looks like a value read-back. Pass the
    tensors that live on the device in a real deployment (pools, State, device tables,
    HiSparse buffers and LRU state) and every check applies only to those storages and to
    values computed from them (taint propagates through each op's outputs): the
    detector then proves that nothing derived from device-resident cache state is read
    back to the host or given a data-dependent shape, while host index math goes free.
    """

    def __init__(self, device: str | torch.device = "cpu", *, owned: Iterable[torch.Tensor] | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.fired: list[str] = []
        self._owned = None if owned is None else list(owned)
        self._modes: tuple[_Function, _Dispatch] | None = None

    def __enter__(self) -> SyncDetector:
        taint = None if self._owned is None else _Taint(self._owned)
        self._modes = (_Function(self.device, self.fired, taint), _Dispatch(self.device, self.fired, taint))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._modes is not None
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = None
