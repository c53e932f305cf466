"""One file for every runtime: each fused node carries its standard-operator form as a model-local ONNX function.

A ``timm_sortconv::SortConv2d`` node (:mod:`.fused`) runs where the package's library is registered. So that the
same file also runs where it is not, :func:`attach_functions` gives the model one function per distinct layer
configuration, of the node's domain and name, told apart by the function's ``overload`` (the node names the same
one): its body is the layer in standard operators, written by the same lowering as a plain export (:mod:`.lowering`)
for any batch, height and width, with the node's inputs ``X``, ``W``, ``B`` and ``S`` where it has them (the weight and
bias are inputs of the body, so a batch normalisation folded into the node's initializers holds for the body too). onnxruntime then runs
the package's kernel where the library is registered and inlines the function where it is not (from onnxruntime
1.27: :data:`STOCK_INLINING_ONNXRUNTIME`). A runtime that does not inline model-local functions (OpenVINO) takes the
file :func:`inline_functions` writes: every function expanded in place, standard operators only, with the sorting
written for that runtime (:data:`.portable.OPENVINO`, a ``TopK`` per ring, which OpenVINO runs faster than a min/max
network, and onnxruntime slower).
"""
from __future__ import annotations

import hashlib
import io
import warnings
from typing import Dict, List

import torch
import torch.nn as nn

from ..grid import centre_grid
from ..ops.alignment import align_conv2d_harmonic, is_aligned
from ..ops.geometry import get_geometry
from .fused import ACTIVATIONS, CENTRE_OP, DOMAIN, OP_NAME, _attributes
from .lowering import standard_operators
from .portable import sort_conv2d_portable

__all__ = ["FUNCTION_IR_VERSION", "STOCK_INLINING_ONNXRUNTIME", "attach_functions", "expand_centring",
           "inline_functions", "stock_onnxruntime_inlines"]

#: The IR version from which a function has an ``overload`` (onnx 1.16).
FUNCTION_IR_VERSION = 10
_BODY_OPSET = 18
#: The first onnxruntime that runs a fused file without the library when the file has more than one layer
#: configuration: 1.23.2 to 1.26.0 (1.23.2 is the last for Python 3.10) infer every overload's body with another
#: overload's (a 1 -> 32 layer's weight reshaped as a 32 -> 32 one's: "[ShapeInferenceError] ... Reshape ...
#: incompatible shapes") and refuse the file; 1.27.0 to 1.32.0 load it. With the library registered every one of
#: them runs it, and the file :func:`inline_functions` writes runs in all of them.
STOCK_INLINING_ONNXRUNTIME = (1, 27)


def stock_onnxruntime_inlines(version: str = None) -> bool:
    """Whether onnxruntime ``version`` (default: the installed one) runs a fused file with several layer
    configurations without the library (:data:`STOCK_INLINING_ONNXRUNTIME`)."""
    if version is None:
        import onnxruntime

        version = onnxruntime.__version__
    numbers = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    return numbers >= STOCK_INLINING_ONNXRUNTIME


class _Layer(nn.Module):
    """One node's layer in standard operators, its weight and bias as inputs."""

    def __init__(self, attributes: Dict[str, object]) -> None:
        super().__init__()
        pads = attributes["pads"]  # top, left, bottom, right
        self.padding = (pads[1], pads[3], pads[0], pads[2])
        self.stride, self.dilation = tuple(attributes["strides"]), tuple(attributes["dilations"])
        self.groups = attributes["group"]
        self.geometry = get_geometry(attributes["kernel_size"], attributes["sampling"], attributes["sorting"])
        self.centre = bool(attributes.get("centre", 0))
        self.min_size = int(attributes.get("centre_min_size", 1))
        activation = attributes.get("activation", "")
        if activation not in ACTIVATIONS:
            raise ValueError(f"fused ONNX node: activation {activation!r} is not one of {ACTIVATIONS}")
        self.relu = activation == "Relu"

    def forward(self, x, weight, bias=None, sum=None):
        y = self._layer(x, weight, bias)
        if sum is not None:
            y = y + sum
        return torch.relu(y) if self.relu else y

    def _layer(self, x, weight, bias):
        if self.centre:
            k = self.geometry.kernel_size
            x = centre_grid(x, [k, k], list(self.stride), [self.padding[2], self.padding[0]], list(self.dilation),
                            self.min_size)
        if is_aligned(self.geometry):
            x = nn.functional.pad(x, self.padding) if any(self.padding) else x
            return align_conv2d_harmonic(x, weight, bias, self.geometry, self.stride, self.dilation, self.groups)
        return sort_conv2d_portable(x, weight, bias, self.geometry, self.stride, self.padding, self.dilation,
                                    self.groups)


def _decoded(attributes: Dict[str, object]) -> Dict[str, object]:
    return {name: value.decode() if isinstance(value, bytes) else value for name, value in attributes.items()}


def _traced_nodes(module: nn.Module, example, names: List[str], dynamic: Dict[str, Dict[int, str]],
                  decomposition: str = "network"):
    """``module`` exported in standard operators (the sorting networks as ``decomposition``) at ``example`` (its
    inputs named ``names``, ``dynamic`` axes), as a list of nodes, its constants as ``Constant`` nodes (a function or
    a graph's inlined part has no initializers)."""
    import onnx
    from onnx import helper

    buffer = io.BytesIO()
    with warnings.catch_warnings(), standard_operators(decomposition):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, example, buffer, dynamo=False, opset_version=_BODY_OPSET, input_names=names,
                          output_names=["Y"], dynamic_axes=dynamic)
    graph = onnx.load_from_string(buffer.getvalue()).graph
    return [helper.make_node("Constant", [], [tensor.name], value=tensor) for tensor in graph.initializer] + list(
        graph.node)


