"""The registered models: timm's conventions, exact quarter-turn invariance of the SC models, twins."""
import warnings

import pytest
import timm
import torch
import torch.nn as nn
from timm.layers import DropBlock2d, DropPath
from timm.models import FeatureListNet, group_parameters

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv import SortConv2d, quarter_turn_check
from timm_sortconv.grid import CentredConv2d, CentredMaxPool2d
from timm_sortconv.hub import bundled_weights_dir
from timm_sortconv.models.scnn import SCNN
from conftest import quick_first, randomise_batchnorm

SCNNS = [f"scnn_{v}_{k}" for v in ("s_gs", "s_rs", "p_gs", "p_rs") for k in (3, 5, 7)]
SCNN_BASELINES = [f"scnn_baseline_{k}" for k in (3, 5, 7)]
RI = ["ri_vgg16", "ri_resnet18", "ri_densenet40"]
RI_BASELINES = [f"{name}_baseline" for name in RI]
ALL = SCNNS + SCNN_BASELINES + RI + RI_BASELINES
# One SC model per family, and input sides at which, with PyTorch's grids (stride_align="corner", the paper's
# networks), every stride and pooling tiles the map, so a quarter turn maps each layer's grid onto itself.
FAMILIES = {"scnn_p_rs_3": 28, "ri_vgg16": 32, "ri_resnet18": 18, "ri_densenet40": 15}
# Every registered SC entrypoint, its default input side, and three other sides of both parities.
BEYOND_THE_PAPER = ["scnn_p_rs_7_canon", "scnn_p_c2_7_canon", "scnn_p_rs_7_blur", "scnn_p_rs_7_early_canon",
                    "scnn_p_align_7_guided", "scnn_p_align_7_guided_canon"]
SC_ENTRYPOINTS = SCNNS + BEYOND_THE_PAPER + RI
OTHER_SIZES = {28: (27, 30, 33), 128: (127, 130, 97)}
# Small inputs every family accepts (RI-VGG16 pools five times).
SMALL = {"scnn": 28, "ri_vgg16": 32, "ri_resnet18": 16, "ri_densenet40": 16}


def _small_size(name):
    return SMALL["scnn" if name.startswith("scnn") else name.replace("_baseline", "")]


def _baseline(name):
    return f"scnn_baseline_{name[-1]}" if name.startswith("scnn") else f"{name}_baseline"


def _num_params(model):
    return sum(p.numel() for p in model.parameters())


def _quarter_turn_error(model, x):
    """Largest change of the logits over the three quarter turns, relative to their size."""
    with torch.no_grad():
        out = model(torch.cat([torch.rot90(x, k, (2, 3)) for k in range(4)]))
    out = out.view(4, x.shape[0], -1)
    return (out[1:] - out[0]).abs().max().item() / out[0].abs().max().item()


def test_registry_holds_every_entrypoint():
    assert sorted(timm.list_models("scnn_*")) == sorted(SCNNS + SCNN_BASELINES + BEYOND_THE_PAPER)
    assert sorted(timm.list_models("ri_*")) == sorted(RI + RI_BASELINES)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCNNS + SCNN_BASELINES)
def test_scnn_trains_at_its_input_size_with_any_classes_and_channels(name):
    model = timm.create_model(name, num_classes=7, in_chans=2)
    assert model.pretrained_cfg["input_size"] == (1, 28, 28)
    out = model(torch.randn(1, 2, 28, 28))
    assert out.shape == (1, 7)
    out.logsumexp(1).sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


# Full 128x128 training steps of RI-VGG16 and RI-ResNet18 take seconds each with the reference
# operator; they run at 32x32, which goes through every layer the same way.
@pytest.mark.slow
@pytest.mark.parametrize("name, size", [("ri_densenet40", 128), ("ri_densenet40_baseline", 128), ("ri_vgg16", 32),
                                        ("ri_vgg16_baseline", 32), ("ri_resnet18", 32), ("ri_resnet18_baseline", 32)])
def test_ri_models_train_with_any_classes_and_channels(name, size):
    model = timm.create_model(name, num_classes=24, in_chans=1)
    assert model.pretrained_cfg["input_size"][1:] == (128, 128)
    out = model(torch.randn(1, 1, size, size))
    assert out.shape == (1, 24)
    out.logsumexp(1).sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


