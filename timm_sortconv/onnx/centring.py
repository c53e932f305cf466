"""The centring of strided grids (:mod:`timm_sortconv.grid`) in ONNX: the TorchScript-based exporter's translations of
``timm_sortconv::centre_grid`` and ``timm_sortconv::centre_grid_same``, which ``torch.jit.trace`` records where a
layer centres its grid; and of ``timm_sortconv::canonical_frame``, the frame in which the canonical turn turns a
non-square image (:func:`timm_sortconv.canonical.canonical_frame`), by the same rules.

Where the exporter knows the input's height and width (a static shape: the sizes of every layer follow from the
example's), the rule is worked out here and written as the nodes it needs at that size: nothing where the grid is
centred already, otherwise an ``AveragePool`` of 2 pixels along the axes read half a pixel on, and a ``Slice`` for a
crop (or a ``Pad`` for "SAME" padding). Where a size is dynamic, the same rule is computed in the
graph from the input's shape (``Shape``, ``Mod``, ``Div``, ``Where``) and applied without branches: the half-pixel
read of an axis whose residue is even takes the mean of the input with itself, ``(x + x) * 0.5 = x`` exactly. No
``If`` node is written, so every runtime's type inference takes the graph at a static shape as at a dynamic one.

Inside :func:`.lowering.fused_export` a centring is one node, ``timm_sortconv::CentreGrid`` (the arguments as
attributes, and the traced ``sizes``, 0 where dynamic), which :func:`.fused.merge_centring` moves into the
``SortConv2d`` node it feeds and :func:`.functions.expand_centring` writes as the standard operators above
elsewhere.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..canonical import _edge_index, canonical_size
from ..grid import centre_grid_residues, same_padding_totals
from .fused import CENTRE_OP, DOMAIN
from .lowering import fused_export_enabled

__all__ = ["register_symbolics"]


def _constant(g, values: Sequence[int]):
    return g.op("Constant", value_t=torch.tensor(list(values), dtype=torch.int64))


def _static_sizes(x) -> Optional[List[int]]:
    """The input's height and width where the exporter knows them, else ``None``."""
    from torch.onnx import symbolic_helper

    sizes = symbolic_helper._get_tensor_sizes(x)
    if not sizes or len(sizes) < 2 or sizes[-1] is None or sizes[-2] is None:
        return None
    return [int(sizes[-2]), int(sizes[-1])]


def _rank(x) -> int:
    from torch.onnx import symbolic_helper

    rank = symbolic_helper._get_tensor_rank(x)
    if rank is None:
        raise ValueError("ONNX export: a centred layer's input has no known rank")
    return rank


def _slice(g, x, start, end, dim: int):
    """``x[start:end]`` along ``dim``; ``start`` and ``end`` ints or 1-element int64 values of the graph."""
    bound = (lambda v: _constant(g, [v]) if isinstance(v, int) else v)
    return g.op("Slice", x, bound(start), bound(end), _constant(g, [dim]))


def _half_pixel_static(g, x, rank: int, sizes: List[int], odd: List[bool]):
    """The half-pixel read of the axes marked ``odd`` (the mean of each pixel and the next; ``sizes`` updated): on
    a batch of images one ``AveragePool`` of 2 pixels along those axes, a single pass over the input (a ``Slice``
    pair, an ``Add`` and a ``Mul`` per axis copy it four times each); an image without a batch axis, which
    ``AveragePool`` does not take, by those nodes."""
    if not any(odd):
        return x
    if rank == 4:
        x = g.op("AveragePool", x, kernel_shape_i=[2 if o else 1 for o in odd], strides_i=[1, 1])
    for axis in range(2):
        if odd[axis]:
            if rank != 4:
                dim, size = rank - 2 + axis, sizes[axis]
                x = g.op("Mul", g.op("Add", _slice(g, x, 0, size - 1, dim), _slice(g, x, 1, size, dim)),
                         g.op("Constant", value_t=torch.tensor(0.5)))
            sizes[axis] -= 1
    return x


def _centre_static(g, x, rank: int, sizes: List[int], residues: List[int]):
    x = _half_pixel_static(g, x, rank, sizes, [residue % 2 == 1 for residue in residues])
    for axis in range(2):
        crop = residues[axis] // 2
        if crop > 0:
            x = _slice(g, x, crop, sizes[axis] - crop, rank - 2 + axis)
    return x


