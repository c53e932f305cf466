"""Aligned windows: each window turned back by its own orientation, then an ordinary convolution.

``sorting="align"`` (one orientation per window position, shared by the input channels of a group) and
``sorting="align-channel"`` (one per channel) replace SC's sorting by an alignment. Sorting makes a window's
samples invariant to a turn by forgetting their order; alignment keeps the order and forgets only the turn.

**The mathematics.** Ring ``r`` of a window holds ``N`` samples ``s_j`` at the angles ``2*pi*j/N``
(:mod:`.geometry`, angular order). Its discrete Fourier coefficients are ``S_m = sum_j s_j exp(-2*pi*i*m*j/N)``.
A turn of the window's content by ``d`` samples (the angle ``2*pi*d/N``) shifts the samples cyclically,
``s'_j = s_{j-d}``, which multiplies ``S_m`` by ``exp(-i*m*a)`` with ``a = 2*pi*d/N``. The window's orientation
is read from the first harmonic: ``c = sum_r S_1(r) / N_r`` (the rings together; with ``"align"`` also summed
over the channels of the group), which turns as ``c' = c * exp(-i*a)``. With ``e = c / |c|`` the aligned
coefficients

    ``A_m = S_m * conj(e)^m``   (``m`` signed, ``conj(e)^(-m) = e^m``)

are unchanged by the turn: ``S_m exp(-i*m*a) * conj(e)^m exp(i*m*a) = A_m``. The aligned samples are the inverse
transform of ``A`` (the real part; for even ``N`` the Nyquist term ``m = N/2`` keeps ``Re(conj(e)^(N/2))``, which
is exact for turns by whole samples). So the aligned window is exactly invariant to turns that move every ring
by whole samples (a quarter turn moves ring ``r`` of an odd window by ``2r`` samples, and the polar samples of
a quarter-turned image are exactly those samples moved), and for other angles up to the interpolation between
samples, while its inner order is kept. Sample ``j`` of ring ``r`` is then multiplied by the weight at the
``j``-th grid position of ring ``r`` (in angular order) and the products summed, as a convolution does.

**Windows with no orientation.** Where ``c = 0`` (a flat window, or one symmetric under a half turn, whose odd
harmonics vanish) ``e`` is undefined. The turned harmonics are therefore weighted by a gate

    ``g = |c|^2 / (|c|^2 + RELATIVE * E + LEVEL * M + TINY)``,   ``E = sum_r sum_{m != 0} |S_m(r)|^2 / N_r^2``,
    ``M = sum_r |S_0(r)|^2 / N_r^2``

(``E``: the variance of the ring samples about their ring means, ``M``: the squared ring means, both summed over
rings and the channels that share ``c``): ``A_m = g * S_m * conj(e)^m`` for ``m != 0`` and ``A_0 = S_0``. The
``LEVEL`` term keeps rounding from orienting a flat window: the harmonics of a window of constant value ``v``
computed in float32 are not 0 but about ``1e-7 v``, as large against their own variance as a real edge, while
``LEVEL * M`` holds ``g`` near ``1e-5`` there and costs a window of contrast ``1e-3`` or more nothing that
matters. ``g``, ``E`` and ``M`` are invariant to turns,
so the invariance above holds; as ``c -> 0`` the window fades continuously to its ring means and the centre,
which need no orientation, so the output does not jump where the orientation flips. ``g`` is a function of
ratios of ``|c|^2``, ``E`` and ``M`` alone, so the output stays positively homogeneous of degree one in the input,
as a convolution's,
and the gradient of ``g * conj(e)^m`` is bounded by a multiple of ``1 / sqrt(RELATIVE)`` relative to the
window's scale: ``e`` varies fastest where ``|c|`` is small, and there ``g`` is small. ``TINY`` only keeps the
quotients defined for a window that is exactly flat. The orientation is computed in float32 at least, and the
gradient flows through it (it is a smooth function of the window wherever ``c != 0``).

**Guide channels.** With ``"align"`` the input may carry one channel more per group than the weight takes
(:func:`.checks.guide_channels`): the group's last channel is a guide (:mod:`timm_sortconv.guide`). It is sampled and
its spectra join ``c``, ``E`` and ``M`` like any channel of the group, but it has no weight: the result is that of
a zero weight for it, without the products, and its gradient comes through the orientation alone.

Three implementations compute the same function:

* :func:`aligned_samples`: the specification, used by the reference path: the samples, each ring's FFT, the
  turn, the inverse FFT; then the reference path's product with the weight.
* :func:`align_conv2d_harmonic`: the same in three standard operators (the ``"harmonic"`` backend, any device):
  a depthwise convolution gives every channel's ring spectra at every position (the polar sampling and the
  real Fourier basis are both linear in the window, so they are one ``k x k`` filter per harmonic), the turn is
  an elementwise product with the positions' powers of ``conj(e)``, and a ``1 x 1`` convolution takes the
  product with the weight written in the same Fourier basis. Its backward is autograd of that forward,
  recomputed, so only the input and the weight are kept for backward.
* the fused CPU kernel (``csrc/align_conv_kernel.h``, the ``"cpu"`` backend, which ``backend="auto"`` takes on the
  CPU): per block of output positions the same spectra (:attr:`HarmonicTables.analysis` after the sampling taps),
  turn and product in the same basis, in per-thread buffers, with its backward (through the orientation too)
  written out; nothing of ``k*k`` times the input's size is written to memory.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .geometry import ALIGNMENTS, SortGeometry

__all__ = ["LEVEL", "RELATIVE", "TINY", "aligned_samples", "align_conv2d_harmonic", "is_aligned"]

#: How strongly a window must be oriented, relative to its variance, before it is turned at full strength.
RELATIVE = 0.1
#: How much of a window's squared ring means counts against its orientation (above float32 rounding, 1e-14 of it).
LEVEL = 1e-8
#: Keeps the quotients defined for an exactly flat window.
TINY = 1e-20


def is_aligned(geometry: SortGeometry) -> bool:
    """Whether ``geometry`` aligns its windows instead of sorting them."""
    return geometry.sorting in ALIGNMENTS


def _rings(geometry: SortGeometry) -> List[Tuple[int, int]]:
    """The slot ranges of the rings (every segment of more than one sample: the centre is left out)."""
    return [(s, e) for s, e in geometry.segments if e - s > 1]


def _orientation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gate_and_direction(first_re, first_im, energy):
    """``(g, Re e, Im e)`` of the module docstring from ``c``'s parts and ``E``."""
    power = first_re * first_re + first_im * first_im
    norm = torch.rsqrt(power + TINY)
    gate = power / (power + RELATIVE * energy + TINY)
    return gate, first_re * norm, first_im * norm


