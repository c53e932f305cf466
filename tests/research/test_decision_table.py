"""``scripts/research/decision_table.py``: the training rule (resumable, bit for bit), the augmentation, the jobs'
order, the time-matched row's steps, the claims shared by several processes, and a tiny end-to-end run on
MNIST-layout data written by the test (random pixels: the numbers mean nothing, the bookkeeping is checked)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from test_data import make_mnist

from timm_sortconv.cli.records import write_records


@pytest.fixture(scope="module")
def table():
    import decision_table
    return decision_table


def small_model(table, row_name="p_rs_7"):
    row = next(row for row in table.ROWS if row.name == row_name)
    torch.manual_seed(0)
    return table.build(row, channels=[8] * 6)


def data(n=120, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=generator),
            torch.randint(0, 10, (n,), generator=generator))


@pytest.mark.parametrize("row_name", ["p_rs_7", "e2cnn_c8"])
def test_a_run_stopped_and_resumed_from_its_checkpoint_ends_with_the_weights_of_an_unbroken_one(
        table, tmp_path, row_name):
    if row_name == "e2cnn_c8":  # its convolutions keep an expanded filter buffer in eval mode only
        pytest.importorskip("e2cnn")
    images, labels = data()
    unbroken = table.Trainer(small_model(table, row_name), images, labels, steps=6, seed=3, augment=True)
    unbroken.run(None, every=2)
    checkpoint = tmp_path / "run.pth"
    first = table.Trainer(small_model(table, row_name), images, labels, steps=6, seed=3, augment=True)
    while first.step < 4:  # a run killed after its fourth step: its checkpoint holds step 4
        first.train_step()
    torch.save(first.state(), checkpoint)
    resumed = table.Trainer(small_model(table, row_name), images, labels, steps=6, seed=3, augment=True)
    resumed.run(checkpoint, every=2)
    assert resumed.step == 6 and first.step == 4
    for name, value in unbroken.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name


def test_augmented_batches_turn_each_image_by_its_own_angle_fixed_by_the_step(table):
    images, labels = data(100)
    images[:, 10:18, 4:24] = 255  # a bar: every turn but the half turn moves it
    trainer = table.Trainer(small_model(table), images, labels, steps=10, seed=0, augment=True)
    plain = table.Trainer(small_model(table), images, labels, steps=10, seed=0, augment=False)
    turned, turned_labels = trainer.batch(5)
    upright, upright_labels = plain.batch(5)
    assert torch.equal(turned_labels, upright_labels)  # the same images in the same order
    assert not torch.equal(turned, upright)
    assert torch.equal(turned, trainer.batch(5)[0])  # the same angles whenever step 5 runs (a resumed run too)
    differences = (turned.float() - upright.float()).abs().flatten(1).sum(1)
    assert len(set(differences.tolist())) > len(differences) // 2  # not one angle for the whole batch


def test_jobs_run_every_row_at_the_smallest_size_first_and_one_seed_at_50000(table):
    plain_rows = [row for row in table.ROWS if not row.aligned]
    # the last five: the E(2)-CNN on the aligned rounds' local tasks (the next test)
    found = table.jobs(plain_rows, [50000, 1000, 5000], [0, 1, 2], [0], local=True)[:-5]
    everywhere = [row for row in plain_rows if not row.sizes]
    rows, attempts = [row for row in everywhere if not row.attempt], [row for row in everywhere if row.attempt]
    assert len(rows) == 8 and attempts  # the attempts run at the smallest size and on the local task only
    limited = [row for row in table.ROWS if row.sizes]
    assert [row.name for row in limited] == ["e2cnn_c8_params"] and limited[0].sizes == (1000,)
    sizes = [job.size for job in found]
    assert sizes == ([1000] * 3 * len(everywhere) + [5000] * 24 + [50000] * 8 + [0] * len(everywhere)
                     + [1000] * 3)  # the equal-parameter E(2)-CNN last, its three seeds at 1,000 images
    assert [job.seed for job in found[:len(everywhere) + 1]] == [0] * len(everywhere) + [1]
    assert not any(job.row.attempt for job in found if job.size > 1000)
    assert {job.seed for job in found if job.size == 50000} == {0}
    assert [job.name for job in found[-4:]] == ["one_seed0", "n1000_seed0", "n1000_seed1", "n1000_seed2"]
    assert {job.row.name for job in found[-3:]} == {"e2cnn_c8_params"} and found[0].name == "n1000_seed0"
    assert table.jobs(plain_rows, [5000], [0], [0], local=False)[-1].row.name != "e2cnn_c8_params"


def test_the_aligned_rounds_run_each_variant_on_mnist_rot_and_both_local_tasks_with_three_seeds(table):
    found = table.jobs(table.ROWS, [1000, 5000], [0, 1, 2], [0], local=True)
    aligned = [row for row in table.ROWS if row.aligned]
    # at most three rounds, each trying at most three variants
    rounds = {row.aligned for row in aligned}
    assert rounds <= {1, 2, 3} and all(sum(row.aligned == r for row in aligned) <= 3 for r in rounds)
    for row in aligned:
        mine = sorted(job.name for job in found if job.row is row)
        assert mine == sorted(f"{task}_seed{seed}" for seed in (0, 1, 2) for task in ("n1000", "one", "pair"))
    # the E(2)-CNN, their rival on the local tasks, runs them with the same seeds (seed 0 of `one` is the table's)
    rival = sorted(job.name for job in found if job.row.name == "e2cnn_c8" and job.size == 0)
    assert rival == ["one_seed0", "one_seed1", "one_seed2", "pair_seed0", "pair_seed1", "pair_seed2"]
    first_aligned = next(i for i, job in enumerate(found) if job.row.aligned)
    assert all(not job.row.aligned for job in found[:first_aligned])
    assert not any(job.row.aligned for job in table.jobs(table.ROWS, [1000], [0], [0], local=False) if job.size == 0)


def test_an_aligned_row_beats_its_rival_only_by_more_than_two_standard_errors(table, tmp_path):
    row = next(row.name for row in table.ROWS if row.aligned)
    results = tmp_path / "decision.csv"

    def write(name, key, seed, mean):
        job = f"{'n1000' if key == 'mnist' else key}_seed{seed}"
        table.records(results).put(
            {"row": name, "job": job, "task": "mnist", "train_images": 1000, "seed": seed, "mnist_rot": {"mean": mean}}
            if key == "mnist" else {"row": name, "job": job, "task": key, "seed": seed, "mean": mean, "retained": 0.99})
    for seed, (mine, e2, canon) in enumerate([(92.0, 89.5, 96.5), (92.4, 90.0, 96.7), (92.8, 90.5, 96.9)]):
        write(row, "one", seed, mine)        # +2.40 ± 0.37 (SEs 0.23 and 0.29): beats the E(2)-CNN
        write("e2cnn_c8", "one", seed, e2)
        write(row, "pair", seed, mine - 3)   # +0.00 ± 0.37: does not
        write("e2cnn_c8", "pair", seed, e2 - 0.6)
        write(row, "mnist", seed, mine)
        write("sc2+canon", "mnist", seed, canon)
    lines = table.aligned_table(results).splitlines()
    cells = [cell.strip() for cell in next(l for l in lines if l.startswith("| 1 |")).strip("|").split("|")]
    assert cells[2:5] == ["92.40 ± 0.23 (3)", "-4.30 ± 0.26", "no"]
    assert cells[5:8] == ["92.40 ± 0.23 (3)", "+2.40 ± 0.37", "yes"]
    assert cells[8:11] in (["89.40 ± 0.23 (3)", d, "no"] for d in ("+0.00 ± 0.37", "-0.00 ± 0.37")) and cells[11] == "0.990 / 0.990"


def test_a_time_matched_row_gets_the_steps_that_fit_its_rows_time(table):
    times = {"seconds_per_step": {"p_rs_7": 0.6, "e2cnn_c8": 0.3}}
    rows = {row.name: row for row in table.ROWS}
    assert table.steps_for(rows["e2cnn_c8"], 1000, times) == 2000
    assert table.steps_for(rows["p_rs_7"], 1000, times) == 1000


def test_the_equal_parameter_e2cnn_has_the_parameters_of_p_rs_7_within_five_percent(table):
    pytest.importorskip("e2cnn")
    rows = {row.name: row for row in table.ROWS}
    count = {name: sum(p.numel() for p in table.build(rows[name]).parameters())
             for name in ("p_rs_7", "e2cnn_c8", "e2cnn_c8_params")}
    assert abs(count["e2cnn_c8_params"] / count["p_rs_7"] - 1) < 0.05
    assert count["e2cnn_c8"] * 10 < count["p_rs_7"]  # the time-matched row with the SCNN's channels: far fewer


def test_a_job_claimed_by_a_live_process_is_left_alone_and_one_of_a_dead_process_is_taken(table, tmp_path):
    claim = table.Claim(tmp_path / "claims" / "job")
    assert claim.take() and not table.Claim(claim.path).take()  # this process holds it
    claim.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim.path.write_text(dead.stdout.strip())  # a process that has exited
    assert table.Claim(claim.path).take() and claim.path.read_text().split()[0] == str(os.getpid())
    assert not table.Claim(claim.path).take()  # with this process's start time: still its own


def test_a_claim_whose_process_id_now_names_another_process_is_taken(table, tmp_path):
    """After a reboot a live process may have a dead owner's id: the start time in the claim tells them apart."""
    path = tmp_path / "claims" / "job"
    path.parent.mkdir()
    started = table._started(os.getpid())
    if started is None:
        pytest.skip("no /proc here: a claim holds the process id alone")
    path.write_text(f"{os.getpid()} {int(started) + 1}")  # this id, another process's start
    assert table.Claim(path).take() and path.read_text() == f"{os.getpid()} {started}"
    path.write_text(str(os.getpid()))  # a claim without a start time: the live id holds it
    assert not table.Claim(path).take()


