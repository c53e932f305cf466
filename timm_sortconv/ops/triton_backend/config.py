"""Launch settings of the Triton backend, in one place: the choices a GPU measurement decides.

Which kernels compute a call (:func:`choose_path`):

* ``"direct"``: groups with fewer input channels than a matrix instruction's depth and at most
  ``DIRECT_MAX_OUT_PER_GROUP`` outputs (depthwise convolutions). Lanes are (group, position) windows, one
  group per program; the products are FMAs into an [outputs, groups, positions] tile; the backward adds
  the input and weight gradients with atomics.
* ``"fused"`` (forward only, windows of at most ``FUSED_MAX_SEGMENT`` sorted values, enough programs to
  fill the GPU): an implicit GEMM, each program sorting a tile of (input channel, position) windows and
  multiplying every sorted slot into its output tile with ``tl.dot``; the windows are sorted once per
  block of ``BLOCK_O`` outputs (once in all where the group has at most ``FUSED_MAX_BLOCK_O``).
* ``"columns"``: the sorted columns are written once, a bounded number of images at a time
  (``COLUMN_CHUNK_BYTES``), and multiplied by cuBLAS (``torch.matmul``). The backward of every call that
  is not direct takes this path: the column and weight gradients are two cuBLAS products, a kernel sorts
  again and sends the column gradient back to the window values, and ``F.fold`` gathers them per input
  pixel (no atomics).

``TIMM_SORTCONV_TRITON_PATH=direct|fused|columns`` forces one path for every call (benchmarks compare them
that way); each is exact for any call.

A lane holds the values of its largest sorted segment (9, 16, 25, 24, 49, 32, 81 for the ring and global
variants up to k = 9; 4 or 2 for the orbit sortings), so the block sizes below give each thread one or two lanes (in the sm_90 compile report of
BENCHMARKS.md the columns kernels and the direct forward do not spill up to k = 7; the direct backward
spills 296 bytes at 7x7 polar rings, its 49 window gradients being live at once). ``scripts/triton_kernel_report.py``
compiles every kernel for an H100 (sm_90) on any machine and prints registers and spills per setting;
the timings that should decide these constants need a GPU (``scripts/gpu_check.sh``).
"""
from __future__ import annotations

import os
from typing import Tuple

__all__ = ["PATH_ENV", "PATHS", "FORWARD_PATH", "choose_path", "column_blocks", "fused_blocks", "direct_blocks",
           "column_images"]

PATH_ENV = "TIMM_SORTCONV_TRITON_PATH"
PATHS = ("direct", "fused", "columns")

# The path of calls with enough channels per group for tl.dot: "fused" where the geometry's largest sorted
# segment has at most FUSED_MAX_SEGMENT values, else "columns". Unmeasured on a GPU (scripts/bench_sortconv.py
# --device cuda --triton-paths fused,columns times both); chosen from the sm_90 compile report: the fused
# kernel compiles without spills for 3x3 windows (9 values, 183-186 registers) and spills from 16 values on
# (k = 5 ring: 344 spilled bytes in float32; k = 7 ring: 1456), where the columns kernel does not spill.
FORWARD_PATH = "fused"
FUSED_MAX_SEGMENT = 9
# ... and where the window has at most FUSED_MAX_SLOTS samples: the orbit sortings ("c4"/"c2") have segments
# of 4 or 2 values at any k, but the fused kernel at k >= 5 (25 or more slots per window, each a tl.dot) has
# not been compiled or measured.
FUSED_MAX_SLOTS = 9
# The fused kernel has one program per block of positions and of outputs, each looping over all input
# channels: with fewer than this many programs per multiprocessor (e.g. 32 images of 8x8 with 256 channels:
# 64 programs on an H100's 132) the GPU idles, and the columns path's cuBLAS product splits the reduction.
FUSED_MIN_PROGRAMS_PER_SM = 2
# tl.dot needs K >= 16: groups with fewer input channels run direct when they have at most
# DIRECT_MAX_OUT_PER_GROUP outputs (depthwise convolutions), else through the columns (cuBLAS has no such
# bound, and few input channels make few columns). A direct program keeps every output's weight of every
# slot live (the compiler hoists their loads): 4 outputs x 49 slots is about what fits.
DOT_MIN_CHANNELS = 16
DIRECT_MAX_OUT_PER_GROUP = 4

