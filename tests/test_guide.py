"""Guided alignment (:mod:`timm_sortconv.guide`): aligned windows turned by the orientation of the model's blurred
input. The tests assert the property itself (exact invariance to quarter turns at sizes whose strided grids need
centring, of a registered network and of a sortified timm model), that the guide decides the turn (a guided layer
differs from an unguided one and ignores the features' own orientation where the guide varies), agreement of every
backend and of both gradients with the reference path, the model API (state_dict keys, deepcopy, features), the
routes out of eager mode (compile, export, ONNX), and one clear error for every combination the guide cannot
serve."""
from __future__ import annotations

import copy
import io
import warnings

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv import SortConv2d, quarter_turn_check, sortify
from timm_sortconv.guide import GAIN, OrientationGuide, area_matrix, attach_guide, check_guide_ramp, guided_layers
from timm_sortconv.models import SCNN

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(channels=(4, 4, 6, 6, 8, 8))


def small_guided(kernel_size=5, **kwargs):
    torch.manual_seed(0)
    return SCNN(kernel_size=kernel_size, sorting="align", guide_blur=2.0, **SMALL, **kwargs).eval()


def two_layers(backend="auto", groups=1, stride=1):
    torch.manual_seed(1)
    net = nn.Sequential(SortConv2d(2, 4, 5, padding=2, sorting="align", backend=backend), nn.Tanh(),
                        SortConv2d(4, 4, 3, stride=stride, padding=1, groups=groups, sorting="align", backend=backend))
    attach_guide(net, blur=1.5)
    return net


@pytest.mark.parametrize("size", [28, 29, 30, 31])
def test_a_guided_scnn_is_exactly_invariant_to_quarter_turns_at_every_size(size):
    model = small_guided().double()
    assert quarter_turn_check(model, size, batch=2, search=0).error < 1e-10


def test_a_sortified_timm_model_with_a_guide_is_exactly_invariant_to_quarter_turns():
    torch.manual_seed(0)
    model = sortify(timm.create_model("resnet18", num_classes=3), sorting="align", guide_blur=3.0).eval().double()
    assert quarter_turn_check(model, 45, batch=1, search=0).error < 1e-10


@pytest.mark.parametrize("size", [28, 29])
def test_a_guided_scnn_with_a_ramp_is_exactly_invariant_to_quarter_turns(size):
    """The ramp is fixed along +x of the image; the canonical turn in front keeps the network invariant."""
    model = small_guided(canonicalize="moment1", guide_ramp=0.05).double()
    assert quarter_turn_check(model, size, batch=2, search=0).error < 1e-10


def test_a_sortified_timm_model_with_a_ramp_is_exactly_invariant_to_quarter_turns():
    torch.manual_seed(0)
    model = sortify(timm.create_model("resnet10t", num_classes=3), sorting="align", guide_blur=3.0,
                    canonicalize="moment1", guide_ramp=0.02).eval().double()
    assert model.conv1[0].orientation_guide.ramp == 0.02
    assert quarter_turn_check(model, 37, batch=1, search=0).error < 1e-10


@pytest.mark.parametrize("width", [16, 17])
def test_the_ramp_is_a_slope_along_x_centred_on_the_image_before_the_gain(width):
    x = torch.rand(2, 3, 12, width, dtype=torch.float64)
    plain, ramped = OrientationGuide(2.0).double(), OrientationGuide(2.0, ramp=0.25).double()
    slope = (torch.arange(width, dtype=torch.float64) - (width - 1) / 2) * 0.25 * GAIN
    torch.testing.assert_close(ramped(x) - plain(x), slope.expand(2, 1, 12, width))
    # where the input is flat the ramp alone is the guide: its first harmonic points along +x in every window
    flat = torch.ones(1, 1, 12, width, dtype=torch.float64)
    torch.testing.assert_close(ramped(flat), slope.expand(1, 1, 12, width))


