"""A small model containing ``SortConv2d`` survives ``torch.jit.trace``, ``torch.compile`` and ONNX export
(run by onnxruntime) with the same output as in eager mode. Tracing and compiling record the registered
operator (``tests/test_operator.py`` checks that its fast kernel runs there); ONNX export writes the layer in
standard operators (``timm_sortconv.onnx.portable``), whose decompositions compute the reference path, and an
exported graph with a dynamic height and width centres its strided layers for the size it is given."""
import io
import warnings
from collections import Counter

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv import onnx as sc_onnx
from timm_sortconv.canonical import MomentCanonicalize2d
from timm_sortconv.ops import alignment, geometry
from timm_sortconv.onnx import portable
from timm_sortconv.ops.geometry import get_geometry
from timm_sortconv.ops.reference import sort_conv2d_reference

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


# The portable graph (timm_sortconv.onnx.portable): every decomposition is the reference path's function, in
# standard operators that both exporters write and onnxruntime runs.
@pytest.mark.parametrize("name", portable.DECOMPOSITIONS)
@pytest.mark.parametrize("k", [3, 4, 7])
@pytest.mark.parametrize("sampling,sorting", [("polar", "ring"), ("square", "ring"), ("polar", "global"),
                                              ("square", "c4"), ("polar", "c2")])
def test_every_decomposition_computes_the_reference_path(name, k, sampling, sorting):
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(2, 6, 11, 12, generator=generator, dtype=torch.float64)
    weight = torch.randn(4, 3, k, k, generator=generator, dtype=torch.float64)
    bias = torch.randn(4, generator=generator, dtype=torch.float64)
    geometry = get_geometry(k, sampling, sorting)
    out = portable.sort_conv2d_portable(x, weight, bias, geometry, (2, 1), (1, 2, 0, 1), (1, 2), 2, name)
    expected = sort_conv2d_reference(F.pad(x, (1, 2, 0, 1)), weight, bias, geometry, (2, 1), (1, 2), 2)
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=1e-10)


def test_an_unknown_decomposition_is_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown decomposition='bubble'; accepted: 'network', 'chunked'"):
        with sc_onnx.decomposition("bubble"):
            pass


def test_the_first_export_of_a_process_writes_the_same_graph_as_the_next(monkeypatch):
    """The aligned layers' harmonic tables are built on first use and cached: built inside the trace, the first
    export would carry the operations that build them (index assignments, stacks) where the next carries them as
    constants."""
    onnx = pytest.importorskip("onnx")
    monkeypatch.setattr(alignment, "_TABLES", {})  # as in a new process
    layer = SortConv2d(3, 4, 5, padding=2, sorting="align").eval()
    graphs = []
    for _ in range(2):
        buffer = io.BytesIO()
        sc_onnx.export(layer, torch.randn(1, 3, 9, 9), buffer)
        graphs.append(Counter(node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node))
    assert graphs[0] == graphs[1] and "ScatterND" not in graphs[0]


def _exported(model, example, dynamo, dynamic_size=False):
    buffer = io.BytesIO()
    sc_onnx.export(model, example, buffer, dynamo=dynamo, dynamic_size=dynamic_size)
    return buffer.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_the_exported_layer_is_a_sorting_network_of_standard_operators(dynamo):
    """One SC layer's graph: a sampling convolution, Min/Max pairs (two per comparator of the geometry's network), no
    TopK, one convolution for the weights; onnxruntime computes the layer."""
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    layer = SortConv2d(3, 5, 3, padding=1).eval()
    example = torch.randn(2, 3, 10, 10)
    data = _exported(layer, example, dynamo)
    ops = Counter(node.op_type for node in onnx.load_from_string(data).graph.node)
    comparators = len(get_geometry(3, "polar", "ring").comparators())
    assert ops["Min"] == ops["Max"] == comparators and ops["Conv"] == 2 and "TopK" not in ops
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    for x in (example, torch.randn(1, 3, 10, 10)):
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(session.run(None, {"x": x.numpy()})[0]), layer(x),
                                       atol=1e-5, rtol=1e-5)


def _turn_error(outputs):
    upright = torch.from_numpy(outputs[0])
    return max(float((torch.from_numpy(o) - upright).abs().max() / upright.abs().max()) for o in outputs[1:])


