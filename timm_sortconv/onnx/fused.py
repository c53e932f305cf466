"""SC layers exported as one node each, ``timm_sortconv::SortConv2d``, for runtimes that take a custom operator.

By default an exported SC layer is a few standard operators (:mod:`.portable`), which every ONNX runtime runs. Inside
:func:`.lowering.fused_export` (``timm_sortconv.onnx.export(..., fused=True)`` enters it) each sorting layer is
written instead as one node of the domain ``timm_sortconv``, which onnxruntime runs with the library of
:mod:`.runtime`: the fused CPU kernel of PyTorch's CPU backend, on onnxruntime's intra-op threads. The node:

* inputs ``X`` ``(N, C, H, W)``, ``W`` ``(O, C/group, k, k)`` (the layer's weight as it is, grid order), optional
  ``B`` ``(O,)``; output ``Y``; all float32;
* attributes: ``kernel_size``, ``strides``, ``dilations``, ``group``, ``pads`` (zeros, ``[top, left, bottom, right]``
  as ONNX ``Conv`` orders them), and the sampling geometry as :func:`~timm_sortconv.ops.geometry.get_geometry`
  computes it, which stays the only place it is computed: ``taps``, ``tap_offsets`` (per sample in slot order and
  tap, ``(dy, dx)`` from window pixel ``k // 2``), ``tap_weights``, ``segments`` (``[start, end)`` slot ranges sorted
  together), ``comparators`` (the sorting network's ``(lo, hi)`` pairs), ``slot_to_grid``; and ``sampling``,
  ``sorting`` for the reader.

Both exporters write it: the TorchScript-based one (``dynamo=False``) through a symbolic of the registered operator
``timm_sortconv::sort_conv2d`` (:func:`register_symbolics`, at import), the dynamo one through
:func:`translation_table`, an onnxscript translation of the same operator. Inside :func:`.lowering.fused_export` the
lowering records that operator, so that the exporter meets it.

What the node takes is what the kernel takes, in float32: any kernel size up to 15 (odd or even), stride, dilation,
groups, zero padding on each side (other padding modes are ``Pad`` nodes before it), bias or none, square and polar
sampling, the sortings ``ring``, ``global``, ``c4`` and ``c2``. Anything else is refused at export time with
:class:`FusedExportError`, naming the option and what is accepted. The aligned variants (``sorting="align"``,
``"align-channel"``) have no node: they export in standard operators as by default (their own kernel is not in the
library).

This module has no ``from __future__ import annotations``: the exporter reads the translation function's annotations
as objects.
"""
from typing import Dict, List, Optional, Sequence

import torch

from ..ops.geometry import ALIGNMENTS, SortGeometry, get_geometry

__all__ = ["DOMAIN", "FusedExportError", "OP_NAME", "OPSET", "check_fused", "drop_unread_constants", "fold_batch_norms",
           "node_attributes", "register_symbolics", "translation_table"]

DOMAIN = "timm_sortconv"
OP_NAME = "SortConv2d"
OPSET = 1
#: The largest kernel size of the CPU kernel (:data:`timm_sortconv.ops.cpu_backend.MAX_KERNEL_SIZE`).
MAX_KERNEL_SIZE = 15
#: The sortings the node computes; the aligned ones export in standard operators.
FUSED_SORTINGS = ("ring", "global", "c4", "c2")
ALIGNED_SORTINGS = tuple(ALIGNMENTS)
_TORCH_OP = "timm_sortconv::sort_conv2d"


class FusedExportError(ValueError):
    """An SC layer that the fused node cannot compute, found at export time."""


def check_fused(dtypes: Sequence[torch.dtype], kernel_size: Optional[int] = None,
                sorting: Optional[str] = None) -> None:
    """Raises :class:`FusedExportError` where the node cannot compute a layer of these tensor dtypes, kernel size
    and sorting (``None``: not checked)."""
    for found in dtypes:
        if found != torch.float32:
            raise FusedExportError(f"fused ONNX export: dtype={found}; the timm_sortconv::SortConv2d node computes "
                                   "torch.float32 only (export the model in float32, or without fused=True)")
    if kernel_size is not None and kernel_size > MAX_KERNEL_SIZE:
        raise FusedExportError(f"fused ONNX export: kernel_size={kernel_size}; the timm_sortconv::SortConv2d node "
                               f"takes 1 to {MAX_KERNEL_SIZE} (export without fused=True)")
    if sorting is not None and sorting not in FUSED_SORTINGS + ALIGNED_SORTINGS:
        raise FusedExportError(f"fused ONNX export: sorting={sorting!r}; the timm_sortconv::SortConv2d node takes "
                               f"{', '.join(map(repr, FUSED_SORTINGS))} (and {', '.join(map(repr, ALIGNED_SORTINGS))} "
                               "export in standard operators)")


