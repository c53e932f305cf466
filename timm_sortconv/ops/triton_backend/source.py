"""Triton source for one SC geometry, generated from :mod:`timm_sortconv.ops.geometry`'s tables.

Every kernel of the backend does the same first steps for a tile of *lanes*, each lane one (output
position, input channel) window: read the window values it needs (zeros outside the input, so the caller
never pads), form the samples (square: the values; polar: the bilinear taps, as weighted sums with the tap
weights written into the source as constants of the compute dtype), and sort each segment (a ring, or the
whole window) with the comparator network of :meth:`SortGeometry.comparators`. The network is emitted as
straight-line code over per-slot tensors (``s0``, ``s1``, ...: one value per lane each), so a lane sorts
its own window in registers, with no ranks, one-hot matrices or data-dependent indexing.

Order of the emitted code, chosen to keep few values live (registers) per lane:

* Segment by segment: a segment's window values are read, its samples formed, sorted and consumed (stored
  as columns, multiplied into the output tile, or sent back as gradients) before the next segment starts.
  Polar rings share window values; each segment reads the ones it needs again (cache hits) rather than
  keeping them live.
* Within a segment the comparators run depth first (:func:`depth_first`): the first half of a segment is
  sorted before the second half is read. Each wire still meets its comparators in the same order, so the
  sorted values are bit for bit those of the network's own order.

Comparators: the forward kernels take ``lo, hi = min, max`` with NaN propagation (``min.NaN``/``max.NaN``
on the GPU, two instructions): a NaN in a window makes both values of each comparator it meets NaN, so it
spreads inside its own segment only, and every output of that window is NaN anyway, as in the reference.
Kernels that need the permutation (the backward) decide each swap by ``b < a`` and swap both values with
selects, so the network is always a permutation, and record the decisions as bits of int32 words (32
comparators per word, per segment); replaying them in reverse moves the gradient of each sorted slot back
to its sample (the transpose of the permutation), and the transposed taps move it to the window values.
"""
from __future__ import annotations

import heapq
import linecache
from typing import Dict, List, Sequence, Tuple

from ..geometry import SortGeometry

__all__ = ["depth_first", "kernel_source", "load_kernels", "sample_taps"]


def sample_taps(geometry: SortGeometry) -> List[List[Tuple[int, float]]]:
    """Per sample (slot order): its taps as (row-major window position, weight), zero weights left out."""
    k, n = geometry.kernel_size, geometry.kernel_size // 2
    taps = []
    for offsets, weights in zip(geometry.tap_offsets.tolist(), geometry.tap_weights.tolist()):
        taps.append([((dy + n) * k + dx + n, w) for (dy, dx), w in zip(offsets, weights) if w != 0.0])
    return taps


