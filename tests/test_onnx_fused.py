"""The fused ONNX path: each sorting layer exported as one ``timm_sortconv::SortConv2d`` node and run by onnxruntime
with the library built from the package's CPU kernel (``timm_sortconv.onnx``: ``fused.py``, ``runtime.py``).

The file's outputs are compared with the reference path in PyTorch (the readable specification, which shares no
kernel code with the library), for both exporters, across the variants the node takes; the graph must hold one node
per sorting layer; the node's threads must not change its result; the layers it cannot compute must be refused at
export time; a library that cannot be built must say why in one line.
"""
import io

import numpy
import pytest
import torch
import torch.nn as nn

from conftest import quick_first, randomise_batchnorm, unavailable
from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv import onnx as sc_onnx
from timm_sortconv.ops import native
from timm_sortconv.cli import run
from timm_sortconv.cli.onnx import library_main
from timm_sortconv.onnx.fused import drop_unread_constants
from timm_sortconv.onnx.functions import stock_onnxruntime_inlines

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def library():
    try:
        return sc_onnx.build_library()
    except sc_onnx.LibraryBuildError as error:
        unavailable(f"the onnxruntime operator library cannot be built here: {error}")


def _fused(model, example, dynamo=False, dynamic_size=False):
    buffer = io.BytesIO()
    sc_onnx.export(model.eval(), example, buffer, dynamo=dynamo, dynamic_size=dynamic_size, fused=True)
    return buffer.getvalue()


def _fused_nodes(data):
    graph = onnx.load_from_string(data).graph
    return [node for node in graph.node if node.domain == "timm_sortconv"]


def _run(data, library, x, threads=1):
    """The file's output for ``x`` with the library registered; the file must be valid ONNX (onnx.checker: nodes in
    order, the custom domain's opset and functions declared), as tools other than onnxruntime require."""
    if isinstance(data, bytes):
        onnx.checker.check_model(onnx.load_from_string(data))
    return torch.from_numpy(sc_onnx.session(data, threads, library=library).run(None, {"x": x.numpy()})[0])


def _reference(model, x):
    """The model's output with every sorting layer on the reference path."""
    backends = {}
    for module in model.modules():
        if isinstance(module, SortConv2d):
            backends[module] = module.backend
            module.backend = "reference"
    try:
        with torch.no_grad():
            return model.eval()(x)
    finally:
        for module, backend in backends.items():
            module.backend = backend


def _assert_agrees(got, expected):
    assert got.shape == expected.shape
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < 1e-4, f"onnxruntime and PyTorch differ by {error:.2e} of the largest output"


def _model(**kwargs):
    torch.manual_seed(0)
    return nn.Sequential(SortConv2d(3, 8, **kwargs), nn.ReLU())


# (constructor arguments of a 3 -> 8 layer); the first runs in the quick loop
VARIANTS = [
    dict(kernel_size=5, padding=2, sampling="polar", sorting="ring"),
    dict(kernel_size=3, padding=1, sampling="square", sorting="ring"),
    dict(kernel_size=3, padding=1, sampling="square", sorting="global"),
    dict(kernel_size=7, padding=3, sampling="polar", sorting="global"),
    dict(kernel_size=5, padding=2, sampling="polar", sorting="c4"),
    dict(kernel_size=5, padding=2, sampling="square", sorting="c2"),
    dict(kernel_size=3, stride=2, padding=1, sampling="polar", sorting="ring"),
    dict(kernel_size=3, stride=2, padding=1, sampling="polar", sorting="ring", stride_align="corner"),
    dict(kernel_size=4, padding=2, sampling="polar", sorting="ring"),
    dict(kernel_size=4, padding="same", sampling="square", sorting="global"),
    dict(kernel_size=2, stride=2, sampling="square", sorting="ring"),
    dict(kernel_size=3, padding=2, dilation=2, sampling="polar", sorting="ring", bias=False),
    dict(kernel_size=3, padding=(0, 1), sampling="square", sorting="ring"),
    dict(kernel_size=3, padding=1, padding_mode="reflect", sampling="polar", sorting="ring"),
    dict(kernel_size=1, sampling="square", sorting="ring"),
]


