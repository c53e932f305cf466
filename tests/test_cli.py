"""What every command-line tool does with a user's mistake, and where ``python -m timm_sortconv.check`` writes.

A model name timm does not know ends a tool in one ``error:`` line naming timm's closest names (the shared
:func:`timm_sortconv.cli.run`), without a traceback, whichever of the tool's model options carries it.
"""
import json
import logging
import subprocess
import sys

import pytest
import timm
import torch

from timm_sortconv import check
from timm_sortconv.cli import invariance, mnist_results, model_cards, push_to_hub, run, train, validate
from timm_sortconv.data import mnist_sample_dir

SAMPLE = str(mnist_sample_dir())
TYPO, CLOSEST = "scnn_p_rs7", "scnn_p_rs_7"


def typo_commands(tmp_path):
    """For each tool that takes a model name: its ``main`` and a command line with a typo in one model option.
    (``scripts/demo.py`` builds its models' names itself, from ``--kernel-size``, whose choices argparse checks;
    ``check`` measures a fixed list.)"""
    row = tmp_path / "row.json"
    row.write_text(json.dumps({"model": TYPO, "model_kwargs": [], "train_args": [], "commands": [],
                               "reproduce": f"python scripts/mnist_results.py --model {TYPO} --data-dir DATA"}))
    data = ["--dataset", "sortconv/mnist", "--data-dir", SAMPLE]
    return {
        "train --model": (train.main, ["--model", TYPO, *data, "--output", str(tmp_path)]),
        "validate --model": (validate.main, ["--model", TYPO, *data]),
        "validate --baseline-model": (validate.main, ["--model", "scnn_p_rs_3", "--baseline-model", TYPO, *data]),
        "mnist_results --model": (mnist_results.main, ["--model", TYPO, "--data-dir", SAMPLE, "--runs",
                                                       str(tmp_path / "runs"), "--results", str(tmp_path / "rows")]),
        "invariance --models": (invariance.main, ["--models", "scnn_p_rs_3", TYPO]),
        "invariance --models --quarter-turn": (invariance.main, ["--models", TYPO, "--quarter-turn", "28"]),
        "push_to_hub --model": (push_to_hub.main, ["--model", TYPO, "--checkpoint", str(row), "--dry-run",
                                                   str(tmp_path / "upload")]),
        "model_cards ROWS": (model_cards.main, [str(row), "--out", str(tmp_path / "cards")]),
    }


@pytest.mark.parametrize("tool", ["train --model", "validate --model", "validate --baseline-model",
                                  "mnist_results --model", "invariance --models", "invariance --models --quarter-turn",
                                  "push_to_hub --model", "model_cards ROWS"])
def test_a_model_name_typo_ends_in_one_line_with_the_closest_names(tool, tmp_path, capsys, one_thread):
    main, argv = typo_commands(tmp_path)[tool]
    with pytest.raises(SystemExit) as exit_info:
        run(main, argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: unknown model {TYPO!r}; closest: {CLOSEST}, scnn_s_rs_7, scnn_p_rs_5"], errors


def test_the_closest_names_come_from_timms_registry_and_tags_are_checked_too(capsys):
    for name in ("resnet_18", "convnext_atto"):
        assert timm.is_model(name) == (name == "convnext_atto")
    with pytest.raises(SystemExit):
        run(lambda argv: timm.create_model("resnet_18"))
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: unknown model 'resnet_18'; closest: resnet18")
    with pytest.raises(SystemExit):
        run(lambda argv: timm.create_model("scnn_p_rs_7.imagenet", pretrained=True))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: unknown pretrained tag 'imagenet' of scnn_p_rs_7; its tags: mnist")
    with pytest.raises(SystemExit):
        run(lambda argv: timm.create_model("qqqqqqqqqq"))
    assert "no registered name is close" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="something else"):  # other errors are not input errors: they propagate
        run(lambda argv: (_ for _ in ()).throw(RuntimeError("something else")))


@pytest.mark.slow
def test_a_typo_in_the_training_script_prints_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, "scripts/train.py", "--model", TYPO, "--dataset", "sortconv/mnist",
                             "--data-dir", SAMPLE, "--output", str(tmp_path)], capture_output=True, text=True,
                            timeout=300, cwd=check.__file__.rsplit("/timm_sortconv/", 1)[0])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: unknown model {TYPO!r}; closest: {CLOSEST}")


@pytest.fixture
def one_case(monkeypatch):
    """``check`` cut to one agreement case and no timed model: its output logic, in a second."""
    case = check.Case("reference", None, "polar", "ring", 3, check.LAYERS[0], "float32")
    monkeypatch.setattr(check, "agreement_cases", lambda device: [case])
    monkeypatch.setattr(check, "MODELS", {})


def test_check_prints_its_report_and_writes_a_file_only_where_output_says(one_case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert check.main(["--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Sorting Convolution check") and "1 of 1 cases agree." in printed
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder
    report = tmp_path / "sub" / "report.md"
    report.parent.mkdir()
    assert check.main(["--device", "cpu", "--output", str(report)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["report.md", "sub"]
    assert printed.startswith(report.read_text().rstrip("\n")) and f"Report written to {report}" in printed


def test_loading_weights_logs_what_it_loaded(tmp_path, caplog):
    """timm's log line names the key a checkpoint keeps its weights under, and ``weights`` for a file that is the
    weights themselves (the bundled safetensors), where timm alone leaves a blank."""
    with caplog.at_level(logging.INFO, logger="timm"):
        model = timm.create_model("scnn_p_rs_3", pretrained=True)
        torch.save({"state_dict": model.state_dict()}, tmp_path / "run.pth.tar")
        timm.models.load_checkpoint(model, str(tmp_path / "run.pth.tar"))
    loaded = [r.getMessage() for r in caplog.records if "from checkpoint" in r.getMessage()]
    assert [m.split(" from checkpoint")[0] for m in loaded] == ["Loaded weights", "Loaded state_dict"], loaded
    assert loaded[0].endswith("scnn_p_rs_3.safetensors'")
