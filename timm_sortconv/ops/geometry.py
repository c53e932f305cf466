"""Sampling geometry of Sorting Convolution, computed from first principles for any odd kernel size.

A ``k x k`` window (``k = 2n + 1``) is split into the centre and ``n`` Chebyshev rings; ring ``r``
holds the ``8r`` grid positions ``(dy, dx)`` with ``max(|dy|, |dx|) = r``. Every SC variant works on
a vector of ``k*k`` *samples* laid out in **ring order**: the centre first, then ring 1's eight
samples, then ring 2's sixteen, and so on. Ring ``r`` occupies slots ``[(2r-1)^2, (2r+1)^2)``.

* ``sampling="square"``: the samples of ring ``r`` are the window's values at ring ``r``'s grid
  positions (so each sample has a single tap of weight 1).
* ``sampling="polar"``: the samples of ring ``r`` are the ``8r`` points on the circle of radius ``r``
  at angles ``2*pi*j/(8r)``, angle 0 on the +x (column) axis, each read by bilinear interpolation
  from the (at most four) grid positions around it. Since ``|x|, |y| <= r <= n`` every tap lies
  inside the window. The points of the first quadrant are computed with ``cos``/``sin`` and the other
  three quadrants are exact 90-degree rotations of them, so the tap tables are exactly symmetric under
  ``torch.rot90`` and 90-degree equivariance holds to the last bit of the weights.
* ``sampling="polar-offset"``: as ``"polar"``, with every ring's points turned by half their angular
  step, to ``2*pi*(j + 1/2)/(8r)``. No point then lies on an axis or a diagonal.
  With ``"polar"`` the points on the axes read one pixel exactly while the others are blends of
  up to four, so a ring's values differ in how blurred they are, in a pattern that repeats every 90
  degrees and that a rotation by 45 degrees swaps (the axis and diagonal points change roles): a cue
  to the orientation of the content that training can learn and that turns with the input. With the
  offset, ring 1's eight points are images of one another under the grid's symmetries (quarter turns
  and mirrors), so each is read through the same blend.

**Ring density.** With ``ring_density=m > 1`` (polar sampling, either kind) ring ``r`` is read at
``8rm`` points, angle ``2*pi*j/(8rm)`` (``2*pi*(j + 1/2)/(8rm)`` with the offset), instead of ``8r``.
Sorted, the ``8rm`` values are close to the quantiles of the ring's values, which a rotation by any
angle barely moves, whereas ``8r`` order statistics jump whenever the rotation is not a multiple of
``45/r`` degrees. Each run of ``m`` consecutive sorted values is averaged and takes the weight that one
sorted value takes at density 1, so the layer keeps its ``k*k`` weights: a geometry of density ``m`` has
``1 + 4n(n+1)m`` samples for ring sorting (the centre once) and ``m*k*k`` for global sorting (the centre
``m`` times, so that the sorted values split into ``k*k`` runs of ``m``), more than the ``k*k`` slots of
density 1. For ring sorting the density may also be given per ring, ``(m_1, ..., m_n)``: ring ``r`` is
read at ``8r m_r`` points, e.g. ``(3, 2, 1)`` for ``k = 7`` spends the extra samples on the inner rings,
whose ``8r`` points are the sparsest in angle, and has ``1 + 24 + 32 + 24 = 81 = 9*9`` samples.
:attr:`SortGeometry.slot_to_grid` then sends ``m`` slots to each kernel position and
:attr:`SortGeometry.slot_scale` is ``1/m``. :func:`square_slot_form` lays such a geometry onto the
``K*K`` slots of a larger odd ``K`` (unused slots get zero weight), for backends that take one sample
per kernel position.

Sorting then rearranges the samples (``sorting="ring"``: each ring's slots among themselves;
``sorting="global"``: all slots) and the sorted value in slot ``s`` is multiplied by the kernel weight
at grid position :attr:`SortGeometry.slot_to_grid` ``[s]``: for ring sorting, ring ``r``'s sorted
values are written to ring ``r``'s positions in row-major order (the centre stays in the centre);
for global sorting, the ``k*k`` sorted values are written row-major over the whole window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch

__all__ = [
    "SAMPLINGS",
    "SORTINGS",
    "SortGeometry",
    "get_geometry",
    "ring_grid_offsets",
    "row_major_offsets",
    "polar_points",
    "batcher_comparators",
    "check_kernel_size",
    "check_variant",
    "check_ring_density",
    "square_slot_form",
]

SAMPLINGS = ("square", "polar", "polar-offset")
SORTINGS = ("ring", "global")

# Tap weights closer than this to 0 or 1 are snapped: cos(pi/2) is 6e-17, not 0, and a tap of weight
# 6e-17 one step outside the circle's bounding box would leave the window.
_SNAP = 1e-12


def ring_grid_offsets(kernel_size: int) -> List[Tuple[int, int]]:
    """Grid offsets ``(dy, dx)`` of the window in ring order: centre, then each Chebyshev ring in
    row-major order."""
    n = kernel_size // 2
    offsets = [(0, 0)]
    for r in range(1, n + 1):
        offsets += [(dy, dx) for dy in range(-r, r + 1) for dx in range(-r, r + 1) if max(abs(dy), abs(dx)) == r]
    return offsets


def row_major_offsets(kernel_size: int) -> List[Tuple[int, int]]:
    """Grid offsets ``(dy, dx)`` of the window in row-major order."""
    n = kernel_size // 2
    return [(dy, dx) for dy in range(-n, n + 1) for dx in range(-n, n + 1)]


def polar_points(radius: int, count: Optional[int] = None, offset: float = 0.0) -> List[Tuple[float, float]]:
    """The ``count`` (default ``8 * radius``, a multiple of 4) points ``(y, x)`` on the circle of that
    radius, angle ``2*pi*(j + offset)/count`` from the +x axis, in order of ``j``. The first quadrant is
    computed; the others are its exact rotations ``(y, x) -> (x, -y)`` by 90 degrees."""
    count = 8 * radius if count is None else count
    if count % 4:
        raise ValueError(f"polar_points needs a multiple of 4 points (a quarter turn maps them onto themselves), "
                         f"got count={count}")
    quarter = count // 4
    first = []
    for j in range(quarter):
        angle = 2.0 * math.pi * (j + offset) / count
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
        kernel_size: odd ``k``.
        sampling: ``"square"`` or ``"polar"``.
        sorting: ``"ring"`` or ``"global"``.
        segments: ``(start, end)`` slot ranges sorted independently, in ring order.
        tap_offsets: ``(k*k, T, 2)`` int64 grid offsets ``(dy, dx)`` of each sample's taps (unused taps
            repeat the first one with weight 0).
        tap_weights: ``(k*k, T)`` float64 bilinear weights; each row sums to 1.
        interpolation: ``(k*k, k*k)`` float64 matrix mapping the row-major window to ring-order samples.
        slot_to_grid: ``(k*k,)`` int64 row-major kernel position that multiplies each sorted slot.
        ring_density: ``m`` or ``(m_1, ..., m_n)``: samples per kernel position (see the module
            docstring); above 1 the sample tables above have :attr:`samples` rows instead of ``k*k``.
        slot_scale: ``None`` at density 1, else ``(samples,)`` float64 factors (``1/m`` of the slot's
            ring) that the weight of each sorted slot is multiplied by.
    """

    kernel_size: int
    sampling: str
    sorting: str
    segments: Tuple[Tuple[int, int], ...]
    tap_offsets: torch.Tensor
    tap_weights: torch.Tensor
    interpolation: torch.Tensor
    slot_to_grid: torch.Tensor
    ring_density: Union[int, Tuple[int, ...]] = 1
    slot_scale: Optional[torch.Tensor] = None

    @property
    def samples(self) -> int:
        """Number of samples (and sorted slots) per window: ``k*k`` at density 1."""
        return self.slot_to_grid.numel()

    def comparators(self) -> List[Tuple[int, int]]:
        """The sorting network over ring-order slots: one Batcher network per segment, shifted."""
        return [(a + s, b + s) for s, e in self.segments for a, b in batcher_comparators(e - s)]


