"""Rotation sweeps: how much a model's pooled features and predictions change when its input turns.

:func:`rotate` turns a batch of images about their centre (bilinear, zero fill; multiples of 90
degrees of square images are exact ``torch.rot90``); :func:`rotation_sweep` feeds a model the rotated
batch at each angle of a sweep and reports, per angle, the relative change of the pooled features
against angle 0 and how many predictions still agree with angle 0 (and the accuracy, given labels).
:func:`sweep_table` prints several models' sweeps side by side.

Run as a script to compare models at random initialisation on digit-like images::

    python -m timm_sortconv.invariance --models scnn_p_rs_7 scnn_baseline_7 --angles 0:360:45
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["RotationSweep", "rotate", "rotation_sweep", "sweep_table", "synthetic_digits"]


def rotate(images: torch.Tensor, angle: float, fill: float = 0.0) -> torch.Tensor:
    """``images`` rotated counter-clockwise by ``angle`` degrees about their centre.

    The centre is the middle of the pixel grid, ``((H - 1) / 2, (W - 1) / 2)``, so a square image turned
    by 90 degrees lands exactly on its own grid: multiples of 90 degrees of square images are returned
    by :func:`torch.rot90` (bit-exact, any dtype), and agree with the bilinear path at nearby angles.
    Other angles use bilinear interpolation; output pixels whose source lies outside the image take
    ``fill`` (blended bilinearly at the border), and the output keeps the input's size. The result is
    deterministic and each image is rotated independently of the rest of the batch.

    Args:
        images: ``(..., H, W)`` tensor, e.g. ``(N, C, H, W)``; floating point unless ``angle`` is a
            multiple of 90 degrees (and, for non-square images, of 180 degrees).
        angle: degrees, counter-clockwise as displayed (row 0 at the top), the convention of
            ``torch.rot90(images, 1, dims=(-2, -1))`` and of torchvision.
        fill: value of the pixels rotated in from outside the image.

    Returns:
        Tensor of the same shape, dtype and device.

    Example:
        >>> x = torch.arange(16.).view(1, 1, 4, 4)
        >>> torch.equal(rotate(x, 90), torch.rot90(x, 1, dims=(-2, -1)))
        True
        >>> rotate(x, 30).shape
        torch.Size([1, 1, 4, 4])
    """
    if not isinstance(images, torch.Tensor) or images.dim() < 2:
        raise ValueError(f"rotate expects a tensor of shape (..., H, W), got "
                         f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}")
    angle = float(angle)
    if not math.isfinite(angle):
        raise ValueError(f"angle must be a finite number of degrees, got {angle}")
    h, w = images.shape[-2:]
    quarters = angle / 90.0
    if quarters == round(quarters) and (h == w or round(quarters) % 2 == 0):
        return torch.rot90(images, int(round(quarters)) % 4, dims=(-2, -1)).clone()
    if not images.is_floating_point():
        raise TypeError(f"rotating by {angle} degrees interpolates and needs a floating-point tensor, got {images.dtype}")
    if h < 2 or w < 2:
        raise ValueError(f"rotate needs images of at least 2x2 pixels, got {h}x{w}")

    compute_dtype = images.dtype if images.dtype in (torch.float32, torch.float64) else torch.float32
    x = images.reshape(1, -1, h, w).to(compute_dtype)
    if fill:
        x = x - fill
    theta = math.radians(angle)
    cos, sin = math.cos(theta), math.sin(theta)
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    ys = torch.arange(h, dtype=torch.float64, device=images.device) - cy
    xs = torch.arange(w, dtype=torch.float64, device=images.device) - cx
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    # Output pixel (x, y) (y pointing down) reads the input at its rotation by -angle, which in
    # y-down coordinates is (x cos - y sin, x sin + y cos) for a counter-clockwise turn on screen.
    src_x = xx * cos - yy * sin
    src_y = xx * sin + yy * cos
    grid = torch.stack((src_x / cx, src_y / cy), dim=-1).unsqueeze(0).to(compute_dtype)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    if fill:
        out = out + fill
    return out.reshape(images.shape).to(images.dtype)


@dataclass
class RotationSweep:
    """Per-angle results of :func:`rotation_sweep`.

    Attributes:
        angles: degrees.
        feature_change: mean over the images of ``||f(rotated) - f(original)|| / ||f(original)||``
            for the pooled (pre-logits) features ``f``.
        agreement: fraction of images whose predicted class equals their prediction at angle 0.
        accuracy: fraction of correct predictions, if labels were given.
    """

    angles: List[float]
    feature_change: List[float]
    agreement: List[float]
    accuracy: Optional[List[float]] = None

    def rows(self) -> List[Dict[str, float]]:
        """One dict per angle (``angle``, ``feature_change``, ``agreement`` and maybe ``accuracy``)."""
        rows = []
        for i, angle in enumerate(self.angles):
            row = dict(angle=angle, feature_change=self.feature_change[i], agreement=self.agreement[i])
            if self.accuracy is not None:
                row["accuracy"] = self.accuracy[i]
            rows.append(row)
        return rows

    def table(self) -> str:
        """A Markdown table, one row per angle."""
        return sweep_table({"model": self})

    def __str__(self) -> str:
        return self.table()


def _format_angle(angle: float) -> str:
    return f"{angle:g}"


def sweep_table(sweeps: Mapping[str, RotationSweep]) -> str:
    """Several models' sweeps side by side as a Markdown table (they must share their angles).

    Example output::

        | angle | a: feature change | a: agreement | b: feature change | b: agreement |
        |---:|---:|---:|---:|---:|
        | 0 | 0.00% | 100.0% | 0.00% | 100.0% |
        | 45 | 3.10% | 87.5% | 41.20% | 25.0% |
    """
    if not sweeps:
        raise ValueError("sweep_table needs at least one sweep")
    angles = next(iter(sweeps.values())).angles
    for name, sweep in sweeps.items():
        if sweep.angles != angles:
            raise ValueError(f"sweep {name!r} has angles {sweep.angles}, the first one {angles}")
    header = ["angle"]
    for name, sweep in sweeps.items():
        header += [f"{name}: feature change", f"{name}: agreement"]
        if sweep.accuracy is not None:
            header.append(f"{name}: accuracy")
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for i, angle in enumerate(angles):
        cells = [_format_angle(angle)]
        for sweep in sweeps.values():
            cells += [f"{100 * sweep.feature_change[i]:.2f}%", f"{100 * sweep.agreement[i]:.1f}%"]
            if sweep.accuracy is not None:
                cells.append(f"{100 * sweep.accuracy[i]:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _timm_features_and_logits(model: nn.Module, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    features = model.forward_features(x)
    return model.forward_head(features, pre_logits=True), model.forward_head(features)


def rotation_sweep(
    model: nn.Module,
    images: torch.Tensor,
    angles: Iterable[float] = range(0, 360, 10),
    *,
    targets: Optional[torch.Tensor] = None,
    features: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    batch_size: Optional[int] = None,
    fill: float = 0.0,
) -> RotationSweep:
    """Rotates ``images`` by each angle and measures how ``model``'s pooled features and predictions move.

    The model runs in eval mode without gradients (its training mode is restored afterwards) on the
    device and dtype of ``images``. Angle 0 is the reference whether or not it is in ``angles``.

    Args:
        model: a classifier; with timm's API (``forward_features`` and ``forward_head(pre_logits=)``)
            the pooled features are ``forward_head(forward_features(x), pre_logits=True)``.
        images: ``(N, C, H, W)`` floating-point batch, as the model takes it; the corners rotated in
            are ``fill``, so pass images whose background is ``fill`` (e.g. before normalisation).
        angles: degrees, counter-clockwise (see :func:`rotate`).
        targets: optional ``(N,)`` labels, to also report accuracy.
        features: ``x -> (N, D)`` pooled features for models without timm's API (the logits are then
            ``model(x)``), e.g. ``lambda x: torch.flatten(tv_resnet.avgpool(...), 1)``.
        batch_size: images per forward pass (default: all at once).
        fill: passed to :func:`rotate`.

    Returns:
        A :class:`RotationSweep`; ``print`` it for a table.

    Example:
        >>> import timm, timm_sortconv
        >>> model = timm.create_model("scnn_p_rs_3")
        >>> sweep = rotation_sweep(model, torch.rand(2, 1, 28, 28), angles=[0, 90])
        >>> sweep.feature_change[1] < 1e-5, sweep.agreement[1]
        (True, 1.0)
    """
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or not images.is_floating_point():
        raise ValueError("rotation_sweep expects a floating-point (N, C, H, W) batch, got "
                         f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}"
                         f"{' of ' + str(images.dtype) if isinstance(images, torch.Tensor) else ''}")
    angles = [float(a) for a in angles]
    if not angles:
        raise ValueError("rotation_sweep needs at least one angle")
    if targets is not None and (targets.dim() != 1 or targets.shape[0] != images.shape[0]):
        raise ValueError(f"targets must have shape ({images.shape[0]},), got {tuple(targets.shape)}")
    if features is None and not (hasattr(model, "forward_features") and hasattr(model, "forward_head")):
        raise TypeError(f"{type(model).__name__} has no forward_features/forward_head (timm's API); pass "
                        "features=a function returning the pooled features of a batch")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size}")

    def evaluate(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        pooled, logits = [], []
        step = batch_size or x.shape[0]
        for chunk in x.split(step):
            if features is None:
                f, y = _timm_features_and_logits(model, chunk)
            else:
                f, y = features(chunk), model(chunk)
            pooled.append(f.reshape(f.shape[0], -1).double())
            logits.append(y)
        return torch.cat(pooled), torch.cat(logits).argmax(-1)

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference, reference_pred = evaluate(images)
            reference_norm = reference.norm(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
            change, agreement, accuracy = [], [], []
            for angle in angles:
                pooled, pred = (reference, reference_pred) if angle % 360 == 0 else evaluate(rotate(images, angle, fill))
                change.append(((pooled - reference).norm(dim=1) / reference_norm).mean().item())
                agreement.append((pred == reference_pred).double().mean().item())
                if targets is not None:
                    accuracy.append((pred == targets.to(pred.device)).double().mean().item())
    finally:
        model.train(was_training)
    return RotationSweep(angles, change, agreement, accuracy if targets is not None else None)


def synthetic_digits(num_images: int, size: int = 28, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Digit-like images ``(N, 1, size, size)`` in ``[0, 1]``: one to three smooth pen strokes on a black
    background, drawn inside the central ``18/28`` of the canvas (MNIST's digits fill a 20x20 box). Deterministic
    for a ``seed``; made for demos and tests that must not depend on a data set.

    Example:
        >>> x = synthetic_digits(4)
        >>> x.shape, bool(x.min() >= 0), bool(x.max() <= 1)
        (torch.Size([4, 1, 28, 28]), True, True)
    """
    if num_images < 1 or size < 8:
        raise ValueError(f"need num_images >= 1 and size >= 8, got num_images={num_images}, size={size}")
    gen = torch.Generator().manual_seed(seed)
    box = 9.0 / 28.0 * size  # half-width of the box the strokes stay in
    width = 1.1 / 28.0 * size  # pen radius (Gaussian sigma) in pixels
    centre = (size - 1) / 2.0
    coords = torch.arange(size, dtype=torch.float64)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    t = torch.linspace(0, 1, 48, dtype=torch.float64).view(-1, 1)
    images = torch.zeros(num_images, 1, size, size, dtype=torch.float64)
    for n in range(num_images):
        num_strokes = int(torch.randint(1, 4, (1,), generator=gen))
        # quadratic Bezier strokes: start, control and end points in the box
        points = (torch.rand(num_strokes, 3, 2, generator=gen, dtype=torch.float64) * 2 - 1) * box + centre
        for start, control, end in points:
            curve = (1 - t) ** 2 * start + 2 * (1 - t) * t * control + t ** 2 * end  # (48, 2) as (y, x)
            dist2 = (yy.unsqueeze(-1) - curve[:, 0]) ** 2 + (xx.unsqueeze(-1) - curve[:, 1]) ** 2
            stroke = torch.exp(-dist2.min(dim=-1).values / (2 * width ** 2))
            images[n, 0] = torch.maximum(images[n, 0], stroke)
    return images.to(dtype)


def _parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m timm_sortconv.invariance",
        description="Rotation sweep of timm models at random initialisation.")
    parser.add_argument("--models", nargs="+", default=["scnn_p_rs_7", "scnn_baseline_7"], help="timm model names")
    parser.add_argument("--angles", default="0:360:45", help="START:STOP:STEP or a comma list, in degrees")
    parser.add_argument("--num-images", type=int, default=16, help="images in the batch")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model initialisation and the images")
    parser.add_argument("--mnist-images", default=None, metavar="IDX_FILE",
                        help="an MNIST IDX image file (gzipped or not) instead of synthetic digits")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Prints the sweep table of ``--models`` on digit-like images (see ``--help``)."""
    import timm

    from .data.rotation import parse_rotations

    args = _parse_args(argv)
    angles = parse_rotations(args.angles)
    if args.mnist_images:
        from .data.mnist import read_idx

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
    main()