def _centre_dynamic(g, x, rank: int, kernel_size, stride, padding, dilation, min_size: int):
    """:func:`timm_sortconv.grid.centre_grid` computed from the input's shape: per strided axis the residue
    ``r`` (0 where the span is negative or the crop would leave fewer than ``min_size`` pixels), a half-pixel read of
    ``r % 2`` pixels and a crop of ``r // 2`` on each side."""
    shape = g.op("Shape", x)
    zero, two = _constant(g, [0]), _constant(g, [2])
    for axis in range(2):
        if stride[axis] == 1:
            continue
        dim = rank - 2 + axis
        size = g.op("Gather", shape, _constant(g, [dim]), axis_i=0)
        span = g.op("Add", size, _constant(g, [2 * padding[axis] - dilation[axis] * (kernel_size[axis] - 1) - 1]))
        excess = g.op("Mod", span, _constant(g, [stride[axis]]))
        skip = g.op("Or", g.op("Less", span, zero), g.op("Less", g.op("Sub", size, excess), _constant(g, [min_size])))
        excess = g.op("Where", skip, zero, excess)
        half, crop = g.op("Mod", excess, two), g.op("Div", excess, two)
        kept = g.op("Sub", size, half)
        x = g.op("Mul", g.op("Add", _slice(g, x, zero, kept, dim), _slice(g, x, half, size, dim)),
                 g.op("Constant", value_t=torch.tensor(0.5)))
        x = _slice(g, x, crop, g.op("Sub", kept, crop), dim)
    return x


def _centre_grid_symbolic(g, x, kernel_size, stride, padding, dilation, min_size):
    from torch.onnx import symbolic_helper

    kernel_size, stride, padding, dilation = (symbolic_helper._get_const(v, "is", name) for v, name in (
        (kernel_size, "kernel_size"), (stride, "stride"), (padding, "padding"), (dilation, "dilation")))
    min_size = symbolic_helper._get_const(min_size, "i", "min_size")
    rank = _rank(x)
    sizes = _static_sizes(x)
    residues = (centre_grid_residues(sizes[0], sizes[1], kernel_size, stride, padding, dilation, min_size)
                if sizes is not None else None)
    if residues == [0, 0]:  # centred already at the traced size
        return x
    if fused_export_enabled():  # one node, merged into the SortConv2d node it feeds or expanded (fused.py)
        out = g.op(f"{DOMAIN}::{CENTRE_OP}", x, kernel_size_i=kernel_size, strides_i=stride, pads_i=padding,
                   dilations_i=dilation, min_size_i=min_size, sizes_i=sizes or [0, 0])
        shape = symbolic_helper._get_tensor_sizes(x)
        if shape:  # the sizes the exporter knows: those before the last two, and the last two where static
            last = [sizes[axis] - residues[axis] for axis in range(2)] if sizes is not None else [None, None]
            out.setType(x.type().with_sizes(shape[:-2] + last))
        return out
    if sizes is not None:
        return _centre_static(g, x, rank, sizes, residues)
    return _centre_dynamic(g, x, rank, kernel_size, stride, padding, dilation, min_size)


def _centre_same_dynamic(g, x, rank: int, kernel_size, stride, dilation):
    """:func:`timm_sortconv.grid.centre_grid_same` computed from the input's shape: per axis the total padding of
    "SAME", a half-pixel read where it is odd, then a crop (a negative total) and a pad (a positive one) of half the
    rest on each side, one of them of 0 pixels."""
    shape = g.op("Shape", x)
    zero, two = _constant(g, [0]), _constant(g, [2])
    pads = []
    for axis in range(2):
        dim = rank - 2 + axis
        size = g.op("Gather", shape, _constant(g, [dim]), axis_i=0)
        outputs = g.op("Div", g.op("Add", size, _constant(g, [stride[axis] - 1])), _constant(g, [stride[axis]]))
        total = g.op("Sub", g.op("Add", g.op("Mul", g.op("Sub", outputs, _constant(g, [1])),
                                             _constant(g, [stride[axis]])),
                                 _constant(g, [dilation[axis] * (kernel_size[axis] - 1) + 1])), size)
        half = g.op("Mod", total, two)
        kept = g.op("Sub", size, half)
        x = g.op("Mul", g.op("Add", _slice(g, x, zero, kept, dim), _slice(g, x, half, size, dim)),
                 g.op("Constant", value_t=torch.tensor(0.5)))
        side = g.op("Div", g.op("Add", total, half), two)  # even: exact, whatever its sign
        crop = g.op("Max", g.op("Neg", side), zero)
        x = _slice(g, x, crop, g.op("Sub", kept, crop), dim)
        pads.append(g.op("Max", side, zero))
    before = [zero] * (rank - 2) + pads
    return g.op("Pad", x, g.op("Concat", *before, *before, axis_i=0))


