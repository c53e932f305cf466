"""Triton source for one SC geometry, generated from :mod:`timm_sortconv.ops.geometry`'s tables.

Every kernel of the backend does the same first steps for a tile of *lanes*, each lane one (output
position, input channel) window: read the window values (zeros outside the input, so the caller never
pads), form the samples (square: the values; polar: the bilinear taps, as weighted sums with the tap
weights written into the source as constants of the compute dtype), and sort each segment (a ring, or the
whole window) with the comparator network of :meth:`SortGeometry.comparators`. The network is emitted as
straight-line code over per-slot tensors (``s0``, ``s1``, ...: one value per lane each), so a lane sorts
its own window in registers, with no ranks, one-hot matrices or data-dependent indexing.

Memory accesses: every kernel reads a window one position (or one window row) per load, writes window values
one window row per store (``[lanes, W]`` tiles built by a tree of ``tl.join``) and the direct backward adds a
window's input gradient one position per atomic add. A whole window read or written as one tile and split by
``tl.split`` makes fewer memory operations and a shorter compile (Triton's coalescing pass walks the whole
connected program once per memory operation), but Triton 3.6 keeps such a tile in local memory (6-7 KB per
thread for the 7x7 columns kernels, 72-2,360 bytes for the 3x3 fused and the direct kernels), where lane
tensors stay in registers; the price is a longer compile at k = 7 (7x7 global sorting's record kernel:
18-19 s). ``scripts/triton_kernel_report.py`` measures both.

Within a segment the comparators run depth first (:func:`depth_first`): the first half of a segment is
sorted before the second half's samples are formed. Each wire still meets its comparators in the same
order, so the sorted values are bit for bit those of the network's own order.

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
from typing import Dict, List, Optional, Sequence, Tuple

from ..geometry import SortGeometry
from .config import DIRECT_BLOCK_J

__all__ = ["depth_first", "gemm_depth", "kernel_source", "load_kernels", "sample_taps", "swap_words", "tile_width"]


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


def tile_width(count: int) -> int:
    """The last axis of a wide tile holding ``count`` values: the next power of two (``tl.split`` and
    ``tl.join`` halve and double it)."""
    return 1 << max(0, count - 1).bit_length()


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
    """Emits one kernel: its wide loads and stores, samples, sorting networks and their reverse.

    ``lanes``: the shape of the lane tile, as the kernel's constexpr names (``"BLOCK_C, BLOCK_P"``: channels
    by positions), positions last."""

    def __init__(self, geometry: SortGeometry, name: str, args: str, lanes: str) -> None:
        self.geometry = geometry
        self.k = geometry.kernel_size
        self.slots = self.k ** 2
        self.width = tile_width(self.slots)
        self.lanes = lanes
        self.taps = sample_taps(geometry)
        self.write = _Writer()
        self.comparators = {segment: depth_first([(a, b) for a, b in geometry.comparators()
                                                  if segment[0] <= a < segment[1]])
                            for segment in geometry.segments}
        # Comparators are numbered across the segments, in order: comparator t of a segment records its swap
        # as bit (first + t) % 32 of word (first + t) // 32 (first: the comparators of earlier segments).
        self.first_comparator = {}
        counted = 0
        for segment in geometry.segments:
            self.first_comparator[segment] = counted
            counted += len(self.comparators[segment])
        self.words = (counted + 31) // 32
        self.used = sorted({q for sample in self.taps for q, _ in sample})
        self.weights = {w: n for n, w in enumerate(sorted({w for sample in self.taps for _, w in sample} - {1.0}))}
        self.temporaries = 0
        self.header(name, args)

    def header(self, name: str, args: str) -> None:
        """The kernel's signature. Its integer arguments are not specialized (Triton would otherwise compile
        again for each value that is 1 or a multiple of 16, e.g. for the last, smaller batch of an epoch)."""
        integers = [a.strip() for a in args.split(",") if not a.strip().endswith("_ptr") and ":" not in a]
        self.write("", "", f"@triton.jit(do_not_specialize={integers!r})", f"def {name}({args}):")
        self.write.depth = 1

    def temporary(self) -> str:
        self.temporaries += 1
        return f"t{self.temporaries}_"

    def positions(self, window: bool = True, block: str = "tl.program_id(0)") -> None:
        """Lane positions of the program's block (``block``: its index among the blocks of positions):
        ``p`` (flat over the launch's images), ``p_ok``, ``image``
        and ``l`` (the position in its image); with ``window``, ``pos`` [1, BLOCK_P] (the offset of each
        window's top-left corner in x) and the corner's row and column ``ih0``, ``iw0`` (for the bounds of
        :meth:`window_bounds`: zero padding is a masked read); the tap weights ``tw{n}``."""
        w = self.write
        # Index arithmetic in int64: no offset overflows on large tensors (and Triton's interpreter checks
        # every int32 operation for overflow, several times slower than the operation itself).
        # (a loop's block index is a Python int in the interpreter: no .to() on it; n_pos is an int32, so the
        # product does not overflow)
        w(f"p = {block}.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)" if block == "tl.program_id(0)" else
          f"p = (tl.arange(0, BLOCK_P) + {block} * BLOCK_P).to(tl.int64)",
          "p_ok = p < n_pos",
          "image = p // L",
          "l = p % L")
        if window:
            w("ih0 = (l // out_w) * stride_h - pad_t",
              "iw0 = (l % out_w) * stride_w - pad_l",
              "pos = (image * sxb + ih0 * sxh + iw0 * sxw)[None, :]")
        for weight, n in self.weights.items():
            w(f"tw{n} = tl.full([], {weight!r}, COMPUTE)")

    def split(self, tile: str, width: int, names: Sequence[Optional[str]], shape: str) -> None:
        """``names[i] = tile[..., i]`` for a ``[shape, width]`` tile; None: not needed. Each level of
        ``tl.split`` separates the even entries from the odd ones, so entry ``i`` is reached by the bits
        of ``i`` from the lowest."""
        names = list(names) + [None] * (width - len(names))
        if all(name is None for name in names):
            return
        w = self.write
        if width == 1:
            w(f"{names[0]} = tl.reshape({tile}, [{shape}])")
            return
        if width == 2:
            w(f"{names[0] or self.temporary()}, {names[1] or self.temporary()} = tl.split({tile})")
            return
        even, odd = self.temporary(), self.temporary()
        w(f"{even}, {odd} = tl.split(tl.reshape({tile}, [{shape}, {width // 2}, 2]))")
        self.split(even, width // 2, names[0::2], shape)
        self.split(odd, width // 2, names[1::2], shape)

    def join(self, values: Sequence[str], width: int, shape: str) -> str:
        """The name of a ``[shape, width]`` tile whose entry ``i`` is ``values[i]`` (all of that shape),
        built by the reverse of :meth:`split`'s tree."""
        w = self.write
        name = self.temporary()
        if width == 1:
            w(f"{name} = tl.reshape({values[0]}, [{shape}, 1])")
        elif width == 2:
            w(f"{name} = tl.join({values[0]}, {values[1]})")
        else:
            even, odd = self.join(values[0::2], width // 2, shape), self.join(values[1::2], width // 2, shape)
            w(f"{name} = tl.reshape(tl.join({even}, {odd}), [{shape}, {width}])")
        return name

    def padded(self, values: Sequence[Optional[str]], width: int, shape: str, dtype: str) -> List[str]:
        """``values`` with None and the entries up to ``width`` replaced by a zero tile."""
        zero = self.temporary()
        self.write(f"{zero} = tl.zeros([{shape}], {dtype})")
        return [value or zero for value in values] + [zero] * (width - len(values))

    def load_window(self) -> None:
        """``v{q}`` for every window position q a sample reads, of every lane: one load of a lane tensor per
        position at ``x_lane`` (each lane's window corner; ``lane_ok``: which lanes exist) plus its offset, masked
        by the window's rows and columns (:meth:`window_bounds`)."""
        for q in self.used:
            offset, inside = self.window_position(q)
            self.write(f"v{q} = tl.load(x_lane + {offset}, mask=lane_ok & {inside}, other=0.0).to(COMPUTE)")

    def window_position(self, q: int) -> Tuple[str, str]:
        """(offset from the window's corner in x, whether it lies inside the input) of window position q, for
        loads and atomic adds of one position each (the bounds of :meth:`window_bounds`)."""
        r, c = divmod(q, self.k)
        return f"({r} * dil_h) * sxh + ({c} * dil_w) * sxw", f"row_ok{r} & col_ok{c}"

    def load_window_rows(self) -> None:
        """``v{q}`` for every window position q a sample reads, one masked load per window row: a ``[W8, lanes]``
        tile (W8: the next power of two of k) at ``x_lane`` plus the row's offset, split into the row's values
        (the masks from :meth:`window_bounds` and the row's columns ``row_cols``)."""
        width = tile_width(self.k)
        self.row_masks()
        for r in sorted({q // self.k for q in self.used}):
            tile = self.temporary()
            pointers, mask = self.row_tile("x_lane", r)
            self.write(f"{tile} = tl.permute(tl.load({pointers}, mask={mask}, other=0.0), (1, 2, 0)).to(COMPUTE)")
            names = [f"v{q}" if q in self.used else None for q in range(r * self.k, (r + 1) * self.k)]
            self.split(tile, width, names, self.lanes)

    @staticmethod
    def row_tile(lane: str, row: int) -> Tuple[str, str]:
        """(pointers, mask) of the ``[W8, lanes]`` tile of window row ``row`` at ``lane`` (each lane's window
        corner in a buffer of x's strides): masked by :meth:`window_bounds`' ``row_ok{row}`` and
        :meth:`row_masks`' ``row_cols``."""
        return (f"{lane}[None, :, :] + ({row} * dil_h) * sxh + row_off",
                f"(lane_ok & row_ok{row})[None, :, :] & row_cols")

    def row_masks(self) -> None:
        """``row_cols`` [W8, 1, BLOCK_P] (which of a window row's W8 entries are columns of the window inside the
        input) and ``row_off`` [W8, 1, 1] (their offsets in x) for tiles of one window row per memory operation."""
        self.write(f"row_j = tl.arange(0, {tile_width(self.k)})",
                   f"row_cols = ((row_j < {self.k})[:, None] & (iw0[None, :] + row_j[:, None] * dil_w >= 0) "
                   "& (iw0[None, :] + row_j[:, None] * dil_w < W))[:, None, :]",
                   "row_off = (row_j.to(tl.int64) * dil_w * sxw)[:, None, None]")

    def window_bounds(self, columns: bool = True) -> None:
        """``row_ok{r}`` / ``col_ok{c}`` [1, BLOCK_P]: whether row r / column c of each lane's window lies inside
        the input (for :meth:`load_window` with ``each``; :meth:`load_window_rows` needs the rows only)."""
        for r in sorted({q // self.k for q in self.used}):
            self.write(f"row_ok{r} = ((ih0 + {r} * dil_h >= 0) & (ih0 + {r} * dil_h < H))[None, :]")
        for c in sorted({q % self.k for q in self.used} if columns else ()):
            self.write(f"col_ok{c} = ((iw0 + {c} * dil_w >= 0) & (iw0 + {c} * dil_w < W))[None, :]")

    def slot_tile(self, base: str, stride: str, segment: Tuple[int, int], mask: str) -> Tuple[str, str]:
        """(pointers, mask) of the ``[shape, Ws]`` tile of a segment's slots (``Ws``: the tile width of its
        length) at ``base + slot * stride``, for a ``base`` and ``mask`` of the lane tile's shape."""
        start, end = segment
        index = self.temporary()
        self.write(f"{index} = tl.arange(0, {tile_width(end - start)})")
        return (f"({base})[None, :, :] + (({start} + {index}) * {stride})[:, None, None]",
                f"{mask}[None, :, :] & ({index} < {end - start})[:, None, None]")

    def load_slots(self, prefix: str, base: str, stride: str, segment: Tuple[int, int], mask: str,
                   shape: str, dtype: str = "COMPUTE") -> None:
        """``{prefix}{i}`` for the slots i of ``segment`` (a range of slots, or of any entries): one load of
        their tile, converted to ``dtype``."""
        start, end = segment
        pointers, tile_mask = self.slot_tile(base, stride, segment, mask)
        tile = self.temporary()
        self.write(f"{tile} = tl.permute(tl.load({pointers}, mask={tile_mask}, other=0), (1, 2, 0)).to({dtype})")
        self.split(tile, tile_width(end - start), [f"{prefix}{i}" for i in range(start, end)], shape)

    def store_slots(self, values: Sequence[str], base: str, stride: str, mask: str, dtype: str,
                    shape: Optional[str] = None, operation: str = "tl.store") -> None:
        """``values`` (of the tile ``shape``, by default the lanes') written to ``base + i * stride`` where
        ``mask`` holds, by one ``operation`` (``tl.store`` or ``tl.atomic_add``) of their tile, converted to
        ``dtype``."""
        shape = shape or self.lanes
        width = tile_width(len(values))
        tile = self.join(list(values) + [values[0]] * (width - len(values)), width, shape)  # padding: masked
        pointers, tile_mask = self.slot_tile(base, stride, (0, len(values)), mask)
        self.write(f"{operation}({pointers}, tl.permute({tile}, (2, 0, 1)).to({dtype}), mask={tile_mask})")

    def store_rows(self, values: Sequence[str], base: str, stride: str, mask: str, dtype: str) -> None:
        """``values`` (one per window position, of the lanes' shape) written to ``base + q * stride``, one
        :meth:`store_slots` per window row: tiles of k values keep each store's layout conversion small, where
        a whole window's tile made Triton 3.6 keep it in local memory (6 KB per thread at k = 7)."""
        k = self.k
        for row in range((len(values) + k - 1) // k):
            self.store_slots(values[row * k:(row + 1) * k], f"{base} + {row * k} * {stride}", stride, mask, dtype)

    def scatter_rows(self, started: set, lane: str, dtype: str) -> None:
        """The window gradients ``gv{q}`` added into the input gradient at ``lane`` (each lane's window corner in a
        buffer of x's strides), one relaxed ``tl.atomic_add`` per window row: :meth:`row_tile`, as
        :meth:`load_window_rows` reads (padding and the columns beyond k are masked; :meth:`window_bounds` and
        :meth:`row_masks` written before)."""
        width = tile_width(self.k)
        self.write(f"gx_lane = {lane}")
        for r in sorted({q // self.k for q in started}):
            values = self.padded([f"gv{q}" if q in started else None for q in range(r * self.k, (r + 1) * self.k)],
                                 width, self.lanes, "COMPUTE")
            tile = self.join(values, width, self.lanes)
            pointers, mask = self.row_tile("gx_lane", r)
            self.write(f"tl.atomic_add({pointers}, tl.permute({tile}, (2, 0, 1)).to({dtype}), mask={mask}, "
                       "sem=\"relaxed\")")

    def load_each(self, prefix: str, base: str, stride: str, segment: Tuple[int, int], mask: str,
                  dtype: str = "COMPUTE") -> None:
        """``{prefix}{i}`` for the entries i of ``segment``: one load of a lane tensor each at
        ``base + i * stride`` (no tile to split)."""
        for i in range(*segment):
            self.write(f"{prefix}{i} = tl.load({base} + {i} * {stride}, mask={mask}, other=0).to({dtype})")

    def sample(self, i: int) -> None:
        """``s{i}`` = sample i of every lane, from the window values."""
        self.write(f"s{i} = " + " + ".join(self.scaled(f"v{q}", weight) for q, weight in self.taps[i]))

    def scaled(self, name: str, weight: float) -> str:
        return name if weight == 1.0 else f"{name} * tw{self.weights[weight]}"

    def sort_segment(self, segment: Tuple[int, int], record: bool) -> None:
        """Samples of ``segment`` formed and sorted into ``s{start}..s{end-1}`` (each sample formed when
        the network first needs it); with ``record`` the swap decisions are kept in ``swaps{word}`` (one
        bit per comparator, numbered across segments: a shift and an or per comparator, and an and and a
        compare to read it back; a select in place of the shift made LLVM take 25-35 s on the 7x7 square
        global network in the sm_90 compile)."""
        w = self.write
        start, end = segment
        defined: set = set()
        if end - start == 1:
            self.sample(start)
            return
        for t, (a, b) in enumerate(self.comparators[segment]):
            for i in (a, b):
                if i not in defined:
                    defined.add(i)
                    self.sample(i)
            if record:
                word, bit = divmod(self.first_comparator[segment] + t, 32)
                w(f"swap = s{b} < s{a}",
                  f"lo = tl.where(swap, s{b}, s{a})",
                  f"s{b} = tl.where(swap, s{a}, s{b})",
                  f"s{a} = lo")
                w(f"swaps{word} = swap.to(tl.int32)" if bit == 0 else
                  f"swaps{word} = swaps{word} | (swap.to(tl.int32) << {bit})")
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
            word, bit = divmod(self.first_comparator[segment] + t, 32)
            w(f"swap = (swaps{word} & {_bit(bit)}) != 0",
              f"lo = tl.where(swap, g{b}, g{a})",
              f"g{b} = tl.where(swap, g{a}, g{b})",
              f"g{a} = lo")

    def window_gradients(self, segment: Tuple[int, int], started: set) -> None:
        """``gv{q}`` += the transposed taps applied to the segment's sample gradients ``g{i}``."""
        w = self.write
        for i in range(*segment):
            for q, weight in self.taps[i]:
                term = self.scaled(f"g{i}", weight)
                w(f"gv{q} = gv{q} + {term}" if q in started else f"gv{q} = {term}")
                started.add(q)

    def window_gradient_values(self, started: set) -> List[str]:
        """The window gradients ``gv{q}`` for every window position q, zeros where no sample reads q."""
        return self.padded([f"gv{q}" if q in started else None for q in range(self.slots)], self.slots,
                           self.lanes, "COMPUTE")

    def send_window_gradients(self, started: set, channel: str, bounds: bool = False) -> None:
        """The window gradients ``gv{q}`` sent on, ``channel`` being each lane row's input channel (int64): with
        SCATTER added into the input gradient at ``windows_ptr`` (a buffer of x's strides; :meth:`scatter_rows`,
        after the masks of :meth:`window_bounds` and :meth:`row_masks` where ``bounds``), else written to
        ``windows[image, channel, q, l]`` (strides swb, swc, swq)."""
        w = self.write
        w("if SCATTER:")
        w.depth += 1
        if bounds:
            self.window_bounds(columns=False)
            self.row_masks()
        self.scatter_rows(started, f"windows_ptr + pos + ({channel} * sxc)[:, None]", "windows_ptr.dtype.element_ty")
        w.depth -= 1
        w("else:")
        w.depth += 1
        w(f"windows_lane = windows_ptr + (image * swb + l)[None, :] + ({channel} * swc)[:, None]")
        self.store_rows(self.window_gradient_values(started), "windows_lane", "swq", "lane_ok",
                        "windows_ptr.dtype.element_ty")
        w.depth -= 1

    def source(self) -> str:
        return "\n".join(self.write.lines)


def _channel_lanes(kernel: _Kernel, buffers: List[Tuple[str, str, str, str]], window: bool = True,
                   corner: bool = False) -> None:
    """Lanes of the columns path's kernels: a block of channels ``c`` (rows) by the block of positions,
    with ``window``: ``x_lane`` pointing at each lane's window corner and the window's row and column masks
    (:meth:`_Kernel.window_bounds`, for loads of one window position each); with ``corner`` only the corner's
    offset ``pos`` and row and column (:meth:`_Kernel.positions`); per ``(name, pointer, image stride, channel
    stride)`` a pointer to each lane's entry of a [image, channel, ..., position] buffer (positions contiguous)."""
    kernel.positions(window or corner)
    kernel.write("c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)",
                 "lane_ok = (c < C)[:, None] & p_ok[None, :]")
    if window:
        kernel.write("x_lane = x_ptr + pos + (c.to(tl.int64) * sxc)[:, None]")
        kernel.window_bounds()
    for name, pointer, image_stride, channel_stride in buffers:
        kernel.write(f"{name} = {pointer} + (image * {image_stride} + l)[None, :] "
                     f"+ (c.to(tl.int64) * {channel_stride})[:, None]")


_BLOCKS = "BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr"


def _columns_kernel(geometry: SortGeometry) -> str:
    """``columns[image, c, slot, l]`` (strides scb, scc, scs; l contiguous) = sorted samples of channel c's
    window at output position l. Grid: (position blocks, channel blocks)."""
    kernel = _Kernel(geometry, "columns_kernel",
                     f"x_ptr, cols_ptr, C, {_POSITION_ARGS}, scb, scc, scs, COMPUTE: tl.constexpr, {_BLOCKS}",
                     "BLOCK_C, BLOCK_P")
    _channel_lanes(kernel, [("cols_lane", "cols_ptr", "scb", "scc")])
    kernel.load_window()
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=False)
    kernel.store_rows([f"s{i}" for i in range(kernel.slots)], "cols_lane", "scs", "lane_ok",
                      "cols_ptr.dtype.element_ty")
    return kernel.source()


def _record_kernel(geometry: SortGeometry) -> str:
    """The first kernel of the columns path's backward: ``swaps[image, c, word, l]`` (strides ssb, ssc, ssw)
    = the swap decisions of the network sorting channel c's window at position l (:func:`swap_words`
    int32 words), and with STORE_COLUMNS the sorted columns as :func:`_columns_kernel` writes them.
    Grid: (position blocks, channel blocks)."""
    kernel = _Kernel(geometry, "record_kernel",
                     f"x_ptr, cols_ptr, swaps_ptr, C, {_POSITION_ARGS}, scb, scc, scs, ssb, ssc, ssw, "
                     f"COMPUTE: tl.constexpr, STORE_COLUMNS: tl.constexpr, {_BLOCKS}", "BLOCK_C, BLOCK_P")
    w = kernel.write
    _channel_lanes(kernel, [("cols_lane", "cols_ptr", "scb", "scc"), ("swaps_lane", "swaps_ptr", "ssb", "ssc")])
    kernel.load_window()
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=True)
    if kernel.words:
        kernel.store_slots([f"swaps{word}" for word in range(kernel.words)], "swaps_lane", "ssw", "lane_ok",
                           "tl.int32")
    w("if STORE_COLUMNS:")
    w.depth += 1
    kernel.store_rows([f"s{i}" for i in range(kernel.slots)], "cols_lane", "scs", "lane_ok",
                      "cols_ptr.dtype.element_ty")
    return kernel.source()


def _replay_kernel(geometry: SortGeometry) -> str:
    """The second kernel of the columns path's backward: ``windows[image, c, q, l]`` (strides swb, swc, swq)
    = the gradient of window value q of channel c's window at position l, from the sorted columns' gradient
    ``grad_cols`` (strides sgb, sgc, sgs) replayed through the recorded swaps (``swaps``, as
    :func:`_record_kernel` writes them) and the transposed taps; with SCATTER added straight into the input
    gradient instead (``windows_ptr``: a zeroed buffer of the chunk's images with x's strides, the position
    arguments x's), one relaxed atomic addition per window value, a window row per instruction. Grid: (position
    blocks, channel blocks)."""
    kernel = _Kernel(geometry, "replay_kernel",
                     f"swaps_ptr, grad_cols_ptr, windows_ptr, C, {_POSITION_ARGS}, ssb, ssc, ssw, sgb, sgc, sgs, swb, "
                     f"swc, swq, COMPUTE: tl.constexpr, SCATTER: tl.constexpr, {_BLOCKS}", "BLOCK_C, BLOCK_P")
    _channel_lanes(kernel, [("swaps_lane", "swaps_ptr", "ssb", "ssc"), ("grad_lane", "grad_cols_ptr", "sgb", "sgc")],
                   window=False, corner=True)
    if kernel.words:
        kernel.load_slots("swaps", "swaps_lane", "ssw", (0, kernel.words), "lane_ok", kernel.lanes, "tl.int32")
    started: set = set()
    for segment in geometry.segments:
        kernel.load_each("g", "grad_lane", "sgs", segment, "lane_ok")
        kernel.unsort_segment(segment)
        kernel.window_gradients(segment, started)
    kernel.send_window_gradients(started, "c.to(tl.int64)", bounds=True)
    return kernel.source()


def swap_words(geometry: SortGeometry) -> int:
    """The int32 words of one window's recorded swaps: one bit per comparator of the geometry's network."""
    return (len(geometry.comparators()) + 31) // 32


def _store_output_tile(kernel: _Kernel) -> None:
    """The bias added to the [BLOCK_P, BLOCK_O] accumulator ``acc`` (HAS_BIAS) and the tile stored at the
    lanes' positions and the group's outputs ``o`` (the fused and gemm forward kernels)."""
    kernel.write("if HAS_BIAS:",
                 "    acc += tl.load(bias_ptr + group * out_per_group + o, mask=o_ok, other=0.0).to(ACCUMULATE)[None, :]",
                 "out = out_ptr + (image * sob + (l // out_w) * soh + (l % out_w) * sow)[:, None] "
                 "+ ((group * out_per_group + o).to(tl.int64) * soc)[None, :]",
                 "tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=p_ok[:, None] & o_ok[None, :])")


def _fused_forward_kernel(geometry: SortGeometry) -> str:
    """The forward pass as an implicit GEMM: per block of positions and of one group's output channels,
    the loop over the group's input channels (BLOCK_C at a time) sorts each lane's windows and multiplies
    every sorted slot tile (lanes [BLOCK_C, BLOCK_P], transposed) into the output tile [BLOCK_P, BLOCK_O]
    with ``tl.dot`` (weight ``w`` laid out [group, slot, in_per_group, out_per_group]). Grid: (position
    blocks, output blocks, groups)."""
    kernel = _Kernel(geometry, "fused_forward_kernel",
                     f"x_ptr, w_ptr, bias_ptr, out_ptr, in_per_group, out_per_group, {_POSITION_ARGS}, sob, soc, soh, "
                     "sow, COMPUTE: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr, "
                     "HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_O: tl.constexpr",
                     "BLOCK_C, BLOCK_P")
    w = kernel.write
    kernel.positions()
    kernel.window_bounds()
    w("group = tl.program_id(2)",
      "o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)",
      "o_ok = o < out_per_group",
      "acc = tl.zeros([BLOCK_P, BLOCK_O], ACCUMULATE)",
      "slot_stride = in_per_group * out_per_group",
      "for c0 in range(0, in_per_group, BLOCK_C):")
    w.depth += 1
    w("c = c0 + tl.arange(0, BLOCK_C)",
      "c_ok = c < in_per_group",
      "lane_ok = c_ok[:, None] & p_ok[None, :]",
      "x_lane = x_ptr + pos + ((group * in_per_group + c).to(tl.int64) * sxc)[:, None]",
      f"w_lane = w_ptr + (group * {kernel.slots} * in_per_group + c)[:, None] * out_per_group + o[None, :]",
      "w_ok = c_ok[:, None] & o_ok[None, :]")
    kernel.load_window()
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=False)
        for i in range(*segment):
            # out_dtype given: Triton 3.6 takes float32 unless told, even with a float64 accumulator.
            w(f"acc = tl.dot(tl.trans(s{i}.to(w_ptr.dtype.element_ty)), tl.load(w_lane + {i} * slot_stride, "
              "mask=w_ok, other=0.0), acc, input_precision=PRECISION, out_dtype=ACCUMULATE)")
    w.depth -= 1
    _store_output_tile(kernel)
    return kernel.source()


# The direct kernels: one group per program, its lanes (position) windows [1, BLOCK_P], and BLOCK_J of the
# group's outputs, each with its own accumulator (acc0, acc1, ...: the source holds DIRECT_OUTPUTS of them,
# those beyond BLOCK_J compiled out). Products are plain FMAs, for groups with too few input channels for a
# matrix instruction (depthwise convolutions, first layers); a weight is one scalar per slot and output for
# the whole program (scalar loads, which need no layout: the program's tensors are all [1, BLOCK_P]).
# Positions spread over the threads, so reads and writes of NCHW tensors are coalesced.
DIRECT_OUTPUTS = DIRECT_BLOCK_J
_DIRECT_ARGS = (f"in_per_group, out_per_group, {_POSITION_ARGS}, sob, soc, soh, sow")
_DIRECT_LANES = "1, BLOCK_P"


def _each_output(kernel: _Kernel, *lines: str) -> None:
    """``lines`` for each output ``{j}`` of the program's block (``j < BLOCK_J``, decided at compile time)."""
    for j in range(DIRECT_OUTPUTS):
        kernel.write(f"if BLOCK_J > {j}:", *("    " + line.format(j=j) for line in lines))


def _direct_prologue(kernel: _Kernel) -> None:
    """The program's group ``g``, its first output ``j0`` and whether output j exists (``out_ok{j}``), the
    lanes and each output's offset ``out_offset`` [1, BLOCK_P] (output channel 0 of the group), and the window's
    row and column bounds for loads and atomic adds of one window position each."""
    w = kernel.write
    kernel.positions()
    kernel.window_bounds()
    w("g = tl.program_id(1)",
      "j0 = tl.program_id(2) * BLOCK_J",
      "lane_ok = p_ok[None, :]",
      "out_offset = (image * sob + (l // out_w) * soh + (l % out_w) * sow)[None, :] "
      "+ (g * out_per_group + j0).to(tl.int64) * soc",
      "slot_stride = in_per_group * out_per_group")
    _each_output(kernel, "out_ok{j} = j0 + {j} < out_per_group")


def _direct_channel_loop(kernel: _Kernel) -> None:
    """The loop over the group's input channels, with the lanes' window corners (``x_offset``) and the
    offset of the channel's weight at slot 0 and the program's first output (``w_offset``, a scalar)."""
    w = kernel.write
    w("for c in range(0, in_per_group):")
    w.depth += 1
    w("x_offset = pos + (g * in_per_group + c).to(tl.int64) * sxc",
      f"w_offset = ((g * {kernel.slots}) * in_per_group + c) * out_per_group + j0",
      "x_lane = x_ptr + x_offset")


def _load_weights(kernel: _Kernel, segment: Tuple[int, int]) -> None:
    """``w{i}_{j}``: the weight of slot i and output j, for the segment's slots (scalar loads)."""
    for i in range(*segment):
        _each_output(kernel, f"w{i}_{{j}} = tl.load(w_ptr + w_offset + {i} * slot_stride + {{j}}, mask=out_ok{{j}}, "
                     "other=0.0).to(COMPUTE)")


def _direct_forward_kernel(geometry: SortGeometry) -> str:
    """out[g * out_per_group + j, position] for the program's outputs j and positions; weight laid out
    [group, slot, in_per_group, out_per_group]. Grid: (position blocks, groups, output blocks)."""
    kernel = _Kernel(geometry, "direct_forward_kernel",
                     f"x_ptr, w_ptr, bias_ptr, out_ptr, {_DIRECT_ARGS}, COMPUTE: tl.constexpr, HAS_BIAS: tl.constexpr, "
                     "BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr", _DIRECT_LANES)
    w = kernel.write
    _direct_prologue(kernel)
    _each_output(kernel, "acc{j} = tl.zeros([1, BLOCK_P], COMPUTE)")
    _direct_channel_loop(kernel)
    kernel.load_window()
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=False)
        _load_weights(kernel, segment)
        for i in range(*segment):
            _each_output(kernel, f"acc{{j}} += w{i}_{{j}} * s{i}")
    w.depth -= 1
    _each_output(kernel, "if HAS_BIAS:",
                 "    acc{j} += tl.load(bias_ptr + g * out_per_group + j0 + {j}, mask=out_ok{j}, other=0.0).to(COMPUTE)",
                 "tl.store(out_ptr + out_offset + {j} * soc, acc{j}.to(out_ptr.dtype.element_ty), "
                 "mask=lane_ok & out_ok{j})")
    return kernel.source()


def _direct_backward_kernel(geometry: SortGeometry) -> str:
    """The direct kernels' backward: per channel the windows are sorted again recording the swaps; the
    weight gradient (layout of ``w``) and the input gradient (``grad_x``, the input's strides) are added
    with atomics: per program a scalar per slot and output, and every lane's window gradients as one tile."""
    kernel = _Kernel(geometry, "direct_backward_kernel",
                     f"x_ptr, w_ptr, grad_out_ptr, grad_x_ptr, grad_w_ptr, {_DIRECT_ARGS}, COMPUTE: tl.constexpr, "
                     "NEED_X: tl.constexpr, NEED_W: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_J: tl.constexpr",
                     _DIRECT_LANES)
    w = kernel.write
    _direct_prologue(kernel)
    _each_output(kernel, "grad_out{j} = tl.load(grad_out_ptr + out_offset + {j} * soc, mask=lane_ok & out_ok{j}, "
                 "other=0.0).to(COMPUTE)")
    _direct_channel_loop(kernel)
    kernel.load_window()
    started: set = set()
    for segment in geometry.segments:
        start, end = segment
        kernel.sort_segment(segment, record=True)
        w("if NEED_W:")
        w.depth += 1
        for i in range(start, end):
            _each_output(kernel, f"tl.atomic_add(grad_w_ptr + w_offset + {i} * slot_stride + {{j}}, "
                         f"tl.sum(s{i} * grad_out{{j}}).to(grad_w_ptr.dtype.element_ty), mask=out_ok{{j}})")
        w.depth -= 1
        w("if NEED_X:")
        w.depth += 1
        _load_weights(kernel, segment)
        for i in range(start, end):
            w(f"g{i} = w{i}_0 * grad_out0")  # BLOCK_J >= 1
            for j in range(1, DIRECT_OUTPUTS):
                w(f"if BLOCK_J > {j}:", f"    g{i} += w{i}_{j} * grad_out{j}")
        kernel.unsort_segment(segment)
        kernel.window_gradients(segment, started)
        w.depth -= 1
    w("if NEED_X:")
    w.depth += 1
    for q in sorted(started):
        offset, inside = kernel.window_position(q)
        w(f"tl.atomic_add(grad_x_ptr + x_offset + {offset}, gv{q}.to(grad_x_ptr.dtype.element_ty), "
          f"mask=lane_ok & {inside})")
    return kernel.source()


# The gemm kernels: an implicit GEMM with one (position, input channel) window per lane. A program's lanes are
# BLOCK_C input channels of one group by its BLOCK_P positions ([BLOCK_C, BLOCK_P] tensors, one or two threads
# per position), so sorting is elementwise and needs no data movement between threads. Each
# step of the reduction takes BLOCK_C channels: their sorted slots are joined into one [BLOCK_P, BLOCK_C * K]
# operand (K = gemm_depth(k * k): a channel's slots, zero-padded to a power of two of at least 16, the smallest
# depth of tl.dot; column c * K + i is slot i of channel c) and multiplied with those channels' [BLOCK_C * K,
# BLOCK_O] weight tile by one tl.dot: the product runs on tensor cores with one layout conversion of the operand
# per step. Several channels per step give the small windows (k = 3: K = 16) a deeper product per conversion.
# Their windows are read one position at a time (the forward's and the weight gradient's: a lane tensor per
# position, with masks from the window's rows and columns) or one window row at a time (the input gradient's,
# whose longer program would compile for 20-30 s with a load per position), and the input gradient's window values
# are written one row at a time: with a whole window as one tile,
# Triton 3.6 (with torch 2.11) keeps the tile in local memory, spilling 600-4,000 bytes per thread at k = 5 and 7
# in the sm_90 report, where Triton 3.8 keeps it in registers.
_GEMM_LANES = "BLOCK_C, BLOCK_P"
_GEMM_BLOCKS = "BLOCK_P: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_C: tl.constexpr"
_GEMM_TYPES = "COMPUTE: tl.constexpr, ACCUMULATE: tl.constexpr, PRECISION: tl.constexpr"


def gemm_depth(slots: int) -> int:
    """The reduction depth per input channel of the gemm kernels: ``slots`` padded to a power of two >= 16."""
    return max(16, tile_width(slots))


def _gemm_channels(kernel: _Kernel, first: str) -> None:
    """The program's channel block from its first channel ``first`` in ``group``: ``cc`` [BLOCK_C], ``c_ok``,
    ``chan`` (the channels' indices in the input); the operand's rows ``rc`` (channel in the block) and ``rq``
    (slot) and which hold a weight, ``row_ok`` [BLOCK_C * K]. (``lane_ok`` [BLOCK_C, BLOCK_P] follows the
    positions: ``c_ok[:, None] & p_ok[None, :]``.)"""
    depth = gemm_depth(kernel.slots)
    kernel.write(f"c0 = {first}",
                 "cc = tl.arange(0, BLOCK_C)",
                 "c_ok = c0 + cc < in_per_group",
                 "chan = (group * in_per_group + c0 + cc).to(tl.int64)",
                 f"r = tl.arange(0, BLOCK_C * {depth})",
                 f"rc = r // {depth}",
                 f"rq = r % {depth}",
                 f"row_ok = (rq < {kernel.slots}) & (c0 + rc < in_per_group)")


def _gemm_sorted_operand(kernel: _Kernel) -> None:
    """``a``: the [BLOCK_P, BLOCK_C * K] operand of the program's channels: the lanes' windows read, sampled,
    sorted, and joined (zeros beyond each channel's slots)."""
    depth = gemm_depth(kernel.slots)
    kernel.write("x_lane = x_ptr + pos + (chan * sxc)[:, None]")
    kernel.load_window()
    for segment in kernel.geometry.segments:
        kernel.sort_segment(segment, record=False)
    values = kernel.padded([f"s{i}" for i in range(kernel.slots)], depth, kernel.lanes, "COMPUTE")
    tile = kernel.join(values, depth, kernel.lanes)  # [BLOCK_C, BLOCK_P, K]
    kernel.write(f"a = tl.reshape(tl.permute({tile}, (1, 0, 2)), [BLOCK_P, BLOCK_C * {depth}])")


def _gemm_weight_tile(kernel: _Kernel) -> Tuple[str, str]:
    """Pointers [BLOCK_C * K, BLOCK_O] of the channels' weights (``w`` laid out [channel, slot, out_per_group];
    a group's channels are consecutive) and their mask, for the operand's rows and the outputs ``o``."""
    return (f"w_ptr + ((group * in_per_group + c0 + rc) * {kernel.slots} + rq)[:, None] * out_per_group + o[None, :]",
            "row_ok[:, None] & o_ok[None, :]")


def _gemm_grad_tile() -> Tuple[str, str]:
    """Pointers [BLOCK_P, BLOCK_O] of the output gradient at the lanes' positions and outputs ``o`` of the
    group, and their mask."""
    return ("grad_out_ptr + (image * sgb + (l // out_w) * sgh + (l % out_w) * sgw)[:, None] "
            "+ ((group * out_per_group + o).to(tl.int64) * sgc)[None, :]", "p_ok[:, None] & o_ok[None, :]")


def _gemm_forward_kernel(geometry: SortGeometry) -> str:
    """out[image, group * out_per_group + o, position] for a block of positions and of one group's outputs:
    for each block of BLOCK_C input channels of the group, the lanes' windows sorted, joined into the operand and
    multiplied with the channels' weights into the [BLOCK_P, BLOCK_O] accumulator. Grid: (position blocks,
    output blocks, groups)."""
    kernel = _Kernel(geometry, "gemm_forward_kernel",
                     f"x_ptr, w_ptr, bias_ptr, out_ptr, in_per_group, out_per_group, {_POSITION_ARGS}, sob, soc, soh, "
                     f"sow, {_GEMM_TYPES}, HAS_BIAS: tl.constexpr, {_GEMM_BLOCKS}", _GEMM_LANES)
    w = kernel.write
    kernel.positions()
    kernel.window_bounds()
    pointers, mask = _gemm_weight_tile(kernel)
    w("group = tl.program_id(2)",
      "o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)",
      "o_ok = o < out_per_group",
      "acc = tl.zeros([BLOCK_P, BLOCK_O], ACCUMULATE)",
      "for step in range(0, in_per_group, BLOCK_C):")
    w.depth += 1
    _gemm_channels(kernel, "step")
    w("lane_ok = c_ok[:, None] & p_ok[None, :]")
    _gemm_sorted_operand(kernel)
    w(f"w_tile = tl.load({pointers}, mask={mask}, other=0.0)",
      "acc = tl.dot(a.to(w_ptr.dtype.element_ty), w_tile, acc, input_precision=PRECISION, out_dtype=ACCUMULATE)")
    w.depth -= 1
    _store_output_tile(kernel)
    return kernel.source()


def _gemm_input_backward_kernel(geometry: SortGeometry) -> str:
    """The input gradient's window values, per block of positions and BLOCK_C input channels of one group: the
    lanes' windows sorted again recording the swaps; the sorted slots' gradient [BLOCK_P, BLOCK_C * K] = the
    output gradient times the channels' weights (tl.dot per block of the group's outputs); split per slot, sent
    back through the swaps and the transposed taps, and written as ``windows[image, channel, q, l]`` (strides
    swb, swc, swq), which ``F.fold`` sums per input pixel (no atomics: deterministic); with SCATTER, added
    straight into the input gradient instead (``windows_ptr``: a buffer of x's shape and strides, zeroed; one
    atomic addition per window value, one window row per instruction: no window values in memory and no fold,
    but sums in a varying order). Grid: (position blocks, groups, channel blocks)."""
    kernel = _Kernel(geometry, "gemm_input_backward_kernel",
                     f"x_ptr, w_ptr, grad_out_ptr, windows_ptr, in_per_group, out_per_group, {_POSITION_ARGS}, "
                     f"sgb, sgc, sgh, sgw, swb, swc, swq, {_GEMM_TYPES}, SCATTER: tl.constexpr, {_GEMM_BLOCKS}",
                     _GEMM_LANES)
    w = kernel.write
    depth = gemm_depth(kernel.slots)
    kernel.positions()
    pointers, mask = _gemm_weight_tile(kernel)
    grad_pointers, grad_mask = _gemm_grad_tile()
    w("group = tl.program_id(1)")
    _gemm_channels(kernel, "tl.program_id(2) * BLOCK_C")
    w("lane_ok = c_ok[:, None] & p_ok[None, :]",
      "x_lane = x_ptr + pos + (chan * sxc)[:, None]")
    kernel.window_bounds(columns=False)
    kernel.load_window_rows()
    for segment in geometry.segments:
        kernel.sort_segment(segment, record=True)
    w(f"gs = tl.zeros([BLOCK_P, BLOCK_C * {depth}], ACCUMULATE)",
      "for o0 in range(0, out_per_group, BLOCK_O):")
    w.depth += 1
    w("o = o0 + tl.arange(0, BLOCK_O)",
      "o_ok = o < out_per_group",
      f"g = tl.load({grad_pointers}, mask={grad_mask}, other=0.0)",
      f"w_tile = tl.load({pointers}, mask={mask}, other=0.0)",
      "gs = tl.dot(g.to(w_ptr.dtype.element_ty), tl.trans(w_tile), gs, input_precision=PRECISION, "
      "out_dtype=ACCUMULATE)")
    w.depth -= 1
    w(f"gs = tl.permute(tl.reshape(gs.to(COMPUTE), [BLOCK_P, BLOCK_C, {depth}]), (1, 0, 2))")
    kernel.split("gs", depth, [f"g{i}" for i in range(kernel.slots)], kernel.lanes)
    started: set = set()
    for segment in geometry.segments:
        kernel.unsort_segment(segment)
        kernel.window_gradients(segment, started)
    kernel.send_window_gradients(started, "chan")
    return kernel.source()


def _gemm_weight_backward_kernel(geometry: SortGeometry) -> str:
    """The weight gradient's partial sums: per split of the position blocks (blocks ``split``, ``split +
    splits``, ...), block of BLOCK_C input channels of one group and block of the group's outputs, the sum over
    the split's positions of the sorted slots [BLOCK_C * K, BLOCK_P] times the output gradient [BLOCK_P, BLOCK_O]
    (tl.dot), written to ``partial[split, channel, slot, o]``; the caller sums the splits in a fixed order
    (deterministic). Grid: (splits, groups x channel blocks, output blocks)."""
    kernel = _Kernel(geometry, "gemm_weight_backward_kernel",
                     f"x_ptr, grad_out_ptr, partial_ptr, in_per_group, out_per_group, channels, n_blocks, splits, "
                     f"{_POSITION_ARGS}, sgb, sgc, sgh, sgw, {_GEMM_TYPES}, {_GEMM_BLOCKS}", _GEMM_LANES)
    w = kernel.write
    depth = gemm_depth(kernel.slots)
    grad_pointers, grad_mask = _gemm_grad_tile()
    w("split = tl.program_id(0)",
      "channel_blocks = tl.cdiv(in_per_group, BLOCK_C)",
      "group = tl.program_id(1) // channel_blocks",
      "o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)",
      "o_ok = o < out_per_group",
      f"acc = tl.zeros([BLOCK_C * {depth}, BLOCK_O], ACCUMULATE)")
    _gemm_channels(kernel, "(tl.program_id(1) % channel_blocks) * BLOCK_C")
    w("for block in range(split, n_blocks, splits):")
    w.depth += 1
    kernel.positions(block="block")
    kernel.window_bounds()
    w("lane_ok = c_ok[:, None] & p_ok[None, :]")
    _gemm_sorted_operand(kernel)
    w(f"g = tl.load({grad_pointers}, mask={grad_mask}, other=0.0)",
      "acc = tl.dot(tl.trans(a).to(grad_out_ptr.dtype.element_ty), g, acc, input_precision=PRECISION, "
      "out_dtype=ACCUMULATE)")
    w.depth -= 1
    w(f"partial = partial_ptr + ((split * channels + group * in_per_group + c0 + rc) * {kernel.slots} + rq)[:, None]"
      ".to(tl.int64) * out_per_group + o[None, :]",
      "tl.store(partial, acc.to(partial_ptr.dtype.element_ty), mask=row_ok[:, None] & o_ok[None, :])")
    return kernel.source()


_KERNELS = (_columns_kernel, _record_kernel, _replay_kernel, _fused_forward_kernel, _direct_forward_kernel,
            _direct_backward_kernel, _gemm_forward_kernel, _gemm_input_backward_kernel, _gemm_weight_backward_kernel)


def kernel_source(geometry: SortGeometry) -> str:
    """The Python source of a module holding the backend's kernels for ``geometry``."""
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
