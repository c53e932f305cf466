"""timm-sortconv: Sorting Convolution (rotation-invariant CNNs) for timm and PyTorch.

Importing the package registers its models with timm (``scnn_*``, ``ri_vgg16``, ``ri_resnet18``,
``ri_densenet40`` and their ``*_baseline`` twins).

Layout, from the operator to the product: :mod:`.ops` (sampling geometry, the reference path, the
functional ``sort_conv2d`` and its fast backends) -> :mod:`.layers` (``SortConv2d``, ``SortConv2dSame``) ->
:mod:`.sortify` (the conversion pass for any model) -> :mod:`.models` (the paper's networks, timm style)
-> :mod:`.rotation` (rotating images), :mod:`.data` (data sets, MNIST-rot), :mod:`.invariance` (per-angle
results) -> :mod:`.hub` (weights), :mod:`.onnx` (export and deployment) and :mod:`.cli` (train, validate, demo and
the other tools).
"""
from . import models, onnx
from .invariance import QuarterTurnCheck, RotationSweep, quarter_turn_check, rotation_sweep
from .layers import SortConv2d, SortConv2dSame
from .ops import available_backends, get_geometry, sort_conv2d
from .rotation import rotate
from .sortify import SortifyReport, sortify
from .version import __version__


__all__ = [
    "QuarterTurnCheck",
    "RotationSweep",
    "SortConv2d",
    "SortConv2dSame",
    "SortifyReport",
    "available_backends",
    "get_geometry",
    "quarter_turn_check",
    "rotate",
    "rotation_sweep",
    "sort_conv2d",
    "sortify",
    "__version__",
]
