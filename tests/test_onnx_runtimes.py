"""Every way a user exports an SC model gives a file that onnxruntime and OpenVINO load and that agrees with PyTorch.

The ways: ``torch.onnx.export`` with the TorchScript-based exporter at a static shape (the plain call many pipelines
make) and with dynamic axes (run at another batch and size than the traced one), the dynamo exporter, the package's
``timm_sortconv.onnx.export`` and timm's ``onnx_export``. The plain call is checked for every registered model, every
plain twin and a ``sortify``-ed timm ``resnet18``; the others for one model of each family. Agreement: within 1e-4 of
the largest logit (float32), in onnxruntime and in OpenVINO (CPU, float32 inference precision: its default on a CPU
with bfloat16 units is bfloat16, which moves the logits by far more).
"""
import io
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

import timm_sortconv
from conftest import quick_first
from timm_sortconv import sortify

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")
openvino = pytest.importorskip("openvino")

REGISTERED = sorted(name for name in timm.list_models() if name.startswith(("scnn_", "ri_")))
# One model of each family (the guided one with the canonical turn: a centring, a guide and a turn in one graph).
FAMILIES = ["scnn_p_rs_7", "scnn_p_align_7_guided_canon", "ri_resnet18", "ri_vgg16", "ri_densenet40", "sortify"]


def _model(name):
    """The model in evaluation mode and an example batch of 2 (the 128x128 networks at 64x64: the graph is the same,
    and every strided layer meets an odd size there, so its grid is centred)."""
    torch.manual_seed(0)
    if name == "sortify":
        model = sortify(timm.create_model("resnet18"))
        size = (3, 64, 64)
    else:
        model = timm.create_model(name)
        size = model.pretrained_cfg["input_size"]
        if size[-1] > 64:
            size = (size[0], 64, 64)
    return model.eval(), torch.randn(2, *size)


def _export(way, model, x):
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if way == "torchscript":
            torch.onnx.export(model, (x,), buffer, dynamo=False)
        elif way == "torchscript-dynamic":
            torch.onnx.export(model, (x,), buffer, dynamo=False, input_names=["x"],
                              dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}})
        elif way == "dynamo":
            torch.onnx.export(model, (x,), buffer, dynamo=True, verbose=False)
        elif way == "package":
            timm_sortconv.onnx.export(model, x, buffer)
        elif way == "timm":
            from timm.utils.onnx import onnx_export

            with tempfile.TemporaryDirectory() as folder:
                file = Path(folder) / "model.onnx"
                onnx_export(model, str(file), example_input=x, check=False)
                return file.read_bytes()
    return buffer.getvalue()


def _runs(data, x):
    """The file's output for ``x`` in onnxruntime and in OpenVINO."""
    session = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    core = openvino.Core()
    compiled = core.compile_model(core.read_model(data, b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return {"onnxruntime": session.run(None, {name: x.numpy()})[0], "openvino": compiled(x.numpy())[0]}


def _assert_agrees(model, data, x):
    onnx.checker.check_model(onnx.load_from_string(data))  # valid ONNX, as tools other than the runtimes require
    with torch.no_grad():
        expected = model(x).numpy()
    for runtime, got in _runs(data, x).items():
        assert got.shape == expected.shape, runtime
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error < 1e-4, f"{runtime} differs from PyTorch by {error:.1e} of the largest logit"


@pytest.mark.parametrize("name", quick_first(REGISTERED + ["sortify"]))
def test_the_plain_torchscript_export_of_every_model_loads_and_agrees(name):
    model, x = _model(name)
    _assert_agrees(model, _export("torchscript", model, x), x)


@pytest.mark.slow
@pytest.mark.parametrize("way", ["torchscript-dynamic", "dynamo", "package", "timm"])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_way_of_exporting_loads_and_agrees(name, way):
    model, x = _model(name)
    data = _export(way, model, x)
    _assert_agrees(model, data, x)
    if way in ("torchscript-dynamic", "package"):  # the dynamic axes hold: another batch (and size)
        shape = (3, *x.shape[1:3], x.shape[3]) if way == "package" else (1, x.shape[1], x.shape[2] + 3,
                                                                            x.shape[3] - 2)
        _assert_agrees(model, data, torch.randn(shape))


@pytest.mark.parametrize("name", quick_first(["scnn_p_rs_7", "ri_resnet18", "scnn_p_align_7_guided"]))
def test_the_openvino_decomposition_agrees_in_both_runtimes(name):
    """The sorting as OpenVINO runs it fastest (a TopK per ring over a grouped sampling convolution)."""
    model, x = _model(name)
    buffer = io.BytesIO()
    timm_sortconv.onnx.export(model, x, buffer, decomposition=timm_sortconv.onnx.OPENVINO)
    graph = onnx.load_from_string(buffer.getvalue()).graph
    if name != "scnn_p_align_7_guided":  # (the aligned variants sort nothing)
        assert any(node.op_type == "TopK" for node in graph.node)
    _assert_agrees(model, buffer.getvalue(), x)


def test_no_export_writes_an_if_node():
    """The centring of strided grids is written without branches (timm_sortconv.onnx.centring): at a static shape the
    few nodes the size needs, with dynamic axes the rule computed from the shape."""
    model, x = _model("ri_resnet18")
    for way in ("torchscript", "torchscript-dynamic"):
        graph = onnx.load_from_string(_export(way, model, x)).graph
        assert not [node for node in graph.node if node.op_type == "If"], way
