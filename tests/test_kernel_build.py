"""Building the fused CPU kernel where several Python environments share one extension cache.

Two real virtual environments with the same torch and Python, reaching torch through different folders, load
a kernel in turn from one empty cache, twice each: each builds exactly once, announces that build with one
line before and one after, and never rebuilds the other's. The kernel here is a one-function module (it
builds in seconds); the package's kernel goes through the same code (``cpu_backend.load_kernel``).
"""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from timm_sortconv.ops import cpu_backend

REPO = Path(cpu_backend.__file__).resolve().parents[2]
TINY_SOURCE = b"""#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""
LOAD = """
import sys
from timm_sortconv.ops import cpu_backend
kernel = cpu_backend.load_kernel(sys.argv[1], "generic")
print(kernel.module.answer(), kernel.module.__file__)
"""


def second_environment(root: Path) -> Path:
    """A virtual environment of this Python whose ``torch`` is this one's, reached through a link in a folder
    of its own (so its torch headers and libraries have other paths, as in a second environment with its own
    install of the same torch), and whose other packages are this environment's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    linked = root / "linked"
    linked.mkdir()
    (linked / "torch").symlink_to(Path(torch.__file__).resolve().parent, target_is_directory=True)
    (site / "environment.pth").write_text(f"{linked}\n{sysconfig.get_paths()['purelib']}\n")
    return python


@pytest.mark.slow  # two builds: about a minute on 2 shared cores
def test_two_environments_each_build_once_and_never_rebuild_each_other(tmp_path):
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "sort_conv_cpu.cpp").write_bytes(TINY_SOURCE)
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    first = Path(sys.executable)
    second = second_environment(tmp_path / "second")
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))

    def load(python):
        result = subprocess.run([str(python), str(script), str(sources)], env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        answer, library = result.stdout.split()
        assert answer == "42"
        library = Path(library)
        return library, library.stat().st_mtime_ns, result.stderr

    runs = [(python, load(python)) for python in (first, second, first, second)]
    libraries = {python: {library for p, (library, _, _) in runs if p == python} for python in (first, second)}
    assert len(libraries[first]) == len(libraries[second]) == 1, "a later load used another cache entry"
    assert libraries[first] != libraries[second], "the two environments share one entry"
    for python, (library, stamp, _) in runs[2:]:
        assert stamp == next(s for p, (_, s, _) in runs if p == python), f"{python}: its build was rebuilt"
    # One build per environment, counted by the builds ninja ran (its log) and by the announcements.
    for python, (library,) in libraries.items():
        log = (library.parent / ".ninja_log").read_text().splitlines()
        assert sum(f"\t{library.name}\t" in line for line in log) == 1, log
        # each entry's build commands name its own environment's torch
        torch_folder = tmp_path / "second" / "linked" / "torch" if python == second else Path(torch.__file__).parent
        assert f"-isystem {torch_folder / 'include'}" in (library.parent / "build.ninja").read_text()
    announced = [stderr.count("timm_sortconv: compiling the fused CPU kernel (generic level")
                 for _, (_, _, stderr) in runs]
    assert announced == [1, 1, 0, 0]
    built = [stderr.count("timm_sortconv: the fused CPU kernel (generic) is built") for _, (_, _, stderr) in runs]
    assert built == [1, 1, 0, 0]
    assert runs[2][1][2] == runs[3][1][2] == "", "loading a cached build printed something"
    first_stderr = runs[0][1][2].splitlines()
    assert len(first_stderr) == 2, first_stderr
    assert "because this Python environment" in first_stderr[0] and "has no build of these sources yet" \
        in first_stderr[0] and "about a minute" in first_stderr[0] and str(tmp_path / "cache") in first_stderr[0]


def test_cache_name_hashes_the_build_environment(monkeypatch):
    sources = cpu_backend._sources(cpu_backend.SOURCE_DIR)
    name = cpu_backend.extension_name(sources, "generic")
    assert cpu_backend.build_environment()[0] == os.path.dirname(os.path.abspath(torch.__file__))
    monkeypatch.setenv("CXX", os.environ.get("CXX", "c++") + "-other")
    assert cpu_backend.extension_name(sources, "generic") != name
    monkeypatch.undo()
    assert cpu_backend.extension_name(sources, "generic") == name
    monkeypatch.setattr(cpu_backend, "build_environment", lambda: ("/another/env/torch", "", "", "c++"))
    assert cpu_backend.extension_name(sources, "generic") != name
