"""The fused CPU backend: a C++ extension (``timm_sortconv/csrc/sort_conv_cpu.cpp``) built on first use.

For a block of 32 output positions (16 in float64) and one input channel at a time, the kernel
gathers the samples of every window (bilinear taps for polar sampling), sorts each ring or the whole
window with the Batcher network of :meth:`SortGeometry.comparators` as vectorised compare-exchanges
across the block, and multiplies the sorted panel straight into the block's outputs with a
register-tiled micro-GEMM. Nothing of size ``k*k`` times the input is ever written to memory. In the
float32 forward pass with unit stride (square sampling, and polar sampling with k = 5 or 7, whose tap
positions are compiled in from ``csrc/polar_taps.h``) gathering and sorting are one pass straight from
the input into registers.

Zero padding is added inside the kernel, while it copies each image it works on into a per-thread
buffer (other padding modes, and calls with fewer images than threads, are padded by ``F.pad``
first). Backward keeps only the input, unpadded, and the weight (no index tensors, no columns): it
gathers and sorts again, recording the network's swap decisions, forms the weight gradient from the
sorted panel, and routes the panel's gradient back to the samples by replaying the swaps in reverse,
then to the input through the same taps.

The extension is compiled with ``torch.utils.cpp_extension.load`` the first time ``backend="auto"``
(or ``"cpu"``) needs it (``-O3 -march=native``, OpenMP through ``at::parallel_for``) into PyTorch's
extension cache (``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), so later
processes load it at once. The build's name carries a hash of the source, the flags, the torch and
Python versions and the CPU's model and feature flags: a cache is never reused on another CPU or
after an edit. If the build fails (no compiler, no ninja), one warning is issued and
``backend="auto"`` uses the reference path. ``TIMM_SORTCONV_DISABLE_FAST=1`` switches the backend off
(:func:`timm_sortconv.ops.backends.fast_disabled`).

Supported (``supports_cpu``): CPU tensors of float32 or float64 (input, weight and bias of one
dtype), odd ``k <= 15``, any stride, dilation and groups. Under ``torch.autocast`` on the CPU the
operator computes SC in float32 (see :mod:`.operator`), so this kernel runs there too. A gradient whose
own graph is being built (double backward) is computed by the operator through the reference path.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import warnings
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .backends import NO_PADDING, Backend, fast_disabled, register_backend
from .geometry import SortGeometry

__all__ = ["MAX_KERNEL_SIZE", "POLAR_TAP_SIZES", "build_extension", "load_extension", "polar_tap_header",
           "sort_conv2d_cpu", "supports_cpu"]

MAX_KERNEL_SIZE = 15
SUPPORTED_DTYPES = (torch.float32, torch.float64)

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "sort_conv_cpu.cpp"
_POLAR_HEADER = _SOURCE.parent / "polar_taps.h"
# Kernel sizes whose polar tap positions are compiled into the extension (polar_taps.h).
POLAR_TAP_SIZES = (5, 7)
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-fno-math-errno",
           "-fno-trapping-math", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_extension = None
_build_failed = False


def _cpu_signature() -> str:
    """The CPU's model name and feature flags: ``-march=native`` code is only valid on such a CPU."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU implementer", "CPU part") and key not in fields:
                    fields[key] = value.strip()
    except OSError:
        pass
    return f"{platform.machine()}|{platform.processor()}|{sorted(fields.items())}"


def _extension_name() -> str:
    digest = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), _POLAR_HEADER.read_bytes(), " ".join(_CFLAGS + _LDFLAGS).encode(),
                 torch.__version__.encode(), sys.version.encode(), _cpu_signature().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"timm_sortconv_cpu_{digest.hexdigest()[:16]}"


def _ninja_on_path() -> Optional[str]:
    """A ``PATH`` that reaches ninja: the venv's ``bin`` (where ``pip install ninja`` puts it) is not on
    ``PATH`` when Python is run by its full path."""
    path = os.environ.get("PATH", "")
    if shutil.which("ninja", path=path):
        return path
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if shutil.which("ninja", path=folder):
            return os.pathsep.join([folder, path])
    return None


