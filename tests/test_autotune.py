"""backend="auto"'s checked, timed choice (timm_sortconv.ops.triton_backend.tuning), on the CPU.

The tuner is tested with injected candidates (right, wrong, failing), an injected clock and an injected
capture state, so that every rule of the choice is exercised without a GPU: the reference's result on the
deciding call, the fastest agreeing candidate kept, one warning per candidate left out, deterministic mode,
CUDA graph capture, the switch, non-finite inputs, the checker with autocast off (the Triton backend's
half-precision backward checked against float32 samples under autocast). Then the same tuner behind the
operator: through a test backend registered for bfloat16 CPU tensors (taken from the CPU kernel for these
tests), eagerly, under torch.compile and under DDP. The Triton backend's own candidates are checked here for
their order and flags; running them (Triton's interpreter) is in tests/test_triton_backend.py.
"""
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from timm_sortconv import SortConv2d, sort_conv2d
from timm_sortconv.ops import backends, cpu_backend
from timm_sortconv.ops.backends import Backend, register_backend, resolve_backend
from timm_sortconv.ops.geometry import get_geometry
from timm_sortconv.ops.reference import sort_conv2d_reference, sort_conv2d_reference_backward
from timm_sortconv.ops.triton_backend import tuning
from timm_sortconv.ops.triton_backend.tuning import TUNE_ENV, Candidate, Tuner, disagreement

CPU = torch.device("cpu")


class Clock:
    """An injected timer: seconds per candidate name (missing: 1.0), and the names it was asked for."""

    def __init__(self, **seconds):
        self.seconds = seconds
        self.asked = []

    def __call__(self, candidate, args, device):
        self.asked.append(candidate.name)
        return self.seconds.get(candidate.name, 1.0)


class Counted:
    """A candidate's function that counts its calls and returns ``result(x)``."""

    def __init__(self, result):
        self.result = result
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.result(x)


def make(name, result, deterministic=True):
    fn = Counted(result)
    return Candidate(name, fn, deterministic), fn


def right(x):
    return x * 2


@pytest.fixture
def tuner():
    t = Tuner()
    t.timer = Clock()
    return t


def decide(tuner, candidates, x=None, key="key"):
    x = torch.arange(6.0) if x is None else x
    reference, _ = make("reference path", right)
    return tuner.run(key, lambda: f"configuration {key}", reference, lambda: candidates, (x,), CPU)


def test_the_fastest_agreeing_candidate_is_kept(tuner, monkeypatch):
    monkeypatch.delenv(TUNE_ENV, raising=False)
    slow, slow_fn = make("slow", right)
    fast, fast_fn = make("fast", lambda x: x * 2 + 1e-7)  # agrees within float32's tolerance
    tuner.timer = Clock(**{"reference path": 3.0, "slow": 2.0, "fast": 1.0})
    assert torch.equal(decide(tuner, [slow, fast]), torch.arange(6.0) * 2)  # the reference's own result
    assert sorted(tuner.timer.asked) == ["fast", "reference path", "slow"]
    decision, = tuner.decisions()
    assert decision.chosen is fast and decision.rejected == {} and decision.seconds["reference path"] == 3.0
    calls = fast_fn.calls
    decide(tuner, [slow, fast])
    assert fast_fn.calls == calls + 1 and slow_fn.calls == 1 and tuner.timer.asked.count("fast") == 1


def test_the_reference_path_is_kept_where_it_is_fastest(tuner):
    kernel, kernel_fn = make("kernel", right)
    tuner.timer = Clock(**{"reference path": 1.0, "kernel": 2.0})
    decide(tuner, [kernel])
    assert tuner.decisions()[0].chosen.name == "reference path"
    decide(tuner, [kernel])
    assert kernel_fn.calls == 1  # checked once, never run again


