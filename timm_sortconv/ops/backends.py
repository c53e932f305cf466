"""Backend registry: the reference path and the fast kernels that must agree with it.

A backend is a callable ``fn(x_padded, weight, bias, geometry, stride, dilation, groups)`` plus a
``supports(...)`` predicate with the same arguments. ``backend="auto"`` takes the first registered
fast backend that supports the call and falls back to the reference path otherwise; while tracing,
scripting, compiling or exporting it always takes the reference path, which is made of ordinary
PyTorch operators that those tools understand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

from .reference import sort_conv2d_reference

__all__ = ["Backend", "check_backend_name", "register_backend", "available_backends", "resolve_backend", "run_backend"]


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    supports: Callable[..., bool]
    available: Callable[[], bool]
    # Whether backend="auto" may pick it; a backend not yet measured on its hardware is opt-in.
    auto: bool = True


_BACKENDS: Dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Adds a backend; ``auto`` tries fast backends in registration order."""
    _BACKENDS[backend.name] = backend


register_backend(Backend("reference", sort_conv2d_reference, lambda *args: True, lambda: True))


def available_backends() -> List[str]:
    """Names of the backends usable in this process (a fast one may be missing its compiler)."""
    return [name for name, b in _BACKENDS.items() if b.available()]


def check_backend_name(name: str) -> str:
    """Returns ``name`` if it is ``"auto"`` or a registered backend, else raises ``ValueError``."""
    if name != "auto" and name not in _BACKENDS:
        raise ValueError(f"unknown backend={name!r}; accepted: 'auto', {', '.join(map(repr, _BACKENDS))}")
    return name


def _tracing() -> bool:
    return (torch.jit.is_scripting() or torch.jit.is_tracing() or torch.compiler.is_compiling()
            or torch.onnx.is_in_onnx_export())


def resolve_backend(name: str, *args) -> Backend:
    """The backend that runs a call: a named one (it must support the call) or ``auto``'s choice."""
    if name == "auto":
        if not _tracing():
            for backend in _BACKENDS.values():
                if backend.name != "reference" and backend.auto and backend.supports(*args) and backend.available():
                    return backend
        return _BACKENDS["reference"]
    backend = _BACKENDS[check_backend_name(name)]
    if not backend.available():
        raise RuntimeError(f"backend {name!r} is not available in this process; available: {available_backends()}")
    if not backend.supports(*args):
        raise RuntimeError(f"backend {name!r} does not support this call (device, dtype or kernel size); "
                           "use backend='auto' to fall back to the reference path")
    return backend


def run_backend(name: str, x, weight, bias, geometry, stride, dilation, groups) -> torch.Tensor:
    args = (x, weight, bias, geometry, stride, dilation, groups)
    return resolve_backend(name, *args).fn(*args)
