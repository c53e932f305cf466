"""The main job: see rotation invariance with your own eyes, on a CPU (README.md gives the time it took).

Trains a small SCNN (``scnn_p_rs_3``: Sorting Convolution with polar sampling and ring sorting) and its
plain-convolution twin (``scnn_baseline_3``, the same parameters) on MNIST, then evaluates both on the
test images rotated by 0, 10, ..., 350 degrees (the paper's MNIST-rot protocol on a slice), prints the
per-angle accuracy table, and writes it as a CSV and a plot. Everything goes under ``--output``, with
``run.json``: the demo's arguments and the images it trained on and swept, counted on the data sets the steps
read (``scripts/docs.py --record-demo`` stores the run with them).

With no ``--data-dir`` it uses the MNIST sample that ships in the package (6,000 training and 500 test
images, :func:`timm_sortconv.data.mnist_sample_dir`), so it needs no data folder and no network; with
``--data-dir`` it reads a full MNIST folder and trains on a seeded ``--train-samples`` slice of it.

The steps are the package's own tools, run in this process and printed as commands you could run
yourself::

    scripts/train.py    --model scnn_baseline_3 ...
    scripts/train.py    --model scnn_p_rs_3 ...
    scripts/validate.py --model scnn_p_rs_3 --baseline-model scnn_baseline_3 --rotations 0:360:10 ...

The schedule (one epoch of 5,000 images, batch 20, Adam at 2e-3 with a cosine decay to zero over the
updates) is far shorter than the paper's 100 epochs (``scripts/configs/mnist_scnn.yaml``); the decay to
zero lets BatchNorm's running statistics settle on the final weights of such a short run. Run it again
after an interruption and the training resumes where it stopped.

Examples::

    python scripts/demo.py
    python scripts/demo.py --data-dir DATA/mnist --output output/demo-full
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, Optional, Sequence

from ..data import cap_samples, create_dataset
from ..data.mnist import find_mnist_folder, mnist_sample_dir
from . import run
from . import train as train_tool
from . import validate as validate_tool

parser = argparse.ArgumentParser(prog="scripts/demo.py",
                                 description="Train an SCNN and its plain twin on MNIST, then sweep rotations")
parser.add_argument("--data-dir", default=None, metavar="DIR",
                    help="a folder with the four MNIST IDX files (default: the sample shipped in the package)")
parser.add_argument("--output", default=os.path.join("output", "demo"), metavar="DIR",
                    help="where the runs, the CSV and the plot go (default: output/demo)")
parser.add_argument("--kernel-size", type=int, default=3, choices=(3, 5, 7), help="K of scnn_p_rs_K (default: 3)")
parser.add_argument("--train-samples", type=int, default=5000, metavar="N", help="training images (default: 5000)")
parser.add_argument("--samples", type=int, default=500, metavar="N", help="test images swept (default: 500)")
parser.add_argument("--workers", "-j", type=int, default=0, metavar="N", help="data loading processes (default: 0)")
parser.add_argument("--dataset-download", action="store_true",
                    help="download MNIST into --data-dir if the files are missing (needs a network)")


def has_checkpoint(run_dir: str) -> bool:
    return os.path.isdir(run_dir) and any(name == "last.pth.tar" or name.startswith("recovery-")
                                          for name in os.listdir(run_dir))


def step(tool, script: str, argv: Sequence[str]) -> float:
    """Runs a tool in this process, printed as the command that does the same; returns its seconds."""
    print("\n$ python " + " ".join([f"scripts/{script}", *argv]), flush=True)
    start = time.time()
    tool.main(list(argv))
    return time.time() - start


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Runs the demo (see ``--help``); returns the seconds each step took."""
    args = parser.parse_args(argv)
    if args.data_dir is None:
        if args.dataset_download:
            parser.error("--dataset-download needs --data-dir (the sample shipped in the package needs no download)")
        data_dir = str(mnist_sample_dir())
    else:
        data_dir = args.data_dir
        if not args.dataset_download:
            find_mnist_folder(data_dir)  # a missing or incomplete folder: one clear error before any work
    models = (f"scnn_baseline_{args.kernel_size}", f"scnn_p_rs_{args.kernel_size}")
    data = ["--dataset", "sortconv/mnist", "--data-dir", data_dir, "-j", str(args.workers)]
    if args.dataset_download:
        data.append("--dataset-download")
    timings = {}
    for model in models:
        run_dir = os.path.join(args.output, model)
        resume = ["--resume", run_dir] if has_checkpoint(run_dir) else []
        timings[f"train {model}"] = step(train_tool, "train.py", [
            "--model", model, *data, "--train-samples", str(args.train_samples), "--val-samples", "1000",
            "--epochs", "1", "-b", "20", "-vb", "100", "--lr", "2e-3", "--sched", "cosine", "--sched-on-updates",
            "--log-interval", "50", "--output", args.output, "--experiment", model, *resume])
    sc, baseline = models[1], models[0]
    csv_path = os.path.join(args.output, "rotation_sweep.csv")
    plot_path = os.path.join(args.output, "rotation_sweep.png")
    sweep = [*data, "--split", "test", "--model", sc, "--checkpoint", os.path.join(args.output, sc, "model_best.pth.tar"),
             "--baseline-model", baseline, "--baseline-checkpoint",
             os.path.join(args.output, baseline, "model_best.pth.tar"), "--rotations", "0:360:10", "--samples",
             str(args.samples), "--results-csv", csv_path, "--plot", plot_path]
    timings["rotation sweep"] = step(validate_tool, "validate.py", sweep)
    # train.py's training split ("train") capped as it caps it; the sweep's images as validate.py builds them
    train_images = len(cap_samples(create_dataset("sortconv/mnist", root=data_dir, split="train"), args.train_samples))
    test_images = validate_tool.build_sweep(validate_tool.parser.parse_args(sweep), channels=1).num_images
    with open(os.path.join(args.output, "run.json"), "w") as f:
        json.dump(dict(arguments=list(sys.argv[1:] if argv is None else argv), train_images=train_images,
                       test_images=test_images), f, indent=1)
    print("\n" + "  ".join(f"{name}: {seconds:.0f} s" for name, seconds in timings.items())
          + f"  (total {sum(timings.values()):.0f} s)")
    print(f"{sc} uses Sorting Convolution, {baseline} plain convolutions with the same parameters.")
    print(f"Per-angle accuracies: {csv_path}; plot: {plot_path}")
    sys.stdout.flush()
    return timings


if __name__ == "__main__":
    run(main)