def _centre_grid_same_symbolic(g, x, kernel_size, stride, dilation):
    from torch.onnx import symbolic_helper

    kernel_size, stride, dilation = (symbolic_helper._get_const(v, "is", name) for v, name in (
        (kernel_size, "kernel_size"), (stride, "stride"), (dilation, "dilation")))
    rank = _rank(x)
    sizes = _static_sizes(x)
    if sizes is None:
        return _centre_same_dynamic(g, x, rank, kernel_size, stride, dilation)
    totals = same_padding_totals(sizes[0], sizes[1], kernel_size, stride, dilation)
    x = _half_pixel_static(g, x, rank, sizes, [total % 2 == 1 for total in totals])
    pads = [0] * (2 * rank)
    for axis in range(2):
        side = (totals[axis] + totals[axis] % 2) // 2
        dim = rank - 2 + axis
        if side < 0:
            x = _slice(g, x, -side, sizes[axis] + side, dim)
        else:
            pads[dim] = pads[rank + dim] = side
    if any(pads):
        x = g.op("Pad", x, _constant(g, pads))
    return x


def _edge_indices(g, index, size, padding_mode: str):
    """:func:`timm_sortconv.canonical._edge_index` of int64 values of the graph (``size`` 1-element)."""
    last = g.op("Sub", size, _constant(g, [1]))
    if padding_mode == "border":
        return g.op("Min", g.op("Max", index, _constant(g, [0])), last)
    period = g.op("Max", g.op("Mul", last, _constant(g, [2])), _constant(g, [1]))  # a size of 1 reads its pixel
    folded = g.op("Mod", index, period)
    return g.op("Where", g.op("Less", folded, size), folded, g.op("Sub", period, folded))


def _frame_dynamic(g, images, rank: int, padding_mode: str):
    """:func:`timm_sortconv.canonical.canonical_frame` computed from the input's shape: the frame's side
    ``ceil(sqrt((H - 1)^2 + (W - 1)^2)) + 4`` (in float64, exact for every image side below 2^26), each axis one
    pixel more where its margin would be odd, and no frame where the image is square."""
    shape = g.op("Shape", images)
    h, w = (g.op("Gather", shape, _constant(g, [rank - 2 + axis]), axis_i=0) for axis in range(2))
    one = _constant(g, [1])
    square = g.op("Add", g.op("Mul", g.op("Sub", h, one), g.op("Sub", h, one)),
                  g.op("Mul", g.op("Sub", w, one), g.op("Sub", w, one)))
    side = g.op("Cast", g.op("Ceil", g.op("Sqrt", g.op("Cast", square, to_i=11))), to_i=7)  # double, int64
    side = g.op("Add", side, _constant(g, [4]))
    same = g.op("Equal", h, w)
    sizes = [g.op("Where", same, size, g.op("Add", side, g.op("Mod", g.op("Sub", side, size), _constant(g, [2]))))
             for size in (h, w)]
    margins = [g.op("Div", g.op("Sub", framed, size), _constant(g, [2])) for framed, size in zip(sizes, (h, w))]
    if padding_mode == "zeros":
        zero = [_constant(g, [0])] * (rank - 2)
        return g.op("Pad", images, g.op("Concat", *zero, *margins, *zero, *margins, axis_i=0))
    for axis in range(2):
        index = g.op("Sub", g.op("Range", g.op("Squeeze", _constant(g, [0])), g.op("Squeeze", sizes[axis]),
                                 g.op("Squeeze", one)), margins[axis])
        images = g.op("Gather", images, _edge_indices(g, index, (h, w)[axis], padding_mode), axis_i=rank - 2 + axis)
    return images


def _canonical_frame_symbolic(g, images, padding_mode):
    from torch.onnx import symbolic_helper

    padding_mode = symbolic_helper._get_const(padding_mode, "s", "padding_mode")
    rank = _rank(images)
    sizes = _static_sizes(images)
    if sizes is None:
        return _frame_dynamic(g, images, rank, padding_mode)
    height, width = canonical_size(*sizes)
    if (height, width) == tuple(sizes):
        return images
    top, left = (height - sizes[0]) // 2, (width - sizes[1]) // 2
    if padding_mode == "zeros":
        pads = [0] * (2 * rank)
        pads[rank - 2] = pads[2 * rank - 2] = top
        pads[rank - 1] = pads[2 * rank - 1] = left
        return g.op("Pad", images, _constant(g, pads))
    for axis, (framed, margin) in enumerate(((height, top), (width, left))):
        index = _edge_index(torch.arange(framed) - margin, sizes[axis], padding_mode)
        images = g.op("Gather", images, g.op("Constant", value_t=index), axis_i=rank - 2 + axis)
    return images


def register_symbolics() -> None:
    """Registers the translations with the TorchScript-based exporter (at import of :mod:`timm_sortconv.onnx`)."""
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic("timm_sortconv::centre_grid", _centre_grid_symbolic, 1)
    register_custom_op_symbolic("timm_sortconv::centre_grid_same", _centre_grid_same_symbolic, 1)
    register_custom_op_symbolic("timm_sortconv::canonical_frame", _canonical_frame_symbolic, 1)