def _body(attributes: Dict[str, object], weight_shape: List[int], inputs: int, channels: int, decomposition: str):
    """The function of a node with these attributes and ``inputs`` inputs (``X``, ``W``, ``B``, ``S``): the layer
    for any batch, height and width."""
    k = attributes["kernel_size"]
    size = max(2 * k * max(attributes["dilations"]), 8)
    layer = _Layer(attributes)
    example = (torch.zeros(1, channels, size, size), torch.zeros(weight_shape), torch.zeros(weight_shape[0]))
    if inputs > 3:
        with torch.no_grad():
            example += (torch.zeros_like(layer(*example)),)
    example = example[:inputs]
    names = ["X", "W", "B", "S"][:inputs]
    axes = {0: "n", 2: "h", 3: "w"}
    dynamic = {"X": axes, "Y": axes, **({"S": axes} if inputs > 3 else {})}
    return _traced_nodes(layer, example, names, dynamic, decomposition), names


def _overload(attributes: Dict[str, object], weight_shape: List[int], inputs: int, channels: int) -> str:
    key = repr((sorted(attributes.items()), weight_shape, inputs > 2, channels) + ((True,) if inputs > 3 else ())
               ).encode()
    return "layer_" + hashlib.sha256(key).hexdigest()[:12]


def attach_functions(model, decomposition: str = "network") -> int:
    """Gives each ``timm_sortconv::SortConv2d`` node of ``model`` (an ``onnx.ModelProto``, in place) its
    standard-operator form as a model-local function (module docstring), its sorting networks written as
    ``decomposition`` (:data:`.portable.DECOMPOSITIONS`); returns the number of functions added."""
    from onnx import helper

    shapes = {tensor.name: list(tensor.dims) for tensor in model.graph.initializer}
    made: Dict[str, object] = {}
    for node in model.graph.node:
        if node.domain != DOMAIN or node.op_type != OP_NAME:
            continue
        attributes = _decoded(_attributes(node))
        weight_shape = shapes.get(node.input[1])
        if weight_shape is None:
            raise ValueError(f"fused ONNX export: the weight of node {node.name} is not an initializer")
        inputs = len(node.input) if len(node.input) != 3 or node.input[2] else 2
        guides = attributes.get("guides", 0)
        in_channels = weight_shape[1] * attributes["group"] + guides * attributes["group"]
        overload = _overload(attributes, weight_shape, inputs, in_channels)
        node.overload = overload
        if overload in made:
            continue
        nodes, inputs = _body(attributes, weight_shape, inputs, in_channels, decomposition)
        made[overload] = helper.make_function(DOMAIN, OP_NAME, inputs, ["Y"], nodes,
                                              [helper.make_opsetid("", _BODY_OPSET)], overload=overload)
    model.functions.extend(made.values())
    if made:
        model.ir_version = max(model.ir_version, FUNCTION_IR_VERSION)
        _import_opset(model, "", _BODY_OPSET)
    return len(made)


def _import_opset(model, domain: str, version: int) -> None:
    for opset in model.opset_import:
        if opset.domain == domain:
            if opset.version < version:
                raise ValueError(f"the model imports opset {opset.version} of {domain!r}; the functions need "
                                 f"{version} or later (export with opset_version >= {version})")
            return
    from onnx import helper

    model.opset_import.append(helper.make_opsetid(domain, version))


class _Centring(nn.Module):
    def __init__(self, attributes: Dict[str, object]) -> None:
        super().__init__()
        self.arguments = [list(attributes[name]) for name in ("kernel_size", "strides", "pads", "dilations")]
        self.min_size = int(attributes["min_size"])

    def forward(self, x):
        return torch.ops.timm_sortconv.centre_grid(x, *self.arguments, self.min_size)


def _inline(graph, node, nodes, inputs: List[str], outputs: List[str], prefix: str) -> None:
    """Replaces ``node`` of ``graph`` by ``nodes`` (whose graph inputs are ``inputs`` and outputs ``outputs``), their
    other values renamed under ``prefix``."""
    names = dict(zip(inputs, node.input))
    names.update(zip(outputs, node.output))
    at = list(graph.node).index(node)
    graph.node.remove(node)
    for i, body in enumerate(nodes):
        for values in (body.input, body.output):
            for j, name in enumerate(values):
                if name:
                    values[j] = names.setdefault(name, f"{prefix}/{name}")
        body.name = f"{prefix}/{body.name or body.op_type}_{i}"
        graph.node.insert(at + i, body)


def expand_centring(model) -> int:
    """Writes each ``CentreGrid`` node of ``model`` that :func:`.fused.merge_centring` left (a centred pooling or
    plain convolution) as the standard operators of a plain export (:mod:`.centring`: for the traced size where the
    node records one, else for any), in place; returns how many."""
    left = [node for node in model.graph.node if node.domain == DOMAIN and node.op_type == CENTRE_OP]
    for index, node in enumerate(left):
        attributes = _attributes(node)
        height, width = attributes["sizes"]
        static = height > 0 and width > 0
        example = torch.zeros(1, 1, *(attributes["sizes"] if static else (32, 32)))
        axes = {0: "n", 1: "c"} if static else {0: "n", 1: "c", 2: "h", 3: "w"}
        nodes = _traced_nodes(_Centring(attributes), (example,), ["X"], {"X": axes, "Y": axes})
        _inline(model.graph, node, nodes, ["X"], ["Y"], f"centre_grid_{index}")
    return len(left)


def inline_functions(model):
    """A copy of ``model`` with every model-local function expanded in place: standard operators only, for runtimes
    that do not inline functions."""
    from onnx import inliner

    return inliner.inline_local_functions(model)
