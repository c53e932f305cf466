"""Measuring rotation invariance: per-angle results of a model, as numbers, a table, a CSV and a plot.

Two measurements over a sweep of angles, both built on :func:`timm_sortconv.rotation.rotate`:

* :func:`rotation_sweep` feeds a model one batch turned by each angle and reports, per angle, the
  relative change of the pooled features against angle 0 and how many predictions still agree with
  angle 0 (and the accuracy, given labels); :func:`sweep_table` prints several models side by side.
  It needs no data set and no trained weights (``scripts/invariance.py`` runs it on digit-like images).
* :func:`accuracy_sweep` measures top-1 accuracy at every angle of a
  :class:`~timm_sortconv.data.RotatedDataset` (on the MNIST test set: the paper's MNIST-rot) through
  timm's loader; :func:`accuracy_table`, :func:`write_sweep_csv` / :func:`read_sweep_csv` and
  :func:`plot_sweep` print, store, read back and draw such per-angle accuracies
  (``scripts/validate.py --rotations``, ``scripts/mnist_results.py``, ``scripts/demo.py``).

And one check of SC's exact promise: :func:`quarter_turn_check` measures how far any model is from exact
invariance to quarter turns at a given input size, and finds the nearest sizes where it is exact.
"""
from __future__ import annotations

import copy
import csv
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn

from .rotation import rotate

__all__ = [
    "PerAngle",
    "QuarterTurnCheck",
    "RotationSweep",
    "accuracy_sweep",
    "accuracy_table",
    "plot_sweep",
    "quarter_turn_check",
    "read_sweep_csv",
    "rotate",
    "rotation_sweep",
    "sweep_figure",
    "sweep_table",
    "write_sweep_csv",
]

_logger = logging.getLogger(__name__)

# Top-1 accuracy (%) by angle (degrees), in sweep order.
PerAngle = Dict[float, float]


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


@torch.inference_mode()
def accuracy_sweep(
    model: nn.Module,
    sweep,
    data_config: Mapping,
    *,
    batch_size: int = 100,
    num_workers: int = 0,
    device: Optional[torch.device] = None,
    use_prefetcher: bool = True,
    amp_dtype: Optional[torch.dtype] = None,
    channels_last: bool = False,
    label: str = "",
) -> PerAngle:
    """Top-1 accuracy (%) of ``model`` at each angle of ``sweep``.

    Args:
        model: a classifier; it is moved to ``device`` and put in eval mode.
        sweep: a :class:`~timm_sortconv.data.RotatedDataset` (its ``angles`` and ``num_images``).
        data_config: timm's data config of the model (``input_size``, ``interpolation``, ``mean``,
            ``std``, ``crop_pct``), e.g. from :func:`timm_sortconv.data.resolve_data_config`.
        batch_size, num_workers, use_prefetcher: passed to :func:`timm.data.create_loader`.
        device: where the model runs (default: the model's device).
        amp_dtype: run under ``torch.autocast`` with this dtype (``None``: full precision).
        channels_last: feed the model ``channels_last`` tensors.
        label: name used in the progress lines that are logged.

    Returns:
        ``{angle: accuracy}`` in the order of ``sweep.angles``.
    """
    from timm.data import create_loader

    device = device if device is not None else next(model.parameters()).device
    loader = create_loader(
        sweep,
        input_size=data_config["input_size"],
        batch_size=batch_size,
        is_training=False,
        interpolation=data_config["interpolation"],
        mean=data_config["mean"],
        std=data_config["std"],
        crop_pct=data_config["crop_pct"],
        num_workers=num_workers,
        device=device,
        use_prefetcher=use_prefetcher,
    )
    model.to(device).eval()
    if channels_last:
        model.to(memory_format=torch.channels_last)
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
    correct: List[torch.Tensor] = []
    start = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        input, target = input.to(device), target.to(device)
        if channels_last:
            input = input.contiguous(memory_format=torch.channels_last)
        with autocast:
            output = model(input)
        correct.append((output.argmax(dim=-1) == target).cpu())
        if (batch_idx + 1) % 50 == 0 or batch_idx + 1 == len(loader):
            _logger.info(f"{label or type(model).__name__}: [{batch_idx + 1:>4d}/{len(loader)}] "
                         f"({time.time() - start:.1f}s)")
    per_angle = torch.cat(correct).view(len(sweep.angles), sweep.num_images).double().mean(dim=1) * 100
    return {angle: accuracy.item() for angle, accuracy in zip(sweep.angles, per_angle)}