def test_a_tiny_table_runs_records_and_is_not_rerun(table, tmp_path, capsys):
    folder = tmp_path / "mnist"
    make_mnist(folder, num_train=10_000 + 120, num_test=24)  # the train split holds 10,000 images out
    res = tmp_path / "res" / "decision.csv"
    args = ["run", "--data-dir", str(folder), "--output", str(tmp_path / "out"), "--results", str(res),
            "--rows", "plain", "plain+aug", "p_rs_7", "--sizes", "50", "100", "--seeds", "0", "1", "--big-seeds", "0",
            "--steps", "2", "--local-steps", "2", "--local-scenes", "60", "--local-test-scenes", "10", "--sweep-samples", "6", "--test-samples",
            "12", "--timing-rounds", "1", "--timing-steps", "1", "--channels", *["8"] * 6]
    table.main(args + ["--only-local"])  # the local task's jobs first (a second process takes the rest)
    assert sorted(f"{r['row']}/{r['job']}" for r in table.records(res).records()) \
        == sorted(f"{row}/one_seed0" for row in ("plain", "plain+aug", "p_rs_7"))
    table.main(args)
    results = {f"{r['row']}/{r['job']}": r for r in table.records(res).records()}
    assert sorted(results) == sorted(f"{row}/{job}" for row in ("plain", "plain+aug", "p_rs_7")
                                     for job in ("n50_seed0", "n50_seed1", "n100_seed0", "n100_seed1", "one_seed0"))
    sweep = results["p_rs_7/n50_seed0"]
    assert sweep["mnist_rot"]["angles"] == [float(a) for a in range(0, 360, 10)] and sweep["mnist_rot"]["images"] == 6
    per_angle = sweep["mnist_rot"]["per_angle"]
    assert per_angle[0] == per_angle[9] == per_angle[18] == per_angle[27]  # SC: exact at quarter turns
    assert sweep["steps"] == 2 and results["plain+aug/n50_seed0"]["augment"]
    assert "mnist" not in sweep and results["p_rs_7/n100_seed0"]["test_images"] == 12  # upright at the largest size
    assert results["p_rs_7/one_seed0"]["task"] == "one" and 0 <= results["p_rs_7/one_seed0"]["retained"]
    timing = json.loads((tmp_path / "res" / "decision_timing.json").read_text())
    assert set(timing["seconds_per_step"]) == {"plain", "plain+aug", "p_rs_7"}
    assert timing["machine_before"]["isa"] in ("avx512", "avx2", "other")
    assert not list((tmp_path / "out" / "claims").iterdir())  # every claim released
    stamp = res.stat().st_mtime_ns
    capsys.readouterr()
    table.main(args)
    assert "every job is done" in capsys.readouterr().out
    assert res.stat().st_mtime_ns == stamp
    markdown = table.table(res, (50, 100))
    line = next(line for line in markdown.splitlines() if "`scnn_p_rs_7`" in line)
    mean = sum(results[f"p_rs_7/n50_seed{s}"]["mnist_rot"]["mean"] for s in (0, 1)) / 2
    assert f"{mean:.2f} ± " in line and "(2)" in line and line.count("|") == len((50, 100)) + 6


