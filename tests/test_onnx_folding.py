"""What an export's fixed sizes decide is written as constants (timm_sortconv.onnx.folding): the folded file computes
the same outputs at every batch, keeps computing what depends on a dynamic axis, and leaves nothing to fold."""
import io
import warnings
from collections import Counter

import numpy as np
import pytest
import timm
import torch

from timm_sortconv import onnx as sc_onnx
from timm_sortconv.onnx.folding import fold_static_sizes
from timm_sortconv.onnx.functions import stock_onnxruntime_inlines

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402


def _outputs(model_proto, x):
    session = onnxruntime.InferenceSession(model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _sized_graph():
    """``y = x * (W - 1) + batch`` for ``x (batch, 2, 3, W)`` with a dynamic batch and W = 5, where the arithmetic
    on the width and the batch both start from one ``Shape`` of ``x``."""
    def constant(name, value):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [],
                                                                                  [value]))

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        constant("three", 3), constant("zero", 0), constant("one", 1),
        helper.make_node("Gather", ["shape", "three"], ["width"], axis=0),
        helper.make_node("Sub", ["width", "one"], ["less"]),
        helper.make_node("Range", ["zero", "less", "one"], ["steps"]),
        helper.make_node("ReduceMax", ["steps"], ["largest"], keepdims=0),
        helper.make_node("Add", ["largest", "one"], ["count"]),  # W - 1 by way of a Range: W - 2, then + 1
        helper.make_node("Cast", ["count"], ["factor"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Cast", ["batch"], ["offset"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "factor"], ["scaled"]),
        helper.make_node("Add", ["scaled", "offset"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "sized", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, 3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)  # (onnxruntime 1.23+)


def test_what_the_static_width_decides_is_folded_and_the_batch_is_not():
    model = _sized_graph()
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert fold_static_sizes(model) > 0
    ops = [node.op_type for node in model.graph.node]
    assert "Range" not in ops and "ReduceMax" not in ops and "Sub" not in ops  # the width's arithmetic: a constant
    assert "Shape" in ops and ops.count("Gather") == 1  # the batch is still read from the input
    for batch in (1, 4):
        x = np.random.default_rng(batch).standard_normal((batch, 2, 3, 5)).astype(np.float32)
        np.testing.assert_allclose(_outputs(model, x), x * 4 + batch, rtol=1e-6)
        np.testing.assert_array_equal(_outputs(model, x), _outputs(before, x))
    assert fold_static_sizes(model) == 0


def test_a_dynamic_width_is_not_folded():
    model = _sized_graph()
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_param = "w"
    assert fold_static_sizes(model) == 0
    x = np.ones((2, 2, 3, 9), np.float32)
    np.testing.assert_allclose(_outputs(model, x), x * 8 + 2)


@pytest.mark.parametrize("fused", [False, True], ids=["portable", "fused"])
def test_the_canonical_guided_model_exports_its_sizes_as_constants(fused):
    """The canonical turn's sampling grid, the guide's ramp and pooling and the pooling's centring read only the
    fixed height and width: the package's export computes none of them at run time (nothing is left to fold; in the
    fused file no ``Shape`` or ``Range`` node is left at all, the standard-operator layers' reshapes read the batch),
    and the file agrees with PyTorch at two batches."""
    torch.manual_seed(0)
    model = timm.create_model("scnn_p_align_7_guided_canon", channels=(4, 4, 6, 6, 8, 8)).eval()
    example = torch.randn(2, 1, 28, 28)
    buffer, inlined = io.BytesIO(), io.BytesIO()
    sc_onnx.export(model, example, buffer, fused=fused, inlined=inlined if fused else None)
    exported = onnx.load_from_string(buffer.getvalue())
    ops = {node.op_type for node in exported.graph.node}
    assert "CentreGrid" not in ops and not (fused and ops & {"Shape", "Range"}), ops
    assert fold_static_sizes(exported) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = io.BytesIO()
        torch.onnx.export(model, (example,), plain, dynamo=False, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})
    plain_ops = Counter(node.op_type for node in onnx.load_from_string(plain.getvalue()).graph.node)
    ops = Counter(node.op_type for node in exported.graph.node)
    assert ops["Range"] < plain_ops["Range"] and ops["Shape"] < plain_ops["Shape"], (ops, plain_ops)
    inferred = onnx.shape_inference.infer_shapes(exported)
    dims = {value.name: value.type.tensor_type.shape.dim for value in inferred.graph.value_info}
    for node in exported.graph.node:  # what is left reads a size that is not fixed: the batch
        if node.op_type == "Shape":
            assert any(not d.HasField("dim_value") for d in dims[node.input[0]]), node.name
    # (onnxruntime before 1.27 refuses a fused file of several layer configurations: it runs the inlined one)
    data = buffer.getvalue() if not fused or stock_onnxruntime_inlines() else inlined.getvalue()
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = torch.randn(batch, 1, 28, 28)
        with torch.no_grad():
            expected = model(x)
        got = torch.from_numpy(session.run(None, {"x": x.numpy()})[0])
        torch.testing.assert_close(got, expected, atol=1e-4 * float(expected.abs().max()), rtol=0)
