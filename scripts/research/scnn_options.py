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
* ``align_guide``: for an SCNN whose convolutions align their windows (``sorting="align"``: one orientation per
  position, shared by the channels), the orientation read from a guide instead of the layer's own features: the
  input's channel mean less its minimum (the background becomes 0, which the zero padding continues), under a fixed
  Gaussian blur of ``align_guide`` pixels (0: none), 2x2 average-pooled down to each layer's map, put in as one
  more input channel with a zero weight and scaled by :data:`GUIDE_GAIN`, so that its first harmonic outweighs the
  features' wherever the blurred input varies (where it is flat the features still orient the window). A window
  then turns by the direction in which the input's mass lies at the blur's scale, so the windows of one part of
  the image turn alike and keep their relative orientations, which aligning each window by its own content
  forgets: the canonical turn, taken into every window at the scale of the image's parts (``GuideField``).
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
from typing import Dict, List, Optional, Sequence, Tuple, Union

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from timm_sortconv import SortConv2d
from timm_sortconv.antialias import DOWNSAMPLES, BlurPool2d, GaussianBlur2d, create_downsample, gaussian_kernel1d
from timm_sortconv.grid import CentredMaxPool2d
from timm_sortconv.models import SCNN, ConvNormAct

__all__ = ["DOWNSAMPLES", "GUIDE_GAIN", "INPUT_NORMS", "OPTIONS", "PADDING_MODES", "BlurPool2d", "GaussianBlur2d",
           "GuideField", "GuidedSortConv2d", "apply_options", "create_downsample", "create_model", "gaussian_kernel1d",
           "split_options"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
#: The keyword arguments this module takes beside a model's own.
OPTIONS = ("blur_sigma", "downsample", "padding_mode", "input_norm", "align_guide")
#: How much the guide's channel is scaled, so that its first harmonic outweighs the features' (their activations are
#: of order 1 after BatchNorm, a blurred normalised digit's gradient about 0.1 a pixel): float32 keeps 7 digits.
GUIDE_GAIN = 1e4
INPUT_NORMS = ("model", "unit")


def _blur_sigmas(blur_sigma: Union[float, Sequence[float]]) -> Tuple[float, ...]:
    sigmas = (blur_sigma,) * 6 if isinstance(blur_sigma, (int, float)) else tuple(blur_sigma)
    if len(sigmas) != 6 or any(isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0 for s in sigmas):
        raise ValueError(f"blur_sigma must be a number >= 0 or six of them (one per convolution), got {blur_sigma!r}")
    return sigmas


class GuideField(nn.Module):
    """The guide of ``align_guide`` (module docstring): set from the input of the model's ``features`` by a
    forward pre-hook, read by the :class:`GuidedSortConv2d` layers of the same forward."""

    def __init__(self, sigma: float) -> None:
        super().__init__()
        self.blur = GaussianBlur2d(sigma)
        self.map: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = x.mean(1, keepdim=True)
        return self.blur(base - base.amin(dim=(2, 3), keepdim=True)) * GUIDE_GAIN

    def hook(self, module: nn.Module, args: tuple) -> None:
        self.map = self(args[0])


class GuidedSortConv2d(SortConv2d):
    """A ``SortConv2d`` with ``sorting="align"`` whose windows turn by the guide's orientation: the guide (pooled
    to the input's size) is one more input channel, with a zero weight, whose first harmonic outweighs the others'
    (:class:`GuideField`). Parameters and ``state_dict`` keys are the layer's own."""

    guide_source: List[GuideField]  # a list, so that the field is not registered as this layer's child

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        guide = self.guide_source[0].map
        if guide is None:
            raise RuntimeError("GuidedSortConv2d: no guide was set; call the model, not its layers alone")
        factor = guide.shape[-1] // input.shape[-1]
        if factor < 1 or guide.shape[-2:] != (input.shape[-2] * factor, input.shape[-1] * factor):
            raise ValueError(f"align_guide: a {tuple(input.shape[-2:])} map is not the {tuple(guide.shape[-2:])} "
                             "input pooled 2x2 a whole number of times (use even sizes: 28, 56)")
        if factor > 1:
            guide = F.avg_pool2d(guide, factor)
        zero = weight.new_zeros(weight.shape[0], 1, *weight.shape[2:])
        return super()._conv_forward(torch.cat([input, guide.to(input.dtype)], 1), torch.cat([weight, zero], 1), bias)


def _guide(model: SCNN, sigma: float) -> None:
    convs = [m for m in model.modules() if isinstance(m, SortConv2d)]
    if not convs or any(conv.sorting != "align" or conv.groups != 1 for conv in convs):
        raise ValueError("align_guide is for SCNNs whose SortConv2d layers align with one orientation per position "
                         "(sorting='align', groups=1); got sortings "
                         f"{sorted({conv.sorting for conv in convs})}")
    model.align_guide = GuideField(sigma)
    model.features.register_forward_pre_hook(model.align_guide.hook)
    for conv in convs:
        conv.__class__ = GuidedSortConv2d
        conv.guide_source = [model.align_guide]


def apply_options(model: nn.Module, blur_sigma: Union[float, Sequence[float]] = 0.0, downsample: str = "max",
                  padding_mode: str = "zeros", input_norm: str = "model", align_guide: float = 0.0) -> SCNN:
    """``model`` (an ``SCNN``, with its pooling as built) given the options of the module docstring, in place.

    Every argument is checked before anything changes. The blur becomes a child ``pre`` of each block, before
    ``conv`` (the block's other names and the ``state_dict`` keys stay); the poolings are replaced, their grid
    placed as the model's own (``stride_align``); with ``align_guide`` the aligned convolutions become
    :class:`GuidedSortConv2d` and the model has a child ``align_guide`` (no parameters, no saved buffers).
    """
    if not isinstance(model, SCNN):
        raise ValueError(f"the options {', '.join(OPTIONS)} are for SCNN models, got {type(model).__name__}")
    sigmas = _blur_sigmas(blur_sigma)
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode={padding_mode!r} is not accepted; use one of {PADDING_MODES}")
    if input_norm not in INPUT_NORMS:
        raise ValueError(f"input_norm={input_norm!r} is not accepted; use one of {INPUT_NORMS}")
    if isinstance(align_guide, bool) or not isinstance(align_guide, (int, float)) or not align_guide >= 0:
        raise ValueError(f"align_guide must be a blur of >= 0 pixels (0: none), got {align_guide!r}")
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
    if align_guide:
        _guide(model, align_guide)
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
