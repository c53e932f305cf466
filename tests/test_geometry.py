"""The sampling geometry of Sorting Convolution: ring positions, polar points, bilinear taps and the
sorting networks, checked against their definitions rather than against stored tables."""
import math

import pytest
import torch

from timm_sortconv.ops.geometry import batcher_comparators, get_geometry, polar_points, ring_grid_offsets

KERNEL_SIZES = (1, 3, 5, 7, 9)
VARIANTS = [(s, o) for s in ("square", "polar") for o in ("ring", "global")]

pytestmark = pytest.mark.usefixtures("one_thread")


def ring_slots(r):
    """Slot range of ring ``r`` in ring order: the centre is slot 0, ring r follows the (2r-1)^2 slots inside it."""
    return range((2 * r - 1) ** 2, (2 * r + 1) ** 2)


def sample_taps(geometry, slot):
    """The taps ``[(dy, dx, weight)]`` of one sample, without the zero-weight padding entries."""
    offsets, weights = geometry.tap_offsets[slot].tolist(), geometry.tap_weights[slot].tolist()
    return [(dy, dx, w) for (dy, dx), w in zip(offsets, weights) if w != 0.0]


@pytest.mark.parametrize("k", KERNEL_SIZES)
def test_ring_offsets_are_chebyshev_rings_in_row_major_order(k):
    n = k // 2
    offsets = ring_grid_offsets(k)
    assert offsets[0] == (0, 0)
    assert sorted(offsets) == [(dy, dx) for dy in range(-n, n + 1) for dx in range(-n, n + 1)]
    for r in range(1, n + 1):
        ring = [offsets[s] for s in ring_slots(r)]
        expected = [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if max(abs(dy), abs(dx)) == r]
        assert len(expected) == 8 * r
        assert ring == expected, "ring positions must be row-major: sorted by row, then column"


@pytest.mark.parametrize("k", KERNEL_SIZES)
@pytest.mark.parametrize("sampling,sorting", VARIANTS)
def test_segments_and_slot_to_grid(k, sampling, sorting):
    g = get_geometry(k, sampling, sorting)
    n = k // 2
    row_major_of = {(dy, dx): (dy + n) * k + (dx + n) for dy in range(-n, n + 1) for dx in range(-n, n + 1)}
    ring_order = ring_grid_offsets(k)
    if sorting == "global":
        assert g.segments == ((0, k * k),)
        assert g.slot_to_grid.tolist() == list(range(k * k))
    else:
        assert g.segments == ((0, 1),) + tuple((ring_slots(r).start, ring_slots(r).stop) for r in range(1, n + 1))
        assert g.slot_to_grid[0].item() == row_major_of[(0, 0)]
        for r in range(1, n + 1):
            targets = [g.slot_to_grid[s].item() for s in ring_slots(r)]
            ring_positions = sorted(row_major_of[o] for o in ring_order if max(map(abs, o)) == r)
            assert targets == ring_positions, "ring r's sorted values go to ring r's positions, row-major"


@pytest.mark.parametrize("k", KERNEL_SIZES)
@pytest.mark.parametrize("sorting", ("ring", "global"))
def test_square_sampling_reads_each_ring_position_once(k, sorting):
    g = get_geometry(k, "square", sorting)
    n = k // 2
    for slot, (dy, dx) in enumerate(ring_grid_offsets(k)):
        assert sample_taps(g, slot) == [(dy, dx, 1.0)]
    # Row s of the interpolation matrix picks the row-major window index of ring-order position s.
    grid_order = [(dy + n) * k + (dx + n) for dy, dx in ring_grid_offsets(k)]
    assert torch.equal(g.interpolation, torch.eye(k * k, dtype=torch.float64)[grid_order])


@pytest.mark.parametrize("k", KERNEL_SIZES)
def test_polar_points_lie_on_their_circles_at_the_right_angles(k):
    g = get_geometry(k, "polar", "ring")
    n = k // 2
    assert sample_taps(g, 0) == [(0, 0, 1.0)]
    for r in range(1, n + 1):
        for j, slot in enumerate(ring_slots(r)):
            taps = sample_taps(g, slot)
            # Bilinear interpolation reproduces linear functions, so the weighted tap offsets are the point.
            y = sum(w * dy for dy, dx, w in taps)
            x = sum(w * dx for dy, dx, w in taps)
            assert math.hypot(y, x) == pytest.approx(r, abs=1e-12)
            angle = 2 * math.pi * j / (8 * r)
            assert y == pytest.approx(r * math.sin(angle), abs=1e-12)
            assert x == pytest.approx(r * math.cos(angle), abs=1e-12)


