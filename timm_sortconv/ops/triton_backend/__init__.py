"""The Triton backend for CUDA tensors (``backend="triton"``).

Kernels are generated per geometry (:mod:`.source`): each lane of a program sorts one (output position,
input channel) window with the geometry's comparator network, in registers, reading the input in place
(zero padding is a masked read, so autograd keeps only the input and the weight, as for ``nn.Conv2d``).
Three paths use them (:mod:`.config` chooses per call and holds every block size):

* ``direct``: groups with few input and output channels (depthwise convolutions): FMAs into an
  [outputs, groups, positions] tile; the backward sorts again, records the swaps, and adds the input and
  weight gradients with atomics.
* ``fused`` (forward, windows of at most 9 samples: k = 3): an implicit GEMM; each sorted slot tile goes straight into ``tl.dot``.
* ``columns``: sorted columns written for a bounded chunk of images and multiplied by cuBLAS. Also the
  backward of every call that is not direct: the weight and column gradients are cuBLAS products, a kernel
  sorts again and replays the recorded swaps in reverse to send the column gradient back through the taps,
  and ``F.fold`` gathers it per input pixel.

Precision: sorting and interpolation are exact in the input's precision (float16/bfloat16 inputs are
interpolated and sorted in float32 and rounded once; rounding is monotonic, so that is the rounding of the
exactly sorted values). Products accumulate in float32 (float64 for float64). A float32 product uses TF32
exactly where ``torch.backends.cudnn.allow_tf32`` (read per call) lets a convolution use it. Under
``torch.autocast`` the operator casts float32 tensors to the autocast dtype first, as autocast does for
``F.conv2d`` (:mod:`timm_sortconv.ops.operator`), and the result has that dtype.

Supported (:func:`supports_triton`): CUDA tensors of one device and of one dtype among float16, bfloat16,
float32 and float64, odd ``k <= 9``, any stride, dilation, groups, number of
channels, padding (zeros inside the kernels; other modes through ``F.pad`` first), ``torch.channels_last``
inputs and any batch size. Larger kernels take the reference path: their networks (up to 121 values per
segment) would not fit a lane's registers. A gradient whose own graph is being built (double backward) is
computed by the operator through the reference path.

Compilation: Triton compiles a kernel the first time a geometry, dtype and block configuration meets it,
and keeps it in its cache (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``) for later processes. The
sorting networks are long straight-line programs, and Triton's coalescing pass takes time that grows with
the number of memory accesses times the program's length: seconds for 3x3 windows, minutes for the 7x7
and 9x9 backward kernels (``scripts/triton_kernel_report.py`` compiles them all ahead, for any GPU
architecture, without one). Integer arguments are not specialized, so other batch sizes or image sizes
reuse the compiled kernels.

``backend="auto"`` leaves this backend out unless ``TIMM_SORTCONV_TRITON_AUTO=1`` is set: it has not yet been
measured faster than the reference path on a GPU. Under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported) the backend takes CPU tensors, which is how its correctness is tested without a
GPU; natively it takes CUDA tensors only.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from ..backends import NO_PADDING, Backend, register_backend
from ..geometry import SortGeometry
from . import config

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

__all__ = ["KERNELS", "MAX_KERNEL_SIZE", "SUPPORTED_DTYPES", "backward", "forward", "launch_settings",
           "supports_triton"]

AUTO_ENV = "TIMM_SORTCONV_TRITON_AUTO"
# Triton's interpreter runs the kernels with NumPy, on CPU tensors.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_KERNEL_SIZE = 9
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class _Call:
    """Sizes of one call, and the position arguments every kernel takes."""

    geometry: SortGeometry
    batch: int
    channels: int
    height: int
    width: int
    out_channels: int
    groups: int
    out_h: int
    out_w: int
    stride: Tuple[int, int]
    dilation: Tuple[int, int]
    pad: Tuple[int, int, int, int]

    @classmethod
    def of(cls, x, weight, geometry, stride, dilation, groups, pad) -> "_Call":
        k = geometry.kernel_size
        batch, channels, height, width = x.shape
        out_h = (height + pad[2] + pad[3] - dilation[0] * (k - 1) - 1) // stride[0] + 1
        out_w = (width + pad[0] + pad[1] - dilation[1] * (k - 1) - 1) // stride[1] + 1
        return cls(geometry, batch, channels, height, width, weight.shape[0], groups, out_h, out_w, tuple(stride),
                   tuple(dilation), tuple(pad))

    @property
    def slots(self) -> int:
        return self.geometry.kernel_size ** 2

    @property
    def largest_segment(self) -> int:
        return max(end - start for start, end in self.geometry.segments)

    @property
    def in_per_group(self) -> int:
        return self.channels // self.groups

    @property
    def out_per_group(self) -> int:
        return self.out_channels // self.groups

    def position_args(self, x: torch.Tensor, images: int) -> tuple:
        """``n_pos, L, out_w, H, W, sxb, sxc, sxh, sxw, stride_h, stride_w, dil_h, dil_w, pad_t, pad_l``."""
        positions = self.out_h * self.out_w
        return (images * positions, positions, self.out_w, self.height, self.width, *x.stride(), *self.stride,
                *self.dilation, self.pad[2], self.pad[0])


def _compute_dtype(dtype: torch.dtype):
    """Triton dtype of sampling, sorting and accumulation: float64 for float64, else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def _dot_precision(dtype: torch.dtype) -> str:
    return "tf32" if dtype == torch.float32 and torch.backends.cudnn.allow_tf32 else "ieee"


