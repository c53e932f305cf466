"""RI-ResNet18: ResNet18 with Sorting Convolutions for 128x128 inputs, and its plain-conv twin.

The paper's ResNet18 for texture and remote-sensing images: a ``3 x 3`` stride-1 stem convolution with
BatchNorm and ReLU, 2x2 max pooling, four stages of two BasicBlocks (64, 128, 256, 512 channels;
stages 2-4 start with stride 2), global average pooling and a linear classifier. ``ri_resnet18`` uses
``SortConv2d`` in every ``3 x 3`` convolution, the strided ones included; the ``1 x 1`` shortcut
projections stay ``nn.Conv2d`` (a ``1 x 1`` convolution already commutes with rotation).
``ri_resnet18_baseline`` is the same network with ``nn.Conv2d`` everywhere.

A stride-2 layer samples every other pixel, which maps onto itself under a 90-degree rotation only
for some input sizes. With ``stride_align='centre'`` (default) the max pooling, the strided ``3 x 3``
convolutions and the strided ``1 x 1`` shortcuts all centre their grid on the image
(:mod:`timm_sortconv.grid`), so ``ri_resnet18`` is exactly invariant to quarter turns at every input
size; ``stride_align='corner'`` is the paper's network, exact only for sides 2 * m with m, (m + 1) / 2 and
(m + 3) / 4 odd (18, 50, 114, ...).

Papers:
* `Sorting Convolution Operation for Achieving Rotational Invariance` - https://arxiv.org/abs/2305.14462
* `Deep Residual Learning for Image Recognition` - https://arxiv.org/abs/1512.03385
"""
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from timm.layers import DropBlock2d, DropPath, create_classifier, get_device_dtype
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices

from ..canonical import CanonicalInputMixin, create_canonicalizer
from ..grid import plain_conv_layer, pool_class
from ._conv import fixed_variant_args, get_conv_layer
from ._common import ri_cfg

__all__ = ['SortResNet', 'BasicBlock']


