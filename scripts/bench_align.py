#!/usr/bin/env python3
"""What the aligned variants cost: SCNN training steps with ``sorting="align"`` / ``"align-channel"`` and the
guided network (``scnn_p_align_7_guided``: aligned windows turned by the blurred input's orientation,
:mod:`timm_sortconv.guide`) against ring-sorted SC (``scnn_p_rs_7``) and plain convolutions (``scnn_baseline_7``),
in one process, on the CPU or on a GPU (``--device cuda``).

Every model is the paper's MNIST network (7x7 kernels in the first four layers, polar sampling) on the same random
batch; the aligned ones run on ``backend="auto"`` (on the CPU the fused kernel, ``csrc/align_conv_kernel.h``, where it
is built; on CUDA the standard-operator form, checked against the reference path and timed on its first call) unless
``--backend`` names another (``harmonic``: the standard-operator path). One training step is a forward, a backward and
an Adam update. After a warm-up step each, the models take turns for ``--rounds`` rounds, so that a change in the
machine's load falls on all alike, and the least time of the rounds is kept: on the CPU the process's CPU time
(``time.process_time``, which time spent waiting for a core does not count) and the wall-clock time beside it; on a
GPU the wall-clock time with the device synchronised. With ``--layers`` it also times each SC layer's forward and
forward+backward at its input size in the network: ring-sorted, aligned, and guided (the aligned layer with the
guide's channel, as the guided network runs it). As in a training step, the backward computes the gradient of the
weight and of the layer's input, except at the first layer, whose input is the image (its rows are marked
"weight only").

Printed: the device, PyTorch's threads, the 1-minute load average before and after, and Markdown tables of
milliseconds per step with each model's ratio to ``scnn_p_rs_7``, and per layer with the aligned and guided layers'
ratios to the ring-sorted one.

Examples::

    python scripts/bench_align.py                          # batch 50, one thread, 5 rounds
    python scripts/bench_align.py --rounds 9 --layers
    python scripts/bench_align.py --batch-size 1 --layers  # inference-sized calls
    python scripts/bench_align.py --backend harmonic --rounds 2 --models align,scnn_p_rs_7
    python scripts/bench_align.py --device cuda --layers
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Callable, Dict, List

import timm
import torch

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv import SortConv2d
from timm_sortconv.check import training_step
from timm_sortconv.guide import OrientationGuide
from timm_sortconv.models import SCNN

MODELS = ("scnn_baseline_7", "scnn_p_rs_7", "align", "align-channel", "guided")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="SCNN training steps: aligned SC against ring-sorted SC and conv")
    parser.add_argument("--batch-size", "-b", type=int, default=50, help="images per step (default: 50)")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads (default: 1)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the models taking turns (default: 5)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--backend", default="auto", help="backend of the aligned models (default: auto)")
    parser.add_argument("--layers", action="store_true",
                        help="also time each SC layer: ring-sorted, aligned and guided")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default: cpu)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    return args


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return f"{name} ({'with' if 'avx512f' in flags else 'without'} avx512f)"


def load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


def build(name: str, backend: str) -> torch.nn.Module:
    if name in ("align", "align-channel"):
        return SCNN(sorting=name, backend=backend)
    if name == "guided":
        return timm.create_model("scnn_p_align_7_guided", backend=backend)
    return timm.create_model(name)


def take_turns(fns: Dict[str, Callable[[], object]], rounds: int, device: torch.device) -> Dict[str, List[float]]:
    """(least CPU seconds, least wall-clock seconds) of each function over ``rounds`` rounds of turns, after a
    warm-up call each; on a GPU both are wall-clock seconds with the device synchronised before and after."""
    cuda = device.type == "cuda"
    for fn in fns.values():
        fn()
    cpu: Dict[str, List[float]] = {name: [] for name in fns}
    wall: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if cuda:
                torch.cuda.synchronize(device)
            wall_start, cpu_start = time.perf_counter(), time.process_time()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(wall[name][-1] if cuda else time.process_time() - cpu_start)
    return {name: [min(cpu[name]), min(wall[name])] for name in fns}


def _guided_twin(layer: SortConv2d, shape: torch.Size, backend: str) -> SortConv2d:
    """``layer`` aligned and guided, with a guide map of its input's size set (as the guided network's forward
    sets it)."""
    conv = SortConv2d.from_conv(layer, sampling="polar", sorting="align", backend=backend)
    guide = OrientationGuide(4.0).to(layer.weight.device)
    guide.map = guide(torch.rand(shape[0], 1, shape[2], shape[3], generator=torch.Generator().manual_seed(1)).to(
        layer.weight.device))
    conv.guided, conv.guide_source = True, (guide,)
    return conv


def layer_calls(batch: int, backend: str, device: torch.device) -> Dict[str, Callable[[], object]]:
    """Forward and forward+backward of each distinct SC layer of SCNN, ring-sorted, aligned and guided, at its
    input."""
    reference = SCNN()
    shapes = []

    def hook(module, inputs, output):
        shapes.append((module, inputs[0].shape))

    handles = [m.register_forward_hook(hook) for m in reference.modules() if isinstance(m, SortConv2d)]
    reference(torch.zeros(batch, 1, 28, 28))
    for handle in handles:
        handle.remove()
    calls = {}
    for index, (layer, shape) in enumerate(shapes):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(index)).to(device)
        input_grad = index > 0  # the image needs no gradient
        layer = layer.to(device)
        for label in ("ring", "align", "guided"):
            if label == "guided":
                conv = _guided_twin(layer, shape, backend)
            else:
                conv = SortConv2d.from_conv(layer, sampling="polar", sorting=label,
                                            backend="auto" if label == "ring" else backend)
            name = f"{layer.in_channels}->{layer.out_channels} k{layer.kernel_size[0]} {tuple(shape[2:])} {label}"

            def forward(conv=conv, x=x):
                with torch.no_grad():
                    conv(x)

            def forward_backward(conv=conv, x=x, input_grad=input_grad):
                leaf = x.detach().requires_grad_(input_grad)
                conv(leaf).sum().backward()

            calls[f"{name} forward"] = forward
            calls[f"{name} forward+backward{'' if input_grad else ' (weight only)'}"] = forward_backward
    return calls


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = [name.strip() for name in args.models.split(",") if name.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    print(f"Device: {where}; PyTorch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"aligned models on backend={args.backend!r}; batch {args.batch_size}, {args.rounds} rounds")
    print(f"Load average (1 minute) before: {load_average()} on {os.cpu_count()} logical CPUs")
    torch.manual_seed(0)
    steps = {name: training_step(build(name, args.backend).to(device), (1, 28, 28), args.batch_size, device)
             for name in names}
    times = take_turns(steps, args.rounds, device)
    print(f"Load average (1 minute) after: {load_average()}\n")
    base = times.get("scnn_p_rs_7")
    clock = "GPU" if device.type == "cuda" else "CPU"
    print(f"| model | {clock} ms / step | wall ms / step | {clock} time / scnn_p_rs_7 |")
    print("|---|---:|---:|---:|")
    for name, (cpu, wall) in times.items():
        ratio = f"{cpu / base[0]:.2f}" if base else "-"
        print(f"| {name} | {cpu * 1e3:.0f} | {wall * 1e3:.0f} | {ratio} |")
    if args.layers:
        layer_times = take_turns(layer_calls(args.batch_size, args.backend, device), args.rounds, device)
        print("\n| layer (input) | pass | ring ms | align ms | guided ms | align / ring | guided / ring |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, (cpu, _) in layer_times.items():
            if " ring " not in name:
                continue
            aligned = layer_times[name.replace(" ring ", " align ")][0]
            guided = layer_times[name.replace(" ring ", " guided ")][0]
            layer, _, what = name.partition(" ring ")
            print(f"| {layer} | {what} | {cpu * 1e3:.1f} | {aligned * 1e3:.1f} | {guided * 1e3:.1f} | "
                  f"{aligned / cpu:.2f} | {guided / cpu:.2f} |")


if __name__ == "__main__":
    main()
