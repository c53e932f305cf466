"""Sorting Convolution in standard operators: the graph that ``torch.onnx.export`` writes for an SC layer.

An exported model runs in any ONNX runtime (onnxruntime and OpenVINO are tested) with nothing to install or
register, so each SC layer is written as a few standard operators, in three steps that mirror the kernels':

1. **Sampling**: every channel's ``k*k`` samples of every window by one convolution of each channel alone (the input
   viewed as ``(N*C, 1, H, W)``; ``"topk"``: one grouped convolution) with a fixed ``(k*k, 1, k, k)`` filter bank: the
   rows of the geometry's interpolation matrix (square sampling: one-hot filters; polar: the bilinear taps), with the
   layer's stride, dilation and zero padding. The filter bank is the same for every layer of a geometry (``k*k*k*k``
   numbers; ``"topk"`` repeats it for each channel), not a copy of the weights.
2. **Sorting**: each segment (a ring, an orbit, or the whole window) by a min/max sorting network (Batcher's odd-even
   merge, :meth:`~timm_sortconv.ops.geometry.SortGeometry.comparators`): the samples split into one map per slot,
   each comparator a ``Min`` and a ``Max`` of two maps, then the maps concatenated again. A network is exact (it only
   moves values) and needs no data-dependent control flow; ``TopK``, the only sort ONNX has, pays per row and costs
   several times more in onnxruntime.
3. **Weights**: one ``1 x 1`` convolution over the ``C*k*k`` sorted channels with the weight in slot order (channel
   ``c*k*k + s``), the groups and the bias of the layer: the same products as the layer's convolution.

The aligned variants (``sorting="align"``, ``"align-channel"``) export through their standard-operator form, the
``harmonic`` backend (:func:`~timm_sortconv.ops.alignment.align_conv2d_harmonic`): :mod:`.lowering` chooses.

The graph's cost against the layer's plain convolution is the sorting's passes over memory: each comparator reads
two maps of ``N*C*Ho*Wo`` values and writes two, where a convolution reads its input once. Which form is fastest
depends on the runtime (``BENCHMARKS.md``, "Exported to ONNX", measures them per model), so there are several
(:data:`DECOMPOSITIONS`), chosen while exporting by :func:`timm_sortconv.onnx.decomposition`:

* ``"network"`` (the default, :data:`ONNXRUNTIME`): as above; onnxruntime runs its ``Min``/``Max`` nodes in place;
* ``"topk"`` (:data:`OPENVINO`): the samples by one grouped convolution of the image as it is (``(N, C*k*k, Ho,
  Wo)``, no batch of ``N*C`` one-channel images), viewed as ``(N*C, k*k, Ho*Wo)`` and each segment sorted by one
  ``TopK`` along the slots: OpenVINO runs a ``TopK`` along a plain axis in one pass, but a ``Min``/``Max`` pair per
  comparator as two kernels each (and onnxruntime a ``TopK`` row by row: 4-6 times slower than ``"network"`` there);
* ``"chunked"``: the network on groups of channels small enough for the cache (sized for one image);
* ``"layered"``: the network a layer of disjoint comparators at a time on the whole stack of samples (six nodes a
  layer instead of two a comparator);
* ``"select"``: a layer at a time too, each slot with its partner (one ``Gather``, then ``Where(low, Min, Max)``);
* ``"reference"``: the reference path as traced (one ``TopK`` per segment over unfolded windows).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..ops.geometry import SortGeometry
from ..ops.reference import slot_weight, sort_conv2d_reference

__all__ = ["DECOMPOSITIONS", "ONNXRUNTIME", "OPENVINO", "sort_conv2d_portable"]

#: The ways an SC layer can be written in standard operators (module docstring).
DECOMPOSITIONS = ("network", "chunked", "layered", "select", "topk", "reference")
#: The decomposition for onnxruntime (the default) and the one for OpenVINO (BENCHMARKS.md, "Exported to ONNX").
ONNXRUNTIME, OPENVINO = "network", "topk"
#: The values a chunk's sorting network keeps live, at most, in "chunked" (for one image): about the L2 cache of one
#: core; and the most chunks a layer is cut into (each repeats the layer's network in the graph).
CHUNK_VALUES = 1 << 18
MAX_CHUNKS = 16


def _sampling_filters(geometry: SortGeometry, like: torch.Tensor) -> torch.Tensor:
    """``(k*k, 1, k, k)``: sample ``s`` of a window is its product with filter ``s`` (slot order)."""
    k = geometry.kernel_size
    return geometry.interpolation.to(device=like.device, dtype=like.dtype).reshape(k * k, 1, k, k)


def _sorted_maps(samples: torch.Tensor, geometry: SortGeometry) -> torch.Tensor:
    """``(M, k*k, Ho, Wo)`` samples with every segment sorted ascending by the geometry's min/max network."""
    maps: List[torch.Tensor] = list(samples.split(1, dim=1))
    for a, b in geometry.comparators():
        low, high = torch.minimum(maps[a], maps[b]), torch.maximum(maps[a], maps[b])
        maps[a], maps[b] = low, high
    return torch.cat(maps, 1)