class BasicBlock(nn.Module):
    """ResNet's basic block: two ``3 x 3`` convolutions of ``conv_layer`` and a (projected) shortcut."""
    expansion = 1

    def __init__(
            self,
            inplanes: int,
            planes: int,
            stride: int = 1,
            downsample: Optional[nn.Module] = None,
            conv_layer: Callable[..., nn.Module] = nn.Conv2d,
            norm_layer: Callable[..., nn.Module] = nn.BatchNorm2d,
            drop_block: Optional[Callable[[], nn.Module]] = None,
            drop_path: Optional[nn.Module] = None,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.conv1 = conv_layer(inplanes, planes, 3, stride=stride, padding=1, bias=False, **dd)
        self.bn1 = norm_layer(planes, **dd)
        self.drop_block = drop_block() if drop_block is not None else nn.Identity()
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = conv_layer(planes, planes, 3, padding=1, bias=False, **dd)
        self.bn2 = norm_layer(planes, **dd)
        self.act2 = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path = drop_path

    def zero_init_last(self) -> None:
        nn.init.zeros_(self.bn2.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.drop_block(x)
        x = self.act1(x)
        x = self.conv2(x)
        x = self.bn2(x)
        if self.drop_path is not None:
            x = self.drop_path(x)
        if self.downsample is not None:
            shortcut = self.downsample(shortcut)
        x += shortcut
        return self.act2(x)


def _drop_blocks(drop_block_rate: float) -> List[Optional[Callable[[], nn.Module]]]:
    # As timm's ResNet: DropBlock in the last two stages only.
    if not drop_block_rate:
        return [None] * 4
    return [None, None,
            partial(DropBlock2d, drop_prob=drop_block_rate, block_size=5, gamma_scale=0.25),
            partial(DropBlock2d, drop_prob=drop_block_rate, block_size=3, gamma_scale=1.00)]


class SortResNet(CanonicalInputMixin, nn.Module):
    """ResNet with a ``3 x 3`` stride-1 stem and 2x2 max pooling, sorting or plain ``3 x 3`` convolutions.

    Args:
        layers: BasicBlocks per stage.
        channels: widths of the stages.
        sampling: ``'polar'`` or ``'square'``, or ``None`` with ``sorting=None`` for ``nn.Conv2d``.
        sorting: ``'ring'``, ``'global'``, ``'c4'`` or ``'c2'`` (:func:`~timm_sortconv.sort_conv2d`), or ``None``.
        backend: the ``SortConv2d`` backend (``'auto'``, ``'reference'`` or a fast backend's name).
        stride_align: ``'centre'`` (default: every strided layer's grid centred on the image, so that the network
            is exactly invariant to quarter turns at every input size, :mod:`timm_sortconv.grid`) or ``'corner'``
            (PyTorch's grid, the paper's network: exact only at some sizes).
        num_classes: classifier outputs (0: no classifier).
        in_chans: input channels.
        stem_width: channels of the stem convolution.
        global_pool: timm pooling type (``'avg'``, ``'max'``, ``'avgmax'``, ``'catavgmax'``).
        canonicalize: ``None`` or ``'moment2'``/``'moment4'``/``'moment1'``: turn each input image about its
            centre to the orientation of its angular moment first (:mod:`timm_sortconv.canonical`); no
            parameters. Measured on MNIST-rot only (RESULTS.md).
        drop_rate: dropout before the classifier.
        drop_path_rate: stochastic depth, linearly increasing over the blocks.
        drop_block_rate: DropBlock in stages 3 and 4.
        zero_init_last: zero the last BatchNorm weight of each block (timm's default).
        bn_momentum, bn_eps: BatchNorm settings.
    """

    def __init__(
            self,
            layers: Sequence[int] = (2, 2, 2, 2),
            channels: Sequence[int] = (64, 128, 256, 512),
            sampling: Optional[str] = 'polar',
            sorting: Optional[str] = 'ring',
            backend: str = 'auto',
            stride_align: str = 'centre',
            num_classes: int = 45,
            in_chans: int = 3,
            stem_width: int = 64,
            global_pool: str = 'avg',
            canonicalize: Optional[str] = None,
            drop_rate: float = 0.,
            drop_path_rate: float = 0.,
            drop_block_rate: float = 0.,
            zero_init_last: bool = True,
            bn_momentum: float = 0.1,
            bn_eps: float = 1e-5,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        self.canonicalize = create_canonicalizer(canonicalize)
        if len(layers) != 4 or len(channels) != 4:
            raise ValueError(f"ResNet has four stages: give four block counts and four widths, got "
                             f"layers={tuple(layers)}, channels={tuple(channels)}")
        conv_layer = get_conv_layer(sampling, sorting, backend, stride_align)
        shortcut_layer = plain_conv_layer(stride_align)
        norm_layer = partial(nn.BatchNorm2d, eps=bn_eps, momentum=bn_momentum)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.drop_rate = drop_rate
        self.grad_checkpointing = False

        self.conv1 = conv_layer(in_chans, stem_width, 3, padding=1, bias=False, **dd)
        self.bn1 = norm_layer(stem_width, **dd)
        self.act1 = nn.ReLU(inplace=True)
        self.maxpool = pool_class('max', stride_align)(kernel_size=2, stride=2)
        self.feature_info = [dict(num_chs=stem_width, reduction=1, module='act1')]

        inplanes = stem_width
        net_stride = 2
        net_num_blocks = sum(layers)
        net_block_idx = 0
        for stage_idx, (num_blocks, planes, drop_block) in enumerate(zip(layers, channels, _drop_blocks(drop_block_rate))):
            stride = 1 if stage_idx == 0 else 2
            net_stride *= stride
            blocks = []
            for block_idx in range(num_blocks):
                downsample = None
                if block_idx == 0 and (stride != 1 or inplanes != planes):
                    downsample = nn.Sequential(
                        shortcut_layer(inplanes, planes, 1, stride=stride, bias=False, **dd),
                        norm_layer(planes, **dd),
                    )
                block_dpr = drop_path_rate * net_block_idx / max(net_num_blocks - 1, 1)
                blocks.append(BasicBlock(
                    inplanes,
                    planes,
                    stride if block_idx == 0 else 1,
                    downsample,
                    conv_layer=conv_layer,
                    norm_layer=norm_layer,
                    drop_block=drop_block,
                    drop_path=DropPath(block_dpr) if block_dpr > 0. else None,
                    **dd,
                ))
                inplanes = planes
                net_block_idx += 1
            stage_name = f'layer{stage_idx + 1}'
            self.add_module(stage_name, nn.Sequential(*blocks))
            self.feature_info.append(dict(num_chs=planes, reduction=net_stride, module=stage_name))
        self.stage_names = tuple(f'layer{i + 1}' for i in range(len(layers)))

        self.num_features = inplanes
        self.global_pool, self.fc = create_classifier(self.num_features, num_classes, pool_type=global_pool, **dd)
        self.head_hidden_size = self.num_features * self.global_pool.feat_mult()
        self.init_weights(zero_init_last=zero_init_last)

    @torch.jit.ignore
    def init_weights(self, zero_init_last: bool = True) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
        if zero_init_last:
            for m in self.modules():
                if isinstance(m, BasicBlock):
                    m.zero_init_last()

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, str]:
        return dict(stem=r'^conv1|bn1|maxpool', blocks=r'^layer(\d+)' if coarse else r'^layer(\d+)\.(\d+)')

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self, name_only: bool = False) -> Union[str, nn.Module]:
        return 'fc' if name_only else self.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        dd = get_device_dtype(self)
        self.num_classes = num_classes
        if global_pool is None:
            global_pool = self.global_pool.pool_type
        self.global_pool, self.fc = create_classifier(self.num_features, num_classes, pool_type=global_pool, **dd)
        self.head_hidden_size = self.num_features * self.global_pool.feat_mult()
        self.global_pool.train(self.training)
        self.fc.train(self.training)

    @torch.jit.unused
    def _stages(self) -> List[nn.Module]:
        return [self.layer1, self.layer2, self.layer3, self.layer4]

    def _forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """``forward_intermediates`` of the turned image: index 0 the stem (before max pooling), 1-4 the stages."""
        assert output_fmt == 'NCHW', 'Output shape must be NCHW.'
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.feature_info), indices)
        x = self.act1(self.bn1(self.conv1(x)))
        if 0 in take_indices:
            intermediates.append(x)
        x = self.maxpool(x)
        stages = self._stages()
        if stop_early:
            stages = stages[:max_index]
        for feat_idx, stage in enumerate(stages, start=1):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint_seq(stage, x)
            else:
                x = stage(x)
            if feat_idx in take_indices:
                intermediates.append(x)
        if intermediates_only:
            return intermediates
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: Union[int, List[int]] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> List[int]:
        """Empties the stages after the last tap in ``indices`` (and drops the classifier if ``prune_head``)."""
        take_indices, max_index = feature_take_indices(len(self.feature_info), indices)
        for name in self.stage_names[max_index:]:
            setattr(self, name, nn.Sequential())  # empty, not Identity, so checkpoint_seq can iterate it
        if max_index == 0:
            self.maxpool = nn.Identity()
        prune_end = max_index < len(self.feature_info) - 1
        if prune_end:
            # the features now end at the last kept tap; the head, sized for the final features, goes too
            self.num_features = self.head_hidden_size = self.feature_info[max_index]['num_chs']
        if prune_head or prune_end:
            self.reset_classifier(0, '')
        return take_indices

    def _forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.act1(x)
        x = self.maxpool(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self._stages(), x, flatten=True)
        else:
            x = self.layer1(x)
            x = self.layer2(x)
            x = self.layer3(x)
            x = self.layer4(x)
        return x

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.global_pool(x)
        if self.drop_rate:
            x = F.dropout(x, p=float(self.drop_rate), training=self.training)
        return x if pre_logits else self.fc(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        return self.forward_head(x)


def _create_resnet(variant: str, pretrained: bool = False, **kwargs: Any) -> SortResNet:
    return build_model_with_cfg(SortResNet, variant, pretrained, **kwargs)


def _cfg(dataset: str = 'nwpu', **kwargs) -> Dict[str, Any]:
    return ri_cfg(first_conv='conv1', classifier='fc', pool_size=(8, 8), dataset=dataset, **kwargs)


default_cfgs = generate_default_cfgs({
    'ri_resnet18.nwpu': _cfg(),
    'ri_resnet18.outex': _cfg('outex'),
    'ri_resnet18_baseline.nwpu': _cfg(),
    'ri_resnet18_baseline.outex': _cfg('outex'),
})


@register_model
def ri_resnet18(pretrained: bool = False, **kwargs: Any) -> SortResNet:
    """RI-ResNet18: ``SortConv2d`` in every 3x3 convolution, 3x3 stride-1 stem, 2x2 max pooling."""
    model_args = dict(layers=(2, 2, 2, 2), sampling='polar', sorting='ring')
    return _create_resnet('ri_resnet18', pretrained, **dict(model_args, **kwargs))


@register_model
def ri_resnet18_baseline(pretrained: bool = False, **kwargs: Any) -> SortResNet:
    """The plain-convolution twin of ``ri_resnet18`` (same layers and parameters, ``nn.Conv2d``)."""
    model_args = dict(layers=(2, 2, 2, 2))
    return _create_resnet('ri_resnet18_baseline', pretrained,
                          **fixed_variant_args('ri_resnet18_baseline', dict(model_args, **kwargs), None, None))
