"""RI-DenseNet40: DenseNet-40 with Sorting Convolutions for 128x128 inputs, and its plain-conv twin.

DenseNet-40 (growth rate 12, no bottleneck, no compression): a ``3 x 3`` stride-2 stem convolution with
24 channels and 2x2 max pooling (for 128x128 inputs), three dense blocks of 12 BN-ReLU-conv3x3 layers,
transitions BN-ReLU-conv1x1-avgpool2x2 between them, and a BN-ReLU, global pooling, linear head.
``ri_densenet40`` uses ``SortConv2d`` in the stem and in every ``3 x 3`` layer; the ``1 x 1``
transition convolutions stay ``nn.Conv2d``. ``ri_densenet40_baseline`` uses ``nn.Conv2d`` everywhere.

With ``stride_align='centre'`` (default) the strided stem, the max pooling and the transitions' average
pooling centre their grid on the image (:mod:`timm_sortconv.grid`), so ``ri_densenet40`` is exactly invariant
to quarter turns at every input size; with ``stride_align='corner'`` (the paper's network) only at sides
``16 m - 1`` (15, 31, ..., 127).

Papers:
* `Sorting Convolution Operation for Achieving Rotational Invariance` - https://arxiv.org/abs/2305.14462
* `Densely Connected Convolutional Networks` - https://arxiv.org/abs/1608.06993
"""
from collections import OrderedDict
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import BatchNormAct2d, create_classifier, get_device_dtype
from timm.models import build_model_with_cfg, checkpoint, generate_default_cfgs, register_model
from timm.models._manipulate import MATCH_PREV_GROUP

from ..canonical import create_canonicalizer
from ..grid import pool_class
from ._common import SequentialFeaturesMixin, ri_cfg
from ._conv import fixed_variant_args, get_conv_layer

__all__ = ['SortDenseNet']


