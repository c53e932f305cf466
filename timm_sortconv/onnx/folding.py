"""Folding what an exported graph's static sizes decide: :func:`fold_static_sizes`.

The TorchScript-based exporter records every size a model reads from a tensor (``x.shape[-1]``, the canonical
turn's sampling grid, the orientation guide's ramp and pooling, a centring's residue) as ``Shape`` nodes and the
arithmetic on them, because a traced size may be a dynamic axis. With a dynamic batch and a fixed height and width
(:func:`timm_sortconv.onnx.export`'s default) most of that arithmetic reads only the height and width, so its values
are the same at every call; the runtime would still compute them at every call (``scnn_p_align_7_guided_canon``:
about 700 such nodes of 766, each one a call of the runtime's thread pool). The pass walks the graph once in order,
keeping each value's type (ONNX shape inference, node by node, with the known values as data) and, where known, its
value: a ``Shape`` whose dimensions are known, or the parts of one that a ``Gather`` or ``Slice`` reads, and any
standard node all of whose inputs are known (evaluated with ``onnx.reference``). The known values computed from a
size become ``Constant`` nodes, and what then reads nothing is removed; nothing that depends on the batch or on the
input's values is folded, and what the exporter left of the weights' arithmetic stays as it is (a runtime folds that
once, when it loads the file).

:func:`merge_repeats` then keeps one of the nodes that compute the same thing: a guided model pools its guide to a
size once per layer of that size, and casts it to the layer's dtype, which it already has (the trace records the
call of every layer). Each such node costs a runtime a call of its own at every run.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .fused import _attributes, _subgraphs

__all__ = ["fold_static_sizes", "merge_repeats", "value_dims"]

# Values with more elements stay computed (a folded value is stored in the file): 2 MiB of float32.
_LARGEST = 1 << 19
_RANDOM = {"Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike"}
_STANDARD = ("", "ai.onnx")


def _opaque(node) -> bool:
    """Whether what ``node`` computes is more than its inputs and attributes say: a node with a subgraph, or a random
    one. Such a node is neither folded nor merged."""
    return node.op_type in _RANDOM or bool(_subgraphs(node))


def _dims(value_type) -> Optional[List[Optional[int]]]:
    """A tensor type's dimensions (``None`` where not known), or ``None`` where its rank is not known."""
    tensor = value_type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]


def _tensor_type(dtype: int, dims):
    from onnx import helper

    return helper.make_tensor_type_proto(dtype, dims)


def _fused_output_dims(node, input_dims, weight_dims) -> Optional[List[Optional[int]]]:
    """The dimensions of a ``timm_sortconv::SortConv2d`` node's output (:func:`.fused.output_size`; a centring
    inside the node keeps them)."""
    from .fused import output_size

    if input_dims is None or weight_dims is None or len(input_dims) != 4:
        return None
    a = _attributes(node)
    k, strides, dilations = a["kernel_size"], a.get("strides", [1, 1]), a.get("dilations", [1, 1])
    pads = a.get("pads", [0, 0, 0, 0])
    return [input_dims[0], weight_dims[0],
            output_size(input_dims[2], k, strides[0], pads[0] + pads[2], dilations[0]),
            output_size(input_dims[3], k, strides[1], pads[1] + pads[3], dilations[1])]


def _package_node_dims(node, types) -> Optional[List[Optional[int]]]:
    """The output dimensions of one of the package's nodes (``None``: not known). A ``CentreGrid`` whose input's
    height and width are known gets them as its ``sizes`` (:mod:`.centring`: the traced size), so that
    :func:`.functions.expand_centring` writes it for that size."""
    from onnx import helper

    from ..grid import centre_grid_residues
    from .fused import CENTRE_OP, DOMAIN, OP_NAME

    if node.domain != DOMAIN or node.input[0] not in types:
        return None
    dims = _dims(types[node.input[0]])
    if node.op_type == OP_NAME and node.input[1] in types:
        return _fused_output_dims(node, dims, _dims(types[node.input[1]]))
    if node.op_type != CENTRE_OP or dims is None or len(dims) < 2 or None in dims[-2:]:
        return None
    a = _attributes(node)
    residues = centre_grid_residues(dims[-2], dims[-1], list(a["kernel_size"]), list(a["strides"]), list(a["pads"]),
                                    list(a["dilations"]), int(a["min_size"]))
    if list(a["sizes"]) != dims[-2:]:
        del node.attribute[[attribute.name for attribute in node.attribute].index("sizes")]
        node.attribute.append(helper.make_attribute("sizes", dims[-2:]))
    return dims[:-2] + [dims[-2] - residues[0], dims[-1] - residues[1]]


