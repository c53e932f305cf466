"""``python -m timm_sortconv.check``: the command users run to check and measure SC on their machine.

CI runs it on the CPU with ``--quick``, which checks and does not time (test_quick_check_on_the_cpu); the other
tests check what it covers, that a backend that disagrees with the reference path fails it, and that its speed
section prints a ratio only where the machine let it measure one.
"""
import functools
import itertools
import os
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
    assert {sorting for _, sorting in variants} >= {"c4", "c2", "align"}
    backends_checked = {c.label for c in cases}
    assert "auto" in backends_checked and backends_checked >= {b for b in backends.available_backends()
                                                               if b != "reference" and not b.startswith("triton-")}
    for label in backends_checked:
        mine = [c for c in cases if c.label == label]
        assert {c.k for c in mine} == {3, 5, 7} and {c.dtype for c in mine} == {"float32", "bfloat16"}
        assert len(mine) == len(check.variants_of(label)) * 3 * len(check.LAYERS) * 2
        assert {(c.sampling, c.sorting) for c in mine} == set(check.variants_of(label))


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
    compiled = Decision("k=5", Candidate("gemm", print), {}, {}, {"gemm": 0.5}, 7.25, {"fused": "failed: ptxas"})
    assert check.decision_rows([timed, untimed, compiled]) == [
        ["k=3 polar-ring float32", "fused", "fused 0.100 ms; reference 2.500 ms", "fused 12.50 s; direct 3.25 s",
         "direct: disagrees (relative error 1e-1)"],
        ["k=7 square-global bfloat16", "reference", "-", "-", "-"],
        ["k=5", "gemm", "-", "parallel compile 7.25 s; fused failed to compile: failed: ptxas; gemm 0.50 s", "-"]]
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
    cases = check.agreement_cases(CPU)  # the Triton backend's too under TRITON_INTERPRET=1
    labels = {f"| {case.label}" for case in cases}
    agreement = [line for line in text.splitlines() if line.split(" | ")[0] in labels]
    assert len(agreement) == len(cases) and all(line.endswith("| pass |") for line in agreement)
    assert "## Speed" not in text and " ms" not in text  # --quick times nothing: the README says so
    assert "run without `--quick` to time" in text and text.strip().splitlines()[-1].startswith("Done in")


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


def test_measure_takes_turns_and_keeps_each_functions_least_cpu_time(monkeypatch):
    now = {"cpu": 0.0, "wall": 0.0}
    monkeypatch.setattr(check, "cpu_clock", lambda: now["cpu"])
    monkeypatch.setattr(check, "wall_clock", lambda: now["wall"])
    loads = iter([0.5, 3.0])  # before the rounds, after them
    monkeypatch.setattr(check, "load_average", lambda: next(loads))
    costs = {"sc": iter([9.0, 3.0, 2.0, 5.0]), "conv": iter([9.0, 1.0, 4.0, 1.0])}  # the warm-up call's first
    order = []

    def call(name):  # runs for its cost in CPU seconds, and twice that in wall-clock seconds
        order.append(name)
        cost = next(costs[name])
        now["cpu"] += cost
        now["wall"] += 2 * cost

    timing = check.measure({name: functools.partial(call, name) for name in costs}, 3, CPU)
    assert order == ["sc", "conv"] * 4
    assert timing.seconds == {"sc": 2.0, "conv": 1.0} and timing.cpu_share == 0.5 and timing.load == 3.0