def _float32(values: torch.Tensor) -> List[float]:
    """The tap weights as the float attribute stores them: float32, with no weight rounded to zero or from it
    (make_plan leaves zero weights out, so that would change the taps)."""
    rounded = values.to(torch.float32)
    if not torch.equal(rounded == 0, values == 0):
        raise FusedExportError("fused ONNX export: a tap weight of the geometry rounds to zero in float32")
    return rounded.reshape(-1).tolist()


def node_attributes(geometry: SortGeometry, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                    groups: int) -> Dict[str, object]:
    """The node's attributes (module docstring) for a layer of ``geometry`` with ``padding = [left, right, top,
    bottom]`` zeros."""
    comparators = geometry.comparators() or []
    return dict(
        kernel_size=geometry.kernel_size, strides=[int(stride[0]), int(stride[1])],
        dilations=[int(dilation[0]), int(dilation[1])], group=int(groups),
        pads=[int(padding[2]), int(padding[0]), int(padding[3]), int(padding[1])],
        taps=int(geometry.tap_offsets.shape[1]), tap_offsets=geometry.tap_offsets.reshape(-1).tolist(),
        tap_weights=_float32(geometry.tap_weights), segments=[int(v) for segment in geometry.segments for v in segment],
        comparators=[int(v) for pair in comparators for v in pair], slot_to_grid=geometry.slot_to_grid.tolist(),
        sampling=geometry.sampling, sorting=geometry.sorting)


def _suffixed(name: str, value) -> str:
    """``g.op``'s keyword for an attribute: its kind as a suffix (an empty list is ints: a network of no
    comparators)."""
    first = (value[0] if value else 0) if isinstance(value, list) else value
    return name + {int: "_i", float: "_f", str: "_s"}[type(first)]


def _symbolic(g, input, weight, bias, stride, padding, dilation, groups, sampling, sorting, backend):
    """The TorchScript-based exporter's translation of ``timm_sortconv::sort_conv2d``."""
    from torch.onnx import symbolic_helper

    sizes = symbolic_helper._get_tensor_sizes(weight)
    if not sizes or sizes[-1] is None:
        raise FusedExportError("fused ONNX export: the weight's kernel size is not known at export time")
    stride, padding, dilation = (symbolic_helper._get_const(value, "is", name) for value, name in
                                 ((stride, "stride"), (padding, "padding"), (dilation, "dilation")))
    groups = symbolic_helper._get_const(groups, "i", "groups")
    sampling, sorting = (symbolic_helper._get_const(value, "s", name) for value, name in
                         ((sampling, "sampling"), (sorting, "sorting")))
    attributes = node_attributes(get_geometry(int(sizes[-1]), sampling, sorting), stride, padding, dilation, groups)
    named = {_suffixed(name, value): value for name, value in attributes.items()}
    inputs = [input, weight] if symbolic_helper._is_none(bias) else [input, weight, bias]
    out = g.op(f"{DOMAIN}::{OP_NAME}", *inputs, **named)
    out.setType(input.type().with_sizes([None] * 4))
    return out


def register_symbolics() -> None:
    """Registers :func:`_symbolic` with the TorchScript-based exporter (the registered operator is recorded only
    inside :func:`.lowering.fused_export`, so this changes no other export)."""
    from torch.onnx import register_custom_op_symbolic

    register_custom_op_symbolic(_TORCH_OP, _symbolic, 1)


def _op_schema():
    """The node's ``onnx.defs.OpSchema``, which onnxscript's tracer needs to write a node of a custom domain."""
    from onnx import defs

    kind = defs.OpSchema.AttrType
    kinds = dict(kernel_size=kind.INT, strides=kind.INTS, dilations=kind.INTS, group=kind.INT, pads=kind.INTS,
                 taps=kind.INT, tap_offsets=kind.INTS, tap_weights=kind.FLOATS, segments=kind.INTS,
                 comparators=kind.INTS, slot_to_grid=kind.INTS, sampling=kind.STRING, sorting=kind.STRING)
    parameter = defs.OpSchema.FormalParameter
    return defs.OpSchema(
        OP_NAME, DOMAIN, OPSET, "Sorting Convolution (timm_sortconv): one SC layer's forward",
        inputs=[parameter("X", "T"), parameter("W", "T"),
                parameter("B", "T", param_option=defs.OpSchema.FormalParameterOption.Optional)],
        outputs=[parameter("Y", "T")], type_constraints=[("T", ["tensor(float)"], "float32")],
        attributes=[defs.OpSchema.Attribute(name, value, "") for name, value in kinds.items()])


