"""The Sorting Convolution operator: geometry, functional op and backends."""
from .backends import available_backends, register_backend
from . import cpu_backend  # noqa: F401  (registers the fused CPU backend)
from . import triton_backend  # noqa: F401  (registers the Triton backend, CUDA tensors only)
from .checks import PADDING_MODES
from .functional import sort_conv2d
from .geometry import SAMPLINGS, SORTINGS, SortGeometry, get_geometry

__all__ = [
    "PADDING_MODES",
    "SAMPLINGS",
    "SORTINGS",
    "SortGeometry",
    "available_backends",
    "get_geometry",
    "register_backend",
    "sort_conv2d",
]
