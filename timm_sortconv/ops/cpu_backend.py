"""The fused CPU backend: a C++ extension (``timm_sortconv/csrc``: the kernel in ``sort_conv_kernel.h``, one
translation unit per dtype, Python bindings in ``sort_conv_cpu.cpp``) built on first use.

For a block of output positions (two vectors: 32 float32 positions with AVX-512, 16 with AVX2, 8 on
SSE2 or NEON; half as many in float64) and one input channel at a time, the kernel
gathers the samples of every window (bilinear taps for polar sampling), sorts each ring or the whole
window with the Batcher network of :meth:`SortGeometry.comparators` as vectorised compare-exchanges
across the block, and multiplies the sorted panel straight into the block's outputs with a
register-tiled micro-GEMM. Nothing of size ``k*k`` times the input is ever written to memory. In the
float32 forward pass with unit stride on AVX-512 and AVX2 (square sampling, and polar sampling with
k = 5 or 7, whose tap positions are compiled in from ``csrc/polar_taps.h``) gathering and sorting are one
pass straight from the input into registers, with masked loads.

Zero padding is added inside the kernel, while it copies each image it works on into a per-thread
buffer (other padding modes, and calls with fewer images than threads, are padded by ``F.pad``
first). Backward keeps only the input, unpadded, and the weight (no index tensors, no columns): it
gathers and sorts again, recording the network's swap decisions, forms the weight gradient from the
sorted panel, and routes the panel's gradient back to the samples by replaying the swaps in reverse,
then to the input through the same taps.

The aligned variants (``sorting="align"``, ``"align-channel"``: :mod:`.alignment`) have a kernel of their own in the
same extension (``csrc/align_conv_kernel.h``), on the same blocks, image copies and micro-GEMMs: per block it takes
every channel's ring spectra (the sampling taps, then each ring's real DFT), the orientation of each group (or
channel) and the gated turn, and multiplies the block's aligned columns with the weight written in the same
harmonic basis (each channel's weights through the same ring transform while the kernel repacks them, and the
weight gradient back through its transpose); its backward recomputes them and runs the gradient back through the
turn and the orientation.

The extension is compiled with ``torch.utils.cpp_extension.load`` the first time ``backend="auto"``
(or ``"cpu"``) needs it (the package's flags and OpenMP through ``at::parallel_for``), once per instruction-set
level: :mod:`timm_sortconv.ops.native` says which levels there are, how one is chosen for this CPU (as PyTorch chooses
its own kernels, ``TIMM_SORTCONV_CPU_ISA`` to name another) and with which flags; the runtime libraries of
:mod:`timm_sortconv.onnx` are built from the same sources at the same level.

Builds are cached in PyTorch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) under a name that hashes the sources, the flags, the level, the torch and
Python versions and the build environment (:func:`build_environment`: the torch installation's folder, Python's
header folders and the compiler, which the entry's ``build.ninja`` names), and every process on the machine
reuses them. The build compiles a copy of the sources kept in its cache entry, so two checkouts of the
package with identical sources in one environment share one entry, while checkouts with different sources
and environments with another torch folder (two virtual environments) get entries of their own: none
rebuilds another's (were the environment left out, each would rewrite the shared ``build.ninja`` with its
own paths and ninja would recompile at every switch). A build prints one line to stderr before it starts
(what it builds, why, about how long it takes) and one when it is done; loading a cached build prints
nothing. If the build fails (no compiler, no ninja), a warning says why, a lower level is tried, and where
none builds ``backend="auto"`` uses the reference path (the harmonic backend for the aligned variants). ``TIMM_SORTCONV_DISABLE_FAST=1`` switches the
backend off (:func:`timm_sortconv.ops.backends.fast_disabled`).

Supported (``supports_cpu``): CPU tensors of float32 or float64 (input, weight and bias of one
dtype), and of bfloat16 where the CPU multiplies bfloat16 pairs (AVX-512 BF16: :func:`bf16_products`),
``k <= 15`` (odd or even), any stride, dilation and groups, every sorting and alignment. A bfloat16 call
samples and sorts in float32 and rounds only the multiplicands to bfloat16 (``csrc/bf16_gemm.h``; an aligned
one runs in float32 throughout); ``torch.autocast(dtype=bfloat16)`` on the CPU makes such calls where this
kernel takes them, float32 calls elsewhere (see :mod:`.operator`).
A gradient whose own graph is being built (double backward) is computed by the operator through the
reference path.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .native import (CFLAGS, ISA_ENV, ISA_LEVELS, SOURCE_DIR, IsaLevel, cpu_isa, digest, missing_features,
                      runnable_isa_levels, say, stage_sources)
from .alignment import RELATIVE, TINY, harmonic_tables, is_aligned
from .backends import (DISABLE_ENV, NO_PADDING, Backend, availability_changed, environment_reader, fast_disabled,
                       register_backend)
from .checks import guide_channels
from .geometry import ALIGNMENTS, SortGeometry

__all__ = ["ISA_ENV", "ISA_LEVELS", "MAX_KERNEL_SIZE", "POLAR_TAP_SIZES", "SOURCE_DIR", "CpuKernel",
           "IsaLevel", "align_kernel_tables", "build_environment", "cpu_isa", "extension_name", "load_extension",
           "load_kernel",
           "polar_tap_header", "runnable_isa_levels", "sort_conv2d_cpu", "supports_cpu", "bf16_products"]

MAX_KERNEL_SIZE = 15
SUPPORTED_DTYPES = (torch.float32, torch.float64)

_SOURCE_NAME = "sort_conv_cpu.cpp"
# Kernel sizes whose polar tap positions are compiled into the extension (polar_taps.h).
POLAR_TAP_SIZES = (3, 5, 7)
# The package's flags with OpenMP, whose threads at::parallel_for uses.
_CFLAGS = CFLAGS + ("-fopenmp",)
_LDFLAGS = ("-fopenmp",)  # cpp_extension.load appends to the lists it is given: it gets copies

_lock = threading.RLock()
_kernels: Dict[str, "CpuKernel"] = {}  # by extension name
_package_kernel: Dict[str, Optional["CpuKernel"]] = {}  # by requested level; None: nothing could be built


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


def _sources(folder: Path) -> Dict[str, bytes]:
    """The kernel's sources in ``folder``: every ``.cpp`` (each compiled, ``sort_conv_cpu.cpp`` holding the
    Python bindings) and ``.h``, by name."""
    if not (folder / _SOURCE_NAME).is_file():
        raise FileNotFoundError(f"{folder}: no {_SOURCE_NAME} there (give a folder like {SOURCE_DIR})")
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.suffix in (".cpp", ".h")}


def build_environment() -> Tuple[str, ...]:
    """What ``cpp_extension.load`` writes into a build's ``build.ninja`` besides the sources and flags: the
    torch installation's folder as this interpreter imports it (its headers and libraries are named by
    path), Python's header folders and the C++ compiler (``CXX``, else ``c++``)."""
    paths = sysconfig.get_paths()
    return (os.path.dirname(os.path.abspath(torch.__file__)), paths.get("include", ""),
            paths.get("platinclude", ""), os.environ.get("CXX", "c++"))