def _share(t: torch.Tensor, geometry: SortGeometry, groups: int) -> torch.Tensor:
    """``(B, C, ...)`` -> summed over the channels of each group and repeated to ``(B, C, ...)`` for ``"align"``;
    unchanged for ``"align-channel"``."""
    if ALIGNMENTS[geometry.sorting] == "channel":
        return t
    batch, channels = t.shape[:2]
    summed = t.reshape(batch, groups, channels // groups, *t.shape[2:]).sum(2, keepdim=True)
    return summed.expand(batch, groups, channels // groups, *t.shape[2:]).reshape(t.shape)


def aligned_samples(samples: torch.Tensor, geometry: SortGeometry, groups: int) -> torch.Tensor:
    """The samples ``(B, C, Ho, Wo, k*k)`` in slot order with each window turned back by its orientation
    (the module docstring): the specification of the aligned variants."""
    rings = _rings(geometry)
    if not rings or samples.numel() == 0:  # a 1 x 1 window has no ring to turn; an empty batch nothing
        return samples
    work = _orientation_dtype(samples.dtype)
    spectra = [torch.fft.fft(samples[..., s:e].to(work).contiguous(), dim=-1) for s, e in rings]
    first = sum(spectrum[..., 1] / (e - s) for spectrum, (s, e) in zip(spectra, rings))
    energy = sum((spectrum[..., 1:].real ** 2 + spectrum[..., 1:].imag ** 2).sum(-1) / (e - s) ** 2
                 for spectrum, (s, e) in zip(spectra, rings))
    level = sum(spectrum[..., 0].real ** 2 / (e - s) ** 2 for spectrum, (s, e) in zip(spectra, rings))
    energy = energy + LEVEL / RELATIVE * level  # the gate's denominator holds RELATIVE * E + LEVEL * M
    gate, e_re, e_im = _gate_and_direction(_share(first.real, geometry, groups),
                                           _share(first.imag, geometry, groups), _share(energy, geometry, groups))
    back = torch.complex(e_re, -e_im)  # conj(e)
    largest = max(e - s for s, e in rings) // 2
    powers = [torch.ones_like(back)]
    for _ in range(largest):
        powers.append(powers[-1] * back)
    out = [samples[..., s:e] for s, e in geometry.segments if e - s == 1]  # the centre, which never turns
    for spectrum, (s, e) in zip(spectra, rings):
        n = e - s
        turns = []
        for m in range(n):
            signed = m if m <= n // 2 else m - n  # fft's order: 0, 1, ..., then the negative harmonics
            if signed == 0:
                turns.append(torch.ones_like(back))
            elif signed > 0 and not (n % 2 == 0 and signed == n // 2):
                turns.append(powers[signed] * gate)
            else:  # negative harmonics, and the Nyquist term: conj(conj(e)^|m|), whose real part is the same
                turns.append(powers[abs(signed)].conj() * gate)
        turned = torch.fft.ifft(spectrum * torch.stack(turns, -1), dim=-1).real
        out.append(turned.to(samples.dtype))
    return torch.cat(out, dim=-1)


@dataclass(frozen=True)
class HarmonicTables:
    """The constant tables of :func:`align_conv2d_harmonic` for one geometry, device and dtype.

    Harmonic channels (``k*k`` of them) in three blocks: ``fixed`` (the centre, each ring's ``S_0`` and, for even
    ``N``, its ``S_{N/2}``), then ``Re S_m`` of every pair ``(ring, 0 < m < N/2)``, then ``Im S_m`` of the same pairs
    in the same order, so that the turn is a complex product of the two blocks.

    Attributes:
        analysis: ``(k*k, k*k)``: the samples in slot order -> harmonic channels (each ring's real DFT).
        filters: ``(k*k, 1, k, k)``: the window -> harmonic channel filters (sampling and Fourier basis).
        synthesis: ``(k*k, k*k)``: slot-order weights -> harmonic-channel weights (the inverse basis).
        fixed: the number of fixed channels.
        nyquist: ``(fixed,)`` long: each fixed channel's ``m`` for a Nyquist channel, else 0.
        pair_harmonic: ``(pairs,)`` long: each pair's ``m``.
        first: ``(pairs,)``: ``1 / N`` for the pairs with ``m = 1``, else 0: ``c = sum first * (Re + i Im)``.
        energy_pairs, energy_fixed: ``(pairs,)``, ``(fixed,)``: ``E + (LEVEL / RELATIVE) M = sum energy_pairs *
            (Re^2 + Im^2) + sum energy_fixed * S^2`` (the ``S_0`` rows carry the ``M`` term, the Nyquist rows ``E``'s).
        largest: the largest ``m``.
    """

    analysis: torch.Tensor
    filters: torch.Tensor
    synthesis: torch.Tensor
    fixed: int
    nyquist: torch.Tensor
    pair_harmonic: torch.Tensor
    first: torch.Tensor
    energy_pairs: torch.Tensor
    energy_fixed: torch.Tensor
    largest: int


_TABLES: Dict[Tuple, HarmonicTables] = {}


def _ring_basis(n: int) -> List[Tuple[str, int, torch.Tensor]]:
    """The real Fourier analysis rows of a ring of ``n`` samples: ``(part, m, row)`` with ``part`` ``"fixed"``
    (``S_0``, the Nyquist ``S_{n/2}``), ``"re"`` or ``"im"``."""
    j = torch.arange(n, dtype=torch.float64)
    rows = [("fixed", 0, torch.ones(n, dtype=torch.float64))]
    for m in range(1, (n + 1) // 2):
        angle = 2 * torch.pi * m * j / n
        rows += [("re", m, torch.cos(angle)), ("im", m, -torch.sin(angle))]
    if n % 2 == 0:
        rows.append(("fixed", n // 2, torch.cos(torch.pi * j)))
    return rows


@contextlib.contextmanager
def _untraced():
    """Suspends a TorchScript trace in progress: tables built inside are constants of the traced graph, as they are
    where the cache already holds them, instead of the operations that built them (an exported file would otherwise
    depend on whether it was the first export of the process)."""
    if not torch.jit.is_tracing():  # (torch.compile and torch.export read this as False: no private call traced)
        yield
        return
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        yield
    finally:
        torch._C._set_tracing_state(state)


def harmonic_tables(geometry: SortGeometry, device: torch.device, dtype: torch.dtype) -> HarmonicTables:
    """The cached :class:`HarmonicTables` of ``geometry`` on ``device`` in ``dtype``."""
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting, device, dtype)
    if key not in _TABLES:
        with _untraced():
            _TABLES[key] = _build_tables(geometry, device, dtype)
    return _TABLES[key]


def _build_tables(geometry: SortGeometry, device: torch.device, dtype: torch.dtype) -> HarmonicTables:
    kk = geometry.kernel_size ** 2
    blocks = {"fixed": [], "re": [], "im": []}  # (row over the k*k slots, m, ring size)
    for s, e in geometry.segments:
        n = e - s
        for part, m, row in (_ring_basis(n) if n > 1 else [("fixed", 0, torch.ones(1, dtype=torch.float64))]):
            full = torch.zeros(kk, dtype=torch.float64)
            full[s:e] = row
            blocks[part].append((full, m, n))
    ordered = blocks["fixed"] + blocks["re"] + blocks["im"]
    analysis = torch.stack([row for row, _, _ in ordered])
    # analysis @ analysis.T is diagonal (n for S_0 and the Nyquist row, n / 2 for the others), so the
    # inverse is analysis.T scaled by its reciprocal.
    inverse = analysis.t() / (analysis * analysis).sum(1)
    filters = (analysis @ geometry.interpolation).reshape(kk, 1, geometry.kernel_size, geometry.kernel_size)
    fixed = [(m, n) for _, m, n in blocks["fixed"]]
    pairs = [(m, n) for _, m, n in blocks["re"]]
    to = dict(device=device, dtype=dtype)
    return HarmonicTables(
        analysis.to(**to), filters.to(**to), inverse.to(**to), len(fixed),
        torch.tensor([m for m, _ in fixed], device=device),
        torch.tensor([m for m, _ in pairs], device=device),
        torch.tensor([1.0 / n if m == 1 else 0.0 for m, n in pairs], **to),
        torch.tensor([2.0 / n ** 2 for _, n in pairs], **to),
        torch.tensor([(1.0 if m > 0 else LEVEL / RELATIVE if n > 1 else 0.0) / n ** 2 for m, n in fixed], **to),
        max(m for m, _ in fixed + pairs))


def _turns(first_re, first_im, energy, largest: int):
    """The gated powers ``g * conj(e)^m``, ``m = 0 .. largest`` (``m = 0``: 1), as real and imaginary parts
    ``(B, C', largest + 1, Ho, Wo)``."""
    gate, e_re, e_im = _gate_and_direction(first_re, first_im, energy)
    re, im = [e_re * gate], [-e_im * gate]
    for _ in range(largest - 1):
        re, im = re + [re[-1] * e_re + im[-1] * e_im], im + [im[-1] * e_re - re[-1] * e_im]
    one, zero = torch.ones_like(gate), torch.zeros_like(gate)
    return torch.stack([one] + re, 2), torch.stack([zero] + im, 2)


def align_conv2d_harmonic(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
                          groups: int) -> torch.Tensor:
    """The aligned variants on an already padded input ``x``, in standard operators (module docstring);
    equal to the reference path up to rounding, differentiable by autograd. Guide channels
    (:func:`.checks.guide_channels`) join the orientation and are left out of the product."""
    # int(): a traced size is a tensor, and an exported convolution needs a kernel of known shape (a layer's
    # channels are fixed, its height and width may vary)
    batch, channels = x.shape[0], int(x.shape[1])
    kk = geometry.kernel_size ** 2
    tables = harmonic_tables(geometry, x.device, x.dtype)
    nf, pairs = tables.fixed, tables.pair_harmonic.numel()
    spectra = F.conv2d(x, tables.filters.repeat(channels, 1, 1, 1), None, stride, 0, dilation, channels)
    ho, wo = spectra.shape[2:]
    spectra = spectra.view(batch, channels, kk, ho, wo)
    fixed, re, im = spectra[:, :, :nf], spectra[:, :, nf:nf + pairs], spectra[:, :, nf + pairs:]
    flat = weight.reshape(weight.shape[0], weight.shape[1], kk).index_select(2, geometry.slot_to_grid.to(x.device))
    harmonic_weight = flat @ tables.synthesis  # (O, C / groups, k*k) over the harmonic channels
    shape = (batch, channels, kk, ho, wo)
    if pairs == 0:  # a 1 x 1 or 2 x 2 window: nothing turns (and a guide channel does nothing)
        return _harmonic_product(spectra, shape, harmonic_weight, bias, groups)
    work = _orientation_dtype(x.dtype)
    re_w, im_w = re.to(work), im.to(work)
    first = tables.first.to(work).view(-1, 1, 1)
    energy = ((re_w * re_w + im_w * im_w) * tables.energy_pairs.to(work).view(-1, 1, 1)).sum(2)
    energy = energy + (fixed.to(work) ** 2 * tables.energy_fixed.to(work).view(-1, 1, 1)).sum(2)
    shared = ALIGNMENTS[geometry.sorting] == "shared"
    first_re, first_im = (re_w * first).sum(2), (im_w * first).sum(2)
    if shared:  # one orientation per position for the channels of each group
        first_re, first_im, energy = (t.view(batch, groups, channels // groups, ho, wo).sum(2)
                                      for t in (first_re, first_im, energy))
    turn_re, turn_im = _turns(first_re, first_im, energy, tables.largest)
    turn_re, turn_im = turn_re.to(x.dtype), turn_im.to(x.dtype)
    per_group = 1 if shared else channels // groups
    split = (batch, groups, channels // groups)
    pair_re, pair_im = (t.index_select(2, tables.pair_harmonic).view(batch, groups, per_group, pairs, ho, wo)
                        for t in (turn_re, turn_im))
    re, im = re.reshape(*split, pairs, ho, wo), im.reshape(*split, pairs, ho, wo)
    aligned_re = torch.addcmul(re * pair_re, im, pair_im, value=-1)
    aligned_im = torch.addcmul(re * pair_im, im, pair_re)
    nyquist = turn_re.index_select(2, tables.nyquist).view(batch, groups, per_group, nf, ho, wo)
    fixed = fixed.reshape(*split, nf, ho, wo) * nyquist
    return _harmonic_product(torch.cat([fixed, aligned_re, aligned_im], 3), shape, harmonic_weight, bias, groups)


def _harmonic_product(columns: torch.Tensor, shape: Tuple, harmonic_weight: torch.Tensor, bias: Optional[torch.Tensor],
                      groups: int) -> torch.Tensor:
    """The harmonic columns of every input channel (``shape``: batch, channels, k*k, Ho, Wo, whatever ``columns``'
    own layout of them) times ``harmonic_weight`` ``(O, C/groups, k*k)``, a grouped ``1 x 1`` convolution. A guide
    channel (:func:`.checks.guide_channels`: the last of each group, where the input has one more per group than the
    weight takes) is left out: it turns the windows, it is not multiplied."""
    batch, channels, kk, ho, wo = shape
    weighted = harmonic_weight.shape[1]
    if weighted * groups != channels:
        columns = columns.reshape(batch, groups, channels // groups, kk, ho, wo)[:, :, :weighted]
    return F.conv2d(columns.reshape(batch, groups * weighted * kk, ho, wo),
                    harmonic_weight.reshape(harmonic_weight.shape[0], -1, 1, 1), bias, 1, 0, 1, groups)
