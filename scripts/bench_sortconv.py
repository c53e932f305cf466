#!/usr/bin/env python3
"""Benchmark Sorting Convolution on CPU: the fused backend against the reference path and ``nn.Conv2d``.

For every layer shape and SC variant it prints, in milliseconds, the time of ``F.conv2d``, of
``sort_conv2d(backend="reference")`` and of the fast backend (``backend="cpu"``), forward alone (under
``torch.no_grad``) and forward + backward (gradients of input, weight and bias), the fast/conv ratios,
and the memory each path keeps for backward. Optionally it also measures whole-model training
throughput (``scnn_p_rs_7`` against ``scnn_baseline_7``) and an E(2)-CNN peer on the same task.

What is measured:
- Times: the median of ``--repeats`` runs after one warm-up run; conv and the fast path take turns in
  every repeat, so a busy machine slows them alike. ``--clock wall`` (default) is elapsed time;
  ``--clock cpu`` is the process's CPU time (all its threads), which other processes on a shared
  machine disturb far less; with one thread it is the cleanest comparison there is. The reference
  path, tens of times slower, gets ``--reference-repeats`` runs (default 1) after its warm-up.
- Memory: the bytes of the distinct tensors autograd saves for backward during the forward pass
  (``torch.autograd.graph.saved_tensors_hooks``): the memory a training step holds per layer between
  forward and backward. Parameters count too (the weight is saved by every path).

On a CUDA GPU (``--device cuda``) it prints a GPU table instead: per layer, variant, kernel size
and precision, ``F.conv2d`` in float32 without TF32 and with PyTorch's defaults (or under autocast for
``bf16``/``fp16``), SC on the GPU (one column per ``--triton-paths`` entry: ``auto``, ``backend="auto"`` as
users get it, which checks and times its kernels on the warm-up call; ``triton``, the Triton backend's own rule;
or one path, ``backend="triton-<path>"``)
and the reference path, forward and forward+backward, timed with CUDA events; and with ``--throughput``, training
steps of scnn_p_rs_7, ri_resnet18 and ri_densenet40 against their ``*_baseline`` twins. ``--dry-run`` runs
that code on tiny CPU tensors (the Triton kernels in Triton's interpreter: set ``TRITON_INTERPRET=1``).

Examples:
    python scripts/bench_sortconv.py                           # the four ResNet/SCNN layer shapes, all variants
    python scripts/bench_sortconv.py --shapes k5 --skip-reference   # the same layers with 5x5 kernels
    python scripts/bench_sortconv.py --shapes scnn_p_rs_7 --variants polar-ring --skip-reference
    python scripts/bench_sortconv.py --shapes none --throughput --e2cnn
    python scripts/bench_sortconv.py --shapes none --throughput --precisions fp32,bf16 --threads 1 --clock cpu
    python scripts/bench_sortconv.py --shapes none --twins all --latency --threads 1 --clock cpu
    python scripts/bench_sortconv.py --device cuda --shapes gpu --kernel-sizes 3,5,7 --precisions fp32,bf16
    python scripts/bench_sortconv.py --device cuda --shapes gpu --triton-paths fused,columns --skip-reference
    TRITON_INTERPRET=1 python scripts/bench_sortconv.py --device cuda --dry-run --throughput
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

import timm
import timm_sortconv
from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv.check import DECISION_HEADER, decision_rows
from timm_sortconv.ops import SAMPLINGS, SORTINGS, cpu_backend
from timm_sortconv.ops.triton_backend import tuning

VARIANTS = ("polar-ring", "polar-global", "square-ring", "square-global")  # the default: the paper's four
# every sampling-sorting pair the operator takes (e.g. polar-c2, square-c4)
ACCEPTED_VARIANTS = tuple(f"{sampling}-{sorting}" for sampling in SAMPLINGS for sorting in SORTINGS)
MODELS = {"scnn_p_rs_7": 100, "ri_resnet18": 10, "ri_densenet40": 10}  # the paper's batch sizes


@dataclass(frozen=True)
class LayerShape:
    batch: int
    in_channels: int
    out_channels: int
    height: int
    width: int
    kernel_size: int
    stride: int = 1
    padding: int = -1  # -1: kernel_size // 2
    dilation: int = 1
    groups: int = 1
    count: int = 1  # how often the layer occurs in its model

    @property
    def pad(self) -> int:
        return self.kernel_size // 2 if self.padding < 0 else self.padding

    def label(self) -> str:
        extra = "".join(f", {name} {value}" for name, value, default in (
            ("stride", self.stride, 1), ("dilation", self.dilation, 1), ("groups", self.groups, 1)) if value != default)
        times = f" (x{self.count})" if self.count > 1 else ""
        return (f"B={self.batch}, C_in={self.in_channels}, C_out={self.out_channels}, "
                f"{self.height}x{self.width}, k={self.kernel_size}{extra}{times}")


# Layers of the paper's networks: the SCNN's 7x7 convolutions at 28x28 and 14x14 (batch 100, the paper's), a
# ResNet stage at 64x64 with 3x3 and 7x7 kernels (batch 10).
RESNET_SHAPES = [
    LayerShape(100, 32, 32, 28, 28, 7),
    LayerShape(100, 32, 64, 14, 14, 7),
    LayerShape(10, 64, 64, 64, 64, 3),
    LayerShape(10, 64, 64, 64, 64, 7),
]
# The same layers with 5x5 kernels.
K5_SHAPES = [
    LayerShape(100, 32, 32, 28, 28, 5),
    LayerShape(100, 32, 64, 14, 14, 5),
    LayerShape(10, 64, 64, 64, 64, 5),
]
# GPU shapes: the SCNN's 7x7 layers, ResNet stages at 32x32 to 8x8 (batch 32), and two of ConvNeXt-T's 7x7
# depthwise layers at 224x224 input (stages 1 and 3).
GPU_SHAPES = [
    LayerShape(100, 32, 32, 28, 28, 7),
    LayerShape(100, 32, 64, 14, 14, 7),
    LayerShape(32, 64, 64, 32, 32, 3),
    LayerShape(32, 128, 128, 16, 16, 3),
    LayerShape(32, 256, 256, 8, 8, 3),
    LayerShape(32, 96, 96, 56, 56, 7, groups=96),
    LayerShape(32, 384, 384, 14, 14, 7, groups=384),
]
SHAPE_SETS = {"resnet": ("The SCNN and ResNet layer shapes", RESNET_SHAPES),
              "k5": ("The same layers with k = 5", K5_SHAPES),
              "gpu": ("GPU shapes: SCNN and ResNet layers, two ConvNeXt depthwise layers", GPU_SHAPES)}


def model_layer_shapes(name: str, batch: int) -> Tuple[List[LayerShape], str]:
    """The distinct ``SortConv2d`` layers of a model at its default input size, with their counts,
    and the model's variant."""
    model = timm.create_model(name)
    input_size = model.pretrained_cfg["input_size"]
    found: Dict[LayerShape, int] = {}
    variants = set()

    def hook(module, inputs, output):
        x = inputs[0]
        shape = LayerShape(batch, module.in_channels, module.out_channels, x.shape[2], x.shape[3],
                           module.kernel_size[0], module.stride[0], module.padding[0], module.dilation[0],
                           module.groups)
        found[shape] = found.get(shape, 0) + 1
        variants.add(f"{module.sampling}-{module.sorting}")

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, SortConv2d)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, *input_size))
    for handle in handles:
        handle.remove()
    return [replace(shape, count=count) for shape, count in found.items()], "/".join(sorted(variants))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def median_times(fns: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """Median seconds of each function; one warm-up call each, then the functions take turns."""
    for fn in fns.values():
        fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            samples[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sum(storages.values())


def layer_calls(shape: LayerShape, variant: Optional[str], backend: str):
    """(forward, forward+backward, forward-with-grad) closures for conv (variant None) or SC."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.batch, shape.in_channels, shape.height, shape.width, generator=generator)
    weight = torch.randn(shape.out_channels, shape.in_channels // shape.groups, shape.kernel_size, shape.kernel_size,
                         generator=generator) * 0.1
    bias = torch.randn(shape.out_channels, generator=generator)
    x_grad, weight_grad, bias_grad = (t.clone().requires_grad_() for t in (x, weight, bias))
    kwargs = dict(stride=shape.stride, padding=shape.pad, dilation=shape.dilation, groups=shape.groups)
    if variant is None:
        def op(*args):
            return F.conv2d(*args, **kwargs)
    else:
        sampling, sorting = variant.rsplit("-", 1)

        def op(*args):
            return sort_conv2d(*args, sampling=sampling, sorting=sorting, backend=backend, **kwargs)

    def forward():
        with torch.no_grad():
            return op(x, weight, bias)

    def forward_with_grad():
        return op(x_grad, weight_grad, bias_grad)

    def forward_backward():
        x_grad.grad = weight_grad.grad = bias_grad.grad = None
        out = forward_with_grad()
        out.backward(torch.ones_like(out))

    return forward, forward_backward, forward_with_grad


def bench_layer(shape: LayerShape, variants: Sequence[str], repeats: int, reference_repeats: int) -> List[dict]:
    """One row per variant; the reference path is timed only if ``reference_repeats`` > 0."""
    reference = reference_repeats > 0
    conv_f, conv_fb, conv_saved = layer_calls(shape, None, "")
    rows = []
    for variant in variants:
        fast_f, fast_fb, fast_saved = layer_calls(shape, variant, "cpu")
        times = median_times({"conv_f": conv_f, "conv_fb": conv_fb, "fast_f": fast_f, "fast_fb": fast_fb}, repeats)
        if reference:
            ref_f, ref_fb, ref_saved = layer_calls(shape, variant, "reference")
            times.update(median_times({"ref_f": ref_f, "ref_fb": ref_fb}, reference_repeats))
        row = dict(variant=variant, **times, conv_mb=saved_bytes(conv_saved) / 2**20,
                   fast_mb=saved_bytes(fast_saved) / 2**20)
        if reference:
            row["ref_mb"] = saved_bytes(ref_saved) / 2**20
        rows.append(row)
    return rows


def ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def table_header(reference: bool, first: List[str]) -> None:
    header = first + ["conv fwd", "conv f+b"]
    if reference:
        header += ["ref fwd", "ref f+b"]
    header += ["fast fwd", "fast f+b", "fast/conv fwd", "fast/conv f+b"]
    if reference:
        header += ["ref/fast f+b"]
    header += ["saved MB conv", "saved MB fast"] + (["saved MB ref"] if reference else [])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))


def table_row(row: dict, reference: bool, first: List[str]) -> None:
    cells = first + [ms(row["conv_f"]), ms(row["conv_fb"])]
    if reference:
        cells += [ms(row["ref_f"]), ms(row["ref_fb"])]
    cells += [ms(row["fast_f"]), ms(row["fast_fb"]), f"{row['fast_f'] / row['conv_f']:.2f}x",
              f"{row['fast_fb'] / row['conv_fb']:.2f}x"]
    if reference:
        cells += [f"{row['ref_fb'] / row['fast_fb']:.1f}x"]
    cells += [f"{row['conv_mb']:.1f}", f"{row['fast_mb']:.1f}"] + ([f"{row['ref_mb']:.1f}"] if reference else [])
    print("| " + " | ".join(cells) + " |")


def print_layer_table(shape: LayerShape, rows: List[dict], reference: bool) -> None:
    """One table per shape, one row per variant."""
    print(f"\n#### {shape.label()}\n")
    table_header(reference, ["variant"])
    for row in rows:
        table_row(row, reference, [row["variant"]])


def print_model_table(name: str, shapes: List[LayerShape], results: Dict[LayerShape, List[dict]],
                      reference: bool) -> None:
    """One row per distinct layer and variant, then the layers weighted by how often each occurs:
    the SC layers of one training step."""
    print(f"\n#### {name}: one row per distinct SortConv2d layer (batch {shapes[0].batch})\n")
    table_header(reference, ["C_in -> C_out, H x W, k", "x", "variant"])
    for shape in shapes:
        extra = f", stride {shape.stride}" if shape.stride != 1 else ""
        layer = f"{shape.in_channels} -> {shape.out_channels}, {shape.height}x{shape.width}, {shape.kernel_size}{extra}"
        for row in results[shape]:
            table_row(row, reference, [layer, str(shape.count), row["variant"]])
    print(f"\n#### {name}: all its SortConv2d layers (times weighted by occurrence)\n")
    print("| variant | conv fwd | conv f+b | fast fwd | fast f+b | fast/conv fwd | fast/conv f+b |")
    print("|---|---|---|---|---|---|---|")
    for index, variant in enumerate(row["variant"] for row in results[shapes[0]]):
        total = {key: sum(results[s][index][key] * s.count for s in shapes)
                 for key in ("conv_f", "conv_fb", "fast_f", "fast_fb")}
        print(f"| {variant} | {ms(total['conv_f'])} | {ms(total['conv_fb'])} | {ms(total['fast_f'])} | "
              f"{ms(total['fast_fb'])} | {total['fast_f'] / total['conv_f']:.2f}x | "
              f"{total['fast_fb'] / total['conv_fb']:.2f}x |")


def training_step(model: nn.Module, batch: int, input_size: Sequence[int], precision: str = "fp32",
                  num_classes: int = 10) -> Callable[[], None]:
    """One Adam training step (forward, cross-entropy, backward, step) of `model` on a fixed random batch;
    ``precision="bf16"``: forward and loss under ``torch.autocast("cpu", dtype=torch.bfloat16)``."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, *input_size, generator=generator)
    labels = torch.randint(0, num_classes, (batch,), generator=generator)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model.train()

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    return step


def training_throughput(model: nn.Module, batch: int, input_size: Sequence[int], steps: int,
                        num_classes: int = 10) -> float:
    """Images per second of Adam training steps; median step."""
    seconds = median_times({"step": training_step(model, batch, input_size, num_classes=num_classes)}, steps)["step"]
    return batch / seconds


def set_backend(model: nn.Module, backend: str) -> nn.Module:
    for module in model.modules():
        if isinstance(module, SortConv2d):
            module.backend = backend
    return model


def e2cnn_mnist_model(width: int = 1):
    """An E(2)-CNN (C8 regular fields) shaped like SCNN: six equivariant convolutions with 4, 4, 8, 8, 16,
    16 regular fields times ``width`` (width 1: 32 ... 128 channels, SCNN's widths; width 4: about
    SCNN's parameter count), kernels 7, 7, 7, 7, 3, 3 with padding k // 2, batch norm and ReLU, 2x2 max
    pooling after the 2nd and 4th, group pooling, global average pooling and one linear layer: the
    feature-map sizes of scnn_*_7, with the equivariance built into the filters."""
    from e2cnn import gspaces
    from e2cnn import nn as enn

    space = gspaces.Rot2dOnR2(N=8)
    fields = enn.FieldType(space, [space.trivial_repr])
    layers = []
    for index, (count, k) in enumerate(zip((4 * width, 4 * width, 8 * width, 8 * width, 16 * width, 16 * width),
                                           (7, 7, 7, 7, 3, 3))):
        out_type = enn.FieldType(space, count * [space.regular_repr])
        layers += [enn.R2Conv(fields, out_type, kernel_size=k, padding=k // 2, bias=False),
                   enn.InnerBatchNorm(out_type), enn.ReLU(out_type, inplace=True)]
        if index in (1, 3):
            layers.append(enn.PointwiseMaxPool(out_type, 2))
        fields = out_type
    layers.append(enn.GroupPooling(fields))

    class E2MNIST(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_type = enn.FieldType(space, [space.trivial_repr])
            self.features = enn.SequentialModule(*layers)
            self.fc = nn.Linear(16 * width, 10)

        def forward(self, x):
            x = self.features(enn.GeometricTensor(x, self.input_type)).tensor
            return self.fc(x.mean((2, 3)))

    return E2MNIST()


CPU_PRECISIONS = ("fp32", "bf16")
# How the CPU tables name them.
CPU_PRECISION_LABELS = {"fp32": "float32", "bf16": "bfloat16 autocast"}


def print_throughput(steps: int, batch: int, e2cnn: bool, reference: bool, precisions: Sequence[str] = ("fp32",)) -> None:
    """The whole-model table: every model in every precision, their steps taking turns (median step)."""
    print(f"\n### Whole-model training throughput (MNIST 1x28x28, batch {batch}, Adam, median of {steps} steps "
          "taken in turns)\n")
    print("| model | precision | parameters | images/s | time per step (ms) |")
    print("|---|---|---|---|---|")
    entries: List[Tuple[str, Callable[[], nn.Module]]] = [
        ("scnn_baseline_7 (nn.Conv2d)", lambda: timm.create_model("scnn_baseline_7")),
        ("scnn_p_rs_7, fast CPU backend", lambda: set_backend(timm.create_model("scnn_p_rs_7"), "cpu")),
    ]
    if reference:
        entries.append(("scnn_p_rs_7, reference path",
                        lambda: set_backend(timm.create_model("scnn_p_rs_7"), "reference")))
    if e2cnn:
        entries.append(("E(2)-CNN (e2cnn), C8 regular, SCNN's widths", e2cnn_mnist_model))
        entries.append(("E(2)-CNN (e2cnn), C8 regular, 4x the widths (SCNN's parameter count)",
                        lambda: e2cnn_mnist_model(width=4)))
    steps_by_row: Dict[Tuple[str, str], Callable[[], None]] = {}
    parameters: Dict[str, int] = {}
    for name, build in entries:
        for precision in precisions:
            try:
                model = build()
            except ImportError as error:
                print(f"| {name} | {precision} | - | not run: {error} | - |")
                break
            parameters[name] = sum(p.numel() for p in model.parameters())
            steps_by_row[name, precision] = training_step(model, batch, (1, 28, 28), precision)
    seconds = median_times(steps_by_row, steps)
    for (name, precision), step_seconds in seconds.items():
        print(f"| {name} | {CPU_PRECISION_LABELS[precision]} | {parameters[name]:,} | {batch / step_seconds:.0f} | "
              f"{step_seconds * 1e3:.0f} |")

def sortified_resnet18() -> nn.Module:
    """timm's ``resnet18`` with every convolution of kernel size >= 2 turned into SortConv2d (``sortify``'s
    defaults: polar sampling, ring sorting)."""
    return timm_sortconv.sortify(timm.create_model("resnet18"))


# The training-speed goal's models on the CPU: name -> (SC model, its plain twin, input size, batch).
CPU_TWINS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[], nn.Module], Tuple[int, int, int], int]] = {
    "scnn_p_rs_7": (lambda: timm.create_model("scnn_p_rs_7"), lambda: timm.create_model("scnn_baseline_7"),
                    (1, 28, 28), 100),
    "scnn_p_c2_7_canon": (lambda: timm.create_model("scnn_p_c2_7_canon"),
                          lambda: timm.create_model("scnn_baseline_7"), (1, 28, 28), 100),
    "scnn_p_gs_7": (lambda: timm.create_model("scnn_p_gs_7"), lambda: timm.create_model("scnn_baseline_7"),
                    (1, 28, 28), 100),
    "ri_resnet18": (lambda: timm.create_model("ri_resnet18"), lambda: timm.create_model("ri_resnet18_baseline"),
                    (3, 128, 128), 16),
    "sortified_resnet18": (sortified_resnet18, lambda: timm.create_model("resnet18"), (3, 224, 224), 8),
}


def print_twins(names: Sequence[str], steps: int, precisions: Sequence[str]) -> None:
    """Per model, its training step against its plain twin's (the two taking turns, median step)."""
    print(f"\n### Training steps against the plain twin (Adam, median of {steps} steps taken in turns)\n")
    print("| SC model | twin | input, batch | precision | SC images/s | twin images/s | SC / twin |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        build_sc, build_twin, size, batch = CPU_TWINS[name]
        for precision in precisions:
            sc, twin = build_sc(), build_twin()
            steps_by_row = {side: training_step(model, batch, size, precision,
                                                num_classes=model.get_classifier().out_features)
                            for side, model in (("sc", sc), ("twin", twin))}
            seconds = median_times(steps_by_row, steps)
            print(f"| {name} | {twin.default_cfg['architecture']} | {size[1]}x{size[2]}, {batch} | "
                  f"{CPU_PRECISION_LABELS[precision]} | {batch / seconds['sc']:.1f} | "
                  f"{batch / seconds['twin']:.1f} | {seconds['twin'] / seconds['sc']:.2f} |", flush=True)


# Inference input per model of CPU_TWINS: the training input, except ri_resnet18 at ImageNet's 224.
LATENCY_SIZES = {"ri_resnet18": (3, 224, 224)}


def print_latency(names: Sequence[str], repeats: int) -> None:
    """Per model, eval-mode inference of one image (``torch.no_grad``) against its plain twin's, the two
    taking turns (median)."""
    print(f"\n### Inference at batch 1 against the plain twin (eval mode, no_grad, median of {repeats} taken in "
          "turns)\n")
    print("| SC model | twin | input | SC ms | twin ms | SC / twin |")
    print("|---|---|---|---|---|---|")
    for name in names:
        build_sc, build_twin, size, _ = CPU_TWINS[name]
        size = LATENCY_SIZES.get(name, size)
        image = torch.randn(1, *size, generator=torch.Generator().manual_seed(0))
        sc, twin = build_sc().eval(), build_twin().eval()

        def infer(model):
            def run():
                with torch.no_grad():
                    model(image)
            return run

        seconds = median_times({"sc": infer(sc), "twin": infer(twin)}, repeats)
        print(f"| {name} | {twin.default_cfg['architecture']} | {size[1]}x{size[2]} | {seconds['sc'] * 1e3:.1f} | "
              f"{seconds['twin'] * 1e3:.1f} | {seconds['sc'] / seconds['twin']:.2f}x |", flush=True)


# ---------------------------------------------------------------------------------------------------------
# --device cuda: the GPU table (F.conv2d against the Triton backend) and model throughput.

PRECISIONS = ("fp32", "bf16", "fp16")
# "auto": backend="auto", what users get (its kernel checked and timed on the warm-up call, or the reference
# path); "triton": backend="triton", the Triton backend's own rule, unchecked; a path: backend="triton-<path>".
TRITON_PATHS = ("auto", "triton", "direct", "fused", "columns", "gemm")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Models and their nn.Conv2d twins, with the paper's batch sizes (inputs at the model's own size: 28x28 for the
# SCNN, 128x128 for the others).
CUDA_MODELS = {"scnn_p_rs_7": ("scnn_baseline_7", 100), "ri_resnet18": ("ri_resnet18_baseline", 32),
               "ri_densenet40": ("ri_densenet40_baseline", 32)}
# --dry-run: one tiny layer, and small model inputs, so that the interpreter finishes in seconds.
DRY_RUN_SHAPES = [LayerShape(2, 4, 4, 6, 6, 3)]


def cuda_median_times(fns: Dict[str, Callable[[], object]], repeats: int, device: torch.device) -> Dict[str, float]:
    """Median seconds of each function (one warm-up call each, then taking turns), timed with CUDA events
    on a GPU and the wall clock elsewhere; NaN with ``repeats`` 0 (the warm-up alone: compiles kernels and
    makes backend="auto"'s decisions)."""
    for fn in fns.values():
        fn()
    samples: Dict[str, List[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(tuning.seconds(fn, device))
    return {name: statistics.median(values) if values else float("nan") for name, values in samples.items()}


@contextlib.contextmanager
def conv_precision(precision: str, device: torch.device):
    """``fp32``: float32 without TF32 anywhere; ``tf32``: PyTorch's defaults (TF32 in cuDNN convolutions);
    ``bf16``/``fp16``: under ``torch.autocast``."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    if precision == "fp32":
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        if precision in AUTOCAST_DTYPES:
            with torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision]):
                yield
        else:
            yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def sc_backend(path: str) -> str:
    """The ``backend=`` argument of a ``--triton-paths`` entry (:data:`TRITON_PATHS`)."""
    return path if path in ("auto", "triton") else f"triton-{path}"


def cuda_layer_calls(shape: LayerShape, variant: Optional[str], backend: str, device: torch.device,
                     precision: str):
    """(forward, forward+backward, forward-with-grad) closures on ``device`` under ``precision``: F.conv2d
    (variant None) or SC (``--dry-run`` on the CPU runs the Triton backend under Triton's interpreter, where it
    takes CPU tensors)."""
    tensors = {}

    def moved(fn):
        def run():
            with conv_precision(precision, device):
                return fn()
        return run

    if variant is None:
        def op(x, weight, bias):
            return F.conv2d(x, weight, bias, shape.stride, shape.pad, shape.dilation, shape.groups)
    else:
        sampling, sorting = variant.rsplit("-", 1)

        def op(x, weight, bias):
            return sort_conv2d(x, weight, bias, shape.stride, shape.pad, shape.dilation, shape.groups,
                               sampling=sampling, sorting=sorting, backend=backend)
    generator = torch.Generator().manual_seed(0)
    for name, size in (("x", (shape.batch, shape.in_channels, shape.height, shape.width)),
                       ("weight", (shape.out_channels, shape.in_channels // shape.groups, shape.kernel_size,
                                   shape.kernel_size)), ("bias", (shape.out_channels,))):
        tensors[name] = (torch.randn(size, generator=generator) * (0.1 if name == "weight" else 1.0)).to(device)
    grads = {name: t.clone().requires_grad_() for name, t in tensors.items()}

    def forward():
        with torch.no_grad():
            return op(tensors["x"], tensors["weight"], tensors["bias"])

    def forward_with_grad():
        return op(grads["x"], grads["weight"], grads["bias"])

    def forward_backward():
        for t in grads.values():
            t.grad = None
        out = forward_with_grad()
        out.backward(torch.ones_like(out))

    return moved(forward), moved(forward_backward), moved(forward_with_grad)


def cuda_bench_layer(shape: LayerShape, variants: Sequence[str], precision: str, paths: Sequence[str],
                     repeats: int, reference_repeats: int, device: torch.device) -> List[dict]:
    """One row per variant: conv (float32 without TF32 and default, or autocast), SC Triton per path and
    the reference path (if ``reference_repeats`` > 0), forward and forward+backward, and saved MB."""
    fns = {}
    conv_precisions = {"conv32": "fp32", "conv": "tf32"} if precision == "fp32" else {"conv": precision}
    sc_precision = "tf32" if precision == "fp32" else precision  # PyTorch's defaults for float32
    for name, conv_mode in conv_precisions.items():
        f, fb, _ = cuda_layer_calls(shape, None, "", device, conv_mode)
        fns.update({f"{name}_f": f, f"{name}_fb": fb})
    conv_times = cuda_median_times(fns, repeats, device)
    _, _, conv_saved = cuda_layer_calls(shape, None, "", device, sc_precision)
    rows = []
    for variant in variants:
        row = dict(variant=variant, k=shape.kernel_size, **conv_times, conv_mb=saved_bytes(conv_saved) / 2**20)
        triton_fns = {}
        for path in paths:
            f, fb, saved = cuda_layer_calls(shape, variant, sc_backend(path), device, sc_precision)
            triton_fns.update({f"triton[{path}]_f": f, f"triton[{path}]_fb": fb})
            row[f"triton[{path}]_mb"] = saved_bytes(saved) / 2**20
        row.update(cuda_median_times(triton_fns, repeats, device))
        if reference_repeats > 0:
            f, fb, _ = cuda_layer_calls(shape, variant, "reference", device, sc_precision)
            row.update(cuda_median_times({"ref_f": f, "ref_fb": fb}, reference_repeats, device))
        rows.append(row)
    return rows


def compiled_kernel_rows() -> List[List[str]]:
    """Every Triton kernel of the backend compiled in this process, with its block sizes and what it costs on
    the device: registers per thread, spilled bytes, shared memory, warps (Triton's own record; the columns
    are "?" where a Triton version keeps them elsewhere)."""
    from timm_sortconv.ops.triton_backend import KERNELS
    from timm_sortconv.ops.triton_backend.source import _modules

    rows = []
    for (k, sampling, sorting), namespace in _modules.items():
        for name in KERNELS:
            for entry in getattr(namespace[name], "device_caches", {}).values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for compiled in list(getattr(cache, "values", lambda: [])()):
                    constants = getattr(getattr(compiled, "src", None), "constants", None) or {}
                    blocks = " ".join(f"{key[6:] if isinstance(key, str) else key}={value}"
                                      for key, value in constants.items() if "BLOCK" in str(key))
                    metadata = getattr(compiled, "metadata", None)
                    rows.append([name, f"k={k} {sampling}-{sorting}", blocks or "?",
                                 str(getattr(compiled, "n_regs", "?")), str(getattr(compiled, "n_spills", "?")),
                                 str(getattr(metadata, "shared", "?")), str(getattr(metadata, "num_warps", "?"))])
    return rows


def print_compiled_kernels() -> None:
    rows = compiled_kernel_rows()
    for row in rows:
        RECORD("kernel", **dict(zip(("kernel", "geometry", "blocks", "registers", "spilled", "shared", "warps"), row)))
    print(f"\n### The Triton kernels compiled in this run ({len(rows)})\n")
    header = ["kernel", "geometry", "blocks", "registers", "spilled", "shared B", "warps"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_cuda_profile(shape: LayerShape, variant: str, precision: str, path: str, device: torch.device) -> None:
    """torch.profiler's kernels of three SC forward+backward calls on the Triton backend, by device time:
    which of the sorting kernels, cuBLAS products and F.fold take the time."""
    from torch.profiler import ProfilerActivity, profile

    _, forward_backward, _ = cuda_layer_calls(shape, variant, sc_backend(path), device,
                                              "tf32" if precision == "fp32" else precision)
    forward_backward()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            forward_backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n#### Profile: {shape.label()}, {variant}, {precision}, triton[{path}], 3 x forward+backward\n")
    print("```")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=12, max_name_column_width=60))
    print("```")


def print_cuda_table(title: str, rows: List[dict], precision: str, paths: Sequence[str], reference: bool) -> None:
    """The GPU table: conv, SC Triton (per path), SC reference, and SC Triton over conv."""
    conv = ["conv fp32 fwd", "conv fp32 f+b", "conv default fwd", "conv default f+b"] if precision == "fp32" \
        else [f"conv {precision} fwd", f"conv {precision} f+b"]
    header = ["shape", "variant", "k"] + conv
    for path in paths:
        header += [f"triton[{path}] fwd", f"triton[{path}] f+b", f"triton[{path}]/conv fwd",
                   f"triton[{path}]/conv f+b", f"saved MB triton[{path}]"]
    header += (["ref fwd", "ref f+b"] if reference else []) + ["saved MB conv"]
    print(f"\n### {title} ({precision}, ms)\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for label, row in rows:
        keys = ["conv32_f", "conv32_fb", "conv_f", "conv_fb"] if precision == "fp32" else ["conv_f", "conv_fb"]
        cells = [label, row["variant"], str(row["k"])] + [f"{row[key] * 1e3:.3f}" for key in keys]
        for path in paths:
            f, fb = row[f"triton[{path}]_f"], row[f"triton[{path}]_fb"]
            cells += [f"{f * 1e3:.3f}", f"{fb * 1e3:.3f}", f"{f / row['conv_f']:.2f}x", f"{fb / row['conv_fb']:.2f}x",
                      f"{row[f'triton[{path}]_mb']:.1f}"]
        if reference:
            cells += [f"{row['ref_f'] * 1e3:.3f}", f"{row['ref_fb'] * 1e3:.3f}"]
        cells.append(f"{row['conv_mb']:.1f}")
        print("| " + " | ".join(cells) + " |")


def cuda_layer_shapes(args, variants: List[str], variant_given: bool, device: torch.device):
    """(title, [(shape, variants)]) per entry of --shapes, k replaced by each of --kernel-sizes."""
    sizes = [int(k) for k in args.kernel_sizes.split(",")] if args.kernel_sizes else [None]
    for name in args.shapes.split(","):
        if name == "none":
            continue
        if args.dry_run:
            title, shapes, layer_variants = "Dry run: one tiny layer", DRY_RUN_SHAPES, variants
        elif name in SHAPE_SETS:
            title, shapes = SHAPE_SETS[name]
            layer_variants = variants
        else:
            shapes, model_variant = model_layer_shapes(name, args.batch or CUDA_MODELS[name][1])
            title = f"{name}: its SortConv2d layers at its input size"
            layer_variants = variants if variant_given else model_variant.split("/")
        entries = [(shape if k is None else replace(shape, kernel_size=k, padding=-1), layer_variants)
                   for k in sizes for shape in shapes]
        yield title, entries
        if args.dry_run:
            return


def cuda_training_throughput(name: str, backend: Optional[str], batch: int, steps: int, precision: str,
                             device: torch.device, input_size: Optional[Sequence[int]] = None,
                             compile_mode: str = "eager") -> float:
    """Images per second of Adam steps of model ``name`` on ``device`` (SortConv2d layers on ``backend``), the
    model run eagerly or through ``torch.compile(model, mode=compile_mode)`` (its first steps compile)."""
    torch._dynamo.reset()
    model = timm.create_model(name)
    if backend is not None:
        set_backend(model, backend)
    model.to(device).train()
    forward = model if compile_mode == "eager" else torch.compile(model, mode=compile_mode)
    input_size = input_size or model.pretrained_cfg["input_size"]
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch, *input_size, generator=generator).to(device)
    labels = torch.randint(0, model.num_classes, (batch,), generator=generator).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with conv_precision(precision, device):
            loss = F.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()

    if compile_mode != "eager":  # the compiles, and the CUDA graphs' recording, before the timed steps
        for _ in range(3):
            step()
    return batch / cuda_median_times({"step": step}, steps, device)["step"]


class JsonLines:
    """``--json FILE``: every measurement of the GPU benchmark appended to FILE as one JSON object per line, written
    and flushed as it is made (a run cut off keeps what it measured)."""

    def __init__(self, path: Optional[str]):
        self.file = open(path, "a") if path else None

    def __call__(self, kind: str, **fields) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"kind": kind, **fields}, default=str) + "\n")
            self.file.flush()


RECORD = JsonLines(None)
COMPILE_MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


def print_cuda_throughput(args, precisions: Sequence[str], device: torch.device) -> None:
    backend = "auto"  # what users get; on a dry run's CPU tensors, the CPU backend or the reference path
    print(f"\n### Training throughput (Adam, median of {args.steps} steps after a warm-up step; SortConv2d on "
          f"backend {backend!r})\n")
    print("| model | precision | torch.compile | batch | images/s | baseline twin | its images/s | SC / twin |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (twin, batch) in CUDA_MODELS.items():
        batch = 2 if args.dry_run else (args.batch or batch)
        size = (1, 28, 28) if args.dry_run and name.startswith("scnn") else (3, 32, 32) if args.dry_run else None
        for precision in precisions:
            mode = "tf32" if precision == "fp32" else precision
            for compile_mode in args.compile_modes.split(","):
                sc = cuda_training_throughput(name, backend, batch, args.steps, mode, device, size, compile_mode)
                base = cuda_training_throughput(twin, None, batch, args.steps, mode, device, size, compile_mode)
                print(f"| {name} | {precision} | {compile_mode} | {batch} | {sc:.0f} | {twin} | {base:.0f} | "
                      f"{sc / base:.2f} |", flush=True)
                RECORD("throughput", model=name, precision=precision, compile=compile_mode, batch=batch,
                       images_s=sc, twin=twin, twin_images_s=base)


def main_cuda(args, variants: List[str], variant_given: bool) -> None:
    """The GPU benchmark (``--device cuda``), or its dry run on CPU tensors."""
    if args.dry_run:
        device = torch.device("cpu")
        args.repeats, args.steps = 1, 1
    elif not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (use --dry-run to check the script on the CPU)")
    else:
        device = torch.device("cuda")
    import triton

    global RECORD
    RECORD = JsonLines(args.json)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, timm {timm.__version__}, "
          f"timm_sortconv {timm_sortconv.__version__}; median of {args.repeats} (CUDA events); 'default' is "
          "PyTorch's float32 default (TF32 in convolutions), which SC's product follows")
    RECORD("environment", device=name, torch=torch.__version__, triton=triton.__version__, timm=timm.__version__,
           timm_sortconv=timm_sortconv.__version__, repeats=args.repeats, argv=sys.argv[1:],
           multiprocessors=torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 0)
    reference_repeats = 0 if args.skip_reference else args.reference_repeats
    precisions = args.precisions.split(",")
    paths = args.triton_paths.split(",")
    for title, entries in cuda_layer_shapes(args, variants, variant_given, device):
        for precision in precisions:
            rows = []
            for shape, layer_variants in entries:
                for row in cuda_bench_layer(shape, layer_variants, precision, paths, args.repeats, reference_repeats,
                                            device):
                    rows.append((shape.label(), row))
                    RECORD("layer", table=title, shape=shape.label(), precision=precision, **row)
            print_cuda_table(title, rows, precision, paths, reference_repeats > 0)
            if args.profile:
                for shape, layer_variants in entries:
                    for variant in layer_variants:
                        for path in paths:
                            print_cuda_profile(shape, variant, precision, path, device)
    if args.throughput:
        print_cuda_throughput(args, precisions, device)
    if device.type == "cuda":
        print_compiled_kernels()
    decisions = tuning.TUNER.decisions()
    if decisions:  # what the triton[auto] columns and the throughput ran
        print('\n### What backend="auto" decided in this run\n')
        print("| " + " | ".join(DECISION_HEADER) + " |\n|" + "---|" * len(DECISION_HEADER))
        for row in decision_rows(decisions):
            print("| " + " | ".join(row) + " |")
        for decision in decisions:
            RECORD("decision", configuration=decision.configuration, chosen=decision.chosen.name,
                   seconds=decision.seconds, checked_seconds=decision.checked_seconds, rejected=decision.rejected,
                   compile_seconds=decision.compile_seconds, compile_failures=decision.compile_failures)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shapes", default="resnet",
                        help="comma-separated: 'resnet' (four SCNN and ResNet layer shapes), 'k5' (three of "
                             "them with k = 5), model names "
                             f"({', '.join(MODELS)}: their SortConv2d layers at the model's input size), or 'none'")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated SC variants (sampling-sorting); model layer tables use the model's "
                             "own variant unless this is given explicitly")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: CPU time of the process (robust on a shared machine)")
    parser.add_argument("--reference-repeats", type=int, default=1,
                        help="timed runs of the (slow) reference path per measurement")
    parser.add_argument("--skip-reference", action="store_true", help="do not time the reference path")
    parser.add_argument("--batch", type=int, default=None, help="batch size for model layers (default: the paper's)")
    parser.add_argument("--throughput", action="store_true",
                        help="whole-model training throughput of scnn_p_rs_7 vs scnn_baseline_7")
    parser.add_argument("--compile-modes", default="eager",
                        help="cuda --throughput: comma-separated, of eager, default, reduce-overhead, "
                             "max-autotune-no-cudagraphs: each model trained as it is or through torch.compile(mode=)")
    parser.add_argument("--e2cnn", action="store_true", help="add an E(2)-CNN model to the throughput table")
    parser.add_argument("--twins", default=None,
                        help=f"comma-separated, of {', '.join(CPU_TWINS)} or 'all': each model's training step "
                             "against its plain twin's, at the model's input size and batch (CPU)")
    parser.add_argument("--latency", action="store_true",
                        help="with --twins: also inference at batch 1 against the twin (--repeats times)")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps for throughput")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU table (F.conv2d against the Triton backend), see the description")
    parser.add_argument("--kernel-sizes", default=None,
                        help="cuda: comma-separated k replacing each listed shape's own (e.g. 3,5,7)")
    parser.add_argument("--precisions", default="fp32",
                        help=f"comma-separated, of {', '.join(PRECISIONS)} on cuda and {', '.join(CPU_PRECISIONS)} "
                             "for the CPU's --throughput (bf16/fp16: under torch.autocast)")
    parser.add_argument("--triton-paths", default="auto",
                        help="cuda: comma-separated SC columns to time: auto (backend='auto', as users get it: "
                             "checked and timed on the warm-up call), triton (backend='triton', its own rule), or "
                             "a path of the Triton backend (backend='triton-<path>'): direct, fused, columns, gemm")
    parser.add_argument("--profile", action="store_true",
                        help="cuda: after each table, torch.profiler's kernel times of SC forward+backward per row")
    parser.add_argument("--json", metavar="FILE",
                        help="cuda: also append every measurement to FILE as JSON lines, as it is made")
    parser.add_argument("--dry-run", action="store_true",
                        help="cuda: run the GPU table's code on tiny CPU tensors (set TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    accepted = PRECISIONS if args.device == "cuda" else CPU_PRECISIONS
    for precision in args.precisions.split(","):
        if precision not in accepted:
            parser.error(f"unknown precision {precision!r} on {args.device}; accepted: {', '.join(accepted)}")
    for compile_mode in args.compile_modes.split(","):
        if compile_mode not in COMPILE_MODES:
            parser.error(f"unknown --compile-modes entry {compile_mode!r}; accepted: {', '.join(COMPILE_MODES)}")
    for path in args.triton_paths.split(","):
        if path not in TRITON_PATHS:
            parser.error(f"unknown Triton path {path!r}; accepted: {', '.join(TRITON_PATHS)}")
    if args.kernel_sizes is not None:
        for k in args.kernel_sizes.split(","):
            if not k.isdigit() or int(k) % 2 == 0:
                parser.error(f"--kernel-sizes takes odd ints, got {k!r}")
    for variant in args.variants.split(","):
        if variant not in ACCEPTED_VARIANTS:
            parser.error(f"unknown variant {variant!r}; accepted: {', '.join(ACCEPTED_VARIANTS)}")
    if args.twins == "all":
        args.twins = ",".join(CPU_TWINS)
    for name in (args.twins.split(",") if args.twins else []):
        if name not in CPU_TWINS:
            parser.error(f"unknown --twins model {name!r}; accepted: {', '.join(CPU_TWINS)}, all")
    for name in args.shapes.split(","):
        if name != "none" and name not in SHAPE_SETS and name not in MODELS:
            parser.error(f"unknown shape set {name!r}; accepted: {', '.join(SHAPE_SETS)}, none, {', '.join(MODELS)}")
    return args


def main(argv=None) -> None:
    global clock
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]
    variant_given = any(a.startswith("--variants") for a in (argv if argv is not None else sys.argv[1:]))
    variants = args.variants.split(",")
    if args.device == "cuda":
        main_cuda(args, variants, variant_given)
        return
    start = time.perf_counter()
    if cpu_backend.load_extension() is None:
        sys.exit("the fused CPU backend could not be built; nothing to benchmark")
    print(f"torch {torch.__version__}, timm {timm.__version__}, timm_sortconv {timm_sortconv.__version__}, "
          f"threads {torch.get_num_threads()}, {args.clock} clock, extension ready in "
          f"{time.perf_counter() - start:.1f} s; CPU kernel level {cpu_backend.cpu_isa()}, PyTorch's "
          f"{torch.backends.cpu.get_cpu_capability()}")
    reference_repeats = 0 if args.skip_reference else args.reference_repeats
    reference = reference_repeats > 0
    for name in args.shapes.split(","):
        if name == "none":
            continue
        if name in SHAPE_SETS:
            title, layer_shapes = SHAPE_SETS[name]
            print(f"\n### {title} (padding k // 2, float32, median of {args.repeats})")
            for shape in layer_shapes:
                print_layer_table(shape, bench_layer(shape, variants, args.repeats, reference_repeats), reference)
            continue
        shapes, model_variant = model_layer_shapes(name, args.batch or MODELS[name])
        layer_variants = variants if variant_given else model_variant.split("/")
        print(f"\n### {name}: its SortConv2d layers at its input size ({model_variant}, float32, "
              f"median of {args.repeats})")
        results = {shape: bench_layer(shape, layer_variants, args.repeats, reference_repeats) for shape in shapes}
        print_model_table(name, shapes, results, reference)
    if args.throughput or args.e2cnn:
        print_throughput(args.steps, 100, args.e2cnn, reference, args.precisions.split(","))
    if args.twins:
        print_twins(args.twins.split(","), args.steps, args.precisions.split(","))
        if args.latency:
            print_latency(args.twins.split(","), args.repeats)


if __name__ == "__main__":
    main()
