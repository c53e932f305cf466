"""Orbit sorting (``sorting="c4"`` / ``"c2"``): each ring's samples sorted only among those a quarter (half)
turn maps onto one another.

Checked against its definition: the segments are the orbits of the rotation group, the operator is
exactly equivariant to the group's turns (and not to a quarter turn with ``"c2"``: it keeps the direction
that ring sorting throws away), every backend agrees with the reference path, gradients are right, and
the variant goes through the layer, the models, ``sortify`` and ONNX. The CPU kernel's agreement at every
instruction-set level is in ``tests/test_cpu_backend.py``, the Triton kernels' in
``tests/test_triton_backend.py``.
"""
import io
import math

import pytest
import timm
import torch
import torch.nn as nn

from conftest import randomise_batchnorm
from timm_sortconv import SortConv2d, sort_conv2d, sortify
from timm_sortconv.models.scnn import SCNN
from timm_sortconv.ops.backends import available_backends
from timm_sortconv.ops.geometry import ORBIT_SORTINGS, angular_ring_offsets, get_geometry, polar_points

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLINGS = ("square", "polar")
GROUPS = {"c4": 4, "c2": 2}


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def ring_of(slot):
    """The ring of a slot in ring order (0: the centre)."""
    return (math.isqrt(slot) + 1) // 2


def sample_point(geometry, slot):
    """The point a sample reads: its taps' weighted offset (bilinear interpolation reproduces linear functions)."""
    offsets, weights = geometry.tap_offsets[slot].double(), geometry.tap_weights[slot]
    return (weights[:, None] * offsets).sum(0).tolist()


@pytest.mark.parametrize("k", [1, 3, 5, 7, 9])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("sorting", ["c4", "c2"])
def test_segments_are_the_orbits_of_the_rotation_group(sorting, sampling, k):
    g = get_geometry(k, sampling, sorting)
    group, n = ORBIT_SORTINGS[sorting], k // 2
    assert group == GROUPS[sorting]
    assert g.segments[0] == (0, 1)
    assert all(end - start == group for start, end in g.segments[1:])
    assert [s for segment in g.segments for s in range(*segment)] == list(range(k * k))
    assert sorted(g.slot_to_grid.tolist()) == list(range(k * k)), "every weight used once"
    for start, end in g.segments[1:]:
        points = [sample_point(g, s) for s in range(start, end)]
        radius = max(abs(v) for v in points[0]) if sampling == "square" else math.hypot(*points[0])
        for (y0, x0), (y1, x1) in zip(points, points[1:] + points[:1]):
            # the next member of an orbit is the previous one turned by 360/group degrees (y, x) -> (x, -y) for 90
            turn = 2 * math.pi / group
            expected = (y0 * math.cos(turn) + x0 * math.sin(turn), x0 * math.cos(turn) - y0 * math.sin(turn))
            assert y1 == pytest.approx(expected[0], abs=1e-9) and x1 == pytest.approx(expected[1], abs=1e-9)
        assert 1 <= radius <= n + 1e-9
    # the weight that multiplies a sorted slot is at the grid position of the same angular index on its ring
    for start, end in g.segments[1:]:
        for s in range(start, end):
            row, col = divmod(int(g.slot_to_grid[s]), k)
            assert max(abs(row - n), abs(col - n)) == ring_of(s)
    batcher = {2: [(0, 1)], 4: [(0, 1), (2, 3), (0, 2), (1, 3), (1, 2)]}[group]
    assert g.comparators() == [(s + a, s + b) for s, e in g.segments if e - s > 1 for a, b in batcher]


@pytest.mark.parametrize("radius", [1, 2, 3, 4])
def test_angular_ring_order_matches_the_polar_points(radius):
    offsets = angular_ring_offsets(radius)
    assert len(offsets) == 8 * radius and len(set(offsets)) == 8 * radius
    assert all(max(abs(dy), abs(dx)) == radius for dy, dx in offsets)
    # a quarter turn moves each position 2r places on, as it moves the polar points
    index = {p: j for j, p in enumerate(offsets)}
    assert all(index[(dx, -dy)] == (j + 2 * radius) % (8 * radius) for j, (dy, dx) in enumerate(offsets))
    points = polar_points(radius)
    assert all(index[(round(y), round(x))] == j for j, (y, x) in enumerate(points)
               if abs(y - round(y)) < 1e-9 and abs(x - round(x)) < 1e-9 and max(abs(round(y)), abs(round(x))) == radius)


