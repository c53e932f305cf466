"""Sorting Convolution as one registered PyTorch operator: ``torch.ops.timm_sortconv.sort_conv2d``.

The operator is what every SC layer calls, so that the tools that handle PyTorch operators handle SC
with its fast kernels:

* ``torch.jit.trace`` and ``torch.jit.script`` call it like any ATen operator; a plain eager call (plain tensors,
  no tracing, compiling, exporting, dispatch or ``__torch_function__`` mode, profiler or autocast:
  :func:`plain_eager`) runs the same kernels and autograd formula through :class:`_EagerSortConv2d` instead, without
  the dispatcher, whose unboxing of ten arguments and the Python layers of ``torch.library`` around a custom
  operator's kernels and formula cost several times a small layer's kernel (``scripts/bench_host.py``);
* ``torch.compile`` (``fullgraph=True``, dynamic shapes) and ``torch.export`` see one opaque node whose
  output shape comes from the fake implementation below, and run the fast kernel at run time;
* autograd uses the formula registered here: the backend's backward kernel, which sorts again, so
  only the input and the weight are kept for backward (as for ``nn.Conv2d``). When the gradient's own
  graph is being built (``create_graph=True``: double backward, gradient penalties, Hessian-vector
  products), the gradient is computed through the differentiable reference path instead: with the
  permutation of each window held fixed SC is bilinear in the window values and the weight, and
  autograd of the reference path gives exactly those second derivatives;
* autocast: on the CPU, with ``dtype=torch.bfloat16`` where the fused CPU kernel takes bfloat16 calls
  (AVX-512 BF16, :func:`.cpu_backend.bf16_products`), the operator runs in bfloat16 as a convolution would:
  the kernel samples and sorts in float32 and multiplies in bfloat16 with float32 sums; otherwise the CPU
  computes in float32 (a reference path in bfloat16 would sample and sort rounded values) and returns the
  autocast dtype. On other devices it computes in the autocast dtype (the kernels accumulate in float32).

Arguments of ``sort_conv2d(input, weight, bias, stride, padding, dilation, groups, sampling, sorting,
backend)``: ``stride`` and ``dilation`` as ``[h, w]``, ``padding`` as the zeros to add ``[left, right,
top, bottom]`` (``F.pad``'s order; other padding modes are applied before the call), and the variant
and backend names of :func:`timm_sortconv.sort_conv2d`. ``backend`` is resolved by
:func:`timm_sortconv.ops.backends.resolve_backend` on the first call of each kind (backend name, variant, kernel
size, the tensors' devices and dtypes, stride, dilation, groups, the registry and the switch of the fast backends)
and looked up after. The operator checks its tensors (:func:`.checks.check_tensors` on the first call of a kind,
the sizes on every call: here, below autocast, so that mixed dtypes are refused only outside it, as by
``F.conv2d``); the other arguments are checked by its callers, :func:`timm_sortconv.sort_conv2d` and the
layers' constructors.

A second operator, ``sort_conv2d_backward``, returns ``(grad_input, grad_weight)`` (an empty tensor for
a gradient not asked for), so that compiled backward graphs call the fast backward kernel too.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .backends import NO_PADDING, Backend, environment, resolve_backend
from .checks import check_shapes, check_tensors
from .geometry import SortGeometry, get_geometry
from .reference import sort_conv2d_reference

__all__ = ["plain_eager", "sort_conv2d_backward_op", "sort_conv2d_eager", "sort_conv2d_op"]


# (backend name, variant, k, the tensors' devices and dtypes, stride, dilation, groups, the environment) ->
# (the backend that runs such calls, the geometry): everything a call's plan depends on but its sizes, worked
# out by the first call of its kind (which also checks the tensors' dtypes and devices) and looked up after.
_PLANS: Dict[tuple, Tuple[Backend, SortGeometry]] = {}


def _call(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride, dilation, groups: int, sampling: str,
          sorting: str, backend: str) -> Tuple[Backend, SortGeometry]:
    """The backend that runs the call and its geometry; the first call of a kind checks its tensors' dtypes and
    devices (:func:`.checks.check_tensors`), which the key then holds."""
    key = (backend, sampling, sorting, weight.shape[-1], input.device, input.dtype, weight.device, weight.dtype,
           None if bias is None else (bias.device, bias.dtype), stride[0], stride[1], dilation[0], dilation[1],
           groups, environment())
    plan = _PLANS.get(key)
    if plan is None:
        check_tensors(input, weight, bias, groups, sorting)
        geometry = get_geometry(weight.shape[-1], sampling, sorting)
        chosen = resolve_backend(backend, input, weight, bias, geometry, (stride[0], stride[1]),
                                 (dilation[0], dilation[1]), groups)
        plan = _PLANS[key] = (chosen, geometry)
    return plan


def _padded_for(chosen: Backend, x: Tensor, pad: Tuple[int, int, int, int]) -> Tuple[Tensor, Tuple[int, ...]]:
    """The input as ``chosen`` takes it: in a layout it reads, and unpadded with ``pad`` for a zero-padding
    backend, else padded here."""
    if not (x.is_contiguous() or (chosen.channels_last and x.is_contiguous(memory_format=torch.channels_last))):
        x = x.contiguous(memory_format=_memory_format(x) if chosen.channels_last else torch.contiguous_format)
    if chosen.zero_padding or not any(pad):
        return x, pad
    return F.pad(x, pad), NO_PADDING


def _memory_format(input: Tensor) -> torch.memory_format:
    """The output's layout: channels_last for a channels_last input, as ``F.conv2d`` returns it; also for a
    view into one (a crop, as ``timm_sortconv.grid.centre_grid`` makes), whose channels are still its
    fastest-varying dimension."""
    if input.is_contiguous():
        return torch.contiguous_format
    if input.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    channels_fastest = input.stride(1) == 1 and input.stride(3) >= input.shape[1] and input.stride(2) >= input.stride(3)
    return torch.channels_last if channels_fastest else torch.contiguous_format


def _forward(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
             dilation: List[int], groups: int, sampling: str, sorting: str, backend: str) -> Tensor:
    """The operator's forward: the checks of the call's sizes, the backend's kernel, the promised layout."""
    chosen, geometry = _call(input, weight, bias, stride, dilation, groups, sampling, sorting, backend)
    check_shapes(input, weight, bias, groups, padding, dilation, sorting)
    x, pad = _padded_for(chosen, input, tuple(padding))
    out = chosen.forward(x, weight.contiguous(), None if bias is None else bias.contiguous(), geometry,
                         (stride[0], stride[1]), (dilation[0], dilation[1]), groups, pad)
    # the layout the fake kernel promises, whatever the backend returned
    return out.contiguous(memory_format=_memory_format(input))


