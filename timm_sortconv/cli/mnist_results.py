"""One row of RESULTS.md: train an SCNN on MNIST, then measure it on the MNIST test set and on MNIST-rot.

Runs three ordinary commands (in this process), printed as they start, and skips what is already done (a
finished run is not retrained, an interrupted one resumes)::

    scripts/train.py    -c scripts/configs/mnist_scnn_short.yaml --model MODEL ...     -> <runs>/<name>/
    scripts/validate.py --dataset sortconv/mnist --split test ...                      -> MNIST test accuracy
    scripts/validate.py --dataset sortconv/mnist_rot --split test ... --plot           -> MNIST-rot, per angle

and adds the row to the table ``--results`` (a CSV, one row per name: the numbers, the per-angle accuracies and
the commands; :class:`~timm_sortconv.cli.records.RecordTable`), replacing a row of the same name. The sweep's own
files go beside the run: ``<runs>/<name>/mnist_rot.csv`` (accuracy per angle, validate.py's CSV) and
``mnist_rot.png`` (the per-angle plot, with the ``--compare`` rows of the table drawn beside, whose per-angle
accuracies are written there as ``compare-<row>.csv``). MNIST-rot is every
test image of the data folder (MNIST's 10,000; the package's sample has 500) at 0, 10, ..., 350 degrees;
``--rot-samples N`` sweeps a fixed random N of them instead (the same N images for every model with the same
``--seed``). The row records how many images each evaluation read (``mnist_test_images``,
``mnist_rot_images``), counted on the data set validate.py builds, not on the options asked for.
``--table`` prints the Markdown table of every row of ``--results``. Options this tool does not know
go to ``scripts/train.py`` as they are (for instance ``--lr 1e-3``), checked by its parser first, and are
recorded in the row. A finished run is reused only if it was trained with the same settings. The row's
``train_minutes`` is the time its epochs ran (``summary.csv``'s ``train_seconds``, training and validation, pauses
and stops between resumes not counted); for a run whose summary lacks that column, the wall time of its last
training session (from ``args.yaml``, written at each start, to the summary's last line).

Examples::

    python scripts/mnist_results.py --model scnn_p_rs_7 --data-dir DATA/mnist
    python scripts/mnist_results.py --model scnn_p_rs_7 --model-kwargs stride_align=corner --name scnn_p_rs_7-corner \\
        --data-dir DATA/mnist --rot-samples 2000 --compare scnn_p_rs_7
    python scripts/mnist_results.py --table
"""
import argparse
import csv
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from ..invariance import read_sweep_csv, write_sweep_csv
from . import key_value, run
from .records import RecordTable
from . import train as train_tool
from . import validate as validate_tool

# This tool makes the rows of the repository's RESULTS.md: its presets are the clone's scripts/configs/.
REPO = str(Path(__file__).resolve().parents[2])
CONFIGS = os.path.join(REPO, "scripts", "configs")

# The paper's figures (Mo & Zhao 2024, section III-A and Table 1; 100 epochs), (MNIST, MNIST-rot) in %,
# for the models it reports; None where it gives none.
PAPER = {
    "scnn_baseline_7": (99.43, 44.53), "scnn_p_rs_7": (99.04, 95.05), "scnn_p_rs_5": (None, 93.92),
    "scnn_p_rs_3": (None, 88.98), "scnn_s_rs_7": (None, 92.63), "scnn_s_rs_5": (None, 87.60),
}

parser = argparse.ArgumentParser(description="Train an SCNN on MNIST and measure it on MNIST and MNIST-rot")
parser.add_argument("--model", metavar="MODEL", help="registered model, e.g. scnn_p_rs_7")
parser.add_argument("--model-kwargs", nargs="*", default=[], type=key_value, metavar="KEY=VALUE",
                    help="model arguments (scripts/train.py --model-kwargs), e.g. stride_align=corner")
parser.add_argument("--name", default="", help="name of the row, run and files (default: the model name)")
parser.add_argument("--data-dir", metavar="DIR", help="folder with the MNIST IDX files")
parser.add_argument("--config", default=os.path.join(CONFIGS, "mnist_scnn_short.yaml"), metavar="YAML",
                    help="training preset (default: configs/mnist_scnn_short.yaml)")