@pytest.mark.parametrize("wrong,reason", [
    (lambda x: x * 3, "differs from the reference path's"),
    (lambda x: torch.where(x == 1, float("nan"), x * 2), "NaN elsewhere"),
    (lambda x: (x * 2)[:3], "has shape"),
    (lambda x: x.double() * 2, "float64"),
])
def test_a_candidate_that_disagrees_is_left_out_with_one_warning(tuner, wrong, reason):
    bad, bad_fn = make("bad kernel", wrong)
    good, _ = make("good kernel", right)
    tuner.timer = Clock(**{"bad kernel": 0.1, "good kernel": 0.5})  # the wrong one would be fastest
    with pytest.warns(RuntimeWarning, match="bad kernel") as caught:
        decide(tuner, [bad, good])
    assert len(caught) == 1 and "configuration key" in str(caught[0].message) and reason in str(caught[0].message)
    decision, = tuner.decisions()
    assert decision.chosen is good and reason in decision.rejected["bad kernel"]
    assert "bad kernel" not in tuner.timer.asked
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for _ in range(3):
            decide(tuner, [bad, good])
    assert bad_fn.calls == 1


def test_a_candidate_that_fails_to_compile_or_launch_is_left_out(tuner):
    def raises(x):
        raise RuntimeError("PTX compilation failed\nptxas fatal")

    broken, _ = make("broken kernel", raises)
    with pytest.warns(RuntimeWarning, match="broken kernel is left out for configuration key: failed: RuntimeError: "
                                            "PTX compilation failed[.] "):
        out = decide(tuner, [broken])
    assert torch.equal(out, torch.arange(6.0) * 2)
    assert tuner.decisions()[0].chosen.name == "reference path"


def test_candidates_are_compiled_in_parallel_threads_before_any_is_checked(tuner):
    """Every candidate's ``prepare`` runs, two at once (a barrier of two would time out one at a time), before
    the first checked run; a failing ``prepare`` is dropped (its checked run reports the error), and the
    decision records the parallel compile's wall time."""
    import threading

    barrier, order = threading.Barrier(2, timeout=30), []

    def prepared(name, fail=False):
        def prepare(x):
            order.append(f"prepare {name}")
            barrier.wait()
            assert threading.current_thread() is not threading.main_thread()
            if fail:
                raise RuntimeError("ptxas fatal")
        return prepare

    def checked(name, result):
        def run(x):
            order.append(f"run {name}")
            return result(x)
        return run

    tuner.compile_threads = 2
    first = Candidate("first", checked("first", right), prepare=prepared("first"))
    second = Candidate("second", checked("second", right), prepare=prepared("second", fail=True))
    plain, _ = make("no prepare", right)
    decide(tuner, [first, second, plain])
    assert sorted(order[:2]) == ["prepare first", "prepare second"]
    assert order[2:] == ["run first", "run second"]  # the checked runs, after every compile (timing: the clock)
    decision, = tuner.decisions()
    assert decision.rejected == {} and decision.compile_seconds > 0
    assert decision.compile_failures == {"second": "failed: RuntimeError: ptxas fatal"}
    assert set(decision.checked_seconds) == {"first", "second", "no prepare"}


def test_a_candidate_whose_timing_fails_is_left_out(tuner):
    kernel, _ = make("kernel", right)

    def timer(candidate, args, device):
        if candidate.name == "kernel":
            raise torch.cuda.OutOfMemoryError("out of memory")
        return 1.0

    tuner.timer = timer
    with pytest.warns(RuntimeWarning, match="kernel is left out .* failed: OutOfMemoryError"):
        decide(tuner, [kernel])
    assert tuner.decisions()[0].chosen.name == "reference path"


