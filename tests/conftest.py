"""Shared pytest fixtures and helpers."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parent.parent
# The research tools (tests/research/) import one another as scripts run from their folder do.
RESEARCH = REPO / "scripts" / "research"
if str(RESEARCH) not in sys.path:
    sys.path.insert(0, str(RESEARCH))


def load_script(path, name):
    """The script at ``path`` (``scripts/*.py``, not a package module) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# timm's own train.py, validate.py and benchmark.py, which the README runs through ``python -m timm_sortconv.run``,
# are in timm's GitHub repository only: neither timm's wheel nor its sdist on PyPI holds them (timm 1.0.31's sdist has
# the package and tests/), and CI reaches package registries only, so the set-up cannot fetch them. With
# TIMM_SCRIPTS_DIR naming a folder that holds them (a checkout of timm's repository), the tests that need them run.
TIMM_SCRIPTS_DIR = os.environ.get("TIMM_SCRIPTS_DIR")
NO_TIMM_SCRIPTS = ("timm's train.py, validate.py and benchmark.py are in timm's GitHub repository only, not in its "
                   "wheel or its PyPI sdist, so CI (package registries only) cannot fetch them; TIMM_SCRIPTS_DIR=<a "
                   "checkout of timm's repository> runs this test")


def under_ci() -> bool:
    """Whether this run is CI's: the environment variable ``CI`` set (as CI services and ``.ci/run`` set it)."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def unavailable(reason: str):
    """Skips the test for ``reason``, something this machine lacks that ``scripts/bootstrap.sh`` provides (the
    fused CPU kernel, timm's test files); under CI, which runs the set-up first, it fails the test instead: there the
    lack is a broken set-up, and a skip would hide it."""
    if under_ci():
        pytest.fail(f"{reason} (CI runs scripts/bootstrap.sh, which provides it)", pytrace=False)
    pytest.skip(reason)


def quick_first(values, quick=1):
    """``parametrize`` values of which the first ``quick`` run in the quick loop (``pytest -m "not slow"``) and the
    others carry the ``slow`` marker; a tuple value is the arguments of a multi-name ``parametrize``."""
    return [value if index < quick else
            pytest.param(*(value if isinstance(value, tuple) else (value,)), marks=pytest.mark.slow)
            for index, value in enumerate(values)]


def kernel_levels():
    """The instruction-set levels whose CPU kernels the tests run (the ``isa`` fixture of tests/test_cpu_backend.py):
    those this CPU runs, from the package's own level (``cpu_backend.cpu_isa()``: PyTorch's, which
    ``ATEN_CPU_CAPABILITY`` sets, unless ``TIMM_SORTCONV_CPU_ISA`` names one) down. An AVX-512 machine runs avx512,
    avx2 and generic, an AVX2-only one avx2 and generic, others generic; under ``ATEN_CPU_CAPABILITY=avx2`` an AVX-512
    machine runs the suite as an AVX2-only one does: the same levels, and the avx2 build as the package's kernel,
    which has no bfloat16 products (the AVX-512 BF16 tests skip)."""
    from timm_sortconv.ops import cpu_backend

    levels = cpu_backend.runnable_isa_levels()
    return levels[levels.index(cpu_backend.cpu_isa()):]


@pytest.fixture
def one_thread():
    """Runs a test on one intra-op thread. The operator tests use tiny tensors, for which thread start-up
    costs more than the work, and a second busy process on a 2-core machine makes spinning OpenMP
    workers hundreds of times slower (31 ms instead of 0.14 ms for one 5x5 forward, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def auto_without_triton(monkeypatch):
    """backend="auto" as on a machine without CUDA, for the tests of its CPU fallbacks: under TRITON_INTERPRET=1
    the Triton backend takes CPU tensors and would come before them, so ``auto`` leaves it out here
    (``backend="triton"`` still runs it)."""
    import dataclasses

    from timm_sortconv.ops import backends

    triton = backends._BACKENDS.get("triton")
    if triton is not None:
        monkeypatch.setitem(backends._BACKENDS, "triton", dataclasses.replace(triton, auto=False))


def randomise_batchnorm(model, seed=0):
    """Non-trivial BatchNorm statistics and affine parameters, so that eval-mode BatchNorm hides nothing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.rand(m.num_features, generator=gen) - 0.5)
                m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
                    m.bias.copy_(torch.rand(m.num_features, generator=gen) - 0.5)
