"""timm-sortconv: Sorting Convolution (rotation-invariant CNNs) for timm and PyTorch.

Importing the package registers its models with timm (``scnn_*``, ``ri_vgg16``, ``ri_resnet18``,
``ri_densenet40`` and their ``*_baseline`` twins).
"""
from . import models
from .layers import SortConv2d
from .ops import available_backends, get_geometry, sort_conv2d
from .sortify import SortConv2dSame, SortifyReport, sortify

_INVARIANCE_NAMES = ("RotationSweep", "rotate", "rotation_sweep")


def __getattr__(name):
    # The rotation-sweep helpers are imported on first use, so that ``python -m timm_sortconv.invariance``
    # does not find its own module already imported by the package (runpy warns about that).
    if name in _INVARIANCE_NAMES:
        from . import invariance

        return getattr(invariance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "RotationSweep",
    "SortConv2d",
    "SortConv2dSame",
    "SortifyReport",
    "available_backends",
    "get_geometry",
    "rotate",
    "rotation_sweep",
    "sort_conv2d",
    "sortify",
    "__version__",
]