@pytest.mark.slow
@pytest.mark.parametrize("name,kwargs,sizes", [
    ("ri_resnet18", dict(channels=(4, 8, 8, 8), stem_width=4, num_classes=5), (33, 40, 47)),
    ("scnn_p_rs_7_blur", dict(channels=(4, 4, 6, 6, 8, 8)), (28, 29, 30)),
    ("scnn_p_align_7_guided", dict(channels=(4, 4, 6, 6, 8, 8)), (28, 30, 33)),
    ("scnn_p_rs_7_canon", dict(channels=(4, 4, 6, 6, 8, 8)), (28, 31)),
    ("scnn_p_align_7_guided_canon", dict(channels=(4, 4, 6, 6, 8, 8)), (28, 31)),
])
def test_a_graph_with_dynamic_height_and_width_is_centred_at_every_size(name, kwargs, sizes):
    """Exported by the TorchScript-based exporter with a dynamic height and width at one size, the graph centres its
    strided layers (convolutions, pooling, blurred pooling), its canonical turn and its guide for the size it is given:
    exactly invariant to quarter turns in onnxruntime at sizes of both parities, as the model is, and equal to the
    model there."""
    onnxruntime = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs).eval()
    channels = model.pretrained_cfg["input_size"][0]
    data = _exported(model, torch.randn(2, channels, sizes[0], sizes[0]), False, dynamic_size=True)
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(1)
    for size in sizes:
        x = torch.randn(2, channels, size, size, generator=generator)
        outputs = [session.run(None, {"x": torch.rot90(x, turn, (2, 3)).contiguous().numpy()})[0] for turn in range(4)]
        assert _turn_error(outputs) < 1e-5, size
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(outputs[0]), model(x), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_dynamo_exporter_refuses_a_dynamic_size_it_cannot_centre_and_exports_a_fixed_one():
    """torch.export follows the centring's branches at a fixed size; for a dynamic height and width it would have to
    reason about every strided layer's residue, so that is refused with one error saying what to do instead."""
    onnxruntime = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = timm.create_model("ri_resnet18", channels=(4, 8, 8, 8), stem_width=4, num_classes=5).eval()
    example = torch.randn(2, 3, 33, 33)
    with pytest.raises(Exception, match="torch.export cannot follow for a dynamic height or width.*dynamo=False"):
        _exported(model, example, True, dynamic_size=True)
    session = onnxruntime.InferenceSession(_exported(model, example, True), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(session.run(None, {"x": example.numpy()})[0]), model(example),
                                   atol=1e-4, rtol=1e-4)


class _Centre(nn.Module):
    def __init__(self, same: bool, kernel, stride):
        super().__init__()
        self.same, self.kernel, self.stride = same, kernel, stride

    def forward(self, x):
        from timm_sortconv.grid import centre_grid, centre_grid_same

        if self.same:
            return centre_grid_same(x, self.kernel, self.stride, [1, 1])
        return centre_grid(x, self.kernel, self.stride, [1, 1], [1, 1])


@pytest.mark.parametrize("same", [False, True], ids=["valid", "same"])
@pytest.mark.parametrize("shape", [(2, 3, 12, 12), (2, 3, 12, 11), (2, 3, 13, 16), (3, 14, 12)])
def test_a_static_centring_reads_half_a_pixel_in_one_pooling_and_agrees(same, shape):
    """At a static size the half-pixel read of a batch of images is one ``AveragePool`` over the axes that need it
    (no ``Slice``/``Add``/``Mul`` copies of the input), and the centred input agrees with PyTorch's in onnxruntime, for
    either axis, both, and an image without a batch (read by the slices instead)."""
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    from timm_sortconv.grid import centre_grid_residues, same_padding_totals

    module = _Centre(same, [3, 3], [2, 2])
    x = torch.randn(*shape)
    odd = ([total % 2 for total in same_padding_totals(shape[-2], shape[-1], [3, 3], [2, 2], [1, 1])] if same else
           [residue % 2 for residue in centre_grid_residues(shape[-2], shape[-1], [3, 3], [2, 2], [1, 1], [1, 1])])
    buffer = io.BytesIO()
    torch.onnx.export(module, (x,), buffer, dynamo=False, input_names=["x"])
    ops = Counter(node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node)
    if len(shape) == 4:
        assert ops["AveragePool"] == (1 if any(odd) else 0) and ops["Add"] == ops["Mul"] == 0, ops
    else:
        assert ops["AveragePool"] == 0 and ops["Add"] == sum(odd), ops
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    torch.testing.assert_close(torch.from_numpy(session.run(None, {"x": x.numpy()})[0]), module(x),
                               atol=1e-6, rtol=1e-6)
