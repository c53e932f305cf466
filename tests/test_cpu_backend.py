"""The fused CPU backend (``backend="cpu"``) against the specification, the reference path.

Forward values and all three gradients must agree with ``backend="reference"`` to float tolerance for
every variant, kernel size, stride, dilation, groups and padding mode; ``backend="auto"`` must take the
fast path exactly where it is supported and fall back otherwise; backward must keep nothing but the
input and the weight; a NaN must stay local. The agreement tests run on the kernel of every
instruction-set level of ``conftest.kernel_levels()`` (``isa`` fixture: avx512, avx2 and generic on an AVX-512
machine; avx2 and generic on an AVX2-only one, or under ``ATEN_CPU_CAPABILITY=avx2``). The
first test of a level builds its extension (under a minute, once per machine: it is cached across
processes); if the package's level cannot be built the module is skipped with the build's reason (under CI it
fails: there the set-up has built the kernel).
"""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import kernel_levels, load_script, quick_first, unavailable
from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv.ops import cpu_backend, native
from timm_sortconv.ops.backends import DISABLE_ENV, fast_disabled, resolve_backend
from timm_sortconv.ops.functional import resolve_padding
from timm_sortconv.ops.geometry import get_geometry
from timm_sortconv.ops.reference import sorted_patches

# the four paper variants, and two orbit sortings (samples in orbit order, segments of 4 and 2 slots)
VARIANTS = [(s, o) for s in ("square", "polar") for o in ("ring", "global")] + [("square", "c4"), ("polar", "c2")]
VARIANT_IDS = [f"{s}-{o}" for s, o in VARIANTS]
# (stride, dilation, groups, padding_mode): every value of each appears with several of the others.
CONFIGS = [
    (1, 1, 1, "zeros"),
    (2, 1, 2, "reflect"),
    (1, 2, 2, "replicate"),
    (2, 2, 1, "circular"),
    (1, 1, 2, "circular"),
    (2, 2, 2, "zeros"),
]
TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float64: dict(rtol=1e-10, atol=1e-10)}


@pytest.fixture(scope="module", autouse=True)
def extension():
    if fast_disabled():
        pytest.skip(f"{DISABLE_ENV} is set")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ext = cpu_backend.load_extension()
    if ext is None:
        reasons = "; ".join(str(w.message) for w in caught) or "unknown reason"
        unavailable(f"the fused CPU extension could not be built here: {reasons}")
    return ext


# The highest level in the quick loop, every level in the full suite.
@pytest.fixture(params=quick_first(kernel_levels()))
def isa(request, monkeypatch):
    """Runs a test on the kernel built for each instruction-set level of ``conftest.kernel_levels()`` (the package's
    choice follows TIMM_SORTCONV_CPU_ISA); a level that fails to build fails the test."""
    monkeypatch.setenv(cpu_backend.ISA_ENV, request.param)
    assert cpu_backend.load_kernel(isa=request.param).isa == request.param
    return request.param


@pytest.fixture
def threads():
    """Sets the intra-op thread count for one test and restores it."""
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def forward_and_gradients(backend, x, weight, bias, **kwargs):
    """Output and (input, weight, bias) gradients for a fixed random output gradient."""
    x, weight, bias = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    out = sort_conv2d(x, weight, bias, backend=backend, **kwargs)
    grad_out = randn(*out.shape, seed=99, dtype=out.dtype)
    return (out, *torch.autograd.grad(out, (x, weight, bias), grad_out))