def test_configurations_decide_separately(tuner):
    a, _ = make("a", right)
    b, _ = make("b", right)
    tuner.timer = Clock(a=1.0, b=2.0, **{"reference path": 3.0})
    decide(tuner, [a, b], key="first")
    tuner.timer = Clock(a=2.0, b=1.0, **{"reference path": 3.0})
    decide(tuner, [a, b], key="second")
    assert [d.chosen.name for d in tuner.decisions()] == ["a", "b"]
    tuner.clear()
    assert tuner.decisions() == []


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def test_deterministic_mode_takes_the_first_agreeing_deterministic_candidate_untimed(tuner, deterministic):
    atomic, atomic_fn = make("atomic kernel", right, deterministic=False)
    wrong, _ = make("wrong kernel", lambda x: -x)
    plain, _ = make("plain kernel", right)
    later, _ = make("later kernel", right)
    tuner.timer = Clock(**{"later kernel": 0.0})
    with pytest.warns(RuntimeWarning, match="wrong kernel"):
        decide(tuner, [atomic, wrong, plain, later])
    assert tuner.decisions()[0].chosen is plain and tuner.timer.asked == [] and atomic_fn.calls == 0
    assert tuner.decisions()[0].seconds == {}


def test_nothing_is_checked_timed_or_kept_during_cuda_graph_capture(tuner, monkeypatch):
    kernel, kernel_fn = make("kernel", right)
    monkeypatch.setattr(tuning, "capturing", lambda device: True)
    assert torch.equal(decide(tuner, [kernel]), torch.arange(6.0) * 2)
    assert kernel_fn.calls == 0 and tuner.timer.asked == [] and tuner.decisions() == []
    monkeypatch.setattr(tuning, "capturing", lambda device: False)
    decide(tuner, [kernel])  # after the capture: decides
    assert len(tuner.decisions()) == 1
    monkeypatch.setattr(tuning, "capturing", lambda device: True)
    decide(tuner, [kernel])  # a decided configuration runs its choice inside a capture
    assert tuner.timer.asked.count("kernel") == 1


def test_the_switch_runs_the_preferred_candidate_unchecked(tuner, monkeypatch):
    first, first_fn = make("first", lambda x: x + 100)  # wrong, and nothing checks it
    second, second_fn = make("second", right)
    monkeypatch.setenv(TUNE_ENV, "0")
    assert torch.equal(decide(tuner, [first, second]), torch.arange(6.0) + 100)
    assert first_fn.calls == 1 and second_fn.calls == 0 and tuner.decisions() == [] and tuner.timer.asked == []
    monkeypatch.setenv(TUNE_ENV, "1")
    with pytest.warns(RuntimeWarning, match="first"):
        decide(tuner, [first, second])


def test_a_configuration_with_nothing_to_decide_lists_its_candidates_once(tuner, monkeypatch):
    first, first_fn = make("first", right)
    listed = []

    def candidates():
        listed.append(1)
        return [first]

    reference, reference_fn = make("reference path", right)
    monkeypatch.setenv(TUNE_ENV, "0")
    for _ in range(3):
        tuner.run("key", lambda: "configuration", reference, candidates, (torch.arange(6.0),), CPU)
    assert len(listed) == 1 and first_fn.calls == 3 and reference_fn.calls == 0
    for _ in range(2):  # no candidate at all: the reference path, also listed once
        tuner.run("other", lambda: "configuration", reference, lambda: listed.append(1) or [], (torch.arange(6.0),),
                  CPU)
    assert len(listed) == 2 and reference_fn.calls == 2
    tuner.clear()
    tuner.run("key", lambda: "configuration", reference, candidates, (torch.arange(6.0),), CPU)
    assert len(listed) == 3


def test_non_finite_inputs_are_checked_on_a_finite_copy(tuner):
    seen = []
    kernel, _ = make("kernel", lambda x: seen.append(x.clone()) or x * 2)
    x = torch.tensor([1.0, float("nan"), float("inf"), 4.0])
    out = decide(tuner, [kernel], x=x)
    assert torch.equal(out[[0, 3]], torch.tensor([2.0, 8.0])) and torch.isnan(out[1]) and torch.isinf(out[2])
    assert torch.isfinite(seen[0]).all()  # the kernel was checked on zeros in place of NaN and inf
    decision, = tuner.decisions()
    assert decision.rejected == {} and set(decision.seconds) == {"reference path", "kernel"}