def _import_cpp_extension():
    """``torch.utils.cpp_extension`` without its import-time warning about a missing CUDA runtime, which
    says nothing about this CPU-only build and would otherwise greet every process on a CPU machine."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.setLevel(level)
    return cpp_extension


def build_extension(name: str, folder: Path, verbose: bool = False):
    """Builds (or loads from the extension cache) ``folder/sort_conv_cpu.cpp`` with its headers as the
    module ``name``, with this backend's flags; raises where it cannot be built. ``load_extension`` uses it
    for the package's own sources, ``scripts/bench_kernel_ab.py`` for other versions of them."""
    cpp_extension = _import_cpp_extension()
    path = _ninja_on_path()
    if path is None:
        raise RuntimeError("ninja is not installed (pip install ninja)")
    saved_path = os.environ.get("PATH")
    os.environ["PATH"] = path
    try:
        return cpp_extension.load(name=name, sources=[str(folder / _SOURCE.name)], extra_include_paths=[str(folder)],
                                  extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS, verbose=verbose)
    finally:
        if saved_path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = saved_path


def load_extension(verbose: bool = False):
    """The compiled extension module, building it on first call; ``None`` if disabled or the build failed
    (a single warning says why)."""
    global _extension, _build_failed
    if _extension is not None or _build_failed or fast_disabled():
        return _extension
    with _lock:
        if _extension is not None or _build_failed:
            return _extension
        try:
            _extension = build_extension(_extension_name(), _SOURCE.parent, verbose)
        except Exception as error:  # a missing compiler raises many different error types
            _build_failed = True
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            warnings.warn(f"timm_sortconv: the fused CPU backend could not be built ({first_line}); "
                          "SortConv2d uses the (slower) reference path. Set TIMM_SORTCONV_DISABLE_FAST=1 to silence "
                          "this.",
                          RuntimeWarning, stacklevel=2)
    return _extension


def polar_tap_header() -> str:
    """The text of ``csrc/polar_taps.h``: for k in :data:`POLAR_TAP_SIZES`, the window positions (row,
    column) of every polar sample's bilinear taps, in slot order, as :func:`get_geometry` makes them.

    With the positions known at compile time the kernel reads each window value once per segment
    instead of once per tap. The kernel uses them only where they equal the tables it is given at run
    time (the weights always come from those), and a test checks that the file equals this text."""
    from .geometry import get_geometry

    lines = ["// Generated by timm_sortconv.ops.cpu_backend.polar_tap_header() from geometry.py: do not edit.",
             "// Per polar kernel size K and sample (slot order): its number of taps and their window",
             "// positions (row, column), in the order of SortGeometry.tap_offsets, zero weights left out.",
             "#pragma once", "", "template <int K>", "struct PolarTaps;"]
    for k in POLAR_TAP_SIZES:
        geometry = get_geometry(k, "polar", "ring")
        counts, taps = [], []
        for offsets, weights in zip(geometry.tap_offsets.tolist(), geometry.tap_weights.tolist()):
            used = [(dy + k // 2, dx + k // 2) for (dy, dx), w in zip(offsets, weights) if w != 0.0]
            counts.append(len(used))
            taps.append(used + [(0, 0)] * (4 - len(used)))
        rows = ",\n      ".join("{" + ", ".join(f"{{{r}, {c}}}" for r, c in sample) + "}" for sample in taps)
        lines += ["", "template <>", f"struct PolarTaps<{k}> {{",
                  f"  static constexpr int kCount[{k * k}] = {{{', '.join(map(str, counts))}}};",
                  f"  static constexpr int kTap[{k * k}][4][2] = {{\n      {rows}}};", "};"]
    return "\n".join(lines) + "\n"


def _available() -> bool:
    return load_extension() is not None


class _Tables:
    """Geometry tensors in the layout the extension reads, cached per geometry."""

    def __init__(self, geometry: SortGeometry) -> None:
        self.tap_offsets = geometry.tap_offsets.contiguous()
        self.tap_weights = geometry.tap_weights.contiguous()
        self.segments = torch.tensor(geometry.segments, dtype=torch.int64).reshape(-1, 2)
        self.comparators = torch.tensor(geometry.comparators() or [], dtype=torch.int32).reshape(-1, 2)
        self.slot_to_grid = geometry.slot_to_grid
        self.grid_to_slot = torch.argsort(geometry.slot_to_grid)


_tables: Dict[Tuple[int, str, str], _Tables] = {}


def _tables_for(geometry: SortGeometry) -> _Tables:
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting)
    if key not in _tables:
        _tables[key] = _Tables(geometry)
    return _tables[key]


def _weight_slots(weight: torch.Tensor, tables: _Tables) -> torch.Tensor:
    """``(O, C/g, k, k)`` -> ``(O, C/g * k*k)`` in slot order."""
    flat = weight.reshape(weight.shape[0], weight.shape[1], -1)
    return flat.index_select(2, tables.slot_to_grid).reshape(weight.shape[0], -1).contiguous()




def _padding_kwargs(pad: Tuple[int, int, int, int]) -> Dict[str, int]:
    """The extension's zero-padding arguments (``F.pad``'s order); none for an input already padded, so
    that ``scripts/bench_kernel_ab.py`` can run kernel versions from before they existed."""
    return dict(zip(("pad_left", "pad_right", "pad_top", "pad_bottom"), pad)) if any(pad) else {}


def _forward(x, weight, bias, geometry, stride, dilation, groups, pad=NO_PADDING):
    tables = _tables_for(geometry)
    return load_extension().forward(x, _weight_slots(weight, tables), bias, tables.tap_offsets, tables.tap_weights,
                                    tables.segments, tables.comparators, geometry.kernel_size, stride[0], stride[1],
                                    dilation[0], dilation[1], groups, **_padding_kwargs(pad))


def _backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight, pad=NO_PADDING):
    tables = _tables_for(geometry)
    grad_input, grad_weight_slots = load_extension().backward(
        grad_output, x, _weight_slots(weight, tables), tables.tap_offsets, tables.tap_weights, tables.segments,
        tables.comparators, geometry.kernel_size, stride[0], stride[1], dilation[0], dilation[1], groups,
        need_input, need_weight, **_padding_kwargs(pad))
    grad_weight = None
    if need_weight:
        out_channels, in_per_group = weight.shape[:2]
        grad_weight = (grad_weight_slots.view(out_channels, in_per_group, -1)
                       .index_select(2, tables.grid_to_slot).view_as(weight))
    return grad_input, grad_weight


