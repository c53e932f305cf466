"""When should a user pick SC? Every row of RESULTS.md's decision table, trained and measured by one rule.

The question a user with a rotation problem asks first is whether a plain CNN with rotation augmentation,
or with the canonical turn, or an E(2)-CNN, would do as well. This script answers it on MNIST at three
training-set sizes, with the networks laid out as the paper's SCNN (:data:`ROWS`):

* **Training** (one rule for every row): a seeded slice of ``N`` upright images of MNIST's 50,000-image training
  split (``--sizes``, default 1,000, 5,000 and 50,000; seed 42, so the smaller slices lie inside the larger),
  the same number of optimizer steps whatever ``N`` (``--steps``, default 1,000 of batch 50: 1 epoch of 50,000
  images, 10 of 5,000, 50 of 1,000), Adam at 2e-3 decayed to zero by a cosine over the steps (ablation.py's
  recipe), the last weights kept. Rows with ``augment`` turn each training image by its own angle drawn
  uniformly from [0, 360) (bilinear, zero fill, rounded to 8 bits as MNIST-rot's images are). A row with
  ``time_of`` (the E(2)-CNN) trains for the time its named row takes: its steps are ``--steps`` times the
  ratio of the two rows' step times, measured in one process taking turns (``decision_timing.json``).
* **Seeds**: ``--seeds`` (default 0 1 2) at every size below 50,000, seed 0 at 50,000 (``--big-seeds``).
* **Measured** per run: MNIST-rot on a fixed slice of ``--sweep-samples`` test images (seed 42, as
  ablation.py) turned by 0, 10, ..., 350 degrees as MNIST-rot is made: mean, worst angle, with standard errors
  over images; at the largest size, upright MNIST on all 10,000 test images.
* **Local rotations** (the ``one`` task of ``local_rotation.py``: one digit at a random place on a 56x56 canvas,
  turned about its own centre at test time): per row one training seed on 10,000 upright scenes for one epoch
  (200 steps; a ``time_of`` row its time), augmented rows with the whole canvas turned; measured on 1,000
  test scenes: mean over 12 turns and what it keeps of the upright accuracy (``retained``).
* **Time**: ``decision_timing.json`` (beside the results table) holds every row's training step (batch 50, one
  thread), the minimum of interleaved rounds on this machine, with the CPU and the load average; ``s/epoch`` is
  that times the 1,000 steps of an epoch of 50,000 images.

**The attempts** (rows with ``attempt``, at most two rounds): SC configurations meant to beat the augmented plain
CNN and the E(2)-CNN at the smallest size (:data:`RIVALS`); they run at that size only, and on the local task,
and have a table of their own (:func:`attempts_table`).

**The aligned convolution** (rows with ``aligned``, :data:`ALIGNED_TASKS`): SC's sorting replaced by turning each
window back by its own orientation (``sorting="align"``, ``"align-channel"``), in P-RS-7's layout, at most two
rounds of at most three variants, and a third round of the guided network (``scnn_p_align_7_guided``). Each variant runs at the smallest size and on both local tasks (``one``, and
``pair``: two digits, the label their sum, 19 classes), seeds 0, 1 and 2, with the SC rows' steps; the E(2)-CNN row
runs both local tasks with those seeds too. :func:`aligned_table` sets each against :data:`ALIGNED_RIVALS`.

**Equal parameters**: the E(2)-CNN with the SCNN's channels has 17x fewer parameters than the SCNN; with 4x the
channels it has about as many, and a training step 8.7x P-RS-7's, so it runs at P-RS-7's time (115 steps) and
at the smallest size only (a row with ``sizes``).

Runs are jobs, done in a fixed order (every row at 1,000 images first, seed by seed, then 5,000, then 50,000,
then the local task, then the rows with ``sizes``), each adding its row to the table ``--results`` (one CSV,
:class:`~timm_sortconv.cli.records.RecordTable`: the row's name, the job's name as ``job``, ``mnist_rot.*`` and
``machine.*`` in columns); a job whose row is there is skipped. Training checkpoints every ``--checkpoint-every``
steps under ``--output`` (outside the repository), so a killed run goes on from its last checkpoint when the same
command runs again, and ends with the weights an uninterrupted run has. Several processes may share the work (``run`` in each): a job is claimed by a lock
file under ``--output``, freed when its process has died.

Example (``DATA``: the MNIST folder; ``RUNS``: a folder outside the repository)::

    python scripts/research/decision_table.py run --data-dir DATA --output RUNS/decision
    python scripts/research/decision_table.py table
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import local_rotation
from ablation import create_model, load_split, rotated_sweep, summarise, sweep_correct
from timm_sortconv.check import cpu_model
from timm_sortconv.cli import run
from timm_sortconv.cli.records import RecordTable
from timm_sortconv.rotation import rotate_each

RESULTS = Path(__file__).resolve().parent / "results" / "decision.csv"
BATCH = 50
LR = 2e-3
ANGLES = [float(a) for a in range(0, 360, 10)]
LOCAL_SCENES, LOCAL_TEST_SCENES, LOCAL_STEPS = 10_000, 1_000, 200
EPOCH_IMAGES = 50_000  # "s/epoch": an epoch of MNIST's training split


@dataclass(frozen=True)
class Row:
    """One network and how it is trained: ``model`` and ``kwargs`` as ablation.py's ``create_model`` takes
    them, ``augment``: turned training images, ``time_of``: train for the time of that row (steps scaled)."""

    name: str
    model: str
    kwargs: Dict = field(default_factory=dict)
    augment: bool = False
    time_of: Optional[str] = None
    what: str = ""
    attempt: int = 0  # 0: a row of the table; 1, 2: a round of attempts at an SC model that beats the others
    sizes: Tuple[int, ...] = ()  # only at these training-set sizes, after every other job (empty: all, and local)
    aligned: int = 0  # 1, 2, 3: a round of the aligned convolution's variants (ALIGNED_TASKS, ALIGNED_SEEDS)


ROWS = (
    Row("plain", "scnn_baseline_7", what="plain CNN (`scnn_baseline_7`)"),
    Row("plain+aug", "scnn_baseline_7", augment=True, what="plain CNN + rotation augmentation"),
    Row("plain+canon", "scnn_baseline_7", {"canonicalize": "moment1"},
        what="plain CNN + the canonical turn (`canonicalize=moment1`)"),
    Row("p_rs_7", "scnn_p_rs_7", what="SC, the paper's P-RS-7 (`scnn_p_rs_7`)"),
    Row("p_rs_7_blur", "scnn_p_rs_7_blur", what="SC with blur (`scnn_p_rs_7_blur`)"),
    Row("p_c2_7_canon", "scnn_p_c2_7_canon", what="SC, half-turn orbits + the turn (`scnn_p_c2_7_canon`)"),
    Row("p_c2_7_canon+aug", "scnn_p_c2_7_canon", augment=True, what="`scnn_p_c2_7_canon` + rotation augmentation"),
    Row("e2cnn_c8", "e2cnn", {"channels": [32, 32, 64, 64, 128, 128]}, time_of="p_rs_7",
        what="E(2)-CNN C8, the SCNN's channels, trained for P-RS-7's time"),
    # Equal parameters (the module docstring's **Equal parameters**): at P-RS-7's time, the smallest size only.
    Row("e2cnn_c8_params", "e2cnn", {"channels": [128, 128, 256, 256, 512, 512]}, time_of="p_rs_7", sizes=(1000,),
        what="E(2)-CNN C8 with P-RS-7's parameters (4x the channels), trained for P-RS-7's time"),
    # The attempts: SC configurations meant to beat the augmented plain CNN and the E(2)-CNN at 1,000 images
    # (SCNN's ``sorted_convs``: SC in the first convolutions only, plain ones after).
    Row("sc2+canon", "scnn_p_rs_7", {"canonicalize": "moment1", "sorted_convs": 2}, attempt=1,
        what="SC in the first 2 convolutions, plain after, + the canonical turn (`scnn_p_rs_7_early_canon`)"),
    Row("sc2+aug", "scnn_p_rs_7", {"sorted_convs": 2}, augment=True, attempt=1,
        what="SC in the first 2 convolutions, plain after, + rotation augmentation"),
)
# The aligned convolution (sorting="align"/"align-channel": each window turned back by its own orientation, in
# the P-RS-7 layout): at most two rounds of at most three variants, each on MNIST-rot after 1,000 images and on
# both local tasks, seeds 0, 1, 2 (the module docstring's **The aligned convolution**).
ROWS += (
    Row("align", "scnn", {"sorting": "align"}, aligned=1,
        what="aligned convolution, one orientation per position (`sorting=align`), every layer"),
    Row("align-channel", "scnn", {"sorting": "align-channel"}, aligned=1,
        what="aligned convolution, one orientation per channel (`sorting=align-channel`), every layer"),
    Row("align+blur", "scnn", {"sorting": "align", "input_blur": 0.7, "downsample": "blur-max"}, aligned=1,
        what="`sorting=align` with `scnn_p_rs_7_blur`'s blur before the first layer and blurred max pooling"),
    # Round 2, after round 1 fell 2.5-3 points short of sc2+canon on MNIST-rot at seed 0 (93.6-94.2): the windows
    # turned by the input's mass at a digit's parts' scale (the library's guide, timm_sortconv.guide, a 4-pixel blur:
    # scnn_p_align_7_guided), which keeps the relative orientation of a part's windows; and the aligned analogue of
    # the table's best row.
    Row("align+guide", "scnn", {"sorting": "align", "guide_blur": 4.0}, aligned=2,
        what="`sorting=align`, every window turned by the blurred input's orientation (`scnn_p_align_7_guided`)"),
    Row("align2+canon", "scnn", {"sorting": "align", "sorted_convs": 2, "canonicalize": "moment1"}, aligned=2,
        what="aligned in the first 2 convolutions, plain after, + the canonical turn (as `sc2+canon`)"),
    # An 8-pixel blur's orientation is the first angular moment of the mass within about a digit's radius (14):
    # the canonical turn of each digit-sized neighbourhood, where a whole image's turn cannot follow its parts.
    Row("align+guide8", "scnn", {"sorting": "align", "guide_blur": 8.0}, aligned=2,
        what="`sorting=align`, every window turned by the mass around it at a digit's scale (`guide_blur=8`)"),
    # Round 3, the guided network (scnn_p_align_7_guided) on whole images: at 1,000 images it reads upright digits as
    # well as sc2+canon nearly (96.1 against 96.7, seed 0) but dips by 2.5 points between the quarter turns, where
    # every layer's polar samples are interpolated; the canonical turn in front leaves it only the residue of each
    # turn (its windows still follow the parts); then with the grid's own samples (square), and with a guide that
    # also carries the canonical orientation where the blurred mass is flat (`guide_ramp`, timm_sortconv.guide).
    Row("guide+canon", "scnn", {"sorting": "align", "guide_blur": 4.0, "canonicalize": "moment1"}, aligned=3,
        what="`scnn_p_align_7_guided` + the canonical turn (`canonicalize=moment1`)"),
    Row("guide+canon-square", "scnn", {"sampling": "square", "sorting": "align", "guide_blur": 4.0,
                                       "canonicalize": "moment1"}, aligned=3,
        what="the same with square sampling (the grid's samples, no interpolation)"),
    Row("guide+canon+ramp", "scnn", {"sorting": "align", "guide_blur": 4.0, "canonicalize": "moment1",
                                     "guide_ramp": 0.02}, aligned=3,
        what="`guide+canon` with the canonical orientation in the guide (a ramp of 0.02 a pixel)"),
)
ROW_NAMES = tuple(row.name for row in ROWS)
#: The aligned rounds' tasks and seeds, and the rows they are compared with there (the E(2)-CNN on the local tasks
#: runs these seeds and tasks too).
ALIGNED_TASKS, ALIGNED_SEEDS = ("one", "pair"), (0, 1, 2)
ALIGNED_RIVALS = {"one": "e2cnn_c8", "pair": "e2cnn_c8", "mnist": "sc2+canon"}
#: The rows the attempts must beat, and one more they are compared with (the canonical turn alone).
RIVALS = ("plain+aug", "e2cnn_c8")
ALSO_COMPARED = ("plain+canon",)


@dataclass(frozen=True)
class Job:
    row: Row
    size: int  # training images; 0: a local-rotation task
    seed: int
    task: str = "one"  # with size 0: the local task of local_rotation.py ("one" or "pair")

    @property
    def name(self) -> str:
        return f"{self.task}_seed{self.seed}" if self.size == 0 else f"n{self.size}_seed{self.seed}"


def jobs(rows: Sequence[Row], sizes: Sequence[int], seeds: Sequence[int], big_seeds: Sequence[int],
         local: bool) -> List[Job]:
    """Every job, in the order of the module docstring (the attempts at the smallest size only, the rows with
    ``sizes`` last)."""
    found = []
    everywhere = [row for row in rows if not row.sizes and not row.aligned]
    for size in sorted(sizes):
        for seed in (big_seeds if size >= EPOCH_IMAGES else seeds):
            found += [Job(row, size, seed) for row in everywhere if not row.attempt or size == min(sizes)]
    if local:
        found += [Job(row, 0, 0) for row in everywhere]
    for row in rows:
        for size in sorted(set(row.sizes) & set(sizes)):
            found += [Job(row, size, seed) for seed in (big_seeds if size >= EPOCH_IMAGES else seeds)]
    # The aligned rounds, seed by seed: their local rivals' jobs first, then each round's rows on every task.
    rivals = [row for row in rows if row.name in set(ALIGNED_RIVALS.values()) and row.name != ALIGNED_RIVALS["mnist"]]
    for seed in ALIGNED_SEEDS:
        for task in ALIGNED_TASKS if local else ():
            found += [Job(row, 0, seed, task) for row in rivals if not (task == "one" and seed == 0)]
    for round_ in sorted({row.aligned for row in rows if row.aligned}):
        for seed in ALIGNED_SEEDS:
            for row in (row for row in rows if row.aligned == round_):
                found.append(Job(row, min(sizes), seed))
                found += [Job(row, 0, seed, task) for task in (ALIGNED_TASKS if local else ())]
    return found


def normalise(images: torch.Tensor, cfg: dict) -> torch.Tensor:
    """uint8 ``(N, H, W)`` -> the model's normalised ``(N, 1, H, W)`` input."""
    return (images.float().unsqueeze(1) / 255 - cfg["mean"][0]) / cfg["std"][0]