def test_disagreement_accepts_rounding_and_names_the_rest():
    b = torch.randn(100, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert disagreement(b + 1e-12, b) is None
    assert "differs" in disagreement(b + 1e-3, b)
    half = b.to(torch.bfloat16)
    assert disagreement((half.double() * (1 + 2 ** -8)).to(torch.bfloat16), half) is None  # one unit of rounding
    assert disagreement((None, b), (None, b)) is None
    assert "missing" in disagreement((None, b), (b, b))
    inf = b.clone()
    inf[3] = float("inf")
    assert disagreement(inf, inf) is None and "infinities" in disagreement(b, inf)


# The tuner behind the operator: a backend for bfloat16 CPU tensors whose auto form is a tuned choice
# between a wrong kernel, the reference path and a right kernel (the reference itself, counted).

class Counter:
    def __init__(self):
        self.forward = self.backward = self.wrong = 0


def reference_forward(x, weight, bias, geometry, stride, dilation, groups, pad):
    """The reference path as a zero-padding backend's forward."""
    return sort_conv2d_reference(F.pad(x, pad), weight, bias, geometry, stride, dilation, groups)


def reference_backward(grad, x, weight, geometry, stride, dilation, groups, need_input, need_weight, pad):
    grad_x, grad_weight = sort_conv2d_reference_backward(grad, F.pad(x, pad), weight, geometry, stride, dilation,
                                                         groups, need_input, need_weight)
    if grad_x is not None:
        grad_x = grad_x[:, :, pad[2]:pad[2] + x.shape[2], pad[0]:pad[0] + x.shape[3]]
    return grad_x, grad_weight


@pytest.fixture
def tuned_backend(monkeypatch):
    counts = Counter()
    tuner = Tuner()
    tuner.timer = Clock(**{"right forward": 0.5, "right backward": 0.5, "wrong forward": 0.1})
    monkeypatch.setattr(tuning, "TUNER", tuner)
    # bfloat16 CPU calls are this test backend's alone (the CPU kernel takes them where the CPU has AVX-512 BF16)
    monkeypatch.setattr(cpu_backend, "bf16_products", lambda: False)

    def right_forward(*args):
        counts.forward += 1
        return reference_forward(*args)

    def right_backward(*args):
        counts.backward += 1
        return reference_backward(*args)

    def wrong_forward(*args):
        counts.wrong += 1
        return -reference_forward(*args)

    def tuned(kind, reference, candidates):
        def run(*args):
            key = (kind, args[0].shape, args[1].shape, args[-1])
            return tuning.TUNER.run(key, lambda: f"test {kind} {key}", Candidate("reference path", reference),
                                    lambda: candidates, args, args[0].device)
        return run

    forward_candidates = [Candidate("wrong forward", wrong_forward), Candidate("right forward", right_forward)]
    register_backend(Backend("tuned-test", reference_forward, reference_backward,
                             lambda x, *args: x.dtype == torch.bfloat16 and x.device.type == "cpu", lambda: True,
                             zero_padding=True,
                             auto_forward=tuned("forward", reference_forward, forward_candidates),
                             auto_backward=tuned("backward", reference_backward,
                                                 [Candidate("right backward", right_backward)])),
                     # first in auto's order: under TRITON_INTERPRET=1 the Triton backend takes CPU bfloat16 too
                     before=next(iter(backends._BACKENDS)))
    yield counts
    backends._BACKENDS.pop("tuned-test", None)


def bf16_call(seed=0, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 9, 9, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(4, 3, 3, 3, generator=generator).bfloat16().requires_grad_()
    return x, weight


def test_auto_runs_the_backends_auto_form():
    if "triton" not in backends._BACKENDS:
        pytest.skip("no triton package")
    from timm_sortconv.ops import triton_backend

    auto = backends._BACKENDS["triton"].for_auto()
    assert backends._BACKENDS["triton"].auto
    assert auto.forward is triton_backend.tuned_forward and auto.backward is triton_backend.tuned_backward
    assert backends._BACKENDS["triton"].forward is triton_backend.forward  # backend="triton": its own rule


def test_auto_through_the_operator_is_checked_and_tuned(tuned_backend):
    x, weight = bf16_call()
    assert resolve_backend("auto", x, weight, None, get_geometry(3), (1, 1), (1, 1), 1).name == "tuned-test"
    with pytest.warns(RuntimeWarning, match="wrong forward"):
        out = sort_conv2d(x, weight, padding=1)
        out.float().sum().backward()
    expected = sort_conv2d(x.detach(), weight.detach(), padding=1, backend="reference")
    assert torch.equal(out, expected)
    assert tuned_backend.wrong == 1 and tuned_backend.forward == 1 and tuned_backend.backward == 1
    grads = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    out = sort_conv2d(x, weight, padding=1)  # decided: the right kernels only
    out.float().sum().backward()
    assert tuned_backend.wrong == 1 and tuned_backend.forward == 2 and tuned_backend.backward == 2
    assert torch.equal(x.grad, grads[0]) and torch.equal(weight.grad, grads[1])
    assert [d.chosen.name for d in tuning.TUNER.decisions()] == ["right forward", "right backward"]


@pytest.mark.slow
def test_auto_under_torch_compile_decides_at_run_time(tuned_backend):
    x, weight = bf16_call()

    def fn(x, weight):
        return sort_conv2d(x, weight, padding=1) * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    with pytest.warns(RuntimeWarning, match="wrong forward"):
        out = compiled(x, weight)
        out.float().sum().backward()
    assert torch.equal(out, fn(x.detach(), weight.detach()))
    # tracing ran on fake tensors and decided nothing; the real call decided once per configuration
    assert len(tuning.TUNER.decisions()) == 2
    other = bf16_call(seed=1)[0][:1, :, :7, :7].detach()  # a new shape: the dynamic graph, a new decision
    with pytest.warns(RuntimeWarning, match="wrong forward"):
        compiled(other, weight.detach())
    assert len(tuning.TUNER.decisions()) == 3


def _ddp_worker(rank, world_size, init_file, results):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        tuner = Tuner()
        # the ranks time differently and keep different kernels, both checked
        tuner.timer = Clock(**{"kernel a": 1.0 + rank, "kernel b": 2.0 - rank, "reference path": 5.0})
        tuning.TUNER = tuner

        def tuned_forward(*args):
            return tuning.TUNER.run(("forward", args[0].shape), lambda: "ddp test",
                                    Candidate("reference path", reference_forward),
                                    lambda: [Candidate("kernel a", reference_forward),
                                             Candidate("kernel b", reference_forward)], args, args[0].device)

        register_backend(Backend("tuned-test", reference_forward, reference_backward,
                                 lambda x, *args: x.dtype == torch.float64, lambda: True, zero_padding=True,
                                 auto_forward=tuned_forward), before=next(iter(backends._BACKENDS)))
        backends._BACKENDS["cpu"] = dataclasses.replace(backends._BACKENDS["cpu"], auto=False)
        torch.manual_seed(0)
        layer = SortConv2d(3, 4, 3, padding=1, bias=False).double()
        model = DistributedDataParallel(layer)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        for _ in range(2):  # the deciding step, then a decided one
            model.zero_grad()
            model(x).square().sum().backward()
        results[rank] = (tuner.decisions()[0].chosen.name, layer.weight.grad.clone(), x)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_processes_decide_alone_and_agree(tmp_path):
    # Two gloo processes time differently and keep different kernels; no collective is involved in the
    # decision, and the all-reduced gradient is the average of the reference path's.
    import torch.multiprocessing as mp

    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), results), nprocs=2, join=True)
    (chosen0, grad0, x0), (chosen1, grad1, x1) = results[0], results[1]
    assert {chosen0, chosen1} == {"kernel a", "kernel b"}
    assert torch.equal(grad0, grad1)
    torch.manual_seed(0)
    layer = SortConv2d(3, 4, 3, padding=1, bias=False, backend="reference").double()
    for x in (x0, x1):
        layer(x).square().sum().backward()
    torch.testing.assert_close(grad0, layer.weight.grad / 2)


