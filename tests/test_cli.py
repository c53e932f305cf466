"""What every command-line tool does with a user's mistake, and where ``python -m timm_sortconv.check`` writes.

A model name timm does not know ends a tool in one ``error:`` line naming timm's closest names (the shared
:func:`timm_sortconv.cli.run`), without a traceback, whichever of the tool's model options carries it; so do
``--pretrained`` for a model without weights (naming those with weights) and a data set whose images have other
channels than the model takes (naming the option that fixes it).
"""
import logging
import subprocess
import sys

import pytest
import timm
import torch

from timm_sortconv import check
from timm_sortconv.cli import invariance, mnist_results, model_cards, push_to_hub, run, train, validate
from timm_sortconv.data import mnist_sample_dir
from timm_sortconv.hub import bundled_models

SAMPLE = str(mnist_sample_dir())
TYPO, CLOSEST = "scnn_p_rs7", "scnn_p_rs_7"


def typo_commands(tmp_path):
    """For each tool that takes a model name: its ``main`` and a command line with a typo in one model option.
    (``scripts/demo.py`` builds its models' names itself, from ``--kernel-size``, whose choices argparse checks;
    ``check`` measures a fixed list.)"""
    row = tmp_path / "rows.csv"
    mnist_results.records(row).put({"name": TYPO, "model": TYPO, "model_kwargs": [], "train_args": [], "commands": [],
                                    "reproduce": f"python scripts/mnist_results.py --model {TYPO} --data-dir DATA"})
    data = ["--dataset", "sortconv/mnist", "--data-dir", SAMPLE]
    return {
        "train --model": (train.main, ["--model", TYPO, *data, "--output", str(tmp_path)]),
        "validate --model": (validate.main, ["--model", TYPO, *data]),
        "validate --baseline-model": (validate.main, ["--model", "scnn_p_rs_3", "--baseline-model", TYPO, *data]),
        "mnist_results --model": (mnist_results.main, ["--model", TYPO, "--data-dir", SAMPLE, "--runs",
                                                       str(tmp_path / "runs"), "--results", str(row)]),
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
def own_stderr():
    """Takes timm's log handlers off the root logger before and after the test: :func:`run` adds one
    (``timm.utils.setup_default_logging``) on the stderr of its time, a test's captured stderr that is closed
    after it, where a later test's log lines would raise logging's errors into that test's stderr."""
    def remove():
        for handler in [h for h in logging.root.handlers if type(h) is logging.StreamHandler]:
            logging.root.removeHandler(handler)
    remove()
    yield
    remove()


def one_error_line(main, argv, capsys) -> str:
    """Runs ``main(argv)`` as the scripts do (:func:`run`); asserts that it ends with exit status 2, no traceback,
    and one ``error:`` line, stderr's last; returns that line."""
    with pytest.raises(SystemExit) as exit_info:
        run(main, argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0], err
    return errors[0]


MNIST = ["--dataset", "sortconv/mnist", "--data-dir", SAMPLE]
FIX_CHANNELS = "to build it for 1-channel input, or a model that takes 1 channel"


@pytest.mark.parametrize("tool", ["validate --model", "validate --baseline-model", "validate --input-size",
                                  "train --model"])
def test_a_model_that_takes_other_channels_than_the_data_ends_in_one_line(tool, tmp_path, capsys, one_thread,
                                                                          own_stderr):
    """MNIST's images have one channel, ri_resnet18 takes three: the tool names the model, both counts and the
    option that builds the model for the data (``--input-size`` where the user gave that), before reading a
    batch, and ``train`` writes nothing."""
    main, argv, expected = {
        "validate --model": (validate.main, [*MNIST, "--split", "test", "--model", "ri_resnet18", "-b", "20"],
                             f"--model ri_resnet18 takes 3 input channels but sortconv/mnist has 1; pass --in-chans 1 "
                             f"{FIX_CHANNELS}"),
        "validate --baseline-model": (validate.main, [*MNIST, "--model", "scnn_p_rs_3", "--baseline-model",
                                                      "ri_resnet18_baseline"],
                                      "--baseline-model ri_resnet18_baseline takes 3 input channels but sortconv/mnist "
                                      f"has 1; pass --in-chans 1 {FIX_CHANNELS}"),
        "validate --input-size": (validate.main, [*MNIST, "--model", "ri_resnet18", "--input-size", "3", "64", "64"],
                                  "--model ri_resnet18 takes 3 input channels but sortconv/mnist has 1; pass "
                                  f"--input-size 1 64 64 {FIX_CHANNELS}"),
        "train --model": (train.main, [*MNIST, "--model", "ri_resnet18", "--output", str(tmp_path), "--epochs", "1"],
                          f"--model ri_resnet18 takes 3 input channels but sortconv/mnist has 1; pass --in-chans 1 "
                          f"{FIX_CHANNELS}"),
    }[tool]
    assert one_error_line(main, argv, capsys) == "error: " + expected
    assert list(tmp_path.iterdir()) == []


def test_the_channels_the_error_names_are_accepted(one_thread, own_stderr):
    """``--in-chans 1``, as the error above says, builds ri_resnet18 for MNIST's images, and it evaluates them."""
    results = validate.main([*MNIST, "--split", "test", "--model", "ri_resnet18", "--in-chans", "1", "--samples", "2",
                             "-j", "0"])
    assert list(results["ri_resnet18"]) == [0.0]


@pytest.mark.parametrize("tool", ["validate --pretrained", "validate --baseline-pretrained", "train --pretrained"])
def test_pretrained_weights_of_a_model_without_them_end_in_one_line_naming_the_models_with_weights(
        tool, tmp_path, capsys, one_thread, own_stderr):
    """The message names the option that asked for the weights (validate has one per model)."""
    main, argv, name = {
        "validate --pretrained": (validate.main, [*MNIST, "--model", "ri_resnet18", "--pretrained"], "ri_resnet18"),
        "validate --baseline-pretrained": (validate.main, [*MNIST, "--model", "scnn_p_rs_3", "--baseline-model",
                                                           "ri_vgg16", "--baseline-pretrained"], "ri_vgg16"),
        "train --pretrained": (train.main, [*MNIST, "--model", "ri_resnet18", "--pretrained", "--output",
                                            str(tmp_path)], "ri_resnet18"),
    }[tool]
    option = tool.split()[1]
    with_weights = bundled_models()
    assert {"scnn_p_rs_3", "scnn_p_rs_7", "scnn_baseline_7"} <= set(with_weights) and name not in with_weights
    assert one_error_line(main, argv, capsys) == (
        f"error: {name} has no pretrained weights here; models with weights (bundled): {', '.join(with_weights)}; "
        f"leave out {option} to start it at random initialisation")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_issues_command_line_with_the_wrong_channels_prints_one_line(tmp_path):
    """The command line of issue 47, as a user types it: MNIST (one channel) with ri_resnet18 (three)."""
    result = subprocess.run([sys.executable, "scripts/validate.py", *MNIST, "--split", "test", "--model", "ri_resnet18",
                             "-b", "20"], capture_output=True, text=True, timeout=300,
                            cwd=check.__file__.rsplit("/timm_sortconv/", 1)[0])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: --model ri_resnet18 takes 3 input channels but sortconv/mnist has 1; pass --in-chans 1 {FIX_CHANNELS}")


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