@torch.library.custom_op("timm_sortconv::sort_conv2d", mutates_args=())
def sort_conv2d_op(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
                   dilation: List[int], groups: int, sampling: str, sorting: str, backend: str) -> Tensor:
    return _forward(input, weight, bias, stride, padding, dilation, groups, sampling, sorting, backend)


def _output_shape(input: Tensor, weight: Tensor, stride, padding, dilation) -> List:
    k = weight.shape[-1]
    height = input.shape[2] + padding[2] + padding[3]
    width = input.shape[3] + padding[0] + padding[1]
    return [input.shape[0], weight.shape[0], (height - dilation[0] * (k - 1) - 1) // stride[0] + 1,
            (width - dilation[1] * (k - 1) - 1) // stride[1] + 1]


@sort_conv2d_op.register_fake
def _(input, weight, bias, stride, padding, dilation, groups, sampling, sorting, backend):
    check_tensors(input, weight, bias, groups, sorting)
    return input.new_empty(_output_shape(input, weight, stride, padding, dilation)).contiguous(
        memory_format=_memory_format(input))


def _backward_kernels(grad_output: Tensor, input: Tensor, weight: Tensor, stride: List[int], padding: List[int],
                      dilation: List[int], groups: int, sampling: str, sorting: str, backend: str, need_input: bool,
                      need_weight: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The gradients of the input and the weight by the backend's backward kernel (``None`` where not asked)."""
    chosen, geometry = _call(input, weight, None, stride, dilation, groups, sampling, sorting, backend)
    pad = tuple(padding)
    x, kernel_pad = _padded_for(chosen, input, pad)
    grad_x, grad_weight = chosen.backward(grad_output.contiguous(), x, weight.contiguous(), geometry,
                                          (stride[0], stride[1]), (dilation[0], dilation[1]), groups, need_input,
                                          need_weight, kernel_pad)
    if grad_x is not None and x.shape != input.shape:  # padded here: cut the padding off
        grad_x = grad_x[:, :, pad[2]:pad[2] + input.shape[2], pad[0]:pad[0] + input.shape[3]]
    return (grad_x.contiguous() if need_input else None), (grad_weight.contiguous() if need_weight else None)


@torch.library.custom_op("timm_sortconv::sort_conv2d_backward", mutates_args=())
def sort_conv2d_backward_op(grad_output: Tensor, input: Tensor, weight: Tensor, stride: List[int],
                            padding: List[int], dilation: List[int], groups: int, sampling: str, sorting: str,
                            backend: str, need_input: bool, need_weight: bool) -> Tuple[Tensor, Tensor]:
    grad_x, grad_weight = _backward_kernels(grad_output, input, weight, stride, padding, dilation, groups, sampling,
                                            sorting, backend, need_input, need_weight)
    empty = input.new_empty(0)
    return (empty if grad_x is None else grad_x), (empty if grad_weight is None else grad_weight)


@sort_conv2d_backward_op.register_fake
def _(grad_output, input, weight, stride, padding, dilation, groups, sampling, sorting, backend, need_input,
      need_weight):
    return (input.new_empty(input.shape) if need_input else input.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups, sampling, sorting, backend = inputs
    ctx.save_for_backward(input, weight)
    ctx.config = (stride, padding, dilation, groups, sampling, sorting, backend)


def _reference_gradients(grad_output: Tensor, input: Tensor, weight: Tensor, config, needs) -> List[Optional[Tensor]]:
    """Input and weight gradients through the differentiable reference path, with their own graph."""
    stride, padding, dilation, groups, sampling, sorting, _ = config
    geometry = get_geometry(weight.shape[-1], sampling, sorting)
    with torch.enable_grad():
        out = sort_conv2d_reference(F.pad(input, padding) if any(padding) else input, weight, None, geometry,
                                    (stride[0], stride[1]), (dilation[0], dilation[1]), groups)
        wanted = [t for t, need in zip((input, weight), needs) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, create_graph=True, allow_unused=True))
    return [next(grads) if need else None for need in needs]


def _gradients(ctx, grad_output: Tensor, kernels: Callable) -> Tuple:
    """The autograd formula of module docstring: ``kernels(grad_output, input, weight, *config, need_input,
    need_weight)`` gives the gradients, unless their own graph is being built."""
    input, weight = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_input = grad_weight = grad_bias = None
    if need_input or need_weight:
        if torch.is_grad_enabled():  # create_graph=True: the gradient must itself be differentiable
            grad_input, grad_weight = _reference_gradients(grad_output, input, weight, ctx.config,
                                                           (need_input, need_weight))
        else:
            # backward() may be called under autocast (autograd runs the formula under its caller's): the kernels
            # compute in the dtypes the forward saved, as the operator's forward does with autocast off
            with torch.autocast(input.device.type, enabled=False) if torch._C._is_any_autocast_enabled() \
                    else contextlib.nullcontext():
                grad_input, grad_weight = kernels(grad_output, input, weight, *ctx.config, need_input, need_weight)
            grad_input = grad_input if need_input else None
            grad_weight = grad_weight if need_weight else None
    if need_bias:
        grad_bias = grad_output.sum((0, 2, 3))
    return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None


def _backward(ctx, grad_output):
    return _gradients(ctx, grad_output, sort_conv2d_backward_op)


sort_conv2d_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerSortConv2d(torch.autograd.Function):
    """The operator's forward and autograd formula as a plain ``autograd.Function`` over the same backend kernels,
    for the calls :func:`plain_eager` lets through: the dispatcher's unboxing of ten arguments and the Python
    layers of ``torch.library`` around a custom operator's kernels and formula cost several times a small
    layer's kernel; everything that traces, compiles, exports, profiles or autocasts sees the registered
    operator instead."""

    @staticmethod
    def forward(ctx, input, weight, bias, config):
        # config: (stride, padding, dilation, groups, sampling, sorting, backend), one argument for apply to pass
        out = _forward(input, weight, bias, *config)
        ctx.save_for_backward(input, weight)
        ctx.config = config
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return _gradients(ctx, grad_output, _backward_kernels)[:4]


def plain_eager(input: Tensor, weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a call may skip the dispatcher: plain tensors, no tracing, compiling or exporting, no dispatch or
    ``__torch_function__`` mode, no profiler and no autocast. The checks cost about a
    microsecond."""
    return (type(input) is Tensor and (type(weight) is Tensor or type(weight) is nn.Parameter)
            and (bias is None or type(bias) is Tensor or type(bias) is nn.Parameter)
            and torch._C._get_tracing_state() is None and not torch.compiler.is_compiling()
            and not torch.compiler.is_exporting()
            and not _dispatch_mode_active() and not torch._C._is_torch_function_mode_enabled()
            and not torch.autograd.profiler._is_profiler_enabled
            and not torch._C._is_any_autocast_enabled())


def _dispatch_mode_active() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0


def sort_conv2d_eager(input: Tensor, weight: Tensor, bias: Optional[Tensor], stride: List[int], padding: List[int],
                      dilation: List[int], groups: int, sampling: str, sorting: str, backend: str) -> Tensor:
    """The operator's result for a call :func:`plain_eager` lets through, without the dispatcher: the kernels
    alone where no gradient is wanted, else through :class:`_EagerSortConv2d`."""
    if torch.is_grad_enabled() and (input.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _EagerSortConv2d.apply(input, weight, bias, (stride, padding, dilation, groups, sampling, sorting,
                                                            backend))
    return _forward(input, weight, bias, stride, padding, dilation, groups, sampling, sorting, backend)


def _cpu_bf16_args(args, cast_to):
    """A CPU call's arguments under bfloat16 autocast cast by ``cast_to(torch.bfloat16)`` if the call then runs
    the fused kernel with bfloat16 products, else ``None``; the cheap checks come before the cast."""
    from .cpu_backend import bf16_products

    if args[-1] not in ("auto", "cpu") or not bf16_products():  # args[-1]: the backend's name
        return None
    cast = cast_to(torch.bfloat16)
    input, weight, bias, stride, _padding, dilation, groups, sampling, sorting, backend = cast
    if input.dtype != torch.bfloat16:  # float64 stays float64
        return None
    chosen, _ = _call(input, weight, bias, stride, dilation, groups, sampling, sorting, backend)
    return cast if chosen.name == "cpu" else None


def _autocast_kernel(device_type: str):
    """The operator's autocast rule for one device type: its floating-point tensors cast to the compute
    dtype (on the CPU bfloat16 where the fused kernel multiplies in bfloat16, else float32; the autocast dtype
    elsewhere), the operator run with autocast off, and the output returned in the autocast dtype."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def autocast(*args):
        output_dtype = torch.get_autocast_dtype(device_type)
        # float64 stays float64, as autocast leaves it; the CPU computes every other float type in float32,
        # or in bfloat16 where its fused kernel multiplies in bfloat16
        eligible = (torch.float16, torch.bfloat16, torch.float32) if device_type == "cpu" else (torch.float32,)

        def cast_to(dtype):
            return [a.to(dtype) if isinstance(a, Tensor) and a.dtype in eligible else a for a in args]

        if device_type != "cpu":
            cast = cast_to(output_dtype)
        else:
            bf16 = _cpu_bf16_args(args, cast_to) if output_dtype == torch.bfloat16 else None
            cast = bf16 if bf16 is not None else cast_to(torch.float32)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            out = torch.ops.timm_sortconv.sort_conv2d.default(*cast)
        return out if out.dtype == torch.float64 else out.to(output_dtype)

    return key, autocast


_LIBRARY = torch.library.Library("timm_sortconv", "FRAGMENT")
for _device_type in ("cpu", "cuda"):
    _key, _kernel = _autocast_kernel(_device_type)
    # The C++ dispatcher's entry (eager), and the Python one that tracing under autocast consults.
    _LIBRARY.impl("sort_conv2d", lambda _keyset, *args, _kernel=_kernel: _kernel(*args), _key.name,
                  with_keyset=True)
    torch.ops.timm_sortconv.sort_conv2d.default.py_impl(_key)(_kernel)
