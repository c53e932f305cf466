"""The Triton backend for CUDA tensors: what ``backend="auto"`` runs on a GPU, and ``backend="triton"``.

Kernels are generated per geometry (:mod:`.source`): each lane of a program sorts one (output position,
input channel) window with the geometry's comparator network, in registers, reading the input in place
(zero padding is a masked read, so autograd keeps only the input and the weight, as for ``nn.Conv2d``).
Four paths use them (:mod:`.config`: which paths a call may take, and their block sizes; ``backend="triton-<path>"``
runs one of them for a call):

* ``direct`` (windows of at most 25 samples, k <= 5; its backward 9, k = 3): groups with few input
  channels (depthwise convolutions), one group per program: FMAs of scalar weights into an accumulator per
  output; the backward sorts again, records the swaps, and adds the input and weight gradients with
  atomics.
* ``fused`` (forward, windows of at most 9 samples: k = 3): an implicit GEMM; each sorted slot tile goes
  straight into ``tl.dot``.
* ``gemm`` (windows of at most 49 samples, k <= 7; not taken by ``auto`` in float64): an implicit GEMM with
  a block of positions per program: the sorted slots of BLOCK_C channels at a block of positions are one
  ``[positions, BLOCK_C * K]`` operand of ``tl.dot`` (K: a channel's slots padded to a power of two >= 16).
  Its backward sorts again: one kernel records the swaps and sends the slots' gradient (a ``tl.dot`` of the
  output gradient and the weights) back to the window values, which ``F.fold`` gathers per input pixel (or,
  a candidate of ``auto`` outside deterministic mode, adds them into the input gradient with atomics: no window
  values in memory); another sums the weight gradient's ``tl.dot`` products over splits of the positions, added
  in a fixed order. No columns are written to memory.
* ``columns``: sorted columns written for a bounded chunk of images and multiplied by cuBLAS. Also the
  backward of every call that is not direct: the weight and column gradients are cuBLAS products, a kernel
  sorts again recording the swaps (and writing the columns), another replays them in reverse to send the
  column gradient back through the taps, and ``F.fold`` gathers it per input pixel (or, a candidate of
  ``auto`` outside deterministic mode, the replay kernel adds it into the input gradient with atomics).

``backend="auto"`` (:func:`tuned_forward`, :func:`tuned_backward`) does not trust the kernels: nobody
has measured them on the user's GPU. Per configuration of a call, its first call checks every candidate
(each path the call may take, with each of its block sizes: :func:`candidates`) against the reference
path, leaves out with a warning any that fails or disagrees, and keeps the fastest of the reference and
the rest, timed on the GPU (:mod:`.tuning`, which also says how deterministic mode, CUDA graph capture
and ``TIMM_SORTCONV_TUNE=0`` change that). ``backend="triton"`` runs the first candidate directly.

Precision: sorting and interpolation are exact in the input's precision (float16/bfloat16 inputs are
interpolated and sorted in float32 and rounded once; rounding is monotonic, so that is the rounding of the
exactly sorted values). Products accumulate in float32 (float64 for float64). A float32 product uses TF32
exactly where ``torch.backends.cudnn.allow_tf32`` (read per call) lets a convolution use it. Under
``torch.autocast`` the operator casts float32 tensors to the autocast dtype first, as autocast does for
``F.conv2d`` (:mod:`timm_sortconv.ops.operator`), and the result has that dtype.

Supported (:func:`supports_triton`): CUDA tensors of one device and of one dtype among float16, bfloat16,
float32 and float64, odd ``k <= 9``, any stride, dilation, groups, number of
channels, padding (zeros inside the kernels; other modes through ``F.pad`` first), ``torch.channels_last``
inputs and any batch size. Larger and even kernels take the reference path (networks of up to 121 values
per segment would not fit a lane's registers; the kernels' windows have a centre), and so does ``auto`` for
k = 9 (:data:`config.AUTO_MAX_KERNEL_SIZE`). A gradient whose own graph is being built (double backward)
is computed by the operator through the reference path.

Compilation: Triton compiles a kernel the first time a geometry, dtype and block configuration meets it,
and keeps it in its cache (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``) for later processes. The
sorting networks are long straight-line programs, and Triton's coalescing pass takes time that grows with
the number of memory operations times the square of the program's length; the kernels read a window one
position or row per memory operation, which Triton 3.6 keeps in registers where a whole-window tile spilled
(:mod:`.source`), and the columns path's backward is two kernels: every kernel ``auto`` can take for k <= 7 compiles for sm_90 without spills, in seconds to tens of
seconds (``scripts/triton_kernel_report.py`` compiles them for any GPU architecture, without one; its numbers
are in BENCHMARKS.md). Integer arguments are not specialized, so other batch sizes
or image sizes reuse the compiled kernels. ``auto``'s first call of a configuration compiles its candidates
in parallel threads first (:func:`prepare`: each candidate's code with every launch replaced by a compile of
the same kernel for the same arguments), so the wait is about the slowest compile, not their sum.

Under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported) the backend takes CPU
tensors, which is how its correctness is tested without a GPU; natively it takes CUDA tensors only.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..alignment import align_conv2d_harmonic, is_aligned
from ..backends import NO_PADDING, Backend, register_backend, registered_backend
from ..geometry import SortGeometry
from ..reference import autograd_backward, sort_conv2d_reference, sort_conv2d_reference_backward
from . import config, tuning
from .source import load_kernels, swap_words

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

__all__ = ["BACKWARD_KERNELS", "KERNELS", "KERNEL_PATHS", "MAX_KERNEL_SIZE", "SCATTER_KERNELS", "SCATTER_PATHS", "SUPPORTED_DTYPES", "backward", "candidates", "forward",
           "launch_settings", "prepare", "supports_triton", "tuned_backward", "tuned_forward"]

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
    def window_span(self) -> Tuple[int, int]:
        """The rows and columns of the input one window spans."""
        k = self.geometry.kernel_size
        return (k - 1) * self.dilation[0] + 1, (k - 1) * self.dilation[1] + 1

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


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launch grids: ``triton.cdiv`` is a JIT function, and a call of it from Python costs
    microseconds of the host's time per launch."""
    return -(-a // b)


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


# The weight's layouts the kernels read, each made by one gather (torch.take: one kernel, where a selection
# and a permuted copy were two) with an index table per (geometry, weight shape, groups, layout, device).
# (layout, axes): the order of the layout's axes among (group, out, in, slot).
LAYOUTS = {"slots": (0, 1, 2, 3), "slot_major": (0, 3, 2, 1), "channel_major": (0, 2, 3, 1)}
_layout_indices: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}