def turned(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each uint8 image turned by its own uniform angle in [0, 360), rounded to 8 bits."""
    angles = torch.rand(len(images), generator=generator, dtype=torch.float64) * 360
    out = rotate_each(images.float().unsqueeze(1), angles).round().clamp(0, 255)
    return out.squeeze(1).to(torch.uint8)


class Trainer:
    """The training rule of the module docstring, one step at a time, resumable from a checkpoint: batch ``b``
    of epoch ``e`` is fixed by the seed (the order), and so is an augmented batch's angles (by the step)."""

    def __init__(self, model, images: torch.Tensor, labels: torch.Tensor, steps: int, seed: int, augment: bool):
        self.model, self.images, self.labels = model, images, labels
        self.steps, self.seed, self.augment = steps, seed, augment
        self.optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        self.per_epoch = max(1, len(images) // BATCH)
        self.step, self.seconds = 0, 0.0
        self._order: Tuple[int, torch.Tensor] = (-1, torch.empty(0))

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        epoch, b = divmod(step, self.per_epoch)
        if self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            self._order = (epoch, torch.randperm(len(self.images), generator=generator))
        idx = self._order[1][b * BATCH:(b + 1) * BATCH]
        images = self.images[idx]
        if self.augment:
            images = turned(images, torch.Generator().manual_seed(self.seed * 1_000_003 + step))
        return images, self.labels[idx]

    def train_step(self) -> float:
        images, labels = self.batch(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.5 * LR * (1 + math.cos(math.pi * self.step / self.steps))
        self.model.train()
        loss = F.cross_entropy(self.model(normalise(images, self.model.pretrained_cfg)), labels)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.step += 1
        return loss.item()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                "seconds": self.seconds}

    def load(self, state: dict) -> None:
        # The checkpoint was written in training mode; e2cnn's convolutions hold an expanded ``filter`` buffer
        # only in eval mode, so the model must be in the same mode to take the same keys.
        self.model.train()
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.seconds = state["step"], state["seconds"]

    def run(self, checkpoint: Optional[Path], every: int, log_every: int = 100) -> None:
        if checkpoint is not None and checkpoint.is_file():
            self.load(torch.load(checkpoint, weights_only=False))
            print(f"  resumed at step {self.step}/{self.steps} from {checkpoint}", flush=True)
        while self.step < self.steps:
            start = time.perf_counter()
            loss = self.train_step()
            self.seconds += time.perf_counter() - start
            if self.step % log_every == 0 or self.step == self.steps:
                print(f"  step {self.step}/{self.steps} loss {loss:.4f} ({self.seconds / self.step:.3f} s/step)",
                      flush=True)
            if checkpoint is not None and (self.step % every == 0) and self.step < self.steps:
                temporary = checkpoint.with_suffix(".tmp")
                torch.save(self.state(), temporary)
                os.replace(temporary, checkpoint)


def machine() -> Dict:
    """The CPU, its widest vector extension, and the load average (the seconds depend on all three)."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    isa = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags else "other"
    return {"cpu": cpu_model(), "isa": isa, "threads": torch.get_num_threads(), "load_average": list(os.getloadavg())}


def build(row: Row, classes: int = 10, in_chans: Optional[int] = None, channels: Optional[Sequence[int]] = None
          ) -> torch.nn.Module:
    """The row's network; ``channels`` (``--channels``) replaces every row's channel counts."""
    kwargs = dict(row.kwargs)
    if channels:
        kwargs["channels"] = list(channels)
    if classes != 10:
        kwargs["num_classes"] = classes
    if in_chans is not None and row.model != "e2cnn":
        kwargs["in_chans"] = in_chans
    return create_model(row.model, kwargs)


def measure_timing(rows: Sequence[Row], rounds: int, steps: int, channels: Optional[Sequence[int]] = None) -> Dict:
    """Seconds per training step (batch 50) of every row, the minimum over ``rounds`` rounds that take turns
    between the rows (so that a slower minute slows every row alike), each round ``steps`` steps."""
    x = torch.randint(0, 256, (BATCH * 4, 28, 28), dtype=torch.uint8)
    y = torch.randint(0, 10, (BATCH * 4,))
    trainers = {}
    for row in rows:
        torch.manual_seed(0)
        trainers[row.name] = Trainer(build(row, channels=channels), x, y, 10 ** 6, 0, row.augment)
        trainers[row.name].train_step()  # warm-up
    best = {name: float("inf") for name in trainers}
    before = machine()
    for _ in range(rounds):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    return {"seconds_per_step": best, "batch": BATCH, "rounds": rounds, "steps_per_round": steps,
            "machine_before": before, "machine_after": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def timing_path(results: Path) -> Path:
    """The step times' file beside the results table ``results``: ``<table>_timing.json``."""
    return results.with_name(f"{results.stem}_timing.json")


def records(results: Path) -> RecordTable:
    """The results table: one row per job, named by the row's name and the job's (``job``)."""
    return RecordTable(results, key=("row", "job"), spread=("mnist_rot", "machine"))


def timing(results: Path, rows: Sequence[Row], rounds: int = 3, steps: int = 5,
           channels: Optional[Sequence[int]] = None) -> Dict:
    """:func:`timing_path` of ``results``: measured once for ``rows``. Rows missing from a stored file are
    measured (with ``p_rs_7``, whose stored time then scales theirs, so that a busier minute does not move
    them) and added under ``added``; the stored rows' times are kept, since the ``time_of`` rows' steps were
    fixed by them."""
    path = timing_path(results)
    command = "python scripts/research/decision_table.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    stored = json.loads(path.read_text()) if path.is_file() else None
    missing = [row for row in rows if stored is None or row.name not in stored["seconds_per_step"]]
    if not missing:
        return stored
    reference = next(row for row in ROWS if row.name == "p_rs_7")
    if stored is not None and reference.name in stored["seconds_per_step"]:
        print(f"timing the training steps of {', '.join(row.name for row in missing)} against p_rs_7 ...", flush=True)
        result = measure_timing([reference, *[row for row in missing if row is not reference]], rounds, steps, channels)
        scale = stored["seconds_per_step"][reference.name] / result["seconds_per_step"][reference.name]
        for row in missing:
            stored["seconds_per_step"][row.name] = result["seconds_per_step"][row.name] * scale
        stored.setdefault("added", []).append({**{k: v for k, v in result.items() if k != "seconds_per_step"},
                                               "rows": [row.name for row in missing], "scale": scale,
                                               "measured": result["seconds_per_step"], "command": command})
        result = stored
    else:
        print(f"timing the training steps of {', '.join(row.name for row in rows)} ...", flush=True)
        result = dict(measure_timing(rows, rounds, steps, channels), command=command)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


def timing_of(rows: Sequence[Row], args) -> Dict:
    """:func:`timing` for ``rows`` and the rows whose time they train for, with the command line's settings."""
    timed = {name for row in rows for name in (row.name, row.time_of) if name}
    return timing(Path(args.results), [row for row in ROWS if row.name in timed], args.timing_rounds,
                  args.timing_steps, args.channels)


def steps_for(row: Row, base: int, times: Dict) -> int:
    """``base`` steps, or for a ``time_of`` row as many as fit in that row's time for ``base`` steps."""
    if not row.time_of:
        return base
    per_step = times["seconds_per_step"]
    return max(1, round(base * per_step[row.time_of] / per_step[row.name]))


class Claim:
    """A lock file that marks a job as taken by this process (freed on exit, or when its process is gone). It holds
    the process's id and, where ``/proc`` tells it, its start time: after a reboot another process may have the id
    of a dead owner, and the start time tells them apart."""

    def __init__(self, path: Path):
        self.path = path

    def take(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    pid, *start = self.path.read_text().split()
                    owner = (int(pid), start[0] if start else None)
                except (OSError, ValueError):
                    owner = (0, None)
                if owner[0] and _alive(*owner):
                    return False
                self.path.unlink(missing_ok=True)  # its process died: take it over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()} {_started(os.getpid()) or ''}".strip())
            return True
        return False

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def _started(pid: int) -> Optional[str]:
    """The start time of process ``pid`` in clock ticks after boot (``/proc/<pid>/stat``), or None off Linux."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]  # field 22; the name in parentheses may hold spaces


def _alive(pid: int, start: Optional[str] = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    now = _started(pid) if start else None
    return now is None or now == start


def run_job(job: Job, args, times: Dict, data: Dict) -> Dict:
    row = job.row
    torch.manual_seed(job.seed)
    checkpoint = Path(args.output) / row.name / f"{job.name}.pth"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    if job.size == 0:
        train_scenes, test_scenes = data["scenes"][job.task]
        model = build(row, classes=9 * local_rotation.TASKS[job.task] + 1, in_chans=1, channels=args.channels)
        images, labels = data["scene_images"][job.task], train_scenes.labels
        steps = steps_for(row, args.local_steps, times)
    else:
        model = build(row, channels=args.channels)
        images, labels = data["slices"][job.size]
        steps = steps_for(row, args.steps, times)
    params = sum(p.numel() for p in model.parameters())
    print(f"{row.name} {job.name}: {row.model} {row.kwargs} ({params:,} parameters), {len(images):,} images, "
          f"{steps} steps{', augmented' if row.augment else ''}", flush=True)
    trainer = Trainer(model, images, labels, steps, job.seed, row.augment)
    trainer.run(checkpoint, args.checkpoint_every)
    start = time.perf_counter()
    result = {"row": row.name, "job": job.name, "model": row.model, "model_kwargs": row.kwargs, "augment": row.augment,
              "time_of": row.time_of, "seed": job.seed, "params": params, "steps": steps, "batch": BATCH, "lr": LR,
              "train_seconds": round(trainer.seconds, 1), "machine": machine()}
    if job.size == 0:
        result.update(task=job.task, train_scenes=len(images),
                      **local_rotation.evaluate(model, test_scenes, 30.0, args.data_seed))
    else:
        sweep_images, sweep_labels = data["sweep"]
        sweep = summarise(sweep_correct(model, sweep_images, sweep_labels), ANGLES)
        result.update(task="mnist", train_images=job.size, mnist_rot=sweep)
        if job.size == max(args.sizes):  # the table's MNIST column
            upright = sweep_correct(model, data["test"][0].unsqueeze(0), data["test"][1])[:, 0].double()
            result.update(test_images=len(upright), mnist=100 * upright.mean().item(),
                          mnist_se=100 * upright.std(unbiased=True).item() / math.sqrt(len(upright)))
    result["eval_seconds"] = round(time.perf_counter() - start, 1)
    result["command"] = "python scripts/research/decision_table.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    return result


def load_data(args, local_tasks: Sequence[str]) -> Dict:
    data = {"slices": {size: load_split(args.data_dir, "train", size, seed=42)[:2] for size in args.sizes},
            "test": load_split(args.data_dir, "test", args.test_samples, seed=42)[:2],
            "sweep": rotated_sweep(args.data_dir, args.sweep_samples, ANGLES, str(Path(args.output) / "cache")),
            "scenes": {}, "scene_images": {}}
    scene_args = argparse.Namespace(data_dir=args.data_dir, train_scenes=args.local_scenes,
                                    test_scenes=args.local_test_scenes, canvas=56, seed=args.data_seed)
    for task in local_tasks:
        data["scenes"][task] = local_rotation.load_scenes(scene_args, task)
        data["scene_images"][task] = local_rotation.render(data["scenes"][task][0])
    return data


def run_all(args) -> None:
    rows = [row for row in ROWS if not args.rows or row.name in args.rows]
    if any(row.model == "e2cnn" for row in rows) and importlib.util.find_spec("e2cnn") is None:
        print("e2cnn is not installed (pip install -e '.[research]'): the E(2)-CNN's jobs are skipped", flush=True)
        rows = [row for row in rows if row.model != "e2cnn"]
    table = records(Path(args.results))
    torch.set_num_threads(args.threads)
    times = timing_of(rows, args)
    done = {(r["row"], r["job"]) for r in table.records()}
    todo = [job for job in jobs(rows, args.sizes, args.seeds, args.big_seeds, not args.no_local)
            if (job.row.name, job.name) not in done and (job.size == 0 or not args.only_local)]
    if not todo:
        print("every job is done")
        return
    data = load_data(args, sorted({job.task for job in todo if job.size == 0}))
    for job in todo:
        claim = Claim(Path(args.output) / "claims" / f"{job.row.name}-{job.name}")
        if not claim.take():
            continue
        try:
            if table.find(row=job.row.name, job=job.name) is not None:  # done by another process meanwhile
                continue
            result = run_job(job, args, times, data)
            table.put(result)
            summary = (f"MNIST-rot {result['mnist_rot']['mean']:.2f}, worst {result['mnist_rot']['worst']:.2f}"
                       + (f", MNIST {result['mnist']:.2f}" if "mnist" in result else "") if job.size else
                       f"{job.task}: turns {result['mean']:.2f}, upright {result['upright']:.2f}, "
                       f"retained {result['retained']:.3f}")
            print(f"  {summary} ({result['train_seconds']:.0f} s training)", flush=True)
        finally:
            claim.release()


def _mean_se(values: Sequence[float]) -> Tuple[float, float]:
    """The mean and the standard error between ``values`` (NaN for one value)."""
    values = np.asarray(values, dtype=float)
    return values.mean(), (values.std(ddof=1) / math.sqrt(len(values)) if len(values) > 1 else float("nan"))


def _stats(values: Sequence[float]) -> str:
    mean, se = _mean_se(values)
    return f"{mean:.2f} ± {se:.2f}" if len(values) > 1 else f"{mean:.2f}"


def _step_times(results: Path) -> Dict[str, float]:
    """The stored seconds per training step by row (empty before they are measured)."""
    path = timing_path(results)
    return json.loads(path.read_text())["seconds_per_step"] if path.is_file() else {}


def load_results(results: Path) -> Dict[str, Dict[str, List[Dict]]]:
    """``{row: {"n1000": [seed results], ..., "one": [...]}}``."""
    found: Dict[str, Dict[str, List[Dict]]] = {}
    for result in records(results).records():
        key = result["task"] if result.get("task") in local_rotation.TASKS else f"n{result['train_images']}"
        found.setdefault(result["row"], {}).setdefault(key, []).append(result)
    return found


def table(results: Path, sizes: Sequence[int] = (1000, 5000, 50000)) -> str:
    """The Markdown table: per row and training size the MNIST-rot mean / worst angle (mean over seeds ± the
    standard error between seeds, and the seeds' count), upright MNIST at 50,000, the local task, parameters
    and seconds per epoch of 50,000 images."""
    found = load_results(results)
    times = _step_times(results)
    head = ("| row | " + " | ".join(f"MNIST-rot, {size:,} images: mean / worst (seeds)" for size in sizes)
            + f" | MNIST, {max(sizes):,} | local turns: mean / retained | params | s/epoch |")
    lines = [head, "|---|" + "---|" * (len(sizes) + 4)]
    for row in (row for row in ROWS if not row.attempt and not row.aligned):
        runs = found.get(row.name, {})
        cells = []
        for size in sizes:
            seeds = runs.get(f"n{size}", [])
            cells.append(f"{_stats([r['mnist_rot']['mean'] for r in seeds])} / "
                         f"{_stats([r['mnist_rot']['worst'] for r in seeds])} ({len(seeds)})" if seeds else "-")
        big = runs.get(f"n{max(sizes)}", [])
        one = [r for r in runs.get("one", []) if r["seed"] == 0]  # the table's local column: seed 0
        cells.append(_stats([r["mnist"] for r in big]) if big else "-")
        cells.append(f"{one[0]['mean']:.2f} / {one[0]['retained']:.3f}" if one else "-")
        params = next((r["params"] for r in runs.get(f"n{min(sizes)}", []) + big), None)
        cells.append(f"{params:,}" if params else "-")
        cells.append(f"{times[row.name] * EPOCH_IMAGES / BATCH:.0f}" if row.name in times else "-")
        lines.append(f"| {row.what or row.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attempts_table(results: Path, size: int = 1000) -> str:
    """The attempts (:data:`ROWS` with ``attempt``) at ``size`` images against :data:`RIVALS`: MNIST-rot mean over
    seeds ± the standard error between seeds, each difference with the standard error of the difference
    (``sqrt(se1^2 + se2^2)``), whether the attempt beats every rival by more than two of those, and the
    difference from each row of :data:`ALSO_COMPARED`."""
    found = load_results(results)
    times = _step_times(results)
    rivals = {name: [r["mnist_rot"]["mean"] for r in found.get(name, {}).get(f"n{size}", [])]
              for name in RIVALS + ALSO_COMPARED}
    head = (f"| round | attempt | MNIST-rot, {size:,} images: mean / worst (seeds) | "
            + " | ".join(f"minus `{name}`" for name in RIVALS) + " | beats both by > 2 SE | "
            + " | ".join(f"minus `{name}`" for name in ALSO_COMPARED) + " | local turns: mean / retained | s/epoch |")
    lines = [head, "|---|---|---|" + "---|" * (len(RIVALS) + len(ALSO_COMPARED)) + "---|---|---|"]
    for row in (row for row in ROWS if row.attempt):
        runs = found.get(row.name, {})
        seeds = runs.get(f"n{size}", [])
        means = [r["mnist_rot"]["mean"] for r in seeds]
        cells = [str(row.attempt), row.what or row.name]
        cells.append(f"{_stats(means)} / {_stats([r['mnist_rot']['worst'] for r in seeds])} ({len(seeds)})"
                     if seeds else "-")
        def minus(name: str) -> Optional[bool]:
            """The difference's cell; whether it exceeds two standard errors (None: fewer than 2 seeds)."""
            if len(means) < 2 or len(rivals[name]) < 2:
                cells.append("-")
                return None
            (mean, se), (rival, rival_se) = _mean_se(means), _mean_se(rivals[name])
            error = math.hypot(se, rival_se)
            cells.append(f"{mean - rival:+.2f} ± {error:.2f}")
            return mean - rival > 2 * error

        wins = [minus(name) for name in RIVALS]
        cells.append("-" if None in wins else "yes" if all(wins) else "no")
        for name in ALSO_COMPARED:
            minus(name)
        one = [r for r in runs.get("one", []) if r["seed"] == 0]
        cells.append(f"{one[0]['mean']:.2f} / {one[0]['retained']:.3f}" if one else "-")
        cells.append(f"{times[row.name] * EPOCH_IMAGES / BATCH:.0f}" if row.name in times else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def aligned_table(results: Path, size: int = 1000) -> str:
    """The aligned rounds (:data:`ROWS` with ``aligned``) against :data:`ALIGNED_RIVALS`, per task: the mean over
    seeds ± the standard error between seeds, the difference from the rival with the standard error of the
    difference, and whether it exceeds two of those (the goal: every task); on the local tasks also what the
    row keeps of its upright accuracy (``retained``, the goal: >= 0.98)."""
    found = load_results(results)
    tasks = (("mnist", f"n{size}", f"MNIST-rot, {size:,} images"),) + tuple((t, t, f"`{t}`: mean over turns")
                                                                           for t in ALIGNED_TASKS)

    def means(name: str, key: str) -> List[float]:
        runs = found.get(name, {}).get(key, [])
        return [r["mnist_rot"]["mean"] if key.startswith("n") else r["mean"] for r in runs]

    head = "| round | row | " + " | ".join(f"{title} (seeds) | minus `{ALIGNED_RIVALS[task]}` | > 2 SE"
                                          for task, _, title in tasks) + " | retained (one / pair) |"
    lines = [head, "|---|---|" + "---|---|---|" * len(tasks) + "---|"]
    for row in (row for row in ROWS if row.aligned):
        cells = [str(row.aligned), row.what or row.name]
        for task, key, _ in tasks:
            mine, rival = means(row.name, key), means(ALIGNED_RIVALS[task], key)
            cells.append(f"{_stats(mine)} ({len(mine)})" if mine else "-")
            if len(mine) < 2 or len(rival) < 2:
                cells += ["-", "-"]
                continue
            (mean, se), (other, other_se) = _mean_se(mine), _mean_se(rival)
            error = math.hypot(se, other_se)
            cells += [f"{mean - other:+.2f} ± {error:.2f}", "yes" if mean - other > 2 * error else "no"]
        retained = [np.mean([r["retained"] for r in found.get(row.name, {}).get(t, [])] or [float("nan")])
                    for t in ALIGNED_TASKS]
        cells.append(" / ".join("-" if math.isnan(v) else f"{v:.3f}" for v in retained))
        lines.append("| " + " | ".join(cells) + " |")
    for task in ALIGNED_TASKS:  # the rivals' own rows on the local tasks
        rival = ALIGNED_RIVALS[task]
        runs = found.get(rival, {}).get(task, [])
        if runs:
            lines.append(f"| rival | `{rival}` on `{task}` | {_stats([r['mean'] for r in runs])} ({len(runs)}), "
                         f"retained {np.mean([r['retained'] for r in runs]):.3f} |" + " |" * (3 * len(tasks) - 1))
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("run", "table", "timing"),
                        help="run: the jobs; table: print the tables; timing: only measure the rows' missing step "
                             "times")
    parser.add_argument("--data-dir", help="MNIST folder (IDX files)")
    parser.add_argument("--output", default="output/decision",
                        help="checkpoints, claims and the sweep cache (keep it outside the repository)")
    parser.add_argument("--results", default=str(RESULTS),
                        help="the results table, one row per job (default: results/decision.csv beside this script)")
    parser.add_argument("--rows", nargs="+", choices=ROW_NAMES, help="only these rows (default: all)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 50000])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--big-seeds", type=int, nargs="+", default=[0], help="seeds at 50,000 images")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--local-steps", type=int, default=LOCAL_STEPS)
    parser.add_argument("--local-scenes", type=int, default=LOCAL_SCENES, help="the local task's training scenes")
    parser.add_argument("--local-test-scenes", type=int, default=LOCAL_TEST_SCENES)
    parser.add_argument("--no-local", action="store_true", help="skip the local-rotation task")
    parser.add_argument("--only-local", action="store_true",
                        help="only the local-rotation tasks' jobs (a second process can take the rest with --no-local)")
    parser.add_argument("--sweep-samples", type=int, default=1000, help="MNIST-rot: test images turned 36 ways")
    parser.add_argument("--test-samples", type=int, default=10_000, help="upright MNIST: test images")
    parser.add_argument("--channels", type=int, nargs=6, metavar="C",
                        help="every row's six channel counts (multiples of 8; default: each model's own)")
    parser.add_argument("--data-seed", type=int, default=42)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timing-rounds", type=int, default=3, help="interleaved rounds of the step times")
    parser.add_argument("--timing-steps", type=int, default=5, help="training steps per row and round")
    args = parser.parse_args(argv)
    if args.action == "table":
        print(table(Path(args.results), sorted(args.sizes)) + "\n\n" + attempts_table(Path(args.results),
                                                                                    min(args.sizes))
              + "\n\n" + aligned_table(Path(args.results), min(args.sizes)))
        return
    if args.action == "timing":
        torch.set_num_threads(args.threads)
        timing_of([row for row in ROWS if not args.rows or row.name in args.rows], args)
        return
    if not args.data_dir:
        parser.error("run needs --data-dir (the MNIST folder)")
    if args.only_local and args.no_local:
        parser.error("--only-local and --no-local exclude each other: give one of them, or neither for every job")
    if min(args.sizes) < BATCH or max(args.sizes) > EPOCH_IMAGES:
        parser.error(f"--sizes must lie between {BATCH} and {EPOCH_IMAGES:,}, got {args.sizes}")
    run_all(args)


if __name__ == "__main__":
    run(main)
