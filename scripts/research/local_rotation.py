"""Local rotations: scenes of MNIST digits, each turned about its own centre, trained upright.

A turn of the whole image is what a canonical turn (``canonicalize=``) undoes and what MNIST-rot measures.
Here every digit of a scene is turned by its own angle about its own centre, while the digits stay where
they are: no turn of the whole image produces such a scene, so only invariance of the network's local
responses helps. Tasks (``--task``):

* ``one``: one digit on a black canvas, ``--canvas`` pixels a side (default 56) or ``HxW`` (``28x60``: a strip
  that holds two digits side by side), at a random place; the label is the digit (10 classes).
* ``pair``: two digits on the canvas; the label is their sum (19 classes). The sum needs both digits and
  does not depend on which one is where, so a network with global pooling needs no positional convention
  (the ordered pair would ask it to tell left from right, which an invariant, globally pooled network can
  only read from the border of its maps).

**Scenes.** Each digit is its 28x28 MNIST image with the pixels farther than ``RADIUS`` (14) pixels from the
image centre set to 0 (a few pixels of a few digits), so that a turned digit stays inside the disc of
radius 14 about its own centre. Digits are placed, at integer offsets, with their centres at least
``2 * RADIUS`` apart: the discs of two digits never overlap, whatever their turns, and the canvas is their
sum. A digit turned by ``a`` degrees is its masked image turned counter-clockwise about the image centre
(bilinear, zero fill: :func:`timm_sortconv.rotation.rotate_each`), rounded to 8 bits as MNIST-rot is,
masked again, then placed. Which digits and where are drawn from ``--seed`` (the data seed, 42 by default:
the same scenes for every row and training seed): ``--train-scenes`` from MNIST's 50,000-image training
split, ``--test-scenes`` from its test set.

**Training** (ablation.py's recipe): upright scenes only, batch ``--batch-size``, Adam at ``--lr`` decayed to
zero by a cosine over the updates, ``--epochs`` epochs, or ``--time-budget SECONDS``: as many updates as fit
in that time (the time per update is measured over the first ``PROBE_STEPS`` updates, at the starting rate),
which is how a slower peer is trained for the same time as an SC row. ``--seeds`` are training seeds
(initialisation and order).

**Evaluation**, on the test scenes:

* ``upright``: no turn.
* the grid: ``360 / --angle-step`` conditions (default 12: 0, 30, ..., 330). In condition ``c`` the first
  digit of every scene is turned by ``c * step`` and every other digit by ``(c + o) * step`` with its own
  offset ``o`` drawn uniformly per scene and digit: each digit goes through every angle of the grid once
  over the conditions, and the digits' angles are independent of one another. ``mean`` is the mean over
  the conditions, ``worst`` the worst condition (the worst angle of the first digit, the others' spread
  uniformly); for ``one`` this is the usual rotation sweep.
* ``random``: each digit turned by its own uniform angle in [0, 360).
* ``ceiling``: the accuracy of the best perfectly invariant classifier, for which a 6 and a 9 are one digit
  (a turned 6 is a 9): per group of test scenes with the same digits up to 6 = 9 (as a set for ``pair``),
  the most frequent label, counted over the test scenes' labels.

Standard errors are over scenes (a scene's grid conditions count as one sample), as in ablation.py.
Outputs: one row per task, name and seed in the table ``--results`` (a CSV,
:class:`~timm_sortconv.cli.records.RecordTable`: numbers, command, parameters, seconds per epoch); a seed whose
row is there is skipped. ``--table`` prints the Markdown table of every row of every task in ``--results``, with
``--paired ROW`` each row's paired difference from ``ROW`` over their common seeds.
Models (``--model``) are those of ablation.py: timm names (the SCNN family) and the peers of ``peers.py``
(``e2cnn``, ``gmr:<timm model>``), whose packages live in a separate environment.

Example::

    python scripts/research/local_rotation.py --task pair --name p_rs_7 --model scnn_p_rs_7 \\
        --model-kwargs 'channels=(16,16,32,32,64,64)' --data-dir DATA --train-scenes 10000 --epochs 2
    python scripts/research/local_rotation.py --table
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ablation import create_model, paired_difference
from timm_sortconv.cli import CommandError, key_value, parse_key_values, run
from timm_sortconv.cli.records import RecordTable
from timm_sortconv.data import MNIST
from timm_sortconv.rotation import rotate_each

RESULTS = Path(__file__).resolve().parent / "results" / "local_rotation.csv"


def records(results) -> RecordTable:
    """The results table: one row per task, row name and training seed."""
    return RecordTable(results, key=("task", "name", "seed"))
PATCH = 28  # an MNIST image
RADIUS = 14  # digits are masked to this disc about the image centre
TASKS = {"one": 1, "pair": 2}  # task -> digits per scene
PROBE_STEPS = 20  # updates timed to size a --time-budget run


def disc_mask() -> torch.Tensor:
    """``(PATCH, PATCH)`` bool: the pixels within ``RADIUS`` of the image centre ``((PATCH - 1) / 2, ...)``.
    The disc is symmetric under quarter turns of the grid, so masking commutes with ``rot90``."""
    r = torch.arange(PATCH, dtype=torch.float64) - (PATCH - 1) / 2
    return r[:, None] ** 2 + r[None, :] ** 2 <= RADIUS ** 2


@dataclass
class Scenes:
    """``count`` scenes of ``n`` digits: ``digits`` uint8 ``(count, n, PATCH, PATCH)`` (masked), ``classes``
    ``(count, n)`` the digits' labels, ``corners`` ``(count, n, 2)`` each digit's top-left (row, column) on the
    canvas: ``canvas`` pixels a side, or ``(height, width)``."""
    digits: torch.Tensor
    classes: torch.Tensor
    corners: torch.Tensor
    canvas: Union[int, Tuple[int, int]]

    @property
    def size(self) -> Tuple[int, int]:
        """The canvas's ``(height, width)``."""
        return canvas_size(self.canvas)

    @property
    def labels(self) -> torch.Tensor:
        """The task's label: the digit (one digit) or the sum of the digits."""
        return self.classes.sum(1)

    def __len__(self) -> int:
        return len(self.classes)


