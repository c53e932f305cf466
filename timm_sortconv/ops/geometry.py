"""Sampling geometry of Sorting Convolution, computed from first principles for any kernel size.

A ``k x k`` window (``k = 2n + 1``) is split into the centre and ``n`` Chebyshev rings; ring ``r``
holds the ``8r`` grid positions ``(dy, dx)`` with ``max(|dy|, |dx|) = r``. Every SC variant works on
a vector of ``k*k`` *samples* laid out in **ring order**: the centre first, then ring 1's eight
samples, then ring 2's sixteen, and so on. Ring ``r`` occupies slots ``[(2r-1)^2, (2r+1)^2)``.

**Even kernels** (``k = 2n``, e.g. the ``4 x 4`` stem and ``2 x 2`` downsampling of ConvNeXt) have their
centre between four pixels. Measured from it, the pixels sit at half-integer coordinates, and ring ``r``
(``r = 1 .. n``) holds the ``8r - 4`` positions at Chebyshev distance ``r - 1/2``: the inner ``2 x 2``, then
12, 20, ... positions, slots ``[(2r-2)^2, (2r)^2)``; there is no centre sample. A quarter turn about the
centre maps every ring onto itself, so everything below (polar points on circles of radius ``r - 1/2``,
the sortings, their orbits of 4 and 2) carries over unchanged. Grid offsets are stored as integers
``(dy, dx) = (row, column) - k // 2`` for every ``k``, so a window's top-left pixel is at ``-(k // 2)``
and row-major index ``(dy + k // 2) * k + (dx + k // 2)``; for even ``k`` the true position of an offset
relative to the centre is ``(dy + 1/2, dx + 1/2)``.

* ``sampling="square"``: the samples of ring ``r`` are the window's values at ring ``r``'s grid
  positions (so each sample has a single tap of weight 1).
* ``sampling="polar"``: the samples of ring ``r`` are the ``8r`` points on the circle of radius ``r``
  at angles ``2*pi*j/(8r)``, angle 0 on the +x (column) axis, each read by bilinear interpolation
  from the (at most four) grid positions around it. Since ``|x|, |y| <= r <= n`` every tap lies
  inside the window. The points of the first quadrant are computed with ``cos``/``sin`` and the other
  three quadrants are exact 90-degree rotations of them, so the tap tables are exactly symmetric under
  ``torch.rot90`` and 90-degree equivariance holds to the last bit of the weights.

Sorting then rearranges the samples (``sorting="ring"``: each ring's slots among themselves;
``sorting="global"``: all slots) and the sorted value in slot ``s`` is multiplied by the kernel weight
at grid position :attr:`SortGeometry.slot_to_grid` ``[s]``: for ring sorting, ring ``r``'s sorted
values are written to ring ``r``'s positions in row-major order (the centre stays in the centre);
for global sorting, the ``k*k`` sorted values are written row-major over the whole window.

``sorting="c4"`` and ``sorting="c2"`` sort less: only within the *orbits* of the quarter turns (C4:
the 4 samples of a ring at angles ``a, a + 90, a + 180, a + 270`` degrees) or of the half turn (C2:
the 2 samples at ``a`` and ``a + 180``). A quarter (half) turn of the window permutes every orbit
cyclically, so the result is exactly invariant to it, as for ring sorting, while the network keeps
which orbit, that is which direction modulo 90 (180) degrees, each value came from. That is the
information ring sorting throws away, and a network needs it where the input's orientation is known
up to a quarter (half) turn: after :class:`~timm_sortconv.canonical.MomentCanonicalize2d` of order 4
(2); with ring sorting either order does. For these sortings the samples of each ring are laid out
orbit by orbit (slot ``(o, m)`` of ring ``r``: the sample at angular index ``j = o + m * 8r / |C|``, in
order of the angle ``atan2(dy, dx)`` from the +x axis, as :func:`polar_points` counts), each orbit one
segment, and the sorted value of slot ``(o, m)`` is multiplied by the weight at the ``j``-th grid
position of ring ``r`` in the same angular order. With square sampling, slot ``(o, m)`` reads the grid
position whose weight it carries, so without the sorting it would be ``nn.Conv2d``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

__all__ = [
    "ALIGNMENTS",
    "ORBIT_SORTINGS",
    "SAMPLINGS",
    "SORTINGS",
    "SortGeometry",
    "get_geometry",
    "ring_grid_offsets",
    "row_major_offsets",
    "orbit_order",
    "polar_points",
    "batcher_comparators",
    "check_kernel_size",
    "check_variant",
]

SAMPLINGS = ("square", "polar")
SORTINGS = ("ring", "global", "c4", "c2", "align", "align-channel")
# sorting -> the order of the rotation group whose orbits are sorted
ORBIT_SORTINGS = {"c4": 4, "c2": 2}
# The variants that turn each window to its own orientation instead of sorting it (:mod:`.alignment`), and
# whether one orientation is shared by the channels of a group ("align") or each channel has its own.
ALIGNMENTS = {"align": "shared", "align-channel": "channel"}

# Tap weights closer than this to 0 or 1 are snapped: cos(pi/2) is 6e-17, not 0, and a tap of weight
# 6e-17 one step outside the circle's bounding box would leave the window.
_SNAP = 1e-12


def _centre_shift(kernel_size: int) -> float:
    """Where the window's centre lies from the grid offset ``(0, 0)``: 0 for odd ``k``, 1/2 for even."""
    return 0.0 if kernel_size % 2 else 0.5


