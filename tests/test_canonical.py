"""Moment canonicalization (``timm_sortconv.canonical``) and the per-image turn it uses (``rotate_each``):
the angle follows a turn of the input, the canonical images of all turns of a digit agree, an SCNN with it
keeps exact quarter-turn invariance and gains invariance between the quarter turns, gradients reach the
input, and it survives scripting, tracing, compiling and export."""
import math
import warnings

import pytest
import timm
import torch
import torch.nn as nn

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv import SortConv2d, sortify
from timm_sortconv.canonical import CANONICALIZERS, PADDING_MODES, MomentCanonicalize2d, canonical_frame, \
    canonical_size, create_canonicalizer, moment_angle, moment_terms
from timm_sortconv.data import create_dataset, mnist_sample_dir
from timm_sortconv.rotation import rotate, rotate_each

pytestmark = pytest.mark.usefixtures("one_thread")

MEAN, STD = 0.1307, 0.3081


def digits(n=16):
    """``n`` normalised test digits of the bundled MNIST sample, ``(n, 1, 28, 28)`` float64."""
    data = create_dataset("sortconv/mnist", root=str(mnist_sample_dir()), split="test")
    x = data.images[:n].to(torch.float64).unsqueeze(1) / 255.0
    return (x - MEAN) / STD


def turned(x, angle):
    """``x`` turned as MNIST-rot turns a digit: in pixel space, zero (black) fill, then normalised again."""
    return (rotate(x * STD + MEAN, angle) - MEAN) / STD


def wrapped(delta, period):
    """``delta`` (degrees) brought to ``(-period / 2, period / 2]``."""
    return torch.remainder(delta + period / 2, period) - period / 2


def test_rotate_each_matches_rotate_and_rot90():
    x = torch.rand(3, 2, 9, 9, dtype=torch.float64)
    out = rotate_each(x, torch.tensor([90.0, 33.0, -180.0]))
    assert torch.allclose(out[0], torch.rot90(x[0], 1, dims=(-2, -1)), atol=1e-12)
    assert torch.allclose(out[1:2], rotate(x[1:2], 33.0), atol=1e-12)
    assert torch.allclose(out[2], torch.rot90(x[2], 2, dims=(-2, -1)), atol=1e-12)
    # border fill: a constant image stays constant under any turn
    ones = torch.ones(1, 1, 8, 8)
    assert torch.allclose(rotate_each(ones, torch.tensor([20.0]), padding_mode="border"), ones)
    assert rotate_each(ones, torch.tensor([20.0]))[0, 0, 0, 0] < 1  # zeros fill


@pytest.mark.parametrize("images, angles, match", [
    (torch.rand(2, 8, 8), torch.zeros(2), "shape \\(N, C, H, W\\)"),
    (torch.rand(2, 1, 8, 8), torch.zeros(3), "one angle per image"),
])
def test_rotate_each_bad_input(images, angles, match):
    with pytest.raises(ValueError, match=match):
        rotate_each(images, angles)


@pytest.mark.parametrize("order", [1, 2, 4])
def test_moment_angle_follows_the_turn_of_the_image(order):
    x = digits()
    base = moment_angle(x, order)
    period = 360.0 / order
    for angle in (10.0, 45.0, 70.0, 90.0):
        moved = moment_angle(turned(x, angle), order)
        err = wrapped(moved - base - angle, period).abs()
        # interpolation moves the estimate a little; order 1 (the centroid) is the least stable
        assert err.median() < (1.5 if order == 1 else 0.5), (angle, err)
    assert base.abs().max() <= 180.0 / order + 1e-9


def test_moment_angle_of_a_bar_and_of_a_blank_image():
    x = torch.zeros(2, 3, 15, 15)
    x[0, :, 7, 2:13] = 1.0  # horizontal bar: principal axis at 0 degrees
    angles = moment_angle(torch.cat([rotate(x[:1], 30), x[1:]]), order=2)
    assert abs(angles[0].item() - 30.0) < 1.0
    assert angles[1].item() == 0.0  # no orientation to read: no turn
    # an image too small for the disc has no orientation either: the same image back, nothing undefined
    tiny = torch.tensor([[[[0.7]]]])
    assert moment_angle(tiny).item() == 0.0
    assert torch.equal(MomentCanonicalize2d()(tiny), tiny)


