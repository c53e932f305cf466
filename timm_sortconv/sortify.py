"""``sortify``: turn the convolutions of any network into Sorting Convolutions, in place.

A Sorting Convolution keeps ``nn.Conv2d``'s weight and only rearranges each window before the
product, so a trained or freshly built network (timm, torchvision, your own) becomes its SC twin by
swapping modules: same parameters, same ``state_dict`` keys, same output shapes.

Each convolution of the model gets exactly one verdict, checked in this order:

1. "excluded": its qualified name is rejected by ``include``/``exclude``;
2. "already": it is a ``SortConv2d`` (so the pass is idempotent);
3. "skipped", with the reason: it is not a 2-D ``nn.Conv2d`` (``Conv1d``, ``Conv3d``, transposed
   convolutions, timm's ``CondConv2d``), or its kernel is not square, or not odd;
4. "kept": its kernel is smaller than ``min_kernel_size`` (a ``1 x 1`` convolution already commutes
   with rotations, so it stays plain);
5. "replaced": ``nn.Conv2d`` and subclasses that keep its ``forward`` (torchvision's and timm's plain
   convolutions, ``timm.layers.create_conv2d`` with static padding, each branch of a ``MixedConv2d``)
   become :class:`~timm_sortconv.SortConv2d`; timm's ``Conv2dSame`` / ``Conv2dSameExport`` (dynamic
   TensorFlow "SAME" padding) become :class:`SortConv2dSame`, which pads exactly the same way;
6. "skipped": any other ``nn.Conv2d`` subclass, because it overrides ``forward`` with arithmetic
   that ``SortConv2d`` would silently drop (timm's ``StdConv2d`` family standardises the weight on
   every call).
"""
from __future__ import annotations

import fnmatch
import logging
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from timm.layers import CondConv2d, Conv2dSame, pad_same, register_notrace_module
from timm.layers.conv2d_same import Conv2dSameExport

from .layers import SortConv2d
from .ops.geometry import check_variant

__all__ = ["SortConv2dSame", "SortifyReport", "fixed_variant_args", "get_conv_layer", "sortify"]

_logger = logging.getLogger(__name__)

Patterns = Optional[Union[str, Sequence[str]]]

# timm's FX feature extraction (features_only=True, feature_cls="fx") treats these as leaves: the
# operator validates shapes in Python, which symbolic tracing cannot follow.
register_notrace_module(SortConv2d)


