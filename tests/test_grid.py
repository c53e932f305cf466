"""Centred strided grids (timm_sortconv.grid): the output size of the layer is kept, and a quarter turn of the
input turns the output at every input size, for convolutions and pooling of any kernel, stride, padding and
dilation; where the grid is centred already nothing changes."""
import itertools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import REPO, load_script
from timm_sortconv import SortConv2d
from timm_sortconv.grid import (CentredAvgPool2d, CentredConv2d, CentredMaxPool2d, centre_grid, centre_grid_same,
                                check_stride_align, min_input_size, plain_conv_layer, pool_class)

pytestmark = pytest.mark.usefixtures("one_thread")


def turned(x, k=1):
    return torch.rot90(x, k, (-2, -1))


def assert_equivariant(layer, x):
    """For a layer whose weights a quarter turn leaves unchanged (pooling; a convolution is given such weights)."""
    with torch.no_grad():
        torch.testing.assert_close(layer(turned(x)), turned(layer(x)), rtol=1e-12, atol=1e-12)


CONV_CASES = list(itertools.product((1, 2, 3, 4), (2, 3, 4), (0, 1, 2), (1, 2)))  # kernel, stride, padding, dilation


@pytest.mark.slow
@pytest.mark.parametrize("kernel, stride, padding, dilation", CONV_CASES)
def test_centred_convolution_keeps_the_size_and_turns_with_the_input(kernel, stride, padding, dilation):
    torch.manual_seed(0)
    plain = nn.Conv2d(2, 3, kernel, stride, padding, dilation).double()
    with torch.no_grad():  # a filter a quarter turn leaves as it is: the sum of its four turns
        plain.weight.copy_(sum(turned(plain.weight, k) for k in range(4)))
    centred = CentredConv2d.from_conv(plain)
    for size in range(max(9, dilation * (kernel - 1) + 1), 18):
        x = torch.randn(1, 2, size, size, dtype=torch.float64)
        assert centred(x).shape == plain(x).shape
        assert_equivariant(centred, x)
        span = size + 2 * padding - dilation * (kernel - 1) - 1
        if span % stride == 0:  # centred already: the very same computation
            assert torch.equal(centred(x), plain(x))


@pytest.mark.parametrize("pool, kwargs", [
    (nn.MaxPool2d, dict(kernel_size=2)), (nn.MaxPool2d, dict(kernel_size=3, stride=2, padding=1)),
    (nn.MaxPool2d, dict(kernel_size=3, stride=2, dilation=2)), (nn.AvgPool2d, dict(kernel_size=2)),
    (nn.AvgPool2d, dict(kernel_size=3, stride=3, padding=1))])
def test_centred_pooling_keeps_the_size_and_turns_with_the_input(pool, kwargs):
    plain = pool(**kwargs)
    centred = (CentredMaxPool2d if pool is nn.MaxPool2d else CentredAvgPool2d).from_pool(plain)
    for size in range(9, 17):
        x = torch.randn(2, 3, size, size, dtype=torch.float64)
        assert centred(x).shape == plain(x).shape
        assert_equivariant(centred, x)


def test_oblong_inputs_turn_too():
    conv = CentredConv2d(1, 1, 3, stride=2, padding=1).double()
    with torch.no_grad():
        conv.weight.copy_(sum(turned(conv.weight, k) for k in range(4)))
    x = torch.randn(1, 1, 10, 13, dtype=torch.float64)
    assert_equivariant(conv, x)
    assert conv(x).shape == F.conv2d(x, conv.weight, conv.bias, 2, 1).shape


def test_half_a_pixel_is_the_mean_of_neighbours_and_crops_are_symmetric():
    x = torch.arange(36.0).view(1, 1, 6, 6)
    # k=1, stride 2 on 6: span 5, excess 1: read half a pixel on, windows at 0.5, 2.5, 4.5
    out = centre_grid(x, [1, 1], [2, 2], [0, 0], [1, 1])
    assert torch.equal(out, (x[..., :-1, :-1] + x[..., 1:, :-1] + x[..., :-1, 1:] + x[..., 1:, 1:]) / 4)
    # k=1, stride 3 on 6: span 5, excess 2: one pixel cropped off each side, no blur
    assert torch.equal(centre_grid(x, [1, 1], [3, 3], [0, 0], [1, 1]), x[..., 1:-1, 1:-1])
    # centred already, or unit stride: unchanged (the same tensor)
    assert centre_grid(x, [2, 2], [2, 2], [0, 0], [1, 1]) is x and centre_grid(x, [3, 3], [1, 1], [1, 1], [1, 1]) is x


