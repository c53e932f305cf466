"""The reference path: Sorting Convolution in plain, readable PyTorch.

This is the specification every fast backend is tested against. It works on any device and dtype
PyTorch supports, is differentiable through autograd, and traces/exports (no data-dependent Python).

Steps, for an already padded input ``(B, C, Hp, Wp)``:

1. **Patches.** The ``k*k`` window values of every output position, taken by strided slicing of the
   padded input: in slot order for square sampling, row-major for polar: ``(B, C, Ho, Wo, k*k)``.
2. **Sampling.** Square sampling uses them as they are; polar sampling multiplies them by the
   ``(k*k, k*k)`` bilinear interpolation matrix of :mod:`timm_sortconv.ops.geometry`.
3. **Sorting.** ``torch.sort`` along the last axis, per ring segment or over all slots; for the aligned
   variants (``sorting="align"``, ``"align-channel"``) each window turned back by its own orientation instead
   (:func:`.alignment.aligned_samples`).
4. **Convolution.** One contraction with the weight rearranged into slot order, per group.

:func:`sort_conv2d_reference_backward` is the same computation's gradient, written out: with the
sorting permutation of every window held fixed, SC is bilinear in the window values and the weight,
so the weight gradient contracts the output gradient with the sorted windows, and the window
gradient is the output gradient contracted with the weight, moved back through the permutation
(``scatter`` with the sort's indices), the sampling matrix (transposed) and the strided slicing
(accumulated into the padded input). The operator's autograd formula uses it wherever no fast backend
computes the gradient (its implementations run below autograd, so nothing records the forward there). The
aligned variants' gradient also flows through each window's orientation; it is autograd of the forward,
recomputed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .alignment import aligned_samples, is_aligned
from .geometry import SortGeometry, row_major_offsets

__all__ = ["sorted_patches", "sort_conv2d_reference", "sort_conv2d_reference_backward"]


def _patches(x: torch.Tensor, geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
             out_size: Tuple[int, int]) -> torch.Tensor:
    """Window values ``(B, C, Ho, Wo, k*k)`` by one strided slice per grid offset: the samples in slot order
    for square sampling, the row-major window for polar sampling."""
    k, n = geometry.kernel_size, geometry.kernel_size // 2
    (sh, sw), (dh, dw), (ho, wo) = stride, dilation, out_size
    # Square samples are the window itself, taken straight in slot order; polar samples are
    # interpolated from the row-major window.
    order = geometry.sample_grid if geometry.sampling == "square" else row_major_offsets(k)
    slices = []
    for dy, dx in order:
        top, left = (dy + n) * dh, (dx + n) * dw
        slices.append(x[:, :, top: top + (ho - 1) * sh + 1: sh, left: left + (wo - 1) * sw + 1: sw])
    return torch.stack(slices, dim=-1)


def _samples(x: torch.Tensor, geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
             out_size: Tuple[int, int]) -> torch.Tensor:
    """The ``k*k`` samples of every window in slot order, before sorting: ``(B, C, Ho, Wo, k*k)``."""
    patches = _patches(x, geometry, stride, dilation, out_size)
    if geometry.sampling != "square":
        # Row-major window values -> bilinear samples in slot order.
        interpolation = geometry.interpolation.to(device=patches.device, dtype=patches.dtype)
        patches = torch.matmul(patches, interpolation.t())
    return patches


def _orbit_size(geometry: SortGeometry) -> int:
    """With the centre a segment of its own and every other segment of one size (the orbit sortings, and ring
    sorting for k = 3), that size; else 0."""
    sizes = {end - start for start, end in geometry.segments[1:]}
    return sizes.pop() if geometry.segments[:1] == ((0, 1),) and len(sizes) == 1 else 0


def _sort_orbits(samples: torch.Tensor, orbit: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The samples after the centre sorted in consecutive groups of ``orbit``, in one batched sort: the sorted
    samples with the centre in front ``(..., k*k)``, and each group's sort order ``(..., groups, orbit)``."""
    values, order = torch.sort(samples[..., 1:].unflatten(-1, (-1, orbit)), dim=-1)
    return torch.cat([samples[..., :1], values.flatten(-2)], -1), order