def check_kernel_size(kernel_size) -> int:
    """Returns the odd square kernel size ``k`` or raises ``ValueError`` naming what was given."""
    if isinstance(kernel_size, (tuple, list)):
        if len(kernel_size) != 2 or kernel_size[0] != kernel_size[1]:
            raise ValueError(
                f"SortConv2d needs a square kernel, got kernel_size={tuple(kernel_size)}; "
                "pass one odd int k >= 1 or a pair (k, k)"
            )
        kernel_size = kernel_size[0]
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(
            f"SortConv2d needs an odd kernel size k >= 1 (1, 3, 5, 7, ...), got kernel_size={kernel_size!r}"
        )
    return kernel_size


def check_variant(sampling: str, sorting: str) -> None:
    if sampling not in SAMPLINGS:
        raise ValueError(f"unknown sampling={sampling!r}; accepted: {', '.join(map(repr, SAMPLINGS))}")
    if sorting not in SORTINGS:
        raise ValueError(f"unknown sorting={sorting!r}; accepted: {', '.join(map(repr, SORTINGS))}")


def check_ring_density(ring_density, kernel_size: int, sampling: str, sorting: str) -> Union[int, Tuple[int, ...]]:
    """Returns ``ring_density`` as given (an int >= 1, or for ring sorting one int >= 1 per ring; above 1
    only with polar sampling), a per-ring list as a tuple, or raises ``ValueError``."""
    def valid(m):
        return isinstance(m, int) and not isinstance(m, bool) and m >= 1

    rings = kernel_size // 2
    if isinstance(ring_density, (tuple, list)):
        if sorting != "ring" or len(ring_density) != rings or not all(map(valid, ring_density)):
            raise ValueError(f"a per-ring ring_density needs sorting='ring' and one int >= 1 for each of the {rings} "
                             f"rings of a {kernel_size}x{kernel_size} kernel, got ring_density={ring_density!r}, "
                             f"sorting={sorting!r}")
        ring_density = tuple(ring_density)
        dense = any(m > 1 for m in ring_density)
    elif not valid(ring_density):
        raise ValueError(f"ring_density must be an int >= 1 (samples per kernel position) or, for ring sorting, "
                         f"one per ring, got {ring_density!r}")
    else:
        dense = ring_density > 1
    if dense and sampling == "square":
        raise ValueError(f"ring_density={ring_density} needs a polar sampling: square sampling reads each grid "
                         f"position once and has no denser points to read, got sampling={sampling!r}")
    return ring_density