@pytest.mark.parametrize("kwargs", quick_first(VARIANTS), ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
@pytest.mark.parametrize("dynamo", quick_first([False, True]), ids=["torchscript", "dynamo"])
def test_each_variant_is_one_node_that_agrees_with_the_reference_path(library, kwargs, dynamo):
    model = _model(**kwargs)
    x = torch.randn(2, 3, 13, 12)
    data = _fused(model, x, dynamo)
    nodes = _fused_nodes(data)
    assert [node.op_type for node in nodes] == ["SortConv2d"]
    _assert_agrees(_run(data, library, x), _reference(model, x))


@pytest.mark.parametrize("dynamo", quick_first([False, True]), ids=["torchscript", "dynamo"])
def test_groups_and_a_dynamic_size(library, dynamo):
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(4, 8, 5, padding=2, groups=2, sampling="polar", sorting="ring"), nn.ReLU(),
                          SortConv2d(8, 6, 3, stride=2, padding=1, groups=2, sampling="square", sorting="global",
                                     stride_align="corner"))
    data = _fused(model, torch.randn(1, 4, 16, 16), dynamo, dynamic_size=True)
    assert len(_fused_nodes(data)) == 2
    for shape in ((1, 4, 16, 16), (3, 4, 15, 18)):
        x = torch.randn(shape)
        _assert_agrees(_run(data, library, x), _reference(model, x))


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_paper_network_has_one_node_per_sorting_layer(library, dynamo):
    import timm

    model = timm.create_model("scnn_p_rs_7", pretrained=True).eval()
    layers = sum(isinstance(m, SortConv2d) for m in model.modules())
    x = torch.randn(3, 1, 28, 28)
    data = _fused(model, x, dynamo)
    assert len(_fused_nodes(data)) == layers == 6
    graph = onnx.load_from_string(data)
    assert not [node for node in graph.graph.node if node.op_type == "BatchNormalization"]  # folded into the nodes
    assert drop_unread_constants(graph) == 0  # no argument of the nodes left behind
    _assert_agrees(_run(data, library, x), _reference(model, x))


