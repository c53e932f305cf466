"""The onnxruntime custom-operator library that runs an SC layer as one node: building it and finding it.

The library (``csrc/onnxruntime/sort_conv_op.cpp``) computes the node ``timm_sortconv::SortConv2d`` (the forward of
one SC layer in float32, written by :mod:`.fused_export`) with the fused kernel that PyTorch's CPU backend runs
(``csrc/sort_conv_kernel.h``), compiled without libtorch. It needs onnxruntime's C API headers, which the onnxruntime
wheel does not ship: they are taken from Debian's ``libonnxruntime-dev`` package (onnxruntime 1.21), downloaded once
and checked against its SHA-256 (:data:`HEADERS_URL`, :data:`HEADERS_SHA256`), or from a folder named by
``ORT_INCLUDE_DIR`` (one holding ``onnxruntime_c_api.h``). The library asks onnxruntime for the C API of those
headers (version 21), which every later onnxruntime serves, and links against nothing of onnxruntime's.

It is compiled with the C++ compiler (``CXX``, else ``c++``) and the flags of the PyTorch extension
(:mod:`.cpu_backend`: ``-O3``, the same floating-point flags, one build per instruction-set level, ``avx512``,
``avx2`` or ``generic``, chosen as there), with ``-fopenmp-simd`` instead of ``-fopenmp``: the library's threads are
onnxruntime's. Builds are cached under :func:`cache_dir` by a hash of the sources, flags, compiler and headers, so a
build happens once per change; :func:`build_library` returns the cached file when there is one.

Example:
    >>> import onnxruntime
    >>> options = onnxruntime.SessionOptions()
    >>> options.register_custom_ops_library(str(build_library()))  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Optional

from .cpu_backend import _CFLAGS, ISA_LEVELS, SOURCE_DIR, cpu_isa

__all__ = ["CACHE_ENV", "HEADERS_SHA256", "HEADERS_URL", "INCLUDE_ENV", "THREADS_KEY", "LibraryBuildError",
           "build_library", "cache_dir", "headers_dir", "library_path"]

HEADERS_URL = ("http://deb.debian.org/debian/pool/main/o/onnxruntime/"
               "libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb")
HEADERS_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
#: A folder holding onnxruntime's C API headers, used instead of the download.
INCLUDE_ENV = "ORT_INCLUDE_DIR"
#: Where the headers and builds are kept (default: :func:`cache_dir`).
CACHE_ENV = "TIMM_SORTCONV_ONNX_CACHE"
#: The session configuration entry from which the node takes its number of threads (kThreadsKey in the library).
THREADS_KEY = "custom_op.SortConv2d.intra_op_num_threads"

OP_SOURCE = SOURCE_DIR / "onnxruntime" / "sort_conv_op.cpp"
# The PyTorch extension's optimisation and floating-point flags; the SIMD pragmas without OpenMP's runtime.
CFLAGS = tuple(flag for flag in _CFLAGS if flag != "-fopenmp") + (
    "-fopenmp-simd", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden")
_HEADER_NAMES = ("onnxruntime_c_api.h",)

_lock = threading.Lock()


class LibraryBuildError(RuntimeError):
    """The library cannot be built here; the message says why in one line."""


def cache_dir() -> Path:
    """``TIMM_SORTCONV_ONNX_CACHE`` if set; in a checkout of the repository its ignored ``.cache/onnxruntime``; else
    ``~/.cache/timm_sortconv/onnxruntime``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    checkout = SOURCE_DIR.parents[1]
    if (checkout / "pyproject.toml").is_file() and (checkout / ".git").exists():
        return checkout / ".cache" / "onnxruntime"
    return Path.home() / ".cache" / "timm_sortconv" / "onnxruntime"


