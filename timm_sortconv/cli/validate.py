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
        --rotations 0:360:10 --samples 500 --results-csv output/sweep.csv --plot output/sweep.png
"""
import argparse
import glob
import logging
import os
from typing import Dict, Optional, Sequence

import torch

from .. import models  # noqa: F401  (registers the SC models with timm)
from ..data import RotatedDataset, cap_samples, create_dataset, is_sortconv_dataset, resolve_data_config
from ..invariance import PerAngle, accuracy_sweep, accuracy_table, plot_sweep, read_sweep_csv, write_sweep_csv
from ..layers import SortConv2d
from ..rotation import parse_rotations
from . import (CommandError, KeyValueArgs, add_data_args, add_input_args, check_input_channels, create_model_or_error,
               key_value, run)

_logger = logging.getLogger("validate")

parser = argparse.ArgumentParser(description="Evaluate a model (and a baseline) over a rotation sweep")
group = parser.add_argument_group("Dataset")
add_data_args(group)
group.add_argument("--split", metavar="NAME", default="validation", help="split to evaluate (default: validation)")
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
group.add_argument("--model-kwargs", nargs="*", default={}, action=KeyValueArgs, type=key_value, metavar="KEY=VALUE",
                   help="extra create_model arguments for both models, e.g. sampling=polar")
add_input_args(group)

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


def build_model(name: str, checkpoint: str, pretrained: bool, args, option: str = "--pretrained") -> torch.nn.Module:
    """``timm.create_model`` with the weights asked for; hub and local-folder names load their weights.
    ``option`` is the flag that asked for pretrained weights, named in the error for a model without them."""
    from_folder = name.startswith(("hf-hub:", "local-dir:"))
    if checkpoint and not os.path.isfile(checkpoint):
        raise CommandError(f"checkpoint {checkpoint} does not exist")
    kwargs = dict(args.model_kwargs)
    if args.num_classes is not None:
        kwargs["num_classes"] = args.num_classes
    in_chans = args.in_chans if args.in_chans is not None else (args.input_size[0] if args.input_size else None)
    if in_chans is not None:
        kwargs["in_chans"] = in_chans
    if not (checkpoint or pretrained or from_folder):
        _logger.warning(f"{name}: no weights given (--checkpoint, --pretrained, hf-hub: or local-dir:), "
                        "evaluating it at random initialisation")
    model = create_model_or_error(name, option, pretrained=pretrained or from_folder, checkpoint_path=checkpoint,
                                  **kwargs)
    return model.eval()


def describe(model: torch.nn.Module) -> str:
    """What computes the model's convolutions, for the plot's legend."""
    variants = sorted({(m.sampling, m.sorting) for m in model.modules() if isinstance(m, SortConv2d)})
    if not variants:
        return "plain convolutions"
    return "Sorting Convolution (" + "; ".join(f"{sampling} sampling, {sorting} sorting"
                                               for sampling, sorting in variants) + ")"


def check_image_folder(dataset: str, data_dir: Optional[str]) -> None:
    """Without ``--dataset`` the data folder is read as an image folder; a folder of MNIST's IDX files (as the
    bundled sample, ``timm_sortconv/data/mnist_sample``) is refused in one line that names the option to add,
    instead of timm's traceback about finding no images."""
    if dataset or not data_dir:
        return
    idx_files = [path for folder in ("", "raw", os.path.join("MNIST", "raw"))
                 for path in glob.glob(os.path.join(glob.escape(data_dir), folder, "*-idx[13]-ubyte*"))]
    if idx_files:
        raise CommandError(f"--data-dir {data_dir} holds MNIST IDX files (e.g. {os.path.basename(idx_files[0])}), "
                           "not an image folder: add --dataset sortconv/mnist (or sortconv/mnist_rot)")


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


def add_compared(results: Dict[str, PerAngle], paths: Sequence[str]) -> None:
    """Adds the curves of ``paths`` to ``results``; their angles must be those just evaluated."""
    angles = list(next(iter(results.values())))
    for path in paths:
        try:
            compared = read_sweep_csv(path)
        except (OSError, ValueError) as error:
            raise CommandError(f"--compare-csv: {error}") from None
        for label, per_angle in compared.items():
            if list(per_angle) != angles:
                raise CommandError(f"--compare-csv {path} has angles {list(per_angle)}, not the {angles} "
                                   "evaluated now")
            name, n = label, 1
            while name in results:
                n += 1
                name = f"{label} ({n})"
            results[name] = per_angle


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, PerAngle]:
    """Evaluates the models of ``argv`` (see ``--help``); returns their per-angle accuracies by label."""
    args = parser.parse_args(argv)
    if args.baseline_checkpoint and not args.baseline_model:
        parser.error("--baseline-checkpoint needs --baseline-model")
    check_image_folder(args.dataset, args.data_dir)
    if args.rotations:
        try:
            parse_rotations(args.rotations)
        except ValueError as error:
            parser.error(f"--rotations: {error}")
    device = torch.device(args.device)
    label = args.label or args.model
    evaluated = {label: build_model(args.model, args.checkpoint, args.pretrained, args)}
    options = {label: f"--model {args.model}"}  # the option that named each model, for the messages
    if args.baseline_model:
        label = args.baseline_model if args.baseline_model not in evaluated else f"{args.baseline_model} (baseline)"
        evaluated[label] = build_model(args.baseline_model, args.baseline_checkpoint, args.baseline_pretrained, args,
                                       "--baseline-pretrained")
        options[label] = f"--baseline-model {args.baseline_model}"
    data_configs = {label: resolve_data_config(vars(args), model=model, dataset=args.dataset)
                    for label, model in evaluated.items()}
    sweep = build_sweep(args, channels=next(iter(data_configs.values()))["input_size"][0])
    for label, option in options.items():
        check_input_channels(sweep, args.dataset, option, data_configs[label], args.input_size is not None)
    _logger.info(f"Evaluating {sweep.num_images} images x {len(sweep.angles)} angles of {args.dataset or 'folder'} "
                 f"split {args.split!r}")
    amp_dtype = (torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16) if args.amp else None
    results: Dict[str, PerAngle] = {
        label: accuracy_sweep(model, sweep, data_configs[label], batch_size=args.batch_size,
                              num_workers=args.workers, device=device, use_prefetcher=not args.no_prefetcher,
                              amp_dtype=amp_dtype, channels_last=args.channels_last, label=label)
        for label, model in evaluated.items()
    }
    shown = dict(results)
    add_compared(shown, args.compare_csv)

    print(accuracy_table(shown))
    for path in (args.results_csv, args.plot):  # e.g. output/sweep.csv on a clone that has no output/ yet
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if args.results_csv:  # the models evaluated now; --compare-csv curves stay in their own files
        write_sweep_csv(args.results_csv, results)
        _logger.info(f"Wrote {args.results_csv}")
    if args.plot:
        title = (f"{args.dataset or 'image folder'} ({args.split}), {sweep.num_images} images x "
                 f"{len(sweep.angles)} angles" + (", rotated there and back" if args.round_trip else ""))
        try:
            plot_sweep(args.plot, shown, title, kinds={label: describe(model) for label, model in evaluated.items()})
        except ImportError as error:
            raise CommandError(str(error)) from None
        _logger.info(f"Wrote {args.plot}")
    return results


if __name__ == "__main__":
    run(main)