def _layout_index(call: "_Call", layout: str, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(gather, scatter)``: the flat weight positions read into ``layout`` (shaped as the layout), and, per flat
    weight position, where the layout holds it (for a gradient in that layout); cached, no copy per call."""
    geometry = call.geometry
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting, call.out_channels, call.in_per_group,
           call.groups, layout, str(device))
    if key not in _layout_indices:
        slots = call.slots
        # flat (O, C/g, k, k) position of every (group, out, in, slot) entry: slot s multiplies grid slot_to_grid[s]
        flat = (torch.arange(call.out_channels).view(call.groups, call.out_per_group, 1, 1) * (call.in_per_group * slots)
                + torch.arange(call.in_per_group).view(1, 1, -1, 1) * slots
                + geometry.slot_to_grid.view(1, 1, 1, -1))
        gather = flat.permute(*LAYOUTS[layout]).contiguous()
        scatter = torch.empty_like(gather).view(-1)
        scatter[gather.view(-1)] = torch.arange(gather.numel())
        _layout_indices[key] = (gather.to(device), scatter.to(device))
    return _layout_indices[key]


def _weight_in(layout: str, weight: torch.Tensor, call: "_Call") -> torch.Tensor:
    """``(O, C/g, k, k)`` -> the weight in ``layout`` (:data:`LAYOUTS`; ``slots``: ``(G, O/g, C/g, slots)``, slots
    in the geometry's order; ``slot_major``: ``[group, slot, in_per_group, out_per_group]`` for the fused and
    direct kernels; ``channel_major``: ``[group, in_per_group, slot, out_per_group]`` for the gemm kernels)."""
    return torch.take(weight, _layout_index(call, layout, weight.device)[0])


def _weight_from(layout: str, grad: torch.Tensor, call: "_Call") -> torch.Tensor:
    """The inverse of :func:`_weight_in`: a gradient laid out as ``layout`` -> ``(O, C/g, k, k)``."""
    k = call.geometry.kernel_size
    return torch.take(grad, _layout_index(call, layout, grad.device)[1]).view(call.out_channels, call.in_per_group,
                                                                              k, k)


# Each kernel and the path whose block sizes it takes.
KERNEL_PATHS = {"columns_kernel": "columns", "record_kernel": "columns", "replay_kernel": "columns",
                "fused_forward_kernel": "fused",
                "direct_forward_kernel": "direct", "direct_backward_kernel": "direct",
                "gemm_forward_kernel": "gemm", "gemm_input_backward_kernel": "gemm",
                "gemm_weight_backward_kernel": "gemm"}
KERNELS = tuple(KERNEL_PATHS)
# The kernels that take their path's backward block sizes (config.blocks_of(..., backward=True)).
BACKWARD_KERNELS = ("direct_backward_kernel", "gemm_input_backward_kernel", "gemm_weight_backward_kernel")
# The kernels that send the input gradient to the window values and, with SCATTER, add them into the input
# gradient with atomics instead of writing them for F.fold; the paths whose backward they are.
SCATTER_KERNELS = ("replay_kernel", "gemm_input_backward_kernel")
SCATTER_PATHS = tuple(KERNEL_PATHS[kernel] for kernel in SCATTER_KERNELS)


def launch_settings(kernel: str, geometry: SortGeometry, dtype: torch.dtype, groups: int, in_per_group: int,
                    out_per_group: int, has_bias: bool = True, need_input: bool = True, need_weight: bool = True,
                    blocks: Optional[tuple] = None, scatter: bool = False) -> dict:
    """The compile-time arguments (block sizes, dtypes, flags, ``num_warps``, ``num_stages``) with which
    the backend launches ``kernel`` (one of :data:`KERNELS`) for such a call: with ``blocks``, one of its
    path's candidates (:func:`config.blocks_of`), else the first; ``scatter``: the gemm input gradient's
    kernel or the columns path's replay kernel adding into the input gradient with atomics
    (:func:`_gemm_backward`, :func:`_columns_backward`).
    ``scripts/triton_kernel_report.py`` compiles the kernels with them."""
    compute = _compute_dtype(dtype)
    path = KERNEL_PATHS.get(kernel)
    if path is None:
        raise ValueError(f"unknown kernel {kernel!r}; accepted: {', '.join(KERNELS)}")
    blocks = blocks or config.blocks_of(path, geometry.kernel_size ** 2, groups, out_per_group,
                                        backward=kernel in BACKWARD_KERNELS)[0]
    if path == "columns":
        block_p, block_c, warps = blocks
        meta = dict(COMPUTE=compute, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps, num_stages=1)
        if kernel in SCATTER_KERNELS:
            return dict(meta, SCATTER=bool(scatter))
        return dict(meta, STORE_COLUMNS=bool(need_weight)) if kernel == "record_kernel" else meta
    if path == "gemm":
        block_p, block_o, block_c, warps = blocks
        meta = dict(COMPUTE=compute, ACCUMULATE=compute, PRECISION=_dot_precision(dtype), BLOCK_P=block_p,
                    BLOCK_O=block_o, BLOCK_C=block_c, num_warps=warps, num_stages=1)
        if kernel in SCATTER_KERNELS:
            return dict(meta, SCATTER=bool(scatter))
        return dict(meta, HAS_BIAS=has_bias) if kernel == "gemm_forward_kernel" else meta
    if path == "fused":
        block_p, block_c, block_o, warps = blocks
        # One stage: software pipelining would keep a buffer per sorted slot's weight tile and stage (Triton
        # took 442 s to compile such a 7x7 kernel, which then spilled), for tiles that hit the cache anyway.
        return dict(COMPUTE=compute, ACCUMULATE=compute, PRECISION=_dot_precision(dtype), HAS_BIAS=has_bias,
                    BLOCK_P=block_p, BLOCK_C=block_c, BLOCK_O=block_o, num_warps=warps, num_stages=1)
    block_p, block_j, warps = blocks
    meta = dict(COMPUTE=compute, BLOCK_P=block_p, BLOCK_J=block_j, num_warps=warps, num_stages=1)
    if kernel == "direct_forward_kernel":
        return dict(meta, HAS_BIAS=has_bias)
    return dict(meta, NEED_X=bool(need_input), NEED_W=bool(need_weight))


# Set in a thread while :func:`prepare` runs a candidate there: its launches compile instead of running.
_COMPILE_ONLY = threading.local()


def _launch(kernel, grid: tuple):
    """``kernel[grid]``, the launcher every path calls; while :func:`prepare` runs in this thread, a call that
    compiles ``kernel`` for the same arguments (the same specialization, hence the same cache entry) without
    running it."""
    if getattr(_COMPILE_ONLY, "active", False):
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


def prepare(path_function, *args, **kwargs) -> None:
    """Compiles the kernels ``path_function(*args, **kwargs)`` launches, without running them (what
    ``auto`` calls in parallel threads before checking its candidates). The path's own tensor work still
    runs, on buffers the kernels did not fill, under ``torch.no_grad`` on the arguments' device."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    _COMPILE_ONLY.active = True
    try:
        with torch.no_grad(), torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            path_function(*args, **kwargs)
    finally:
        _COMPILE_ONLY.active = False


def _settings(kernel: str, call: _Call, dtype: torch.dtype, blocks: Optional[tuple], **flags) -> dict:
    return launch_settings(kernel, call.geometry, dtype, call.groups, call.in_per_group, call.out_per_group,
                           blocks=blocks, **flags)


def _direct_grid(call: _Call, meta: dict) -> tuple:
    return (_cdiv(call.batch * call.out_h * call.out_w, meta["BLOCK_P"]), call.groups,
            _cdiv(call.out_per_group, meta["BLOCK_J"]))


def _direct_forward(x, weight, bias, call: _Call, blocks: Optional[tuple] = None):
    out = _empty_output(x, call)
    meta = _settings("direct_forward_kernel", call, x.dtype, blocks, has_bias=bias is not None)
    _launch(load_kernels(call.geometry)["direct_forward_kernel"], _direct_grid(call, meta))(
        x, _weight_in("slot_major", weight, call), bias if bias is not None else x, out, call.in_per_group,
        call.out_per_group, *call.position_args(x, call.batch), *out.stride(), **meta)
    return out


def _fused_grid(call: _Call, meta: dict) -> tuple:
    return (_cdiv(call.batch * call.out_h * call.out_w, meta["BLOCK_P"]),
            _cdiv(call.out_per_group, meta["BLOCK_O"]), call.groups)


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _fused_occupancy(x, call: _Call) -> Tuple[int, int]:
    """(programs of the fused kernel, multiprocessors of x's GPU; 0 off CUDA) for :func:`config.choose_path`."""
    if not x.is_cuda:
        return 0, 0
    meta = _settings("fused_forward_kernel", call, x.dtype, None)
    programs = 1
    for size in _fused_grid(call, meta):
        programs *= size
    return programs, _multiprocessors(x.device)


def _fused_forward(x, weight, bias, call: _Call, blocks: Optional[tuple] = None):
    out = _empty_output(x, call)
    meta = _settings("fused_forward_kernel", call, x.dtype, blocks, has_bias=bias is not None)
    _launch(load_kernels(call.geometry)["fused_forward_kernel"], _fused_grid(call, meta))(
        x, _weight_in("slot_major", weight, call), bias if bias is not None else x, out, call.in_per_group,
        call.out_per_group, *call.position_args(x, call.batch), *out.stride(), **meta)
    return out


def _zeroed_input_gradient(x: torch.Tensor, accumulate: torch.dtype) -> torch.Tensor:
    """A zeroed buffer for an input gradient that kernels add into with atomics: ``accumulate``'s dtype and x's
    strides (contiguous or channels_last), which the kernels address both by."""
    grad_x = torch.zeros_like(x, dtype=accumulate)
    assert grad_x.stride() == x.stride()
    return grad_x


def _chunks(call: _Call, lane_bytes: int):
    """``(first, end)`` image ranges of the columns path, for buffers of ``lane_bytes`` bytes per (channel,
    output position) window together."""
    images = config.column_images(call.channels * call.out_h * call.out_w * lane_bytes, call.batch)
    for first in range(0, call.batch, images):
        yield first, min(call.batch, first + images)


def _column_grid(call: _Call, meta: dict, images: int) -> tuple:
    return (_cdiv(images * call.out_h * call.out_w, meta["BLOCK_P"]), _cdiv(call.channels, meta["BLOCK_C"]))


def _launch_columns(x, columns, column_strides, call: _Call, first: int, end: int, blocks: Optional[tuple]):
    """Sorted columns of images [first, end) into ``columns`` (strides: image, channel, slot)."""
    meta = _settings("columns_kernel", call, x.dtype, blocks)
    part = x[first:end]
    _launch(load_kernels(call.geometry)["columns_kernel"], _column_grid(call, meta, end - first))(
        part, columns, call.channels, *call.position_args(part, end - first), *column_strides, **meta)


def _columns_forward(x, weight, bias, call: _Call, blocks: Optional[tuple] = None):
    positions = call.out_h * call.out_w
    depth = call.in_per_group * call.slots
    weight_rows = _weight_in("slots", weight, call).reshape(call.groups, call.out_per_group, depth)
    out = torch.empty(call.batch, call.out_channels, call.out_h, call.out_w, dtype=x.dtype, device=x.device)
    with _cublas_like_conv(x.dtype):
        for first, end in _chunks(call, call.slots * x.element_size()):
            images = end - first
            # [image, channel, slot, position]: the product writes the output's own layout.
            columns = torch.empty(images, call.channels, call.slots, positions, dtype=x.dtype, device=x.device)
            _launch_columns(x, columns, columns.stride()[:3], call, first, end, blocks)
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


def _fold_chunk(grad_input: Optional[torch.Tensor], windows: torch.Tensor, call: _Call, first: int, end: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The input gradient (``dtype``) with images ``[first, end)`` folded from their window gradients ``windows``:
    the fold itself where the chunk is the whole batch (no buffer to copy it into), else written into
    ``grad_input``, made at the first chunk (``None`` before it)."""
    folded = _fold(windows.view(end - first, call.channels * call.slots, -1), call)
    if first == 0 and end == call.batch:
        return folded.to(dtype)
    if grad_input is None:
        grad_input = torch.empty(call.batch, call.channels, call.height, call.width, dtype=dtype,
                                 device=windows.device)
    grad_input[first:end] = folded
    return grad_input


def _columns_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool,
                      blocks: Optional[tuple] = None, scatter: bool = False):
    """The columns path's backward, per chunk of images: the weight gradient as the product of the output
    gradient with the sorted columns; the input gradient as the column gradient (the weight times the output
    gradient) sent back through each window's recorded swaps and taps (the record and replay kernels) and
    gathered per input pixel by ``F.fold``, or with ``scatter`` added into the input gradient by the replay
    kernel's atomics (no window values in memory; sums in a varying order, so ``auto`` leaves it out in
    deterministic mode). The record kernel writes the columns too where both are asked for, so each window is
    sorted once."""
    positions = call.out_h * call.out_w
    depth = call.in_per_group * call.slots
    words = swap_words(call.geometry)
    weight_rows = _weight_in("slots", weight, call).reshape(call.groups, call.out_per_group, depth)
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    grad_rows = torch.zeros(call.groups, call.out_per_group, depth, dtype=accumulate, device=x.device) \
        if need_weight else None
    grad_input = None
    record = _settings("record_kernel", call, x.dtype, blocks, need_weight=need_weight)
    replay = _settings("replay_kernel", call, x.dtype, blocks, scatter=scatter)
    kernels = load_kernels(call.geometry)
    # Per window: the columns and their gradient (x's dtype), the window gradients (accumulate's; none with
    # scatter, whose input gradient has x's shape), the swaps.
    windows_bytes = 0 if scatter else torch.finfo(accumulate).bits // 8
    lane_bytes = call.slots * (2 * x.element_size() + windows_bytes) + 4 * words
    grad_x = _zeroed_input_gradient(x, accumulate) if scatter and need_input else None
    with _cublas_like_conv(x.dtype):
        for first, end in _chunks(call, lane_bytes):
            images = end - first
            part = x[first:end]
            # [group, out, image * position]: each product below is one GEMM per group over the chunk.
            grad_part = (grad_out[first:end].view(images, call.groups, call.out_per_group, positions)
                         .permute(1, 2, 0, 3).reshape(call.groups, call.out_per_group, images * positions))
            # [channel, slot, image, position]: a group's rows are (channel, slot), its columns (image, l).
            columns = torch.empty(call.channels, call.slots, images, positions, dtype=x.dtype, device=x.device) \
                if need_weight else part
            column_strides = (columns.stride(2), columns.stride(0), columns.stride(1)) if need_weight else (0, 0, 0)
            if need_input:
                swaps = torch.empty(call.channels, words, images, positions, dtype=torch.int32, device=x.device)
                swap_strides = (swaps.stride(2), swaps.stride(0), swaps.stride(1))
                _launch(kernels["record_kernel"], _column_grid(call, record, images))(
                    part, columns, swaps, call.channels, *call.position_args(part, images), *column_strides,
                    *swap_strides, **record)
            else:
                _launch_columns(x, columns, column_strides, call, first, end, blocks)
            if need_weight:
                grad_rows += torch.matmul(grad_part, columns.view(call.groups, depth, images * positions)
                                          .transpose(1, 2)).to(accumulate)
                del columns
            if need_input:
                grad_columns = torch.matmul(weight_rows.transpose(1, 2), grad_part)  # [channel, slot, image, l]
                windows = grad_x[first:end] if scatter else torch.empty(
                    images, call.channels, call.slots, positions, dtype=accumulate, device=x.device)
                _launch(kernels["replay_kernel"], _column_grid(call, replay, images))(
                    swaps, grad_columns, windows, call.channels, *call.position_args(part, images), *swap_strides,
                    positions, call.slots * images * positions, images * positions,
                    *((0, 0, 0) if scatter else windows.stride()[:3]), **replay)
                del grad_columns, swaps
                if not scatter:
                    grad_input = _fold_chunk(grad_input, windows, call, first, end, x.dtype)
    if grad_x is not None:
        grad_input = grad_x.to(x.dtype)
    grad_weight = None
    if need_weight:
        grad_weight = _weight_from("slots", grad_rows.view(call.groups, call.out_per_group, call.in_per_group,
                                                        call.slots), call).to(weight.dtype)
    return grad_input, grad_weight


def _direct_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool,
                     blocks: Optional[tuple] = None):
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    weight_slots = _weight_in("slot_major", weight, call)
    grad_x = _zeroed_input_gradient(x, accumulate) if need_input else x
    grad_w = torch.zeros(weight_slots.shape, dtype=accumulate, device=x.device) if need_weight else weight_slots
    meta = _settings("direct_backward_kernel", call, x.dtype, blocks, need_input=need_input, need_weight=need_weight)
    _launch(load_kernels(call.geometry)["direct_backward_kernel"], _direct_grid(call, meta))(
        x, weight_slots, grad_out, grad_x, grad_w, call.in_per_group, call.out_per_group,
        *call.position_args(x, call.batch), *grad_out.stride(), **meta)
    grad_input = grad_x.to(x.dtype) if need_input else None
    grad_weight = _weight_from("slot_major", grad_w, call).to(weight.dtype) if need_weight else None
    return grad_input, grad_weight


def _gemm_forward(x, weight, bias, call: _Call, blocks: Optional[tuple] = None):
    out = _empty_output(x, call)
    meta = _settings("gemm_forward_kernel", call, x.dtype, blocks, has_bias=bias is not None)
    grid = (_cdiv(call.batch * call.out_h * call.out_w, meta["BLOCK_P"]),
            _cdiv(call.out_per_group, meta["BLOCK_O"]), call.groups)
    _launch(load_kernels(call.geometry)["gemm_forward_kernel"], grid)(
        x, _weight_in("channel_major", weight, call), bias if bias is not None else x, out, call.in_per_group,
        call.out_per_group, *call.position_args(x, call.batch), *out.stride(), **meta)
    return out


def _gemm_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool,
                   blocks: Optional[tuple] = None, scatter: bool = False):
    """The gemm path's backward: the input gradient per chunk of images (its window values written by the
    input kernel, ``F.fold`` gathering them per pixel), or with ``scatter`` in one launch whose kernel adds the
    window values into the input gradient with atomics (no buffer of window values, k * k times the input's
    size, written and read back; sums in a varying order, so ``auto`` leaves it out in deterministic mode);
    the weight gradient from partial sums over splits of the positions, added in a fixed order. Both sort
    the windows again from ``x``."""
    accumulate = torch.float64 if x.dtype == torch.float64 else torch.float32
    kernels = load_kernels(call.geometry)
    positions = call.out_h * call.out_w
    grad_input = grad_weight = None
    if need_input:
        meta = _settings("gemm_input_backward_kernel", call, x.dtype, blocks, scatter=scatter)
        weights = _weight_in("channel_major", weight, call)
        grad_x = _zeroed_input_gradient(x, accumulate) if scatter else None
        chunks = [(0, call.batch)] if scatter else _chunks(call, call.slots * torch.finfo(accumulate).bits // 8)
        for first, end in chunks:
            images = end - first
            part = x[first:end]
            windows = grad_x[first:end] if scatter else torch.empty(
                images, call.channels, call.slots, positions, dtype=accumulate, device=x.device)
            grid = (_cdiv(images * positions, meta["BLOCK_P"]), call.groups,
                    _cdiv(call.in_per_group, meta["BLOCK_C"]))
            _launch(kernels["gemm_input_backward_kernel"], grid)(
                part, weights, grad_out[first:end], windows, call.in_per_group, call.out_per_group,
                *call.position_args(part, images), *grad_out.stride(),
                *((0, 0, 0) if scatter else windows.stride()[:3]), **meta)
            if not scatter:
                grad_input = _fold_chunk(grad_input, windows, call, first, end, x.dtype)
        if scatter:
            grad_input = grad_x.to(x.dtype)
    if need_weight:
        meta = _settings("gemm_weight_backward_kernel", call, x.dtype, blocks)
        blocks_of_positions = _cdiv(call.batch * positions, meta["BLOCK_P"])
        output_blocks = _cdiv(call.out_per_group, meta["BLOCK_O"])
        channel_blocks = call.groups * _cdiv(call.in_per_group, meta["BLOCK_C"])
        splits = config.gemm_splits(channel_blocks * output_blocks, blocks_of_positions,
                                    _multiprocessors(x.device) if x.is_cuda else 0)
        partial = torch.empty(splits, call.channels, call.slots, call.out_per_group, dtype=accumulate,
                              device=x.device)
        _launch(kernels["gemm_weight_backward_kernel"], (splits, channel_blocks, output_blocks))(
            x, grad_out, partial, call.in_per_group, call.out_per_group, call.channels, blocks_of_positions, splits,
            *call.position_args(x, call.batch), *grad_out.stride(), **meta)
        summed = (partial[0] if splits == 1 else partial.sum(0)).view(call.groups, call.in_per_group, call.slots,
                                                                       call.out_per_group)
        grad_weight = _weight_from("channel_major", summed, call).to(weight.dtype)
    return grad_input, grad_weight


def forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geometry: SortGeometry,
            stride: Tuple[int, int], dilation: Tuple[int, int], groups: int,
            pad: Tuple[int, int, int, int] = NO_PADDING, path: Optional[str] = None) -> torch.Tensor:
    """SC of ``x`` (contiguous or channels_last, unpadded: ``pad`` zeros in ``F.pad``'s order are read as
    zeros) with ``weight`` and ``bias`` of x's dtype, on ``path`` (one of :data:`config.PATHS`) or else the
    path :func:`config.choose_path` picks (``backend="triton"``), with its first block sizes."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    if path is None:
        path = config.choose_path(call.in_per_group, call.out_per_group, call.largest_segment,
                                  *_fused_occupancy(x, call), slots=call.slots, double=x.dtype == torch.float64)
    return _FORWARD_PATHS[path](x, weight, bias, call)


def backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: SortGeometry,
             stride: Tuple[int, int], dilation: Tuple[int, int], groups: int, need_input: bool, need_weight: bool,
             pad: Tuple[int, int, int, int] = NO_PADDING,
             path: Optional[str] = None) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(grad_input, grad_weight)`` of :func:`forward` for a contiguous ``grad_out`` (None where not needed),
    by the backward of forward path ``path`` (:func:`config.backward_path_of`), or else direct for direct
    calls and through the columns for the others; under ``torch.use_deterministic_algorithms(True)`` never
    direct (its atomic additions make the sums' order vary): through the columns."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    if path is None:
        path = config.backward_paths(call.in_per_group, call.out_per_group, call.largest_segment, call.slots)[0]
    else:
        path = config.backward_path_of(path)
    if path == "direct" and torch.are_deterministic_algorithms_enabled():
        path = "columns"
    return _BACKWARD_PATHS[path](grad_out, x, weight, call, need_input, need_weight)


_FORWARD_PATHS = {"direct": _direct_forward, "fused": _fused_forward, "gemm": _gemm_forward,
                  "columns": _columns_forward}
_BACKWARD_PATHS = {"direct": _direct_backward, "gemm": _gemm_backward, "columns": _columns_backward}
_BLOCK_NAMES = {"columns": ("P", "C", "w"), "fused": ("P", "C", "O", "w"), "direct": ("P", "J", "w"),
                "gemm": ("P", "O", "C", "w")}


def _reference_forward(x, weight, bias, call: _Call):
    return sort_conv2d_reference(F.pad(x, call.pad), weight, bias, call.geometry, call.stride, call.dilation,
                                 call.groups)


def _reference_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool):
    grad_x, grad_weight = sort_conv2d_reference_backward(grad_out, F.pad(x, call.pad), weight, call.geometry,
                                                         call.stride, call.dilation, call.groups, need_input,
                                                         need_weight)
    if grad_x is not None:  # the gradient of the unpadded input
        left, _, top, _ = call.pad
        grad_x = grad_x[:, :, top:top + call.height, left:left + call.width]
    return grad_x, grad_weight


