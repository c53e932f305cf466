#!/usr/bin/env python3
"""What centring the strided grids costs: training steps and inference of a model with ``stride_align="centre"``
(the default) against ``"corner"`` (PyTorch's grid), in one process.

Both builds are the same network with the same weights; they differ only where an input side makes a strided
layer's grid off centre, and there the centred one reads its input half a pixel on (a 2-tap mean) or crops it
first (``timm_sortconv.grid``). At a size where every grid is centred anyway the two run the same operations.
The two take turns for ``--rounds`` rounds of ``--steps`` steps each, after warm-up steps, so a machine that
slows down slows both alike; printed is a Markdown table of the median milliseconds per step and the ratio.
A timm model name after ``--sortify`` is converted by :func:`timm_sortconv.sortify` with each setting.

Examples::

    python scripts/bench_stride_align.py --model ri_resnet18 --size 128 --batch-size 16
    python scripts/bench_stride_align.py --sortify resnet18 --size 224 --batch-size 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import torch.nn.functional as F

import timm_sortconv
from timm_sortconv.grid import STRIDE_ALIGNS


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Cost of stride_align='centre' against 'corner'")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", default="ri_resnet18", help="registered SC model (default: ri_resnet18)")
    source.add_argument("--sortify", metavar="TIMM_MODEL", help="a timm model converted by sortify instead")
    parser.add_argument("--size", type=int, default=128, help="input side (default: 128)")
    parser.add_argument("--batch-size", "-b", type=int, default=16, help="images per step (default: 16)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (default: 3)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, the two settings taking turns (default: 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args(argv)
    if args.size < 8 or args.batch_size < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--size must be >= 8, and --batch-size, --steps and --rounds >= 1")
    return args


def build(args, stride_align: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.sortify:
        return timm_sortconv.sortify(timm.create_model(args.sortify), stride_align=stride_align)
    return timm.create_model(args.model, stride_align=stride_align)


def make_steps(args, stride_align: str):
    """``(training step, inference step)`` of the model built with ``stride_align``."""
    model = build(args, stride_align)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    channels = model.pretrained_cfg.get("input_size", (3,))[0]
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, channels, args.size, args.size, generator=generator)
    target = torch.randint(0, model.num_classes, (args.batch_size,), generator=generator)

    def train():
        model.train()
        loss = F.cross_entropy(model(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    @torch.no_grad()
    def infer():
        model.eval()
        model(x)

    return train, infer


def main(argv=None) -> None:
    args = parse_args(argv)
    steps = {align: make_steps(args, align) for align in STRIDE_ALIGNS}
    times = {(align, kind): [] for align in STRIDE_ALIGNS for kind in ("train", "infer")}
    for align in STRIDE_ALIGNS:
        for fn in steps[align]:
            for _ in range(args.warmup):
                fn()
    for _ in range(args.rounds):
        for align in STRIDE_ALIGNS:
            for kind, fn in zip(("train", "infer"), steps[align]):
                start = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                times[(align, kind)].append((time.perf_counter() - start) / args.steps * 1000)
    name = f"sortify({args.sortify})" if args.sortify else args.model
    print(f"{name}, {args.batch_size}x{args.size}x{args.size}, {torch.get_num_threads()} threads, median of "
          f"{args.rounds} rounds of {args.steps} steps")
    print("| step | centre ms | corner ms | centre / corner |\n|---|---|---|---|")
    for kind in ("train", "infer"):
        centre, corner = (statistics.median(times[(align, kind)]) for align in ("centre", "corner"))
        print(f"| {kind} | {centre:.1f} | {corner:.1f} | {centre / corner:.3f} |")


if __name__ == "__main__":
    main()
