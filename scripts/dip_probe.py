#!/usr/bin/env python3
"""Where does an SCNN lose accuracy between the quarter turns? A diagnosis of trained weights, no training.

For a trained SCNN and a slice of the MNIST test set, for each angle theta, with ``R`` the rotation by
theta (:func:`timm_sortconv.invariance.rotate`, bilinear about the map's centre, zero fill):

* **Equivariance error per stage.** ``F_s`` is the network up to stage ``s`` (each conv-BN-ReLU block,
  each 2x2 pooling, the global pooling). ``cumulative`` is ``||F_s(R x) - R F_s(x)|| / ||R F_s(x)||`` on the
  central disc of the map (radius half the map's width): how far the rotated image's features are from the
  rotated upright features. ``local`` is the same for stage ``s`` alone, fed ``R`` of its upright input:
  ``||L_s(R h) - R L_s(h)|| / ||R L_s(h)||``; it separates the error a stage adds from the one it inherits.
  ``floor`` is ``||R^-1 R h - h|| / ||h||`` for the stage's output, the blur of rotating a map there and
  back: errors near it are within what rotating a grid map can resolve.
* **Repair.** The rotated image runs through the network, but at stage ``s`` its activation is replaced
  by ``R F_s(x)``, the upright image's activation rotated (what an exactly equivariant network up to ``s``
  would give); the accuracy of the rest of the network on that is reported per ``s``. Repairing at the
  input is the plain rotated accuracy (float rotation, no 8-bit rounding); repairing at the pooled features
  is the upright accuracy. The accuracy a stage adds when repaired is what the layers up to it lose.

Example::

    python scripts/dip_probe.py --data-dir DATA --model scnn_p_rs_7 --pretrained --samples 500 \\
        --angles 10,20,30,45 --out results/mnist/ablation/probe_scnn_p_rs_7.json
"""
from __future__ import annotations

import argparse
import json
from typing import Callable, List, Tuple

import timm
import torch
import torch.nn as nn

import timm_sortconv.models  # noqa: F401  (registers the SC models)
from timm_sortconv.data import cap_samples, create_dataset, parse_rotations
from timm_sortconv.invariance import rotate


def stages(model: nn.Module) -> List[Tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """The network as a list of ``(name, function)``, each feeding the next: the ``features`` children
    (blocks and poolings), then the global pooling, then the classifier."""
    out = [(f"{i}:{type(m).__name__}", m) for i, m in enumerate(model.features)]
    out.append(("pooled", lambda x: model.forward_head(x, pre_logits=True)))
    out.append(("logits", model.head.fc))
    return out


def disc(size: int, device=None) -> torch.Tensor:
    """Mask of the pixels whose centre lies within half the map's width of the map's centre."""
    c = (size - 1) / 2
    coords = torch.arange(size, dtype=torch.float64, device=device) - c
    return (coords.view(-1, 1) ** 2 + coords.view(1, -1) ** 2) <= (size / 2) ** 2


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` over the central disc for maps (summed over the batch), over all for vectors."""
    if a.dim() == 4:
        mask = disc(a.shape[-1], a.device)
        a, b = a[..., mask], b[..., mask]
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def rot(t: torch.Tensor, angle: float) -> torch.Tensor:
    return rotate(t, angle) if t.dim() == 4 else t


@torch.no_grad()
def probe(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, angles: List[float], mean: float,
          std: float):
    """The per-stage errors and repaired accuracies described in the module docstring, per angle."""
    chain = stages(model)
    upright = [(images - mean) / std]
    for _, f in chain:
        upright.append(f(upright[-1]))
    names = ["input"] + [n for n, _ in chain]
    result = {"stages": names, "upright_accuracy": (upright[-1].argmax(1) == labels).double().mean().item() * 100,
              "angles": {}}
    for angle in angles:
        rotated = [(rotate(images, angle) - mean) / std]
        for _, f in chain:
            rotated.append(f(rotated[-1]))
        rows = []
        for s, name in enumerate(names):
            ideal = rot(upright[s], angle)
            row = {"stage": name, "cumulative": rel_error(rotated[s], ideal)}
            if s > 0:
                row["local"] = rel_error(chain[s - 1][1](rot(upright[s - 1], angle)), ideal)
            if upright[s].dim() == 4:
                row["floor"] = rel_error(rotate(ideal, -angle), upright[s])
            if s < len(names) - 1:
                x = ideal
                for _, f in chain[s:]:
                    x = f(x)
                row["repaired_accuracy"] = (x.argmax(1) == labels).double().mean().item() * 100
            rows.append(row)
        rows[-1]["repaired_accuracy"] = result["upright_accuracy"]
        result["angles"][f"{angle:g}"] = rows
    return result


def format_result(result) -> str:
    lines = [f"upright accuracy {result['upright_accuracy']:.2f}%"]
    for angle, rows in result["angles"].items():
        lines.append(f"\nangle {angle}: stage | cumulative | local | floor | accuracy if repaired here")
        for row in rows:
            cells = [f"{row['stage']:>22}", f"{100 * row['cumulative']:8.2f}%"]
            cells.append(f"{100 * row['local']:8.2f}%" if "local" in row else " " * 9)
            cells.append(f"{100 * row['floor']:8.2f}%" if "floor" in row else " " * 9)
            cells.append(f"{row['repaired_accuracy']:7.2f}%")
            lines.append(" ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="MNIST folder")
    parser.add_argument("--model", default="scnn_p_rs_7")
    parser.add_argument("--pretrained", action="store_true", help="the bundled weights")
    parser.add_argument("--checkpoint", default="", help="weights to load instead")
    parser.add_argument("--model-kwargs", nargs="*", default=[], help="key=value create_model arguments")
    parser.add_argument("--samples", type=int, default=500, help="test images (the first of the 2,000-image slice)")
    parser.add_argument("--angles", default="10,20,30,45", help="degrees, START:STOP:STEP or a list")
    parser.add_argument("--out", default="", help="write the result as JSON here")
    args = parser.parse_args(argv)
    kwargs = dict(kv.split("=", 1) for kv in args.model_kwargs)
    model = timm.create_model(args.model, pretrained=args.pretrained, checkpoint_path=args.checkpoint, **kwargs)
    model.eval()
    test = cap_samples(create_dataset("sortconv/mnist", root=args.data_dir, split="test"), 2000, seed=42)
    index = test.indices[:args.samples]
    images = test.dataset.images[index].unsqueeze(1).float() / 255
    labels = test.dataset.targets[index]
    cfg = model.pretrained_cfg
    result = probe(model, images, labels, parse_rotations(args.angles), cfg["mean"][0], cfg["std"][0])
    result.update(model=args.model, checkpoint=args.checkpoint or ("bundled" if args.pretrained else ""),
                  samples=len(index))
    print(format_result(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
