"""The training and evaluation tools (scripts/train.py, validate.py, mnist_results.py) end to end on tiny
MNIST-layout data written by the tests.

The SCNN runs at 4 channels per layer so that a run takes a second or two: a straight run writes its
files; a run stopped after one epoch and a run killed mid-epoch (a real process, SIGKILL) both resume
to exactly the straight run's weights and summary; two CPU processes train under torchrun with gloo;
validate.py sweeps rotations of their weights and writes its CSV and plot. Runs that need no process
of their own call the tools' ``main(argv)`` in this process, which saves the interpreter start-up.
"""
import csv
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch
import yaml
from test_data import make_mnist

from timm_sortconv.cli import CommandError
from timm_sortconv.cli import mnist_results as results_tool
from timm_sortconv.cli import train as train_tool
from timm_sortconv.cli import validate as validate_tool

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scripts" / "train.py"
TINY_SCNN = ["--model", "scnn_p_rs_3", "--model-kwargs", "channels=(4,4,4,4,4,4)"]
# Resuming must restore the learning rate of either kind of schedule, so the runs use ones that change it
# (and that do not depend on --epochs, which differs between a stopped run and its resumption).
SCHEDULES = {
    "per-update": ["--sched", "step", "--decay-epochs", "0.5", "--decay-rate", "0.5", "--sched-on-updates"],
    "per-epoch": ["--sched", "step", "--decay-epochs", "1", "--decay-rate", "0.5"],
}


@pytest.fixture(scope="module")
def train():
    return train_tool


@pytest.fixture(scope="module")
def validate():
    return validate_tool


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mnist")
    make_mnist(folder, num_train=96, num_test=24)
    return folder


