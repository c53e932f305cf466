"""Launch settings of the Triton backend, in one place: which paths and block sizes a call may take.

Which kernels compute a call:

* ``"direct"``: groups with fewer input channels than a matrix instruction's depth (depthwise
  convolutions, first layers). One group per program, its lanes (position) windows; the products are FMAs
  of scalar weights into an accumulator per output; the backward adds the input and weight gradients with
  atomics.
* ``"fused"`` (forward only, windows of at most ``FUSED_MAX_SLOTS`` samples): an implicit GEMM, each
  program sorting a tile of (input channel, position) windows and multiplying every sorted slot into its
  output tile with ``tl.dot``; the windows are sorted once per block of ``BLOCK_O`` outputs (once in all
  where the group has at most ``FUSED_MAX_BLOCK_O``).
* ``"gemm"`` (windows of at most ``GEMM_MAX_SLOTS`` samples): an implicit GEMM with one window per lane and
  BLOCK_C input channels per step: their sorted slots at a block of positions are one [positions, BLOCK_C * K]
  operand (K: a channel's slots padded to a power of two >= 16) of a ``tl.dot`` with their weights. Its
  backward sorts again: the input gradient's kernel records the swaps and sends the slots' gradient (another
  ``tl.dot``) back to the window values, which ``F.fold`` gathers per input pixel, or (``auto``'s other gemm
  backward, never in deterministic mode) adds them into the input gradient with atomics, which writes no window
  values to memory; the weight gradient's kernel sums ``tl.dot`` products over splits of the positions, added
  up in a fixed order (no atomics).
* ``"columns"``: the sorted columns are written once, a bounded number of images at a time
  (``COLUMN_CHUNK_BYTES``), and multiplied by cuBLAS (``torch.matmul``). Its backward: a kernel sorts the
  windows again, recording each comparator's swap (and writing the columns for the weight gradient's
  cuBLAS product), a second replays the swaps in reverse to send the column gradient (another cuBLAS
  product) back to the window values, and ``F.fold`` gathers them per input pixel (no atomics), or (``auto``'s
  other columns backward, never in deterministic mode) the second adds them into the input gradient with atomics.

``backend="auto"`` checks and times, per configuration, every path of :func:`forward_paths` or
:func:`backward_paths` with each of its block sizes (:func:`blocks_of`), and the reference path
(:mod:`.tuning`); ``backend="triton"`` takes the first path with its first block sizes, and
``backend="triton-<path>"`` (e.g. ``"triton-columns"``) that path for the call it is given to, whatever the
call (each path is exact for any call; benchmarks and ``timm_sortconv.check`` compare them that way). The
path travels with the call as its backend argument, so two threads may run two paths at once.

Every kernel reads a lane's whole window (``k * k`` values) before sorting it, and a lane sorts its segments in
registers, so the block sizes keep a thread's lanes few: one, or two for windows of at most
``TWO_LANES_MAX_SLOTS`` samples (columns and direct kernels), 2-8 (the 3x3 fused kernel), and a position's
channels on one or two threads (gemm). ``scripts/triton_kernel_report.py --candidates`` compiles every candidate
for an H100 (sm_90) on any machine and prints registers, spills and compile time; the sm_90 report in
BENCHMARKS.md is what the limits below come from. Which candidate is fastest is left to the timing on the
user's GPU.
"""
from __future__ import annotations

from typing import Tuple

__all__ = ["PATHS", "FORWARD_PATH", "backward_path_of", "backward_paths", "blocks_of", "choose_path", "column_candidates",
           "column_images", "direct_candidates", "forward_paths", "fused_candidates", "gemm_candidates",
           "gemm_splits", "window_limit"]

# In the backend's order of preference where a rule does not decide (auto's order of checking, the first
# deterministic candidate): the gemm path, not yet measured on a GPU, last.
PATHS = ("direct", "fused", "columns", "gemm")