def test_where_the_input_is_flat_the_ramp_turns_the_windows():
    """On a flat image the plain guide is zero (the features orient each window) and the ramped one points along +x
    everywhere: a guided layer's output then differs."""
    torch.manual_seed(3)
    layer = SortConv2d(3, 4, 5, padding=2, sorting="align", guided=True).double()
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    flat = torch.ones(1, 1, 16, 16, dtype=torch.float64)
    outputs = []
    for guide in (OrientationGuide(2.0), OrientationGuide(2.0, ramp=0.02)):
        guide.double()
        guide.map = guide(flat)
        layer.guide_source = (guide,)
        outputs.append(layer(x))
    assert (outputs[0] - outputs[1]).abs().max() > 1e-2 * outputs[0].abs().max()


def test_the_guide_decides_the_turn_where_it_varies():
    """With the features kept, a guided layer's output follows the guide: a guide made from a turned image turns the
    windows otherwise."""
    torch.manual_seed(2)
    layer = SortConv2d(3, 4, 5, padding=2, sorting="align", guided=True).double()
    guide = OrientationGuide(2.0)
    layer.guide_source = (guide,)
    x = torch.randn(1, 3, 16, 16, dtype=torch.float64)
    image = torch.zeros(1, 1, 16, 16, dtype=torch.float64)
    image[..., 3:9, 5:8] = 1.0  # a bar off the centre: its blurred mass points one way across the map
    guide.map = guide(image)
    first = layer(x)
    guide.map = guide(torch.rot90(image, 1, (2, 3)))
    assert (layer(x) - first).abs().max() > 1e-2


def test_a_guided_layer_is_the_aligned_operator_on_the_input_and_the_scaled_guide():
    """What a guided layer computes, written out: the aligned convolution of the input with the guide's map (pooled to
    the layer's size) as one more channel with a zero weight."""
    net = two_layers(stride=2).double()
    x = torch.randn(2, 2, 15, 15, dtype=torch.float64)
    out = net(x)
    guide = net[0].orientation_guide
    expected_map = F.adaptive_avg_pool2d(guide(x), (15, 15))
    assert torch.allclose(guide.map, expected_map)
    assert guide.map.abs().max() > GAIN * 1e-3
    plain = copy.deepcopy(net)
    for layer in (plain[0], plain[2]):
        layer.guided = False
    first = SortConv2d(3, 4, 5, padding=2, sorting="align").double()
    with torch.no_grad():
        first.weight.copy_(torch.cat([net[0].weight, torch.zeros(4, 1, 5, 5, dtype=torch.float64)], 1))
        first.bias.copy_(net[0].bias)
    hidden = torch.tanh(first(torch.cat([x, guide.map], 1)))
    assert torch.allclose(net[1](net[0](x)), hidden, atol=1e-12)
    assert torch.allclose(out, net[2](hidden))


def test_where_the_guide_varies_its_orientation_alone_turns_the_windows():
    """With a guide that varies everywhere (a ramp at a blurred image's scale), a guided layer is linear in its input,
    turned by the guide's orientation alone: the same layer with the input scaled far down, so that the features add
    nothing to the orientation, gives the same output scaled back. The gradient reaches the weight and the input."""
    from timm_sortconv import sort_conv2d

    torch.manual_seed(0)
    layer = SortConv2d(2, 3, 5, padding=2, sorting="align", guided=True).double()
    guide = OrientationGuide(2.0)
    layer.guide_source = (guide,)
    guide.map = torch.arange(20, dtype=torch.float64).view(1, 1, 20, 1).expand(2, 1, 20, 20) * 0.1 * GAIN
    x = torch.randn(2, 2, 20, 20, dtype=torch.float64, requires_grad=True)
    weight = torch.cat([layer.weight, torch.zeros_like(layer.weight[:, :1])], 1)
    out = layer(x)
    scaled = sort_conv2d(torch.cat([x.detach() * 1e-6, guide.map], 1), weight, None, padding=2, sorting="align",
                         backend="reference") * 1e6
    torch.testing.assert_close(out - layer.bias.view(1, -1, 1, 1), scaled, rtol=1e-2, atol=1e-2)
    out.square().sum().backward()
    assert layer.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("backend", ["auto", "harmonic"])
