"""The Triton backend for CUDA tensors (``backend="triton"``).

One program takes a block of output positions (of any images) and a block of output channels of one
group and loops over the group's input channels. Per channel it loads the ``k*k`` window of every
position, forms the samples with one small matrix product by the sampling matrix (bilinear taps for
polar sampling, a permutation for square sampling), and sorts each ring or window by *ranks*: the
slot of sample ``i`` is the number of samples of its segment that are smaller, ties broken by index,
so the ranks are always a permutation (a NaN compares false with everything and only ever makes its
own window NaN). The sorted panel is multiplied into the output tile with ``tl.dot`` in IEEE fp32
(no TF32). Backward recomputes the ranks, routes the panel's gradient back through them and the
transposed sampling matrix, and accumulates the input and weight gradients with atomics; nothing but
the padded input and the weight is saved.

The ranks cost ``(k*k)^2`` comparisons per window and channel, which is why this backend stops at
``k = 7``. It only takes CUDA tensors and has not been run on a GPU in this project (no GPU was at
hand); its correctness is tested on the CPU with Triton's interpreter (``TRITON_INTERPRET=1``). Until it
has been, ``backend="auto"`` leaves it out unless ``TIMM_SORTCONV_TRITON_AUTO=1`` is set.
"""

import os
from typing import Dict, Optional, Tuple

import torch

from .backends import Backend, register_backend
from .geometry import SortGeometry

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs and machines without the CUDA build of torch
    triton = None

__all__ = ["MAX_KERNEL_SIZE", "MAX_OUT_PER_GROUP", "sort_conv2d_triton", "supports_triton"]

MAX_KERNEL_SIZE = 7
MAX_OUT_PER_GROUP = 256
BLOCK_POSITIONS = 16


