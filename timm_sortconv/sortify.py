"""``sortify``: turn the convolutions of any network into Sorting Convolutions, in place.

A Sorting Convolution keeps ``nn.Conv2d``'s weight and only rearranges each window before the
product, so a trained or freshly built network (timm, torchvision, your own) becomes its SC twin by
swapping modules: same parameters, same ``state_dict`` keys, same output shapes.

Each convolution of the model gets exactly one verdict, checked in this order:

1. "excluded": its qualified name is rejected by ``include``/``exclude``;
2. "already": it is a ``SortConv2d`` (so the pass is idempotent);
3. "skipped", with the reason: it is not a 2-D ``nn.Conv2d`` (``Conv1d``, ``Conv3d``, transposed
   convolutions, timm's ``CondConv2d``), or its kernel is not square, or it is even and
   ``even_kernels=False``, or it is even with ``nn.Conv2d``'s asymmetric ``padding="same"``;
4. "kept": its kernel is smaller than ``min_kernel_size`` (a ``1 x 1`` convolution already commutes
   with rotations, so it stays plain);
5. "replaced": ``nn.Conv2d`` and subclasses that keep its ``forward`` (torchvision's and timm's plain
   convolutions, ``timm.layers.create_conv2d`` with static padding, each branch of a ``MixedConv2d``), and
   :class:`~timm_sortconv.grid.CentredConv2d`, become :class:`~timm_sortconv.SortConv2d`; timm's
   ``Conv2dSame`` / ``Conv2dSameExport`` (dynamic TensorFlow "SAME" padding) become :class:`SortConv2dSame`,
   with the same output size; even kernels (ConvNeXt's ``4 x 4`` stem and ``2 x 2`` downsampling, patch
   embeddings) included;
6. "skipped": any other ``nn.Conv2d`` subclass, because it overrides ``forward`` with arithmetic
   that ``SortConv2d`` would silently drop (timm's ``StdConv2d`` family standardises the weight on
   every call).

With ``stride_align="centre"`` (default) every strided layer is also given a grid of windows centred on
the image (:mod:`timm_sortconv.grid`), so that a quarter turn of the input maps it onto itself at every
input size: the new SC layers, the strided plain convolutions that are kept (``1 x 1`` shortcut
projections; they become :class:`~timm_sortconv.grid.CentredConv2d`, while unit-stride ones stay exactly what
they were) and ``nn.MaxPool2d`` /
``nn.AvgPool2d`` (:class:`~timm_sortconv.grid.CentredMaxPool2d`, :class:`~timm_sortconv.grid.CentredAvgPool2d`);
they are listed as "centred" (layers centred already are left as they are). A strided layer it cannot
centre (an excluded or skipped convolution, a pooling layer of another class, ``ceil_mode=True``, a
``SortConv2d`` found with ``stride_align="corner"``) is listed as "uncentred" with the reason: the model is
then exactly invariant only at the sizes where that layer's grid happens to be centred, which
:func:`timm_sortconv.quarter_turn_check` finds for a given model and size. Layers without parameters are
swapped the same way, so the ``state_dict`` keys stay the same.
"""
from __future__ import annotations

import fnmatch
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import torch.nn as nn
from timm.layers import CondConv2d, Conv2dSame
from timm.layers.conv2d_same import Conv2dSameExport

from .canonical import CanonicalInputMixin, canonical_order, create_canonicalizer
from .guide import attach_guide, check_guidable, check_guide_blur, check_guide_ramp, guided_layers
from .grid import CENTRED_LAYERS, CentredAvgPool2d, CentredConv2d, CentredMaxPool2d, check_stride_align
from .layers import SortConv2d, SortConv2dSame
from .ops.backends import check_backend_name
from .ops.geometry import check_variant

__all__ = ["SortifyReport", "sortify"]

_logger = logging.getLogger(__name__)

Patterns = Optional[Union[str, Sequence[str]]]

