"""``sort_conv2d``: the functional Sorting Convolution, with ``nn.Conv2d``'s padding semantics."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .backends import run_backend
from .geometry import check_kernel_size, check_variant, get_geometry, square_slot_form

__all__ = ["sort_conv2d", "PADDING_MODES"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

IntPair = Union[int, Sequence[int]]


def _pair(value: IntPair, name: str, minimum: int) -> Tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in pair):
        raise ValueError(f"{name} must be an int >= {minimum} or a pair of them, got {name}={value!r}")
    return pair


def resolve_padding(padding: Union[str, IntPair], kernel_size: int, stride: Tuple[int, int],
                    dilation: Tuple[int, int]) -> Tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` as ``F.pad`` wants it, from an int, a pair, ``"same"`` or ``"valid"``."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        if padding != "same":
            raise ValueError(f"padding={padding!r} is not accepted; use 'same', 'valid', an int or a pair of ints")
        if stride != (1, 1):
            raise ValueError(f"padding='same' is not supported for strided convolutions (stride={stride}), "
                             "as in nn.Conv2d")
        total_h, total_w = dilation[0] * (kernel_size - 1), dilation[1] * (kernel_size - 1)
        return (total_w // 2, total_w - total_w // 2, total_h // 2, total_h - total_h // 2)
    ph, pw = _pair(padding, "padding", 0)
    return (pw, pw, ph, ph)


def check_input(x: torch.Tensor, weight: torch.Tensor, groups: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"sort_conv2d expects a torch.Tensor input, got {type(x).__name__}")
    if not (x.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"sort_conv2d needs floating-point tensors (float16, bfloat16, float32, float64), "
                        f"got input {x.dtype} and weight {weight.dtype}")
    if x.dim() != 4:
        raise RuntimeError(f"sort_conv2d expects a 4-D (N, C, H, W) input (or 3-D (C, H, W) through SortConv2d), "
                           f"got a {x.dim()}-D input of shape {tuple(x.shape)}")
    if x.shape[1] != weight.shape[1] * groups:
        raise RuntimeError(f"sort_conv2d: input has {x.shape[1]} channels but the weight {tuple(weight.shape)} "
                           f"with groups={groups} expects {weight.shape[1] * groups}")


def sort_conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    stride: IntPair = 1,
    padding: Union[str, IntPair] = 0,
    dilation: IntPair = 1,
    groups: int = 1,
    padding_mode: str = "zeros",
    *,
    sampling: str = "polar",
    sorting: str = "ring",
    ring_density: Union[int, Sequence[int]] = 1,
    backend: str = "auto",
) -> torch.Tensor:
    """Sorting Convolution of ``input`` with an ordinary convolution ``weight``.

    For every input channel and output position the ``k x k`` window is sampled (``"square"``: the
    grid values; ``"polar"``: bilinear samples on circles of radius 1..k//2), sorted (``"ring"``: each
    ring separately; ``"global"``: all values), laid back on the grid, and contracted with ``weight``
    exactly as :func:`torch.nn.functional.conv2d` would. The result is invariant to any rotation of the
    window's content that maps the sample points onto themselves.

    Args:
        input: ``(N, C_in, H, W)`` floating-point tensor.
        weight: ``(C_out, C_in / groups, k, k)`` with odd ``k``.
        bias: optional ``(C_out,)``.
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d`; ``padding`` may be
            ``"same"`` or ``"valid"``.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"`` (as ``nn.Conv2d``).
        sampling: ``"polar"`` (default), ``"polar-offset"`` (the polar points turned by half a step, off the
            axes and diagonals) or ``"square"``.
        sorting: ``"ring"`` (default) or ``"global"``.
        ring_density: ``m >= 1`` (polar sampling): ring ``r`` is read at ``8rm`` points and each run of
            ``m`` consecutive sorted values is averaged before it meets its weight, which makes the sorted
            values of a ring nearly invariant to any rotation, not only to multiples of ``45/r`` degrees
            (:mod:`timm_sortconv.ops.geometry`). The reference path computes it as it is; the fast
            backends compute it as a larger kernel (:func:`~timm_sortconv.ops.geometry.square_slot_form`),
            which costs about ``m`` times the sorting and the product of density 1. For ring sorting it
            may be one density per ring, e.g. ``(3, 2, 1)`` for ``k = 7``.
        backend: ``"auto"`` (the fastest backend that supports the call), ``"reference"`` or the name of
            a fast backend (see :func:`timm_sortconv.ops.available_backends`).

    Returns:
        ``(N, C_out, H_out, W_out)`` with the same size formula as ``conv2d``.

    Example:
        >>> x, w = torch.randn(2, 4, 16, 16), torch.randn(8, 4, 5, 5)
        >>> sort_conv2d(x, w, padding=2).shape
        torch.Size([2, 8, 16, 16])
    """
    if weight.dim() != 4:
        raise ValueError(f"weight must be 4-D (C_out, C_in/groups, k, k), got shape {tuple(weight.shape)}")
    # int(): while tracing, sizes are tensors; the kernel size is a constant of the traced graph.
    k = check_kernel_size(tuple(int(size) for size in weight.shape[2:]))
    check_variant(sampling, sorting)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or weight.shape[0] % groups:
        raise ValueError(f"groups must be a positive int dividing C_out={weight.shape[0]}, got groups={groups!r}")
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode={padding_mode!r} is not accepted; use one of {PADDING_MODES}")
    check_input(input, weight, groups)
    stride = _pair(stride, "stride", 1)
    dilation = _pair(dilation, "dilation", 1)
    pad = resolve_padding(padding, k, stride, dilation)
    hp, wp = input.shape[2] + pad[2] + pad[3], input.shape[3] + pad[0] + pad[1]
    if hp < dilation[0] * (k - 1) + 1 or wp < dilation[1] * (k - 1) + 1:
        raise RuntimeError(f"sort_conv2d: padded input size ({hp}, {wp}) is smaller than the dilated kernel "
                           f"({dilation[0] * (k - 1) + 1}, {dilation[1] * (k - 1) + 1})")
    geometry = get_geometry(k, sampling, sorting, ring_density)
    if geometry.samples != k * k and backend != "reference":
        return _run_square_form(backend, input, weight, bias, geometry, stride, dilation, groups, pad, padding_mode)
    return run_backend(backend, input, weight, bias, geometry, stride, dilation, groups, pad, padding_mode)


def _run_square_form(backend, x, weight, bias, geometry, stride, dilation, groups, pad, padding_mode):
    """A geometry with more samples than ``k*k`` run as its square slot form: the weight spread over the
    larger kernel's slots and the input padded for the larger kernel (with zeros: its taps never read
    them, the output keeps its size)."""
    square, index, scale = square_slot_form(geometry)
    big, k = square.kernel_size, geometry.kernel_size
    flat = weight.reshape(weight.shape[0], weight.shape[1], k * k)
    spread = flat.index_select(2, index.to(weight.device)) * scale.to(device=weight.device, dtype=weight.dtype)
    unused = spread.new_zeros(spread.shape[0], spread.shape[1], big * big - geometry.samples)
    big_weight = torch.cat([spread, unused], dim=2).reshape(weight.shape[0], weight.shape[1], big, big)
    if padding_mode != "zeros" and any(pad):
        x, pad = F.pad(x, pad, mode=padding_mode), (0, 0, 0, 0)
    extra_h, extra_w = dilation[0] * (big - k) // 2, dilation[1] * (big - k) // 2
    pad = (pad[0] + extra_w, pad[1] + extra_w, pad[2] + extra_h, pad[3] + extra_h)
    return run_backend(backend, x, big_weight, bias, square, stride, dilation, groups, pad, "zeros")