@pytest.mark.parametrize("kernel, stride", [(1, 2), (2, 1), (3, 2), (4, 2), (3, 3), (5, 2)])
def test_same_padding_gives_tensorflow_sizes_and_turns_with_the_input(kernel, stride):
    """Turning the input and the filter turns the output: the padded grid is symmetric."""
    weight = torch.randn(2, 1, kernel, kernel, dtype=torch.float64)
    for size in range(7, 14):
        x = torch.randn(1, 1, size, size, dtype=torch.float64)
        out = F.conv2d(centre_grid_same(x, [kernel, kernel], [stride, stride], [1, 1]), weight, stride=stride)
        assert out.shape[-1] == -(-size // stride)
        again = F.conv2d(centre_grid_same(turned(x), [kernel, kernel], [stride, stride], [1, 1]), turned(weight),
                         stride=stride)
        torch.testing.assert_close(again, turned(out), rtol=1e-12, atol=1e-12)


def test_classes_and_errors():
    assert plain_conv_layer("corner") is nn.Conv2d
    make = plain_conv_layer("centre")
    for args, kwargs, expected in [((2, 4, 3), {}, nn.Conv2d), ((2, 4, 3, 1, 1), {}, nn.Conv2d),
                                   ((2, 4, 3), dict(stride=(1, 1)), nn.Conv2d), ((2, 4, 3, 2), {}, CentredConv2d),
                                   ((2, 4, 1), dict(stride=(1, 2)), CentredConv2d)]:
        conv = make(*args, **kwargs)
        assert type(conv) is expected and (conv.in_channels, conv.out_channels) == (2, 4), (args, kwargs)
    assert pool_class("max", "centre") is CentredMaxPool2d and pool_class("avg", "corner") is nn.AvgPool2d
    assert check_stride_align("corner") == "corner"
    with pytest.raises(ValueError, match="stride_align='left' is not accepted; use 'centre'"):
        check_stride_align("left")
    with pytest.raises(ValueError, match="pooling kind='min' is not accepted"):
        pool_class("min", "centre")
    with pytest.raises(ValueError, match="ceil_mode=False"):
        CentredMaxPool2d(2, ceil_mode=True)
    conv = nn.Conv2d(2, 4, 3, stride=2, bias=False).eval().requires_grad_(False)
    copy = CentredConv2d.from_conv(conv)
    assert torch.equal(copy.weight, conv.weight) and copy.bias is None and not copy.training
    assert not copy.weight.requires_grad and list(copy.state_dict()) == list(conv.state_dict())


def test_from_conv_reads_a_parametrised_weight():
    conv = nn.utils.parametrizations.weight_norm(nn.Conv2d(2, 4, 1, stride=2))
    copy = CentredConv2d.from_conv(conv)
    assert torch.equal(copy.weight, conv.weight) and torch.equal(copy.bias, conv.bias)


def test_a_cropped_channels_last_input_keeps_its_layout():
    """A 4x4 stride-4 window on a side of 10 crops the input (a strided view); the sorting convolution still
    returns channels_last, as nn.Conv2d does, and the same values as for the contiguous input."""
    from timm_sortconv import SortConv2d

    conv = SortConv2d(3, 4, 4, stride=4)
    x = torch.randn(2, 3, 10, 10).contiguous(memory_format=torch.channels_last).requires_grad_()
    out = conv(x)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    torch.testing.assert_close(out, conv(x.detach().contiguous()))
    out.sum().backward()
    assert x.grad.is_contiguous(memory_format=torch.channels_last)


def test_centred_layers_script():
    for layer in (CentredConv2d(2, 2, 3, stride=2, padding=1), CentredMaxPool2d(2), CentredAvgPool2d(3, 2, 1)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice
            scripted = torch.jit.script(layer)
        for size in (9, 10):
            x = torch.randn(1, 2, size, size)
            torch.testing.assert_close(scripted(x), layer(x))


def test_benchmark_script_runs_and_checks_its_input(capsys):
    bench = load_script(REPO / "scripts" / "bench_stride_align.py", "bench_stride_align")
    bench.main(["--model", "scnn_p_rs_3", "--size", "30", "-b", "2", "--steps", "1", "--rounds", "1", "--warmup", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("scnn_p_rs_3, 2x30x30") and lines[3].startswith("| train |")
    assert lines[4].startswith("| infer |") and len(lines) == 5
    with pytest.raises(SystemExit):
        bench.parse_args(["--size", "4"])


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "circular", "replicate"])
def test_inputs_shorter_than_the_centring_crop_are_taken_on_pytorchs_grid(padding_mode):
    """Where the crop that centres the grid would leave less input than there is (or than a reflect or circular
    padding needs), that side is not centred: the layer takes the input as nn.Conv2d does, with its values."""
    torch.manual_seed(0)
    kept = 0
    for size, padding in ((1, 1), (3, 2), (2, 1), (3, 1)):
        if padding_mode == "reflect" and padding >= size:
            continue  # nn.Conv2d refuses it too (F.pad)
        conv = nn.Conv2d(2, 3, 1, stride=4, padding=padding, padding_mode=padding_mode)
        centred, layer = CentredConv2d.from_conv(conv), SortConv2d.from_conv(conv, sampling="square")
        x = torch.randn(1, 2, size, 9)
        assert centred(x).shape == layer(x).shape == conv(x).shape
        # The other side needs no crop ((W + 2p - 1) % 4 == 0), so where the short side is kept as it is, the
        # output is nn.Conv2d's.
        wide = torch.randn(1, 2, size, 9 - 2 * padding)
        excess = (size + 2 * padding - 1) % 4
        if size - excess < min_input_size(padding_mode, [padding] * 4):
            torch.testing.assert_close(centred(wide), conv(wide))
            kept += 1
    assert kept


def test_half_pixel_reads_off_the_cpu_by_one_pooling_that_equals_the_cpu_sums():
    """Off the CPU the half-pixel read is one average pooling (one kernel to launch); it equals the CPU's two
    sums per axis up to rounding, for rows, columns and both, and gives the same shape (meta tensors: a GPU's)."""
    from timm_sortconv.grid import _half_pixel

    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    for rows, columns in ((True, False), (False, True), (True, True)):
        pooled = torch.nn.functional.avg_pool2d(x, [2 if rows else 1, 2 if columns else 1], stride=1)
        torch.testing.assert_close(_half_pixel(x, rows, columns), pooled, rtol=0, atol=1e-15)
        assert _half_pixel(x.to("meta"), rows, columns).shape == pooled.shape
    assert _half_pixel(x, False, False) is x