# A plain dict rather than functools.lru_cache: torch.compile ignores an lru_cache and traces the
# wrapped function, which put hundreds of table-building ops into every compiled graph, while it reads
# an entry of this dict as a constant.
_GEOMETRIES: Dict[Tuple[int, str, str, int], SortGeometry] = {}


def get_geometry(kernel_size: int, sampling: str = "polar", sorting: str = "ring",
                 ring_density: Union[int, Tuple[int, ...]] = 1) -> SortGeometry:
    """The cached :class:`SortGeometry` for an odd ``kernel_size``, a variant and a ring density.

    Example:
        >>> g = get_geometry(3, "polar", "ring")
        >>> g.segments
        ((0, 1), (1, 9))
        >>> g.tap_weights.sum(1).allclose(torch.ones(9, dtype=torch.float64))
        True
        >>> get_geometry(3, "polar", "ring", ring_density=2).segments
        ((0, 1), (1, 17))
        >>> get_geometry(7, "polar", "ring", ring_density=(3, 2, 1)).samples
        81
    """
    k = check_kernel_size(kernel_size)
    check_variant(sampling, sorting)
    key = (k, sampling, sorting, check_ring_density(ring_density, k, sampling, sorting))
    if key not in _GEOMETRIES:
        _GEOMETRIES[key] = _build_geometry(*key)
    return _GEOMETRIES[key]