def test_every_backend_and_both_gradients_agree_with_the_reference(backend, groups):
    torch.manual_seed(3)
    x = torch.randn(2, 2, 13, 13, dtype=torch.float64, requires_grad=True)
    outputs, grads = [], []
    for name in ("reference", backend):
        net = two_layers(name, groups, stride=2).double()
        out = net(x)
        (gx, gw) = torch.autograd.grad(out.square().sum(), [x, net[2].weight])
        outputs.append(out)
        grads.append((gx, gw))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-9, rtol=1e-9)
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-7)


def test_gradcheck_through_the_guide_and_the_features():
    net = two_layers("reference").double()
    x = torch.randn(1, 2, 9, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: net(t).sum((2, 3)), (x,), eps=1e-6, atol=1e-5)


def test_the_model_api_holds():
    model = small_guided()
    plain = SCNN(kernel_size=5, sampling=None, sorting=None, **SMALL)
    assert list(model.state_dict()) == list(plain.state_dict())
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    assert guided_layers(model) == [f"features.{i}.conv" for i in (0, 1, 3, 4, 6, 7)]
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        out = model(x)
        twin = copy.deepcopy(model)
        assert twin.features[0].conv.orientation_guide is twin.features[4].conv.guide_source[0]
        assert twin.features[4].conv.guide_source[0] is not model.features[4].conv.guide_source[0]
        torch.testing.assert_close(twin(x), out)
        features = model.forward_intermediates(x, intermediates_only=True)
        assert [f.shape[1] for f in features] == [4, 6, 8]
    model.set_grad_checkpointing(True)
    model.train()
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_registered_network_for_both_kinds_of_turn_is_built_as_its_card_says():
    model = timm.create_model("scnn_p_align_7_guided_canon")
    convs = [m for m in model.modules() if isinstance(m, SortConv2d)]
    assert len(convs) == 6 and all(c.guided and c.sorting == "align" for c in convs)
    guide = model.features[0].conv.orientation_guide
    assert guide.blur.sigma == 4.0 and guide.ramp == 0.02 and model.canonicalize.order == 1
    assert model.state_dict().keys() == timm.create_model("scnn_p_align_7_guided").state_dict().keys()


def test_the_registered_model_is_built_as_its_card_says():
    model = timm.create_model("scnn_p_align_7_guided")
    convs = [m for m in model.modules() if isinstance(m, SortConv2d)]
    assert len(convs) == 6 and all(c.guided and c.sorting == "align" and c.sampling == "polar" for c in convs)
    assert model.features[0].conv.orientation_guide.blur.sigma == 4.0
    with pytest.raises(ValueError, match="scnn_p_align_7_guided is defined by"):
        timm.create_model("scnn_p_align_7_guided", sorting="ring")


@pytest.mark.slow
def test_compile_and_export_compute_what_eager_does():
    model = small_guided()
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), expected)
        torch.testing.assert_close(torch.export.export(model, (x,)).module()(x), expected)


@pytest.mark.slow
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_onnx_export_runs_in_onnxruntime(dynamo):
    onnxruntime = pytest.importorskip("onnxruntime")
    model = small_guided()
    x = torch.randn(2, 1, 28, 28)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (x,), buffer, dynamo=True, input_names=["x"],
                              dynamic_shapes={"x": {0: "batch"}})
        else:
            torch.onnx.export(model, (x,), buffer, dynamo=False, opset_version=18, input_names=["x"],
                              dynamic_axes={"x": {0: "batch"}})
    session = onnxruntime.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    for batch in (x, torch.randn(3, 1, 28, 28)):
        with torch.no_grad():
            expected = model(batch)
        (out,) = session.run(None, {"x": batch.numpy()})
        torch.testing.assert_close(torch.from_numpy(out), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size_in,size_out", [(28, 14), (28, 7), (29, 14), (15, 7), (7, 7), (5, 9), (224, 56)])
def test_the_guides_pooling_in_standard_operators_is_adaptive_average_pooling(size_in, size_out):
    x = torch.randn(2, 1, size_in, size_in + 3, dtype=torch.float64)
    rows, columns = area_matrix(size_in, size_out, x.dtype), area_matrix(size_in + 3, size_out + 1, x.dtype)
    torch.testing.assert_close(rows @ x @ columns.t(), F.adaptive_avg_pool2d(x, (size_out, size_out + 1)))


def test_combinations_the_guide_cannot_serve_are_refused_at_construction():
    with pytest.raises(ValueError, match="guided=True .* needs sorting='align'.*got sorting='ring'"):
        SortConv2d(2, 4, 3, sorting="ring", guided=True)
    with pytest.raises(ValueError, match="guide_blur=4.0 .* needs sorting='align'.*got sorting='align-channel'"):
        SCNN(sorting="align-channel", guide_blur=4.0)
    with pytest.raises(ValueError, match="guide_blur must be a blur of >= 0 pixels"):
        SCNN(sorting="align", guide_blur=-1)
    model = timm.create_model("resnet10t")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="needs sorting='align'"):
        sortify(model, sorting="ring", guide_blur=4.0)
    with pytest.raises(ValueError, match="guide source 'nope' is not a module"):
        sortify(model, sorting="align", guide_blur=4.0, guide_source="nope")
    with pytest.raises(ValueError, match="guide_source='conv1' .* needs guide_blur > 0"):
        sortify(model, sorting="align", guide_source="conv1")
    assert not any(isinstance(m, SortConv2d) for m in model.modules())
    assert all(torch.equal(before[key], value) for key, value in model.state_dict().items())