# The path backend="triton" takes for calls with enough channels per group for tl.dot, where the fused
# kernel can take them (FUSED_MAX_SEGMENT, FUSED_MAX_SLOTS, enough programs).
FORWARD_PATH = "fused"
FUSED_MAX_SEGMENT = 9
# The fused kernel keeps every sorted slot in tl.dot's operand layout: in the sm_90 report (Triton 3.6 and
# 3.8) it compiles in 0.5-1.2 s without spills for 3x3 windows in float32, float16 and bfloat16 (the block
# sizes of fused_candidates), and spills from 25 samples on (k = 5: 150-870 bytes with 32 outputs). It is not
# taken beyond FUSED_MAX_SLOTS samples, orbit sortings included.
FUSED_MAX_SLOTS = 9
# The fused kernel has one program per block of positions and of outputs, each looping over all input
# channels: with fewer than this many programs per multiprocessor (e.g. 32 images of 8x8 with 256 channels:
# 64 programs on an H100's 132) the GPU idles, and the columns path's cuBLAS product splits the reduction.
FUSED_MIN_PROGRAMS_PER_SM = 2
# tl.dot needs K >= 16: groups with fewer input channels run direct when they have at most
# DIRECT_MAX_OUT_PER_GROUP outputs (depthwise convolutions), else through the columns (cuBLAS has no such
# bound, and few input channels make few columns). A direct program computes DIRECT_BLOCK_J of them (more:
# several programs, each sorting the windows again): with 4 per program the forward spilled 296 bytes at
# k = 7 and the backward 24 at k = 5 in the sm_90 report.
DOT_MIN_CHANNELS = 16
DIRECT_MAX_OUT_PER_GROUP = 4
DIRECT_BLOCK_J = 2
# A direct lane keeps its window, sorted samples and the program's weights in registers. In the sm_90
# report (BENCHMARKS.md; Triton 3.6 and 3.8, float32 and bfloat16) the forward compiles in 0.2-1.0 s without
# spills up to 25 samples and spills 8-80 bytes at 49; the backward, which also keeps the swaps and gradients,
# compiles without spills at 9 samples (256 positions per program) and spills 80-104 bytes at 49. Windows
# beyond these sizes take the columns path (auto and backend="triton"; backend="triton-direct" still takes the
# direct kernels).
DIRECT_MAX_SLOTS = 25
DIRECT_BACKWARD_MAX_SLOTS = 9
# float64 values take two registers each: in the sm_90 report the direct forward spills 72 bytes at 25
# samples in float64 (none at 9), and the fused kernel 200 at 9, so float64 takes neither there.
DIRECT_MAX_SLOTS_FLOAT64 = 9
# Kernel sizes whose kernels backend="auto" checks and times: every candidate up to k = 7 compiles for
# sm_90 in under 15 s of CPU time without spills; larger kernels are left to the reference path by auto
# (backend="triton" still runs them).
AUTO_MAX_KERNEL_SIZE = 7
# Windows of at most this many samples get block sizes with two lanes per thread among the candidates.
TWO_LANES_MAX_SLOTS = 25

# The gemm kernels keep a position's BLOCK_C lanes (channels) on one or two threads: their window values, sorted
# samples (and in the input gradient's kernel the recorded swaps and the slots' gradient) in registers.
GEMM_MAX_SLOTS = 49
# float64 values take two registers each: in the sm_90 report (Triton 3.8) the gemm kernels spill in float64 from
# k = 3 on (the forward 96 bytes; k = 5 and 7: 120-368), so float64 takes them only when named.
GEMM_MAX_SLOTS_FLOAT64 = 0
# In the sm_90 report (Triton 3.6 and 3.8, float32 and bfloat16, k = 3, 5, 7) the gemm kernels compile without
# spills with at most 32 outputs per block and 8 warps for 128 positions or 4 for 64 (gemm_candidates); 64
# outputs spill 8-344 bytes with Triton 3.8, and 32 outputs with 4 warps for 128 positions 8-176.
GEMM_MAX_BLOCK_O = 32
GEMM_NARROW_SLOTS = 25
# Input channels per step of the gemm kernels' reduction, by the window's samples (at most): 4 for 3x3 windows
# (K = 64 per step), 2 for 5x5 (64), 1 beyond (7x7: 64).
GEMM_STEP_CHANNELS = ((9, 4), (25, 2), (10 ** 9, 1))
# The weight gradient's kernel splits the positions so that the GPU has this many programs per multiprocessor
# (its grid is otherwise channels x output blocks: 32 programs for a 32 -> 32 layer).
GEMM_WEIGHT_PROGRAMS_PER_SM = 4

