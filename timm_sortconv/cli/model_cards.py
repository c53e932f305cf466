"""Write ``model_cards/<model>.md`` for published MNIST SCNN weights from the rows scripts/mnist_results.py wrote.

Every number on a card comes from the model's row in a table of ``scripts/mnist_results.py`` (``--results``) or
from the paper (its figures, labelled as such); the card names the commands that reproduce the row. Rows are given
as ``TABLE`` (every row of it) or ``TABLE:NAME`` (the row named NAME).
``scripts/push_to_hub.py --model <model>`` uploads the card as the Hub repository's README.md.

Run it from the clone, as the cards' commands run: the data folder is shown as ``DATA/mnist`` (the README's name
for a folder of the MNIST IDX files), the training runs as the default ``output/mnist``, and the results as the
table the row is kept in now, relative to the current folder.

Example::

    python scripts/model_cards.py model_cards/results/sweep2000.csv \\
        --hub-row model_cards/results/full.csv:scnn_p_rs_7-paper
"""
import argparse
import csv
import os
from typing import List, Optional, Sequence

from . import CommandError, run
from .mnist_results import PAPER, records

SAMPLING = {"s": "square sampling (the window's own pixels, ring r being the 8r pixels of the square at distance r)",
            "p": "polar sampling (ring r: 8r points evenly spaced on the circle of radius r, bilinearly "
                 "interpolated)"}
SORTING = {"rs": "ring sorting (each ring's values sorted on their own)",
           "gs": "global sorting (all k*k values of the window, the centre included, sorted together and laid "
                 "back in row-major order)",
           "c2": "half-turn orbit sorting (`sorting='c2'`: each ring's values sorted in pairs 180 degrees apart, "
                 "so that a half turn changes nothing and the direction modulo 180 degrees is kept)",
           "c4": "quarter-turn orbit sorting (`sorting='c4'`: each ring's values sorted in fours 90 degrees apart)",
           "align": "aligned windows in place of sorting (`sorting='align'`: each window's rings turned back, in "
                    "their Fourier basis, by one orientation per position, their inner order kept)"}
CITATION = """@article{mo2024sorting,
  title   = {Sorting Convolution Operation for Achieving Rotational Invariance},
  author  = {Mo, Hanlin and Zhao, Guoying},
  journal = {IEEE Signal Processing Letters},
  year    = {2024},
  doi     = {10.1109/LSP.2024.3381909},
  note    = {arXiv:2305.14462}
}"""

parser = argparse.ArgumentParser(description="Write model cards from mnist_results.py rows")
parser.add_argument("rows", nargs="+", metavar="ROWS",
                    help="TABLE (every row of a table of scripts/mnist_results.py, e.g. model_cards/results/full.csv) "
                         "or TABLE:NAME (one row); rows with model kwargs are left out")
parser.add_argument("--hub-row", nargs="*", default=[], metavar="TABLE:NAME",
                    help="rows whose weights are the published ones for their model (override a row in ROWS)")
parser.add_argument("--out", default="model_cards", metavar="DIR", help="where cards go (default: model_cards)")


CANONICAL = ("; each input image is first turned about its centre to its principal axis (the orientation of its "
             "second-order angular moment, `canonicalize='moment2'`, no parameters), so that the turn left over is "
             "a multiple of 180 degrees (up to the error of the angle's estimate), which the SC layers ignore")


BLURRED = ("; a fixed Gaussian blur of 0.7 pixels before the first convolution and blurred max pooling (the 2x2 "
           "maximum at stride 1, then a [1, 2, 1] / 4 filter at stride 2) in place of both max poolings "
           "(`input_blur=0.7`, `downsample='blur-max'`, no parameters), which keeps its accuracy when the parts of an "
           "image are turned independently")


EARLY_CANONICAL = ("; only the first two convolutions sort (`sorted_convs=2`), the other four are plain `nn.Conv2d`, "
                   "so the later layers see a digit's orientation (a 6 from a 9); each input image is first turned "
                   "about its centre by the angle of its first-order angular moment (`canonicalize='moment1'`, no "
                   "parameters), which turns a quarter-turned image into the same image")


GUIDED = ("; every window is turned by the orientation of the input blurred by 4 pixels around it instead of by its "
          "own (`guide_blur=4`: the input's channel mean less its minimum under a Gaussian blur, pooled to each "
          "layer's map and read as one more channel with a zero weight; no parameters), so that the windows of one "
          "part of a scene turn alike and keep their relative orientations, which lets it follow parts turned "
          "independently")