@dataclass
class SortifyReport:
    """What :func:`sortify` did to each convolution, by qualified module name.

    Attributes:
        replaced: convolutions now computed by ``SortConv2d`` / ``SortConv2dSame``.
        kept: square kernels smaller than ``min_kernel_size`` (e.g. ``1 x 1``), plain on purpose.
        already: modules that were ``SortConv2d`` before the call.
        excluded: convolutions left alone because of ``include``/``exclude``.
        skipped: ``(name, reason)`` for convolutions that could not be converted.
        centred: strided layers whose grid of windows is now centred (``stride_align="centre"``).
        uncentred: ``(name, reason)`` for strided layers whose grid could not be centred: the model is
            exactly invariant to quarter turns only at the input sizes where their grid is centred anyway.
        canonicalize: the ``canonicalize`` put in front of the model, or ``None``.
        guided: the aligned layers that turn their windows by the orientation guide (``guide_blur``).
        guide_source: the module whose input the guide is made from, or ``None``.
    """

    replaced: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)
    already: List[str] = field(default_factory=list)
    excluded: List[str] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)
    centred: List[str] = field(default_factory=list)
    uncentred: List[Tuple[str, str]] = field(default_factory=list)
    canonicalize: Optional[str] = None
    guided: List[str] = field(default_factory=list)
    guide_source: Optional[str] = None

    def summary(self) -> str:
        """One line with the counts."""
        return (f"replaced {len(self.replaced)}, kept {len(self.kept)} (kernel < min_kernel_size), "
                f"already sorting {len(self.already)}, excluded {len(self.excluded)}, skipped {len(self.skipped)}; "
                f"strided grids centred {len(self.centred)}, not centred {len(self.uncentred)}")

    def __str__(self) -> str:
        lines = [f"sortify: {self.summary()}"]
        if self.canonicalize:
            lines.append(f"  input turned first: canonicalize={self.canonicalize!r}")
        if self.guided:
            lines.append(f"  orientation guide made from the input of {self.guide_source or '<root>'}, read by "
                         f"{len(self.guided)} aligned layers")
        for title, names in (("replaced", self.replaced), ("kept", self.kept), ("already", self.already),
                             ("excluded", self.excluded), ("centred", self.centred)):
            if names:
                lines.append(f"  {title}: {', '.join(names)}")
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped]
        lines += [f"  not centred {name}: {reason}" for name, reason in self.uncentred]
        if self.uncentred:
            lines.append("  exact quarter-turn invariance only at some input sizes: "
                         "timm_sortconv.quarter_turn_check(model, size) measures it and finds the nearest")
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
    if isinstance(module, CentredConv2d):  # a plain convolution with a centred grid (this package's plain twins)
        return SortConv2d, ""
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


def _strided(module: nn.Module) -> bool:
    """Whether ``module`` has a stride other than 1 and is not centred already (:data:`CENTRED_LAYERS`)."""
    if isinstance(module, CENTRED_LAYERS):
        return False
    stride = getattr(module, "stride", 1)
    return any(step != 1 for step in (stride if isinstance(stride, (tuple, list)) else (stride,)))


def _centred_twin(module: nn.Module) -> Tuple[Optional[nn.Module], str]:
    """``(module with a centred grid, "")`` for a strided plain convolution or pooling layer, or
    ``(None, why not)``."""
    if isinstance(module, nn.Conv2d) and _replacement_class(module)[0] is SortConv2d:  # plain nn.Conv2d behaviour
        if isinstance(module.padding, str):
            return None, f"padding={module.padding!r}"
        return CentredConv2d.from_conv(module), ""
    if type(module) in (nn.MaxPool2d, nn.AvgPool2d):
        if module.ceil_mode:
            return None, f"{type(module).__name__} with ceil_mode=True"
        centred = CentredMaxPool2d if isinstance(module, nn.MaxPool2d) else CentredAvgPool2d
        return centred.from_pool(module).train(module.training), ""
    return None, f"{type(module).__name__} has no centred counterpart"


def _add_canonicalizer(model: nn.Module, canonicalize: str) -> None:
    """Puts :func:`~timm_sortconv.canonical.create_canonicalizer` ``(canonicalize)`` in front of ``model`` as
    ``model.canonicalize``: where the model applies that slot itself (this package's models,
    :class:`~timm_sortconv.canonical.CanonicalInputMixin`) it fills the slot, else a forward pre-hook applies it."""
    model.canonicalize = create_canonicalizer(canonicalize)
    if not isinstance(model, CanonicalInputMixin):
        model.register_forward_pre_hook(_canonicalize_input)


def _canonicalize_input(model: nn.Module, args: tuple) -> tuple:
    """Forward pre-hook: the model's first argument, turned by ``model.canonicalize``."""
    return (model.canonicalize(args[0]),) + tuple(args[1:])


