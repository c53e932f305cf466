"""The aligned variants (``sorting="align"``, ``"align-channel"``): each window turned back by its own orientation.

The oracle below shares no code with the package: it reads each ring's samples by bilinear interpolation at
points it computes itself, finds the window's orientation as the angle of the rings' first Fourier
coefficients (``atan2``), and reads the ring's trigonometric interpolant at the sample angles offset by it,
position by position in Python loops. The tests assert the invariance itself (on the samples and on the
layer), agreement of the forward and of both gradients with the oracle, and that windows with no orientation
neither make the output jump nor the gradient explode.
"""
from __future__ import annotations

import math

import pytest
import torch

from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv.models import SCNN
from timm_sortconv.ops.alignment import LEVEL, RELATIVE, aligned_samples, align_conv2d_harmonic
from timm_sortconv.ops.geometry import get_geometry

ALIGNED = ["align", "align-channel"]


def _ring_offsets(r):
    ring = [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if max(abs(dy), abs(dx)) == r]
    return sorted(ring, key=lambda p: math.atan2(p[0], p[1]) % (2 * math.pi))


def _bilinear(window, y, x, n):
    """``window`` (k, k) read at ``(y, x)`` measured from its centre."""
    y0, x0 = math.floor(y + 1e-12), math.floor(x + 1e-12)
    value = 0
    for yy, wy in ((y0, 1 - (y - y0)), (y0 + 1, y - y0)):
        for xx, wx in ((x0, 1 - (x - x0)), (x0 + 1, x - x0)):
            if abs(wy * wx) > 1e-12:
                value = value + wy * wx * window[yy + n, xx + n]
    return value


