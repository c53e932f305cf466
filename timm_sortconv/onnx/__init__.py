"""SC models in ONNX: exporting them, and running the exported files fast. Start here.

**Exporting.** ``torch.onnx.export`` takes an SC model as it is (either exporter, a static shape or dynamic axes),
and so do timm's ``onnx_export`` and :func:`export`, this package's call with the settings it tests and measures.
The file holds standard operators only and runs in every ONNX runtime. With ``export(..., fused=True)`` each SC
layer is one ``timm_sortconv::SortConv2d`` node, which onnxruntime runs with the package's own kernels once the
library is registered (:func:`session`, or ``register_custom_ops_library(library_path())`` on your own options).

**The modules**, in the order an export passes through them:

* :mod:`.lowering`: what an SC layer becomes while a model is traced, chosen by a context (standard operators by
  default, :func:`decomposition` for another form of the sorting network, :func:`fused_export` for the node);
* :mod:`.portable`: the standard-operator form of the sorting layers (sampling convolution, min/max network, 1x1
  product);
* :mod:`.centring`: the centring of strided grids (:mod:`timm_sortconv.grid`) as standard operators, at a static
  shape and at a dynamic one; :mod:`.guide`: the orientation guide's pooling, likewise;
* :mod:`.fused`: the node, its attributes, both exporters' translations of it, and the passes over the written file
  (batch normalisations folded into the nodes);
* :mod:`.exporting`: :func:`export`;
* :mod:`.runtime`: the onnxruntime library (``csrc/onnxruntime/``, built by :mod:`timm_sortconv.ops.native` against the
  vendored C API header: offline, any CPU), :func:`library_path` and :func:`session`.

The command line is ``scripts/onnx_export.py`` (:mod:`timm_sortconv.cli.onnx`).

Importing this package registers the lowering with the operator (:func:`timm_sortconv.ops.functional.set_onnx_lowering`)
and the TorchScript-based exporter's translations of the package's operators, once; ``import timm_sortconv`` does it.
"""
from ..ops.functional import set_onnx_lowering
from . import centring, fused, guide
from .exporting import check_model, export
from .fused import FusedExportError
from .lowering import Lowering, decomposition, fused_export, fused_export_enabled, lower_sort_conv2d
from .portable import DECOMPOSITIONS, ONNXRUNTIME, OPENVINO
from .runtime import THREADS_KEY, LibraryBuildError, build_library, library_path, session

set_onnx_lowering(lower_sort_conv2d)
centring.register_symbolics()
guide.register_symbolics()
fused.register_symbolics()

__all__ = ["DECOMPOSITIONS", "ONNXRUNTIME", "OPENVINO", "THREADS_KEY", "FusedExportError", "LibraryBuildError",
           "Lowering", "build_library", "check_model", "decomposition", "export", "fused_export", "fused_export_enabled",
           "library_path", "session"]