def accuracy_table(results: Mapping[str, PerAngle]) -> str:
    """Per-angle accuracies of several models as a text table, one row per angle and a last row of means.

    Example:
        >>> print(accuracy_table({"sc": {0.0: 99.0, 45.0: 97.0}}))
          angle          sc
              0       99.00
             45       97.00
           mean       98.00
    """
    labels = list(results)
    angles = list(next(iter(results.values())))
    width = max(10, *(len(label) for label in labels))
    lines = ["angle".rjust(7) + "".join(label.rjust(width + 2) for label in labels)]
    for angle in angles:
        lines.append(f"{angle:7g}" + "".join(f"{results[label][angle]:{width + 2}.2f}" for label in labels))
    lines.append("mean".rjust(7) + "".join(f"{sum(results[label].values()) / len(angles):{width + 2}.2f}"
                                           for label in labels))
    return "\n".join(lines)


def write_sweep_csv(path, results: Mapping[str, PerAngle]) -> None:
    """Writes ``angle,<label>,...`` and one row per angle (accuracies in %, 4 decimals)."""
    labels = list(results)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["angle"] + labels)
        for angle in next(iter(results.values())):
            writer.writerow([f"{angle:g}"] + [f"{results[label][angle]:.4f}" for label in labels])


def read_sweep_csv(path) -> Dict[str, PerAngle]:
    """The per-angle accuracies :func:`write_sweep_csv` wrote, by label; ``ValueError`` names what is wrong."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"per-angle CSV {path} does not exist")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2 or len(rows[0]) < 2 or rows[0][0] != "angle":
        raise ValueError(f"{path} is not a per-angle CSV (header 'angle,<label>,...', one row per angle)")
    try:
        return {label: {float(row[0]): float(row[col]) for row in rows[1:]}
                for col, label in enumerate(rows[0][1:], start=1)}
    except (ValueError, IndexError) as e:
        raise ValueError(f"{path}: unreadable row ({e})") from None


def plot_sweep(path, results: Mapping[str, PerAngle], title: str, kinds: Optional[Mapping[str, str]] = None) -> None:
    """Accuracy against angle: a Cartesian panel and a polar panel (angle as the polar angle), each titled and
    with its legend below it, where it hides no point of any curve.

    Args:
        path: the image file to write (PNG by its extension).
        results: per-angle accuracies by label.
        title: the figure's title.
        kinds: optional words appended to labels in the legend, e.g. ``{"scnn_p_rs_3": "Sorting Convolution"}``.
    """
    import matplotlib.pyplot as plt

    fig = sweep_figure(results, title, kinds)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def sweep_figure(results: Mapping[str, PerAngle], title: str, kinds: Optional[Mapping[str, str]] = None):
    """The matplotlib figure :func:`plot_sweep` writes (arguments as there)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'timm-sortconv[plot]'") from None

    kinds = kinds or {}
    fig = plt.figure(figsize=(11, 5.6))
    cartesian = fig.add_subplot(1, 2, 1)
    polar = fig.add_subplot(1, 2, 2, projection="polar")
    for label, per_angle in results.items():
        angles, accuracies = list(per_angle), list(per_angle.values())
        mean = sum(accuracies) / len(accuracies)
        name = f"{label}: {kinds[label]}" if label in kinds else label
        cartesian.plot(angles, accuracies, marker="o", markersize=3, label=f"{name} (mean {mean:.2f}%)")
        # Close the curve only when the sweep goes all the way round (its next step would be 360 degrees on).
        full_circle = len(angles) > 1 and angles[-1] + (angles[1] - angles[0]) - angles[0] >= 360
        if full_circle:
            angles, accuracies = angles + [angles[0] + 360], accuracies + accuracies[:1]
        polar.plot([math.radians(a) for a in angles], accuracies, marker="o", markersize=3, label=name)
    cartesian.set_xlabel("rotation angle (degrees)")
    cartesian.set_ylabel("top-1 accuracy (%)")
    cartesian.set_ylim(0, 100)
    cartesian.grid(True, alpha=0.3)
    cartesian.set_title("top-1 accuracy (%) against the rotation angle", fontsize=10)
    polar.set_ylim(0, 100)
    polar.set_title("the same, the angle drawn as the polar angle", fontsize=10, pad=22)
    # Below each panel, outside its axes: inside, a legend covers the low points of a curve.
    for axes, offset in ((cartesian, -0.14), (polar, -0.08)):
        axes.legend(loc="upper center", bbox_to_anchor=(0.5, offset), fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.95))  # the top strip for the title, clear of the polar panel's
    return fig


