"""Turning each input image to a canonical orientation read from its own moments, before an SC network.

An SC network is exactly invariant to quarter turns of its input, and between them it is not: its
layers sample the image on a grid, and a network trained on upright digits learns to read what a turn
between the quarter turns changes (RESULTS.md, "Between the quarter turns"). :class:`MomentCanonicalize2d`
removes that part of the turn before the network sees the image. It measures the orientation of the
image's order-``k`` angular moment about the image centre,

    ``c_k = sum_p w(r_p) (I(p) - m) r_p^k exp(i k theta_p)``,

(``theta_p`` counter-clockwise on screen, ``w`` a disc that fades out over the last 2 pixels before the
inscribed circle, ``m`` the image's mean over that disc), and turns the image by ``-arg(c_k) / k``
degrees. Turning the input by ``a`` multiplies ``c_k`` by ``exp(i k a)``, so every turn of an image is
brought to the same canonical image up to a multiple of ``360 / k`` degrees. With ``k = 2`` (the image's
principal axis) or ``k = 4`` that leftover is a multiple of a quarter turn, which the SC network after it
ignores exactly: together they are invariant to every angle, up to the interpolation of the turns and
the error of the angle estimate (with ``sorting="c2"``, which ignores half turns only, ``k = 2``). ``k = 1``
(the direction of the centroid) leaves nothing over, so it also serves a plain CNN, but its angle is less
stable.

It has no parameters. It is a property of the network's input, not of a convolution: it needs the
image's centre, which is the centre of the turns a sweep applies (MNIST-rot turns each digit about the
centre of its 28x28 frame). An image whose moment vanishes (a blank image, or one symmetric under turns
of ``360 / k`` degrees) has no orientation to read; its angle is taken as 0. The angle is a function of
the input but is treated as a constant by autograd (the gradient flows through the turned image only),
because ``arg`` has no useful gradient where the moment is small.

**Any input shape.** A square frame is closed under the quarter turns, and so is its inscribed disc, over which
the moment is read: a square input is turned inside its own frame, and the turn is exactly equivariant to its
quarter turns (what lies outside the inscribed disc, the corners, is turned out of the frame, and the corners
turned in hold ``padding_mode``: the turn MNIST-rot applies to its digits). A non-square frame is closed under the
half turn only, and its content may fill it to its edges (parts side by side), so turning it inside its own frame
would cut it. A non-square ``H x W`` input is therefore first placed at the centre of a larger frame
``H' x W'`` (:func:`canonical_size`, :func:`canonical_frame`), whose new pixels hold what ``padding_mode`` gives
to pixels turned in from outside (``"zeros"``: 0; ``"border"``: the nearest edge pixel of the input;
``"reflection"``: the input mirrored about its edge pixels), and the moment is read and the turn made in that
frame. Its size: the input's pixel centres lie within ``r_max = sqrt((H - 1)^2 + (W - 1)^2) / 2`` of its
centre, and the disc weight ``w`` is 1 up to 2 pixels inside the frame's inscribed circle (radius
``min(H', W') / 2``), so

    ``H', W' >= 2 r_max + 4``,  ``H' - H`` and ``W' - W`` even

puts every pixel of the input at full weight (the orientation is read over the whole input) and, whatever the
angle, every output pixel that reads an input pixel (bilinearly: within ``sqrt(2)`` of its turned centre, at most
``r_max + 1.5`` from the centre) inside the frame, whose half side is at least that: nothing is cut. The even
margins keep the input's centre at the frame's centre, the centre of the turn. ``H' = W'`` when
``H`` and ``W`` have the same parity (two 28x28 digits side by side, 28x56: 66x66), else they differ by one.
The frame holds the circle about the input, the one shape that no angle changes, so every image of a batch comes
out at the same size, and a half turn of the input (or a quarter turn, when ``H' = W'``) turns the frame with it.
The network after the turn must take the frame: every model of this package pools globally; it sees
``H' W'`` pixels (2.8 times a 28x56 input's).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module

from .rotation import _rotate_each

__all__ = ["CANONICALIZERS", "PADDING_MODES", "CanonicalInputMixin", "MomentCanonicalize2d", "canonical_frame",
           "canonical_order", "canonical_size", "create_canonicalizer", "moment_angle", "moment_terms"]

#: Names accepted by :func:`create_canonicalizer` (and the models' ``canonicalize=``), by moment order.
CANONICALIZERS = {"moment1": 1, "moment2": 2, "moment4": 4}
#: What the pixels from outside the input hold (``grid_sample``'s padding modes).
PADDING_MODES = ("border", "zeros", "reflection")


def _check_order(order: int) -> None:
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise ValueError(f"order must be an int >= 1, got {order!r}")


def _check_padding_mode(padding_mode: str) -> None:
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode must be 'border', 'zeros' or 'reflection', got {padding_mode!r}")


def _check_images(images: torch.Tensor, name: str) -> None:
    if images.dim() != 4:
        raise ValueError(f"{name} expects images of shape (N, C, H, W), got {list(images.shape)}")
    if images.shape[-2] < 1 or images.shape[-1] < 1:
        raise ValueError(f"{name} expects images of at least 1x1 pixels, got {list(images.shape)}")


def canonical_size(height: int, width: int) -> Tuple[int, int]:
    """The frame ``(H', W')`` in which an ``H x W`` image is turned (the module docstring, "Any input shape"):
    ``(H, W)`` for a square image, else the smallest ``H' >= 2 r_max + 4`` with ``H' - H`` even and the same for
    ``W'``, where ``r_max = sqrt((H - 1)^2 + (W - 1)^2) / 2``.

    Example:
        >>> canonical_size(28, 28), canonical_size(28, 56), canonical_size(28, 29)
        ((28, 28), (66, 66), (44, 43))
    """
    if height == width:
        return height, width
    # the smallest s with s * s >= (H - 1)^2 + (W - 1)^2, in integers (float's sqrt is only a first guess)
    square = (height - 1) * (height - 1) + (width - 1) * (width - 1)
    side = int(math.sqrt(float(square)))
    while side * side < square:
        side += 1
    while side > 0 and (side - 1) * (side - 1) >= square:
        side -= 1
    side += 4
    return side + (side - height) % 2, side + (side - width) % 2


def _edge_index(index: torch.Tensor, size: int, padding_mode: str) -> torch.Tensor:
    """The input pixel that ``padding_mode`` reads at each of ``index`` (positions along an axis of ``size``
    pixels, some outside it): the nearest edge pixel (``"border"``), or the reflection about the edge pixels
    (``"reflection"``, period ``2 (size - 1)``), as ``grid_sample`` with ``align_corners=True`` reads them."""
    if padding_mode == "border" or size == 1:
        return index.clamp(0, size - 1)
    period = 2 * (size - 1)
    folded = torch.remainder(index, period)
    return torch.where(folded < size, folded, period - folded)


def canonical_frame(images: torch.Tensor, padding_mode: str = "border") -> torch.Tensor:
    """``images`` ``(N, C, H, W)`` at the centre of their frame :func:`canonical_size` ``(H, W)``, the new pixels
    filled by ``padding_mode`` (the module docstring, "Any input shape"); a square image is returned as it is.

    Example:
        >>> x = torch.ones(1, 1, 28, 56)
        >>> framed = canonical_frame(x, padding_mode="zeros")
        >>> framed.shape, framed.sum().item(), torch.equal(framed[..., 19:47, 5:61], x)
        (torch.Size([1, 1, 66, 66]), 1568.0, True)
    """
    _check_images(images, "canonical_frame")
    _check_padding_mode(padding_mode)
    return _frame(images, padding_mode)


def _frame(images: torch.Tensor, padding_mode: str) -> torch.Tensor:
    """:func:`canonical_frame` without the argument checks (TorchScript compiles this one). A trace records one
    operator, ``timm_sortconv::canonical_frame``, whose size follows the input's at run time (the ONNX exporter writes
    it for the sizes it knows, or computes the frame from the shape: :mod:`timm_sortconv.onnx.centring`)."""
    if not torch.jit.is_scripting() and torch.jit.is_tracing():
        return torch.ops.timm_sortconv.canonical_frame(images, padding_mode)
    return _framed(images, padding_mode)


def _framed(images: torch.Tensor, padding_mode: str) -> torch.Tensor:
    h, w = images.shape[-2], images.shape[-1]
    height, width = canonical_size(h, w)
    if height == h and width == w:
        return images
    top, left = (height - h) // 2, (width - w) // 2
    if padding_mode == "zeros":
        return F.pad(images, [left, left, top, top])
    rows = _edge_index(torch.arange(height, device=images.device) - top, h, padding_mode)
    columns = _edge_index(torch.arange(width, device=images.device) - left, w, padding_mode)
    return images.index_select(-2, rows).index_select(-1, columns)


@torch.library.custom_op("timm_sortconv::canonical_frame", mutates_args=())
def _canonical_frame_op(images: torch.Tensor, padding_mode: str) -> torch.Tensor:
    """:func:`canonical_frame` as one operator for traces (a copy: an operator's output is never its input)."""
    return _framed(images, padding_mode).clone()


@_canonical_frame_op.register_fake
def _(images, padding_mode):
    return images.new_empty(images.shape[:-2] + canonical_size(images.shape[-2], images.shape[-1]))


def moment_angle(images: torch.Tensor, order: int = 2, padding_mode: str = "border") -> torch.Tensor:
    """The orientation ``arg(c_k) / k`` of each image's order-``k`` angular moment, in degrees: the angle
    :class:`MomentCanonicalize2d` turns by.

    Args:
        images: ``(N, C, H, W)``; the channels are averaged first. A non-square image is read in its frame
            (:func:`canonical_frame`), over the whole image.
        order: ``k >= 1``; the angle is defined modulo ``360 / k`` degrees and lies in
            ``[-180 / k, 180 / k]``.
        padding_mode: what the frame of a non-square image holds outside it (:func:`canonical_frame`).

    Returns:
        ``(N,)`` float32 (float64 for float64 input) angles, counter-clockwise on screen: turning an
        image by ``a`` degrees (:func:`timm_sortconv.rotation.rotate`) adds ``a`` (modulo ``360 / k``).
        An image without orientation (blank, or too small for the disc) gives 0.

    Example:
        >>> from timm_sortconv.rotation import rotate
        >>> x = torch.zeros(1, 1, 15, 15)
        >>> x[0, 0, 7, 2:13] = 1.0  # a horizontal bar
        >>> round(moment_angle(rotate(x, 30)).item())
        30
    """
    _check_images(images, "moment_angle")
    _check_order(order)
    _check_padding_mode(padding_mode)
    return _moment_angle(_frame(images, padding_mode), order)


def moment_terms(images: torch.Tensor, order: int = 2,
                 padding_mode: str = "border") -> Tuple[torch.Tensor, torch.Tensor]:
    """Each pixel's term ``w(r_p) (I(p) - m) r_p^k exp(i k theta_p)`` of the order-``k`` angular moment ``c_k``
    (the module docstring defines them): their sum is ``c_k``, whose argument :func:`moment_angle` reads.

    Args:
        images: ``(N, C, H, W)``; the channels are averaged first.
        order: ``k >= 1``.
        padding_mode: what the frame of a non-square image holds outside it (:func:`canonical_frame`).

    Returns:
        ``(real, imag)``, each ``(N, H', W')`` (:func:`canonical_size`: ``(N, H, W)`` for square images),
        float32 (float64 for float64 input); zero outside the disc.

    Example:
        >>> x = torch.zeros(1, 1, 15, 15)
        >>> x[0, 0, 7, 2:13] = 1.0  # a horizontal bar: c_2 is real and positive
        >>> real, imag = moment_terms(x)
        >>> real.shape, round(real.sum().item()), round(imag.sum().item())
        (torch.Size([1, 15, 15]), 110, 0)
    """
    _check_images(images, "moment_terms")
    _check_order(order)
    _check_padding_mode(padding_mode)
    return _moment_terms(_frame(images, padding_mode), order)


def _moment_terms(images: torch.Tensor, order: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`moment_terms` of images already in their frame, without the argument checks."""
    dtype = torch.float64 if images.dtype == torch.float64 else torch.float32
    x = images.detach().to(dtype).mean(dim=1)
    h, w = x.shape[-2], x.shape[-1]
    ys = torch.arange(h, dtype=dtype, device=x.device) - (h - 1) / 2.0
    xs = torch.arange(w, dtype=dtype, device=x.device) - (w - 1) / 2.0
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    radius = torch.sqrt(xx * xx + yy * yy)
    # min(h, w) / 2 from the coordinates (a trace keeps what Python's min returns as a constant); fades out over the
    # last 2 pixels
    disc = ((torch.minimum(-ys[0], -xs[0]) + 0.5 - radius) / 2.0).clamp(0.0, 1.0)
    # theta counter-clockwise on screen: y points down, so the angle of (x, -y).
    theta = torch.atan2(-yy, xx)
    if not torch.jit.is_scripting():  # TorchScript compiles no branch under this test
        if torch.onnx.is_in_onnx_export():
            # ONNX writes atan2 as atan(y / x), NaN at the centre of an odd-sized image, where atan2(0, 0) = 0 and
            # the weight is 0: there it reads atan2(0, 1) = 0 instead
            theta = torch.atan2(-yy, torch.where(radius > 0, xx, torch.ones_like(xx)))
    weight = disc * radius.pow(order)
    centred = x - (x * disc).sum(dim=(-2, -1), keepdim=True) / disc.sum().clamp_min(1e-12)
    return centred * weight * torch.cos(order * theta), centred * weight * torch.sin(order * theta)


def _moment_angle(images: torch.Tensor, order: int) -> torch.Tensor:
    """:func:`moment_angle` of images already in their frame, without the argument checks (TorchScript compiles
    this one)."""
    real, imag = _moment_terms(images, order)
    real, imag = real.sum(dim=(-2, -1)), imag.sum(dim=(-2, -1))
    # plain arithmetic rather than torch.rad2deg, which ONNX export does not know
    return torch.atan2(imag, real) * (180.0 / math.pi / order)


# timm's FX feature extraction treats it as a leaf: its sizes come from the input's shape in Python.
@register_notrace_module
class MomentCanonicalize2d(nn.Module):
    """Turns each image by minus its :func:`moment_angle`, about its centre (the module docstring says why).

    A square image is turned inside its own frame; a non-square one inside a larger frame that holds it whole
    whatever the angle (:func:`canonical_size`; the module docstring, "Any input shape").

    Args:
        order: the moment's order ``k`` (1, 2 or 4 are the useful ones; 2 and 4 leave a multiple of a
            quarter turn, which an SC network ignores).
        padding_mode: what the pixels from outside the image hold, in the corners turned in and in the frame
            around a non-square image: ``"border"`` (the nearest edge pixel: the background of a digit or a
            texture, the default), ``"zeros"`` or ``"reflection"``.

    Shape: ``(N, C, H, W)`` or ``(C, H, W)`` in, ``(N, C, H', W')`` or ``(C, H', W')`` out
    (:func:`canonical_size`: ``H' = H``, ``W' = W`` for square images), any float dtype.

    Example:
        >>> from timm_sortconv.rotation import rotate
        >>> canon = MomentCanonicalize2d(order=2)
        >>> x = torch.zeros(1, 1, 15, 15)
        >>> x[0, 0, 3:12, 6:9] = 1.0  # a vertical bar, 3 pixels wide
        >>> a, b = canon(x), canon(rotate(x, 35))
        >>> def change(u, v): return float((u - v).norm() / u.norm())
        >>> round(change(x, rotate(x, 35)), 2), round(change(a, b), 2)  # turned: 0.83; canonical: interpolation
        (0.83, 0.24)
        >>> canon(torch.zeros(2, 1, 28, 56)).shape  # two digits side by side: turned in a frame that holds them
        torch.Size([2, 1, 66, 66])
    """

    def __init__(self, order: int = 2, padding_mode: str = "border") -> None:
        super().__init__()
        _check_order(order)
        _check_padding_mode(padding_mode)
        self.order = order
        self.padding_mode = padding_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 and x.dim() != 4:
            raise ValueError("MomentCanonicalize2d expects images of shape (N, C, H, W) or (C, H, W), got "
                             + str(list(x.shape)))
        if not x.is_floating_point():
            raise TypeError("MomentCanonicalize2d turns by interpolation and needs floating-point images: convert "
                            "them first (x.float())")
        batch = x if x.dim() == 4 else x.unsqueeze(0)
        if batch.shape[-2] < 1 or batch.shape[-1] < 1:
            raise ValueError("MomentCanonicalize2d expects images of at least 1x1 pixels, got " + str(list(x.shape)))
        framed = _frame(batch, self.padding_mode)
        out = _rotate_each(framed, -_moment_angle(framed, self.order), self.padding_mode)
        return out if x.dim() == 4 else out.squeeze(0)

    def extra_repr(self) -> str:
        return f"order={self.order}, padding_mode={self.padding_mode!r}"


def canonical_order(name: Optional[str]) -> int:
    """The moment order that a ``canonicalize=`` argument names (``CANONICALIZERS``), 0 for ``None``."""
    if name is None:
        return 0
    if name not in CANONICALIZERS:
        raise ValueError(f"canonicalize must be None or one of {sorted(CANONICALIZERS)}, got {name!r}")
    return CANONICALIZERS[name]


def create_canonicalizer(name: Optional[str]) -> nn.Module:
    """The module a model's ``canonicalize=`` names: ``None`` gives ``nn.Identity()``, ``"momentK"`` a
    :class:`MomentCanonicalize2d` of order ``K`` (``CANONICALIZERS`` lists them)."""
    order = canonical_order(name)
    return nn.Identity() if order == 0 else MomentCanonicalize2d(order)


class CanonicalInputMixin:
    """The one place where a model of this package turns its input: timm's two entry points from an image,
    ``forward_features`` and ``forward_intermediates``, apply ``self.canonicalize`` and hand the turned image to
    the model's ``_forward_features`` / ``_forward_intermediates`` (``forward`` goes through ``forward_features``).

    Contract: the model's ``__init__`` sets ``self.canonicalize`` (:func:`create_canonicalizer`: ``nn.Identity``
    or a :class:`MomentCanonicalize2d`) before its other modules, so that timm's ``features_only`` wrappers, which
    run the model's children in order, run it first too; :func:`~timm_sortconv.sortify` fills the same slot. The
    model defines ``_forward_features(x)`` and ``_forward_intermediates(x, indices, norm, stop_early, output_fmt,
    intermediates_only)`` for the turned image.
    """

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_features(self.canonicalize(x))

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = "NCHW",
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Features and the intermediates at the model's taps (``feature_info``; the model's
        ``_forward_intermediates`` says which they are).

        Args:
            x: input images.
            indices: last n taps if int, all if None, these ones if a sequence.
            norm: unused (no norm after the last tap).
            stop_early: stop after the last requested tap.
            output_fmt: ``"NCHW"`` only.
            intermediates_only: return only the intermediates.
        """
        return self._forward_intermediates(self.canonicalize(x), indices, norm, stop_early, output_fmt,
                                           intermediates_only)
