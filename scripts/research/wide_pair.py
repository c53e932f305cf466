"""Two digits side by side: the guided networks, blurred SC and the E(2)-CNN on a non-square two-part task,
trained four times the decision table's local steps.

The README's "Both kinds, one network" rests on the decision table's local tasks: a 56x56 canvas, 200 steps.
This study asks whether its order holds on a canvas that is not square and after longer training:

* **The task**: ``local_rotation.py``'s ``pair`` (two MNIST digits, each turned about its own centre at test
  time, the label their sum: 19 classes, needing both digits) on a ``--canvas`` of 28x60 pixels: a strip that
  holds the two digits side by side (their discs of radius 14 apart, up to 4 pixels of play). 10,000 upright
  training scenes from MNIST's 50,000-image training split, ``--test-scenes`` (1,000) from its test set, data
  seed 42 (``local_rotation.load_scenes``).
* **The rows** (:data:`ROWS`), decision_table.py's as they are there: ``align+guide`` (what
  ``scnn_p_align_7_guided`` registers), ``guide+canon+ramp`` (``scnn_p_align_7_guided_canon``: its canonical turn
  reads the strip in a 70x70 frame, :func:`timm_sortconv.canonical.canonical_size`, and the network after it
  sees that frame), ``p_rs_7_blur`` and ``e2cnn_c8``.
* **Training**: decision_table.py's rule (``decision_table.Trainer``: batch 50, Adam at 2e-3 decayed to zero by
  a cosine, upright scenes), ``--steps`` (800: four times the table's 200 local steps, 4 epochs of the 10,000
  scenes) for every SC row; the E(2)-CNN, a ``time_of`` row, trains for P-RS-7's time by the table's rule: the
  steps times the stored ratio of the two rows' step times (``decision_table.timing``, ``steps_for``), 1,431.
  Seeds 0, 1 and 2, one thread.
* **Measured** (``local_rotation.evaluate``): upright accuracy, the mean over 12 turns (each digit through every
  multiple of 30 degrees, the digits' angles independent), the worst of them, random turns, what the turns keep
  of the upright accuracy (``retained``), the best accuracy a perfectly invariant classifier can reach
  (``ceiling``: a 6 is a turned 9); standard errors over scenes.

``run`` does the jobs seed by seed (every row at seed 0 first), each adding one row to the table ``--results``
(one CSV, :class:`~timm_sortconv.cli.records.RecordTable`: the numbers, the command, the machine); a job whose row
is there is skipped. Training checkpoints under ``--output`` (outside the repository) every
``--checkpoint-every`` steps and at its end, so a run killed at any point goes on from its last checkpoint when the
same command runs again, with the weights an unbroken run has. ``table`` prints the Markdown table: per row the
mean over seeds and their standard deviation.

Example (``DATA``: the MNIST folder; ``RUNS``: a folder outside the repository)::

    OMP_NUM_THREADS=1 python scripts/research/wide_pair.py run --data-dir DATA --output RUNS/wide_pair
    python scripts/research/wide_pair.py table
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

import decision_table
import local_rotation
from timm_sortconv.canonical import canonical_size
from timm_sortconv.cli import CommandError, run
from timm_sortconv.cli.records import RecordTable

RESULTS = Path(__file__).resolve().parent / "results" / "wide_pair.csv"
#: decision_table.py's rows measured here, in the table's order.
ROWS = tuple(row for name in ("align+guide", "guide+canon+ramp", "p_rs_7_blur", "e2cnn_c8")
             for row in decision_table.ROWS if row.name == name)
CANVAS = (28, 60)
SEEDS = (0, 1, 2)
STEPS = 4 * decision_table.LOCAL_STEPS
TASK = "pair"


def records(results) -> RecordTable:
    """The results table: one row per network and seed."""
    return RecordTable(results, key=("row", "seed"), spread=("machine",))


def network_input(row: decision_table.Row, canvas: Tuple[int, int]) -> Tuple[int, int]:
    """The size the row's network reads: the canvas, or the frame of its canonical turn."""
    return canonical_size(*canvas) if row.kwargs.get("canonicalize") else tuple(canvas)


