"""Strided layers whose grid of windows is centred on the image, so that a quarter turn maps it onto itself.

A layer with kernel ``k`` (dilated extent ``K = d (k - 1) + 1``), stride ``s`` and padding ``p`` on a side of
``N`` pixels puts its first window's centre at ``(K - 1) / 2 - p`` and steps by ``s``; with
``D = N + 2p - K``, its last window's centre is ``D - D mod s`` further on. The grid is symmetric about
the image's centre ``(N - 1) / 2``, which a quarter turn (``torch.rot90``) keeps in place, only when
``r = D mod s`` is 0. Otherwise the turned image is sampled ``r / 2`` pixels off, and no network built on
such a layer is exactly invariant to quarter turns at that size: ``nn.Conv2d(k=3, stride=2, padding=1)``
on any even size, for example, or 2x2 max pooling on any odd one.

:func:`centre_grid` prepares a layer's input so that its grid is centred, with the layer's own output
size: where ``r`` is odd it reads the input half a pixel on (the mean of each two neighbouring pixels, a
``2``-tap filter that is its own mirror image), which makes ``r`` even, and then it crops ``r / 2`` pixels
off each side. Each axis is treated alone, by the same rule, so the result is equivariant to quarter
turns of any square or oblong input. Where ``r`` is 0 the input is returned unchanged, so a network whose
sizes were already exact computes exactly what it did without it.

What is done depends on each input side (modulo the stride), in Python control flow, which eager mode,
``torch.jit.script`` and ``torch.compile`` follow at every size. Where sizes are recorded instead, the rule goes with
them, so that a graph with a dynamic height and width is centred at every size, as the model is:

* ``torch.jit.trace`` and the TorchScript-based ONNX exporter record one operator per centring,
  ``timm_sortconv::centre_grid`` (``centre_grid_same`` for "SAME" padding), which computes the rule at run time;
  the ONNX exporter writes it as the few standard nodes the traced size needs, or, for a dynamic height or width,
  as nodes that compute the rule from the input's shape (:mod:`timm_sortconv.onnx.centring`);
* ``torch.export`` and the dynamo-based ONNX exporter follow the branches at a fixed size; a dynamic height or width
  of a strided layer's input is refused with an error saying what to do instead (the symbolic sizes of a branch-free
  form of the rule grow with every strided layer, and the exporter's reasoning about them with it: a minute for three
  layers).

``stride_align`` names the choice everywhere it is offered (``SortConv2d``, the models, ``sortify``):
``"centre"`` (this module) or ``"corner"`` (PyTorch's grid, first window at the top-left corner; the
paper's networks).
"""
from __future__ import annotations

import inspect
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module
from torch.nn.modules.utils import _pair

__all__ = ["CENTRED_LAYERS", "STRIDE_ALIGNS", "CentredAvgPool2d", "CentredConv2d", "CentredMaxPool2d", "centre_grid",
           "centre_grid_same", "check_stride_align", "min_input_size", "plain_conv_layer", "pool_class"]

STRIDE_ALIGNS = ("centre", "corner")


def check_stride_align(stride_align: str) -> str:
    """Returns ``stride_align`` if it is one of :data:`STRIDE_ALIGNS`, else raises ``ValueError`` naming them."""
    if stride_align not in STRIDE_ALIGNS:
        raise ValueError(f"stride_align={stride_align!r} is not accepted; use 'centre' (the strided grid centred on "
                         "the image: exact quarter-turn invariance at every size) or 'corner' (nn.Conv2d's grid)")
    return stride_align


def _half_pixel(x: torch.Tensor, rows: bool, columns: bool) -> torch.Tensor:
    """``x`` read half a pixel on along its rows and/or columns: the mean of each two (or four) neighbours, one
    pixel fewer along each. Off the CPU in one pooling operation (one kernel to launch, and one in its backward,
    where the host's time per launch counts); on the CPU as two sums per axis, which take a fifth of its time."""
    if not rows and not columns:
        return x
    if x.device.type != "cpu":
        return F.avg_pool2d(x, [2 if rows else 1, 2 if columns else 1], stride=1)
    for dim, half in ((x.dim() - 2, rows), (x.dim() - 1, columns)):
        if half:
            size = x.shape[dim] - 1
            x = (x.narrow(dim, 0, size) + x.narrow(dim, 1, size)) * 0.5
    return x


