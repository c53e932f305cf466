"""SCNN: the MNIST network of the Sorting Convolution paper, in its 12 SC variants and its plain baseline,
and ``scnn_p_rs_7_canon`` / ``scnn_p_c2_7_canon``, P-RS-7 turned to its principal axis first (the second with
half-turn orbit sorting, ``sorting='c2'``), and ``scnn_p_rs_7_blur``, P-RS-7 with a blurred input and blurred
max pooling (:mod:`timm_sortconv.antialias`), for scenes whose parts are turned independently, and
``scnn_p_rs_7_early_canon``, which sorts in its first two convolutions only and turns its input by its first
angular moment, and ``scnn_p_align_7_guided``, whose windows are turned by the orientation of the blurred input
around them (:mod:`timm_sortconv.guide`), for scenes whose parts are turned independently, and
``scnn_p_align_7_guided_canon``, the same turned by its first angular moment first with the canonical orientation
in its guide, for whole-image turns and turned parts alike.

Six convolutions with 32, 32, 64, 64, 128, 128 channels, each followed by BatchNorm and ReLU; 2x2 max
pooling after the second and the fourth; the first four have a ``K x K`` kernel (K = 3, 5 or 7), the
last two ``3 x 3``; padding ``k // 2``; global average pooling (the paper's 7x7 average pooling of the
7x7 map of a 28x28 input); one linear layer.

``scnn_{s,p}_{gs,rs}_{K}`` use ``SortConv2d`` in all six layers: ``s``/``p`` = square/polar sampling,
``gs``/``rs`` = global/ring sorting. ``scnn_baseline_{K}`` uses ``nn.Conv2d`` and has exactly the same
parameters. On a 28x28 input every pooling window tiles the map, so an SCNN's logits are exactly
invariant to rotations by multiples of 90 degrees, and polar sampling keeps them close for any angle.

Paper: `Sorting Convolution Operation for Achieving Rotational Invariance` (Mo & Zhao, IEEE SPL 2024)
- https://arxiv.org/abs/2305.14462
"""
from typing import Any, Dict, List, Optional, Sequence

import torch.nn as nn

from timm.layers import ClassifierHead
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from ..antialias import GaussianBlur2d, create_downsample
from ..canonical import create_canonicalizer
from ..guide import attach_guide, check_guide_blur, check_guide_ramp
from ..hub import HUB_ORG, bundled_weights_dir
from ._common import PAPER_CFG, SequentialClassifierMixin
from ._conv import ConvNormAct, fixed_variant_args, get_conv_layer

__all__ = ['SCNN']