def depth_first(pairs: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The comparators ``pairs`` reordered so that those with the smallest larger index run first, as soon
    as the comparators before them on both of their wires have run. Every wire meets its comparators in
    the original order, so the network computes exactly the same; a sorting network over a block's two
    halves then sorts the first half before it touches the second."""
    last: Dict[int, int] = {}
    waiting = [0] * len(pairs)
    successors: List[List[int]] = [[] for _ in pairs]
    for t, (a, b) in enumerate(pairs):
        for wire in {a, b}:
            if wire in last:
                successors[last[wire]].append(t)
                waiting[t] += 1
            last[wire] = t
    ready = [(max(pair), t) for t, pair in enumerate(pairs) if waiting[t] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, t = heapq.heappop(ready)
        order.append(pairs[t])
        for u in successors[t]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (max(pairs[u]), u))
    return order


class _Writer:
    """Lines of Python source at an indentation level."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self.depth = 0

    def __call__(self, *lines: str) -> None:
        self.lines += ["    " * self.depth + line for line in lines]


_NAN = "propagate_nan=tl.PropagateNan.ALL"


def _bit(bit: int) -> int:
    """The int32 constant with only ``bit`` set (bit 31 is the sign bit: a negative constant)."""
    return (1 << bit) - (1 << 32 if bit == 31 else 0)

# The arguments every kernel takes to find its lanes' windows: output positions (flat over the images
# of the launch), the input's size and strides, and the convolution's stride, dilation and zero padding.
_POSITION_ARGS = ("n_pos, L, out_w, H, W, sxb, sxc, sxh, sxw, stride_h, stride_w, dil_h, dil_w, pad_t, pad_l")


class _Kernel:
    """Emits one kernel: its window reads, samples, sorting networks and their reverse."""

    def __init__(self, geometry: SortGeometry, name: str, args: str) -> None:
        self.geometry = geometry
        self.k = geometry.kernel_size
        self.slots = self.k ** 2
        self.taps = sample_taps(geometry)
        self.write = _Writer()
        self.comparators = {segment: depth_first([(a, b) for a, b in geometry.comparators()
                                                  if segment[0] <= a < segment[1]])
                            for segment in geometry.segments}
        self.used = sorted({q for sample in self.taps for q, _ in sample})
        self.weights = {w: n for n, w in enumerate(sorted({w for sample in self.taps for _, w in sample} - {1.0}))}
        # Per-lane row masks (ok_row{r}) already formed in the current channel block.
        self.row_masks: set = set()
        self.header(name, args)

    def header(self, name: str, args: str) -> None:
        """The kernel's signature. Its integer arguments are not specialized (Triton would otherwise compile
        again for each value that is 1 or a multiple of 16, e.g. for the last, smaller batch of an epoch:
        these kernels take tens of seconds to compile)."""
        integers = [a.strip() for a in args.split(",") if not a.strip().endswith("_ptr") and ":" not in a]
        self.write("", "", f"@triton.jit(do_not_specialize={integers!r})", f"def {name}({args}):")
        self.write.depth = 1

    def positions(self) -> None:
        """Lane positions of the program's block: ``pos`` [1, BLOCK_P], the offset of each window's
        top-left corner in x; per window row and column used, whether it lies inside the input
        (``row_ok{r}``, which also holds ``p_ok``, and ``col_ok{c}``: zero padding is a masked read);
        per window position ``off{q}``, its offset from the corner; the tap weights ``tw{n}``."""
        w = self.write
        # Index arithmetic in int64: no offset overflows on large tensors (and Triton's interpreter checks
        # every int32 operation for overflow, several times slower than the operation itself).
        w("p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)",
          "p_ok = p < n_pos",
          "image = p // L",
          "l = p % L",
          "ih0 = (l // out_w) * stride_h - pad_t",
          "iw0 = (l % out_w) * stride_w - pad_l",
          "pos = (image * sxb + ih0 * sxh + iw0 * sxw)[None, :]",
          "row_step = dil_h.to(tl.int64)",
          "col_step = dil_w.to(tl.int64)")
        for r in sorted({q // self.k for q in self.used}):
            w(f"row_ok{r} = (p_ok & (ih0 + {r} * row_step >= 0) & (ih0 + {r} * row_step < H))[None, :]")
        for c in sorted({q % self.k for q in self.used}):
            w(f"col_ok{c} = ((iw0 + {c} * col_step >= 0) & (iw0 + {c} * col_step < W))[None, :]")
        for q in self.used:
            r, c = divmod(q, self.k)
            w(f"off{q} = {r} * row_step * sxh + {c} * col_step * sxw")
        for weight, n in self.weights.items():
            w(f"tw{n} = tl.full([], {weight!r}, COMPUTE)")

    def new_channel_block(self) -> None:
        """Forget the row masks of the previous block of channels (``lane_ok`` changed)."""
        self.row_masks = set()

    def window_mask(self, q: int) -> str:
        """The mask of window position q's reads for every lane, forming its row's mask first if needed."""
        r, c = divmod(q, self.k)
        if r not in self.row_masks:
            self.row_masks.add(r)
            self.write(f"ok_row{r} = lane_ok & row_ok{r}")
        return f"ok_row{r} & col_ok{c}"

    def scaled(self, name: str, weight: float) -> str:
        return name if weight == 1.0 else f"{name} * tw{self.weights[weight]}"

    def sample(self, i: int, loaded: set) -> None:
        """``s{i}`` = sample i of every lane, reading the window values it needs that this segment has not."""
        w = self.write
        for q, _ in self.taps[i]:
            if q not in loaded:
                loaded.add(q)
                mask = self.window_mask(q)
                w(f"v{q} = tl.load(x_lane + off{q}, mask={mask}, other=0.0).to(COMPUTE)")
        w(f"s{i} = " + " + ".join(self.scaled(f"v{q}", weight) for q, weight in self.taps[i]))

    def sort_segment(self, segment: Tuple[int, int], record: bool) -> None:
        """Samples of ``segment`` formed and sorted into ``s{start}..s{end-1}``; with ``record`` the swap
        decisions are kept in ``swaps{word}`` (bit ``t % 32`` of word ``t // 32`` for comparator t: an or
        and a select per comparator, and an and and a compare to read it back)."""
        w = self.write
        start, end = segment
        defined: set = set()
        loaded: set = set()
        if end - start == 1:
            self.sample(start, loaded)
            return
        for t, (a, b) in enumerate(self.comparators[segment]):
            for i in (a, b):
                if i not in defined:
                    defined.add(i)
                    self.sample(i, loaded)
            if record:
                word, bit = divmod(t, 32)
                w(f"swap = s{b} < s{a}",
                  f"lo = tl.where(swap, s{b}, s{a})",
                  f"s{b} = tl.where(swap, s{a}, s{b})",
                  f"s{a} = lo")
                w(f"swaps{word} = swap.to(tl.int32)" if bit == 0 else
                  f"swaps{word} = tl.where(swap, swaps{word} | {_bit(bit)}, swaps{word})")
            else:
                w(f"lo = tl.minimum(s{a}, s{b}, {_NAN})",
                  f"s{b} = tl.maximum(s{a}, s{b}, {_NAN})",
                  f"s{a} = lo")

    def unsort_segment(self, segment: Tuple[int, int]) -> None:
        """``g{i}`` (gradients of sorted slots) moved back to the samples by the recorded swaps, in reverse."""
        w = self.write
        pairs = self.comparators[segment]
        for t in reversed(range(len(pairs))):
            a, b = pairs[t]
            word, bit = divmod(t, 32)
            w(f"swap = (swaps{word} & {_bit(bit)}) != 0",
              f"lo = tl.where(swap, g{b}, g{a})",
              f"g{b} = tl.where(swap, g{a}, g{b})",
              f"g{a} = lo")

    def last_segment_of_positions(self) -> Dict[int, int]:
        """Per window position, the index of the last segment whose samples read it."""
        last = {}
        for index, (start, end) in enumerate(self.geometry.segments):
            for i in range(start, end):
                for q, _ in self.taps[i]:
                    last[q] = index
        return last

    def window_gradients(self, segment: Tuple[int, int], started: set) -> None:
        """``gv{q}`` += the transposed taps applied to the segment's sample gradients ``g{i}``."""
        w = self.write
        for i in range(*segment):
            for q, weight in self.taps[i]:
                term = self.scaled(f"g{i}", weight)
                w(f"gv{q} = gv{q} + {term}" if q in started else f"gv{q} = {term}")
                started.add(q)

    def source(self) -> str:
        return "\n".join(self.write.lines)


def _channel_lanes(kernel: _Kernel, buffers: List[Tuple[str, str, str, str]]) -> None:
    """Lanes of the columns kernels: a block of channels ``c`` (rows) by the block of positions, ``x_lane``
    pointing at each lane's window corner, and per ``(name, pointer, image stride, channel stride)`` a
    pointer to each lane's entry of a [image, channel, ..., position] buffer (positions contiguous)."""
    kernel.positions()
    kernel.write("c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)",
                 "lane_ok = (c < C)[:, None] & p_ok[None, :]",
                 "x_lane = x_ptr + pos + (c.to(tl.int64) * sxc)[:, None]")
    for name, pointer, image_stride, channel_stride in buffers:
        kernel.write(f"{name} = {pointer} + (image * {image_stride} + l)[None, :] "
                     f"+ (c.to(tl.int64) * {channel_stride})[:, None]")


def _columns_kernel(geometry: SortGeometry) -> str:
    """``columns[image, c, slot, l]`` (strides scb, scc, scs; l contiguous) = sorted samples of channel c's
    window at output position l. Grid: (position blocks, channel blocks)."""
    kernel = _Kernel(geometry, "columns_kernel",
                     f"x_ptr, cols_ptr, C, {_POSITION_ARGS}, scb, scc, scs, COMPUTE: tl.constexpr, "
                     "BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr")
    w = kernel.write
    _channel_lanes(kernel, [("cols_lane", "cols_ptr", "scb", "scc")])
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=False)
        for i in range(*segment):
            w(f"tl.store(cols_lane + {i} * scs, s{i}.to(cols_ptr.dtype.element_ty), mask=lane_ok)")
    return kernel.source()


def _unsort_kernel(geometry: SortGeometry) -> str:
    """``windows[image, c, q, l]`` (strides swb, swc, swq) = the gradient of window value q of channel c's
    window at position l, from the sorted columns' gradient ``grad_cols`` (strides sgb, sgc, sgs): the
    windows are sorted again recording the swaps, the gradient replayed through them and the taps."""
    kernel = _Kernel(geometry, "unsort_kernel",
                     f"x_ptr, grad_cols_ptr, windows_ptr, C, {_POSITION_ARGS}, sgb, sgc, sgs, swb, "
                     "swc, swq, COMPUTE: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr")
    w = kernel.write
    _channel_lanes(kernel, [("grad_lane", "grad_cols_ptr", "sgb", "sgc"),
                            ("windows_lane", "windows_ptr", "swb", "swc")])
    started: set = set()
    last = kernel.last_segment_of_positions()
    out_type = "windows_ptr.dtype.element_ty"
    for index, segment in enumerate(geometry.segments):
        kernel.sort_segment(segment, record=True)
        for i in range(*segment):
            w(f"g{i} = tl.load(grad_lane + {i} * sgs, mask=lane_ok, other=0.0).to(COMPUTE)")
        kernel.unsort_segment(segment)
        kernel.window_gradients(segment, started)
        for q in sorted(q for q, seg in last.items() if seg == index):
            w(f"tl.store(windows_lane + {q} * swq, gv{q}.to({out_type}), mask=lane_ok)")
    for q in range(kernel.slots):
        if q not in last:  # a window position no sample reads: its gradient is zero
            w(f"tl.store(windows_lane + {q} * swq, tl.zeros([BLOCK_C, BLOCK_P], {out_type}), mask=lane_ok)")
    return kernel.source()


def _fused_forward_kernel(geometry: SortGeometry) -> str:
    """The forward pass as an implicit GEMM: per block of positions and of one group's output channels,
    the loop over the group's input channels (BLOCK_C at a time) sorts each lane's windows and multiplies
    every sorted slot tile (lanes [BLOCK_C, BLOCK_P], transposed) into the output tile [BLOCK_P, BLOCK_O]
    with ``tl.dot`` (weight ``w`` laid out [group, slot, in_per_group, out_per_group]). Grid: (position
    blocks, output blocks, groups)."""
    kernel = _Kernel(geometry, "fused_forward_kernel",
                     f"x_ptr, w_ptr, bias_ptr, out_ptr, in_per_group, out_per_group, {_POSITION_ARGS}, sob, soc, soh, "
                     "sow, COMPUTE: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, "
                     "HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr")
    w = kernel.write
    kernel.positions()
    w("group = tl.program_id(2)",
      "o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)",
      "o_ok = o < out_per_group",
      "acc = tl.zeros([BLOCK_P, BLOCK_O], ACCUMULATE)",
      "slot_stride = in_per_group * out_per_group",
      "for c0 in range(0, in_per_group, BLOCK_C):")
    w.depth += 1
    kernel.new_channel_block()
    w("c = c0 + tl.arange(0, BLOCK_C)",
      "c_ok = c < in_per_group",
      "lane_ok = c_ok[:, None] & p_ok[None, :]",
      "x_lane = x_ptr + pos + ((group * in_per_group + c).to(tl.int64) * sxc)[:, None]",
      f"w_lane = w_ptr + (group * {kernel.slots} * in_per_group + c)[:, None] * out_per_group + o[None, :]",
      "w_ok = c_ok[:, None] & o_ok[None, :]")
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=False)
        for i in range(*segment):
            # out_dtype given: Triton 3.6 takes float32 unless told, even with a float64 accumulator.
            w(f"acc = tl.dot(tl.trans(s{i}.to(w_ptr.dtype.element_ty)), tl.load(w_lane + {i} * slot_stride, "
              "mask=w_ok, other=0.0), acc, input_precision=PRECISION, out_dtype=ACCUMULATE)")
    w.depth -= 1
    w("if HAS_BIAS:",
      "    acc += tl.load(bias_ptr + group * out_per_group + o, mask=o_ok, other=0.0).to(ACCUMULATE)[None, :]",
      "out = out_ptr + (image * sob + (l // out_w) * soh + (l % out_w) * sow)[:, None] "
      "+ ((group * out_per_group + o).to(tl.int64) * soc)[None, :]",
      "tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & o_ok[None, :])")
    return kernel.source()


# The direct kernels' lanes are (group, position) windows and each program keeps an accumulator tile
# [BLOCK_J, BLOCK_G, BLOCK_P] for BLOCK_J of each group's outputs; products are plain FMAs, for groups
# with too few input channels for a matrix instruction (depthwise convolutions, first layers). Positions
# are the last axis, which Triton spreads over the threads: a lane's sorted values broadcast over the
# outputs in its own thread, and reads and writes of NCHW tensors are coalesced.
_DIRECT_ARGS = (f"groups, in_per_group, out_per_group, {_POSITION_ARGS}, sob, soc, soh, sow")


def _direct_prologue(kernel: _Kernel) -> None:
    w = kernel.write
    kernel.positions()
    w("g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)",
      "j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)",
      "g_ok = g < groups",
      "lane_ok = g_ok[:, None] & p_ok[None, :]",
      "jg_ok = (j < out_per_group)[:, None] & g_ok[None, :]",
      "out_ok = jg_ok[:, :, None] & lane_ok[None, :, :]",
      "out_offset = (image * sob + (l // out_w) * soh + (l % out_w) * sow)[None, None, :] "
      "+ ((g[None, :] * out_per_group + j[:, None]).to(tl.int64) * soc)[:, :, None]",
      "slot_stride = in_per_group * out_per_group")


def _direct_channel_loop(kernel: _Kernel) -> None:
    w = kernel.write
    w("for c in range(0, in_per_group):")
    w.depth += 1
    kernel.new_channel_block()
    w("x_offset = pos + ((g * in_per_group + c).to(tl.int64) * sxc)[:, None]",
      f"w_offset = (g[None, :] * ({kernel.slots} * in_per_group) + c) * out_per_group + j[:, None]",
      "x_lane = x_ptr + x_offset",
      "w_lane = w_ptr + w_offset")


def _direct_forward_kernel(geometry: SortGeometry) -> str:
    """out[g * out_per_group + j, position] for a tile of outputs j, groups and positions; weight laid out
    [group, slot, in_per_group, out_per_group]. Grid: (position blocks, group blocks, output blocks)."""
    kernel = _Kernel(geometry, "direct_forward_kernel",
                     f"x_ptr, w_ptr, bias_ptr, out_ptr, {_DIRECT_ARGS}, COMPUTE: tl.constexpr, HAS_BIAS: tl.constexpr, "
                     "BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr")
    w = kernel.write
    _direct_prologue(kernel)
    w("acc = tl.zeros([BLOCK_J, BLOCK_G, BLOCK_P], COMPUTE)")
    _direct_channel_loop(kernel)
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=False)
        for i in range(*segment):
            w(f"acc += tl.load(w_lane + {i} * slot_stride, mask=jg_ok, other=0.0).to(COMPUTE)[:, :, None] "
              f"* s{i}[None, :, :]")
    w.depth -= 1
    w("if HAS_BIAS:",
      "    acc += tl.load(bias_ptr + g[None, :] * out_per_group + j[:, None], mask=jg_ok, other=0.0)"
      ".to(COMPUTE)[:, :, None]",
      "tl.store(out_ptr + out_offset, acc.to(out_ptr.dtype.element_ty), mask=out_ok)")
    return kernel.source()


