"""The SCNN options of ``scripts/research/scnn_options.py`` (blur, blurred and average downsampling, padding modes,
the input's normalisation, the aligned layers' guide)
and the moment strength of ``ablation.py``.

The properties asserted (the low-pass layers themselves are the package's, tests/test_antialias.py): the options,
put into a built SCNN, keep its parameters, its ``state_dict`` keys and its exact quarter-turn
invariance, and change what it computes as the same layers built in would; the moment strength ignores turns
and separates an oriented shape from a round one.
"""

import pytest
import timm
import torch
import torch.nn as nn

import timm_sortconv  # noqa: F401  (registers the models)
from conftest import randomise_batchnorm
from timm_sortconv.grid import CentredAvgPool2d
from timm_sortconv.rotation import rotate

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def options():
    import scnn_options
    return scnn_options


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def quarter_turn_error(model, x):
    with torch.no_grad():
        out = model(torch.cat([torch.rot90(x, t, (2, 3)) for t in range(4)])).view(4, x.shape[0], -1)
    return ((out[1:] - out[0]).abs().max() / out[0].abs().max()).item()


@pytest.mark.parametrize("name, kwargs", [
    *[("scnn_p_rs_3", kwargs) for kwargs in (dict(blur_sigma=0.7), dict(downsample="blur-max"),
                                              dict(downsample="blur-avg"), dict(downsample="avg"),
                                              dict(blur_sigma=(0.7, 0, 0, 0, 0, 0)), dict(padding_mode="replicate"))],
])
def test_options_keep_parameters_and_exact_quarter_turn_invariance(options, name, kwargs):
    own = {key: value for key, value in kwargs.items() if key not in options.OPTIONS}
    torch.manual_seed(0)
    paper = options.create_model(name, channels=(4, 4, 8, 8, 8, 8), **own)
    torch.manual_seed(0)
    model = options.create_model(name, channels=(4, 4, 8, 8, 8, 8), **kwargs).double().eval()
    assert list(model.state_dict()) == list(paper.state_dict())  # the filters are fixed buffers, not saved
    assert all(torch.equal(a, b.double()) for a, b in zip(model.parameters(), paper.parameters()))  # same draw
    randomise_batchnorm(model)
    x = randn(2, 1, 28, 28)
    assert quarter_turn_error(model, x) < 1e-12
    paper = paper.double().eval()
    paper.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(model(x), paper(x))


def test_average_downsampling_is_the_centred_pooling_of_the_model_grid(options):
    model = options.create_model("scnn_p_rs_3", channels=(2,) * 6, downsample="avg")
    assert [type(m) for m in model.features if isinstance(m, nn.AvgPool2d)] == [CentredAvgPool2d] * 2
    corner = options.create_model("scnn_p_rs_3", channels=(2,) * 6, downsample="avg", stride_align="corner")
    assert [type(m) for m in corner.features if isinstance(m, nn.AvgPool2d)] == [nn.AvgPool2d] * 2
    assert all(m.stride_align == "corner" for m in options.create_model(
        "scnn_p_rs_3", channels=(2,) * 6, downsample="blur-max", stride_align="corner").features
        if isinstance(m, options.BlurPool2d))


def test_padding_mode_and_blur_compute_what_the_layers_built_in_compute(options):
    """The surgery gives each block's convolution the padding of a convolution built with that mode, and the blur
    runs before it."""
    torch.manual_seed(0)
    model = options.create_model("scnn_baseline_3", channels=(2,) * 6, padding_mode="reflect",
                                 blur_sigma=(0.5, 0, 0, 0, 0, 0)).double().eval()
    block = model.features[0]
    assert list(dict(block.named_children())) == ["pre", "conv", "bn", "act"]
    built = nn.Conv2d(1, 2, 3, padding=1, bias=False, padding_mode="reflect").double()
    built.weight.data.copy_(block.conv.weight)
    x = randn(1, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(block.conv(x), built(x))
        torch.testing.assert_close(block(x), block.act(block.bn(built(options.GaussianBlur2d(0.5)(x)))))


@pytest.mark.parametrize("kwargs, match", [
    (dict(blur_sigma=-1), "blur_sigma"), (dict(blur_sigma=(1, 2)), "six"),
    (dict(downsample="median"), r"downsample='median' is not accepted; use one of 'max', 'avg', 'blur-max', 'blur-avg'"),
    (dict(padding_mode="edge"), "padding_mode='edge' is not accepted"),
    (dict(input_norm="imagenet"), r"input_norm='imagenet' is not accepted; use one of \('model', 'unit'\)"),
])
def test_bad_options_are_refused_before_anything_changes(options, kwargs, match):
    model = timm.create_model("scnn_p_rs_3", channels=(2,) * 6)
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=match):
        options.apply_options(model, **kwargs)
    assert [type(m) for m in model.modules()] == before
    with pytest.raises(ValueError, match="'avg' or 'max'"):
        options.BlurPool2d("min")
    with pytest.raises(ValueError, match="are for SCNN models, got SortResNet"):
        options.create_model("ri_resnet18", blur_sigma=0.5)


