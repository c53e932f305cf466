"""Backend registry: the reference path and the fast kernels that must agree with it.

A backend computes Sorting Convolution below autograd, as two kernels that take the padded input
(or, for a ``zero_padding`` backend, the unpadded input and ``pad = (left, right, top, bottom)``, which
it pads with zeros itself):

* ``forward(x, weight, bias, geometry, stride, dilation, groups, pad) -> output``;
* ``backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight, pad)
  -> (grad_x or None, grad_weight or None)``, the gradient of ``x`` as it was given.

``supports(x, weight, bias, geometry, stride, dilation, groups)`` says whether the backend computes a
call exactly as the reference path would (the predicates look at devices, dtypes and the geometry,
never at the input's height or width), ``available()`` whether it can run in this process (a compiler,
a package). The operator :func:`timm_sortconv.ops.operator.sort_conv2d_op` looks the backend up here
for every call; ``backend="auto"`` takes the first registered fast backend that supports the call and
is allowed for ``auto``, in the form it gives for ``auto`` (``auto_forward``/``auto_backward``: the Triton
backend's choice among its kernels and the reference path, checked and timed per configuration), and the
reference path otherwise.

``TIMM_SORTCONV_DISABLE_FAST=1`` switches every fast backend off (read by :func:`fast_disabled`, the one
place that reads it): ``auto`` then always takes the reference path and naming a fast backend is an error.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .alignment import align_conv2d_harmonic, is_aligned
from .reference import autograd_backward, sort_conv2d_reference, sort_conv2d_reference_backward

__all__ = ["DISABLE_ENV", "NO_PADDING", "Backend", "UnsupportedCall", "available_backends", "check_backend_name",
           "availability_changed", "environment", "fast_disabled", "register_backend", "registered_backend",
           "resolve_backend"]

DISABLE_ENV = "TIMM_SORTCONV_DISABLE_FAST"
NO_PADDING = (0, 0, 0, 0)


class UnsupportedCall(RuntimeError):
    """A backend named explicitly cannot run the call (its device, dtype, kernel size or sorting)."""


ForwardKernel = Callable[..., torch.Tensor]
BackwardKernel = Callable[..., Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


@dataclass(frozen=True)
class Backend:
    name: str
    forward: ForwardKernel
    backward: BackwardKernel
    supports: Callable[..., bool]
    available: Callable[[], bool]
    # Whether backend="auto" may pick it.
    auto: bool = True
    # Whether its kernels take the unpadded input and pad=(left, right, top, bottom) zeros.
    zero_padding: bool = False
    # Whether its kernels read an input contiguous in torch.channels_last order as it is (else: made contiguous).
    channels_last: bool = False
    # What backend="auto" runs instead of forward and backward, if given (same signatures): e.g. the Triton
    # backend's choice among its kernels and the reference path, checked and timed per configuration.
    auto_forward: Optional[ForwardKernel] = None
    auto_backward: Optional[BackwardKernel] = None

    def for_auto(self) -> "Backend":
        """The backend as ``auto`` runs it: itself, or with ``auto_forward``/``auto_backward`` as its kernels."""
        if self.auto_forward is None and self.auto_backward is None:
            return self
        return _auto_form(self)


@functools.lru_cache(maxsize=None)
def _auto_form(backend: Backend) -> Backend:
    return replace(backend, forward=backend.auto_forward or backend.forward,
                   backward=backend.auto_backward or backend.backward)


class _Registry(Dict[str, Backend]):
    """The registry: a dict that counts its changes (``version``), so that a caller may keep what it resolved
    while nothing was registered, replaced or removed."""

    version = 0

    def __setitem__(self, name, backend):
        super().__setitem__(name, backend)
        self.version += 1

    def __delitem__(self, name):
        super().__delitem__(name)
        self.version += 1

    def pop(self, *args):
        self.version += 1
        return super().pop(*args)


_BACKENDS: Dict[str, Backend] = _Registry()


def register_backend(backend: Backend, before: Optional[str] = None) -> None:
    """Adds a backend; ``auto`` tries fast backends in registration order, or with ``before`` (a registered
    backend's name) ahead of that one: the fused CPU kernel goes ahead of the harmonic backend, which runs the
    aligned variants on any device but more slowly."""
    if before is None or before not in _BACKENDS:
        _BACKENDS[backend.name] = backend
        return
    entries = [(name, b) for name, b in _BACKENDS.items() if name != backend.name]
    _BACKENDS.clear()
    for name, b in entries:
        if name == before:
            _BACKENDS[backend.name] = backend
        _BACKENDS[name] = b




def availability_changed() -> None:
    """Says that a backend's ``available()`` may answer otherwise now (a kernel was built, or failed to build), so
    that what was resolved with the old answer is resolved again."""
    _BACKENDS.version += 1


def environment_reader(name: str) -> Callable[[], Optional[str]]:
    """A function that answers ``os.environ.get(name)``, for the paths every call takes: ``os.environ.get`` of an
    unset variable raises and catches a ``KeyError`` inside (about half a microsecond), while the dictionary that
    ``os.environ`` keeps and updates on every assignment through it (CPython's ``os._Environ._data``, keyed as its
    ``encodekey`` makes them) answers in a tenth of that. Falls back to ``os.environ.get`` where that dictionary
    is not there. As ``os.environ.get``, it does not see ``os.putenv``."""
    data = getattr(os.environ, "_data", None)
    encodekey, decodevalue = getattr(os.environ, "encodekey", None), getattr(os.environ, "decodevalue", None)
    if not isinstance(data, dict) or encodekey is None or decodevalue is None:
        return functools.partial(os.environ.get, name)
    key = encodekey(name)

    def read() -> Optional[str]:
        value = data.get(key)
        return None if value is None else decodevalue(value)

    return read


_disable_setting = environment_reader(DISABLE_ENV)


def fast_disabled() -> bool:
    """Whether ``TIMM_SORTCONV_DISABLE_FAST`` switches the fast backends off."""
    return (_disable_setting() or "").strip().lower() not in ("", "0", "false", "no")


def environment() -> Tuple[int, Optional[str]]:
    """What :func:`resolve_backend`'s answer depends on beside its arguments: the registry's version and the
    switch of :func:`fast_disabled`, as set; a caller may keep an answer while it is unchanged."""
    return _BACKENDS.version, _disable_setting()


def _reference_forward(x, weight, bias, geometry, stride, dilation, groups, pad=NO_PADDING):
    return sort_conv2d_reference(x, weight, bias, geometry, stride, dilation, groups)


def _reference_backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight,
                        pad=NO_PADDING):
    return sort_conv2d_reference_backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input,
                                          need_weight)


register_backend(Backend("reference", _reference_forward, _reference_backward, lambda *args: True, lambda: True))


def _harmonic_forward(x, weight, bias, geometry, stride, dilation, groups, pad=NO_PADDING):
    return align_conv2d_harmonic(x, weight, bias, geometry, stride, dilation, groups)


def _harmonic_backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight,
                       pad=NO_PADDING):
    return autograd_backward(align_conv2d_harmonic, grad_output, x, weight, geometry, stride, dilation, groups,
                             need_input, need_weight)


# The aligned variants in standard operators (a depthwise convolution, a product, a 1 x 1 convolution): any
# device and dtype, so auto takes it for every aligned call that no backend registered ahead of it takes (the
# fused CPU kernel, where it is built); the other sorting backends do not take them. On CUDA, auto runs it checked
# against the reference path and timed against it (the Triton backend's tuner gives it that form).
register_backend(Backend("harmonic", _harmonic_forward, _harmonic_backward,
                         lambda x, weight, bias, geometry, *args: is_aligned(geometry), lambda: True))


def registered_backend(name: str) -> Backend:
    """The registered backend ``name`` (``KeyError`` if none)."""
    return _BACKENDS[name]


def available_backends() -> List[str]:
    """Names of the backends usable in this process (a fast one may be missing its compiler, or switched off)."""
    return [name for name, b in _BACKENDS.items() if name == "reference" or (not fast_disabled() and b.available())]


def check_backend_name(name: str) -> str:
    """Returns ``name`` if it is ``"auto"`` or a registered backend, else raises ``ValueError``."""
    if name != "auto" and name not in _BACKENDS:
        raise ValueError(f"unknown backend={name!r}; accepted: 'auto', {', '.join(map(repr, _BACKENDS))}")
    return name


def resolve_backend(name: str, *args) -> Backend:
    """The backend that runs a call: a named one (it must support the call) or ``auto``'s choice."""
    if name == "auto":
        if not fast_disabled():
            for backend in _BACKENDS.values():
                if backend.name != "reference" and backend.auto and backend.supports(*args) and backend.available():
                    return backend.for_auto()
        return _BACKENDS["reference"]
    backend = _BACKENDS[check_backend_name(name)]
    if name != "reference" and fast_disabled():
        raise RuntimeError(f"backend {name!r} is switched off by {DISABLE_ENV}; use backend='auto' or 'reference'")
    if not backend.available():
        raise RuntimeError(f"backend {name!r} is not available in this process; available: {available_backends()}")
    if not backend.supports(*args):
        raise UnsupportedCall(f"backend {name!r} does not support this call (device, dtype, kernel size or sorting); "
                              "use backend='auto' to fall back to the reference path")
    return backend