def _direct_backward_kernel(geometry: SortGeometry) -> str:
    """The direct kernels' backward: per channel the windows are sorted again recording the swaps; the
    weight gradient (layout of ``w``) and the input gradient (``grad_x``, the input's strides) are added
    with atomics: per program a [BLOCK_J, BLOCK_G] tile per slot, and every lane's window gradients."""
    kernel = _Kernel(geometry, "direct_backward_kernel",
                     f"x_ptr, w_ptr, grad_out_ptr, grad_x_ptr, grad_w_ptr, {_DIRECT_ARGS}, COMPUTE: tl.constexpr, "
                     "NEED_X: tl.constexpr, NEED_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr, "
                     "BLOCK_J: tl.constexpr")
    w = kernel.write
    _direct_prologue(kernel)
    w("grad_out = tl.load(grad_out_ptr + out_offset, mask=out_ok, other=0.0).to(COMPUTE)")
    _direct_channel_loop(kernel)
    w("grad_x_lane = grad_x_ptr + x_offset",
      "grad_w_lane = grad_w_ptr + w_offset")
    started: set = set()
    last = kernel.last_segment_of_positions()
    for index, segment in enumerate(geometry.segments):
        kernel.sort_segment(segment, record=True)
        w("if NEED_W:")
        for i in range(*segment):
            w(f"    tl.atomic_add(grad_w_lane + {i} * slot_stride, tl.sum(s{i}[None, :, :] * grad_out, axis=2), "
              "mask=jg_ok)")
        w("if NEED_X:")
        w.depth += 1
        for i in range(*segment):
            w(f"g{i} = tl.sum(tl.load(w_lane + {i} * slot_stride, mask=jg_ok, other=0.0).to(COMPUTE)[:, :, None] "
              "* grad_out, axis=0)")
        kernel.unsort_segment(segment)
        kernel.window_gradients(segment, started)
        for q in sorted(q for q, seg in last.items() if seg == index):
            mask = kernel.window_mask(q)
            w(f"tl.atomic_add(grad_x_lane + off{q}, gv{q}.to(grad_x_ptr.dtype.element_ty), mask={mask})")
        w.depth -= 1
    return kernel.source()


