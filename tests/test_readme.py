"""Every command of README.md, of ``docs/timm_scripts.md`` and of the model cards runs as written, offline, on a
CPU-only machine.

Quick checks: Python blocks are executed, and every shell command (of the README, the timm scripts' page, the cards
and ``model_cards/README.md``) is checked: the files it runs exist and its flags parse with the tool's own parser.

The slow tests run the commands themselves, in order, with ``CUDA_VISIBLE_DEVICES`` empty and ``HF_HUB_OFFLINE=1``,
in a folder laid out as the clone (``scripts/``, ``timm_sortconv/`` and ``.venv`` linked, a copy of
``model_cards/results``), so that they write nothing into the clone: the README's commands with their own data
folder (the MNIST sample in the package), the cards' with a tiny MNIST in ``DATA/mnist``. What a test changes in a
command to make it take seconds is listed in :data:`SHORTER`: the number of epochs and of samples, nothing else;
``python`` is the interpreter running the tests. Commands that run timm's own scripts (``TIMM/...``) run when
``TIMM_SCRIPTS_DIR`` names a folder that holds them (``conftest.NO_TIMM_SCRIPTS`` says why CI has none); their
launcher part is always checked.
"""
import glob
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from test_data import make_mnist

from conftest import NO_TIMM_SCRIPTS, TIMM_SCRIPTS_DIR
from timm_sortconv.cli import demo, invariance, mnist_results, model_cards, push_to_hub, train, validate
from timm_sortconv.data import export

REPO = Path(__file__).resolve().parents[1]
CARDS_DIR = REPO / "model_cards"
PYTHON = ".venv/bin/python"
TOOLS = {f"scripts/{name}.py": tool.build_parser() if hasattr(tool, "build_parser") else tool.parser
         for name, tool in (("train", train), ("validate", validate), ("demo", demo), ("invariance", invariance),
                            ("mnist_results", mnist_results), ("model_cards", model_cards))}


def blocks(text, lang):
    return [code for found, code in re.findall(r"^```(\w+)\n(.*?)^```", text, flags=re.S | re.M) if found == lang]


def commands(block):
    """The block's commands: continuation lines joined, comments dropped, ``&&`` chains split."""
    text = re.sub(r"\\\n\s*", " ", block)
    for line in text.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            yield from (part.strip() for part in line.split("&&"))


README = (REPO / "README.md").read_text()
PYTHON_BLOCKS = blocks(README, "python")
SHELL_BLOCKS = blocks(README, "bash")
TIMM_BLOCKS = blocks((REPO / "docs" / "timm_scripts.md").read_text(), "bash")
CARDS = sorted(CARDS_DIR.glob("scnn_*.md"))
# a card's commands: in backticks, mnist_results.py first (its one or two stages), then validate.py
CARD_COMMANDS = {card.stem: re.findall(r"`(python scripts/[^`]+)`", card.read_text()) for card in CARDS}
CARDS_README_COMMANDS = [c for block in blocks((CARDS_DIR / "README.md").read_text(), "bash") for c in commands(block)]


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


def parse_timm_script(script, argv):
    module = runpy.run_path(str(Path(TIMM_SCRIPTS_DIR) / script), run_name="readme_check")
    args_config, remaining = module["config_parser"].parse_known_args(argv) if "config_parser" in module else (
        None, argv)
    module["parser"].parse_args(remaining)


def check(command):
    words = shlex.split(command)
    program, rest = words[0], words[1:]
    if program == "bash":
        assert (REPO / rest[0]).is_file(), command
    elif program == ".venv/bin/torchrun":
        script_at = next(i for i, word in enumerate(rest) if word.endswith(".py"))
        check(f"{PYTHON} " + shlex.join(rest[script_at:]))
    elif program in (PYTHON, "python"):
        if rest[:2] == ["-m", "pytest"]:
            return
        if rest[:2] == ["-m", "timm_sortconv.run"]:
            script = rest[2]
            assert Path(script).name in ("train.py", "validate.py", "benchmark.py", "inference.py", "onnx_export.py",
                                         "onnx_validate.py"), command
            if TIMM_SCRIPTS_DIR:  # else test_timm_script_commands_parse says it was skipped
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
        elif script == "scripts/onnx_export.py":
            from timm_sortconv.cli import onnx as onnx_tool

            onnx_tool.parse_args(argv)
        elif script == "scripts/onnx_library.py":
            assert not argv or argv[0].startswith("--"), command
        elif script.startswith("scripts/bench_"):
            runpy.run_path(str(REPO / script), run_name="readme_check")["parse_args"](argv)
        else:
            parsed, unknown = TOOLS[script].parse_known_args(argv)
            if script == "scripts/mnist_results.py" and unknown:
                train.parse_args(unknown)  # mnist_results passes what it does not know to train.py
            else:
                assert not unknown, (command, unknown)
    else:
        pytest.fail(f"command with no check: {command}")