class _TwoNorms(nn.Module):
    """A normalisation that alone reads a layer's output (folded) and one that shares it (kept)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.norm1 = SortConv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.norm2 = SortConv2d(8, 8, 5, padding=2, sampling="square"), nn.BatchNorm2d(8)

    def forward(self, x):
        y = self.conv2(torch.relu(self.norm1(self.conv1(x))))
        return self.norm2(y) + y


@pytest.mark.parametrize("dynamo", quick_first([False, True]), ids=["torchscript", "dynamo"])
def test_a_normalisation_that_alone_reads_a_node_is_folded_into_it(library, dynamo):
    torch.manual_seed(0)
    model = _TwoNorms().eval()
    randomise_batchnorm(model)
    x = torch.randn(2, 3, 12, 12)
    data = _fused(model, x, dynamo)
    norms = [node for node in onnx.load_from_string(data).graph.node if node.op_type == "BatchNormalization"]
    assert len(norms) == 1 and len(_fused_nodes(data)) == 2
    _assert_agrees(_run(data, library, x), _reference(model, x))


class _TwoReadings(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = SortConv2d(3, 8, 5, padding=2)
        self.conv2 = SortConv2d(8, 8, 3, padding=1, sorting="align")

    def forward(self, x):
        y = self.conv2(torch.relu(self.conv1(x)))
        return torch.relu(y) + y


def test_a_relu_that_alone_reads_a_node_is_merged_into_it(library):
    """The first layer's ReLU becomes its node's activation; the second layer's output is read twice and keeps its
    own. Agrees with the library (negated input too: the ReLU then zeroes other outputs) and without it (each node's
    function ends in the same ReLU; the inlined file for other runtimes holds both ReLUs); a node with an activation
    the library does not know is refused when the session loads it."""
    torch.manual_seed(0)
    model = _TwoReadings().eval()
    x = torch.randn(2, 3, 11, 12)
    buffer, inlined = io.BytesIO(), io.BytesIO()
    sc_onnx.export(model, x, buffer, fused=True, inlined=inlined)
    data = buffer.getvalue()
    graph = onnx.load_from_string(data).graph
    activations = [{a.name: a.s for a in node.attribute}.get("activation", b"") for node in _fused_nodes(data)]
    assert activations == [b"Relu", b""]
    assert sum(node.op_type == "Relu" for node in graph.node) == 1
    expected = _reference(model, x)
    _assert_agrees(_run(data, library, x), expected)
    _assert_agrees(_run(data, library, -x), _reference(model, -x))
    stock = data if stock_onnxruntime_inlines() else inlined.getvalue()
    session = onnxruntime.InferenceSession(stock, providers=["CPUExecutionProvider"])
    _assert_agrees(torch.from_numpy(session.run(None, {"x": x.numpy()})[0]), expected)
    assert sum(node.op_type == "Relu" for node in onnx.load_from_string(inlined.getvalue()).graph.node) == 2
    unknown = onnx.load_from_string(data)
    for attribute in unknown.graph.node[[n.domain for n in unknown.graph.node].index("timm_sortconv")].attribute:
        if attribute.name == "activation":
            attribute.s = b"Tanh"
    with pytest.raises(Exception, match="activation 'Tanh'"):
        sc_onnx.session(unknown.SerializeToString(), 1, library=library)


def test_threads_do_not_change_the_result(library):
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(8, 16, 7, padding=3, sampling="polar", sorting="ring"), nn.ReLU(),
                          SortConv2d(16, 16, 3, stride=2, padding=1, sampling="square", sorting="global"))
    data = _fused(model, torch.randn(1, 8, 32, 32))
    for batch in (1, 3):  # fewer images than threads (padded once, positions shared out) and more
        x = torch.randn(batch, 8, 32, 32)
        one, two = _run(data, library, x, threads=1), _run(data, library, x, threads=2)
        assert torch.equal(one, two)
        _assert_agrees(one, _reference(model, x))


@pytest.mark.parametrize("size", [7, 9, 12, 33])
@pytest.mark.parametrize("kernel_size,stride,sorting", [(3, 1, "ring"), (5, 1, "ring"), (7, 2, "ring"),
                                                        (7, 1, "align")])
def test_one_image_cut_into_tasks_agrees_at_every_size(library, size, kernel_size, stride, sorting):
    """One padded image on two threads: the node cuts its positions into tasks, each copying and padding only the rows
    its windows read (a task's rows may start at the first or reach the last, or both). Fewer blocks than threads
    (7 x 7: 49 positions, 12 x 12 at stride 2: 36) are cut between whole vectors (25 + 24), where the positions past
    a task's last whole vector take the products with the outputs on the lanes. Equal to one thread, and to the
    reference."""
    torch.manual_seed(0)
    layer = SortConv2d(64, 32, kernel_size, stride=stride, padding=kernel_size // 2, sampling="polar", sorting=sorting)
    x = torch.randn(1, 64, size, size)
    data = _fused(layer, x)
    one, two = _run(data, library, x, threads=1), _run(data, library, x, threads=2)
    assert torch.equal(one, two)
    _assert_agrees(two, _reference(layer, x))


def test_a_file_runs_on_session_options_of_ones_own(library, tmp_path):
    """register_custom_ops_library(library_path()) on plain options, as the module docstring describes (the path as
    library_path returns it: onnxruntime refuses a Path), without the threads entry."""
    model = _model(kernel_size=5, padding=2).eval()
    x = torch.randn(1, 3, 12, 12)
    path = tmp_path / "model.onnx"
    sc_onnx.export(model, x, path, fused=True)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    assert sc_onnx.library_path() == str(library)
    options.register_custom_ops_library(sc_onnx.library_path())
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    _assert_agrees(torch.from_numpy(session.run(None, {"x": x.numpy()})[0]), _reference(model, x))


@pytest.mark.parametrize("kwargs", quick_first([
    dict(kernel_size=5, padding=2, sorting="align"),
    dict(kernel_size=3, padding=1, sorting="align-channel", sampling="square"),
    dict(kernel_size=7, padding=3, stride=2, sorting="align", groups=1),
    dict(kernel_size=3, padding=1, sorting="align", groups=3, bias=False),
]), ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_the_aligned_variants_are_one_node_that_agrees_with_the_reference_path(library, kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(3, 6, **kwargs), nn.ReLU(), SortConv2d(6, 8, 3, padding=1, sorting="ring"))
    x = torch.randn(2, 3, 13, 12)
    data = _fused(model, x)
    assert [node.op_type for node in _fused_nodes(data)] == ["SortConv2d"] * 2
    _assert_agrees(_run(data, library, x), _reference(model, x))


@pytest.mark.slow
def test_a_guided_network_is_one_node_per_layer_with_its_guide_channel(library):
    """scnn_p_align_7_guided_canon: the canonical turn, the guide pooled to each layer's size (two matrix products at
    a static shape, once per size: the layers of a size share them) and joined as one more input channel, which
    each node reads for the orientation only; no Cast of the guide to the type it has."""
    import timm

    model = timm.create_model("scnn_p_align_7_guided_canon", pretrained=True).eval()
    x = torch.randn(2, 1, 28, 28)
    data = _fused(model, x)
    nodes = _fused_nodes(data)
    assert len(nodes) == 6
    graph = onnx.load_from_string(data).graph
    concats = [node for node in graph.node if node.output[0] in {node.input[0] for node in nodes}]
    guides = [node.input[1] for node in concats]  # the pooled guide at 28 x 28, 14 x 14, 7 x 7, two layers each
    assert len(concats) == 6 and len(set(guides)) == 3, guides
    makers = {output: node for node in graph.node for output in node.output}
    assert all(makers[name].op_type == "MatMul" for name in guides), [makers[name].op_type for name in guides]
    assert all(onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "guides")) == 1
               for node in nodes)
    _assert_agrees(_run(data, library, x), _reference(model, x))


@pytest.mark.parametrize("dynamic_size", quick_first([False, True]), ids=["static", "dynamic"])
def test_a_centred_strided_layer_centres_inside_its_node(library, dynamic_size):
    """The centring of a strided SC layer's grid is the node's (its ``centre`` attribute), not nodes of its own; a
    centred pooling keeps its few standard nodes; the graph is right at odd and even sizes."""
    torch.manual_seed(0)
    from timm_sortconv.grid import CentredMaxPool2d

    # at 20 x 19 each strided layer meets an odd residue on some axis (the second an even window: residue 1 on 5)
    model = nn.Sequential(SortConv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), CentredMaxPool2d(3, 2, 1),
                          SortConv2d(8, 8, 4, stride=2, padding=1, sorting="align"))
    x = torch.randn(1, 3, 20, 19)
    data = _fused(model, x, dynamic_size=dynamic_size)
    graph = onnx.load_from_string(data).graph
    nodes = _fused_nodes(data)
    assert [node.op_type for node in nodes] == ["SortConv2d"] * 2
    assert all(onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "centre")) == 1
               for node in nodes)
    assert not [node for node in graph.node if node.op_type == "If"]
    for shape in ((1, 3, 20, 19),) + (((2, 3, 23, 18), (1, 3, 17, 17)) if dynamic_size else ()):
        x = torch.randn(shape)
        _assert_agrees(_run(data, library, x), _reference(model, x))


def _profiled_op_names(data, x, library=None):
    """The names of the kernels onnxruntime ran for ``x`` (its profile), with ``library`` registered or none."""
    import json
    import os

    options = onnxruntime.SessionOptions()
    options.enable_profiling = True
    if library is not None:
        options.register_custom_ops_library(str(library))
    session = onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    out = session.run(None, {"x": x.numpy()})[0]
    path = session.end_profiling()
    try:
        with open(path) as f:
            events = json.load(f)
    finally:
        os.remove(path)
    return out, {event["args"]["op_name"] for event in events if event.get("cat") == "Node"}


def test_one_fused_file_runs_in_every_onnxruntime_and_inlined_in_openvino(library):
    """Without the library onnxruntime inlines each node's model-local function (standard operators); with it, it
    runs the package's kernel; the inlined file holds standard operators only, which OpenVINO runs."""
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(3, 8, 5, padding=2), nn.BatchNorm2d(8), nn.ReLU(),
                          SortConv2d(8, 8, 3, stride=2, padding=1, sorting="align"), nn.ReLU(),
                          SortConv2d(8, 8, 5, padding=2)).eval()
    randomise_batchnorm(model)
    x = torch.randn(2, 3, 16, 15)
    buffer, inlined = io.BytesIO(), io.BytesIO()
    sc_onnx.export(model, x, buffer, fused=True, inlined=inlined)
    data = buffer.getvalue()
    exported = onnx.load_from_string(data)
    assert len(exported.functions) == 3  # the first and last layers differ in their weights only: one each anyway
    expected = _reference(model, x)
    # (onnxruntime before 1.27 runs the inlined file instead: it refuses a file with several configurations)
    stock, stock_ops = _profiled_op_names(data if stock_onnxruntime_inlines() else inlined.getvalue(), x)
    _assert_agrees(torch.from_numpy(stock), expected)
    assert "SortConv2d" not in stock_ops and "Conv" in stock_ops
    fast, fast_ops = _profiled_op_names(data, x, library)
    _assert_agrees(torch.from_numpy(fast), expected)
    assert "SortConv2d" in fast_ops and "Min" not in fast_ops
    standard = onnx.load_from_string(inlined.getvalue())
    assert not standard.functions and all(node.domain in ("", "ai.onnx") for node in standard.graph.node)
    openvino = pytest.importorskip("openvino")
    core = openvino.Core()
    compiled = core.compile_model(core.read_model(inlined.getvalue(), b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    _assert_agrees(torch.from_numpy(compiled(x.numpy())[0]), expected)


def test_stock_onnxruntime_runs_a_file_of_several_configurations_from_the_version_the_package_names():
    """STOCK_INLINING_ONNXRUNTIME holds for the installed onnxruntime: a fused file with two layer configurations (two
    overloads of one function) loads without the library exactly where stock_onnxruntime_inlines() says so, and the
    version test reads release and local versions."""
    model = nn.Sequential(SortConv2d(3, 8, 5, padding=2), nn.ReLU(), SortConv2d(8, 8, 5, padding=2)).eval()
    buffer = io.BytesIO()
    sc_onnx.export(model, torch.randn(1, 3, 12, 12), buffer, fused=True)
    try:
        onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
        loads = True
    except Exception as error:  # onnxruntime's Fail, which it does not export under one name in every version
        assert "ShapeInferenceError" in str(error), error
        loads = False
    assert loads == stock_onnxruntime_inlines()
    assert not stock_onnxruntime_inlines("1.26.0") and stock_onnxruntime_inlines("1.27.0")
    assert stock_onnxruntime_inlines("1.32.0+cpu") and not stock_onnxruntime_inlines("1.9.0")


def test_the_openvino_extension_runs_a_fused_file_node_for_node():
    """OpenVINO with the package's extension (built against the openvino wheel) reads each node into its own
    operation and runs the package's kernels: the sortings, an aligned layer with a centred stride, a folded
    normalisation."""
    pytest.importorskip("openvino")
    from timm_sortconv.onnx import openvino as sc_openvino

    try:
        sc_openvino.extension_path()
    except sc_openvino.ExtensionBuildError as error:
        unavailable(f"the OpenVINO extension cannot be built here: {error}")
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(3, 8, 5, padding=2), nn.BatchNorm2d(8), nn.ReLU(),
                          SortConv2d(8, 8, 3, stride=2, padding=1, sorting="align"), nn.ReLU(),
                          SortConv2d(8, 6, 3, padding=1, sampling="square", sorting="global")).eval()
    randomise_batchnorm(model)
    x = torch.randn(2, 3, 15, 16)
    buffer = io.BytesIO()
    sc_onnx.export(model, x, buffer, fused=True)
    compiled = sc_openvino.compile_model(buffer.getvalue(), config={"PERF_COUNT": True})
    request = compiled.create_infer_request()
    out = list(request.infer([x.numpy()]).values())[0]
    _assert_agrees(torch.from_numpy(out), _reference(model, x))
    assert sum(info.node_type == "Reference" for info in request.profiling_info) == 3  # the three nodes, as ours


class _Residual(nn.Module):
    """A residual block's second half: SC layer (normalised or not), plus the shortcut (or a broadcast shift), ReLU."""

    def __init__(self, normalised: bool, broadcast: bool = False):
        super().__init__()
        self.conv = SortConv2d(8, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8) if normalised else nn.Identity()
        self.shift = nn.Parameter(torch.randn(1, 8, 1, 1)) if broadcast else None

    def forward(self, x):
        y = self.bn(self.conv(x))
        return torch.relu(y + (self.shift if self.shift is not None else x))


@pytest.mark.parametrize("normalised", [True, False], ids=["bn", "no-bias"])
def test_a_residual_add_and_its_relu_are_merged_into_the_node(library, normalised):
    """The shortcut's Add that alone reads a node (then its ReLU) becomes the node's input S, added before the
    activation (a node without a bias gets a zero one): one node, agreeing with the reference with the library at one
    and two threads, without it (the function adds S too), inlined in standard operators, and in OpenVINO."""
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(3, 8, 3, padding=1), _Residual(normalised)).eval()
    randomise_batchnorm(model)
    x = torch.randn(2, 3, 13, 12)
    buffer, inlined = io.BytesIO(), io.BytesIO()
    sc_onnx.export(model, x, buffer, fused=True, inlined=inlined)
    data = buffer.getvalue()
    ops = [node.op_type for node in onnx.load_from_string(data).graph.node]
    assert ops.count("SortConv2d") == 2 and "Add" not in ops and "Relu" not in ops, ops
    first, node = _fused_nodes(data)
    assert len(node.input) == 4 and node.input[3] == first.output[0] and node.input[2]
    assert any(a.name == "activation" and a.s == b"Relu" for a in node.attribute)
    expected = _reference(model, x)
    for threads in (1, 2):
        _assert_agrees(_run(data, library, x, threads), expected)
    if stock_onnxruntime_inlines():
        stock = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
        _assert_agrees(torch.from_numpy(stock.run(None, {"x": x.numpy()})[0]), expected)
    standard = onnxruntime.InferenceSession(inlined.getvalue(), providers=["CPUExecutionProvider"])
    _assert_agrees(torch.from_numpy(standard.run(None, {"x": x.numpy()})[0]), expected)
    pytest.importorskip("openvino")
    from timm_sortconv.onnx import openvino as sc_openvino

    try:
        sc_openvino.extension_path()
    except sc_openvino.ExtensionBuildError as error:
        unavailable(f"the OpenVINO extension cannot be built here: {error}")
    out = sc_openvino.compile_model(data)(x.numpy())[0]
    _assert_agrees(torch.from_numpy(out), expected)