@pytest.mark.parametrize("k", [3, 5, 7])
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("sorting", ["c4", "c2"])
def test_exactly_equivariant_to_the_group_turns(sorting, sampling, k):
    x, weight, bias = randn(2, 3, 13, 13), randn(4, 3, k, k, seed=1), randn(4, seed=2)
    turns = 4 // GROUPS[sorting]  # quarter turns in the group's generator
    out = sort_conv2d(x, weight, bias, padding=k // 2, sampling=sampling, sorting=sorting, backend="reference")
    for t in range(turns, 4, turns):
        turned = sort_conv2d(torch.rot90(x, t, (2, 3)), weight, bias, padding=k // 2, sampling=sampling,
                             sorting=sorting, backend="reference")
        torch.testing.assert_close(turned, torch.rot90(out, t, (2, 3)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_c2_keeps_the_direction_that_a_quarter_turn_changes(sampling):
    """A window and its quarter turn: ring sorting and c4 cannot tell them apart, c2 can."""
    x, weight = randn(1, 1, 7, 7), randn(1, 1, 7, 7, seed=1)
    outputs = {}
    for sorting in ("ring", "c4", "c2"):
        pair = [sort_conv2d(image, weight, sampling=sampling, sorting=sorting, backend="reference").item()
                for image in (x, torch.rot90(x, 1, (2, 3)))]
        outputs[sorting] = pair
    for sorting in ("ring", "c4"):
        assert outputs[sorting][0] == pytest.approx(outputs[sorting][1], abs=1e-12)
    assert abs(outputs["c2"][0] - outputs["c2"][1]) > 1e-3


def test_c4_sorts_less_than_ring_sorting():
    """On a 3x3 window of distinct values, ring sorting puts ring 1 in one order whatever the layout; c4 sorts the
    two orbits {E, N, W, S} and {NE, NW, SW, SE} separately, so a value moves between orbits only with its own."""
    window = torch.arange(9, dtype=torch.float64).reshape(1, 1, 3, 3)
    g = get_geometry(3, "square", "c4")
    per_slot = {}
    for slot in range(9):
        weight = torch.zeros(1, 1, 3, 3, dtype=torch.float64)
        weight.view(-1)[g.slot_to_grid[slot]] = 1.0  # reads sorted slot `slot`
        per_slot[slot] = sort_conv2d(window, weight, sampling="square", sorting="c4", backend="reference").item()
    # grid value at (dy, dx) is 3 * (dy + 1) + (dx + 1); in angular order from +x (dy the row offset): the
    # axis orbit (0, 1), (1, 0), (0, -1), (-1, 0) holds 5, 7, 3, 1, the diagonal orbit 8, 6, 0, 2
    assert [per_slot[s] for s in range(9)] == [4, 1, 3, 5, 7, 0, 2, 6, 8]


@pytest.mark.slow
@pytest.mark.parametrize("sorting", ["c4", "c2"])
def test_gradcheck_reference(sorting):
    x = randn(1, 2, 6, 6).requires_grad_()
    weight, bias = randn(3, 2, 5, 5, seed=1).requires_grad_(), randn(3, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, w, b: sort_conv2d(a, w, b, padding=2, sorting=sorting, backend="reference"), (x, weight, bias))


@pytest.mark.parametrize("backend", [b for b in available_backends() if b not in ("reference", "harmonic")] + ["auto"])
@pytest.mark.parametrize("sampling,sorting", [("polar", "c2"), ("square", "c4"), ("polar", "c4")])
def test_fast_backends_agree_with_reference_forward_and_backward(backend, sampling, sorting):
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        x = randn(2, 4, 11, 13, dtype=dtype)
        weight, bias = randn(6, 2, 7, 7, seed=1, dtype=dtype), randn(6, seed=2, dtype=dtype)
        grad = randn(2, 6, 6, 7, seed=3, dtype=dtype)
        results = []
        for name in ("reference", backend):
            leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
            out = sort_conv2d(*leaves, stride=2, padding=3, groups=2, sampling=sampling, sorting=sorting,
                              backend=name)
            results.append((out, *torch.autograd.grad(out, leaves, grad)))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("sorting,canonicalize", [("c4", None), ("c2", None), ("c4", "moment4")])
def test_scnn_with_orbit_sorting_is_invariant_to_its_group(sorting, canonicalize):
    model = SCNN(7, "polar", sorting, channels=(4, 4, 8, 8, 8, 8), canonicalize=canonicalize).double().eval()
    randomise_batchnorm(model)
    x = randn(3, 1, 28, 28)
    with torch.no_grad():
        logits = model(x)
        for t in range(1, 4):
            turned = model(torch.rot90(x, t, (2, 3)))
            if canonicalize is not None:  # the canonical turns of the quarter turns agree up to float rounding
                torch.testing.assert_close(turned, logits, rtol=1e-6, atol=1e-6)
            elif sorting == "c4" or t == 2:
                torch.testing.assert_close(turned, logits, rtol=1e-9, atol=1e-9)
            else:
                assert (turned - logits).abs().max() > 1e-6, "c2 does not ignore a quarter turn"
    # same parameters as the ring-sorting network and the plain baseline
    plain = SCNN(7, None, None, channels=(4, 4, 8, 8, 8, 8))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())


def test_c2_with_the_principal_axis_turn_is_invariant_to_any_quarter_turn():
    """The principal-axis turn leaves a multiple of 180 degrees over, which c2 ignores: with it a c2 network
    answers a digit and its quarter turns alike (up to the turn's resampling)."""
    model = SCNN(7, "polar", "c2", channels=(4, 4, 8, 8, 8, 8), canonicalize="moment2").double().eval()
    randomise_batchnorm(model)
    y, x = torch.meshgrid(torch.arange(28.0), torch.arange(28.0), indexing="ij")
    # an elongated blob, tilted: a clear principal axis
    u, v = (x - 13.5) * math.cos(0.4) + (y - 13.5) * math.sin(0.4), -(x - 13.5) * math.sin(0.4) + (y - 13.5) * math.cos(0.4)
    image = torch.exp(-(u / 7) ** 2 - (v / 2.5) ** 2 + 0.3 * torch.sin(u)).double()[None, None]
    with torch.no_grad():
        logits = model(image)
        spread = max((model(torch.rot90(image, t, (2, 3))) - logits).abs().max().item() for t in (1, 2, 3))
        plain = SCNN(7, "polar", "c2", channels=(4, 4, 8, 8, 8, 8)).double().eval()
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("canonicalize")},
                              strict=False)
        plain_spread = (plain(torch.rot90(image, 1, (2, 3))) - plain(image)).abs().max().item()
    assert spread < 0.2 * plain_spread