def _sort_segments(samples: torch.Tensor, geometry: SortGeometry) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each segment of the last axis sorted ascending, and where each sorted value came from (slot indices)."""
    if len(geometry.segments) == 1:
        return torch.sort(samples, dim=-1)
    orbit = _orbit_size(geometry)
    if orbit > 1 and len(geometry.segments) > 2:  # equal segments after the centre: one batched sort
        values, order = _sort_orbits(samples, orbit)
        order = order + torch.arange(1, samples.shape[-1], orbit, device=samples.device).unsqueeze(-1)
        centre = torch.zeros_like(samples[..., :1], dtype=torch.long)
        return values, torch.cat([centre, order.flatten(-2)], -1)
    values, indices = [], []
    for start, end in geometry.segments:
        part = samples[..., start:end]
        if end - start == 1:
            values.append(part)
            indices.append(torch.full_like(part, start, dtype=torch.long))
        else:
            sorted_part, order = torch.sort(part, dim=-1)
            values.append(sorted_part)
            indices.append(order + start)
    return torch.cat(values, dim=-1), torch.cat(indices, dim=-1)


def sorted_patches(x: torch.Tensor, geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
                   out_size: Tuple[int, int], groups: int = 1) -> torch.Tensor:
    """The sampled and sorted (or, for the aligned variants, aligned) windows ``(B, C, Ho, Wo, k*k)`` in slot
    order, for a padded input; ``groups`` sets which channels share an orientation (``sorting="align"``)."""
    samples = _samples(x, geometry, stride, dilation, out_size)
    if is_aligned(geometry):
        return aligned_samples(samples, geometry, groups)
    if len(geometry.segments) == 1:
        return torch.sort(samples, dim=-1).values
    orbit = _orbit_size(geometry)
    if orbit > 1 and len(geometry.segments) > 2:
        return _sort_orbits(samples, orbit)[0]
    parts = [samples[..., s:e] if e - s == 1 else torch.sort(samples[..., s:e], dim=-1).values
             for s, e in geometry.segments]
    return torch.cat(parts, dim=-1)


def slot_weight(weight: torch.Tensor, geometry: SortGeometry) -> torch.Tensor:
    """The weight ``(O, C/g, k, k)`` flattened into slot order ``(O, C/g, k*k)``."""
    flat = weight.reshape(weight.shape[0], weight.shape[1], -1)
    return flat.index_select(2, geometry.slot_to_grid.to(weight.device))


def _output_size(x: torch.Tensor, k: int, stride: Tuple[int, int], dilation: Tuple[int, int]) -> Tuple[int, int]:
    hp, wp = x.shape[2], x.shape[3]
    return (hp - dilation[0] * (k - 1) - 1) // stride[0] + 1, (wp - dilation[1] * (k - 1) - 1) // stride[1] + 1


def sort_conv2d_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
                          groups: int) -> torch.Tensor:
    """SC on an already padded input ``x``; shapes are checked by the caller. An aligned input's guide channels
    (:func:`.checks.guide_channels`) join the orientation and are left out of the product."""
    k = geometry.kernel_size
    batch, channels = x.shape[0], x.shape[1]
    ho, wo = _output_size(x, k, stride, dilation)
    cols = sorted_patches(x, geometry, stride, dilation, (ho, wo), groups)
    w = slot_weight(weight, geometry)
    out_channels, weighted = w.shape[0], w.shape[1]
    cols = cols.reshape(batch, groups, channels // groups, ho, wo, k * k)[:, :, :weighted]
    w = w.reshape(groups, out_channels // groups, weighted, k * k).to(cols.dtype)
    out = torch.einsum("bgchws,gocs->bgohw", cols, w).reshape(batch, out_channels, ho, wo)
    if bias is not None:
        out = out + bias.to(out.dtype).view(1, -1, 1, 1)
    return out


def sort_conv2d_reference_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
                                   groups: int, need_input: bool = True, need_weight: bool = True
                                   ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of :func:`sort_conv2d_reference` with respect to the padded input ``x`` and ``weight``.

    Returns ``(grad_x, grad_weight)``, each ``None`` where not asked for. The bias gradient is the output
    gradient summed over batch and positions, which the caller forms.
    """
    if is_aligned(geometry):
        return autograd_backward(sort_conv2d_reference, grad_output, x, weight, geometry, stride, dilation, groups,
                                 need_input, need_weight)
    k, kk = geometry.kernel_size, geometry.kernel_size ** 2
    batch, channels = x.shape[0], x.shape[1]
    ho, wo = _output_size(x, k, stride, dilation)
    out_channels = weight.shape[0]
    cg, og = channels // groups, out_channels // groups
    sorted_values, order = _sort_segments(_samples(x, geometry, stride, dilation, (ho, wo)), geometry)
    grad_out = grad_output.reshape(batch, groups, og, ho, wo).to(sorted_values.dtype)
    grad_x = grad_weight = None
    if need_weight:
        cols = sorted_values.reshape(batch, groups, cg, ho, wo, kk)
        grad_slots = torch.einsum("bgohw,bgchws->gocs", grad_out, cols).reshape(out_channels, cg, kk)
        # slot s multiplies kernel position slot_to_grid[s]
        grad_weight = torch.zeros_like(grad_slots).index_copy_(2, geometry.slot_to_grid.to(weight.device), grad_slots)
        grad_weight = grad_weight.reshape(weight.shape).to(weight.dtype)
    if need_input:
        w = slot_weight(weight, geometry).reshape(groups, og, cg, kk).to(sorted_values.dtype)
        grad_sorted = torch.einsum("bgohw,gocs->bgchws", grad_out, w).reshape(sorted_values.shape)
        grad_samples = torch.zeros_like(grad_sorted).scatter_(-1, order, grad_sorted)
        if geometry.sampling != "square":
            interpolation = geometry.interpolation.to(device=x.device, dtype=grad_samples.dtype)
            grad_samples = torch.matmul(grad_samples, interpolation)  # back to row-major window positions
        grad_x = torch.zeros(x.shape, dtype=grad_samples.dtype, device=x.device)
        order_of_window = geometry.sample_grid if geometry.sampling == "square" else row_major_offsets(k)
        n = k // 2
        (sh, sw), (dh, dw) = stride, dilation
        for q, (dy, dx) in enumerate(order_of_window):
            top, left = (dy + n) * dh, (dx + n) * dw
            grad_x[:, :, top: top + (ho - 1) * sh + 1: sh, left: left + (wo - 1) * sw + 1: sw] += grad_samples[..., q]
        grad_x = grad_x.to(x.dtype)
    return grad_x, grad_weight


def autograd_backward(forward, grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int], groups: int,
                      need_input: bool, need_weight: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(grad_x, grad_weight)`` of ``forward(x, weight, None, geometry, stride, dilation, groups)`` by autograd of
    the forward, recomputed here (so that only ``x`` and ``weight`` are kept for backward). A registered
    operator's kernels run with autograd's dispatch keys excluded; they are let back in for the recomputation."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor"):
        excluded = excluded.remove(getattr(torch._C.DispatchKey, key))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        x_ = x.detach().requires_grad_(need_input)
        weight_ = weight.detach().requires_grad_(need_weight)
        out = forward(x_, weight_, None, geometry, stride, dilation, groups)
        wanted = [t for t, need in ((x_, need_input), (weight_, need_weight)) if need]
        grads = iter(torch.autograd.grad(out, wanted, grad_output))
    return (next(grads) if need_input else None), (next(grads) if need_weight else None)
