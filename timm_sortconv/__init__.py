"""timm-sortconv: Sorting Convolution (rotation-invariant CNNs) for timm and PyTorch."""
from .layers import SortConv2d
from .ops import available_backends, get_geometry, sort_conv2d

__version__ = "0.1.0"

__all__ = ["SortConv2d", "available_backends", "get_geometry", "sort_conv2d", "__version__"]