def test_registered_c2_model_is_the_baselines_size_with_the_principal_axis_turn():
    model = timm.create_model("scnn_p_c2_7_canon")
    assert model.canonicalize.order == 2
    assert {(m.sampling, m.sorting) for m in model.modules() if isinstance(m, SortConv2d)} == {("polar", "c2")}
    baseline = timm.create_model("scnn_baseline_7")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in baseline.parameters())
    with pytest.raises(ValueError, match="sorting='c2'"):
        timm.create_model("scnn_p_c2_7_canon", sorting="ring")


def test_layer_models_and_sortify_take_the_orbit_sortings():
    conv = SortConv2d(3, 5, 5, padding=2, sorting="c2")
    assert conv.sorting == "c2" and "sorting=c2" in repr(conv).replace("'", "")
    model = timm.create_model("ri_resnet18", sorting="c4", num_classes=3)
    assert {m.sorting for m in model.modules() if isinstance(m, SortConv2d)} == {"c4"}
    net = sortify(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3)), sorting="c2")
    assert [m.sorting for m in net if isinstance(m, SortConv2d)] == ["c2", "c2"]
    x = randn(1, 3, 9, 9, dtype=torch.float32)
    torch.testing.assert_close(torch.rot90(net(x), 2, (2, 3)), net(torch.rot90(x, 2, (2, 3))), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="accepted: 'ring', 'global', 'c4', 'c2'"):
        SortConv2d(3, 5, 5, sorting="c3")


@pytest.mark.slow
def test_onnx_export_runs_the_orbit_sorting():
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    model = nn.Sequential(SortConv2d(2, 4, 5, padding=2, sorting="c2"), nn.ReLU(),
                          SortConv2d(4, 3, 3, padding=1, sampling="square", sorting="c4")).eval()
    x = randn(2, 2, 12, 12, dtype=torch.float32)
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, input_names=["x"], dynamo=False)
    session = ort.InferenceSession(buffer.getvalue(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"x": x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), model(x).detach(), rtol=1e-4, atol=1e-4)
