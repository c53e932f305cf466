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
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from timm.layers import CondConv2d, Conv2dSame
from timm.layers.conv2d_same import Conv2dSameExport

from .canonical import canonical_order
from .layers import SortConv2d, SortConv2dSame
from .ops.backends import check_backend_name
from ._moved import moved_names
from .ops.geometry import check_variant

__all__ = ["SortifyReport", "sortify"]

_logger = logging.getLogger(__name__)

Patterns = Optional[Union[str, Sequence[str]]]

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


def _stem_name(model: nn.Module) -> Optional[str]:
    """Qualified name of the convolution that reads the input: timm's ``pretrained_cfg["first_conv"]``,
    else the first convolution in ``named_modules()`` order; ``None`` if there is none."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    first = cfg.get("first_conv") if isinstance(cfg, dict) else None
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    if isinstance(first, str):
        try:
            if _is_convolution(model.get_submodule(first)):
                return first
        except AttributeError:
            pass
    return next((name for name, module in model.named_modules() if _is_convolution(module)), None)


def sortify(
    model: nn.Module,
    sampling: str = "polar",
    sorting: str = "ring",
    min_kernel_size: int = 3,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    backend: str = "auto",
    canonicalize: Optional[str] = None,
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
        sampling: ``"polar"``, ``"polar-offset"`` or ``"square"``.
        sorting: ``"ring"``, ``"global"``, ``"c4"`` or ``"c2"`` (:func:`~timm_sortconv.sort_conv2d`).
        min_kernel_size: odd square kernels smaller than this stay plain (default 3: ``1 x 1`` kept).
        include: glob pattern(s) (:func:`fnmatch.fnmatchcase`) on qualified module names as printed by
            ``model.named_modules()``, e.g. ``"layer1.*"`` or ``["conv1", "layer*.0.conv?"]``; only
            matching convolutions are converted. ``*`` also matches dots. ``None``: all.
        exclude: glob pattern(s); matching convolutions are left alone (applied after ``include``).
        backend: ``SortConv2d`` backend for the new modules (``"auto"`` picks the fastest available).
        canonicalize: ``None``, or ``"moment2"``/``"moment4"``/``"moment1"``: the stem convolution first
            turns each input image to the orientation of its angular moment (``SortConv2d``'s
            ``canonicalize``), so that the network's invariance covers the angles between the quarter
            turns (with ``sorting="c2"``: ``"moment2"`` or ``"moment1"``, the turn left over by order 4 is
            not ignored). The stem is the model's ``pretrained_cfg["first_conv"]`` (timm models), else its first
            convolution in ``named_modules()`` order; it must end up a ``SortConv2d``, and the model must
            not turn its input already (a model's own ``canonicalize``); an error says so before anything is
            changed. Like ``sampling``, it is a setting of the layer, not saved in the ``state_dict``.
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
    check_backend_name(backend)
    if isinstance(min_kernel_size, bool) or not isinstance(min_kernel_size, int) or min_kernel_size < 1:
        raise ValueError(f"min_kernel_size must be an int >= 1, got {min_kernel_size!r}")
    include_patterns = _as_patterns(include, "include")
    exclude_patterns = _as_patterns(exclude, "exclude")
    canonical_order(canonicalize)  # checks the name

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

    stem = None
    if canonicalize is not None and not isinstance(getattr(model, "canonicalize", None), (nn.Identity, type(None))):
        raise ValueError(f"canonicalize={canonicalize!r}: the model already turns its input "
                         f"(model.canonicalize is {type(model.canonicalize).__name__}); turning it twice only blurs it")
    if canonicalize is not None:
        stem_name = _stem_name(model)
        stem = model.get_submodule(stem_name) if stem_name is not None else None
        stem = new_modules.get(id(stem), stem)
        if not isinstance(stem, SortConv2d):
            found = "no convolution" if stem_name is None else f"the stem {stem_name or '<root>'!r}"
            raise ValueError(f"canonicalize={canonicalize!r} turns the input of the model's stem convolution, "
                             f"but {found} is not converted to a SortConv2d (include it, or leave canonicalize=None)")

    # Every reference is swapped, so a module registered under two names stays one shared module.
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in new_modules:
                setattr(parent, child_name, new_modules[id(child)])
    model = new_modules.get(id(model), model)
    if stem is not None:
        stem.set_canonicalize(canonicalize)

    reasons = Counter(reason for _, reason in report.skipped)
    log = _logger.warning if report.skipped else _logger.info
    log("sortify(sampling=%s, sorting=%s): %s%s", sampling, sorting, report.summary(),
        "".join(f"; {count} x {reason}" for reason, count in reasons.items()))
    return (model, report) if return_report else model


# Names that lived here before: they still import, with a warning naming their home.
__getattr__ = moved_names(__name__, {"get_conv_layer": "timm_sortconv.models",
                                     "fixed_variant_args": "timm_sortconv.models"})
