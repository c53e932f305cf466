"""``sampling="polar-offset"`` (the research options of the SCNN are tested in ``tests/research/``).

The properties asserted: the offset points lie where the docstring says and ring 1 reads all of them
through one blend, the operator is exactly equivariant to quarter turns on every backend and the
fast backends agree with the reference path in value and gradient.
"""
import math

import pytest
import torch

from timm_sortconv import sort_conv2d
from timm_sortconv.ops import available_backends
from timm_sortconv.ops.geometry import get_geometry

pytestmark = pytest.mark.usefixtures("one_thread")

SORTINGS = ("ring", "global")
FAST = [b for b in available_backends() if b != "reference"]


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


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
def test_offset_operator_is_exactly_equivariant_to_quarter_turns_on_every_backend(k, sorting):
    x, weight = randn(2, 3, 11, 11, seed=k), randn(4, 3, k, k, seed=k + 1)
    outs = {}
    for backend in ["reference"] + FAST:
        args = dict(padding=k // 2, sampling="polar-offset", sorting=sorting, backend=backend)
        out = sort_conv2d(x, weight, **args)
        for turns in (1, 2, 3):
            turned = sort_conv2d(torch.rot90(x, turns, (2, 3)), weight, **args)
            assert (turned - torch.rot90(out, turns, (2, 3))).abs().max() < 1e-12, backend
        outs[backend] = out
    for out in outs.values():
        assert (out - outs["reference"]).abs().max() < 1e-10
    paper = sort_conv2d(x, weight, padding=k // 2, sampling="polar", sorting=sorting, backend="reference")
    assert not torch.allclose(outs["reference"], paper)


@pytest.mark.skipif(not FAST, reason="no fast backend in this process")
@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", SORTINGS)
@pytest.mark.slow
@pytest.mark.parametrize("config", [dict(), dict(stride=2), dict(dilation=2), dict(groups=2),
                                    dict(padding_mode="reflect")])
def test_offset_fast_backends_agree_with_the_reference_in_value_and_gradient(k, sorting, config):
    x = randn(2, 4, 12, 11, seed=k).requires_grad_()
    weight = randn(6, 4 // config.get("groups", 1), k, k, seed=k + 1).requires_grad_()
    bias = randn(6, seed=k + 2).requires_grad_()
    dilation = config.get("dilation", 1)
    args = dict(padding=dilation * (k // 2), sampling="polar-offset", sorting=sorting, **config)
    outs, grads = [], []
    for backend in ["reference"] + FAST:
        out = sort_conv2d(x, weight, bias, backend=backend, **args)
        grads.append(torch.autograd.grad((out * randn(*out.shape, seed=9)).sum(), (x, weight, bias)))
        outs.append(out)
    for out, grad in zip(outs[1:], grads[1:]):
        assert out.shape == outs[0].shape
        assert (out - outs[0]).abs().max() < 1e-10
        for a, b in zip(grads[0], grad):
            assert (a - b).abs().max() < 1e-10


@pytest.mark.slow
def test_offset_gradcheck():
    x = randn(1, 2, 5, 5, seed=1).requires_grad_()
    weight = randn(2, 2, 3, 3, seed=2).requires_grad_()
    for backend in ["reference"] + FAST:
        assert torch.autograd.gradcheck(
            lambda x, w: sort_conv2d(x, w, padding=1, sampling="polar-offset", backend=backend), (x, weight))
