"""SC layers exported as one node each, ``timm_sortconv::SortConv2d``, for runtimes that take a custom operator.

By default an exported SC layer is a few standard operators (:mod:`.portable`), which every ONNX runtime runs. Inside
:func:`.lowering.fused_export` (``timm_sortconv.onnx.export(..., fused=True)`` enters it) each sorting layer is
written instead as one node of the domain ``timm_sortconv``, which onnxruntime runs with the library of
:mod:`.runtime`: the fused CPU kernel of PyTorch's CPU backend, on onnxruntime's intra-op threads. The node:

* inputs ``X`` ``(N, C, H, W)``, ``W`` ``(O, C/group, k, k)`` (the layer's weight as it is, grid order), optional
  ``B`` ``(O,)`` and ``S`` (like ``Y``: added to it before the activation, where a residual ``Add`` is merged,
  :func:`fuse_residuals`); output ``Y``; all float32;
* attributes: ``kernel_size``, ``strides``, ``dilations``, ``group``, ``pads`` (zeros, ``[top, left, bottom, right]``
  as ONNX ``Conv`` orders them), and the sampling geometry as :func:`~timm_sortconv.ops.geometry.get_geometry`
  computes it, which stays the only place it is computed: ``taps``, ``tap_offsets`` (per sample in slot order and
  tap, ``(dy, dx)`` from window pixel ``k // 2``), ``tap_weights``, ``segments`` (``[start, end)`` slot ranges sorted
  together), ``comparators`` (the sorting network's ``(lo, hi)`` pairs), ``slot_to_grid``; and ``sampling``,
  ``sorting`` for the reader; the aligned variants' tables besides (:func:`node_attributes`); ``centre`` and
  ``centre_min_size`` where a strided grid's centring is merged into the node (:func:`merge_centring`); ``activation``
  ``"Relu"`` where a ReLU that alone read the node's output is (:func:`fuse_activations`).

Both exporters write it: the TorchScript-based one (``dynamo=False``) through a symbolic of the registered operator
``timm_sortconv::sort_conv2d`` (:func:`register_symbolics`, at import), the dynamo one through
:func:`translation_table`, an onnxscript translation of the same operator. Inside :func:`.lowering.fused_export` the
lowering records that operator, so that the exporter meets it.

What the node takes is what the kernel takes, in float32: any kernel size up to 15 (odd or even), stride, dilation,
groups, zero padding on each side (other padding modes are ``Pad`` nodes before it), bias or none, square and polar
sampling, the sortings ``ring``, ``global``, ``c4`` and ``c2``, and the aligned variants (``align`` with or without
a guide channel, ``align-channel``), which the library runs with the aligned kernel. Anything else is refused at
export time with :class:`FusedExportError`, naming the option and what is accepted.

This module has no ``from __future__ import annotations``: the exporter reads the translation function's annotations
as objects.
"""
from typing import Dict, List, Optional, Sequence

import torch

from ..ops.cpu_backend import align_kernel_tables
from ..ops.geometry import ALIGNMENTS, SortGeometry, get_geometry

__all__ = ["ACTIVATIONS", "CENTRE_OP", "DOMAIN", "FusedExportError", "OP_NAME", "OPSET", "check_fused",
           "drop_unread_constants", "fold_batch_norms", "fuse_activations", "fuse_residuals", "merge_centring",
           "node_attributes", "output_size", "register_symbolics", "translation_table"]

DOMAIN = "timm_sortconv"
OP_NAME = "SortConv2d"
OPSET = 1
#: The largest kernel size of the CPU kernel (:data:`timm_sortconv.ops.cpu_backend.MAX_KERNEL_SIZE`).
MAX_KERNEL_SIZE = 15
#: The sortings the node computes (the aligned ones with the aligned kernel).
FUSED_SORTINGS = ("ring", "global", "c4", "c2") + tuple(ALIGNMENTS)
_TORCH_OP = "timm_sortconv::sort_conv2d"
#: The node's ``activation`` values: none, or the output rectified as it is stored (:func:`fuse_activations`).
ACTIVATIONS = ("", "Relu")
#: The node that :mod:`.centring` writes inside :func:`.lowering.fused_export` for a centred grid: merged into the
#: SortConv2d node that alone reads it (:func:`merge_centring`), otherwise expanded into standard operators
#: (:func:`.functions.expand_centring`).
CENTRE_OP = "CentreGrid"


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
    if sorting is not None and sorting not in FUSED_SORTINGS:
        raise FusedExportError(f"fused ONNX export: sorting={sorting!r}; the timm_sortconv::SortConv2d node takes "
                               f"{', '.join(map(repr, FUSED_SORTINGS))}")


