"""Fixed low-pass layers that keep a map's quarter-turn symmetry: a Gaussian blur and blurred 2x downsampling.

Sorting Convolution reads each window through a few samples (``8r`` on the ring of radius ``r``); what a
rotation by an angle between the quarter turns changes most is content that varies fast between
neighbouring samples or pixels. These layers remove some of it before SC samples a map or before a
map is subsampled. They have no parameters (their kernels are buffers) and their kernels are
symmetric under ``torch.rot90``, so a network built from them keeps SC's exact invariance to quarter
turns: :class:`GaussianBlur2d` has an odd kernel centred on a pixel, and :class:`BlurPool2d`'s output
pixels sit where a 2x2 pooling's tiles are centred, which a quarter turn maps onto themselves on an
even-sized map, and on any map with ``stride_align="centre"`` (:mod:`timm_sortconv.grid`).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import register_notrace_module

from .grid import centre_grid, check_stride_align, pool_class

__all__ = ["DOWNSAMPLES", "BlurPool2d", "GaussianBlur2d", "create_downsample", "gaussian_kernel1d"]


def gaussian_kernel1d(sigma: float, dtype=torch.float32) -> torch.Tensor:
    """The sampled Gaussian of standard deviation ``sigma`` pixels on ``-r..r``, ``r = ceil(2 sigma)``,
    normalised to sum 1.

    >>> gaussian_kernel1d(0.5)
    tensor([0.1065, 0.7870, 0.1065])
    """
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be a positive number of pixels, got {sigma!r}")
    radius = math.ceil(2 * sigma)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64)
    kernel = torch.exp(-x ** 2 / (2 * sigma ** 2))
    return (kernel / kernel.sum()).to(dtype)


class _SeparableFilter(nn.Module):
    """A fixed separable filter ``kernel x kernel`` applied to each channel, zero padding."""

    def __init__(self, kernel: torch.Tensor, stride: int, padding: int) -> None:
        super().__init__()
        self.register_buffer("kernel", kernel.clone(), persistent=False)
        self.stride = stride
        self.padding = padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels = x.shape[1]
        k = self.kernel.to(x.dtype)
        # Rows then columns: two 1-D depthwise passes, the same result as the 2-D outer product.
        x = F.conv2d(x, k.view(1, 1, -1, 1).expand(channels, 1, -1, 1), stride=(self.stride, 1),
                     padding=(self.padding, 0), groups=channels)
        return F.conv2d(x, k.view(1, 1, 1, -1).expand(channels, 1, 1, -1), stride=(1, self.stride),
                        padding=(0, self.padding), groups=channels)

    def extra_repr(self) -> str:
        return f"kernel={[round(v, 4) for v in self.kernel.tolist()]}, stride={self.stride}, padding={self.padding}"


class GaussianBlur2d(_SeparableFilter):
    """A fixed Gaussian blur of standard deviation ``sigma`` pixels, per channel, same size out (zero padding).

    Example:
        >>> blur = GaussianBlur2d(0.7)
        >>> x = torch.randn(2, 3, 8, 8)
        >>> torch.allclose(blur(torch.rot90(x, 1, (2, 3))), torch.rot90(blur(x), 1, (2, 3)), atol=1e-6)
        True
    """

    def __init__(self, sigma: float) -> None:
        kernel = gaussian_kernel1d(sigma)
        super().__init__(kernel, stride=1, padding=len(kernel) // 2)
        self.sigma = sigma


@register_notrace_module  # its centring branches on the input's size (FX feature extraction keeps it whole)
class BlurPool2d(nn.Module):
    """2x downsampling after a low-pass: ``mode="avg"`` filters with the binomial ``[1, 3, 3, 1] / 8`` (per
    axis) at stride 2, ``mode="max"`` takes the 2x2 maximum at stride 1 first and then filters with
    ``[1, 2, 1] / 4`` at stride 2 (Zhang, *Making Convolutional Networks Shift-Invariant Again*, 2019).

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

    def __init__(self, mode: str = "avg", stride_align: str = "centre") -> None:
        super().__init__()
        if mode not in ("avg", "max"):
            raise ValueError(f"BlurPool2d mode={mode!r} is not accepted; use 'avg' or 'max'")
        self.mode = mode
        self.stride_align = check_stride_align(stride_align)
        if mode == "avg":
            self.filter = _SeparableFilter(torch.tensor([1.0, 3.0, 3.0, 1.0]) / 8, stride=2, padding=1)
        else:
            self.filter = _SeparableFilter(torch.tensor([1.0, 2.0, 1.0]) / 4, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "max":
            x = F.max_pool2d(x, kernel_size=2, stride=1)
        if self.stride_align == "centre":
            taps = self.filter.kernel.shape[0]
            x = centre_grid(x, [taps, taps], [2, 2], [self.filter.padding, self.filter.padding], [1, 1])
        return self.filter(x)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, stride_align={self.stride_align!r}"


DOWNSAMPLES = ("max", "avg", "blur-avg", "blur-max")


def create_downsample(name: str, stride_align: str = "centre") -> nn.Module:
    """The 2x downsampling ``name``: ``"max"``/``"avg"`` (2x2 pooling, stride 2) or ``"blur-avg"``/
    ``"blur-max"`` (:class:`BlurPool2d`), its grid placed by ``stride_align`` (:mod:`timm_sortconv.grid`)."""
    if name in ("max", "avg"):
        return pool_class(name, stride_align)(kernel_size=2, stride=2)
    if name in ("blur-avg", "blur-max"):
        return BlurPool2d(name.split("-")[1], stride_align)
    raise ValueError(f"downsample={name!r} is not accepted; use one of {', '.join(map(repr, DOWNSAMPLES))}")
