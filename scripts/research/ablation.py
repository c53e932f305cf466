"""One row of the MNIST-rot ablation: train a model on upright MNIST for some seeds, sweep it, report error bars.

Every row of RESULTS.md's ablation runs this same protocol, so rows differ only by the model and its
options (``--model``, ``--model-kwargs``) unless a flag of the recipe is changed on purpose:

* **Training**: a seeded slice of ``--train-samples`` images of MNIST's 50,000-image training split (the
  same images for every row and seed), ``--epochs`` epochs, batch ``--batch-size``, Adam at ``--lr``
  decayed to zero by a cosine over the updates, no weight decay, no augmentation: the recipe of
  ``scripts/configs/mnist_scnn_short.yaml``, in a plain loop (no loader processes); ``--weight-decay``
  adds decoupled weight decay (AdamW). The model kept is the
  last one. ``--seeds`` are training seeds (initialisation and image order). ``--train-rotation D`` is a
  diagnostic outside the paper's setting: every batch is rotated by one angle drawn uniformly from
  ``[0, D)`` degrees (seeded; bilinear, zero fill, rounded to 8 bits as the sweep's images are), which shows
  how much of the dip a network of that architecture can learn away when training shows it rotations.
* **Sweep**: a fixed seeded slice of ``--sweep-samples`` MNIST test images (the slice RESULTS.md's
  2,000-image sweeps use), each rotated by every angle of ``--angles`` exactly as MNIST-rot is made
  (:class:`timm_sortconv.data.RotatedDataset`: bilinear, zero fill, rounded to 8 bits).
* **Report**, per seed: the accuracy at each angle, the mean over the angles, the upright accuracy, the
  worst angle and the dip (upright minus worst), each with its standard error over the images: an
  image's results at all angles count as one sample (they are not independent), so the SE of the mean is
  the standard deviation of the per-image mean over the angles divided by sqrt(images), and the dip's SE
  is that of the per-image difference between upright and the worst angle. Over seeds: the mean and the
  standard deviation between seeds.

For a network that is exactly invariant to quarter turns (every SCNN on 28x28 inputs) the angles
0..80 give the same mean as 0..350, at a quarter of the cost: ``--angles 0:90:10`` is what screening
rows use, and the full 36 angles what peers (not exactly quarter-turn invariant) and final rows use.

``--model-kwargs`` also take the SCNN options of ``scnn_options.py`` beside this script (``blur_sigma``,
``downsample``, ``padding_mode``), which the package does not ship. ``--pretrained`` trains nothing: it sweeps
the bundled weights of ``--model`` built with ``--model-kwargs``, which tests an option that adds no parameters
(e.g. ``blur_sigma=0.7``) on weights trained without it.

Peers and screening layers (``--model`` names that are not timm models: ``e2cnn``, ``orientmax:``/``orientkey:``,
``frames<pool><K>x<step>:``, ``gmr:``) are defined and explained in ``peers.py`` beside this script.

Outputs: one row per name and seed in the table ``--results`` (a CSV,
:class:`~timm_sortconv.cli.records.RecordTable`: the numbers, the command, the per-image results packed as base64
bits) and ``<output>/<name>/seed<S>.pth`` (the weights). A seed whose row is there is skipped. ``--table`` prints
the Markdown table of every row of ``--results``. ``--features`` measures, for every trained seed in
``--results`` (bundled weights for ``--pretrained`` rows), and for the same network untrained, from its seed, how
far the pooled features (the classifier's input) of the first ``--feature-samples`` sweep images move when the
images are rotated by 45 degrees: the mean of ``||f(rotated) - f(upright)||`` relative to the mean
``||f(upright)||``, and relative to the mean distance between the ten class centroids of the upright features (how
far the rotation moves an image compared with how far apart the classes are); it writes them, one row per name and
seed, to ``<results>_features.csv`` beside the table. ``--turn-cost WITHOUT WITH`` compares two stored rows'
upright accuracy, image by image, by how strongly each upright image is oriented (:func:`moment_strength`) and by
class: where a canonical turn costs what it costs. ``--csv OUT`` writes every row of ``--results`` as one line of a
CSV (:func:`write_csv`).

Example::

    python scripts/research/ablation.py --name p_rs_7 --model scnn_p_rs_7 --data-dir DATA --train-samples 10000 \\
        --epochs 2 --seeds 0 1 2 --angles 0:90:10 --results scripts/research/results/ablation/screen.csv
    python scripts/research/ablation.py --table --results scripts/research/results/ablation/screen.csv
"""
from __future__ import annotations