@pytest.mark.parametrize("k", (5, 7))
def test_polar_points_of_paper_kernel_sizes_lie_exactly_on_circles(k):
    """The paper's released 5x5 and 7x7 tables put points off the circle; ours must not."""
    for r in range(1, k // 2 + 1):
        points = polar_points(r)
        assert len(points) == 8 * r
        for y, x in points:
            assert math.hypot(y, x) == pytest.approx(r, abs=1e-12)
        angles = sorted(math.atan2(y, x) % (2 * math.pi) for y, x in points)
        steps = [b - a for a, b in zip(angles, angles[1:])] + [angles[0] + 2 * math.pi - angles[-1]]
        assert steps == pytest.approx([2 * math.pi / (8 * r)] * (8 * r), abs=1e-12)


@pytest.mark.parametrize("k", KERNEL_SIZES)
def test_polar_taps_are_the_bilinear_corners_inside_the_window(k):
    g = get_geometry(k, "polar", "ring")
    n = k // 2
    for r in range(1, n + 1):
        for j, slot in enumerate(ring_slots(r)):
            angle = 2 * math.pi * j / (8 * r)
            y, x = r * math.sin(angle), r * math.cos(angle)
            taps = sample_taps(g, slot)
            assert 1 <= len(taps) <= 4
            assert len({(dy, dx) for dy, dx, _ in taps}) == len(taps), "taps must be distinct grid positions"
            assert sum(w for _, _, w in taps) == pytest.approx(1.0, abs=1e-12)
            for dy, dx, w in taps:
                assert max(abs(dy), abs(dx)) <= n, "every tap lies inside the window"
                assert w > 0
                # The bilinear support: the corners of the grid cell holding the point, each weighted by
                # the area of the opposite sub-rectangle.
                assert abs(dy - y) < 1 and abs(dx - x) < 1
                assert w == pytest.approx((1 - abs(dy - y)) * (1 - abs(dx - x)), abs=1e-12)
            # The interpolation matrix row of a sample is its taps scattered onto the row-major window.
            row = torch.zeros(k * k, dtype=torch.float64)
            for dy, dx, w in taps:
                row[(dy + n) * k + (dx + n)] += w
            assert torch.equal(g.interpolation[slot], row)


@pytest.mark.parametrize("k", KERNEL_SIZES)
@pytest.mark.parametrize("sampling", ("square", "polar"))
def test_tap_table_is_exactly_symmetric_under_quarter_turns(k, sampling):
    """Rotating a ring's point set by 90 degrees maps it onto itself, bit for bit: the sample a quarter
    turn (2r steps) further on has the rotated taps with identical weights."""
    g = get_geometry(k, sampling, "ring")
    n = k // 2
    window = g.interpolation.reshape(k * k, k, k)
    for r in range(1, n + 1):
        slots = list(ring_slots(r))
        samples = [window[s] for s in slots]
        # A point (y, x) turns to (x, -y): for a k x k tap map M indexed [dy + n, dx + n] that is
        # torch.rot90(M, -1).
        for m in samples:
            turned = torch.rot90(m, -1, dims=(0, 1))
            assert any(torch.equal(turned, other) for other in samples), "the turned point set maps onto itself"
        if sampling == "polar":
            # Angle 2*pi*j/(8r) + 90 degrees is sample j + 2r.
            for j in range(8 * r):
                rotated = torch.rot90(samples[j], -1, dims=(0, 1))
                assert torch.equal(rotated, samples[(j + 2 * r) % (8 * r)])


def test_kernel_size_one_is_a_single_centre():
    for sampling, sorting in VARIANTS:
        g = get_geometry(1, sampling, sorting)
        assert g.segments == ((0, 1),)
        assert g.tap_offsets.tolist() == [[[0, 0]]]
        assert g.tap_weights.tolist() == [[1.0]]
        assert g.interpolation.tolist() == [[1.0]]
        assert g.slot_to_grid.tolist() == [0]
        assert g.comparators() == []


def apply_network(values, comparators):
    """Runs a comparator network along the last axis of ``values`` (a tensor)."""
    values = values.clone()
    for i, j in comparators:
        low, high = torch.minimum(values[..., i], values[..., j]), torch.maximum(values[..., i], values[..., j])
        values[..., i], values[..., j] = low, high
    return values


@pytest.mark.slow
@pytest.mark.parametrize("size", range(1, 17))
def test_batcher_network_sorts_every_zero_one_input(size):
    """0-1 principle: a comparator network sorts everything iff it sorts all 2^size 0-1 vectors."""
    pairs = batcher_comparators(size)
    assert all(0 <= i < j < size for i, j in pairs)
    bits = torch.arange(2 ** size).unsqueeze(1).bitwise_right_shift(torch.arange(size)).bitwise_and(1)
    out = apply_network(bits, pairs)
    assert torch.equal(out, bits.sort(dim=1).values)


@pytest.mark.parametrize("size", (24, 49))
def test_batcher_network_sorts_random_inputs(size):
    generator = torch.Generator().manual_seed(size)
    values = torch.randn(2000, size, generator=generator, dtype=torch.float64)
    # Ties and repeated values too: a coarse integer grid.
    values = torch.cat([values, torch.randint(0, 4, (2000, size), generator=generator).double()])
    assert torch.equal(apply_network(values, batcher_comparators(size)), values.sort(dim=1).values)


def test_batcher_comparator_counts():
    assert len(batcher_comparators(8)) == 19
    assert len(batcher_comparators(16)) == 63
    assert len(batcher_comparators(24)) == 132
    assert len(batcher_comparators(1)) == 0
    assert batcher_comparators(2) == [(0, 1)]


@pytest.mark.parametrize("k", (3, 5, 7))
@pytest.mark.parametrize("sorting", ("ring", "global"))
def test_geometry_comparators_sort_each_segment(k, sorting):
    g = get_geometry(k, "polar", sorting)
    generator = torch.Generator().manual_seed(k)
    values = torch.randn(500, k * k, generator=generator, dtype=torch.float64)
    expected = torch.cat([values[:, s:e].sort(dim=1).values for s, e in g.segments], dim=1)
    assert torch.equal(apply_network(values, g.comparators()), expected)
    touched = {i for pair in g.comparators() for i in pair}
    assert all(any(s <= i < e for s, e in g.segments) for i in touched)
    for i, j in g.comparators():
        assert any(s <= i < j < e for s, e in g.segments), "a comparator must not cross segments"

