"""Exporting SC models to ONNX: :func:`export`, the call with the settings this package measures and tests.

``torch.onnx.export`` takes an SC model as it is, with either exporter, at a static shape or with dynamic axes:
every SC layer is written in standard operators (:mod:`.portable`) and every centring of a strided grid without
branches (:mod:`.centring`), so the file runs in any ONNX runtime with nothing to install. :func:`export` is that
call with an input ``x`` and an output ``y`` with a dynamic batch (``dynamic_size=True``: a dynamic height and width
too), and with ``fused=True`` each sorting layer as one ``timm_sortconv::SortConv2d`` node (:mod:`.fused`), run by
the package's library in onnxruntime (:mod:`.runtime`).

Example:
    >>> import timm, io
    >>> model = timm.create_model("scnn_p_rs_3").eval()
    >>> export(model, torch.randn(1, 1, 28, 28), io.BytesIO())
"""
from __future__ import annotations

import contextlib
import io
import os
import warnings
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn as nn

from .folding import fold_static_sizes, merge_repeats
from .functions import attach_functions, expand_centring, inline_functions
from .fused import (DOMAIN, OPSET, FusedExportError, check_fused, drop_unread_constants, fold_batch_norms,
                    fuse_activations, fuse_residuals, merge_centring, translation_table)
from .lowering import current, fused_export
from .lowering import decomposition as lowered_as
from .portable import ONNXRUNTIME, OPENVINO

__all__ = ["check_model", "export"]


def check_model(model: nn.Module, example: Optional[torch.Tensor] = None) -> None:
    """Raises :class:`FusedExportError` where a sorting layer of ``model`` (run on ``example``) cannot be written as
    the fused node: before the export, so that the error is this one and not the exporter's wrapping of it."""
    from ..layers import SortConv2d

    for name, module in model.named_modules():
        if isinstance(module, SortConv2d):
            try:
                check_fused([p.dtype for p in (module.weight, module.bias) if p is not None], module.kernel_size[0],
                            module.sorting)
            except FusedExportError as error:
                raise FusedExportError(f"{error} [layer {name}]") from None
    if example is not None:
        check_fused([example.dtype])


def export(model: nn.Module, example: torch.Tensor, f, *, dynamo: bool = False, dynamic_size: bool = False,
           opset_version: int = 18, fused: bool = False, inlined=None, decomposition: Optional[str] = None) -> None:
    """Exports ``model`` (in evaluation mode) at ``example``'s shape to ``f`` (a path or a binary file object). What
    the fixed sizes decide (the arithmetic on ``Shape`` nodes that reads no dynamic axis) is written as constants
    (:func:`.folding.fold_static_sizes`), where the package ``onnx`` is installed.

    Args:
        model: any model, SC layers included.
        example: an input ``(N, C, H, W)``.
        f: where the ``.onnx`` file goes.
        dynamo: ``torch.onnx.export``'s ``dynamo`` (the TorchScript-based exporter by default, which writes a file
            onnxruntime loads with every opset since 13).
        dynamic_size: a dynamic height and width beside the dynamic batch. With ``dynamo=True`` a model that centres
            a strided grid (the default ``stride_align="centre"`` of its strided layers) is refused with a
            ``ValueError`` saying what to do instead: ``torch.export`` follows the centring at one size only.
        opset_version: the ONNX opset (18 by default, the least the fused file's functions take).
        fused: each sorting layer as one ``timm_sortconv::SortConv2d`` node (module docstring), float32 only. The
            file runs in every onnxruntime: with the library of :func:`.runtime.library_path` registered
            (:func:`.runtime.session`) the nodes run the package's kernel, without it each node's standard-operator
            form, which the file carries as a model-local function (:mod:`.functions`). A ``BatchNormalization``
            that alone reads a node's output is folded into its weight and bias (:func:`.fused.fold_batch_norms`),
            as the exporters fold one into a convolution, an ``Add`` of a value of the node's shape that alone
            reads it (a residual block's) into the node (:func:`.fused.fuse_residuals`), and a ``Relu`` that then
            alone reads it (:func:`.fused.fuse_activations`). A layer the node cannot compute raises
            :class:`FusedExportError` before anything is exported. Default: standard operators only.
        inlined: with ``fused=True``, where to write the same model with every function expanded in place (a path or
            a binary file object): standard operators only, for runtimes that do not inline ONNX functions
            (OpenVINO), the sorting written as :data:`.portable.OPENVINO` unless ``decomposition`` names another.
        decomposition: how the sorting of SC layers in standard operators is written (:data:`.portable.DECOMPOSITIONS`;
            default: the context's, :func:`.lowering.decomposition`, which is :data:`.portable.ONNXRUNTIME`). For a
            file that OpenVINO will run: :data:`.portable.OPENVINO`.
    """
    if decomposition is not None:
        with lowered_as(decomposition):
            return export(model, example, f, dynamo=dynamo, dynamic_size=dynamic_size, opset_version=opset_version,
                          fused=fused, inlined=inlined)
    if dynamo and dynamic_size:
        _refuse_dynamic_centring(model)
    if inlined is not None and not fused:
        raise ValueError("inlined= is the fused file with its functions expanded; it needs fused=True (without it "
                         "the file written to f is standard operators already)")
    if fused:
        check_model(model, example)
    buffer = io.BytesIO()
    _export(model, example, buffer, dynamo, dynamic_size, opset_version, fused)
    try:
        import onnx  # (the package onnx, not this module)
    except ImportError:  # a plain export without the package onnx: the file as the exporter wrote it
        if fused:
            raise
        _write(buffer.getvalue(), f)
        return
    exported = onnx.load_from_string(buffer.getvalue())
    if not fused:
        fold_static_sizes(exported)
        merge_repeats(exported)
        drop_unread_constants(exported)
        _write(exported.SerializeToString(), f)
        return
    fold_batch_norms(exported)
    fuse_activations(exported)
    merge_centring(exported)
    fold_static_sizes(exported)  # (a CentreGrid left learns its input's size here, where it is static)
    expand_centring(exported)
    fold_static_sizes(exported)
    if fuse_residuals(exported):  # (with every size known; the ReLUs after the merged Adds follow)
        fuse_activations(exported)
    merge_repeats(exported)
    drop_unread_constants(exported)
    standard = onnx.ModelProto()
    standard.CopyFrom(exported)
    attach_functions(exported, current().decomposition)
    _write(exported.SerializeToString(), f)
    if inlined is not None:
        chosen = current().decomposition
        attach_functions(standard, OPENVINO if chosen == ONNXRUNTIME else chosen)
        _write(inline_functions(standard).SerializeToString(), inlined)