def centre_grid(x: torch.Tensor, kernel_size: List[int], stride: List[int], padding: List[int],
                dilation: List[int], min_size: int = 1) -> torch.Tensor:
    """``x`` (``(..., H, W)``) prepared for a layer with these arguments (``padding`` per side, as
    ``nn.Conv2d`` and the pooling layers take it) so that the layer's grid of windows is centred and its
    output size unchanged (the module docstring says how). Unchanged where the grid is centred already,
    for unit strides, and where the padded input is smaller than the window (the layer then raises its own
    error). A side that the crop would leave shorter than ``min_size`` (1; a reflect or circular padding
    needs more, and its layer says how much) is left as it is, so that such an input of a few pixels is
    taken, as ``nn.Conv2d`` takes it, on PyTorch's grid, which is not centred there.

    Example:
        >>> x = torch.arange(16.0).view(1, 1, 4, 4)
        >>> centre_grid(x, [1, 1], [2, 2], [0, 0], [1, 1])[0, 0]  # windows at 0.5 and 2.5, not 0 and 2
        tensor([[ 2.5000,  3.5000,  4.5000],
                [ 6.5000,  7.5000,  8.5000],
                [10.5000, 11.5000, 12.5000]])
    """
    if not torch.jit.is_scripting():
        if torch.jit.is_tracing():  # torch.jit.trace, the TorchScript ONNX exporter: one operator, sized at run time
            # (int(): a size read off a tensor while tracing is a traced value; the layer's arguments are constants)
            return torch.ops.timm_sortconv.centre_grid(x, *([int(v) for v in arg] for arg in (
                kernel_size, stride, padding, dilation)), int(min_size))
        if torch.compiler.is_exporting():
            _refuse_symbolic_sizes(x, stride)
    return _centre_grid(x, kernel_size, stride, padding, dilation, min_size)


def centre_grid_residues(height: int, width: int, kernel_size: List[int], stride: List[int], padding: List[int],
                         dilation: List[int], min_size: int = 1) -> List[int]:
    """``[rows, columns]``: the residue ``r`` of each axis of an ``height x width`` input that :func:`centre_grid`
    takes away (read half a pixel on where it is odd, then ``r // 2`` cropped off each side), 0 where nothing is to
    be done."""
    residues = [0, 0]
    sizes = [height, width]
    for axis in range(2):  # (a range, not enumerate over a tuple: TorchScript compiles this)
        span = sizes[axis] + 2 * padding[axis] - dilation[axis] * (kernel_size[axis] - 1) - 1
        if stride[axis] != 1 and span >= 0:
            excess = span % stride[axis]
            residues[axis] = 0 if sizes[axis] - excess < min_size else excess
    return residues


def _centre_grid(x: torch.Tensor, kernel_size: List[int], stride: List[int], padding: List[int],
                 dilation: List[int], min_size: int) -> torch.Tensor:
    residues = centre_grid_residues(x.shape[-2], x.shape[-1], kernel_size, stride, padding, dilation, min_size)
    x = _half_pixel(x, residues[0] % 2 == 1, residues[1] % 2 == 1)
    for axis in range(2):
        crop = residues[axis] // 2
        if crop > 0:
            dim = x.dim() - 2 + axis
            x = x.narrow(dim, crop, x.shape[dim] - 2 * crop)
    return x


@torch.library.custom_op("timm_sortconv::centre_grid", mutates_args=())
def _centre_grid_op(x: torch.Tensor, kernel_size: List[int], stride: List[int], padding: List[int],
                    dilation: List[int], min_size: int) -> torch.Tensor:
    """:func:`centre_grid` as one operator, which a trace records with its arguments (a copy: an operator's output
    is never its input)."""
    return _centre_grid(x, kernel_size, stride, padding, dilation, min_size).clone()


@_centre_grid_op.register_fake
def _(x, kernel_size, stride, padding, dilation, min_size):
    residues = centre_grid_residues(x.shape[-2], x.shape[-1], kernel_size, stride, padding, dilation, min_size)
    return x.new_empty(x.shape[:-2] + (x.shape[-2] - residues[0], x.shape[-1] - residues[1]))


def _refuse_symbolic_sizes(x: torch.Tensor, stride: List[int]) -> None:
    """Raises the error of the module docstring where ``torch.export`` gives a strided axis a symbolic size."""
    for axis in range(2):
        size = x.shape[x.dim() - 2 + axis]
        if stride[axis] != 1 and not isinstance(size, int):
            raise ValueError(
                f"a strided layer's grid is centred for the input's actual size (timm_sortconv.grid), which "
                f"torch.export cannot follow for a dynamic height or width ({size}): export at a fixed size, or with "
                "the TorchScript-based exporter for a dynamic size (torch.onnx.export(..., dynamo=False), which "
                "timm's onnx_export.py uses unless --dynamo), or build the model with stride_align='corner'")


def min_input_size(padding_mode: str, padding: List[int]) -> int:
    """The shortest input side that ``F.pad`` takes with this mode and ``padding`` (in ``F.pad``'s order)."""
    if padding_mode == "reflect":
        return max(padding) + 1
    if padding_mode == "circular":
        return max(max(padding), 1)
    return 1


