"""The checks ``scripts/demo.py`` prints at its end, which say whether a run is right whatever the CPU.

The check logic runs on synthetic per-angle rows (no training): the quarter turns must hold the same count of
correct images, SC's mean must lie :data:`~timm_sortconv.cli.demo.MIN_MARGIN` points above the plain network's and
within :data:`~timm_sortconv.cli.demo.EXPECTED_SC_MEAN`. The stored demo runs (``results/demo/``, every CPU README.md
lists) pass them, so the constants and the documented figures agree. The demo's own ``main`` runs with its training
and sweep replaced by given results, to see what it prints, writes into ``run.json`` and exits with.
"""
import json
from pathlib import Path

import pytest

from timm_sortconv.cli import demo
from timm_sortconv.invariance import read_sweep_csv

REPO = Path(__file__).resolve().parents[1]
STORED = REPO / "results" / "demo"
ANGLES = [10.0 * i for i in range(36)]


def sweep(sc_upright=81.4, sc_off=78.0, plain_upright=96.6, plain_off=38.0, images=500, turn=None):
    """A sweep of 36 angles shaped like the demo's: SC level at the quarter turns and lower between them, the plain
    network high upright only; ``turn``: (angle, accuracy) that replaces SC's accuracy at one angle."""
    sc = {a: sc_upright if a % 90 == 0 else sc_off for a in ANGLES}
    plain = {a: plain_upright if a == 0 else plain_off for a in ANGLES}
    if turn is not None:
        sc[turn[0]] = turn[1]
    return {"scnn_p_rs_3": sc, "scnn_baseline_3": plain}


def checks(results, images=500, calibrated=True):
    return demo.check_sweep(results, "scnn_p_rs_3", "scnn_baseline_3", images, calibrated=calibrated)


def verdicts(found):
    return [(check.name, check.verdict) for check in found]


def test_a_right_run_passes_every_check():
    found = checks(sweep())
    assert verdicts(found) == [("quarter turns", "PASS"), ("SC above plain", "PASS"), ("expected range", "PASS")]
    assert "the same 407 of 500 images right at 0, 90, 180 and 270 degrees" in found[0].detail
    assert str(found[0]).startswith("PASS  quarter turns: ")


def test_one_image_more_at_a_quarter_turn_fails_it():
    found = checks(sweep(turn=(270.0, 81.6)))
    assert found[0].verdict == "FAIL"
    assert "got 407, 407, 407, 408 of 500 images right at 0, 90, 180 and 270 degrees" in found[0].detail
    assert "python -m timm_sortconv.check --quick" in found[0].detail
    # the other angles are free to move: only the quarter turns are exact
    assert checks(sweep(turn=(100.0, 60.0)))[0].verdict == "PASS"


def test_counts_are_compared_not_the_printed_percentages():
    # accuracies as validate.py computes them (float noise) and as its CSV holds them (4 decimals) are one count
    found = checks(sweep(turn=(180.0, 407 / 500 * 100 + 1e-12)))
    assert found[0].verdict == "PASS"


def test_sc_near_the_plain_network_fails_the_margin():
    low = demo.EXPECTED_SC_MEAN[0]
    # SC's mean inside the range, the plain network's too close below it
    found = checks(sweep(sc_upright=low + 2, sc_off=low + 2, plain_upright=low - 5, plain_off=low - 5))
    assert verdicts(found)[1:] == [("SC above plain", "FAIL"), ("expected range", "PASS")]
    assert f"at least {demo.MIN_MARGIN:g} above on any CPU" in found[1].detail


def test_a_mean_outside_the_expected_range_only_warns():
    low, high = demo.EXPECTED_SC_MEAN
    for value in (low - 0.5, high + 0.5):
        found = checks(sweep(sc_upright=value, sc_off=value))
        assert verdicts(found) == [("quarter turns", "PASS"), ("SC above plain", "PASS"), ("expected range", "WARN")]
        assert f"outside {low:g}-{high:g}%" in found[2].detail
    for value in (low, high):  # the bounds belong to the range
        assert checks(sweep(sc_upright=value, sc_off=value))[2].verdict == "PASS"


def test_runs_other_than_the_default_check_the_quarter_turns_only():
    found = checks(sweep(sc_upright=30.0, sc_off=30.0), calibrated=False)
    assert verdicts(found) == [("quarter turns", "PASS"), ("SC above plain", "SKIP"), ("expected range", "SKIP")]
    assert found[1].detail.startswith("not checked: calibrated on the default run (--kernel-size 3, "
                                      "--train-samples 5000, --samples 500, the MNIST sample in the package)")
    args = demo.parser.parse_args(["--output", "elsewhere", "-j", "2"])
    assert demo.is_default_run(args)
    for changed in (["--kernel-size", "5"], ["--train-samples", "50"], ["--samples", "8"], ["--data-dir", "DATA"]):
        assert not demo.is_default_run(demo.parser.parse_args(changed)), changed


def test_a_sweep_without_the_quarter_turns_is_refused():
    results = {name: {a: v for a, v in per_angle.items() if a != 270.0} for name, per_angle in sweep().items()}
    with pytest.raises(ValueError, match="has no 270 degrees; the checks need the quarter turns 0, 90, 180, 270"):
        checks(results)


def test_the_stored_runs_on_every_cpu_pass_the_checks():
    """The demo's stored sweep passes all three checks, and each other CPU's run (its mean and upright figures)
    lies in the range and the margin: the constants agree with the figures README.md gives."""
    meta = json.loads((STORED / "demo.json").read_text())
    stored = read_sweep_csv(STORED / "rotation_sweep.csv")
    assert [check.verdict for check in checks(stored, images=meta["test_images"])] == ["PASS"] * 3
    low, high = demo.EXPECTED_SC_MEAN
    for run in meta["other_cpus"]:
        assert low <= run["mean"]["scnn_p_rs_3"] <= high, run["machine"]
        assert run["mean"]["scnn_p_rs_3"] - run["mean"]["scnn_baseline_3"] >= demo.MIN_MARGIN, run["machine"]


@pytest.mark.parametrize("results,status", [(sweep(), 0), (sweep(sc_upright=90.0, sc_off=70.0), 0),
                                            (sweep(turn=(90.0, 81.2)), 1)], ids=["right", "warned", "failed"])
def test_the_demo_prints_the_checks_records_them_and_exits_1_only_on_a_failure(results, status, tmp_path,
                                                                               monkeypatch, capsys):
    def step(tool, script, argv):  # no training, and the sweep's results as given
        return 0.0, results if script == "validate.py" else None

    monkeypatch.setattr(demo, "step", step)
    argv = ["--output", str(tmp_path)]
    if status:
        with pytest.raises(SystemExit) as info:
            demo.main(argv)
        assert info.value.code == 1
    else:
        demo.main(argv)
    out = capsys.readouterr().out.splitlines()
    start = out.index("Checks (a right run passes them on any CPU):")
    found = checks(results)
    assert out[start + 1:start + 4] == [f"  {check}" for check in found]
    assert out[start + 4] == ("The run is wrong: quarter turns failed (exit status 1)." if status else
                              "The run is right" + (" (the warning compares its figure with the CPUs measured)."
                                                    if found[2].verdict == "WARN" else "."))
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["checks"] == [dict(name=c.name, verdict=c.verdict, detail=c.detail) for c in found]
    assert record["test_images"] == 500 and record["train_images"] == 5000
    assert set(record["machine"]) == {"cpu", "kernel_isa", "torch_capability", "threads", "logical_cpus"}