def _evaluate(node, values: Dict[str, np.ndarray]) -> Optional[List[np.ndarray]]:
    from onnx.reference import ReferenceEvaluator

    try:
        results = ReferenceEvaluator(node).run(None, {name: values[name] for name in node.input if name})
    except Exception:  # an operator the reference does not implement: the node stays
        return None
    results = [np.asarray(result) for result in results]
    return None if any(result.size > _LARGEST for result in results) else results


def _partial(node, values, parts) -> Optional[Tuple[List[Optional[int]], bool]]:
    """The entries of a 1-D integer value that a ``Gather`` (axis 0) or ``Slice`` (axis 0, step 1) reads from a
    partly known one (``parts``: a ``Shape``'s dimensions, ``None`` where not known), and whether the result is a
    scalar (a ``Gather`` of a scalar index); ``None`` where the node is not such a read."""
    source = parts.get(node.input[0])
    if source is None:
        return None
    if node.op_type == "Gather":
        axis = _attributes(node).get("axis", 0)
        index = values.get(node.input[1])
        if axis != 0 or index is None or index.ndim > 1:
            return None
        return [source[int(i)] for i in np.atleast_1d(index)], index.ndim == 0
    if node.op_type == "Slice" and len(node.input) >= 3:
        starts, ends = values.get(node.input[1]), values.get(node.input[2])
        axes = values.get(node.input[3]) if len(node.input) > 3 and node.input[3] else np.array([0])
        steps = values.get(node.input[4]) if len(node.input) > 4 and node.input[4] else np.array([1])
        if any(v is None for v in (starts, ends, axes, steps)) or axes.tolist() not in ([0], [-1]) or \
                steps.tolist() != [1]:
            return None
        return source[int(starts[0]):int(min(ends[0], len(source)))], False
    return None


def _walk(model) -> Tuple[Dict[str, object], Dict[int, List[np.ndarray]]]:
    """The graph of ``model`` walked once in order (the module docstring): each value's type where known, and the
    results of the nodes to fold, by position."""
    from onnx import defs, helper, numpy_helper
    from onnx.shape_inference import infer_node_outputs

    graph = model.graph
    opset = {o.domain: o.version for o in model.opset_import}
    types = {v.name: v.type for v in graph.input}
    values: Dict[str, np.ndarray] = {}
    for tensor in graph.initializer:
        values[tensor.name] = numpy_helper.to_array(tensor)
        types[tensor.name] = _tensor_type(tensor.data_type, list(tensor.dims))
    parts: Dict[str, List[Optional[int]]] = {}  # 1-D int64 values known in part
    # The known values computed from a size (a Shape): those are folded. The others (a weight's transpose, a
    # constant's cast) are known for the evaluation of what reads them but left as the exporter wrote them.
    sized = set()
    folded = {}
    for position, node in enumerate(graph.node):
        standard = node.domain in _STANDARD
        results = None
        if not standard:
            dims = _package_node_dims(node, types)
            if dims is not None:
                types[node.output[0]] = _tensor_type(types[node.input[0]].tensor_type.elem_type, dims)
            continue
        if _opaque(node):
            results = None
        elif node.op_type == "Shape" and node.input[0] in types:
            dims = _dims(types[node.input[0]])
            if dims is not None:
                a = _attributes(node)
                dims = dims[a.get("start", 0):a.get("end", len(dims))]
                if all(d is not None for d in dims):
                    results = [np.array(dims, dtype=np.int64)]
                else:
                    parts[node.output[0]] = dims
        elif node.op_type in ("Gather", "Slice") and node.input[0] in parts:
            read = _partial(node, values, parts)
            if read is not None:
                picked, scalar = read
                if all(d is not None for d in picked):
                    results = [np.array(picked[0] if scalar else picked, dtype=np.int64)]
                elif not scalar:
                    parts[node.output[0]] = picked
        elif node.op_type == "Constant" or all(name in values for name in node.input if name):
            results = _evaluate(node, values)
        if node.op_type == "Shape" or any(name in sized for name in node.input):
            sized.update(name for name in node.output if name)
        if results is not None:
            for name, result in zip(node.output, results):
                values[name] = result
                types[name] = _tensor_type(helper.np_dtype_to_tensor_dtype(result.dtype), list(result.shape))
            if node.op_type != "Constant" and node.output[0] in sized:
                folded[position] = results
            continue
        try:
            schema = defs.get_schema(node.op_type, opset.get(node.domain, opset.get("", 1)), node.domain)
            known_types = {name: types[name] for name in node.input if name in types}
            data = {name: numpy_helper.from_array(values[name], name) for name in node.input if name in values}
            types.update(infer_node_outputs(schema, node, known_types, data, opset_imports=list(model.opset_import)))
        except Exception:  # types not inferred: what reads this node's outputs is not folded
            pass
    return types, folded


