"""The reference path: Sorting Convolution in plain, readable PyTorch.

This is the specification every fast backend is tested against. It works on any device and dtype
PyTorch supports, is differentiable through autograd, and traces/exports (no data-dependent Python).

Steps, for an already padded input ``(B, C, Hp, Wp)``:

1. **Patches.** The ``k*k`` window values of every output position, taken by strided slicing of the
   padded input in ring order: ``(B, C, Ho, Wo, k*k)``.
2. **Sampling.** Square sampling uses them as they are; polar sampling multiplies them by the
   ``(samples, k*k)`` bilinear interpolation matrix of :mod:`timm_sortconv.ops.geometry` (``samples =
   k*k`` except with a ring density above 1).
3. **Sorting.** ``torch.sort`` along the last axis, per ring segment or over all slots.
4. **Convolution.** One contraction with the weight rearranged into slot order (each slot's kernel
   position, times the slot's scale at a ring density above 1), per group.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .geometry import SortGeometry, ring_grid_offsets, row_major_offsets

__all__ = ["sorted_patches", "sort_conv2d_reference"]


def _patches(x: torch.Tensor, geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
             out_size: Tuple[int, int]) -> torch.Tensor:
    """Window values in ring order, ``(B, C, Ho, Wo, k*k)``, by one strided slice per grid offset."""
    k, n = geometry.kernel_size, geometry.kernel_size // 2
    (sh, sw), (dh, dw), (ho, wo) = stride, dilation, out_size
    # Square samples are the window itself, taken straight in ring order; polar samples are
    # interpolated from the row-major window.
    order = ring_grid_offsets(k) if geometry.sampling == "square" else row_major_offsets(k)
    slices = []
    for dy, dx in order:
        top, left = (dy + n) * dh, (dx + n) * dw
        slices.append(x[:, :, top: top + (ho - 1) * sh + 1: sh, left: left + (wo - 1) * sw + 1: sw])
    return torch.stack(slices, dim=-1)


def sorted_patches(x: torch.Tensor, geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
                   out_size: Tuple[int, int]) -> torch.Tensor:
    """The sampled and sorted windows ``(B, C, Ho, Wo, samples)`` in slot order, for a padded input."""
    patches = _patches(x, geometry, stride, dilation, out_size)
    if geometry.sampling != "square":
        # Row-major window values -> ring-order bilinear samples.
        interpolation = geometry.interpolation.to(device=patches.device, dtype=patches.dtype)
        patches = torch.matmul(patches, interpolation.t())
    if len(geometry.segments) == 1:
        return torch.sort(patches, dim=-1).values
    parts = [patches[..., s:e] if e - s == 1 else torch.sort(patches[..., s:e], dim=-1).values
             for s, e in geometry.segments]
    return torch.cat(parts, dim=-1)


def slot_weight(weight: torch.Tensor, geometry: SortGeometry) -> torch.Tensor:
    """The weight ``(O, C/g, k, k)`` flattened into slot order ``(O, C/g, samples)``."""
    flat = weight.reshape(weight.shape[0], weight.shape[1], -1)
    slots = flat.index_select(2, geometry.slot_to_grid.to(weight.device))
    if geometry.slot_scale is not None:
        slots = slots * geometry.slot_scale.to(device=weight.device, dtype=weight.dtype)
    return slots


def sort_conv2d_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          geometry: SortGeometry, stride: Tuple[int, int], dilation: Tuple[int, int],
                          groups: int) -> torch.Tensor:
    """SC on an already padded input ``x``; shapes are checked by the caller."""
    k = geometry.kernel_size
    batch, channels, hp, wp = x.shape
    ho = (hp - dilation[0] * (k - 1) - 1) // stride[0] + 1
    wo = (wp - dilation[1] * (k - 1) - 1) // stride[1] + 1
    cols = sorted_patches(x, geometry, stride, dilation, (ho, wo))
    w = slot_weight(weight, geometry)
    out_channels = w.shape[0]
    cols = cols.reshape(batch, groups, channels // groups, ho, wo, geometry.samples)
    w = w.reshape(groups, out_channels // groups, channels // groups, geometry.samples).to(cols.dtype)
    out = torch.einsum("bgchws,gocs->bgohw", cols, w).reshape(batch, out_channels, ho, wo)
    if bias is not None:
        out = out + bias.to(out.dtype).view(1, -1, 1, 1)
    return out