def extension_name(sources: Dict[str, bytes], isa: str) -> str:
    """The cache entry's name: a hash of the sources, the flags, the level, the torch and Python versions and
    :func:`build_environment` (not of where the sources are, nor of the CPU model)."""
    tag = digest(sources, " ".join(_CFLAGS + ISA_LEVELS[isa].flags + _LDFLAGS), isa, torch.__version__, sys.version,
                 *build_environment())
    return f"timm_sortconv_cpu_{isa}_{tag}"


def _build(sources: Dict[str, bytes], isa: str, verbose: bool) -> ModuleType:
    """Compiles (or loads from the cache) the sources for ``isa``; raises where they cannot be built. A build
    (no library in the cache entry yet) is announced on stderr before it starts and when it is done."""
    cpp_extension = _import_cpp_extension()
    path = _ninja_on_path()
    if path is None:
        raise RuntimeError("ninja is not installed (pip install ninja)")
    name = extension_name(sources, isa)
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())
    build_directory = root / name
    source_folder = build_directory / "src"
    stage_sources(sources, source_folder)
    # Every .cpp is a translation unit of its own (ninja compiles them in parallel).
    units = [str(source_folder / file_name) for file_name in sources if file_name.endswith(".cpp")]
    library = build_directory / (name + (".pyd" if sys.platform == "win32" else ".so"))
    compiles = not library.is_file()
    if compiles:
        say(f"compiling the fused CPU kernel ({isa} level, {len(units)} C++ files) into {build_directory}, "
             f"because this Python environment (torch {torch.__version__} in {build_environment()[0]}) has no "
             f"build of these sources yet; this takes about a minute on 2 idle cores, once per environment")
    start = time.perf_counter()
    saved_path = os.environ.get("PATH")
    os.environ["PATH"] = path
    try:
        module = cpp_extension.load(name=name, sources=units, extra_include_paths=[str(source_folder)],
                                    extra_cflags=list(_CFLAGS + ISA_LEVELS[isa].flags), extra_ldflags=list(_LDFLAGS),
                                    build_directory=str(build_directory), verbose=verbose)
        if compiles:
            say(f"the fused CPU kernel ({isa}) is built ({time.perf_counter() - start:.0f} s); later processes "
                 "of this environment load it from the cache")
        return module
    finally:
        if saved_path is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = saved_path