# The fused kernel's output tile [BLOCK_P, BLOCK_O] and its sorted slot tiles share a thread's registers: in the
# sm_90 report (Triton 3.6 and 3.8, float32/bfloat16/float16, 3x3 windows) 32 outputs with 4 warps and 64 with
# 8 warps and 32 positions compile without spills, 64 outputs with 4 warps spill 8-96 bytes and 128 with 4 or
# 8 warps 8-1,040. Wider groups sort their windows once per block of outputs.
FUSED_BLOCK_C = 16
FUSED_MAX_BLOCK_O = 32
FUSED_WIDE_BLOCK = (32, FUSED_BLOCK_C, 64, 8)
# Bytes of a chunk's buffers of the columns path (forward: the sorted columns; backward: the columns, their
# gradient, the window gradients and the recorded swaps together), which bound the images per chunk.
COLUMN_CHUNK_BYTES = 256 << 20


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def window_limit(path: str, backward: bool = False, double: bool = False) -> int:
    """The most samples per window for which a path's kernels are taken without being forced (``backward``:
    its backward; ``double``: float64, whose values take two registers each), 0 for none: FUSED_MAX_SLOTS,
    DIRECT_MAX_SLOTS, DIRECT_BACKWARD_MAX_SLOTS and GEMM_MAX_SLOTS, in float64 DIRECT_MAX_SLOTS_FLOAT64 for the
    direct forward and neither the fused nor the gemm kernels (GEMM_MAX_SLOTS_FLOAT64)."""
    if path == "fused":
        return 0 if double else FUSED_MAX_SLOTS
    if path == "direct":
        return DIRECT_BACKWARD_MAX_SLOTS if backward else DIRECT_MAX_SLOTS_FLOAT64 if double else DIRECT_MAX_SLOTS
    if path == "gemm":
        return GEMM_MAX_SLOTS_FLOAT64 if double else GEMM_MAX_SLOTS
    return AUTO_MAX_KERNEL_SIZE ** 2


def choose_path(in_per_group: int, out_per_group: int, largest_segment: int, fused_programs: int = 0,
                multiprocessors: int = 0, slots: int = 0, double: bool = False) -> str:
    """The forward path ``backend="triton"`` takes (and ``auto`` prefers). ``fused_programs``: how many
    programs the fused kernel would launch, on a GPU of ``multiprocessors`` (0: unknown, e.g. in Triton's
    interpreter, which then does not count); ``slots``: the window's samples (``k * k``; 0: the largest
    segment's); ``double``: float64."""
    window = max(slots, largest_segment)
    if in_per_group < DOT_MIN_CHANNELS:
        direct = out_per_group <= DIRECT_MAX_OUT_PER_GROUP and window <= window_limit("direct", double=double)
        return "direct" if direct else "columns"
    if (largest_segment > FUSED_MAX_SEGMENT or window > window_limit("fused", double=double)
            or fused_programs < FUSED_MIN_PROGRAMS_PER_SM * multiprocessors):
        return "columns"
    return FORWARD_PATH


def forward_paths(in_per_group: int, out_per_group: int, largest_segment: int, fused_programs: int = 0,
                  multiprocessors: int = 0, slots: int = 0, double: bool = False) -> Tuple[str, ...]:
    """The forward paths backend="auto" tries, :func:`choose_path`'s first: ``"direct"`` for groups with
    fewer than DOT_MIN_CHANNELS input channels, ``"fused"`` for groups with at least that many, ``"gemm"``
    for any, each for windows within its :func:`window_limit`; ``"columns"`` for any call."""
    first = choose_path(in_per_group, out_per_group, largest_segment, fused_programs, multiprocessors, slots,
                        double)
    few_channels = in_per_group < DOT_MIN_CHANNELS
    window = max(slots, largest_segment)
    eligible = {"direct": few_channels and window <= window_limit("direct", double=double),
                "fused": not few_channels and window <= window_limit("fused", double=double),
                "gemm": window <= window_limit("gemm", double=double), "columns": True}
    return (first,) + tuple(path for path in PATHS if path != first and eligible[path])


def backward_paths(in_per_group: int, out_per_group: int, largest_segment: int, slots: int,
                   double: bool = False) -> Tuple[str, ...]:
    """The backward paths, the first being ``backend="triton"``'s (the fused path's backward is the
    columns path's): ``"direct"`` for groups with fewer than DOT_MIN_CHANNELS input channels and windows
    of at most DIRECT_BACKWARD_MAX_SLOTS samples, first where :func:`choose_path` takes it; ``"gemm"`` for
    windows within its :func:`window_limit`; ``"columns"`` for any call."""
    window = max(slots, largest_segment)
    direct = in_per_group < DOT_MIN_CHANNELS and window <= window_limit("direct", backward=True)
    gemm = window <= window_limit("gemm", backward=True, double=double)
    first = "direct" if direct and choose_path(in_per_group, out_per_group, largest_segment, slots=slots) == "direct" \
        else "columns"
    eligible = {"direct": direct, "columns": True, "gemm": gemm}
    return (first,) + tuple(path for path in eligible if path != first and eligible[path])


def backward_path_of(forward_path: str) -> str:
    """The backward a forward path's backend (``backend="triton-<path>"``) runs: its own, the columns path's for
    the fused path, which has none."""
    return "columns" if forward_path == "fused" else forward_path


def column_candidates(slots: int) -> Tuple[Tuple[int, int, int], ...]:
    """(BLOCK_P, BLOCK_C, num_warps) of the columns path's kernels: positions along the block (the
    contiguous axis of NCHW inputs), one or two lanes per thread."""
    if slots <= TWO_LANES_MAX_SLOTS:
        return (64, 4, 4), (64, 2, 4)
    return (64, 2, 4), (128, 1, 4)


