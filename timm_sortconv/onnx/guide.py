"""The orientation guide's pooling (:meth:`timm_sortconv.guide.OrientationGuide.at_size`) in ONNX: the
TorchScript-based exporter's translation of ``timm_sortconv::pool_to``, which a trace records where a guided layer
reads the guide at its own size.

Adaptive average pooling of each axis is a matrix product, ``A_h @ map @ A_w^T``
(:func:`timm_sortconv.guide.area_matrix`). Where the exporter knows both sizes (a static shape), the matrices are
constants and the pooling is two ``MatMul`` nodes; where a size is dynamic, the matrices are computed in the graph
from the sizes (``Range``, comparisons, a division: the same rule).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..guide import area_matrix

__all__ = ["register_symbolics"]

_FLOAT = 1  # onnx.TensorProto.FLOAT


def _sizes(value) -> Optional[Tuple[int, int]]:
    from torch.onnx import symbolic_helper

    sizes = symbolic_helper._get_tensor_sizes(value)
    if not sizes or len(sizes) < 2 or sizes[-1] is None or sizes[-2] is None:
        return None
    return int(sizes[-2]), int(sizes[-1])


def _axis_size(g, value, dim: int):
    return g.op("Gather", g.op("Shape", value), g.op("Constant", value_t=torch.tensor(dim)), axis_i=0)


def _dynamic_matrix(g, size_in, size_out):
    """:func:`~timm_sortconv.guide.area_matrix` of two sizes (0-d int64 values of the graph) in the graph."""
    def constant(v):
        return g.op("Constant", value_t=torch.tensor(v, dtype=torch.int64))

    rows = g.op("Unsqueeze", g.op("Range", constant(0), size_out, constant(1)), g.op(
        "Constant", value_t=torch.tensor([1])))
    start = g.op("Div", g.op("Mul", rows, size_in), size_out)
    end = g.op("Div", g.op("Sub", g.op("Add", g.op("Mul", g.op("Add", rows, constant(1)), size_in), size_out),
                           constant(1)), size_out)
    columns = g.op("Unsqueeze", g.op("Range", constant(0), size_in, constant(1)), g.op(
        "Constant", value_t=torch.tensor([0])))
    inside = g.op("And", g.op("GreaterOrEqual", columns, start), g.op("Less", columns, end))
    return g.op("Div", g.op("Cast", inside, to_i=_FLOAT), g.op("Cast", g.op("Sub", end, start), to_i=_FLOAT))


def _pool_to_symbolic(g, guide, like):
    sizes_in, sizes_out = _sizes(guide), _sizes(like)
    if sizes_in is not None and sizes_out is not None:
        if sizes_in == sizes_out:
            return guide
        rows, columns = (g.op("Constant", value_t=area_matrix(n, m)) for n, m in zip(sizes_in, sizes_out))
        return g.op("MatMul", g.op("MatMul", rows, guide), g.op("Transpose", columns, perm_i=[1, 0]))
    rows = _dynamic_matrix(g, _axis_size(g, guide, 2), _axis_size(g, like, 2))
    columns = _dynamic_matrix(g, _axis_size(g, guide, 3), _axis_size(g, like, 3))
    return g.op("MatMul", g.op("MatMul", rows, guide), g.op("Transpose", columns, perm_i=[1, 0]))


def register_symbolics() -> None:
    """Registers the translation with the TorchScript-based exporter (at import of :mod:`timm_sortconv.onnx`)."""
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic("timm_sortconv::pool_to", _pool_to_symbolic, 1)
