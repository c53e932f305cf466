#!/usr/bin/env python3
"""Training throughput of a model eager, under ``torch.compile`` and under bfloat16 autocast, in one process.

Each mode builds the same model (same seed) and Adam optimiser and runs training steps (forward,
cross-entropy, backward, step) on a fixed random batch; the modes take turns for ``--rounds`` rounds of
``--steps`` steps each, after warm-up steps (which include the compilation), so a machine that slows
down slows every mode alike. Printed: the median images/s of each mode over the rounds, and each mode's
ratio to eager. The SC layers run their fused CPU kernel in every mode (under ``torch.compile`` the
registered operator calls it; under autocast it computes in float32).

Examples::

    python scripts/bench_compile.py --model scnn_p_rs_7 --batch-size 100
    python scripts/bench_compile.py --model scnn_baseline_7 --batch-size 100 --modes eager compiled
"""
from __future__ import annotations

import argparse
import statistics
import time

import timm
import torch
import torch.nn.functional as F

import timm_sortconv  # noqa: F401  (registers the models)

MODES = ("eager", "compiled", "bf16-autocast")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Training throughput: eager, torch.compile, bfloat16 autocast")
    parser.add_argument("--model", default="scnn_p_rs_7", help="registered model (default: scnn_p_rs_7)")
    parser.add_argument("--batch-size", "-b", type=int, default=100, help="images per step (default: 100)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (default: 5)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, modes taking turns (default: 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="modes to compare")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default: inductor)")
    return parser.parse_args(argv)


def make_step(mode: str, args):
    torch.manual_seed(0)
    model = timm.create_model(args.model).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    forward = torch.compile(model, backend=args.compile_backend) if mode == "compiled" else model
    channels, height, width = model.pretrained_cfg["input_size"]
    x = torch.randn(args.batch_size, channels, height, width)
    target = torch.randint(0, model.num_classes, (args.batch_size,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16-autocast"):
            loss = F.cross_entropy(forward(x), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def main(argv=None):
    args = parse_args(argv)
    steps = {mode: make_step(mode, args) for mode in args.modes}
    for mode, step in steps.items():
        start = time.perf_counter()
        for _ in range(args.warmup):
            step()
        print(f"{mode}: warm-up {time.perf_counter() - start:.1f} s", flush=True)
    rates = {mode: [] for mode in steps}
    for _ in range(args.rounds):
        for mode, step in steps.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            rates[mode].append(args.steps * args.batch_size / (time.perf_counter() - start))
    eager = statistics.median(rates["eager"]) if "eager" in rates else None
    print(f"\n{args.model}, batch {args.batch_size}, {torch.get_num_threads()} threads, median of {args.rounds} "
          f"rounds of {args.steps} steps:")
    for mode, values in rates.items():
        median = statistics.median(values)
        ratio = f"  ({median / eager:.2f}x eager)" if eager else ""
        print(f"  {mode:>14}: {median:8.1f} images/s  (rounds {min(values):.1f}-{max(values):.1f}){ratio}")


if __name__ == "__main__":
    main()
