"""Guided alignment: every aligned window turned by the orientation of the model's blurred input around it.

``sorting="align"`` turns each window back by the orientation of its own content (:mod:`.ops.alignment`), which
forgets how the windows of one part of an image lie to each other. With a guide, a model's aligned layers read the
orientation of each window from one map made once per forward from the model's input instead:

* **The guide** (:class:`OrientationGuide`): the input's mean over its channels, less its minimum over the image
  (the background becomes 0, which zero padding continues), under a fixed Gaussian blur of ``blur`` pixels, times
  :data:`GAIN`. Its first harmonic in a window points where the input's mass lies at the blur's scale, so the
  windows of one part turn alike and keep their relative orientations: the canonical turn, taken into every window
  at the scale of the image's parts.
* **Where it is made**: a forward pre-hook on the model's first convolution (the one that reads the image in every
  timm and torchvision CNN; or the module named by ``source``) computes it once per forward, after anything in
  front of that convolution (the canonical turn, a normalisation).
* **How a layer reads it**: each guided ``SortConv2d`` pools the map to its own input size (adaptive average
  pooling, whose windows are mirror-symmetric, so the pooled map turns with the input) and takes it as one more
  input channel of each group: the operator's guide channel (:func:`.ops.checks.guide_channels`), which joins the
  orientation and has no weight (what a zero weight would give, without its products). The aligned operator sums
  the first harmonics of a group's channels into the window's orientation; scaled by :data:`GAIN`, the guide's
  outweighs the features' wherever the blurred input varies, and where it is flat (far from every part) the
  features orient the window as without a guide. The layer's parameters and ``state_dict`` keys are those of an unguided layer, and everything that runs
  the aligned operator (its reference path, the fused CPU kernel, the standard-operator ``harmonic`` backend,
  ``torch.compile``, ``torch.export``, ONNX) runs a guided layer. ``torch.jit.script`` cannot compile the
  pre-hook that shares the guide between layers: scripting a guided model raises one error saying so.

* **A ramp for whole-image turns** (``ramp``, for a model that turns its input to a canonical orientation first,
  ``canonicalize=``): a ramp of ``ramp`` units a pixel along the +x axis of the turned image, added to the map before
  the gain. Where the blurred input is flat (a blob's top, the background) the windows then turn by the image's
  canonical orientation instead of by their features, so that whole-image turns are followed as well as turned
  parts. The ramp is fixed in the turned image's frame: the model stays invariant to quarter turns through the
  canonical turn in front of it, which is why a ramp without one is refused.

Why the invariance to quarter turns stays exact: the guide is equivariant (a channel mean, a minimum over the
image, a symmetric blur with zero padding, a gain), its pooling too, and the aligned operator is exactly invariant
to quarter turns of all its input channels together.

Example:
    >>> import timm
    >>> from timm_sortconv import sortify
    >>> net, report = sortify(timm.create_model("resnet18"), sorting="align", guide_blur=4.0, return_report=True)
    >>> report.guide_source, len(report.guided)
    ('conv1', 17)
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .antialias import GaussianBlur2d

__all__ = ["GAIN", "OrientationGuide", "area_matrix", "attach_guide", "check_guidable", "check_guide_blur",
           "check_guide_ramp", "guided_layers"]

#: How much the guide is scaled, so that its first harmonic outweighs the features' (activations are of order 1
#: after BatchNorm, a blurred normalised image's gradient about 0.1 a pixel); float32 keeps 7 digits of the sum.
GAIN = 1e4


def check_guide_blur(guide_blur, sorting: Optional[str] = "align") -> float:
    """Returns ``guide_blur`` as a float if it is a number of pixels ``>= 0`` (0: no guide) that ``sorting`` can
    serve, else raises ``ValueError`` naming what is accepted."""
    if isinstance(guide_blur, bool) or not isinstance(guide_blur, (int, float)) or not (
            math.isfinite(guide_blur) and guide_blur >= 0):
        raise ValueError(f"guide_blur must be a blur of >= 0 pixels (0: no guide; 4: a digit's parts on MNIST), "
                         f"got {guide_blur!r}")
    if guide_blur and sorting != "align":
        raise ValueError(f"guide_blur={guide_blur!r} turns every window by the guide's orientation, which needs "
                         f"sorting='align' (one orientation per position, shared by a group's channels); got "
                         f"sorting={sorting!r}")
    return float(guide_blur)


def check_guide_ramp(guide_ramp, guide_blur: float = 4.0, canonicalize=None) -> float:
    """Returns ``guide_ramp`` as a float if it is a slope ``>= 0`` a pixel (0: no ramp) that a model with these
    ``guide_blur`` and ``canonicalize`` can take (a ramp needs a guide and a canonical turn in front of it), else
    raises ``ValueError`` naming what is accepted. ``canonicalize`` is the option (``"moment1"``...) or the module
    that applies it (an ``nn.Identity`` turns nothing)."""
    guide_ramp = _ramp_slope(guide_ramp)
    if guide_ramp and not guide_blur:
        raise ValueError(f"guide_ramp={guide_ramp!r} is added to the orientation guide, which needs guide_blur > 0")
    if guide_ramp and (canonicalize is None or isinstance(canonicalize, nn.Identity)):
        raise ValueError(f"guide_ramp={guide_ramp!r} is fixed along the +x axis of the image, so the model keeps its "
                         "invariance only if it turns its input to a canonical orientation first: pass "
                         "canonicalize='moment1' (or 'moment2', 'moment4') with it")
    return guide_ramp


def _ramp_slope(guide_ramp) -> float:
    if isinstance(guide_ramp, bool) or not isinstance(guide_ramp, (int, float)) or not (
            math.isfinite(guide_ramp) and guide_ramp >= 0):
        raise ValueError(f"guide_ramp must be a slope >= 0 a pixel (0: no ramp; 0.02 in scnn_p_align_7_guided_canon), "
                         f"got {guide_ramp!r}")
    return float(guide_ramp)


def area_matrix(size_in: int, size_out: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(size_out, size_in)``: adaptive average pooling of one axis as a matrix (row ``i`` averages the inputs
    ``floor(i * n / m) .. ceil((i + 1) * n / m) - 1``, as ``F.adaptive_avg_pool2d``): the ONNX form of
    :meth:`OrientationGuide.at_size` is ``A_h @ map @ A_w^T`` (:mod:`timm_sortconv.onnx.guide`)."""
    rows = torch.arange(size_out).unsqueeze(1)
    start = torch.div(rows * size_in, size_out, rounding_mode="floor")
    end = torch.div((rows + 1) * size_in + size_out - 1, size_out, rounding_mode="floor")
    columns = torch.arange(size_in).unsqueeze(0)
    inside = ((columns >= start) & (columns < end)).to(dtype)
    return inside / (end - start).to(dtype)


