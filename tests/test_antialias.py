"""The fixed low-pass layers (:mod:`timm_sortconv.antialias`) and the SCNN arguments that use them.

Asserted: the Gaussian kernel is normalised and symmetric; the blur and the blurred poolings commute with quarter
turns and attenuate what downsampling aliases; ``input_blur=`` and ``downsample=`` add no parameters or
``state_dict`` keys, keep exact quarter-turn invariance, compute the blur and pooling they name, and refuse bad
values with what is accepted.
"""
import math

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import timm_sortconv  # noqa: F401  (registers the models)
from conftest import randomise_batchnorm
from timm_sortconv.antialias import BlurPool2d, GaussianBlur2d, create_downsample, gaussian_kernel1d
from timm_sortconv.grid import CentredMaxPool2d


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_gaussian_kernel_is_normalised_and_symmetric():
    for sigma in (0.5, 0.7, 1.0, 2.0):
        g = gaussian_kernel1d(sigma, torch.float64)
        assert len(g) == 2 * math.ceil(2 * sigma) + 1
        assert g.sum().item() == pytest.approx(1.0, abs=1e-12)
        assert torch.equal(g, g.flip(0))
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="positive"):
            gaussian_kernel1d(bad)


@pytest.mark.parametrize("layer", ["blur", "avg", "max"])
@pytest.mark.parametrize("size", (28, 14, 15))
def test_lowpass_layers_commute_with_quarter_turns(layer, size):
    module = GaussianBlur2d(0.7) if layer == "blur" else BlurPool2d(layer)
    x = randn(2, 3, size, size)
    out = module(x)
    assert out.shape[-1] == (size if layer == "blur" else size // 2)
    for turns in (1, 2, 3):
        assert (module(torch.rot90(x, turns, (2, 3))) - torch.rot90(out, turns, (2, 3))).abs().max() < 1e-12


def test_blur_is_the_two_dimensional_gaussian():
    x = randn(1, 2, 9, 9)
    g = gaussian_kernel1d(0.7, torch.float64)
    kernel = (g[:, None] * g[None, :]).expand(2, 1, -1, -1)
    expected = F.conv2d(x, kernel, padding=len(g) // 2, groups=2)
    assert torch.allclose(GaussianBlur2d(0.7)(x), expected, atol=1e-12)


def test_blur_pool_attenuates_what_downsampling_aliases():
    """Stripes of period 4 pixels become the highest frequency of the downsampled map (aliasing); the
    binomial filter passes cos(pi/4)^3 of them, half of what 2x2 average pooling passes (cos(pi/4))."""
    cols = torch.arange(16, dtype=torch.float64)
    stripes = torch.cos(math.pi * cols / 2).expand(1, 1, 16, 16).contiguous()
    box = nn.AvgPool2d(2)(stripes)[..., 2:-2, 2:-2].abs().max().item()
    blurred = BlurPool2d("avg")(stripes)[..., 2:-2, 2:-2].abs().max().item()
    assert box == pytest.approx(math.cos(math.pi / 4) / math.sqrt(2), abs=1e-12)
    assert blurred == pytest.approx(box / 2, abs=1e-12)


def test_scnn_p_rs_7_blur_is_p_rs_7_with_the_blur_and_blurred_pooling():
    """Same parameters and keys as scnn_p_rs_7 (its weights load), a GaussianBlur2d(0.7) before the first
    convolution and BlurPool2d('max') for both poolings; what it computes is those layers around P-RS-7's."""
    torch.manual_seed(0)
    blur = timm.create_model("scnn_p_rs_7_blur", channels=(4, 4, 4, 4, 4, 4), backend="reference")
    plain = timm.create_model("scnn_p_rs_7", channels=(4, 4, 4, 4, 4, 4), backend="reference")
    assert blur.state_dict().keys() == plain.state_dict().keys()
    randomise_batchnorm(plain)
    blur.load_state_dict(plain.state_dict())
    assert isinstance(blur.features[0].pre, GaussianBlur2d) and blur.features[0].pre.sigma == 0.7
    pools = [m for m in blur.features if isinstance(m, BlurPool2d)]
    assert len(pools) == 2 and all(p.mode == "max" for p in pools)
    assert sum(isinstance(m, CentredMaxPool2d) for m in plain.features) == 2
    # the same network with the layers swapped in by hand
    plain.features[0] = nn.Sequential(GaussianBlur2d(0.7), *plain.features[0])
    for i, m in enumerate(plain.features):
        if isinstance(m, CentredMaxPool2d):
            plain.features[i] = create_downsample("blur-max")
    x = torch.randn(2, 1, 28, 28)
    blur.eval(), plain.eval()
    with torch.no_grad():
        assert torch.allclose(blur(x), plain(x), atol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(input_blur=0.7), dict(downsample="blur-max"), dict(downsample="blur-avg"),
                                    dict(downsample="avg"), dict(input_blur=1.0, downsample="blur-max",
                                                                 stride_align="corner")])
def test_scnn_low_pass_arguments_keep_parameters_and_quarter_turn_invariance(kwargs):
    torch.manual_seed(1)
    base = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4))
    model = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4), **kwargs)
    assert model.state_dict().keys() == base.state_dict().keys()
    randomise_batchnorm(model)
    model.eval()
    sizes = (28,) if kwargs.get("stride_align") == "corner" else (28, 27, 30)
    for size in sizes:
        x = torch.randn(2, 1, size, size, dtype=torch.float64)
        with torch.no_grad():
            out = model.double()(torch.cat([torch.rot90(x, t, (2, 3)) for t in range(4)])).view(4, 2, -1)
        assert (out[1:] - out[0]).abs().max() <= 1e-9 * out[0].abs().max(), size


@pytest.mark.parametrize("kwargs,match", [
    (dict(downsample="min"), r"downsample='min' is not accepted; use one of 'max', 'avg', 'blur-max', 'blur-avg'"),
    (dict(input_blur=-0.5), r"input_blur must be a number of pixels >= 0 \(0: no blur\), got -0.5"),
    (dict(input_blur="0.7"), r"input_blur must be a number of pixels >= 0"),
])
def test_scnn_refuses_bad_low_pass_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        timm.create_model("scnn_p_rs_7", **kwargs)
