"""Rotation sweep of timm models at random initialisation: how far the pooled features move with the angle.

No data set and no weights are needed: the images are digit-like strokes drawn from a seed
(:func:`timm_sortconv.data.synthetic_digits`), or the first images of an MNIST IDX file. The table is
:func:`timm_sortconv.invariance.sweep_table`.

Example::

    python scripts/invariance.py --models scnn_p_rs_7 scnn_baseline_7 --angles 0:360:45
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

from .. import models  # noqa: F401  (registers the SC models with timm)
from ..data.mnist import read_idx
from ..data.synthetic import synthetic_digits
from ..invariance import rotation_sweep, sweep_table
from ..rotation import parse_rotations
from . import run

parser = argparse.ArgumentParser(prog="scripts/invariance.py",
                                 description="Rotation sweep of timm models at random initialisation.")
parser.add_argument("--models", nargs="+", default=["scnn_p_rs_7", "scnn_baseline_7"], help="timm model names")
parser.add_argument("--angles", default="0:360:45", help="START:STOP:STEP or a comma list, in degrees")
parser.add_argument("--num-images", type=int, default=16, help="images in the batch")
parser.add_argument("--seed", type=int, default=0, help="seeds the model initialisation and the images")
parser.add_argument("--mnist-images", default=None, metavar="IDX_FILE",
                    help="an MNIST IDX image file (gzipped or not) instead of synthetic digits")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prints the sweep table of ``--models`` on digit-like images (see ``--help``)."""
    import timm

    args = parser.parse_args(argv)
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
