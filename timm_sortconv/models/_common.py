"""Pieces the model files share: the feature-tap API of a network built on one ``features`` sequence, and
the default-cfg fields (the convolutions themselves: :mod:`._conv`; the input turn every model applies in one
place: :class:`~timm_sortconv.canonical.CanonicalInputMixin`).

* :class:`SequentialFeaturesMixin`: ``forward_intermediates`` and ``prune_intermediate_layers`` for
  ``SCNN``, ``SortVGG`` and ``SortDenseNet``, whose taps are outputs of ``self.features`` children;
* :class:`SequentialClassifierMixin`: the rest of timm's model API (head, classifier, checkpointing,
  forward) for ``SCNN`` and ``SortVGG``, a ``features`` sequence followed by a ``ClassifierHead``;
* :func:`ri_cfg`: the ``.nwpu`` and ``.outex`` default cfgs of the 128x128 models.
"""
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import get_device_dtype
from timm.models import checkpoint_seq
from timm.models._features import feature_take_indices

from ..canonical import CanonicalInputMixin

__all__ = ['SequentialFeaturesMixin', 'SequentialClassifierMixin', 'PAPER_CFG', 'ri_cfg']


class SequentialFeaturesMixin(CanonicalInputMixin):
    """timm's intermediate-feature API for a network whose feature taps are outputs of ``self.features``.

    Contract: the model's ``__init__`` sets

    * ``self.features``: an ``nn.Sequential``, the whole trunk;
    * ``self.feature_info``: one dict per tap (timm's format, ``num_chs`` among its keys);
    * ``self.feature_ends``: for each tap, the index into ``self.features`` of the child whose output it
      is, increasing;
    * ``self.num_features``: the channels of the trunk's output;
    * ``self.canonicalize``, first (:class:`~timm_sortconv.canonical.CanonicalInputMixin`);

    and the model defines ``reset_classifier(num_classes, global_pool)``, which sizes the classifier for
    ``self.num_features``.
    """

    def _forward_intermediates(
            self,
            x: torch.Tensor,
            indices: Optional[Union[int, List[int]]] = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """``forward_intermediates`` of the turned image: the taps of ``feature_info`` (the class docstring
        lists them)."""
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
            self.reset_classifier(0, '')
        return take_indices


class SequentialClassifierMixin(SequentialFeaturesMixin):
    """timm's whole model API for a ``self.features`` sequence followed by ``self.head``, a ``ClassifierHead``.

    Contract: besides :class:`SequentialFeaturesMixin`'s attributes the model's ``__init__`` sets
    ``self.head`` (a ``timm.layers.ClassifierHead``), ``self.num_classes``, ``self.head_hidden_size`` and
    ``self.grad_checkpointing``; the stem is ``features.0`` and every later child of ``features`` is one
    block. This mixin then supplies ``group_matcher``, ``set_grad_checkpointing``, ``get_classifier``,
    ``reset_classifier``, ``forward_head``, ``forward`` and the trunk behind ``forward_features``.
    """

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^features\.0\.', blocks=r'^features\.(\d+)')

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self, name_only: bool = False) -> Union[str, nn.Module]:
        return 'head.fc' if name_only else self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        self.num_classes = num_classes
        self.head.reset(num_classes, global_pool, in_features=self.num_features, **get_device_dtype(self))
        self.head_hidden_size = self.head.num_features

    def _forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.features, x)
        return self.features(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=pre_logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(x)
        return self.forward_head(x)


PAPER_CFG = dict(
    license='apache-2.0',
    paper_ids='arXiv:2305.14462',
    paper_name='Sorting Convolution Operation for Achieving Rotational Invariance',
)

_DATASET_CFGS = {
    # NWPU-RESISC45: 45 classes of RGB remote-sensing scenes.
    'nwpu': dict(num_classes=45, input_size=(3, 128, 128), mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD),
    # Outex_TC_00012: 24 grayscale texture classes; inputs in [0, 1] are mapped to [-1, 1].
    'outex': dict(num_classes=24, input_size=(1, 128, 128), mean=(0.5,), std=(0.5,)),
}


def ri_cfg(
        first_conv: str,
        classifier: str,
        pool_size: Tuple[int, int],
        dataset: str = 'nwpu',
        url: str = '',
        **kwargs,
) -> Dict[str, Any]:
    """Default cfg of a 128x128 model (``ri_*``) trained on ``dataset`` (``'nwpu'`` or ``'outex'``).

    Args:
        first_conv, classifier: the model's first convolution and classifier, as module names.
        pool_size: the size of the map the head pools for a 128x128 input.
        dataset: the data set the weights are for; sets classes, input size, mean and std.
        url: where the weights are.
        kwargs: cfg fields that override the above.
    """
    if dataset not in _DATASET_CFGS:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(_DATASET_CFGS)}")
    return {
        'url': url,
        'pool_size': pool_size,
        'crop_pct': 1.0, 'interpolation': 'bilinear',
        'first_conv': first_conv, 'classifier': classifier,
        **_DATASET_CFGS[dataset],
        **PAPER_CFG,
        **kwargs,
    }
