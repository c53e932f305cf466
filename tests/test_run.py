"""``python -m timm_sortconv.run SCRIPT ARGS``: any script runs as ``__main__`` with the models registered.

timm's own ``train.py``, ``validate.py`` and ``benchmark.py`` live in timm's repository, not in its wheel
or sdist (``conftest.NO_TIMM_SCRIPTS``); with ``TIMM_SCRIPTS_DIR`` pointing at a checkout of it, they are run on a
small image folder too. The launcher's mechanism itself is tested everywhere, on scripts written here.
"""
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NO_TIMM_SCRIPTS, TIMM_SCRIPTS_DIR
from timm_sortconv.data import mnist_sample_dir
from timm_sortconv.data.export import main as export_main


def launch(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "timm_sortconv.run", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


@pytest.mark.slow
def test_the_script_sees_the_models_its_arguments_and_its_folder(tmp_path):
    (tmp_path / "helper.py").write_text("VALUE = 'from the script folder'\n")
    script = tmp_path / "script.py"
    script.write_text(
        "import sys, timm, helper\n"
        "assert __name__ == '__main__'\n"
        "model = timm.create_model('scnn_p_rs_3')\n"
        "print(sys.argv[1:], helper.VALUE, type(model).__name__)\n"
        "sys.exit(int(sys.argv[-1]))\n")
    result = launch(script, "--model", "scnn_p_rs_3", "0")
    assert result.returncode == 0, result.stderr
    assert "['--model', 'scnn_p_rs_3', '0'] from the script folder SCNN" in result.stdout
    assert launch(script, "3").returncode == 3  # the script's exit status is the launcher's


@pytest.mark.slow
def test_usage_and_a_missing_script():
    assert "usage: python -m timm_sortconv.run SCRIPT" in launch().stdout
    result = launch("no/such/train.py")
    assert result.returncode == 2 and "no/such/train.py is not a file" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """The package's MNIST sample as image folders (train/, validation/), as timm's scripts read them."""
    out = tmp_path_factory.mktemp("mnist_folders")
    export_main(["sortconv/mnist", "--data-dir", str(mnist_sample_dir()), "--out", str(out)])
    return out


@pytest.mark.skipif(not TIMM_SCRIPTS_DIR, reason=NO_TIMM_SCRIPTS)
@pytest.mark.parametrize("script", ["validate.py", "benchmark.py", "train.py"])
def test_timms_scripts_run_our_models(script, image_folder, tmp_path):
    data = ["--num-classes", "10", "--mean", "0.1307", "--std", "0.3081", "--crop-pct", "1.0", "--workers", "0"]
    args = {
        "validate.py": [image_folder, "--split", "validation", "--model", "scnn_p_rs_3", "--pretrained",
                        "--input-size", 1, 28, 28, "-b", 100, "--device", "cpu", *data],
        "benchmark.py": ["--model", "scnn_p_rs_3", "--input-size", 3, 28, 28, "-b", 8, "--num-warm-iter", 1,
                         "--num-bench-iter", 5, "--device", "cpu", "--bench", "both"],
        "train.py": [image_folder, "--model", "scnn_p_rs_3", "--input-size", 1, 28, 28, "--epochs", 1, "-b", 50,
                     "--opt", "adam", "--lr", "1e-3", "--no-aug", "--smoothing", 0, "--device", "cpu",
                     "--output", tmp_path, "--experiment", "run", "--log-interval", 50, *data],
    }[script]
    result = launch(Path(TIMM_SCRIPTS_DIR) / script, *args, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    if script == "validate.py":
        assert "scnn_p_rs_3" in log and "Acc@1" in log
    elif script == "benchmark.py":
        assert '"infer_samples_per_sec"' in log and '"train_samples_per_sec"' in log and '"error"' not in log
    else:
        assert (tmp_path / "run" / "model_best.pth.tar").is_file()


def test_the_launcher_runs_a_script_as_main_in_process(tmp_path, monkeypatch, capsys):
    """The launcher's own logic, without a subprocess: usage, a missing script, and a script run as ``__main__``
    with its command line and its folder first on the path."""
    from timm_sortconv import run

    script = tmp_path / "tool.py"
    script.write_text("import sys, timm\nprint(__name__, sys.argv[1:], sys.path[0] == sys.argv[0].rsplit('/', 1)[0], "
                      "'scnn_p_rs_3' in timm.list_models('scnn_*'))\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    run.main([str(script), "--x", "1"])
    assert capsys.readouterr().out.strip() == "__main__ ['--x', '1'] True True"
    with pytest.raises(SystemExit) as exit_info:
        run.main([])
    assert exit_info.value.code == 2 and "usage: python -m timm_sortconv.run" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        run.main([str(tmp_path / "missing.py")])
    assert exit_info.value.code == 2 and "missing.py is not a file" in capsys.readouterr().err
