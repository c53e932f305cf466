"""The fused CPU kernel of the aligned variants (``sorting="align"``, ``"align-channel"``; csrc/align_conv_kernel.h)
against the specification, the reference path (``aligned_samples``: each ring's FFT, the turn, the inverse FFT).

The forward values and the input, weight and bias gradients (the input's through each window's orientation) must
agree with ``backend="reference"``: tightly in float64, to float32 rounding in float32, for every kernel size the
models use and an even one, both samplings, strides, dilations, groups (dense, grouped, depthwise) and padding
modes (zeros added inside the kernel, the others by ``F.pad`` first), an empty batch and a channels_last input.
``backend="auto"`` must take the kernel for aligned CPU calls, while ``backend="harmonic"`` keeps working; backward
keeps only the input and the weight; windows with no orientation keep the gradient finite in float32 too.
"""
import pytest
import torch

from test_alignment import oracle
# the extension (built, or the module skipped), the isa and threads fixtures, the tolerances and helpers
from test_cpu_backend import TOLERANCE, extension, forward_and_gradients, isa, randn, threads  # noqa: F401
from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv.ops import cpu_backend
from timm_sortconv.ops.checks import ShapeError
from timm_sortconv.ops.backends import resolve_backend
from timm_sortconv.ops.geometry import get_geometry

ALIGNED = ["align", "align-channel"]
# (stride, dilation, groups, padding_mode) on 4 input channels: dense, grouped and depthwise (groups = 4).
CONFIGS = [
    (1, 1, 1, "zeros"),
    (2, 1, 2, "zeros"),
    (1, 2, 4, "zeros"),
    (2, 2, 1, "reflect"),
    (1, 1, 2, "circular"),
]


def assert_agree(x, weight, bias, **kwargs):
    fast = forward_and_gradients("cpu", x, weight, bias, **kwargs)
    reference = forward_and_gradients("reference", x, weight, bias, **kwargs)
    for name, a, b in zip(("output", "grad input", "grad weight", "grad bias"), fast, reference):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, **TOLERANCE[x.dtype], msg=lambda m: f"{name} ({kwargs}): {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("k", [1, 3, 4, 5, 7])
