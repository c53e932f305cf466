"""Building the package's C++ kernels: instruction-set levels, compiler flags, the cache, the compile.

One source tree (``csrc/``) is compiled into three kinds of library, which all read what is here:

* the PyTorch extension (:mod:`.cpu_backend`, through ``torch.utils.cpp_extension``: it links libtorch);
* the runtime libraries of :mod:`timm_sortconv.onnx` (onnxruntime's operator library,
  :mod:`timm_sortconv.onnx.runtime`): plain shared libraries compiled by :func:`build_library` with the same optimisation flags and level, without
  libtorch.

**Levels** (:data:`ISA_LEVELS`): ``avx512`` (``-march=x86-64-v4``), ``avx2`` (``-march=x86-64-v3``: AVX2 and FMA)
and ``generic`` (the compiler's default for the machine: SSE2 on x86-64, NEON on aarch64). As PyTorch's own CPU
kernels do, the level follows ``torch.backends.cpu.get_cpu_capability()`` (so ``ATEN_CPU_CAPABILITY=avx2`` limits it
too), never above what the CPU can run; ``TIMM_SORTCONV_CPU_ISA`` names another level, and a level the CPU cannot run
is refused with an error, never executed. No build is specific to one CPU model (``-march=native`` is not used), so a
cache entry serves every CPU of its level, and nothing here is specific to x86-64: on another machine the level is
``generic``.

**Cache**: a library built by :func:`build_library` is named by a hash of its sources, flags, level, compiler and
include folders, under :func:`cache_dir`, so it is compiled once per change and found by every later process.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = ["CACHE_ENV", "CFLAGS", "ISA_ENV", "ISA_LEVELS", "SOURCE_DIR", "BuildError", "IsaLevel", "build_library",
           "cache_dir", "check_isa", "compiler", "cpu_isa", "digest", "library_file", "runnable_isa_levels", "say",
           "stage_sources"]

#: The kernels' sources.
SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc"
#: Names an instruction-set level for every build of this process (default: PyTorch's, within the CPU's).
ISA_ENV = "TIMM_SORTCONV_CPU_ISA"
#: Where :func:`build_library` keeps its builds (default: :func:`cache_dir`).
CACHE_ENV = "TIMM_SORTCONV_CACHE"
#: Optimisation and floating-point flags of every build. Contraction into FMAs is allowed (the kernels are tested
#: against the reference path to a tolerance, not bit for bit); errno and traps are not needed by the kernels.
CFLAGS = ("-O3", "-ffp-contract=fast", "-fno-math-errno", "-fno-trapping-math", "-DNDEBUG")


@dataclass(frozen=True)
class IsaLevel:
    """An instruction-set level the kernels are compiled for: its compiler flags, the machines it is for, and the
    CPU features (``torch.cpu.get_capabilities()`` names) it needs to run."""

    name: str
    flags: Tuple[str, ...]
    machines: Tuple[str, ...]  # platform.machine() values; empty: every machine
    features: Tuple[str, ...]


_X86 = ("x86_64", "AMD64", "amd64")
# -march=x86-64-v3: AVX, AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE (and XSAVE, which every AVX CPU has);
# -march=x86-64-v4 adds AVX-512 F, BW, CD, DQ and VL. Both leave the tuning generic.
_V3_FEATURES = ("avx", "avx2", "fma3", "bmi", "bmi2", "f16c", "lzcnt", "movbe")
_V4_FEATURES = _V3_FEATURES + ("avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl")
#: Highest first: the order in which a failed build falls back.
ISA_LEVELS: Dict[str, IsaLevel] = {
    "avx512": IsaLevel("avx512", ("-march=x86-64-v4",), _X86, _V4_FEATURES),
    "avx2": IsaLevel("avx2", ("-march=x86-64-v3",), _X86, _V3_FEATURES),
    "generic": IsaLevel("generic", (), (), ()),
}
# torch.backends.cpu.get_cpu_capability() -> the level that matches it (others: generic).
_TORCH_CAPABILITY = {"AVX512": "avx512", "AVX2": "avx2"}


class BuildError(RuntimeError):
    """A library cannot be built here; the message says why in one line."""


@functools.lru_cache(maxsize=None)
def _cpu_features() -> frozenset:
    """The CPU's features under ``torch.cpu.get_capabilities()``'s names (cpuinfo, which also checks that
    the OS saves the registers), or ``/proc/cpuinfo``'s flags with older torch. MOVBE, which cpuinfo does not
    report, is read from ``/proc/cpuinfo``; without that file it is taken to come with AVX2, as it does on
    Intel's AVX2 CPUs (since Haswell) and AMD's (since Excavator)."""
    features = set()
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is not None:
        features |= {name for name, value in capabilities().items() if value is True}
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    # /proc/cpuinfo's names for the features cpuinfo calls otherwise.
    renamed = {"fma": "fma3", "bmi1": "bmi", "abm": "lzcnt", "avx512f": "avx512_f", "avx512bw": "avx512_bw",
               "avx512cd": "avx512_cd", "avx512dq": "avx512_dq", "avx512vl": "avx512_vl"}
    if capabilities is None:
        features |= {renamed.get(flag, flag) for flag in flags}
    elif "movbe" in flags or (not flags and "avx2" in features):
        features.add("movbe")
    return frozenset(features)


def missing_features(level: IsaLevel) -> Tuple[str, ...]:
    """What this CPU lacks to run ``level`` (empty: it runs it)."""
    if level.machines and platform.machine() not in level.machines:
        return (f"an {level.machines[0]} CPU (this one is {platform.machine() or 'unknown'})",)
    return tuple(feature for feature in level.features if feature not in _cpu_features())


def runnable_isa_levels() -> Tuple[str, ...]:
    """The levels of :data:`ISA_LEVELS` this CPU can run, highest first (``generic`` always)."""
    return tuple(name for name, level in ISA_LEVELS.items() if not missing_features(level))


@functools.lru_cache(maxsize=None)
def _resolve_isa(requested: Optional[str]) -> str:
    runnable = runnable_isa_levels()
    if requested is None:
        # As PyTorch chooses its own kernels (ATEN_CPU_CAPABILITY included), but never above this CPU.
        preferred = _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), "generic")
        names = list(ISA_LEVELS)
        return next(name for name in names[names.index(preferred):] if name in runnable)
    if requested not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={requested!r} is not an instruction-set level; accepted: "
                         f"{', '.join(ISA_LEVELS)}")
    missing = missing_features(ISA_LEVELS[requested])
    if missing:
        raise RuntimeError(f"{ISA_ENV}={requested}: this CPU cannot run that level (it lacks "
                           f"{', '.join(missing)}); levels it can run: {', '.join(runnable)}")
    return requested


def cpu_isa() -> str:
    """The instruction-set level the kernels are built for in this process: ``TIMM_SORTCONV_CPU_ISA`` if set (read
    at every call; a level this CPU cannot run raises ``RuntimeError``, an unknown name ``ValueError``), else the
    level of ``torch.backends.cpu.get_cpu_capability()``, capped at what the CPU runs."""
    requested = os.environ.get(ISA_ENV, "").strip().lower()
    return _resolve_isa(requested or None)


def check_isa(isa: Optional[str]) -> str:
    """``isa`` if it is a level of :data:`ISA_LEVELS` (``None``: :func:`cpu_isa`), else :class:`BuildError` naming
    the accepted ones. A level this CPU cannot run may still be built (for another machine)."""
    if isa is None:
        return cpu_isa()
    if isa not in ISA_LEVELS:
        raise BuildError(f"isa={isa!r} is not an instruction-set level; accepted: {', '.join(ISA_LEVELS)}")
    return isa


def say(line: str) -> None:
    """One line of the package's build messages, on stderr."""
    sys.stderr.write(f"timm_sortconv: {line}\n")
    sys.stderr.flush()


