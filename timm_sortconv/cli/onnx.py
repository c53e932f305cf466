"""Export a registered model to ONNX and check the file in onnxruntime; print the onnxruntime library's path.

``python scripts/onnx_export.py MODEL FILE [--fused] [--pretrained]`` exports ``MODEL`` at its input size
(:func:`timm_sortconv.onnx.export`), runs the file in onnxruntime, and exits with status 1 where its output differs
from PyTorch's by more than 1e-4 of the largest; ``python scripts/onnx_library.py`` builds the onnxruntime operator
library where it is not built yet and prints its path (:func:`timm_sortconv.onnx.library_path`). A problem with the
input (an unknown model, weights it has none of, a layer the fused node cannot take, a library that cannot be built)
is one ``error:`` line (:func:`timm_sortconv.cli.run`).
"""
from __future__ import annotations

import argparse
import io
from pathlib import Path

import torch

from .. import onnx as sc_onnx
from . import CommandError, check_model_name, create_model_or_error

__all__ = ["library_main", "main", "parse_args"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python scripts/onnx_export.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a registered model, e.g. scnn_p_rs_7")
    parser.add_argument("output", help="the .onnx file to write")
    parser.add_argument("--fused", action="store_true",
                        help="SC layers as timm_sortconv::SortConv2d nodes, run by the package's library")
    parser.add_argument("--dynamo", action="store_true", help="the dynamo exporter (default: TorchScript-based)")
    parser.add_argument("--dynamic-size", action="store_true", help="a dynamic height and width (default: batch only)")
    parser.add_argument("--pretrained", action="store_true", help="the model's bundled weights")
    parser.add_argument("--batch", type=int, default=1, help="the example's batch size (default: 1)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default: 1)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of :func:`main`, parsed (``--help`` lists it)."""
    args = _parser().parse_args(argv)
    if args.batch < 1 or args.threads < 0:
        raise CommandError(f"--batch must be >= 1 and --threads >= 0, got {args.batch} and {args.threads}")
    return args


def _export(args: argparse.Namespace) -> int:
    import onnxruntime

    model = create_model_or_error(args.model, pretrained=args.pretrained).eval()
    example = torch.randn(args.batch, *model.pretrained_cfg.get("input_size", (3, 224, 224)))
    buffer = io.BytesIO()
    sc_onnx.export(model, example, buffer, dynamo=args.dynamo, dynamic_size=args.dynamic_size, fused=args.fused)
    data = buffer.getvalue()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_bytes(data)
    if args.fused:
        runner = sc_onnx.session(data, args.threads)
    else:
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


def main(argv=None) -> None:
    """``scripts/onnx_export.py`` (module docstring)."""
    args = parse_args(argv)
    check_model_name(args.model)
    try:
        status = _export(args)
    except (sc_onnx.LibraryBuildError, sc_onnx.FusedExportError) as error:
        raise CommandError(str(error)) from None
    if status != 0:
        raise SystemExit(status)


def library_main(argv=None) -> None:
    """``scripts/onnx_library.py [--isa LEVEL] [--verbose]``: builds the onnxruntime library where needed and prints
    its path."""
    parser = argparse.ArgumentParser(prog="python scripts/onnx_library.py",
                                     description="build the onnxruntime operator library and print its path")
    parser.add_argument("--isa", default=None, help="instruction-set level: avx512, avx2 or generic (default: this "
                                                    "CPU's, as the PyTorch kernel chooses it)")
    parser.add_argument("--verbose", action="store_true", help="print the compiler's command and errors")
    args = parser.parse_args(argv)
    try:
        print(sc_onnx.build_library(args.isa, verbose=args.verbose))
    except sc_onnx.LibraryBuildError as error:
        raise CommandError(str(error)) from None


if __name__ == "__main__":
    from . import run

    run(main)
