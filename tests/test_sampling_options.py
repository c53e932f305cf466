"""The sampling options beyond the paper's (``ring_density``, ``sampling="polar-offset"``), the fixed
low-pass layers of :mod:`timm_sortconv.lowpass` and the SCNN options built on them.

The properties asserted: the geometry is what the docstring says (points on their circles at their
angles, ``m`` sorted slots per kernel position, the quarter-turn symmetry of the tap tables), the operator
equals a loop written here from the definition, it is exactly equivariant to quarter turns, the fast
backend (run as the larger square kernel) agrees with the reference path in value and gradient, and a
denser ring is measurably closer to invariant under rotations between the quarter turns.
"""
import math
from functools import partial

import pytest
import timm
import torch
import torch.nn as nn

from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv.lowpass import BlurPool2d, GaussianBlur2d, create_downsample, gaussian_kernel1d
from timm_sortconv.ops import available_backends
from timm_sortconv.ops.geometry import get_geometry, polar_points, square_slot_form

pytestmark = pytest.mark.usefixtures("one_thread")

sc = partial(sort_conv2d, backend="reference")
SORTINGS = ("ring", "global")


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def bilinear(image, y, x):
    """``image`` (2-D list, zero outside) at the real point (y, x), by the bilinear formula."""
    y0, x0 = math.floor(y), math.floor(x)
    total = 0.0
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if 0 <= yy < len(image) and 0 <= xx < len(image[0]):
                total += wy * wx * image[yy][xx]
    return total


