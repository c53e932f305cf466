"""Rotation sweep of timm models at random initialisation: how far the pooled features move with the angle.

No data set and no weights are needed: the images are digit-like strokes drawn from a seed
(:func:`timm_sortconv.data.synthetic_digits`), or the first images of an MNIST IDX file. The table is
:func:`timm_sortconv.invariance.sweep_table`.

``--quarter-turn SIZE ...`` instead measures, for each model and input size, how far its logits are from exact
invariance to a quarter turn (:func:`timm_sortconv.quarter_turn_check`: random images, float64), with the
strided grids of ``--stride-align``; ``--sortify`` converts each (timm or torchvision-style) model first.

Examples::

    python scripts/invariance.py --models scnn_p_rs_7 scnn_baseline_7 --angles 0:360:45
    python scripts/invariance.py --models ri_resnet18 ri_densenet40 --quarter-turn 127 128 --stride-align corner
    python scripts/invariance.py --models resnet18 --sortify --quarter-turn 224 225
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from .. import models  # noqa: F401  (registers the SC models with timm)
from ..data.mnist import read_idx
from ..data.synthetic import synthetic_digits
from ..grid import STRIDE_ALIGNS
from ..invariance import quarter_turn_check, rotation_sweep, sweep_table
from ..rotation import parse_rotations
from . import check_model_name, run

parser = argparse.ArgumentParser(prog="scripts/invariance.py",
                                 description="Rotation sweep of timm models at random initialisation.")
parser.add_argument("--models", nargs="+", default=["scnn_p_rs_7", "scnn_baseline_7"], help="timm model names")
parser.add_argument("--angles", default="0:360:45", help="START:STOP:STEP or a comma list, in degrees")
parser.add_argument("--num-images", type=int, default=16, help="images in the batch")
parser.add_argument("--seed", type=int, default=0, help="seeds the model initialisation and the images")
parser.add_argument("--mnist-images", default=None, metavar="IDX_FILE",
                    help="an MNIST IDX image file (gzipped or not) instead of synthetic digits")
parser.add_argument("--quarter-turn", nargs="+", type=int, default=None, metavar="SIZE",
                    help="instead of the sweep: each model's quarter-turn error at these input sizes (float64)")
parser.add_argument("--stride-align", choices=STRIDE_ALIGNS, default="centre",
                    help="with --quarter-turn: the models' (or sortify's) strided grids (default: centre)")
parser.add_argument("--sortify", action="store_true", help="with --quarter-turn: convert each model with sortify")
parser.add_argument("--search", type=int, default=0, metavar="N",
                    help="with --quarter-turn: look up to N pixels away for the nearest exact sizes (default 0)")


def _own_model(name: str) -> bool:
    """Whether timm's entrypoint ``name`` is one of this package's models."""
    import timm

    return timm.models.model_entrypoint(name).__module__.startswith(f"{__package__.split('.')[0]}.")


def quarter_turn_table(args) -> str:
    """The Markdown table of ``--quarter-turn``."""
    import timm

    from ..sortify import sortify

    lines = ["| model | stride_align | size | quarter-turn error | nearest exact sizes |", "|---|---|---|---|---|"]
    for name in args.models:
        torch.manual_seed(args.seed)
        # This package's models take stride_align themselves (their pooling and plain shortcuts included);
        # other timm models keep PyTorch's grid until sortify converts them.
        model = timm.create_model(name, **({"stride_align": args.stride_align} if _own_model(name) else {}))
        if args.sortify:
            model, label = sortify(model, stride_align=args.stride_align), f"sortify({name})"
        else:
            label = name
        for size in args.quarter_turn:
            check = quarter_turn_check(model, size, search=args.search, batch=1, seed=args.seed)
            nearest = "-" if not args.search else ", ".join(
                str(s) for s in dict.fromkeys((check.below, check.above)) if s is not None) or "none nearby"
            lines.append(f"| {label} | {args.stride_align} | {size} | {check.error:.1e} | {nearest} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prints the sweep table of ``--models`` on digit-like images (see ``--help``)."""
    import timm

    args = parser.parse_args(argv)
    for name in args.models:
        check_model_name(name)
    if args.quarter_turn:
        if min(args.quarter_turn) < 1 or args.search < 0:
            parser.error("--quarter-turn sizes must be >= 1 and --search >= 0")
        plain = [name for name in args.models if not args.sortify and not _own_model(name)]
        if plain:
            verb = "is not an SC model" if len(plain) == 1 else "are not SC models"
            parser.error(f"--models: {', '.join(plain)} {verb}; add --sortify to measure a timm model converted by "
                         "sortify")
        print(quarter_turn_table(args))
        return
    try:
        angles = parse_rotations(args.angles)
    except ValueError as error:
        parser.error(f"--angles: {error}")
    if args.mnist_images:
        pixels = torch.from_numpy(read_idx(args.mnist_images)[:args.num_images].copy())
        images = pixels.unsqueeze(1).float() / 255.0
        source = f"the first {images.shape[0]} images of {args.mnist_images}"
    else:
        images = synthetic_digits(args.num_images, seed=args.seed)
        source = f"{args.num_images} synthetic digits (seed {args.seed})"
    sweeps = {}
    for name in args.models:
        torch.manual_seed(args.seed)
        model = timm.create_model(name, in_chans=images.shape[1])
        sweeps[name] = rotation_sweep(model, images, angles)
    print(f"Rotation sweep at random initialisation (seed {args.seed}) on {source}; pixel values in [0, 1],")
    print("feature change = mean relative L2 change of the pooled features against angle 0,")
    print("agreement = predictions equal to those at angle 0.\n")
    print(sweep_table(sweeps))


if __name__ == "__main__":
    run(main)
