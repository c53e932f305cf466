"""Exporting SC models to ONNX.

``torch.onnx.export`` takes an SC model as it is, with either exporter: every SC layer is written in standard
operators (:mod:`.ops.portable`), so the file runs in any ONNX runtime with nothing to install. :func:`export` is
that call with the settings this package measures (``BENCHMARKS.md``, "Exported to ONNX"): input ``x`` and output
``y`` with a dynamic batch, and with ``dynamic_size=True`` a dynamic height and width too.

For onnxruntime there is a faster opt-in: ``export(..., fused=True)`` writes each sorting layer as one node,
``timm_sortconv::SortConv2d`` (:mod:`.ops.fused_export`: float32; the aligned variants stay in standard operators),
which a library built from the package's own fused CPU kernel computes (:mod:`.ops.ort_library`), on onnxruntime's
intra-op threads; :func:`session` opens such a file with the library registered. Such a file runs only where the
library is registered. The library is built once per change of the kernel (under a minute; the onnxruntime headers
it needs are downloaded from Debian once and checked)::

    python -m timm_sortconv.onnx build                                # prints the library's path
    python -m timm_sortconv.onnx export scnn_p_rs_7 model.onnx --fused    # exports, runs it, compares with PyTorch

or from Python: ``session(path_or_bytes, threads=1)``, or on your own ``onnxruntime.SessionOptions``,
``options.register_custom_ops_library(str(build_library()))`` (then also
``options.add_session_config_entry(THREADS_KEY, str(n))`` with your ``intra_op_num_threads`` ``n``: the node splits
its work into that many parts, by default into the machine's hardware threads).

Example:
    >>> import timm, io
    >>> model = timm.create_model("scnn_p_rs_3").eval()
    >>> export(model, torch.randn(1, 1, 28, 28), io.BytesIO())
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import warnings
from pathlib import Path
from typing import List, Optional, Union

import torch
import torch.nn as nn

from .ops.fused_export import (DOMAIN, OPSET, FusedExportError, check_fused, drop_unread_constants, fold_batch_norms,
                               fused_export, fused_export_enabled, translation_table)
from .ops.ort_library import THREADS_KEY, LibraryBuildError, build_library, library_path

__all__ = ["THREADS_KEY", "FusedExportError", "LibraryBuildError", "build_library", "check_model", "export",
           "fused_export", "fused_export_enabled", "library_path", "main", "parse_args", "session"]


def check_model(model: nn.Module, example: Optional[torch.Tensor] = None) -> None:
    """Raises :class:`FusedExportError` where a sorting layer of ``model`` (run on ``example``) cannot be written as
    the fused node: before the export, so that the error is this one and not the exporter's wrapping of it."""
    from .layers import SortConv2d

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
           opset_version: int = 18, fused: bool = False) -> None:
    """Exports ``model`` (in evaluation mode) at ``example``'s shape to ``f`` (a path or a binary file object).

    Args:
        model: any model, SC layers included.
        example: an input ``(N, C, H, W)``.
        f: where the ``.onnx`` file goes.
        dynamo: ``torch.onnx.export``'s ``dynamo`` (the TorchScript-based exporter by default, which writes a file
            onnxruntime loads with every opset since 13).
        dynamic_size: a dynamic height and width beside the dynamic batch. With ``dynamo=True`` a model that centres
            a strided grid (the default ``stride_align="centre"`` of its strided layers) is refused with a
            ``ValueError`` saying what to do instead: ``torch.export`` follows the centring at one size only.
        opset_version: the ONNX opset (18 by default).
        fused: each sorting layer as one ``timm_sortconv::SortConv2d`` node (module docstring), which only
            onnxruntime with the library of :func:`build_library` runs (:func:`session`); float32 only. A
            ``BatchNormalization`` that alone reads a node's output is folded into its weight and bias
            (:func:`~.ops.fused_export.fold_batch_norms`), as the exporters fold one into a convolution. A layer the
            node cannot compute raises :class:`FusedExportError` before anything is exported; the aligned variants
            stay in standard operators. Default: standard operators only.
    """
    if dynamo and dynamic_size:
        _refuse_dynamic_centring(model)
    if fused:
        import onnx  # (the package onnx, not this module)

        check_model(model, example)
        buffer = io.BytesIO()
        _export(model, example, buffer, dynamo, dynamic_size, opset_version, fused)
        exported = onnx.load_from_string(buffer.getvalue())
        fold_batch_norms(exported)
        drop_unread_constants(exported)
        data = exported.SerializeToString()
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(data)
        else:
            f.write(data)
        return
    _export(model, example, f, dynamo, dynamic_size, opset_version, fused)