def naive_dense(image, weight, cy, cx, density, sorting):
    """One output value of a single-channel, single-filter SC with ring density ``density`` (an int, or
    one per ring) at (cy, cx), from the definition: 8r*m_r points on ring r, sorted, runs of m_r averaged,
    laid out as density 1 lays out its sorted values (ring: ring r's positions row-major; global: the
    whole window row-major)."""
    k = len(weight)
    n = k // 2
    per_ring = density if isinstance(density, tuple) else (density,) * n
    rings = {0: [image[cy][cx]] * (density if sorting == "global" else 1)}
    for r in range(1, n + 1):
        count = 8 * r * per_ring[r - 1]
        angles = [2 * math.pi * j / count for j in range(count)]
        rings[r] = [bilinear(image, cy + r * math.sin(a), cx + r * math.cos(a)) for a in angles]

    def runs(values, m):
        values = sorted(values)
        return [sum(values[i:i + m]) / m for i in range(0, len(values), m)]

    out = 0.0
    if sorting == "global":
        averaged = runs([v for r in range(n + 1) for v in rings[r]], density)
        for i, value in enumerate(averaged):
            out += weight[i // k][i % k] * value
        return out
    out += weight[n][n] * rings[0][0]
    for r in range(1, n + 1):
        positions = [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if max(abs(dy), abs(dx)) == r]
        for (dy, dx), value in zip(positions, runs(rings[r], per_ring[r - 1])):
            out += weight[dy + n][dx + n] * value
    return out


# -------------------------------------------------------------------------------------------------------
# Geometry
# -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", (1, 3, 5, 7))
@pytest.mark.parametrize("density", (2, 3))
@pytest.mark.parametrize("sorting", SORTINGS)
def test_dense_geometry_reads_m_points_per_position_and_averages_runs_of_m(k, density, sorting):
    g = get_geometry(k, "polar", sorting, density)
    n = k // 2
    expected = 1 + 4 * n * (n + 1) * density if sorting == "ring" else k * k * density
    assert g.samples == expected == g.tap_offsets.shape[0] == g.interpolation.shape[0]
    # segments tile the samples; each kernel position takes `density` slots (the ring centre one)
    assert g.segments[0][0] == 0 and g.segments[-1][1] == expected
    assert all(a[1] == b[0] for a, b in zip(g.segments, g.segments[1:]))
    counts = torch.bincount(g.slot_to_grid, minlength=k * k)
    centre = n * k + n
    assert counts[centre] == (1 if sorting == "ring" else density)
    assert (torch.cat([counts[:centre], counts[centre + 1:]]) == density).all()
    # runs of m consecutive slots share their kernel position and the scale 1/m
    for start, end in g.segments:
        if end - start > 1:
            assert (g.slot_to_grid[start:end].view(-1, density) == g.slot_to_grid[start:end:density, None]).all()
    if g.samples > 1:
        assert torch.allclose(g.slot_scale[g.slot_to_grid != centre], torch.tensor(1.0 / density, dtype=torch.float64))
    else:  # a 1x1 kernel with ring sorting has no ring to read more densely
        assert g.slot_scale is None
    assert torch.allclose(g.tap_weights.sum(1), torch.ones(expected, dtype=torch.float64))


def test_per_ring_density():
    g = get_geometry(7, "polar", "ring", (3, 2, 1))
    assert g.samples == 81 and g.segments == ((0, 1), (1, 25), (25, 57), (57, 81))
    assert g.slot_scale.tolist() == [1.0] + [1 / 3] * 24 + [1 / 2] * 32 + [1.0] * 24
    assert torch.equal(torch.bincount(g.slot_to_grid, minlength=49)[get_geometry(7).slot_to_grid],
                       torch.tensor([1] + [3] * 8 + [2] * 16 + [1] * 24))
    square, _, _ = square_slot_form(g)
    assert square.kernel_size == 9 and square.segments == g.segments  # 81 samples fill 9 x 9: nothing unused
    assert get_geometry(7, "polar", "ring", [3, 2, 1]) is g
    for bad in ((3, 2), (2, 2, 0)):
        with pytest.raises(ValueError, match="one int >= 1 for each of the 3 rings"):
            get_geometry(7, "polar", "ring", bad)
    with pytest.raises(ValueError, match="sorting='ring'"):
        get_geometry(7, "polar", "global", (3, 2, 1))


@pytest.mark.parametrize("r", (1, 2, 3))
@pytest.mark.parametrize("count_factor", (1, 2, 3))
def test_dense_polar_points_lie_on_the_circle_and_turn_onto_themselves(r, count_factor):
    count = 8 * r * count_factor
    points = polar_points(r, count)
    for j, (y, x) in enumerate(points):
        assert y == pytest.approx(r * math.sin(2 * math.pi * j / count), abs=1e-12)
        assert x == pytest.approx(r * math.cos(2 * math.pi * j / count), abs=1e-12)
        # a quarter turn (y, x) -> (x, -y) lands exactly on the point a quarter of the way on
        assert points[(j + count // 4) % count] == (x, -y)
    assert polar_points(r) == polar_points(r, 8 * r)
    with pytest.raises(ValueError, match="multiple of 4"):
        polar_points(r, 8 * r + 2)


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", SORTINGS)
def test_square_slot_form_holds_the_same_samples_in_a_larger_window(k, sorting):
    g = get_geometry(k, "polar", sorting, 2)
    square, index, scale = square_slot_form(g)
    big = square.kernel_size
    assert big % 2 == 1 and big * big >= g.samples > (big - 2) ** 2
    assert torch.equal(index, g.slot_to_grid) and torch.equal(scale, g.slot_scale)
    # the first samples are g's, read through the same offsets (relative to the centre)
    assert torch.equal(square.tap_offsets[:g.samples], g.tap_offsets)
    assert torch.equal(square.tap_weights[:g.samples], g.tap_weights)
    assert square.segments[:len(g.segments)] == g.segments
    assert all(e - s == 1 for s, e in square.segments[len(g.segments):])
    assert square.sampling != "polar" and str(k) in square.sampling


@pytest.mark.parametrize("kwargs, match", [
    (dict(sampling="square", ring_density=2), "needs a polar sampling"),
    (dict(ring_density=0), "int >= 1"),
    (dict(ring_density=1.5), "int >= 1"),
])
def test_bad_ring_density(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sc(randn(1, 1, 5, 5), randn(1, 1, 3, 3), **kwargs)
    with pytest.raises(ValueError, match=match):
        SortConv2d(1, 1, 3, **kwargs)


# -------------------------------------------------------------------------------------------------------
# Operator
# -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k, density, sorting", [(k, m, s) for k in (3, 5) for m in (2, 3) for s in SORTINGS]
                         + [(5, (2, 1), "ring"), (5, (1, 3), "ring"), (7, (3, 2, 1), "ring")])
def test_dense_operator_agrees_with_the_definition(k, density, sorting):
    image, weight = randn(1, 1, 7, 6, seed=k), randn(1, 1, k, k, seed=k + 1)
    out = sc(image, weight, padding=k // 2, sorting=sorting, ring_density=density)
    rows, w = image[0, 0].tolist(), weight[0, 0].tolist()
    for cy in range(7):
        for cx in range(6):
            assert out[0, 0, cy, cx].item() == pytest.approx(naive_dense(rows, w, cy, cx, density, sorting), abs=1e-12)


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", SORTINGS)
def test_dense_operator_is_exactly_equivariant_to_quarter_turns(k, sorting):
    x, weight, bias = randn(2, 3, 11, 11, seed=k), randn(4, 3, k, k, seed=k + 1), randn(4, seed=k + 2)
    for backend in ["reference"] + [b for b in ("cpu",) if b in available_backends()]:
        out = sort_conv2d(x, weight, bias, padding=k // 2, sorting=sorting, ring_density=2, backend=backend)
        for turns in (1, 2, 3):
            turned = sort_conv2d(torch.rot90(x, turns, (2, 3)), weight, bias, padding=k // 2, sorting=sorting,
                                 ring_density=2, backend=backend)
            assert (turned - torch.rot90(out, turns, (2, 3))).abs().max() < 1e-12, backend


@pytest.mark.parametrize("sorting", SORTINGS)
def test_dense_rings_change_less_under_rotation_between_quarter_turns(sorting):
    """The point of a denser ring: on a smooth image rotated by 20 degrees about a pixel, the sorted and
    averaged ring values there move less than half as much at density 4 as at density 1 (measured:
    0.043 against 0.116 for ring sorting)."""
    size, centre = 21, 10
    coords = torch.arange(size, dtype=torch.float64) - centre
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    gen = torch.Generator().manual_seed(0)
    change = {1: 0.0, 4: 0.0}
    for _ in range(20):
        blobs = (torch.rand(6, 2, generator=gen, dtype=torch.float64) * 2 - 1) * 4
        heights = torch.randn(6, generator=gen, dtype=torch.float64)

        def image(angle):
            t = math.radians(angle)
            # the blobs' centres turned by `angle` about the central pixel: an exactly rotated smooth image
            cy = blobs[:, 0] * math.cos(t) + blobs[:, 1] * math.sin(t)
            cx = -blobs[:, 0] * math.sin(t) + blobs[:, 1] * math.cos(t)
            d2 = (yy[..., None] - cy) ** 2 + (xx[..., None] - cx) ** 2
            return (heights * torch.exp(-d2 / 2.0)).sum(-1).view(1, 1, size, size)

        # one output channel per kernel position: its one-hot weight picks one averaged run
        one_hot = torch.eye(49, dtype=torch.float64).view(49, 1, 7, 7)
        for density in change:
            before, after = (sc(image(angle), one_hot, sorting=sorting, ring_density=density)[0, :, centre - 3,
                                                                                               centre - 3]
                             for angle in (0, 20))
            change[density] += ((after - before).norm() / before.norm()).item() / 20
    assert change[4] < change[1] / 2, change


@pytest.mark.skipif("cpu" not in available_backends(), reason="the fused CPU backend is not built")
@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", SORTINGS)
@pytest.mark.parametrize("config", [dict(), dict(stride=2), dict(dilation=2), dict(groups=2),
                                    dict(padding_mode="reflect"), dict(ring_density="per ring")])
def test_cpu_backend_agrees_with_the_reference_in_value_and_gradient(k, sorting, config):
    if config.get("ring_density") == "per ring":
        if sorting == "global":
            pytest.skip("per-ring densities are for ring sorting")
        config = dict(ring_density=tuple(range(k // 2, 0, -1)))
    x = randn(2, 4, 12, 11, seed=k).requires_grad_()
    weight = randn(6, 4 // config.get("groups", 1), k, k, seed=k + 1).requires_grad_()
    bias = randn(6, seed=k + 2).requires_grad_()
    dilation = config.get("dilation", 1)
    args = dict(padding=dilation * (k // 2), sorting=sorting, **{"ring_density": 2, **config})
    outs, grads = [], []
    for backend in ("reference", "cpu"):
        out = sort_conv2d(x, weight, bias, backend=backend, **args)
        grads.append(torch.autograd.grad((out * randn(*out.shape, seed=9)).sum(), (x, weight, bias)))
        outs.append(out)
    assert outs[0].shape == outs[1].shape
    assert (outs[0] - outs[1]).abs().max() < 1e-10
    for a, b in zip(*grads):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("sorting", SORTINGS)
@pytest.mark.parametrize("backend", ["reference"] + [b for b in ("cpu",) if b in available_backends()])
def test_dense_gradcheck(sorting, backend):
    x = randn(1, 2, 5, 5, seed=1).requires_grad_()
    weight = randn(2, 2, 3, 3, seed=2).requires_grad_()

    def fn(x, weight):
        return sort_conv2d(x, weight, padding=1, sorting=sorting, ring_density=2, backend=backend)

    assert torch.autograd.gradcheck(fn, (x, weight))


def test_density_one_is_the_paper_operator():
    x, weight = randn(1, 2, 9, 9, seed=3), randn(3, 2, 5, 5, seed=4)
    assert get_geometry(5, "polar", "ring", 1) is get_geometry(5, "polar", "ring")
    assert torch.equal(sc(x, weight, padding=2, ring_density=1), sc(x, weight, padding=2))


def test_module_passes_ring_density():
    conv = SortConv2d(2, 3, 5, padding=2, ring_density=2, backend="reference").double()
    x = randn(1, 2, 8, 8)
    assert torch.equal(conv(x), sc(x, conv.weight, conv.bias, padding=2, ring_density=2))
    assert "ring_density=2" in repr(conv)


# -------------------------------------------------------------------------------------------------------
# polar-offset sampling
# -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", (3, 5, 7, 9))
def test_offset_points_sit_half_a_step_off_the_axes_and_diagonals(k):
    g = get_geometry(k, "polar-offset", "ring")
    for r in range(1, k // 2 + 1):
        for j, slot in enumerate(range((2 * r - 1) ** 2, (2 * r + 1) ** 2)):
            offsets, weights = g.tap_offsets[slot].tolist(), g.tap_weights[slot].tolist()
            y = sum(w * dy for (dy, dx), w in zip(offsets, weights))
            x = sum(w * dx for (dy, dx), w in zip(offsets, weights))
            angle = 2 * math.pi * (j + 0.5) / (8 * r)
            assert (y, x) == (pytest.approx(r * math.sin(angle), abs=1e-12), pytest.approx(r * math.cos(angle), abs=1e-12))
            assert min(abs(y), abs(x), abs(abs(y) - abs(x))) > 0.1, "no point on an axis or a diagonal"


def test_offset_ring_one_reads_every_point_through_the_same_blend():
    """The grid's symmetries map ring 1's offset points onto one another, so their four bilinear weights
    are the same numbers; the paper's points mix exact reads (one weight 1) and blends."""
    def blend(sampling, slot):
        return tuple(sorted(round(w, 12) for w in get_geometry(3, sampling, "ring").tap_weights[slot].tolist()))

    blends = {sampling: {blend(sampling, slot) for slot in range(1, 9)} for sampling in ("polar", "polar-offset")}
    assert len(blends["polar-offset"]) == 1
    assert len(blends["polar"]) == 2


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", SORTINGS)
@pytest.mark.parametrize("density", (1, 2))
def test_offset_operator_is_exactly_equivariant_to_quarter_turns_on_every_backend(k, sorting, density):
    x, weight = randn(2, 3, 11, 11, seed=k), randn(4, 3, k, k, seed=k + 1)
    outs = {}
    for backend in ["reference"] + [b for b in ("cpu",) if b in available_backends()]:
        args = dict(padding=k // 2, sampling="polar-offset", sorting=sorting, ring_density=density, backend=backend)
        out = sort_conv2d(x, weight, **args)
        for turns in (1, 2, 3):
            turned = sort_conv2d(torch.rot90(x, turns, (2, 3)), weight, **args)
            assert (turned - torch.rot90(out, turns, (2, 3))).abs().max() < 1e-12, backend
        outs[backend] = out
    for out in outs.values():
        assert (out - outs["reference"]).abs().max() < 1e-10
    assert not torch.allclose(outs["reference"], sc(x, weight, padding=k // 2, sorting=sorting, ring_density=density))


def test_offset_gradcheck():
    x = randn(1, 2, 5, 5, seed=1).requires_grad_()
    weight = randn(2, 2, 3, 3, seed=2).requires_grad_()
    backends = ["reference"] + [b for b in ("cpu",) if b in available_backends()]
    for backend in backends:
        assert torch.autograd.gradcheck(
            lambda x, w: sort_conv2d(x, w, padding=1, sampling="polar-offset", backend=backend), (x, weight))


# -------------------------------------------------------------------------------------------------------
# Low-pass layers and the SCNN options
# -------------------------------------------------------------------------------------------------------

def test_gaussian_kernel_is_normalised_and_symmetric():
    for sigma in (0.5, 0.7, 1.0, 2.0):
        g = gaussian_kernel1d(sigma, torch.float64)
        assert len(g) == 2 * math.ceil(2 * sigma) + 1
        assert g.sum().item() == pytest.approx(1.0, abs=1e-12)
        assert torch.equal(g, g.flip(0))
    with pytest.raises(ValueError, match="positive"):
        gaussian_kernel1d(0)


@pytest.mark.parametrize("layer", [GaussianBlur2d(0.7), BlurPool2d("avg"), BlurPool2d("max")])
@pytest.mark.parametrize("size", (28, 14))
def test_lowpass_layers_commute_with_quarter_turns(layer, size):
    x = randn(2, 3, size, size)
    out = layer(x)
    assert out.shape[-1] == (size if isinstance(layer, GaussianBlur2d) else size // 2)
    for turns in (1, 2, 3):
        assert (layer(torch.rot90(x, turns, (2, 3))) - torch.rot90(out, turns, (2, 3))).abs().max() < 1e-12


def test_blur_pool_attenuates_what_downsampling_aliases():
    """Stripes of period 4 pixels become the highest frequency of the downsampled map (aliasing); the
    binomial filter passes cos(pi/4)^3 of them, half of what 2x2 average pooling passes (cos(pi/4))."""
    cols = torch.arange(16, dtype=torch.float64)
    stripes = torch.cos(math.pi * cols / 2).expand(1, 1, 16, 16).contiguous()
    box = nn.AvgPool2d(2)(stripes)[..., 2:-2, 2:-2].abs().max().item()
    blurred = BlurPool2d("avg")(stripes)[..., 2:-2, 2:-2].abs().max().item()
    assert box == pytest.approx(math.cos(math.pi / 4) / math.sqrt(2), abs=1e-12)
    assert blurred == pytest.approx(box / 2, abs=1e-12)


def test_bad_downsample_and_blur_pool_mode():
    with pytest.raises(ValueError, match="'max', 'avg', 'blur-avg', 'blur-max'"):
        create_downsample("blur")
    with pytest.raises(ValueError, match="'avg' or 'max'"):
        BlurPool2d("min")


@pytest.mark.parametrize("kwargs", [dict(blur_sigma=0.7), dict(downsample="blur-max"), dict(downsample="blur-avg"),
                                    dict(ring_density=2), dict(blur_sigma=(0.7, 0, 0, 0, 0, 0)),
                                    dict(ring_density=(2, 1))])
def test_scnn_options_keep_parameters_and_exact_quarter_turn_invariance(kwargs):
    torch.manual_seed(0)
    paper = timm.create_model("scnn_p_rs_5")
    model = timm.create_model("scnn_p_rs_5", **kwargs).double().eval()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in paper.named_parameters()]
    model.load_state_dict(paper.state_dict())  # no new state: the filters are fixed, not saved
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        out = model(torch.cat([torch.rot90(x, t, (2, 3)) for t in range(4)])).view(4, 2, -1)
        assert (out[1:] - out[0]).abs().max() < 1e-12 * out.abs().max()
        assert not torch.allclose(out[0], paper.double().eval()(x))


@pytest.mark.parametrize("kwargs, match", [
    (dict(blur_sigma=-1), "blur_sigma"), (dict(blur_sigma=(1, 2)), "six"),
    (dict(downsample="median"), "downsample='median'"),
])
def test_scnn_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        timm.create_model("scnn_p_rs_3", **kwargs)
    # a per-ring density gives the 3x3 layers its first ring's
    model = timm.create_model("scnn_p_rs_5", ring_density=(2, 1))
    assert [m.ring_density for m in model.modules() if isinstance(m, SortConv2d)] == [(2, 1)] * 4 + [(2,)] * 2
    with pytest.raises(ValueError, match="no rings"):
        timm.create_model("scnn_baseline_3", ring_density=2)