@pytest.fixture
def speed_section(monkeypatch, capsys):
    """Runs ``check`` cut to its speed section (no agreement case; the real layers and training steps of one
    model, at batch 2) on 2 PyTorch threads, with clocks that advance by a millisecond of wall-clock time at each
    reading and by ``share`` of one of CPU time, and the load average ``load``; gives the report from its speed
    section on, and the PyTorch threads each reading of the CPU clock saw."""
    monkeypatch.setattr(check, "agreement_cases", lambda device: [])
    monkeypatch.setattr(check, "MODELS", {"scnn_p_rs_7": ("scnn_baseline_7", 2)})

    def run(share: float, load: float):
        threads_seen = set()
        cpu = itertools.count(0, share * 1e-3)

        def cpu_clock():
            threads_seen.add(torch.get_num_threads())
            return next(cpu)

        monkeypatch.setattr(check, "wall_clock", itertools.count(0, 1e-3).__next__)
        monkeypatch.setattr(check, "cpu_clock", cpu_clock)
        monkeypatch.setattr(check, "load_average", lambda: load)
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert check.main(["--device", "cpu"]) == 0
            assert torch.get_num_threads() == 2  # restored after the speed section
        finally:
            torch.set_num_threads(threads)
        out = capsys.readouterr().out
        return out[out.index("## Speed"):], threads_seen

    return run


def _ratio_cells(text):
    """The ratio cells of the speed section's rows: the last two of each layer row, the last of the step row."""
    layers = [line.split(" | ") for line in text.splitlines() if line.startswith("| scnn_p_rs_7 | (2, ")]
    steps = [line.split(" | ") for line in text.splitlines() if line.startswith("| scnn_p_rs_7 | scnn_baseline_7 |")]
    assert len(layers) == 6 and len(steps) == 1
    return [cell.rstrip(" |") for row in layers for cell in row[-2:]] + [steps[0][-1].rstrip(" |")]


def test_on_an_idle_machine_the_ratios_are_printed_with_the_load_and_the_threads(speed_section):
    text, threads_seen = speed_section(share=1.0, load=0.25)
    assert threads_seen == {1}
    assert "on 1 PyTorch thread (of 2 by default)" in text
    for when in ("before", "after"):
        assert f"Load average (1 minute) {when}: 0.25, on {os.cpu_count()} logical CPUs." in text
    assert _ratio_cells(text) == ["1.00x"] * 13  # every call timed alike by the fake clocks
    assert "not measured" not in text


@pytest.mark.parametrize("share, load_per_cpu, reason", [
    (0.5, 0.25, "this process ran 50% of the time it was timed, load {load:.1f} on {cpus} logical CPUs"),
    (1.0, 2.0, "load {load:.1f} on {cpus} logical CPUs")], ids=["waited for a core", "load average"])
def test_on_a_busy_machine_a_note_replaces_the_ratios(speed_section, share, load_per_cpu, reason):
    cpus = os.cpu_count()
    text, _ = speed_section(share=share, load=load_per_cpu * cpus)
    reason = reason.format(cpus=cpus, load=load_per_cpu * cpus)
    note = f"not measured: the machine is busy ({reason}); rerun on an idle machine"
    assert _ratio_cells(text) == [note] * 13
    times = [line.split(" | ")[2:6] for line in text.splitlines() if line.startswith("| scnn_p_rs_7 | (2, ")]
    assert all(float(cell) > 0 for row in times for cell in row)  # the times measured are still shown


def test_on_a_gpu_measure_keeps_the_median_of_cuda_event_times_and_the_load_rule(monkeypatch):
    from timm_sortconv.ops.triton_backend import tuning

    times = iter([1.0, 5.0, 2.0, 3.0, 3.0, 4.0])  # sc, conv, sc, conv, ...
    monkeypatch.setattr(tuning, "seconds", lambda fn, device: (fn(), next(times))[1])
    monkeypatch.setattr(check, "load_average", lambda: 0.0)
    calls = []
    timing = check.measure({"sc": lambda: calls.append("sc"), "conv": lambda: calls.append("conv")}, 3,
                           torch.device("cuda"))
    assert calls == ["sc", "conv"] * 4  # the warm-up calls, then three rounds
    assert timing.seconds == {"sc": 2.0, "conv": 4.0} and timing.cpu_share is None
    assert timing.ratio("sc", "conv") == "0.50x"
    busy = check.Timing(timing.seconds, None, 2.0 * os.cpu_count())
    assert busy.ratio("sc", "conv").startswith("not measured: the machine is busy (load ")
