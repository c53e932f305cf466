"""How MNIST-rot's digits are turned, and what that does to a trained network's figure: paired, same weights.

The paper's MNIST-rot (Mo & Zhao, section III) is the MNIST test set turned by 0, 10, ..., 350 degrees; it
does not say how the turn resamples the 28x28 grid. This package's MNIST-rot
(:class:`timm_sortconv.data.RotatedDataset`) turns about the middle of the pixel grid, bilinear, zero fill,
rounded back to 8 bits. Each other variant changes one of those choices, as another common implementation
would make it:

* ``bilinear``: the package's MNIST-rot, image for image (the reference of every paired difference).
* ``torchvision``: ``torchvision.transforms.functional.rotate(image, angle)`` on the 8-bit PIL image with its
  defaults, what ``transforms.RandomRotation`` and most PyTorch code do: nearest neighbour, about the image
  centre, zero fill.
* ``bicubic``: bicubic interpolation (``grid_sample``'s, a = -0.75) about the grid's middle, zero fill, clamped
  to 0-255 and rounded to 8 bits: a sharper interpolation than bilinear.
* ``float``: ``bilinear`` not rounded to 8 bits (what turning the normalised float tensor gives).
* ``half-pixel``: bilinear about the point half a pixel right of and below the grid's middle, i.e. (14, 14)
  in pixel-centre coordinates for a 28x28 digit (OpenCV's ``getRotationMatrix2D((w / 2, h / 2), ...)``
  reading of "the image centre"), rounded to 8 bits. A quarter turn then also shifts the digit by a pixel.

Every variant runs on the same test images with the same weights, so its difference from ``bilinear`` is
paired: per image, the mean over the angles of (correct with the variant) - (correct with ``bilinear``); the
standard error is over images (an image's angles count as one sample, as in ``ablation.py``). Each variant's
mean, upright and worst angle are reported the same way.

Example (the bundled weights, 2,000 test images; ``--samples 10000`` is all of MNIST-rot)::

    python scripts/research/turn_protocol.py --data-dir DATA --model scnn_p_rs_7 --pretrained --samples 2000 \\
        --variants torchvision bicubic half-pixel --out turns.json
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ablation import load_split, summarise, sweep_correct
from scnn_options import create_model
from timm_sortconv.cli import CommandError, key_value, parse_key_values, run
from timm_sortconv.rotation import parse_rotations, rotate

VARIANTS = {
    "bilinear": "bilinear about the grid's middle, zero fill, 8-bit (the package's MNIST-rot)",
    "torchvision": "torchvision.transforms.functional.rotate's defaults on the PIL image (nearest neighbour)",
    "bicubic": "bicubic about the grid's middle, zero fill, 8-bit",
    "float": "bilinear about the grid's middle, zero fill, not rounded to 8 bits",
    "half-pixel": "bilinear about (W/2, H/2) in pixel-centre coordinates, zero fill, 8-bit",
}


def _grid(h: int, w: int, angle: float, cy: float, cx: float) -> torch.Tensor:
    """``grid_sample``'s grid (``align_corners=True``, ``(1, H, W, 2)``, float64) that turns an ``(H, W)`` map
    counter-clockwise on screen by ``angle`` degrees about the point ``(cy, cx)`` (row, column; pixel centres
    at integers)."""
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    yy, xx = torch.meshgrid(torch.arange(h, dtype=torch.float64) - cy, torch.arange(w, dtype=torch.float64) - cx,
                            indexing="ij")
    # Output pixel (x, y) (y down) reads the input at its turn by -angle about the centre, as rotate() does.
    src_x = xx * cos - yy * sin + cx
    src_y = xx * sin + yy * cos + cy
    return torch.stack((src_x / (w - 1) * 2 - 1, src_y / (h - 1) * 2 - 1), dim=-1).unsqueeze(0)


def turn(images: torch.Tensor, angle: float, variant: str) -> torch.Tensor:
    """The 8-bit digits ``images`` ``(N, H, W)`` turned by ``angle`` degrees as ``variant`` turns them: float32
    ``(N, H, W)`` on the 0-255 scale (whole numbers except for ``float``)."""
    if images.dtype != torch.uint8 or images.dim() != 3:
        raise ValueError(f"turn expects 8-bit images of shape (N, H, W), got {images.dtype} {tuple(images.shape)}")
    x = images.float()
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; accepted: {', '.join(VARIANTS)}")
    if angle % 360 == 0:
        return x
    if variant in ("bilinear", "float"):
        out = rotate(x, angle)
        return out if variant == "float" else out.round().clamp(0, 255)
    if variant == "torchvision":
        from torchvision.transforms import functional as TF
        turned = [np.asarray(TF.rotate(Image.fromarray(image), angle)) for image in images.numpy()]
        return torch.from_numpy(np.stack(turned)).float()
    h, w = images.shape[-2:]
    if variant == "bicubic":
        grid, mode = _grid(h, w, angle, (h - 1) / 2, (w - 1) / 2), "bicubic"
    else:  # half-pixel
        grid, mode = _grid(h, w, angle, h / 2, w / 2), "bilinear"
    out = F.grid_sample(x.unsqueeze(1), grid.float().expand(len(x), -1, -1, -1), mode=mode, padding_mode="zeros",
                        align_corners=True)[:, 0]
    return out.round().clamp(0, 255)


def correct_at(model, images: torch.Tensor, labels: torch.Tensor, angles: List[float], variant: str,
               batch: int) -> torch.Tensor:
    """``(N, A)`` bool: whether each image, turned by each angle as ``variant`` turns it, is classified right
    (one angle's images at a time, to keep a whole test set's 36 copies out of memory)."""
    return torch.cat([sweep_correct(model, turn(images, angle, variant).unsqueeze(0), labels, batch)
                      for angle in angles], dim=1)


def paired(correct: torch.Tensor, reference: torch.Tensor) -> Dict:
    """The change from ``reference`` to ``correct`` (both ``(N, A)``), in points: of the mean over the angles
    (with its standard error over images) and of each angle's accuracy."""
    per_image = (correct.double() - reference.double()).mean(1)
    return {"mean": per_image.mean().item() * 100,
            "mean_se": (per_image.std(unbiased=True) / math.sqrt(len(per_image))).item() * 100,
            "per_angle": [round(v, 4) for v in ((correct.double() - reference.double()).mean(0) * 100).tolist()]}


