"""``SortConv2d`` and ``sort_conv2d`` keep the contract of ``nn.Conv2d`` and ``F.conv2d``: fuzzed side by side.

Each case is a valid random configuration (kernel, stride, padding, dilation, groups, padding mode, bias,
dtype, batched or unbatched input, sampling, sorting, stride alignment), changed in at most one place to a
value that may be wrong (a non-positive stride or dilation, negative padding, a float, a bad padding string,
groups that do not divide, mixed dtypes, an integer or bool input, the wrong channels, dimensions or size).
Integer inputs are also drawn for every kernel size the fuzz draws, each integer dtype with each. The
properties asserted:

* the Sorting Convolution accepts a case exactly when PyTorch's convolution does, and where both refuse,
  with the same exception class (or a subclass of it: tensors that do not fit together raise
  ``ShapeError`` and ``DtypeError``, ``RuntimeError`` as in PyTorch and ``ValueError`` or ``TypeError`` too)
  and a message of one line that names what was changed (the input, when nothing was);
* where both accept, the output has the same shape and dtype, and the same values wherever Sorting
  Convolution must equal the convolution: a ``1 x 1`` kernel on PyTorch's grid, and a constant input read
  without zeros (every window constant, so that sampling and sorting change nothing), for every sampling.

A layer is compared over its construction and first call together: ``nn.Conv2d`` refuses a stride of 0 only
when called, ``SortConv2d`` when built. Where PyTorch's own paths disagree, Sorting Convolution takes the
strict one, and the test asserts that instead (:func:`pytorch_quirk`):

* negative padding with a non-zero ``padding_mode``: ``nn.Conv2d`` hands it to ``F.pad`` (a crop), while it
  refuses negative zero padding; Sorting Convolution refuses negative padding with every mode;
* a bias of another dtype with ``padding="same"`` or ``"valid"``: ``F.conv2d``'s path for a padding string
  adds it unchecked, while it refuses the same call with ``padding=0``; Sorting Convolution refuses it;
* an input of the wrong dimensions with a non-zero ``padding_mode`` meets ``F.pad`` first in ``nn.Conv2d``,
  whose error is a ``NotImplementedError`` of five lines; Sorting Convolution raises the ``RuntimeError`` of
  one line that ``nn.Conv2d`` raises with zero padding;
* a bool input meets a kernel that has no bool version in ``nn.Conv2d`` where it has no bias or pads with
  ``"reflect"`` or ``"replicate"`` (a ``NotImplementedError``), and the check of its dtype elsewhere (a
  ``RuntimeError``); Sorting Convolution refuses every integer and bool input with the ``RuntimeError``.
``SortConv2d``'s own limits (square kernels, floating-point tensors) have tests of their own at the end.
"""
import collections
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Conv2dSame

from timm_sortconv import SortConv2d, SortConv2dSame, sort_conv2d
from timm_sortconv.ops import PADDING_MODES, SAMPLINGS, SORTINGS
from timm_sortconv.ops.checks import DtypeError, ShapeError

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = 300
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTEGER_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool)
KERNEL_SIZES = (1, 1, 2, 3, 3, 4, 5)  # drawn from: 1 and 3 twice as often
# Values an argument may be changed to, valid ones among them.
BAD_VALUES = {
    "stride": [0, -1, (1, 0), 1.5, True, (1, 2, 3), (), None, (2,), np.int64(2)],
    "padding": [-1, (0, -1), 1.5, (1, 2, 3), "full", "SAME", None, (1,)],
    "dilation": [0, -2, (1, 0), 2.0, (1, 1, 1), [2]],
    "groups": [0, -1, 3, True],
    "padding_mode": ["mirror", "zero"],
}
# Changes of the input (and, for the functional form, of the weight and bias).
INPUT_CHANGES = ["dtype", "integer dtype", "bias dtype", "channels", "2-D", "5-D", "no pixels", "small",
                 "empty batch"]
FUNCTIONAL_CHANGES = ["weight 3-D", "bias shape", "weight dtype"]