@pytest.mark.slow
@pytest.mark.parametrize("name", SCNNS)
def test_scnn_logits_are_exactly_invariant_to_quarter_turns(name):
    torch.manual_seed(0)
    model = timm.create_model(name).double().eval()
    randomise_batchnorm(model)
    assert _quarter_turn_error(model, torch.randn(1, 1, 28, 28, dtype=torch.float64)) < 1e-12


@pytest.mark.parametrize("name", SCNN_BASELINES + RI_BASELINES)
def test_the_plain_twins_are_plain_convolutions_wherever_the_stride_is_one(name):
    """Tools that match the exact type (a converter such as GMR-Conv's, quantization, FLOP counters) see the
    twins as the plain networks they are: every unit-stride convolution is exactly ``nn.Conv2d``; only a strided
    one, whose grid the default ``stride_align="centre"`` centres, is a ``CentredConv2d`` (``nn.Conv2d`` with
    PyTorch's grid)."""
    for align, strided_class in (("centre", CentredConv2d), ("corner", nn.Conv2d)):
        convs = [m for m in timm.create_model(name, stride_align=align).modules() if isinstance(m, nn.Conv2d)]
        assert convs and all(type(m) is (nn.Conv2d if m.stride == (1, 1) else strided_class) for m in convs)
        assert any(m.stride == (1, 1) for m in convs)
    strided = {"ri_resnet18_baseline": 6, "ri_densenet40_baseline": 1}.get(name, 0)  # 3x3 and 1x1 shortcut
    assert sum(type(m) is CentredConv2d for m in timm.create_model(name).modules()) == strided


def _exact_at(name, sizes, **kwargs):
    """Asserts that ``name`` (random weights and BatchNorm statistics) is exactly invariant to quarter turns at
    each of ``sizes`` in float64 (:func:`timm_sortconv.quarter_turn_check`)."""
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs)
    randomise_batchnorm(model)
    for size in sizes:
        check = quarter_turn_check(model, size, batch=1, search=0)
        assert check.error < 1e-10, f"{name} at {size}: {check}"


@pytest.mark.parametrize("name", quick_first(["scnn_p_rs_7", "scnn_p_c2_7_canon"] + [
    name for name in SC_ENTRYPOINTS if name not in ("scnn_p_rs_7", "scnn_p_c2_7_canon")], 2))
def test_every_sc_entrypoint_is_exact_at_its_default_size_and_three_others(name):
    """The registered networks as they are (their widths, their default input size from ``pretrained_cfg``);
    the 128x128 ones at their default size only here, their other sizes below (slow)."""
    default = timm.create_model(name).pretrained_cfg["input_size"][-1]
    _exact_at(name, (default,) + (OTHER_SIZES[default] if default == 28 else ()))


@pytest.mark.slow
@pytest.mark.parametrize("name", RI)
def test_every_ri_entrypoint_is_exact_at_three_other_sizes(name):
    _exact_at(name, OTHER_SIZES[128])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ri_resnet18", "ri_densenet40"])
@pytest.mark.parametrize("size", [33, 40, 47, 64])
def test_narrow_ri_networks_are_exact_at_sizes_of_both_parities(name, size):
    """The same strided layers as the entrypoints, narrow enough to be quick, at sides whose strided grids are
    off centre with PyTorch's grid (ri_vgg16 has no width option: its other sizes are in the slow test)."""
    widths = {"ri_resnet18": dict(channels=(4, 8, 8, 8), stem_width=4),
              "ri_densenet40": dict(growth_rate=2, block_config=(2, 2, 2), stem_width=4)}[name]
    _exact_at(name, (size,), num_classes=3, **widths)


@pytest.mark.slow
def test_the_paper_grid_is_an_option_and_differs_only_where_the_size_needs_it():
    """``stride_align="corner"`` builds the paper's network (plain pooling and shortcut classes) with the same
    ``state_dict`` keys; at 28x28, where every grid is centred anyway, the two compute the same logits."""
    centre, corner = timm.create_model("ri_resnet18"), timm.create_model("ri_resnet18", stride_align="corner")
    assert type(centre.maxpool) is CentredMaxPool2d and type(corner.maxpool) is nn.MaxPool2d
    assert type(centre.layer2[0].downsample[0]) is CentredConv2d and type(corner.layer2[0].downsample[0]) is nn.Conv2d
    assert centre.layer2[0].conv1.stride_align == "centre" and corner.layer2[0].conv1.stride_align == "corner"
    assert list(centre.state_dict()) == list(corner.state_dict())
    torch.manual_seed(0)
    scnn = timm.create_model("scnn_p_rs_3").double().eval()
    paper = timm.create_model("scnn_p_rs_3", stride_align="corner").double().eval()
    paper.load_state_dict(scnn.state_dict())
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(scnn(x), paper(x))
        assert not torch.allclose(scnn(x[..., 1:, 1:]), paper(x[..., 1:, 1:]))
    with pytest.raises(ValueError, match="stride_align='middle' is not accepted; use 'centre'"):
        timm.create_model("ri_vgg16", stride_align="middle")


