"""Every count a result file records is the count measured: scripts/mnist_results.py on the MNIST sample in the
package (500 test images), where the full set's 10,000 and an asked-for slice larger than the set are both wrong.

A 4-channel SCNN trains two epochs on 100 images; its row and the learning curve's point after epoch 1 (asked for
600 images) each sweep the 500 test images at 36 angles and must say so, in the table's row, the curve and the line
printed; ``--compare`` accepts rows swept on the same images and refuses others.
"""
import contextlib
import io
import json

import pytest

from timm_sortconv.cli import mnist_results as results_tool
from timm_sortconv.data import MNIST, mnist_sample_dir

SAMPLE = str(mnist_sample_dir())


@pytest.fixture(scope="module")
def row(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rows")
    common = ["--data-dir", SAMPLE, "--runs", str(folder / "runs"), "--results", str(folder / "res.csv"), "-j", "0",
              "--model-kwargs", "channels=(4,4,4,4,4,4)"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        record = results_tool.main(["--model", "scnn_p_rs_3", "--name", "sc", *common, "--epochs", "2", "--curve",
                                    "1", "--curve-samples", "600",
                                    # train.py's: a short run on a slice of the sample
                                    "--train-samples", "100", "--val-samples", "50", "-b", "20"])
    return record, common, folder, out.getvalue()


@pytest.mark.slow
def test_mnist_results_records_the_images_it_evaluated(row):
    record, _, folder, out = row
    test_images = len(MNIST(SAMPLE, split="test"))
    assert test_images == 500
    assert record["mnist_test_images"] == record["mnist_rot_images"] == test_images
    assert results_tool.records(folder / "res.csv").records() == [record]  # the table's row reads back the same
    assert (folder / "runs" / "sc" / "mnist_rot.csv").is_file() and (folder / "runs" / "sc" / "mnist_rot.png").is_file()
    (point,) = record["curve"]
    assert point["epoch"] == 1 and point["mnist_test_images"] == point["mnist_rot_images"] == test_images
    assert json.loads((folder / "runs" / "sc" / "curve.json").read_text())["1"] == point
    assert "curve: epoch 1:" in out and "; 500 images x 36 angles)" in out
    assert "sc: MNIST" in out and "(500 images x 36 angles)" in out and "10000" not in out


@pytest.mark.slow
def test_compare_accepts_rows_swept_on_the_same_images_only(row, capsys):
    _, common, _, _ = row

    def compared(*extra):
        args, _ = results_tool.parser.parse_known_args(["--model", "scnn_baseline_3", *common, "--compare", "sc",
                                                        *extra])
        results_tool.check_compared(args)

    compared()
    compared("--rot-samples", "600", "--seed", "3")  # more than the set holds: the whole set, whatever the seed
    for extra in (["--rot-samples", "20"], ["--rot-samples", "499"]):
        with pytest.raises(SystemExit):
            compared(*extra)
        assert "the curves would not be comparable" in capsys.readouterr().err


@pytest.mark.slow
def test_moment_probe_records_the_digits_it_measured(tmp_path):
    """dip_probe --moments asked for 2,000 digits of the sample's 500 test images measures and records 500."""
    import dip_probe

    out = tmp_path / "moments.json"
    dip_probe.main(["--moments", "--data-dir", SAMPLE, "--samples", "2000", "--angles", "30", "--out", str(out)])
    assert json.loads(out.read_text())["samples"] == len(MNIST(SAMPLE, split="test")) == 500


@pytest.mark.slow
def test_the_demo_records_the_images_it_used_and_docs_stores_them(tmp_path, monkeypatch):
    """scripts/demo.py writes the images it trained on and swept (run.json); scripts/docs.py --record-demo stores
    those, and the command with its arguments, instead of the defaults' 5,000 and 500, and keeps the other CPUs' runs."""
    import shutil

    from conftest import REPO, load_script
    from timm_sortconv.cli import demo

    output = tmp_path / "demo"
    demo.main(["--output", str(output), "--train-samples", "50", "--samples", "8", "-j", "0"])
    record = json.loads((output / "run.json").read_text())
    assert {key: record[key] for key in ("arguments", "train_images", "test_images")} == dict(
        arguments=["--output", str(output), "--train-samples", "50", "--samples", "8", "-j", "0"], train_images=50,
        test_images=8)
    # a short run checks the quarter turns only (tests/test_demo.py checks the checks)
    assert [check["verdict"] for check in record["checks"]] == ["PASS", "SKIP", "SKIP"]
    assert record["seconds"] > 0 and len(record["load_average"]) == 2  # how long it took, and under what load
    docs = load_script(REPO / "scripts" / "docs.py", "docs_for_counts")
    stored = tmp_path / "stored"
    shutil.copytree(REPO / "results" / "demo", stored)
    monkeypatch.setattr(docs, "DEMO", stored)
    docs.record_demo(output, minutes=1.0, load="a test")
    meta = json.loads((stored / "demo.json").read_text())
    assert (meta["train_images"], meta["test_images"]) == (50, 8)
    assert meta["command"].startswith(".venv/bin/python scripts/demo.py --output ") and "--samples 8" in meta["command"]
    assert meta["other_cpus"] == json.loads((REPO / "results" / "demo" / "demo.json").read_text())["other_cpus"]
    assert "on the sample's 8 test images after one epoch on 50;" in docs.demo()
    # the machine recorded is the one the demo ran on, as run.json says
    assert meta["machine"] == f"{record['machine']['cpu']}, {record['machine']['threads']} threads"
    assert meta["isa"] == record["machine"]["kernel_isa"]
    # another CPU's run is stored beside the stored sweep, replacing an earlier one of the same machine and level
    docs.record_demo(output, minutes=2.0, load="", where="a test, forced")
    docs.record_demo(output, minutes=3.0, load="", where="a test, again")
    again = json.loads((stored / "demo.json").read_text())
    # (the stored runs may include this machine's, at this level and thread count: that one is replaced too)
    others = [o for o in meta["other_cpus"] if (o["machine"], o["isa"]) != (meta["machine"], meta["isa"])]
    assert again["other_cpus"][:-1] == others and again["command"] == meta["command"]
    assert {key: again["other_cpus"][-1][key] for key in ("machine", "isa", "where", "minutes")} == dict(
        machine=meta["machine"], isa=meta["isa"], where="a test, again", minutes=3.0)
    assert f"mean of 36 over the {len(again['other_cpus']) + 1} stored runs" in docs.demo()  # every run counted
    docs.record_demo(output)  # the time and load the run measured, not typed in
    measured = json.loads((stored / "demo.json").read_text())
    assert measured["minutes"] == round(record["seconds"] / 60, 1)
    assert measured["load"].startswith("load average ") or record["load_average"] == [None, None]