def run_job(row: decision_table.Row, seed: int, args, times: Dict, scenes) -> Dict:
    """Trains (or resumes) and measures one row at one seed; returns its record."""
    train_scenes, test_scenes, train_images = scenes
    checkpoint = Path(args.output) / row.name / f"seed{seed}.pth"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = decision_table.build(row, classes=9 * local_rotation.TASKS[TASK] + 1, in_chans=1, channels=args.channels)
    steps = decision_table.steps_for(row, args.steps, times)
    params = sum(p.numel() for p in model.parameters())
    print(f"{row.name} seed {seed}: {row.model} {row.kwargs} ({params:,} parameters), {steps} steps, input "
          f"{'x'.join(map(str, network_input(row, args.canvas)))}", flush=True)
    trainer = decision_table.Trainer(model, train_images, train_scenes.labels, steps, seed, row.augment)
    trainer.run(checkpoint, args.checkpoint_every)
    # the trained weights too, so that a run stopped while measuring only measures again
    temporary = checkpoint.with_suffix(".tmp")
    torch.save(trainer.state(), temporary)
    os.replace(temporary, checkpoint)
    start = time.perf_counter()
    measured = local_rotation.evaluate(model, test_scenes, 360 / 12, args.data_seed)
    kwargs = {**row.kwargs, "channels": list(args.channels)} if args.channels else row.kwargs
    return {"row": row.name, "seed": seed, "model": row.model, "model_kwargs": kwargs, "time_of": row.time_of,
            "task": TASK, "canvas": list(args.canvas), "input": list(network_input(row, args.canvas)),
            "params": params, "steps": steps, "batch": decision_table.BATCH, "lr": decision_table.LR,
            "train_scenes": len(train_images), "train_seconds": round(trainer.seconds, 1),
            "seconds_per_step": round(trainer.seconds / max(trainer.step, 1), 3),
            **{k: v for k, v in measured.items() if k not in ("grid_angles",)},
            "eval_seconds": round(time.perf_counter() - start, 1), "data_seed": args.data_seed,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": decision_table.machine(),
            "command": args.command}


def run_all(args) -> None:
    rows = [row for row in ROWS if not args.rows or row.name in args.rows]
    if any(row.model == "e2cnn" for row in rows) and importlib.util.find_spec("e2cnn") is None:
        raise CommandError("the E(2)-CNN's row needs e2cnn: pip install -e '.[research]' (or leave it out with "
                           "--rows)")
    torch.set_num_threads(args.threads)
    table = records(args.results)
    todo = [(row, seed) for seed in args.seeds for row in rows if table.find(row=row.name, seed=seed) is None]
    if not todo:
        print(f"every job is in {args.results}", flush=True)
        return
    # the E(2)-CNN's steps: the table's stored step times of it and of the row whose time it takes
    timed = [row for row in decision_table.ROWS if row.name in {name for r in rows for name in (r.name, r.time_of)}]
    times = decision_table.timing(Path(decision_table.RESULTS), timed)
    scene_args = argparse.Namespace(data_dir=args.data_dir, train_scenes=args.train_scenes,
                                    test_scenes=args.test_scenes, canvas=tuple(args.canvas), seed=args.data_seed)
    train_scenes, test_scenes = local_rotation.load_scenes(scene_args, TASK)
    scenes = (train_scenes, test_scenes, local_rotation.render(train_scenes))
    print(f"{len(todo)} jobs to do: {', '.join(f'{row.name}/{seed}' for row, seed in todo)}", flush=True)
    for row, seed in todo:
        record = run_job(row, seed, args, times, scenes)
        table.put(record)
        print(f"  upright {record['upright']:.2f}, turns {record['mean']:.2f} (worst {record['worst']:.2f}), random "
              f"{record['random']:.2f}, retained {record['retained']:.3f} ({record['train_seconds']:.0f} s training, "
              f"{record['eval_seconds']:.0f} s measuring)", flush=True)


def _spread(values: Sequence[float]) -> str:
    values = np.asarray(values, dtype=float)
    return f"{values.mean():.2f} ± {values.std(ddof=1):.2f}" if len(values) > 1 else f"{values.mean():.2f}"


