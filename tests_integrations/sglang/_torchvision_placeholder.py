"""An import-time placeholder for ``torchvision``, installed only where it cannot import.

SGLang's storage and host-pool modules import ``sglang.srt.configs``, whose multimodal
configs import ``torchvision.transforms`` at module level. PyPI has no CPU build of
torchvision for the CPU torch this venv uses (its wheels link ``libtorch_cuda.so``), so
the real package cannot load here. Nothing the tests exercise calls torchvision: the
placeholder only lets those module-level imports complete, and any use of it raises.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types


class _Unavailable(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"torchvision is a placeholder in this venv (no CPU build on PyPI); "
                           f"{self.__name__}.{name} is not available")


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def install() -> bool:
    """Register the placeholder if ``torchvision`` is not importable; True if it did."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    # transformers caches whether torchvision is available; ask it first, while the answer
    # is still the true one (absent), so it never routes work to the placeholder.
    try:
        from transformers.utils import import_utils
    except ImportError:
        pass
    else:
        import_utils.is_torchvision_available()
    root = _Unavailable("torchvision")
    root.__path__ = []  # a package, so submodule imports resolve to the entries below
    transforms = _Unavailable("torchvision.transforms")
    transforms.__path__ = []
    functional = _Unavailable("torchvision.transforms.functional")
    for mod in (transforms, functional):
        mod.InterpolationMode = InterpolationMode
    transforms.functional = functional
    root.transforms = transforms
    for mod in (root, transforms, functional):
        mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None, is_package=mod is not functional)
    sys.modules.update({m.__name__: m for m in (root, transforms, functional)})
    return True
