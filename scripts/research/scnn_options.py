"""The SCNN options the MNIST-rot ablation tried and the package does not ship: fixed low-pass layers, blurred
downsampling and other padding modes, put into a built ``timm_sortconv.models.SCNN`` by module surgery.

``ablation.py`` and ``dip_probe.py`` take them as ``--model-kwargs`` beside the model's own arguments
(:func:`create_model`); RESULTS.md lists what each did (none closed the dip between the quarter turns):

* ``blur_sigma``: a fixed Gaussian blur of that many pixels before each of the six convolutions (one number
  for all, or six; 0: none). It removes the content that varies fastest between SC's samples.
* ``downsample``: the two 2x downsamplings: ``"max"`` (the paper's 2x2 max pooling), ``"avg"`` (2x2 average
  pooling), ``"blur-max"`` or ``"blur-avg"`` (:class:`BlurPool2d`).
* ``padding_mode``: how the six convolutions pad (``"zeros"``, the paper's, or ``"reflect"``, ``"replicate"``,
  ``"circular"``). With zeros every map has a frame of zeros, which the layers see as content (the background
  of a normalised MNIST image is not 0) and which, unlike the digit, does not turn with the input.

Why they keep SC's exact invariance to quarter turns: the layers have no parameters (their kernels are buffers,
not saved, so the ``state_dict`` keys stay those of the model) and their kernels are symmetric under
``torch.rot90``: :class:`GaussianBlur2d` has an odd kernel centred on a pixel, and :class:`BlurPool2d`'s output
pixels sit where a 2x2 pooling's tiles are centred, which a quarter turn maps onto themselves on an even-sized
map, and on any map with ``stride_align="centre"`` (:mod:`timm_sortconv.grid`). A model is built first (its
random weights drawn as without the options) and changed after, so a seed gives the same initial weights with
and without them.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, Sequence, Tuple, Union

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module

from timm_sortconv.grid import CentredMaxPool2d, centre_grid, check_stride_align, pool_class
from timm_sortconv.models import SCNN, ConvNormAct

__all__ = ["DOWNSAMPLES", "OPTIONS", "PADDING_MODES", "BlurPool2d", "GaussianBlur2d", "apply_options",
           "create_downsample", "create_model", "gaussian_kernel1d", "split_options"]

DOWNSAMPLES = ("max", "avg", "blur-avg", "blur-max")
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
#: The keyword arguments this module takes beside a model's own.
OPTIONS = ("blur_sigma", "downsample", "padding_mode")


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


def create_downsample(name: str, stride_align: str = "centre") -> nn.Module:
    """The 2x downsampling ``name``: ``"max"``/``"avg"`` (2x2 pooling, stride 2) or ``"blur-avg"``/
    ``"blur-max"`` (:class:`BlurPool2d`), its grid placed by ``stride_align`` (:mod:`timm_sortconv.grid`)."""
    if name in ("max", "avg"):
        return pool_class(name, stride_align)(kernel_size=2, stride=2)
    if name in ("blur-avg", "blur-max"):
        return BlurPool2d(name.split("-")[1], stride_align)
    raise ValueError(f"downsample={name!r} is not accepted; use one of {', '.join(map(repr, DOWNSAMPLES))}")


def _blur_sigmas(blur_sigma: Union[float, Sequence[float]]) -> Tuple[float, ...]:
    sigmas = (blur_sigma,) * 6 if isinstance(blur_sigma, (int, float)) else tuple(blur_sigma)
    if len(sigmas) != 6 or any(isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 for s in sigmas):
        raise ValueError(f"blur_sigma must be a number >= 0 or six of them (one per convolution), got {blur_sigma!r}")
    return sigmas


def apply_options(model: nn.Module, blur_sigma: Union[float, Sequence[float]] = 0.0, downsample: str = "max",
                  padding_mode: str = "zeros") -> SCNN:
    """``model`` (an ``SCNN``, with its pooling as built) given the options of the module docstring, in place.

    Every argument is checked before anything changes. The blur becomes a child ``pre`` of each block, before
    ``conv`` (the block's other names and the ``state_dict`` keys stay); the poolings are replaced, their grid
    placed as the model's own (``stride_align``).
    """
    if not isinstance(model, SCNN):
        raise ValueError(f"the options {', '.join(OPTIONS)} are for SCNN models, got {type(model).__name__}")
    sigmas = _blur_sigmas(blur_sigma)
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode={padding_mode!r} is not accepted; use one of {PADDING_MODES}")
    pools = [i for i, m in enumerate(model.features) if isinstance(m, nn.MaxPool2d)]
    stride_align = "centre" if isinstance(model.features[pools[0]], CentredMaxPool2d) else "corner"
    create_downsample(downsample, stride_align)  # checks the name
    blocks = [i for i, m in enumerate(model.features) if isinstance(m, ConvNormAct)]
    for index, sigma in zip(blocks, sigmas):
        block = model.features[index]
        block.conv.padding_mode = padding_mode  # nn.Conv2d and SortConv2d read it on every call
        if sigma > 0:
            model.features[index] = nn.Sequential(OrderedDict([("pre", GaussianBlur2d(sigma)),
                                                               *block.named_children()]))
    if downsample != "max":
        for index in pools:
            model.features[index] = create_downsample(downsample, stride_align)
    return model


def split_options(kwargs: Dict) -> Tuple[Dict, Dict]:
    """``(the model's own arguments, this module's options)`` of one ``--model-kwargs`` dictionary."""
    return ({k: v for k, v in kwargs.items() if k not in OPTIONS}, {k: v for k, v in kwargs.items() if k in OPTIONS})


def create_model(name: str, pretrained: bool = False, **kwargs) -> nn.Module:
    """``timm.create_model(name, pretrained, ...)`` (``"scnn"``: the ``SCNN`` class itself, for variants that no
    entrypoint names) with the options of the module docstring among ``kwargs`` applied after it is built (and its
    weights loaded)."""
    model_kwargs, options = split_options(kwargs)
    if name == "scnn":
        if pretrained:
            raise ValueError("scnn: no weights for the class itself; name a registered model for pretrained=True")
        model = SCNN(**model_kwargs)
    else:
        model = timm.create_model(name, pretrained=pretrained, **model_kwargs)
    return apply_options(model, **options) if options else model
