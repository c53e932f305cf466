"""How the model files build their convolutions: the conv factory, the named-variant check, the conv block.

Every model takes ``sampling``, ``sorting``, ``backend`` and ``stride_align`` and builds its ``k > 1``
convolutions with :func:`get_conv_layer`: ``SortConv2d`` with that variant, or a plain convolution for the
plain twin (both ``None``). Entrypoints whose name fixes the variant check the user's keywords with
:func:`fixed_variant_args`.
"""
from collections import OrderedDict
from functools import partial
from typing import Callable, Optional

import torch.nn as nn

from ..grid import check_stride_align, plain_conv_layer
from ..layers import SortConv2d
from ..ops.backends import check_backend_name
from ..ops.geometry import check_variant

__all__ = ['ConvNormAct', 'fixed_variant_args', 'get_conv_layer']


def get_conv_layer(sampling: Optional[str] = None, sorting: Optional[str] = None,
                   backend: str = 'auto', stride_align: str = 'centre') -> Callable[..., nn.Conv2d]:
    """The convolution class a model builds its ``k > 1`` layers with.

    Plain convolutions when both ``sampling`` and ``sorting`` are ``None`` (the plain-conv baseline;
    ``backend`` is then unused): :func:`timm_sortconv.grid.plain_conv_layer` of ``stride_align``, which gives an
    ``nn.Conv2d`` wherever the stride is 1. Else
    ``SortConv2d`` with that variant, ``backend`` and ``stride_align``. Giving only one of them is an error.

    Example:
        >>> get_conv_layer("square", "global")(4, 8, 3).sorting
        'global'
        >>> type(get_conv_layer()(4, 8, 3, padding=1)) is nn.Conv2d
        True
    """
    check_backend_name(backend)
    check_stride_align(stride_align)
    if sampling is None and sorting is None:
        return plain_conv_layer(stride_align)
    if sampling is None or sorting is None:
        raise ValueError("give sampling and sorting together (a Sorting Convolution) or neither (plain nn.Conv2d), "
                         f"got sampling={sampling!r}, sorting={sorting!r}")
    check_variant(sampling, sorting)
    return partial(SortConv2d, sampling=sampling, sorting=sorting, backend=backend, stride_align=stride_align)


def fixed_variant_args(model_name: str, kwargs: dict, sampling: Optional[str], sorting: Optional[str]) -> dict:
    """``kwargs`` plus the conv variant that ``model_name`` stands for (``None, None``: plain convolutions).

    Entrypoints whose name fixes the variant (``scnn_p_rs_7``, the ``*_baseline`` twins) use this so that
    a conflicting ``sampling``/``sorting`` keyword is an error instead of a model whose name lies.
    """
    for key, value in (("sampling", sampling), ("sorting", sorting)):
        if key in kwargs and kwargs[key] != value:
            raise ValueError(f"{model_name} is defined by sampling={sampling!r}, sorting={sorting!r}, got "
                             f"{key}={kwargs[key]!r}; create the model registered for that variant instead")
    return dict(kwargs, sampling=sampling, sorting=sorting)


class ConvNormAct(nn.Sequential):
    """Convolution (``conv_layer``, padding ``k // 2``, no bias), BatchNorm, ReLU; ``pre``, if given, before them.

    One block is one unit of gradient checkpointing, so the in-place ReLU only overwrites a tensor
    that lives inside the block.
    """

    def __init__(
            self,
            in_chs: int,
            out_chs: int,
            kernel_size: int,
            conv_layer: Callable[..., nn.Module] = nn.Conv2d,
            bn_momentum: float = 0.1,
            bn_eps: float = 1e-5,
            pre: Optional[nn.Module] = None,
            device=None,
            dtype=None,
    ) -> None:
        dd = {'device': device, 'dtype': dtype}
        # `pre` (a parameter-free filter before the convolution) comes first; the other names stay.
        super().__init__(OrderedDict(([('pre', pre)] if pre is not None else []) + [
            ('conv', conv_layer(in_chs, out_chs, kernel_size, padding=kernel_size // 2, bias=False, **dd)),
            ('bn', nn.BatchNorm2d(out_chs, eps=bn_eps, momentum=bn_momentum, **dd)),
            ('act', nn.ReLU(inplace=True)),
        ]))
