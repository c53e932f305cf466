"""``sort_conv2d``: the functional Sorting Convolution, with ``F.conv2d``'s arguments and ``nn.Conv2d``'s padding
modes.

:func:`sort_conv2d` checks its arguments (:mod:`.checks`) and calls :func:`sort_conv2d_padded`, the forward
that the layers call too: unbatched inputs, non-zero padding modes through ``F.pad``, then
:func:`sort_conv2d_zero_padded`: the registered operator ``torch.ops.timm_sortconv.sort_conv2d``
(:mod:`.operator`, which checks the tensors), or, while exporting to ONNX, the lowering that :mod:`timm_sortconv.onnx`
registers here (:func:`set_onnx_lowering`): the same function in standard operators by default, so that the ONNX
graph needs no custom operator.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .operator import plain_eager, sort_conv2d_eager  # (registers torch.ops.timm_sortconv.sort_conv2d)
from .backends import check_backend_name
from .checks import IntPair, check_input, functional_arguments, int_pair
from .geometry import check_kernel_size, get_geometry

__all__ = ["set_onnx_lowering", "sort_conv2d", "sort_conv2d_padded", "sort_conv2d_zero_padded", "resolve_padding"]

#: What writes an SC layer while a model is exported to ONNX (:func:`set_onnx_lowering`).
_onnx_lowering: Optional[Callable[..., torch.Tensor]] = None


def set_onnx_lowering(lowering: Callable[..., torch.Tensor]) -> None:
    """Registers what writes an SC layer during ``torch.onnx.export``: a function of the arguments of
    :func:`sort_conv2d_zero_padded` but the backend (:func:`timm_sortconv.onnx.lowering.lower_sort_conv2d`, registered
    when :mod:`timm_sortconv.onnx` is imported: this package's own import does it). ONNX runtimes know no
    ``timm_sortconv`` operator, so an export without it is refused."""
    global _onnx_lowering
    _onnx_lowering = lowering


def resolve_padding(padding: Union[str, IntPair], kernel_size: int, dilation: Tuple[int, int]
                    ) -> Tuple[int, int, int, int]:
    """``(left, right, top, bottom)`` as ``F.pad`` wants it, from a checked ``padding`` (an int, a pair, ``"same"``
    or ``"valid"``; ``"same"`` puts the odd pixel of an odd total on the right and bottom, as ``F.conv2d``)."""
    if padding == "valid":
        return (0, 0, 0, 0)
    if padding == "same":
        total_h, total_w = dilation[0] * (kernel_size - 1), dilation[1] * (kernel_size - 1)
        return (total_w // 2, total_w - total_w // 2, total_h // 2, total_h - total_h // 2)
    ph, pw = int_pair(padding, "padding")
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
        input: ``(N, C_in, H, W)`` or unbatched ``(C_in, H, W)`` floating-point tensor.
        weight: ``(C_out, C_in / groups, k, k)``, ``k`` odd or even.
        bias: optional ``(C_out,)``.
        stride, padding, dilation, groups: as in :func:`torch.nn.functional.conv2d`, which accepts and refuses
            the same values (:mod:`.checks`); ``padding`` may be ``"same"`` or ``"valid"``.
        padding_mode: ``"zeros"``, ``"reflect"``, ``"replicate"`` or ``"circular"`` (as ``nn.Conv2d``).
        sampling: ``"polar"`` (default) or ``"square"``.
        sorting: ``"ring"`` (default), ``"global"``, or ``"c4"``/``"c2"``: only the samples of a ring that a
            quarter/half turn maps onto one another are sorted together (see :mod:`.geometry`); or
            ``"align"``/``"align-channel"``: instead of sorting, each window is turned back by its own
            orientation (one per position shared by a group's channels / one per channel, :mod:`.alignment`).
            With ``"align"`` the input may carry one *guide channel* after each group's channels
            (``(C_in / groups + 1) * groups`` channels): it joins the orientation of its group's windows and has
            no weight (as a zero weight would give, without its products; :mod:`timm_sortconv.guide`).
        backend: ``"auto"`` (the fastest backend that supports the call), ``"reference"`` or the name of
            a fast backend (see :func:`timm_sortconv.ops.available_backends`).

    Returns:
        ``(N, C_out, H_out, W_out)`` (``(C_out, H_out, W_out)`` for an unbatched input) with the same size
        formula as ``conv2d``, in the input's dtype.

    Example:
        >>> x, w = torch.randn(2, 4, 16, 16), torch.randn(8, 4, 5, 5)
        >>> sort_conv2d(x, w, padding=2).shape
        torch.Size([2, 8, 16, 16])
    """
    for name, tensor in (("input", input), ("weight", weight), ("bias", bias)):
        if not isinstance(tensor, torch.Tensor) and not (name == "bias" and tensor is None):
            raise TypeError(f"sort_conv2d expects a torch.Tensor {name}, got {type(tensor).__name__}")
    stride, padding, dilation, groups = functional_arguments(weight, stride, padding, dilation, groups,
                                                             padding_mode)
    check_input(input, weight, groups, sorting)
    # int(): while tracing, sizes are tensors; the kernel size is a constant of the traced graph.
    k = check_kernel_size(tuple(int(size) for size in weight.shape[2:]))
    get_geometry(k, sampling, sorting)  # checks the variant; built now, outside any traced region, and cached
    check_backend_name(backend)
    return sort_conv2d_padded(input, weight, bias, list(stride), list(resolve_padding(padding, k, dilation)),
                              padding_mode, list(dilation), groups, sampling, sorting, backend)


def sort_conv2d_padded(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int],
                       padding: List[int], padding_mode: str, dilation: List[int], groups: int, sampling: str,
                       sorting: str, backend: str) -> torch.Tensor:
    """SC with ``padding = [left, right, top, bottom]`` in ``padding_mode``, of a 4-D or an unbatched 3-D input;
    the arguments other than the tensors already checked (TorchScript-able: the layers' forward)."""
    if not torch.jit.is_scripting():  # the common case first: a layer's plain eager call goes straight to the kernels
        if padding_mode == "zeros" and input.dim() == 4 and plain_eager(input, weight, bias):
            return sort_conv2d_eager(input, weight, bias, stride, padding, dilation, groups, sampling, sorting,
                                     backend)
    check_input(input, weight, groups, sorting)  # (the eager path's operator checks its 4-D inputs per call)
    unbatched = input.dim() == 3
    if unbatched:
        input = input.unsqueeze(0)
    if padding_mode != "zeros":
        input = F.pad(input, padding, mode=padding_mode)
        padding = [0, 0, 0, 0]
    out = sort_conv2d_zero_padded(input, weight, bias, stride, padding, dilation, groups, sampling, sorting, backend)
    return out.squeeze(0) if unbatched else out