parser.add_argument("--epochs", type=int, default=None, metavar="N", help="epochs (default: the preset's)")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="training seed and --rot-samples slice seed")
parser.add_argument("--runs", default=os.path.join("output", "mnist"), metavar="DIR", help="training runs go here")
parser.add_argument("--results", default=os.path.join("output", "mnist", "results.csv"), metavar="CSV",
                    help="the table the row is added to (default: output/mnist/results.csv)")
parser.add_argument("--rot-samples", type=int, default=None, metavar="N",
                    help="sweep N random test images instead of all (MNIST: 10,000)")
parser.add_argument("--compare", nargs="+", default=[], metavar="NAME",
                    help="rows of --results to draw beside this one (same --rot-samples and --seed)")
parser.add_argument("--curve", type=int, nargs="+", default=[], metavar="EPOCH",
                    help="also measure the weights after these epochs (kept by train.py --keep-epochs), as a learning "
                         "curve in <runs>/<name>/curve.json and the row; the last epoch on all of MNIST-rot")
parser.add_argument("--curve-samples", type=int, default=2000, metavar="N",
                    help="MNIST-rot images of the curve's points before the last epoch (default: 2000)")
parser.add_argument("-j", "--workers", type=int, default=1, metavar="N", help="data loading processes")
parser.add_argument("--table", action="store_true", help="print the Markdown table of --results and exit")


def run_tool(tool, command):
    """Runs a tool's ``main`` on ``command`` (``[python, script, *argv]``) in this process, printing it first."""
    print("\n$ " + relative(command), flush=True)
    return tool.main(command[2:])


def read_csv(path):
    """The one model's per-angle accuracies in a CSV written by validate.py --results-csv."""
    (per_angle,) = read_sweep_csv(path).values()
    return per_angle


def summary_rows(run_dir):
    path = os.path.join(run_dir, "summary.csv")
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def training_seconds(run_dir, summary) -> float:
    """The seconds the run's epochs ran (the summary's ``train_seconds``), or, where a row lacks them (a run
    begun by an older train.py), the wall time from its last start (``args.yaml``) to its last summary line."""
    if summary and all(row.get("train_seconds") for row in summary):
        return sum(float(row["train_seconds"]) for row in summary)
    return os.path.getmtime(os.path.join(run_dir, "summary.csv")) - os.path.getmtime(os.path.join(run_dir, "args.yaml"))


# train.py options this script sets itself; passing them through would move or redefine the run.
OWN_TRAIN_OPTIONS = ("-c", "--config", "--output", "--experiment", "--resume", "--model", "--data-dir")
# Settings that may differ between a finished run and a request to measure it again.
INCIDENTAL = {"resume", "workers", "log_interval", "recovery_interval", "output", "experiment", "data_dir",
              "config", "checkpoint_hist", "keep_epochs"}


def train_settings(command):
    """The settings ``command`` (a train.py command line) would train with, as train.py's parser resolves
    them; an option train.py does not know (a typo) stops here, before anything runs."""
    import yaml

    _, text = train_tool.parse_args(command[2:])
    return yaml.safe_load(text)