@contextmanager
def _cublas_like_conv(dtype: torch.dtype):
    """cuBLAS products as a convolution would compute them: TF32 for float32 exactly where
    ``torch.backends.cudnn.allow_tf32`` allows it, and float32 accumulation for half types."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_tf32 = dtype == torch.float32 and torch.backends.cudnn.allow_tf32
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = saved


def _empty_output(x: torch.Tensor, call: _Call) -> torch.Tensor:
    """The output, channels_last where the input is (as ``F.conv2d`` makes it)."""
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return torch.empty(call.batch, call.out_channels, call.out_h, call.out_w, dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


_slot_orders: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}


def _slot_order(geometry: SortGeometry, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(slot_to_grid, grid_to_slot)`` on ``device``, cached: no host-to-device copy per call."""
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting, str(device))
    if key not in _slot_orders:
        _slot_orders[key] = (geometry.slot_to_grid.to(device), torch.argsort(geometry.slot_to_grid).to(device))
    return _slot_orders[key]


def _weight_in_slots(weight: torch.Tensor, call: _Call) -> torch.Tensor:
    """``(O, C/g, k, k)`` -> ``(G, O/g, C/g, slots)``, slots in the geometry's order."""
    flat = weight.reshape(call.groups, call.out_per_group, call.in_per_group, call.slots)
    return flat.index_select(3, _slot_order(call.geometry, weight.device)[0])


def _weight_from_slots(grad: torch.Tensor, call: _Call) -> torch.Tensor:
    """The inverse of :func:`_weight_in_slots`: ``(G, O/g, C/g, slots)`` -> ``(O, C/g, k, k)``."""
    k = call.geometry.kernel_size
    return (grad.index_select(3, _slot_order(call.geometry, grad.device)[1])
            .reshape(call.out_channels, call.in_per_group, k, k))


def _slot_major(weight: torch.Tensor, call: _Call) -> torch.Tensor:
    """The weight laid out ``[group, slot, in_per_group, out_per_group]`` for the fused and direct kernels."""
    return _weight_in_slots(weight, call).permute(0, 3, 2, 1).contiguous()


def _from_slot_major(grad: torch.Tensor, call: _Call) -> torch.Tensor:
    return _weight_from_slots(grad.permute(0, 3, 2, 1), call)


KERNELS = ("columns_kernel", "unsort_kernel", "fused_forward_kernel", "direct_forward_kernel",
           "direct_backward_kernel")