@pytest.mark.parametrize("block", SHELL_BLOCKS + TIMM_BLOCKS)
def test_shell_block_commands_parse(block, monkeypatch):
    monkeypatch.chdir(REPO)  # paths in the README are relative to the clone
    for command in commands(block):
        check(command)


def test_readme_commands_read_the_data_in_the_package():
    # a fresh clone has no data folder: every data folder the README names is the sample shipped in the package
    named = [word for block in SHELL_BLOCKS for command in commands(block) for word in
             re.findall(r"(?:--data-dir|start \S+) (\S+)", command)]
    assert named and set(named) == {"timm_sortconv/data/mnist_sample"}


@pytest.mark.parametrize("card", [*CARD_COMMANDS, "README"])
def test_model_card_commands_parse_and_name_only_the_clones_folders(card, monkeypatch):
    monkeypatch.chdir(REPO)
    found = CARD_COMMANDS[card] if card != "README" else CARDS_README_COMMANDS
    assert found
    for command in found:
        check(command)
        # data as the README names it, runs and results inside the clone, no machine's paths
        assert not re.search(r"(^| )(/|\.\./|~)|results/mnist|shared", command), command
        if "--data-dir" in command:
            assert "--data-dir DATA/mnist " in command + " ", command


@pytest.mark.skipif(not TIMM_SCRIPTS_DIR, reason=NO_TIMM_SCRIPTS)
def test_timm_script_commands_parse():
    launched = [shlex.split(c) for block in TIMM_BLOCKS for c in commands(block) if "-m timm_sortconv.run" in c]
    assert len(launched) >= 2
    for words in launched:
        parse_timm_script(Path(words[3]).name, words[4:])


# ------------------------------------------------------------------------------------------ running the commands

# What a test adds to a command (found by a word it contains, or by all words of a tuple; the first entry that
# matches) so that it takes seconds: the number of epochs and of samples; the rest runs as written. Training runs
# one epoch on 200 images (validation on 100), sweeps read 20 images, the demo trains on 50 images and sweeps 8.
SAMPLES = ["--train-samples", "200", "--val-samples", "100"]
SHORTER = [
    # No loader workers under torchrun: on CPython 3.11.7 a worker forked while another thread of the rank holds the
    # interpreter's thread-state lock hangs forever (python/cpython#112275, fixed in later 3.11 releases and 3.12);
    # seen once here, rank 0 waiting on its validation worker and rank 1 in DDP's buffer broadcast.
    (".venv/bin/torchrun", ["--epochs", "1", "-j", "0", *SAMPLES]),
    ("scripts/train.py", ["--epochs", "1", *SAMPLES]),
    # the README's rows sweep 20 images, the row and the one it is compared with alike; a card's row sweeps as
    # written, as the stored row it is compared with did
    (("scripts/mnist_results.py", "timm_sortconv/data/mnist_sample"),
     ["--epochs", "1", "--rot-samples", "20", *SAMPLES]),
    ("scripts/mnist_results.py", ["--epochs", "1", *SAMPLES]),
    ("scripts/validate.py", ["--samples", "20"]),
    ("TIMM/train.py", ["--epochs", "1"]),
    ("scripts/demo.py", ["--train-samples", "50", "--samples", "8"]),
]
NOT_RUN = {
    "bash scripts/bootstrap.sh": "the set-up itself: CI runs it before the tests",
    f"{PYTHON} -m pytest -q": "this test suite",
    f"{PYTHON} -m timm_sortconv.check --quick": "tests/test_check.py runs it (test_quick_check_on_the_cpu)",
    "bash scripts/paper_protocol.sh start output/paper timm_sortconv/data/mnist_sample scnn_p_rs_7": "a 100-epoch run "
    "in the background: tests/test_train.py runs the script on a tiny configuration, stopped and started again",
    "bash scripts/paper_protocol.sh status output/paper scnn_p_rs_7": "the status of that run",
    # shortened to one epoch, the same run as the torchrun line before it; its configuration is the first line's
    ".venv/bin/torchrun --nproc_per_node 2 scripts/train.py -c scripts/configs/mnist_scnn.yaml --model scnn_p_rs_7 "
    "--data-dir timm_sortconv/data/mnist_sample --device cpu": "the torchrun line before it with the paper's "
    "configuration, which the first line trains with: shortened to one epoch, the same run",
}