def _build_geometry(k: int, sampling: str, sorting: str, density) -> SortGeometry:
    n = k // 2
    grid = ring_grid_offsets(k)
    per_ring = density if isinstance(density, tuple) else (density,) * n
    offset = 0.5 if sampling == "polar-offset" else 0.0
    if sampling == "square":
        taps = [[(dy, dx, 1.0)] for dy, dx in grid]
    else:
        # The centre is read once for ring sorting (a segment of its own) and `density` times for global
        # sorting, whose sorted values must split into k*k runs of `density`.
        taps = [[(0, 0, 1.0)]] * (density if sorting == "global" else 1)
        for r in range(1, n + 1):
            taps += [_bilinear_taps(y, x) for y, x in polar_points(r, 8 * r * per_ring[r - 1], offset)]
    width = max(len(t) for t in taps)
    taps = [t + [(*t[0][:2], 0.0)] * (width - len(t)) for t in taps]
    interpolation_rows = []
    for sample_taps in taps:
        row = [0.0] * (k * k)
        for dy, dx, w in sample_taps:
            assert max(abs(dy), abs(dx)) <= n, "a bilinear tap left the window"
            row[(dy + n) * k + (dx + n)] += w
        interpolation_rows.append(row)
    # The tables are filled as Python lists and converted once: a caller that is traced or compiled
    # before the cache holds this geometry then records three constants, not one op per entry.
    offsets = torch.tensor([[(dy, dx) for dy, dx, _ in t] for t in taps], dtype=torch.long)
    weights = torch.tensor([[w for _, _, w in t] for t in taps], dtype=torch.float64)
    interpolation = torch.tensor(interpolation_rows, dtype=torch.float64)
    scales = [1.0]
    if sorting == "ring":
        # Ring r's 8r*m_r samples follow those inside it; at density 1 these are the ring-order slots.
        bounds, positions = [(0, 1)], [(dy + n) * k + (dx + n) for dy, dx in grid]
        slot_to_grid = positions[:1]
        for r, m in enumerate(per_ring, start=1):
            bounds.append((bounds[-1][1], bounds[-1][1] + 8 * r * m))
            # The sorted run j of m values goes to the ring's j-th position (row-major within a ring).
            slot_to_grid += [positions[(2 * r - 1) ** 2 + j // m] for j in range(8 * r * m)]
            scales += [1.0 / m] * (8 * r * m)
        segments = tuple(bounds)
        slot_to_grid = torch.tensor(slot_to_grid, dtype=torch.long)
    else:
        segments = ((0, k * k * density),)
        slot_to_grid = torch.arange(k * k * density) // density
        scales = [1.0 / density] * (k * k * density)
    slot_scale = torch.tensor(scales, dtype=torch.float64) if max(per_ring, default=1) > 1 or (
        sorting == "global" and density > 1) else None
    return SortGeometry(k, sampling, sorting, segments, offsets, weights, interpolation, slot_to_grid, density,
                        slot_scale)


_SQUARE_FORMS: Dict[Tuple[int, str, str, int], Tuple[SortGeometry, torch.Tensor, torch.Tensor]] = {}


def square_slot_form(geometry: SortGeometry) -> Tuple[SortGeometry, torch.Tensor, torch.Tensor]:
    """``geometry`` laid onto the ``K*K`` slots of the smallest odd ``K >= k`` with ``K*K >= samples``, for a
    backend that takes one sample per kernel position; returns ``(square, index, scale)``.

    ``square`` has kernel size ``K``, the same samples (their taps stay inside the central ``k x k`` of
    the ``K x K`` window, so an input padded for ``K`` gives the same output size and values as one padded
    for ``k``) followed by ``K*K - samples`` unused samples of their own (one segment each, reading the
    centre), and slot ``s`` multiplies kernel position ``s`` (row-major). A ``(O, C, k, k)`` weight becomes
    ``square``'s ``(O, C, K, K)`` weight as ``w.flatten(2)[..., index] * scale`` for the first ``samples``
    positions and zeros after them. Its ``sampling`` names ``k`` and the density (e.g.
    ``"polar-k7-x2"`` or ``"polar-k7-x3,2,1"``), so that caches keyed by kernel size and variant do not
    mix it with a real ``K x K`` geometry. A geometry of density 1 is returned as it is, with ``scale`` all ones.
    """
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting, geometry.ring_density)
    if key in _SQUARE_FORMS:
        return _SQUARE_FORMS[key]
    k, samples = geometry.kernel_size, geometry.samples
    scale = geometry.slot_scale if geometry.slot_scale is not None else torch.ones(samples, dtype=torch.float64)
    if samples == k * k:
        form = (geometry, geometry.slot_to_grid, scale)
    else:
        big = k
        while big * big < samples:
            big += 2
        unused = big * big - samples
        offsets = torch.cat([geometry.tap_offsets, torch.zeros(unused, geometry.tap_offsets.shape[1], 2,
                                                               dtype=torch.long)])
        weights = torch.cat([geometry.tap_weights, torch.zeros(unused, geometry.tap_weights.shape[1],
                                                               dtype=torch.float64)])
        weights[samples:, 0] = 1.0
        shift = (big - k) // 2
        # Window positions (row-major) of the k x k interpolation matrix's columns inside the K x K window.
        columns = torch.tensor([(row + shift) * big + col + shift for row in range(k) for col in range(k)])
        interpolation = torch.zeros(big * big, big * big, dtype=torch.float64)
        interpolation[:samples, columns] = geometry.interpolation
        interpolation[samples:, (big * big) // 2] = 1.0
        segments = geometry.segments + tuple((s, s + 1) for s in range(samples, big * big))
        density = geometry.ring_density
        label = ",".join(map(str, density)) if isinstance(density, tuple) else str(density)
        square = SortGeometry(big, f"{geometry.sampling}-k{k}-x{label}", geometry.sorting, segments,
                              offsets, weights, interpolation, torch.arange(big * big))
        form = (square, geometry.slot_to_grid, scale)
    _SQUARE_FORMS[key] = form
    return form