@torch.library.custom_op("timm_sortconv::pool_to", mutates_args=())
def _pool_to(guide: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The guide pooled to the height and width of ``like`` (whose values are not read): one operator for traces, its
    size the shape of a value, which the ONNX exporter may know statically."""
    if guide.shape[-2:] == like.shape[-2:]:
        return guide.clone()
    return F.adaptive_avg_pool2d(guide, (like.shape[-2], like.shape[-1]))


@_pool_to.register_fake
def _(guide, like):
    return guide.new_empty(guide.shape[:-2] + like.shape[-2:])


class OrientationGuide(nn.Module):
    """The guide of the module docstring: no parameters (the blur's kernel is a buffer that is not saved). It holds
    the map of the latest forward (``map``), which the guided layers of the same forward read at their own size.

    Args:
        blur: the Gaussian's standard deviation in pixels (> 0).
        gain: the factor of :data:`GAIN`.
        ramp: the slope a pixel of the ramp along +x added before the gain (0: none; the module docstring).

    Example:
        >>> guide = OrientationGuide(2.0)
        >>> x = torch.randn(2, 3, 16, 16)
        >>> turned = guide(torch.rot90(x, 1, (2, 3)))
        >>> torch.allclose(turned, torch.rot90(guide(x), 1, (2, 3)), atol=1e-2)
        True
    """

    def __init__(self, blur: float = 4.0, gain: float = GAIN, ramp: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        if check_guide_blur(blur) <= 0:
            raise ValueError(f"OrientationGuide needs a blur > 0 pixels, got {blur!r}")
        self.blur = GaussianBlur2d(blur, device=device, dtype=dtype)
        self.gain = float(gain)
        self.ramp = _ramp_slope(ramp)
        self.map: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The guide map ``(N, 1, H, W)`` of images ``(N, C, H, W)`` (or ``(C, H, W)``: ``N = 1``)."""
        if x.dim() == 3:
            x = x.unsqueeze(0)
        base = x.mean(1, keepdim=True)
        guide = self.blur(base - base.amin(dim=(2, 3), keepdim=True))
        if self.ramp:
            columns = torch.arange(guide.shape[-1], dtype=guide.dtype, device=guide.device)
            guide = guide + (columns - (guide.shape[-1] - 1) / 2) * self.ramp
        return guide * self.gain

    def hook(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of the module whose input the guide is made from: keeps the map for this forward."""
        self.map = self(args[0])

    def at_size(self, height: int, width: int) -> torch.Tensor:
        """The latest map pooled to ``height x width`` (adaptive average pooling)."""
        guide = self._latest()
        if guide.shape[-2] == height and guide.shape[-1] == width:
            return guide
        return F.adaptive_avg_pool2d(guide, (height, width))

    def like(self, x: torch.Tensor) -> torch.Tensor:
        """The latest map pooled to the height and width of ``x`` (what a guided layer reads: :meth:`at_size`, and
        one operator for traces, which the ONNX exporter writes for the sizes it knows of ``x``)."""
        guide = self._latest()
        if torch.jit.is_tracing():
            return torch.ops.timm_sortconv.pool_to(guide, x)
        return self.at_size(x.shape[-2], x.shape[-1])

    def _latest(self) -> torch.Tensor:
        if self.map is None:
            raise RuntimeError("this guided SortConv2d has no orientation guide yet: the guide is made when the "
                               "model's first convolution runs; call the model (or forward_features), not a layer "
                               "alone")
        return self.map

    def extra_repr(self) -> str:
        return f"blur={self.blur.sigma}, gain={self.gain:g}" + (f", ramp={self.ramp:g}" if self.ramp else "")


def guided_layers(model: nn.Module) -> List[str]:
    """The qualified names of ``model``'s guided ``SortConv2d`` layers."""
    from .layers import SortConv2d

    return [name for name, m in model.named_modules() if isinstance(m, SortConv2d) and m.guided]


def _source(model: nn.Module, source: Optional[str]) -> Tuple[str, nn.Module]:
    if source is not None:
        try:
            return source, model.get_submodule(source)
        except AttributeError:
            raise ValueError(f"guide source {source!r} is not a module of the model; give the qualified name of the "
                             "module whose input is the image (model.named_modules())") from None
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            return name, module
    raise ValueError("the model has no nn.Conv2d to make the orientation guide from; name the module whose input is "
                     "the image with source=")


def check_guidable(model: nn.Module, source: Optional[str] = None) -> None:
    """Raises ``ValueError`` where :func:`attach_guide` would refuse ``model`` whatever its aligned layers: it is
    guided already, a ``SortConv2d`` in it has ``sorting="align-channel"``, or ``source`` names no module of it."""
    from .layers import SortConv2d

    if any(isinstance(m, OrientationGuide) for m in model.modules()):
        raise ValueError("the model is guided already (it holds an OrientationGuide); build it anew to change the "
                         "guide")
    refused = [name for name, m in model.named_modules() if isinstance(m, SortConv2d) and m.sorting == "align-channel"]
    if refused:
        raise ValueError(f"the orientation guide turns all channels of a position alike, which sorting='align-channel' "
                         f"(each channel by its own orientation) cannot take: {', '.join(refused)}; use "
                         "sorting='align'")
    _source(model, source)


def attach_guide(model: nn.Module, blur: float = 4.0, source: Optional[str] = None,
                 ramp: float = 0.0) -> OrientationGuide:
    """Guides every ``SortConv2d`` of ``model`` with ``sorting="align"``, in place: the guide is made from the
    input of ``source`` (a qualified module name; default: the first ``nn.Conv2d`` in ``model.modules()``, the stem)
    once per forward, and each such layer reads it (the module docstring). The guide becomes the child
    ``orientation_guide`` of the source module; it has no parameters and saves nothing, so the ``state_dict`` keys
    stay. Attach after any conversion of the source module (``sortify`` does so with ``guide_blur=``): a
    replaced module loses its hooks. ``ramp`` (the module docstring) needs ``model.canonicalize``, the canonical
    turn this package's models and ``sortify(canonicalize=...)`` put in front: attach after it.

    Raises ``ValueError`` before changing anything when the model has no aligned layer, has a layer the guide cannot
    serve (``sorting="align-channel"``, whose channels turn each by its own orientation), or is guided already.

    Example:
        >>> from timm_sortconv import SortConv2d
        >>> net = nn.Sequential(SortConv2d(1, 4, 3, padding=1, sorting="align"), nn.ReLU(),
        ...                     SortConv2d(4, 2, 3, padding=1, sorting="align"))
        >>> guide = attach_guide(net, blur=2.0)
        >>> net(torch.randn(1, 1, 12, 12)).shape, guided_layers(net)
        (torch.Size([1, 2, 12, 12]), ['0', '2'])
    """
    from .layers import SortConv2d

    check_guide_blur(blur)
    if blur <= 0:
        raise ValueError(f"attach_guide needs a blur > 0 pixels, got {blur!r}")
    check_guidable(model, source)
    check_guide_ramp(ramp, blur, getattr(model, "canonicalize", None))
    aligned = [m for m in model.modules() if isinstance(m, SortConv2d) and m.sorting == "align"]
    if not aligned:
        raise ValueError("the model has no SortConv2d with sorting='align' for the orientation guide to turn; build "
                         "it with sorting='align' (or sortify(model, sorting='align', guide_blur=...))")
    _, source_module = _source(model, source)
    parameter = next(model.parameters(), None)
    guide = OrientationGuide(blur, ramp=ramp, device=None if parameter is None else parameter.device)
    # A child of the module it is made from (not of the model, which may be an nn.Sequential that would run it).
    source_module.orientation_guide = guide
    source_module.register_forward_pre_hook(guide.hook)
    for layer in aligned:
        layer.guided = True
        layer.guide_source = (guide,)
    return guide