def digest(sources: Dict[str, bytes], *parts: str) -> str:
    """A hash of ``sources`` (name -> text) and ``parts`` (flags, level, versions): a build's cache name."""
    hashed = hashlib.sha256()
    for name, text in sources.items():
        hashed.update(name.encode() + b"\0" + text + b"\0")
    for part in parts:
        hashed.update(part.encode() + b"\0")
    return hashed.hexdigest()[:16]


def stage_sources(sources: Dict[str, bytes], folder: Path) -> None:
    """Writes the sources into a build's own folder where they are missing or differ, and leaves identical files
    untouched (a build tool rebuilds what is newer than its output)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        path = folder / name
        if path.is_file() and path.read_bytes() == text:
            continue
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{name}.", delete=False) as f:
            f.write(text)
        os.replace(f.name, path)


def cache_dir() -> Path:
    """``TIMM_SORTCONV_CACHE`` if set; in a checkout of the repository its ignored ``.cache/native``; else
    ``~/.cache/timm_sortconv``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    checkout = SOURCE_DIR.parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / ".git").exists():
        return checkout / ".cache" / "native"
    return Path.home() / ".cache" / "timm_sortconv"


def compiler() -> str:
    """The C++ compiler: ``CXX``, else ``c++``; :class:`BuildError` where it is not on ``PATH``."""
    found = os.environ.get("CXX", "c++")
    if shutil.which(found) is None:
        raise BuildError(f"no C++ compiler: {found!r} is not on PATH (install g++ or clang++, or set CXX)")
    return found