import argparse
import base64
import csv
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import scnn_options
from peers import MNIST_CFG, E2CNN, FrameAverage, gmr_convert, orient_convert
from timm_sortconv.canonical import moment_terms
from timm_sortconv.cli import CommandError, key_value, parse_key_values, run
from timm_sortconv.cli.records import RecordTable
from timm_sortconv.data import RotatedDataset, cap_samples, create_dataset
from timm_sortconv.rotation import parse_rotations, rotate

# The rows this repository keeps (RESULTS.md); --results names another table.
RESULTS = Path(__file__).resolve().parent / "results" / "ablation" / "screen.csv"


def records(results) -> RecordTable:
    """The results table: one row per name and training seed."""
    return RecordTable(results, key=("name", "seed"))


def beside(results, suffix: str) -> Path:
    """A file that belongs to the table ``results``: ``<table>_<suffix>`` (its features, its rows' notes)."""
    results = Path(results)
    return results.with_name(f"{results.stem}_{suffix}")


def load_split(data_dir: str, split: str, samples: int, seed: int):
    """``(images uint8 (N, 28, 28), labels)`` of a seeded slice of an MNIST split."""
    base = create_dataset("sortconv/mnist", root=data_dir, split=split)
    sliced = cap_samples(base, samples, seed=seed)
    index = torch.tensor(sliced.indices) if sliced is not base else torch.arange(len(base))
    return base.images[index], base.targets[index], sliced


def rotated_sweep(data_dir: str, samples: int, angles: List[float], cache_dir: str):
    """``(images uint8 (A, N, 28, 28), labels (N,))``: the test slice at every angle, as MNIST-rot makes them."""
    key = f"mnist_test_{samples}_seed42_" + "_".join(f"{a:g}" for a in angles) + ".pt"
    path = Path(cache_dir) / key if cache_dir else None
    if path is not None and path.is_file():
        return torch.load(path)
    _, labels, sliced = load_split(data_dir, "test", samples, seed=42)
    sweep = RotatedDataset(sliced, angles)
    images = torch.stack([torch.from_numpy(np.array(sweep[i][0])) for i in range(len(sweep))])
    result = (images.view(len(angles), len(sliced), 28, 28), labels)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, path)
    return result


def create_model(name: str, kwargs: Dict) -> torch.nn.Module:
    """A timm model, ``"scnn"`` (``timm_sortconv.models.SCNN(**kwargs)``, for variants that no entrypoint
    names, e.g. ``sorting="c2"``), or one of the peers of the module docstring; ``kwargs`` may hold
    the options of ``scnn_options.py``."""
    if name == "scnn":
        model = scnn_options.create_model("scnn", **kwargs)
        model.pretrained_cfg = {**MNIST_CFG, **(getattr(model, "pretrained_cfg", None) or {})}  # input_norm's wins
        return model
    if name == "e2cnn":
        return E2CNN(**kwargs)
    if name.startswith("orient") and ":" in name:
        prefix, base = name.split(":", 1)
        match = re.fullmatch(r"orient(max|key)(2|4|8)?", prefix)
        if not match:
            raise CommandError(f"--model {name}: use orientmax:<model> or orientkey:<model>, optionally with the "
                               "number of turns, e.g. orientmax8:scnn")
        turns = int(match.group(2)) if match.group(2) else None
        return orient_convert(create_model(base, kwargs), match.group(1), turns)
    if name.startswith("frames") and ":" in name:
        prefix, base = name.split(":", 1)
        match = re.fullmatch(r"frames(avg|max)(\d+)x([\d.]+)", prefix)
        if not match or int(match.group(2)) < 1:
            raise CommandError(f"--model {name}: use frames(avg|max)<K>x<step>:<model> with K >= 1, "
                               "e.g. framesavg3x20:scnn")
        k, step = int(match.group(2)), float(match.group(3))
        offsets = [(j - (k - 1) / 2) * step for j in range(k)]
        return FrameAverage(create_model(base, kwargs), offsets, match.group(1))
    if name.startswith("gmr:"):
        return gmr_convert(scnn_options.create_model(name[4:], **kwargs))
    return scnn_options.create_model(name, **kwargs)