def launch_settings(kernel: str, geometry: SortGeometry, dtype: torch.dtype, groups: int, in_per_group: int,
                    out_per_group: int, has_bias: bool = True, need_input: bool = True,
                    need_weight: bool = True) -> dict:
    """The compile-time arguments (block sizes, dtypes, flags, ``num_warps``, ``num_stages``) with which
    the backend launches ``kernel`` (one of :data:`KERNELS`) for such a call; ``scripts/triton_kernel_report.py``
    compiles the kernels with them."""
    segment = max(end - start for start, end in geometry.segments)
    compute = _compute_dtype(dtype)
    if kernel in ("columns_kernel", "unsort_kernel"):
        block_p, block_c, warps = config.column_blocks(segment)
        return dict(COMPUTE=compute, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps, num_stages=1)
    if kernel == "fused_forward_kernel":
        block_p, block_c, block_o, warps = config.fused_blocks(segment, out_per_group)
        # One stage: software pipelining would keep a buffer per sorted slot's weight tile and stage (Triton
        # took 442 s to compile such a 7x7 kernel, which then spilled), for tiles that hit the cache anyway.
        return dict(COMPUTE=compute, ACCUMULATE=compute, PRECISION=_dot_precision(dtype), HAS_BIAS=has_bias,
                    BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_O=block_o, num_warps=warps, num_stages=1)
    block_p, block_g, block_j, warps = config.direct_blocks(segment, groups, out_per_group)
    meta = dict(COMPUTE=compute, BLOCK_P=block_p, BLOCK_G=block_g, BLOCK_J=block_j, num_warps=warps, num_stages=1)
    if kernel == "direct_forward_kernel":
        return dict(meta, HAS_BIAS=has_bias)
    if kernel == "direct_backward_kernel":
        return dict(meta, NEED_X=bool(need_input), NEED_W=bool(need_weight))
    raise ValueError(f"unknown kernel {kernel!r}; accepted: {', '.join(KERNELS)}")


def _settings(kernel: str, call: _Call, dtype: torch.dtype, **flags) -> dict:
    return launch_settings(kernel, call.geometry, dtype, call.groups, call.in_per_group, call.out_per_group, **flags)


def _direct_grid(call: _Call, meta: dict) -> tuple:
    return (triton.cdiv(call.batch * call.out_h * call.out_w, meta["BLOCK_P"]),
            triton.cdiv(call.groups, meta["BLOCK_G"]), triton.cdiv(call.out_per_group, meta["BLOCK_J"]))


def _direct_forward(x, weight, bias, call: _Call):
    out = _empty_output(x, call)
    meta = _settings("direct_forward_kernel", call, x.dtype, has_bias=bias is not None)
    load_kernels(call.geometry)["direct_forward_kernel"][_direct_grid(call, meta)](
        x, _slot_major(weight, call), bias if bias is not None else x, out, call.groups, call.in_per_group,
        call.out_per_group, *call.position_args(x, call.batch), *out.stride(), **meta)
    return out


def _fused_grid(call: _Call, meta: dict) -> tuple:
    return (triton.cdiv(call.batch * call.out_h * call.out_w, meta["BLOCK_P"]),
            triton.cdiv(call.out_per_group, meta["BLOCK_O"]), call.groups)


def _fused_occupancy(x, weight, call: _Call) -> Tuple[int, int]:
    """(programs of the fused kernel, multiprocessors of x's GPU; 0 off CUDA) for :func:`config.choose_path`."""
    if not x.is_cuda:
        return 0, 0
    meta = _settings("fused_forward_kernel", call, x.dtype)
    programs = 1
    for size in _fused_grid(call, meta):
        programs *= size
    return programs, torch.cuda.get_device_properties(x.device).multi_processor_count


def _fused_forward(x, weight, bias, call: _Call):
    out = _empty_output(x, call)
    meta = _settings("fused_forward_kernel", call, x.dtype, has_bias=bias is not None)
    load_kernels(call.geometry)["fused_forward_kernel"][_fused_grid(call, meta)](
        x, _slot_major(weight, call), bias if bias is not None else x, out, call.in_per_group, call.out_per_group,
        *call.position_args(x, call.batch), *out.stride(), **meta)
    return out


def _chunks(call: _Call, element_size: int):
    """``(first, end)`` image ranges of the columns path, for buffers of ``element_size`` bytes per column
    entry together."""
    images = config.column_images(call.channels * call.slots * call.out_h * call.out_w * element_size, call.batch)
    for first in range(0, call.batch, images):
        yield first, min(call.batch, first + images)


