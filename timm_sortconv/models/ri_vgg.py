"""RI-VGG16: VGG16 with Sorting Convolutions and a global-pooling head, and its plain-conv twin.

The paper's texture / remote-sensing VGG16 for 128x128 inputs: 13 ``3 x 3`` convolutions
(64, 64, M, 128, 128, M, 256 x 3, M, 512 x 3, M, 512 x 3, M), each followed by BatchNorm and ReLU
(``vgg16_bn``'s layout; the paper trains from scratch), then global average pooling and one linear
classifier. There is no flatten of a spatial map and no 7x7 ``ConvMlp``: everything after the last
convolution is a global pooling, so nothing in the head breaks rotation invariance. All convolutions
have stride 1 and every max pooling tiles even-sized maps, so ``ri_vgg16`` is exactly invariant to
90-degree rotations of any input whose side is a multiple of 32.

``ri_vgg16`` uses ``SortConv2d`` (default polar sampling, ring sorting; ``sampling``/``sorting``
choose another variant), ``ri_vgg16_baseline`` uses ``nn.Conv2d`` with identical parameters.

Papers:
* `Sorted Convolutional Network for Achieving Continuous Rotational Invariance` - https://arxiv.org/abs/2305.14462
* `Very Deep Convolutional Networks for Large-Scale Image Recognition` - https://arxiv.org/abs/1409.1556
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, get_device_dtype
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from ..sortify import fixed_variant_args, get_conv_layer
from .scnn import ConvNormAct

__all__ = ['SortVGG']

cfgs: Dict[str, List[Union[str, int]]] = {
    'vgg16': [64, 64, 'M', 128, 128, 'M', 256, 256, 256, 'M', 512, 512, 512, 'M', 512, 512, 512, 'M'],
}


class SortVGG(nn.Module):
    """VGG with BatchNorm, sorting (``sampling``/``sorting`` given) or plain (both ``None``) convolutions,
    and a global-pooling head.

    Args:
        cfg: layer widths and ``'M'`` (2x2 max pooling), as timm's ``vgg.cfgs``.
        sampling: ``'polar'`` or ``'square'``, or ``None`` with ``sorting=None`` for ``nn.Conv2d``.
        sorting: ``'ring'`` or ``'global'``, or ``None``.
        num_classes: classifier outputs (0: no classifier).
        in_chans: input channels.
        global_pool: timm pooling type (``'avg'``, ``'max'``, ``'avgmax'``, ``'catavgmax'``).
        drop_rate: dropout before the classifier.
        bn_momentum, bn_eps: BatchNorm settings.
    """

    def __init__(
            self,
            cfg: Sequence[Union[str, int]],
            sampling: Optional[str] = 'polar',
            sorting: Optional[str] = 'ring',
            num_classes: int = 45,
            in_chans: int = 3,
            global_pool: str = 'avg',
            drop_rate: float = 0.,
            bn_momentum: float = 0.1,
            bn_eps: float = 1e-5,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        conv_layer = get_conv_layer(sampling, sorting)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.sampling = sampling
        self.sorting = sorting
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
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
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

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^features\.0\.', blocks=r'^features\.(\d+)')

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        self.head.reset(num_classes, global_pool, **get_device_dtype(self))
        self.head_hidden_size = self.head.num_features

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Features and intermediates: indices 0-4 before each max pooling, 5 after the last one.

        Args:
            x: input images.
            indices: last n taps if int, all if None, these ones if a sequence.
            norm: unused (no final norm).
            stop_early: stop after the last requested tap.
            output_fmt: ``'NCHW'`` only.
            intermediates_only: return only the intermediates.
        """
        assert output_fmt == 'NCHW', 'Output shape must be NCHW.'
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.feature_ends), indices)
        layers = self.features if torch.jit.is_scripting() or not stop_early else (
            self.features[:self.feature_ends[max_index] + 1])
        feat_idx = 0
        for i, layer in enumerate(layers):
            x = layer(x)
            if feat_idx < len(self.feature_ends) and i == self.feature_ends[feat_idx]:
                if feat_idx in take_indices:
                    intermediates.append(x)
                feat_idx += 1
        if intermediates_only:
            return intermediates
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Drops the layers after the last tap in ``indices`` (and the classifier if ``prune_head``)."""
        take_indices, max_index = feature_take_indices(len(self.feature_ends), indices)
        prune_end = max_index < len(self.feature_ends) - 1
        self.features = self.features[:self.feature_ends[max_index] + 1]
        if prune_end:
            # the features now end at the last kept tap; the head, sized for the final features, goes too
            self.num_features = self.feature_info[max_index]['num_chs']
        if prune_head or prune_end:
            self.num_classes = 0
            self.head.reset(0, '', in_features=self.num_features, **get_device_dtype(self))
            self.head_hidden_size = self.num_features
        return take_indices

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.features, x)
        return self.features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        return self.forward_head(x)


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


def _cfg(url: str = '', **kwargs) -> Dict[str, Any]:
    return {
        'url': url,
        'num_classes': 45, 'input_size': (3, 128, 128), 'pool_size': (4, 4),
        'crop_pct': 1.0, 'interpolation': 'bilinear',
        'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'features.0.conv', 'classifier': 'head.fc',
        'license': 'apache-2.0',
        'paper_ids': 'arXiv:2305.14462',
        'paper_name': 'Sorted Convolutional Network for Achieving Continuous Rotational Invariance',
        **kwargs,
    }


def _outex_cfg(url: str = '', **kwargs) -> Dict[str, Any]:
    # Outex_TC_00012: 24 grayscale texture classes; inputs in [0, 1] are mapped to [-1, 1].
    return _cfg(url=url, **dict(dict(num_classes=24, input_size=(1, 128, 128), mean=(0.5,), std=(0.5,)), **kwargs))


default_cfgs = generate_default_cfgs({
    'ri_vgg16.nwpu': _cfg(),
    'ri_vgg16.outex': _outex_cfg(),
    'ri_vgg16_baseline.nwpu': _cfg(),
    'ri_vgg16_baseline.outex': _outex_cfg(),
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