def _centring_layers(model: nn.Module) -> List[str]:
    """The modules of ``model`` whose strided grid is centred for the input's size (:mod:`.grid`)."""
    from .antialias import BlurPool2d
    from .grid import CENTRED_LAYERS
    from .layers import SortConv2d, SortConv2dSame

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


def session(model: Union[str, os.PathLike, bytes], threads: int = 1, *, library: Optional[os.PathLike] = None,
            options=None):
    """An ``onnxruntime.InferenceSession`` (CPU) of ``model`` (a path or the file's bytes) that runs the fused nodes:
    the library (``library``, default :func:`build_library`, built on first use) registered, ``threads`` intra-op
    threads (0: onnxruntime's default), which the node uses too (:data:`THREADS_KEY`). ``options``: a
    ``SessionOptions`` to start from."""
    import onnxruntime

    options = onnxruntime.SessionOptions() if options is None else options
    options.intra_op_num_threads = threads
    if threads > 0:
        options.add_session_config_entry(THREADS_KEY, str(threads))
    options.register_custom_ops_library(str(build_library() if library is None else library))
    source = model if isinstance(model, bytes) else str(model)
    return onnxruntime.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _export_command(args: argparse.Namespace) -> int:
    import io

    from .cli import create_model_or_error

    model = create_model_or_error(args.model, pretrained=args.pretrained).eval()
    size = model.pretrained_cfg.get("input_size", (3, 224, 224))
    example = torch.randn(args.batch, *size)
    buffer = io.BytesIO()
    export(model, example, buffer, dynamo=args.dynamo, fused=args.fused)
    data = buffer.getvalue()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_bytes(data)
    if args.fused:
        runner = session(data, args.threads)
    else:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = args.threads
        runner = onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = model(example)
    got = torch.from_numpy(runner.run(None, {"x": example.numpy()})[0])
    error = float((got - expected).abs().max() / expected.abs().max())
    print(f"{args.output}: {args.model}, {'fused' if args.fused else 'standard operators'}, "
          f"{'dynamo' if args.dynamo else 'TorchScript'} exporter; onnxruntime agrees with PyTorch to {error:.1e} "
          "of the largest output")
    return 0 if error < 1e-4 else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m timm_sortconv.onnx", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build the onnxruntime operator library and print its path")
    build.add_argument("--isa", default=None, help="instruction-set level: avx512, avx2 or generic (default: this "
                                                    "CPU's, as the PyTorch kernel chooses it)")
    build.add_argument("--verbose", action="store_true", help="print the compiler's command and errors")
    exporting = commands.add_parser("export", help="export a timm model, run it in onnxruntime, compare")
    exporting.add_argument("model", help="a registered model, e.g. scnn_p_rs_7")
    exporting.add_argument("output", help="the .onnx file to write")
    exporting.add_argument("--fused", action="store_true", help="sorting layers as timm_sortconv::SortConv2d nodes")
    exporting.add_argument("--dynamo", action="store_true", help="the dynamo exporter (default: TorchScript-based)")
    exporting.add_argument("--pretrained", action="store_true", help="the model's bundled weights")
    exporting.add_argument("--batch", type=int, default=1, help="the example's batch size (default: 1)")
    exporting.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default: 1)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of :func:`main`, parsed (``--help`` lists it)."""
    return _parser().parse_args(argv)


def main(argv=None) -> None:
    """``python -m timm_sortconv.onnx build`` (prints the library's path) / ``export MODEL FILE [--fused]``: exits
    with status 1 where onnxruntime's output differs from PyTorch's by more than 1e-4 of the largest; a problem with
    the input (an unknown model, weights it has none of, a layer the fused node cannot take, a library that cannot
    be built) is one ``error:`` line (:func:`timm_sortconv.cli.run`)."""
    from .cli import CommandError, check_model_name

    args = parse_args(argv)
    try:
        if args.command == "build":
            print(build_library(args.isa, verbose=args.verbose))
            return
        check_model_name(args.model)
        if _export_command(args) != 0:
            raise SystemExit(1)
    except (LibraryBuildError, FusedExportError) as error:
        raise CommandError(str(error)) from None


if __name__ == "__main__":
    from .cli import run

    run(main)