def _library_sources(source: Path, include_dirs: Sequence[Path]) -> Dict[str, bytes]:
    """The source and every header it may include (the kernels' and the include folders'), by relative name."""
    sources = {source.name: source.read_bytes()}
    for folder in (SOURCE_DIR, *include_dirs):
        for path in sorted(folder.rglob("*.h")):
            sources[str(path.relative_to(folder.parent))] = path.read_bytes()
    return sources


def library_file(name: str, source: Path, include_dirs: Sequence[Path] = (), isa: Optional[str] = None,
                 flags: Sequence[str] = (), libraries: Sequence[str] = ()) -> Path:
    """Where :func:`build_library` keeps the build of these arguments (it may not exist yet)."""
    isa = check_isa(isa)
    tag = digest(_library_sources(source, include_dirs), " ".join(_flags(isa, flags)), " ".join(libraries), isa,
                 compiler(), *map(str, include_dirs))
    return cache_dir() / "build" / f"{name}_{isa}_{tag}{'.dll' if sys.platform == 'win32' else '.so'}"


def _flags(isa: str, flags: Sequence[str]) -> Tuple[str, ...]:
    # The SIMD pragmas without OpenMP's runtime: a runtime library's threads are the runtime's.
    return CFLAGS + ISA_LEVELS[isa].flags + ("-fopenmp-simd", "-std=c++17", "-fPIC", "-shared",
                                             "-fvisibility=hidden") + tuple(flags)


_lock = threading.Lock()


def build_library(name: str, source: Path, include_dirs: Sequence[Path] = (), isa: Optional[str] = None,
                  flags: Sequence[str] = (), libraries: Sequence[str] = (), verbose: bool = False) -> Path:
    """A shared library compiled from ``source`` (with ``csrc/`` and ``include_dirs`` on the include path, linked
    with ``libraries``, which come after it on the command line as the linker wants them) at ``isa`` (default:
    :func:`cpu_isa`), from the cache where it was built before; otherwise compiled into it, with one line on stderr
    saying so. Raises :class:`BuildError` with a one-line reason where it cannot be built."""
    isa = check_isa(isa)
    with _lock:
        path = library_file(name, source, include_dirs, isa, flags, libraries)
        if path.is_file():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        includes = [f"-I{folder}" for folder in include_dirs]
        command = [compiler(), *_flags(isa, flags), *includes, str(source), *libraries, "-o", str(partial)]
        say(f"compiling {name} ({isa} level) into {path}; this takes under a minute, once")
        if verbose:
            sys.stderr.write(" ".join(command) + "\n")
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            raise BuildError(f"cannot run the C++ compiler {command[0]!r}: {error}") from None
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            if verbose:
                sys.stderr.write(done.stderr)
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise BuildError(f"compiling {source.name} failed: {errors[0] if errors else 'no message'}"
                             + ("" if verbose else " (verbose=True prints the command and every message)"))
        os.replace(partial, path)
        return path
