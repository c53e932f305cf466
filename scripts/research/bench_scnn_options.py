#!/usr/bin/env python3
"""Training-step time of ``scnn_p_rs_7`` with each option of the ablation, relative to the paper's network.

One process builds every variant and times one forward+backward of a batch in turns (``--rounds``
rounds), so that a machine whose speed drifts between minutes slows every variant alike; the minimum over
the rounds is reported, with its ratio to the paper's network.

    python scripts/research/bench_scnn_options.py --batch 50 --threads 1 --rounds 3
"""
import argparse
import time

import torch

from scnn_options import create_model

VARIANTS = {
    "paper": {},
    "padding_mode=replicate": dict(padding_mode="replicate"),
    "blur_sigma=0.7": dict(blur_sigma=0.7),
    "downsample=blur-max": dict(downsample="blur-max"),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    x = torch.randn(args.batch, 1, 28, 28)
    models = {name: create_model("scnn_p_rs_7", **options) for name, options in VARIANTS.items()}
    times = {name: [] for name in models}
    for model in models.values():  # warm-up: builds tables and the extension's plans
        model(x).sum().backward()
    for _ in range(args.rounds):
        for name, model in models.items():
            start = time.perf_counter()
            model(x).sum().backward()
            times[name].append(time.perf_counter() - start)
    paper = min(times["paper"])
    for name, values in times.items():
        print(f"| {name} | {min(values):.3f} s | {min(values) / paper:.2f}x |")


if __name__ == "__main__":
    main()