def _next_power_of_two(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _forward_kernel(x_ptr, w_ptr, b_ptr, out_ptr, sampling_ptr, grid_offset_ptr, segment_ptr, segment_start_ptr,
                        total, positions, out_w, channels, in_per_group, out_channels, out_per_group, plane, in_w,
                        stride_h, stride_w, SLOTS: tl.constexpr, S: tl.constexpr, BLOCK_P: tl.constexpr,
                        BLOCK_O: tl.constexpr, HAS_BIAS: tl.constexpr):
        group = tl.program_id(2)
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        p_mask = p < total
        image = p // positions
        position = p % positions
        window = image * channels * plane + (position // out_w) * stride_h * in_w + (position % out_w) * stride_w
        slot = tl.arange(0, S)
        slot_mask = slot < SLOTS
        grid_offset = tl.load(grid_offset_ptr + slot, mask=slot_mask, other=0)
        segment = tl.load(segment_ptr + slot)
        segment_start = tl.load(segment_start_ptr + slot)
        sampling_t = tl.load(sampling_ptr + slot[:, None] * S + slot[None, :])  # [window position, sample]
        same = (segment[:, None] == segment[None, :])[None, :, :]  # [1, sample i, sample j]
        earlier = (slot[None, :] < slot[:, None])[None, :, :]  # j < i
        o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        o_mask = o < out_per_group
        acc = tl.zeros([BLOCK_P, BLOCK_O], dtype=x_ptr.dtype.element_ty)
        for c in range(0, in_per_group):
            channel = group * in_per_group + c
            values = tl.load(x_ptr + (window + channel * plane)[:, None] + grid_offset[None, :],
                             mask=p_mask[:, None] & slot_mask[None, :], other=0.0)
            samples = tl.dot(values, sampling_t, input_precision="ieee")
            # The slot of each sample once its segment is sorted ascending, ties by index: [P, S].
            before = same & ((samples[:, None, :] < samples[:, :, None])
                             | ((samples[:, None, :] == samples[:, :, None]) & earlier))
            rank = tl.sum(before.to(tl.int32), axis=2) + segment_start[None, :]
            hit = rank[:, :, None] == slot[None, None, :]  # [P, sample, slot]
            ordered = tl.sum(tl.where(hit, samples[:, :, None], 0.0), axis=1)
            w = tl.load(w_ptr + (group * out_per_group + o)[None, :] * (in_per_group * SLOTS) + c * SLOTS
                        + slot[:, None], mask=slot_mask[:, None] & o_mask[None, :], other=0.0)
            acc += tl.dot(ordered, w, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(b_ptr + group * out_per_group + o, mask=o_mask, other=0.0)[None, :]
        out = out_ptr + (image * out_channels * positions + position)[:, None] \
            + ((group * out_per_group + o) * positions)[None, :]
        tl.store(out, acc, mask=p_mask[:, None] & o_mask[None, :])

    @triton.jit
    def _backward_kernel(x_ptr, w_ptr, grad_out_ptr, grad_x_ptr, grad_w_ptr, sampling_ptr, grid_offset_ptr,
                         segment_ptr, segment_start_ptr, total, positions, out_w, channels, in_per_group,
                         out_channels, out_per_group, plane, in_w, stride_h, stride_w, SLOTS: tl.constexpr,
                         S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr, NEED_X: tl.constexpr,
                         NEED_W: tl.constexpr):
        group = tl.program_id(1)
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        p_mask = p < total
        image = p // positions
        position = p % positions
        window = image * channels * plane + (position // out_w) * stride_h * in_w + (position % out_w) * stride_w
        slot = tl.arange(0, S)
        slot_mask = slot < SLOTS
        grid_offset = tl.load(grid_offset_ptr + slot, mask=slot_mask, other=0)
        segment = tl.load(segment_ptr + slot)
        segment_start = tl.load(segment_start_ptr + slot)
        sampling_t = tl.load(sampling_ptr + slot[:, None] * S + slot[None, :])
        same = (segment[:, None] == segment[None, :])[None, :, :]
        earlier = (slot[None, :] < slot[:, None])[None, :, :]
        o = tl.arange(0, BLOCK_O)
        o_mask = o < out_per_group
        grad_out = tl.load(grad_out_ptr + (image * out_channels * positions + position)[:, None]
                           + ((group * out_per_group + o) * positions)[None, :],
                           mask=p_mask[:, None] & o_mask[None, :], other=0.0)
        for c in range(0, in_per_group):
            channel = group * in_per_group + c
            values = tl.load(x_ptr + (window + channel * plane)[:, None] + grid_offset[None, :],
                             mask=p_mask[:, None] & slot_mask[None, :], other=0.0)
            samples = tl.dot(values, sampling_t, input_precision="ieee")
            # The slot of each sample once its segment is sorted ascending, ties by index: [P, S].
            before = same & ((samples[:, None, :] < samples[:, :, None])
                             | ((samples[:, None, :] == samples[:, :, None]) & earlier))
            rank = tl.sum(before.to(tl.int32), axis=2) + segment_start[None, :]
            hit = rank[:, :, None] == slot[None, None, :]  # [P, sample, slot]
            w_rows = (group * out_per_group + o)[None, :] * (in_per_group * SLOTS) + c * SLOTS + slot[:, None]
            if NEED_W:
                ordered = tl.sum(tl.where(hit, samples[:, :, None], 0.0), axis=1)
                grad_w = tl.dot(tl.trans(grad_out), ordered, input_precision="ieee")
                tl.atomic_add(grad_w_ptr + tl.trans(w_rows), grad_w, mask=o_mask[:, None] & slot_mask[None, :])
            if NEED_X:
                w = tl.load(w_ptr + w_rows, mask=slot_mask[:, None] & o_mask[None, :], other=0.0)
                grad_ordered = tl.dot(grad_out, tl.trans(w), input_precision="ieee")
                grad_samples = tl.sum(tl.where(hit, grad_ordered[:, None, :], 0.0), axis=2)
                grad_values = tl.dot(grad_samples, tl.trans(sampling_t), input_precision="ieee")
                tl.atomic_add(grad_x_ptr + (window + channel * plane)[:, None] + grid_offset[None, :], grad_values,
                              mask=p_mask[:, None] & slot_mask[None, :])


class _Tables:
    """Per geometry and dtype: the sampling matrix, segments and slot order, padded to S slots."""

    def __init__(self, geometry: SortGeometry, dtype: torch.dtype, device: torch.device) -> None:
        slots = geometry.kernel_size ** 2
        self.size = _next_power_of_two(slots)
        sampling = torch.zeros(self.size, self.size, dtype=torch.float64)
        sampling[:slots, :slots] = geometry.interpolation.t()  # [window position, sample]
        self.sampling = sampling.to(device=device, dtype=dtype).contiguous()
        segment = torch.arange(self.size, dtype=torch.int32) + len(geometry.segments)  # padding: alone
        start = torch.arange(self.size, dtype=torch.int32)
        for index, (first, end) in enumerate(geometry.segments):
            segment[first:end] = index
            start[first:end] = first
        self.segment, self.segment_start = segment.to(device), start.to(device)
        self.slot_to_grid = geometry.slot_to_grid.to(device)
        self.grid_to_slot = torch.argsort(geometry.slot_to_grid).to(device)


_tables: Dict[tuple, _Tables] = {}


def _tables_for(geometry: SortGeometry, dtype: torch.dtype, device: torch.device) -> _Tables:
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting, dtype, str(device))
    if key not in _tables:
        _tables[key] = _Tables(geometry, dtype, device)
    return _tables[key]


def _launch_geometry(x, geometry, stride, dilation):
    k = geometry.kernel_size
    hp, wp = x.shape[2:]
    out_h = (hp - dilation[0] * (k - 1) - 1) // stride[0] + 1
    out_w = (wp - dilation[1] * (k - 1) - 1) // stride[1] + 1
    q = torch.arange(k * k)
    offsets = (q // k) * dilation[0] * wp + (q % k) * dilation[1]
    return out_h, out_w, offsets.to(device=x.device, dtype=torch.int32)


def _weight_slots(weight: torch.Tensor, tables: _Tables) -> torch.Tensor:
    flat = weight.reshape(weight.shape[0], weight.shape[1], -1)
    return flat.index_select(2, tables.slot_to_grid).reshape(weight.shape[0], -1).contiguous()


def _forward(x, weight, bias, geometry, stride, dilation, groups):
    tables = _tables_for(geometry, x.dtype, x.device)
    batch, channels = x.shape[:2]
    out_channels = weight.shape[0]
    out_per_group = out_channels // groups
    out_h, out_w, grid_offset = _launch_geometry(x, geometry, stride, dilation)
    output = torch.empty(batch, out_channels, out_h, out_w, dtype=x.dtype, device=x.device)
    total = batch * out_h * out_w
    block_o = min(64, _next_power_of_two(out_per_group))
    launch = (triton.cdiv(total, BLOCK_POSITIONS), triton.cdiv(out_per_group, block_o), groups)
    _forward_kernel[launch](
        x, _weight_slots(weight, tables), bias if bias is not None else x, output, tables.sampling, grid_offset,
        tables.segment, tables.segment_start, total, out_h * out_w, out_w, channels, channels // groups,
        out_channels, out_per_group, x.shape[2] * x.shape[3], x.shape[3], stride[0], stride[1],
        SLOTS=geometry.kernel_size ** 2, S=tables.size, BLOCK_P=BLOCK_POSITIONS, BLOCK_O=block_o,
        HAS_BIAS=bias is not None)
    return output


def _backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight):
    tables = _tables_for(geometry, x.dtype, x.device)
    batch, channels = x.shape[:2]
    out_channels = weight.shape[0]
    out_per_group = out_channels // groups
    out_h, out_w, grid_offset = _launch_geometry(x, geometry, stride, dilation)
    weight_slots = _weight_slots(weight, tables)
    grad_input = torch.zeros_like(x)
    grad_weight_slots = torch.zeros_like(weight_slots)
    total = batch * out_h * out_w
    _backward_kernel[(triton.cdiv(total, BLOCK_POSITIONS), groups)](
        x, weight_slots, grad_output, grad_input, grad_weight_slots, tables.sampling,
        grid_offset, tables.segment, tables.segment_start, total, out_h * out_w, out_w, channels,
        channels // groups, out_channels, out_per_group, x.shape[2] * x.shape[3], x.shape[3], stride[0],
        stride[1], SLOTS=geometry.kernel_size ** 2, S=tables.size, BLOCK_P=BLOCK_POSITIONS,
        BLOCK_O=_next_power_of_two(out_per_group), NEED_X=bool(need_input), NEED_W=bool(need_weight))
    grad_weight = None
    if need_weight:
        grad_weight = (grad_weight_slots.view(out_channels, weight.shape[1], -1)
                       .index_select(2, tables.grid_to_slot).view_as(weight))
    return grad_input, grad_weight


def sort_conv2d_triton(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geometry: SortGeometry,
                       stride: Tuple[int, int], dilation: Tuple[int, int], groups: int, pad=(0, 0, 0, 0)) -> torch.Tensor:
    """The backend's forward kernel, on an already padded input."""
    return _forward(x, weight, bias, geometry, stride, dilation, groups)


def sort_conv2d_triton_backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight,
                                pad=(0, 0, 0, 0)):
    """The backend's backward kernel: ranks again; gradients of the padded input and the weight."""
    return _backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight)


def supports_triton(x, weight, bias, geometry: SortGeometry, stride, dilation, groups) -> bool:
    """CUDA tensors of one device and dtype (float32/float64), ``k <= 7``, at most 256 outputs per group."""
    tensors = [x, weight] + ([bias] if bias is not None else [])
    return (
        triton is not None
        and x.is_cuda
        and all(t.device == x.device and t.dtype == x.dtype for t in tensors)
        and x.dtype in (torch.float32, torch.float64)
        and geometry.kernel_size <= MAX_KERNEL_SIZE
        and weight.shape[0] // groups <= MAX_OUT_PER_GROUP
    )


def _available() -> bool:
    return triton is not None and torch.cuda.is_available()


# Not yet run on a GPU: backend="auto" takes it only with TIMM_SORTCONV_TRITON_AUTO=1 (backend="triton" always).
register_backend(Backend("triton", sort_conv2d_triton, sort_conv2d_triton_backward, supports_triton, _available,
                         auto=os.environ.get("TIMM_SORTCONV_TRITON_AUTO", "") == "1"))