def load_kernel(folder: Optional[os.PathLike] = None, isa: Optional[str] = None, verbose: bool = False) -> "CpuKernel":
    """The kernel compiled from ``folder`` (a folder holding ``sort_conv_cpu.cpp`` and its headers; default:
    the package's own) for the instruction-set level ``isa`` (default: :func:`cpu_isa`), built on first use
    and cached on disk and in this process. Raises where the CPU cannot run the level or the build fails.
    ``scripts/research/bench_kernel_ab.py`` uses it to run versions of the kernel side by side."""
    isa = cpu_isa() if isa is None else isa
    if isa not in ISA_LEVELS:
        raise ValueError(f"isa={isa!r} is not an instruction-set level; accepted: {', '.join(ISA_LEVELS)}")
    missing = missing_features(ISA_LEVELS[isa])
    if missing:
        raise RuntimeError(f"this CPU cannot run the {isa} level (it lacks {', '.join(missing)})")
    sources = _sources(Path(SOURCE_DIR if folder is None else folder))
    name = extension_name(sources, isa)
    with _lock:
        if name not in _kernels:
            _kernels[name] = CpuKernel(_build(sources, isa, verbose), isa)
        return _kernels[name]


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _package_kernel_for(isa: str, verbose: bool = False) -> Optional["CpuKernel"]:
    """The package's kernel for ``isa``, or for the highest lower level that builds (one warning per level
    that does not); None where none builds."""
    if isa in _package_kernel:
        return _package_kernel[isa]
    with _lock:
        if isa in _package_kernel:
            return _package_kernel[isa]
        kernel, failures = None, []
        names = list(ISA_LEVELS)
        for level in names[names.index(isa):]:
            try:
                kernel = load_kernel(None, level, verbose)
                break
            except Exception as error:  # a missing compiler raises many different error types
                failures.append(f"{level}: {_first_line(error)}")
        if failures:
            outcome = (f"using the {kernel.isa} build" if kernel is not None else
                       "SortConv2d uses the (slower) reference path")
            warnings.warn(f"timm_sortconv: the fused CPU backend could not be built ({'; '.join(failures)}); "
                          f"{outcome}. Set {DISABLE_ENV}=1 to silence this.", RuntimeWarning, stacklevel=3)
        _package_kernel[isa] = kernel
        availability_changed()  # "auto" takes this kernel, or knows there is none, from now on
        return kernel


def load_extension(verbose: bool = False) -> Optional[ModuleType]:
    """The compiled extension module of the package's sources at :func:`cpu_isa`'s level, building it on first
    call; ``None`` if disabled or nothing could be built (a single warning says why)."""
    if fast_disabled():
        return None
    kernel = _package_kernel_for(cpu_isa(), verbose)
    return None if kernel is None else kernel.module


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