@pytest.mark.parametrize("order", [1, 2, 4])
def test_moment_terms_sum_to_the_moment_whose_argument_is_the_angle(order):
    """The per-pixel terms of c_k: zero outside the disc, and their sum's argument over k is the moment angle."""
    x = digits(4)
    real, imag = moment_terms(x, order)
    assert real.shape == imag.shape == (4, 28, 28) and real.dtype == torch.float64
    assert (real[:, 0, 0] == 0).all() and (imag[:, 0, 0] == 0).all()  # a corner lies outside the inscribed disc
    angle = torch.rad2deg(torch.atan2(imag.sum((1, 2)), real.sum((1, 2)))) / order
    torch.testing.assert_close(angle, moment_angle(x, order))
    with pytest.raises(ValueError, match="N, C, H, W"):
        moment_terms(x[0])


def test_canonicalizer_takes_one_unbatched_image_and_angles_on_another_device():
    x = digits(2).float()
    canon = MomentCanonicalize2d(2)
    assert torch.allclose(canon(x[0]), canon(x)[0], atol=1e-6)
    # the turn follows the images' device (here "meta", standing in for a GPU), whatever the angles' device
    out = rotate_each(torch.empty(2, 1, 8, 8, device="meta"), torch.tensor([30.0, 60.0]))
    assert out.device.type == "meta" and out.shape == (2, 1, 8, 8)


@pytest.mark.parametrize("order", [1, 2, 4])
def test_canonical_images_of_all_turns_agree_up_to_the_leftover_quarter_turns(order):
    x = digits(8)
    canon = MomentCanonicalize2d(order)
    ref = canon(x)
    leftovers = {1: (0,), 2: (0, 2), 4: (0, 1, 2, 3)}[order]
    for angle in (20.0, 45.0, 100.0):
        out = canon(turned(x, angle))
        # distance to the nearest quarter turn of the upright digit's canonical image, relative to its size
        dist = torch.stack([(out - torch.rot90(ref, t, (2, 3))).flatten(1).norm(dim=1) for t in leftovers]).min(0).values
        rel = dist / ref.flatten(1).norm(dim=1)
        plain = (turned(x, angle) - x).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
        assert rel.median() < 0.25 and (rel < plain).all(), (angle, rel, plain)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CANONICALIZERS))
def test_scnn_with_canonicalize_keeps_its_parameters_and_exact_quarter_turns(name):
    torch.manual_seed(0)
    paper = timm.create_model("scnn_p_rs_3")
    model = timm.create_model("scnn_p_rs_3", canonicalize=name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in paper.named_parameters()]
    model.load_state_dict(paper.state_dict())  # nothing new to save
    model = model.double().eval()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        out = model(torch.cat([torch.rot90(x, t, (2, 3)) for t in range(4)])).view(4, 2, -1)
    # the canonical turn of a quarter-turned image is computed anew: equal up to rounding, not bit-exact
    assert (out[1:] - out[0]).abs().max() < 1e-9 * out.abs().max()


def test_canonicalize_makes_the_sweep_flat_between_the_quarter_turns():
    """An untrained SCNN already changes its logits between the quarter turns; turned to the principal
    axis first, clearly less (what is left is the interpolation of the two turns)."""
    torch.manual_seed(0)
    plain = timm.create_model("scnn_p_rs_3", channels=(8, 8, 8, 8, 8, 8)).double().eval()
    canon = timm.create_model("scnn_p_rs_3", channels=(8, 8, 8, 8, 8, 8), canonicalize="moment2").double().eval()
    canon.load_state_dict(plain.state_dict())
    x = digits(16)
    with torch.no_grad():
        for angle in (30.0, 45.0):
            errs = []
            for model in (plain, canon):
                a, b = model.forward_features(x), model.forward_features(turned(x, angle))
                errs.append(((b.mean((2, 3)) - a.mean((2, 3))).norm(dim=1) / a.mean((2, 3)).norm(dim=1)).median())
            assert errs[1] < 0.7 * errs[0], (angle, errs)


@pytest.mark.slow
def test_canonicalize_passes_gradients_to_the_input_and_to_the_weights():
    model = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4), canonicalize="moment2")
    x = digits(4).float().requires_grad_(True)
    model(x).logsumexp(1).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    # with the angle held fixed the turn is linear in the image: gradcheck that map
    y = digits(2)[:, :, 6:18, 6:18].clone().requires_grad_(True)
    angles = moment_angle(y, 2).detach()
    assert torch.autograd.gradcheck(lambda t: rotate_each(t, -angles, "border"), (y,))