def test_a_ramp_without_a_guide_or_a_canonical_turn_is_refused_at_construction():
    with pytest.raises(ValueError, match="guide_ramp=0.02 is fixed along the \\+x axis.*canonicalize='moment1'"):
        SCNN(sorting="align", guide_blur=4.0, guide_ramp=0.02)
    with pytest.raises(ValueError, match="guide_ramp=0.02 .* needs guide_blur > 0"):
        SCNN(sorting="align", canonicalize="moment1", guide_ramp=0.02)
    for bad in (-0.1, float("nan"), True, "0.02"):
        with pytest.raises(ValueError, match="guide_ramp must be a slope >= 0 a pixel"):
            SCNN(sorting="align", guide_blur=4.0, canonicalize="moment1", guide_ramp=bad)
    with pytest.raises(ValueError, match="guide_ramp must be a slope"):
        OrientationGuide(2.0, ramp=-1)
    model = timm.create_model("resnet10t")
    with pytest.raises(ValueError, match="fixed along the \\+x axis"):
        sortify(model, sorting="align", guide_blur=4.0, guide_ramp=0.02)
    assert not any(isinstance(m, SortConv2d) for m in model.modules())
    with pytest.raises(ValueError, match="fixed along the \\+x axis"):
        attach_guide(nn.Sequential(SortConv2d(1, 2, 3, sorting="align")), ramp=0.02)
    assert check_guide_ramp(0, 0.0, None) == 0.0


def test_attach_guide_refuses_what_it_cannot_guide():
    mixed = nn.Sequential(SortConv2d(1, 2, 3, sorting="align"), SortConv2d(2, 2, 3, sorting="align-channel"))
    with pytest.raises(ValueError, match="sorting='align-channel' .* cannot take: 1"):
        attach_guide(mixed)
    with pytest.raises(ValueError, match="no SortConv2d with sorting='align'"):
        attach_guide(nn.Sequential(SortConv2d(1, 2, 3, sorting="ring")))
    net = two_layers()
    with pytest.raises(ValueError, match="guided already"):
        attach_guide(net)


def test_a_guided_layer_called_alone_says_why_it_cannot_run():
    layer = SortConv2d(1, 2, 3, sorting="align", guided=True)
    with pytest.raises(RuntimeError, match="no orientation guide; attach one"):
        layer(torch.randn(1, 1, 8, 8))
    net = two_layers()
    with pytest.raises(RuntimeError, match="no orientation guide yet"):
        net[2](torch.randn(1, 4, 8, 8))
    net(torch.randn(2, 2, 8, 8))
    with pytest.raises(RuntimeError, match="made from 2 image\\(s\\), this layer has 3"):
        net[2](torch.randn(3, 4, 8, 8))


def test_scripting_an_unguided_layer_still_works():
    layer = SortConv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 8, 8)
    torch.testing.assert_close(torch.jit.script(layer)(x), layer(x))