def train(args, train_extra, name, run_dir, epochs):
    """Trains (or resumes) the run unless all its epochs are done; returns the training command."""
    clashing = [a for a in train_extra if a.split("=")[0] in OWN_TRAIN_OPTIONS]
    if clashing:
        parser.error(f"{clashing[0]} is set by this script (the run is <runs>/<name>); use --name, --runs or "
                     "--config instead")
    command = [sys.executable, os.path.join(REPO, "scripts", "train.py"), "-c", args.config, "--model", args.model,
               "--data-dir", args.data_dir, "--seed", str(args.seed), "-j", str(args.workers),
               "--output", args.runs, "--experiment", name, "--log-interval", "200"]
    if args.epochs is not None:
        command += ["--epochs", str(args.epochs)]
    if args.model_kwargs:
        command += ["--model-kwargs", *args.model_kwargs]
    if args.curve:
        command += ["--keep-epochs", *map(str, args.curve)]
    command += train_extra
    wanted = train_settings(command)
    stored_path = os.path.join(run_dir, "args.yaml")
    if os.path.isfile(stored_path):  # an existing run is reused (or resumed) only with the same settings
        import yaml

        with open(stored_path) as f:
            stored = yaml.safe_load(f)
        changed = sorted(k for k in set(wanted) | set(stored)
                         if k not in INCIDENTAL and wanted.get(k) != stored.get(k))
        if changed:
            parser.error(f"{run_dir} was trained with other settings ("
                         + ", ".join(f"{k}: {stored.get(k)!r} there, {wanted.get(k)!r} asked" for k in changed[:4])
                         + "); give this row another --name, or remove that run")
    if len(summary_rows(run_dir)) >= epochs:
        print(f"{run_dir}: all {epochs} epochs done, not retraining")
        return command
    started = any(f == "last.pth.tar" or f.startswith("recovery-") for f in os.listdir(run_dir)) \
        if os.path.isdir(run_dir) else False
    if started:
        update_curve(args, name, run_dir, epochs)  # points kept by an earlier, stopped session of the run
    run_tool(train_tool, command + (["--resume", run_dir] if started else []))
    return command


def preset_epochs(args):
    if args.epochs is not None:
        return args.epochs
    import yaml

    with open(args.config) as f:
        return int(yaml.safe_load(f)["epochs"])


def records(results) -> RecordTable:
    """The table of rows ``--results``: one row per name."""
    return RecordTable(results, key=("name",))


def validate_commands(args, name, checkpoint, sweep, rot_samples, compare=()):
    """The validate.py command lines of a row: MNIST test (its CSV path still to add) and the MNIST-rot sweep of
    ``rot_samples`` images (None: all), with its per-angle CSV and plot as ``<sweep>.csv|png`` and the per-angle
    CSVs ``compare`` drawn beside."""
    common = ["--model", args.model, "--checkpoint", checkpoint, "--data-dir", args.data_dir, "--split", "test",
              "-b", "500", "-j", str(args.workers), "--label", name]
    if args.model_kwargs:
        common += ["--model-kwargs", *args.model_kwargs]
    validate_script = os.path.join(REPO, "scripts", "validate.py")
    mnist = [sys.executable, validate_script, "--dataset", "sortconv/mnist", *common]
    rot = [sys.executable, validate_script, "--dataset", "sortconv/mnist_rot", *common,
           "--results-csv", f"{sweep}.csv", "--plot", f"{sweep}.png"]
    if rot_samples:
        rot += ["--samples", str(rot_samples), "--seed", str(args.seed)]
    if compare:
        rot += ["--compare-csv", *compare]
    return mnist, rot


def images_swept(command) -> int:
    """The images a validate.py command line evaluates at each angle, counted on the sweep validate.py builds for
    it (so a slice larger than the data folder's test set counts the images there are)."""
    return validate_tool.build_sweep(validate_tool.parser.parse_args(command[2:]), channels=1).num_images


def evaluate(args, name, checkpoint, sweep, rot_samples, compare=()):
    """MNIST test accuracy and the MNIST-rot sweep of ``rot_samples`` images (None: all), per-angle CSV and plot
    as ``<sweep>.csv|png`` (the per-angle CSVs ``compare`` drawn beside); returns (mnist %, per-angle %, commands,
    the images each evaluated as ``mnist_test_images`` and ``mnist_rot_images``)."""
    mnist, rot = validate_commands(args, name, checkpoint, sweep, rot_samples, compare)
    mnist_csv = os.path.join(tempfile.mkdtemp(prefix="mnist_results_"), f"{name}.csv")  # one number: in the row
    try:
        run_tool(validate_tool, mnist + ["--results-csv", mnist_csv])
        mnist_accuracy = read_csv(mnist_csv)[0.0]
    finally:
        shutil.rmtree(os.path.dirname(mnist_csv), ignore_errors=True)
    run_tool(validate_tool, rot)
    images = dict(mnist_test_images=images_swept(mnist), mnist_rot_images=images_swept(rot))
    # the MNIST command as recorded prints its table instead of writing the temporary CSV
    return mnist_accuracy, read_csv(f"{sweep}.csv"), [mnist, rot], images