def _float32(values: torch.Tensor) -> List[float]:
    """The tap weights as the float attribute stores them: float32, with no weight rounded to zero or from it
    (make_plan leaves zero weights out, so that would change the taps)."""
    rounded = values.to(torch.float32)
    if not torch.equal(rounded == 0, values == 0):
        raise FusedExportError("fused ONNX export: a tap weight of the geometry rounds to zero in float32")
    return rounded.reshape(-1).tolist()


def node_attributes(geometry: SortGeometry, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
                    groups: int, guides: int = 0) -> Dict[str, object]:
    """The node's attributes (module docstring) for a layer of ``geometry`` with ``padding = [left, right, top,
    bottom]`` zeros and ``guides`` guide channels a group (aligned layers only)."""
    comparators = [] if geometry.sorting in ALIGNMENTS else geometry.comparators() or []
    attributes = dict(
        kernel_size=geometry.kernel_size, strides=[int(stride[0]), int(stride[1])],
        dilations=[int(dilation[0]), int(dilation[1])], group=int(groups),
        pads=[int(padding[2]), int(padding[0]), int(padding[3]), int(padding[1])],
        taps=int(geometry.tap_offsets.shape[1]), tap_offsets=geometry.tap_offsets.reshape(-1).tolist(),
        tap_weights=_float32(geometry.tap_weights), segments=[int(v) for segment in geometry.segments for v in segment],
        comparators=[int(v) for pair in comparators for v in pair], slot_to_grid=geometry.slot_to_grid.tolist(),
        sampling=geometry.sampling, sorting=geometry.sorting)
    if geometry.sorting in ALIGNMENTS:
        tables = align_kernel_tables(geometry)
        attributes.update(guides=int(guides), shared=int(bool(tables["shared"])), relative=float(tables["relative"]),
                          tiny=float(tables["tiny"]))
        for name in ("fold", "dft", "first", "energy_pairs", "energy_fixed", "weight_scale", "guide_first"):
            attributes[name] = tables[name].to(torch.float64).reshape(-1).tolist()
        for name in ("blocks", "pairs", "fixed"):
            attributes[name] = [int(v) for v in tables[name].reshape(-1).tolist()]
    elif guides:
        raise FusedExportError("fused ONNX export: guide channels need sorting='align'")
    return attributes


def output_size(size: Optional[int], kernel_size: int, stride: int, pad: int, dilation: int) -> Optional[int]:
    """The node's output size along an axis of ``size`` (``None``: not known) with ``pad`` zeros in all."""
    if size is None:
        return None
    return (size + pad - dilation * (kernel_size - 1) - 1) // stride + 1


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
    shape = symbolic_helper._get_tensor_sizes(input) or [None] * 4
    if sorting == "align" and shape[1] is None:
        raise FusedExportError("fused ONNX export: an aligned layer's input channels are not known at export time, "
                               "so whether it carries a guide channel is not either; export without fused=True")
    guides = 1 if sorting == "align" and shape[1] == (int(sizes[1]) + 1) * groups else 0
    attributes = node_attributes(get_geometry(int(sizes[-1]), sampling, sorting), stride, padding, dilation, groups,
                                 guides)
    named = {_suffixed(name, value): value for name, value in attributes.items()}
    inputs = [input, weight] if symbolic_helper._is_none(bias) else [input, weight, bias]
    out = g.op(f"{DOMAIN}::{OP_NAME}", *inputs, **named)
    k = int(sizes[-1])  # the output's sizes where the input's are known: the exporter's inference goes on after it
    out.setType(input.type().with_sizes([shape[0], int(sizes[0])] + [
        output_size(shape[2 + axis], k, stride[axis], padding[2 - 2 * axis] + padding[3 - 2 * axis], dilation[axis])
        for axis in range(2)]))
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
                 comparators=kind.INTS, slot_to_grid=kind.INTS, sampling=kind.STRING, sorting=kind.STRING,
                 guides=kind.INT, shared=kind.INT, relative=kind.FLOAT, tiny=kind.FLOAT, fold=kind.FLOATS,
                 dft=kind.FLOATS, blocks=kind.INTS, pairs=kind.INTS, fixed=kind.INTS, first=kind.FLOATS,
                 energy_pairs=kind.FLOATS, energy_fixed=kind.FLOATS, weight_scale=kind.FLOATS,
                 guide_first=kind.FLOATS, centre=kind.INT, centre_min_size=kind.INT, activation=kind.STRING)
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
        channels = input.shape[1] if input.shape is not None else None
        guides = 1 if sorting == "align" and channels == (weight.shape[1] + 1) * groups else 0
        attributes = node_attributes(get_geometry(kernel_size, sampling, sorting), stride, padding, dilation, groups,
                                     guides)
        return node(input, weight, bias, **attributes) if bias is not None else node(input, weight, **attributes)

    return {torch.ops.timm_sortconv.sort_conv2d.default: sort_conv2d}