def _folded_dft(geometry: SortGeometry) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each ring's real DFT as the kernel computes it: a fold, then small dense blocks. Returns ``(fold, dft,
    blocks)``: ``fold`` and ``dft`` ``(k*k, k*k)``, ``blocks`` ``(n, 2)`` (start, size) of ``dft``'s diagonal blocks;
    ``dft @ fold`` are the rows of :attr:`.alignment.HarmonicTables.analysis`, in the kernel's order.

    A ring of ``N`` samples ``s_j`` has ``Re S_m = sum_j s_j cos(2 pi m j / N)`` and ``Im S_m = -sum_j s_j sin(2 pi m
    j / N)``; ``j`` and ``N - j`` share the cosine and have opposite sines, so with ``u_j = s_j + s_{N-j}`` and
    ``v_j = s_j - s_{N-j}`` (``0 < j < N/2``) the cosine rows (``S_0``, ``Re S_m`` for ``0 < m < N/2``, the Nyquist
    ``S_{N/2}`` of an even ring) read only ``s_0``, the ``u_j`` and ``s_{N/2}``, and the sine rows (``Im S_m``) only the
    ``v_j``: two square blocks of about ``N/2`` a side, half the products of the whole ``N x N`` transform, each a
    micro-GEMM over a block's lanes. The centre is a block of its own."""
    slots = geometry.kernel_size ** 2
    fold = torch.zeros(slots, slots, dtype=torch.float64)
    dft = torch.zeros(slots, slots, dtype=torch.float64)
    blocks, row = [], 0
    for start, end in geometry.segments:
        n = end - start
        if n == 1:
            fold[row, start] = dft[row, row] = 1.0
            blocks.append((row, 1))
            row += 1
            continue
        pairs = range(1, (n + 1) // 2)  # 0 < j < N/2, and the harmonics 0 < m < N/2
        cosine = [0, *pairs] + ([n // 2] if n % 2 == 0 else [])  # folded inputs j, and harmonics m
        for i, j in enumerate(cosine):
            fold[row + i, start + j] = 1.0
            if 0 < j < n / 2:
                fold[row + i, start + n - j] = 1.0
        for a, m in enumerate(cosine):
            for b, j in enumerate(cosine):
                dft[row + a, row + b] = torch.cos(torch.tensor(2 * torch.pi * (m * j % n) / n, dtype=torch.float64))
        blocks.append((row, len(cosine)))
        row += len(cosine)
        for i, j in enumerate(pairs):
            fold[row + i, start + j], fold[row + i, start + n - j] = 1.0, -1.0
        for a, m in enumerate(pairs):
            for b, j in enumerate(pairs):
                dft[row + a, row + b] = -torch.sin(torch.tensor(2 * torch.pi * (m * j % n) / n, dtype=torch.float64))
        blocks.append((row, len(pairs)))
        row += len(pairs)
    # cos(pi/2) and sin(pi) come out as about 1e-16: exact zeros
    dft = dft.masked_fill(dft.abs() < 1e-12, 0.0)
    return fold, dft, torch.tensor([b for b in blocks if b[1] > 0], dtype=torch.int64).reshape(-1, 2)


class _AlignTables:
    """The aligned variants' tables as the extension reads them, cached per geometry and dtype: ``kwargs`` for
    ``align_forward``/``align_backward`` (:func:`_folded_dft`, and :func:`.alignment.harmonic_tables`'s description
    of each harmonic channel, at the kernel's row of that channel); ``to_harmonic`` ``(k*k, k*k)``, which takes
    each channel's weights in grid order to the harmonic basis in the kernel's order (the inverse transform's rows
    in grid order: the product of the slot-order weight with the aligned samples is the product of the harmonic
    weight with the aligned harmonics), and ``weight_scale``, with which the kernel computes that product itself;
    ``guide_first`` (:func:`_guide_first`)."""

    def __init__(self, geometry: SortGeometry, dtype: torch.dtype) -> None:
        exact = harmonic_tables(geometry, torch.device("cpu"), torch.float64)
        fold, dft, blocks = _folded_dft(geometry)
        analysis = dft @ fold  # the analysis rows in the kernel's order
        # order[row]: the harmonic channel (harmonic_tables' order) at the kernel's row, found by its analysis row
        distance = torch.cdist(analysis, exact.analysis, p=float("inf"))
        order = distance.argmin(1)
        if not (distance.amin(1) < 1e-9).all() or sorted(order.tolist()) != list(range(len(order))):
            raise AssertionError(f"the folded DFT of {geometry} does not match harmonic_tables")
        row_of = torch.argsort(order)  # the kernel's row of each harmonic channel
        fixed, pairs = exact.fixed, exact.pair_harmonic.numel()
        self.kwargs = dict(
            fold=fold, dft=dft, blocks=blocks,
            pairs=torch.stack([row_of[fixed:fixed + pairs], row_of[fixed + pairs:], exact.pair_harmonic], 1),
            first=exact.first, energy_pairs=exact.energy_pairs,
            fixed=torch.stack([row_of[:fixed], exact.nyquist], 1), energy_fixed=exact.energy_fixed,
            shared=ALIGNMENTS[geometry.sorting] == "shared", relative=RELATIVE, tiny=TINY)
        self.to_harmonic = exact.synthesis[torch.argsort(geometry.slot_to_grid)][:, order].to(dtype)
        # 1 / |row|^2 of the analysis: the kernel's harmonic weight is the analysis of the slot-order weight with
        # its rows scaled by this (the synthesis is the analysis transposed and so scaled)
        self.weight_scale = (analysis ** 2).sum(1).reciprocal()
        self.guide_first = _guide_first(geometry, analysis, self.kwargs)


def _guide_first(geometry: SortGeometry, analysis: torch.Tensor, tables: Dict[str, object]) -> torch.Tensor:
    """``(3, k*k)``: a guide channel's ``c_re`` and ``c_im`` as sums over its samples in slot order, and for each slot
    the weight ``w`` of its ring's squared mean in ``E``, for the kernel to take a guide's orientation without its
    ring DFTs: where ``E``'s terms of each ring of ``N`` samples are Parseval's sum over ``m != 0`` plus ``S_0``'s
    share, ``E_ring = sum_j (s_j - mean)^2 / N + w mean^2`` (checked here, in float64, as quadratic forms of the
    samples). ``(0, k*k)`` where they are not (the kernel then takes the guide's spectra)."""
    pairs, fixed = tables["pairs"].long(), tables["fixed"].long()
    first = tables["first"].to(torch.float64)
    rows = [(pairs[:, 0], tables["energy_pairs"]), (pairs[:, 1], tables["energy_pairs"]),
            (fixed[:, 0], tables["energy_fixed"])]
    energy = sum((analysis[r].t() * w.to(torch.float64)) @ analysis[r] for r, w in rows)
    expected = torch.zeros_like(energy)
    level = torch.zeros(analysis.shape[1], dtype=torch.float64)
    for start, end in geometry.segments:
        n = end - start
        level[start:end] = energy[start:end, start:end].sum()  # the form's value at s = 1: w
        expected[start:end, start:end] = torch.eye(n, dtype=torch.float64) / n + (level[start] - 1.0) / n ** 2
    if not torch.allclose(energy, expected, rtol=0.0, atol=1e-12):
        return torch.zeros(0, analysis.shape[1], dtype=torch.float64)
    return torch.stack([first @ analysis[pairs[:, 0]], first @ analysis[pairs[:, 1]], level])


_align_tables: Dict[Tuple[int, str, str, torch.dtype], _AlignTables] = {}


def _align_tables_for(geometry: SortGeometry, dtype: torch.dtype) -> _AlignTables:
    key = (geometry.kernel_size, geometry.sampling, geometry.sorting, dtype)
    if key not in _align_tables:
        _align_tables[key] = _AlignTables(geometry, dtype)
    return _align_tables[key]


def align_kernel_tables(geometry: SortGeometry) -> Dict[str, object]:
    """The tables the aligned kernel takes for ``geometry`` besides the tensors and the sampling tables, by the
    extension's argument names (float32 calls): ``fold``, ``dft``, ``blocks``, ``pairs``, ``first``,
    ``energy_pairs``, ``fixed``, ``energy_fixed``, ``shared``, ``relative``, ``tiny``, ``weight_scale`` and
    ``guide_first``. The onnxruntime node carries them as attributes (:mod:`timm_sortconv.onnx.fused`), so that this
    stays the one place they are computed."""
    align = _align_tables_for(geometry, torch.float32)
    return dict(align.kwargs, weight_scale=align.weight_scale, guide_first=align.guide_first)


def _align_weight_args(module: ModuleType, weight: torch.Tensor, geometry: SortGeometry,
                       align: _AlignTables) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The weight as the extension's ``align_forward``/``align_backward`` take it, and their keywords for it and
    for a guide: ``(O, C/g * k*k)`` in grid order with its slot order and the harmonic rows' scale (the kernel takes
    it to the harmonic basis while repacking it), and :func:`_guide_first`; or, for a kernel from before those
    arguments (``scripts/research/bench_kernel_ab.py`` loads older versions), already in the harmonic basis
    (``weight @ to_harmonic``)."""
    if getattr(module, "align_takes_grid_weight", False):
        return weight.reshape(weight.shape[0], -1), {"slot_to_grid": _tables_for(geometry).slot_to_grid,
                                                     "weight_scale": align.weight_scale,
                                                     "guide_first": align.guide_first}
    flat = weight.reshape(weight.shape[0], weight.shape[1], -1) @ align.to_harmonic
    return flat.reshape(weight.shape[0], -1), {}


def _guide_kwargs(x: torch.Tensor, weight: torch.Tensor, groups: int, geometry: SortGeometry) -> Dict[str, int]:
    """The extension's ``guides`` argument: :func:`.checks.guide_channels` of the call (the operator has checked that
    the channels fit); none where there are none, so that ``scripts/research/bench_kernel_ab.py`` can run kernel
    versions from before the argument existed."""
    guides = guide_channels(x.shape[1], weight, groups, geometry.sorting)
    return {"guides": guides} if guides else {}


def _geometry_args(geometry: SortGeometry, tables: _Tables, stride, dilation, groups) -> Dict[str, object]:
    return dict(tap_offsets=tables.tap_offsets, tap_weights=tables.tap_weights, segments=tables.segments,
                kernel_size=geometry.kernel_size, stride_h=stride[0], stride_w=stride[1], dilation_h=dilation[0],
                dilation_w=dilation[1], groups=groups)


def _weight_args(module: ModuleType, weight: torch.Tensor, tables: _Tables) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The weight as ``(O, C/g * k*k)`` and the extension's keyword for its order: in grid order with
    ``slot_to_grid`` (the kernel permutes it while repacking), or, for a kernel from before that argument
    (``scripts/research/bench_kernel_ab.py`` loads older versions), reordered into slot order here."""
    flat = weight.reshape(weight.shape[0], -1).contiguous()
    if getattr(module, "takes_slot_to_grid", False):
        return flat, {"slot_to_grid": tables.slot_to_grid}
    slots = flat.view(weight.shape[0], weight.shape[1], -1).index_select(2, tables.slot_to_grid)
    return slots.reshape(weight.shape[0], -1), {}


def _padding_kwargs(pad: Tuple[int, int, int, int]) -> Dict[str, int]:
    """The extension's zero-padding arguments (``F.pad``'s order); none for an input already padded, so
    that ``scripts/research/bench_kernel_ab.py`` can run kernel versions from before they existed."""
    return dict(zip(("pad_left", "pad_right", "pad_top", "pad_bottom"), pad)) if any(pad) else {}


@dataclass(frozen=True)
class CpuKernel:
    """A compiled kernel (see :func:`load_kernel`): ``forward`` and ``backward`` take the arguments of the
    backend's ``_forward`` and ``_backward`` (weights in grid order, geometry tables made here)."""

    module: ModuleType
    isa: str
    #: Whether the module is this package's own build, which takes the weight in grid order with ``slot_to_grid``
    #: and the zero padding (``scripts/research/bench_kernel_ab.py`` loads older ones) ...
    current: bool = field(init=False)
    #: ... and the 4-D weight itself, answering its gradient in its shape.
    whole_weight: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "current", getattr(self.module, "takes_slot_to_grid", False))
        object.__setattr__(self, "whole_weight", self.current and getattr(self.module, "takes_4d_weight", False))

    def forward(self, x, weight, bias, geometry, stride, dilation, groups, pad=NO_PADDING):
        if is_aligned(geometry):
            return self._align_forward(x, weight, bias, geometry, stride, dilation, groups, pad)
        tables = _tables_for(geometry)
        if self.current:  # positional arguments: the binding parses them several microseconds faster
            return self.module.forward(x, weight if self.whole_weight else weight.reshape(weight.shape[0], -1), bias,
                                       tables.tap_offsets, tables.tap_weights, tables.segments, tables.comparators,
                                       geometry.kernel_size, stride[0], stride[1], dilation[0], dilation[1], groups,
                                       pad[0], pad[1], pad[2], pad[3], tables.slot_to_grid)
        flat, order = _weight_args(self.module, weight, tables)
        return self.module.forward(x, flat, bias, tables.tap_offsets, tables.tap_weights, tables.segments,
                                   tables.comparators, geometry.kernel_size, stride[0], stride[1], dilation[0],
                                   dilation[1], groups, **_padding_kwargs(pad), **order)

    def backward(self, grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight,
                 pad=NO_PADDING):
        if is_aligned(geometry):
            return self._align_backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input,
                                        need_weight, pad)
        tables = _tables_for(geometry)
        if self.current:
            grad_input, grad_weight = self.module.backward(
                grad_output, x, weight if self.whole_weight else weight.reshape(weight.shape[0], -1),
                tables.tap_offsets, tables.tap_weights, tables.segments, tables.comparators, geometry.kernel_size,
                stride[0], stride[1], dilation[0], dilation[1], groups, need_input, need_weight, pad[0], pad[1],
                pad[2], pad[3], tables.slot_to_grid)
            if not need_weight:
                return grad_input, None
            return grad_input, (grad_weight if self.whole_weight else grad_weight.view_as(weight))
        flat, order = _weight_args(self.module, weight, tables)
        grad_input, grad_weight = self.module.backward(
            grad_output, x, flat, tables.tap_offsets, tables.tap_weights, tables.segments, tables.comparators,
            geometry.kernel_size, stride[0], stride[1], dilation[0], dilation[1], groups, need_input, need_weight,
            **_padding_kwargs(pad), **order)
        if not need_weight:
            return grad_input, None
        if not order:  # an older kernel answers in slot order
            out_channels, in_per_group = weight.shape[:2]
            grad_weight = grad_weight.view(out_channels, in_per_group, -1).index_select(2, tables.grid_to_slot)
        return grad_input, grad_weight.view_as(weight)

    # The aligned variants (csrc/align_conv_kernel.h). The kernel multiplies in the harmonic basis and takes the
    # weight there itself (_align_weight_args). A bfloat16 call is computed in float32 (products included) and
    # rounded to bfloat16 at the end.
    def _align_forward(self, x, weight, bias, geometry, stride, dilation, groups, pad):
        if x.dtype == torch.bfloat16:
            bias = None if bias is None else bias.float()
            return self._align_forward(x.float(), weight.float(), bias, geometry, stride, dilation, groups,
                                       pad).bfloat16()
        align = _align_tables_for(geometry, x.dtype)
        flat, weight_kwargs = _align_weight_args(self.module, weight, geometry, align)
        return self.module.align_forward(x, flat, bias=bias, **weight_kwargs,
                                         **_geometry_args(geometry, _tables_for(geometry), stride, dilation, groups),
                                         **align.kwargs, **_padding_kwargs(pad),
                                         **_guide_kwargs(x, weight, groups, geometry))

    def _align_backward(self, grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight,
                        pad):
        if x.dtype == torch.bfloat16:
            grads = self._align_backward(grad_output.float(), x.float(), weight.float(), geometry, stride, dilation,
                                         groups, need_input, need_weight, pad)
            return tuple(None if g is None else g.bfloat16() for g in grads)
        align = _align_tables_for(geometry, x.dtype)
        flat, weight_kwargs = _align_weight_args(self.module, weight, geometry, align)
        grad_input, grad_weight = self.module.align_backward(
            grad_output, x, flat, **weight_kwargs,
            **_geometry_args(geometry, _tables_for(geometry), stride, dilation, groups),
            **align.kwargs, need_input_grad=need_input, need_weight_grad=need_weight, **_padding_kwargs(pad),
            **_guide_kwargs(x, weight, groups, geometry))
        if not need_weight:
            return grad_input, None
        if not weight_kwargs:  # an older kernel answers in the harmonic basis
            grad_weight = grad_weight.view(weight.shape[0], weight.shape[1], -1) @ align.to_harmonic.t()
        return grad_input, grad_weight.view_as(weight)