@pytest.mark.slow
@pytest.mark.parametrize("name, size", list(FAMILIES.items()))
def test_sc_models_are_invariant_to_quarter_turns_and_their_baselines_are_not(name, size):
    torch.manual_seed(0)
    x = torch.randn(1, 1, size, size, dtype=torch.float64)
    errors = {}
    for model_name in (name, _baseline(name)):
        model = timm.create_model(model_name, in_chans=1, stride_align="corner").double().eval()
        randomise_batchnorm(model)
        errors[model_name] = _quarter_turn_error(model, x)
    assert errors[name] < 1e-12
    assert errors[_baseline(name)] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", SCNNS + RI)
def test_sc_models_sort_every_spatial_convolution_and_match_their_baseline(name):
    model, baseline = timm.create_model(name), timm.create_model(_baseline(name))
    assert _num_params(model) == _num_params(baseline)
    assert [(k, v.shape) for k, v in model.state_dict().items()] == \
           [(k, v.shape) for k, v in baseline.state_dict().items()]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    expected_sorted = {"scnn": 6, "ri_vgg16": 13, "ri_resnet18": 17, "ri_densenet40": 37}[
        "scnn" if name.startswith("scnn") else name]
    assert sum(isinstance(m, SortConv2d) for m in convs) == expected_sorted
    for m in convs:
        assert isinstance(m, SortConv2d) == (m.kernel_size != (1, 1))
    assert not any(isinstance(m, SortConv2d) for m in baseline.modules())


def test_sorted_convs_sorts_the_first_convolutions_and_leaves_the_rest_plain():
    """``sorted_convs=0`` computes what the plain twin computes with the same weights, 6 is the SC network, and 2
    keeps the first two blocks' maps (turning with the input) and makes the four others plain;
    ``scnn_p_rs_7_early_canon`` is P-RS-7 with 2 and the first moment's turn."""
    channels = (4, 4, 8, 8, 8, 8)
    torch.manual_seed(0)
    paper = timm.create_model("scnn_p_rs_3", channels=channels).double().eval()
    randomise_batchnorm(paper)
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    plain = timm.create_model("scnn_baseline_3", channels=channels).double().eval()
    plain.load_state_dict(paper.state_dict())
    outputs = {}
    for n in (0, 2, 6):
        torch.manual_seed(0)
        model = timm.create_model("scnn_p_rs_3", channels=channels, sorted_convs=n).double().eval()
        assert list(model.state_dict()) == list(paper.state_dict())
        model.load_state_dict(paper.state_dict())
        convs = [m.conv for m in model.features if hasattr(m, "conv")]
        assert [isinstance(c, SortConv2d) for c in convs] == [True] * n + [False] * (6 - n)
        with torch.no_grad():
            outputs[n] = model(x)
            if n == 2:
                early = model.features[:2]
                torch.testing.assert_close(early(x), paper.features[:2](x))
                torch.testing.assert_close(early(torch.rot90(x, 1, (2, 3))), torch.rot90(early(x), 1, (2, 3)))
                assert _quarter_turn_error(model, x) > 1e-6  # the plain layers see the turn
    with torch.no_grad():
        torch.testing.assert_close(outputs[0], plain(x))
        torch.testing.assert_close(outputs[6], paper(x), rtol=0, atol=0)
    assert not torch.allclose(outputs[2], outputs[6])
    early = timm.create_model("scnn_p_rs_7_early_canon")
    assert early.canonicalize.order == 1 and _num_params(early) == _num_params(timm.create_model("scnn_baseline_7"))
    assert [isinstance(m.conv, SortConv2d) for m in early.features if hasattr(m, "conv")] == [True] * 2 + [False] * 4
    for bad in (7, -1, 2.0, True):
        with pytest.raises(ValueError, match="sorted_convs must be a whole number of convolutions from 0 to 6"):
            timm.create_model("scnn_p_rs_3", sorted_convs=bad)