def _selected(samples: torch.Tensor, geometry: SortGeometry) -> torch.Tensor:
    """The sorting network a layer at a time, each slot with its partner in the layer: one ``Gather`` of the
    partners, then ``Min`` where the slot is a comparator's low side and ``Max`` where it is the high side (a slot
    no comparator of the layer touches is its own partner), written as ``Where(low, Min, Max)``, which runtimes
    that fuse element-wise operators (OpenVINO) run as one pass."""
    slots = samples.shape[1]
    shape = samples.shape
    samples = samples.flatten(2)  # 3-D: a runtime keeps one plain layout through the network (no reorders)
    for layer in _network_layers(geometry):
        partner, low = list(range(slots)), [True] * slots
        for a, b in layer:
            partner[a], partner[b], low[b] = b, a, False
        others = samples[:, partner]
        mask = torch.tensor(low, device=samples.device).view(1, slots, 1)
        samples = torch.where(mask, torch.minimum(samples, others), torch.maximum(samples, others))
    return samples.reshape(shape)


def _topk_sorted(samples: torch.Tensor, geometry: SortGeometry) -> torch.Tensor:
    """``(M, k*k, L)`` samples with every segment of more than one sample sorted ascending by one ``TopK`` along the
    slots (the segment's size, smallest first). Three-dimensional, so that a runtime keeps one plain layout through
    the sorting (no reorders around each ``TopK``)."""
    parts = []
    for start, end in geometry.segments:
        part = samples[:, start:end]
        parts.append(torch.topk(part, end - start, dim=1, largest=False, sorted=True).values if end - start > 1
                     else part)
    return torch.cat(parts, 1)


def _network_layers(geometry: SortGeometry) -> List[List[Tuple[int, int]]]:
    """The geometry's comparators in layers of disjoint pairs, each at the first layer after every comparator before it
    that touches one of its slots (the network's depth)."""
    layers: List[List[Tuple[int, int]]] = []
    ready = [0] * geometry.kernel_size ** 2
    for a, b in geometry.comparators():
        depth = max(ready[a], ready[b])
        if depth == len(layers):
            layers.append([])
        layers[depth].append((a, b))
        ready[a] = ready[b] = depth + 1
    return layers


def _layered(samples: torch.Tensor, geometry: SortGeometry) -> Tuple[torch.Tensor, List[int]]:
    """The sorting network a layer at a time on the whole ``(M, k*k, Ho, Wo)`` tensor: per layer the low and the high
    sides of its comparators gathered, one ``Min`` and one ``Max``, and the maps concatenated again (six nodes a layer,
    where :func:`_sorted_maps` has two a comparator). Returns the maps and the slot each holds."""
    held = list(range(samples.shape[1]))  # held[i]: the slot whose sorted value map i holds
    for layer in _network_layers(geometry):
        where = {slot: i for i, slot in enumerate(held)}
        low_side = [where[a] for a, _ in layer]
        high_side = [where[b] for _, b in layer]
        rest = [i for i in range(len(held)) if i not in set(low_side) | set(high_side)]
        first = samples[:, low_side]
        second = samples[:, high_side]
        parts = [torch.minimum(first, second), torch.maximum(first, second)]
        if rest:
            parts.append(samples[:, rest])
        samples = torch.cat(parts, 1)
        held = [a for a, _ in layer] + [b for _, b in layer] + [held[i] for i in rest]
    return samples, held


