"""The onnxruntime operator library that runs the package's nodes: building it, finding it, opening sessions with it.

The library (``csrc/onnxruntime/sort_conv_op.cpp``) computes the nodes of the domain ``timm_sortconv`` (:mod:`.fused`)
with the fused kernels that PyTorch's CPU backend runs (``csrc/sort_conv_kernel.h``), compiled without libtorch. It is
compiled against onnxruntime's C API header, which the onnxruntime wheel does not ship and this package does
(``csrc/third_party/onnxruntime``, MIT): nothing is downloaded, on any machine. The library asks onnxruntime for the
C API of that header (version 21), which every onnxruntime since 1.21 serves, and links against nothing of
onnxruntime's.

It is built by :func:`timm_sortconv.ops.native.build_library`: the flags and the instruction-set level of the PyTorch
extension, cached by a hash of the sources, so a build happens once per change of the kernel (under a minute).
:func:`build_library` returns the cached file when there is one; :func:`library_path` is what onnxruntime-extensions
users know as ``get_library_path()``.

Example:
    >>> import onnxruntime
    >>> options = onnxruntime.SessionOptions()
    >>> options.register_custom_ops_library(library_path())  # doctest: +SKIP
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ..ops import native

__all__ = ["THREADS_KEY", "LibraryBuildError", "build_library", "library_path", "session"]

#: The session configuration entry from which the nodes take their number of threads (kThreadsKey in the library).
THREADS_KEY = "custom_op.SortConv2d.intra_op_num_threads"
OP_SOURCE = native.SOURCE_DIR / "onnxruntime" / "sort_conv_op.cpp"
HEADERS = native.SOURCE_DIR / "third_party" / "onnxruntime"
_NAME = "timm_sortconv_onnxruntime"

#: The library cannot be built here (no compiler, a compile error); the message says why in one line.
LibraryBuildError = native.BuildError


def build_library(isa: Optional[str] = None, verbose: bool = False) -> Path:
    """The library for ``isa`` (default: this CPU's level as the PyTorch kernel chooses it, :func:`.native.cpu_isa`),
    compiled if the cache has no build of today's sources. Raises :class:`LibraryBuildError` with a one-line reason
    where it cannot be built."""
    return native.build_library(_NAME, OP_SOURCE, [HEADERS], isa, verbose=verbose)


def library_path(isa: Optional[str] = None) -> str:
    """The library's path as a ``str``, which ``onnxruntime.SessionOptions.register_custom_ops_library`` takes as it
    is (it refuses a ``Path``): built on first use (:func:`build_library`), found in the cache after."""
    return str(build_library(isa))


def session(model: Union[str, os.PathLike, bytes], threads: int = 1, *, library: Optional[os.PathLike] = None,
            options=None):
    """An ``onnxruntime.InferenceSession`` (CPU) of ``model`` (a path or the file's bytes) that runs the package's
    nodes with its kernels: the library (``library``, default :func:`library_path`) registered, ``threads`` intra-op
    threads (0: onnxruntime's default), which the nodes use too (:data:`THREADS_KEY`). ``options``: a
    ``SessionOptions`` to start from."""
    import onnxruntime

    options = onnxruntime.SessionOptions() if options is None else options
    options.intra_op_num_threads = threads
    if threads > 0:
        options.add_session_config_entry(THREADS_KEY, str(threads))
    options.register_custom_ops_library(library_path() if library is None else str(library))
    source = model if isinstance(model, bytes) else str(model)
    return onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])