def centre_grid_same(x: torch.Tensor, kernel_size: List[int], stride: List[int], dilation: List[int]) -> torch.Tensor:
    """``x`` padded (or cropped) symmetrically for TensorFlow's "SAME" output size ``ceil(N / s)``, with a
    centred grid: the counterpart of ``timm.layers.pad_same``, which puts an odd pixel of padding on the
    bottom/right. Where the padding is odd, the input is read half a pixel on first."""
    if not torch.jit.is_scripting():
        if torch.jit.is_tracing():  # as in centre_grid: one operator
            return torch.ops.timm_sortconv.centre_grid_same(x, *([int(v) for v in arg] for arg in (
                kernel_size, stride, dilation)))
        if torch.compiler.is_exporting():
            _refuse_symbolic_sizes(x, stride)
    return _centre_grid_same(x, kernel_size, stride, dilation)


def same_padding_totals(height: int, width: int, kernel_size: List[int], stride: List[int],
                        dilation: List[int]) -> List[int]:
    """``[rows, columns]``: the padding "SAME" adds along each axis of an ``height x width`` input for the output
    size ``ceil(N / s)`` (negative: cropped). :func:`centre_grid_same` reads the input half a pixel on where it is
    odd and then pads (or crops) half of the even total on each side."""
    totals = [0, 0]
    sizes = [height, width]
    for axis in range(2):
        out = (sizes[axis] + stride[axis] - 1) // stride[axis]
        totals[axis] = (out - 1) * stride[axis] + dilation[axis] * (kernel_size[axis] - 1) + 1 - sizes[axis]
    return totals


def _centre_grid_same(x: torch.Tensor, kernel_size: List[int], stride: List[int],
                      dilation: List[int]) -> torch.Tensor:
    totals = same_padding_totals(x.shape[-2], x.shape[-1], kernel_size, stride, dilation)
    x = _half_pixel(x, totals[0] % 2 == 1, totals[1] % 2 == 1)
    for axis in range(2):
        dim = x.dim() - 2 + axis
        total = totals[axis] + totals[axis] % 2  # read half a pixel on: one pixel fewer to pad
        side = total // 2
        if side < 0:
            x = x.narrow(dim, -side, x.shape[dim] + 2 * side)
        elif side > 0:
            pad = [0, 0, 0, 0]
            pad[2 * (1 - axis)] = side
            pad[2 * (1 - axis) + 1] = side
            x = F.pad(x, pad)
    return x


@torch.library.custom_op("timm_sortconv::centre_grid_same", mutates_args=())
def _centre_grid_same_op(x: torch.Tensor, kernel_size: List[int], stride: List[int],
                         dilation: List[int]) -> torch.Tensor:
    """:func:`centre_grid_same` as one operator (as :func:`_centre_grid_op`)."""
    return _centre_grid_same(x, kernel_size, stride, dilation).clone()