_REFERENCE = {"forward": tuning.Candidate("reference path", _reference_forward),
              "backward": tuning.Candidate("reference path", _reference_backward)}


def _check_forward(args: tuple, result) -> tuple:
    """What the forward candidates are checked on: the call itself (zeroed where the reference's result is
    not finite), against the reference in float32 for half types (the kernels' own precision)."""
    if tuning.all_finite(result) and args[0].dtype not in tuning.HALF_TYPES:
        return args, result
    args = args if tuning.all_finite(result) else tuning.zeroed(args)
    return args, tuning.upcast(_reference_forward)(*args)


def _check_backward(args: tuple, result) -> tuple:
    """What the backward candidates are checked on: the call's output gradient and weight (zeroed where not
    finite) with an input of its shape, dtype and layout whose windows hold distinct values
    (:func:`tuning.tie_free_like`), against the reference in float32 for half types."""
    grad_out, x, weight, call, need_input, need_weight = tuning.zeroed(args)
    x = tuning.tie_free_like(x, call.window_span)
    args = (grad_out, x, weight, call, need_input, need_weight)
    return args, tuning.upcast(_reference_backward)(*args)


def candidates(kind: str, call: _Call, x: torch.Tensor, need_input: bool = True) -> List[tuning.Candidate]:
    """The kernels backend="auto" checks and times for a ``"forward"`` or ``"backward"`` call, in the
    backend's order of preference: each path of :func:`config.forward_paths` (or ``backward_paths``) with
    each of its block sizes; for a backward that wants the input gradient, the columns and gemm paths' block
    sizes again with their atomic scatter, last (not deterministic, like the direct backward). None for ``k >``
    :data:`config.AUTO_MAX_KERNEL_SIZE`."""
    if call.geometry.kernel_size > config.AUTO_MAX_KERNEL_SIZE:
        return []
    if kind == "forward":
        paths = config.forward_paths(call.in_per_group, call.out_per_group, call.largest_segment,
                                     *_fused_occupancy(x, call), slots=call.slots, double=x.dtype == torch.float64)
        table = _FORWARD_PATHS
    else:
        paths = config.backward_paths(call.in_per_group, call.out_per_group, call.largest_segment, call.slots,
                                      double=x.dtype == torch.float64)
        table = _BACKWARD_PATHS
    found = []
    variants = [(path, {}) for path in paths]
    if kind == "backward" and need_input:
        variants += [(path, {"scatter": True}) for path in paths if path in SCATTER_PATHS]
    for path, options in variants:
        for blocks in config.blocks_of(path, call.slots, call.groups, call.out_per_group, kind == "backward"):
            sizes = " ".join(f"{name}={size}" for name, size in zip(_BLOCK_NAMES[path], blocks))
            run = functools.partial(table[path], blocks=blocks, **options)
            # The direct backward and the columns and gemm scatters add with atomics: sums in a varying order.
            # The interpreter compiles nothing.
            atomic = kind == "backward" and (path == "direct" or bool(options))
            found.append(tuning.Candidate(f"triton {path} {kind} ({sizes}{', atomic' if options else ''})", run,
                                          deterministic=not atomic,
                                          prepare=None if INTERPRETED else functools.partial(prepare, run)))
    return found