class SCNN(SequentialClassifierMixin, nn.Module):
    """The paper's MNIST network with sorting (``sampling``/``sorting`` given) or plain convolutions (both ``None``).

    Args:
        kernel_size: kernel of the first four convolutions (odd).
        sampling: ``'polar'`` or ``'square'``, or ``None`` with ``sorting=None`` for ``nn.Conv2d``.
        sorting: ``'ring'``, ``'global'``, ``'c4'``, ``'c2'``, ``'align'`` or ``'align-channel'``
            (:func:`~timm_sortconv.sort_conv2d`), or ``None``.
        backend: the ``SortConv2d`` backend (``'auto'``, ``'reference'`` or a fast backend's name).
        stride_align: ``'centre'`` (default: every strided layer's grid centred on the image, so that the network
            is exactly invariant to quarter turns at every input size, :mod:`timm_sortconv.grid`) or ``'corner'``
            (PyTorch's grid, the paper's network: exact at multiples of 4, 28 included, where both are the same).
        num_classes: classifier outputs (0: no classifier).
        in_chans: input channels.
        channels: widths of the six convolutions.
        global_pool: timm pooling type (``'avg'``, ``'max'``, ``'avgmax'``, ``'catavgmax'``; all keep invariance).
        canonicalize: ``None``, or ``'moment2'``/``'moment4'``/``'moment1'``: turn each input image to the
            orientation of its order-2/4/1 angular moment before the first convolution
            (:class:`~timm_sortconv.canonical.MomentCanonicalize2d`). With order 2 or 4 the leftover
            turn is a multiple of 90 degrees, which the SC layers ignore, so the network's invariance
            extends to the angles between the quarter turns; no parameters. With ``sorting='c2'`` (half
            turns ignored, the direction modulo 180 degrees kept) use order 2: it leaves a multiple of 180.
            A non-square input is turned in a larger frame that holds it whole, which the layers then read
            (:func:`~timm_sortconv.canonical.canonical_size`: 28x56 becomes 66x66).
        input_blur: ``sigma`` in pixels of a fixed Gaussian blur before the first convolution (0: none;
            :class:`~timm_sortconv.antialias.GaussianBlur2d`, the child ``features.0.pre``).
        downsample: the two 2x downsamplings, ``'max'`` (the paper's 2x2 max pooling), ``'avg'``, or the blurred
            ``'blur-max'`` / ``'blur-avg'`` (:class:`~timm_sortconv.antialias.BlurPool2d`). With ``input_blur=0.7``
            and ``'blur-max'`` (``scnn_p_rs_7_blur``) ring-sorted SC keeps its accuracy on scenes whose parts are
            turned independently (RESULTS.md, "Local rotations"). Neither adds parameters or ``state_dict`` keys,
            and both keep the exact invariance to quarter turns.
        guide_blur: with ``sorting='align'``, turn every aligned window by the orientation of the input blurred by
            that many pixels around it instead of by its own (:mod:`timm_sortconv.guide`; 0: no guide). The guide
            is made from the input of the first convolution (after ``canonicalize``); no parameters, no
            ``state_dict`` keys. ``scnn_p_align_7_guided`` (4 pixels).
        guide_ramp: with ``guide_blur`` and ``canonicalize``, a ramp of that many units a pixel along the turned
            image's +x axis added to the guide (:mod:`timm_sortconv.guide`; 0: none): where the blurred input is
            flat the windows turn by the image's canonical orientation. ``scnn_p_align_7_guided_canon`` (0.02).
        sorted_convs: how many of the six convolutions, from the input on, sort (6, the default: all; the
            others are ``nn.Conv2d`` with the same parameters). With 2, the early layers' responses ignore how
            small patches are turned, and the later layers still see orientation (a 6 from a 9), which a network
            sorted throughout cannot; whole turns are then left to ``canonicalize='moment1'`` (the network is no
            longer invariant to quarter turns by its layers). ``scnn_p_rs_7_early_canon``.
        drop_rate: dropout before the classifier.
        bn_momentum, bn_eps: BatchNorm settings (timm's ``train.py`` passes them when asked).

    The weights keep PyTorch's default initialisation, as in the paper's code. ``forward_intermediates``
    taps the three stages: the outputs before each max pooling, and the last one.
    """

    def __init__(
            self,
            kernel_size: int = 7,
            sampling: Optional[str] = 'polar',
            sorting: Optional[str] = 'ring',
            backend: str = 'auto',
            stride_align: str = 'centre',
            num_classes: int = 10,
            in_chans: int = 1,
            channels: Sequence[int] = (32, 32, 64, 64, 128, 128),
            global_pool: str = 'avg',
            canonicalize: Optional[str] = None,
            input_blur: float = 0.,
            downsample: str = 'max',
            guide_blur: float = 0.,
            guide_ramp: float = 0.,
            sorted_convs: int = 6,
            drop_rate: float = 0.,
            bn_momentum: float = 0.1,
            bn_eps: float = 1e-5,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        if len(channels) != 6:
            raise ValueError(f"SCNN has six convolutions, got channels={tuple(channels)}")
        self.canonicalize = create_canonicalizer(canonicalize)
        if isinstance(input_blur, bool) or not isinstance(input_blur, (int, float)) or not input_blur >= 0:
            raise ValueError(f"input_blur must be a number of pixels >= 0 (0: no blur), got {input_blur!r}")
        conv_layer = get_conv_layer(sampling, sorting, backend, stride_align)
        create_downsample(downsample, stride_align)  # checks the name before anything is built
        guide_blur = check_guide_blur(guide_blur, sorting)
        guide_ramp = check_guide_ramp(guide_ramp, guide_blur, self.canonicalize)
        if isinstance(sorted_convs, bool) or not isinstance(sorted_convs, int) or not 0 <= sorted_convs <= 6:
            raise ValueError(f"sorted_convs must be a whole number of convolutions from 0 to 6, got {sorted_convs!r}")
        plain_layer = get_conv_layer(None, None, backend, stride_align)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False
        self.feature_info = []
        self.feature_ends = []  # index into self.features of each feature_info tap

        kernel_sizes = (kernel_size,) * 4 + (3, 3)
        layers: List[nn.Module] = []
        prev_chs = in_chans
        net_stride = 1
        for idx, (chs, k) in enumerate(zip(channels, kernel_sizes)):
            if idx in (2, 4):
                self.feature_info.append(dict(num_chs=prev_chs, reduction=net_stride, module=f'features.{len(layers) - 1}'))
                self.feature_ends.append(len(layers) - 1)
                layers.append(create_downsample(downsample, stride_align, **dd))
                net_stride *= 2
            pre = GaussianBlur2d(input_blur, **dd) if idx == 0 and input_blur else None
            layer = conv_layer if idx < sorted_convs else plain_layer
            layers.append(ConvNormAct(prev_chs, chs, k, layer, bn_momentum, bn_eps, pre=pre, **dd))
            prev_chs = chs
        self.features = nn.Sequential(*layers)
        self.feature_info.append(dict(num_chs=prev_chs, reduction=net_stride, module=f'features.{len(layers) - 1}'))
        self.feature_ends.append(len(layers) - 1)

        self.num_features = self.head_hidden_size = prev_chs
        self.head = ClassifierHead(prev_chs, num_classes, pool_type=global_pool, drop_rate=drop_rate, **dd)
        if guide_blur:
            attach_guide(self, guide_blur, ramp=guide_ramp)


def _create_scnn(variant: str, kernel_size: int, sampling: Optional[str], sorting: Optional[str],
                 pretrained: bool = False, /, **kwargs: Any) -> SCNN:
    # Positional-only, so that a user's sampling/sorting keyword reaches the check below.
    kwargs = fixed_variant_args(variant, kwargs, sampling, sorting)
    return build_model_with_cfg(
        SCNN,
        variant,
        pretrained,
        kernel_size=kernel_size,
        feature_cfg=dict(flatten_sequential=True, out_indices=(0, 1, 2)),
        **kwargs,
    )


def _cfg(url: str = '', **kwargs) -> Dict[str, Any]:
    return {
        'url': url,
        'num_classes': 10, 'input_size': (1, 28, 28), 'pool_size': (7, 7),
        'crop_pct': 1.0, 'interpolation': 'bilinear',
        # mean and std of the 60,000 MNIST training images' pixels in [0, 1]
        'mean': (0.1307,), 'std': (0.3081,),
        'first_conv': 'features.0.conv', 'classifier': 'head.fc',
        **PAPER_CFG,
        **kwargs,
    }


def _pretrained(model_name: str) -> Dict[str, Any]:
    # Weights that scripts/push_to_hub.py --bundle copied into bundled_weights_dir() (the package's weights/
    # folder, or TIMM_SORTCONV_WEIGHTS_DIR) load with pretrained=True, offline; checked once, at import. The
    # same weights are published as HUB_ORG/<model>.mnist (timm loads the bundled file first, no network).
    weights = bundled_weights_dir() / f'{model_name}.safetensors'
    if not weights.is_file():
        return {}
    return {'file': str(weights), 'hf_hub_id': f'{HUB_ORG}/{model_name}.mnist'}


default_cfgs = generate_default_cfgs({
    **{f'scnn_{variant}_{k}.mnist': _cfg(**_pretrained(f'scnn_{variant}_{k}'))
       for variant in ('s_gs', 's_rs', 'p_gs', 'p_rs', 'baseline') for k in (3, 5, 7)},
    'scnn_p_rs_7_canon.mnist': _cfg(**_pretrained('scnn_p_rs_7_canon')),
    'scnn_p_c2_7_canon.mnist': _cfg(**_pretrained('scnn_p_c2_7_canon')),
    'scnn_p_rs_7_blur.mnist': _cfg(**_pretrained('scnn_p_rs_7_blur')),
    'scnn_p_rs_7_early_canon.mnist': _cfg(**_pretrained('scnn_p_rs_7_early_canon')),
    'scnn_p_align_7_guided.mnist': _cfg(**_pretrained('scnn_p_align_7_guided')),
    'scnn_p_align_7_guided_canon.mnist': _cfg(**_pretrained('scnn_p_align_7_guided_canon')),
})


@register_model
def scnn_s_gs_3(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, square sampling, global sorting, 3x3 kernels."""
    return _create_scnn('scnn_s_gs_3', 3, 'square', 'global', pretrained, **kwargs)


@register_model
def scnn_s_gs_5(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, square sampling, global sorting, 5x5 kernels in the first four layers."""
    return _create_scnn('scnn_s_gs_5', 5, 'square', 'global', pretrained, **kwargs)


@register_model
def scnn_s_gs_7(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, square sampling, global sorting, 7x7 kernels in the first four layers."""
    return _create_scnn('scnn_s_gs_7', 7, 'square', 'global', pretrained, **kwargs)


@register_model
def scnn_s_rs_3(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, square sampling, ring sorting, 3x3 kernels."""
    return _create_scnn('scnn_s_rs_3', 3, 'square', 'ring', pretrained, **kwargs)


@register_model
def scnn_s_rs_5(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, square sampling, ring sorting, 5x5 kernels in the first four layers."""
    return _create_scnn('scnn_s_rs_5', 5, 'square', 'ring', pretrained, **kwargs)


@register_model
def scnn_s_rs_7(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, square sampling, ring sorting, 7x7 kernels in the first four layers."""
    return _create_scnn('scnn_s_rs_7', 7, 'square', 'ring', pretrained, **kwargs)


@register_model
def scnn_p_gs_3(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, polar sampling, global sorting, 3x3 kernels."""
    return _create_scnn('scnn_p_gs_3', 3, 'polar', 'global', pretrained, **kwargs)


@register_model
def scnn_p_gs_5(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, polar sampling, global sorting, 5x5 kernels in the first four layers."""
    return _create_scnn('scnn_p_gs_5', 5, 'polar', 'global', pretrained, **kwargs)


@register_model
def scnn_p_gs_7(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, polar sampling, global sorting, 7x7 kernels in the first four layers."""
    return _create_scnn('scnn_p_gs_7', 7, 'polar', 'global', pretrained, **kwargs)


@register_model
def scnn_p_rs_3(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, polar sampling, ring sorting, 3x3 kernels."""
    return _create_scnn('scnn_p_rs_3', 3, 'polar', 'ring', pretrained, **kwargs)


@register_model
def scnn_p_rs_5(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, polar sampling, ring sorting, 5x5 kernels in the first four layers."""
    return _create_scnn('scnn_p_rs_5', 5, 'polar', 'ring', pretrained, **kwargs)


@register_model
def scnn_p_rs_7(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """SCNN, polar sampling, ring sorting, 7x7 kernels in the first four layers (the paper's best, P-RS-7)."""
    return _create_scnn('scnn_p_rs_7', 7, 'polar', 'ring', pretrained, **kwargs)


@register_model
def scnn_baseline_3(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """The plain-convolution baseline of the SCNNs with 3x3 kernels."""
    return _create_scnn('scnn_baseline_3', 3, None, None, pretrained, **kwargs)


@register_model
def scnn_baseline_5(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """The plain-convolution baseline of the SCNNs with 5x5 kernels in the first four layers."""
    return _create_scnn('scnn_baseline_5', 5, None, None, pretrained, **kwargs)


@register_model
def scnn_baseline_7(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """The plain-convolution baseline of the SCNNs with 7x7 kernels in the first four layers."""
    return _create_scnn('scnn_baseline_7', 7, None, None, pretrained, **kwargs)


@register_model
def scnn_p_rs_7_canon(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """``scnn_p_rs_7`` whose input is first turned to its principal axis (``canonicalize='moment2'``):
    the same weights' shapes, invariant to every angle up to interpolation (see :mod:`timm_sortconv.canonical`)."""
    kwargs.setdefault('canonicalize', 'moment2')
    return _create_scnn('scnn_p_rs_7_canon', 7, 'polar', 'ring', pretrained, **kwargs)


@register_model
def scnn_p_c2_7_canon(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """The P-RS-7 network with half-turn orbit sorting (``sorting='c2'``: each ring's samples sorted in pairs
    180 degrees apart) and its input turned to its principal axis (``canonicalize='moment2'``): the turn
    leaves a multiple of 180 degrees over, which c2 ignores exactly, and c2 keeps the direction modulo 180
    degrees that ring sorting discards. The same weights' shapes as ``scnn_baseline_7``."""
    kwargs.setdefault('canonicalize', 'moment2')
    return _create_scnn('scnn_p_c2_7_canon', 7, 'polar', 'c2', pretrained, **kwargs)


@register_model
def scnn_p_rs_7_blur(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """P-RS-7 with a Gaussian blur (0.7 px) before the first convolution and blurred max pooling: the SC network
    that keeps its accuracy when the parts of a scene are turned independently (RESULTS.md, "Local rotations")."""
    kwargs.setdefault('input_blur', 0.7)
    kwargs.setdefault('downsample', 'blur-max')
    return _create_scnn('scnn_p_rs_7_blur', 7, 'polar', 'ring', pretrained, **kwargs)


@register_model
def scnn_p_rs_7_early_canon(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """P-RS-7 that sorts in its first two convolutions only (``sorted_convs=2``; the other four are plain) with
    its input turned by its first angular moment (``canonicalize='moment1'``): exactly invariant to quarter
    turns (the turn), the early responses unchanged by small turned patches (SC), and the later layers free to
    see a digit's orientation. Above the plain CNN with rotation augmentation and the E(2)-CNN when trained on
    1,000 images (RESULTS.md, "When to pick SC"). The same weights' shapes as ``scnn_baseline_7``."""
    kwargs.setdefault('canonicalize', 'moment1')
    kwargs.setdefault('sorted_convs', 2)
    return _create_scnn('scnn_p_rs_7_early_canon', 7, 'polar', 'ring', pretrained, **kwargs)


@register_model
def scnn_p_align_7_guided(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """The P-RS-7 layout with aligned windows (``sorting='align'``) in all six convolutions, each window turned by the
    orientation of the input blurred by 4 pixels around it (``guide_blur=4``, :mod:`timm_sortconv.guide`): the
    windows of one part of a scene turn alike, so the network follows parts turned independently (RESULTS.md, "When
    to pick SC"). Exactly invariant to quarter turns; the same weights' shapes as ``scnn_baseline_7``."""
    kwargs.setdefault('guide_blur', 4.0)
    return _create_scnn('scnn_p_align_7_guided', 7, 'polar', 'align', pretrained, **kwargs)


@register_model
def scnn_p_align_7_guided_canon(pretrained: bool = False, **kwargs: Any) -> SCNN:
    """``scnn_p_align_7_guided`` whose input is first turned by its first angular moment (``canonicalize='moment1'``)
    and whose guide carries that canonical orientation (``guide_ramp=0.02``, :mod:`timm_sortconv.guide`): where the
    blurred input is flat its windows turn with the whole image, elsewhere with its parts. One network for
    whole-image turns and for parts turned independently (RESULTS.md, "When to pick SC"). Exactly invariant to
    quarter turns; the same weights' shapes as ``scnn_baseline_7``."""
    kwargs.setdefault('canonicalize', 'moment1')
    kwargs.setdefault('guide_blur', 4.0)
    kwargs.setdefault('guide_ramp', 0.02)
    return _create_scnn('scnn_p_align_7_guided_canon', 7, 'polar', 'align', pretrained, **kwargs)
