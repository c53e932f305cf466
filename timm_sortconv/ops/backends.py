"""Backend registry: the reference path and the fast kernels that must agree with it.

A backend is a callable ``fn(x_padded, weight, bias, geometry, stride, dilation, groups)`` plus a
``supports(...)`` predicate with the same arguments (given the input before padding: no predicate
depends on its height or width). A backend with ``zero_padding`` also takes ``pad=(left, right, top,
bottom)`` and an unpadded input, and pads it with zeros itself. ``backend="auto"`` takes the first
registered fast backend that supports the call and falls back to the reference path otherwise; while
tracing, scripting, compiling or exporting it always takes the reference path, which is made of
ordinary PyTorch operators that those tools understand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .reference import sort_conv2d_reference

__all__ = ["Backend", "check_backend_name", "register_backend", "available_backends", "resolve_backend", "run_backend",
           "run_recomputing"]


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    supports: Callable[..., bool]
    available: Callable[[], bool]
    # Whether backend="auto" may pick it; a backend not yet measured on its hardware is opt-in.
    auto: bool = True
    # Whether fn(..., pad=(left, right, top, bottom)) pads an unpadded input with zeros itself.
    zero_padding: bool = False


_BACKENDS: Dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Adds a backend; ``auto`` tries fast backends in registration order."""
    _BACKENDS[backend.name] = backend


register_backend(Backend("reference", sort_conv2d_reference, lambda *args: True, lambda: True))


def available_backends() -> List[str]:
    """Names of the backends usable in this process (a fast one may be missing its compiler)."""
    return [name for name, b in _BACKENDS.items() if b.available()]


def check_backend_name(name: str) -> str:
    """Returns ``name`` if it is ``"auto"`` or a registered backend, else raises ``ValueError``."""
    if name != "auto" and name not in _BACKENDS:
        raise ValueError(f"unknown backend={name!r}; accepted: 'auto', {', '.join(map(repr, _BACKENDS))}")
    return name


def _tracing() -> bool:
    return (torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling()
            or torch.onnx.is_in_onnx_export())


def resolve_backend(name: str, *args) -> Backend:
    """The backend that runs a call: a named one (it must support the call) or ``auto``'s choice."""
    if name == "auto":
        if not _tracing():
            for backend in _BACKENDS.values():
                if backend.name != "reference" and backend.auto and backend.supports(*args) and backend.available():
                    return backend
        return _BACKENDS["reference"]
    backend = _BACKENDS[check_backend_name(name)]
    if not backend.available():
        raise RuntimeError(f"backend {name!r} is not available in this process; available: {available_backends()}")
    if not backend.supports(*args):
        raise RuntimeError(f"backend {name!r} does not support this call (device, dtype or kernel size); "
                           "use backend='auto' to fall back to the reference path")
    return backend


def run_backend(name: str, x, weight, bias, geometry, stride, dilation, groups, pad=(0, 0, 0, 0),
                padding_mode: str = "zeros") -> torch.Tensor:
    """Runs a call on its backend; ``pad`` (``F.pad``'s order) is added here with ``padding_mode``, or by a
    ``zero_padding`` backend itself when the mode is ``"zeros"``."""
    backend = resolve_backend(name, x, weight, bias, geometry, stride, dilation, groups)
    if any(pad) and backend.zero_padding and padding_mode == "zeros":
        return backend.fn(x, weight, bias, geometry, stride, dilation, groups, pad=tuple(pad))
    if any(pad):
        x = F.pad(x, pad, mode="constant" if padding_mode == "zeros" else padding_mode)
    return backend.fn(x, weight, bias, geometry, stride, dilation, groups)


# A fast backend's kernels: forward(x, weight, bias, geometry, stride, dilation, groups) -> output, and
# backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight)
# -> (grad_input or None, grad_weight or None).
ForwardKernel = Callable[..., torch.Tensor]
BackwardKernel = Callable[..., Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


class _RecomputingSortConv(torch.autograd.Function):
    """Autograd of the fast backends: saves only the input and the weight (as given, no copies) and
    lets the backward kernel sort again instead of keeping the sorted columns or their permutation."""

    @staticmethod
    def forward(ctx, forward_kernel, backward_kernel, x, weight, bias, geometry, stride, dilation, groups):
        ctx.save_for_backward(x, weight)
        ctx.config = (backward_kernel, geometry, stride, dilation, groups)
        return forward_kernel(x, weight, bias, geometry, stride, dilation, groups)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        backward_kernel, geometry, stride, dilation, groups = ctx.config
        need_input, need_weight, need_bias = ctx.needs_input_grad[2:5]
        grad_input = grad_weight = grad_bias = None
        if need_input or need_weight:
            grad_input, grad_weight = backward_kernel(grad_output.contiguous(), x, weight, geometry, stride, dilation,
                                                      groups, need_input, need_weight)
        if need_bias:
            grad_bias = grad_output.sum((0, 2, 3))
        return (None, None, grad_input if need_input else None, grad_weight if need_weight else None, grad_bias,
                None, None, None, None)


def run_recomputing(forward_kernel: ForwardKernel, backward_kernel: BackwardKernel, x, weight, bias, geometry,
                    stride, dilation, groups, keep_channels_last: bool = False) -> torch.Tensor:
    """Runs a fast backend's kernels on contiguous tensors, through autograd only when a gradient is needed;
    with ``keep_channels_last`` an input contiguous in ``torch.channels_last`` order is passed as it is."""
    if not (keep_channels_last and x.is_contiguous(memory_format=torch.channels_last)):
        x = x.contiguous()
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _RecomputingSortConv.apply(forward_kernel, backward_kernel, x, weight, bias, geometry, stride,
                                          dilation, groups)
    return forward_kernel(x, weight, bias, geometry, stride, dilation, groups)
