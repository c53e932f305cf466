#!/usr/bin/env python3
"""Evaluate a model, and optionally a baseline beside it, over a rotation sweep of a data set.

The model comes from ``--model`` with ``--checkpoint`` (a training checkpoint or weights file),
``--pretrained`` (the entrypoint's published weights) or a ``hf-hub:ORG/NAME`` / ``local-dir:PATH``
name. ``--rotations 0:360:10`` rotates every image of the split by each angle (bilinear about the
centre, zero fill: :class:`timm_sortconv.data.RotatedDataset`), which on the MNIST test set is the
paper's MNIST-rot. Prints a per-angle top-1 accuracy table and the mean over angles, writes
``--results-csv`` (one row per angle: ``angle`` and one accuracy column per model) and ``--plot``
(accuracy against angle, Cartesian and polar).

Example (MNIST-rot on 500 test images, an SCNN against its plain twin)::

    python scripts/validate.py --dataset sortconv/mnist --split test --data-dir DATA/mnist \\
        --model scnn_p_rs_3 --checkpoint output/train/p_rs_3/model_best.pth.tar \\
        --baseline-model scnn_baseline_3 --baseline-checkpoint output/train/baseline_3/model_best.pth.tar \\
        --rotations 0:360:10 --samples 500 --results-csv sweep.csv --plot sweep.png
"""
import argparse
import csv
import logging
import os
import time
from contextlib import nullcontext
from functools import partial
from typing import Dict, List

import torch
from timm import utils
from timm.data import create_loader
from timm.models import create_model

import timm_sortconv.models  # noqa: F401  (registers the SC models with timm)
from timm_sortconv.data import (
    DatasetLayoutError,
    RotatedDataset,
    cap_samples,
    create_dataset,
    is_sortconv_dataset,
    parse_rotations,
    resolve_data_config,
)

_logger = logging.getLogger("validate")

parser = argparse.ArgumentParser(description="Evaluate a model (and a baseline) over a rotation sweep")
group = parser.add_argument_group("Dataset")
group.add_argument("--data-dir", metavar="DIR", help="data folder")
group.add_argument("--dataset", metavar="NAME", default="",
                   help="sortconv/mnist, sortconv/mnist_rot, sortconv/outex12, sortconv/nwpu45, or a timm dataset "
                        "name (empty: image folder)")
group.add_argument("--split", metavar="NAME", default="validation", help="split to evaluate (default: validation)")
group.add_argument("--dataset-download", action="store_true", default=False, help="download the data set if missing")
group.add_argument("--class-map", default="", type=str, metavar="FILENAME", help="class map for image folders")
group.add_argument("--rotations", default=None, metavar="SPEC",
                   help="angles in degrees: START:STOP:STEP (e.g. 0:360:10) or a list (e.g. 0,45,90); default: none")
group.add_argument("--round-trip", action="store_true", default=False,
                   help="rotate each image by the angle and back (upright, resampled twice): a control that "
                        "tells how much of a sweep's loss is resampling rather than orientation")
group.add_argument("--samples", type=int, default=None, metavar="N",
                   help="evaluate a seeded random N-image slice of the split (each image at every angle)")

group = parser.add_argument_group("Models")
group.add_argument("--model", required=True, metavar="MODEL", help="model name, hf-hub:ORG/NAME or local-dir:PATH")
group.add_argument("--checkpoint", default="", metavar="PATH", help="weights of --model")
group.add_argument("--pretrained", action="store_true", default=False, help="load --model's published weights")
group.add_argument("--label", default="", metavar="NAME", help="name of --model in the table, CSV and plot (default: "
                   "the model name)")
group.add_argument("--baseline-model", default="", metavar="MODEL", help="a second model shown beside --model")
group.add_argument("--baseline-checkpoint", default="", metavar="PATH", help="weights of --baseline-model")
group.add_argument("--baseline-pretrained", action="store_true", default=False,
                   help="load --baseline-model's published weights")
group.add_argument("--model-kwargs", nargs="*", default={}, action=utils.ParseKwargs,
                   help="extra create_model arguments for both models, e.g. sampling=polar")
group.add_argument("--num-classes", type=int, default=None, metavar="N", help="classes (model default if unset)")
group.add_argument("--in-chans", type=int, default=None, metavar="N", help="input channels (model default if unset)")
group.add_argument("--input-size", default=None, nargs=3, type=int, metavar="N N N", help="input C H W")
group.add_argument("--crop-pct", default=None, type=float, metavar="N",
                   help="centre crop fraction (1.0 for sortconv/ data sets, else the model's)")
group.add_argument("--mean", type=float, nargs="+", default=None, metavar="MEAN", help="normalisation mean")
group.add_argument("--std", type=float, nargs="+", default=None, metavar="STD", help="normalisation std")
group.add_argument("--interpolation", default="", type=str, metavar="NAME", help="resize interpolation")

