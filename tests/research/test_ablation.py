"""The research tools ``scripts/research/ablation.py`` (with ``peers.py``) and ``dip_probe.py``: the ablation's statistics against hand-computed values, and one
tiny row end to end on MNIST-layout data written by the test (random pixels: the numbers mean nothing, the
bookkeeping is what is checked)."""
import base64
import json
import math

import numpy as np
import pytest
import torch
from conftest import REPO
from test_data import make_mnist
from timm_sortconv.models import SCNN


@pytest.fixture(scope="module")
def peers():
    import peers
    return peers


@pytest.fixture(scope="module")
def ablation():
    import ablation
    return ablation


def test_summary_counts_an_images_angles_as_one_sample(ablation):
    # 4 images x 3 angles (0, 10, 20): per-angle accuracy 100, 50, 25 %
    correct = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    s = ablation.summarise(correct, [0.0, 10.0, 20.0])
    assert s["per_angle"] == [100.0, 50.0, 25.0]
    assert s["mean"] == pytest.approx(100 * 7 / 12)
    assert (s["upright"], s["worst"], s["worst_angle"], s["dip"]) == (100.0, 25.0, 20.0, 75.0)
    per_image = torch.tensor([3, 2, 1, 1], dtype=torch.float64) / 3
    assert s["mean_se"] == pytest.approx(100 * per_image.std().item() / 2)
    assert s["upright_se"] == 0.0
    assert s["worst_se"] == pytest.approx(100 * torch.tensor([1.0, 0, 0, 0]).std().item() / 2)
    assert s["dip_se"] == pytest.approx(100 * torch.tensor([0.0, 1, 1, 1]).std().item() / 2)


@pytest.mark.slow
def test_a_row_trains_sweeps_records_and_is_not_rerun(ablation, tmp_path, capsys):
    data = tmp_path / "mnist"
    make_mnist(data, num_train=10020, num_test=16)  # the train split holds 10,000 images out for validation
    results = tmp_path / "res" / "screen.csv"
    common = ["--data-dir", str(data), "--results", str(results), "--output", str(tmp_path / "out"),
              "--cache-dir", str(tmp_path / "cache"), "--train-samples", "20", "--epochs", "1", "--batch-size", "10",
              "--sweep-samples", "8", "--angles", "0,45,90", "--model", "scnn_p_rs_3", "--model-kwargs",
              "channels=(4,4,4,4,4,4)", "blur_sigma=0.5"]
    ablation.main(["--name", "tiny", "--seeds", "0", "1", *common])
    rows = [ablation.records(results).find(name="tiny", seed=s) for s in (0, 1)]
    for row in rows:
        assert row["model_kwargs"] == {"channels": [4, 4, 4, 4, 4, 4], "blur_sigma": 0.5}
        assert (row["train_samples"], row["epochs"], row["images"], row["angles"]) == (20, 1, 8, [0.0, 45.0, 90.0])
        assert (tmp_path / "out" / "tiny" / f"seed{row['seed']}.pth").is_file()
        bits = np.unpackbits(np.frombuffer(base64.b64decode(row["correct"]), dtype=np.uint8))[:8 * 3]
        correct = torch.from_numpy(bits.reshape(8, 3).astype(bool))
        assert row["per_angle"] == ablation.summarise(correct, row["angles"])["per_angle"]
        assert row["per_angle"][0] == row["per_angle"][2]  # an SCNN is exactly invariant to a quarter turn
        assert row["command"].startswith("python scripts/research/ablation.py")
    # A seed whose result exists is not trained again.
    weights = tmp_path / "out" / "tiny" / "seed0.pth"
    mtime = weights.stat().st_mtime_ns
    capsys.readouterr()
    ablation.main(["--name", "tiny", "--seeds", "0", *common])
    assert "tiny seed 0 is in" in capsys.readouterr().out and weights.stat().st_mtime_ns == mtime
    ablation.main(["--table", "--results", str(results)])
    line = capsys.readouterr().out.splitlines()[2]
    assert line.startswith("| tiny | 2 |") and f"{np.mean([r['mean'] for r in rows]):.2f}" in line
    ablation.main(["--features", "--feature-samples", "8", *common])
    features = ablation.RecordTable(tmp_path / "res" / "screen_features.csv", key=("name", "seed")).records()
    assert [(r["name"], r["seed"]) for r in features] == [("tiny", 0), ("tiny", 1)]
    assert all(math.isfinite(r["trained"]["relative"]) and r["angle"] == 45 for r in features)


