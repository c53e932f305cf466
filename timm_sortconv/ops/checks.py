"""The checks of a Sorting Convolution's arguments: ``nn.Conv2d``'s contract, in one place.

``SortConv2d`` and :func:`~timm_sortconv.sort_conv2d` accept what ``nn.Conv2d`` and ``F.conv2d`` accept, and
refuse the rest with the exception class PyTorch raises for it, in one line that names the argument and what
is accepted: ``TypeError`` for a value of the wrong type, ``ValueError`` where ``nn.Conv2d``'s constructor
refuses (a padding string, ``groups``, ``padding_mode``), ``RuntimeError`` where the convolution itself
refuses (a non-positive stride, dilation or kernel size, negative padding, an input of the wrong dimensions or
size). Tensors that do not fit together, which ``F.conv2d`` refuses with a ``RuntimeError``, raise
:class:`ShapeError` (an input whose channels the weight does not expect, a bias of the wrong size, ``groups``
that do not divide the weight's output channels) and :class:`DtypeError` (an integer or bool input beside
floating-point weights): each is a ``RuntimeError``, as ``nn.Conv2d``'s callers catch it, and a ``ValueError``
or ``TypeError``, the mistake it is.
Sorting Convolution's own limits (a square kernel, floating-point tensors, a sampling, sorting and backend it
knows) are ``ValueError`` and ``TypeError``; :func:`.geometry.check_kernel_size` checks the kernel size and
:func:`.geometry.check_variant` the variant, where the geometry is built.

Each check runs once per call, at the entry it belongs to:

* :func:`layer_arguments`: a layer's constructor (``nn.Conv2d`` checks some of them only at the first call;
  a layer refuses them when it is built);
* :func:`functional_arguments`: :func:`~timm_sortconv.sort_conv2d`'s arguments other than the tensors;
* :func:`check_input`: the input's dimensions, size, dtype and channels against the weight, where a call begins
  (``sort_conv2d``, a layer's forward), so that the error comes from the caller's line, not from inside the
  operator, and before the input is padded or centred;
* :func:`check_tensors` and :func:`check_size`: the tensors, in the operator
  (:mod:`.operator`), below autocast: autocast casts the tensors to one dtype first, so that mixed dtypes are
  refused only outside it, as by ``F.conv2d``.
"""
from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor

__all__ = ["DtypeError", "PADDING_MODES", "ShapeError", "check_input", "check_shapes", "check_size", "check_tensors",
           "functional_arguments", "guide_channels", "layer_arguments"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
PADDING_STRINGS = ("same", "valid")

IntPair = Union[int, Sequence[int]]


class ShapeError(ValueError, RuntimeError):
    """Tensors whose shapes do not fit together: an input whose channels the weight does not expect, a bias of
    the wrong size, ``groups`` that do not divide the weight's output channels. A ``RuntimeError``, the class
    ``F.conv2d`` raises for them, and a ``ValueError``, the mistake it is."""


class DtypeError(TypeError, RuntimeError):
    """A tensor that is not floating-point beside floating-point ones (an integer or bool input, floating-point
    weights): a ``RuntimeError``, the class ``F.conv2d`` raises for it, and a ``TypeError``, the mistake it is."""


def _int(value) -> int:
    """``value`` as an int (an int, a NumPy integer, an integer 0-d tensor), else ``TypeError``; bools are refused,
    as ``F.conv2d`` refuses them."""
    if isinstance(value, bool):
        raise TypeError
    return operator.index(value)


def int_pair(value: IntPair, name: str) -> Tuple[int, int]:
    """``value`` (an int, or a list or tuple of one or two ints) as a pair, as ``F.conv2d`` reads it."""
    try:
        values = [_int(v) for v in value] if isinstance(value, (list, tuple)) else [_int(value)] * 2
    except TypeError:
        raise TypeError(f"{name}={value!r} is not accepted; use an int or a pair of ints") from None
    if len(values) == 1:
        values *= 2
    if len(values) != 2:
        raise RuntimeError(f"{name}={value!r} has {len(values)} values; use an int or a pair of ints")
    return values[0], values[1]


def _positive(pair: Tuple[int, int], value: IntPair, name: str) -> Tuple[int, int]:
    if min(pair) < 1:
        raise RuntimeError(f"{name}={value!r}: non-positive {name} is not supported; use ints >= 1")
    return pair


def _groups(groups) -> int:
    """``groups`` as an int, else ``TypeError``; its value is checked by the caller."""
    try:
        return _int(groups)
    except TypeError:
        raise TypeError(f"groups={groups!r} is not accepted; use a positive int") from None


def _positive_groups(groups: int, refusal: Type[Exception]) -> int:
    if groups < 1:
        raise refusal(f"groups={groups} is not accepted; use a positive int")
    return groups


def _padding_string(padding: str, stride: IntPair, refusal: Type[Exception]) -> str:
    """``padding`` if it is ``"valid"``, or ``"same"`` with a unit ``stride`` (compared as given, as PyTorch
    does), else ``refusal``."""
    if padding not in PADDING_STRINGS:
        raise refusal(f"padding={padding!r} is not accepted; use 'same', 'valid', an int or a pair of ints")
    if padding == "same" and any(s != 1 for s in (stride if isinstance(stride, (list, tuple)) else [stride])):
        raise refusal(f"padding='same' is not supported for strided convolutions (stride={stride!r}), as in "
                      "nn.Conv2d; use an int or a pair of ints")
    return padding


def _pairs(stride: IntPair, padding: Union[str, IntPair], dilation: IntPair
           ) -> Tuple[Tuple[int, int], Union[str, Tuple[int, int]], Tuple[int, int]]:
    """``stride``, ``padding`` (a string is checked by the caller) and ``dilation`` as pairs of valid values:
    each argument's type first, then the values, in the order ``F.conv2d`` checks them."""
    pairs = [int_pair(stride, "stride"), padding if isinstance(padding, str) else int_pair(padding, "padding"),
             int_pair(dilation, "dilation")]
    stride_pair = _positive(pairs[0], stride, "stride")
    if not isinstance(padding, str) and min(pairs[1]) < 0:
        raise RuntimeError(f"padding={padding!r}: negative padding is not supported; use ints >= 0")
    return stride_pair, pairs[1], _positive(pairs[2], dilation, "dilation")


def _not_floating(dtypes: str) -> str:
    """The message for tensors that are not all floating-point, ``dtypes`` naming each one's dtype."""
    return ("sort_conv2d needs floating-point tensors (float16, bfloat16, float32, float64): integer, bool and "
            "complex ones are not accepted; got " + dtypes)


def guide_channels(channels: int, weight: Tensor, groups: int, sorting: str) -> int:
    """How many guide channels each group of an input with ``channels`` channels carries: 1 where ``sorting`` is
    ``"align"`` and the input has one channel per group more than ``weight`` takes (the orientation guide,
    :mod:`.alignment`: it joins the orientation of its group's windows and has no weight), else 0. The caller
    checks that the channels fit one of the two forms."""
    return 1 if sorting == "align" and channels == (weight.shape[1] + 1) * groups else 0


def _channels_fit(channels: int, weight: Tensor, groups: int, sorting: str) -> bool:
    return channels == weight.shape[1] * groups or guide_channels(channels, weight, groups, sorting) == 1


def _channels_message(input: Tensor, weight: Tensor, groups: int, sorting: str = "") -> str:
    """The message for an input whose channels (dimension -3, batched or not) ``weight`` does not expect."""
    guided = (f" (or {(weight.shape[1] + 1) * groups}: one guide channel after each group's, which "
              "sorting='align' reads for the orientation only)") if sorting == "align" else ""
    return (f"sort_conv2d: input has {input.shape[-3]} channels (shape {list(input.shape)}) but the weight "
            f"{list(weight.shape)} with groups={groups} expects {weight.shape[1] * groups}{guided}")


def check_padding_mode(padding_mode: str) -> str:
    """Returns ``padding_mode`` if it is one of :data:`PADDING_MODES`, else raises ``ValueError``."""
    if padding_mode not in PADDING_MODES:
        raise ValueError(f"padding_mode={padding_mode!r} is not accepted; use one of {PADDING_MODES}")
    return padding_mode


def layer_arguments(in_channels: int, out_channels: int, stride: IntPair, padding: Union[str, IntPair],
                    dilation: IntPair, groups: int, padding_mode: str
                    ) -> Tuple[Tuple[int, int], Union[str, Tuple[int, int]], Tuple[int, int], int]:
    """A layer's ``(stride, padding, dilation, groups)``, checked and as pairs, or the error ``nn.Conv2d``
    raises for them (when built, or at its first call), checked in the same order."""
    groups = _positive_groups(_groups(groups), ValueError)
    for name, channels in (("in_channels", in_channels), ("out_channels", out_channels)):
        if channels % groups:
            raise ValueError(f"groups={groups} must divide {name}={channels}")
    if isinstance(padding, str):
        _padding_string(padding, stride, ValueError)
    check_padding_mode(padding_mode)
    return (*_pairs(stride, padding, dilation), groups)


def functional_arguments(weight: Tensor, stride: IntPair, padding: Union[str, IntPair], dilation: IntPair,
                         groups: int, padding_mode: str
                         ) -> Tuple[Tuple[int, int], Union[str, Tuple[int, int]], Tuple[int, int], int]:
    """:func:`~timm_sortconv.sort_conv2d`'s ``(stride, padding, dilation, groups)`` for this ``weight``, checked
    and as pairs, or the error ``F.conv2d`` raises for them: every argument's type before any value."""
    check_padding_mode(padding_mode)
    groups = _groups(groups)
    stride_pair, padding_pair, dilation_pair = _pairs(stride, padding, dilation)
    if isinstance(padding, str):
        _padding_string(padding, stride, RuntimeError)
    _positive_groups(groups, RuntimeError)
    if weight.dim() != 4:
        raise RuntimeError(f"weight must be 4-D (C_out, C_in / groups, k, k), got shape {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise RuntimeError(f"weight of shape {tuple(weight.shape)} has no output channels; it needs at least one")
    if weight.shape[0] % groups:
        raise ShapeError(f"groups={groups} must divide the weight's {weight.shape[0]} output channels "
                         f"(weight shape {tuple(weight.shape)})")
    return stride_pair, padding_pair, dilation_pair, groups


def check_input(input: Tensor, weight: Tensor, groups: int, sorting: str = "") -> None:
    """Raises an error naming what is wrong with ``input`` for ``weight`` and what is accepted: unless it is 3-D
    (unbatched) or 4-D (batched) with pixels (only its batch may be empty), as ``F.conv2d`` wants it
    (``RuntimeError``), with floating-point tensors (:class:`DtypeError` where their dtypes differ, as
    ``F.conv2d`` refuses them, else ``TypeError``), with the channels the weight expects with ``groups``
    (:class:`ShapeError`; with ``sorting="align"`` also one guide channel more per group,
    :func:`guide_channels`). The layers' forward calls it first (TorchScript compiles it), so that the centring
    of a strided grid (:mod:`timm_sortconv.grid`) sees an input it can centre, and an integer input is refused
    before it is read half a pixel on, which would make it float."""
    if input.dim() != 3 and input.dim() != 4:
        raise RuntimeError(f"sort_conv2d expects a 3-D (C, H, W) or 4-D (N, C, H, W) input, got a {input.dim()}-D "
                           f"input of shape {list(input.shape)}")
    # (a traced size is a tensor, an exported one may be symbolic; the example being traced or exported has pixels
    # and the channels the weight expects, and the operator checks the channels of every call)
    tracing = torch.jit.is_tracing()
    if not torch.jit.is_scripting():  # (TorchScript compiles no torch.compiler)
        tracing = tracing or torch.compiler.is_exporting()
    if not tracing and (input.shape[-1] == 0 or input.shape[-2] == 0):
        raise RuntimeError(_no_pixels(input))
    if not input.is_floating_point() or not weight.is_floating_point():
        dtypes = f"input {input.dtype}, weight {weight.dtype}"
        if input.dtype != weight.dtype:
            raise DtypeError(_not_floating(dtypes))
        raise TypeError(_not_floating(dtypes))
    if not tracing and not _channels_fit(input.shape[-3], weight, groups, sorting):
        raise ShapeError(_channels_message(input, weight, groups, sorting))


def _no_pixels(input: Tensor) -> str:
    return f"sort_conv2d: the input of shape {list(input.shape)} has no pixels; only its batch may be empty"


def check_tensors(input: Tensor, weight: Tensor, bias: Optional[Tensor], groups: int, sorting: str = "") -> None:
    """Raises an error naming what is wrong with the tensors of a call and what is accepted: floating-point
    tensors of one dtype on one device, an input (4-D: :func:`check_input` ran at the entry) whose channels
    the weight expects, a bias per output channel. Tensors that are not all floating-point are a
    :class:`DtypeError` where their dtypes differ (``F.conv2d`` refuses them), else a ``TypeError`` (an integer
    input with integer weights, which ``F.conv2d`` convolves and sorting does not)."""
    tensors = {"input": input, "weight": weight, "bias": bias}
    tensors = {name: t for name, t in tensors.items() if t is not None}
    dtypes = ", ".join(f"{name} {t.dtype}" for name, t in tensors.items())
    if not all(t.is_floating_point() for t in tensors.values()):
        raise (DtypeError if len({t.dtype for t in tensors.values()}) > 1 else TypeError)(_not_floating(dtypes))
    if len({t.device for t in tensors.values()}) > 1:
        raise RuntimeError("sort_conv2d needs its tensors on one device, got "
                           + ", ".join(f"{name} on {t.device}" for name, t in tensors.items()))
    if len({t.dtype for t in tensors.values()}) > 1:
        raise RuntimeError("sort_conv2d needs its tensors in one dtype (outside autocast, as F.conv2d), got " + dtypes)
    if not _channels_fit(input.shape[-3], weight, groups, sorting):
        raise ShapeError(_channels_message(input, weight, groups, sorting))
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ShapeError(f"sort_conv2d: bias of shape {tuple(bias.shape)} does not match {weight.shape[0]} "
                         "output channels")


def check_shapes(input: Tensor, weight: Tensor, bias: Optional[Tensor], groups: int, padding: Sequence[int],
                 dilation: Sequence[int], sorting: str = "") -> None:
    """The checks of :func:`check_input`, :func:`check_tensors` and :func:`check_size` that depend on sizes: the
    input's channels and pixels, the bias's shape and the padded input's size (the dtypes and devices are checked
    once per kind of call). An input that is not 4-D is refused here too."""
    if input.dim() != 4 or input.shape[1] != weight.shape[1] * groups or input.shape[2] == 0 or input.shape[3] == 0:
        if input.dim() != 4:
            raise RuntimeError(f"sort_conv2d expects a 4-D (N, C, H, W) input, got shape {list(input.shape)}")
        if input.shape[2] == 0 or input.shape[3] == 0:
            raise RuntimeError(_no_pixels(input))
        if not _channels_fit(input.shape[1], weight, groups, sorting):
            raise ShapeError(_channels_message(input, weight, groups, sorting))
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ShapeError(f"sort_conv2d: bias of shape {tuple(bias.shape)} does not match {weight.shape[0]} "
                         "output channels")
    check_size(input, weight, padding, dilation)


def check_size(input: Tensor, weight: Tensor, padding: Sequence[int], dilation: Sequence[int]) -> None:
    """Raises ``RuntimeError`` unless the input, padded (``padding`` as ``F.pad`` takes it), is at least as large
    as the dilated kernel."""
    k = weight.shape[-1]
    height, width = input.shape[2] + padding[2] + padding[3], input.shape[3] + padding[0] + padding[1]
    if height < dilation[0] * (k - 1) + 1 or width < dilation[1] * (k - 1) + 1:
        raise RuntimeError(f"sort_conv2d: padded input size ({height}, {width}) is smaller than the dilated kernel "
                           f"({dilation[0] * (k - 1) + 1}, {dilation[1] * (k - 1) + 1})")
