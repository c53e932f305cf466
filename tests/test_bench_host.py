"""scripts/bench_host.py's triton mode: the Triton backend's host work per call on meta tensors, without a GPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def host_rows(tmp_path, *extra):
    """The JSON lines of one run over scnn_p_rs_7's layers, forced onto the columns and gemm paths (a subprocess:
    the script replaces the backend's launcher with its counter)."""
    out = tmp_path / f"host{len(extra)}.jsonl"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_host.py"), "triton", "--models",
                             "scnn_p_rs_7", "--paths", "columns", "gemm", "--rounds", "1", "--calls", "2", "--json",
                             str(out), *extra], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return {(row["layer"], row["path"].split()[0]): row for row in map(json.loads, out.read_text().splitlines())}


def test_the_scatter_launches_no_fold(tmp_path):
    fold, scatter = host_rows(tmp_path), host_rows(tmp_path, "--scatter")
    assert fold.keys() == scatter.keys() and len(fold) == 12  # 6 layers x 2 paths
    assert all(row["path"] in ("columns", "gemm") for row in fold.values())
    assert all(row["path"].endswith(" scatter") for row in scatter.values())
    for key, row in fold.items():
        assert scatter[key]["launches"][0] == row["launches"][0]  # the same forward
        # the backward's F.fold (counted as a launch), once per chunk of images, is gone
        assert scatter[key]["launches"][1] < row["launches"][1], (key, row["launches"], scatter[key]["launches"])
        if key[1] == "gemm":  # the input gradient's kernel and the weight gradient's
            assert scatter[key]["launches"][1] == 2


def test_scatter_with_auto_is_refused_in_one_line():
    # auto's candidates already hold the scatters: --scatter forces paths only, and says so without a traceback
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_host.py"), "triton", "--models",
                             "scnn_p_rs_7", "--paths", "gemm", "auto", "--scatter"], capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "--scatter" in result.stderr and "auto" in result.stderr and not result.stdout.strip()