@pytest.fixture
def clone(tmp_path):
    """A folder laid out as the clone for the documented commands, with tiny data sets."""
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    (tmp_path / "timm_sortconv").symlink_to(REPO / "timm_sortconv")  # the MNIST sample the README's commands read
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    shutil.copytree(CARDS_DIR / "results", tmp_path / "model_cards" / "results")
    # training split 205, validation 41: one batch of 100 for each of torchrun's two processes
    make_mnist(tmp_path / "DATA" / "mnist", num_train=246, num_test=12)  # the cards' data folder
    if TIMM_SCRIPTS_DIR:
        (tmp_path / "TIMM").symlink_to(Path(TIMM_SCRIPTS_DIR).resolve())
    return tmp_path


def run_as_written(command, folder):
    """Runs ``command`` in ``folder`` (plus its :data:`SHORTER` options) on a CPU-only machine; returns its log."""
    words = shlex.split(command)
    extra = next((extra for key, extra in SHORTER if all(word in words for word in
                                                         (key if isinstance(key, tuple) else (key,)))), [])
    if "--curve" in words and "--epochs" in extra:  # a learning curve of the one epoch left (the last --curve wins)
        extra = extra + ["--curve", "1"]
    words += extra
    if words[0] == "python":
        words[0] = sys.executable
    words = [match for word in words for match in (sorted(glob.glob(word, root_dir=folder)) or [word])]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(words, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"{command}\n{log[-4000:]}"
    return log


@pytest.mark.slow
@pytest.mark.parametrize("block", SHELL_BLOCKS + TIMM_BLOCKS)
def test_readme_commands_run(block, clone):
    before = set(os.listdir(clone))
    ran = []
    for command in commands(block):
        if command in NOT_RUN or ("TIMM/" in command and not TIMM_SCRIPTS_DIR):
            continue
        run_as_written(command, clone)
        ran.append(command)
    if not ran:
        pytest.skip("; ".join(NOT_RUN.get(c, NO_TIMM_SCRIPTS) for c in commands(block)))
    # what they write goes under output/, which git ignores, so git status of a clone stays clean
    assert set(os.listdir(clone)) - before <= {"output"}
    assert "/output/" in (REPO / ".gitignore").read_text().splitlines()


def test_readme_commands_name_no_output_in_the_clone_outside_output():
    """Every file or folder a README command is told to write (the runs of paper_protocol.sh, --results-csv, --plot,
    --output, --runs, --results, --out) is under output/, which git ignores."""
    named = [(command, word) for block in SHELL_BLOCKS + TIMM_BLOCKS for command in commands(block)
             for word in re.findall(r"(?:paper_protocol\.sh \w+|--results-csv|--plot|--output|--runs|--results|--out)"
                                    r" (\S+)", command)]
    assert named and all(word.startswith("output/") for _, word in named), named


def compared_rows_first(command: str) -> List[str]:
    """The commands of the rows ``command`` compares with (``--compare``): each of those models' row on the same
    data, results folder, sweep and epochs. A card's row is made beside rows swept on the same images (the card
    says so), and mnist_results.py refuses to compare with rows swept on others: on the tests' small data set, the
    stored rows'."""
    words = shlex.split(command)
    if "--compare" not in words:
        return []
    start = end = words.index("--compare")
    while end + 1 < len(words) and not words[end + 1].startswith("-"):
        end += 1
    kept = []
    for option, value in zip(words, words[1:]):
        if option in ("--data-dir", "--results", "--rot-samples", "--epochs", "--seed"):
            kept += [option, value]
    return [shlex.join(words[:2] + ["--model", name] + kept) for name in words[start + 1:end + 1]]


# One card of each kind: a 2,000-image sweep, a full sweep beside the baseline, and weights trained in two stages.
# The others differ from these in the model's name and the numbers (test_model_card_commands_parse... checks them).
@pytest.mark.slow
@pytest.mark.parametrize("card", ["scnn_p_gs_3", "scnn_p_rs_7", "scnn_p_c2_7_canon"])
def test_model_card_commands_run(card, clone):
    for command in CARD_COMMANDS[card]:
        for row in compared_rows_first(command):
            run_as_written(row, clone)
        run_as_written(command, clone)
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    for code in blocks((CARDS_DIR / f"{card}.md").read_text(), "python"):
        result = subprocess.run([sys.executable, "-c", code], cwd=clone, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_the_cards_are_what_their_commands_write(clone):
    """``model_cards/README.md``'s commands, run in the clone's layout, write the committed cards."""
    for command in CARDS_README_COMMANDS:
        run_as_written(command, clone)
    written = sorted((clone / "model_cards").glob("scnn_*.md"))
    assert [p.name for p in written] == [p.name for p in CARDS]
    for path in written:
        assert path.read_text() == (CARDS_DIR / path.name).read_text(), path.name