def _attributes(node) -> Dict[str, object]:
    """An ONNX node's attributes by name, as values (``onnx.helper.get_attribute_value``)."""
    from onnx import helper

    return {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}


def _subgraphs(node) -> List[object]:
    """The graphs that ``node``'s attributes hold (an ``If``'s branches, a ``Loop``'s body)."""
    return [g for attribute in node.attribute
            for g in list(attribute.graphs) + ([attribute.g] if attribute.HasField("g") else [])]


def _names_read(graph) -> Dict[str, int]:
    """How many times each value name is read in ``graph``, its subgraphs (which read outer names too) and its
    outputs."""
    counts: Dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            counts[name] = counts.get(name, 0) + 1
        for subgraph in _subgraphs(node):
            for name, count in _names_read(subgraph).items():
                counts[name] = counts.get(name, 0) + count
    for output in graph.output:
        counts[output.name] = counts.get(output.name, 0) + 1
    return counts


def _sole_readers(graph) -> Dict[str, object]:
    """The value names of ``graph`` that one node reads, once, and nothing else (no subgraph, no graph output),
    each with that node."""
    readers: Dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    reads = _names_read(graph)
    return {name: nodes[0] for name, nodes in readers.items() if len(nodes) == 1 and reads.get(name) == 1}


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
    sole = _sole_readers(graph)
    aliases = {node.output[0]: node.input[0] for node in graph.node
               if node.op_type == "Identity" and node.input[0] in initializers}
    folded, removed = 0, []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != OP_NAME:
            continue
        norm = sole.get(node.output[0])
        if norm is None or norm.op_type != "BatchNormalization":
            continue
        attributes = {a.name: a for a in norm.attribute}
        if len(norm.output) != 1 or ("training_mode" in attributes and attributes["training_mode"].i != 0):
            continue
        # (the exporter writes a parameter equal to another as an Identity of it)
        parameters = [aliases.get(name, name) for name in norm.input[1:5]]
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


def fuse_activations(model) -> int:
    """Merges each ``Relu`` that alone reads a fused node's output (not a graph output) into that node, in place in
    ``model`` (an ``onnx.ModelProto``): the node's ``activation`` becomes ``"Relu"`` and the library rectifies each
    output as it stores it, where a separate node would pass over the whole output again (and, at batch 1, cost
    onnxruntime a dispatch on its threads per layer), as onnxruntime fuses a ``Relu`` into its own ``Conv``. The
    node's standard-operator form (:mod:`.functions`) ends in the same ``Relu``. Returns the number merged."""
    from onnx import helper

    graph = model.graph
    sole = _sole_readers(graph)
    merged = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != OP_NAME:
            continue
        if any(a.name == "activation" and a.s for a in node.attribute):
            continue
        relu = sole.get(node.output[0])
        if relu is None or relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
            continue
        node.output[0] = relu.output[0]
        kept = [a for a in node.attribute if a.name != "activation"]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute("activation", "Relu")])
        merged.append(relu)
    for relu in merged:
        graph.node.remove(relu)
    return len(merged)


