"""Every code block of README.md runs as written: Python blocks are executed, and every command of the shell
blocks is checked: the files it runs exist and its flags parse with the tool's own parser.

Commands that run timm's own scripts through ``python -m timm_sortconv.run`` are parsed with those
scripts' parsers when ``TIMM_SCRIPTS_DIR`` points at a checkout of timm's repository (they are not in
timm's wheel); their launcher part is always checked.
"""
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from timm_sortconv.cli import demo, invariance, mnist_results, model_cards, push_to_hub, train, validate
from timm_sortconv.data import export

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.S | re.M)
PYTHON_BLOCKS = [code for lang, code in BLOCKS if lang == "python"]
SHELL_BLOCKS = [code for lang, code in BLOCKS if lang == "bash"]
PYTHON = ".venv/bin/python"
TOOLS = {f"scripts/{name}.py": tool.build_parser() if hasattr(tool, "build_parser") else tool.parser
         for name, tool in (("train", train), ("validate", validate), ("demo", demo), ("invariance", invariance),
                            ("mnist_results", mnist_results), ("model_cards", model_cards))}


def commands(block):
    """The block's commands: continuation lines joined, comments dropped, ``&&`` chains split."""
    text = re.sub(r"\\\n\s*", " ", block)
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            yield from (part.strip() for part in line.split("&&"))


def test_readme_has_the_two_commands_first():
    first = SHELL_BLOCKS[0]
    assert list(commands(first)) == ["bash scripts/bootstrap.sh", f"{PYTHON} scripts/demo.py",
                                     "bash scripts/bootstrap.sh", f"{PYTHON} -m pytest -q"]
    ci = (REPO / ".ci" / "run").read_text()
    assert f"bash scripts/bootstrap.sh && {PYTHON} -m pytest -q" in ci  # CI runs the README's test command


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(index, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="error::DeprecationWarning:timm_sortconv")
    result = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[index]], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


TIMM_SCRIPTS = os.environ.get("TIMM_SCRIPTS_DIR")


def parse_timm_script(script, argv):
    module = runpy.run_path(str(Path(TIMM_SCRIPTS) / script), run_name="readme_check")
    args_config, remaining = module["config_parser"].parse_known_args(argv) if "config_parser" in module else (
        None, argv)
    module["parser"].parse_args(remaining)


def check(command):
    words = shlex.split(command)
    program, rest = words[0], words[1:]
    if program == "bash":
        assert (REPO / rest[0]).is_file(), command
    elif program in ("mkdir", "cp", "gunzip"):
        return  # file handling around timm's own data layout
    elif program == ".venv/bin/torchrun":
        script_at = next(i for i, word in enumerate(rest) if word.endswith(".py"))
        check(f"{PYTHON} " + shlex.join(rest[script_at:]))
    elif program == PYTHON:
        if rest[:2] == ["-m", "pytest"]:
            return
        if rest[:2] == ["-m", "timm_sortconv.run"]:
            script = rest[2]
            assert Path(script).name in ("train.py", "validate.py", "benchmark.py", "inference.py"), command
            if TIMM_SCRIPTS:  # else test_timm_script_commands_parse says it was skipped
                parse_timm_script(Path(script).name, rest[3:])
            return
        if rest[:2] == ["-m", "timm_sortconv.check"]:
            from timm_sortconv import check as check_tool

            check_tool.parse_args(rest[2:])
            return
        if rest[:2] == ["-m", "timm_sortconv.data.export"]:
            with pytest.raises(SystemExit) as info:  # parse only: --help after the arguments stops there
                export.main(rest[2:] + ["--help"])
            assert info.value.code == 0
            return
        script, argv = rest[0], rest[1:]
        assert (REPO / script).is_file(), command
        if script == "scripts/push_to_hub.py":
            push_to_hub.parse_args(argv)
        elif script == "scripts/train.py":
            train.parse_args(argv)
        elif script.startswith("scripts/bench_"):
            runpy.run_path(str(REPO / script), run_name="readme_check")["parse_args"](argv)
        else:
            parsed, unknown = TOOLS[script].parse_known_args(argv)
            if script == "scripts/mnist_results.py" and unknown:
                train.parse_args(unknown)  # mnist_results passes what it does not know to train.py
            else:
                assert not unknown, (command, unknown)
    else:
        pytest.fail(f"README command with no check: {command}")


@pytest.mark.parametrize("index", range(len(SHELL_BLOCKS)))
def test_shell_block_commands_parse(index, monkeypatch):
    monkeypatch.chdir(REPO)  # paths in the README are relative to the clone
    for command in commands(SHELL_BLOCKS[index]):
        check(command)


@pytest.mark.skipif(not TIMM_SCRIPTS, reason="TIMM_SCRIPTS_DIR (a checkout of timm's repository) is not set")
def test_timm_script_commands_parse():
    launched = [shlex.split(c) for block in SHELL_BLOCKS for c in commands(block) if "-m timm_sortconv.run" in c]
    assert len(launched) >= 2
    for words in launched:
        parse_timm_script(Path(words[3]).name, words[4:])