class _LateShortcut(nn.Module):
    """A residual whose shortcut is computed after the SC layer, as timm's BasicBlock downsamples its shortcut after
    conv2."""

    def __init__(self):
        super().__init__()
        self.conv = SortConv2d(8, 8, 3, padding=1)
        self.shortcut = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = self.conv(x)
        return torch.relu(y + self.shortcut(x))


@pytest.mark.parametrize("dynamo", quick_first([False, True]), ids=["torchscript", "dynamo"])
def test_a_merged_residual_keeps_the_graph_in_order(library, dynamo):
    """The node that takes in an Add whose shortcut is made after it moves to the Add's place: every input is made
    before the node that reads it, the file passes onnx.checker, and it agrees."""
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(3, 8, 3, padding=1), _LateShortcut()).eval()
    x = torch.randn(2, 3, 13, 12)
    buffer = io.BytesIO()
    sc_onnx.export(model, x, buffer, fused=True, dynamo=dynamo)
    proto = onnx.load_from_string(buffer.getvalue())
    assert "Add" not in [node.op_type for node in proto.graph.node]
    made = {i.name for i in proto.graph.input} | {t.name for t in proto.graph.initializer}
    for node in proto.graph.node:
        assert all(not name or name in made for name in node.input), f"{node.name} reads a later node's output"
        made.update(node.output)
    onnx.checker.check_model(proto)
    _assert_agrees(_run(buffer.getvalue(), library, x, 1), _reference(model, x))