FUSED_BLOCK_C = 16
FUSED_MAX_BLOCK_O = 128
# Bytes of a chunk's buffers of the columns path (forward: the sorted columns; backward: the columns, their
# gradient and the window gradients together), which bound the images per chunk.
COLUMN_CHUNK_BYTES = 256 << 20


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def choose_path(in_per_group: int, out_per_group: int, largest_segment: int, fused_programs: int = 0,
                multiprocessors: int = 0, slots: int = 0) -> str:
    """The forward path of a call; the backward is ``"direct"`` for direct calls, else ``"columns"``.
    ``fused_programs``: how many programs the fused kernel would launch, on a GPU of ``multiprocessors``
    (0: unknown, e.g. in Triton's interpreter, which then does not count); ``slots``: the window's samples
    (``k * k``; 0: the largest segment's)."""
    forced = os.environ.get(PATH_ENV, "").strip().lower()
    if forced:
        if forced not in PATHS:
            raise ValueError(f"{PATH_ENV}={forced!r} is not a path; accepted: {', '.join(PATHS)}")
        return forced
    if in_per_group < DOT_MIN_CHANNELS:
        return "direct" if out_per_group <= DIRECT_MAX_OUT_PER_GROUP else "columns"
    if (largest_segment > FUSED_MAX_SEGMENT or max(slots, largest_segment) > FUSED_MAX_SLOTS
            or fused_programs < FUSED_MIN_PROGRAMS_PER_SM * multiprocessors):
        return "columns"
    return FORWARD_PATH


def column_blocks(largest_segment: int) -> Tuple[int, int, int]:
    """(BLOCK_P, BLOCK_C, num_warps) of the columns and unsort kernels: positions along the block (the
    contiguous axis of NCHW inputs), one or two lanes per thread."""
    if largest_segment <= 16:
        return 64, 4, 4
    return 64, 2, 4


def fused_blocks(largest_segment: int, out_per_group: int) -> Tuple[int, int, int, int]:
    """(BLOCK_P, BLOCK_C, BLOCK_O, num_warps) of the fused forward kernel."""
    block_o = max(16, min(FUSED_MAX_BLOCK_O, _next_power_of_two(out_per_group)))
    if largest_segment <= 16:
        return 64, FUSED_BLOCK_C, block_o, 4
    if largest_segment <= 32:
        return 64, FUSED_BLOCK_C, block_o, 8
    if largest_segment <= 49:
        return 32, FUSED_BLOCK_C, block_o, 8
    return 16, FUSED_BLOCK_C, block_o, 8


def direct_blocks(largest_segment: int, groups: int, out_per_group: int) -> Tuple[int, int, int, int]:
    """(BLOCK_P, BLOCK_G, BLOCK_J, num_warps) of the direct kernels: one group per program (its weights are
    then one value per slot and output for all threads) and 256 positions (128 for segments of more than
    16 values), and up to DIRECT_MAX_OUT_PER_GROUP outputs (more, forced by PATH_ENV: several programs)."""
    block_j = min(DIRECT_MAX_OUT_PER_GROUP, _next_power_of_two(out_per_group))
    return (256 if largest_segment <= 16 else 128), 1, block_j, 4


def column_images(bytes_per_image: int, batch: int) -> int:
    """Images per chunk of the columns path, so that a chunk's buffers stay within COLUMN_CHUNK_BYTES."""
    return max(1, min(batch, COLUMN_CHUNK_BYTES // max(1, bytes_per_image)))