def test_scnn_variants_come_from_their_names():
    for name in SCNNS:
        sampling, sorting = name.split("_")[1:3]
        model = timm.create_model(name)
        kernel_sizes = [m.kernel_size[0] for m in model.modules() if isinstance(m, nn.Conv2d)]
        assert kernel_sizes == [int(name[-1])] * 4 + [3, 3]
        assert {(m.sampling, m.sorting) for m in model.modules() if isinstance(m, SortConv2d)} == {
            ({"s": "square", "p": "polar"}[sampling], {"gs": "global", "rs": "ring"}[sorting])}


def test_variant_keywords():
    model = timm.create_model("ri_resnet18", sampling="square", sorting="global")
    assert {(m.sampling, m.sorting) for m in model.modules() if isinstance(m, SortConv2d)} == {("square", "global")}
    with pytest.raises(ValueError, match="scnn_p_rs_7 is defined by sampling='polar', sorting='ring'"):
        timm.create_model("scnn_p_rs_7", sorting="global")
    with pytest.raises(ValueError, match="ri_vgg16_baseline"):
        timm.create_model("ri_vgg16_baseline", sampling="polar")
    with pytest.raises(ValueError, match="together"):
        SCNN(sampling="polar", sorting=None)
    with pytest.raises(ValueError, match="unknown sampling"):
        timm.create_model("ri_densenet40", sampling="hexagonal")


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_builds_with_timm_train_py_arguments_and_describes_itself(name):
    # timm's train.py calls create_model with these; the None values are dropped by timm.
    model = timm.create_model(name, pretrained=False, in_chans=None, num_classes=None, drop_rate=0.1,
                              drop_path_rate=None, drop_block_rate=None, global_pool=None, bn_momentum=0.01,
                              bn_eps=1e-3, scriptable=False, checkpoint_path="")
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert norms and all(m.momentum == 0.01 and m.eps == 1e-3 for m in norms)
    assert model.drop_rate == 0.1

    cfg = model.pretrained_cfg
    for key in ("input_size", "mean", "std", "num_classes", "first_conv", "classifier", "license", "paper_ids",
                "interpolation", "crop_pct", "pool_size"):
        assert cfg.get(key) is not None, key
    assert cfg["tag"] == ("mnist" if name.startswith("scnn") else "nwpu")
    assert cfg["paper_ids"] == "arXiv:2305.14462"
    # A Hub repository is declared exactly for the entrypoints whose weights ship in the package.
    shipped = (bundled_weights_dir() / f"{name}.safetensors").is_file()
    assert cfg.get("hf_hub_id") == (f"timm-sortconv/{name}.mnist" if shipped else None)
    assert cfg["pool_size"] == (cfg["input_size"][1] // model.feature_info[-1]["reduction"],) * 2
    first_conv = model.get_submodule(cfg["first_conv"])
    assert isinstance(first_conv, nn.Conv2d) and first_conv.in_channels == cfg["input_size"][0] == model.in_chans
    assert len(cfg["mean"]) == len(cfg["std"]) == cfg["input_size"][0]
    classifier = model.get_submodule(cfg["classifier"])
    assert classifier is model.get_classifier() and classifier.out_features == cfg["num_classes"] == model.num_classes


@pytest.mark.slow
@pytest.mark.parametrize("name", RI + RI_BASELINES)
def test_outex_tag_sets_channels_and_classes(name):
    outex = timm.create_model(f"{name}.outex")
    assert (outex.in_chans, outex.num_classes) == (1, 24) and outex.pretrained_cfg["mean"] == (0.5,)
    assert outex.get_submodule(outex.pretrained_cfg["first_conv"]).in_channels == 1


def test_stochastic_depth_and_drop_block_in_ri_resnet18():
    model = timm.create_model("ri_resnet18_baseline", drop_path_rate=0.1, drop_block_rate=0.1)
    assert sum(isinstance(m, DropPath) for m in model.modules()) == 7  # all blocks but the first
    assert sum(isinstance(m, DropBlock2d) for m in model.modules()) == 4  # stages 3 and 4


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES) + [_baseline(n) for n in FAMILIES])
def test_head_api(name):
    size = _small_size(name)
    model = timm.create_model(name, in_chans=1).eval()
    x = torch.randn(1, 1, size, size)
    features = model.forward_features(x)
    assert features.shape[1] == model.num_features
    assert model.forward_head(features, pre_logits=True).shape == (1, model.num_features)
    assert isinstance(model.get_classifier(), nn.Linear)
    model.reset_classifier(5)
    assert model.forward_head(features).shape == (1, 5)
    assert model.get_classifier().out_features == 5 and model.num_classes == 5
    model.reset_classifier(0)
    assert model.forward_head(features).shape == (1, model.num_features)
    model.reset_classifier(3, global_pool="catavgmax")
    assert model.forward_head(features, pre_logits=True).shape == (1, 2 * model.num_features)
    assert model(x).shape == (1, 3)
    for coarse in (False, True):  # parameter groups for layer-wise learning-rate decay
        groups = list(group_parameters(model, model.group_matcher(coarse=coarse)).values())
        assert model.pretrained_cfg["first_conv"] + ".weight" in groups[0] and len(groups) > 3
        assert model.pretrained_cfg["classifier"] + ".weight" in groups[-1]


