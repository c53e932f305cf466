"""Which ONNX form an SC layer takes when a model is exported: the lowering, chosen by a context.

While ``torch.onnx.export`` traces a model, every SC layer's call reaches :func:`lower_sort_conv2d` (registered with
:func:`timm_sortconv.ops.functional.set_onnx_lowering` when :mod:`timm_sortconv.onnx` is imported, which importing
the package does). What it writes depends on the :class:`Lowering` of the current context (a ``contextvars``
value, so threads and nested exports each see their own):

* by default, standard operators (:mod:`.portable` for the sortings, the harmonic form of
  :func:`~timm_sortconv.ops.alignment.align_conv2d_harmonic` for the aligned variants), which every ONNX runtime
  runs; ``decomposition`` names how the sorting network is written (:data:`.portable.DECOMPOSITIONS`);
* inside :func:`fused_export`, one ``timm_sortconv::SortConv2d`` node per layer (:mod:`.fused`), which the
  package's runtime library computes.

The centring of strided grids (:mod:`timm_sortconv.grid`) follows the same context (:mod:`.centring`).

Example:
    >>> with decomposition("layered"):
    ...     current().decomposition
    'layered'
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Iterator, List, Optional

import torch
import torch.nn.functional as F

from ..ops.alignment import align_conv2d_harmonic, is_aligned
from ..ops.geometry import get_geometry
from .fused import check_fused
from .portable import DECOMPOSITIONS, sort_conv2d_portable

__all__ = ["Lowering", "current", "decomposition", "fused_export", "fused_export_enabled", "lower_sort_conv2d",
           "standard_operators"]


@dataclass(frozen=True)
class Lowering:
    """How exports write SC layers: ``fused`` (one ``timm_sortconv::SortConv2d`` node each) or standard operators
    with the sorting network written as ``decomposition``."""

    fused: bool = False
    decomposition: str = "network"


_LOWERING: contextvars.ContextVar[Lowering] = contextvars.ContextVar("timm_sortconv_onnx_lowering",
                                                                     default=Lowering())


def current() -> Lowering:
    """The lowering of the current context."""
    return _LOWERING.get()


@contextlib.contextmanager
def _lowered(**changes) -> Iterator[Lowering]:
    token = _LOWERING.set(replace(_LOWERING.get(), **changes))
    try:
        yield _LOWERING.get()
    finally:
        _LOWERING.reset(token)


@contextlib.contextmanager
def decomposition(name: str) -> Iterator[None]:
    """Exports inside the ``with`` block write the sorting networks of SC layers as ``name`` (one of
    :data:`.portable.DECOMPOSITIONS`)."""
    if name not in DECOMPOSITIONS:
        raise ValueError(f"unknown decomposition={name!r}; accepted: {', '.join(map(repr, DECOMPOSITIONS))}")
    with _lowered(decomposition=name):
        yield


@contextlib.contextmanager
def fused_export() -> Iterator[None]:
    """Exports inside the ``with`` block write each SC layer as one ``timm_sortconv::SortConv2d`` node
    (:mod:`.fused`); pass ``custom_opsets={"timm_sortconv": 1}`` to the TorchScript-based exporter and
    ``custom_translation_table=fused.translation_table()`` to the dynamo one (:func:`timm_sortconv.onnx.export` does
    both, and completes the file: :func:`.fused.finish`)."""
    with _lowered(fused=True):
        yield


@contextlib.contextmanager
def standard_operators(name: str = "network") -> Iterator[None]:
    """Exports inside the ``with`` block write SC layers in standard operators, the sorting networks as ``name``,
    whatever the context around it (the bodies of :mod:`.functions`)."""
    with _lowered(fused=False), decomposition(name):
        yield


def fused_export_enabled() -> bool:
    """Whether exports in this context write SC layers as ``timm_sortconv::SortConv2d`` nodes."""
    return _LOWERING.get().fused


def lower_sort_conv2d(input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], stride: List[int],
                      padding: List[int], dilation: List[int], groups: int, sampling: str,
                      sorting: str) -> torch.Tensor:
    """An SC layer (``padding = [left, right, top, bottom]`` zeros) as the current lowering writes it."""
    lowering = _LOWERING.get()
    if lowering.fused:  # the registered operator, which the exporters write as the node (.fused)
        check_fused([t.dtype for t in (input, weight, bias) if t is not None], int(weight.shape[-1]), sorting)
        return torch.ops.timm_sortconv.sort_conv2d(input, weight, bias, stride, padding, dilation, groups, sampling,
                                                   sorting, "auto")
    geometry = get_geometry(int(weight.shape[-1]), sampling, sorting)  # a traced size is a tensor
    if is_aligned(geometry):  # in convolutions and products (the reference path's FFT has no ONNX form)
        padded = F.pad(input, padding) if any(padding) else input
        return align_conv2d_harmonic(padded, weight, bias, geometry, (stride[0], stride[1]),
                                     (dilation[0], dilation[1]), groups)
    return sort_conv2d_portable(input, weight, bias, geometry, (stride[0], stride[1]),
                                (padding[0], padding[1], padding[2], padding[3]), (dilation[0], dilation[1]), groups,
                                lowering.decomposition)