# The Triton backend's candidates: their order, flags and names, without running them.

def triton_call(channels, out_channels, groups, k=3, sorting="ring"):
    pytest.importorskip("triton")
    from timm_sortconv.ops import triton_backend

    x = torch.empty(2, channels, 16, 16)
    weight = torch.empty(out_channels, channels // groups, k, k)
    call = triton_backend._Call.of(x, weight, get_geometry(k, "polar", sorting), (1, 1), (1, 1), groups,
                                   (k // 2,) * 4)
    return triton_backend, call, x


def test_triton_candidates_follow_the_rule():
    triton_backend, call, x = triton_call(32, 32, 1)
    from timm_sortconv.ops.triton_backend import config

    names = [c.name for c in triton_backend.candidates("forward", call, x)]
    assert names[0].startswith("triton fused forward (P=64") and any(n.startswith("triton columns") for n in names)
    assert names[-1].startswith("triton gemm forward")  # unmeasured on a GPU: last in the order of preference
    assert len(names) == (len(config.fused_candidates(9, 32)) + len(config.column_candidates(9))
                          + len(config.gemm_candidates(9, 32)))
    backward = triton_backend.candidates("backward", call, x)
    # each path twice: its input gradient folded, then added into place by atomics (last, not deterministic)
    assert [c.name.split(" (")[0] for c in backward] == \
        (["triton columns backward"] * 2 + ["triton gemm backward"] * 2) * 2
    assert [c.deterministic for c in backward] == [True] * 4 + [False] * 4
    assert all(c.name.endswith(", atomic)") for c in backward[4:])
    # compiled in parallel before the checks; the interpreter compiles nothing
    assert all((c.prepare is None) == triton_backend.INTERPRETED for c in backward)
    # no scatter where no input gradient is wanted, nor in the forward
    assert not any("atomic" in c.name for c in triton_backend.candidates("backward", call, x, need_input=False))
    assert not any("atomic" in name for name in names)
    depthwise, call, x = triton_call(8, 8, 8, k=7)
    # 49 slots: the direct kernels spill, and the fused kernel takes 9 at most: the columns and gemm paths
    for kind in ("forward", "backward"):
        assert [c.name.split(" (")[0] for c in depthwise.candidates(kind, call, x)][::2] == \
            [f"triton columns {kind}", f"triton gemm {kind}"] * (2 if kind == "backward" else 1)
    depthwise, call, x = triton_call(8, 8, 8, k=5)
    forward = [c.name.split(" (")[0] for c in depthwise.candidates("forward", call, x)]
    assert forward[0] == "triton direct forward" and "triton fused forward" not in forward
    # 25 slots: the direct backward compiles slowly; at 9, one block size (the one without spills)
    assert {c.name.split(" (")[0] for c in depthwise.candidates("backward", call, x)} == \
        {"triton columns backward", "triton gemm backward"}
    depthwise, call, x = triton_call(8, 8, 8, k=3)
    backward = depthwise.candidates("backward", call, x)
    assert [c.name.split(" (")[0] for c in backward].count("triton direct backward") == 1
    assert backward[0].name.startswith("triton direct backward") and not backward[0].deterministic
    deterministic = [c for c in backward if c.deterministic]
    assert deterministic[-1].name.startswith("triton gemm backward") and "atomic" not in deterministic[-1].name
    assert backward[-1].name.startswith("triton gemm backward") and not backward[-1].deterministic


def test_triton_leaves_large_and_even_kernels_to_the_reference():
    triton_backend, call, x = triton_call(4, 4, 1, k=9)
    assert triton_backend.candidates("forward", call, x) == []  # k = 9: not checked for compile time
    even = dataclasses.replace(get_geometry(3), kernel_size=4)  # only k is read
    assert not triton_backend.supports_triton(x, torch.empty(4, 4, 4, 4), None, even, (1, 1), (1, 1), 1)


def test_tie_free_inputs_hold_distinct_exact_values_in_every_window():
    x = torch.empty(2, 3, 20, 17, dtype=torch.float16).to(memory_format=torch.channels_last)
    tied = tuning.tie_free_like(x, (5, 9), seed=3)
    assert tied.dtype == x.dtype and tied.stride() == x.stride() and (tied > 0).all()
    assert torch.equal(tied.float().bfloat16().float(), tied.float())  # exact in bfloat16 too
    windows = F.unfold(tied[:, :1].float(), (5, 9))  # every 5x9 window of the first channel
    assert (windows.sort(dim=1).values.diff(dim=1) > 0).all()


def test_upcast_computes_half_types_in_float32():
    seen = []

    def fn(a, b, flag):
        seen.append((a.dtype, b.dtype, flag))
        return a * b, None

    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    out, none = tuning.upcast(fn)(a, a, "flag")
    assert seen == [(torch.float32, torch.float32, "flag")] and out.dtype == torch.bfloat16 and none is None
    assert tuning.upcast(fn)(a.double(), a.double(), 1)[0].dtype == torch.float64


def test_the_checker_runs_with_autocast_off(tuner):
    # A backward runs under the autocast of the code that called backward(): the expected result must not.
    seen = []

    def checker(args, result):
        seen.append(torch.is_autocast_enabled("cpu"))
        return args, result

    reference, _ = make("reference path", right)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tuner.run("key", lambda: "configuration", reference, lambda: [make("right", right)[0]], (torch.arange(6.0),),
                  CPU, checker)
        assert torch.is_autocast_enabled("cpu")
    assert seen == [False]


def half_backward_call(dtype, k=7):
    """A half-precision backward call of a k x k polar-ring layer (zero padding) as the Triton backend's checker
    takes it: ``(grad_out, x, weight, call, need_input, need_weight)``."""
    pytest.importorskip("triton")
    from timm_sortconv.ops import triton_backend

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 12, 12, generator=generator).to(dtype)
    weight = (torch.randn(8, 4, k, k, generator=generator) * 0.1).to(dtype)
    call = triton_backend._Call.of(x, weight, get_geometry(k, "polar", "ring"), (1, 1), (1, 1), 1, (k // 2,) * 4)
    grad_out = torch.randn(2, 8, call.out_h, call.out_w, generator=generator).to(dtype)
    return triton_backend, (grad_out, x, weight, call, True, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_half_backward_checkers_input_has_distinct_samples_in_every_7x7_window(dtype):
    # What the kernels sort: the bilinear samples of the checker's input in float32, per ring segment. Windows that
    # reach into the padding hold zeros that tie, whose gradients all go to the padding.
    triton_backend, args = half_backward_call(dtype)
    (_, x, _, call, _, _), _ = triton_backend._check_backward(args, None)
    assert x.dtype == dtype
    windows = F.unfold(x.float().flatten(0, 1).unsqueeze(1), 7)  # every 7x7 window of every channel, row-major
    assert (windows.sort(dim=1).values.diff(dim=1) > 0).all()
    samples = call.geometry.interpolation.float() @ windows  # (image * channel, slot, window)
    for start, end in call.geometry.segments:
        assert (samples[:, start:end].sort(dim=1).values.diff(dim=1) > 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_backward_under_autocast_is_checked_against_float32_samples(tuner, dtype):
    # Under autocast the float32 reference would interpolate its samples in the autocast dtype; rounded samples tie
    # (bfloat16: more than half of the 7x7 windows) and their gradients go either way. A kernel sorts them in float32,
    # as this candidate does, and agrees with the checker's reference.
    triton_backend, args = half_backward_call(dtype)

    def float32_samples(*args):
        with torch.autocast("cpu", enabled=False):
            return tuning.upcast(triton_backend._reference_backward)(*args)

    with torch.autocast("cpu", dtype=dtype):
        tuner.run("key", lambda: "7x7 backward", triton_backend._REFERENCE["backward"],
                  lambda: [Candidate("float32 samples", float32_samples)], args, CPU, triton_backend._check_backward)
    assert tuner.decisions()[0].rejected == {}


def test_triton_backward_takes_no_atomics_in_deterministic_mode(monkeypatch):
    triton_backend, call, x = triton_call(8, 8, 8)  # depthwise 3x3: the direct backward by the rule
    called = []
    for path in ("direct", "columns"):
        monkeypatch.setitem(triton_backend._BACKWARD_PATHS, path, lambda *args, path=path: called.append(path))
    arguments = (torch.empty(2, 8, 16, 16), x, torch.empty(8, 1, 3, 3), call.geometry, (1, 1), (1, 1), 8, True, True,
                 call.pad)
    triton_backend.backward(*arguments)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        triton_backend.backward(*arguments)
    finally:
        torch.use_deterministic_algorithms(before)
    assert called == ["direct", "columns"]


@pytest.fixture
def aligned_tuner(monkeypatch):
    """The aligned variants' checked choice as on CUDA, run on the CPU (a fresh tuner, a clock that makes the
    harmonic form the faster)."""
    from timm_sortconv.ops import triton_backend

    t = Tuner()
    t.timer = Clock(**{"reference path": 2.0, "harmonic (standard operators)": 1.0})
    monkeypatch.setattr(tuning, "TUNER", t)
    monkeypatch.setattr(triton_backend, "_tuned_here", lambda x: True)
    return t


@pytest.mark.parametrize("sorting", ["align", "align-channel"])
def test_auto_checks_the_aligned_variants_standard_operator_form_and_keeps_the_faster(aligned_tuner, sorting):
    from timm_sortconv.ops import triton_backend

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 9, 9, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 2, 5, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    geometry = get_geometry(5, "polar", sorting)
    padded = F.pad(x, (2, 2, 2, 2))
    out = triton_backend.tuned_aligned_forward(padded, weight, None, geometry, (1, 1), (1, 1), 2)
    again = triton_backend.tuned_aligned_forward(padded, weight, None, geometry, (1, 1), (1, 1), 2)
    expected = sort_conv2d(padded, weight, groups=2, sorting=sorting, backend="reference")
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(again, expected)
    grad = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    got = triton_backend.tuned_aligned_backward(grad, padded.detach(), weight.detach(), geometry, (1, 1), (1, 1), 2,
                                                True, True)
    want = torch.autograd.grad(expected, (padded, weight), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    decisions = aligned_tuner.decisions()
    assert [d.chosen.name for d in decisions] == ["harmonic (standard operators)"] * 2
    assert all(d.rejected == {} for d in decisions)


def test_auto_keeps_the_reference_path_where_the_aligned_standard_operator_form_disagrees(aligned_tuner, monkeypatch):
    from timm_sortconv.ops import triton_backend

    reference, harmonic = triton_backend._ALIGNED["forward"]
    wrong = Candidate(harmonic.name, lambda x, weight, bias, call: harmonic.run(x, weight, bias, call) + 1.0)
    monkeypatch.setitem(triton_backend._ALIGNED, "forward", (reference, wrong))
    x = torch.randn(1, 2, 8, 8, dtype=torch.float64)
    weight = torch.randn(2, 2, 3, 3, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="harmonic .* is left out .* differs from the reference"):
        out = triton_backend.tuned_aligned_forward(x, weight, None, get_geometry(3, "polar", "align"), (1, 1), (1, 1),
                                                   1)
    torch.testing.assert_close(out, sort_conv2d(x, weight, sorting="align", backend="reference"))
    assert aligned_tuner.decisions()[0].chosen.name == "reference path"