def oracle(x, weight, bias, k, sampling, sorting):
    """Aligned convolution, stride 1, no padding, one group, position by position."""
    n = k // 2
    out_h, out_w = x.shape[2] - k + 1, x.shape[3] - k + 1
    rows = []
    for b in range(x.shape[0]):
        maps = []
        for i in range(out_h):
            for j in range(out_w):
                windows = x[b, :, i:i + k, j:j + k]
                rings = []  # per channel: per ring, the samples in angular order
                for c in range(x.shape[1]):
                    per_ring = []
                    for r in range(1, n + 1):
                        count = 8 * r
                        if sampling == "polar":
                            points = [(r * math.sin(2 * math.pi * q / count), r * math.cos(2 * math.pi * q / count))
                                      for q in range(count)]
                            per_ring.append(torch.stack([_bilinear(windows[c], y, xx, n) for y, xx in points]))
                        else:
                            per_ring.append(torch.stack([windows[c, dy + n, dx + n] for dy, dx in _ring_offsets(r)]))
                    rings.append(per_ring)

                def first_and_variance(channels):
                    re = im = var = level = 0
                    for c in channels:
                        for s in rings[c]:
                            count = len(s)
                            angles = torch.arange(count, dtype=x.dtype) * 2 * math.pi / count
                            re = re + (s * torch.cos(angles)).sum() / count
                            im = im - (s * torch.sin(angles)).sum() / count
                            var = var + ((s - s.mean()) ** 2).mean()
                            level = level + s.mean() ** 2
                    return re, im, var, level

                shared = first_and_variance(range(x.shape[1]))
                total = bias.clone()
                for c in range(x.shape[1]):
                    re, im, var, level = shared if sorting == "align" else first_and_variance([c])
                    power = re * re + im * im
                    gate = power / (power + RELATIVE * var + LEVEL * level + 1e-20)
                    theta = torch.atan2(im, re)  # c = |c| exp(i theta)
                    total = total + weight[:, c, n, n] * windows[c, n, n]
                    for r, s in zip(range(1, n + 1), rings[c]):
                        count = len(s)
                        angles = torch.arange(count, dtype=x.dtype) * 2 * math.pi / count
                        mean = s.mean()
                        for q in range(count):
                            # the ring's trigonometric interpolant at the angle of sample q minus theta
                            at = angles[q] - theta
                            value = 0
                            for m in range(1, count // 2 + 1):
                                a = (s * torch.cos(m * angles)).sum()
                                bb = (s * torch.sin(m * angles)).sum()
                                term = a * torch.cos(m * at) + bb * torch.sin(m * at)
                                value = value + (term if 2 * m == count else 2 * term) / count
                            dy, dx = _ring_offsets(r)[q]
                            total = total + weight[:, c, dy + n, dx + n] * (mean + gate * value)
                maps.append(total)
        rows.append(torch.stack(maps, -1).view(-1, out_h, out_w))
    return torch.stack(rows)


@pytest.mark.parametrize("sorting", ALIGNED)
@pytest.mark.parametrize("sampling", ["polar", "square"])
@pytest.mark.parametrize("backend", ["reference", "harmonic"])
def test_forward_and_both_gradients_agree_with_the_oracle(backend, sampling, sorting):
    torch.manual_seed(0)
    x = torch.randn(2, 2, 7, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
    expected = oracle(x, weight, bias, 5, sampling, sorting)
    grad = torch.randn_like(expected)
    want = torch.autograd.grad(expected, (x, weight, bias), grad)
    got = sort_conv2d(x, weight, bias, sampling=sampling, sorting=sorting, backend=backend)
    torch.testing.assert_close(got, expected)
    for g, w in zip(torch.autograd.grad(got, (x, weight, bias), grad), want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("sorting", ALIGNED)
@pytest.mark.parametrize("k", [3, 4, 5, 7])
def test_aligned_samples_ignore_a_turn_by_whole_samples_of_every_ring(k, sorting):
    """Turning every ring by the same angle, a whole number of its samples (45 degrees: ring r of an odd
    window moves r samples), leaves the aligned samples as they were."""
    geometry = get_geometry(k, "polar", sorting)
    torch.manual_seed(k)
    samples = torch.randn(2, 3, 4, 5, k * k, dtype=torch.float64)
    rings = [(s, e) for s, e in geometry.segments if e - s > 1]
    eighth = all((e - s) % 8 == 0 for s, e in rings)
    for turn in ([1, 2, 3] if eighth else [2]):  # eighths (odd k) or quarters (even k: rings of 4, 12, ...)
        turned = samples.clone()
        for s, e in rings:
            turned[..., s:e] = torch.roll(samples[..., s:e], (e - s) * turn // (8 if eighth else 4), -1)
        torch.testing.assert_close(aligned_samples(turned, geometry, 1), aligned_samples(samples, geometry, 1))
    # and the alignment is not the identity: the samples do change
    assert not torch.allclose(aligned_samples(samples, geometry, 1), samples)


@pytest.mark.parametrize("backend", ["reference", "harmonic"])
@pytest.mark.parametrize("sorting", ALIGNED)
def test_a_quarter_turn_of_the_input_turns_the_output(sorting, backend):
    torch.manual_seed(1)
    layer = SortConv2d(3, 4, 7, padding=3, groups=1, sorting=sorting, backend=backend).double()
    x = torch.randn(2, 3, 11, 11, dtype=torch.float64)
    for turns in (1, 2, 3):
        torch.testing.assert_close(layer(torch.rot90(x, turns, (2, 3))), torch.rot90(layer(x), turns, (2, 3)))


def test_windows_with_no_orientation_keep_the_output_continuous_and_the_gradient_finite():
    torch.manual_seed(2)
    weight = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    # a flat input, and one symmetric under a half turn about every window's centre (no odd harmonics)
    flat = torch.full((1, 2, 5, 5), 0.3, dtype=torch.float64)
    symmetric = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    symmetric = symmetric + torch.rot90(symmetric, 2, (2, 3))
    direction = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    for sorting in ALIGNED:
        for x in (flat, symmetric):
            x = x.clone().requires_grad_(True)
            out = sort_conv2d(x, weight, sorting=sorting)
            grad = torch.autograd.grad(out.sum(), x)[0]
            assert torch.isfinite(out).all() and torch.isfinite(grad).all()
            # the orientation flips between x - t d and x + t d; the output moves by O(t) all the same
            steps = [(sort_conv2d(x.detach() + t * direction, weight, sorting=sorting)
                      - sort_conv2d(x.detach() - t * direction, weight, sorting=sorting)).abs().max().item() / t
                     for t in (1e-2, 1e-4, 1e-6)]
            assert max(steps) < 10 * (weight.abs().sum().item() + 1)


def test_the_output_is_positively_homogeneous_as_a_convolution_is():
    torch.manual_seed(3)
    x, weight = torch.randn(1, 3, 9, 9, dtype=torch.float64), torch.randn(2, 3, 7, 7, dtype=torch.float64)
    for sorting in ALIGNED:
        out = sort_conv2d(x, weight, sorting=sorting)
        for scale in (1e-3, 5.0):
            torch.testing.assert_close(sort_conv2d(scale * x, weight, sorting=sorting), scale * out)


@pytest.mark.parametrize("sorting", ALIGNED)
def test_the_harmonic_backend_agrees_with_the_reference_with_stride_dilation_and_groups(sorting):
    torch.manual_seed(4)
    for k, stride, dilation, groups in [(3, (2, 1), (1, 1), 2), (5, (1, 2), (2, 1), 4), (7, (2, 2), (1, 1), 1),
                                        (4, (1, 1), (1, 1), 2), (1, (1, 1), (1, 1), 1)]:
        geometry = get_geometry(k, "polar", sorting)
        x = torch.randn(2, 4, 15, 15, dtype=torch.float64)
        weight, bias = torch.randn(8, 4 // groups, k, k, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
        reference = sort_conv2d(x, weight, bias, stride, 0, dilation, groups, sorting=sorting, backend="reference")
        torch.testing.assert_close(align_conv2d_harmonic(x, weight, bias, geometry, stride, dilation, groups),
                                   reference)
        # one orientation per group for "align": turning one group's channels alone turns only its outputs
        assert reference.shape == (2, 8, (15 - dilation[0] * (k - 1) - 1) // stride[0] + 1,
                                   (15 - dilation[1] * (k - 1) - 1) // stride[1] + 1)


def test_align_shares_one_orientation_per_group_and_align_channel_one_per_channel():
    """Adding a strongly oriented pattern to one channel turns the other channels' windows with "align" (they
    share its orientation), and leaves them as they were with "align-channel"."""
    torch.manual_seed(5)
    x = torch.randn(1, 2, 7, 7, dtype=torch.float64)
    weight = torch.zeros(1, 2, 7, 7, dtype=torch.float64)
    weight[0, 1] = torch.randn(7, 7, dtype=torch.float64)  # reads only channel 1
    ramp = torch.arange(7, dtype=torch.float64).view(1, 7) * 10.0
    pushed = x.clone()
    pushed[0, 0] += ramp  # channel 0 only
    for sorting, changes in (("align", True), ("align-channel", False)):
        before, after = sort_conv2d(x, weight, sorting=sorting), sort_conv2d(pushed, weight, sorting=sorting)
        assert torch.allclose(before, after) is not changes


def test_an_aligned_scnn_is_invariant_to_quarter_turns_and_trains():
    torch.manual_seed(6)
    model = SCNN(sorting="align", channels=(4, 4, 8, 8, 8, 8)).double().eval()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    torch.testing.assert_close(model(torch.rot90(x, 1, (2, 3))), model(x))
    model.train()
    loss = model(x).logsumexp(1).sum()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("backend", ["reference", "harmonic", "auto"])
def test_rounding_does_not_orient_a_flat_window_in_float32(backend):
    """A window of constant nonzero value has harmonics of about 1e-7 of its value in float32 (rounding); they must
    not set an orientation, whose gradient would follow the rounding: float32 agrees with float64 there, and with
    the layer's output for the windows' ring means alone."""
    torch.manual_seed(7)
    x = torch.full((1, 3, 9, 9), 0.7, dtype=torch.float64)
    x[..., :3, :] = torch.randn(1, 3, 3, 9, dtype=torch.float64)  # some windows with structure, most flat
    weight = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    for sorting in ALIGNED:
        results = []
        for dtype in (torch.float64, torch.float32):
            leaf = x.to(dtype).requires_grad_(True)
            out = sort_conv2d(leaf, weight.to(dtype), sorting=sorting, backend=backend)
            grad = torch.autograd.grad(out, leaf, torch.ones_like(out))[0]
            results.append((out.double(), grad.double()))
        (out64, grad64), (out32, grad32) = results
        torch.testing.assert_close(out32, out64, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad32, grad64, rtol=1e-3, atol=1e-3 * grad64.abs().max().item())
