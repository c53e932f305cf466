"""What CI runs (``bash .ci/run``): the README's test command after the set-up, with ``CI`` set, under which a
thing the set-up provides and this machine lacks fails the run instead of skipping tests
(``conftest.unavailable``)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import unavailable

REPO = Path(__file__).resolve().parents[1]


def test_ci_sets_ci_and_runs_the_readmes_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert 'export CI="${CI:-true}"' in ci
    assert "bash scripts/bootstrap.sh && .venv/bin/python -m pytest -q" in ci


@pytest.mark.parametrize("ci, outcome", [("", pytest.skip.Exception), ("false", pytest.skip.Exception),
                                         ("true", pytest.fail.Exception), ("1", pytest.fail.Exception)])
def test_a_missing_piece_skips_here_and_fails_under_ci(ci, outcome, monkeypatch):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="the fused CPU extension could not be built"):
        unavailable("the fused CPU extension could not be built here: no compiler")


@pytest.mark.slow
@pytest.mark.parametrize("ci, summary", [("", "1 skipped"), ("true", "1 error")])
def test_a_kernel_that_does_not_build_fails_the_cpu_backend_tests_under_ci(ci, summary, tmp_path):
    """tests/test_cpu_backend.py with the kernel's build failing (a plugin makes ``load_extension`` warn and return
    ``None``, as a build without a compiler does): skipped with the build's reason here, an error under CI."""
    (tmp_path / "no_kernel.py").write_text(
        "import warnings\n"
        "from timm_sortconv.ops import cpu_backend\n"
        "def failed_build(verbose=False):\n"
        "    warnings.warn('no C++ compiler')\n"
        "    return None\n"
        "cpu_backend.load_extension = failed_build\n")
    env = dict(os.environ, CI=ci, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    env.pop("TIMM_SORTCONV_DISABLE_FAST", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no_kernel", "-p", "no:cacheprovider",
                             "-n", "0", "-rse",
                             "tests/test_cpu_backend.py::test_compiled_polar_tap_positions_match_the_geometry"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    log = result.stdout + result.stderr
    assert log.strip().splitlines()[-1].split(" in ")[0].endswith(summary), log[-3000:]
    assert "the fused CPU extension could not be built here: no C++ compiler" in log, log[-3000:]
