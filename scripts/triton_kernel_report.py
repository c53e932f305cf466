#!/usr/bin/env python3
"""Compile the Triton backend's kernels for an NVIDIA GPU on any machine, and report what they cost.

No GPU is needed: Triton compiles for a named target (``--arch 90``: the H100) with the ``ptxas`` it ships,
and ``cuobjdump`` (also shipped) reads the binary. For every kernel, geometry and dtype asked for, with the
launch settings the backend uses (``triton_backend.launch_settings``), it prints registers per thread,
spilled bytes (stack frame), shared memory, SASS instruction counts (all, min/max, matrix instructions,
global loads/stores, atomics) and the compile time (CPU seconds of this process and of the ptxas it runs,
which other processes on a busy machine disturb far less than the elapsed time). A kernel that fails to compile is reported with the
first line of its error and makes the script exit with status 1.

``--candidates`` compiles every block-size candidate that ``backend="auto"`` times (``config.blocks_of``)
instead of the first one alone, and the kernels that send the input gradient to the window values both ways
(their window values written for ``F.fold``, and added into place by atomics: ``scatter`` in the blocks
column); the column ``auto`` says whether ``auto`` runs the kernel for the geometry
and dtype at all (``config.AUTO_MAX_KERNEL_SIZE`` and ``config.window_limit``).

Examples:
    python scripts/triton_kernel_report.py                                  # every kernel, k = 3, 5, 7
    python scripts/triton_kernel_report.py --k 7 --candidates               # every auto candidate at k = 7
    python scripts/triton_kernel_report.py --k 7 --variants polar-ring --kernels fused_forward_kernel \\
        --dtypes float32,bfloat16 --out-per-group 32,64,128
    python scripts/triton_kernel_report.py --roofline H100,H200 --dtypes float32,bfloat16  # no compiling
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import torch

from timm_sortconv.ops.geometry import SAMPLINGS, SORTINGS

VARIANTS = ("polar-ring", "polar-global", "square-ring", "square-global")  # the default: the paper's four
# every sampling-sorting pair the operator takes (e.g. polar-c2)
ACCEPTED_VARIANTS = tuple(f"{sampling}-{sorting}" for sampling in SAMPLINGS for sorting in SORTINGS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float64: "*fp64"}
# Buffers the backend allocates in the accumulation dtype (float32, float64 for float64) whatever the input's.
ACCUMULATED = {"windows_ptr", "grad_x_ptr", "grad_w_ptr", "partial_ptr"}
# Buffers of int32 words (the recorded swaps).
WORDS = {"swaps_ptr"}
SASS_GROUPS = {"min/max": ("FMNMX", "DMNMX", "HMNMX2"), "mma": ("HGMMA", "HMMA", "DMMA"), "ld.global": ("LDG",),
               "st.global": ("STG",), "atomics": ("RED", "REDG", "ATOM", "ATOMG")}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--k", default="3,5,7", help="comma-separated odd kernel sizes (up to 9)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated sampling-sorting variants")
    parser.add_argument("--kernels", default=None, help="comma-separated kernel names (default: all)")
    parser.add_argument("--dtypes", default="float32", help=f"comma-separated input dtypes: {', '.join(DTYPES)}")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 (H100), 80 (A100)")
    parser.add_argument("--in-per-group", type=int, default=32, help="input channels per group (fused kernel)")
    parser.add_argument("--out-per-group", default="32", help="comma-separated outputs per group (block sizes)")
    parser.add_argument("--groups", type=int, default=1, help="groups (direct kernels' block sizes)")
    parser.add_argument("--roofline", metavar="GPUS",
                        help=f"instead of compiling: each SortConv2d layer of {', '.join(ROOFLINE_MODELS)} (their "
                             "default input size and batch) with its FLOPs, bytes and time bounds on these GPUs "
                             f"({', '.join(GPUS)}) for --dtypes float32 (TF32) or bfloat16")
    parser.add_argument("--candidates", action="store_true",
                        help="every block-size candidate backend='auto' times, not only the first")
    parser.add_argument("--compile-threads", type=int, metavar="N",
                        help="instead of the table: the wall time of compiling the selected kernels one after "
                             "another, then in N threads (as backend='auto' compiles its candidates)")
    args = parser.parse_args(argv)
    from timm_sortconv.ops.triton_backend import KERNELS

    args.k = [int(k) for k in args.k.split(",")]
    args.variants = args.variants.split(",")
    args.kernels = args.kernels.split(",") if args.kernels else list(KERNELS)
    args.dtypes = args.dtypes.split(",")
    args.out_per_group = [int(o) for o in args.out_per_group.split(",")]
    for name, given, accepted in (("variant", args.variants, ACCEPTED_VARIANTS), ("kernel", args.kernels, KERNELS),
                                  ("dtype", args.dtypes, tuple(DTYPES))):
        for value in given:
            if value not in accepted:
                parser.error(f"unknown {name} {value!r}; accepted: {', '.join(accepted)}")
    for k in args.k:
        if k % 2 == 0 or not 1 <= k <= 9:
            parser.error(f"--k takes odd sizes from 1 to 9, got {k}")
    return args


def signature(fn, dtype: torch.dtype) -> Dict[str, str]:
    """Argument types as the backend passes them: pointers of the input's dtype (accumulation buffers of
    float32, or float64; swap words of int32), 32-bit integers, and the constexprs."""
    accumulate = POINTER_TYPES[torch.float64 if dtype == torch.float64 else torch.float32]
    types = {}
    for param in fn.params:
        if param.is_constexpr:
            types[param.name] = "constexpr"
        elif param.name in WORDS:
            types[param.name] = "*i32"
        elif param.name.endswith("_ptr"):
            types[param.name] = accumulate if param.name in ACCUMULATED else POINTER_TYPES[dtype]
        else:
            types[param.name] = "i32"
    return types


def sass_counts(sass: str) -> Dict[str, int]:
    """Instruction counts by opcode (predicates and modifiers stripped)."""
    counts: Dict[str, int] = {}
    for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass):
        counts[match.group(1)] = counts.get(match.group(1), 0) + 1
    return counts


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def compile_kernel(fn, dtype, meta: dict, arch: int, folder: Path) -> dict:
    """Compiles ``fn`` with ``meta`` for ``sm_<arch>``; returns the report's cells."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    constexprs = {name: value for name, value in meta.items() if name not in ("num_warps", "num_stages")}
    start = cpu_seconds()
    compiled = triton.compile(ASTSource(fn=fn, signature=signature(fn, dtype), constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": meta["num_warps"], "num_stages": meta["num_stages"]})
    seconds = cpu_seconds() - start
    cubin = folder / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                           check=True).stdout
    resources = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    counts = sass_counts(subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                                        text=True, check=True).stdout)
    cells = {"regs": resources.get("REG", "?"), "spill B": resources.get("STACK", "?"),
             "shared B": compiled.metadata.shared, "layout conversions": compiled.asm["ttgir"].count("ttg.convert_layout"),
             "SASS": sum(counts.values())}
    for group, opcodes in SASS_GROUPS.items():
        cells[group] = sum(counts.get(op, 0) for op in opcodes)
    cells["compile CPU s"] = f"{seconds:.1f}"
    return cells


