"""RI-VGG16: VGG16 with Sorting Convolutions and a global-pooling head, and its plain-conv twin.

The paper's texture / remote-sensing VGG16 for 128x128 inputs: 13 ``3 x 3`` convolutions
(64, 64, M, 128, 128, M, 256 x 3, M, 512 x 3, M, 512 x 3, M), each followed by BatchNorm and ReLU
(``vgg16_bn``'s layout; the paper trains from scratch), then global average pooling and one linear
classifier. There is no flatten of a spatial map and no 7x7 ``ConvMlp``: everything after the last
convolution is a global pooling, so nothing in the head breaks rotation invariance. All convolutions
have stride 1; with ``stride_align='centre'`` (default) every max pooling centres its grid on the image
(:mod:`timm_sortconv.grid`), so ``ri_vgg16`` is exactly invariant to quarter turns at every input size; with
``stride_align='corner'`` (the paper's network) only where every pooling tiles an even-sized map (multiples
of 32).

``ri_vgg16`` uses ``SortConv2d`` (default polar sampling, ring sorting; ``sampling``/``sorting``
choose another variant), ``ri_vgg16_baseline`` uses ``nn.Conv2d`` with identical parameters.

Papers:
* `Sorting Convolution Operation for Achieving Rotational Invariance` - https://arxiv.org/abs/2305.14462
* `Very Deep Convolutional Networks for Large-Scale Image Recognition` - https://arxiv.org/abs/1409.1556
"""
from typing import Any, Dict, List, Optional, Sequence, Union

import torch.nn as nn

from timm.layers import ClassifierHead
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from ..canonical import create_canonicalizer
from ..grid import pool_class
from ._common import SequentialClassifierMixin, ri_cfg
from ._conv import ConvNormAct, fixed_variant_args, get_conv_layer

__all__ = ['SortVGG']

cfgs: Dict[str, List[Union[str, int]]] = {
    'vgg16': [64, 64, 'M', 128, 128, 'M', 256, 256, 256, 'M', 512, 512, 512, 'M', 512, 512, 512, 'M'],
}


class SortVGG(SequentialClassifierMixin, nn.Module):
    """VGG with BatchNorm, sorting (``sampling``/``sorting`` given) or plain (both ``None``) convolutions,
    and a global-pooling head.

    Args:
        cfg: layer widths and ``'M'`` (2x2 max pooling), as timm's ``vgg.cfgs``.
        sampling: ``'polar'`` or ``'square'``, or ``None`` with ``sorting=None`` for ``nn.Conv2d``.
        sorting: ``'ring'``, ``'global'``, ``'c4'`` or ``'c2'`` (:func:`~timm_sortconv.sort_conv2d`), or ``None``.
        backend: the ``SortConv2d`` backend (``'auto'``, ``'reference'`` or a fast backend's name).
        stride_align: ``'centre'`` (default: every strided layer's grid centred on the image, so that the network
            is exactly invariant to quarter turns at every input size, :mod:`timm_sortconv.grid`) or ``'corner'``
            (PyTorch's grid, the paper's network: exact only at some sizes).
        num_classes: classifier outputs (0: no classifier).
        in_chans: input channels.
        global_pool: timm pooling type (``'avg'``, ``'max'``, ``'avgmax'``, ``'catavgmax'``).
        canonicalize: ``None`` or ``'moment2'``/``'moment4'``/``'moment1'``: turn each input image about its
            centre to the orientation of its angular moment first (:mod:`timm_sortconv.canonical`); no
            parameters. Measured on MNIST-rot only (RESULTS.md).
        drop_rate: dropout before the classifier.
        bn_momentum, bn_eps: BatchNorm settings.

    ``forward_intermediates`` taps the output before each max pooling, and after the last one.
    """

    def __init__(
            self,
            cfg: Sequence[Union[str, int]],
            sampling: Optional[str] = 'polar',
            sorting: Optional[str] = 'ring',
            backend: str = 'auto',
            stride_align: str = 'centre',
            num_classes: int = 45,
            in_chans: int = 3,
            global_pool: str = 'avg',
            canonicalize: Optional[str] = None,
            drop_rate: float = 0.,
            bn_momentum: float = 0.1,
            bn_eps: float = 1e-5,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        conv_layer = get_conv_layer(sampling, sorting, backend, stride_align)
        pool_layer = pool_class('max', stride_align)
        self.canonicalize = create_canonicalizer(canonicalize)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False
        self.feature_info = []
        self.feature_ends = []  # index into self.features of each feature_info tap

        prev_chs = in_chans
        net_stride = 1
        layers: List[nn.Module] = []
        for v in cfg:
            if v == 'M':
                self.feature_info.append(dict(num_chs=prev_chs, reduction=net_stride, module=f'features.{len(layers) - 1}'))
                self.feature_ends.append(len(layers) - 1)
                layers.append(pool_layer(kernel_size=2, stride=2))
                net_stride *= 2
            else:
                layers.append(ConvNormAct(prev_chs, v, 3, conv_layer, bn_momentum, bn_eps, **dd))
                prev_chs = v
        self.features = nn.Sequential(*layers)
        # as timm's VGG: a last tap after the final max pooling, the output of forward_features
        self.feature_info.append(dict(num_chs=prev_chs, reduction=net_stride, module=f'features.{len(layers) - 1}'))
        self.feature_ends.append(len(layers) - 1)

        self.num_features = self.head_hidden_size = prev_chs
        self.head = ClassifierHead(prev_chs, num_classes, pool_type=global_pool, drop_rate=drop_rate, **dd)
        self._initialize_weights()

    def _initialize_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)



def _create_vgg(variant: str, pretrained: bool = False, **kwargs: Any) -> SortVGG:
    cfg = variant.split('_')[1]
    return build_model_with_cfg(
        SortVGG,
        variant,
        pretrained,
        model_cfg=cfgs[cfg],
        feature_cfg=dict(flatten_sequential=True, out_indices=(0, 1, 2, 3, 4, 5)),
        **kwargs,
    )


def _cfg(dataset: str = 'nwpu', **kwargs) -> Dict[str, Any]:
    return ri_cfg(first_conv='features.0.conv', classifier='head.fc', pool_size=(4, 4), dataset=dataset, **kwargs)


default_cfgs = generate_default_cfgs({
    'ri_vgg16.nwpu': _cfg(),
    'ri_vgg16.outex': _cfg('outex'),
    'ri_vgg16_baseline.nwpu': _cfg(),
    'ri_vgg16_baseline.outex': _cfg('outex'),
})


@register_model
def ri_vgg16(pretrained: bool = False, **kwargs: Any) -> SortVGG:
    """RI-VGG16: VGG16-BN with ``SortConv2d`` in all 13 convolutions and a global-pooling head."""
    model_args = dict(sampling='polar', sorting='ring')
    return _create_vgg('ri_vgg16', pretrained=pretrained, **dict(model_args, **kwargs))


@register_model
def ri_vgg16_baseline(pretrained: bool = False, **kwargs: Any) -> SortVGG:
    """The plain-convolution twin of ``ri_vgg16`` (same layers and parameters, ``nn.Conv2d``)."""
    return _create_vgg('ri_vgg16_baseline', pretrained=pretrained,
                       **fixed_variant_args('ri_vgg16_baseline', kwargs, None, None))
