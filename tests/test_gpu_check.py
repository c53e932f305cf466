"""scripts/gpu_check.sh hands back what the device machine returns: at most 8 files under ``$OUT``. The stages
themselves need a GPU (dry-run by hand with ``DRY_RUN=1``); here the packing runs on stage logs already written, with
a stage name the script does not know (it says so and runs nothing)."""
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def _run(out: Path, cwd: Path) -> str:
    # From an empty folder: no carried wheels to install, nothing written beside $OUT.
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_SECONDS="60")
    result = subprocess.run(["bash", str(SCRIPT), "no-such-stage"], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _files(out: Path):
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())


@pytest.mark.parametrize("stages", [3, 9])
def test_the_returned_files_are_at_most_eight_and_keep_every_log(stages, tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    (out / "logs").mkdir(parents=True)
    work.mkdir()
    logs = {f"stage{i}.log": f"| table of stage {i} |\n" for i in range(stages)}
    for name, text in logs.items():
        (out / "logs" / name).write_text(text)
    (out / "results.jsonl").write_text('{"stage": 0}\n')
    printed = _run(out, work)
    assert "unknown stage no-such-stage" in printed
    files = _files(out)
    assert len(files) <= 8, files
    assert "summary.txt" in files and "results.jsonl" in files
    if "logs.tgz" in files:  # packed: every log inside, none beside it
        assert stages + 2 > 8 and not any(f.startswith("logs/") for f in files)
        with tarfile.open(out / "logs.tgz") as tar:
            packed = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
        assert packed == logs
    else:  # few enough to come back as they are
        assert stages + 2 <= 8
        assert {f[len("logs/"):]: (out / f).read_text() for f in files if f.startswith("logs/")} == logs
    assert not any(work.iterdir())
