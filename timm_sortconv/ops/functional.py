"""``sort_conv2d``: the functional Sorting Convolution, with ``nn.Conv2d``'s padding semantics.

:func:`sort_conv2d` checks its arguments, applies non-zero padding modes with ``F.pad`` and calls
:func:`sort_conv2d_zero_padded`, which the layers call directly: the registered operator
``torch.ops.timm_sortconv.sort_conv2d`` (:mod:`.operator`), or, while exporting to ONNX, the reference
path written in standard operators, so that the ONNX graph needs no custom operator.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from .backends import check_backend_name
from .geometry import check_kernel_size, check_variant, get_geometry
from .operator import check_input, check_size
from .reference import sort_conv2d_reference

__all__ = ["sort_conv2d", "sort_conv2d_zero_padded", "check_groups", "PADDING_MODES"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

IntPair = Union[int, Sequence[int]]


def _pair(value: IntPair, name: str, minimum: int) -> Tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in pair):
        raise ValueError(f"{name} must be an int >= {minimum} or a pair of them, got {name}={value!r}")
    return pair


def check_groups(groups, out_channels: int, in_channels: Optional[int] = None) -> int:
    """Returns ``groups`` if it is a positive int dividing ``out_channels`` (and ``in_channels``, where given),
    else raises ``ValueError`` naming the values."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or out_channels % groups \
            or (in_channels is not None and in_channels % groups):
        channels = f"out_channels={out_channels}" + ("" if in_channels is None else f" and in_channels={in_channels}")
        raise ValueError(f"groups={groups!r} must be a positive int dividing {channels}")
    return groups


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
    backend: str = "auto",
) -> torch.Tensor:
    """Sorting Convolution of ``input`` with an ordinary convolution ``weight``.

    For every input channel and output position the ``k x k`` window is sampled (``"square"``: the
    grid values; ``"polar"``: bilinear samples on circles of radius 1..k//2), sorted (``"ring"``: each
    ring separately; ``"global"``: all values; ``"c4"``/``"c2"``: within each ring, the samples a quarter/half
    turn apart), laid back on the grid, and contracted with ``weight``
    exactly as :func:`torch.nn.functional.conv2d` would. The result is invariant to any rotation of the
    window's content that maps the sample points onto themselves (``"c4"``/``"c2"``: a quarter/half turn).

    Args:
        input: ``(N, C_in, H, W)`` floating-point tensor.
        weight: ``(C_out, C_in / groups, k, k)``, ``k`` odd or even.
        bias: optional ``(C_out,)``.
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d`; ``padding`` may be
            ``"same"`` or ``"valid"``.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"`` (as ``nn.Conv2d``).
        sampling: ``"polar"`` (default) or ``"square"``.
        sorting: ``"ring"`` (default), ``"global"``, or ``"c4"``/``"c2"``: only the samples of a ring that a
            quarter/half turn maps onto one another are sorted together (see :mod:`.geometry`).
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
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode={padding_mode!r} is not accepted; use one of {PADDING_MODES}")
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"sort_conv2d expects a torch.Tensor input, got {type(input).__name__}")
    check_groups(groups, weight.shape[0])  # the input's channels: check_input below
    check_input(input, weight, bias, groups)
    stride = _pair(stride, "stride", 1)
    dilation = _pair(dilation, "dilation", 1)
    pad = resolve_padding(padding, k, stride, dilation)
    check_size(input, weight, pad, dilation)  # before F.pad below, whose own error would be less clear
    get_geometry(k, sampling, sorting)  # built now, outside any traced region, and cached
    check_backend_name(backend)
    if any(pad) and padding_mode != "zeros":
        input, pad = F.pad(input, pad, mode=padding_mode), (0, 0, 0, 0)
    return sort_conv2d_zero_padded(input, weight, bias, list(stride), list(pad), list(dilation), groups, sampling,
                                   sorting, backend)


def sort_conv2d_zero_padded(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int],
                            padding: List[int], dilation: List[int], groups: int, sampling: str, sorting: str,
                            backend: str) -> torch.Tensor:
    """SC with ``padding = [left, right, top, bottom]`` zeros, arguments already checked (TorchScript-able).

    This is the registered operator, except during ONNX export, where the reference path's standard
    operators are exported instead (ONNX runtimes know no ``timm_sortconv`` operator).
    """
    if not torch.jit.is_scripting():
        if torch.onnx.is_in_onnx_export():
            geometry = get_geometry(int(weight.shape[-1]), sampling, sorting)  # a traced size is a tensor
            padded = F.pad(input, padding) if any(padding) else input
            return sort_conv2d_reference(padded, weight, bias, geometry, (stride[0], stride[1]),
                                         (dilation[0], dilation[1]), groups)
    return torch.ops.timm_sortconv.sort_conv2d(input, weight, bias, stride, padding, dilation, groups, sampling,
                                               sorting, backend)