_KERNELS = (_columns_kernel, _unsort_kernel, _fused_forward_kernel, _direct_forward_kernel, _direct_backward_kernel)


def kernel_source(geometry: SortGeometry) -> str:
    """The Python source of a module holding the backend's five kernels for ``geometry``."""
    head = [f'"""Triton kernels for k={geometry.kernel_size}, sampling={geometry.sampling!r}, '
            f'sorting={geometry.sorting!r}; generated by timm_sortconv.ops.triton_backend.source."""',
            "import triton", "import triton.language as tl"]
    return "\n".join(head + [make(geometry) for make in _KERNELS]) + "\n"


_modules: Dict[Tuple[int, str, str], dict] = {}


def load_kernels(geometry: SortGeometry) -> dict:
    """The namespace of the generated module for ``geometry`` (cached): its kernels by name.

    The source is compiled under a pseudo file name registered in ``linecache``, where ``triton.jit`` (and
    the interpreter) read a function's source back; Triton's own cache then keys compiled kernels by it."""
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting)
    if key not in _modules:
        text = kernel_source(geometry)
        filename = f"<timm_sortconv triton kernels k{key[0]} {key[1]} {key[2]}>"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        namespace = {"__name__": f"timm_sortconv.ops.triton_backend.generated_k{key[0]}_{key[1]}_{key[2]}"}
        exec(compile(text, filename, "exec"), namespace)
        _modules[key] = namespace
    return _modules[key]
