"""Where does an SCNN lose accuracy between the quarter turns? A diagnosis of trained weights, no training.

For a trained SCNN and a slice of the MNIST test set, for each angle theta, with ``R`` the rotation by
theta (:func:`timm_sortconv.rotation.rotate`, bilinear about the map's centre, zero fill):

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

``--operator`` instead probes one SC window, no network and no data: smooth random images (sums of
Gaussian blobs of width ``--blob-sigma`` pixels, optionally blurred by ``--blur`` more) are rendered on
the grid exactly, upright and rotated by each angle about the window's centre pixel, and for each ring
the relative change of the window's sorted ring values is reported, median over ``--fields`` images.
Rendering is exact, so what changes is the operator's own response: where the ring's points fall
between the pixels.

``--shifts R`` asks how much the network cares where the digit sits on its grid: the upright test digits moved
by every whole-pixel shift up to ``R`` each way (zero fill, so nothing but the position changes), each shift's
accuracy and its paired change from the unmoved digits. A convolution moves its output with its input; 2x2 max
pooling does not for an odd shift, and a network may learn to depend on that. ``--canvas N`` first puts the
digits in the middle of an N x N background, further from the border the layers pad. With ``--out`` each shift is
one row of that table (a CSV, :class:`~timm_sortconv.cli.records.RecordTable`), named by the model, its
arguments, its weights, the canvas and the shift: every model and canvas probed in one file.

``--moments`` measures how well :func:`timm_sortconv.canonical.moment_angle` reads a digit's turn, the
quantity ``canonicalize=`` relies on: for each order and angle, the test digits of the ablation's sweep
(turned as MNIST-rot turns them, 8-bit) give angles that should exceed the upright digit's by the turn,
modulo ``360 / order``; the median error and the share of digits off by more than 5 degrees are reported.

Examples::

    python scripts/research/dip_probe.py --data-dir DATA --model scnn_p_rs_7 --pretrained --samples 500 \\
        --angles 10,20,30,45 --out scripts/research/results/ablation/probe_scnn_p_rs_7.json
    python scripts/research/dip_probe.py --operator --angles 10,22.5,30,45 --sampling polar square --blur 0 0.7
    python scripts/research/dip_probe.py --shifts 1 --data-dir DATA --model scnn_p_rs_7 --pretrained --samples 2000 \\
        --out scripts/research/results/ablation/shifts.csv
    python scripts/research/dip_probe.py --moments --data-dir DATA --samples 2000 --angles 0:90:10 \\
        --out scripts/research/results/ablation/moment_probe.json
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Callable, List, Tuple

import torch
import torch.nn as nn

from ablation import load_split, rotated_sweep
from scnn_options import create_model
from timm_sortconv.canonical import moment_angle
from timm_sortconv.cli import key_value, parse_key_values, run
from timm_sortconv.cli.records import RecordTable
from timm_sortconv.rotation import parse_rotations, rotate


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


def shift(images: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """``images`` ``(..., H, W)`` moved ``dy`` pixels down and ``dx`` right, the uncovered pixels 0."""
    h, w = images.shape[-2:]
    out = torch.zeros_like(images)
    if abs(dy) < h and abs(dx) < w:
        out[..., max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
            images[..., max(-dy, 0):h - max(dy, 0), max(-dx, 0):w - max(dx, 0)]
    return out


@torch.no_grad()
def shift_probe(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, shifts: List[Tuple[int, int]],
                batch: int = 500) -> List[dict]:
    """Per shift ``(dy, dx)`` of the 8-bit digits ``images`` ``(N, H, W)``: the accuracy, and its paired change
    from the unmoved digits with the standard error over images (in points)."""
    mean, std = model.pretrained_cfg["mean"][0], model.pretrained_cfg["std"][0]

    def correct(dy, dx):
        moved = (shift(images, dy, dx).float().unsqueeze(1) / 255 - mean) / std  # at the images' own size
        return torch.cat([model(moved[s:s + batch]).argmax(1) == labels[s:s + batch]
                          for s in range(0, len(images), batch)]).double()
    unmoved = correct(0, 0)
    rows = []
    for dy, dx in shifts:
        c = unmoved if (dy, dx) == (0, 0) else correct(dy, dx)
        change = c - unmoved
        rows.append({"shift": [dy, dx], "accuracy": c.mean().item() * 100, "change": change.mean().item() * 100,
                     "change_se": change.std(unbiased=True).item() / math.sqrt(len(c)) * 100})
    return rows


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


def blob_images(count: int, blob_sigma: float, blur: float, angle: float, size: int = 15, seed: int = 0):
    """``(count, 1, size, size)`` smooth images, each the same sum of Gaussian blobs (random centres, real
    coordinates) turned by ``angle`` degrees about the centre pixel, rendered exactly (a blur of ``blur``
    pixels widens each blob: the Gaussians' widths add in quadrature)."""
    gen = torch.Generator().manual_seed(seed)
    centres = (torch.rand(count, 6, 2, generator=gen, dtype=torch.float64) * 2 - 1) * 4
    heights = torch.randn(count, 6, generator=gen, dtype=torch.float64)
    width2 = blob_sigma ** 2 + blur ** 2
    t = math.radians(angle)
    # y down, x right: a counter-clockwise turn on screen maps (y, x) -> (y cos - x sin, x cos + y sin)
    turned = torch.stack((centres[..., 0] * math.cos(t) - centres[..., 1] * math.sin(t),
                          centres[..., 1] * math.cos(t) + centres[..., 0] * math.sin(t)), -1)
    coords = torch.arange(size, dtype=torch.float64) - size // 2
    d2 = (coords.view(1, 1, -1, 1, 1) - turned[:, None, None, :, 0]) ** 2 \
        + (coords.view(1, 1, 1, -1, 1) - turned[:, None, None, :, 1]) ** 2
    images = (heights[:, None, None, :] * blob_sigma ** 2 / width2 * torch.exp(-d2 / (2 * width2))).sum(-1)
    return images.view(count, 1, size, size)


def operator_probe(angles, samplings, blob_sigmas, blurs, fields: int, kernel_size: int = 7):
    """Rows ``(blob_sigma, blur, sampling, angle, [change of ring 1, ..., ring n])`` as described above."""
    from timm_sortconv import sort_conv2d
    from timm_sortconv import get_geometry

    k, n = kernel_size, kernel_size // 2
    ring_of = torch.tensor([max(abs(q // k - n), abs(q % k - n)) for q in range(k * k)])
    one_hot = torch.eye(k * k, dtype=torch.float64).view(k * k, 1, k, k)
    rows = []
    for blob_sigma in blob_sigmas:
        for blur in blurs:
            upright = blob_images(fields, blob_sigma, blur, 0.0)
            for sampling in samplings:
                get_geometry(k, sampling, "ring")  # checks the variant
                centre = upright.shape[-1] // 2 - n

                def values(images):
                    out = sort_conv2d(images, one_hot, sampling=sampling, sorting="ring", backend="reference")
                    return out[:, :, centre, centre]

                before = values(upright)
                for angle in angles:
                    after = values(blob_images(fields, blob_sigma, blur, angle))
                    changes = []
                    for r in range(1, n + 1):
                        a, b = after[:, ring_of == r], before[:, ring_of == r]
                        spread = (b - b.mean(1, keepdim=True)).norm(dim=1).clamp_min(1e-12)
                        changes.append(((a - b).norm(dim=1) / spread).median().item())
                    rows.append((blob_sigma, blur, sampling, angle, changes))
    return rows


def moment_probe(data_dir: str, samples: int, angles: List[float], orders=(1, 2, 4)) -> dict:
    """Per order and angle (``rows``): the median error (degrees) of :func:`moment_angle` on turned test digits,
    and the share of digits whose error exceeds 5 degrees (the module docstring defines the error); ``samples``:
    the digits measured, the first ``samples`` of the 2,000-image slice or all a smaller test set has."""
    images, _ = rotated_sweep(data_dir, 2000, [0.0] + list(angles), "")
    x = images[:, :samples].unsqueeze(2).double() / 255
    rows = []
    for order in orders:
        period = 360.0 / order
        upright = moment_angle(x[0], order)
        for i, angle in enumerate(angles, start=1):
            err = torch.remainder(moment_angle(x[i], order) - upright - angle + period / 2, period) - period / 2
            rows.append(dict(order=order, angle=angle, median_error=err.abs().median().item(),
                             share_over_5_degrees=(err.abs() > 5).double().mean().item()))
    return dict(samples=x.shape[1], rows=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="MNIST folder")
    parser.add_argument("--operator", action="store_true", help="probe one SC window on smooth images (no data)")
    parser.add_argument("--sampling", nargs="+", default=["polar"], help="samplings to compare (--operator)")
    parser.add_argument("--blob-sigma", type=float, nargs="+", default=[1.0], help="blob widths (--operator)")
    parser.add_argument("--blur", type=float, nargs="+", default=[0.0], help="extra blurs (--operator)")
    parser.add_argument("--fields", type=int, default=2000, help="random images (--operator)")
    parser.add_argument("--moments", action="store_true", help="how well the moment angle reads a digit's turn")
    parser.add_argument("--shifts", type=int, default=None, metavar="R",
                        help="accuracy on the upright digits moved by up to R whole pixels down/up and right/left "
                             "(every shift of -R..R by -R..R)")
    parser.add_argument("--canvas", type=int, default=28, metavar="N",
                        help="with --shifts: the digits in the middle of an N x N background first (default 28: as "
                             "they are)")
    parser.add_argument("--model", default="scnn_p_rs_7")
    parser.add_argument("--pretrained", action="store_true", help="the bundled weights")
    parser.add_argument("--checkpoint", default="", help="weights to load instead")
    parser.add_argument("--model-kwargs", nargs="*", default=[], type=key_value, metavar="KEY=VALUE",
                        help="create_model arguments, and the options of scnn_options.py")
    parser.add_argument("--samples", type=int, default=500, help="test images (the first of the 2,000-image slice)")
    parser.add_argument("--angles", default="10,20,30,45", help="degrees, START:STOP:STEP or a list")
    parser.add_argument("--out", default="", help="write the result as JSON here (with --shifts: add its rows to this "
                        "table, a CSV)")
    args = parser.parse_args(argv)
    if args.operator:
        rows = operator_probe(parse_rotations(args.angles), args.sampling, args.blob_sigma, args.blur, args.fields)
        print("blob sigma | blur | sampling | angle | median relative change of the sorted values, ring 1..n")
        for blob_sigma, blur, sampling, angle, changes in rows:
            print(f"{blob_sigma:10g} | {blur:4g} | {sampling:>12} | {angle:5g} | "
                  + "  ".join(f"{100 * c:5.1f}%" for c in changes))
        if args.out:
            with open(args.out, "w") as f:
                json.dump([dict(blob_sigma=b, blur=u, sampling=s, angle=a, ring_change=c)
                           for b, u, s, a, c in rows], f, indent=1)
        return
    if not args.data_dir:
        parser.error("--data-dir is needed (or --operator)")
    if args.moments:
        result = moment_probe(args.data_dir, args.samples, parse_rotations(args.angles))
        print(f"{result['samples']} test digits")
        print("order | angle | median error (degrees) | digits off by more than 5 degrees")
        for r in result["rows"]:
            print(f"{r['order']:5d} | {r['angle']:5g} | {r['median_error']:22.3f} | {100 * r['share_over_5_degrees']:.2f}%")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
        return
    if args.shifts is not None and args.shifts < 0:
        parser.error(f"--shifts {args.shifts}: a number of pixels, 0 or more")
    if args.canvas < 28 or args.canvas % 2:
        parser.error(f"--canvas {args.canvas}: an even number of pixels, 28 or more")
    kwargs = parse_key_values(args.model_kwargs)
    model = create_model(args.model, args.pretrained, checkpoint_path=args.checkpoint, **kwargs)
    model.eval()
    if args.shifts is not None:
        steps = range(-args.shifts, args.shifts + 1)
        shifts = [(dy, dx) for dy in steps for dx in steps]
        images, labels, _ = load_split(args.data_dir, "test", 2000, seed=42)
        pad = (args.canvas - images.shape[-1]) // 2
        images = torch.nn.functional.pad(images[:args.samples], (pad, pad, pad, pad))  # 0: the background
        rows = shift_probe(model, images, labels[:args.samples], shifts)
        print("shift (down, right) | accuracy | paired change from unmoved")
        for r in rows:
            print(f"{r['shift'][0]:+d}, {r['shift'][1]:+d} | {r['accuracy']:6.2f}% | "
                  f"{r['change']:+6.2f} ± {r['change_se']:.2f}")
        if args.out:
            table = RecordTable(args.out, key=("model", "model_kwargs", "checkpoint", "canvas", "shift"))
            for r in rows:
                table.put(dict(model=args.model, model_kwargs=kwargs,
                               checkpoint=args.checkpoint or ("bundled" if args.pretrained else ""),
                               samples=len(labels[:args.samples]), canvas=args.canvas, **r))
        return
    images, labels, _ = load_split(args.data_dir, "test", 2000, seed=42)  # the ablation's sweep slice
    images, labels = images[:args.samples].unsqueeze(1).float() / 255, labels[:args.samples]
    cfg = model.pretrained_cfg
    result = probe(model, images, labels, parse_rotations(args.angles), cfg["mean"][0], cfg["std"][0])
    result.update(model=args.model, checkpoint=args.checkpoint or ("bundled" if args.pretrained else ""),
                  samples=len(labels))
    print(format_result(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    run(main)