def random_case(rng: random.Random, layer: bool, arguments: bool = True) -> dict:
    """A valid configuration, then at most one change (of the input only, unless ``arguments``)."""
    k = rng.choice(KERNEL_SIZES)
    groups = rng.choice([1, 1, 2])
    case = dict(
        k=k, groups=groups, in_channels=groups * rng.randint(1, 2), out_channels=groups * rng.randint(1, 2),
        stride=rng.choice([1, 1, 2, (1, 2), [2, 1], 3]), dilation=rng.choice([1, 1, 2, (2, 1)]),
        padding=rng.choice([0, 1, 2, (1, 0), "valid", "same"]),
        padding_mode=rng.choice(PADDING_MODES) if layer else "zeros", bias=rng.random() < 0.7,
        dtype=rng.choice(DTYPES + DTYPES[:2]), batch=rng.choice([None, 1, 2]),
        size=(rng.randint(3, 9), rng.randint(3, 9)),
        sampling=rng.choice(SAMPLINGS), sorting=rng.choice(SORTINGS), stride_align=rng.choice(["centre", "corner"]),
        constant=rng.random() < 0.5, change=None,
    )
    if case["padding"] == "same":
        case["stride"] = 1
    if rng.random() < 0.6:
        choices = [name for name in BAD_VALUES if arguments and (layer or name != "padding_mode")] + ["input"]
        what = rng.choice(choices)
        if what == "input":
            what = rng.choice(INPUT_CHANGES + ([] if layer else FUNCTIONAL_CHANGES))
            if what in ("bias dtype", "bias shape") and not case["bias"]:
                return case
            if what == "integer dtype":
                case["integer_dtype"] = rng.choice(INTEGER_DTYPES)
        else:
            value = rng.choice(BAD_VALUES[what] + ([2] if what == "stride" else []))
            if (what in ("padding", "dilation") and isinstance(value, (tuple, list)) and len(value) != 2
                    and case["padding_mode"] != "zeros"):
                # nn.Conv2d builds F.pad's padding from these as they are: padding (p,), or dilation (d,) with
                # padding="same", pads the width alone, padding (1, 2, 3) the channels too; F.conv2d and
                # SortConv2d read (p,) as (p, p) and refuse three values
                return case
            case[what] = value
        case["change"] = what
    elif arguments and case["padding"] == "same" and rng.random() < 0.2:
        case["stride"], case["change"] = 2, "padding"  # 'same' is refused for strided convolutions
    return case


