"""Fixed low-pass layers that keep a network's invariance: a Gaussian blur and blurred 2x downsampling.

Sorting Convolution is invariant to a turn of each window, but a window's samples between the pixels, and a
2x2 pooling's grid, see the fine detail of an image differently at each angle and each place. Low-passing
the input and the poolings removes that detail: on scenes whose parts are turned independently (RESULTS.md,
"Local rotations") ring-sorted SC then keeps its accuracy under the turns.

* :class:`GaussianBlur2d`: a blur of ``sigma`` pixels per channel, same size out.
* :class:`BlurPool2d`: 2x downsampling after a low-pass (Zhang, *Making Convolutional Networks Shift-Invariant
  Again*, ICML 2019): ``"max"``, the 2x2 maximum at stride 1 and then a ``[1, 2, 1] / 4`` filter at stride 2;
  ``"avg"``, a ``[1, 3, 3, 1] / 8`` filter at stride 2.

Neither has parameters (their kernels are buffers, not saved: a model's ``state_dict`` keys stay those without
them), and both commute with quarter turns: the blur's kernel is odd and centred on a pixel, and the blurred
pooling's output pixels sit where a 2x2 pooling's tiles are centred, which a quarter turn maps onto themselves on
an even-sized map, and on any map with ``stride_align="centre"`` (:mod:`timm_sortconv.grid`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module

from .grid import centre_grid, check_stride_align, pool_class

__all__ = ["DOWNSAMPLES", "BlurPool2d", "GaussianBlur2d", "create_downsample", "gaussian_kernel1d"]

#: The 2x downsamplings :func:`create_downsample` makes.
DOWNSAMPLES = ("max", "avg", "blur-max", "blur-avg")


def gaussian_kernel1d(sigma: float, dtype=torch.float32) -> torch.Tensor:
    """The sampled Gaussian of standard deviation ``sigma`` pixels on ``-r..r``, ``r = ceil(2 sigma)``,
    normalised to sum 1.

    >>> gaussian_kernel1d(0.5)
    tensor([0.1065, 0.7870, 0.1065])
    """
    if isinstance(sigma, bool) or not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a positive number of pixels, got {sigma!r}")
    radius = math.ceil(2 * sigma)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-x ** 2 / (2 * sigma ** 2))
    return (kernel / kernel.sum()).to(dtype)


class _SeparableFilter(nn.Module):
    """A fixed separable filter ``kernel x kernel`` applied to each channel, zero padding."""

    def __init__(self, kernel: torch.Tensor, stride: int, padding: int, device=None, dtype=None) -> None:
        super().__init__()
        self.register_buffer("kernel", kernel.to(device=device, dtype=dtype, copy=True), persistent=False)
        self.stride = stride
        self.padding = padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # int(): a traced size is a tensor, and an exported convolution needs a kernel of known shape (the channels
        # of a model's map are fixed; its height and width may vary)
        channels = int(x.shape[1])
        k = self.kernel.to(x.dtype)
        # Rows then columns: two 1-D depthwise passes, the same result as the 2-D outer product.
        x = F.conv2d(x, k.view(1, 1, -1, 1).expand(channels, 1, -1, 1), stride=(self.stride, 1),
                     padding=(self.padding, 0), groups=channels)
        return F.conv2d(x, k.view(1, 1, 1, -1).expand(channels, 1, 1, -1), stride=(1, self.stride),
                        padding=(0, self.padding), groups=channels)

    def extra_repr(self) -> str:
        return f"kernel={[round(v, 4) for v in self.kernel.tolist()]}, stride={self.stride}, padding={self.padding}"


@register_notrace_module  # reads its channel count from the input's shape (FX feature extraction keeps it whole)
class GaussianBlur2d(_SeparableFilter):
    """A fixed Gaussian blur of standard deviation ``sigma`` pixels, per channel, same size out (zero padding).

    Example:
        >>> blur = GaussianBlur2d(0.7)
        >>> x = torch.randn(2, 3, 8, 8)
        >>> torch.allclose(blur(torch.rot90(x, 1, (2, 3))), torch.rot90(blur(x), 1, (2, 3)), atol=1e-6)
        True
    """

    def __init__(self, sigma: float, device=None, dtype=None) -> None:
        kernel = gaussian_kernel1d(sigma)
        super().__init__(kernel, stride=1, padding=len(kernel) // 2, device=device, dtype=dtype)
        self.sigma = sigma


@register_notrace_module  # its centring branches on the input's size (FX feature extraction keeps it whole)
class BlurPool2d(nn.Module):
    """2x downsampling after a low-pass: ``mode="avg"`` filters with the binomial ``[1, 3, 3, 1] / 8`` (per
    axis) at stride 2, ``mode="max"`` takes the 2x2 maximum at stride 1 first and then filters with
    ``[1, 2, 1] / 4`` at stride 2.

    Either way an ``H x W`` map becomes ``floor(H / 2) x floor(W / 2)`` like a 2x2 pooling of stride 2, and
    output pixel ``j`` is centred where the 2x2 tile ``(2j, 2j + 1)`` is (``stride_align="corner"``) or where a
    centred 2x2 pooling's tile is (``"centre"``, :mod:`timm_sortconv.grid`; the same on even sides).

    Example:
        >>> pool = BlurPool2d("max")
        >>> x = torch.randn(1, 2, 28, 28)
        >>> pool(x).shape
        torch.Size([1, 2, 14, 14])
        >>> torch.allclose(pool(torch.rot90(x, 1, (2, 3))), torch.rot90(pool(x), 1, (2, 3)), atol=1e-6)
        True
    """

    def __init__(self, mode: str = "avg", stride_align: str = "centre", device=None, dtype=None) -> None:
        super().__init__()
        if mode not in ("avg", "max"):
            raise ValueError(f"BlurPool2d mode={mode!r} is not accepted; use 'avg' or 'max'")
        self.mode = mode
        self.stride_align = check_stride_align(stride_align)
        if mode == "avg":
            self.filter = _SeparableFilter(torch.tensor([1.0, 3.0, 3.0, 1.0]) / 8, stride=2, padding=1, device=device,
                                           dtype=dtype)
        else:
            self.filter = _SeparableFilter(torch.tensor([1.0, 2.0, 1.0]) / 4, stride=2, padding=1, device=device,
                                           dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "max":
            x = F.max_pool2d(x, kernel_size=2, stride=1)
        if self.stride_align == "centre":
            taps = self.filter.kernel.shape[0]
            x = centre_grid(x, [taps, taps], [2, 2], [self.filter.padding, self.filter.padding], [1, 1])
        return self.filter(x)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, stride_align={self.stride_align!r}"


def create_downsample(name: str, stride_align: str = "centre", device=None, dtype=None) -> nn.Module:
    """The 2x downsampling ``name``: ``"max"``/``"avg"`` (2x2 pooling, stride 2) or ``"blur-max"``/
    ``"blur-avg"`` (:class:`BlurPool2d`), its grid placed by ``stride_align`` (:mod:`timm_sortconv.grid`)."""
    if name in ("max", "avg"):
        return pool_class(name, stride_align)(kernel_size=2, stride=2)
    if name in ("blur-avg", "blur-max"):
        return BlurPool2d(name.split("-")[1], stride_align, device=device, dtype=dtype)
    raise ValueError(f"downsample={name!r} is not accepted; use one of {', '.join(map(repr, DOWNSAMPLES))}")
