#!/usr/bin/env python3
"""See rotation invariance with your own eyes in a few minutes on a CPU.

Trains a small SCNN (``scnn_p_rs_3``: polar sampling, ring sorting) and its plain-convolution twin
(``scnn_baseline_3``, the same parameters) on a slice of real MNIST, then evaluates both on the test
images rotated by 0, 10, ..., 350 degrees (the paper's MNIST-rot protocol on a slice), prints the
per-angle accuracy table and plots it. It runs three ordinary commands, printed as they start::

    scripts/train.py    --model scnn_baseline_3 ...
    scripts/train.py    --model scnn_p_rs_3 ...
    scripts/validate.py --model scnn_p_rs_3 --baseline-model scnn_baseline_3 --rotations 0:360:10 ...

The short schedule (one epoch of 5,000 images, batch 20, Adam at 2e-3 with a cosine decay to zero
over the updates) is not the paper's 100-epoch protocol (``scripts/configs/mnist_scnn.yaml``); the
decay to zero lets BatchNorm's running statistics settle on the final weights of such a short run.
Run it again after an interruption and the training resumes where it stopped.

Example::

    python scripts/demo.py --data-dir DATA/mnist
"""
import argparse
import os
import subprocess
import sys
import time

SCRIPTS = os.path.dirname(os.path.abspath(__file__))

parser = argparse.ArgumentParser(description="Train an SCNN and its baseline on MNIST, sweep rotations")
parser.add_argument("--data-dir", required=True, metavar="DIR", help="folder with the MNIST IDX files (see README)")
parser.add_argument("--output", default="output/demo", metavar="DIR", help="where runs, CSV and plot go")
parser.add_argument("--kernel-size", type=int, default=3, choices=(3, 5, 7), help="K of scnn_p_rs_K (default: 3)")
parser.add_argument("--train-samples", type=int, default=5000, metavar="N", help="training images (default: 5000)")
parser.add_argument("--samples", type=int, default=500, metavar="N", help="test images swept (default: 500)")
parser.add_argument("--workers", "-j", type=int, default=0, metavar="N", help="data loading processes (default: 0)")
parser.add_argument("--dataset-download", action="store_true", help="download MNIST into --data-dir if missing")


def has_checkpoint(run_dir: str) -> bool:
    return os.path.isdir(run_dir) and any(name == "last.pth.tar" or name.startswith("recovery-")
                                          for name in os.listdir(run_dir))


def run(command):
    print("\n$ " + " ".join(command), flush=True)
    start = time.time()
    subprocess.run(command, check=True)
    return time.time() - start


def main(argv=None):
    args = parser.parse_args(argv)
    models = (f"scnn_baseline_{args.kernel_size}", f"scnn_p_rs_{args.kernel_size}")
    data = ["--dataset", "sortconv/mnist", "--data-dir", args.data_dir, "-j", str(args.workers)]
    if args.dataset_download:
        data.append("--dataset-download")
    timings = {}
    for model in models:
        run_dir = os.path.join(args.output, model)
        resume = ["--resume", run_dir] if has_checkpoint(run_dir) else []
        timings[f"train {model}"] = run([
            sys.executable, os.path.join(SCRIPTS, "train.py"), "--model", model, *data,
            "--train-samples", str(args.train_samples), "--val-samples", "1000", "--epochs", "1",
            "-b", "20", "-vb", "100", "--lr", "2e-3", "--sched", "cosine", "--sched-on-updates",
            "--log-interval", "50", "--output", args.output, "--experiment", model, *resume])
    sc, baseline = models[1], models[0]
    timings["rotation sweep"] = run([
        sys.executable, os.path.join(SCRIPTS, "validate.py"), *data, "--split", "test",
        "--model", sc, "--checkpoint", os.path.join(args.output, sc, "model_best.pth.tar"),
        "--baseline-model", baseline,
        "--baseline-checkpoint", os.path.join(args.output, baseline, "model_best.pth.tar"),
        "--rotations", "0:360:10", "--samples", str(args.samples),
        "--results-csv", os.path.join(args.output, "rotation_sweep.csv"),
        "--plot", os.path.join(args.output, "rotation_sweep.png")])
    print("\n" + "  ".join(f"{step}: {seconds:.0f} s" for step, seconds in timings.items())
          + f"  (total {sum(timings.values()):.0f} s)")
    print(f"Per-angle accuracies: {os.path.join(args.output, 'rotation_sweep.csv')}; "
          f"plot: {os.path.join(args.output, 'rotation_sweep.png')}")


if __name__ == "__main__":
    main()