def translation_table() -> Dict[object, object]:
    """The dynamo exporter's ``custom_translation_table`` that writes ``timm_sortconv::sort_conv2d`` as the node."""
    import onnxscript
    from onnxscript.values import Op, Opset

    node = Op(Opset(DOMAIN, OPSET), OP_NAME, _op_schema())

    def sort_conv2d(input: onnxscript.FLOAT, weight: onnxscript.FLOAT, bias: Optional[onnxscript.FLOAT] = None,
                    stride: Sequence[int] = (1, 1), padding: Sequence[int] = (0, 0, 0, 0),
                    dilation: Sequence[int] = (1, 1), groups: int = 1, sampling: str = "polar",
                    sorting: str = "ring", backend: str = "auto") -> onnxscript.FLOAT:
        kernel_size = weight.shape[-1] if weight.shape is not None else None
        if not isinstance(kernel_size, int):
            raise FusedExportError("fused ONNX export: the weight's kernel size is not known at export time")
        attributes = node_attributes(get_geometry(kernel_size, sampling, sorting), stride, padding, dilation, groups)
        return node(input, weight, bias, **attributes) if bias is not None else node(input, weight, **attributes)

    return {torch.ops.timm_sortconv.sort_conv2d.default: sort_conv2d}


def _names_read(graph) -> Dict[str, int]:
    """How many times each value name is read in ``graph``, its subgraphs (which read outer names too) and its
    outputs."""
    counts: Dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            counts[name] = counts.get(name, 0) + 1
        for attribute in node.attribute:
            for subgraph in list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else []):
                for name, count in _names_read(subgraph).items():
                    counts[name] = counts.get(name, 0) + count
    for output in graph.output:
        counts[output.name] = counts.get(output.name, 0) + 1
    return counts


def fold_batch_norms(model) -> int:
    """Folds each ``BatchNormalization`` (inference form, constant parameters) that alone reads a fused node's
    output into that node's weight and bias, in place in ``model`` (an ``onnx.ModelProto``), as the exporters fold
    one into a convolution: the node is linear in its weight for fixed sorted windows, so ``BN(W * s + b)`` is
    ``W' * s + b'`` with ``W' = W * g``, ``b' = (b - mean) * g + beta``, ``g = scale / sqrt(var + eps)``. Returns the
    number folded."""
    import numpy as np
    from onnx import numpy_helper

    graph = model.graph
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    reads = _names_read(graph)
    readers: Dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    folded, removed = 0, []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != OP_NAME:
            continue
        users = readers.get(node.output[0], [])
        if len(users) != 1 or reads.get(node.output[0]) != 1 or users[0].op_type != "BatchNormalization":
            continue
        norm = users[0]
        attributes = {a.name: a for a in norm.attribute}
        if len(norm.output) != 1 or ("training_mode" in attributes and attributes["training_mode"].i != 0):
            continue
        parameters = list(norm.input[1:5])
        weight_name = node.input[1]
        bias_name = node.input[2] if len(node.input) > 2 and node.input[2] else None
        owned = [weight_name] + ([bias_name] if bias_name else [])
        if not all(name in initializers for name in parameters + owned) or any(reads[n] != 1 for n in owned):
            continue
        scale, beta, mean, var = (numpy_helper.to_array(initializers[n]).astype(np.float64) for n in parameters)
        epsilon = attributes["epsilon"].f if "epsilon" in attributes else 1e-5
        gain = scale / np.sqrt(var + epsilon)
        weight = numpy_helper.to_array(initializers[weight_name]).astype(np.float64)
        bias = numpy_helper.to_array(initializers[bias_name]).astype(np.float64) if bias_name else 0.0
        new_weight = (weight * gain[:, None, None, None]).astype(np.float32)
        new_bias = ((bias - mean) * gain + beta).astype(np.float32)
        initializers[weight_name].CopyFrom(numpy_helper.from_array(new_weight, weight_name))
        if bias_name is None:
            bias_name = f"{node.output[0]}_folded_bias"
            graph.initializer.append(numpy_helper.from_array(new_bias, bias_name))
            while len(node.input) < 3:
                node.input.append("")
            node.input[2] = bias_name
        else:
            initializers[bias_name].CopyFrom(numpy_helper.from_array(new_bias, bias_name))
        node.output[0] = norm.output[0]
        removed.append(norm)
        folded += 1
    for norm in removed:
        graph.node.remove(norm)
    if removed:  # the normalisations' parameters, where nothing else reads them
        reads = _names_read(graph)
        unread = [tensor for tensor in graph.initializer if reads.get(tensor.name, 0) == 0]
        for tensor in unread:
            graph.initializer.remove(tensor)
    return folded


def drop_unread_constants(model) -> int:
    """Removes the ``Constant`` nodes of ``model``'s graph whose values nothing reads (the TorchScript-based exporter
    leaves the fused node's list arguments behind as such, which the node takes as attributes); returns how many."""
    graph = model.graph
    dropped = 0
    while True:
        reads = _names_read(graph)
        unread = [node for node in graph.node if node.op_type == "Constant" and node.domain in ("", "ai.onnx")
                  and not any(reads.get(name, 0) for name in node.output)]
        if not unread:
            return dropped
        for node in unread:
            graph.node.remove(node)
        dropped += len(unread)