def canvas_size(canvas: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    """A canvas's ``(height, width)``: ``canvas`` pixels a side, or ``canvas`` itself."""
    return (canvas, canvas) if isinstance(canvas, int) else (int(canvas[0]), int(canvas[1]))


def parse_canvas(text: str) -> Union[int, Tuple[int, int]]:
    """``--canvas``: ``"56"`` (a side) or ``"28x60"`` (height x width), each at least ``PATCH``."""
    try:
        sides = tuple(int(side) for side in text.lower().split("x"))
    except ValueError:
        sides = ()
    if len(sides) not in (1, 2) or min(sides) < PATCH:
        raise argparse.ArgumentTypeError(f"expected a side or HEIGHTxWIDTH, each at least {PATCH} pixels (56, "
                                         f"28x60), got {text!r}")
    return sides[0] if len(sides) == 1 else sides


def place(rng: np.random.Generator, n: int, canvas: Union[int, Tuple[int, int]], tries: int = 1000) -> np.ndarray:
    """``(n, 2)`` top-left corners of ``n`` digits on the canvas, uniform over the placements whose digit
    centres are at least ``2 * RADIUS`` apart (rejection sampling)."""
    height, width = canvas_size(canvas)
    # a square canvas draws both coordinates from one bound, as it always has (the same scenes from a seed)
    span = height - PATCH + 1 if height == width else np.array([height - PATCH + 1, width - PATCH + 1])
    for _ in range(tries):
        corners = rng.integers(0, span, size=(n, 2))
        gaps = corners[:, None, :] - corners[None, :, :]
        far = (gaps ** 2).sum(-1) >= (2 * RADIUS) ** 2
        if np.all(far | np.eye(n, dtype=bool)):
            return corners
    raise CommandError(f"--canvas {canvas}: no placement of {n} non-overlapping digits found in {tries} tries; "
                       f"use a larger canvas")


def make_scenes(images: torch.Tensor, classes: torch.Tensor, n: int, count: int,
                canvas: Union[int, Tuple[int, int]], seed: int) -> Scenes:
    """``count`` scenes of ``n`` digits drawn (with replacement) from ``images`` ``(N, 28, 28)`` uint8 and
    placed on the canvas (a side, or ``(height, width)``), all from ``seed``."""
    if min(canvas_size(canvas)) < PATCH:
        raise CommandError(f"--canvas must be at least {PATCH} pixels a side, got {canvas}")
    rng = np.random.default_rng(seed)
    index = torch.from_numpy(rng.integers(0, len(images), size=(count, n)))
    corners = torch.from_numpy(np.stack([place(rng, n, canvas) for _ in range(count)]))
    digits = images[index] * disc_mask()
    return Scenes(digits, classes[index].long(), corners, canvas)


def render(scenes: Scenes, angles: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(count, height, width)`` uint8: the scenes with digit ``j`` of scene ``i`` turned counter-clockwise by
    ``angles[i, j]`` degrees about its own centre (``None``: upright)."""
    count, n = scenes.classes.shape
    digits = scenes.digits
    if angles is not None:
        flat = digits.reshape(count * n, 1, PATCH, PATCH).float()
        turned = rotate_each(flat, angles.reshape(-1).double()).round().clamp(0, 255)
        digits = turned.to(torch.uint8).view(count, n, PATCH, PATCH) * disc_mask()
    out = torch.zeros(count, *scenes.size, dtype=torch.uint8)
    offsets = torch.arange(PATCH)
    scene = torch.arange(count)[:, None, None]
    for j in range(n):
        rows = scenes.corners[:, j, 0, None, None] + offsets[None, :, None]
        cols = scenes.corners[:, j, 1, None, None] + offsets[None, None, :]
        out[scene, rows, cols] += digits[:, j]  # discs never overlap: the sum is each digit where it lies
    return out


def grid_angles(scenes: Scenes, step: float, seed: int) -> torch.Tensor:
    """``(conditions, count, n)``: the grid's angles (module docstring), the offsets drawn from ``seed``."""
    count, n = scenes.classes.shape
    conditions = round(360 / step)
    offsets = torch.from_numpy(np.random.default_rng(seed).integers(0, conditions, size=(count, n)))
    offsets[:, 0] = 0
    c = torch.arange(conditions)[:, None, None]
    return ((c + offsets[None]) % conditions).double() * step


def random_angles(scenes: Scenes, seed: int) -> torch.Tensor:
    """``(count, n)`` uniform angles in [0, 360) from ``seed``."""
    return torch.from_numpy(np.random.default_rng(seed).uniform(0, 360, size=tuple(scenes.classes.shape)))


def merged(digit: int) -> int:
    """A digit as a perfectly invariant model sees it: a 9 is a turned 6."""
    return 6 if digit == 9 else digit


def ceiling(scenes: Scenes) -> float:
    """Best accuracy (%) of a classifier that sees each scene's digits with 6 = 9, as a set (module docstring)."""
    groups: Dict[tuple, Counter] = {}
    for digits, label in zip(scenes.classes.tolist(), scenes.labels.tolist()):
        groups.setdefault(tuple(sorted(merged(d) for d in digits)), Counter())[label] += 1
    return 100 * sum(max(c.values()) for c in groups.values()) / len(scenes)


def normalise(images: torch.Tensor, cfg: dict) -> torch.Tensor:
    """uint8 ``(N, H, W)`` -> the model's normalised ``(N, 1, H, W)`` input."""
    return (images.float().unsqueeze(1) / 255 - cfg["mean"][0]) / cfg["std"][0]


def train(model, images: torch.Tensor, labels: torch.Tensor, args, seed: int) -> Dict:
    """The recipe of the module docstring; returns the updates made, the epochs they make and the seconds."""
    cfg = model.pretrained_cfg
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    per_epoch = len(images) // args.batch_size
    total = per_epoch * args.epochs if args.time_budget is None else None
    model.train()
    start, step, epoch = time.time(), 0, 0
    while total is None or step < total:
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for b in range(per_epoch):
            if total is None and step == PROBE_STEPS:
                total = max(PROBE_STEPS, int(args.time_budget * PROBE_STEPS / (time.time() - start)))
                print(f"  {args.time_budget:.0f} s fit {total} updates ({total / per_epoch:.2f} epochs)", flush=True)
            if total is not None and step >= total:
                break
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            lr = args.lr if total is None else 0.5 * args.lr * (1 + math.cos(math.pi * step / total))
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = F.cross_entropy(model(normalise(images[idx], cfg)), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_interval == 0:
                rate = step * args.batch_size / (time.time() - start)
                print(f"  step {step}/{total or '?'} loss {loss.item():.4f} ({rate:.0f} scenes/s)", flush=True)
        epoch += 1
    seconds = time.time() - start
    return {"updates": step, "epochs": step / per_epoch, "train_seconds": round(seconds, 1),
            "seconds_per_epoch": round(seconds * per_epoch / step, 1)}


@torch.no_grad()
def correct(model, images: torch.Tensor, labels: torch.Tensor, batch: int = 250) -> torch.Tensor:
    """``(N,)`` bool: whether each scene is classified correctly."""
    model.eval()
    cfg = model.pretrained_cfg
    return torch.cat([model(normalise(images[s:s + batch], cfg)).argmax(1) == labels[s:s + batch]
                      for s in range(0, len(images), batch)])


def evaluate(model, scenes: Scenes, step: float, seed: int) -> Dict:
    """Upright, grid (mean, worst, per angle) and random-angle accuracy (%) with standard errors over scenes."""
    labels = scenes.labels
    upright = correct(model, render(scenes), labels).double()
    grid = grid_angles(scenes, step, seed + 1)
    on_grid = torch.stack([correct(model, render(scenes, a), labels) for a in grid], 1).double()  # (count, conditions)
    randomly = correct(model, render(scenes, random_angles(scenes, seed + 2)), labels).double()
    n = len(scenes)
    se = lambda v: 100 * v.std(unbiased=True).item() / math.sqrt(n)  # noqa: E731
    per_angle = on_grid.mean(0) * 100
    worst = int(per_angle.argmin())
    return {
        "upright": 100 * upright.mean().item(), "upright_se": se(upright),
        "grid_angles": [c * step for c in range(len(grid))], "per_angle": [round(v, 3) for v in per_angle.tolist()],
        "mean": 100 * on_grid.mean().item(), "mean_se": se(on_grid.mean(1)),
        "worst": per_angle[worst].item(), "worst_angle": worst * step, "worst_se": se(on_grid[:, worst]),
        "random": 100 * randomly.mean().item(), "random_se": se(randomly),
        "retained": on_grid.mean().item() / max(upright.mean().item(), 1e-12),
        "mean_minus_upright_se": se(on_grid.mean(1) - upright),
        "ceiling": ceiling(scenes), "scenes": n,
    }


def load_scenes(args, task: str):
    n = TASKS[task]
    train_set, test_set = MNIST(args.data_dir, split="train"), MNIST(args.data_dir, split="test")
    train_scenes = make_scenes(train_set.images, train_set.targets, n, args.train_scenes, args.canvas, args.seed)
    test_scenes = make_scenes(test_set.images, test_set.targets, n, args.test_scenes, args.canvas, args.seed + 1)
    return train_scenes, test_scenes


def build(name: str, kwargs: Dict, classes: int) -> torch.nn.Module:
    """ablation.py's model ``name`` with ``classes`` outputs (one input channel for the timm models)."""
    kwargs = {"num_classes": classes, **kwargs}
    if name != "e2cnn":
        kwargs.setdefault("in_chans", 1)
    return create_model(name, kwargs)


def run_rows(args) -> None:
    kwargs = parse_key_values(args.model_kwargs)
    classes = 9 * TASKS[args.task] + 1  # the sums 0 .. 9n (one digit: 0 .. 9)
    table = records(args.results)
    train_scenes, test_scenes = load_scenes(args, args.task)
    train_images = render(train_scenes)
    for seed in args.seeds:
        if table.find(task=args.task, name=args.name, seed=seed) is not None:
            print(f"{args.task}/{args.name} seed {seed} is in {args.results}: skipped")
            continue
        torch.manual_seed(seed)
        model = build(args.model, kwargs, classes)
        params = sum(p.numel() for p in model.parameters())
        print(f"{args.task}/{args.name} seed {seed}: {args.model} {kwargs} ({params} parameters)", flush=True)
        trained = train(model, train_images, train_scenes.labels, args, seed)
        start = time.time()
        result = evaluate(model, test_scenes, args.angle_step, args.seed)
        result.update(task=args.task, name=args.name, model=args.model, model_kwargs=kwargs, seed=seed,
                      params=params, classes=classes, canvas=args.canvas, data_seed=args.seed,
                      train_scenes=len(train_scenes), batch_size=args.batch_size, lr=args.lr,
                      time_budget=args.time_budget, **trained, eval_seconds=round(time.time() - start, 1),
                      threads=torch.get_num_threads(),
                      command="python scripts/research/local_rotation.py " + " ".join(map(shlex.quote, sys.argv[1:])))
        table.put(result)
        print(f"  upright {result['upright']:.2f}, grid mean {result['mean']:.2f} +- {result['mean_se']:.2f}, worst "
              f"{result['worst']:.2f} at {result['worst_angle']:g}, random {result['random']:.2f}, retained "
              f"{result['retained']:.3f}, ceiling {result['ceiling']:.2f} "
              f"({trained['train_seconds']:.0f} s, {trained['epochs']:.2f} epochs)", flush=True)


def table(results: str, paired: Optional[str] = None) -> str:
    """The Markdown table of every row of the table ``results``, task by task (rows by name): the mean
    over seeds (with the mean per-seed standard error over scenes, and the spread between seeds), and with
    ``paired`` each row's :func:`~ablation.paired_difference` from that row of the same task in upright, mean
    and random accuracy (``-`` with fewer than two common seeds)."""
    head = ("| task | row | model | params | seeds | trained (epochs, s/epoch) | upright | mean over turns | "
            "worst (angle) | random turns | retained | ceiling |")
    lines = [head + (f" vs {paired}: upright | mean | random |" if paired else ""),
             "|" + "---|" * (12 + (3 if paired else 0))]
    found: Dict[str, Dict[str, List[Dict]]] = {}
    for record in records(results).records():
        found.setdefault(record["task"], {}).setdefault(record["name"], []).append(record)
    for task in sorted(found):
        reference = {r["seed"]: r for r in found[task].get(paired, [])}
        for name in sorted(found[task]):
            seeds = found[task][name]

            def cell(key: str) -> str:
                values = np.array([s[key] for s in seeds])
                sd = f", sd {values.std(ddof=1):.2f}" if len(values) > 1 else ""
                return f"{values.mean():.2f} (se {np.mean([s[key + '_se'] for s in seeds]):.2f}{sd})"

            first = seeds[0]
            epochs = np.mean([s["epochs"] for s in seeds])
            per_epoch = np.mean([s["seconds_per_epoch"] for s in seeds])
            worst = "/".join(sorted({f"{s['worst_angle']:g}" for s in seeds}))
            retained = np.mean([s["retained"] for s in seeds])
            kwargs = " ".join(f"{k}={v}" for k, v in first["model_kwargs"].items() if k != "channels")
            line = (f"| {task} | {name} | {(first['model'] + ' ' + kwargs).strip()} | {first['params']:,} | "
                    f"{len(seeds)} | {first['train_scenes']:,} x {epochs:.2f} ({per_epoch:.0f}) | {cell('upright')} | "
                    f"{cell('mean')} | "
                    f"{np.mean([s['worst'] for s in seeds]):.2f} ({worst}) | {cell('random')} | {retained:.3f} | "
                    f"{first['ceiling']:.2f} |")
            if paired:
                mine = {s["seed"]: s for s in seeds}
                diffs = [paired_difference(mine, reference, key) if name != paired else None
                         for key in ("upright", "mean", "random")]
                line += "".join(f" {d or '-'} |" for d in diffs)
            lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="pair")
    parser.add_argument("--name", help="row name (the table's name column)")
    parser.add_argument("--model", default="scnn_p_rs_7", help="a timm name, scnn, e2cnn or gmr:<timm name>")
    parser.add_argument("--model-kwargs", nargs="*", default=[], type=key_value, metavar="KEY=VALUE")
    parser.add_argument("--data-dir", help="MNIST folder (IDX files)")
    parser.add_argument("--canvas", type=parse_canvas, default=56, metavar="SIDE|HxW",
                        help="the scenes' canvas: pixels a side, or height x width (28x60)")
    parser.add_argument("--train-scenes", type=int, default=10000)
    parser.add_argument("--test-scenes", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=42, help="data seed: the scenes, offsets and random angles")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--time-budget", type=float, metavar="SECONDS",
                        help="train for as many updates as fit in this time instead of --epochs")
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--angle-step", type=float, default=30.0, help="the grid's step, degrees (divides 360)")
    parser.add_argument("--results", default=str(RESULTS), help="the results table (CSV), one row per seed")
    parser.add_argument("--log-interval", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--table", action="store_true", help="print the table of --results and exit")
    parser.add_argument("--paired", metavar="ROW", help="with --table: paired differences from ROW")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.results, args.paired))
        return
    if not args.name or not args.data_dir:
        parser.error("--name and --data-dir are needed to run a row")
    if args.angle_step <= 0 or abs(360 / args.angle_step - round(360 / args.angle_step)) > 1e-9:
        parser.error(f"--angle-step must divide 360, got {args.angle_step}")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error(f"--time-budget must be positive seconds, got {args.time_budget}")
    torch.set_num_threads(args.threads)
    run_rows(args)


if __name__ == "__main__":
    run(main)