def table(result: Dict) -> str:
    lines = [f"{result['model']} ({result['checkpoint']}), {result['images']} test images x {len(result['angles'])} "
             "angles",
             "| variant | how the digits are turned | MNIST-rot | upright | worst (angle) | paired vs bilinear |",
             "|---|---|---|---|---|---|"]
    for name, row in result["variants"].items():
        change = row.get("paired")
        lines.append(f"| {name} | {VARIANTS[name]} | {row['mean']:.2f} ± {row['mean_se']:.2f} | "
                     f"{row['upright']:.2f} | {row['worst']:.2f} ({row['worst_angle']:g}) | "
                     + (f"{change['mean']:+.2f} ± {change['mean_se']:.2f} |" if change else "- |"))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, metavar="DATA", help="folder of the MNIST IDX files")
    parser.add_argument("--model", default="scnn_p_rs_7", help="timm model name (default: scnn_p_rs_7)")
    weights = parser.add_mutually_exclusive_group(required=True)
    weights.add_argument("--pretrained", action="store_true", help="the model's bundled weights")
    weights.add_argument("--checkpoint", default="", metavar="PATH", help="weights to load (a training checkpoint)")
    parser.add_argument("--model-kwargs", nargs="*", default=[], type=key_value, metavar="KEY=VALUE",
                        help="create_model arguments, and the options of scnn_options.py")
    parser.add_argument("--variants", nargs="+", default=["bilinear", "torchvision", "bicubic", "half-pixel"],
                        choices=list(VARIANTS), metavar="VARIANT",
                        help=f"turns to measure (accepted: {', '.join(VARIANTS)}; bilinear, the reference, is always "
                             "measured; default: all but float)")
    parser.add_argument("--samples", type=int, default=2000, metavar="N",
                        help="test images: the seeded slice the ablation and 2,000-image sweeps use (default 2000; "
                             "10000 is the whole test set)")
    parser.add_argument("--angles", default="0:360:10",
                        help="degrees, START:STOP:STEP or a list (default: MNIST-rot's 36)")
    parser.add_argument("-b", "--batch-size", type=int, default=500, metavar="N")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="torch threads (default: torch's)")
    parser.add_argument("--out", default="", metavar="JSON", help="write the result here (with the command)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch_size < 1:
        raise CommandError("--samples and --batch-size must be at least 1")
    if args.checkpoint and not Path(args.checkpoint).is_file():
        raise CommandError(f"--checkpoint {args.checkpoint}: no such file (a checkpoint written by scripts/train.py)")
    try:
        angles = parse_rotations(args.angles)
    except ValueError as error:
        raise CommandError(f"--angles {args.angles!r}: {error}") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = ["bilinear"] + [v for v in dict.fromkeys(args.variants) if v != "bilinear"]
    kwargs = parse_key_values(args.model_kwargs)
    if args.checkpoint:
        kwargs["checkpoint_path"] = args.checkpoint
    model = create_model(args.model, args.pretrained, **kwargs).eval()
    images, labels, _ = load_split(args.data_dir, "test", args.samples, seed=42)
    result = {"model": args.model, "checkpoint": args.checkpoint or "bundled", "images": len(labels), "angles": angles,
              "threads": torch.get_num_threads(), "variants": {},
              "command": shlex.join(["python", "scripts/research/turn_protocol.py",
                                     *(sys.argv[1:] if argv is None else argv)])}
    reference = None
    for variant in variants:
        start = time.time()
        correct = correct_at(model, images, labels, angles, variant, args.batch_size)
        row = summarise(correct, angles)
        row.pop("angles")
        if reference is None:
            reference = correct
        else:
            row["paired"] = paired(correct, reference)
        row["seconds"] = round(time.time() - start, 1)
        result["variants"][variant] = row
        print(f"{variant}: {row['mean']:.2f}% over {len(angles)} angles ({row['seconds']} s)", flush=True)
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    run(main)