def test_unit_input_norm_puts_the_background_at_the_padding_value(options):
    """With the pixels on [0, 1] a blank image is 0 everywhere, what the first layer pads with: its response is 0
    (no frame); with MNIST's normalisation the border rows answer the padding and differ from the middle."""
    import ablation
    torch.manual_seed(0)
    unit = options.create_model("scnn_p_rs_3", channels=(2,) * 6, input_norm="unit").double().eval()
    torch.manual_seed(0)
    paper = timm.create_model("scnn_p_rs_3", channels=(2,) * 6).double().eval()
    assert list(unit.state_dict()) == list(paper.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(unit.parameters(), paper.parameters()))
    assert (unit.pretrained_cfg["mean"], unit.pretrained_cfg["std"]) == ((0.0,), (1.0,))
    assert paper.pretrained_cfg["mean"] == (0.1307,)  # the cfg is a copy: other models keep theirs
    assert timm.create_model("scnn_p_rs_3").pretrained_cfg["std"] == (0.3081,)
    blank = torch.zeros(1, 28, 28, dtype=torch.uint8)
    with torch.no_grad():
        framed = paper.features[0].conv(ablation.normalise(blank, paper.pretrained_cfg).double())
        assert torch.equal(unit.features[0].conv(ablation.normalise(blank, unit.pretrained_cfg).double()),
                           torch.zeros_like(framed))
    assert not torch.allclose(framed[..., 0, :], framed[..., 14, :])
    # the bare class (ablation.py's "scnn") takes it too, MNIST's normalisation otherwise
    bare = dict(kernel_size=3, channels=(2,) * 6)
    assert ablation.create_model("scnn", dict(bare, input_norm="unit")).pretrained_cfg["mean"] == (0.0,)
    assert ablation.create_model("scnn", bare).pretrained_cfg["mean"] == (0.1307,)


def test_options_and_model_arguments_are_told_apart(options):
    assert options.split_options(dict(channels=(2,) * 6, blur_sigma=0.5, sorting="c2")) == (
        dict(channels=(2,) * 6, sorting="c2"), dict(blur_sigma=0.5))
    model = options.create_model("scnn", kernel_size=3, sorting="c2", channels=(2,) * 6, downsample="avg")
    assert model.features[0].conv.sorting == "c2"


def digits(n=16):
    """``n`` normalised test digits of the bundled MNIST sample, ``(n, 1, 28, 28)`` float64."""
    from timm_sortconv.data import create_dataset, mnist_sample_dir

    data = create_dataset("sortconv/mnist", root=str(mnist_sample_dir()), split="test")
    return (data.images[:n].to(torch.float64).unsqueeze(1) / 255.0 - 0.1307) / 0.3081


@pytest.mark.parametrize("order", [1, 2, 4])
def test_moment_strength_ignores_turns_and_lies_in_the_unit_interval(order):
    from ablation import moment_strength

    x = digits()
    base = moment_strength(x, order)
    assert ((base >= 0) & (base <= 1)).all() and base.max() > 0
    torch.testing.assert_close(moment_strength(torch.rot90(x, 1, (2, 3)), order), base)  # exact turn
    # a turn between the quarter turns resamples the image: the strength moves by interpolation only
    turned = (rotate(x * 0.3081 + 0.1307, 30.0) - 0.1307) / 0.3081  # as MNIST-rot turns a digit: black fill
    assert (moment_strength(turned, order) - base).abs().median() < 0.1 * base.median()


def test_moment_strength_of_a_bar_a_square_and_a_blank_image():
    from ablation import moment_strength

    x = torch.zeros(3, 1, 15, 15, dtype=torch.float64)
    x[0, 0, 7, 2:13] = 1.0  # a bar has a principal axis
    x[1, 0, 4:11, 4:11] = 1.0  # a square has none (order 2), but has an order-4 direction
    s2, s4 = moment_strength(x, 2), moment_strength(x, 4)
    assert s2[0] > 0.2 and s2[1] < 1e-6 and s4[1] > 0.05
    assert s2[2] == 0.0 and s4[2] == 0.0
    with pytest.raises(ValueError, match="N, C, H, W"):
        moment_strength(x[0])