@pytest.fixture(scope="module")
def output(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def train_args(data_dir, output, experiment, epochs, schedule="per-update"):
    """The tiny run's arguments; ``schedule``: a name in :data:`SCHEDULES` or the schedule's own arguments."""
    schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    return [str(a) for a in (*TINY_SCNN, *schedule, "--dataset", "sortconv/mnist", "--data-dir", data_dir,
                             "--train-split", "trainval", "--val-split", "test", "--epochs", epochs, "-b", 8, "-j", 0,
                             "--seed", 7, "--log-interval", 4, "--recovery-interval", 3, "--output", output,
                             "--experiment", experiment)]


@pytest.fixture(scope="module")
def straight_run(train, data_dir, output):
    train.main(train_args(data_dir, output, "straight", 2))
    return output / "straight"


@pytest.fixture(scope="module")
def straight_per_epoch_run(train, data_dir, output):
    train.main(train_args(data_dir, output, "straight-per-epoch", 2, "per-epoch"))
    return output / "straight-per-epoch"


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def summary(run_dir):
    with open(run_dir / "summary.csv") as f:
        return list(csv.DictReader(f))


def assert_same_training(run_dir, reference_dir):
    # every column but the epochs' running time, which is measured
    ours, theirs = summary(run_dir), summary(reference_dir)
    assert all(float(row["train_seconds"]) > 0 for row in ours)
    assert [{k: v for k, v in row.items() if k != "train_seconds"} for row in ours] == [
        {k: v for k, v in row.items() if k != "train_seconds"} for row in theirs]
    ours, theirs = load(run_dir / "last.pth.tar"), load(reference_dir / "last.pth.tar")
    assert ours["state_dict"].keys() == theirs["state_dict"].keys()
    for key, value in theirs["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    for ours_state, theirs_state in zip(ours["optimizer"]["state"].values(), theirs["optimizer"]["state"].values()):
        for name, value in theirs_state.items():
            assert torch.equal(torch.as_tensor(ours_state[name]), torch.as_tensor(value)), name


@pytest.mark.slow
def test_train_writes_summary_args_and_checkpoints(straight_run):
    run_dir = straight_run
    with open(run_dir / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["epoch"] for row in rows] == ["0", "1"]
    assert set(rows[0]) == {"epoch", "train_loss", "train_seconds", "eval_loss", "eval_top1", "eval_top5", "lr"}
    assert all(0 <= float(row["eval_top1"]) <= 100 and float(row["train_loss"]) > 0 for row in rows)
    args = yaml.safe_load((run_dir / "args.yaml").read_text())
    assert args["model"] == "scnn_p_rs_3" and args["epochs"] == 2 and args["no_aug"] is True
    assert (run_dir / "model_best.pth.tar").is_file()
    assert not list(run_dir.glob("recovery-*")), "recovery checkpoints outlive their epoch"
    last = load(run_dir / "last.pth.tar")
    assert last["epoch"] == 1 and last["task_state"]["progress"] == dict(epoch=2, batch=0, loss_sum=0.0, loss_count=0,
                                                                           seconds=0.0)
    model = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4))
    model.load_state_dict(last["state_dict"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_resume_after_an_epoch_matches_the_straight_run(train, straight_run, data_dir, output, caplog, schedule,
                                                        request):
    reference = straight_run if schedule == "per-update" else request.getfixturevalue("straight_per_epoch_run")
    stopped = f"stopped-{schedule}"
    train.main(train_args(data_dir, output, stopped, 1, schedule))
    with caplog.at_level(logging.INFO):
        train.main(train_args(data_dir, output, stopped, 2, schedule) + ["--resume", str(output / stopped)])
    assert "training epochs 1..1" in caplog.text
    # timm-style progress lines with throughput and time left.
    assert "Train: 1 [  12/12 (100%)]" in caplog.text and "/s" in caplog.text and "ETA: epoch" in caplog.text
    assert_same_training(output / stopped, reference)
    with open(output / stopped / "summary.csv") as f:
        rates = [float(row["lr"]) for row in csv.DictReader(f)]
    assert rates[1] < rates[0]


@pytest.mark.slow
def test_summary_records_the_rate_timm_records(train, straight_per_epoch_run, data_dir, output):
    """summary.csv's ``lr`` is timm's train.py's: the optimizer's rate after the epoch's updates, before the per-epoch
    step. A per-update cosine schedule (the demo's) records the rate each epoch ended at, which the checkpoint
    written after the epoch holds, not the rate the epoch started at; a per-epoch schedule records the rate its
    epoch ran at. Resumed runs record the same (the resume tests compare every column)."""
    start = 1e-4  # --lr's default
    cosine = ["--sched", "cosine", "--sched-on-updates"]
    train.main(train_args(data_dir, output, "cosine", 2, cosine) + ["--keep-epochs", "1", "2"])
    recorded = [float(row["lr"]) for row in summary(output / "cosine")]
    ended = [load(output / "cosine" / f"epoch-{n}.pth.tar")["optimizer"]["param_groups"][0]["lr"] for n in (1, 2)]
    assert recorded == ended
    # 12 updates an epoch over 24: half-way down the cosine after the first epoch, at its floor (--min-lr 0) after
    # the second
    assert recorded == pytest.approx([start / 2, 0.0], abs=1e-12)

    per_epoch = [float(row["lr"]) for row in summary(straight_per_epoch_run)]
    assert per_epoch == pytest.approx([start, start / 2], abs=1e-12)  # --decay-epochs 1 --decay-rate 0.5


@pytest.mark.slow
def test_killed_mid_epoch_resumes_to_the_same_result(train, straight_run, data_dir, output, caplog):
    command = [sys.executable, str(TRAIN), *train_args(data_dir, output, "killed", 2)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    deadline = time.time() + 240
    while not list((output / "killed").glob("recovery-*.pth.tar")) and time.time() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL, "training finished before it could be killed"
    # The epoch's seconds before the kill travel in the checkpoint and count in its summary row: mark them.
    resume_from = train.find_resume_checkpoint(str(output / "killed"))
    checkpoint = load(resume_from)
    progress = checkpoint["task_state"]["progress"]
    assert progress["batch"] > 0 and progress["seconds"] > 0
    progress["seconds"] += 1000.0
    torch.save(checkpoint, resume_from)
    with caplog.at_level(logging.INFO):
        train.main(train_args(data_dir, output, "killed", 2) + ["--resume", str(output / "killed")])
    assert "resuming at batch" in caplog.text
    assert_same_training(output / "killed", straight_run)
    seconds = [float(row["train_seconds"]) for row in summary(output / "killed")]
    assert seconds[progress["epoch"]] > 1000 and min(seconds) < 1000, seconds


@pytest.mark.slow
def test_bfloat16_autocast_and_channels_last_train_like_float32(train, straight_run, data_dir, output):
    train.main(train_args(data_dir, output, "amp", 1) + ["--amp", "--amp-dtype", "bfloat16", "--channels-last"])

    def first_epoch(run_dir):
        with open(run_dir / "summary.csv") as f:
            return next(csv.DictReader(f))

    amp, reference = first_epoch(output / "amp"), first_epoch(straight_run)
    assert float(amp["train_loss"]) == pytest.approx(float(reference["train_loss"]), rel=0.02)
    assert float(amp["train_loss"]) != float(reference["train_loss"])  # it did compute in bfloat16


@pytest.fixture(scope="module")
def ddp_run(data_dir, output):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN),
               "--device", "cpu", *train_args(data_dir, output, "ddp", 1)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    return output / "ddp", log


@pytest.mark.slow
def test_torchrun_two_cpu_processes_with_gloo(ddp_run):
    run_dir, log = ddp_run
    assert "process 0 of 2" in log and "process 1 of 2" in log
    assert "Train: 0 [   6/6 (100%)]" in log  # 96 images, 8 per batch, shared by two processes
    with open(run_dir / "summary.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["0"]
    assert (run_dir / "last.pth.tar").is_file() and (run_dir / "args.yaml").is_file()


@pytest.mark.slow
def test_validate_sweep_writes_csv_and_plot(validate, ddp_run, data_dir, tmp_path, capsys, caplog):
    run_dir, _ = ddp_run
    results_csv, plot = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    validate.main([str(a) for a in (*TINY_SCNN, "--checkpoint", run_dir / "last.pth.tar",
                                    "--baseline-model", "scnn_baseline_3", "--dataset", "sortconv/mnist",
                                    "--data-dir", data_dir, "--split", "test", "--rotations", "0:360:90",
                                    "-j", 0, "-b", 8, "--results-csv", results_csv, "--plot", plot)])
    with open(results_csv) as f:
        rows = list(csv.DictReader(f))
    assert [row["angle"] for row in rows] == ["0", "90", "180", "270"]
    assert set(rows[0]) == {"angle", "scnn_p_rs_3", "scnn_baseline_3"}
    sc = [float(row["scnn_p_rs_3"]) for row in rows]
    # An SCNN is exactly invariant to quarter turns: the same accuracy at every one.
    assert sc == [sc[0]] * 4
    # At angle 0 one process over the saved weights agrees with the validation the two processes shared.
    with open(run_dir / "summary.csv") as f:
        (summary,) = list(csv.DictReader(f))
    assert sc[0] == pytest.approx(float(summary["eval_top1"]))
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["angle", "scnn_p_rs_3", "scnn_baseline_3"] and table[-1].split()[0] == "mean"
    assert "no weights given" in caplog.text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000

    # An earlier CSV is drawn beside a new evaluation without re-evaluating it, and --label names the model.
    plot2 = tmp_path / "compared.png"
    again = validate.main([str(a) for a in (*TINY_SCNN, "--checkpoint", run_dir / "last.pth.tar", "--label", "mine",
                                            "--dataset", "sortconv/mnist", "--data-dir", data_dir, "--split", "test",
                                            "--rotations", "0:360:90", "-j", 0, "-b", 8, "--compare-csv", results_csv,
                                            "--plot", plot2, "--results-csv", tmp_path / "mine.csv")])
    assert list(again) == ["mine"] and again["mine"] == dict(zip([0.0, 90.0, 180.0, 270.0], sc))
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["angle", "mine", "scnn_p_rs_3", "scnn_baseline_3"]
    assert plot2.stat().st_size > 10_000
    with open(tmp_path / "mine.csv") as f:  # only what was evaluated now
        assert next(csv.reader(f)) == ["angle", "mine"]
    with pytest.raises(CommandError, match="angles"):
        validate.main([str(a) for a in (*TINY_SCNN, "--dataset", "sortconv/mnist", "--data-dir", data_dir, "--split",
                                        "test", "--rotations", "0:360:180", "-j", 0, "--compare-csv", results_csv)])
    # --round-trip: quarter turns there and back give the images themselves, so even the plain network scores the
    # same at every angle
    trip = validate.main([str(a) for a in ("--model", "scnn_baseline_3", "--dataset", "sortconv/mnist", "--data-dir",
                                           data_dir, "--split", "test", "--rotations", "0:360:90", "-j", 0,
                                           "--round-trip")])["scnn_baseline_3"]
    assert list(trip.values()) == [trip[0.0]] * 4
    sweep_args = validate.parser.parse_args(["--model", "m", "--dataset", "sortconv/mnist", "--data-dir", str(data_dir),
                                             "--split", "test", "--rotations", "0,40", "--round-trip"])
    sweep = validate.build_sweep(sweep_args, channels=1)
    assert sweep.round_trip and sweep.angles == [0.0, 40.0]
    assert not validate.build_sweep(validate.parser.parse_args(["--model", "m", "--dataset", "sortconv/mnist",
                                                                "--data-dir", str(data_dir), "--split", "test"]),
                                    channels=1).round_trip


@pytest.mark.slow
def test_validate_loads_a_local_dir_model(validate, ddp_run, data_dir, tmp_path):
    from timm.models import save_for_hf

    run_dir, _ = ddp_run
    model = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4), checkpoint_path=str(run_dir / "last.pth.tar"))
    save_for_hf(model, tmp_path / "hf", safe_serialization=True)
    name = f"local-dir:{tmp_path / 'hf'}"
    argv = ["--model", name, "--model-kwargs", "channels=(4,4,4,4,4,4)", "--dataset", "sortconv/mnist",
            "--data-dir", str(data_dir), "--split", "test", "-j", "0"]
    loaded = validate.build_model(name, "", False, validate.parser.parse_args(argv))
    assert all(torch.equal(loaded.state_dict()[key], value) for key, value in model.state_dict().items())
    results = validate.main(argv)
    with open(run_dir / "summary.csv") as f:
        (summary,) = list(csv.DictReader(f))
    assert results[name][0.0] == pytest.approx(float(summary["eval_top1"]))


PAPER_PRESETS = sorted(p for p in (REPO / "scripts" / "configs").glob("*.yaml") if not p.stem.endswith("_short"))


@pytest.mark.parametrize("config", PAPER_PRESETS, ids=lambda p: p.name)
def test_presets_set_the_paper_protocols(config):
    args, _ = train_tool.parse_args(["-c", str(config)])
    assert timm.is_model(args.model.split(".")[0]) and args.opt == "adam" and args.sched == "step"
    assert args.epochs == 100 and args.decay_epochs == 10 and args.no_aug and args.weight_decay == 0
    if config.name.startswith("mnist"):
        expected = dict(dataset="sortconv/mnist", batch_size=100, lr=1e-4, decay_rate=0.8, val_split="validation")
    else:
        dataset, classes = ("sortconv/outex12", 24) if config.name.startswith("outex") else ("sortconv/nwpu45", 45)
        expected = dict(dataset=dataset, num_classes=classes, batch_size=10, decay_rate=0.6, val_split="test",
                        lr=1e-3 if "densenet" in config.name else 1e-4)
    assert {key: getattr(args, key) for key in expected} == expected


def test_short_mnist_preset_keeps_the_paper_data_protocol():
    args, _ = train_tool.parse_args(["-c", str(REPO / "scripts" / "configs" / "mnist_scnn_short.yaml")])
    paper, _ = train_tool.parse_args(["-c", str(REPO / "scripts" / "configs" / "mnist_scnn.yaml")])
    for key in ("dataset", "train_split", "val_split", "no_aug", "opt", "weight_decay", "model"):
        assert getattr(args, key) == getattr(paper, key), key
    assert args.sched == "cosine" and args.sched_on_updates and args.epochs == 1 and args.lr == 2e-3


def test_preset_with_an_unknown_key_is_refused(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("batchsize: 10\n")
    with pytest.raises(SystemExit):
        train_tool.parse_args(["-c", str(config)])


@pytest.mark.parametrize("name,in_chans,num_classes", [("scnn_p_rs_7", 1, 10), ("ri_resnet18", 1, 24)])
def test_models_take_the_arguments_timm_train_py_passes(name, in_chans, num_classes):
    # timm's train.py calls create_model with exactly these keyword arguments (timm drops the None ones).
    model = timm.create_model(name, pretrained=False, in_chans=in_chans, num_classes=num_classes, drop_rate=0.0,
                              drop_path_rate=None, drop_block_rate=None, global_pool=None, bn_momentum=None,
                              bn_eps=None, scriptable=False, checkpoint_path="")
    first_conv = model.get_submodule(model.pretrained_cfg["first_conv"])
    assert first_conv.in_channels == in_chans and model.num_classes == num_classes


@pytest.mark.slow
def test_mnist_results_rows_train_measure_compare_and_tabulate(data_dir, tmp_path, capsys):
    results = results_tool
    table = results.records(tmp_path / "res.csv")
    common = [str(a) for a in ("--data-dir", data_dir, "--runs", tmp_path / "runs", "--results", table.path,
                               "--rot-samples", 8, "-j", 0, "--model-kwargs", "channels=(4,4,4,4,4,4)",
                               # the rest goes to train.py: the tiny data set has no 10k validation split
                               "--train-split", "trainval", "--val-split", "test", "-b", 8)]
    base = results.main(["--model", "scnn_baseline_3", "--name", "base", *common])
    row = results.main(["--model", "scnn_p_rs_3", "--name", "sc", "--compare", "base", *common])
    with open(tmp_path / "runs" / "sc" / "summary.csv") as f:
        (summary,) = list(csv.DictReader(f))
    # The validation split here is the test split, so the MNIST number is the epoch's own evaluation.
    assert row["mnist_test_top1"] == pytest.approx(float(summary["eval_top1"]))
    # the training time is the time the epochs ran, not the files' ages
    assert row["train_minutes"] == pytest.approx(float(summary["train_seconds"]) / 60) and row["train_minutes"] > 0
    assert row["epochs"] == 1 and row["mnist_rot_images"] == 8 and row["angles"] == [10.0 * i for i in range(36)]
    with open(tmp_path / "runs" / "sc" / "mnist_rot.csv") as f:  # the sweep's own CSV, beside its run
        per_angle = {float(r["angle"]): float(r["sc"]) for r in csv.DictReader(f)}
    assert row["per_angle_top1"] == list(per_angle.values())
    assert row["mnist_rot_top1"] == pytest.approx(sum(per_angle.values()) / 36)
    assert per_angle[0.0] == per_angle[90.0] == per_angle[180.0] == per_angle[270.0]  # exact quarter-turn invariance
    assert (tmp_path / "runs" / "sc" / "mnist_rot.png").stat().st_size > 10_000
    # the compared row's sweep, drawn beside, is the one in the table
    with open(tmp_path / "runs" / "sc" / "compare-base.csv") as f:
        assert [float(r["base"]) for r in csv.DictReader(f)] == base["per_angle_top1"]
    assert table.records() == [base, row]  # the table reads back each row as it was returned, to the last digit
    assert row["commands"][0].startswith("python scripts/train.py -c scripts/configs/mnist_scnn_short.yaml")
    # A finished row is measured again without retraining.
    weights = tmp_path / "runs" / "sc" / "last.pth.tar"
    mtime = weights.stat().st_mtime_ns
    capsys.readouterr()
    again = results.main(["--model", "scnn_p_rs_3", "--name", "sc", *common])
    assert "not retraining" in capsys.readouterr().out and weights.stat().st_mtime_ns == mtime
    assert again["per_angle_top1"] == row["per_angle_top1"]
    # Refused before anything runs, each with its reason: rows swept on other images drawn together, names that
    # are not file names, a finished run asked for with other settings, options train.py does not know (typos of
    # this script's own), and train.py options that would move the run.
    refusals = {
        "not be comparable": ["--name", "sc2", "--compare", "base", "--rot-samples", "4"],
        "--name 'a/b'": ["--name", "a/b"],
        "trained with other settings (lr: 0.002 there, 0.001 asked)": ["--name", "sc", "--lr", "1e-3"],
        "unrecognized arguments: --rot-sampels": ["--name", "sc3", "--rot-sampels", "4"],
        "--output is set by this script": ["--name", "sc3", "--output", str(tmp_path / "elsewhere")],
        f"--results {tmp_path} is a folder": ["--name", "sc3", "--results", str(tmp_path)],
    }
    for message, extra in refusals.items():
        with pytest.raises(SystemExit):
            results.main(["--model", "scnn_p_rs_3", *common, *extra])
        assert message in capsys.readouterr().err, message
    assert not (tmp_path / "runs" / "sc3").exists() and table.find(name="sc2") is None
    # Without --name, the row is named after the model and its arguments, as a file name.
    args, _ = results.parser.parse_known_args(["--model", "m", "--model-kwargs", "channels=(4,4)", "stride_align=corner"])
    assert results.row_name(args) == "m-channels-4-4-stride_align-corner"
    results.main(["--table", "--results", str(table.path)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| row |") and [line.split("|")[1].strip() for line in lines[2:]] == ["base", "sc"]
    assert f"{base['mnist_rot_top1']:.2f}%" in lines[2]


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["train.py", "validate.py"])
def test_a_folder_of_mnist_files_without_dataset_names_the_option_in_one_line(tool, tmp_path):
    """The bundled sample (IDX files) given as an image folder: one line naming --dataset sortconv/mnist, no
    traceback, nothing written."""
    from timm_sortconv.data import mnist_sample_dir

    result = subprocess.run([sys.executable, str(REPO / "scripts" / tool), "--data-dir", str(mnist_sample_dir()),
                             "--model", "scnn_p_rs_3", "--output" if tool == "train.py" else "--results-csv",
                             str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "TIMM_SORTCONV_DISABLE_FAST": "1"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --data-dir {mnist_sample_dir()} holds MNIST IDX files (e.g. t10k-images-idx3-ubyte.gz), not an "
        "image folder: add --dataset sortconv/mnist (or sortconv/mnist_rot)"]
    assert list(tmp_path.iterdir()) == []


def test_data_folders_that_are_no_mnist_folder_pass_the_check(tmp_path):
    validate_tool.check_image_folder("", str(tmp_path))  # an (empty) image folder: timm reports what it finds
    validate_tool.check_image_folder("", None)
    validate_tool.check_image_folder("sortconv/mnist", str(tmp_path))
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_bytes(b"")
    with pytest.raises(CommandError, match="add --dataset sortconv/mnist"):
        validate_tool.check_image_folder("", str(tmp_path))


@pytest.mark.parametrize("parser", [train_tool.build_parser(), validate_tool.parser], ids=["train", "validate"])
def test_help_shows_input_size_as_c_h_w(parser):
    assert "--input-size C H W" in parser.format_help()
    assert parser.parse_args(["--model", "scnn_p_rs_3", "--input-size", "1", "28", "28"]).input_size == [1, 28, 28]


@pytest.mark.slow
def test_paper_protocol_runs_in_the_background_is_stopped_resumed_and_measured(data_dir, tmp_path):
    """scripts/paper_protocol.sh on a tiny configuration: started in the background, stopped mid-epoch, started
    again, it ends with the weights, summary and learning curve of the same run left uninterrupted."""
    # Batches of 2 (48 an epoch): the stop, sent once the first recovery checkpoint (batch 3) is written, lands
    # mid-epoch even on a busy machine, where the stop's own process takes as long as a dozen batches of 8.
    tiny = ["--epochs", "2", "--curve", "1", "2", "--curve-samples", "8", "--rot-samples", "8", "--model-kwargs",
            "channels=(4,4,4,4,4,4)", "--train-split", "trainval", "--val-split", "test", "-b", "2", "-j", "0",
            "--recovery-interval", "3", "--log-interval", "4"]
    straight = tmp_path / "straight"
    results_tool.main(["--model", "scnn_p_rs_3", "--name", "scnn_p_rs_3-paper", "--config",
                       str(REPO / "scripts" / "configs" / "mnist_scnn.yaml"), "--data-dir", str(data_dir),
                       "--runs", str(straight), "--results", str(straight / "results.csv"),
                       "--curve", "1", "2", "5", "10", "20", "40", "70", "100", *tiny])
    runs = tmp_path / "runs"
    env = dict(os.environ, PYTHON=sys.executable)

    def protocol(*args):
        return subprocess.run(["bash", str(REPO / "scripts" / "paper_protocol.sh"), args[0], str(runs), *args[1:]],
                              env=env, capture_output=True, text=True, timeout=60)

    run_dir = runs / "scnn_p_rs_3-paper"
    assert "started" in protocol("start", str(data_dir), "scnn_p_rs_3", *tiny).stdout
    deadline = time.time() + 240
    while not list(run_dir.glob("recovery-*.pth.tar")) and time.time() < deadline:
        time.sleep(0.01)
    assert "stopped" in protocol("stop", "scnn_p_rs_3").stdout
    deadline = time.time() + 60
    while "not running" not in protocol("status", "scnn_p_rs_3").stdout and time.time() < deadline:
        time.sleep(0.1)
    result = results_tool.records(runs / "results.csv")  # the table paper_protocol.sh adds its row to
    assert result.find(name="scnn_p_rs_3-paper") is None, "the run ended before it was stopped"
    protocol("start", str(data_dir), "scnn_p_rs_3", *tiny)
    deadline = time.time() + 300
    while result.find(name="scnn_p_rs_3-paper") is None and time.time() < deadline:
        time.sleep(0.2)
    while "not running" not in protocol("status", "scnn_p_rs_3").stdout and time.time() < deadline:
        time.sleep(0.1)
    assert_same_training(run_dir, straight / "scnn_p_rs_3-paper")
    for epoch in (1, 2):
        assert (run_dir / f"epoch-{epoch}.pth.tar").is_file()
    ours = result.find(name="scnn_p_rs_3-paper")
    theirs = results_tool.records(straight / "results.csv").find(name="scnn_p_rs_3-paper")
    assert (run_dir / "mnist_rot.csv").is_file() and (run_dir / "mnist_rot.png").is_file()
    assert ours["curve"] == theirs["curve"] and [p["epoch"] for p in ours["curve"]] == [1, 2]
    assert ours["per_angle_top1"] == theirs["per_angle_top1"]
    assert ours["commands"][0].startswith("python scripts/train.py -c scripts/configs/mnist_scnn.yaml")
    log = (runs / "scnn_p_rs_3-paper.log").read_text()
    assert log.count(" start: scnn_p_rs_3, 1 thread(s)") == 2 and "resuming at batch" in log
    assert "curve: epoch 2:" in log and "ETA: epoch" in log
    # Refused in one line: a data folder that is not there.
    refused = protocol("start", str(tmp_path / "nowhere"))
    assert refused.returncode == 2 and refused.stderr.startswith("error: no data folder")
