"""``python -m timm_sortconv.check``: the command users run to check and measure SC on their machine.

CI runs it on the CPU with ``--quick`` (test_quick_check_on_the_cpu); the other tests check what it covers and
that a backend that disagrees with the reference path fails it.
"""
import subprocess
import sys

import pytest
import torch

from timm_sortconv import check
from timm_sortconv.ops import backends
from timm_sortconv.ops.backends import Backend, register_backend
from timm_sortconv.ops.reference import sort_conv2d_reference

CPU = torch.device("cpu")


def test_cases_cover_every_variant_size_layer_and_dtype_for_each_backend():
    cases = check.agreement_cases(CPU)
    variants = {(c.sampling, c.sorting) for c in cases}
    assert {("polar", "ring"), ("polar", "global"), ("square", "ring"), ("square", "global")} <= variants
    assert {sorting for _, sorting in variants} >= {"c4", "c2"}
    backends_checked = {c.label for c in cases}
    assert "auto" in backends_checked and backends_checked >= {b for b in backends.available_backends()
                                                               if b != "reference" and not b.startswith("triton-")}
    for label in backends_checked:
        mine = [c for c in cases if c.label == label]
        assert {c.k for c in mine} == {3, 5, 7} and {c.dtype for c in mine} == {"float32", "bfloat16"}
        assert len(mine) == len(variants) * 3 * len(check.LAYERS) * 2


def test_the_check_inputs_have_no_ties():
    # a tie would let the sort's gradient go to either value, and two right backends differ there
    case = check.Case("cpu", None, "square", "global", 7, check.LAYERS[0], "bfloat16")
    x = check._values(case, CPU)[0]
    windows = torch.nn.functional.unfold(x[:, :1], 7)
    assert (windows.sort(dim=1).values.diff(dim=1) > 0).all()


@pytest.fixture
def broken_backend():
    """A backend that answers float32 CPU calls with the reference's result negated."""
    def forward(x, weight, bias, geometry, stride, dilation, groups, pad=(0, 0, 0, 0)):
        return -sort_conv2d_reference(x, weight, bias, geometry, stride, dilation, groups)

    reference = backends._BACKENDS["reference"]
    register_backend(Backend("broken", forward, reference.backward, lambda x, *args: x.dtype == torch.float32,
                             lambda: True, auto=False))
    yield
    backends._BACKENDS.pop("broken")


def test_a_backend_that_disagrees_fails_the_check(broken_backend, monkeypatch, tmp_path, capsys):
    cases = [check.Case(backend, None, "polar", "ring", 3, check.LAYERS[0], "float32") for backend in ("broken", "auto")]
    error, accepted, note = check.check_case(cases[0], CPU)
    assert error > accepted and note == ""
    monkeypatch.setattr(check, "agreement_cases", lambda device: cases)
    monkeypatch.setattr(check, "MODELS", {})
    report = tmp_path / "report.md"
    assert check.main(["--device", "cpu", "--output", str(report)]) == 1
    text = report.read_text()
    assert "| broken | polar-ring | 3 | 16 -> 16 | float32 |" in text and "| FAIL |" in text
    assert "**1 of 2 cases disagree with the reference path.**" in text


def test_each_agreement_row_is_printed_before_the_next_case_is_checked(monkeypatch, capsys):
    # a first run on a GPU compiles kernels for minutes: what it has checked must be on screen (and in a log cut
    # off at a time limit) as it goes, not only when the whole table is done
    cases = [check.Case("auto", None, "polar", "ring", k, check.LAYERS[0], "float32") for k in (3, 5, 7)]
    printed_before = []

    def fake_check(case, device):
        printed_before.append(sum(line.startswith("| auto | polar-ring |")
                                  for line in capsys.readouterr().out.splitlines()))
        return 1e-7, 1e-5, ""

    monkeypatch.setattr(check, "agreement_cases", lambda device: cases)
    monkeypatch.setattr(check, "check_case", fake_check)
    monkeypatch.setattr(check, "MODELS", {})
    assert check.main(["--device", "cpu"]) == 0
    # capsys.readouterr() drains what was printed, so each count is the rows printed since the previous check
    assert printed_before == [0, 1, 1]
    assert "3 of 3 cases agree." in capsys.readouterr().out


def test_decision_rows_name_the_choice_the_times_and_what_was_left_out():
    from timm_sortconv.ops.triton_backend.tuning import Candidate, Decision

    timed = Decision("k=3 polar-ring float32", Candidate("fused", print), {"fused": 1e-4, "reference": 2.5e-3},
                     {"direct": "disagrees (relative error 1e-1)"}, {"fused": 12.5, "direct": 3.25})
    untimed = Decision("k=7 square-global bfloat16", Candidate("reference", print))
    assert check.decision_rows([timed, untimed]) == [
        ["k=3 polar-ring float32", "fused", "fused 0.100 ms; reference 2.500 ms", "fused 12.50 s; direct 3.25 s",
         "direct: disagrees (relative error 1e-1)"],
        ["k=7 square-global bfloat16", "reference", "-", "-", "-"]]
    assert len(check.DECISION_HEADER) == 5


def test_a_call_the_backend_does_not_support_is_noted_not_failed():
    reference = backends._BACKENDS["reference"]
    register_backend(Backend("never", reference.forward, reference.backward, lambda *args: False, lambda: True,
                             auto=False))
    try:
        case = check.Case("never", None, "polar", "ring", 3, check.LAYERS[0], "float32")
        assert check.check_case(case, CPU) == (0.0, 0.0, "not supported")
    finally:
        backends._BACKENDS.pop("never")


@pytest.mark.slow
def test_quick_check_on_the_cpu(tmp_path):
    report = tmp_path / "check.md"
    result = subprocess.run([sys.executable, "-m", "timm_sortconv.check", "--quick", "--output", str(report)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    for row in ("| PyTorch | " + torch.__version__, "| CPU instruction set (PyTorch's level) |", "| Backends available |"):
        assert row in text
    agreement = [line for line in text.splitlines() if line.startswith("| auto |") or line.startswith("| cpu |")]
    assert len(agreement) == len(check.agreement_cases(CPU)) and all(line.endswith("| pass |") for line in agreement)
    layers = [line for line in text.splitlines() if line.startswith("| scnn_p_rs_7 | (2, ")]
    assert len(layers) == 6 and all(float(cell.strip()) > 0 for line in layers for cell in line.split("|")[3:7])
    step = [line for line in text.splitlines() if line.startswith("| scnn_p_rs_7 | scnn_baseline_7 | 2 |")]
    assert len(step) == 1 and text.strip().splitlines()[-1].startswith("Done in")


def test_on_cuda_each_triton_path_is_checked_where_auto_may_take_it(monkeypatch):
    # the case list for a GPU, built without one: the Triton backend available, bfloat16 and float16 autocast
    monkeypatch.setattr(check, "available_backends", lambda: ["reference", "triton"] + [f"triton-{path}" for path in
                                                                                      ("direct", "fused", "columns", "gemm")])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cases = check.agreement_cases(torch.device("cuda"))
    sizes = {label: {c.k for c in cases if c.label == label} for label in {c.label for c in cases}}
    assert sizes == {"auto": {3, 5, 7}, "triton": {3, 5, 7}, "triton[columns]": {3, 5, 7}, "triton[direct]": {3},
                     "triton[fused]": {3}, "triton[gemm]": {3, 5, 7}}
    assert {c.dtype for c in cases} == {"float32", "bfloat16", "float16"}