def value_dims(model) -> Dict[str, Optional[List[Optional[int]]]]:
    """The dimensions of the values of ``model``'s graph (an ``onnx.ModelProto`` whose nodes are in order) where
    known (``None`` for a dimension not known, or for a value whose rank is not), the package's nodes included."""
    types, _ = _walk(model)
    return {name: _dims(value_type) for name, value_type in types.items()}


def fold_static_sizes(model) -> int:
    """Replaces by constants, in place in ``model`` (an ``onnx.ModelProto`` whose nodes are in order), the values of
    its graph that its inputs' known sizes decide (the module docstring), and removes the nodes then unread; returns
    the number of nodes folded."""
    from onnx import helper, numpy_helper

    graph = model.graph
    _, folded = _walk(model)
    if not folded:
        return 0
    nodes = []
    for position, node in enumerate(graph.node):
        if position not in folded:
            nodes.append(node)
            continue
        for name, result in zip(node.output, folded[position]):
            if name:
                nodes.append(helper.make_node("Constant", [], [name], name=f"{name}_folded",
                                              value=numpy_helper.from_array(result, name)))
    del graph.node[:]
    graph.node.extend(nodes)
    _drop_unread(graph)
    return len(folded)


def _drop_unread(graph) -> None:
    """Removes the standard nodes none of whose outputs is read (by a node, a subgraph or the graph's outputs)."""
    from .fused import _names_read

    while True:
        reads = _names_read(graph)
        unread = [node for node in graph.node if node.domain in _STANDARD and node.op_type not in _RANDOM
                  and not any(reads.get(name, 0) for name in node.output)]
        if not unread:
            return
        for node in unread:
            graph.node.remove(node)


def _node_key(node, names: Dict[str, str]) -> Optional[tuple]:
    """What ``node`` computes, with its inputs under the names they were merged to: its domain, type, inputs and
    attributes (a tensor's by value, without its name); ``None`` for an :func:`_opaque` node."""
    from onnx import helper

    if _opaque(node):
        return None
    attributes = []
    for attribute in sorted(node.attribute, key=lambda a: a.name):
        copy = helper.AttributeProto()
        copy.CopyFrom(attribute)
        copy.t.ClearField("name")
        for tensor in copy.tensors:
            tensor.ClearField("name")
        attributes.append(copy.SerializeToString(deterministic=True))
    return (node.domain, node.op_type, tuple(names.get(name, name) for name in node.input), tuple(attributes))


def merge_repeats(model) -> int:
    """Keeps, in place in ``model`` (an ``onnx.ModelProto`` whose nodes are in order), the first of the standard
    nodes that compute the same thing (same type, attributes and inputs, constants compared by value), and drops
    every ``Cast`` to the type its input has; what read a dropped node's outputs reads the kept ones. A node whose
    output is a graph output stays. Returns the number of nodes dropped."""
    graph = model.graph
    types, _ = _walk(model)
    outputs = {output.name for output in graph.output}
    names: Dict[str, str] = {}  # a dropped node's output -> the value that replaces it
    first: Dict[tuple, object] = {}
    kept = []
    for node in graph.node:
        standard = node.domain in _STANDARD
        if standard and not outputs.intersection(node.output):
            if node.op_type == "Cast" and node.input[0] in types:
                source = types[node.input[0]].tensor_type.elem_type
                if source and source == _attributes(node).get("to"):
                    names[node.output[0]] = names.get(node.input[0], node.input[0])
                    continue
            key = _node_key(node, names)
            if key is not None and key in first:
                for name, kept_name in zip(node.output, first[key].output):
                    if name:
                        names[name] = kept_name
                continue
            if key is not None:
                first[key] = node
        kept.append(node)
    if not names:
        return 0
    dropped = len(graph.node) - len(kept)
    del graph.node[:]
    graph.node.extend(kept)
    _rename_reads(graph, names)
    for info in [info for info in graph.value_info if info.name in names]:
        graph.value_info.remove(info)
    return dropped


def _rename_reads(graph, names: Dict[str, str]) -> None:
    """Every read of a name in ``names`` by a node of ``graph`` or of its subgraphs becomes a read of its value."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in names:
                node.input[i] = names[name]
        for subgraph in _subgraphs(node):
            _rename_reads(subgraph, names)