CANVAS = 28  # --canvas: images are padded with black (0) to CANVAS x CANVAS before normalisation


def normalise(images: torch.Tensor, cfg: dict) -> torch.Tensor:
    pad = (CANVAS - images.shape[-1]) // 2
    x = F.pad(images.float(), (pad, pad, pad, pad)) if pad else images.float()
    return (x.unsqueeze(-3) / 255 - cfg["mean"][0]) / cfg["std"][0]


def train(model, images, labels, args, seed: int) -> float:
    """The recipe of the module docstring; returns the training time in seconds."""
    cfg = model.pretrained_cfg
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(images) // args.batch_size
    total = steps_per_epoch * args.epochs
    model.train()
    angles = torch.Generator().manual_seed(seed * 1000 + 999)  # --train-rotation's angles, one per batch
    start, step = time.time(), 0
    for epoch in range(args.epochs):
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for b in range(steps_per_epoch):
            idx = order[b * args.batch_size:(b + 1) * args.batch_size]
            for group in optimizer.param_groups:
                group["lr"] = 0.5 * args.lr * (1 + math.cos(math.pi * step / total))
            batch = images[idx]
            if args.train_rotation:
                angle = float(torch.rand((), generator=angles)) * args.train_rotation
                batch = rotate(batch.float(), angle).round().clamp(0, 255)
            loss = F.cross_entropy(model(normalise(batch, cfg)), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.log_interval == 0 or step == total:
                rate = step * args.batch_size / (time.time() - start)
                print(f"  step {step}/{total} loss {loss.item():.4f} ({rate:.0f} img/s)", flush=True)
    return time.time() - start


@torch.no_grad()
def sweep_correct(model, images: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """``(N, A)`` bool: whether each image is classified correctly at each angle."""
    model.eval()
    cfg = model.pretrained_cfg
    correct = torch.zeros(images.shape[1], images.shape[0], dtype=torch.bool)
    for a in range(images.shape[0]):
        for s in range(0, images.shape[1], batch):
            logits = model(normalise(images[a, s:s + batch], cfg))
            correct[s:s + batch, a] = logits.argmax(1) == labels[s:s + batch]
    return correct


def summarise(correct: torch.Tensor, angles: List[float]) -> Dict:
    """Per-angle accuracy, mean, upright, worst angle and dip, with standard errors over images (in %)."""
    c = correct.double()
    n = c.shape[0]
    per_angle = c.mean(0) * 100
    worst = int(per_angle.argmin())
    upright = angles.index(0.0) if 0.0 in angles else 0
    se = lambda v: (v.std(unbiased=True) / math.sqrt(n)).item() * 100  # noqa: E731
    return {
        "angles": angles,
        "per_angle": [round(v, 4) for v in per_angle.tolist()],
        "mean": c.mean().item() * 100, "mean_se": se(c.mean(1)),
        "upright": per_angle[upright].item(), "upright_se": se(c[:, upright]),
        "worst": per_angle[worst].item(), "worst_angle": angles[worst], "worst_se": se(c[:, worst]),
        "dip": (per_angle[upright] - per_angle[worst]).item(), "dip_se": se(c[:, upright] - c[:, worst]),
        "images": n,
    }


def pack(correct: torch.Tensor) -> str:
    return base64.b64encode(np.packbits(correct.numpy().astype(np.uint8)).tobytes()).decode()


def run_rows(args) -> None:
    kwargs = parse_key_values(args.model_kwargs)
    angles = parse_rotations(args.angles)
    table = records(args.results)
    weights_dir = Path(args.output) / args.name
    weights_dir.mkdir(parents=True, exist_ok=True)
    if not args.pretrained:
        train_images, train_labels, _ = load_split(args.data_dir, "train", args.train_samples, seed=42)
    sweep_images, sweep_labels = rotated_sweep(args.data_dir, args.sweep_samples, angles, args.cache_dir)
    for seed in args.seeds:
        if table.find(name=args.name, seed=seed) is not None:
            print(f"{args.name} seed {seed} is in {args.results}: skipped")
            continue
        torch.manual_seed(seed)
        if args.pretrained:
            model = scnn_options.create_model(args.model, pretrained=True, **kwargs)
            seconds, train_samples = 0.0, 0
        else:
            model = create_model(args.model, kwargs)
            train_samples = len(train_images)
        params = sum(p.numel() for p in model.parameters())
        print(f"{args.name} seed {seed}: {args.model} {kwargs} ({params} parameters), "
              + ("bundled weights" if args.pretrained else f"{train_samples} images x {args.epochs} epochs"),
              flush=True)
        if not args.pretrained:
            seconds = train(model, train_images, train_labels, args, seed)
            torch.save(model.state_dict(), weights_dir / f"seed{seed}.pth")
        start = time.time()
        correct = sweep_correct(model, sweep_images, sweep_labels)
        result = summarise(correct, angles)
        result.update(name=args.name, model=args.model, model_kwargs=kwargs, seed=seed, params=params,
                      train_samples=train_samples, epochs=0 if args.pretrained else args.epochs,
                      batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                      train_rotation=args.train_rotation,
                      train_seconds=round(seconds, 1), sweep_seconds=round(time.time() - start, 1),
                      threads=torch.get_num_threads(), canvas=CANVAS,
                      command="python scripts/research/ablation.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                      correct=pack(correct))
        table.put(result)
        print(f"  mean {result['mean']:.2f} +- {result['mean_se']:.2f}, upright {result['upright']:.2f}, "
              f"worst {result['worst']:.2f} at {result['worst_angle']:g}, dip {result['dip']:.2f} "
              f"+- {result['dip_se']:.2f} (train {seconds / 60:.1f} min)", flush=True)


@torch.no_grad()
def pooled_features(model, images: torch.Tensor) -> torch.Tensor:
    model.eval()
    x = normalise(images, model.pretrained_cfg)
    if hasattr(model, "forward_head"):
        return model.forward_head(model.forward_features(x), pre_logits=True).double()
    return model.features(model.geometric_tensor(x, model.in_type)).tensor.mean((2, 3)).double()


def feature_change(model, upright: torch.Tensor, rotated: torch.Tensor, labels: torch.Tensor) -> Dict:
    """The two ratios of ``--features`` (see the module docstring) for one model."""
    f0, f1 = pooled_features(model, upright), pooled_features(model, rotated)
    moved = (f1 - f0).norm(dim=1).mean()
    centroids = torch.stack([f0[labels == c].mean(0) for c in range(10)])
    between = torch.cdist(centroids, centroids).sum() / 90
    return {"relative": (moved / f0.norm(dim=1).mean()).item(), "to_class_distance": (moved / between).item()}


def features(args) -> None:
    global CANVAS
    images, labels = rotated_sweep(args.data_dir, args.sweep_samples, [0.0, 45.0], args.cache_dir)
    images, labels = images[:, :args.feature_samples], labels[:args.feature_samples]
    found = RecordTable(beside(args.results, "features.csv"), key=("name", "seed"), spread=("trained", "untrained"))
    command = "python scripts/research/ablation.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    for row in records(args.results).records():
        weights = Path(args.output) / row["name"] / f"seed{row['seed']}.pth"
        bundled = row["epochs"] == 0
        CANVAS = row.get("canvas", 28)
        if not (bundled or weights.is_file()):
            continue
        torch.manual_seed(row["seed"])
        model = create_model(row["model"], row["model_kwargs"])
        untrained = feature_change(model, images[0], images[1], labels)
        if bundled:
            model = scnn_options.create_model(row["model"], pretrained=True, **row["model_kwargs"])
        else:
            model.train()  # as when the weights were saved (e2cnn keeps expanded filters only in eval mode)
            model.load_state_dict(torch.load(weights))
        trained = feature_change(model, images[0], images[1], labels)
        found.put(dict(name=row["name"], seed=row["seed"], dip=row["dip"], trained=trained, untrained=untrained,
                       angle=45, images=len(labels), command=command))
        print(f"| {row['name']} | {row['seed']} | {row['dip']:.2f} | {100 * untrained['relative']:.1f}% | "
              f"{100 * trained['relative']:.1f}% | {trained['to_class_distance']:.3f} |", flush=True)


def _load_rows(results) -> Dict[str, Dict[int, Dict]]:
    """``{name: {seed: record}}`` of the table ``results``, names and seeds in the table's order."""
    found: Dict[str, Dict[int, Dict]] = {}
    for record in records(results).records():
        found.setdefault(record["name"], {})[record["seed"]] = record
    return found


def paired_change(row: Dict[int, Dict], reference: Dict[int, Dict], key: str) -> Optional[Tuple[float, float]]:
    """``(mean, standard error)`` over the seeds both rows ran of (row - reference) in ``key``; ``None`` with
    fewer than two common seeds. A seed fixes the initial weights and the order of the images, so the same seed
    of two rows that add no parameters starts from the same network."""
    common = sorted(set(row) & set(reference))
    if len(common) < 2:
        return None
    diffs = np.array([row[s][key] - reference[s][key] for s in common])
    return float(diffs.mean()), float(diffs.std(ddof=1) / np.sqrt(len(diffs)))


def paired_difference(row: Dict[int, Dict], reference: Dict[int, Dict], key: str) -> Optional[str]:
    """:func:`paired_change` as ``"+d ± se"``."""
    difference = paired_change(row, reference, key)
    return None if difference is None else f"{difference[0]:+.2f} ± {difference[1]:.2f}"


def table(results: str, paired: Optional[str] = None) -> str:
    """The Markdown table of every row of the table ``results`` (by name): per row the mean over its seeds, with the
    spread between seeds (sd) and the mean per-seed standard error over images (se); and, where
    ``--features`` measured the row's seeds, their mean feature change (untrained, trained, trained
    relative to the class centroids' distance). With ``paired`` (a row's name), three more columns: each
    row's :func:`paired_difference` from that row in mean, worst angle and dip ("-" for a row with
    other parameters, or fewer than two seeds in common)."""
    found = _load_rows(results)
    reference = found.get(paired) if paired else None
    if paired and not reference:
        raise CommandError(f"--paired {paired}: no row of that name in {results}")
    changes: Dict[str, List[Dict]] = {}
    for entry in RecordTable(beside(results, "features.csv"), key=("name", "seed")).records():
        changes.setdefault(entry["name"], []).append(entry)
    lines = ["| row | seeds | params | train | mean | upright | worst (angle) | dip | feature change at 45 degrees: "
             "untrained, trained, trained / class distance |" + (f" paired vs {paired}: mean | worst | dip |" if paired else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if paired else "")]
    for name in sorted(found):
        seeds = list(found[name].values())

        def cell(key: str) -> str:
            values = np.array([s[key] for s in seeds])
            se = np.mean([s[key + "_se"] for s in seeds])
            sd = f", sd {values.std(ddof=1):.2f}" if len(values) > 1 else ""
            return f"{values.mean():.2f} (se {se:.2f}{sd})"

        worst_angles = sorted({f"{s['worst_angle']:g}" for s in seeds})
        measured_seeds = changes.get(name, [])
        change = "-"
        if measured_seeds:
            mean = lambda key, sub: np.mean([m[sub][key] for m in measured_seeds])  # noqa: E731
            change = (f"{100 * mean('relative', 'untrained'):.1f}%, {100 * mean('relative', 'trained'):.1f}%, "
                      f"{mean('to_class_distance', 'trained'):.3f} ({len(measured_seeds)} seeds)")
        first = seeds[0]
        trained = f"{first['train_samples']:,} x {first['epochs']}" if first["epochs"] else "bundled"
        line = (f"| {name} | {len(seeds)} | {first['params']:,} | {trained} | {cell('mean')} | "
                f"{cell('upright')} | {cell('worst')} ({'/'.join(worst_angles)}) | {cell('dip')} | {change} |")
        if reference is not None:
            same_net = first["params"] == next(iter(reference.values()))["params"] and name != paired
            diffs = [paired_difference({s["seed"]: s for s in seeds}, reference, key) if same_net else None
                     for key in ("mean", "worst", "dip")]
            line += "".join(f" {d or '-'} |" for d in diffs)
        lines.append(line)
    return "\n".join(lines)


def _portable_command(command: str) -> str:
    """A seed's recorded command as it runs from any checkout: ``DATA`` for the MNIST folder, and without the
    machine's ``--output``/``--cache-dir`` folders (the defaults serve)."""
    command = re.sub(r"--data-dir \S+", "--data-dir DATA", command)
    return re.sub(r" --(?:output|cache-dir) \S+", "", command)


CSV_COLUMNS = ("group", "row", "change", "vs", "seeds", "model", "model_kwargs", "train_samples", "epochs",
               "batch_size", "lr", "weight_decay", "train_rotation", "params", "images", "angles", "mean", "mean_se",
               "mean_sd", "upright", "worst", "worst_angles", "dip", "dip_se", "paired_mean", "paired_mean_se",
               "paired_worst", "paired_worst_se", "paired_dip", "paired_dip_se", "train_minutes", "command")


def write_csv(results: str, out: str, rows_file: Optional[str] = None) -> int:
    """Writes every row of the table ``results`` as one CSV line (:data:`CSV_COLUMNS`) and returns how many.

    Numbers are means over the row's seeds, unrounded (``*_se``: the mean per-seed standard error over images; ``mean_sd``:
    the spread between seeds; ``worst_angles``: each seed's worst angle), the training recipe is the first seed's,
    ``train_minutes`` the range over seeds, ``command`` the first seed's (:func:`_portable_command`). ``rows_file``
    (default ``<results>_rows.csv`` beside the table; columns ``group, row, vs, change``) orders the rows and says what
    each changes and which row it is compared with: the ``paired_*`` columns are :func:`paired_change` from that row,
    for rows with its parameter count. Rows it does not list follow, by name, with those columns empty.
    """
    rows_path = Path(rows_file) if rows_file else beside(results, "rows.csv")
    notes = {}
    if rows_path.is_file():
        with open(rows_path, newline="") as f:
            notes = {entry["row"]: entry for entry in csv.DictReader(f)}
    found = _load_rows(results)
    missing = sorted(set(notes) - set(found))
    if missing:
        raise CommandError(f"--csv: {rows_path} lists rows that {results} does not hold: {', '.join(missing)}")
    names = [name for name in notes] + sorted(set(found) - set(notes))
    lines = []
    for name in names:
        seeds = found[name]
        runs = [seeds[s] for s in sorted(seeds)]
        first = runs[0]
        note = notes.get(name, {})

        def mean(key: str) -> float:
            return float(np.mean([r[key] for r in runs]))

        line = dict(group=note.get("group", ""), row=name, change=note.get("change", ""), vs=note.get("vs", ""),
                    seeds=" ".join(str(s) for s in sorted(seeds)), model=first["model"],
                    model_kwargs=json.dumps(first["model_kwargs"], sort_keys=True),
                    train_rotation=first.get("train_rotation", 0.0), weight_decay=first.get("weight_decay", 0.0),
                    images=first["images"], angles=" ".join(f"{a:g}" for a in first["angles"]),
                    mean_sd=float(np.std([r["mean"] for r in runs], ddof=1)) if len(runs) > 1 else "",
                    worst_angles=" ".join(f"{r['worst_angle']:g}" for r in runs),
                    train_minutes=f"{min(r['train_seconds'] for r in runs) / 60:.1f}-"
                                  f"{max(r['train_seconds'] for r in runs) / 60:.1f}",
                    command=_portable_command(first["command"]),
                    **{key: first[key] for key in ("train_samples", "epochs", "batch_size", "lr", "params")},
                    **{key: mean(key) for key in ("mean", "mean_se", "upright", "worst", "dip", "dip_se")})
        reference = found.get(note.get("vs", ""))
        if reference and next(iter(reference.values()))["params"] == first["params"]:
            for key in ("mean", "worst", "dip"):
                change = paired_change(seeds, reference, key)
                if change is not None:
                    line[f"paired_{key}"], line[f"paired_{key}_se"] = change
        lines.append(line)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(lines)
    return len(lines)


def unpack(row: Dict) -> np.ndarray:
    """A seed's per-image results, ``(images, angles)`` bool, from its record (:func:`pack` wrote them)."""
    images, angles = row["images"], len(row["angles"])
    bits = np.unpackbits(np.frombuffer(base64.b64decode(row["correct"]), dtype=np.uint8))
    return bits[:images * angles].reshape(images, angles).astype(bool)


def moment_strength(images: torch.Tensor, order: int = 2) -> torch.Tensor:
    """How strongly each image is oriented at order ``k``: ``|c_k| / sum_p |term_p|``, ``c_k`` the sum of the
    angular moment's terms (:func:`timm_sortconv.canonical.moment_terms`) whose argument the canonical turn reads.

    The ratio lies in ``[0, 1]``; it does not change when the image is turned (both sums turn with it), and it is
    small where the moment's angle is set by details of the shape rather than by one dominant direction (a round
    digit for ``k = 2``), so that such images are turned to orientations that differ from one writer to the next.
    ``images`` ``(N, C, H, W)``; returns ``(N,)`` (0 for a blank image).
    """
    real, imag = moment_terms(images, order)
    total = torch.sqrt(real * real + imag * imag).sum(dim=(-2, -1))
    real, imag = real.sum(dim=(-2, -1)), imag.sum(dim=(-2, -1))
    return torch.sqrt(real * real + imag * imag) / total.clamp_min(1e-12)


def turn_cost(results: str, without: str, with_turn: str, data_dir: str, order: int) -> str:
    """Where a canonical turn costs upright accuracy: Markdown tables of the upright accuracy of row
    ``without`` and row ``with_turn`` (mean over the seeds both ran) and their paired difference, per
    quartile of the upright sweep images' :func:`moment_strength` of ``order`` (Q1:
    the least oriented quarter, whose turn depends most on details of the writing) and per class."""
    found = _load_rows(results)
    rows = [found.get(name, {}) for name in (without, with_turn)]
    seeds = sorted(set(rows[0]) & set(rows[1]))
    if not seeds:
        raise CommandError(f"--turn-cost: {without} and {with_turn} have no seed in common under {results}")
    images = {rows[i][s]["images"] for i in (0, 1) for s in seeds}
    if len(images) != 1:
        raise CommandError(f"--turn-cost: the rows swept different numbers of images ({sorted(images)})")
    upright = [np.mean([unpack(row[s])[:, 0] for s in seeds], axis=0) * 100 for row in rows]
    # both rows' angle 0 is the same slice of upright test images: the sweep's first angle
    sweep, labels = rotated_sweep(data_dir, images.pop(), [0.0], "")
    strength = moment_strength(sweep[0][:, None].double(), order).numpy()
    edges = np.quantile(strength, [0.25, 0.5, 0.75])
    quartile = np.digitize(strength, edges)
    labels = labels.numpy()

    def line(name: str, mask: np.ndarray) -> str:
        if not mask.any():
            return f"| {name} | 0 | - | - | - |"
        diff = upright[1][mask] - upright[0][mask]
        se = f" ± {diff.std(ddof=1) / np.sqrt(mask.sum()):.2f}" if mask.sum() > 1 else ""
        return (f"| {name} | {mask.sum()} | {upright[0][mask].mean():.2f} | {upright[1][mask].mean():.2f} | "
                f"{diff.mean():+.2f}{se} |")

    head = f"| {{}} | images | {without} upright | {with_turn} upright | difference (se over images) |\n|---|---|---|---|---|"
    lines = [f"Seeds {', '.join(map(str, seeds))}; order-{order} strength quartile edges "
             + ", ".join(f"{e:.3f}" for e in edges), "", head.format(f"order-{order} strength")]
    lines += [line(f"Q{q + 1}", quartile == q) for q in range(4)] + [line("all", quartile >= 0), "",
                                                                     head.format("class")]
    lines += [line(str(c), labels == c) for c in range(10)]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", help="row name (the table's name column)")
    parser.add_argument("--model", default="scnn_p_rs_7")
    parser.add_argument("--model-kwargs", nargs="*", default=[], type=key_value, metavar="KEY=VALUE",
                        help="create_model arguments")
    parser.add_argument("--data-dir", help="MNIST folder")
    parser.add_argument("--train-samples", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0, help="decoupled (AdamW); 0: Adam, the recipe's")
    parser.add_argument("--train-rotation", type=float, default=0.0, metavar="DEGREES",
                        help="diagnostic: rotate each training batch by an angle in [0, DEGREES) (0: never, the "
                             "paper's setting)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--pretrained", action="store_true", help="sweep the bundled weights, train nothing")
    parser.add_argument("--canvas", type=int, default=28,
                        help="pad the 28x28 images (after rotating them) with black to this even size, for "
                             "training and sweep alike: moves the digit away from the map borders")
    parser.add_argument("--sweep-samples", type=int, default=2000)
    parser.add_argument("--angles", default="0:90:10", help="START:STOP:STEP or a list, degrees")
    parser.add_argument("--results", default=str(RESULTS),
                        help="the results table, one row per name and seed (default: results/ablation/screen.csv "
                             "beside this script)")
    parser.add_argument("--output", default="output/ablation", help="where the weights go")
    parser.add_argument("--cache-dir", default="output/ablation/cache", help="rotated test images ('' for none)")
    parser.add_argument("--log-interval", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: on a shared machine two spinning threads measured slower)")
    parser.add_argument("--table", action="store_true", help="print the table of --results and exit")
    parser.add_argument("--paired", metavar="ROW", help="with --table: add each row's paired difference from ROW "
                        "(mean over common seeds, with its standard error)")
    parser.add_argument("--features", action="store_true", help="pooled-feature change at 45 degrees of every "
                        "trained seed of --results (and of its untrained network), then exit")
    parser.add_argument("--feature-samples", type=int, default=500)
    parser.add_argument("--turn-cost", nargs=2, metavar=("WITHOUT", "WITH"),
                        help="where a canonical turn costs upright accuracy: rows WITHOUT and WITH the turn of "
                             "--results, by quartile of the images' --order moment strength and by class (needs "
                             "--data-dir), then exit")
    parser.add_argument("--order", type=int, default=2, help="with --turn-cost: the moment order of the turn")
    parser.add_argument("--csv", metavar="OUT", help="write every row of --results as one line of the CSV OUT "
                        "(what each row changes and what it is paired with: --rows), then exit")
    parser.add_argument("--rows", metavar="FILE", help="with --csv: the rows' order, change and pairing (columns "
                        "group,row,vs,change; default: <results>_rows.csv beside the table)")
    args = parser.parse_args(argv)
    if args.csv:
        print(f"{write_csv(args.results, args.csv, args.rows)} rows written to {args.csv}")
        return
    if args.turn_cost:
        if not args.data_dir:
            parser.error("--turn-cost needs --data-dir (the sweep's images and labels)")
        print(turn_cost(args.results, *args.turn_cost, args.data_dir, args.order))
        return
    if args.table:
        print(table(args.results, args.paired))
        return
    if args.features:
        torch.set_num_threads(args.threads)
        print("| row | seed | dip | feature change untrained | trained | trained, to class distance |\n"
              "|---|---|---|---|---|---|")
        features(args)
        return
    if not args.name or not args.data_dir:
        parser.error("--name and --data-dir are needed to run a row")
    if args.canvas < 28 or args.canvas % 2:
        parser.error(f"--canvas must be an even size >= 28, got {args.canvas}")
    global CANVAS
    CANVAS = args.canvas
    torch.set_num_threads(args.threads)
    run_rows(args)


if __name__ == "__main__":
    run(main)
