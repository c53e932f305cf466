"""timm's own model tests (``tests/test_models.py`` of timm's source distribution) on every registered
entrypoint of this package: forward, backward, default cfgs, features, intermediates, TorchScript, FX.

``scripts/bootstrap.sh`` unpacks the tests of the pinned timm into ``.cache/timm-<version>/tests``; they run
in their own pytest process with this package loaded as a plugin (``-p timm_sortconv``), so that timm's
parametrisation sees the models. Every selected test must pass: none is skipped, and only the TorchScript tests of
the guided models are deselected (their guide is shared between layers by a forward pre-hook, which
``torch.jit.script`` cannot compile: scripting one raises one clear error, asserted below; compile, export and ONNX
run them, tests/test_guide.py).
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import timm_sortconv  # noqa: F401  (registers the models)
from conftest import unavailable

REPO = Path(__file__).resolve().parents[1]
TIMM_TESTS = REPO / ".cache" / f"timm-{timm.__version__}" / "tests" / "test_models.py"
OUR_MODULES = ("scnn", "ri_vgg", "ri_resnet", "ri_densenet")
TORCHSCRIPT_TESTS = {"test_model_forward_torchscript", "test_model_forward_fx_torchscript"}


def our_models():
    return sorted(name for module in OUR_MODULES for name in timm.list_models(module=module))


@pytest.mark.slow
def test_every_entrypoint_passes_timms_model_tests():
    if not TIMM_TESTS.is_file():
        unavailable(f"timm's tests are not at {TIMM_TESTS}: scripts/bootstrap.sh unpacks them from timm's sdist")
    models = our_models()
    assert len(models) == 27, models
    guided = [name for name in models if "_guided" in name]
    assert guided == ["scnn_p_align_7_guided", "scnn_p_align_7_guided_canon"], guided
    for name in guided:
        with pytest.raises(RuntimeError, match="guided SortConv2d .* cannot be compiled by torch.jit.script"):
            torch.jit.script(timm.create_model(name))
    pattern = f"({' or '.join(models)}) and not (torchscript and _guided)"
    # (-n 0: in one process, whose -v lines name each test's outcome; this repository's pytest settings apply there)
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "timm_sortconv", "-p", "no:cacheprovider", "-n", "0",
                             "-v", "-W", "ignore", "-k", pattern, str(TIMM_TESTS)],
                            capture_output=True, text=True, timeout=1800, cwd=TIMM_TESTS.parent.parent)
    log = result.stdout + result.stderr
    summary = log.strip().splitlines()[-1]
    assert result.returncode == 0, log[-6000:]
    assert "skipped" not in summary and "failed" not in summary and "error" not in summary, summary
    passed = re.findall(r"::(test_\w+)\[([^\]]+)\] PASSED", log)
    for name in models:
        # parameters are "<batch size>-<model>" or, with pretrained tags, "<batch size>-<model>.<tag>"
        ran = {test for test, params in passed if name in (p.split(".")[0] for p in params.split("-"))}
        # what timm's file selects for a model of a module it does not list by name, for every entrypoint
        expected = {"test_model_forward", "test_model_backward", "test_model_default_cfgs",
                    "test_model_forward_features", "test_model_forward_fx", "test_model_backward_fx"}
        expected |= set() if name in guided else TORCHSCRIPT_TESTS
        assert expected <= ran and not (name in guided and ran & TORCHSCRIPT_TESTS), (name, sorted(ran))