def test_a_residual_of_another_shape_is_refused_naming_both_shapes(library):
    """A node's S that is not of Y's shape (here a graph input fed one column short) fails the run with one error
    that names Y's shape and S's."""
    torch.manual_seed(0)
    model = nn.Sequential(SortConv2d(3, 8, 3, padding=1), _Residual(False)).eval()
    x = torch.randn(2, 3, 13, 12)
    graph_model = onnx.load_from_string(_fused(model, x))
    node = [node for node in graph_model.graph.node if node.domain == "timm_sortconv" and len(node.input) == 4][0]
    node.input[3] = "s"
    graph_model.graph.input.append(onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, None))
    session = sc_onnx.session(graph_model.SerializeToString(), 1, library=library)
    with pytest.raises(Exception, match=r"S must have Y's shape \(2, 8, 13, 12\), not \(2, 8, 13, 11\)"):
        session.run(None, {"x": x.numpy(), "s": numpy.zeros((2, 8, 13, 11), numpy.float32)})


def test_a_broadcast_add_stays_a_node_of_its_own(library):
    """An Add whose other operand broadcasts (a per-channel shift) is not a residual: it stays, and the file agrees."""
    torch.manual_seed(0)
    model = _Residual(True, broadcast=True).eval()
    randomise_batchnorm(model)
    x = torch.randn(2, 8, 10, 10)
    data = _fused(model, x)
    ops = [node.op_type for node in onnx.load_from_string(data).graph.node]
    assert "Add" in ops and len(_fused_nodes(data)[0].input) <= 3, ops
    _assert_agrees(_run(data, library, x, 2), _reference(model, x))


