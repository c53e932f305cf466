"""The kernel A/B benchmark (``scripts/research/bench_kernel_ab.py``): its argument checks and its checkout of
a revision's kernel sources."""
import subprocess

import pytest

from conftest import REPO, load_script


def load_ab_script():
    return load_script(REPO / "scripts" / "research" / "bench_kernel_ab.py", "bench_kernel_ab")


def test_kernel_ab_script_checks_its_input(tmp_path, capsys):
    ab = load_ab_script()
    for shape in ("1,2,3", "1,2,3,4,6", "1,2,x,4,5"):
        with pytest.raises(SystemExit) as error:
            ab.parse_args(["git:HEAD", "--shape", shape])
        assert error.value.code == 2
        assert "--shape takes B,C_in,C_out,H,k with an odd k" in capsys.readouterr().err
    assert ab.parse_args(["git:HEAD", "--shape", "2,3,4,5,7"]).shape == (2, 3, 4, 5, 7)
    for variant in ("polar", "polar-ring-guided", "disc-ring", "polar-align-guided-x"):
        with pytest.raises(SystemExit) as error:
            ab.parse_args(["git:HEAD", "--variants", variant])
        assert error.value.code == 2
        assert "--variants takes sampling-sorting or sampling-align-guided" in capsys.readouterr().err
    assert ab.parse_args(["git:HEAD", "--variants", "polar-ring,square-align-guided"]).variants == [
        ("polar-ring", "polar", "ring", False), ("square-align-guided", "square", "align", True)]
    with pytest.raises(SystemExit, match="no sort_conv_cpu.cpp there"):
        ab.checkout_csrc(str(tmp_path), tmp_path)
    with pytest.raises(SystemExit, match="no-such-revision"):
        ab.checkout_csrc("git:no-such-revision", tmp_path)
    assert ab.split_version("git:HEAD@avx2", None) == ("git:HEAD", "avx2")
    assert ab.split_version("path/to/csrc", "generic") == ("path/to/csrc", "generic")
    with pytest.raises(SystemExit, match="unknown instruction-set level 'neon'; accepted: avx512, avx2, generic"):
        ab.split_version("git:HEAD@neon", None)


def test_kernel_ab_script_extracts_a_revision(tmp_path):
    ab = load_ab_script()
    repo = REPO
    if subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    folder = ab.checkout_csrc("git:HEAD", tmp_path)
    committed = subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{ab.CSRC}/sort_conv_cpu.cpp"],
                               capture_output=True, check=True).stdout
    assert (folder / "sort_conv_cpu.cpp").read_bytes() == committed
    assert (folder / "polar_taps.h").is_file()