@_centre_grid_same_op.register_fake
def _(x, kernel_size, stride, dilation):
    totals = same_padding_totals(x.shape[-2], x.shape[-1], kernel_size, stride, dilation)
    sizes = [x.shape[-2 + axis] - totals[axis] % 2 + 2 * ((totals[axis] + totals[axis] % 2) // 2) for axis in (0, 1)]
    return x.new_empty(x.shape[:-2] + tuple(sizes))


# timm's FX feature extraction (features_only=True, feature_cls="fx") keeps these as leaves: their centring
# branches on the input's size, which symbolic tracing cannot follow.
@register_notrace_module
class CentredConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose strided grid is centred (:func:`centre_grid`): same constructor, parameters and
    ``state_dict`` keys. For the plain strided convolutions of an SC network (``1 x 1`` shortcut projections,
    a plain twin), whose grid must be the same as the sorting layers' beside them; a unit-stride convolution
    has nothing to centre and stays an ``nn.Conv2d`` (:func:`plain_conv_layer`)."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # nn.Conv2d's own _conv_forward, after centring (TorchScript compiles no super() call)
        pad = self._reversed_padding_repeated_twice
        input = centre_grid(input, [self.kernel_size[0], self.kernel_size[1]], [self.stride[0], self.stride[1]],
                            [pad[2], pad[0]], [self.dilation[0], self.dilation[1]],
                            min_input_size(self.padding_mode, pad))
        if self.padding_mode != "zeros":
            return F.conv2d(F.pad(input, pad, mode=self.padding_mode), weight, bias, self.stride, _pair(0),
                            self.dilation, self.groups)
        return F.conv2d(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "CentredConv2d":
        """A ``CentredConv2d`` with ``conv``'s configuration, device, dtype, training mode and a copy of its
        weights."""
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                  conv.groups, conv.bias is not None, conv.padding_mode, device=conv.weight.device,
                  dtype=conv.weight.dtype)
        return copy_conv_state(new, conv)


def copy_conv_state(new: nn.Conv2d, conv: nn.Conv2d) -> nn.Conv2d:
    """Gives ``new`` (built with ``conv``'s shapes) ``conv``'s weight and bias values, their ``requires_grad``
    and its training mode; returns ``new``. The values are read through the attributes, so a parametrised
    weight (``weight_norm``) arrives as the weight it computes."""
    with torch.no_grad():
        new.weight.copy_(conv.weight)
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    new.weight.requires_grad_(conv.weight.requires_grad)
    if conv.bias is not None:
        new.bias.requires_grad_(conv.bias.requires_grad)
    return new.train(conv.training)


def _check_floor_mode(ceil_mode: bool) -> None:
    if ceil_mode:
        raise ValueError("a centred pooling grid needs ceil_mode=False: ceil mode adds a window that reaches past "
                         "the bottom/right edge only, which a quarter turn does not keep")


@register_notrace_module
class CentredMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` whose strided grid is centred (:func:`centre_grid`); ``ceil_mode`` must be False."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False) -> None:
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        _check_floor_mode(self.ceil_mode)
        self.grid = _grid_args(self.kernel_size, self.stride, self.padding, self.dilation)

    def forward(self, input: torch.Tensor):
        input = centre_grid(input, self.grid[0], self.grid[1], self.grid[2], self.grid[3])
        return F.max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation,
                            ceil_mode=self.ceil_mode, return_indices=self.return_indices)

    @classmethod
    def from_pool(cls, pool: nn.MaxPool2d) -> "CentredMaxPool2d":
        """The same pooling with a centred grid."""
        return cls(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.return_indices, pool.ceil_mode)


@register_notrace_module
class CentredAvgPool2d(nn.AvgPool2d):
    """``nn.AvgPool2d`` whose strided grid is centred (:func:`centre_grid`); ``ceil_mode`` must be False."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: Optional[int] = None) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
        _check_floor_mode(self.ceil_mode)
        self.grid = _grid_args(self.kernel_size, self.stride, self.padding, 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input = centre_grid(input, self.grid[0], self.grid[1], self.grid[2], self.grid[3])
        return F.avg_pool2d(input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                            self.count_include_pad, self.divisor_override)

    @classmethod
    def from_pool(cls, pool: nn.AvgPool2d) -> "CentredAvgPool2d":
        """The same pooling with a centred grid."""
        return cls(pool.kernel_size, pool.stride, pool.padding, pool.ceil_mode, pool.count_include_pad,
                   pool.divisor_override)


def _grid_args(kernel_size, stride, padding, dilation) -> List[List[int]]:
    """A pooling layer's arguments (ints or pairs) as the four lists :func:`centre_grid` takes."""
    return [list(_pair(value)) for value in (kernel_size, stride, padding, dilation)]


#: The plain layers of this module: their grid is centred whatever their stride.
CENTRED_LAYERS = (CentredConv2d, CentredMaxPool2d, CentredAvgPool2d)


_CONV2D_SIGNATURE = inspect.signature(nn.Conv2d)


def _plain_or_centred_conv(*args, **kwargs) -> nn.Conv2d:
    """``nn.Conv2d(*args, **kwargs)``, or :class:`CentredConv2d` with the same arguments where the stride is not 1."""
    stride = _pair(_CONV2D_SIGNATURE.bind(*args, **kwargs).arguments.get("stride", 1))
    return (nn.Conv2d if stride == (1, 1) else CentredConv2d)(*args, **kwargs)


def plain_conv_layer(stride_align: str) -> Callable[..., nn.Conv2d]:
    """What builds the plain convolutions of a network with ``stride_align``: ``nn.Conv2d`` for ``"corner"``; for
    ``"centre"`` a factory taking ``nn.Conv2d``'s arguments that gives a :class:`CentredConv2d` where the stride is
    not 1 and an ``nn.Conv2d`` where it is (no grid to centre: tools that match the exact type see a plain
    convolution).

    Example:
        >>> make = plain_conv_layer("centre")
        >>> type(make(4, 8, 3, padding=1)).__name__, type(make(4, 8, 1, stride=2)).__name__
        ('Conv2d', 'CentredConv2d')
    """
    return _plain_or_centred_conv if check_stride_align(stride_align) == "centre" else nn.Conv2d


def pool_class(kind: str, stride_align: str) -> type:
    """The pooling class (``kind`` ``"max"`` or ``"avg"``) of a network built with ``stride_align``."""
    centred = check_stride_align(stride_align) == "centre"
    if kind == "max":
        return CentredMaxPool2d if centred else nn.MaxPool2d
    if kind == "avg":
        return CentredAvgPool2d if centred else nn.AvgPool2d
    raise ValueError(f"pooling kind={kind!r} is not accepted; use 'max' or 'avg'")
