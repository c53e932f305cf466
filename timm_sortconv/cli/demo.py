"""The main job: see rotation invariance with your own eyes, on a CPU (README.md gives the time it took).

Trains a small SCNN (``scnn_p_rs_3``: Sorting Convolution with polar sampling and ring sorting) and its
plain-convolution twin (``scnn_baseline_3``, the same parameters) on MNIST, then evaluates both on the
test images rotated by 0, 10, ..., 350 degrees (the paper's MNIST-rot protocol on a slice), prints the
per-angle accuracy table, and writes it as a CSV and a plot. Everything goes under ``--output``, with
``run.json``: the demo's arguments, the images it trained on and swept (counted on the data sets the steps read),
what it ran on (the CPU, the SC kernel's instruction-set level, PyTorch's level and threads, the logical CPUs), how
long it took (``seconds``, from its start to its checks) under what load (the 1-minute load average before and
after, where the system reports one) and its checks (``scripts/docs.py --record-demo`` stores the run with them, so
the time README.md gives is the one a run measured).

With no ``--data-dir`` it uses the MNIST sample that ships in the package (6,000 training and 500 test
images, :func:`timm_sortconv.data.mnist_sample_dir`), so it needs no data folder and no network; with
``--data-dir`` it reads a full MNIST folder and trains on a seeded ``--train-samples`` slice of it.

At its end the demo prints checks that say whether the run is right whatever the CPU (:func:`check_sweep`; they go
into ``run.json`` too), one line each:

* **quarter turns**: SC gets the same images right at 0, 90, 180 and 270 degrees, since a quarter turn permutes
  its samples exactly; this holds for any run of the demo, on any CPU.
* **SC above plain**: SC's mean over the angles is at least :data:`MIN_MARGIN` points above the plain twin's.
* **expected range**: SC's mean lies in :data:`EXPECTED_SC_MEAN`, the range README.md quotes.

The last two are calibrated on the default run (the options of :data:`CALIBRATED_ON` at their defaults) and are
skipped, saying so, for others. A failed quarter turn or margin means the run is wrong on any CPU: the demo then
exits with status 1. A mean outside the range, with the other two passing, is a sound run on a CPU that moves one
epoch's result further than the CPUs measured: a warning, and status 0.

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
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..data import cap_samples, create_dataset
from ..data.mnist import find_mnist_folder, mnist_sample_dir
from ..invariance import PerAngle
from . import run
from . import train as train_tool
from . import validate as validate_tool

# The checks of a run (check_sweep). Quarter turns permute SC's samples exactly, so its correct images at these
# angles are the same on any CPU.
QUARTER_TURNS = (0.0, 90.0, 180.0, 270.0)
# The default run's SC mean over 36 angles lies this far above the plain twin's on every CPU measured (README.md's
# demo block has the figures, tests/test_demo.py checks the stored ones against these constants): the plain network
# collapses off upright, SC does not; without its invariance SC would sit near the plain network.
MIN_MARGIN = 25.0
# SC's mean over 36 angles (%) in the default run: the CPUs measured, with room for CPUs not measured, whose
# libraries end the one epoch at other weights.
EXPECTED_SC_MEAN = (74.0, 82.0)
# The options whose defaults make the default run, the one MIN_MARGIN and EXPECTED_SC_MEAN are calibrated on.
CALIBRATED_ON = ("data_dir", "kernel_size", "train_samples", "samples")

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


def step(tool, script: str, argv: Sequence[str]) -> Tuple[float, object]:
    """Runs a tool in this process, printed as the command that does the same; returns its seconds and what its
    ``main`` returned."""
    print("\n$ python " + " ".join([f"scripts/{script}", *argv]), flush=True)
    start = time.time()
    result = tool.main(list(argv))
    return time.time() - start, result


@dataclass(frozen=True)
class Check:
    """One check of a run: its name, its verdict (``PASS``, ``FAIL``, ``WARN`` or ``SKIP``) and what it found."""

    name: str
    verdict: str
    detail: str

    def __str__(self) -> str:
        return f"{self.verdict:<4}  {self.name}: {self.detail}"


def _mean(per_angle: PerAngle) -> float:
    return sum(per_angle.values()) / len(per_angle)


def default_run() -> str:
    """The run the margin and the range are calibrated on, in words: the options of :data:`CALIBRATED_ON` at their
    defaults."""
    options = [f"--{name.replace('_', '-')} {parser.get_default(name)}" for name in CALIBRATED_ON if name != "data_dir"]
    return f"the default run ({', '.join(options)}, the MNIST sample in the package)"


def is_default_run(args: argparse.Namespace) -> bool:
    return all(getattr(args, name) == parser.get_default(name) for name in CALIBRATED_ON)


def check_sweep(results: Mapping[str, PerAngle], sc: str, plain: str, images: int,
                calibrated: bool = True) -> List[Check]:
    """The checks that say whether a demo run is right whatever the CPU (the module's docstring lists them).

    Args:
        results: top-1 accuracy (%) by angle (degrees) of each model, as ``scripts/validate.py`` returns and writes
            them; the angles include :data:`QUARTER_TURNS`.
        sc, plain: the labels of the SC model and of its plain twin in ``results``.
        images: the images swept at each angle (the accuracies are counts of them).
        calibrated: whether the run is the one :data:`MIN_MARGIN` and :data:`EXPECTED_SC_MEAN` hold for
            (:func:`is_default_run`); if not, those two checks are ``SKIP``.

    Returns:
        The quarter-turn, margin and range checks, in that order.
    """
    missing = [angle for angle in QUARTER_TURNS if angle not in results[sc]]
    if missing:
        raise ValueError(f"the sweep of {sc} has no {', '.join(f'{a:g}' for a in missing)} degrees; the checks need "
                         f"the quarter turns {', '.join(f'{a:g}' for a in QUARTER_TURNS)}")
    correct = [round(results[sc][angle] * images / 100) for angle in QUARTER_TURNS]
    turns = ", ".join(f"{a:g}" for a in QUARTER_TURNS[:-1]) + f" and {QUARTER_TURNS[-1]:g} degrees"
    if len(set(correct)) == 1:
        quarter = Check("quarter turns", "PASS", f"{sc} got the same {correct[0]} of {images} images right at {turns}: "
                        "SC is exactly invariant to quarter turns, on any CPU")
    else:
        quarter = Check("quarter turns", "FAIL", f"{sc} got {', '.join(map(str, correct))} of {images} images right "
                        f"at {turns}, where SC gets the same count at each on any CPU: SC is not computed right "
                        "here (python -m timm_sortconv.check --quick compares every path with the reference; please "
                        "report its output)")
    sc_mean, plain_mean = _mean(results[sc]), _mean(results[plain])
    means = (f"SC's mean over {len(results[sc])} angles is {sc_mean:.2f}%, the plain {plain}'s {plain_mean:.2f}%")
    low, high = EXPECTED_SC_MEAN
    if not calibrated:
        return [quarter, Check("SC above plain", "SKIP", f"not checked: calibrated on {default_run()}; {means}"),
                Check("expected range", "SKIP", "not checked: calibrated on the default run too")]
    gap = sc_mean - plain_mean
    if gap >= MIN_MARGIN:
        margin = Check("SC above plain", "PASS", f"{means}: {gap:.2f} points above (at least {MIN_MARGIN:g} expected)")
    else:
        margin = Check("SC above plain", "FAIL", f"{means}: {gap:.2f} points apart, where a right run is at least "
                       f"{MIN_MARGIN:g} above on any CPU: SC did not learn to ignore rotations in this run")
    if low <= sc_mean <= high:
        expected = Check("expected range", "PASS", f"SC's mean {sc_mean:.2f}% lies in {low:g}-{high:g}%, the range "
                         "README.md gives")
    else:
        expected = Check("expected range", "WARN", f"SC's mean {sc_mean:.2f}% lies outside {low:g}-{high:g}%, the "
                         "range README.md gives from the CPUs measured; with the checks above passing the run is "
                         "right, and this CPU's libraries end the epoch further off (please report the figure with "
                         "your CPU model)")
    return [quarter, margin, expected]


def machine() -> Dict[str, object]:
    """What the run ran on, for run.json: the CPU's model, the SC kernel's instruction-set level (``None``: the
    kernel is not built and SC ran on the reference path), PyTorch's own level and its threads."""
    import torch

    from ..check import cpu_model
    from ..ops import cpu_backend

    return dict(cpu=cpu_model(), kernel_isa=cpu_backend.cpu_isa() if cpu_backend.load_extension() else None,
                torch_capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads(),
                logical_cpus=os.cpu_count())


def load_average() -> Optional[float]:
    """The 1-minute load average, or None where the system reports none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    """Runs the demo (see ``--help``); returns the seconds each step took, or exits with status 1 after printing the
    checks if one failed."""
    args = parser.parse_args(argv)
    start, load_before = time.perf_counter(), load_average()
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
        timings[f"train {model}"], _ = step(train_tool, "train.py", [
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
    timings["rotation sweep"], results = step(validate_tool, "validate.py", sweep)
    # train.py's training split ("train") capped as it caps it; the sweep's images as validate.py builds them
    train_images = len(cap_samples(create_dataset("sortconv/mnist", root=data_dir, split="train"), args.train_samples))
    test_images = validate_tool.build_sweep(validate_tool.parser.parse_args(sweep), channels=1).num_images
    checks = check_sweep(results, sc, baseline, test_images, calibrated=is_default_run(args))
    elapsed = time.perf_counter() - start
    with open(os.path.join(args.output, "run.json"), "w") as f:
        json.dump(dict(arguments=list(sys.argv[1:] if argv is None else argv), train_images=train_images,
                       test_images=test_images, machine=machine(), seconds=round(elapsed, 1),
                       load_average=[load_before, load_average()], checks=[asdict(c) for c in checks]), f, indent=1)
    print("\n" + "  ".join(f"{name}: {seconds:.0f} s" for name, seconds in timings.items())
          + f"  (the demo: {elapsed / 60:.1f} min)")
    print(f"{sc} uses Sorting Convolution, {baseline} plain convolutions with the same parameters.")
    print(f"Per-angle accuracies: {csv_path}; plot: {plot_path}")
    print("\nChecks (a right run passes them on any CPU):")
    for check in checks:
        print(f"  {check}")
    failed = [check.name for check in checks if check.verdict == "FAIL"]
    if failed:
        print(f"The run is wrong: {' and '.join(failed)} failed (exit status 1).")
    else:
        print("The run is right" + (" (the warning compares its figure with the CPUs measured)."
                                    if any(c.verdict == "WARN" for c in checks) else "."))
    sys.stdout.flush()
    if failed:
        raise SystemExit(1)
    return timings


if __name__ == "__main__":
    run(main)