def fake_result(row, size, seed, mean):
    return {"row": row, "job": f"n{size}_seed{seed}", "task": "mnist", "train_images": size, "seed": seed,
            "params": 10, "mnist_rot": {"mean": mean, "worst": mean - 5}}


def test_an_attempt_beats_its_rivals_only_by_more_than_two_standard_errors_of_the_difference(table, tmp_path):
    attempt = next(row.name for row in table.ROWS if row.attempt)
    other = [row.name for row in table.ROWS if row.attempt][1]
    means = {"plain+aug": [94.0, 94.2, 94.4], "e2cnn_c8": [92.0, 92.5, 93.0],  # SEs 0.115 and 0.289
             "plain+canon": [95.2, 95.2, 95.2],  # compared, not required: +0.00 ± 0.12 for the first attempt
             attempt: [95.0, 95.2, 95.4],  # +1.0 ± 0.16 and +2.7 ± 0.31: beats both
             other: [94.5, 94.7, 94.9]}  # +0.5 ± 0.16 (> 2 SE) and +2.2 ± 0.31: beats both too
    results = table.records(tmp_path / "decision.csv")
    for row, values in means.items():
        for seed, mean in enumerate(values):
            results.put(fake_result(row, 1000, seed, mean))
    markdown = table.attempts_table(results.path).splitlines()
    header = [cell.strip() for cell in markdown[0].strip("|").split("|")]
    verdict, canon = header.index("beats both by > 2 SE"), header.index("minus `plain+canon`")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in markdown[2:]]
    first = next(row for row in rows if row[1].startswith("SC in the first 2") and "canon" in row[1])
    assert first[2] == "95.20 ± 0.12 / 90.20 ± 0.12 (3)" and first[3:5] == ["+1.00 ± 0.16", "+2.70 ± 0.31"]
    assert first[verdict] == "yes" and first[canon] == "+0.00 ± 0.12"
    results.put(fake_result(other, 1000, 2, 93.0))  # replaces that seed's row
    second = [cell.strip() for cell in table.attempts_table(results.path).splitlines()[3].strip("|").split("|")]
    assert second[verdict] == "no" and second[3].startswith("-0.13 ± ")  # now 94.07 ± 0.52
    kept = [r for r in results.records() if not (r["row"] == "e2cnn_c8" and r["seed"] > 0)]
    write_records(results.path, kept, results.spread)  # one seed: no standard error, no verdict
    for line in table.attempts_table(results.path).splitlines()[2:]:
        assert [cell.strip() for cell in line.strip("|").split("|")][verdict] == "-"