@dataclass(frozen=True)
class QuarterTurnCheck:
    """What :func:`quarter_turn_check` measured.

    Attributes:
        size: the input size ``(H, W)`` measured.
        error: ``||f(rot90 x) - f(x)|| / ||f(x)||`` for the model's output ``f`` (for feature maps,
            ``rot90`` of the upright maps stands in for ``f(x)``: equivariance), random ``x``.
        tolerance: the largest error counted as exact (round-off of the measuring dtype).
        below, above: the nearest square sides below and above the shorter side of ``size`` at which the
            model measured exact, ``None`` where none was found within the search; both the height of
            ``size`` where ``size`` itself is exact.
    """

    size: Tuple[int, int]
    error: float
    tolerance: float
    below: Optional[int]
    above: Optional[int]

    @property
    def exact(self) -> bool:
        return self.error <= self.tolerance

    def __str__(self) -> str:
        size = "x".join(map(str, self.size))
        if self.exact:
            return f"exactly invariant to quarter turns at {size} (error {self.error:.1e})"
        nearest = ", ".join(str(s) for s in (self.below, self.above) if s is not None) or "none found nearby"
        return f"not invariant to quarter turns at {size} (error {self.error:.1e}); nearest exact sizes: {nearest}"


def _model_in_chans(model: nn.Module) -> int:
    """The channels the model takes: its first convolution's (timm keeps ``pretrained_cfg["input_size"]``
    unchanged when a model is built with ``in_chans=``), else the config's, else 3."""
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if first is not None:
        return first.in_channels
    cfg = getattr(model, "pretrained_cfg", None) or {}
    if isinstance(cfg, dict) and cfg.get("input_size"):
        return int(cfg["input_size"][0])
    return 3


def _turn_error(outputs, turned) -> float:
    """The relative change of ``outputs`` (a tensor or a list/tuple/dict of them) under the quarter turn."""
    if isinstance(outputs, dict):
        outputs, turned = list(outputs.values()), list(turned.values())
    if isinstance(outputs, (list, tuple)):
        return max(_turn_error(a, b) for a, b in zip(outputs, turned))
    expected = torch.rot90(outputs, 1, (-2, -1)) if outputs.dim() == 4 else outputs
    return float((turned - expected).norm() / expected.norm().clamp_min(torch.finfo(expected.dtype).tiny))


def quarter_turn_check(model: nn.Module, size, *, in_chans: Optional[int] = None, dtype: torch.dtype = torch.float64,
                       search: int = 32, batch: int = 2, seed: int = 0) -> QuarterTurnCheck:
    """Measures how far ``model`` is from exact invariance to quarter turns at input ``size``, and finds the
    nearest square sizes at which it is exact.

    The model is copied (in ``dtype``, evaluation mode; the original is untouched) and fed ``batch`` random
    images of ``in_chans`` channels (default: the model's first convolution's, else its ``pretrained_cfg``)
    and their quarter turns. At other sizes the same is measured, nearest first, up to ``search`` pixels away,
    until an exact size is found on each side. An error at most ``1e-10`` (``dtype=torch.float64``) or
    ``1e-5`` (``torch.float32``) counts as exact.

    Args:
        model: any image model; its output may be logits, pooled features or feature maps (checked for
            equivariance), or a list of them (``features_only``).
        size: an int (square) or ``(H, W)``.

    Returns:
        :class:`QuarterTurnCheck`; ``print`` it for one line.

    Example:
        >>> import timm
        >>> print(quarter_turn_check(timm.create_model("scnn_p_rs_3"), 30))
        exactly invariant to quarter turns at 30x30 (error ...)
    """
    tolerances = {torch.float64: 1e-10, torch.float32: 1e-5}
    if dtype not in tolerances:
        raise ValueError(f"dtype={dtype}: use torch.float64 (exact to round-off) or torch.float32; the round-off of "
                         "lower precisions hides the error being measured")
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    model = copy.deepcopy(model).to(dtype).eval()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    channels = in_chans or _model_in_chans(model)
    tolerance = tolerances[dtype]
    generator = torch.Generator().manual_seed(seed)

    def error(h: int, w: int) -> float:
        x = torch.randn(batch, channels, h, w, generator=generator, dtype=dtype).to(device)
        with torch.no_grad():
            return _turn_error(model(x), model(torch.rot90(x, 1, (2, 3))))

    measured = error(height, width)
    if measured <= tolerance:
        return QuarterTurnCheck((height, width), measured, tolerance, height, height)
    nearest = []
    for direction in (-1, 1):
        found = None
        for step in range(1, search + 1):
            side = min(height, width) + direction * step
            if side < 1:
                break
            try:
                if error(side, side) <= tolerance:
                    found = side
                    break
            except RuntimeError:  # too small for the network
                break
        nearest.append(found)
    return QuarterTurnCheck((height, width), measured, tolerance, nearest[0], nearest[1])