def _channels_last(x: torch.Tensor) -> bool:
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def _configuration(kind: str, call: _Call, x: torch.Tensor, flags: tuple) -> tuple:
    """The key of a call's decision: what its kernels' results and speed depend on."""
    geometry = call.geometry
    return (kind, geometry.kernel_size, geometry.sampling, geometry.sorting, x.dtype, tuple(x.shape),
            _channels_last(x), call.out_channels, flags, call.stride, call.dilation, call.groups, call.pad, x.device,
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32,
            torch.are_deterministic_algorithms_enabled())


def _describe(kind: str, call: _Call, x: torch.Tensor) -> str:
    geometry = call.geometry
    return (f"SC {kind} k={geometry.kernel_size} {geometry.sampling}-{geometry.sorting}, {x.dtype}, input "
            f"{tuple(x.shape)}{' channels_last' if _channels_last(x) else ''}, {call.out_channels} outputs, stride "
            f"{call.stride}, dilation {call.dilation}, groups {call.groups}, padding {call.pad}, on {x.device}")


def tuned_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geometry: SortGeometry,
                  stride: Tuple[int, int], dilation: Tuple[int, int], groups: int,
                  pad: Tuple[int, int, int, int] = NO_PADDING) -> torch.Tensor:
    """What ``backend="auto"`` runs: :func:`forward`'s arguments, computed by the kernel (or the reference
    path) that :data:`tuning.TUNER` decided for the call's configuration, deciding on its first call."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    return tuning.TUNER.run(_configuration("forward", call, x, (bias is not None,)),
                            lambda: _describe("forward", call, x), _REFERENCE["forward"],
                            lambda: candidates("forward", call, x), (x, weight, bias, call), x.device, _check_forward)


def tuned_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: SortGeometry,
                   stride: Tuple[int, int], dilation: Tuple[int, int], groups: int, need_input: bool,
                   need_weight: bool, pad: Tuple[int, int, int, int] = NO_PADDING
                   ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`backward` as ``backend="auto"`` runs it (see :func:`tuned_forward`)."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    return tuning.TUNER.run(_configuration("backward", call, x, (need_input, need_weight)),
                            lambda: _describe("backward", call, x), _REFERENCE["backward"],
                            lambda: candidates("backward", call, x, need_input),
                            (grad_out, x, weight, call, need_input, need_weight), x.device, _check_backward)


def supports_triton(x, weight, bias, geometry: SortGeometry, stride, dilation, groups) -> bool:
    """Whether the kernels compute this call as the reference path does: Triton installed, CUDA tensors (CPU
    tensors under the interpreter) of one device with one dtype among :data:`SUPPORTED_DTYPES`, and an odd
    ``k <=`` :data:`MAX_KERNEL_SIZE` (beyond, the sorting networks would not fit a lane's registers; even
    kernels have no centre, which the kernels' windows assume)."""
    tensors = [t for t in (x, weight, bias) if t is not None]
    return (
        triton is not None
        and (x.is_cuda or (INTERPRETED and x.device.type == "cpu"))
        and all(t.device == x.device and t.dtype == x.dtype for t in tensors)
        and x.dtype in SUPPORTED_DTYPES
        and geometry.kernel_size % 2 == 1
        and geometry.kernel_size <= MAX_KERNEL_SIZE
        and not is_aligned(geometry)
    )


def _available() -> bool:
    return triton is not None and (torch.cuda.is_available() or INTERPRETED)


# The aligned variants (sorting="align", "align-channel") on CUDA: no Triton kernel; backend="auto" checks their
# standard-operator form (the harmonic backend: a depthwise convolution, products, a 1 x 1 convolution, all cuDNN
# and elementwise kernels) against the reference path on the first call of a configuration and keeps the faster, as
# it does for the Triton kernels.
# (The harmonic backend takes padded inputs: these see the call's padded input and no further padding.)
def _aligned_reference_forward(x, weight, bias, call: _Call):
    return sort_conv2d_reference(x, weight, bias, call.geometry, call.stride, call.dilation, call.groups)


def _aligned_reference_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool):
    return autograd_backward(sort_conv2d_reference, grad_out, x, weight, call.geometry, call.stride, call.dilation,
                             call.groups, need_input, need_weight)