# Peaks of the GPUs the issue measures on (NVIDIA's datasheets, SXM, dense): memory bandwidth in bytes/s, tensor-core
# TF32 and BF16 and plain FP32 arithmetic in operations/s.
GPUS = {"H100": dict(bandwidth=3.35e12, tf32=495e12, bf16=990e12, fp32=67e12),
        "H200": dict(bandwidth=4.8e12, tf32=495e12, bf16=990e12, fp32=67e12)}
ROOFLINE_MODELS = {"scnn_p_rs_7": 100, "ri_resnet18": 32, "ri_densenet40": 32}


def layer_roofline(shape, geometry, element_bytes: int) -> Dict[str, float]:
    """Arithmetic and memory of one SortConv2d layer (a ``bench_sortconv.LayerShape``), forward and
    forward+backward, for three designs: the convolution itself (what cuDNN must at least move), materialised
    columns (the columns path: the sorted columns written and read back, in the backward again with their
    gradient) and the gemm path (the input read once per block of 64 outputs; in the backward the input gradient's
    window values written and read back by ``F.fold``, or with its scatter added into a zeroed float32 buffer of
    the input's size: ``scatter MB f+b`` counts that buffer's zeroing, its write-back from L2 and, for half
    types, its conversion, assuming the atomic additions resolve in L2; their throughput is not modelled).
    ``sort ops``: comparators (two min/max each) and bilinear
    taps (a multiply-add each) per forward, plain FP32 work, done twice more in the gemm backward."""
    k, groups = shape.kernel_size, shape.groups
    out_h = (shape.height + 2 * shape.pad - shape.dilation * (k - 1) - 1) // shape.stride + 1
    out_w = (shape.width + 2 * shape.pad - shape.dilation * (k - 1) - 1) // shape.stride + 1
    positions = shape.batch * out_h * out_w
    windows = positions * shape.in_channels
    macs = positions * shape.out_channels * (shape.in_channels // groups) * k * k
    x = shape.batch * shape.in_channels * shape.height * shape.width * element_bytes
    w = shape.out_channels * (shape.in_channels // groups) * k * k * element_bytes
    out = positions * shape.out_channels * element_bytes
    columns = windows * k * k * element_bytes
    output_blocks = -(-(shape.out_channels // groups) // 64)
    taps = int((geometry.tap_weights != 0).sum())
    sort_ops = windows * (2 * len(geometry.comparators()) + taps)
    conv_fwd, conv_bwd = x + w + out, out + x + w + x + w
    buffer = x * 4 // element_bytes  # the scatter's float32 input gradient
    gemm_fwd = conv_fwd + (output_blocks - 1) * x
    return {
        "GFLOP fwd": 2 * macs / 1e9, "sort Gop fwd": sort_ops / 1e9,
        "conv MB fwd": conv_fwd / 1e6, "conv MB f+b": (conv_fwd + conv_bwd) / 1e6,
        "columns MB fwd": (conv_fwd + 2 * columns) / 1e6,
        "columns MB f+b": (conv_fwd + 2 * columns + conv_bwd + 6 * columns) / 1e6,
        "gemm MB fwd": gemm_fwd / 1e6,
        "gemm MB f+b": (gemm_fwd + conv_bwd + 2 * columns * 4 // element_bytes) / 1e6,
        "scatter MB f+b": (gemm_fwd + conv_bwd - x + 2 * buffer + (buffer + x if element_bytes < 4 else 0)) / 1e6,
    }


def roofline(models: Dict[str, int], gpu: str, dtype: str) -> List[List[str]]:
    """One row per distinct SortConv2d layer of ``models`` (name: batch) with :func:`layer_roofline` and the
    time bounds on ``gpu`` (milliseconds, forward / forward+backward): the larger of memory at full bandwidth and
    products on tensor cores (plus, for SC, its sorting on the plain FP32 units)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_sortconv import model_layer_shapes

    from timm_sortconv.ops.geometry import get_geometry

    peak = GPUS[gpu]
    tensor = peak["bf16" if dtype == "bfloat16" else "tf32"]
    element = 2 if dtype == "bfloat16" else 4
    rows = []
    for name, batch in models.items():
        shapes, variant = model_layer_shapes(name, batch)
        sampling, sorting = variant.split("/")[0].rsplit("-", 1)
        for shape in shapes:
            cells = layer_roofline(shape, get_geometry(shape.kernel_size, sampling, sorting), element)

            def bound(megabytes: float, flop_factor: float, sort_factor: float) -> float:
                return 1e3 * max(megabytes * 1e6 / peak["bandwidth"], flop_factor * cells["GFLOP fwd"] * 1e9 / tensor
                                 + sort_factor * cells["sort Gop fwd"] * 1e9 / peak["fp32"])

            rows.append([name, shape.label(), f"{cells['GFLOP fwd']:.2f}", f"{cells['sort Gop fwd']:.2f}",
                         f"{cells['conv MB fwd']:.0f} / {cells['conv MB f+b']:.0f}",
                         f"{cells['columns MB fwd']:.0f} / {cells['columns MB f+b']:.0f}",
                         f"{cells['gemm MB fwd']:.0f} / {cells['gemm MB f+b']:.0f}",
                         f"{bound(cells['conv MB fwd'], 1, 0):.3f} / {bound(cells['conv MB f+b'], 3, 0):.3f}",
                         f"{bound(cells['columns MB fwd'], 1, 1):.3f} / {bound(cells['columns MB f+b'], 3, 2):.3f}",
                         f"{bound(cells['gemm MB fwd'], 1, 1):.3f} / {bound(cells['gemm MB f+b'], 3, 3):.3f}",
                         f"{cells['scatter MB f+b']:.0f}", f"{bound(cells['scatter MB f+b'], 3, 3):.3f}"])
    return rows


ROOFLINE_HEADER = ["model", "layer", "GFLOP fwd", "sort Gop fwd", "conv MB fwd / f+b", "columns MB fwd / f+b",
                   "gemm MB fwd / f+b", "conv bound ms", "columns bound ms", "gemm bound ms", "scatter MB f+b",
                   "scatter bound ms f+b"]


def blocks(meta: dict) -> str:
    return " ".join(f"{name[6:]}={value}" for name, value in meta.items() if name.startswith("BLOCK_")) + \
        f" w={meta['num_warps']}" + (" scatter" if meta.get("SCATTER") else "")


def compile_jobs(args):
    """``(row cells, kernel, dtype, meta)`` of every kernel, geometry, dtype and block size selected."""
    from timm_sortconv.ops.geometry import get_geometry
    from timm_sortconv.ops.triton_backend import (BACKWARD_KERNELS, KERNEL_PATHS, SCATTER_KERNELS, config,
                                                  launch_settings)
    from timm_sortconv.ops.triton_backend.source import load_kernels

    for kernel in args.kernels:
        outputs = args.out_per_group if KERNEL_PATHS[kernel] in ("fused", "direct", "gemm") else args.out_per_group[:1]
        scatters = (False, True) if args.candidates and kernel in SCATTER_KERNELS else (False,)
        for k in args.k:
            for variant in args.variants:
                geometry = get_geometry(k, *variant.rsplit("-", 1))
                fn = load_kernels(geometry)[kernel]
                path = KERNEL_PATHS[kernel]
                backward = kernel in BACKWARD_KERNELS
                for dtype_name in args.dtypes:
                    dtype = DTYPES[dtype_name]
                    in_auto = k <= config.AUTO_MAX_KERNEL_SIZE and k * k <= config.window_limit(
                        path, backward, dtype == torch.float64)
                    for out_per_group in outputs:
                        every = config.blocks_of(path, k * k, args.groups, out_per_group, backward)
                        for candidate in (every if args.candidates else every[:1]):
                            for scatter in scatters:
                                meta = launch_settings(kernel, geometry, dtype, args.groups, args.in_per_group,
                                                       out_per_group, blocks=candidate, scatter=scatter)
                                yield ([kernel, str(k), variant, dtype_name, blocks(meta),
                                        "yes" if in_auto else "no"], fn, dtype, meta)


def compile_in_threads(args, jobs) -> int:
    """Compiles ``jobs`` one after another, then in ``args.compile_threads`` threads; prints both wall times."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        with tempfile.TemporaryDirectory() as folder:
            compile_kernel(job[1], job[2], job[3], args.arch, Path(folder))

    print(f"{len(jobs)} kernels ({', '.join(sorted({job[0][0] for job in jobs}))}), k {args.k}, {os.cpu_count()} CPUs")
    start = time.perf_counter()
    for job in jobs:
        one(job)
    serial = time.perf_counter() - start
    start = time.perf_counter()
    with ThreadPoolExecutor(args.compile_threads) as pool:
        list(pool.map(one, jobs))
    threaded = time.perf_counter() - start
    print(f"one thread: {serial:.1f} s; {args.compile_threads} threads: {threaded:.1f} s ({serial / threaded:.2f}x)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.roofline:
        for gpu in args.roofline.split(","):
            for dtype in args.dtypes:
                print(f"\n### {gpu}, {dtype}: bounds of each SortConv2d layer (ms, forward / forward+backward)\n")
                print("| " + " | ".join(ROOFLINE_HEADER) + " |\n|" + "---|" * len(ROOFLINE_HEADER))
                for row in roofline(ROOFLINE_MODELS, gpu, dtype):
                    print("| " + " | ".join(row) + " |")
        return 0
    # Compile every kernel afresh (a cached kernel would report no compile time).
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    import triton

    print(f"Triton {triton.__version__}, torch {torch.__version__}, target sm_{args.arch}\n")
    if args.compile_threads:
        return compile_in_threads(args, list(compile_jobs(args)))
    columns = ["kernel", "k", "variant", "dtype", "blocks", "auto", "regs", "spill B", "shared B",
               "layout conversions", "SASS",
               *SASS_GROUPS, "compile CPU s"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        for cells, fn, dtype, meta in compile_jobs(args):
            row = list(cells)
            try:
                compiled = compile_kernel(fn, dtype, meta, args.arch, Path(folder))
                row += [str(compiled[name]) for name in columns[6:]]
            except Exception as error:  # report every kernel, then fail
                failed = True
                message = str(error).strip().splitlines()
                row.append(f"FAILED: {type(error).__name__}: {message[0] if message else ''}"[:200])
            print("| " + " | ".join(row) + " |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
