"""Shared pytest fixtures and helpers."""
import importlib.util
import sys

import pytest
import torch


def load_script(path, name):
    """The script at ``path`` (``scripts/*.py``, not a package module) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def one_thread():
    """Runs a test on one intra-op thread. The operator tests use tiny tensors, for which thread start-up
    costs more than the work, and a second busy process on a 2-core machine makes spinning OpenMP
    workers hundreds of times slower (31 ms instead of 0.14 ms for one 5x5 forward, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