def _write(data: bytes, f) -> None:
    if isinstance(f, (str, os.PathLike)):
        Path(f).write_bytes(data)
    else:
        f.write(data)


def _centring_layers(model: nn.Module) -> List[str]:
    """The modules of ``model`` whose strided grid is centred for the input's size (:mod:`.grid`)."""
    from ..antialias import BlurPool2d
    from ..grid import CENTRED_LAYERS
    from ..layers import SortConv2d, SortConv2dSame

    found = []
    for name, module in model.named_modules():
        if isinstance(module, SortConv2dSame):
            centring = module.stride_align == "centre"
        elif isinstance(module, SortConv2d):
            centring = module.stride_align == "centre" and module.stride != (1, 1)
        else:
            centring = isinstance(module, CENTRED_LAYERS) or (
                isinstance(module, BlurPool2d) and module.stride_align == "centre")
        if centring:
            found.append(name or "<root>")
    return found


def _refuse_dynamic_centring(model: nn.Module) -> None:
    """Raises the error of :func:`export` for a dynamic size under the dynamo exporter where ``model`` centres a
    strided grid: ``torch.export`` follows the centring's branches at one size, and the exporter may specialise the
    declared dynamic size silently instead of failing, which would write a graph that is wrong at other sizes."""
    layers = _centring_layers(model)
    if layers:
        shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
        raise ValueError(f"dynamo=True with dynamic_size=True: {shown} centre a strided grid for the input's actual "
                         "size (timm_sortconv.grid), which torch.export cannot follow for a dynamic height or width; "
                         "export with dynamo=False (the TorchScript-based exporter, whose graph centres at every "
                         "size), at a fixed size, or build the model with stride_align='corner'")


def _export(model, example, f, dynamo, dynamic_size, opset_version, fused) -> None:
    axes = {0: "batch", 2: "height", 3: "width"} if dynamic_size else {0: "batch"}
    with warnings.catch_warnings(), (fused_export() if fused else contextlib.nullcontext()):
        warnings.simplefilter("ignore", category=(torch.jit.TracerWarning, DeprecationWarning, FutureWarning))
        if dynamo:
            # by position, not by name: a model's forward may call its input otherwise than "x"
            shapes = ({axis: torch.export.Dim(name, min=2 if axis else 1) for axis, name in axes.items()},)
            extra = dict(custom_translation_table=translation_table()) if fused else {}
            torch.onnx.export(model, (example,), f, dynamo=True, opset_version=opset_version, input_names=["x"],
                              output_names=["y"], dynamic_shapes=shapes, **extra)
        else:
            extra = dict(custom_opsets={DOMAIN: OPSET}) if fused else {}
            torch.onnx.export(model, (example,), f, dynamo=False, opset_version=opset_version, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": axes, "y": {0: "batch"}}, **extra)