@pytest.mark.slow
def test_canonicalize_survives_script_trace_compile_and_export():
    torch.manual_seed(0)
    model = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4), canonicalize="moment2").eval()
    x = digits(3).float()
    with torch.no_grad():
        expected = model(turned(x.double(), 25.0).float())
        inp = turned(x.double(), 25.0).float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scripting's and tracing's deprecation and constant-size notices
            scripted = torch.jit.script(model)
            traced = torch.jit.trace(model, (x,))
        assert torch.allclose(scripted(inp), expected, atol=1e-5)
        assert torch.allclose(traced(inp), expected, atol=1e-5)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert torch.allclose(compiled(inp), expected, atol=1e-5)
        exported = torch.export.export(model, (x,))
        assert torch.allclose(exported.module()(inp), expected, atol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (dict(order=0), "order must be an int >= 1"), (dict(order=2.0), "order must be an int >= 1"),
    (dict(padding_mode="edge"), "padding_mode must be 'border', 'zeros' or 'reflection'"),
])
def test_bad_canonicalizer_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        MomentCanonicalize2d(**bad)


def test_bad_canonicalize_name_names_the_accepted_ones():
    with pytest.raises(ValueError, match=r"canonicalize must be None or one of \['moment1', 'moment2', 'moment4'\]"):
        timm.create_model("scnn_p_rs_3", canonicalize="pca")
    assert isinstance(create_canonicalizer(None), torch.nn.Identity)
    with pytest.raises(ValueError, match="shape \\(N, C, H, W\\)"):
        moment_angle(torch.rand(8, 8))


def test_canonical_entrypoint_is_p_rs_7_with_moment2():
    model = timm.create_model("scnn_p_rs_7_canon", channels=(2, 2, 2, 2, 2, 2))
    assert isinstance(model.canonicalize, MomentCanonicalize2d) and model.canonicalize.order == 2
    assert model.features[0].conv.sampling == "polar" and model.features[0].conv.sorting == "ring"
    assert math.isclose(sum(p.numel() for p in model.parameters()),
                        sum(p.numel() for p in timm.create_model("scnn_p_rs_7", channels=(2,) * 6).parameters()))


def test_a_convolution_does_not_turn_its_input_and_says_where_the_turn_goes():
    with pytest.raises(TypeError, match=r"SortConv2d\(canonicalize='moment2'\): a convolution does not turn its "
                                        r"input; put timm_sortconv.canonical.MomentCanonicalize2d in front"):
        SortConv2d(1, 4, 5, padding=2, canonicalize="moment2")


@pytest.mark.slow
def test_sortify_canonicalize_turns_the_input_in_front_of_the_model():
    """On a timm or torchvision model the turn is a module in front of the model (``model.canonicalize``, no
    parameters, applied before ``forward``), not an attribute of a convolution."""
    torch.manual_seed(0)
    model = timm.create_model("resnet18", num_classes=3)
    keys = set(model.state_dict())
    model, report = sortify(model, canonicalize="moment2", return_report=True)
    assert isinstance(model.canonicalize, MomentCanonicalize2d) and model.canonicalize.order == 2
    assert report.canonicalize == "moment2" and "input turned first: canonicalize='moment2'" in str(report)
    assert set(model.state_dict()) == keys
    assert not any(hasattr(m, "canonicalize") for m in model.modules() if isinstance(m, SortConv2d))
    plain = sortify(timm.create_model("resnet18", num_classes=3))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 33, 33)
    with torch.no_grad():
        assert torch.allclose(model.eval()(x), plain.eval()(MomentCanonicalize2d(2)(x)), atol=1e-5)


def test_sortify_canonicalize_sets_the_models_own_input_turn():
    """This package's models apply ``model.canonicalize`` themselves (forward_features and intermediates too):
    sortify fills that slot."""
    model = sortify(timm.create_model("scnn_baseline_3", channels=(2,) * 6), canonicalize="moment4")
    assert isinstance(model.canonicalize, MomentCanonicalize2d) and model.canonicalize.order == 4
    assert not model._forward_pre_hooks


