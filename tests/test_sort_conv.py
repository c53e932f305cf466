"""Properties of the Sorting Convolution operator (``sort_conv2d`` and ``SortConv2d``).

Everything runs in float64 unless a test is about dtypes. The tests assert the operator's defining
properties: symmetry (quarter turns, flips, permutations inside a ring or window), agreement with a
naive loop implementation written here from the specification, gradients, dtypes and error messages.
"""
import math
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import quick_first
from timm_sortconv import SortConv2d, SortConv2dSame, sort_conv2d
from timm_sortconv.ops.geometry import get_geometry
from timm_sortconv.ops.reference import sorted_patches

VARIANTS = [(s, o) for s in ("square", "polar") for o in ("ring", "global")]
VARIANT_IDS = [f"{s}-{o}" for s, o in VARIANTS]
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")

# The properties are those of the specification, the reference path; fast backends are held to it by
# their own agreement tests.
sc = partial(sort_conv2d, backend="reference")

pytestmark = pytest.mark.usefixtures("one_thread")


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# A naive implementation, written from the specification with Python loops and floats. It shares no code
# with the package: its own padding rules, its own circle points (math.cos/math.sin for every j), its own
# bilinear formula, Python's sorted().
# ---------------------------------------------------------------------------------------------------------

def naive_read(image, i, j, padding_mode):
    """``image[i][j]`` of a 2-D list, with (i, j) possibly outside the image, extended as ``padding_mode``."""
    height, width = len(image), len(image[0])

    def mirror(index, size):  # reflect without repeating the edge: period 2 * (size - 1)
        period = 2 * (size - 1)
        index %= period
        return period - index if index >= size else index

    if padding_mode == "zeros":
        return image[i][j] if 0 <= i < height and 0 <= j < width else 0.0
    if padding_mode == "replicate":
        return image[min(max(i, 0), height - 1)][min(max(j, 0), width - 1)]
    if padding_mode == "circular":
        return image[i % height][j % width]
    return image[mirror(i, height)][mirror(j, width)]


def naive_samples(image, cy, cx, k, dilation, sampling, padding_mode):
    """``{0: [centre], r: [8r samples of ring r]}`` around input pixel (cy, cx)."""
    n = k // 2
    dh, dw = dilation
    samples = {0: [naive_read(image, cy, cx, padding_mode)]}
    for r in range(1, n + 1):
        if sampling == "square":
            ring = [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if max(abs(dy), abs(dx)) == r]
            samples[r] = [naive_read(image, cy + dy * dh, cx + dx * dw, padding_mode) for dy, dx in ring]
            continue
        samples[r] = []
        for j in range(8 * r):
            angle = 2 * math.pi * j / (8 * r)
            u, v = r * math.sin(angle), r * math.cos(angle)  # in window grid steps: u rows, v columns
            value = 0.0
            for gu in (math.floor(u), math.floor(u) + 1):
                for gv in (math.floor(v), math.floor(v) + 1):
                    weight = (1 - abs(u - gu)) * (1 - abs(v - gv))
                    value += weight * naive_read(image, cy + gu * dh, cx + gv * dw, padding_mode)
            samples[r].append(value)
    return samples


def naive_sorted_window(samples, k, sorting):
    """``{(dy, dx): value}``: the sorted samples laid back on the grid as the specification says."""
    n = k // 2
    if sorting == "global":
        values = sorted(v for r in range(n + 1) for v in samples[r])
        positions = [(dy, dx) for dy in range(-n, n + 1) for dx in range(-n, n + 1)]
        return dict(zip(positions, values))
    window = {(0, 0): samples[0][0]}
    for r in range(1, n + 1):
        ring = [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if max(abs(dy), abs(dx)) == r]
        window.update(zip(ring, sorted(samples[r])))
    return window


