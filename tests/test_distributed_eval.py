"""scripts/train.py under torchrun: the validation accuracy it prints, the one it records (summary.csv, the ranked
checkpoints, ``model_best``) and the one a single process computes for the same weights on the same images are one
number; so are the training loss it prints and the one it records, also after a run killed mid-epoch is resumed.

Two CPU processes (gloo) train a 4-channel SCNN for two epochs on 200 images of the MNIST sample in the package and
validate on 101 of its validation images: 101 is odd, so timm's ordered distributed sampler pads the second process's
shard with a repeated image, which must not count, and each process's shard has its own accuracy and loss, which
must not be the ones printed.
"""
import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from timm_sortconv.cli import validate as validate_tool
from timm_sortconv.data import mnist_sample_dir

REPO = Path(__file__).resolve().parents[1]
TINY_SCNN = ["--model", "scnn_p_rs_3", "--model-kwargs", "channels=(4,4,4,4,4,4)"]
VAL_SAMPLES, SEED, EPOCHS = 101, 7, 2
# the last progress line of a validation: "Test: [   6/6]  Loss: ...  Acc@1: 40.594  Acc@5: ..."
FINAL_LINE = re.compile(r"Test: \[\s*(\d+)/\1\]\s+Loss: \S+\s+Acc@1: (\S+)")


def torchrun(output, experiment, *extra):
    """The command line of a two-process run into ``output/experiment``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(REPO / "scripts" / "train.py"), "--device", "cpu", *TINY_SCNN, "--dataset", "sortconv/mnist",
            "--data-dir", str(mnist_sample_dir()), "--train-split", "train", "--train-samples", "200",
            "--val-split", "validation", "--val-samples", str(VAL_SAMPLES), "--epochs", str(EPOCHS), "-b", "10",
            "-vb", "10", "--lr", "3e-2", "--seed", str(SEED), "-j", "0", "--log-interval", "2",
            "--checkpoint-hist", str(EPOCHS), "--output", str(output), "--experiment", experiment, *extra]


ENV = dict(os.environ, OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("runs")
    result = subprocess.run(torchrun(output, "ddp", "--recovery-interval", "0"), capture_output=True, text=True,
                            timeout=300, cwd=REPO, env=ENV)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return output / "ddp", log


def single_process_top1(checkpoint: Path) -> float:
    """validate.py, one process, on the validation images the run used (the same seeded slice)."""
    results = validate_tool.main([*TINY_SCNN, "--checkpoint", str(checkpoint), "--dataset", "sortconv/mnist",
                                  "--data-dir", str(mnist_sample_dir()), "--split", "validation", "--samples",
                                  str(VAL_SAMPLES), "--seed", str(SEED), "-j", "0", "-b", "32"])
    (per_angle,) = results.values()
    return per_angle[0.0]


@pytest.mark.slow
def test_printed_recorded_and_single_process_accuracy_agree(ddp_run):
    run_dir, log = ddp_run
    assert "process 0 of 2" in log and "process 1 of 2" in log
    printed = [float(top1) for _, top1 in FINAL_LINE.findall(log)]
    with open(run_dir / "summary.csv") as f:
        recorded = [float(row["eval_top1"]) for row in csv.DictReader(f)]
    assert len(printed) == len(recorded) == EPOCHS
    ranked = {}
    for epoch in range(EPOCHS):
        checkpoint = torch.load(run_dir / f"checkpoint-{epoch}.pth.tar", map_location="cpu", weights_only=False)
        ranked[epoch] = checkpoint["metric"]
        single = single_process_top1(run_dir / f"checkpoint-{epoch}.pth.tar")
        # each image counted once: a whole number of the 101 images
        assert round(single * VAL_SAMPLES / 100) == pytest.approx(single * VAL_SAMPLES / 100, abs=1e-6)
        assert recorded[epoch] == pytest.approx(single, abs=1e-9), epoch
        assert ranked[epoch] == pytest.approx(single, abs=1e-9), epoch
        assert printed[epoch] == pytest.approx(single, abs=5e-4), epoch  # printed to 3 decimals
    best = torch.load(run_dir / "model_best.pth.tar", map_location="cpu", weights_only=False)
    assert best["metric"] == max(ranked.values())
    assert f"*** Best metric: {max(ranked.values())}" in log


@pytest.mark.slow
def test_printed_and_recorded_training_loss_agree(ddp_run):
    run_dir, log = ddp_run
    # "Train: 1 [  10/10 (100%)]  Loss: 2.27 (2.31)  ...": the epoch's running mean after its last batch
    printed = [float(mean) for _, mean in re.findall(r"Train: \d+ \[\s*(\d+)/\1 \(100%\)\]\s+Loss: \S+ \((\S+)\)", log)]
    with open(run_dir / "summary.csv") as f:
        recorded = [float(row["train_loss"]) for row in csv.DictReader(f)]
    assert len(printed) == len(recorded) == EPOCHS
    assert printed == [float(f"{loss:#.3g}") for loss in recorded]


def descendants(pid):
    """The ids of the processes below ``pid`` (from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


@pytest.mark.slow
def test_killed_mid_epoch_resumes_to_the_straight_run(ddp_run, tmp_path):
    """Both processes killed after a recovery checkpoint, then resumed: the straight run's weights and summary, bit
    for bit (each process goes on from its own loss sum)."""
    straight_dir, _ = ddp_run
    run_dir = tmp_path / "killed"
    command = torchrun(tmp_path, "killed", "--recovery-interval", "3")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO, env=ENV,
                               start_new_session=True)
    deadline = time.time() + 240
    while not list(run_dir.glob("recovery-*.pth.tar")) and time.time() < deadline and process.poll() is None:
        time.sleep(0.01)
    # torchrun's workers run in sessions of their own: kill them by id, then torchrun
    workers = descendants(process.pid)
    for pid in [*workers, process.pid]:
        os.kill(pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL and workers, "training finished before it could be killed"
    result = subprocess.run(command + ["--resume", str(run_dir)], capture_output=True, text=True, timeout=300,
                            cwd=REPO, env=ENV)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert "resuming at batch" in log
    with open(run_dir / "summary.csv") as f:
        resumed = list(csv.DictReader(f))
    with open(straight_dir / "summary.csv") as f:
        straight = list(csv.DictReader(f))
    for ours, theirs in zip(resumed, straight, strict=True):
        ours.pop("train_seconds"), theirs.pop("train_seconds")
        assert ours == theirs
    ours, theirs = (torch.load(d / "last.pth.tar", map_location="cpu", weights_only=False)["state_dict"]
                    for d in (run_dir, straight_dir))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