def test_sortify_refuses_to_turn_a_model_that_turns_its_input_already():
    model = timm.create_model("scnn_baseline_3", channels=(2,) * 6, canonicalize="moment2")
    with pytest.raises(ValueError, match="the model already turns its input"):
        sortify(model, canonicalize="moment2")
    assert not any(isinstance(m, SortConv2d) for m in model.modules())
    with pytest.raises(ValueError, match="canonicalize must be None or one of"):
        sortify(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1)), canonicalize="moment3")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ri_resnet18", "ri_vgg16", "ri_densenet40"])
def test_every_model_takes_canonicalize_and_applies_it_in_forward_features_and_intermediates(name):
    torch.manual_seed(0)
    kwargs = dict(num_classes=3, in_chans=1)
    model = timm.create_model(name, canonicalize="moment2", **kwargs).eval()
    plain = timm.create_model(name, **kwargs).eval()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(1, 1, 32, 32)
    with torch.no_grad():
        turned_x = MomentCanonicalize2d(2)(x)
        assert torch.allclose(model.forward_features(x), plain.forward_features(turned_x), atol=1e-5)
        last = model.forward_intermediates(x, intermediates_only=True)[-1]
        assert torch.allclose(last, plain.forward_intermediates(turned_x, intermediates_only=True)[-1], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name, size", [("scnn_p_rs_3", 28), ("ri_resnet18", 32)])
def test_features_only_models_canonicalize_first(name, size):
    torch.manual_seed(0)
    feats = timm.create_model(name, features_only=True, in_chans=1, canonicalize="moment2").eval()
    plain = timm.create_model(name, features_only=True, in_chans=1).eval()
    plain.load_state_dict(feats.state_dict())
    x = torch.randn(2, 1, size, size)
    with torch.no_grad():
        for a, b in zip(feats(x), plain(MomentCanonicalize2d(2)(x))):
            assert torch.allclose(a, b, atol=1e-5)


# Inputs of any shape: a non-square image is turned in a frame that holds the circle about it (canonical_size).

def scenes(*parts, angles=None):
    """MNIST digits of the sample side by side, ``(8, 1, 28, 28 * len(parts))`` float64 on [0, 1] with a black (0)
    background: part ``j`` holds digits ``parts[j] .. + 8``, each turned about its own centre by ``angles[j]``."""
    data = create_dataset("sortconv/mnist", root=str(mnist_sample_dir()), split="test")
    digit = lambda start: data.images[start:start + 8].to(torch.float64).unsqueeze(1) / 255.0  # noqa: E731
    return torch.cat([rotate(digit(start), angle) for start, angle in zip(parts, angles or (0.0,) * len(parts))], -1)


@pytest.mark.parametrize("height, width", [(28, 56), (56, 28), (28, 29), (30, 57), (1, 2), (3, 100), (5, 5)])
def test_the_frame_is_the_smallest_that_holds_every_pixel_at_full_weight_centred(height, width):
    frame = canonical_size(height, width)
    if height == width:
        assert frame == (height, width)
        return
    bound = math.hypot(height - 1, width - 1) + 4  # 2 r_max + 4: every pixel 2 pixels inside the disc
    for side, size in zip(frame, (height, width)):
        assert side >= bound and (side - size) % 2 == 0 and side - 2 < bound
    assert canonical_size(width, height) == frame[::-1]


@pytest.mark.parametrize("padding_mode", PADDING_MODES)
@pytest.mark.parametrize("height, width", [(28, 56), (7, 4), (3, 20)])
def test_the_frame_holds_the_input_at_its_centre_and_what_the_turn_reads_outside_it(padding_mode, height, width):
    x = torch.rand(2, 3, height, width, dtype=torch.float64)
    framed = canonical_frame(x, padding_mode)
    rows, columns = canonical_size(height, width)
    top, left = (rows - height) // 2, (columns - width) // 2
    assert framed.shape == (2, 3, rows, columns) and torch.equal(framed[..., top:top + height, left:left + width], x)
    # outside the input: what grid_sample (the turn) reads there, at the same pixel positions
    ys = (torch.arange(rows, dtype=torch.float64) - top) / (height - 1) * 2 - 1
    xs = (torch.arange(columns, dtype=torch.float64) - left) / (width - 1) * 2 - 1
    grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), -1).expand(2, -1, -1, -1)
    read = torch.nn.functional.grid_sample(x, grid, padding_mode=padding_mode, align_corners=True)
    torch.testing.assert_close(framed, read, atol=1e-12, rtol=0)


