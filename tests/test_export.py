"""A small model containing ``SortConv2d`` survives ``torch.jit.trace``, ``torch.compile`` and ONNX export
(run by onnxruntime) with the same output as in eager mode. Tracing and compiling record the registered
operator (``tests/test_operator.py`` checks that its fast kernel runs there); ONNX export writes the
reference path's standard operators."""
import io
import warnings

import pytest
import torch
import torch.nn as nn

from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv.canonical import MomentCanonicalize2d
from timm_sortconv.ops import geometry

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = [(s, o) for s in ("square", "polar") for o in ("ring", "global")]
VARIANT_IDS = [f"{s}-{o}" for s, o in VARIANTS]


def small_model(sampling, sorting):
    torch.manual_seed(0)
    return nn.Sequential(
        SortConv2d(2, 4, 5, padding=2, sampling=sampling, sorting=sorting),
        nn.ReLU(),
        SortConv2d(4, 3, 3, stride=2, padding=1, padding_mode="reflect", sampling=sampling, sorting=sorting),
    ).eval()


def inputs():
    """An example and another batch of another size. The strided layer's centring (``stride_align``) depends on
    each side's parity, which a trace records as it was: both sides of both inputs are even here."""
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 2, 12, 12, generator=generator), torch.randn(3, 2, 16, 18, generator=generator)


@pytest.mark.slow
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_jit_trace_matches_eager(sampling, sorting):
    model = small_model(sampling, sorting)
    example, other = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trace's deprecation and constant-size notices
        traced = torch.jit.trace(model, example)
    with torch.no_grad():
        torch.testing.assert_close(traced(example), model(example), atol=1e-6, rtol=1e-6)
        # Sizes are recorded as operations, so the trace also runs a batch of another shape.
        torch.testing.assert_close(traced(other), model(other), atol=1e-6, rtol=1e-6)


# backend="aot_eager" (dynamo + AOTAutograd, no code generation): compiling this model with the default
# "inductor" took 46 s on the 2-core development machine under load, against 4 s for aot_eager, too much
# for the test budget. Measured with `torch.compile(model)(x)` from a fresh process.
@pytest.mark.slow
@pytest.mark.parametrize("sampling,sorting", [("polar", "ring"), ("square", "global")], ids=["polar-ring",
                                                                                             "square-global"])
def test_torch_compile_matches_eager_forward_and_backward(sampling, sorting):
    model = small_model(sampling, sorting).train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    example, _ = inputs()
    expected = model(example)
    expected.square().sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = compiled(example)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    out.square().sum().backward()
    for p, grad in zip(model.parameters(), expected_grads):
        torch.testing.assert_close(p.grad, grad, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_graph_does_not_rebuild_the_sampling_tables(monkeypatch):
    """Compiling a call whose geometry is not cached yet records the tables as a few constants, not the
    loops that build them (one graph op per table entry made inductor take minutes on a tiny model)."""
    monkeypatch.setattr(geometry, "_GEOMETRIES", {})
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def polar_ring_7x7(x, weight):
        return sort_conv2d(x, weight, padding=3, sampling="polar", sorting="ring")

    x, weight = torch.randn(1, 2, 9, 9), torch.randn(3, 2, 7, 7)
    out = torch.compile(polar_ring_7x7, backend=record, fullgraph=True)(x, weight)
    torch.testing.assert_close(out, polar_ring_7x7(x, weight))
    ops = [str(node.target) for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert ops, "nothing was compiled"
    assert not [op for op in ops if "setitem" in op or "iadd" in op or "zeros" in op]


@pytest.mark.slow
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_onnx_export_runs_in_onnxruntime(sampling, sorting):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = small_model(sampling, sorting)
    example, other = inputs()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript-based exporter's deprecation notice
        torch.onnx.export(model, (example,), buffer, opset_version=17, dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}})
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for x in (example, other):
            (out,) = session.run(None, {"x": x.numpy()})
            torch.testing.assert_close(torch.from_numpy(out), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_onnx_export_of_a_canonicalizing_model_runs_in_onnxruntime():
    """The canonical turn in front of the model (the moment angle and the per-image turn) exports as standard
    ONNX operators."""
    onnxruntime = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = nn.Sequential(MomentCanonicalize2d(2), SortConv2d(1, 4, 5, padding=2), nn.ReLU(),
                          SortConv2d(4, 3, 3, padding=1)).eval()
    generator = torch.Generator().manual_seed(2)
    example, other = torch.randn(2, 1, 12, 12, generator=generator), torch.randn(3, 1, 12, 12, generator=generator)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), buffer, opset_version=17, dynamo=False, input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}})
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for x in (example, other):
            (out,) = session.run(None, {"x": x.numpy()})
            torch.testing.assert_close(torch.from_numpy(out), model(x), atol=1e-4, rtol=1e-4)