def naive_sort_conv(x, weight, bias, stride, padding, dilation, groups, padding_mode, sampling, sorting, positions):
    """``{(b, o, oy, ox): value}`` at the given output positions ``(oy, ox)``."""
    k = weight.shape[-1]
    n = k // 2
    sh, sw = stride
    dh, dw = dilation
    pt, pl = (dh * n, dw * n) if padding == "same" else padding
    c_in_group = weight.shape[1]
    c_out_group = weight.shape[0] // groups
    images, w = x.tolist(), weight.tolist()
    out = {}
    for b in range(x.shape[0]):
        for oy, ox in positions:
            cy, cx = oy * sh - pt + n * dh, ox * sw - pl + n * dw
            windows = [naive_sorted_window(naive_samples(images[b][c], cy, cx, k, (dh, dw), sampling, padding_mode),
                                           k, sorting) for c in range(x.shape[1])]
            for o in range(weight.shape[0]):
                first = (o // c_out_group) * c_in_group
                total = 0.0 if bias is None else bias[o].item()
                for c in range(c_in_group):
                    for (dy, dx), value in windows[first + c].items():
                        total += w[o][c][dy + n][dx + n] * value
                out[b, o, oy, ox] = total
    return out


NAIVE_CONFIGS = [
    dict(stride=(1, 1), padding="k//2", dilation=(1, 1), groups=1, padding_mode="zeros"),
    dict(stride=(2, 2), padding="k//2", dilation=(1, 1), groups=2, padding_mode="reflect"),
    dict(stride=(1, 2), padding=(0, 1), dilation=(2, 2), groups=1, padding_mode="replicate"),
    dict(stride=(1, 1), padding="same", dilation=(2, 2), groups=4, padding_mode="circular"),
    dict(stride=(2, 1), padding="k//2+1", dilation=(1, 1), groups=1, padding_mode="zeros"),
    dict(stride=(1, 1), padding="same", dilation=(1, 2), groups=1, padding_mode="reflect"),
]


@pytest.mark.slow
@pytest.mark.parametrize("config", NAIVE_CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("k", (1, 3, 5, 7))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_agrees_with_naive_loops(sampling, sorting, k, config):
    n = k // 2
    padding = {"k//2": (n, n), "k//2+1": (n + 1, n + 1)}.get(config["padding"], config["padding"])
    x, weight, bias = randn(1, 4, 15, 15, seed=1), randn(4, 4 // config["groups"], k, k, seed=2), randn(4, seed=3)
    out = sc(x, weight, bias, config["stride"], padding, config["dilation"], config["groups"],
             config["padding_mode"], sampling=sampling, sorting=sorting)
    ho, wo = out.shape[2:]
    positions = {(0, 0), (ho - 1, wo - 1), (0, wo - 1), (ho // 2, wo // 2), (ho - 1, wo // 3)}
    expected = naive_sort_conv(x, weight, bias, config["stride"], padding, config["dilation"], config["groups"],
                               config["padding_mode"], sampling, sorting, sorted(positions))
    for (b, o, oy, ox), value in expected.items():
        assert out[b, o, oy, ox].item() == pytest.approx(value, abs=1e-10), (b, o, oy, ox)


@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_kernel_size_one_is_a_plain_pointwise_convolution(sampling, sorting):
    x, weight, bias = randn(2, 4, 6, 6, seed=1), randn(6, 2, 1, 1, seed=2), randn(6, seed=3)
    out = sc(x, weight, bias, stride=2, groups=2, sampling=sampling, sorting=sorting)
    torch.testing.assert_close(out, F.conv2d(x, weight, bias, stride=2, groups=2), atol=1e-13, rtol=0)


@pytest.mark.parametrize("sorting", ("ring", "global"))
def test_square_sampling_with_ring_constant_weight_is_a_plain_convolution(sorting):
    """Sorting only reorders values inside a segment, so a weight constant on each segment (each ring
    for ring sorting, the window for global sorting) sees the same sum as a plain convolution."""
    k, n = 5, 2
    ring_of = torch.tensor([[max(abs(dy), abs(dx)) for dx in range(-n, n + 1)] for dy in range(-n, n + 1)])
    per_ring = randn(4, 3, n + 1, seed=4)
    weight = per_ring[..., ring_of] if sorting == "ring" else per_ring[..., :1, None].expand(4, 3, k, k)
    x = randn(2, 3, 9, 9, seed=5)
    out = sc(x, weight, padding=n, sampling="square", sorting=sorting)
    torch.testing.assert_close(out, F.conv2d(x, weight, padding=n), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# Symmetry
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_equivariant_to_quarter_turns(sampling, sorting, k):
    x, weight, bias = randn(2, 3, 13, 13, seed=k), randn(4, 3, k, k, seed=k + 1), randn(4, seed=k + 2)
    out = sc(x, weight, bias, padding=k // 2, sampling=sampling, sorting=sorting)
    for turns in (1, 2, 3):
        turned = sc(torch.rot90(x, turns, dims=(2, 3)), weight, bias, padding=k // 2,
                    sampling=sampling, sorting=sorting)
        assert (turned - torch.rot90(out, turns, dims=(2, 3))).abs().max() < 1e-12
    # The plain convolution with the same weight is not: the property is SC's, not the test's.
    conv = F.conv2d(x, weight, bias, padding=k // 2)
    assert (F.conv2d(torch.rot90(x, 1, dims=(2, 3)), weight, bias, padding=k // 2)
            - torch.rot90(conv, 1, dims=(2, 3))).abs().max() > 1e-2


@pytest.mark.parametrize("backend", ("reference", "auto"))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_equivariant_to_whole_pixel_moves(sampling, sorting, backend):
    """At stride 1 a moved input moves the output: everywhere with circular padding (the move is then a roll),
    and away from the border with zeros."""
    k, moves = 7, ((1, 1), (-1, -1), (2, -3))
    x, weight, bias = randn(2, 3, 16, 17, seed=5), randn(4, 3, k, k, seed=6), randn(4, seed=7)
    for padding_mode in ("circular", "zeros"):
        args = dict(padding=k // 2, padding_mode=padding_mode, sampling=sampling, sorting=sorting, backend=backend)
        out = sort_conv2d(x, weight, bias, **args)
        for move in moves:
            moved = sort_conv2d(torch.roll(x, move, dims=(2, 3)), weight, bias, **args)
            expected = torch.roll(out, move, dims=(2, 3))
            if padding_mode == "zeros":  # output pixels whose window, before or after the move, reaches the border
                cut = k // 2 + 3
                moved, expected = moved[..., cut:-cut, cut:-cut], expected[..., cut:-cut, cut:-cut]
            torch.testing.assert_close(moved, expected, rtol=0, atol=1e-12)
        if padding_mode == "zeros":
            border = sort_conv2d(torch.roll(x, (1, 1), dims=(2, 3)), weight, bias, **args)[..., 0, :]
            assert not torch.allclose(border, torch.roll(out, (1, 1), dims=(2, 3))[..., 0, :])


@pytest.mark.parametrize("padding_mode", PADDING_MODES)
@pytest.mark.parametrize("stride,dilation", [(1, 2), (2, 1)])
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_equivariant_to_quarter_turns_with_padding_modes_stride_and_dilation(sampling, sorting, stride, dilation,
                                                                             padding_mode):
    """Every padding mode commutes with quarter turns of a square image, and with 13 rows the strided
    output grid (rows 0, 2, ..., 12) is symmetric too."""
    x, weight = randn(1, 2, 13, 13, seed=2), randn(3, 2, 3, 3, seed=3)
    args = dict(stride=stride, padding=dilation, dilation=dilation, padding_mode=padding_mode, sampling=sampling,
                sorting=sorting)
    out = sc(x, weight, **args)
    for turns in (1, 3):
        turned = sc(torch.rot90(x, turns, dims=(2, 3)), weight, **args)
        assert (turned - torch.rot90(out, turns, dims=(2, 3))).abs().max() < 1e-12


@pytest.mark.parametrize("k", (3, 5))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_equivariant_to_flips(sampling, sorting, k):
    """Mirroring also maps each ring's grid positions and circle points onto themselves."""
    x, weight = randn(1, 2, 11, 11, seed=k), randn(3, 2, k, k, seed=k + 1)
    out = sc(x, weight, padding=k // 2, sampling=sampling, sorting=sorting)
    for dims in ((2,), (3,), (2, 3)):
        flipped = sc(x.flip(dims), weight, padding=k // 2, sampling=sampling, sorting=sorting)
        assert (flipped - out.flip(dims)).abs().max() < 1e-12


def ring_positions(r):
    return [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if max(abs(dy), abs(dx)) == r]


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", ("ring", "global"))
def test_square_output_is_invariant_to_permuting_grid_values(sorting, k):
    """Square sampling reads the grid itself: permuting the values of one output position's window
    inside each ring (ring sorting) or over the whole window (global sorting), independently per
    channel, leaves that output bit-for-bit unchanged."""
    n, (cy, cx) = k // 2, (6, 5)
    x, weight = randn(2, 3, 12, 12, seed=k), randn(4, 3, k, k, seed=k + 1)
    generator = torch.Generator().manual_seed(k)
    groups = [ring_positions(r) for r in range(1, n + 1)] if sorting == "ring" else \
        [[(dy, dx) for dy in range(-n, n + 1) for dx in range(-n, n + 1)]]
    permuted = x.clone()
    for positions in groups:
        rows = torch.tensor([cy + dy for dy, _ in positions])
        cols = torch.tensor([cx + dx for _, dx in positions])
        for b in range(x.shape[0]):
            for c in range(x.shape[1]):
                order = torch.randperm(len(positions), generator=generator)
                permuted[b, c, rows, cols] = x[b, c, rows[order], cols[order]]
    out = sc(x, weight, padding=n, sampling="square", sorting=sorting)
    out_permuted = sc(permuted, weight, padding=n, sampling="square", sorting=sorting)
    assert torch.equal(out_permuted[..., cy, cx], out[..., cy, cx])
    # The neighbours' windows were changed in ways that are not permutations of their own rings.
    assert (out_permuted - out).abs().amax(dim=(0, 1)).gt(1e-6).sum() > 0
    if sorting == "ring":
        # Moving a value across rings is not a symmetry of ring sorting.
        swapped = x.clone()
        swapped[..., cy, cx], swapped[..., cy - n, cx - n] = x[..., cy - n, cx - n], x[..., cy, cx]
        out_swapped = sc(swapped, weight, padding=n, sampling="square", sorting=sorting)
        assert (out_swapped[..., cy, cx] - out[..., cy, cx]).abs().max() > 1e-3


def window_with_samples(samples, geometry):
    """A row-major ``k x k`` window whose polar samples are ``samples`` (ring order): the interpolation
    matrix is invertible for k = 3, 5, 7, so every sample vector comes from exactly one window."""
    k = geometry.kernel_size
    return torch.linalg.solve(geometry.interpolation, samples).reshape(k, k)


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", ("ring", "global"))
def test_polar_output_is_invariant_to_permuting_samples(sorting, k):
    """For polar sampling the symmetry acts on the samples, not on the grid: a window whose samples are
    a permutation of another's, within each ring (ring sorting) or over all samples (global), gives the
    same output. Windows with chosen samples are made by inverting the interpolation."""
    geometry = get_geometry(k, "polar", sorting)
    assert torch.linalg.cond(geometry.interpolation) < 1e3, "window_with_samples needs an invertible interpolation"
    n, (cy, cx) = k // 2, (6, 5)
    x, weight = randn(1, 2, 12, 12, seed=k), randn(3, 2, k, k, seed=k + 1)
    generator = torch.Generator().manual_seed(k)
    samples = randn(2, k * k, seed=k + 2)
    permuted = torch.empty_like(samples)
    for c in range(2):
        for start, end in geometry.segments:
            permuted[c, start:end] = samples[c, start + torch.randperm(end - start, generator=generator)]
    assert not torch.equal(permuted, samples)
    images = []
    for sample_set in (samples, permuted):
        image = x.clone()
        for c in range(2):
            image[0, c, cy - n: cy + n + 1, cx - n: cx + n + 1] = window_with_samples(sample_set[c], geometry)
        images.append(image)
    outs = [sc(image, weight, padding=n, sampling="polar", sorting=sorting) for image in images]
    assert (outs[0][..., cy, cx] - outs[1][..., cy, cx]).abs().max() < 1e-10
    # The sorted samples at that position are the sorted chosen samples, for both windows.
    expected = torch.cat([samples[:, s:e].sort(dim=-1).values for s, e in geometry.segments], dim=-1)
    for image in images:
        window = image[:, :, cy - n: cy + n + 1, cx - n: cx + n + 1]
        got = sorted_patches(window, geometry, (1, 1), (1, 1), (1, 1))[0, :, 0, 0]
        assert (got - expected).abs().max() < 1e-10
    # Permuting grid values instead of samples is not a symmetry of polar sampling.
    scrambled = images[0].clone()
    rows, cols = zip(*[(cy + dy, cx + dx) for dy, dx in ring_positions(1)])
    rows, cols = torch.tensor(rows), torch.tensor(cols)
    scrambled[0, :, rows, cols] = images[0][0, :, rows.roll(1), cols.roll(1)]
    out_scrambled = sc(scrambled, weight, padding=n, sampling="polar", sorting=sorting)
    assert (out_scrambled[..., cy, cx] - outs[0][..., cy, cx]).abs().max() > 1e-3


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_output_is_invariant_to_turning_and_mirroring_one_window(sampling, sorting, k):
    """Turning or mirroring the window around one pixel (and nothing else) permutes its samples within
    each ring for every variant, so that pixel's output does not change."""
    n, (cy, cx) = k // 2, (6, 7)
    x, weight = randn(1, 2, 13, 13, seed=k), randn(3, 2, k, k, seed=k + 1)
    out = sc(x, weight, padding=n, sampling=sampling, sorting=sorting)[..., cy, cx]
    window = x[..., cy - n: cy + n + 1, cx - n: cx + n + 1]
    for transformed in (torch.rot90(window, 1, dims=(2, 3)), torch.rot90(window, 2, dims=(2, 3)),
                        window.flip(2), window.transpose(2, 3)):
        image = x.clone()
        image[..., cy - n: cy + n + 1, cx - n: cx + n + 1] = transformed
        got = sc(image, weight, padding=n, sampling=sampling, sorting=sorting)[..., cy, cx]
        assert (got - out).abs().max() < 1e-12


def smooth_image_renderer(batch, size, seed):
    """A function ``theta -> (batch, 1, size, size)`` images of one smooth random scene (Gaussian blobs
    and low-frequency waves) rotated by ``theta`` about the centre pixel. The rotation is applied to the
    continuous scene before sampling it on the grid, so no resampling error enters."""
    generator = torch.Generator().manual_seed(seed)
    centre = (size - 1) / 2
    grid = torch.arange(size, dtype=torch.float64) - centre
    ys, xs = torch.meshgrid(grid, grid, indexing="ij")
    scenes = []
    for _ in range(batch):
        blobs = [(torch.randn(1, generator=generator).item(), 3 * torch.randn(2, generator=generator),
                  2.5 + 1.5 * torch.rand(1, generator=generator).item()) for _ in range(4)]
        waves = [(0.5 * torch.randn(1, generator=generator).item(), 0.35 * torch.randn(2, generator=generator),
                  2 * math.pi * torch.rand(1, generator=generator).item()) for _ in range(2)]
        scenes.append((blobs, waves))

    def render(theta):
        # The rotated image at p is the scene at R(-theta) p (coordinates about the centre pixel).
        sy = math.cos(theta) * ys - math.sin(theta) * xs
        sx = math.sin(theta) * ys + math.cos(theta) * xs
        images = []
        for blobs, waves in scenes:
            image = torch.zeros_like(ys)
            for amplitude, (by, bx), sigma in blobs:
                image += amplitude * torch.exp(-((sy - by) ** 2 + (sx - bx) ** 2) / (2 * sigma ** 2))
            for amplitude, (fy, fx), phase in waves:
                image += amplitude * torch.cos(fy * sy + fx * sx + phase)
            images.append(image)
        return torch.stack(images).unsqueeze(1)

    return render


# polar/square ratio of the relative change, measured with this test's seeds (16 scenes, 32 filters):
# ring sorting 0.35 (k=3), 0.18 (k=5), 0.14 (k=7); global sorting 0.33, 0.25, 0.20. The bounds leave
# a margin of about 1.4x.
RATIO_BOUNDS = {"ring": {3: 0.5, 5: 0.26, 7: 0.2}, "global": {3: 0.46, 5: 0.35, 7: 0.28}}


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", ("ring", "global"))
def test_polar_changes_far_less_than_square_under_45_degree_rotation(sorting, k):
    """A 45-degree turn maps every polar circle's points onto themselves (the step is 360/(8r) degrees),
    so polar responses change only by bilinear interpolation error; square windows read different
    points of the scene."""
    size = 15
    out_index = size // 2 - k // 2  # the output at the centre pixel, without padding
    render = smooth_image_renderer(batch=16, size=size, seed=0)
    upright, turned = render(0.0), render(math.pi / 4)
    # The renderer's own check: a 90-degree turn of the scene is torch.rot90 of the image.
    torch.testing.assert_close(render(math.pi / 2), torch.rot90(upright, -1, dims=(2, 3)), atol=1e-12, rtol=0)
    weight = randn(32, 1, k, k, seed=k)
    change = {}
    for sampling in ("square", "polar"):
        before = sc(upright, weight, sampling=sampling, sorting=sorting)[..., out_index, out_index]
        after = sc(turned, weight, sampling=sampling, sorting=sorting)[..., out_index, out_index]
        change[sampling] = ((after - before).norm() / before.norm()).item()
    assert change["square"] > 0.03, f"the scene is too plain to test anything: {change}"
    assert change["polar"] / change["square"] < RATIO_BOUNDS[sorting][k], change


# ---------------------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("padding_mode", quick_first(PADDING_MODES))
@pytest.mark.parametrize("groups", quick_first((2, 1)))
@pytest.mark.parametrize("stride", quick_first((2, 1)))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_gradcheck(sampling, sorting, stride, groups, padding_mode):
    x = randn(1, 2, 5, 5, seed=1).requires_grad_()
    weight = randn(2, 2 // groups, 3, 3, seed=2).requires_grad_()
    bias = randn(2, seed=3).requires_grad_()

    def fn(x, weight, bias):
        return sc(x, weight, bias, stride, 1, 1, groups, padding_mode, sampling=sampling, sorting=sorting)

    assert torch.autograd.gradcheck(fn, (x, weight, bias))


@pytest.mark.slow
@pytest.mark.parametrize("padding,dilation,k", [("same", 2, 3), (2, 2, 3), ("same", 1, 5)])
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_gradcheck_dilation_and_same_padding(sampling, sorting, padding, dilation, k):
    x = randn(1, 2, 6, 6, seed=1).requires_grad_()
    weight = randn(2, 2, k, k, seed=2).requires_grad_()

    def fn(x, weight):
        return sc(x, weight, None, 1, padding, dilation, 1, "reflect", sampling=sampling, sorting=sorting)

    assert torch.autograd.gradcheck(fn, (x, weight))


# ---------------------------------------------------------------------------------------------------------
# NaN locality
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stride,dilation", [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("k", (3, 5))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_nan_affects_only_windows_containing_it(sampling, sorting, k, stride, dilation):
    n, (py, px) = k // 2, (5, 6)
    x, weight = randn(1, 2, 12, 12, seed=k), randn(3, 2, k, k, seed=k + 1)
    poisoned = x.clone()
    poisoned[0, 1, py, px] = float("nan")
    args = dict(stride=stride, padding=n * dilation, dilation=dilation, sampling=sampling, sorting=sorting)
    clean, out = sc(x, weight, **args), sc(poisoned, weight, **args)
    # Output (oy, ox) reads the grid positions oy*stride - padding + i*dilation, i = 0..k-1.
    reads = lambda o, p: any(o * stride - n * dilation + i * dilation == p for i in range(k))
    contains = torch.tensor([[reads(oy, py) and reads(ox, px) for ox in range(out.shape[3])]
                             for oy in range(out.shape[2])])
    assert contains.any() and not contains.all()
    assert out[..., contains].isnan().all()
    assert out[..., ~contains].isfinite().all()
    torch.testing.assert_close(out[..., ~contains], clean[..., ~contains], atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("k", (3, 7))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_low_precision_dtypes_match_float64(sampling, sorting, k, dtype, tolerance):
    # Inputs representable in bfloat16, so only the computation's rounding is measured.
    x = randn(2, 4, 10, 10, seed=k).to(torch.bfloat16).double()
    weight = (randn(5, 4, k, k, seed=k + 1) / k).to(torch.bfloat16).double()
    bias = randn(5, seed=k + 2).to(torch.bfloat16).double()
    expected = sc(x, weight, bias, padding=k // 2, sampling=sampling, sorting=sorting)
    out = sc(x.to(dtype), weight.to(dtype), bias.to(dtype), padding=k // 2, sampling=sampling,
             sorting=sorting)
    assert out.dtype == dtype
    assert (out.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_autocast_bfloat16(sampling, sorting):
    torch.manual_seed(0)
    layer = SortConv2d(4, 6, 5, padding=2, sampling=sampling, sorting=sorting, backend="reference")
    x = torch.randn(2, 4, 10, 10)
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_cuda_matches_cpu(sampling, sorting):
    x, weight, bias = randn(2, 4, 11, 11, seed=1), randn(6, 2, 5, 5, seed=2), randn(6, seed=3)
    args = dict(stride=2, padding=2, groups=2, padding_mode="reflect", sampling=sampling, sorting=sorting)
    expected = sc(x, weight, bias, **args)
    out = sc(x.cuda(), weight.cuda(), bias.cuda(), **args)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# The module is an nn.Conv2d
# ---------------------------------------------------------------------------------------------------------

MODULE_CONFIGS = [
    dict(in_channels=4, out_channels=6, kernel_size=3),
    dict(in_channels=4, out_channels=8, kernel_size=(5, 5), stride=2, padding=2, groups=2, bias=False),
    dict(in_channels=2, out_channels=2, kernel_size=7, padding="same", dilation=2, padding_mode="reflect"),
]


@pytest.mark.parametrize("config", MODULE_CONFIGS)
def test_module_matches_conv2d_parameters_and_initialisation(config):
    torch.manual_seed(7)
    conv = nn.Conv2d(**config)
    torch.manual_seed(7)
    layer = SortConv2d(**config, sampling="square", sorting="global", backend="reference")
    assert isinstance(layer, nn.Conv2d)
    assert list(layer.state_dict()) == list(conv.state_dict())
    for (name, p), (conv_name, q) in zip(layer.named_parameters(), conv.named_parameters()):
        assert name == conv_name and p.shape == q.shape and p.dtype == q.dtype
        assert torch.equal(p, q), "same seed, same initialisation as nn.Conv2d"
    layer.load_state_dict(conv.state_dict())
    assert layer.extra_repr().startswith(conv.extra_repr())
    assert "sampling=square" in layer.extra_repr() and "sorting=global" in layer.extra_repr()
    assert "backend=reference" in layer.extra_repr()
    assert "backend=auto" in SortConv2d(2, 2, 3).extra_repr()
    assert "sampling=square" in repr(layer)
    x = torch.randn(1, config["in_channels"], 9, 9)
    assert layer(x).shape == conv(x).shape


def test_module_forward_is_the_functional():
    torch.manual_seed(0)
    layer = SortConv2d(4, 6, 5, stride=2, padding=3, dilation=1, groups=2, padding_mode="circular",
                       dtype=torch.float64, sampling="polar", sorting="ring", backend="reference")
    x = randn(2, 4, 11, 11)
    expected = sc(x, layer.weight, layer.bias, 2, 3, 1, 2, "circular", sampling="polar", sorting="ring")
    assert torch.equal(layer(x), expected)


def test_from_conv_copies_configuration_and_weights():
    conv = nn.Conv2d(4, 6, 5, stride=2, padding=1, dilation=2, groups=2, bias=True, padding_mode="replicate",
                     dtype=torch.float64)
    conv.eval()
    layer = SortConv2d.from_conv(conv, sampling="square", sorting="ring")
    for attribute in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                      "padding_mode"):
        assert getattr(layer, attribute) == getattr(conv, attribute), attribute
    assert (layer.sampling, layer.sorting, layer.training) == ("square", "ring", False)
    assert torch.equal(layer.weight, conv.weight) and torch.equal(layer.bias, conv.bias)
    assert layer.weight.dtype == torch.float64
    assert layer.weight.data_ptr() != conv.weight.data_ptr(), "a copy, not shared storage"
    no_bias = SortConv2d.from_conv(nn.Conv2d(2, 2, 3, bias=False))
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"]
    with pytest.raises(TypeError, match="nn.Conv2d.*Linear"):
        SortConv2d.from_conv(nn.Linear(2, 2))


@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_unbatched_input(sampling, sorting):
    layer = SortConv2d(3, 4, 3, padding=1, dtype=torch.float64, sampling=sampling, sorting=sorting,
                       backend="reference")
    x = randn(3, 8, 8)
    conv = nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64)
    out = layer(x)
    assert out.shape == conv(x).shape == (4, 8, 8)
    assert torch.equal(out, layer(x.unsqueeze(0))[0])


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel_size,error,match", [
    (0, RuntimeError, r"kernel_size=0: SortConv2d needs a kernel size k >= 1"),
    (-3, RuntimeError, r"kernel_size=-3: SortConv2d needs a kernel size k >= 1"),
    (2.0, TypeError, r"kernel_size=2.0 is not accepted; use an int k >= 1 or a pair \(k, k\)"),
    ((3, 5), ValueError, r"square kernel.*kernel_size=\(3, 5\).*one int k >= 1"),
    ((0, 0), RuntimeError, r"kernel_size=\(0, 0\): SortConv2d needs a kernel size k >= 1"),
])
def test_bad_kernel_size(kernel_size, error, match):
    with pytest.raises(error, match=match):
        SortConv2d(2, 2, kernel_size)


def test_bad_kernel_size_functional():
    x = torch.randn(1, 2, 8, 8)
    with pytest.raises(RuntimeError, match=r"SortConv2d needs a kernel size k >= 1"):
        sort_conv2d(x, torch.randn(2, 2, 0, 0))
    with pytest.raises(ValueError, match=r"square kernel.*kernel_size=\(3, 5\)"):
        sort_conv2d(x, torch.randn(2, 2, 3, 5))
    with pytest.raises(RuntimeError, match=r"weight must be 4-D.*\(2, 2, 3\)"):
        sort_conv2d(x, torch.randn(2, 2, 3))


@pytest.mark.parametrize("keyword,value,match", [
    ("sampling", "hex", r"sampling='hex'.*accepted: 'square', 'polar'"),
    ("sorting", "bubble", r"sorting='bubble'.*accepted: 'ring', 'global'"),
    ("backend", "nope", r"backend='nope'.*accepted: 'auto', 'reference'"),
])
def test_unknown_variant_or_backend(keyword, value, match):
    with pytest.raises(ValueError, match=match):
        SortConv2d(2, 2, 3, **{keyword: value})
    with pytest.raises(ValueError, match=match):
        sort_conv2d(torch.randn(1, 2, 6, 6), torch.randn(2, 2, 3, 3), **{keyword: value})


def test_groups_must_divide_channels():
    with pytest.raises(ValueError, match=r"groups=3 must divide in_channels=4$"):
        SortConv2d(4, 6, 3, groups=3)
    with pytest.raises(ValueError, match=r"groups=4 must divide out_channels=6$"):
        SortConv2d(4, 6, 3, groups=4)
    with pytest.raises(ValueError, match=r"groups=0 is not accepted; use a positive int$"):
        SortConv2d(4, 6, 3, groups=0)
    with pytest.raises(RuntimeError, match=r"groups=3 must divide the weight's 4 output channels"):
        sort_conv2d(torch.randn(1, 6, 6, 6), torch.randn(4, 2, 3, 3), groups=3)
    with pytest.raises(RuntimeError, match=r"input has 5 channels.*with groups=2 expects 4$"):
        sort_conv2d(torch.randn(1, 5, 6, 6), torch.randn(4, 2, 3, 3), groups=2)


@pytest.mark.parametrize("keyword,value,error,match", [
    ("stride", 0, RuntimeError, r"stride=0: non-positive stride is not supported; use ints >= 1"),
    ("stride", (1, -2), RuntimeError, r"stride=\(1, -2\): non-positive stride"),
    ("stride", 1.5, TypeError, r"stride=1.5 is not accepted; use an int or a pair of ints"),
    ("dilation", 0, RuntimeError, r"dilation=0: non-positive dilation is not supported"),
    ("dilation", (1, 2, 3), RuntimeError, r"dilation=\(1, 2, 3\) has 3 values; use an int or a pair of ints"),
    ("padding", -1, RuntimeError, r"padding=-1: negative padding is not supported; use ints >= 0"),
    ("padding", (0, -1), RuntimeError, r"padding=\(0, -1\): negative padding"),
    ("padding", "full", ValueError, r"padding='full' is not accepted; use 'same', 'valid', an int or a pair"),
    ("padding_mode", "mirror", ValueError, r"padding_mode='mirror'.*'zeros', 'reflect', 'replicate', 'circular'"),
])
def test_bad_stride_dilation_padding_are_refused_when_the_layer_is_built(keyword, value, error, match):
    """``nn.Conv2d`` refuses these values too (some only at its first call); the contract test compares the
    two over random arguments."""
    with pytest.raises(error, match=match):
        SortConv2d(2, 2, 3, **{keyword: value})


def test_bad_padding_stride_dilation_functional():
    x, weight = torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3)
    with pytest.raises(RuntimeError, match=r"padding='full' is not accepted.*'same', 'valid'"):
        sort_conv2d(x, weight, padding="full")
    with pytest.raises(ValueError, match=r"padding_mode='mirror'.*'zeros', 'reflect', 'replicate', 'circular'"):
        sort_conv2d(x, weight, padding_mode="mirror")
    with pytest.raises(RuntimeError, match=r"stride=0: non-positive stride"):
        sort_conv2d(x, weight, stride=0)
    with pytest.raises(RuntimeError, match=r"dilation=\(1, 2, 3\) has 3 values"):
        sort_conv2d(x, weight, dilation=(1, 2, 3))
    with pytest.raises(RuntimeError, match=r"padding='same' is not supported for strided.*stride=2"):
        sort_conv2d(x, weight, stride=2, padding="same")
    with pytest.raises(ValueError, match=r"padding='same' is not supported for strided.*stride=2"):
        SortConv2d(2, 2, 3, stride=2, padding="same")
    with pytest.raises(RuntimeError, match=r"padded input size \(2, 2\).*dilated kernel \(3, 3\)"):
        sort_conv2d(torch.randn(1, 2, 2, 2), weight)
    with pytest.raises(RuntimeError, match=r"input of shape \[1, 2, 0, 8\] has no pixels; only its batch may"):
        sort_conv2d(torch.randn(1, 2, 0, 8), weight, padding=2)


@pytest.mark.parametrize("shape", [(4, 8), (8,), (1, 1, 4, 8, 8)])
@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_input_must_be_3d_or_4d(shape, padding_mode):
    layer = SortConv2d(4, 2, 3, stride=2, padding=1, padding_mode=padding_mode)
    with pytest.raises(RuntimeError, match=rf"3-D \(C, H, W\) or 4-D \(N, C, H, W\) input, got a {len(shape)}-D"):
        layer(torch.randn(*shape))


def test_wrong_channel_count():
    layer = SortConv2d(4, 2, 3)
    with pytest.raises(RuntimeError, match=r"input has 5 channels.*expects 4"):
        layer(torch.randn(1, 5, 8, 8))
    with pytest.raises(RuntimeError, match=r"input has 5 channels.*expects 4"):
        layer(torch.randn(5, 8, 8))


@pytest.mark.parametrize("dtype", (torch.int64, torch.uint8, torch.bool))
def test_non_floating_input(dtype):
    layer = SortConv2d(2, 2, 3)
    with pytest.raises(TypeError, match=rf"floating-point.*got input {dtype}"):
        layer(torch.zeros(1, 2, 6, 6, dtype=dtype))
    with pytest.raises(TypeError, match=r"floating-point.*weight torch.int64"):
        sort_conv2d(torch.zeros(1, 2, 6, 6), torch.zeros(2, 2, 3, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"torch.Tensor input, got list"):
        sort_conv2d([[0.0]], torch.zeros(2, 2, 3, 3))


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32, torch.float32), (torch.float32, torch.float64, None),
                                    (torch.float64, torch.float64, torch.float32)])
def test_mixed_dtypes_are_refused_outside_autocast(dtypes):
    x, weight, bias = (None if d is None else torch.randn(*shape, dtype=d)
                       for d, shape in zip(dtypes, [(1, 2, 6, 6), (2, 2, 3, 3), (2,)]))
    with pytest.raises(RuntimeError, match=rf"one dtype \(outside autocast.*input {dtypes[0]}, weight {dtypes[1]}"):
        sort_conv2d(x, weight, bias)


def raised_before_the_operator(info) -> bool:
    """Whether the error of ``info`` (``pytest.raises``) was raised by timm_sortconv's checks at the call's entry:
    its last frame in ``timm_sortconv/ops/checks.py`` and none in PyTorch's operator dispatch (``torch/_ops.py``,
    ``torch/_library/``), whose frames would put dozens of lines between the caller's line and the message."""
    paths = [Path(str(entry.path)).parts for entry in info.traceback]
    return paths[-1][-3:] == ("timm_sortconv", "ops", "checks.py") and not any(
        parts[-2:] == ("torch", "_ops.py") or "_library" in parts for parts in paths)


@pytest.mark.parametrize("call", ["layer", "unbatched layer", "same layer", "functional", "functional groups"])
def test_a_channel_mismatch_is_a_value_error_raised_before_the_operator(call):
    """A ``ValueError`` naming the channels expected, raised where the call begins; a ``RuntimeError`` too, the
    class ``nn.Conv2d`` raises for it, so that its callers' ``except`` clauses catch it."""
    x = torch.randn(1, 4, 8, 8)
    run = {
        "layer": lambda: SortConv2d(3, 8, 3)(x),
        "unbatched layer": lambda: SortConv2d(3, 8, 3)(x[0]),
        "same layer": lambda: SortConv2dSame(3, 8, 3, stride=2)(x),
        "functional": lambda: sort_conv2d(x, torch.randn(8, 3, 3, 3)),
        "functional groups": lambda: sort_conv2d(x, torch.randn(8, 1, 3, 3), groups=2),
    }[call]
    with pytest.raises(ValueError, match=r"^sort_conv2d: input has 4 channels \(shape \[(1, )?4, 8, 8\]\) but the "
                                         r"weight \[8, [13], 3, 3\] with groups=[12] expects [23]$") as info:
        run()
    assert isinstance(info.value, RuntimeError) and raised_before_the_operator(info)


def test_groups_that_do_not_divide_the_weight_are_a_value_error_raised_before_the_operator():
    with pytest.raises(ValueError, match=r"^groups=4 must divide the weight's 6 output channels \(weight shape "
                                         r"\(6, 1, 3, 3\)\)$") as info:
        sort_conv2d(torch.randn(1, 4, 8, 8), torch.randn(6, 1, 3, 3), groups=4)
    assert isinstance(info.value, RuntimeError) and raised_before_the_operator(info)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("size", [5, 6])
def test_an_integer_input_is_refused_as_by_nn_conv2d(dtype, size):
    """``nn.Conv2d`` refuses an integer or bool input with a ``RuntimeError``, and so does every entry of SC, also
    where a strided layer reads an odd-sized input half a pixel on (which would make it float): a
    ``DtypeError``, a ``TypeError`` too, that names what is accepted."""
    x = torch.ones(1, 2, size, size, dtype=dtype)
    conv = nn.Conv2d(2, 4, 2, stride=2)
    with pytest.raises(RuntimeError):
        conv(x)
    weight, bias = conv.weight.detach(), conv.bias.detach()
    for run in (lambda: SortConv2d.from_conv(conv)(x), lambda: SortConv2dSame(2, 4, 2, stride=2)(x),
                lambda: sort_conv2d(x, weight, bias, stride=2), lambda: sort_conv2d(x, weight, stride=2)):
        with pytest.raises(RuntimeError, match=rf"^sort_conv2d needs floating-point tensors \(float16, bfloat16, "
                                               rf"float32, float64\): integer, bool and complex ones are not "
                                               rf"accepted; got input {dtype}, weight torch.float32$") as info:
            run()
        assert isinstance(info.value, TypeError) and raised_before_the_operator(info)