group = parser.add_argument_group("Run")
group.add_argument("-b", "--batch-size", type=int, default=100, metavar="N", help="batch size (default: 100)")
group.add_argument("-j", "--workers", type=int, default=2, metavar="N", help="data loading processes")
group.add_argument("--seed", type=int, default=42, metavar="S", help="seed of the --samples slice")
group.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=str, help="device")
group.add_argument("--amp", action="store_true", default=False, help="automatic mixed precision")
group.add_argument("--amp-dtype", default="float16", type=str, help="AMP dtype: float16 or bfloat16")
group.add_argument("--channels-last", action="store_true", default=False, help="channels_last memory layout")
group.add_argument("--no-prefetcher", action="store_true", default=False, help="do not use timm's prefetcher")
group.add_argument("--results-csv", default="", metavar="FILE", help="write the per-angle accuracies here")
group.add_argument("--plot", default="", metavar="PNG", help="plot accuracy against angle here")
group.add_argument("--compare-csv", nargs="+", default=[], metavar="FILE",
                   help="per-angle accuracies an earlier --results-csv wrote (same angles and images), shown "
                        "beside the models evaluated now in the table and plot, not re-evaluated")


def build_model(name: str, checkpoint: str, pretrained: bool, args) -> torch.nn.Module:
    """``timm.create_model`` with the weights asked for; hub and local-folder names load their weights."""
    from_folder = name.startswith(("hf-hub:", "local-dir:"))
    if checkpoint and not os.path.isfile(checkpoint):
        raise SystemExit(f"checkpoint {checkpoint} does not exist")
    kwargs = dict(args.model_kwargs)
    if args.num_classes is not None:
        kwargs["num_classes"] = args.num_classes
    in_chans = args.in_chans if args.in_chans is not None else (args.input_size[0] if args.input_size else None)
    if in_chans is not None:
        kwargs["in_chans"] = in_chans
    if not (checkpoint or pretrained or from_folder):
        _logger.warning(f"{name}: no weights given (--checkpoint, --pretrained, hf-hub: or local-dir:), "
                        "evaluating it at random initialisation")
    model = create_model(name, pretrained=pretrained or from_folder, checkpoint_path=checkpoint, **kwargs)
    return model.eval()


def build_sweep(args, channels: int) -> RotatedDataset:
    """The split, capped by ``--samples``, at every angle of ``--rotations`` (angle 0 alone without it)."""
    options = dict(download=args.dataset_download)
    if not is_sortconv_dataset(args.dataset):
        options.update(class_map=args.class_map or None, input_img_mode="L" if channels == 1 else "RGB")
    dataset = create_dataset(args.dataset, root=args.data_dir, split=args.split, **options)
    if isinstance(dataset, RotatedDataset):  # sortconv/mnist_rot: its angles unless --rotations says otherwise
        angles = parse_rotations(args.rotations) if args.rotations else dataset.angles
        base = dataset.base
    else:
        angles = parse_rotations(args.rotations) if args.rotations else [0.0]
        base = dataset
    return RotatedDataset(cap_samples(base, args.samples, seed=args.seed), angles, round_trip=args.round_trip)


@torch.inference_mode()
def evaluate_sweep(model, data_config: dict, sweep: RotatedDataset, args, device, label: str) -> Dict[float, float]:
    """Top-1 accuracy (%) of ``model`` at each angle of ``sweep``."""
    loader = create_loader(
        sweep,
        input_size=data_config["input_size"],
        batch_size=args.batch_size,
        is_training=False,
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
        crop_pct=data_config["crop_pct"],
        num_workers=args.workers,
        device=device,
        use_prefetcher=not args.no_prefetcher,
    )
    amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
    amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype) if args.amp else nullcontext
    model.to(device)
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    correct: List[torch.Tensor] = []
    start = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        if args.no_prefetcher:
            input, target = input.to(device), target.to(device)
        if args.channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        with amp_autocast():
            output = model(input)
        correct.append((output.argmax(dim=-1) == target).cpu())
        if (batch_idx + 1) % 50 == 0 or batch_idx + 1 == len(loader):
            _logger.info(f"{label}: [{batch_idx + 1:>4d}/{len(loader)}] ({time.time() - start:.1f}s)")
    per_angle = torch.cat(correct).view(len(sweep.angles), sweep.num_images).double().mean(dim=1) * 100
    return {angle: accuracy.item() for angle, accuracy in zip(sweep.angles, per_angle)}


def format_table(results: Dict[str, Dict[float, float]]) -> str:
    labels = list(results)
    angles = list(next(iter(results.values())))
    width = max(10, *(len(label) for label in labels))
    lines = ["angle".rjust(7) + "".join(label.rjust(width + 2) for label in labels)]
    for angle in angles:
        lines.append(f"{angle:7g}" + "".join(f"{results[label][angle]:{width + 2}.2f}" for label in labels))
    lines.append("mean".rjust(7) + "".join(f"{sum(results[label].values()) / len(angles):{width + 2}.2f}"
                                           for label in labels))
    return "\n".join(lines)