def update_curve(args, name, run_dir, epochs):
    """Measures each ``epoch-<N>.pth.tar`` of ``--curve`` not measured yet, adding it to ``<run_dir>/curve.json``
    (written after each point, so a stopped run keeps what it measured); returns the points, by epoch."""
    path = os.path.join(run_dir, "curve.json")
    points = {}
    if os.path.isfile(path):
        with open(path) as f:
            points = {int(k): v for k, v in json.load(f).items()}
    for epoch in sorted(args.curve):
        checkpoint = os.path.join(run_dir, f"epoch-{epoch}.pth.tar")
        if epoch in points or not os.path.isfile(checkpoint):
            continue
        rot_samples = args.rot_samples if epoch == epochs else args.curve_samples
        curve_dir = os.path.join(run_dir, "curve")
        os.makedirs(curve_dir, exist_ok=True)
        label = f"{name}-epoch{epoch}"
        mnist, per_angle, _, images = evaluate(args, label, checkpoint, os.path.join(curve_dir, label), rot_samples)
        points[epoch] = dict(epoch=epoch, mnist_test_top1=mnist, mnist_rot_top1=sum(per_angle.values()) / len(per_angle),
                             mnist_rot_worst_top1=min(per_angle.values()), mnist_rot_upright_top1=per_angle[0.0],
                             **images)
        with open(path + ".tmp", "w") as f:
            json.dump({str(k): points[k] for k in sorted(points)}, f, indent=1)
        os.replace(path + ".tmp", path)
        print(f"curve: epoch {epoch}: MNIST {mnist:.2f}%  MNIST-rot {points[epoch]['mnist_rot_top1']:.2f}% "
              f"(worst angle {points[epoch]['mnist_rot_worst_top1']:.2f}%; {images['mnist_rot_images']} images x "
              f"{len(per_angle)} angles)", flush=True)
    return points


def check_compared(args) -> list:
    """The ``--compare`` rows of the table; refuses one it lacks, and one swept on other images than this row will
    be: another number of them, or another seed's slice (the whole test set does not depend on the seed)."""
    if not args.compare:
        return []
    ours = images_swept(validate_commands(args, "row", "", "sweep", args.rot_samples)[1])
    whole = images_swept(validate_commands(args, "row", "", "sweep", None)[1])
    table, found = records(args.results), []
    for other in args.compare:
        theirs = table.find(name=other)
        if theirs is None:
            parser.error(f"--compare {other}: {args.results} has no row {other}; run that row first")
        found.append(theirs)
        same = theirs["mnist_rot_images"] == ours and (ours == whole or theirs["seed"] == args.seed)
        if not same:
            parser.error(f"--compare {other} swept {theirs['mnist_rot_images']} images (seed {theirs['seed']}), "
                         f"not {ours} (seed {args.seed}): the curves would not be comparable")
    return found


def relative(command):
    """A command as RESULTS.md shows it: scripts by their repository path, python as ``python``."""
    out = ["python"] + [os.path.relpath(c, REPO) if os.path.isabs(c) and c.startswith(REPO) else c
                        for c in command[1:]]
    return " ".join(out)