@pytest.mark.parametrize("sampling", ["polar", "square"])
@pytest.mark.parametrize("sorting", ALIGNED)
def test_agrees_with_reference(sorting, sampling, k, dtype, threads, isa):
    threads(1)
    for index, (stride, dilation, groups, padding_mode) in enumerate(CONFIGS):
        # 9 x 21: rows shorter and longer than a block of lanes, partial blocks, blocks across rows and images
        x = randn(2, 4, 9, 21, seed=index, dtype=dtype)
        weight = randn(8, 4 // groups, k, k, seed=10 + index, dtype=dtype)
        bias = randn(8, seed=20 + index, dtype=dtype)
        padding = min(k // 2 * dilation, 8)  # reflect needs padding < size
        assert_agree(x, weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups,
                     padding_mode=padding_mode, sampling=sampling, sorting=sorting)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("sorting", ALIGNED)
def test_polar_samples_read_from_the_runs_agree_for_every_row_width(sorting, count, threads, isa):
    """The ring spectra of k = 3 take their samples straight from the input's runs where a block's runs take two
    vectors or fewer, else from the staged window: rows of 8, 16, 32 and in between, on one thread and on two (two
    images of 5 x 8, 64 -> 64 channels: the first thread's range ends in a block of two rows of 8)."""
    threads(count)
    for index, width in enumerate((8, 16, 32, 12, 17, 33)):
        channels = 64 if width == 8 else 4
        x = randn(2, channels, 5, width, seed=index, dtype=torch.float32)
        weight = randn(channels, channels, 3, 3, seed=10 + index, dtype=torch.float32) * 0.1
        assert_agree(x, weight, randn(channels, seed=20, dtype=torch.float32), padding=1, sampling="polar",
                     sorting=sorting)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("k", [3, 7])
def test_wide_layers_agree_with_reference(k, dtype, threads, isa):
    """The weight goes to the harmonic basis (and its gradient back) in runs of a block's lanes of outputs, moved
    between outputs and window positions in squares of a vector a side. 52, 44 and 39 outputs leave a last run longer
    than a vector but shorter than a block on each vector width (AVX-512, AVX2 and 16 bytes, float32 and float64); 2
    groups of 16 outputs read each group's rows of the weight; with full runs, full squares and the edges."""
    threads(1)
    for index, (out_channels, groups) in enumerate([(52, 1), (44, 1), (39, 1), (32, 2)]):
        x = randn(2, 3 * groups, 6, 7, seed=index, dtype=dtype)
        weight = randn(out_channels, 3, k, k, seed=10 + index, dtype=dtype)
        bias = randn(out_channels, seed=20 + index, dtype=dtype)
        assert_agree(x, weight, bias, padding=k // 2, groups=groups, sampling="polar", sorting="align")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("sorting", ALIGNED)
def test_agrees_with_reference_when_threads_split_the_outputs(sorting, dtype, threads, isa):
    """One 7x7 image (49 positions: fewer blocks than two threads) with work for both: the threads take parts of
    each group's outputs, each part turning the same windows; 100 outputs (9 register tiles of uneven rows) and 2
    groups of 50, the parts ending inside the harmonic weight's rows and the bias."""
    threads(2)
    for index, groups in enumerate((1, 2)):
        x = randn(1, 64, 7, 7, seed=index, dtype=dtype)
        weight = randn(100, 64 // groups, 7, 7, seed=10 + index, dtype=dtype) * 0.05
        bias = randn(100, seed=20 + index, dtype=dtype)
        assert_agree(x, weight, bias, padding=3, groups=groups, sampling="polar", sorting=sorting)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("sampling", ["polar", "square"])
@pytest.mark.parametrize("sorting", ALIGNED)
def test_agrees_with_reference_where_a_block_lies_in_its_first_vector(sorting, sampling, count, threads, isa):
    """One 14x14 image (196 positions: six whole blocks and one of 4) on one thread and on two (ranges of 96 and
    100 positions: the second ends in a block of 4): such a block's spectra, orientation, turn and products are taken
    in the first vector of lanes only, and its products with the outputs on the lanes (gemm_positions); the same at
    3x3 (9 positions, the only block) and 7x7 (a block of 32 and one of 17: a whole vector and one position more; on
    two threads each takes part of the 70 outputs, more than one vector of outputs at a time holds)."""
    threads(count)
    for size, outputs in ((14, 40), (3, 40), (7, 70)):
        x = randn(1, 24, size, size, seed=size, dtype=torch.float32)
        weight = randn(outputs, 24, 7, 7, seed=1, dtype=torch.float32) * 0.05
        assert_agree(x, weight, randn(outputs, seed=2, dtype=torch.float32), padding=3, sampling=sampling,
                     sorting=sorting)


@pytest.mark.parametrize("sorting", ALIGNED)
@pytest.mark.parametrize("sampling", ["polar", "square"])
def test_forward_and_both_gradients_agree_with_the_oracle(sampling, sorting):
    """test_alignment's oracle, which shares no code with the package."""
    x, weight, bias = (t.requires_grad_() for t in (randn(2, 2, 7, 7), randn(3, 2, 5, 5, seed=1), randn(3, seed=2)))
    expected = oracle(x, weight, bias, 5, sampling, sorting)
    grad = randn(*expected.shape, seed=3)
    got = sort_conv2d(x, weight, bias, sampling=sampling, sorting=sorting, backend="cpu")
    torch.testing.assert_close(got, expected)
    for g, w in zip(torch.autograd.grad(got, (x, weight, bias), grad), torch.autograd.grad(expected, (x, weight, bias),
                                                                                          grad)):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("sorting", ALIGNED)
def test_a_quarter_turn_of_the_input_turns_the_output(sorting):
    layer = SortConv2d(3, 4, 7, padding=3, sorting=sorting, backend="cpu").double()
    x = randn(2, 3, 11, 11)
    for turns in (1, 2, 3):
        torch.testing.assert_close(layer(torch.rot90(x, turns, (2, 3))), torch.rot90(layer(x), turns, (2, 3)))


@pytest.mark.parametrize("sorting", ALIGNED)
def test_agrees_with_reference_on_an_empty_batch_and_a_channels_last_input(sorting, threads):
    threads(1)
    x, weight, bias = randn(0, 4, 9, 9), randn(6, 4, 5, 5, seed=1), randn(6, seed=2)
    assert_agree(x, weight, bias, padding=2, sorting=sorting)
    x = randn(2, 4, 9, 11).contiguous(memory_format=torch.channels_last)
    assert_agree(x, weight, bias, padding=2, sorting=sorting)
    out = sort_conv2d(x, weight, bias, padding=2, sorting=sorting, backend="cpu")
    assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("batch", [1, 3])
def test_agrees_with_reference_on_two_threads(batch, threads):
    """Two threads: with fewer images than threads they share blocks and keep private input gradients (and the
    backend pads the input first); otherwise each owns whole images. Large enough to be split."""
    threads(2)
    for sorting in ALIGNED:
        x, weight, bias = randn(batch, 8, 20, 24), randn(16, 8, 5, 5, seed=1), randn(16, seed=2)
        assert_agree(x, weight, bias, padding=2, sorting=sorting)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_windows_with_no_orientation_keep_the_output_and_the_gradient_finite(dtype, threads):
    """Zero windows (c = 0 and E = 0: the gate is 0 / TINY), flat ones and ones symmetric under a half turn (no
    odd harmonic: c = 0 up to rounding) give finite outputs and gradients. In float64 they equal the reference's;
    in float32 the input gradient of a flat nonzero window is not compared: there c and E are rounding noise of
    the sampling and the DFT (|c|^2 about 1e-14 of the window's square, far above TINY), so the gate is not small
    and the orientation, and its gradient, follow the noise, which two implementations round differently."""
    threads(1)
    weight, bias = randn(4, 2, 5, 5, seed=1, dtype=dtype), randn(4, seed=2, dtype=dtype)
    zero, flat = torch.zeros(1, 2, 9, 9, dtype=dtype), torch.full((1, 2, 9, 9), 0.3, dtype=dtype)
    symmetric = randn(1, 2, 9, 9, seed=3, dtype=dtype)
    symmetric = symmetric + torch.rot90(symmetric, 2, (2, 3))
    for sorting in ALIGNED:
        for x in (zero, flat, symmetric):
            got = forward_and_gradients("cpu", x, weight, bias, sorting=sorting)
            assert all(torch.isfinite(t).all() for t in got)
            if dtype == torch.float64 or x is zero:
                assert_agree(x, weight, bias, sorting=sorting)


def test_gradcheck(threads):
    threads(1)
    for sorting, sampling in (("align", "polar"), ("align-channel", "square")):
        x = randn(2, 4, 7, 6).requires_grad_()
        weight = randn(4, 2, 3, 3, seed=1).requires_grad_()
        bias = randn(4, seed=2).requires_grad_()

        def op(x, weight, bias):
            return sort_conv2d(x, weight, bias, stride=2, padding=1, groups=2, sampling=sampling, sorting=sorting,
                               backend="cpu")

        assert torch.autograd.gradcheck(op, (x, weight, bias))


def test_backward_saves_only_the_input_and_the_weight():
    x = torch.randn(2, 4, 12, 12, requires_grad=True)
    weight = torch.randn(8, 4, 7, 7, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = sort_conv2d(x, weight, None, padding=3, sorting="align", backend="cpu")
    assert {id(t) for t in saved} == {id(x), id(weight)}, [tuple(t.shape) for t in saved]
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None


def test_auto_takes_the_kernel_for_aligned_cpu_calls_and_harmonic_stays_available():
    x, weight = torch.randn(1, 2, 8, 8), torch.randn(2, 2, 5, 5)
    for sorting in ALIGNED:
        geometry = get_geometry(5, "polar", sorting)
        assert resolve_backend("auto", x, weight, None, geometry, (1, 1), (1, 1), 1).name == "cpu"
        assert resolve_backend("auto", x.double(), weight.double(), None, geometry, (1, 1), (1, 1), 1).name == "cpu"
        half = (x.half(), weight.half(), None, geometry, (1, 1), (1, 1), 1)
        assert resolve_backend("auto", *half).name == "harmonic"  # the kernel takes no float16
        bf16 = (x.bfloat16(), weight.bfloat16(), None, geometry, (1, 1), (1, 1), 1)
        assert resolve_backend("auto", *bf16).name == ("cpu" if cpu_backend.bf16_products() else "harmonic")
        assert resolve_backend("harmonic", x, weight, None, geometry, (1, 1), (1, 1), 1).name == "harmonic"
        torch.testing.assert_close(sort_conv2d(x, weight, padding=2, sorting=sorting, backend="auto"),
                                   sort_conv2d(x, weight, padding=2, sorting=sorting, backend="harmonic"))


def test_bfloat16_calls_are_computed_in_float32():
    if not cpu_backend.bf16_products():
        pytest.skip("the kernel takes bfloat16 calls only where the CPU multiplies bfloat16 pairs")
    tensors = [randn(2, 3, 10, 10).bfloat16(), randn(4, 3, 5, 5, seed=1).bfloat16(), randn(4, seed=2).bfloat16()]
    grad_out = randn(2, 4, 10, 10, seed=3).bfloat16()
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        x, weight, bias = (t.to(dtype).requires_grad_() for t in tensors)
        out = sort_conv2d(x, weight, bias, padding=2, sorting="align", backend="cpu")
        results.append([out, *torch.autograd.grad(out, (x, weight, bias), grad_out.to(dtype))])
    for a, b in zip(*results):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b.bfloat16(), rtol=0, atol=0)


def with_zero_guide_weight(weight, groups):
    """``weight`` with a zero weight for one more input channel after each group's."""
    out_channels, per_group, k = weight.shape[0], weight.shape[1], weight.shape[-1]
    grouped = weight.view(groups, out_channels // groups, per_group, k, k)
    return torch.cat([grouped, torch.zeros_like(grouped[:, :, :1])], 2).view(out_channels, per_group + 1, k, k)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_a_guide_channel_computes_what_a_zero_weight_does(dtype, threads, isa):
    """With sorting="align" the input may carry one guide channel after each group's (checks.guide_channels, what a
    guided layer passes): the output and every gradient (the guide's, through the orientation, included) are those
    of the same call with a zero weight for that channel, on the reference path. On 2 threads too, where fewer images
    than threads share blocks."""
    assert_guide_channel_is_a_zero_weight("cpu", dtype, threads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("backend", ["harmonic", "reference"])
def test_a_guide_channel_computes_what_a_zero_weight_does_in_standard_operators(backend, dtype, threads):
    assert_guide_channel_is_a_zero_weight(backend, dtype, threads)


def assert_guide_channel_is_a_zero_weight(backend, dtype, threads):
    for index, (k, stride, groups, batch, count) in enumerate([(7, 1, 1, 2, 1), (5, 2, 2, 2, 1), (3, 1, 2, 1, 2),
                                                               (1, 1, 1, 2, 1), (4, 1, 1, 1, 2)]):
        threads(count)
        x = randn(batch, 2 * groups + groups, 11, 14, seed=index, dtype=dtype)
        weight = randn(3 * groups, 2, k, k, seed=10 + index, dtype=dtype)
        bias = randn(3 * groups, seed=20 + index, dtype=dtype)
        kwargs = dict(stride=stride, padding=k // 2, groups=groups, sorting="align")
        got = forward_and_gradients(backend, x, weight, bias, **kwargs)
        out, grad_x, grad_weight, grad_bias = forward_and_gradients("reference", x, with_zero_guide_weight(
            weight, groups), bias, **kwargs)
        grad_weight = grad_weight.view(groups, 3, 3, k, k)[:, :, :2].reshape(weight.shape)
        assert grad_x.view(batch, groups, 3, *grad_x.shape[2:])[:, :, 2].abs().max() > 0 or k < 3
        for name, a, b in zip(("output", "grad input", "grad weight", "grad bias"), got,
                              (out, grad_x, grad_weight, grad_bias)):
            torch.testing.assert_close(a, b, **TOLERANCE[dtype], msg=lambda m: f"{name} (k {k}): {m}")


def test_a_guide_channel_is_taken_only_where_one_orientation_serves_a_group():
    """The operator refuses the extra channel for the other sortings (each channel turns by its own orientation,
    or none turns) with the channels it accepts, and an unguided aligned layer refuses it as nn.Conv2d does."""
    x, weight = randn(1, 3, 9, 9), randn(4, 2, 3, 3)
    for sorting in ("align-channel", "ring"):
        with pytest.raises(ShapeError, match="input has 3 channels .* expects 2$"):
            sort_conv2d(x, weight, sorting=sorting)
    with pytest.raises(ShapeError, match=r"expects 2 \(or 3: one guide channel after each group's"):
        sort_conv2d(randn(1, 4, 9, 9), weight, sorting="align")
    layer = SortConv2d(2, 4, 3, sorting="align").double()
    for stride in (1, 2):
        layer.stride = (stride, stride)
        with pytest.raises(ShapeError, match="input has 3 channels"):
            layer(x)


@pytest.mark.parametrize("k", [3, 4, 5, 7])
@pytest.mark.parametrize("sampling", ["polar", "square"])
def test_a_guides_orientation_from_its_samples_is_the_one_of_its_ring_spectra(sampling, k):
    """The kernel takes a guide channel's (c, E) from its samples (cpu_backend._guide_first, add_guide_orientation):
    c as sums with the tables' weights, E as each ring's variance plus its weight times the squared mean. Both must
    be what aligned_samples computes from each ring's FFT (c = sum S_1 / N, E = sum |S_m|^2 / N^2 over m != 0 plus
    LEVEL / RELATIVE * S_0^2 / N^2 over the rings, the centre left out), for every geometry the models use."""
    from timm_sortconv.ops.alignment import LEVEL, RELATIVE
    geometry = get_geometry(k, sampling, "align")
    guide = cpu_backend._align_tables_for(geometry, torch.float32).guide_first
    assert guide.shape == (3, k * k)
    samples = torch.randn(64, k * k, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) + 3.0
    rings = [(s, e) for s, e in geometry.segments if e - s > 1]
    first = sum(torch.fft.fft(samples[:, s:e])[:, 1] / (e - s) for s, e in rings)
    energy = sum((torch.fft.fft(samples[:, s:e]).abs()[:, 1:] ** 2).sum(1) / (e - s) ** 2
                 + LEVEL / RELATIVE * samples[:, s:e].sum(1) ** 2 / (e - s) ** 2 for s, e in rings)
    torch.testing.assert_close(samples @ guide[0], first.real, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(samples @ guide[1], first.imag, rtol=1e-12, atol=1e-12)
    kernel_energy = sum(samples[:, s:e].var(1, unbiased=False) + guide[2, s] * samples[:, s:e].mean(1) ** 2
                        for s, e in geometry.segments)
    torch.testing.assert_close(kernel_energy, energy, rtol=1e-12, atol=1e-12)