def fuse_residuals(model) -> int:
    """Merges each ``Add`` that alone reads a fused node's output (the node with no activation yet) and adds to it a
    value of the same shape (a residual block's shortcut, not a broadcast) into that node, in place in ``model`` (an
    ``onnx.ModelProto`` whose nodes are in order): the other operand becomes the node's fourth input ``S``, which the
    library adds to each output tile before the activation, as onnxruntime fuses a residual ``Add`` into its own
    ``Conv``; a zero ``B`` is given to a node without one. The node's standard-operator form (:mod:`.functions`) adds
    ``S`` too. The node moves to the Add's place, so the nodes stay in order where the shortcut is made after the
    node (a downsampling convolution, as in timm's ``BasicBlock``). A ``Relu`` that then alone reads the node's output
    :func:`fuse_activations` merges. Returns the number merged."""
    import numpy as np
    from onnx import numpy_helper

    from .folding import value_dims

    graph = model.graph
    sole = _sole_readers(graph)
    weights = {tensor.name: tensor for tensor in graph.initializer}
    candidates = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != OP_NAME or len(node.input) > 3:
            continue
        if any(a.name == "activation" and a.s for a in node.attribute):
            continue
        add = sole.get(node.output[0])
        if add is None or add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
            continue
        other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        if other != node.output[0] and node.input[1] in weights:
            candidates.append((node, add, other))
    if not candidates:  # (the shapes need a walk over the whole graph: only where an Add may be merged)
        return 0
    dims = value_dims(model)
    merged = []
    for node, add, other in candidates:
        ours, theirs = dims.get(node.output[0]), dims.get(other)
        if ours is None or ours != theirs or len(ours) != 4 or None in ours[1:]:
            continue
        if len(node.input) < 3 or not node.input[2]:
            bias = numpy_helper.from_array(np.zeros(weights[node.input[1]].dims[0], dtype=np.float32),
                                           f"{add.output[0]}_zero_bias")
            graph.initializer.append(bias)
            del node.input[2:]
            node.input.append(bias.name)
        node.input.append(other)
        node.output[0] = add.output[0]
        merged.append(node)
    # ONNX requires each input made before the node that reads it (onnx.checker and tools other than onnxruntime
    # refuse the file otherwise). Only the Add read the node's output, so nothing between the two needs it; both now
    # write the Add's output, which no other node writes.
    at_add = {node.output[0]: node for node in merged}
    nodes = [at_add.get(n.output[0], n) if n.op_type == "Add" else n for n in graph.node
             if not (n.domain == DOMAIN and n.output and n.output[0] in at_add)]
    del graph.node[:]
    graph.node.extend(nodes)
    return len(merged)


def merge_centring(model) -> int:
    """Moves each ``CentreGrid`` node whose output only a ``SortConv2d`` node reads, with the same kernel, stride,
    padding and dilation, into that node (its ``centre`` and ``centre_min_size`` attributes: the library centres
    the input itself, and the layer's standard-operator form does too, :mod:`.functions`), in place; returns the
    number merged. What is left (a centred pooling or plain convolution) :func:`.functions.expand_centring` writes
    in standard operators."""
    from onnx import helper

    graph = model.graph
    sole = _sole_readers(graph)
    merged = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != CENTRE_OP:
            continue
        user = sole.get(node.output[0])
        if user is None or user.domain != DOMAIN or user.op_type != OP_NAME or user.input[0] != node.output[0]:
            continue
        centre, layer = _attributes(node), _attributes(user)
        same = (list(centre["kernel_size"]) == [layer["kernel_size"]] * 2
                and list(centre["strides"]) == list(layer["strides"])
                and list(centre["dilations"]) == list(layer["dilations"])
                and list(centre["pads"]) == list(layer["pads"][:2]))
        if not same:
            continue
        user.input[0] = node.input[0]
        user.attribute.extend([helper.make_attribute("centre", 1),
                               helper.make_attribute("centre_min_size", int(centre["min_size"]))])
        merged.append(node)
    for node in merged:
        graph.node.remove(node)
    return len(merged)


def drop_unread_constants(model) -> int:
    """Removes the ``Constant`` and ``Identity`` nodes and the initializers of ``model``'s graph whose values nothing
    reads (the TorchScript-based exporter leaves the fused node's list arguments behind as constants, which the node
    takes as attributes, and a folded normalisation's parameters, one an ``Identity`` of another where they were
    equal); returns how many nodes."""
    graph = model.graph
    dropped = 0
    while True:
        reads = _names_read(graph)
        unread = [node for node in graph.node if node.op_type in ("Constant", "Identity")
                  and node.domain in ("", "ai.onnx") and not any(reads.get(name, 0) for name in node.output)]
        if not unread:
            for tensor in [t for t in graph.initializer if reads.get(t.name, 0) == 0]:
                graph.initializer.remove(tensor)
            return dropped
        for node in unread:
            graph.node.remove(node)
        dropped += len(unread)