def sortify(
    model: nn.Module,
    sampling: str = "polar",
    sorting: str = "ring",
    min_kernel_size: int = 2,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    backend: str = "auto",
    stride_align: str = "centre",
    even_kernels: bool = True,
    canonicalize: Optional[str] = None,
    guide_blur: float = 0.0,
    guide_source: Optional[str] = None,
    guide_ramp: float = 0.0,
    return_report: bool = False,
):
    """Replaces, in place, every eligible ``nn.Conv2d`` of ``model`` by a Sorting Convolution.

    Each replacement is made by :meth:`SortConv2d.from_conv`: same weight and bias tensors (copied),
    stride, padding, dilation, groups, padding mode, device, dtype, training mode and
    ``requires_grad``. The parameter count and ``state_dict`` keys do not change, so checkpoints of the
    original model load into the sortified one and back. A module registered under several names
    (tied weights) is replaced once and stays shared. Hooks registered on a replaced module are not
    carried over. The module docstring lists which layers change and why others do not.

    Args:
        model: any ``nn.Module``; it is modified in place. If ``model`` is itself a convolution the
            converted module is returned, so always use the return value.
        sampling: ``"polar"`` or ``"square"``.
        sorting: ``"ring"``, ``"global"``, ``"c4"``, ``"c2"``, ``"align"`` or ``"align-channel"``
            (:func:`~timm_sortconv.sort_conv2d`).
        min_kernel_size: square kernels smaller than this stay plain (default 2: only ``1 x 1`` kept, which
            commutes with rotations).
        include: glob pattern(s) (:func:`fnmatch.fnmatchcase`) on qualified module names as printed by
            ``model.named_modules()``, e.g. ``"layer1.*"`` or ``["conv1", "layer*.0.conv?"]``; only
            matching convolutions are converted. ``*`` also matches dots. ``None``: all.
        exclude: glob pattern(s); matching convolutions are left alone (applied after ``include``).
        backend: ``SortConv2d`` backend for the new modules (``"auto"`` picks the fastest available).
        stride_align: ``"centre"`` (default): every strided layer it can reach gets a grid centred on the image
            (the module docstring lists them), so the model is exactly invariant to quarter turns at every
            input size; ``"corner"``: strided grids stay where PyTorch puts them.
        even_kernels: convert even square kernels too (default). Their windows' centre lies between four
            pixels, and the result is exactly invariant to quarter turns like an odd kernel's.
        canonicalize: ``None``, or ``"moment2"``/``"moment4"``/``"moment1"``: each input image is first turned
            to the orientation of its angular moment (:mod:`timm_sortconv.canonical`), by a module put in
            front of the model (``model.canonicalize``: this package's models apply it in ``forward_features``
            and ``forward_intermediates``, :class:`~timm_sortconv.canonical.CanonicalInputMixin`; any other
            model through a forward pre-hook, which only a call of the model itself runs, not
            ``forward_features`` or FX tracing), so that the model's invariance covers the angles between the quarter turns (with ``sorting="c2"``:
            ``"moment2"`` or ``"moment1"``). It has no parameters, so the ``state_dict`` keys do not change.
            A non-square input is turned in a larger frame that holds it whole
            (:func:`~timm_sortconv.canonical.canonical_size`), which the model must take (a globally pooled one
            does). A model that turns its input already is refused before anything changes.
        guide_blur: with ``sorting="align"``, turn every aligned window by the orientation of the input blurred by
            that many pixels around it instead of by its own (:mod:`timm_sortconv.guide`; 0, the default: no
            guide). The guide is made once per forward from the input of ``guide_source`` (a qualified module name;
            default: the model's first ``nn.Conv2d``, the stem, which reads the image in every timm and
            torchvision CNN); no parameters, no ``state_dict`` keys.
        guide_source: see ``guide_blur``.
        guide_ramp: with ``guide_blur`` and ``canonicalize``, a ramp of that many units a pixel along the turned
            image's +x axis added to the guide (:mod:`timm_sortconv.guide`; 0, the default: none), so that where the
            blurred input is flat the windows turn by the image's canonical orientation.
        return_report: also return the :class:`SortifyReport`.

    Returns:
        ``model`` (the same object, converted), or ``(model, report)`` if ``return_report``. One line
        is logged through :mod:`logging` (``timm_sortconv.sortify``; a warning if something was skipped).

    Example:
        >>> import timm
        >>> net, report = sortify(timm.create_model("resnet18"), return_report=True)
        >>> all(isinstance(net.get_submodule(name), SortConv2d) for name in report.replaced)
        True
        >>> {net.get_submodule(name).kernel_size for name in report.kept}  # the 1x1 shortcut convolutions
        {(1, 1)}
    """
    check_variant(sampling, sorting)
    check_backend_name(backend)
    check_stride_align(stride_align)
    if isinstance(min_kernel_size, bool) or not isinstance(min_kernel_size, int) or min_kernel_size < 1:
        raise ValueError(f"min_kernel_size must be an int >= 1, got {min_kernel_size!r}")
    guide_blur = check_guide_blur(guide_blur, sorting)
    if guide_source is not None and not guide_blur:
        raise ValueError(f"guide_source={guide_source!r} names where the orientation guide is made; it needs "
                         "guide_blur > 0")
    if guide_blur:  # what attach_guide would refuse after the conversion, refused before it
        check_guidable(model, guide_source)
    # a ramp needs a canonical turn in front: the one asked for, or one the model has already
    check_guide_ramp(guide_ramp, guide_blur,
                     canonicalize if canonical_order(canonicalize) else getattr(model, "canonicalize", None))
    include_patterns = _as_patterns(include, "include")
    exclude_patterns = _as_patterns(exclude, "exclude")
    if canonical_order(canonicalize):
        existing = getattr(model, "canonicalize", None)
        if existing is not None and not isinstance(existing, nn.Identity):
            raise ValueError(f"canonicalize={canonicalize!r}: the model already turns its input (model.canonicalize "
                             f"is {type(existing).__name__}); turning it twice only blurs it")

    report = SortifyReport(canonicalize=canonicalize)
    new_modules = {}
    for name, module in model.named_modules():
        label = name or "<root>"
        if not _is_convolution(module):
            if stride_align == "centre" and isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)) and _strided(module):
                twin, reason = _centred_twin(module)
                if twin is None:
                    report.uncentred.append((label, reason))
                else:
                    new_modules[id(module)] = twin
                    report.centred.append(label)
            continue
        verdict = _verdict(module, name, include_patterns, exclude_patterns, min_kernel_size, even_kernels)
        if verdict == "replaced":
            new_cls = _replacement_class(module)[0]
            # A CentredConv2d's grid is centred already and stays so.
            align = "centre" if isinstance(module, CentredConv2d) else stride_align
            new_modules[id(module)] = new_cls.from_conv(module, sampling=sampling, sorting=sorting, backend=backend,
                                                        stride_align=align)
            report.replaced.append(label)
            if stride_align == "centre" and _strided(module):
                report.centred.append(label)
            continue
        if isinstance(verdict, tuple):
            report.skipped.append((label, verdict[1]))
        else:
            getattr(report, verdict).append(label)
        if stride_align != "centre" or not _strided(module):
            continue
        if verdict == "already":
            if module.stride_align != "centre":  # sortify does not change the layers it finds already sorting
                report.uncentred.append((label, f"{type(module).__name__} with stride_align={module.stride_align!r}"))
            continue
        if verdict == "kept":
            twin, reason = _centred_twin(module)
        else:
            twin, reason = None, "excluded" if verdict == "excluded" else "not converted"
        if twin is None:
            report.uncentred.append((label, reason))
        else:
            new_modules[id(module)] = twin
            report.centred.append(label)

    # Every reference is swapped, so a module registered under two names stays one shared module.
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if child is not None and id(child) in new_modules:
                setattr(parent, child_name, new_modules[id(child)])
    model = new_modules.get(id(model), model)
    if canonicalize is not None:
        _add_canonicalizer(model, canonicalize)
    if guide_blur:
        attach_guide(model, guide_blur, guide_source, ramp=guide_ramp)
        report.guided = guided_layers(model)
        report.guide_source = guide_source or next(name for name, m in model.named_modules()
                                                   if isinstance(m, nn.Conv2d))

    reasons = Counter(reason for _, reason in report.skipped)
    log = _logger.warning if report.skipped else _logger.info
    log("sortify(sampling=%s, sorting=%s): %s%s", sampling, sorting, report.summary(),
        "".join(f"; {count} x {reason}" for reason, count in reasons.items()))
    return (model, report) if return_report else model


def _verdict(module: nn.Module, name: str, include, exclude, min_kernel_size: int, even_kernels: bool):
    """The verdict of the module docstring for one convolution: a name, or ``("skipped", reason)``."""
    if not _selected(name, include, exclude):
        return "excluded"
    if isinstance(module, SortConv2d):
        return "already"
    if not isinstance(module, nn.Conv2d):
        return "skipped", _not_conv2d_reason(module)
    kh, kw = module.kernel_size
    if kh != kw:
        return "skipped", f"non-square kernel {kh}x{kw}"
    if kh % 2 == 0 and not even_kernels:
        return "skipped", f"even kernel {kh}x{kw} (even_kernels=False)"
    if kh % 2 == 0 and module.padding == "same":
        return "skipped", f"even kernel {kh}x{kw} with padding='same', which pads one side more"
    if kh < min_kernel_size:
        return "kept"
    new_cls, reason = _replacement_class(module)
    return "replaced" if new_cls is not None else ("skipped", reason)