def test_an_inlined_file_needs_the_fused_export():
    with pytest.raises(ValueError, match="inlined= .* needs fused=True"):
        sc_onnx.export(_model(kernel_size=3).eval(), torch.randn(1, 3, 8, 8), io.BytesIO(), inlined=io.BytesIO())


def test_the_default_export_has_no_custom_node():
    model = _model(kernel_size=5, padding=2)
    buffer = io.BytesIO()
    sc_onnx.export(model.eval(), torch.randn(1, 3, 12, 12), buffer)
    assert not _fused_nodes(buffer.getvalue())
    assert not sc_onnx.fused_export_enabled()


@pytest.mark.parametrize("make, words", [
    (lambda: _model(kernel_size=3, padding=1).double(), ("dtype=torch.float64", "torch.float32")),
    (lambda: _model(kernel_size=17, padding=8), ("kernel_size=17", "1 to 15")),
], ids=["float64", "kernel-17"])
def test_what_the_node_cannot_compute_is_refused_at_export_time(make, words):
    model = make()
    x = torch.randn(1, 3, 20, 20, dtype=next(model.parameters()).dtype)
    with pytest.raises(sc_onnx.FusedExportError) as raised:
        _fused(model, x)
    assert all(word in str(raised.value) for word in words) and "[layer 0]" in str(raised.value)