def fused_candidates(slots: int, out_per_group: int) -> Tuple[Tuple[int, int, int, int], ...]:
    """(BLOCK_P, BLOCK_C, BLOCK_O, num_warps) of the fused forward kernel (windows of at most
    FUSED_MAX_SLOTS samples): 8 or 4 lanes per thread, sorted once per block of at most FUSED_MAX_BLOCK_O
    outputs, and for groups of at least 64 outputs FUSED_WIDE_BLOCK (2 lanes per thread, sorted half as often)."""
    block_o = max(16, min(FUSED_MAX_BLOCK_O, _next_power_of_two(out_per_group)))
    candidates = ((64, FUSED_BLOCK_C, block_o, 4), (32, FUSED_BLOCK_C, block_o, 4))
    return candidates + ((FUSED_WIDE_BLOCK,) if out_per_group >= FUSED_WIDE_BLOCK[2] else ())


def gemm_candidates(slots: int, out_per_group: int, backward: bool = False) -> Tuple[Tuple[int, int, int, int], ...]:
    """(BLOCK_P, BLOCK_O, BLOCK_C, num_warps) of the gemm kernels: 128 positions on 8 warps or 64 on 4 (two
    threads per position), the group's outputs in blocks of at most GEMM_MAX_BLOCK_O (tl.dot's N >= 16), and
    BLOCK_C input channels per step of the reduction (GEMM_STEP_CHANNELS: more for smaller windows, whose K of 16
    or 32 per channel makes a shallow product) or one (first in the backward, whose recorded swaps and gradients
    take more registers). The backward of windows of more than GEMM_NARROW_SLOTS samples also tries blocks of 16
    outputs on 4 warps, which sort the windows once per 16 outputs."""
    block_o = max(16, min(GEMM_MAX_BLOCK_O, _next_power_of_two(out_per_group)))
    if backward and slots > GEMM_NARROW_SLOTS:
        return tuple(dict.fromkeys(((128, block_o, 1, 8), (128, 16, 1, 4))))
    channels = next(count for most, count in GEMM_STEP_CHANNELS if slots <= most)
    if channels == 1:
        return (128, block_o, 1, 8), (64, block_o, 1, 4)
    if backward:
        return (128, block_o, 1, 8), (128, block_o, channels, 8)
    return (128, block_o, channels, 8), (128, block_o, 1, 8)


def gemm_splits(programs: int, position_blocks: int, multiprocessors: int) -> int:
    """Splits of the position blocks for the gemm weight gradient, whose grid has ``programs`` programs per
    split: enough for GEMM_WEIGHT_PROGRAMS_PER_SM per multiprocessor (2 where unknown, e.g. in the
    interpreter), at most one per block."""
    wanted = GEMM_WEIGHT_PROGRAMS_PER_SM * multiprocessors if multiprocessors else 2 * programs
    return max(1, min(position_blocks, -(-wanted // max(1, programs))))


def direct_candidates(slots: int, groups: int, out_per_group: int,
                      backward: bool = False) -> Tuple[Tuple[int, int, int], ...]:
    """(BLOCK_P, BLOCK_J, num_warps) of the direct kernels: one group per program (a weight is then one
    scalar per slot and output), up to DIRECT_BLOCK_J outputs (more: several programs), and one or two
    lanes per thread (the backward: two, the block size without spills)."""
    block_j = min(DIRECT_BLOCK_J, _next_power_of_two(out_per_group))
    if backward:
        return ((256, block_j, 4),)
    if slots <= TWO_LANES_MAX_SLOTS:
        return (256, block_j, 4), (128, block_j, 4)
    return (128, block_j, 4), (64, block_j, 2)


def blocks_of(path: str, slots: int, groups: int, out_per_group: int, backward: bool = False) -> Tuple[tuple, ...]:
    """The block-size candidates of a path's kernels (``backward``: of its backward), for windows of
    ``slots`` samples, the first being ``backend="triton"``'s."""
    if path == "columns":
        return column_candidates(slots)
    if path == "fused":
        return fused_candidates(slots, out_per_group)
    if path == "direct":
        return direct_candidates(slots, groups, out_per_group, backward)
    if path == "gemm":
        return gemm_candidates(slots, out_per_group, backward)
    raise ValueError(f"unknown path {path!r}; accepted: {', '.join(PATHS)}")


def column_images(bytes_per_image: int, batch: int) -> int:
    """Images per chunk of the columns path, so that a chunk's buffers stay within COLUMN_CHUNK_BYTES."""
    return max(1, min(batch, COLUMN_CHUNK_BYTES // max(1, bytes_per_image)))