def sort_conv2d_zero_padded(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int],
                            padding: List[int], dilation: List[int], groups: int, sampling: str, sorting: str,
                            backend: str) -> torch.Tensor:
    """SC with ``padding = [left, right, top, bottom]`` zeros, arguments other than the tensors already
    checked (TorchScript-able).

    This is the registered operator, except during ONNX export, where the registered lowering writes the layer
    (:func:`set_onnx_lowering`), and for plain eager
    calls (:func:`.operator.plain_eager`), which run the operator's own kernels and autograd formula without the
    dispatcher (:func:`.operator.sort_conv2d_eager`).
    """
    if not torch.jit.is_scripting():
        if plain_eager(input, weight, bias):
            return sort_conv2d_eager(input, weight, bias, stride, padding, dilation, groups, sampling, sorting,
                                     backend)
        if torch.onnx.is_in_onnx_export():
            if _onnx_lowering is None:
                raise RuntimeError("an SC layer is exported to ONNX without timm_sortconv.onnx imported; import it "
                                   "(import timm_sortconv does) before torch.onnx.export")
            return _onnx_lowering(input, weight, bias, stride, padding, dilation, groups, sampling, sorting)
    return torch.ops.timm_sortconv.sort_conv2d(input, weight, bias, stride, padding, dilation, groups, sampling,
                                               sorting, backend)