def tensors(case: dict, seed: int):
    """``(input, weight, bias)`` for a case, with its input changes applied."""
    generator = torch.Generator().manual_seed(seed)
    channels, (height, width) = case["in_channels"], case["size"]
    change = case["change"]
    if change == "channels":
        channels += 1
    if change == "no pixels":
        height = 0
    if change == "small":
        height = 1
    shape = [channels, height, width]
    if case["batch"] is not None or change in ("5-D", "empty batch"):
        shape.insert(0, 0 if change == "empty batch" else case["batch"] or 1)
    if change == "5-D":
        shape.insert(0, 1)
    if change == "2-D":
        shape = shape[-2:]
    dtype = case["dtype"]
    if case["constant"]:
        x = torch.full(shape, 0.75, dtype=torch.float64)
    else:
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
    groups = case["groups"] if isinstance(case["groups"], int) and case["groups"] > 0 else 1
    weight_shape = [case["out_channels"], case["in_channels"] // groups, case["k"], case["k"]]
    if change == "weight 3-D":
        weight_shape = weight_shape[:3]
    weight = torch.randn(weight_shape, generator=generator, dtype=torch.float64)
    bias = torch.randn(case["out_channels"] + (change == "bias shape"), generator=generator, dtype=torch.float64)
    other = other_dtype(dtype)
    input_dtype = {"dtype": other, "integer dtype": case.get("integer_dtype")}.get(change, dtype)
    return (x.to(input_dtype), weight.to(other if change == "weight dtype" else dtype),
            bias.to(other if change == "bias dtype" else dtype) if case["bias"] else None)


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float32 else torch.float64


def outcome(run):
    """``("ok", output)`` or ``("error", exception)``."""
    try:
        return "ok", run()
    except Exception as error:  # the class is compared below
        return "error", error


def values_must_agree(case: dict) -> bool:
    """Whether Sorting Convolution must equal the convolution: a 1x1 kernel on PyTorch's grid, or every window
    constant (a constant input, not read with zeros). Compared in float32 and float64."""
    if case["dtype"] not in (torch.float32, torch.float64) or case["change"] not in (None, "empty batch"):
        return False
    on_pytorch_grid = case["stride"] in (1, (1, 1)) or case["stride_align"] == "corner"
    no_zeros = case["padding"] in (0, "valid") or case["padding_mode"] != "zeros"
    return on_pytorch_grid and (case["k"] == 1 or (case["constant"] and no_zeros))


def compare(case: dict, expected, got, counts: dict, values: bool = True) -> None:
    """Asserts that ``got`` (Sorting Convolution's outcome) matches ``expected`` (PyTorch's), and counts it."""
    kind, value = got
    if pytorch_quirk(case):
        assert kind == "error" and isinstance(value, RuntimeError) and pytorch_quirk(case) in str(value), case
        counts["refused"] += 1
        return
    if expected[0] == "error":
        assert kind == "error", f"{case}: PyTorch refuses ({expected[1]!r}), Sorting Convolution accepts"
        unimplemented = isinstance(expected[1], NotImplementedError) and case["change"] in ("2-D", "5-D",
                                                                                              "integer dtype")
        expected_class = RuntimeError if unimplemented else type(expected[1])
        assert type(value) is expected_class or (type(value) in (ShapeError, DtypeError)
                                                 and isinstance(value, expected_class)), \
            f"{case}: {value!r} where PyTorch raises {expected[1]!r}"
        message = str(value)
        assert message and "\n" not in message, f"{case}: {message!r}"
        change = case["change"] or "input"
        named = {change, "input", "weight" if change.startswith("weight") else "bias" if "bias" in change else change}
        # or PyTorch's own words, where the same call of F.pad refuses it in both
        assert any(name in message for name in named) or message == str(expected[1]), \
            f"{case}: {message!r} names none of {named}"
        counts["refused"] += 1
        return
    assert kind == "ok", f"{case}: PyTorch accepts, Sorting Convolution raises {value!r}"
    out = expected[1]
    assert value.shape == out.shape and value.dtype == out.dtype, case
    counts["accepted"] += 1
    if values and values_must_agree(case):
        tol = 1e-10 if case["dtype"] == torch.float64 else 1e-4
        torch.testing.assert_close(value, out, rtol=tol, atol=tol, msg=lambda m: f"{case}: {m}")
        counts["equal values"] += 1


def assert_not_vacuous(counts: dict, cases: int) -> None:
    """A fuzz whose cases all fall on one side would assert little."""
    assert counts["accepted"] > cases // 4 and counts["refused"] > cases // 4, counts
    assert counts["equal values"] > cases // 20, counts


def pytorch_quirk(case: dict) -> str:
    """For a case where Sorting Convolution refuses what one of PyTorch's paths accepts (the module docstring),
    what its error says; else an empty string."""
    if negative(case["padding"]) and case["padding_mode"] != "zeros":
        return "negative padding"
    if case["change"] == "bias dtype" and isinstance(case["padding"], str):
        return "one dtype"
    return ""


def centring_outgrows_input(case: dict, x: torch.Tensor) -> bool:
    """Whether ``stride_align="centre"`` would leave too little input: the centring of a strided grid
    (:func:`timm_sortconv.grid.centre_grid`) crops ``(N + 2p - K) mod s`` pixels off an input side of ``N`` before
    the padding ``p``, and a crop as long as the input, or one that leaves less than a reflect/circular padding
    needs, is not made: such an input of a few pixels is taken on PyTorch's grid, as ``nn.Conv2d`` takes it."""
    if case["stride_align"] != "centre" or x.dim() not in (3, 4) or case["change"] in BAD_VALUES:
        return False
    stride, padding, dilation = (pair(case[name]) for name in ("stride", "padding", "dilation"))
    for axis in range(2):
        size = x.shape[x.dim() - 2 + axis]
        span = size + 2 * padding[axis] - dilation[axis] * (case["k"] - 1) - 1
        if stride[axis] == 1 or span < 0:
            continue
        left = size - span % stride[axis]
        if left <= 0 or {"reflect": padding[axis] >= left, "circular": padding[axis] > left}.get(
                case["padding_mode"], False):
            return True
    return False


def pair(value):
    if value in ("same", "valid"):
        return (0, 0)  # "same": unit strides only, nothing to centre
    return tuple(value) * (3 - len(value)) if isinstance(value, (tuple, list)) else (value, value)


def layer_args(case):
    return dict(in_channels=case["in_channels"], out_channels=case["out_channels"], kernel_size=case["k"],
                stride=case["stride"], padding=case["padding"], dilation=case["dilation"], groups=case["groups"],
                bias=case["bias"], padding_mode=case["padding_mode"])


def negative(padding) -> bool:
    values = padding if isinstance(padding, (tuple, list)) else [padding]
    return any(isinstance(v, int) and v < 0 for v in values)


def test_sort_conv2d_layer_accepts_and_refuses_what_nn_conv2d_does():
    rng = random.Random(0)
    counts = collections.Counter()
    for index in range(CASES):
        case = random_case(rng, layer=True)
        x, _, _ = tensors(case, index)
        dtype = case["dtype"]
        conv = outcome(lambda: nn.Conv2d(**layer_args(case), dtype=dtype))
        layer = outcome(lambda: SortConv2d(**layer_args(case), dtype=dtype, sampling=case["sampling"],
                                           sorting=case["sorting"], stride_align=case["stride_align"]))
        if conv[0] == "ok" and layer[0] == "ok":
            layer[1].load_state_dict(conv[1].state_dict())
            if case["change"] == "bias dtype" and case["bias"]:  # parameters of two dtypes
                for module in (conv[1], layer[1]):
                    module.bias.data = module.bias.data.to(other_dtype(dtype))
        got = layer if layer[0] == "error" else outcome(lambda: layer[1](x))
        expected = conv if conv[0] == "error" else outcome(lambda: conv[1](x))
        if centring_outgrows_input(case, x):
            counts["centring outgrows the input"] += 1  # taken on PyTorch's grid (centre_grid's min_size)
        compare(case, expected, got, counts)
    assert_not_vacuous(counts, CASES)


def test_sort_conv2d_functional_accepts_and_refuses_what_f_conv2d_does():
    rng = random.Random(1)
    counts = collections.Counter()
    for index in range(CASES):
        case = random_case(rng, layer=False)
        x, weight, bias = tensors(case, index)
        args = dict(stride=case["stride"], padding=case["padding"], dilation=case["dilation"], groups=case["groups"])
        expected = outcome(lambda: F.conv2d(x, weight, bias, **args))
        got = outcome(lambda: sort_conv2d(x, weight, bias, **args, sampling=case["sampling"],
                                          sorting=case["sorting"]))
        compare(dict(case, stride_align="corner"), expected, got, counts)
    assert_not_vacuous(counts, CASES)


def test_sort_conv2d_same_accepts_and_refuses_what_timm_conv2d_same_does():
    """``SortConv2dSame`` against timm's ``Conv2dSame`` (which pads per call, so it takes no padding)."""
    rng = random.Random(2)
    counts = collections.Counter()
    for index in range(CASES // 3):
        # the arguments are SortConv2d's, compared above (and Conv2dSame divides by a stride of 0)
        case = random_case(rng, layer=True, arguments=False)
        case.update(padding=0, padding_mode="zeros", stride=rng.choice([1, 2, 3]))
        args = {name: value for name, value in layer_args(case).items() if name not in ("padding", "padding_mode")}
        x, _, _ = tensors(case, index)
        conv = Conv2dSame(**args, dtype=case["dtype"])
        layer = SortConv2dSame(**args, dtype=case["dtype"], sampling=case["sampling"], sorting=case["sorting"],
                               stride_align=case["stride_align"])
        layer.load_state_dict(conv.state_dict())
        # the values only for a 1x1 kernel at stride 1: elsewhere the padding is zeros
        compare(case, outcome(lambda: conv(x)), outcome(lambda: layer(x)), counts,
                values=case["k"] == 1 and case["stride"] == 1)
    assert counts["accepted"] > CASES // 12 and counts["refused"] > CASES // 12, counts


@pytest.mark.parametrize("k", sorted(set(KERNEL_SIZES)))
def test_integer_inputs_are_refused_as_by_nn_conv2d_with_every_kernel_size(k):
    """Every integer dtype with every kernel size the fuzz draws, on random arguments: ``nn.Conv2d`` and
    ``F.conv2d`` (floating-point weights) refuse the input, and so do ``SortConv2d`` and ``sort_conv2d``,
    before the input is padded or centred (where reading it half a pixel on would make it float)."""
    rng = random.Random(k)
    counts = collections.Counter()
    for index, dtype in enumerate(INTEGER_DTYPES * 3):
        case = dict(random_case(rng, layer=True, arguments=False), k=k, change="integer dtype", integer_dtype=dtype)
        x, weight, bias = tensors(case, index)
        conv = nn.Conv2d(**layer_args(case), dtype=case["dtype"])
        layer = SortConv2d(**layer_args(case), dtype=case["dtype"], sampling=case["sampling"],
                           sorting=case["sorting"], stride_align=case["stride_align"])
        layer.load_state_dict(conv.state_dict())
        refusals = [outcome(lambda: layer(x))]
        compare(case, outcome(lambda: conv(x)), refusals[0], counts)
        args = dict(stride=case["stride"], padding=case["padding"], dilation=case["dilation"], groups=case["groups"])
        refusals.append(outcome(lambda: sort_conv2d(x, weight, bias, **args, sampling=case["sampling"],
                                                    sorting=case["sorting"])))
        compare(dict(case, stride_align="corner"), outcome(lambda: F.conv2d(x, weight, bias, **args)), refusals[1],
                counts)
        for _, error in refusals:
            assert isinstance(error, DtypeError) and f"not accepted; got input {dtype}" in str(error), (case, error)
    assert counts == {"refused": 2 * 3 * len(INTEGER_DTYPES)}, counts


def test_mixed_dtypes_are_cast_by_autocast():
    """Inside autocast a float16 input meets float32 weights as in ``nn.Conv2d``: cast, computed, returned in the
    autocast dtype."""
    conv = nn.Conv2d(3, 4, 3, padding=1)
    layer = SortConv2d.from_conv(conv, sampling="square")
    x = torch.randn(1, 3, 6, 6).half()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = layer(x), conv(x)
    assert out.dtype == expected.dtype == torch.bfloat16 and out.shape == expected.shape
    with pytest.raises(RuntimeError, match=r"one dtype \(outside autocast.*input torch.float16, weight torch.float32"):
        layer(x)


def test_meta_tensors_give_the_convolution_shape():
    x, weight = torch.empty(2, 4, 9, 7, device="meta"), torch.empty(6, 2, 3, 3, device="meta")
    out = sort_conv2d(x, weight, stride=2, padding=1, groups=2)
    assert out.device.type == "meta" and out.shape == F.conv2d(x, weight, stride=2, padding=1, groups=2).shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_tensors_on_two_devices_are_refused_as_by_f_conv2d():
    x, weight = torch.randn(1, 2, 6, 6, device="cuda"), torch.randn(2, 2, 3, 3)
    with pytest.raises(RuntimeError):
        F.conv2d(x, weight)
    with pytest.raises(RuntimeError, match="one device.*input on cuda:0, weight on cpu"):
        sort_conv2d(x, weight)
    torch.testing.assert_close(sort_conv2d(x, weight.cuda(), sampling="square", sorting="global").cpu(),
                               sort_conv2d(x.cpu(), weight, sampling="square", sorting="global"))


# ---------------------------------------------------------------------------------------------------------
# Sorting Convolution's own limits, where it refuses what nn.Conv2d accepts
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel_size", [(3, 5), (3,), (3, 3, 3)])
def test_a_kernel_that_is_not_square_is_refused(kernel_size):
    with pytest.raises(ValueError, match=r"square kernel.*one int k >= 1 or a pair \(k, k\)"):
        SortConv2d(2, 2, kernel_size)
    if len(kernel_size) == 2:
        with pytest.raises(ValueError, match=r"square kernel.*kernel_size=\(3, 5\)"):
            sort_conv2d(torch.randn(1, 2, 8, 8), torch.randn(2, 2, *kernel_size))


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64])
def test_tensors_that_are_not_floating_point_are_refused(dtype):
    x, weight = torch.ones(1, 2, 6, 6, dtype=dtype), torch.ones(2, 2, 3, 3, dtype=dtype)
    assert F.conv2d(x, weight).dtype == dtype  # F.conv2d computes it; sorting complex numbers has no meaning
    with pytest.raises(TypeError, match=rf"floating-point.*input {dtype}, weight {dtype}"):
        sort_conv2d(x, weight)
    with pytest.raises(TypeError, match=r"torch.Tensor input, got list"):
        sort_conv2d([[0.0]], torch.zeros(2, 2, 3, 3))