def _deb_member(archive: bytes, prefix: str) -> bytes:
    """The member of a ``.deb`` (an ``ar`` archive) whose name starts with ``prefix``."""
    if not archive.startswith(b"!<arch>\n"):
        raise LibraryBuildError("the downloaded headers package is not a .deb (ar) archive")
    offset = 8
    while offset + 60 <= len(archive):
        header = archive[offset:offset + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        if name.startswith(prefix):
            return archive[offset + 60:offset + 60 + size]
        offset += 60 + size + size % 2
    raise LibraryBuildError(f"the headers package has no {prefix}* member")


def _download(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.read()
    except (urllib.error.URLError, OSError) as error:
        raise LibraryBuildError(f"cannot download onnxruntime's C API headers from {url} ({error}); set "
                                f"{INCLUDE_ENV} to a folder holding onnxruntime_c_api.h instead") from None


def _headers_at_hand() -> Optional[Path]:
    """``ORT_INCLUDE_DIR``, or the headers already in the cache, or ``None``."""
    given = os.environ.get(INCLUDE_ENV)
    if given:
        folder = Path(given)
        if not all((folder / name).is_file() for name in _HEADER_NAMES):
            raise LibraryBuildError(f"{INCLUDE_ENV}={given} holds no onnxruntime_c_api.h")
        return folder
    folder = cache_dir() / f"headers-{HEADERS_SHA256[:12]}"
    return folder if all((folder / name).is_file() for name in _HEADER_NAMES) else None


def headers_dir() -> Path:
    """The folder of onnxruntime's C API headers: ``ORT_INCLUDE_DIR``, or the headers of :data:`HEADERS_URL`,
    downloaded (and checked) into the cache on first use."""
    at_hand = _headers_at_hand()
    if at_hand is not None:
        return at_hand
    folder = cache_dir() / f"headers-{HEADERS_SHA256[:12]}"
    archive = _download(HEADERS_URL)
    digest = hashlib.sha256(archive).hexdigest()
    if digest != HEADERS_SHA256:
        raise LibraryBuildError(f"the headers package from {HEADERS_URL} has SHA-256 {digest}, expected "
                                f"{HEADERS_SHA256}: refused")
    data = _deb_member(archive, "data.tar")
    staging = Path(tempfile.mkdtemp(prefix=".headers-", dir=_made(cache_dir())))
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if member.isfile() and "include" in parts and member.name.endswith(".h"):
                    relative = Path(*parts[parts.index("onnxruntime", parts.index("include")) + 1:])
                    target = staging / relative
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
        if not all((staging / name).is_file() for name in _HEADER_NAMES):
            raise LibraryBuildError("the headers package holds no include/onnxruntime/onnxruntime_c_api.h")
        try:
            os.replace(staging, folder)
        except OSError:  # another process put them there first
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _sources() -> Dict[str, bytes]:
    """The library's source and the kernel's headers it includes, by name."""
    sources = {path.name: path.read_bytes() for path in sorted(SOURCE_DIR.iterdir()) if path.suffix == ".h"}
    sources[OP_SOURCE.name] = OP_SOURCE.read_bytes()
    return sources


def _compiler() -> str:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise LibraryBuildError(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang++, or set CXX)")
    return compiler


def _library_file(isa: str, compiler: str, headers: Path) -> Path:
    digest = hashlib.sha256()
    for name, text in _sources().items():
        digest.update(name.encode() + b"\0" + text + b"\0")
    for name in _HEADER_NAMES:
        digest.update((headers / name).read_bytes())
    for part in (" ".join(CFLAGS + ISA_LEVELS[isa].flags), isa, compiler):
        digest.update(part.encode() + b"\0")
    return cache_dir() / "build" / f"timm_sortconv_ort_{isa}_{digest.hexdigest()[:16]}.so"


def _check_isa(isa: Optional[str]) -> str:
    if isa is None:
        return cpu_isa()
    if isa not in ISA_LEVELS:
        raise LibraryBuildError(f"isa={isa!r} is not an instruction-set level; accepted: {', '.join(ISA_LEVELS)}")
    return isa


def library_path(isa: Optional[str] = None) -> Optional[Path]:
    """The cached library for ``isa`` (default: the level of :func:`.cpu_backend.cpu_isa`) built from today's
    sources, or ``None`` if it has not been built (:func:`build_library`)."""
    isa = _check_isa(isa)
    try:
        headers = _headers_at_hand()
        path = None if headers is None else _library_file(isa, _compiler(), headers)
    except LibraryBuildError:
        return None
    return path if path is not None and path.is_file() else None


def build_library(isa: Optional[str] = None, verbose: bool = False) -> Path:
    """The library for ``isa`` (default: this CPU's level as the PyTorch kernel chooses it), compiled if the cache
    has no build of today's sources (under a minute on one core; one line on stderr says so). Raises
    :class:`LibraryBuildError` with a one-line reason where it cannot be built (no compiler, no headers)."""
    isa = _check_isa(isa)
    with _lock:
        compiler = _compiler()
        headers = headers_dir()
        path = _library_file(isa, compiler, headers)
        if path.is_file():
            return path
        _made(path.parent)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        command = [compiler, *CFLAGS, *ISA_LEVELS[isa].flags, f"-I{headers}", str(OP_SOURCE), "-o", str(partial)]
        sys.stderr.write(f"timm_sortconv: compiling the onnxruntime operator library ({isa} level) into {path}; "
                         f"this takes under a minute, once\n")
        if verbose:
            sys.stderr.write(" ".join(command) + "\n")
        try:
            done = subprocess.run(command, capture_output=True, text=True)
        except OSError as error:
            raise LibraryBuildError(f"cannot run the C++ compiler {compiler!r}: {error}") from None
        if done.returncode != 0:
            partial.unlink(missing_ok=True)
            if verbose:
                sys.stderr.write(done.stderr)
            errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()
            raise LibraryBuildError(f"compiling {OP_SOURCE.name} failed: {errors[0] if errors else 'no message'}"
                                    + ("" if verbose else " (verbose=True / --verbose prints the command)"))
        os.replace(partial, path)
        return path
