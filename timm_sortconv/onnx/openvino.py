"""The OpenVINO extension that runs the package's nodes: building it against the ``openvino`` wheel and loading it.

OpenVINO does not inline ONNX model-local functions, so a fused file (:mod:`.fused`) runs there either as its
inlined standard-operator twin (:func:`.functions.inline_functions`) or, with this extension, node for node with the
package's kernels: ``csrc/openvino/sort_conv_extension.cpp`` defines an OpenVINO operation ``SortConv2d`` whose
evaluate runs the same layer as the onnxruntime library (``csrc/runtime_layer.h``), and the ONNX frontend's
conversion of the node ``timm_sortconv::SortConv2d`` into it. It is compiled by
:func:`timm_sortconv.ops.native.build_library` against the headers and ``libopenvino`` that the openvino wheel ships
(nothing downloaded), once per change; the kernels' loops run as TBB tasks, in OpenVINO's own thread arena.

Example:
    >>> import openvino
    >>> core = openvino.Core()
    >>> core.add_extension(str(extension_path()))  # doctest: +SKIP
    >>> compiled = core.compile_model("model.onnx", "CPU")  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from ..ops import native

__all__ = ["ExtensionBuildError", "compile_model", "extension_path"]

SOURCE = native.SOURCE_DIR / "openvino" / "sort_conv_extension.cpp"
_NAME = "timm_sortconv_openvino"

#: The extension cannot be built here (no openvino wheel, no compiler, a compile error); the message says why.
ExtensionBuildError = native.BuildError


def _wheel() -> Path:
    try:
        import openvino
    except ImportError:
        raise ExtensionBuildError("the OpenVINO extension needs the openvino package (pip install openvino)") from None
    return Path(openvino.__file__).resolve().parent


def _link_flags(wheel: Path) -> List[str]:
    libraries = [path for pattern in ("libopenvino.so*", "libopenvino_onnx_frontend.so*", "libtbb.so*")
                 for path in sorted((wheel / "libs").glob(pattern))]
    if not libraries:
        raise ExtensionBuildError(f"the openvino wheel at {wheel} holds no libopenvino.so in libs/")
    return [str(path) for path in libraries] + [f"-Wl,-rpath,{wheel / 'libs'}"]


def extension_path(isa: Optional[str] = None, verbose: bool = False) -> Path:
    """The extension's path, for ``openvino.Core().add_extension``: built on first use for ``isa`` (default: this
    CPU's level, :func:`timm_sortconv.ops.native.cpu_isa`), found in the cache after."""
    wheel = _wheel()
    return native.build_library(_NAME, SOURCE, [wheel / "include"], isa, libraries=_link_flags(wheel),
                                verbose=verbose)


def compile_model(model, threads: int = 0, config: Optional[dict] = None):
    """``model`` (a path or the file's bytes) compiled by OpenVINO for the CPU with the extension loaded, in float32
    (``threads`` inference threads, 0: OpenVINO's default)."""
    import openvino

    core = openvino.Core()
    core.add_extension(str(extension_path()))
    settings = {"INFERENCE_PRECISION_HINT": "f32", **(config or {})}
    if threads:
        settings["INFERENCE_NUM_THREADS"] = threads
    source = core.read_model(model, b"") if isinstance(model, bytes) else core.read_model(str(model))
    return core.compile_model(source, "CPU", settings)