def _harmonic_forward(x, weight, bias, call: _Call):
    return align_conv2d_harmonic(x, weight, bias, call.geometry, call.stride, call.dilation, call.groups)


def _harmonic_backward(grad_out, x, weight, call: _Call, need_input: bool, need_weight: bool):
    return autograd_backward(align_conv2d_harmonic, grad_out, x, weight, call.geometry, call.stride, call.dilation,
                             call.groups, need_input, need_weight)


def _tuned_here(x: torch.Tensor) -> bool:
    """Whether auto checks and times the aligned variants for ``x``: on CUDA (elsewhere the fused CPU kernel takes
    them, or the harmonic form runs as it is)."""
    return x.is_cuda


_ALIGNED = {kind: (tuning.Candidate("reference path", reference), tuning.Candidate("harmonic (standard operators)",
                                                                                    harmonic))
            for kind, reference, harmonic in (("forward", _aligned_reference_forward, _harmonic_forward),
                                              ("backward", _aligned_reference_backward, _harmonic_backward))}


def tuned_aligned_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geometry: SortGeometry,
                          stride: Tuple[int, int], dilation: Tuple[int, int], groups: int,
                          pad: Tuple[int, int, int, int] = NO_PADDING) -> torch.Tensor:
    """The harmonic backend as ``backend="auto"`` runs it (``x`` padded already): on CUDA, checked against the reference path and timed
    against it per configuration (:data:`tuning.TUNER`); elsewhere (no fused kernel took the call) as it is."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    reference, harmonic = _ALIGNED["forward"]
    if not _tuned_here(x):
        return harmonic.run(x, weight, bias, call)
    return tuning.TUNER.run(_configuration("forward", call, x, (bias is not None,)),
                            lambda: _describe("forward", call, x), reference, lambda: [harmonic],
                            (x, weight, bias, call), x.device)


def tuned_aligned_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, geometry: SortGeometry,
                           stride: Tuple[int, int], dilation: Tuple[int, int], groups: int, need_input: bool,
                           need_weight: bool, pad: Tuple[int, int, int, int] = NO_PADDING
                           ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`tuned_aligned_forward`'s backward."""
    call = _Call.of(x, weight, geometry, stride, dilation, groups, pad)
    reference, harmonic = _ALIGNED["backward"]
    args = (grad_out, x, weight, call, need_input, need_weight)
    if not _tuned_here(x):
        return harmonic.run(*args)
    return tuning.TUNER.run(_configuration("backward", call, x, (need_input, need_weight)),
                            lambda: _describe("backward", call, x), reference, lambda: [harmonic], args, x.device)



register_backend(Backend("triton", forward, backward, supports_triton, _available, zero_padding=True,
                         channels_last=True, auto_forward=tuned_forward, auto_backward=tuned_backward))
# auto's form of the harmonic backend (it keeps its place in the registry, after the fused CPU kernel)
register_backend(dataclasses.replace(registered_backend("harmonic"), auto_forward=tuned_aligned_forward,
                                     auto_backward=tuned_aligned_backward))
# backend="triton-<path>": one path for the call, whatever its shape (benchmarks and the check compare paths).
for _path in config.PATHS:
    register_backend(Backend(f"triton-{_path}", functools.partial(forward, path=_path),
                             functools.partial(backward, path=_path), supports_triton, _available, auto=False,
                             zero_padding=True, channels_last=True))