@register_notrace_module
class SortConv2dSame(SortConv2d):
    """``SortConv2d`` with TensorFlow-style dynamic "SAME" padding, the sorting twin of timm's ``Conv2dSame``.

    The input is padded by ``timm.layers.pad_same`` for its actual size (asymmetric, more on the
    bottom/right, for strided layers), then sorted and convolved without further padding, exactly
    where ``Conv2dSame`` would convolve.

    Args:
        as :class:`~timm_sortconv.SortConv2d`; ``padding`` must be ``0`` or ``"same"`` (the padding is
        computed per call).

    Example:
        >>> conv = SortConv2dSame(3, 8, 3, stride=2)
        >>> conv(torch.randn(1, 3, 15, 15)).shape
        torch.Size([1, 8, 8, 8])
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None, *,
                 sampling: str = "polar", sorting: str = "ring", backend: str = "auto") -> None:
        if padding not in (0, (0, 0), "same"):
            raise ValueError(f"SortConv2dSame computes its padding per call; pass padding=0 or 'same', "
                             f"got padding={padding!r}")
        if padding_mode != "zeros":
            raise ValueError(f"SortConv2dSame pads with zeros like timm's Conv2dSame; got padding_mode={padding_mode!r}")
        super().__init__(in_channels, out_channels, kernel_size, stride, 0, dilation, groups, bias, padding_mode,
                         device, dtype, sampling=sampling, sorting=sorting, backend=backend)

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        input = pad_same(input, self.kernel_size, self.stride, self.dilation)
        return super()._conv_forward(input, weight, bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, padding=same (dynamic)"


def get_conv_layer(sampling: Optional[str] = None, sorting: Optional[str] = None) -> Callable[..., nn.Conv2d]:
    """The convolution class a model builds its ``k > 1`` layers with.

    ``nn.Conv2d`` when both ``sampling`` and ``sorting`` are ``None`` (the plain-conv baseline), else
    ``SortConv2d`` with that variant. Giving only one of them is an error.

    Example:
        >>> get_conv_layer("square", "global")(4, 8, 3).sorting
        'global'
        >>> get_conv_layer() is nn.Conv2d
        True
    """
    if sampling is None and sorting is None:
        return nn.Conv2d
    if sampling is None or sorting is None:
        raise ValueError("give sampling and sorting together (a Sorting Convolution) or neither (plain nn.Conv2d), "
                         f"got sampling={sampling!r}, sorting={sorting!r}")
    check_variant(sampling, sorting)
    return partial(SortConv2d, sampling=sampling, sorting=sorting)


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


@dataclass
class SortifyReport:
    """What :func:`sortify` did to each convolution, by qualified module name.

    Attributes:
        replaced: convolutions now computed by ``SortConv2d`` / ``SortConv2dSame``.
        kept: square odd kernels smaller than ``min_kernel_size`` (e.g. ``1 x 1``), plain on purpose.
        already: modules that were ``SortConv2d`` before the call.
        excluded: convolutions left alone because of ``include``/``exclude``.
        skipped: ``(name, reason)`` for convolutions that could not be converted.
    """

    replaced: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)
    already: List[str] = field(default_factory=list)
    excluded: List[str] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        """One line with the counts."""
        return (f"replaced {len(self.replaced)}, kept {len(self.kept)} (kernel < min_kernel_size), "
                f"already sorting {len(self.already)}, excluded {len(self.excluded)}, skipped {len(self.skipped)}")

    def __str__(self) -> str:
        lines = [f"sortify: {self.summary()}"]
        for title, names in (("replaced", self.replaced), ("kept", self.kept), ("already", self.already),
                             ("excluded", self.excluded)):
            if names:
                lines.append(f"  {title}: {', '.join(names)}")
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _as_patterns(patterns: Patterns, name: str) -> Optional[Tuple[str, ...]]:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        return (patterns,)
    if isinstance(patterns, Iterable):
        patterns = tuple(patterns)
        if all(isinstance(p, str) for p in patterns):
            return patterns
    raise TypeError(f"{name} must be None, a glob pattern string or a sequence of them, got {patterns!r}")


def _selected(name: str, include: Optional[Tuple[str, ...]], exclude: Optional[Tuple[str, ...]]) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return False
    return not (exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in exclude))


def _replacement_class(module: nn.Conv2d) -> Tuple[Optional[type], str]:
    """``(class to convert to, "")`` or ``(None, why it cannot be converted)`` for an ``nn.Conv2d``."""
    if isinstance(module, (Conv2dSame, Conv2dSameExport)):
        return SortConv2dSame, ""
    cls = type(module)
    if cls.forward is not nn.Conv2d.forward or cls._conv_forward is not nn.Conv2d._conv_forward:
        # e.g. timm's StdConv2d family standardises the weight on every call.
        return None, f"{cls.__name__} overrides nn.Conv2d.forward"
    return SortConv2d, ""


def _is_convolution(module: nn.Module) -> bool:
    return isinstance(module, (nn.modules.conv._ConvNd, CondConv2d))


def _not_conv2d_reason(module: nn.Module) -> str:
    if isinstance(module, nn.modules.conv._ConvTransposeNd):
        return f"{type(module).__name__}: transposed convolutions are not supported"
    if isinstance(module, nn.modules.conv._ConvNd):
        return f"{type(module).__name__}: only 2-D convolutions can be sorted"
    return f"{type(module).__name__}: per-sample expert kernels are not supported"


def sortify(
    model: nn.Module,
    sampling: str = "polar",
    sorting: str = "ring",
    min_kernel_size: int = 3,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    backend: str = "auto",
    return_report: bool = False,
):
    """Replaces, in place, every eligible ``nn.Conv2d`` of ``model`` by a Sorting Convolution.

    Each replacement is made by :meth:`SortConv2d.from_conv`: same weight and bias tensors (copied),
    stride, padding, dilation, groups, padding mode, device, dtype, training mode and
    ``requires_grad``. The parameter count and ``state_dict`` keys do not change, so checkpoints of the
    original model load into the sortified one and back. A module registered under several names
    (tied weights) is replaced once and stays shared. Hooks registered on a replaced module are not
    carried over. The module docstring lists which convolutions change and why others do not.

    Args:
        model: any ``nn.Module``; it is modified in place. If ``model`` is itself a convolution the
            converted module is returned, so always use the return value.
        sampling: ``"polar"`` or ``"square"``.
        sorting: ``"ring"`` or ``"global"``.
        min_kernel_size: odd square kernels smaller than this stay plain (default 3: ``1 x 1`` kept).
        include: glob pattern(s) (:func:`fnmatch.fnmatchcase`) on qualified module names as printed by
            ``model.named_modules()``, e.g. ``"layer1.*"`` or ``["conv1", "layer*.0.conv?"]``; only
            matching convolutions are converted. ``*`` also matches dots. ``None``: all.
        exclude: glob pattern(s); matching convolutions are left alone (applied after ``include``).
        backend: ``SortConv2d`` backend for the new modules (``"auto"`` picks the fastest available).
        return_report: also return the :class:`SortifyReport`.

    Returns:
        ``model`` (the same object, converted), or ``(model, report)`` if ``return_report``. One line
        is logged through :mod:`logging` (``timm_sortconv.sortify``; a warning if something was skipped).

    Example:
        >>> import timm
        >>> net, report = sortify(timm.create_model("resnet18"), return_report=True)
        >>> len(report.replaced), len(report.kept)
        (17, 3)
    """
    check_variant(sampling, sorting)
    if isinstance(min_kernel_size, bool) or not isinstance(min_kernel_size, int) or min_kernel_size < 1:
        raise ValueError(f"min_kernel_size must be an int >= 1, got {min_kernel_size!r}")
    include_patterns = _as_patterns(include, "include")
    exclude_patterns = _as_patterns(exclude, "exclude")

    report = SortifyReport()
    new_modules = {}
    for name, module in model.named_modules():
        if not _is_convolution(module):
            continue
        label = name or "<root>"
        if not _selected(name, include_patterns, exclude_patterns):
            report.excluded.append(label)
            continue
        if isinstance(module, SortConv2d):
            report.already.append(label)
            continue
        if not isinstance(module, nn.Conv2d):
            report.skipped.append((label, _not_conv2d_reason(module)))
            continue
        kh, kw = module.kernel_size
        if kh != kw:
            report.skipped.append((label, f"non-square kernel {kh}x{kw}"))
            continue
        if kh % 2 == 0:
            report.skipped.append((label, f"even kernel {kh}x{kw} has no centre pixel"))
            continue
        if kh < min_kernel_size:
            report.kept.append(label)
            continue
        new_cls, reason = _replacement_class(module)
        if new_cls is None:
            report.skipped.append((label, reason))
            continue
        new_modules[id(module)] = new_cls.from_conv(module, sampling=sampling, sorting=sorting, backend=backend)
        report.replaced.append(label)

    # Every reference is swapped, so a module registered under two names stays one shared module.
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in new_modules:
                setattr(parent, child_name, new_modules[id(child)])
    model = new_modules.get(id(model), model)

    reasons = Counter(reason for _, reason in report.skipped)
    log = _logger.warning if report.skipped else _logger.info
    log("sortify(sampling=%s, sorting=%s): %s%s", sampling, sorting, report.summary(),
        "".join(f"; {count} x {reason}" for reason, count in reasons.items()))
    return (model, report) if return_report else model