def test_a_functional_call_is_refused_while_tracing():
    class Functional(nn.Module):
        def forward(self, x):
            return sort_conv2d(x, torch.ones(2, 3, 3, 3, dtype=torch.float64), padding=1)

    with pytest.raises(sc_onnx.FusedExportError, match="dtype=torch.float64"):
        _fused(Functional(), torch.randn(1, 3, 8, 8, dtype=torch.float64))


def test_a_library_that_cannot_be_built_says_why_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(SystemExit) as status:  # python scripts/onnx_library.py
        run(library_main, [])
    assert status.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: no C++ compiler: '{tmp_path / 'no-such-compiler'}' is not on PATH (install g++ or clang++, or set "
        "CXX)"]
    with pytest.raises(sc_onnx.LibraryBuildError, match="'neon' is not an instruction-set level"):
        sc_onnx.build_library("neon")


def test_the_library_builds_offline_from_the_vendored_header_and_its_portable_level_agrees(tmp_path, monkeypatch):
    """No download: the build reads onnxruntime's C API header from the package (and nothing amd64-only). The portable
    level (16-byte vectors, as on aarch64: a vector holds fewer outputs than a register tile has rows) agrees with the
    reference where a block ends in a few positions (7 x 7: 49), ring-sorted and aligned, on one and two threads."""
    import urllib.request

    def no_network(*args, **kwargs):
        raise AssertionError("the build reached for the network")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    path = sc_onnx.build_library("generic")
    assert path.is_file() and tmp_path in path.parents
    assert sc_onnx.build_library("generic") == path  # cached
    for sorting in ("ring", "align"):
        torch.manual_seed(0)
        layer = SortConv2d(16, 12, 7, padding=3, sampling="polar", sorting=sorting)
        x = torch.randn(1, 16, 7, 7)
        data = _fused(layer, x)
        one, two = _run(data, path, x, threads=1), _run(data, path, x, threads=2)
        assert torch.equal(one, two)
        _assert_agrees(one, _reference(layer, x))