@pytest.mark.parametrize("order", [1, 2, 4])
@pytest.mark.parametrize("layout, padding_mode", [
    ("pair", "zeros"), ("pair", "border"),  # two digits side by side, 28x56
    ("three", "zeros"),  # three in a row, 28x84
    ("diagonal", "zeros"), ("diagonal", "border"),  # two, one lower right of the other, 42x84: a tilted axis
])
def test_non_square_and_several_part_inputs_keep_all_their_ink(order, layout, padding_mode):
    """Turned inside their own frame, two digits side by side kept 0.86 of their ink; in the frame that holds the
    circle about them, all of it, up to the bilinear turn's rounding, whatever the angle the moment reads."""
    if layout == "diagonal":
        pair = scenes(0, 8, angles=(35.0, 110.0))
        x = torch.zeros(8, 1, 42, 84, dtype=torch.float64)
        x[..., :28, :28], x[..., 14:, 56:] = pair[..., :28], pair[..., 28:]
    else:
        x = scenes(0, 8, 16, angles=(0.0, 200.0, 70.0)) if layout == "three" else scenes(0, 8, angles=(35.0, 110.0))
    background = 0.0 if padding_mode == "zeros" else -MEAN / STD  # "border": normalised, as the models see it
    images = x if padding_mode == "zeros" else (x - MEAN) / STD
    out = MomentCanonicalize2d(order, padding_mode)(images)
    assert out.shape[-2:] == canonical_size(*x.shape[-2:])
    kept = (out - background).sum((1, 2, 3)) / (images - background).sum((1, 2, 3))
    assert (kept > 0.995).all(), kept  # nothing cut
    if padding_mode == "zeros":  # nothing added either ("border" repeats ink that touches the input's edge)
        assert (kept < 1.005).all(), kept
    if layout == "diagonal" or order == 1:  # angles to turn by away from the quarter turns (a row's axis is on one)
        angle = moment_angle(images, order, padding_mode)
        assert (torch.remainder(angle, 90.0) - 45.0).abs().min() < 35.0, angle


def test_the_orientation_is_read_over_the_whole_input():
    """A blob in a corner of a strip, far outside the strip's inscribed disc, sets the direction of the centroid."""
    x = torch.zeros(1, 1, 20, 60, dtype=torch.float64)
    x[0, 0, 1:4, 56:59] = 1.0  # about pixel (2, 57): 27.5 right of the centre, 7.5 above it
    assert abs(moment_angle(x, 1).item() - math.degrees(math.atan2(7.5, 27.5))) < 1e-9
    assert abs(moment_angle(torch.rot90(x, 2, (2, 3)), 1).item() - math.degrees(math.atan2(-7.5, -27.5))) < 1e-9


@pytest.mark.parametrize("order", [1, 2, 4])
@pytest.mark.parametrize("width", [56, 57])
def test_a_half_turn_of_a_non_square_input_gives_its_canonical_image_up_to_the_leftover(order, width):
    """A half turn maps a non-square frame onto itself and adds 180 degrees to the moment's angle: the canonical
    images agree up to the leftover turn of the order (none for order 1, a half turn for 2 and 4)."""
    x = torch.nn.functional.pad(scenes(0, 8, angles=(20.0, 75.0)), (0, width - 56))
    canon = MomentCanonicalize2d(order)
    a, b = canon(x), canon(torch.rot90(x, 2, (2, 3)))
    expected = a if order == 1 else torch.rot90(a, 2, (2, 3))
    assert b.shape == a.shape and (b - expected).abs().max() < 1e-8 * a.abs().max()