GUIDED_CANONICAL = ("; each input image is first turned about its centre by the angle of its first-order angular moment "
                    "(`canonicalize='moment1'`, no parameters), which turns a quarter-turned image into the same "
                    "image, and the guide carries that orientation: a ramp of 0.02 a pixel along the turned image's "
                    "+x axis is added to it (`guide_ramp=0.02`), so that where the blurred input is flat the windows "
                    "turn with the whole image")


def _stem(model: str) -> str:
    return model.removesuffix("_canon").removesuffix("_early").removesuffix("_blur").removesuffix("_guided")


def base_model(model: str) -> str:
    """The paper's model name behind one of ours: without the canonical turn, the blur, sorting in the first
    convolutions only, the guide, and orbit sorting or alignment."""
    return _stem(model).replace("_c2_", "_rs_").replace("_c4_", "_rs_").replace("_align_", "_rs_")


def describe(model: str) -> str:
    early = model.endswith("_early_canon")
    guided_canonical = model.endswith("_guided_canon")
    canonical = model.endswith("_canon") and not early and not guided_canonical
    _, variant, *rest = _stem(model).split("_")
    k = rest[-1]
    if variant == "baseline":
        return (f"the plain-convolution twin of the SCNNs (`nn.Conv2d` everywhere, {k}x{k} kernels in the first "
                f"four layers): the paper's baseline, not rotation invariant")
    sampling, sorting = variant, rest[0]
    rings = ", ".join(str(8 * r) for r in range(1, int(k) // 2 + 1))
    what = "aligned convolution" if sorting == "align" else "Sorting Convolution"
    return (f"an SCNN with {what} in {'its first two' if early else 'all six'} layers: "
            f"{SAMPLING[sampling]}, {SORTING[sorting]}; "
            f"{k}x{k} kernels in the first four layers (rings of {rings} values), 3x3 in the last two"
            + (CANONICAL if canonical else "") + (EARLY_CANONICAL if early else "")
            + (BLURRED if model.endswith("_blur") else "") + (GUIDED if "_guided" in model else "")
            + (GUIDED_CANONICAL if guided_canonical else ""))


def angle_table(row, exact: bool = True) -> str:
    angles, accuracies = row["angles"], row["per_angle_top1"]
    by_angle = dict(zip(angles, accuracies))
    quarter = [a for a in angles if a < 90]
    # An SCNN on 28x28 inputs classifies every image identically at a, a + 90, a + 180 and a + 270 degrees;
    # where the measured accuracies show exactly that, one quarter says it all.
    repeats = len(angles) == 4 * len(quarter) and all(
        by_angle.get(a + 90 * q) == by_angle[a] for a in quarter for q in (1, 2, 3))
    shown = quarter if repeats else angles
    lines = []
    for start in range(0, len(shown), 9):
        chunk = shown[start:start + 9]
        lines.append("| angle | " + " | ".join(f"{a:g}" for a in chunk) + " |")
        lines.append("|---|" + "---|" * len(chunk))
        lines.append("| top-1 % | " + " | ".join(f"{by_angle[a]:.2f}" for a in chunk) + " |")
        lines.append("")
    if repeats:
        why = ("the network is exactly invariant to quarter turns" if exact else
               "the canonical turn of a quarter-turned image is the same image up to float rounding")
        lines.append(f"Measured at all {len(angles)} angles: the accuracy at each angle + 90, + 180 and + 270 degrees "
                     f"is exactly the one shown ({why}).")
        lines.append("")
    return "\n".join(lines)


DATA_DIR = "DATA/mnist"  # the README's name for a folder of the MNIST IDX files
RUNS_DIR = os.path.join("output", "mnist")  # scripts/mnist_results.py's default --runs


def portable(row, table: str) -> dict:
    """The row's commands as a clone runs them: the machine's ``--runs`` folder as the default (``output/mnist``),
    its ``--data-dir`` as :data:`DATA_DIR`, and its ``--results`` table as ``table``, where the row is now."""
    words = row["reproduce"].split()

    def value(option):
        return words[words.index(option) + 1].rstrip("/") if option in words else None

    moved = {value("--runs"): RUNS_DIR, value("--data-dir"): DATA_DIR, value("--results"): table}
    moved.pop(None, None)

    def move(word):
        for old, new in sorted(moved.items(), key=lambda item: -len(item[0])):  # a folder inside another first
            if word == old or word.startswith(old + "/"):
                return new + word[len(old):]
        return word

    if "--runs" in words:  # the default, not shown
        del words[words.index("--runs"):words.index("--runs") + 2]
    return {**row, "reproduce": " ".join(map(move, words)),
            "commands": [" ".join(map(move, command.split())) for command in row["commands"]]}


SHORT_PRESET = "scripts/configs/mnist_scnn_short.yaml"
PAPER_PRESET = "scripts/configs/mnist_scnn.yaml"


# train.py options that change how a run logs or loads data, not what it trains
LOGGING_OPTIONS = ("--log-interval", "--recovery-interval", "-j", "--workers")


def training_options(row) -> list:
    """The train.py options the row passed that change the training (its logging and loading options left out)."""
    words, kept = list(row.get("train_args") or []), []
    while words:
        word = words.pop(0)
        if word in LOGGING_OPTIONS:
            words = words[1:]
        else:
            kept.append(word)
    return kept


def paper_schedule(row) -> bool:
    """Whether the row trained on the paper's own schedule: its preset, all 100 epochs, nothing changed."""
    return row["config"] == PAPER_PRESET and row["epochs"] == 100 and not training_options(row)


def schedule(row) -> str:
    epochs = f"{row['epochs']} epoch{'s' if row['epochs'] != 1 else ''}"
    extra = training_options(row)
    if paper_schedule(row):
        return (f"the paper's schedule: {epochs}, batch 100, Adam at 1e-4 times 0.8 every 10 epochs "
                f"(`{row['config']}`)")
    if row["config"] == SHORT_PRESET and not extra:
        return (f"{epochs}, batch 50, Adam at 2e-3 decayed to zero by a cosine over the updates "
                f"(`{row['config']}`{', --epochs ' + str(row['epochs']) if row['epochs'] != 1 else ''})")
    options = f" with `{' '.join(extra)}`" if extra else ""
    return f"{epochs} of the preset `{row['config']}`{options}"


def training_lines(row) -> str:
    """The card's schedule, time, best epoch and command lines; a row trained on from the model's earlier
    bundled weights (``--pretrained``, with its ``row["start"]``) gives both stages."""
    not_paper = ("This is\n  **not** the paper's 100 epochs (Adam 1e-4 x 0.8 every 10 epochs, `scripts/configs/mnist_scnn.yaml`): "
                 "it is\n  what fits a 2-core CPU. Training took")
    start = row.get("start")
    if start is None and paper_schedule(row):
        return f"""- Schedule actually run: {schedule(row)}. Its epochs ran for {row['train_minutes'] / 60:.1f} hours on a 2-core
  CPU; the weights after epoch {row['best_epoch'] + 1} of 100 kept (validation top-1 {row['best_val_top1']:.2f}%).
- Command: `{row['reproduce']}`"""
    if start is None:
        return f"""- Schedule actually run: {schedule(row)}. {not_paper} {row['train_minutes']:.1f} minutes there; best epoch {row['best_epoch']}
  (validation top-1 {row['best_val_top1']:.2f}%).
- Command: `{row['reproduce']}`"""
    extra = " ".join(a for a in row.get("train_args") or [] if a != "--pretrained")
    return f"""- Schedule actually run, in two stages: {schedule(start)}, keeping its best epoch ({start['best_epoch']},
  validation top-1 {start['best_val_top1']:.2f}%), which was bundled; then {row['epochs']} more epochs of the same
  preset from those weights (`--pretrained`) with `{extra}` (best epoch {row['best_epoch']}, validation top-1
  {row['best_val_top1']:.2f}%). {not_paper} {start['train_minutes']:.1f} + {row['train_minutes']:.1f} minutes there.
- Commands: `{start['reproduce']}`, then, with the first stage's best checkpoint as the bundled weights,
  `{row['reproduce']}`"""


def card(row, params: int) -> str:
    model = row["model"]
    # the paper has no canonical turn, blur, partial sorting nor orbit sorting: its P-RS model of the same kernel size
    paper_model = base_model(model)
    paper_mnist, paper_rot = PAPER.get(paper_model, (None, None))
    swept = (f"all 10,000 test images x {len(row['angles'])} angles (the paper's full MNIST-rot, 360,000 images)"
             if row["mnist_rot_images"] == 10000 else
             f"a fixed random {row['mnist_rot_images']:,} of the 10,000 test images x {len(row['angles'])} angles "
             f"({row['mnist_rot_images'] * len(row['angles']):,} images; seed {row['seed']})")
    paper = lambda v: f"{v:.2f}%" if v is not None else "not reported"  # noqa: E731
    invariant = "" if "baseline" in model else (
        " Its logits are invariant to rotations by multiples of 90 degrees at every input size (exactly, up to "
        "float rounding of the canonical turn), and to every other angle up to the interpolation of the turns and "
        "the error of the angle's estimate."
        if model.endswith("_canon") else
        " Its logits are exactly invariant to rotations by multiples of 90 degrees at every input size, and close "
        "for any other angle.")
    return f"""---
library_name: timm
license: apache-2.0
tags: [image-classification, timm, rotation-invariance, sorting-convolution]
datasets: [mnist]
pipeline_tag: image-classification
---
# {model}.mnist

## What it is
`{model}` is {describe(model)}: six convolutions (32, 32, 64, 64, 128, 128 channels) with BatchNorm and
ReLU, {"blurred " if model.endswith("_blur") else "2x2 "}max pooling after the second and fourth, global average pooling and one linear layer;
{params:,} parameters; input 1x28x28 grayscale, 10 classes (the MNIST digits).{invariant}
Built with timm-sortconv (the `timm_sortconv` package), which implements the paper below.

## Training
- Data: the 50,000-image MNIST training split (a seeded 50k/10k split of the 60,000 training images),
  no augmentation; the epoch with the best top-1 on the other 10,000 (validation) images is kept.
{training_lines(row)}

## Results (measured)
| | this model | the paper ({paper_model}, 100 epochs) |
|---|---|---|
| MNIST test (10,000 images) | {row['mnist_test_top1']:.2f}% | {paper(paper_mnist)} |
| MNIST-rot | {row['mnist_rot_top1']:.2f}% | {paper(paper_rot)} |

MNIST-rot here: {swept}, rotated bilinearly about the centre with zero fill. Per angle:

{angle_table(row, exact=not model.endswith("_canon"))}
Commands (`scripts/validate.py`, run by the command above):
{chr(10).join('- `' + c + '`' for c in row['commands'][1:])}

## How to use it
```python
import timm, torch
import timm_sortconv  # registers the models; the MNIST SCNN weights ship inside the package

model = timm.create_model("{model}", pretrained=True).eval()        # bundled weights, no network
# or: timm.create_model("hf-hub:timm-sortconv/{model}.mnist", pretrained=True)
cfg = timm.data.resolve_data_config({{}}, model=model)                # 1x28x28, mean 0.1307, std 0.3081
transform = timm.data.create_transform(**cfg)
# images: white digit on black, 28x28 grayscale (MNIST's convention)
```

## Citation
```bibtex
{CITATION}
```

## Licence
Weights: Apache-2.0. Training data: MNIST (Y. LeCun, C. Cortes, C. J. C. Burges), distributed under
CC BY-SA 3.0.
"""


def read_rows(spec: str, what: str = "") -> List[tuple]:
    """``(row, table)`` for ``TABLE`` (each of its rows) or ``TABLE:NAME`` (that row); ``table`` is the table's
    path relative to the current folder. ``what`` says which row a missing one is, for the error."""
    path, name = (spec, None) if spec.endswith(".csv") else spec.rsplit(":", 1) if ":" in spec else (spec, None)
    if not os.path.isfile(path):
        raise CommandError(f"table {path} does not exist (tables are the CSVs scripts/mnist_results.py writes)")
    with open(path, newline="") as f:
        columns = next(csv.reader(f), [])
    if not {"name", "model"} <= set(columns):  # e.g. a JSON row of an older mnist_results.py
        raise CommandError(f"{path} is not a table of scripts/mnist_results.py (no name and model columns; tables "
                           "are the CSVs it writes, one row per name)")
    found = records(path).records(**({"name": name} if name else {}))
    if not found and not name:
        raise CommandError(f"{path} has no rows")
    if not found:
        raise CommandError(f"{path} has no row {name}" + (f" ({what})" if what else ""))
    table = os.path.relpath(os.path.abspath(path))
    return [(row, table) for row in found]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Writes one card per model of the rows given (see ``--help``)."""
    args = parser.parse_args(argv)
    import timm

    from .. import models  # noqa: F401  (registers the SC models with timm)

    rows = {}
    for spec in list(args.rows) + list(args.hub_row):  # --hub-row last: it wins
        for row, table in read_rows(spec):
            if row["model_kwargs"]:
                continue  # experiments with other settings are RESULTS.md rows, not published models
            if "--pretrained" in (row.get("train_args") or []):
                # trained on from the model's bundled weights: those came from the row named after the model
                (first, _), = read_rows(f"{table}:{row['model']}", f"{row['name']} was trained on from the bundled "
                                                                   f"weights of {row['model']}; its card needs the row "
                                                                   "that trained those, in the same table")
                row["start"] = portable(first, table)
            rows[row["model"]] = portable(row, table)
    os.makedirs(args.out, exist_ok=True)
    for model, row in sorted(rows.items()):
        params = sum(p.numel() for p in timm.create_model(model).parameters())
        path = os.path.join(args.out, f"{model}.md")
        with open(path, "w") as f:
            f.write(card(row, params))
        print(f"wrote {path}")


if __name__ == "__main__":
    run(main)