def _rings(kernel_size: int) -> List[Tuple[float, List[Tuple[int, int]]]]:
    """``(radius, offsets)`` per ring, inside out: the Chebyshev distance of the ring's positions from the
    window's centre and their grid offsets ``(dy, dx)`` in row-major order (the centre of an odd window is
    the ring of radius 0)."""
    shift = _centre_shift(kernel_size)
    low = -(kernel_size // 2)
    positions = [(dy, dx) for dy in range(low, low + kernel_size) for dx in range(low, low + kernel_size)]
    radius = lambda p: max(abs(p[0] + shift), abs(p[1] + shift))  # noqa: E731
    radii = sorted({radius(p) for p in positions})
    return [(r, [p for p in positions if radius(p) == r]) for r in radii]


def ring_grid_offsets(kernel_size: int) -> List[Tuple[int, int]]:
    """Grid offsets ``(dy, dx)`` of the window in ring order: each Chebyshev ring (the centre first for odd
    ``k``) in row-major order."""
    return [p for _, ring in _rings(kernel_size) for p in ring]


def row_major_offsets(kernel_size: int) -> List[Tuple[int, int]]:
    """Grid offsets ``(dy, dx)`` of the window in row-major order."""
    low = -(kernel_size // 2)
    return [(dy, dx) for dy in range(low, low + kernel_size) for dx in range(low, low + kernel_size)]


def polar_points(radius: float, count: int = 0) -> List[Tuple[float, float]]:
    """The ``count`` points ``(y, x)`` (default ``8 * radius``; a multiple of 4) on the circle of that radius,
    angle ``2*pi*j/count`` from the +x axis, in order of ``j``. The first quadrant is computed; the others are
    its exact rotations ``(y, x) -> (x, -y)`` by 90 degrees."""
    count = count or int(8 * radius)
    quarter = count // 4
    first = []
    for j in range(quarter):
        angle = 2.0 * math.pi * j / count
        first.append((radius * math.sin(angle), radius * math.cos(angle)))
    points = list(first)
    for _ in range(3):
        points += [(x, -y) for y, x in points[-quarter:]]
    return points


def _snap(value: float) -> float:
    nearest = round(value)
    return float(nearest) if abs(value - nearest) < _SNAP else value


def _bilinear_taps(y: float, x: float) -> List[Tuple[int, int, float]]:
    """Taps ``(dy, dx, weight)`` of bilinear interpolation at ``(y, x)``; zero-weight taps are dropped."""
    y, x = _snap(y), _snap(x)
    y0, x0 = math.floor(y), math.floor(x)
    fy, fx = y - y0, x - x0
    taps = []
    for dy, wy in ((y0, 1.0 - fy), (y0 + 1, fy)):
        for dx, wx in ((x0, 1.0 - fx), (x0 + 1, fx)):
            if wy * wx > _SNAP:
                taps.append((dy, dx, wy * wx))
    return taps


def batcher_comparators(size: int) -> List[Tuple[int, int]]:
    """Batcher's odd-even merge sort network for ``size`` values, as comparator pairs ``(i, j)``,
    ``i < j``: after ``a[i], a[j] = min, max`` for every pair in order, ``a`` is sorted ascending.

    Built for the next power of two; comparators touching an index ``>= size`` are dropped, which is
    exact because the missing values can be taken as ``+inf`` at the end and never move."""
    padded = 1
    while padded < size:
        padded *= 2
    pairs: List[Tuple[int, int]] = []
    p = 1
    while p < padded:
        k = p
        while k >= 1:
            for j in range(k % p, padded - k, 2 * k):
                for i in range(min(k, padded - j - k)):
                    a, b = i + j, i + j + k
                    if a // (2 * p) == b // (2 * p) and a < size and b < size:
                        pairs.append((a, b))
            k //= 2
        p *= 2
    return pairs


@dataclass(frozen=True)
class SortGeometry:
    """Everything an SC implementation needs for one ``(kernel_size, sampling, sorting)``.

    Attributes:
        kernel_size: ``k`` (odd or even, see the module docstring).
        sampling: ``"square"`` or ``"polar"``.
        sorting: ``"ring"``, ``"global"``, ``"c4"``, ``"c2"``, ``"align"`` or ``"align-channel"``.
        segments: ``(start, end)`` slot ranges sorted independently, in slot order.
        tap_offsets: ``(k*k, T, 2)`` int64 grid offsets ``(dy, dx)`` of each sample's taps (unused taps
            repeat the first one with weight 0).
        tap_weights: ``(k*k, T)`` float64 bilinear weights; each row sums to 1.
        interpolation: ``(k*k, k*k)`` float64 matrix mapping the row-major window to the samples in slot order.
        slot_to_grid: ``(k*k,)`` int64 row-major kernel position that multiplies each sorted slot.
        sample_grid: the grid offset ``(dy, dx)`` of each sample's first tap, in slot order: for square
            sampling, where each sample is read (the same as ``tap_offsets[:, 0]``, kept as Python ints
            so that traced code reads it as constants).
    """

    kernel_size: int
    sampling: str
    sorting: str
    segments: Tuple[Tuple[int, int], ...]
    tap_offsets: torch.Tensor
    tap_weights: torch.Tensor
    interpolation: torch.Tensor
    slot_to_grid: torch.Tensor
    sample_grid: Tuple[Tuple[int, int], ...] = ()

    def comparators(self) -> List[Tuple[int, int]]:
        """The sorting network over the slots: one Batcher network per segment, shifted."""
        return [(a + s, b + s) for s, e in self.segments for a, b in batcher_comparators(e - s)]


def check_kernel_size(kernel_size) -> int:
    """Returns the square kernel size ``k`` (an int, or a pair of equal ints) or raises the error naming what
    was given: ``TypeError`` for a value that is no int, ``RuntimeError`` for ``k < 1`` (as ``nn.Conv2d``),
    ``ValueError`` for a kernel that is not square (Sorting Convolution's own limit)."""
    size = kernel_size
    if isinstance(size, (tuple, list)):
        if len(size) != 2 or size[0] != size[1]:
            raise ValueError(f"SortConv2d needs a square kernel, got kernel_size={tuple(size)}; "
                             "pass one int k >= 1 or a pair (k, k)")
        size = size[0]
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"kernel_size={kernel_size!r} is not accepted; use an int k >= 1 or a pair (k, k)")
    if size < 1:
        raise RuntimeError(f"kernel_size={kernel_size!r}: SortConv2d needs a kernel size k >= 1 (1, 2, 3, ...)")
    return size


def check_variant(sampling: str, sorting: str) -> None:
    if sampling not in SAMPLINGS:
        raise ValueError(f"unknown sampling={sampling!r}; accepted: {', '.join(map(repr, SAMPLINGS))}")
    if sorting not in SORTINGS:
        raise ValueError(f"unknown sorting={sorting!r}; accepted: {', '.join(map(repr, SORTINGS))}")


# A plain dict rather than functools.lru_cache: torch.compile ignores an lru_cache and traces the
# wrapped function, which put hundreds of table-building ops into every compiled graph, while it reads
# an entry of this dict as a constant.
_GEOMETRIES: Dict[Tuple[int, str, str], SortGeometry] = {}


def get_geometry(kernel_size: int, sampling: str = "polar", sorting: str = "ring") -> SortGeometry:
    """The cached :class:`SortGeometry` for a ``kernel_size`` and a variant.

    Example:
        >>> g = get_geometry(3, "polar", "ring")
        >>> g.segments
        ((0, 1), (1, 9))
        >>> g.tap_weights.sum(1).allclose(torch.ones(9, dtype=torch.float64))
        True
    """
    k = check_kernel_size(kernel_size)
    check_variant(sampling, sorting)
    key = (k, sampling, sorting)
    if key not in _GEOMETRIES:
        _GEOMETRIES[key] = _build_geometry(*key)
    return _GEOMETRIES[key]


def _angular(offsets: List[Tuple[int, int]], shift: float) -> List[Tuple[int, int]]:
    """``offsets`` (one ring) in order of their angle about the window's centre, ``atan2`` in ``[0, 360)``."""
    return sorted(offsets, key=lambda p: math.atan2(p[0] + shift, p[1] + shift) % (2.0 * math.pi))


def angular_ring_offsets(radius: int) -> List[Tuple[int, int]]:
    """Ring ``radius``'s ``8 * radius`` grid offsets ``(dy, dx)`` (odd kernels) in order of their angle
    ``atan2(dy, dx)`` in ``[0, 360)`` degrees (``dy`` the row offset), the order of :func:`polar_points`: a
    quarter turn ``(dy, dx) -> (dx, -dy)`` moves each one ``2 * radius`` places on."""
    ring = [(dy, dx) for dy in range(-radius, radius + 1) for dx in range(-radius, radius + 1)
            if max(abs(dy), abs(dx)) == radius]
    return _angular(ring, 0.0)


def orbit_order(size: int, group: int) -> List[int]:
    """Angular indices ``j`` of a ring of ``size`` samples in the slot order of the orbit sortings: orbit by
    orbit, ``o + m * size / group`` for each orbit ``o`` and then each member ``m``.

    Example:
        >>> orbit_order(8, 4)  # ring 1 of an odd window: two orbits of a quarter turn
        [0, 2, 4, 6, 1, 3, 5, 7]
    """
    step = size // group
    return [o + m * step for o in range(step) for m in range(group)]


def _build_geometry(k: int, sampling: str, sorting: str) -> SortGeometry:
    n, shift = k // 2, _centre_shift(k)
    rings = _rings(k)
    group = ORBIT_SORTINGS.get(sorting, 0)
    aligned = sorting in ALIGNMENTS
    if group or aligned:  # samples and weights in angular order, orbit by orbit; the centre (radius 0) stays alone
        weight_rings = [ring if radius == 0 else [_angular(ring, shift)[j] for j in
                                                  orbit_order(len(ring), group or len(ring))]
                        for radius, ring in rings]
    else:
        weight_rings = [ring for _, ring in rings]
    weight_grid = [p for ring in weight_rings for p in ring]
    if sampling == "square":
        taps = [[(dy, dx, 1.0)] for dy, dx in weight_grid]
    else:
        taps = []
        for radius, ring in rings:
            if radius == 0:
                taps.append([(0, 0, 1.0)])
                continue
            points = polar_points(radius, len(ring))
            if group:
                points = [points[j] for j in orbit_order(len(ring), group)]
            # the points are measured from the centre, the taps from the grid offset (0, 0)
            taps += [_bilinear_taps(y - shift, x - shift) for y, x in points]
    width = max(len(t) for t in taps)
    taps = [t + [(*t[0][:2], 0.0)] * (width - len(t)) for t in taps]
    interpolation_rows = []
    for sample_taps in taps:
        row = [0.0] * (k * k)
        for dy, dx, w in sample_taps:
            assert -n <= min(dy, dx) and max(dy, dx) < k - n, "a bilinear tap left the window"
            row[(dy + n) * k + (dx + n)] += w
        interpolation_rows.append(row)
    # The tables are filled as Python lists and converted once: a caller that is traced or compiled
    # before the cache holds this geometry then records three constants, not one op per entry.
    offsets = torch.tensor([[(dy, dx) for dy, dx, _ in t] for t in taps], dtype=torch.long)
    weights = torch.tensor([[w for _, _, w in t] for t in taps], dtype=torch.float64)
    interpolation = torch.tensor(interpolation_rows, dtype=torch.float64)
    bounds, start = [], 0
    for _, ring in rings:
        bounds.append((start, start + len(ring)))
        start += len(ring)
    if group:  # the centre alone, then each orbit
        segments = tuple(seg for a, b in bounds
                         for seg in ([(a, b)] if b - a == 1 else [(s, s + group) for s in range(a, b, group)]))
    elif sorting == "ring" or aligned:
        segments = tuple(bounds)
    else:
        segments = ((0, k * k),)
    if sorting == "global":
        slot_to_grid = torch.arange(k * k)
    else:
        slot_to_grid = torch.tensor([(dy + n) * k + (dx + n) for dy, dx in weight_grid], dtype=torch.long)
    sample_grid = tuple((t[0][0], t[0][1]) for t in taps)
    return SortGeometry(k, sampling, sorting, segments, offsets, weights, interpolation, slot_to_grid, sample_grid)