# TIMM_SORTCONV_CPU_ISA as set -> (the level it asks for, its kernel): what _kernel() answers, the setting read
# per call without resolving it again (valid while _package_kernel holds that kernel).
_kernel_for_setting: Dict[Optional[str], Tuple[str, CpuKernel]] = {}


_isa_setting = environment_reader(ISA_ENV)


def _kernel() -> CpuKernel:
    setting = _isa_setting()
    found = _kernel_for_setting.get(setting)
    if found is not None and _package_kernel.get(found[0]) is found[1]:
        return found[1]
    isa = cpu_isa()
    kernel = _package_kernel_for(isa)
    if kernel is None:
        raise RuntimeError("the fused CPU backend could not be built (see the warning issued at first use)")
    _kernel_for_setting[setting] = (isa, kernel)
    return kernel


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
    return _kernel().forward(x, weight, bias, geometry, stride, dilation, groups, pad)


def sort_conv2d_cpu_backward(grad_output, x, weight, geometry, stride, dilation, groups, need_input, need_weight,
                             pad=NO_PADDING):
    """The backend's backward kernel: sorts again and returns the gradients of the unpadded ``x`` and ``weight``."""
    padded, kernel_pad = _pad_when_fewer_images_than_threads(x, pad)
    grad_input, grad_weight = _kernel().backward(grad_output, padded, weight, geometry, stride, dilation, groups,
                                                 need_input, need_weight, kernel_pad)
    if grad_input is not None and padded is not x:  # padded here: cut the padding's gradient off
        left, _, top, _ = pad
        grad_input = grad_input[:, :, top:top + x.shape[2], left:left + x.shape[3]]
    return grad_input, grad_weight