def _column_grid(call: _Call, meta: dict, images: int) -> tuple:
    return (triton.cdiv(images * call.out_h * call.out_w, meta["BLOCK_P"]), triton.cdiv(call.channels, meta["BLOCK_C"]))


def _launch_columns(x, columns, column_strides, call: _Call, first: int, end: int):
    """Sorted columns of images [first, end) into ``columns`` (strides: image, channel, slot)."""
    meta = _settings("columns_kernel", call, x.dtype)
    part = x[first:end]
    load_kernels(call.geometry)["columns_kernel"][_column_grid(call, meta, end - first)](
        part, columns, call.channels, *call.position_args(part, end - first), *column_strides, **meta)


def _columns_forward(x, weight, bias, call: _Call):
    positions = call.out_h * call.out_w
    depth = call.in_per_group * call.slots
    weight_rows = _weight_in_slots(weight, call).reshape(call.groups, call.out_per_group, depth)
    out = torch.empty(call.batch, call.out_channels, call.out_h, call.out_w, dtype=x.dtype, device=x.device)
    with _cublas_like_conv(x.dtype):
        for first, end in _chunks(call, x.element_size()):
            images = end - first
            # [image, channel, slot, position]: the product writes the output's own layout.
            columns = torch.empty(images, call.channels, call.slots, positions, dtype=x.dtype, device=x.device)
            _launch_columns(x, columns, columns.stride()[:3], call, first, end)
            torch.matmul(weight_rows, columns.view(images, call.groups, depth, positions),
                         out=out[first:end].view(images, call.groups, call.out_per_group, positions))
    if bias is not None:
        out += bias.view(1, -1, 1, 1)
    return out


def _fold(windows: torch.Tensor, call: _Call) -> torch.Tensor:
    """Window-value gradients ``(images, C * k*k, L)`` summed into the input's pixels by ``F.fold``."""
    left, right, top, bottom = call.pad
    k = call.geometry.kernel_size
    if left == right and top == bottom:
        return F.fold(windows, (call.height, call.width), k, dilation=call.dilation, padding=(top, left),
                      stride=call.stride)
    padded = F.fold(windows, (call.height + top + bottom, call.width + left + right), k, dilation=call.dilation,
                    stride=call.stride)
    return padded[:, :, top:top + call.height, left:left + call.width]