def _sample_and_sort(x: torch.Tensor, geometry: SortGeometry, stride: Tuple[int, int], padding: Tuple[int, int],
                     dilation: Tuple[int, int], name: str) -> Tuple[torch.Tensor, List[int]]:
    """``x`` ``(N, C, H, W)`` -> ``(N, C*k*k, Ho, Wo)``: each channel's windows sampled and sorted, channel ``c``'s
    ``i``-th map at ``c*k*k + i``, by the decomposition ``name``; and the slot each map holds (``held[i]``; in slot
    order but for ``"layered"``)."""
    channels, height, width = int(x.shape[1]), x.shape[2], x.shape[3]
    slots = geometry.kernel_size ** 2
    if name == "topk":  # one grouped convolution of the image as it is (no batch of N*C one-channel images)
        filters = _sampling_filters(geometry, x).repeat(channels, 1, 1, 1)
        samples = F.conv2d(x, filters, None, stride, padding, dilation, channels)
        ho, wo = samples.shape[2], samples.shape[3]
        return _topk_sorted(samples.reshape(-1, slots, ho * wo), geometry).reshape(-1, channels * slots, ho,
                                                                                    wo), list(range(slots))
    samples = F.conv2d(x.reshape(-1, 1, height, width), _sampling_filters(geometry, x), None, stride, padding,
                       dilation)
    ho, wo = samples.shape[2], samples.shape[3]
    if name == "layered":
        samples, held = _layered(samples, geometry)
    elif name == "select":
        samples, held = _selected(samples, geometry), list(range(slots))
    else:
        samples, held = _sorted_maps(samples, geometry), list(range(slots))
    return samples.reshape(-1, channels * slots, ho, wo), held


def sort_conv2d_portable(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geometry: SortGeometry,
                         stride: Tuple[int, int], padding: Tuple[int, int, int, int], dilation: Tuple[int, int],
                         groups: int, decomposition: str = "network") -> torch.Tensor:
    """SC of ``x`` with zero ``padding = (left, right, top, bottom)`` in standard operators, the sorting network
    written as ``decomposition`` (the module docstring); the same function as the reference path. The sorting
    variants only: the aligned ones export through :func:`~timm_sortconv.ops.alignment.align_conv2d_harmonic`."""
    if decomposition not in DECOMPOSITIONS:
        raise ValueError(f"unknown decomposition={decomposition!r}; accepted: {', '.join(map(repr, DECOMPOSITIONS))}")
    name = decomposition
    if padding[0] != padding[1] or padding[2] != padding[3] or name == "reference":
        x = F.pad(x, list(padding)) if any(padding) else x
        padding = (0, 0, 0, 0)
    if name == "reference":
        return sort_conv2d_reference(x, weight, bias, geometry, stride, dilation, groups)
    pad = (padding[2], padding[0])
    channels = int(x.shape[1])
    if name == "chunked":  # sized for one image at the traced size, at most MAX_CHUNKS a layer
        per_channel = geometry.kernel_size ** 2 * int(x.shape[2]) * int(x.shape[3])
        chunks = min(MAX_CHUNKS, max(1, math.ceil(channels * per_channel / CHUNK_VALUES)))
        step = math.ceil(channels / chunks)
        parts = [_sample_and_sort(x[:, c:c + step], geometry, stride, pad, dilation, "network")[0]
                 for c in range(0, channels, step)]
        columns, held = (parts[0] if len(parts) == 1 else torch.cat(parts, 1)), list(range(geometry.kernel_size ** 2))
    else:
        columns, held = _sample_and_sort(x, geometry, stride, pad, dilation, name)
    kernel = slot_weight(weight, geometry)
    if held != sorted(held):  # map i of each channel holds slot held[i]: the weight follows, not the maps
        kernel = kernel[:, :, held]
    kernel = kernel.reshape(weight.shape[0], -1, 1, 1).to(columns.dtype)
    return F.conv2d(columns, kernel, bias, 1, 0, 1, groups)