def bf16_products() -> bool:
    """Whether the fused kernel takes bfloat16 calls on this CPU, multiplying in bfloat16 (AVX-512 BF16, in
    the AVX-512 build): the windows are sampled and sorted in float32 from the bfloat16 input, the sorted
    values, weights and output gradients rounded to bfloat16 for the products, which sum in float32."""
    if fast_disabled():
        return False
    module = load_extension()
    return module is not None and bool(getattr(module, "bf16_products", lambda: False)())


def supports_cpu(x, weight, bias, geometry: SortGeometry, stride, dilation, groups) -> bool:
    """Whether the fused kernel computes this call as the reference path would: exactly for float32 and
    float64, and for bfloat16 (where :func:`bf16_products`) with bfloat16 products of float32-sorted windows
    (the aligned variants: in float32 throughout, rounded to bfloat16 at the end)."""
    tensors = [x, weight] + ([bias] if bias is not None else [])
    return (
        all(t.device.type == "cpu" and t.dtype == x.dtype for t in tensors)
        and (x.dtype in SUPPORTED_DTYPES or (x.dtype == torch.bfloat16 and bf16_products()))
        and geometry.kernel_size <= MAX_KERNEL_SIZE
    )


# Ahead of the harmonic backend: auto takes this kernel for the aligned variants on the CPU.
register_backend(Backend("cpu", sort_conv2d_cpu, sort_conv2d_cpu_backward, supports_cpu, _available,
                         zero_padding=True), before="harmonic")