def test_the_library_ab_times_each_library_in_a_process_of_its_own(library, tmp_path):
    """scripts/bench_onnx_library_ab.py --processes: each round's calls of each library in a new process (two sessions
    in one process have each other's pool threads spinning); the same library twice gives equal outputs and a time
    for each."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_onnx_library_ab.py"
    result = subprocess.run([sys.executable, str(script), "--before", str(library), "--after", str(library), "--models",
                             "scnn_p_rs_3", "--batches", "1", "--threads", "2", "--rounds", "2", "--repeats", "2",
                             "--processes"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found = re.search(r"scnn_p_rs_3 batch 1, threads 2: before ([0-9.]+) ms, after ([0-9.]+) ms \(x[0-9.]+\); outputs "
                      r"differ by 0\.0e\+00 of the largest", result.stdout)
    assert found, result.stdout
    assert float(found.group(1)) > 0 and float(found.group(2)) > 0
    assert list(tmp_path.iterdir()) == []  # the file and its input lived in a temporary folder


def test_bench_onnx_times_each_file_in_processes_of_its_own(tmp_path):
    """scripts/bench_onnx.py --processes N: SC and twin each timed in N processes of their own (one session each),
    the row agreeing with PyTorch and its command saying how it was measured, which the deployment table marks."""
    import csv
    import re
    import subprocess
    import sys
    from pathlib import Path

    from conftest import load_script

    repo = Path(__file__).resolve().parents[1]
    table = tmp_path / "onnx.csv"
    result = subprocess.run([sys.executable, str(repo / "scripts" / "bench_onnx.py"), "--models", "scnn_p_rs_7",
                             "--batches", "1", "--threads", "1", "--rounds", "1", "--repeats", "2", "--processes", "1",
                             "--csv", str(table)], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    found = re.search(r"scnn_p_rs_7 batch 1, threads 1: SC ([0-9.]+) ms, scnn_baseline_7 ([0-9.]+) ms, ratio "
                      r"[0-9.]+; error ([0-9.e+-]+);", result.stdout)
    assert found, result.stdout
    assert float(found.group(1)) > 0 and float(found.group(2)) > 0 and float(found.group(3)) < 1e-5
    (row,) = list(csv.DictReader(open(table)))
    assert "--processes 1" in row["command"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx.csv"]  # files and inputs in a temporary folder
    docs = load_script(repo / "scripts" / "docs.py", "docs")
    assert docs._processes(row) == 1 and docs._processes(dict(row, command="python scripts/bench_onnx.py")) == 0
    refused = subprocess.run([sys.executable, str(repo / "scripts" / "bench_onnx.py"), "--processes", "-1"],
                             capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode != 0 and "--processes must be 0 or more" in refused.stderr


def test_bench_onnx_times_each_layer_cut_out_of_the_files(library, tmp_path):
    """scripts/bench_onnx.py --fused --layers: each SC node cut out of the file with the activations it reads (its
    output that of the whole network) and the twin's convolution at the same place, timed, then what the networks
    spend outside those layers; refused without --fused."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_onnx.py"
    result = subprocess.run([sys.executable, str(script), "--fused", "--layers", "--models", "scnn_p_rs_3", "--batches",
                             "1", "--threads", "1", "--rounds", "1", "--repeats", "2"], capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    layers = re.findall(r"layer /features/features\.([0-9])/conv \(1x([0-9]+)x([0-9]+)x[0-9]+\): SC ([0-9.]+) ms, twin "
                        r"([0-9.]+) ms, ratio [0-9.]+; error ([0-9.e+-]+)", result.stdout)
    assert [(index, channels, size) for index, channels, size, *_ in layers] == [
        ("0", "1", "28"), ("1", "32", "28"), ("3", "32", "14"), ("4", "64", "14"), ("6", "64", "7"),
        ("7", "128", "7")], result.stdout
    for *_, sc, twin, error in layers:
        assert float(sc) > 0 and float(twin) > 0 and float(error) < 1e-6
    assert re.search(r"the 6 layers: SC [0-9.]+ ms, twin [0-9.]+ ms, ratio [0-9.]+; outside them", result.stdout)
    assert list(tmp_path.iterdir()) == []  # the cuts and their inputs lived in a temporary folder
    refused = subprocess.run([sys.executable, str(script), "--layers", "--models", "scnn_p_rs_3"], capture_output=True,
                             text=True, cwd=tmp_path)
    assert refused.returncode != 0 and "add --fused" in refused.stderr and "Traceback" not in refused.stderr


def test_the_library_ab_takes_a_sortified_timm_model_with_its_sorting(library, tmp_path):
    """scripts/bench_onnx_library_ab.py --models sortify:NAME@SIZE --sorting S: the timm model converted by sortify
    with that sorting, at SIZE x SIZE; a name without its size is refused in one line."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_onnx_library_ab.py"
    common = [sys.executable, str(script), "--before", str(library), "--after", str(library), "--batches", "1",
              "--threads", "1", "--rounds", "1", "--repeats", "1"]
    result = subprocess.run(common + ["--models", "sortify:resnet10t@32", "--sorting", "align"], capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sortify:resnet10t@32 batch 1, threads 1: before" in result.stdout and "differ by 0.0e+00" in result.stdout
    refused = subprocess.run(common + ["--models", "sortify:resnet10t"], capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode != 0 and "sortify:NAME@SIZE" in refused.stderr
    assert "Traceback" not in refused.stderr
