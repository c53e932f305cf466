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
* ``input_norm``: the input's normalisation, which the paper does not state: ``"model"`` (the model's
  ``pretrained_cfg`` mean and std, MNIST's 0.1307 and 0.3081: the background is -0.42) or ``"unit"`` (mean 0,
  std 1: the pixels on [0, 1] as ``ToTensor`` alone gives them, the background 0, the value the first layer pads
  with). It sets the model's ``pretrained_cfg`` (a copy), which the research tools normalise with.
Why they keep SC's exact invariance to quarter turns: the layers have no parameters (their kernels are buffers,
not saved, so the ``state_dict`` keys stay those of the model) and their kernels are symmetric under
``torch.rot90``: :class:`GaussianBlur2d` has an odd kernel centred on a pixel, and :class:`BlurPool2d`'s output
pixels sit where a 2x2 pooling's tiles are centred, which a quarter turn maps onto themselves on an even-sized
map, and on any map with ``stride_align="centre"`` (:mod:`timm_sortconv.grid`). A model is built first (its
random weights drawn as without the options) and changed after, so a seed gives the same initial weights with
and without them.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Sequence, Tuple, Union

import timm
import torch.nn as nn

from timm_sortconv.antialias import DOWNSAMPLES, BlurPool2d, GaussianBlur2d, create_downsample, gaussian_kernel1d
from timm_sortconv.grid import CentredMaxPool2d
from timm_sortconv.models import SCNN, ConvNormAct

__all__ = ["DOWNSAMPLES", "INPUT_NORMS", "OPTIONS", "PADDING_MODES", "BlurPool2d", "GaussianBlur2d", "apply_options",
           "create_downsample", "create_model", "gaussian_kernel1d", "split_options"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
#: The keyword arguments this module takes beside a model's own.
OPTIONS = ("blur_sigma", "downsample", "padding_mode", "input_norm")
INPUT_NORMS = ("model", "unit")


def _blur_sigmas(blur_sigma: Union[float, Sequence[float]]) -> Tuple[float, ...]:
    sigmas = (blur_sigma,) * 6 if isinstance(blur_sigma, (int, float)) else tuple(blur_sigma)
    if len(sigmas) != 6 or any(isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 for s in sigmas):
        raise ValueError(f"blur_sigma must be a number >= 0 or six of them (one per convolution), got {blur_sigma!r}")
    return sigmas


def apply_options(model: nn.Module, blur_sigma: Union[float, Sequence[float]] = 0.0, downsample: str = "max",
                  padding_mode: str = "zeros", input_norm: str = "model") -> SCNN:
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
    if input_norm not in INPUT_NORMS:
        raise ValueError(f"input_norm={input_norm!r} is not accepted; use one of {INPUT_NORMS}")
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
    if input_norm == "unit":
        channels = model.features[0].conv.in_channels
        cfg = getattr(model, "pretrained_cfg", None) or {}  # the bare SCNN class has none
        model.pretrained_cfg = {**cfg, "mean": (0.0,) * channels, "std": (1.0,) * channels}
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