def test_rows_missing_from_the_timing_are_added_scaled_by_the_reference_and_the_stored_times_kept(
        table, tmp_path, monkeypatch):
    stored = {"seconds_per_step": {"p_rs_7": 0.5, "e2cnn_c8": 0.25}, "batch": 50}
    results = tmp_path / "decision.csv"
    table.timing_path(results).write_text(json.dumps(stored))
    measured = {"p_rs_7": 1.0, "sc2+canon": 0.8}  # a minute twice as slow as the stored one
    monkeypatch.setattr(table, "measure_timing", lambda rows, *a: {"seconds_per_step": {
        row.name: measured[row.name] for row in rows}, "machine_before": {}, "date": "now"})
    rows = [row for row in table.ROWS if row.name in ("p_rs_7", "e2cnn_c8", "sc2+canon")]
    result = table.timing(results, rows)
    assert result["seconds_per_step"] == {"p_rs_7": 0.5, "e2cnn_c8": 0.25, "sc2+canon": 0.4}
    assert result["added"][0]["rows"] == ["sc2+canon"] and result["added"][0]["scale"] == 0.5
    assert json.loads(table.timing_path(results).read_text()) == result
    assert table.timing(results, rows) == result  # nothing missing: nothing measured again


def test_bad_sizes_are_refused_naming_what_is_accepted(table, capsys):
    with pytest.raises(SystemExit):
        table.main(["run", "--data-dir", "nowhere", "--sizes", "10"])
    assert "--sizes must lie between 50 and 50,000" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        table.main(["run", "--data-dir", "nowhere", "--only-local", "--no-local"])
    assert "--only-local and --no-local exclude each other" in capsys.readouterr().err