@pytest.mark.parametrize("name", quick_first(list(FAMILIES) + [_baseline(n) for n in FAMILIES]))
def test_features_only_and_forward_intermediates(name):
    size = _small_size(name)
    torch.manual_seed(0)
    model = timm.create_model(name, in_chans=1).eval()
    x = torch.randn(1, 1, size, size)
    info = model.feature_info
    final, intermediates = model.forward_intermediates(x)
    assert torch.equal(final, intermediates[-1])  # every family's last tap is its forward_features output
    assert [t.shape[1] for t in intermediates] == [f["num_chs"] for f in info]
    assert [t.shape[-1] for t in intermediates] == [size // f["reduction"] for f in info]
    # timm's feature extractor, wrapped around the same modules, returns the same tensors
    extractor = FeatureListNet(model, out_indices=tuple(range(len(info))),
                               flatten_sequential=not name.startswith("ri_resnet"))
    assert all(torch.equal(a, b) for a, b in zip(extractor(x), intermediates))

    # "getter" runs forward_intermediates on a pruned model; "fx" traces the model with SortConv2d as a leaf
    feature_classes = {"scnn_p_rs_3": ("list", "getter", "fx"), "ri_densenet40": ("list", "getter", "fx"),
                       "ri_vgg16": ("list", "getter"), "ri_resnet18": ("list", "getter")}.get(name, ("list",))
    for feature_cls in feature_classes:
        features = timm.create_model(name, in_chans=1, features_only=True, feature_cls=feature_cls).eval()
        shapes = [tuple(t.shape[1:]) for t in features(x)]
        assert shapes == [tuple(t.shape[1:]) for t in intermediates], feature_cls
    last_two = timm.create_model(name, in_chans=1, features_only=True, out_indices=(-2, -1))
    assert last_two.feature_info.channels() == [f["num_chs"] for f in info[-2:]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scnn_p_rs_3", "ri_vgg16_baseline", "ri_resnet18_baseline", "ri_densenet40"])
def test_gradient_checkpointing_gives_the_same_gradients(name):
    size = _small_size(name)
    x = torch.randn(2, 1, size, size)
    grads = []
    for enable in (False, True):
        torch.manual_seed(0)
        model = timm.create_model(name, in_chans=1)
        model.set_grad_checkpointing(enable)
        model(x).logsumexp(1).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(*grads))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scnn_p_rs_3", "ri_resnet18"])
def test_traces(name):
    model = timm.create_model(name, in_chans=1).eval()
    size = 28 if name.startswith("scnn") else 18
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model, torch.randn(2, 1, size, size))
    x = torch.randn(3, 1, size, size)
    assert torch.allclose(traced(x), model(x), atol=1e-5)


# Two of the bundled weights in the quick loop, every one in the full suite.
BUNDLED = [name if name in ("scnn_p_rs_7", "scnn_p_c2_7_canon") else pytest.param(name, marks=pytest.mark.slow)
           for name in sorted(path.stem for path in bundled_weights_dir().glob("*.safetensors"))]


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_weights_compute_what_they_were_trained_with(name):
    """The bundled MNIST weights were trained with PyTorch's grids at 28x28, where the centred grids (the
    default) read exactly the same pixels: the logits on the shipped sample's test digits are equal, bit for bit,
    so every measured accuracy of these weights holds for the default models."""
    from timm_sortconv.data import mnist_sample_dir, read_idx

    images = torch.from_numpy(read_idx(mnist_sample_dir() / "t10k-images-idx3-ubyte.gz")[:32].copy())
    x = ((images.float() / 255 - 0.1307) / 0.3081).unsqueeze(1)
    default = timm.create_model(name, pretrained=True).eval()
    paper = timm.create_model(name, pretrained=True, stride_align="corner").eval()
    with torch.no_grad():
        assert torch.equal(default(x), paper(x))
