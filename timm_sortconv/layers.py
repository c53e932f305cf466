"""The Sorting Convolution layers: drop-in ``nn.Conv2d`` modules whose windows are sampled and sorted before the product.

* :class:`SortConv2d`: ``nn.Conv2d``'s constructor, parameters and padding, plus ``sampling``, ``sorting``,
  ``backend`` and ``stride_align``;
* :class:`SortConv2dSame`: the same with TensorFlow-style dynamic "SAME" padding, the twin of timm's
  ``Conv2dSame`` (what :func:`timm_sortconv.sortify` puts in its place).
"""

# (No postponed annotations here: TorchScript reads a @torch.jit.unused method's annotations as objects.)
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from timm.layers import pad_same, register_notrace_module

from .grid import centre_grid, centre_grid_same, check_stride_align, copy_conv_state, min_input_size
from .ops.backends import check_backend_name
from .ops.checks import check_input, layer_arguments
from .ops.functional import sort_conv2d_padded
from .ops.geometry import get_geometry

__all__ = ["SortConv2d", "SortConv2dSame"]


class SortConv2d(nn.Conv2d):
    """Sorting Convolution (Mo & Zhao): rotation-invariant windows, ``nn.Conv2d``'s weights.

    It *is* an ``nn.Conv2d`` (same constructor, parameters, state-dict keys, initialisation and
    ``extra_repr``), so code that initialises, counts or loads convolutions treats it as one. Only the
    product differs: each ``k x k`` window is sampled (``sampling``), its values sorted (``sorting``) and
    laid back on the grid in row-major order before the usual multiply-add with ``weight``.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode,
        device, dtype: as :class:`torch.nn.Conv2d`, which accepts and refuses the same values
            (:mod:`.ops.checks`; refused here when the layer is built, where ``nn.Conv2d`` refuses some only at
            its first call); ``kernel_size`` must be square (odd or even: an even window's rings lie about the
            point between its four central pixels, see :mod:`.ops.geometry`).
        sampling: ``"polar"`` (bilinear samples on circles, near-invariant to any angle) or ``"square"`` (the
            grid itself, exact only at multiples of 90 degrees).
        sorting: ``"ring"`` (sort each Chebyshev ring, keeps radial structure), ``"global"``, or
            ``"c4"``/``"c2"`` (sort each ring's samples only among those a quarter/half turn apart: exactly
            invariant to quarter/half turns, and keeps the direction modulo 90/180 degrees, for a network
            whose input is turned by ``canonicalize="moment4"``/``"moment2"``), or ``"align"``/``"align-channel"``
            (no sorting: each window turned back by its own orientation, one per position shared by a group's
            channels / one per channel, keeping the window's inner order; :mod:`.ops.alignment`).
        backend: ``"auto"``, ``"reference"`` or a fast backend's name.
        guided: turn every window by the orientation guide of the model (needs ``sorting="align"``; the guide
            itself comes from :func:`timm_sortconv.guide.attach_guide`, which also sets this on every aligned
            layer of the model it guides).
        stride_align: where a strided layer's grid of windows lies: ``"centre"`` (default: symmetric about
            the image's centre, so that a quarter turn of the input maps it onto itself at every input size;
            the input is cropped, or read half a pixel on, where its size needs it, :mod:`timm_sortconv.grid`)
            or ``"corner"`` (``nn.Conv2d``'s grid, which is symmetric only for some sizes). Unit strides are
            the same either way.

    A layer with ``sorting="align"`` can be *guided*: :func:`timm_sortconv.guide.attach_guide` (or a model's or
    ``sortify``'s ``guide_blur=``) makes it turn every window by the orientation of the model's blurred input there,
    read from a map made once per forward (:mod:`timm_sortconv.guide`).

    Turning each image to a canonical orientation first is a step in front of the model, not part of a
    convolution: :class:`timm_sortconv.canonical.MomentCanonicalize2d`, or ``canonicalize=`` of the models and
    of :func:`~timm_sortconv.sortify`.

    Shape:
        Input ``(N, C_in, H, W)`` or ``(C_in, H, W)``; output as ``nn.Conv2d``.

    Example:
        >>> conv = SortConv2d(3, 16, 7, padding=3)
        >>> conv(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 16, 32, 32])
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
        *,
        sampling: str = "polar",
        sorting: str = "ring",
        backend: str = "auto",
        stride_align: str = "centre",
        guided: bool = False,
        canonicalize: None = None,
    ) -> None:
        if canonicalize is not None:
            raise TypeError(f"SortConv2d(canonicalize={canonicalize!r}): a convolution does not turn its input; put "
                            "timm_sortconv.canonical.MomentCanonicalize2d in front of the model, or pass canonicalize= "
                            "to timm.create_model(...) or to sortify(...)")
        # Checks kernel_size, sampling and sorting, and builds the sampling tables now, so that a
        # traced, compiled or exported forward finds them cached instead of recording their construction.
        get_geometry(kernel_size, sampling, sorting)
        if not isinstance(guided, bool):
            raise TypeError(f"guided must be True or False, got {guided!r}")
        if guided and sorting != "align":
            raise ValueError(f"guided=True turns every window by the orientation guide, which needs sorting='align' "
                             f"(one orientation per position, shared by a group's channels); got sorting={sorting!r}")
        stride, padding, dilation, groups = layer_arguments(in_channels, out_channels, stride, padding, dilation,
                                                            groups, padding_mode)
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device, dtype)
        self.sampling = sampling
        self.sorting = sorting
        self.backend = check_backend_name(backend)
        self.stride_align = check_stride_align(stride_align)
        # The guide's map is one more input channel per group; timm_sortconv.guide.attach_guide gives the guide
        # (and sets guided on every aligned layer of the model).
        self.guided = guided
        self.guide_source: tuple = ()

    def __prepare_scriptable__(self):
        """``torch.jit.script`` calls this first: a guided layer reads its guide from a module the model shares
        between its layers through a forward pre-hook, which TorchScript cannot compile; say so in one error."""
        if self.guided:
            raise RuntimeError("a guided SortConv2d (guide_blur, timm_sortconv.guide) cannot be compiled by "
                               "torch.jit.script: its guide is shared between layers through a forward pre-hook; "
                               "use torch.compile, torch.export or ONNX export, which run it")
        return self

    @torch.jit.unused
    def _with_guide(self, input: Tensor, weight: Tensor) -> Tuple[Tensor, Tensor]:
        """``input`` with the orientation guide at its size as one more channel after each group's channels, the
        guide channel that ``sorting="align"`` reads for the orientation only (it has no weight), and ``weight``
        (:mod:`timm_sortconv.guide`)."""
        if not self.guide_source:
            raise RuntimeError("this guided SortConv2d has no orientation guide; attach one to its model with "
                               "timm_sortconv.guide.attach_guide(model, blur)")
        check_input(input, weight, self.groups)
        unbatched = input.dim() == 3
        batch = input.unsqueeze(0) if unbatched else input
        guide = self.guide_source[0].like(batch).to(batch.dtype)
        if guide.shape[0] != batch.shape[0]:
            raise RuntimeError(f"the orientation guide was made from {guide.shape[0]} image(s), this layer has "
                               f"{batch.shape[0]}: a guided layer runs in the forward of the model it belongs to")
        if self.groups == 1:
            batch = torch.cat([batch, guide], 1)
        else:
            grouped = batch.unflatten(1, (self.groups, -1))
            batch = torch.cat([grouped, guide.unsqueeze(1).expand(-1, self.groups, -1, -1, -1)], 2).flatten(1, 2)
        return (batch.squeeze(0) if unbatched else batch), weight

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # (the input is checked by sort_conv2d_padded, or by the operator's per-call checks on its eager path)
        if self.guided:
            input, weight = self._with_guide(input, weight)
        elif self.sorting == "align":  # the operator takes one guide channel more a group there; this layer none
            check_input(input, weight, self.groups)
        if self.stride_align == "centre" and (self.stride[0] != 1 or self.stride[1] != 1):  # unit strides: centred
            # before the centring reads the input half a pixel on
            check_input(input, weight, self.groups, self.sorting if self.guided else "")
            input = centre_grid(input, [self.kernel_size[0], self.kernel_size[1]], [self.stride[0], self.stride[1]],
                                [self._reversed_padding_repeated_twice[2], self._reversed_padding_repeated_twice[0]],
                                [self.dilation[0], self.dilation[1]],
                                min_input_size(self.padding_mode, self._reversed_padding_repeated_twice))
        return sort_conv2d_padded(input, weight, bias, [self.stride[0], self.stride[1]],
                                  self._reversed_padding_repeated_twice, self.padding_mode,
                                  [self.dilation[0], self.dilation[1]], self.groups, self.sampling, self.sorting,
                                  self.backend)

    def extra_repr(self) -> str:
        align = "" if self.stride == (1, 1) else f", stride_align={self.stride_align}"
        guided = ", guided=True" if self.guided else ""
        return (f"{super().extra_repr()}, sampling={self.sampling}, sorting={self.sorting}, backend={self.backend}"
                f"{align}{guided}")

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, *, sampling: str = "polar", sorting: str = "ring",
                  backend: str = "auto", stride_align: str = "centre") -> "SortConv2d":
        """A ``SortConv2d`` with ``conv``'s configuration, a copy of its weights, device and dtype.

        Example:
            >>> conv = nn.Conv2d(8, 8, 3, padding=1, groups=2)
            >>> sc = SortConv2d.from_conv(conv, sampling="square")
            >>> torch.equal(sc.weight, conv.weight), sc.groups
            (True, 2)
        """
        if not isinstance(conv, nn.Conv2d):
            raise TypeError(f"from_conv expects an nn.Conv2d, got {type(conv).__name__}")
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                  conv.groups, conv.bias is not None, conv.padding_mode, device=conv.weight.device,
                  dtype=conv.weight.dtype, sampling=sampling, sorting=sorting, backend=backend,
                  stride_align=stride_align)
        return copy_conv_state(new, conv)


# timm's FX feature extraction (features_only=True, feature_cls="fx") treats these as leaves: the
# operator validates shapes in Python, which symbolic tracing cannot follow.
register_notrace_module(SortConv2d)


@register_notrace_module
class SortConv2dSame(SortConv2d):
    """``SortConv2d`` with TensorFlow-style dynamic "SAME" padding, the sorting twin of timm's ``Conv2dSame``.

    The input is padded for its actual size to TensorFlow's output size ``ceil(N / stride)``, then sorted
    and convolved without further padding. With ``stride_align="corner"`` it is padded by
    ``timm.layers.pad_same`` (an odd pixel of padding on the bottom/right), exactly where ``Conv2dSame``
    would convolve; with ``"centre"`` (default) symmetrically, reading the input half a pixel on where the
    padding is odd (:func:`timm_sortconv.grid.centre_grid_same`), so that a quarter turn maps the grid onto
    itself (this also centres a stride-1 even kernel).

    Args:
        as :class:`~timm_sortconv.SortConv2d`; ``padding`` must be ``0`` or ``"same"`` (the padding is
        computed per call).

    Example:
        >>> conv = SortConv2dSame(3, 8, 3, stride=2)
        >>> conv(torch.randn(1, 3, 15, 15)).shape
        torch.Size([1, 8, 8, 8])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None, *,
                 sampling: str = "polar", sorting: str = "ring", backend: str = "auto",
                 stride_align: str = "centre") -> None:
        if padding not in (0, (0, 0), "same"):
            raise ValueError(f"SortConv2dSame computes its padding per call; pass padding=0 or 'same', "
                             f"got padding={padding!r}")
        if padding_mode != "zeros":
            raise ValueError(f"SortConv2dSame pads with zeros like timm's Conv2dSame; got padding_mode={padding_mode!r}")
        super().__init__(in_channels, out_channels, kernel_size, stride, 0, dilation, groups, bias, padding_mode,
                         device, dtype, sampling=sampling, sorting=sorting, backend=backend, stride_align=stride_align)

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.guided:
            input, weight = self._with_guide(input, weight)
        check_input(input, weight, self.groups, self.sorting if self.guided else "")
        if self.stride_align == "centre":
            input = centre_grid_same(input, [self.kernel_size[0], self.kernel_size[1]],
                                     [self.stride[0], self.stride[1]], [self.dilation[0], self.dilation[1]])
        else:
            input = pad_same(input, self.kernel_size, self.stride, self.dilation)
        return sort_conv2d_padded(input, weight, bias, [self.stride[0], self.stride[1]], [0, 0, 0, 0], "zeros",
                                  [self.dilation[0], self.dilation[1]], self.groups, self.sampling, self.sorting,
                                  self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, padding=same (dynamic)"