def write_csv(path: str, results: Dict[str, Dict[float, float]]) -> None:
    labels = list(results)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["angle"] + labels)
        for angle in next(iter(results.values())):
            writer.writerow([f"{angle:g}"] + [f"{results[label][angle]:.4f}" for label in labels])


def plot_sweep(path: str, results: Dict[str, Dict[float, float]], title: str) -> None:
    """Accuracy against angle: a Cartesian panel and a polar panel (angle as the polar angle)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'timm-sortconv[plot]'") from None
    import math

    fig = plt.figure(figsize=(11, 4.8))
    cartesian = fig.add_subplot(1, 2, 1)
    polar = fig.add_subplot(1, 2, 2, projection="polar")
    for label, per_angle in results.items():
        angles, accuracies = list(per_angle), list(per_angle.values())
        mean = sum(accuracies) / len(accuracies)
        cartesian.plot(angles, accuracies, marker="o", markersize=3, label=f"{label} (mean {mean:.2f}%)")
        # Close the curve only when the sweep goes all the way round (its next step would be 360 degrees on).
        full_circle = len(angles) > 1 and angles[-1] + (angles[1] - angles[0]) - angles[0] >= 360
        if full_circle:
            angles, accuracies = angles + [angles[0] + 360], accuracies + accuracies[:1]
        polar.plot([math.radians(a) for a in angles], accuracies, marker="o", markersize=3, label=label)
    cartesian.set_xlabel("rotation angle (degrees)")
    cartesian.set_ylabel("top-1 accuracy (%)")
    cartesian.set_ylim(0, 100)
    cartesian.grid(True, alpha=0.3)
    cartesian.legend(loc="lower left", fontsize=8)
    polar.set_ylim(0, 100)
    polar.set_title("accuracy (%) by angle", fontsize=10)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_csv(path: str) -> Dict[str, Dict[float, float]]:
    """The per-angle accuracies ``write_csv`` wrote, by label."""
    if not os.path.isfile(path):
        raise SystemExit(f"--compare-csv {path} does not exist")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or len(rows[0]) < 2 or rows[0][0] != "angle":
        raise SystemExit(f"--compare-csv {path} is not a per-angle CSV written by --results-csv "
                         "(header 'angle,<label>,...', one row per angle)")
    try:
        return {label: {float(row[0]): float(row[col]) for row in rows[1:]}
                for col, label in enumerate(rows[0][1:], start=1)}
    except (ValueError, IndexError) as e:
        raise SystemExit(f"--compare-csv {path}: unreadable row ({e})") from None


def add_compared(results: Dict[str, Dict[float, float]], paths: List[str]) -> None:
    """Adds the curves of ``paths`` to ``results``; their angles must be those just evaluated."""
    angles = list(next(iter(results.values())))
    for path in paths:
        for label, per_angle in read_csv(path).items():
            if list(per_angle) != angles:
                raise SystemExit(f"--compare-csv {path} has angles {list(per_angle)}, not the {angles} evaluated now")
            name, n = label, 1
            while name in results:
                n += 1
                name = f"{label} ({n})"
            results[name] = per_angle


def main(argv=None):
    args = parser.parse_args(argv)
    if args.baseline_checkpoint and not args.baseline_model:
        parser.error("--baseline-checkpoint needs --baseline-model")
    device = torch.device(args.device)
    label = args.label or args.model
    models = {label: build_model(args.model, args.checkpoint, args.pretrained, args)}
    if args.baseline_model:
        label = args.baseline_model if args.baseline_model not in models else f"{args.baseline_model} (baseline)"
        models[label] = build_model(args.baseline_model, args.baseline_checkpoint, args.baseline_pretrained, args)
    data_configs = {label: resolve_data_config(vars(args), model=model, dataset=args.dataset)
                    for label, model in models.items()}
    sweep = build_sweep(args, channels=next(iter(data_configs.values()))["input_size"][0])
    _logger.info(f"Evaluating {sweep.num_images} images x {len(sweep.angles)} angles of {args.dataset or 'folder'} "
                 f"split {args.split!r}")
    results: Dict[str, Dict[float, float]] = {
        label: evaluate_sweep(model, data_configs[label], sweep, args, device, label)
        for label, model in models.items()
    }
    shown = dict(results)
    add_compared(shown, args.compare_csv)

    print(format_table(shown))
    if args.results_csv:  # the models evaluated now; --compare-csv curves stay in their own files
        write_csv(args.results_csv, results)
        _logger.info(f"Wrote {args.results_csv}")
    if args.plot:
        title = (f"{args.dataset or 'image folder'} ({args.split}), {sweep.num_images} images x "
                 f"{len(sweep.angles)} angles" + (", rotated there and back" if args.round_trip else ""))
        plot_sweep(args.plot, shown, title)
        _logger.info(f"Wrote {args.plot}")
    return results


if __name__ == "__main__":
    utils.setup_default_logging()
    try:
        main()
    except DatasetLayoutError as error:  # a data folder problem is the user's to fix: the message, not a traceback
        raise SystemExit(f"error: {error}") from None