def table(results) -> str:
    """The Markdown table of ``results``: per row (in :data:`ROWS`' order, then any other) its seeds' mean and
    standard deviation of upright accuracy, the mean over the turns, the worst turn, random turns and what the
    turns keep, with the network's input, parameters, steps and seconds per step (the median over seeds: a run
    paused for others' timings counts the pause in its step)."""
    found: Dict[str, List[Dict]] = {}
    for record in records(results).records():
        found.setdefault(record["row"], []).append(record)
    if not found:
        raise CommandError(f"no results in {results}: run the study first (python scripts/research/wide_pair.py run)")
    order = [row.name for row in ROWS if row.name in found] + sorted(set(found) - {row.name for row in ROWS})
    head = ("| row | network | input | params | steps | s/step | seeds | upright | mean over 12 turns | worst turn | "
            "random turns | retained | ceiling |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in order:
        seeds = sorted(found[name], key=lambda r: r["seed"])
        first = seeds[0]
        what = next((row.what for row in ROWS if row.name == name), first["model"])
        cells = [name, what, "x".join(map(str, first["input"])), f"{first['params']:,}", str(first["steps"]),
                 f"{np.median([r['seconds_per_step'] for r in seeds]):.2f}", str(len(seeds))]
        cells += [_spread([r[key] for r in seeds]) for key in ("upright", "mean", "worst", "random")]
        cells += [f"{np.mean([r['retained'] for r in seeds]):.3f}", f"{first['ceiling']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    machines = sorted({f"{r['machine']['cpu']} ({r['machine']['isa']}, {r['machine']['threads']} thread"
                       f"{'s' if r['machine']['threads'] > 1 else ''})" for rs in found.values() for r in rs})
    dates = sorted({r["date"] for rs in found.values() for r in rs})
    first = next(iter(found.values()))[0]
    lines.append(f"\n`pair` on a {'x'.join(map(str, first['canvas']))} canvas, {first['train_scenes']:,} upright "
                 f"training scenes, {first['scenes']:,} test scenes; mean ± standard deviation over seeds; "
                 f"{', '.join(machines)}, {dates[0]}{' to ' + dates[-1] if len(dates) > 1 else ''}; each row's "
                 "command in the CSV; all of them: `python scripts/research/wide_pair.py run --data-dir DATA/mnist "
                 "--output RUNS/wide_pair` (resumable).")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("run", "table"), help="run: the jobs not yet in --results; table: print it")
    parser.add_argument("--data-dir", help="MNIST folder (IDX files)")
    parser.add_argument("--output", help="checkpoints (outside the repository)")
    parser.add_argument("--results", default=str(RESULTS), help="the results table (CSV)")
    parser.add_argument("--rows", nargs="+", choices=[row.name for row in ROWS], help="only these rows (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--steps", type=int, default=STEPS, help="training steps of the SC rows")
    parser.add_argument("--canvas", type=local_rotation.parse_canvas, default=CANVAS, metavar="HxW")
    parser.add_argument("--train-scenes", type=int, default=decision_table.LOCAL_SCENES)
    parser.add_argument("--test-scenes", type=int, default=decision_table.LOCAL_TEST_SCENES)
    parser.add_argument("--channels", type=int, nargs=6, metavar="C",
                        help="every row's six channel counts (multiples of 8; default: each model's own)")
    parser.add_argument("--data-seed", type=int, default=42)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    args.command = "python scripts/research/wide_pair.py " + " ".join(
        map(shlex.quote, sys.argv[1:] if argv is None else argv))
    if args.action == "table":
        print(table(args.results))
        return
    if not args.data_dir or not args.output:
        parser.error("run needs --data-dir (the MNIST folder) and --output (a folder outside the repository)")
    args.canvas = local_rotation.canvas_size(args.canvas)
    if args.steps < 1 or args.train_scenes < decision_table.BATCH or args.test_scenes < 1:
        parser.error(f"--steps must be >= 1, --train-scenes >= {decision_table.BATCH}, --test-scenes >= 1")
    os.makedirs(args.output, exist_ok=True)
    run_all(args)


if __name__ == "__main__":
    run(main)