def near_tie_inputs(x, k, sampling="polar", sorting="ring", stride=1, padding=0, dilation=1, groups=1,
                    padding_mode="zeros"):
    """Input pixels read by a window holding two different samples closer than float32 can order
    reliably (relative gap < 1e-6, computed in float64).

    The input gradient jumps where two samples swap places, so two float32 implementations that
    round differently may rightly disagree there (by a weight difference); the output and the weight
    gradient do not jump. Exact ties are left in: their order does not matter, because tied samples
    either lie in the zero padding or read the same pixels through reflect/replicate/circular padding.
    """
    x64 = x.detach().double().requires_grad_()
    pad = resolve_padding(padding, k, (dilation, dilation))
    padded = F.pad(x64, pad, mode="constant" if padding_mode == "zeros" else padding_mode)
    hp, wp = padded.shape[2:]
    out_size = ((hp - dilation * (k - 1) - 1) // stride + 1, (wp - dilation * (k - 1) - 1) // stride + 1)
    geometry = get_geometry(k, sampling, sorting)
    values = sorted_patches(padded.detach(), geometry, (stride, stride), (dilation, dilation), out_size)
    near = torch.zeros(values.shape[:4], dtype=torch.bool)
    for start, end in geometry.segments:
        gaps = values[..., start + 1:end] - values[..., start:end - 1]
        scale = 1 + values[..., start + 1:end].abs()
        near |= ((gaps > 1e-12 * scale) & (gaps < 1e-6 * scale)).any(-1)
    channels = x.shape[1]
    footprint = F.conv_transpose2d(near.double(), torch.ones(channels, 1, k, k, dtype=torch.float64), stride=stride,
                                   dilation=dilation, groups=channels)
    footprint = F.pad(footprint, (0, wp - footprint.shape[3], 0, hp - footprint.shape[2]))
    return torch.autograd.grad(padded, x64, footprint)[0] != 0


def assert_agree(x, weight, bias, min_comparable=0.7, **kwargs):
    fast = forward_and_gradients("cpu", x, weight, bias, **kwargs)
    reference = forward_and_gradients("reference", x, weight, bias, **kwargs)
    # float64 has no near ties at these sizes: everything must agree there.
    comparable = torch.ones_like(x, dtype=torch.bool)
    if x.dtype == torch.float32:
        comparable = ~near_tie_inputs(x, weight.shape[-1], **kwargs)
        assert comparable.double().mean() > min_comparable, "too few pixels away from near ties to compare"
    for name, a, b in zip(("output", "grad input", "grad weight", "grad bias"), fast, reference):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "grad input":
            a, b = a[comparable], b[comparable]
        torch.testing.assert_close(a, b, **TOLERANCE[x.dtype], msg=lambda m: f"{name} ({kwargs}): {m}")


@pytest.mark.parametrize("dtype", quick_first([torch.float32, torch.float64]), ids=["float32", "float64"])
@pytest.mark.parametrize("k", quick_first([3, 1, 5, 7]))
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_agrees_with_reference(sampling, sorting, k, dtype, threads, isa):
    threads(1)
    for index, (stride, dilation, groups, padding_mode) in enumerate(CONFIGS):
        # 9 x 37: output rows longer than one block of lanes and shorter ones, with partial blocks.
        x = randn(2, 4, 9, 37, seed=index, dtype=dtype)
        weight = randn(6, 4 // groups, k, k, seed=10 + index, dtype=dtype)
        bias = randn(6, seed=20 + index, dtype=dtype)
        padding = min(k // 2 * dilation, 8)  # reflect needs padding < size
        assert_agree(x, weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups,
                     padding_mode=padding_mode, sampling=sampling, sorting=sorting)


@pytest.mark.parametrize("width", quick_first([17, 3, 5, 8, 14, 16, 28, 33]))
@pytest.mark.parametrize("sampling,sorting", quick_first(VARIANTS, 2), ids=VARIANT_IDS)
def test_agrees_with_reference_for_every_row_width(sampling, sorting, width, threads, isa):
    """The forward pass of square sampling in float32 with unit stride reads each vector of lanes (16 with
    AVX-512, 8 with AVX2) straight from the input when it holds at most two row pieces, and stages it
    otherwise (and at the generic level); every width and dilation must agree with the reference."""
    threads(1)
    for index, (k, dilation) in enumerate([(3, 1), (7, 1), (5, 2), (7, 3), (5, 4)]):
        x = randn(2, 3, 6, width, seed=index, dtype=torch.float32)
        weight, bias = randn(4, 3, k, k, seed=10 + index, dtype=torch.float32), randn(4, seed=20, dtype=torch.float32)
        assert_agree(x, weight, bias, padding=k // 2 * dilation, dilation=dilation, sampling=sampling, sorting=sorting,
                     min_comparable=0.5)


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_polar_samples_read_from_the_runs_agree_for_every_row_width(dtype, count, threads, isa):
    """Polar samples (k = 3) are interpolated straight from the input where a block's runs take two vectors or fewer
    (rows of 32 or 16), and from the staged window otherwise; forward and both gradients must agree at every width.
    Two images of 5 x 8 with 64 -> 64 channels on two threads: the first thread's range (48 positions) ends in a
    block of two rows of 8, the first run's second half spilling into the second's lanes."""
    threads(count)
    for index, width in enumerate((8, 16, 32, 12, 17, 33)):
        channels = 64 if width == 8 else 3
        x = randn(2, channels, 5 if width == 8 else 6, width, seed=index, dtype=dtype)
        weight = randn(channels, channels, 3, 3, seed=10 + index, dtype=dtype) * 0.1
        assert_agree(x, weight, randn(channels, seed=20, dtype=dtype), padding=1, sampling="polar", sorting="ring",
                     min_comparable=0.5)


def test_compiled_polar_tap_positions_match_the_geometry():
    """The kernel reads polar taps (k = 5, 7) at compile-time positions (csrc/polar_taps.h) where they equal the
    geometry's; the file must be what geometry.py gives today (regenerate it with polar_tap_header())."""
    header = Path(cpu_backend.__file__).resolve().parent.parent / "csrc" / "polar_taps.h"
    assert header.read_text() == cpu_backend.polar_tap_header()


@pytest.mark.slow
@pytest.mark.parametrize("k", [9, 11])
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_agrees_with_reference_large_kernels(sampling, sorting, k, threads, isa):
    """k = 9's ring has an unrolled network of 32; its window (81) and everything of k = 11 run the
    comparators from memory."""
    threads(1)
    for dtype in (torch.float32, torch.float64):
        x, weight = randn(1, 2, 14, 12, dtype=dtype), randn(3, 2, k, k, seed=1, dtype=dtype)
        bias = randn(3, dtype=dtype)
        # 81 or 121 samples per window: near ties in float32 are common, so fewer pixels are comparable.
        assert_agree(x, weight, bias, min_comparable=0.3, padding=k // 2, sampling=sampling, sorting=sorting)


@pytest.mark.slow
@pytest.mark.parametrize("size,k,stride", [(1, 3, 1), (2, 3, 1), (5, 5, 2), (6, 7, 1)])
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_agrees_with_reference_when_blocks_span_images(sampling, sorting, size, k, stride, threads, isa):
    """Blocks of two vectors of output positions (32 float32 with AVX-512, 16 with AVX2, 8 at the generic
    level) run across image boundaries; the forward pass reads them from a per-thread copy of the images a
    block touches (up to one per position for 1x1 outputs),
    refilled as the blocks move on (the backward also adds each image's gradient to the input's as it
    leaves). 37 images of 1x1 to 6x6 outputs make every refill case happen; the padding differs between
    height and width."""
    threads(1)
    for dtype in (torch.float32, torch.float64):
        x = randn(37, 3, size, size, seed=size, dtype=dtype)
        weight, bias = randn(4, 3, k, k, seed=1, dtype=dtype), randn(4, seed=2, dtype=dtype)
        assert_agree(x, weight, bias, min_comparable=0.5, stride=stride, padding=(k // 2, k // 2 + 1),
                     sampling=sampling, sorting=sorting)


@pytest.mark.parametrize("channels,groups,stride", [(64, 1, 1), (64, 1, 2), (128, 2, 1)])
@pytest.mark.parametrize("sampling,sorting", [("polar", "ring"), ("square", "global")], ids=["polar-ring",
                                                                                          "square-global"])
def test_agrees_with_reference_when_blocks_share_a_pass_over_large_weights(sampling, sorting, channels, groups,
                                                                          stride, threads, isa):
    """Where a group's weights reach 512 KiB (here 64 -> 64 channels at 7x7: 0.8 MB in float32), several blocks
    share one pass over the weights: the forward multiplies them one after the other on each weight chunk, the
    backward sums the weight gradient over all of them at once and scatters each block's input gradient. Three
    7x7 images (147 positions) make a pass span images and end in a partial pass and a partial block; two
    threads split the images between them."""
    for thread_count in (1, 2):
        threads(thread_count)
        for dtype in (torch.float32, torch.float64):
            x = randn(3, channels, 7, 7, seed=3, dtype=dtype)
            weight = randn(channels, channels // groups, 7, 7, seed=4, dtype=dtype) * 0.05
            bias = randn(channels, seed=5, dtype=dtype)
            assert_agree(x, weight, bias, min_comparable=0.5, stride=stride, padding=3, groups=groups,
                         sampling=sampling, sorting=sorting)


@pytest.mark.slow
def test_agrees_with_reference_on_images_read_in_place(threads, isa):
    """Unpadded images over kMaxCopiedImage (4 MiB) are read, and their gradient written, in place rather than
    through a per-thread copy (padded ones are always copied: the copy adds the zeros)."""
    threads(2)
    x = randn(2, 1, 1030, 1030)  # float64: 8.5 MB per image
    weight, bias = randn(2, 1, 3, 3, seed=1), randn(2, seed=2)
    assert_agree(x, weight, bias, padding=0, sampling="square", sorting="global")


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_agrees_with_reference_on_two_threads(batch, threads, isa):
    """Two threads: with fewer images than threads they share blocks and keep private input gradients;
    otherwise each owns whole images, and its copy of the images (and their gradient) holds none of the
    other thread's. The shape is large enough to be split."""
    threads(2)
    x, weight, bias = randn(batch, 8, 24, 40, dtype=torch.float32), randn(16, 8, 5, 5, seed=1, dtype=torch.float32), \
        randn(16, dtype=torch.float32)
    assert_agree(x, weight, bias, padding=2, sampling="polar", sorting="ring")


@pytest.mark.parametrize("out_channels,groups,stride", [(100, 1, 1), (100, 2, 1), (96, 1, 2)])
def test_agrees_with_reference_when_threads_split_the_outputs(out_channels, groups, stride, threads, isa):
    """One small image has fewer blocks of positions than two threads (7x7: 49 positions, one block of kLanes and a
    partial one; stride 2: 16 positions, one partial block) yet work for both (over 2M multiply-adds): the threads
    take parts of each group's outputs instead, every part sorting the same samples. 100 outputs make 9 register
    tiles of uneven rows (50 per group: 5), so the parts end inside the weight's tiled layout and in the bias."""
    threads(2)
    for dtype in (torch.float32, torch.float64):
        x = randn(1, 64, 7, 7, seed=6, dtype=dtype)
        weight = randn(out_channels, 64 // groups, 7, 7, seed=7, dtype=dtype) * 0.05
        bias = randn(out_channels, seed=8, dtype=dtype)
        assert_agree(x, weight, bias, min_comparable=0.5, stride=stride, padding=3, groups=groups,
                     sampling="polar", sorting="ring")


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("sampling,sorting,k", [("polar", "ring", 7), ("square", "global", 3)])
def test_agrees_with_reference_where_a_block_lies_in_its_first_vector(sampling, sorting, k, count, threads, isa):
    """One 14x14 image (196 positions: six whole blocks and one of 4) on one thread and on two (ranges of 96 and
    100 positions: the second ends in a block of 4): such a block is sorted in the first vector of lanes only, the
    others' lanes left unread, and multiplied with the outputs on the lanes (gemm_positions); the same at 3x3 (9
    positions, the only block) and 7x7 (a block of 32 and one of 17: a whole vector and one position more; on two
    threads each takes part of the 70 outputs, more than one vector of outputs at a time holds)."""
    threads(count)
    for size, outputs in ((14, 40), (3, 40), (7, 70)):
        x = randn(1, 32, size, size, seed=size, dtype=torch.float32)
        weight = randn(outputs, 32, k, k, seed=1, dtype=torch.float32) * 0.05
        assert_agree(x, weight, randn(outputs, seed=2, dtype=torch.float32), min_comparable=0.5, padding=k // 2,
                     sampling=sampling, sorting=sorting)


def test_padding_same_and_no_bias(threads, isa):
    threads(1)
    x, weight = randn(2, 3, 10, 10), randn(5, 3, 5, 5, seed=1)
    fast = sort_conv2d(x, weight, None, padding="same", backend="cpu")
    torch.testing.assert_close(fast, sort_conv2d(x, weight, None, padding="same", backend="reference"))


@pytest.mark.slow
def test_gradcheck(threads, isa):
    threads(1)
    for sampling, sorting in (("polar", "ring"), ("square", "global")):
        x = randn(2, 4, 7, 6).requires_grad_()
        weight = randn(4, 2, 3, 3, seed=1).requires_grad_()
        bias = randn(4, seed=2).requires_grad_()

        def op(x, weight, bias):
            return sort_conv2d(x, weight, bias, stride=2, padding=1, groups=2, padding_mode="reflect",
                               sampling=sampling, sorting=sorting, backend="cpu")

        assert torch.autograd.gradcheck(op, (x, weight, bias))


def test_auto_picks_cpu_where_supported_and_falls_back_elsewhere(monkeypatch, auto_without_triton):
    geometry = get_geometry(3, "polar", "ring")
    x, weight = torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3)
    assert resolve_backend("auto", x, weight, None, geometry, (1, 1), (1, 1), 1).name == "cpu"
    assert resolve_backend("auto", x.double(), weight.double(), None, geometry, (1, 1), (1, 1), 1).name == "cpu"
    bf16 = (x.bfloat16(), weight.bfloat16(), None, geometry, (1, 1), (1, 1), 1)
    assert resolve_backend("auto", *bf16).name == ("cpu" if cpu_backend.bf16_products() else "reference")
    half = (x.half(), weight.half(), None, geometry, (1, 1), (1, 1), 1)
    assert resolve_backend("auto", *half).name == "reference"
    big = get_geometry(17, "polar", "ring")
    assert resolve_backend("auto", torch.randn(1, 2, 20, 20), torch.randn(2, 2, 17, 17), None, big, (1, 1), (1, 1),
                           1).name == "reference"
    mixed = (x, weight.double(), None, geometry, (1, 1), (1, 1), 1)
    assert resolve_backend("auto", *mixed).name == "reference"
    with pytest.raises(RuntimeError, match="does not support"):
        resolve_backend("cpu", *half)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert resolve_backend("auto", x, weight, None, geometry, (1, 1), (1, 1), 1).name == "reference"


def test_sortconv2d_auto_matches_reference_and_falls_back_for_bfloat16():
    conv = SortConv2d(3, 4, 5, padding=2, sorting="global")
    reference = SortConv2d.from_conv(conv, sampling="polar", sorting="global", backend="reference")
    x = torch.randn(2, 3, 12, 12)
    torch.testing.assert_close(conv(x), reference(x), rtol=1e-4, atol=1e-4)
    # bfloat16: the kernel's bfloat16 products where the CPU has AVX-512 BF16, else the reference path
    out = conv.bfloat16()(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("padding_mode,batch", [("zeros", 2), ("zeros", 1), ("reflect", 2)])
def test_backward_saves_only_the_input_and_the_weight(padding_mode, batch, threads):
    """No index tensor of any kind and no float tensor beyond the input and the weight. Zero padding is
    an argument of the operator, so the input itself is kept, unpadded, whatever the batch (with fewer
    images than threads the backend pads once, in the forward and again in the backward); other modes
    keep the padded input (and F.pad's backward may keep the input as well)."""
    threads(2)
    x = torch.randn(batch, 4, 16, 16, requires_grad=True)
    weight = torch.randn(8, 4, 7, 7, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = sort_conv2d(x, weight, bias, padding=3, padding_mode=padding_mode, backend="cpu")
    assert saved, "backward saves the input and the weight"
    assert all(t.is_floating_point() for t in saved), [t.dtype for t in saved]
    if padding_mode == "zeros":
        assert {id(t) for t in saved} == {id(x), id(weight)}, [tuple(t.shape) for t in saved]
    else:
        padded_numel = batch * 4 * 22 * 22
        assert any(tuple(t.shape) == (batch, 4, 22, 22) for t in saved), [tuple(t.shape) for t in saved]
        assert all(t.numel() <= padded_numel or t is weight for t in saved), [tuple(t.shape) for t in saved]
        assert sum(t.numel() for t in saved) <= x.numel() + padded_numel + weight.numel()
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None and bias.grad is not None


@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_nan_stays_local(sampling, sorting, isa):
    """A NaN makes NaN at most the outputs whose (dilated) window holds it, and every other output
    equals the reference's."""
    k, dilation = 5, 2
    x = torch.randn(1, 2, 20, 20)
    x[0, 1, 9, 11] = float("nan")
    weight = torch.randn(3, 2, k, k)
    kwargs = dict(padding=k // 2 * dilation, dilation=dilation, sampling=sampling, sorting=sorting)
    out = sort_conv2d(x, weight, backend="cpu", **kwargs)
    touched = F.conv2d(torch.isnan(x).double().sum(1, keepdim=True), torch.ones(1, 1, k, k, dtype=torch.float64),
                       padding=k // 2 * dilation, dilation=dilation) > 0
    nan = torch.isnan(out)
    assert nan.any(dim=1, keepdim=True).logical_and(~touched).sum() == 0
    assert nan[0, :, 9, 11].all(), "the window centred on the NaN samples it at its centre"
    reference = sort_conv2d(x, weight, backend="reference", **kwargs)
    torch.testing.assert_close(out[~touched.expand_as(out)], reference[~touched.expand_as(out)], rtol=1e-4, atol=1e-4)


def test_cache_name_hashes_sources_flags_and_level_but_not_the_folder(monkeypatch, tmp_path):
    sources = cpu_backend._sources(cpu_backend.SOURCE_DIR)
    name = cpu_backend.extension_name(sources, "generic")
    copy = tmp_path / "csrc"
    copy.mkdir()
    for file_name, text in sources.items():
        (copy / file_name).write_bytes(text)
    assert cpu_backend.extension_name(cpu_backend._sources(copy), "generic") == name
    (copy / "polar_taps.h").write_bytes(sources["polar_taps.h"] + b"// edited\n")
    assert cpu_backend.extension_name(cpu_backend._sources(copy), "generic") != name
    assert cpu_backend.extension_name(sources, "avx2") != name
    monkeypatch.setattr(cpu_backend, "_CFLAGS", cpu_backend._CFLAGS + ("-DSOMETHING",))
    assert cpu_backend.extension_name(sources, "generic") != name


@pytest.fixture
def fresh_isa_choice():
    """Forgets the cached level choice before and after a test that changes what it depends on."""
    native._resolve_isa.cache_clear()
    yield
    native._resolve_isa.cache_clear()


def test_isa_follows_torch_and_the_environment_within_what_the_cpu_runs(monkeypatch, fresh_isa_choice):
    monkeypatch.delenv(cpu_backend.ISA_ENV, raising=False)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    v3 = [feature for feature in cpu_backend.ISA_LEVELS["avx2"].features]
    monkeypatch.setattr(native, "_cpu_features", lambda: frozenset(v3 + ["sse2"]))
    assert cpu_backend.runnable_isa_levels() == ("avx2", "generic")
    for capability, expected in (("AVX512", "avx2"), ("AVX2", "avx2"), ("DEFAULT", "generic")):
        native._resolve_isa.cache_clear()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert cpu_backend.cpu_isa() == expected, capability
    monkeypatch.setenv(cpu_backend.ISA_ENV, "Generic")
    assert cpu_backend.cpu_isa() == "generic"
    monkeypatch.setenv(cpu_backend.ISA_ENV, "avx512")
    with pytest.raises(RuntimeError, match="cannot run that level .*lacks avx512_f.*levels it can run: avx2, generic"):
        cpu_backend.cpu_isa()
    with pytest.raises(RuntimeError, match="cannot run the avx512 level"):
        cpu_backend.load_kernel(isa="avx512")
    monkeypatch.setenv(cpu_backend.ISA_ENV, "neon")
    with pytest.raises(ValueError, match="'neon' is not an instruction-set level; accepted: avx512, avx2, generic"):
        cpu_backend.cpu_isa()
    monkeypatch.setattr(native.platform, "machine", lambda: "aarch64")
    assert cpu_backend.runnable_isa_levels() == ("generic",)


def test_the_tests_run_the_levels_from_the_packages_own_down(monkeypatch, fresh_isa_choice):
    """On an AVX-512 CPU the ``isa`` fixture runs every level; with PyTorch at AVX2 (``ATEN_CPU_CAPABILITY=avx2``) or
    TIMM_SORTCONV_CPU_ISA=avx2 it runs the levels an AVX2-only CPU runs, so the suite counts as many tests there."""
    monkeypatch.delenv(cpu_backend.ISA_ENV, raising=False)
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(native, "_cpu_features", lambda: frozenset(cpu_backend.ISA_LEVELS["avx512"].features))
    for capability, expected in (("AVX512", ("avx512", "avx2", "generic")), ("AVX2", ("avx2", "generic")),
                                 ("DEFAULT", ("generic",))):
        native._resolve_isa.cache_clear()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        assert kernel_levels() == expected, capability
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv(cpu_backend.ISA_ENV, "avx2")
    assert kernel_levels() == ("avx2", "generic")


def test_failed_build_warns_once_and_auto_uses_the_reference(monkeypatch, auto_without_triton):
    """A machine without the tools to build: one warning naming every level tried, then the reference
    path, silently."""
    monkeypatch.setattr(cpu_backend, "_package_kernel", {})
    monkeypatch.setattr(cpu_backend, "_kernels", {})
    monkeypatch.setattr(cpu_backend, "_ninja_on_path", lambda: None)
    with pytest.warns(RuntimeWarning, match="could not be built") as caught:
        assert cpu_backend.load_extension() is None
    assert len(caught) == 1 and f"{cpu_backend.cpu_isa()}: ninja is not installed" in str(caught[0].message)
    assert "generic: ninja is not installed" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_backend.load_extension() is None
        geometry = get_geometry(3, "polar", "ring")
        x, weight = torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3)
        assert resolve_backend("auto", x, weight, None, geometry, (1, 1), (1, 1), 1).name == "reference"
        torch.testing.assert_close(sort_conv2d(x, weight, padding=1),
                                   sort_conv2d(x, weight, padding=1, backend="reference"))


def test_a_level_that_fails_to_build_falls_back_to_a_lower_one(monkeypatch):
    levels = kernel_levels()
    if len(levels) < 2:
        pytest.skip("this CPU runs only the generic level")
    real_build = cpu_backend._build

    def build(sources, isa, verbose):
        if isa == levels[0]:
            raise RuntimeError(f"no compiler for {isa}")
        return real_build(sources, isa, verbose)

    monkeypatch.setattr(cpu_backend, "_package_kernel", {})
    monkeypatch.setattr(cpu_backend, "_kernels", {})
    monkeypatch.setattr(cpu_backend, "_build", build)
    monkeypatch.setenv(cpu_backend.ISA_ENV, levels[0])
    with pytest.warns(RuntimeWarning, match=f"{levels[0]}: no compiler for {levels[0]}.*using the {levels[1]} build"):
        assert cpu_backend.load_extension() is not None
    assert cpu_backend._kernel().isa == levels[1]


# A module with the extension's entry point and nothing else: builds in seconds.
TINY_SOURCE = b"""#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""

LOAD_IN_A_NEW_PROCESS = """
import sys
from timm_sortconv.ops import cpu_backend, native
kernel = cpu_backend.load_kernel(sys.argv[1], "generic")
print(kernel.module.answer(), kernel.module.__file__)
"""


@pytest.mark.slow
def test_two_checkouts_share_or_keep_their_cache_entries(tmp_path, monkeypatch):
    """Identical sources in two folders are one cache entry, built once and reused by other processes;
    different sources are another entry, and building one never rebuilds the other (each entry compiles
    its own copy of the sources)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(cache))
    monkeypatch.setattr(cpu_backend, "_kernels", {})
    first, second, edited = (tmp_path / name for name in ("first", "second", "edited"))
    for folder, text in ((first, TINY_SOURCE), (second, TINY_SOURCE), (edited, TINY_SOURCE.replace(b"42", b"-42"))):
        folder.mkdir()
        (folder / "sort_conv_cpu.cpp").write_bytes(text)
        (folder / "header.h").write_bytes(b"#pragma once\n")
    script = tmp_path / "load.py"
    script.write_text(LOAD_IN_A_NEW_PROCESS)
    repo = Path(cpu_backend.__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))

    def load_in_a_new_process(folder):
        result = subprocess.run([sys.executable, str(script), str(folder)], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        answer, library = result.stdout.split()
        return int(answer), Path(library)

    answer, built = load_in_a_new_process(first)
    assert answer == 42 and cache in built.parents
    # This process has built the package's kernel already: no build may change the names it computes.
    assert built.stem == cpu_backend.extension_name(cpu_backend._sources(first), "generic")
    stamp = built.stat().st_mtime_ns
    kernel = cpu_backend.load_kernel(second, "generic")
    assert kernel.module.answer() == 42 and Path(kernel.module.__file__) == built
    assert built.stat().st_mtime_ns == stamp, "the second checkout rebuilt the first one's entry"
    edited_kernel = cpu_backend.load_kernel(edited, "generic")
    assert edited_kernel.module.answer() == -42 and Path(edited_kernel.module.__file__).parent != built.parent
    assert load_in_a_new_process(first) == (42, built)
    assert built.stat().st_mtime_ns == stamp, "building other sources rebuilt this entry"


def test_benchmark_script_shape_sets(capsys):
    """`bench_sortconv.py --shapes` takes the named shape sets (the ResNet/SCNN layers, the same layers with
    k = 5), model names and 'none', and names them on error."""
    bench = load_script(Path(__file__).resolve().parent.parent / "scripts" / "bench_sortconv.py", "bench_sortconv")
    assert bench.parse_args(["--shapes", "resnet,k5,scnn_p_rs_7,none"]).shapes == "resnet,k5,scnn_p_rs_7,none"
    assert {shape.kernel_size for shape in bench.SHAPE_SETS["k5"][1]} == {5}
    assert {shape.kernel_size for shape in bench.SHAPE_SETS["resnet"][1]} == {3, 7}
    with pytest.raises(SystemExit) as error:
        bench.parse_args(["--shapes", "k9"])
    assert error.value.code == 2
    assert "unknown shape set 'k9'; accepted: resnet, k5, gpu, none" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# bfloat16 calls: float32 sampling and sorting, bfloat16 products (AVX-512 BF16)
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def bf16_kernel():
    """Skips a test where the kernel does not multiply in bfloat16 (asked at run time, after the build)."""
    if not cpu_backend.bf16_products():
        pytest.skip("the package's kernel here has no bfloat16 products (the avx512 build on a CPU with AVX-512 BF16 "
                    "has them): bfloat16 calls go to the reference path")


needs_bf16 = pytest.mark.usefixtures("bf16_kernel")
# Shapes that reach every edge of the pair packing: an odd number of outputs per group (7, 3, 5), an odd
# forward depth (one channel: 49 slots), blocks that end inside a vector pair (13 x 13 = 169 positions),
# groups, stride 2, and a panel of several chunks (32 channels of 7 x 7).
BF16_SHAPES = [
    # batch, channels, outputs, size, k, stride, groups
    (3, 5, 7, 13, 7, 1, 1),
    (2, 4, 6, 11, 5, 2, 2),
    (4, 1, 32, 28, 7, 1, 1),
    (2, 32, 32, 14, 7, 1, 1),
    (1, 3, 5, 9, 3, 1, 1),
]


def bf16_exact(*shape, seed, scale=1.0):
    """Random values that bfloat16 holds exactly (the products of two are exact in float32)."""
    return (randn(*shape, seed=seed, dtype=torch.float32) * scale).bfloat16().float()


def bf16_case(shape, sampling, sorting):
    batch, channels, outputs, size, k, stride, groups = shape
    x = bf16_exact(batch, channels, size, size, seed=1)
    weight = bf16_exact(outputs, channels // groups, k, k, seed=2, scale=0.1)
    bias = bf16_exact(outputs, seed=3)
    kwargs = dict(stride=stride, padding=k // 2, groups=groups, sampling=sampling, sorting=sorting)
    return x, weight, bias, kwargs


def bf16_forward_and_gradients(backend, dtype, x, weight, bias, **kwargs):
    """forward_and_gradients in `dtype` with one output gradient for every dtype (bfloat16 values)."""
    x, weight, bias = (t.detach().to(dtype).requires_grad_() for t in (x, weight, bias))
    out = sort_conv2d(x, weight, bias, backend=backend, **kwargs)
    grad_out = bf16_exact(*out.shape, seed=99).to(dtype)
    return (out, *torch.autograd.grad(out, (x, weight, bias), grad_out))


def relative(got, expected):
    return ((got.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


@needs_bf16
@pytest.mark.parametrize("shape", BF16_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("sampling,sorting", quick_first([("polar", "ring"), ("square", "ring"),
                                                          ("polar", "global"), ("square", "c4")]))
def test_bfloat16_calls_agree_with_the_float32_kernel_within_bfloat16_rounding(sampling, sorting, shape):
    """A bfloat16 call returns bfloat16 output and gradients within bfloat16's rounding (2^-8) of the float64
    reference (output, weight and bias gradients) and of the float32 kernel (the input gradient: values that
    bfloat16 holds tie often, and the kernel's sorting network breaks ties as the reference's sort need not)."""
    x, weight, bias, kwargs = bf16_case(shape, sampling, sorting)
    got = bf16_forward_and_gradients("cpu", torch.bfloat16, x, weight, bias, **kwargs)
    assert all(t.dtype == torch.bfloat16 for t in got)
    reference = bf16_forward_and_gradients("reference", torch.float64, x, weight, bias, **kwargs)
    float32 = bf16_forward_and_gradients("cpu", torch.float32, x, weight, bias, **kwargs)
    for name, g, r in zip(("output", "weight", "bias"), (got[0], got[2], got[3]),
                          (reference[0], reference[2], reference[3])):
        assert relative(g, r) < 2 ** -7, name
    assert relative(got[1], float32[1]) < 2 ** -7
    # and not the float32 result merely rounded at the end: the products were rounded too
    assert relative(got[0], float32[0]) > 0


@needs_bf16
@pytest.mark.parametrize("shape", BF16_SHAPES[:3], ids=lambda s: "x".join(map(str, s)))
def test_bfloat16_products_of_exact_values_are_exact(shape):
    """Square sampling takes the input's own values: where input and weight are bfloat16 values the products
    are exact and only the float32 sums and the output's rounding remain, so each output is within one
    bfloat16 rounding (half a unit in the last place: at most 2^-8 relative, plus the sums' order) of the
    float64 reference."""
    x, weight, bias, kwargs = bf16_case(shape, "square", "ring")
    out = sort_conv2d(x.bfloat16(), weight.bfloat16(), bias.bfloat16(), backend="cpu", **kwargs)
    expected = sort_conv2d(x.double(), weight.double(), bias.double(), backend="reference", **kwargs)
    bound = 2 ** -8 * expected.abs() + 1e-5 * expected.abs().max()
    assert ((out.double() - expected).abs() <= bound).all()


@needs_bf16
def test_bfloat16_nan_stays_in_its_windows():
    """A NaN input value makes the outputs whose windows hold it NaN, and only those, as in float32."""
    x = bf16_exact(1, 2, 12, 12, seed=4)
    x[0, 1, 5, 6] = float("nan")
    weight = bf16_exact(3, 2, 5, 5, seed=5)
    out = sort_conv2d(x.bfloat16(), weight.bfloat16(), None, padding=2, backend="cpu")
    expected = sort_conv2d(x, weight, None, padding=2, backend="cpu")
    assert torch.equal(out.isnan(), expected.isnan()) and out.isnan().any() and not out.isnan().all()


def test_benchmark_script_precisions_per_device(capsys):
    """`bench_sortconv.py --precisions`: fp32 and bf16 for the CPU's throughput table (bf16 under autocast), the
    GPU's list on cuda; anything else is refused with what is accepted."""
    bench = load_script(Path(__file__).resolve().parent.parent / "scripts" / "bench_sortconv.py", "bench_sortconv")
    assert bench.parse_args(["--throughput", "--precisions", "fp32,bf16"]).precisions == "fp32,bf16"
    with pytest.raises(SystemExit) as error:
        bench.parse_args(["--throughput", "--precisions", "fp32,fp16"])
    assert error.value.code == 2
    assert "unknown precision 'fp16' on cpu; accepted: fp32, bf16" in capsys.readouterr().err


def test_benchmark_script_twins(capsys):
    """`bench_sortconv.py --twins`: each model of the training-speed goal is timed against a plain twin, so the SC
    side must hold SortConv2d layers and the twin none, both with the same classifier; unknown names are refused
    with the list."""
    from timm_sortconv import SortConv2d

    bench = load_script(Path(__file__).resolve().parent.parent / "scripts" / "bench_sortconv.py", "bench_sortconv")
    assert bench.parse_args(["--twins", "all"]).twins.split(",") == list(bench.CPU_TWINS)
    for name, (build_sc, build_twin, size, batch) in bench.CPU_TWINS.items():
        sc, twin = build_sc(), build_twin()
        assert any(isinstance(m, SortConv2d) for m in sc.modules()), name
        assert not any(isinstance(m, SortConv2d) for m in twin.modules()), name
        assert sc.get_classifier().out_features == twin.get_classifier().out_features, name
        assert batch >= 1 and len(size) == 3, name
    with pytest.raises(SystemExit) as error:
        bench.parse_args(["--twins", "resnet50"])
    assert error.value.code == 2
    assert "unknown --twins model 'resnet50'; accepted: scnn_p_rs_7," in capsys.readouterr().err


def test_kernel_takes_the_weight_in_grid_order_with_its_slot_order(extension):
    """The extension permutes a grid-order weight into slot order itself (``slot_to_grid``) while repacking it, and
    answers the weight gradient in grid order; the same call with the weight reordered by the caller (no
    ``slot_to_grid``, the older interface that ``bench_kernel_ab.py`` still drives) gives the same output; a
    ``slot_to_grid`` that is not a permutation of the k*k positions is refused."""
    geometry = get_geometry(5, "polar", "ring")
    tables = cpu_backend._tables_for(geometry)
    x, weight = randn(2, 3, 9, 9), randn(4, 3, 5, 5, seed=1)
    args = (tables.tap_offsets, tables.tap_weights, tables.segments, tables.comparators, 5, 1, 1, 1, 1, 1)
    flat = weight.reshape(4, -1)
    slots = weight.reshape(4, 3, 25).index_select(2, tables.slot_to_grid).reshape(4, -1)
    assert not torch.equal(flat, slots)
    grid_out = extension.forward(x, flat, None, *args, slot_to_grid=tables.slot_to_grid)
    torch.testing.assert_close(grid_out, extension.forward(x, slots, None, *args), rtol=0, atol=0)
    grad_out = randn(*grid_out.shape, seed=3)
    _, grid_grad = extension.backward(grad_out, x, flat, *args, False, True, slot_to_grid=tables.slot_to_grid)
    _, slot_grad = extension.backward(grad_out, x, slots, *args, False, True)
    torch.testing.assert_close(grid_grad.view(4, 3, 25),
                               slot_grad.view(4, 3, 25).index_select(2, tables.grid_to_slot), rtol=0, atol=0)
    bad = tables.slot_to_grid.clone()
    bad[1] = bad[0]
    with pytest.raises(RuntimeError, match="permutation of 0..24"):
        extension.forward(x, flat, None, *args, slot_to_grid=bad)