@pytest.mark.parametrize("order", [1, 2, 4])
@pytest.mark.parametrize("size", [(28, 28), (28, 56)])
def test_quarter_turns_give_the_canonical_image_up_to_the_leftover_quarter_turns(order, size):
    """Exact equivariance: a square input keeps its frame, and a non-square one whose sides have one parity has a
    square frame, which its quarter turns turn."""
    x = scenes(*range(0, 8 * (size[1] // 28), 8), angles=(15.0, 50.0)[:size[1] // 28])
    canon = MomentCanonicalize2d(order)
    ref = canon(x)
    assert ref.shape[-2:] == canonical_size(*size) and (size[0] != size[1] or ref.shape == x.shape)
    leftovers = {1: (0,), 2: (0, 2), 4: (0, 1, 2, 3)}[order]
    for turn in (1, 2, 3):
        out = canon(torch.rot90(x, turn, (2, 3)))
        error = torch.stack([(out - torch.rot90(ref, t, (2, 3))).flatten(1).abs().amax(1) for t in leftovers])
        assert error.min(0).values.max() < 1e-8 * ref.abs().max(), (turn, error)


@pytest.mark.parametrize("padding_mode", PADDING_MODES)
def test_the_framed_turn_passes_gradients(padding_mode):
    """With the angle held fixed the framed turn is linear in the image: gradcheck it; and a model with the turn
    in front passes gradients from a non-square input to the input and to every weight."""
    from timm_sortconv.rotation import rotate_each

    y = torch.rand(2, 1, 5, 9, dtype=torch.float64, requires_grad=True)
    angles = moment_angle(y, 1, padding_mode).detach()
    assert torch.autograd.gradcheck(lambda t: rotate_each(canonical_frame(t, padding_mode), -angles, padding_mode),
                                    (y,))
    torch.manual_seed(0)
    model = timm.create_model("scnn_p_align_7_guided_canon", channels=(4,) * 6)
    x = scenes(0, 8)[:2].float().requires_grad_(True)
    model(x).logsumexp(1).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_models_take_the_frame_and_their_guide_is_made_in_it():
    """The turn is the first thing a model runs: its guide (made at the first convolution) and its feature maps
    have the frame's size, and the guided model with the turn in front reads a half-turned pair as the pair."""
    torch.manual_seed(0)
    model = timm.create_model("scnn_p_align_7_guided_canon", channels=(4,) * 6).double().eval()
    x = (scenes(0, 8, angles=(30.0, 0.0)) - MEAN) / STD
    with torch.no_grad():
        logits = model(x)
        guide = next(m for m in model.modules() if m.__class__.__name__ == "OrientationGuide")
        assert guide.map.shape[-2:] == canonical_size(28, 56)
        torch.testing.assert_close(model(torch.rot90(x, 2, (2, 3))), logits, atol=1e-6 * logits.abs().max(), rtol=0)
        last = model.forward_intermediates(x, intermediates_only=True)[-1]
        assert last.shape[-2:] == model._forward_intermediates(
            MomentCanonicalize2d(1)(x), None, False, False, "NCHW", True)[-1].shape[-2:]
    plain = sortify(nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1)), canonicalize="moment2")
    assert plain[0](MomentCanonicalize2d(2)(x.float())).shape[-2:] == canonical_size(28, 56)
    assert plain(x.float()).shape == (8, 4, 1, 1)


def test_the_framed_turn_survives_scripting():
    canon = MomentCanonicalize2d(1)
    x = scenes(0, 8)[:2].float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scripting's deprecation notice
        scripted = torch.jit.script(canon)
    torch.testing.assert_close(scripted(x), canon(x))


@pytest.mark.parametrize("call, error, match", [
    (lambda: MomentCanonicalize2d()(torch.rand(28, 56)), ValueError, r"\(N, C, H, W\) or \(C, H, W\), got \[28, 56\]"),
    (lambda: MomentCanonicalize2d()(torch.zeros(1, 1, 28, 56, dtype=torch.uint8)), TypeError,
     r"needs floating-point images: convert them first \(x.float\(\)\)"),
    (lambda: MomentCanonicalize2d()(torch.rand(1, 1, 0, 5)), ValueError, "at least 1x1 pixels"),
    (lambda: moment_angle(torch.rand(1, 1, 4, 0)), ValueError, "at least 1x1 pixels"),
    (lambda: canonical_frame(torch.rand(1, 1, 4, 6), "edge"), ValueError, "padding_mode must be 'border', 'zeros'"),
    (lambda: moment_terms(torch.rand(1, 1, 4, 6), 1, "edge"), ValueError, "padding_mode must be"),
])
def test_what_the_turn_refuses_is_refused_with_what_to_do(call, error, match):
    with pytest.raises(error, match=match):
        call()
