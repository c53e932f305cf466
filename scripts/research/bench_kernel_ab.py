#!/usr/bin/env python
"""Compare versions of the fused CPU kernel at one layer shape, in one process, taking turns.

On a shared or virtualised machine the same run can move by 10-20% from one minute to the next, far more
than most kernel changes; timings taken in separate runs cannot tell such changes apart. This script
builds every given version of ``timm_sortconv/csrc`` (a git revision, or a folder holding its ``.cpp``
and ``.h`` files) with ``cpu_backend.load_kernel``, loads them all into one process and, repeat after repeat, runs
each version's forward and backward on the same tensors in turn, so that a slow minute slows them alike.
It prints the median forward and forward + backward time of each version in milliseconds (CPU time of
the process with one thread, wall clock otherwise). ``--isa`` builds every version for one instruction-set
level (``avx512``, ``avx2``, ``generic``; default: the level the package would use here), so that an AVX2
build can be measured on an AVX-512 machine; ``version@isa`` sets it for one version.

A variant is ``sampling-sorting`` (``polar-ring``, ``square-align``, ...); ``polar-align-guided`` is the guided layer
(``sorting="align"`` with one guide channel after the input's, which joins the orientation and has no weight).
``--weight-only`` leaves the input's gradient out of the backward, as at a network's first layer.

Only the kernel changes between versions: the geometry tables, the weight layout and the Python wrapper
are today's (``timm_sortconv.ops.cpu_backend``), so versions must share the extension's interface.

Examples:
    python scripts/research/bench_kernel_ab.py git:HEAD~3 git:HEAD
    python scripts/research/bench_kernel_ab.py git:main path/to/edited/csrc --shape 10,64,64,64,3 --repeats 11
    python scripts/research/bench_kernel_ab.py git:HEAD@avx2 git:HEAD@avx512
    python scripts/research/bench_kernel_ab.py git:HEAD --shape 50,1,32,28,7 --variants polar-ring,polar-align-guided \
        --weight-only --repeats 15
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from timm_sortconv.ops import cpu_backend  # noqa: E402
from timm_sortconv.ops.geometry import get_geometry  # noqa: E402

CSRC = "timm_sortconv/csrc"


def checkout_csrc(spec: str, workdir: Path) -> Path:
    """The folder of kernel sources named by ``spec``: ``git:<revision>`` (extracted from this
    repository) or a folder path."""
    if not spec.startswith("git:"):
        folder = Path(spec)
        if not (folder / "sort_conv_cpu.cpp").is_file():
            raise SystemExit(f"{spec}: no sort_conv_cpu.cpp there (give a folder like {CSRC} or git:<revision>)")
        return folder
    revision = spec[len("git:"):]
    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", f"{revision}:{CSRC}"],
                             capture_output=True, text=True)
    if listing.returncode != 0:
        raise SystemExit(f"{spec}: {listing.stderr.strip()}")
    folder = workdir / hashlib.sha256(revision.encode()).hexdigest()[:12]
    folder.mkdir(parents=True, exist_ok=True)
    for name in listing.stdout.split():
        if name.endswith((".cpp", ".h")):
            text = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:{CSRC}/{name}"],
                                  capture_output=True, check=True).stdout
            (folder / name).write_bytes(text)
    return folder


def split_version(spec: str, isa: Optional[str]) -> Tuple[str, Optional[str]]:
    """``version@isa`` -> (version, isa); a version without ``@`` takes ``isa``."""
    version, at, level = spec.rpartition("@")
    if not at:
        return spec, isa
    if level not in cpu_backend.ISA_LEVELS:
        raise SystemExit(f"{spec}: unknown instruction-set level {level!r}; accepted: "
                         f"{', '.join(cpu_backend.ISA_LEVELS)}")
    return version, level


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="+",
                        help="git:<revision> or a folder with sort_conv_cpu.cpp, optionally followed by @<isa>")
    parser.add_argument("--isa", choices=list(cpu_backend.ISA_LEVELS), default=None,
                        help="instruction-set level to build the versions for (default: the package's choice)")
    parser.add_argument("--shape", default="100,32,32,28,7",
                        help="B,C_in,C_out,H,k: a square H x H output, padding k // 2 (default: the issue's first)")
    parser.add_argument("--variants", default="polar-ring,polar-global,square-ring,square-global")
    parser.add_argument("--weight-only", action="store_true",
                        help="the backward computes the weight's gradient only (a first layer's)")
    parser.add_argument("--repeats", type=int, default=7, help="timed turns per version (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: CPU time)")
    args = parser.parse_args(argv)
    try:
        args.shape = tuple(int(v) for v in args.shape.split(","))
        assert len(args.shape) == 5 and min(args.shape) >= 1 and args.shape[4] % 2 == 1
    except (ValueError, AssertionError):
        parser.error(f"--shape takes B,C_in,C_out,H,k with an odd k, got {args.shape!r}")
    args.variants = [parse_variant(parser, variant) for variant in args.variants.split(",")]
    return args


def parse_variant(parser: argparse.ArgumentParser, variant: str) -> Tuple[str, str, str, bool]:
    """(variant, sampling, sorting, guided) of ``sampling-sorting`` or ``sampling-align-guided``."""
    parts = variant.split("-")
    guided = len(parts) == 3 and parts[1:] == ["align", "guided"]
    if (len(parts) != 2 and not guided) or parts[0] not in ("polar", "square") or not parts[1]:
        parser.error(f"--variants takes sampling-sorting or sampling-align-guided (sampling polar or square), "
                     f"got {variant!r}")
    return variant, parts[0], parts[1], guided


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    with tempfile.TemporaryDirectory() as workdir:
        kernels = []
        for spec in args.versions:
            version, isa = split_version(spec, args.isa)
            kernels.append(cpu_backend.load_kernel(checkout_csrc(version, Path(workdir)), isa))
    batch, channels, outputs, size, k = args.shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, channels, size + k - 1, size + k - 1, generator=generator)  # already padded
    guide = torch.rand(batch, 1, size + k - 1, size + k - 1, generator=generator)
    weight = torch.randn(outputs, channels, k, k, generator=generator) * 0.05
    bias = torch.randn(outputs, generator=generator)
    grad_output = torch.randn(batch, outputs, size, size, generator=generator)
    print(f"shape B={batch}, {channels} -> {outputs}, {size}x{size}, k={k}; {args.threads} thread(s), "
          f"{'CPU time' if args.threads == 1 else 'wall clock'}, median of {args.repeats} turns, ms")
    labels = [f"{split_version(spec, None)[0]}@{kernel.isa}" for spec, kernel in zip(args.versions, kernels)]
    for variant, sampling, sorting, guided in args.variants:
        geometry = get_geometry(k, sampling, sorting)
        inputs = torch.cat([x, guide], 1) if guided else x
        forward = [[] for _ in kernels]
        both = [[] for _ in kernels]
        for turn in range(args.repeats + 1):  # turn 0 warms up
            for i, kernel in enumerate(kernels):
                start = clock()
                kernel.forward(inputs, weight, bias, geometry, (1, 1), (1, 1), 1)
                middle = clock()
                kernel.backward(grad_output, inputs, weight, geometry, (1, 1), (1, 1), 1, not args.weight_only, True)
                end = clock()
                if turn:
                    forward[i].append(middle - start)
                    both[i].append(end - start)
        cells = [f"{label}: fwd {statistics.median(f) * 1e3:.1f} f+b {statistics.median(b) * 1e3:.1f}"
                 for label, f, b in zip(labels, forward, both)]
        print(f"{variant:18s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