def _pad_when_fewer_images_than_threads(x: torch.Tensor, pad: Tuple[int, int, int, int]):
    """The kernel pads while each thread copies the images it reads; with fewer images than threads every
    thread would copy whole images to read a part of each, so such calls are padded once here instead."""
    if any(pad) and x.shape[0] < torch.get_num_threads():
        return F.pad(x, pad), NO_PADDING
    return x, pad


def sort_conv2d_cpu(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], geometry: SortGeometry,
                    stride: Tuple[int, int], dilation: Tuple[int, int], groups: int,
                    pad: Tuple[int, int, int, int] = NO_PADDING) -> torch.Tensor:
    """The backend's forward kernel: SC of a contiguous CPU input, with ``pad`` zeros (``F.pad``'s order)
    added by the kernel itself."""
    x, pad = _pad_when_fewer_images_than_threads(x, pad)
    return _forward(x, weight, bias, geometry, stride, dilation, groups, pad)


def sort_conv2d_cpu_backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight,
                             pad=NO_PADDING):
    """The backend's backward kernel: sorts again and returns the gradients of the unpadded ``x`` and ``weight``."""
    padded, kernel_pad = _pad_when_fewer_images_than_threads(x, pad)
    grad_input, grad_weight = _backward(grad_output, padded, weight, geometry, stride, dilation, groups, need_input,
                                        need_weight, kernel_pad)
    if grad_input is not None and padded is not x:  # padded here: cut the padding's gradient off
        left, _, top, _ = pad
        grad_input = grad_input[:, :, top:top + x.shape[2], left:left + x.shape[3]]
    return grad_input, grad_weight


def supports_cpu(x, weight, bias, geometry: SortGeometry, stride, dilation, groups) -> bool:
    """Whether the fused kernel computes this call exactly as the reference path would."""
    tensors = [x, weight] + ([bias] if bias is not None else [])
    return (
        all(t.device.type == "cpu" and t.dtype == x.dtype for t in tensors)
        and x.dtype in SUPPORTED_DTYPES
        and geometry.kernel_size <= MAX_KERNEL_SIZE
    )


register_backend(Backend("cpu", sort_conv2d_cpu, sort_conv2d_cpu_backward, supports_cpu, _available,
                         zero_padding=True))
