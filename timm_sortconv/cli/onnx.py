"""Export a registered model to ONNX and check the files in their runtimes; print the onnxruntime library's path.

``python scripts/onnx_export.py MODEL FILE [--fused] [--pretrained]`` exports ``MODEL`` at its input size
(:func:`timm_sortconv.onnx.export`), runs the file in onnxruntime (with ``--fused``: with the package's library and
without it; an onnxruntime older than 1.27 runs the inlined twin without it) and, where it is installed, in
OpenVINO, says which file to hand which runtime, and exits with status 1 where an output differs from PyTorch's by
more than 1e-4 of the largest. With ``--fused`` it also writes
``FILE``'s standard-operator twin for runtimes that do not inline ONNX functions (``NAME.inlined.onnx``, OpenVINO's).
``python scripts/onnx_library.py`` builds the onnxruntime operator library where it is not built yet and prints its
path (:func:`timm_sortconv.onnx.library_path`). A problem with the input (an unknown model, weights it has none of, a
layer the fused node cannot take, a library that cannot be built) is one ``error:`` line
(:func:`timm_sortconv.cli.run`).
"""
from __future__ import annotations

import argparse
import io
from pathlib import Path

import torch

from .. import onnx as sc_onnx
from ..onnx.functions import STOCK_INLINING_ONNXRUNTIME, stock_onnxruntime_inlines
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
    parser.add_argument("--decomposition", choices=sc_onnx.DECOMPOSITIONS, default=None,
                        help=f"how the sorting is written in standard operators (default: {sc_onnx.ONNXRUNTIME}, "
                             f"onnxruntime's fastest; OpenVINO's: {sc_onnx.OPENVINO})")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of :func:`main`, parsed (``--help`` lists it)."""
    args = _parser().parse_args(argv)
    if args.batch < 1 or args.threads < 0:
        raise CommandError(f"--batch must be >= 1 and --threads >= 0, got {args.batch} and {args.threads}")
    return args


def _inlined_path(output: str) -> Path:
    path = Path(output)
    return path.with_name(f"{path.stem}.inlined{path.suffix or '.onnx'}")


def _onnxruntime(data: bytes, threads: int, library: bool):
    import onnxruntime

    if library:
        return sc_onnx.session(data, threads).run
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    return onnxruntime.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run


def _openvino(data: bytes):
    try:
        import openvino
    except ImportError:
        return None
    core = openvino.Core()
    compiled = core.compile_model(core.read_model(data, b""), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return lambda names, feeds: [compiled(feeds["x"])[0]]


def _export(args: argparse.Namespace) -> int:
    model = create_model_or_error(args.model, pretrained=args.pretrained).eval()
    example = torch.randn(args.batch, *model.pretrained_cfg.get("input_size", (3, 224, 224)))
    buffer, inlined = io.BytesIO(), io.BytesIO() if args.fused else None
    sc_onnx.export(model, example, buffer, dynamo=args.dynamo, dynamic_size=args.dynamic_size, fused=args.fused,
                   inlined=inlined, decomposition=args.decomposition)
    files = {Path(args.output): buffer.getvalue()}
    if args.fused:
        files[_inlined_path(args.output)] = inlined.getvalue()
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    with torch.no_grad():
        expected = model(example)
    main_file, runs = Path(args.output), []
    runs.append((main_file, "onnxruntime with the library" if args.fused else "onnxruntime",
                 _onnxruntime(files[main_file], args.threads, args.fused)))
    standard = _inlined_path(args.output) if args.fused else main_file
    old_onnxruntime = args.fused and not stock_onnxruntime_inlines()
    if args.fused:
        without = standard if old_onnxruntime else main_file
        runs.append((without, "onnxruntime without it", _onnxruntime(files[without], args.threads, False)))
    openvino = _openvino(files[standard])
    if openvino is not None:
        runs.append((standard, "OpenVINO", openvino))
    worst = 0.0
    for path, runtime, run in runs:
        got = torch.from_numpy(run(None, {"x": example.numpy()})[0])
        error = float((got - expected).abs().max() / expected.abs().max())
        worst = max(worst, error)
        print(f"{path}: {args.model} in {runtime} agrees with PyTorch to {error:.1e} of the largest output")
    if old_onnxruntime:
        import onnxruntime

        print(f"hand {main_file} to onnxruntime with timm_sortconv.onnx.library_path() registered; onnxruntime "
              f"{onnxruntime.__version__} (before {'.'.join(map(str, STOCK_INLINING_ONNXRUNTIME))}) cannot run it "
              f"without the library: hand it {standard}, as to runtimes that do not inline ONNX functions (OpenVINO)")
    elif args.fused:
        print(f"hand {main_file} to onnxruntime (the package's kernels where timm_sortconv.onnx.library_path() is "
              f"registered, standard operators where it is not); {standard} to runtimes that do not inline ONNX "
              "functions (OpenVINO)")
    return 0 if worst < 1e-4 else 1


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