def _columns_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool):
    positions = call.out_h * call.out_w
    depth = call.in_per_group * call.slots
    weight_rows = _weight_in_slots(weight, call).reshape(call.groups, call.out_per_group, depth)
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    grad_rows = torch.zeros(call.groups, call.out_per_group, depth, dtype=accumulate, device=x.device) \
        if need_weight else None
    grad_input = torch.empty_like(x, memory_format=torch.contiguous_format) if need_input else None
    meta = _settings("unsort_kernel", call, x.dtype)
    with _cublas_like_conv(x.dtype):
        # Per chunk: the columns and their gradient (x's dtype), and the window gradients (accumulate's).
        for first, end in _chunks(call, 2 * x.element_size() + torch.finfo(accumulate).bits // 8):
            images = end - first
            # [group, out, image * position]: each product below is one GEMM per group over the chunk.
            grad_part = (grad_out[first:end].view(images, call.groups, call.out_per_group, positions)
                         .permute(1, 2, 0, 3).reshape(call.groups, call.out_per_group, images * positions))
            if need_weight:
                # [channel, slot, image, position]: a group's rows are (channel, slot), its columns (image, l).
                columns = torch.empty(call.channels, call.slots, images, positions, dtype=x.dtype, device=x.device)
                _launch_columns(x, columns, (columns.stride(2), columns.stride(0), columns.stride(1)), call, first,
                                end)
                grad_rows += torch.matmul(grad_part, columns.view(call.groups, depth, images * positions)
                                          .transpose(1, 2)).to(accumulate)
                del columns
            if need_input:
                grad_columns = torch.matmul(weight_rows.transpose(1, 2), grad_part)  # [channel, slot, image, l]
                windows = torch.empty(images, call.channels, call.slots, positions, dtype=accumulate,
                                      device=x.device)
                part = x[first:end]
                load_kernels(call.geometry)["unsort_kernel"][_column_grid(call, meta, images)](
                    part, grad_columns, windows, call.channels, *call.position_args(part, images), positions,
                    call.slots * images * positions, images * positions, *windows.stride()[:3], **meta)
                del grad_columns
                grad_input[first:end] = _fold(windows.view(images, call.channels * call.slots, positions), call)
    grad_weight = None
    if need_weight:
        grad_weight = _weight_from_slots(grad_rows.view(call.groups, call.out_per_group, call.in_per_group,
                                                        call.slots), call).to(weight.dtype)
    return grad_input, grad_weight


def _direct_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool):
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    weight_slots = _slot_major(weight, call)
    # Same strides as x (contiguous or channels_last), which the kernel addresses both by.
    grad_x = torch.zeros_like(x, dtype=accumulate) if need_input else x
    grad_w = torch.zeros(weight_slots.shape, dtype=accumulate, device=x.device) if need_weight else weight_slots
    assert grad_x.stride() == x.stride()
    meta = _settings("direct_backward_kernel", call, x.dtype, need_input=need_input, need_weight=need_weight)
    load_kernels(call.geometry)["direct_backward_kernel"][_direct_grid(call, meta)](
        x, weight_slots, grad_out, grad_x, grad_w, call.groups, call.in_per_group, call.out_per_group,
        *call.position_args(x, call.batch), *grad_out.stride(), **meta)
    grad_input = grad_x.to(x.dtype) if need_input else None
    grad_weight = _from_slot_major(grad_w, call).to(weight.dtype) if need_weight else None
    return grad_input, grad_weight


def forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geometry: SortGeometry,
            stride: Tuple[int, int], dilation: Tuple[int, int], groups: int,
            pad: Tuple[int, int, int, int] = NO_PADDING) -> torch.Tensor:
    """SC of ``x`` (contiguous or channels_last, unpadded: ``pad`` zeros in ``F.pad``'s order are read as
    zeros) with ``weight`` and ``bias`` of x's dtype, on the path :func:`config.choose_path` picks."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    path = config.choose_path(call.in_per_group, call.out_per_group, call.largest_segment,
                              *_fused_occupancy(x, weight, call), slots=call.slots)
    if path == "direct":
        return _direct_forward(x, weight, bias, call)
    if path == "fused":
        return _fused_forward(x, weight, bias, call)
    return _columns_forward(x, weight, bias, call)


def backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: SortGeometry,
             stride: Tuple[int, int], dilation: Tuple[int, int], groups: int, need_input: bool, need_weight: bool,
             pad: Tuple[int, int, int, int] = NO_PADDING) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(grad_input, grad_weight)`` of :func:`forward` for a contiguous ``grad_out`` (None where not needed)."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    if config.choose_path(call.in_per_group, call.out_per_group, call.largest_segment) == "direct":
        return _direct_backward(grad_out, x, weight, call, need_input, need_weight)
    return _columns_backward(grad_out, x, weight, call, need_input, need_weight)


def supports_triton(x, weight, bias, geometry: SortGeometry, stride, dilation, groups) -> bool:
    """Whether the kernels compute this call as the reference path does: Triton installed, CUDA tensors (CPU
    tensors under the interpreter) of one device with one dtype among :data:`SUPPORTED_DTYPES`, and ``k <=``
    :data:`MAX_KERNEL_SIZE` (beyond, the sorting networks would not fit a lane's registers)."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    return (
        triton is not None
        and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))
        and all(t.device == x.device and t.dtype == x.dtype for t in tensors)
        and x.dtype in SUPPORTED_DTYPES
        and geometry.kernel_size <= MAX_KERNEL_SIZE
    )


def _available() -> bool:
    return triton is not None and (torch.cuda.is_available() or INTERPRETED)


if triton is not None:
    from .source import load_kernels

register_backend(Backend("triton", forward, backward, supports_triton, _available,
                         auto=os.environ.get(AUTO_ENV, "") == "1", zero_padding=True, channels_last=True))