def test_bad_canvas_is_refused(ablation, capsys):
    with pytest.raises(SystemExit):
        ablation.main(["--name", "x", "--data-dir", "nowhere", "--canvas", "27"])
    assert "--canvas must be an even size >= 28" in capsys.readouterr().err


@pytest.mark.slow
def test_train_rotation_rotates_the_batches_and_only_then(ablation):
    """``--train-rotation``: 0 trains on the images as they are; a range of (practically) zero degrees
    gives the same images back (rotation, rounding and clamping keep an 8-bit image), hence the same
    weights; a real range trains on other images, hence other weights, reproducibly per seed."""
    import argparse

    import timm

    images = torch.randint(0, 256, (40, 28, 28), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    labels = torch.randint(0, 10, (40,), generator=torch.Generator().manual_seed(1))

    def weights(train_rotation):
        torch.manual_seed(0)
        model = timm.create_model("scnn_p_rs_3", channels=(4, 4, 4, 4, 4, 4))
        args = argparse.Namespace(lr=2e-3, weight_decay=0.0, batch_size=10, epochs=1, log_interval=100,
                                  train_rotation=train_rotation)
        ablation.train(model, images, labels, args, seed=3)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    plain = weights(0.0)
    assert torch.equal(weights(1e-9), plain)
    turned = weights(90.0)
    assert not torch.allclose(turned, plain)
    assert torch.equal(weights(90.0), turned)


def test_the_tool_starts_through_the_cli_runner(ablation):
    """``python scripts/research/ablation.py`` ends in ``run(main)``: the package's runner, not a row function."""
    from timm_sortconv import cli

    assert ablation.run is cli.run


@pytest.mark.slow
def test_a_table_piped_into_head_stops_without_a_traceback(tmp_path):
    """``scripts/research/ablation.py --table | head -2``: the runner ends quietly when its reader goes away."""
    import subprocess
    import sys

    from timm_sortconv.cli.records import write_records

    results = tmp_path / "screen.csv"
    write_records(results, [dict(name=f"r{row}", seed=0, params=1, train_samples=1, epochs=1, worst_angle=0.0,
                                 **{k: 1.0 for k in ("mean", "upright", "worst", "dip")},
                                 **{f"{k}_se": 0.0 for k in ("mean", "upright", "worst", "dip")})
                            for row in range(400)])  # enough lines to outlast the pipe's buffer
    script = REPO / "scripts" / "research" / "ablation.py"
    done = subprocess.run(f"'{sys.executable}' '{script}' --table --results '{results}' | head -2", shell=True,
                          capture_output=True, text=True, check=True)
    assert done.stdout.count("\n") == 2 and "Traceback" not in done.stderr


@pytest.mark.slow
def test_dip_probe_on_a_small_test_split_with_typed_model_kwargs(tmp_path):
    """dip_probe takes the ablation's sweep slice (also when the split holds fewer than 2,000 images) and
    parses ``--model-kwargs`` values as Python literals (``blur_sigma=0.5`` is a float, not a string)."""
    import dip_probe

    data = tmp_path / "mnist"
    make_mnist(data, num_train=10020, num_test=16)
    out = tmp_path / "probe.json"
    dip_probe.main(["--data-dir", str(data), "--model", "scnn_p_rs_3", "--model-kwargs", "channels=(4,4,4,4,4,4)",
                    "blur_sigma=0.5", "--samples", "8", "--angles", "45", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["samples"] == 8 and result["model"] == "scnn_p_rs_3"
    assert 0 <= result["upright_accuracy"] <= 100


def test_shift_moves_digits_by_whole_pixels_and_fills_with_background():
    import dip_probe
    x = torch.arange(1, 26, dtype=torch.uint8).view(1, 5, 5)
    moved = dip_probe.shift(x, 1, -2)
    assert torch.equal(moved[0, 1:, :3], x[0, :4, 2:])
    assert moved[0, 0].eq(0).all() and moved[0, :, 3:].eq(0).all()
    assert torch.equal(dip_probe.shift(dip_probe.shift(x, -1, 1), 1, -1)[0, 1:, :4], x[0, 1:, :4])
    assert torch.equal(dip_probe.shift(x, 0, 0), x) and dip_probe.shift(x, 5, 0).eq(0).all()


def test_shift_probe_pairs_each_shift_with_the_unmoved_digits():
    """A network that sees only the sum of the pixels ignores where the digit is (change 0 at every shift); one
    that sees only the top-left quarter does not."""
    import dip_probe
    from peers import MNIST_CFG

    class Probe(torch.nn.Module):
        def __init__(self, region):
            super().__init__()
            self.region, self.pretrained_cfg = region, MNIST_CFG

        def forward(self, x):
            self.seen = x.shape[-2:]
            total = x[..., self.region, self.region].sum((1, 2, 3))
            return torch.stack([torch.cos(total / 40 + k) for k in range(10)], dim=1)

    images = torch.zeros(30, 28, 28, dtype=torch.uint8)
    for i in range(30):
        images[i, 8 + i % 5:16 + i % 7, 9:12 + i % 9] = 40 + 7 * i
    labels = Probe(slice(None))(ablation_normalise(images)).argmax(1)
    shifts = [(0, 0), (1, 1), (-1, 0), (2, -3)]
    rows = dip_probe.shift_probe(Probe(slice(None)), images, labels, shifts, batch=7)
    assert [r["shift"] for r in rows] == [list(s) for s in shifts]
    assert all(r["accuracy"] == 100.0 and r["change"] == 0.0 and r["change_se"] == 0.0 for r in rows)
    rows = dip_probe.shift_probe(Probe(slice(0, 12)), images, labels, shifts, batch=7)
    assert rows[0]["change"] == 0.0 and any(r["change"] != 0.0 for r in rows[1:])
    for r in rows[1:]:
        assert r["change"] == pytest.approx(r["accuracy"] - rows[0]["accuracy"])
    probe = Probe(slice(None))  # the digits are fed at their own size: a larger canvas is not cut back to 28
    dip_probe.shift_probe(probe, torch.nn.functional.pad(images, (2, 2, 2, 2)), labels, [(0, 0)])
    assert probe.seen == (32, 32)


def ablation_normalise(images):
    import ablation
    from peers import MNIST_CFG
    return ablation.normalise(images, MNIST_CFG)


def test_shift_probe_command_writes_each_shift(tmp_path, capsys):
    import dip_probe
    data = tmp_path / "mnist"
    make_mnist(data, num_train=20, num_test=16)
    out = tmp_path / "shifts.csv"
    dip_probe.main(["--data-dir", str(data), "--model", "scnn_p_rs_3", "--model-kwargs", "channels=(4,4,4,4,4,4)",
                    "--samples", "8", "--shifts", "1", "--out", str(out)])
    rows = dip_probe.RecordTable(out, key=()).records()
    assert all(r["samples"] == 8 and r["canvas"] == 28 for r in rows) and [r["shift"] for r in rows] == [
        [dy, dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    assert rows[4]["change"] == 0.0 and rows[0]["model_kwargs"] == {"channels": [4] * 6}  # the unmoved digits
    assert "-1, -1 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        dip_probe.main(["--data-dir", str(data), "--shifts", "-1"])
    assert "--shifts -1: a number of pixels, 0 or more" in capsys.readouterr().err
    dip_probe.main(["--data-dir", str(data), "--model", "scnn_p_rs_3", "--model-kwargs", "channels=(4,4,4,4,4,4)",
                    "--samples", "8", "--shifts", "0", "--canvas", "32", "--out", str(out)])
    assert [r["canvas"] for r in dip_probe.RecordTable(out, key=()).records()] == [28] * 9 + [32]  # one table
    with pytest.raises(SystemExit):
        dip_probe.main(["--data-dir", str(data), "--shifts", "1", "--canvas", "31"])
    assert "--canvas 31: an even number of pixels, 28 or more" in capsys.readouterr().err


def test_paired_table_columns_are_the_mean_difference_over_common_seeds(ablation, tmp_path, capsys):
    """``--table --paired ROW``: per row, mean over the seeds both ran of (row - ROW) and its standard error;
    "-" where the network differs (other parameter count) or fewer than two seeds are shared."""
    results = ablation.records(tmp_path / "screen.csv")

    def write(row, seed, params, mean, worst, dip):
        results.put(dict(
            name=row, seed=seed, params=params, train_samples=10, epochs=1, mean=mean, upright=mean + dip,
            worst=worst, worst_angle=40.0, dip=dip, **{f"{k}_se": 0.1 for k in ("mean", "upright", "worst", "dip")}))

    for seed, (m, w, d) in enumerate([(80.0, 70.0, 9.0), (82.0, 71.0, 8.0), (81.0, 72.0, 7.0)]):
        write("ref", seed, 100, m, w, d)
        write("better", seed, 100, m + 1 + seed, w + 2, d - 1)  # differences 1, 2, 3 in the mean
    write("better", 7, 100, 50.0, 50.0, 50.0)  # a seed the reference lacks: not paired
    write("peer", 0, 30, 90.0, 90.0, 1.0)
    write("peer", 1, 30, 90.0, 90.0, 1.0)
    ablation.main(["--table", "--results", str(results.path), "--paired", "ref"])
    lines = {line.split(" | ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["| better"].endswith("| +2.00 ± 0.58 | +2.00 ± 0.00 | -1.00 ± 0.00 |")
    assert lines["| peer"].endswith("| - | - | - |") and lines["| ref"].endswith("| - | - | - |")
    from timm_sortconv.cli import CommandError  # the runner prints it as one "error:" line, exit 2

    with pytest.raises(CommandError, match=r"--paired missing: no row of that name"):
        ablation.main(["--table", "--results", str(results.path), "--paired", "missing"])


def test_csv_holds_every_row_with_its_pairing_and_a_command_that_runs_here(ablation, tmp_path):
    """``--csv OUT``: one line per row, in the order of the table's ``_rows.csv`` (unlisted rows after, by name),
    the means over seeds unrounded, the paired change from the row ``_rows.csv`` names, and the first seed's command
    without the machine's folders."""
    import csv

    results = ablation.records(tmp_path / "screen.csv")

    def write(row, seed, params, mean, dip, command="python scripts/research/ablation.py --name r"):
        results.put(dict(
            name=row, seed=seed, model="scnn_p_rs_3", model_kwargs={"blur_sigma": 0.5}, params=params,
            train_samples=10, epochs=1, batch_size=5, lr=0.002, images=8, angles=[0.0, 45.0], mean=mean,
            upright=mean + dip, worst=mean - 1, worst_angle=45.0, dip=dip, train_seconds=60.0 * (seed + 1),
            command=command, **{f"{k}_se": 0.1 for k in ("mean", "upright", "worst", "dip")}))

    for seed in (0, 1, 2):
        write("ref", seed, 100, 80.0 + seed, 9.0)
        write("better", seed, 100, 81.0 + 2 * seed, 8.0, "python scripts/research/ablation.py --data-dir /my/mnist "
                                                          "--output /tmp/w --results screen.csv --name better")
    write("zzz", 0, 30, 50.0, 1.0)
    (tmp_path / "screen_rows.csv").write_text("group,row,vs,change\nref group,ref,,the reference\n"
                                       "layers,better,ref,\"a change, with a comma\"\n")
    out = tmp_path / "ablation.csv"
    ablation.main(["--csv", str(out), "--results", str(results.path)])
    rows = list(csv.DictReader(out.open()))
    assert [r["row"] for r in rows] == ["ref", "better", "zzz"] and tuple(rows[0]) == ablation.CSV_COLUMNS
    better = rows[1]
    assert (better["group"], better["change"], better["vs"], better["seeds"]) == ("layers", "a change, with a comma",
                                                                                 "ref", "0 1 2")
    assert float(better["mean"]) == pytest.approx(83.0) and float(better["mean_sd"]) == pytest.approx(2.0)
    assert float(better["paired_mean"]) == pytest.approx(2.0) and float(better["paired_mean_se"]) == pytest.approx(
        np.std([1.0, 2.0, 3.0], ddof=1) / np.sqrt(3))
    assert float(better["paired_dip"]) == pytest.approx(-1.0) and better["train_minutes"] == "1.0-3.0"
    assert better["command"] == "python scripts/research/ablation.py --data-dir DATA --results screen.csv --name better"
    assert json.loads(better["model_kwargs"]) == {"blur_sigma": 0.5}
    assert rows[0]["paired_mean"] == "" and rows[2]["vs"] == "" and rows[2]["mean_sd"] == ""
    (tmp_path / "screen_rows.csv").write_text("group,row,vs,change\nx,gone,,a row never run\n")
    from timm_sortconv.cli import CommandError

    with pytest.raises(CommandError, match="lists rows that .* does not hold: gone"):
        ablation.main(["--csv", str(out), "--results", str(results.path)])


@pytest.mark.slow
def test_moment_probe_reads_the_turn_of_each_digit(tmp_path):
    """dip_probe --moments on the shipped sample's real test digits: the moment angle of a turned digit
    exceeds the upright one's by the turn, to within a degree for orders 2 and 4."""
    import dip_probe
    from timm_sortconv.data import mnist_sample_dir

    out = tmp_path / "moments.json"
    dip_probe.main(["--moments", "--data-dir", str(mnist_sample_dir()), "--samples", "200", "--angles", "0,30",
                    "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["order"], r["angle"]): r for r in result["rows"]}
    assert sorted(rows) == [(o, a) for o in (1, 2, 4) for a in (0.0, 30.0)] and result["samples"] == 200
    assert all(rows[(o, 30.0)]["median_error"] < 1.0 for o in (2, 4))
    assert rows[(2, 30.0)]["share_over_5_degrees"] < 0.02


@pytest.mark.parametrize("tool", ["timm_sortconv.cli.train", "timm_sortconv.cli.validate",
                                  "timm_sortconv.cli.mnist_results", "ablation", "dip_probe"])
def test_a_model_kwarg_without_equals_is_a_usage_error_naming_it(tool, capsys):
    import importlib

    module = importlib.import_module(tool)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--model-kwargs", "canonicalize"])
    assert exit_info.value.code == 2
    assert "argument --model-kwargs: expected KEY=VALUE, got 'canonicalize'" in capsys.readouterr().err


def test_key_values_are_python_literals_where_they_parse():
    from timm_sortconv.cli import parse_key_values

    assert parse_key_values(["a=0.5", "b=(1,2)", "c=polar", "d=None", "e=x=y"]) == dict(
        a=0.5, b=(1, 2), c="polar", d=None, e="x=y")


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["max", "key"])
@pytest.mark.parametrize("sampling", ["polar", "square"])
@pytest.mark.parametrize("sorting,turn", [("c2", 2), ("c4", 1)])
def test_orient_screening_layers_are_exactly_invariant_to_their_group_only(ablation, peers, pool, sampling, sorting, turn):
    torch.manual_seed(0)
    kwargs = dict(channels=(4, 4, 8, 8, 8, 8), sampling=sampling, sorting=sorting)
    model = ablation.create_model(f"orient{pool}:scnn", dict(kwargs)).double().eval()
    assert sum(isinstance(m, peers.OrientConv2d) for m in model.modules()) == 6
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in SCNN(**kwargs).parameters())
    x = torch.randn(3, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        upright = model(x)
        turned = model(torch.rot90(x, turn, (2, 3)))
        torch.testing.assert_close(turned, upright, rtol=1e-9, atol=1e-9)
        if sorting == "c2":  # a half-turn group says nothing about quarter turns
            assert (model(torch.rot90(x, 1, (2, 3))) - upright).abs().max() > 1e-6


@pytest.mark.parametrize("sampling", ["polar", "square"])
def test_orient_effective_kernel_applies_the_weight_to_the_unsorted_samples(peers, sampling):
    from timm_sortconv import SortConv2d
    from timm_sortconv.ops.geometry import get_geometry

    torch.manual_seed(1)
    conv = SortConv2d(3, 5, 7, padding=3, sampling=sampling, sorting="c2").double()
    layer = peers.OrientConv2d(conv, "max")
    x = torch.randn(2, 3, 9, 10, dtype=torch.float64)
    g = get_geometry(7, sampling, "c2")
    windows = torch.nn.functional.unfold(x, 7, padding=3).view(2, 3, 49, -1)  # row-major windows, per channel
    samples = torch.einsum("st,bctl->bcsl", g.interpolation.double(), windows)  # slot order, unsorted
    expected = torch.einsum("ocs,bcsl->bol", conv.weight.flatten(2)[:, :, g.slot_to_grid], samples)
    torch.testing.assert_close(layer.turned_responses(x)[:, 0].flatten(2), expected)
    # the other turn is the same kernel turned by 180 degrees: the response to the half-turned input, turned back
    turned_back = torch.rot90(layer.turned_responses(torch.rot90(x, 2, (2, 3)))[:, 0], 2, (2, 3))
    torch.testing.assert_close(layer.turned_responses(x)[:, 1], turned_back)


def test_orient_on_ring_sorting_is_refused_naming_the_accepted_sortings(ablation):
    with pytest.raises(ablation.CommandError, match="'c2' or 'c4'"):
        ablation.create_model("orientmax:scnn", dict(channels=(4, 4, 8, 8, 8, 8), sorting="ring"))


def test_turn_cost_compares_two_rows_upright_image_by_image(ablation, tmp_path, capsys):
    """``--turn-cost``: upright accuracy of two stored rows over their common seeds, by moment-strength quartile
    of the sweep's upright images and by class; the per-image results come from the seeds' packed bits."""
    data = tmp_path / "mnist"
    make_mnist(data, num_test=40)  # labels 0..9 repeating
    res = tmp_path / "screen.csv"
    # 8 images x 2 angles; row "a" gets every upright image right, row "b" the even-numbered ones only.
    for name, upright in (("a", [True] * 8), ("b", [i % 2 == 0 for i in range(8)])):
        for seed in (0, 1) + ((5,) if name == "b" else ()):
            correct = torch.tensor([[u, False] for u in upright])
            ablation.records(res).put(dict(name=name, seed=seed, images=8, angles=[0.0, 90.0],
                                           correct=ablation.pack(correct)))
    ablation.main(["--turn-cost", "a", "b", "--results", str(res), "--data-dir", str(data)])
    out = capsys.readouterr().out
    assert out.startswith("Seeds 0, 1;")  # seed 5 of "b" has no partner
    lines = {line.split(" | ")[0]: line for line in out.splitlines()}
    assert lines["| all"].startswith("| all | 8 | 100.00 | 50.00 | -50.00 ±")
    # the test slice is a seeded sample: its labels decide which classes appear; each class's
    # difference is -100 for the odd-numbered images of the slice and 0 for the even ones
    _, labels = ablation.rotated_sweep(str(data), 8, [0.0], "")
    for c in set(labels.tolist()):
        odd = [i % 2 == 1 for i, label in enumerate(labels.tolist()) if label == c]
        assert lines[f"| {c}"].startswith(f"| {c} | {len(odd)} | 100.00 | {100 - 100 * np.mean(odd):.2f} |")
    quartile_counts = [int(lines[f"| Q{q}"].split(" | ")[1]) for q in range(1, 5)]
    assert sum(quartile_counts) == 8
    with pytest.raises(ablation.CommandError, match="no seed in common"):
        ablation.turn_cost(str(res), "a", "missing", str(data), 2)


def test_orient_eight_turns_move_the_weights_along_the_polar_rings(ablation, peers):
    """``orientmax8``: eight copies of the kernel, 45 degrees apart along the rings; every second one is an
    exact quarter turn of the one before, so the pooled network is exactly invariant to quarter turns."""
    from timm_sortconv import SortConv2d

    torch.manual_seed(2)
    conv = SortConv2d(2, 3, 7, padding=3, sampling="polar", sorting="c2").double()
    kernels = peers.OrientConv2d(conv, "max", 8).effective_kernels().unflatten(0, (8, 3))
    torch.testing.assert_close(kernels[0], peers.OrientConv2d(conv, "max").effective_kernels()[:3])
    for t in range(8):  # two 45-degree steps are a quarter turn of the kernel, in one direction throughout
        torch.testing.assert_close(kernels[(t + 2) % 8], torch.rot90(kernels[t], -1, (2, 3)))
    assert (kernels[1] - kernels[0]).abs().max() > 1e-3  # a 45-degree step is a different kernel
    model = ablation.create_model("orientmax8:scnn", dict(channels=(4, 4, 8, 8, 8, 8), sorting="c2")).double().eval()
    x = torch.randn(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(torch.rot90(x, 1, (2, 3))), model(x), rtol=1e-9, atol=1e-9)
    with pytest.raises(ablation.CommandError, match="8 needs sampling='polar'"):
        ablation.create_model("orientmax8:scnn", dict(channels=(4, 4, 8, 8, 8, 8), sorting="c2", sampling="square"))
    with pytest.raises(ablation.CommandError, match="orientmax:<model> or orientkey:<model>"):
        ablation.create_model("orientmin:scnn", {})


def test_frames_screening_wrapper_pools_the_canonical_frames_and_keeps_the_invariance(ablation):
    """``frames<pool><K>x<step>:``: the image read at K offsets around its canonical turn, the pooled features
    pooled over the frames; one frame at offset 0 is the canonicalized model itself."""
    from timm_sortconv.canonical import moment_angle
    from timm_sortconv.rotation import rotate_each

    kwargs = dict(channels=(4, 4, 8, 8, 8, 8), sampling="square", sorting="c2", canonicalize="moment2")
    x = torch.nn.functional.pad(torch.randn(3, 1, 20, 20, dtype=torch.float64), (4, 4, 4, 4))
    torch.manual_seed(3)
    single = ablation.create_model("framesavg1x0:scnn", dict(kwargs)).double().eval()
    torch.manual_seed(3)
    plain = SCNN(**kwargs).double().eval()
    torch.manual_seed(4)
    model = ablation.create_model("framesmax3x20:scnn", dict(kwargs)).double().eval()
    assert model.offsets == [-20.0, 0.0, 20.0]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in plain.parameters())
    with torch.no_grad():
        torch.testing.assert_close(single(x), plain(x))
        torch.testing.assert_close(single(x[..., 2:]), plain(x[..., 2:]))  # non-square: turned in the same frame
        inner = model.model  # its canonicalize is now the identity: the wrapper turns the frames
        angle = moment_angle(x)
        frames = [rotate_each(x, -(angle + o), "border") for o in (-20.0, 0.0, 20.0)]
        feats = torch.stack([inner.forward_head(inner.forward_features(f), pre_logits=True) for f in frames])
        torch.testing.assert_close(model(x), inner.head.fc(feats.amax(0)))
        # every frame turns with the input, and the c2 layers ignore the half turn the moment leaves
        torch.testing.assert_close(model(torch.rot90(x, 2, (2, 3))), model(x), rtol=1e-9, atol=1e-9)
    with pytest.raises(ablation.CommandError, match="needs canonicalize="):
        ablation.create_model("framesavg3x20:scnn", dict(channels=(4, 4, 8, 8, 8, 8), sorting="c2"))
    with pytest.raises(ablation.CommandError, match=r"frames\(avg\|max\)<K>x<step>"):
        ablation.create_model("framesmean3:scnn", dict(kwargs))
    with pytest.raises(ablation.CommandError, match=r"<K>x<step>"):  # no frame at all
        ablation.create_model("framesavg0x20:scnn", dict(kwargs))