class DenseLayer(nn.Module):
    """BN-ReLU-conv3x3 on the concatenation of all previous feature maps; adds ``growth_rate`` channels."""

    def __init__(
            self,
            num_input_features: int,
            growth_rate: int,
            conv_layer: Callable[..., nn.Module] = nn.Conv2d,
            norm_layer: Callable[..., nn.Module] = BatchNormAct2d,
            drop_rate: float = 0.,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.norm = norm_layer(num_input_features, **dd)
        self.conv = conv_layer(num_input_features, growth_rate, 3, padding=1, bias=False, **dd)
        self.drop_rate = float(drop_rate)
        self.grad_checkpointing = False

    def _new_features(self, features: List[torch.Tensor]) -> torch.Tensor:
        return self.conv(self.norm(torch.cat(features, 1)))

    @torch.jit.unused
    def _checkpointed(self, features: List[torch.Tensor]) -> torch.Tensor:
        return checkpoint(lambda *inputs: self._new_features(list(inputs)), *features)

    def forward(self, features: List[torch.Tensor]) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting() and any(f.requires_grad for f in features):
            x = self._checkpointed(features)
        else:
            x = self._new_features(features)
        if self.drop_rate > 0:
            x = F.dropout(x, p=self.drop_rate, training=self.training)
        return x


class DenseBlock(nn.ModuleDict):
    """``num_layers`` dense layers; returns the input and all their outputs, concatenated."""

    def __init__(
            self,
            num_layers: int,
            num_input_features: int,
            growth_rate: int,
            conv_layer: Callable[..., nn.Module] = nn.Conv2d,
            norm_layer: Callable[..., nn.Module] = BatchNormAct2d,
            drop_rate: float = 0.,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        for i in range(num_layers):
            self.add_module(f'denselayer{i + 1}', DenseLayer(
                num_input_features + i * growth_rate,
                growth_rate,
                conv_layer=conv_layer,
                norm_layer=norm_layer,
                drop_rate=drop_rate,
                device=device,
                dtype=dtype,
            ))

    def forward(self, init_features: torch.Tensor) -> torch.Tensor:
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseTransition(nn.Sequential):
    """BN-ReLU, ``1 x 1`` convolution (plain: it commutes with rotation), 2x2 average pooling."""

    def __init__(
            self,
            num_input_features: int,
            num_output_features: int,
            norm_layer: Callable[..., nn.Module] = BatchNormAct2d,
            pool_layer: Callable[..., nn.Module] = nn.AvgPool2d,
            device=None,
            dtype=None,
    ) -> None:
        dd = {'device': device, 'dtype': dtype}
        super().__init__(OrderedDict([
            ('norm', norm_layer(num_input_features, **dd)),
            ('conv', nn.Conv2d(num_input_features, num_output_features, 1, bias=False, **dd)),
            ('pool', pool_layer(kernel_size=2, stride=2)),
        ]))


class SortDenseNet(SequentialFeaturesMixin, nn.Module):
    """DenseNet without bottlenecks, with sorting (``sampling``/``sorting`` given) or plain ``3 x 3`` convolutions.

    Args:
        growth_rate: channels added by each dense layer.
        block_config: dense layers per block.
        sampling: ``'polar'`` or ``'square'``, or ``None`` with ``sorting=None`` for ``nn.Conv2d``.
        sorting: ``'ring'``, ``'global'``, ``'c4'`` or ``'c2'`` (:func:`~timm_sortconv.sort_conv2d`), or ``None``.
        backend: the ``SortConv2d`` backend (``'auto'``, ``'reference'`` or a fast backend's name).
        stride_align: ``'centre'`` (default: every strided layer's grid centred on the image, so that the network
            is exactly invariant to quarter turns at every input size, :mod:`timm_sortconv.grid`) or ``'corner'``
            (PyTorch's grid, the paper's network: exact only at some sizes).
        num_classes: classifier outputs (0: no classifier).
        in_chans: input channels.
        stem_width: channels of the stem convolution (``2 * growth_rate`` in DenseNet-40).
        global_pool: timm pooling type (``'avg'``, ``'max'``, ``'avgmax'``, ``'catavgmax'``).
        canonicalize: ``None`` or ``'moment2'``/``'moment4'``/``'moment1'``: turn each input image about its
            centre to the orientation of its angular moment first (:mod:`timm_sortconv.canonical`); no
            parameters. Measured on MNIST-rot only (RESULTS.md).
        drop_rate: dropout before the classifier.
        proj_drop_rate: dropout after each dense layer (as timm's DenseNet).
        bn_momentum, bn_eps: BatchNorm settings.

    ``forward_intermediates`` taps the stem convolution, the dense blocks before the last, and the final norm.
    """

    def __init__(
            self,
            growth_rate: int = 12,
            block_config: Sequence[int] = (12, 12, 12),
            sampling: Optional[str] = 'polar',
            sorting: Optional[str] = 'ring',
            backend: str = 'auto',
            stride_align: str = 'centre',
            num_classes: int = 45,
            in_chans: int = 3,
            stem_width: int = 24,
            global_pool: str = 'avg',
            canonicalize: Optional[str] = None,
            drop_rate: float = 0.,
            proj_drop_rate: float = 0.,
            bn_momentum: float = 0.1,
            bn_eps: float = 1e-5,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        conv_layer = get_conv_layer(sampling, sorting, backend, stride_align)
        self.canonicalize = create_canonicalizer(canonicalize)
        norm_layer = partial(BatchNormAct2d, eps=bn_eps, momentum=bn_momentum)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate

        self.features = nn.Sequential(OrderedDict([
            ('conv0', conv_layer(in_chans, stem_width, 3, stride=2, padding=1, bias=False, **dd)),
            ('pool0', pool_class('max', stride_align)(kernel_size=2, stride=2)),
        ]))
        self.feature_info = [dict(num_chs=stem_width, reduction=2, module='features.conv0')]
        reduction = 4
        num_features = stem_width
        for i, num_layers in enumerate(block_config):
            name = f'denseblock{i + 1}'
            self.features.add_module(name, DenseBlock(
                num_layers,
                num_features,
                growth_rate,
                conv_layer=conv_layer,
                norm_layer=norm_layer,
                drop_rate=proj_drop_rate,
                **dd,
            ))
            num_features += num_layers * growth_rate
            if i != len(block_config) - 1:
                self.feature_info.append(dict(num_chs=num_features, reduction=reduction, module=f'features.{name}'))
                self.features.add_module(f'transition{i + 1}', DenseTransition(
                    num_features, num_features, norm_layer, pool_class('avg', stride_align), **dd))
                reduction *= 2
        self.features.add_module('norm', norm_layer(num_features, **dd))
        self.feature_info.append(dict(num_chs=num_features, reduction=reduction, module='features.norm'))
        feature_names = [n for n, _ in self.features.named_children()]
        self.feature_ends = [feature_names.index(f['module'].split('.', 1)[1]) for f in self.feature_info]

        self.num_features = num_features
        self.global_pool, self.classifier = create_classifier(num_features, num_classes, pool_type=global_pool, **dd)
        self.head_hidden_size = num_features * self.global_pool.feat_mult()
        self.head_drop = nn.Dropout(drop_rate)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(
            stem=r'^features\.conv0',
            blocks=r'^features\.(?:denseblock|transition)(\d+)' if coarse else [
                (r'^features\.denseblock(\d+)\.denselayer(\d+)', None),
                (r'^features\.transition(\d+)', MATCH_PREV_GROUP),
            ],
        )

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for m in self.features.modules():
            if isinstance(m, DenseLayer):
                m.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self, name_only: bool = False) -> Union[str, nn.Module]:
        return 'classifier' if name_only else self.classifier

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        dd = get_device_dtype(self)
        self.num_classes = num_classes
        if global_pool is None:
            global_pool = self.global_pool.pool_type
        self.global_pool, self.classifier = create_classifier(self.num_features, num_classes, pool_type=global_pool, **dd)
        self.head_hidden_size = self.num_features * self.global_pool.feat_mult()
        self.global_pool.train(self.training)
        self.classifier.train(self.training)

    def _forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.global_pool(x)
        x = self.head_drop(x)
        return x if pre_logits else self.classifier(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        return self.forward_head(x)


def _create_densenet(variant: str, pretrained: bool = False, **kwargs: Any) -> SortDenseNet:
    return build_model_with_cfg(SortDenseNet, variant, pretrained, feature_cfg=dict(flatten_sequential=True, out_indices=(0, 1, 2, 3)), **kwargs)


def _cfg(dataset: str = 'nwpu', **kwargs) -> Dict[str, Any]:
    return ri_cfg(first_conv='features.conv0', classifier='classifier', pool_size=(8, 8), dataset=dataset, **kwargs)


default_cfgs = generate_default_cfgs({
    'ri_densenet40.nwpu': _cfg(),
    'ri_densenet40.outex': _cfg('outex'),
    'ri_densenet40_baseline.nwpu': _cfg(),
    'ri_densenet40_baseline.outex': _cfg('outex'),
})


@register_model
def ri_densenet40(pretrained: bool = False, **kwargs: Any) -> SortDenseNet:
    """RI-DenseNet40: ``SortConv2d`` in the 3x3 stride-2 stem and all 36 dense layers."""
    model_args = dict(growth_rate=12, block_config=(12, 12, 12), sampling='polar', sorting='ring')
    return _create_densenet('ri_densenet40', pretrained, **dict(model_args, **kwargs))


@register_model
def ri_densenet40_baseline(pretrained: bool = False, **kwargs: Any) -> SortDenseNet:
    """The plain-convolution twin of ``ri_densenet40`` (same layers and parameters, ``nn.Conv2d``)."""
    model_args = dict(growth_rate=12, block_config=(12, 12, 12))
    return _create_densenet('ri_densenet40_baseline', pretrained,
                            **fixed_variant_args('ri_densenet40_baseline', dict(model_args, **kwargs), None, None))