def table(results):
    """The Markdown table of every row of the table ``results``."""
    rows = records(results).records()

    def order(row):  # the paper's rows first (baseline, polar before square, ring before global, K down)
        parts = row["model"].split("_")
        variant = "_".join(parts[1:-1])
        rank = ["baseline", "p_rs", "p_gs", "s_rs", "s_gs"]
        return (bool(row["model_kwargs"]), rank.index(variant) if variant in rank else len(rank),
                -int(parts[-1]) if parts[-1].isdigit() else 0, row["name"])

    rows.sort(key=order)
    lines = ["| row | model (kwargs) | epochs | train time | best val | MNIST test | paper | MNIST-rot | paper | "
             "images swept |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kwargs = f" ({' '.join(r['model_kwargs'])})" if r["model_kwargs"] else ""
        paper_mnist, paper_rot = PAPER.get(r["model"], (None, None)) if not r["model_kwargs"] else (None, None)
        paper = lambda v: f"{v:.2f}%" if v is not None else "-"  # noqa: E731
        lines.append(f"| {r['name']} | {r['model']}{kwargs} | {r['epochs']} | {r['train_minutes']:.1f} min | "
                     f"{r['best_val_top1']:.2f}% | {r['mnist_test_top1']:.2f}% | {paper(paper_mnist)} | "
                     f"{r['mnist_rot_top1']:.2f}% | {paper(paper_rot)} | "
                     f"{r['mnist_rot_images']:,} x {len(r['angles'])} |")
    return "\n".join(lines)


def row_name(args) -> str:
    """``--name``, or the model and its ``--model-kwargs`` made into a file name."""
    return args.name or re.sub(r"[^A-Za-z0-9_.]+", "-", "-".join([args.model, *args.model_kwargs])).strip("-")


def main(argv: Optional[Sequence[str]] = None):
    """Trains and measures one row, or prints the table (see ``--help``); returns the row's record."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, train_extra = parser.parse_known_args(argv)
    if os.path.isdir(args.results):  # a folder of JSON rows, as this tool once wrote: refused before any training
        parser.error(f"--results {args.results} is a folder; it names the CSV table of the rows (one row per "
                     f"name), e.g. {os.path.join(args.results, 'results.csv')}")
    if args.table:
        print(table(args.results))
        return None
    if not (args.model and args.data_dir):
        parser.error("--model and --data-dir are needed (or --table)")
    name = row_name(args)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        parser.error(f"--name {name!r}: use letters, digits, '-', '_' and '.', not first (it names files)")
    compared = check_compared(args)
    run_dir = os.path.join(args.runs, name)
    epochs = preset_epochs(args)
    if args.curve and not all(0 < epoch <= epochs for epoch in args.curve):
        parser.error(f"--curve {' '.join(map(str, args.curve))}: epochs run from 1 to {epochs}")
    train_command = train(args, train_extra, name, run_dir, epochs)
    curve = update_curve(args, name, run_dir, epochs)
    summary = summary_rows(run_dir)
    best = max(summary, key=lambda row: float(row["eval_top1"]))
    train_seconds = training_seconds(run_dir, summary)
    start = time.time()
    compare = []
    for other in compared:  # their sweeps, from the table, as validate.py's CSVs beside this row's
        compare.append(os.path.join(run_dir, f"compare-{other['name']}.csv"))
        write_sweep_csv(compare[-1], {other["name"]: dict(zip(other["angles"], other["per_angle_top1"]))})
    mnist, per_angle, eval_commands, images = evaluate(args, name, os.path.join(run_dir, "model_best.pth.tar"),
                                                       os.path.join(run_dir, "mnist_rot"), args.rot_samples, compare)
    record = dict(
        name=name, model=args.model, model_kwargs=args.model_kwargs, train_args=train_extra,
        config=os.path.relpath(args.config, REPO),
        epochs=epochs, seed=args.seed, train_minutes=train_seconds / 60, best_epoch=int(best["epoch"]),
        best_val_top1=float(best["eval_top1"]), mnist_test_top1=mnist, mnist_test_images=images["mnist_test_images"],
        mnist_rot_top1=sum(per_angle.values()) / len(per_angle), mnist_rot_images=images["mnist_rot_images"],
        angles=list(per_angle), per_angle_top1=list(per_angle.values()), eval_minutes=(time.time() - start) / 60,
        curve=[curve[epoch] for epoch in sorted(curve)],
        commands=[relative(train_command)] + [relative(c) for c in eval_commands],
        reproduce=relative([sys.executable, os.path.join(REPO, "scripts", "mnist_results.py"), *argv]),
    )
    records(args.results).put(record)
    print(f"\n{name}: MNIST {mnist:.2f}%  MNIST-rot {record['mnist_rot_top1']:.2f}% "
          f"({record['mnist_rot_images']} images x {len(per_angle)} angles)  -> {args.results}")
    return record


if __name__ == "__main__":
    run(main)
