"""The Triton backend (``backend="triton"``) against the reference path.

The kernel tests run wherever the kernels can: natively on a CUDA device when there is one, and otherwise
on CPU tensors under Triton's interpreter, which executes the same kernel code with NumPy. The interpreter
must be switched on (``TRITON_INTERPRET=1``) before Triton is imported, so on a machine without CUDA
``test_kernels_in_the_interpreter`` runs this file again in a subprocess with it set, where the kernel tests
run. The module is skipped where Triton is not installed. The interpreter is slow (about a millisecond per
Triton operation per program), so shapes are tiny: most launches are one program. The kernels run through
the registered operator (``backend="triton"``: its autograd formula and autocast rule); under the
interpreter the backend takes CPU tensors.

Every path (:mod:`timm_sortconv.ops.triton_backend.config`) is tested: the columns path on all 20 geometries
(k = 1..9, four variants), the direct and fused kernels on every k, the gemm kernels on the four variants at
k = 3, 5 and 7 (the sizes ``auto`` takes), each path on the orbit sortings; strides, dilations and groups (1, 2,
depthwise) rotate through them so that each value meets each path. A path is chosen per call by its backend
name (``backend="triton-<path>"``). ``backend="auto"``'s checked and timed
choice among the kernels runs here too (float16 CPU tensors, which only the Triton backend takes under the
interpreter), with an injected clock: every candidate checked and the fastest kept, failing and wrong
kernels left out, no atomics in deterministic mode, no kernel left out on tied inputs, nor from a bfloat16 7x7
backward run under autocast. The tuner's own rules are tested without kernels in tests/test_autotune.py.
"""
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from conftest import load_script  # noqa: E402
from timm_sortconv import sort_conv2d  # noqa: E402
from timm_sortconv.ops import triton_backend  # noqa: E402
from timm_sortconv.ops.backends import resolve_backend  # noqa: E402
from timm_sortconv.ops.geometry import get_geometry  # noqa: E402
from timm_sortconv.ops.reference import sort_conv2d_reference  # noqa: E402
from timm_sortconv.ops.triton_backend import config  # noqa: E402
from timm_sortconv.ops.triton_backend.source import depth_first, kernel_source  # noqa: E402

VARIANTS = [(s, o) for s in ("square", "polar") for o in ("ring", "global")]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
NATIVE = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if NATIVE else "cpu"
kernel_test = pytest.mark.skipif(not (INTERPRETED or NATIVE),
                                 reason="runs in test_kernels_in_the_interpreter's subprocess (no CUDA device here)")


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED or NATIVE, reason="the kernel tests run in this process")
def test_kernels_in_the_interpreter():
    # There every test runs but this one and those that need CUDA or Triton's compiler (run here).
    skip = ("test_kernels_in_the_interpreter", "test_supports_on_cuda", "test_kernels_compile_for_sm90",
            "test_the_columns_fused_and_gemm_kernels_keep_their_windows_in_registers",
            "test_compile_threads_compiles_the_selected_kernels_alone_and_in_threads",
            "test_never_chosen_for_cpu_tensors")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-k",
                             " and ".join(f"not {name}" for name in skip), __file__],
                            env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "passed" in summary and "skipped" not in summary, summary  # every kernel test ran there


# The backend sort_conv2d_triton runs: "triton" (the backend's own choice of path), or "triton-<path>" (the
# ``path`` fixture).
BACKEND = "triton"


def sort_conv2d_triton(x, weight, bias, geometry, stride, dilation, groups, pad=(0, 0, 0, 0)):
    """The registered operator on the Triton backend, with the kernels' arguments."""
    return torch.ops.timm_sortconv.sort_conv2d(x, weight, bias, list(stride), list(pad), list(dilation), groups,
                                               geometry.sampling, geometry.sorting, BACKEND)


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(DEVICE)


@pytest.fixture
def path(request, monkeypatch):
    """Runs the test's calls on one of the backend's paths (the parameter's value): backend="triton-<path>";
    ``"columns-atomic"``, ``"gemm-atomic"``: the path with its input gradient added into place by atomics (the
    scatter ``auto`` times beside the fold)."""
    name = request.param
    if name.endswith("-atomic"):
        name = name[:-len("-atomic")]
        monkeypatch.setitem(triton_backend._BACKWARD_PATHS, name,
                            functools.partial(triton_backend._BACKWARD_PATHS[name], scatter=True))
    monkeypatch.setitem(globals(), "BACKEND", f"triton-{name}")
    return request.param


def run(fn, x, weight, bias, *args, grads=True, rounded_to=None, **kwargs):
    """Output and, with ``grads``, the (input, weight, bias) gradients for a fixed output gradient (drawn in
    float64, rounded to ``rounded_to`` or the output's dtype)."""
    x, weight, bias = (t.detach().clone().requires_grad_(grads) for t in (x, weight, bias))
    out = fn(x, weight, bias, *args, **kwargs)
    if not grads:
        return (out,)
    grad = randn(*out.shape, seed=9).to(rounded_to or out.dtype).to(out.dtype)
    return (out, *torch.autograd.grad(out, (x, weight, bias), grad))


def reference(x, weight, bias, geometry, stride, dilation, groups, pad):
    return sort_conv2d_reference(F.pad(x, pad), weight, bias, geometry, stride, dilation, groups)


def compare(fast, slow, rtol, atol, what):
    for name, a, b in zip(("output", "grad input", "grad weight", "grad bias"), fast, slow):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{name}, {what}: {a.dtype} {a.shape} vs {b.dtype} {b.shape}"
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}, {what}: {m}")


# (stride, dilation, groups) in turn; "dw": depthwise (groups = channels).
SETTINGS = [(1, 1, 1), (2, 1, 2), (1, 2, "dw"), (2, 2, 1), (1, 1, 2), (2, 1, "dw"), (1, 2, 2), (2, 2, "dw")]


def case(index, k, channels=2, out_per_group=3, batch=2, size=(5, 6), dtype=torch.float64):
    """Tensors and arguments of test case ``index``: its settings rotate through SETTINGS; the input is
    unpadded and the backend adds ``k // 2 * dilation`` zeros on each side."""
    stride, dilation, groups = SETTINGS[index % len(SETTINGS)]
    groups = channels if groups == "dw" else groups
    x = randn(batch, channels, *size, seed=index, dtype=dtype)
    weight = randn(out_per_group * groups, channels // groups, k, k, seed=100 + index, dtype=dtype)
    bias = randn(out_per_group * groups, seed=200 + index, dtype=dtype)
    p = k // 2 * dilation
    return x, weight, bias, (stride, stride), (dilation, dilation), groups, (p, p, p, p)


def check_against_reference(index, geometry, grads=True, rtol=1e-10, atol=1e-10, **shape):
    x, weight, bias, stride, dilation, groups, pad = case(index, geometry.kernel_size, **shape)
    args = (geometry, stride, dilation, groups)
    fast = run(sort_conv2d_triton, x, weight, bias, *args, pad=pad, grads=grads)
    slow = run(reference, x, weight, bias, *args, pad, grads=grads)
    compare(fast, slow, rtol, atol, f"{geometry.sampling}-{geometry.sorting} k={geometry.kernel_size}, "
                                    f"stride {stride}, dilation {dilation}, groups {groups}")


# Every geometry's forward and backward through the columns path (its columns kernel, and the record and
# replay kernels of the backward of every non-direct call) or, for the larger global networks, through the
# direct path.
FORWARD_AND_BACKWARD = {"columns": [(k, v) for k in (1, 3, 5) for v in VARIANTS] + [(k, v) for k in (7, 9) for v in
                                                                                  VARIANTS if v[1] == "ring"],
                        "direct": [(k, v) for k in (7, 9) for v in VARIANTS if v[1] == "global"]
                        + [(k, VARIANTS[k // 2 % 4]) for k in (1, 3, 5)]}


@kernel_test
@pytest.mark.parametrize("path", ["columns", "direct", "columns-atomic"], indirect=True)
@pytest.mark.parametrize("k", [1, 3, 5, 7, 9])
def test_agrees_with_reference(path, k):
    for index, (kernel_size, (sampling, sorting)) in enumerate(FORWARD_AND_BACKWARD[path.split("-")[0]]):
        if kernel_size == k:
            check_against_reference(k + index, get_geometry(k, sampling, sorting))


@kernel_test
@pytest.mark.parametrize("path", ["fused"], indirect=True)
@pytest.mark.parametrize("k", [1, 3, 5, 7, 9])
def test_fused_forward_agrees_with_reference(path, k):
    # One variant per k, in turn; the fused path's backward is the columns path's.
    sampling, sorting = VARIANTS[k // 2 % 4]
    check_against_reference(k // 2 + 3, get_geometry(k, sampling, sorting), grads=False)


@kernel_test
@pytest.mark.parametrize("path", ["gemm", "gemm-atomic"], indirect=True)
@pytest.mark.parametrize("k", [3, 5, 7])
def test_gemm_agrees_with_reference(path, k):
    # The four variants at each k auto takes, forward and both gradients; settings rotate with the index.
    for variant, (sampling, sorting) in enumerate(VARIANTS):
        check_against_reference(k + variant, get_geometry(k, sampling, sorting))


def test_every_geometry_is_tested_forward_and_backward():
    tested = {case for cases in FORWARD_AND_BACKWARD.values() for case in cases}
    assert tested == {(k, v) for k in (1, 3, 5, 7, 9) for v in VARIANTS}


@kernel_test
@pytest.mark.parametrize("path", ["columns", "direct", "fused", "gemm", "columns-atomic", "gemm-atomic"], indirect=True)
def test_orbit_sortings_agree_with_reference(path):
    # sorting="c4"/"c2": many segments of 4 or 2 slots, samples in orbit order (square sampling too)
    for index, (k, sampling, sorting) in enumerate([(3, "polar", "c2"), (5, "square", "c4"), (5, "polar", "c4")]):
        check_against_reference(index, get_geometry(k, sampling, sorting), grads=path != "fused")


@kernel_test
@pytest.mark.parametrize("path", ["direct", "fused", "columns", "gemm", "columns-atomic", "gemm-atomic"], indirect=True)
def test_several_blocks_of_positions_channels_and_outputs(path):
    # 3 x 9 x 9 positions (several position blocks and splits of the gemm weight gradient's positions), 20
    # channels (several channel blocks of the columns kernels, two iterations of the fused kernel's channel
    # loop), and more outputs per group than one block of the fused (32), direct (4) or gemm (32) kernels.
    geometry = get_geometry(3, "polar", "ring")
    sizes = {"direct": (4, 6), "fused": (20, 130), "columns": (20, 20), "gemm": (3, 70)}
    channels, out_per_group = sizes[path.split("-")[0]]
    for index in (0, 2):  # groups 1 and depthwise
        check_against_reference(index, geometry, grads=path != "fused", channels=channels if index == 0 else 4,
                                out_per_group=out_per_group, batch=3, size=(9, 9))


@kernel_test
@pytest.mark.parametrize("path", ["columns", "gemm", "columns-atomic"], indirect=True)
def test_columns_in_chunks_of_images(path, monkeypatch):
    # A chunk budget of one image: the forward and backward (the gemm path: its input gradient's window
    # values; the columns scatter: into its images of the input gradient) loop over the batch in 3 chunks.
    monkeypatch.setattr(config, "COLUMN_CHUNK_BYTES", 1)
    check_against_reference(0, get_geometry(5, "square", "global"), batch=3)


@kernel_test
@pytest.mark.parametrize("path", ["direct", "fused", "columns", "gemm", "columns-atomic", "gemm-atomic"], indirect=True)
def test_batch_one_and_asymmetric_padding(path):
    geometry = get_geometry(5, "polar", "global")
    x, weight, bias, stride, dilation, groups, _ = case(1, 5, batch=1)
    pad = (1, 3, 2, 0)  # F.pad's order: left, right, top, bottom
    args = (geometry, stride, dilation, groups)
    fast = run(sort_conv2d_triton, x, weight, bias, *args, pad=pad)
    compare(fast, run(reference, x, weight, bias, *args, pad), 1e-10, 1e-10, "batch 1")


@kernel_test
@pytest.mark.parametrize("path", ["direct", "fused", "columns", "gemm", "columns-atomic", "gemm-atomic"], indirect=True)
def test_channels_last_input(path):
    geometry = get_geometry(5, "polar", "ring")
    x, weight, bias, stride, dilation, groups, pad = case(0, 5, channels=4)
    args = (geometry, stride, dilation, groups)
    fast = run(sort_conv2d_triton, x.to(memory_format=torch.channels_last), weight, bias, *args,
               pad=pad)
    compare(fast, run(reference, x, weight, bias, *args, pad), 1e-10, 1e-10, "channels_last")
    if path != "columns":  # the other kernels write the output in the input's layout, as conv2d
        assert fast[0].is_contiguous(memory_format=torch.channels_last)


@kernel_test
@pytest.mark.parametrize("path", ["direct", "fused", "columns", "gemm", "columns-atomic", "gemm-atomic"], indirect=True)
def test_float32(path):
    check_against_reference(1, get_geometry(7, "polar", "ring"), rtol=1e-4, atol=1e-4, dtype=torch.float32)


def half_case_against_float64(path, dtype, autocast):
    """Output and gradients of a float16/bfloat16 call, explicit or through autocast, against the reference
    in float64 on the same (rounded) values, with tolerances of the half type."""
    geometry = get_geometry(5, "polar", "ring")
    x, weight, bias, stride, dilation, groups, pad = case(4, 5, channels=4)
    rounded = [t.to(dtype).to(torch.float64) for t in (x, weight, bias)]
    args = (geometry, stride, dilation, groups)
    if autocast:
        with torch.autocast(DEVICE, dtype=dtype):
            fast = run(sort_conv2d_triton, *[t.float() for t in rounded], *args, pad=pad)
        assert fast[0].dtype == dtype and all(g.dtype == torch.float32 for g in fast[1:])
    else:
        fast = run(sort_conv2d_triton, *[t.to(dtype) for t in rounded], *args, pad=pad)
        assert all(t.dtype == dtype for t in fast)
    slow = run(reference, *rounded, *args, pad, rounded_to=dtype)
    for name, a, b in zip(("output", "grad input", "grad weight", "grad bias"), fast, slow):
        # Sorted samples are rounded to the half type before the product (as autocast's conv2d rounds its
        # input): errors of a few units of the half type's precision, relative to the result's scale.
        eps = torch.finfo(dtype).eps
        error = (a.double() - b).abs().max() / b.abs().max()
        assert error < 8 * eps, f"{name} ({dtype}, autocast {autocast}): relative error {error:.2e}"


# Triton's interpreter (3.8) multiplies the bit patterns of bfloat16 operands of tl.dot as integers, so the
# fused and gemm kernels' bfloat16 products are checked on CUDA devices only.
BFLOAT16_PATHS = ["direct", "columns"] if INTERPRETED else ["direct", "fused", "gemm", "columns"]


@kernel_test
@pytest.mark.parametrize("path,dtype", [(path, torch.float16) for path in ("direct", "fused", "gemm", "gemm-atomic",
                                                                     "columns", "columns-atomic")]
                         + [(path, torch.bfloat16) for path in BFLOAT16_PATHS], indirect=["path"])
def test_half_types(path, dtype):
    half_case_against_float64(path, dtype, autocast=False)


@kernel_test
@pytest.mark.parametrize("path", BFLOAT16_PATHS, indirect=True)
def test_autocast(path):
    half_case_against_float64(path, torch.bfloat16, autocast=True)


@kernel_test
@pytest.mark.parametrize("path", ["direct", "gemm", "gemm-atomic", "columns", "columns-atomic"], indirect=True)
def test_one_gradient_alone(path):
    # Frozen weights (input gradient only) and a frozen input (weight gradient only), as in fine-tuning.
    geometry = get_geometry(3, "polar", "global")
    x, weight, bias, stride, dilation, groups, pad = case(1, 3)
    args = (geometry, stride, dilation, groups)
    for wanted in ("x", "weight"):
        tensors = {"x": x.clone().requires_grad_(wanted == "x"),
                   "weight": weight.clone().requires_grad_(wanted == "weight")}
        out = sort_conv2d_triton(tensors["x"], tensors["weight"], bias, *args, pad=pad)
        grad, = torch.autograd.grad(out, tensors[wanted], randn(*out.shape, seed=9))
        expected = run(reference, x, weight, bias, *args, pad)[1 if wanted == "x" else 2]
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


@kernel_test
@pytest.mark.parametrize("path", ["direct", "gemm", "columns"], indirect=True)
def test_saves_only_the_input_and_the_weight(path):
    x, weight = randn(1, 2, 8, 8).requires_grad_(), randn(4, 2, 3, 3, seed=1).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sort_conv2d_triton(x, weight, None, get_geometry(3, "polar", "ring"), (1, 1), (1, 1), 1, pad=(1, 1, 1, 1))
    assert len(saved) == 2 and saved[0] is x and saved[1] is weight  # the unpadded input itself


@kernel_test
@pytest.mark.parametrize("path", ["direct", "fused", "columns", "gemm"], indirect=True)
def test_nan_stays_in_its_windows(path):
    geometry = get_geometry(3, "square", "global")
    x = randn(1, 1, 8, 8)
    x[0, 0, 3, 4] = float("nan")
    out = sort_conv2d_triton(x, randn(2, 1, 3, 3, seed=1), None, geometry, (1, 1), (1, 1), 1, pad=(1, 1, 1, 1))
    for channel in range(2):
        nan_rows, nan_cols = torch.isnan(out[0, channel]).nonzero(as_tuple=True)
        # With one zero of padding, output (i, j) reads input rows i-1..i+1 and columns j-1..j+1.
        assert set(zip(nan_rows.tolist(), nan_cols.tolist())) == {(i, j) for i in (2, 3, 4) for j in (3, 4, 5)}


class LaterIsFaster:
    """An injected clock: the reference path takes 10 s, and each new candidate less than the one before."""

    def __init__(self):
        self.order = []

    def __call__(self, candidate, args, device):
        if candidate.name == "reference path":
            return 10.0
        if candidate.name not in self.order:
            self.order.append(candidate.name)
        return 1.0 / (1 + self.order.index(candidate.name))


@pytest.fixture
def fresh_tuner(monkeypatch):
    """A tuner with no decisions and the LaterIsFaster clock, as auto's."""
    from timm_sortconv.ops.triton_backend import tuning

    tuner = tuning.Tuner()
    tuner.timer = LaterIsFaster()
    monkeypatch.setattr(tuning, "TUNER", tuner)
    return tuner


def tuned(x, weight, bias, geometry, stride, dilation, groups, pad):
    """backend="auto"'s output and (input, weight, bias) gradients through the operator."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    out = torch.ops.timm_sortconv.sort_conv2d(leaves[0], leaves[1], leaves[2], list(stride), list(pad),
                                              list(dilation), groups, geometry.sampling, geometry.sorting, "auto")
    return (out, *torch.autograd.grad(out, leaves, randn(*out.shape, seed=9).to(out.dtype)))


def half_case(index, k, channels):
    """A case's tensors in float16: under the interpreter no other fast backend takes float16 CPU tensors,
    so backend="auto" is the Triton backend's checked and timed choice."""
    x, weight, bias, *args = case(index, k, channels=channels)
    return (x.half(), weight.half(), bias.half(), *args)


def assert_close_to_float64(result, x, weight, bias, *args):
    expected = run(reference, x.double(), weight.double(), bias.double(), *args)
    for name, a, b in zip(("output", "grad input", "grad weight", "grad bias"), result, expected):
        error = (a.double() - b).abs().max() / b.abs().max()
        assert error < 8 * torch.finfo(torch.float16).eps, f"{name}: relative error {error:.2e}"


@kernel_test
@pytest.mark.parametrize("index", [0, 2])  # groups 1 (fused/columns) and depthwise (direct/columns)
def test_auto_checks_every_candidate_and_keeps_the_fastest(fresh_tuner, index):
    geometry = get_geometry(3, "polar", "ring")
    x, weight, bias, stride, dilation, groups, pad = half_case(index, 3, 16 if index == 0 else 4)
    args = (geometry, stride, dilation, groups, pad)
    first = tuned(x, weight, bias, *args)
    forward, backward = fresh_tuner.decisions()
    call = triton_backend._Call.of(x, weight, *args)
    for kind, decision in (("forward", forward), ("backward", backward)):
        assert decision.rejected == {}, decision.rejected  # every kernel agreed with the reference path
        assert len(decision.seconds) == 1 + len(triton_backend.candidates(kind, call, x))  # all timed
        assert decision.chosen.name == list(decision.seconds)[-1] != "reference path"  # the clock's fastest
    assert torch.equal(first[0], reference(x, weight, bias, *args))  # the deciding call: the reference's result
    second = tuned(x, weight, bias, *args)  # the kept kernels
    assert len(fresh_tuner.decisions()) == 2
    for result in (first, second):
        assert_close_to_float64(result, x, weight, bias, *args)


@kernel_test
@pytest.mark.parametrize("index", [0, 2])
def test_auto_keeps_the_kernels_on_tied_inputs(fresh_tuner, index):
    # After a ReLU half the values are zeros: ties in every window, where a sort's gradient may go to any
    # of the tied values (torch.sort and a network pick differently). The backward is checked on an input
    # without ties, so no kernel is left out.
    geometry = get_geometry(3, "square", "global")
    x, weight, bias, stride, dilation, groups, pad = half_case(index, 3, 16 if index == 0 else 4)
    tuned(x.relu(), weight, bias, geometry, stride, dilation, groups, pad)
    assert [d.rejected for d in fresh_tuner.decisions()] == [{}, {}]


@kernel_test
def test_auto_keeps_the_bfloat16_backward_kernels_of_a_7x7_layer_under_autocast(fresh_tuner, monkeypatch):
    # backward() called inside autocast, as a layer's benchmark does: the backward runs under it, and the checker's
    # float32 reference must not interpolate in bfloat16 (rounded samples tie in more than half of the 7x7 windows, and
    # a tie's gradients go either way). Candidates: the paths whose bfloat16 kernels this device computes.
    candidates = triton_backend.candidates
    monkeypatch.setattr(triton_backend, "candidates", lambda *args: [
        c for c in candidates(*args) if c.name.split()[1] in BFLOAT16_PATHS])
    x, weight, grad_out = (randn(*shape, seed=seed).to(torch.bfloat16)
                           for seed, shape in enumerate([(1, 2, 9, 9), (4, 2, 7, 7), (1, 4, 9, 9)]))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        triton_backend.tuned_backward(grad_out, x, weight / 10, get_geometry(7, "polar", "ring"), (1, 1), (1, 1), 1,
                                      True, True, (3, 3, 3, 3))
    backward, = fresh_tuner.decisions()
    assert backward.rejected == {} and backward.chosen.name != "reference path"


@kernel_test
def test_auto_leaves_out_a_failing_or_wrong_kernel(fresh_tuner, monkeypatch):
    geometry = get_geometry(3, "square", "global")
    x, weight, bias, stride, dilation, groups, pad = half_case(0, 3, 16)

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    def wrong(x, weight, bias, call, blocks=None):
        return triton_backend._columns_forward(x, weight.flip(-1), bias, call, blocks)

    monkeypatch.setitem(triton_backend._FORWARD_PATHS, "fused", broken)
    monkeypatch.setitem(triton_backend._FORWARD_PATHS, "gemm", broken)
    monkeypatch.setitem(triton_backend._FORWARD_PATHS, "columns", wrong)
    with pytest.warns(RuntimeWarning) as caught:
        out = tuned(x, weight, bias, geometry, stride, dilation, groups, pad)[0]
    messages = [str(w.message) for w in caught]
    assert sum("triton fused forward" in m and "launch failed" in m for m in messages) == 2  # both block sizes
    assert sum("triton gemm forward" in m and "launch failed" in m for m in messages) == 2
    assert sum("triton columns forward" in m and "differs" in m for m in messages) == 2
    forward = fresh_tuner.decisions()[0]
    assert forward.chosen.name == "reference path" and len(forward.rejected) == 6
    assert torch.equal(out, reference(x, weight, bias, geometry, stride, dilation, groups, pad))


@kernel_test
def test_auto_in_deterministic_mode_takes_no_atomics(fresh_tuner):
    geometry = get_geometry(3, "polar", "global")
    x, weight, bias, stride, dilation, groups, pad = half_case(2, 3, 4)  # depthwise
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        results = [tuned(x, weight, bias, geometry, stride, dilation, groups, pad) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    forward, backward = fresh_tuner.decisions()
    assert forward.chosen.name.startswith("triton direct forward") and forward.seconds == {}  # first, untimed
    assert backward.chosen.name.startswith("triton columns backward")  # the direct backward adds with atomics
    assert all(torch.equal(a, b) for a, b in zip(results[2], results[1]))  # the kept kernels: the same bits
    assert_close_to_float64(results[2], x, weight, bias, geometry, stride, dilation, groups, pad)


def test_depth_first_order_sorts_as_the_network_does():
    # Same comparators, each wire meeting its own in the original order: the same result on any input.
    generator = torch.Generator().manual_seed(0)
    for k in (3, 5, 7, 9):
        for sorting in ("ring", "global"):
            pairs = get_geometry(k, "square", sorting).comparators()
            reordered = depth_first(pairs)
            assert sorted(reordered) == sorted(pairs)
            for wire in range(k * k):
                assert [p for p in reordered if wire in p] == [p for p in pairs if wire in p]
            values = torch.randn(k * k, 64, generator=generator)
            results = []
            for order in (pairs, reordered):
                v = values.clone()
                for a, b in order:
                    v[a], v[b] = torch.minimum(v[a], v[b]), torch.maximum(v[a], v[b])
                results.append(v)
            assert torch.equal(results[0], results[1])


def test_generated_source_holds_the_geometry():
    # Each kernel's network is the geometry's (one swap or one min per comparator) and the tap weights are
    # the geometry's, written with every digit of their float64 value.
    geometry = get_geometry(5, "polar", "ring")
    source = kernel_source(geometry)
    comparators = len(geometry.comparators())
    # columns, fused, direct forward, gemm forward and gemm weight gradient kernels
    assert source.count("lo = tl.minimum(") == 5 * comparators
    assert source.count("swap = s") == 3 * comparators  # record, direct backward and gemm input gradient kernels
    assert source.count("swap = (swaps") == 3 * comparators  # replay, direct backward and gemm input gradient
    for weight in geometry.tap_weights.flatten().tolist():
        assert weight in (0.0, 1.0) or f"{weight!r}, COMPUTE)" in source


def test_path_rule():
    assert config.choose_path(1, 1, 25) == "direct"  # depthwise
    assert config.choose_path(1, 1, 49) == "columns"  # depthwise 7x7: the direct kernels would spill
    assert config.choose_path(4, 4, 9) == "direct"  # grouped, few channels per group
    assert config.choose_path(1, 32, 9) == "columns"  # a first layer: too few channels for tl.dot, too many
    assert config.choose_path(3, 128, 24) == "columns"  # outputs for the direct kernels' FMAs
    assert config.choose_path(64, 64, 9) == config.FORWARD_PATH
    assert config.choose_path(64, 64, 24) == "columns"  # larger windows: the fused kernel would spill
    assert config.choose_path(64, 64, 2, slots=9) == config.FORWARD_PATH  # 3x3 orbit sorting
    assert config.choose_path(64, 64, 2, slots=49) == "columns"  # 7x7 orbit sorting: fused unmeasured there
    assert config.choose_path(64, 64, 9, 1000, 132) == config.FORWARD_PATH
    assert config.choose_path(64, 64, 9, 64, 132) == "columns"  # too few programs to fill the GPU
    # backward: direct for windows of up to 9 samples (beyond, its kernel compiles slowly), gemm up to 49
    # (not in float64), the columns for any
    assert config.backward_paths(1, 1, 9, 9) == ("direct", "columns", "gemm")
    assert config.backward_paths(1, 1, 16, 25) == ("columns", "gemm")
    assert config.backward_paths(4, 32, 9, 9) == ("columns", "direct", "gemm")
    assert config.backward_paths(1, 1, 24, 49) == ("columns", "gemm")
    assert config.backward_paths(64, 64, 24, 49, double=True) == ("columns",)
    assert config.backward_paths(64, 64, 9, 9) == ("columns", "gemm")
    assert config.backward_paths(64, 64, 9, 81) == ("columns",)
    assert config.forward_paths(1, 1, 25, slots=25) == ("direct", "columns", "gemm")
    assert config.forward_paths(1, 1, 49, slots=49) == ("columns", "gemm")
    assert config.forward_paths(64, 64, 9, 1000, 132, slots=9) == ("fused", "columns", "gemm")
    assert config.forward_paths(64, 64, 9, 64, 132, slots=9) == ("columns", "fused", "gemm")
    assert config.forward_paths(64, 64, 24, slots=49) == ("columns", "gemm")
    # float64: the fused kernel spills at 9 samples, the direct forward at 25
    assert config.forward_paths(64, 64, 9, slots=9, double=True) == ("columns",)  # the gemm kernels spill too
    assert config.forward_paths(1, 1, 9, slots=9, double=True) == ("direct", "columns")
    assert config.forward_paths(1, 1, 16, slots=25, double=True) == ("columns",)
    assert config.forward_paths(1, 1, 24, slots=49, double=True) == ("columns",)
    # a forced path's backward: its own, the columns' for the fused path, which has none
    assert [config.backward_path_of(path) for path in config.PATHS] == ["direct", "columns", "columns", "gemm"]


def test_gemm_weight_gradient_splits_fill_the_gpu():
    assert config.gemm_splits(32, 613, 132) == 17  # 32 channels x 1 output block: 4 programs per SM of an H100
    assert config.gemm_splits(2048, 613, 132) == 1  # enough programs without splitting
    assert config.gemm_splits(32, 5, 132) == 5  # at most one split per block of positions
    assert config.gemm_splits(3, 9, 0) == 2  # no multiprocessor count (the interpreter): two splits


@kernel_test
def test_each_thread_runs_the_path_its_calls_name(monkeypatch):
    # The path travels with the call (backend="triton-<path>"), not through process-wide state: two threads
    # calling two paths at once each run their own. The paths are replaced by recorders that return the
    # reference's result (Triton's interpreter runs one kernel at a time).
    import threading

    ran, errors = {}, []
    for name in ("columns", "gemm"):
        def record(x, weight, bias, call, blocks=None, name=name):
            ran.setdefault(threading.current_thread().name, set()).add(name)
            return triton_backend._reference_forward(x, weight, bias, call)

        monkeypatch.setitem(triton_backend._FORWARD_PATHS, name, record)
    geometry = get_geometry(3, "polar", "ring")
    x, weight, bias, stride, dilation, groups, pad = case(0, 3)
    barrier = threading.Barrier(2)

    def call(path):
        try:
            barrier.wait()
            for _ in range(20):
                torch.ops.timm_sortconv.sort_conv2d(x, weight, bias, list(stride), list(pad), list(dilation), groups,
                                                    geometry.sampling, geometry.sorting, f"triton-{path}")
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=call, args=(path,), name=path) for path in ("columns", "gemm")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and ran == {"columns": {"columns"}, "gemm": {"gemm"}}


class FakeKernel:
    """Stands for a compiled kernel: records each launch (``kernel[grid](...)``) and each compile
    (``kernel.warmup(..., grid=grid)``) with the arguments Triton specializes on (tensors: dtype, shape,
    strides; the rest: values)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def record(self, mode, grid, args, meta):
        described = tuple((a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a for a in args)
        self.log.append((mode, self.name, tuple(grid), described, tuple(sorted(meta.items()))))

    def __getitem__(self, grid):
        return lambda *args, **meta: self.record("launch", grid, args, meta)

    def warmup(self, *args, grid, **meta):
        self.record("compile", grid, args, meta)


PATH_CALLS = [("forward", path, None) for path in ("direct", "fused", "columns", "gemm")] + [
    ("backward", path, needs) for path in ("direct", "columns", "gemm")
    for needs in ((True, True), (True, False), (False, True))] + [
    ("backward", f"{path}-atomic", needs) for path in triton_backend.SCATTER_PATHS
    for needs in ((True, True), (True, False))]  # the scatters: only where the input gradient is wanted


@pytest.mark.parametrize("kind, path, needs", PATH_CALLS)
def test_prepare_compiles_each_kernel_a_path_launches_for_the_same_arguments(kind, path, needs, monkeypatch):
    """auto compiles its candidates in parallel first (triton_backend.prepare): each launch of the path's code
    becomes a compile of the same kernel with the same arguments, hence the specialization the checked run
    launches, found in the cache."""
    log = []
    monkeypatch.setattr(triton_backend, "load_kernels",
                        lambda geometry: {name: FakeKernel(name, log) for name in triton_backend.KERNELS})
    monkeypatch.setattr(config, "column_images", lambda bytes_per_image, batch: 2)  # chunks of 2 of 3 images
    x, weight = torch.randn(3, 4, 9, 8), torch.randn(6, 2, 3, 3)
    call = triton_backend._Call.of(x, weight, get_geometry(3, "polar", "ring"), (1, 1), (1, 1), 2, (1, 1, 1, 1))
    if kind == "forward":
        function, args = triton_backend._FORWARD_PATHS[path], (x, weight, torch.randn(6), call)
    else:
        name, _, atomic = path.partition("-")
        function = triton_backend._BACKWARD_PATHS[name]
        function = functools.partial(function, scatter=True) if atomic else function
        args = (torch.randn(3, 6, 9, 8), x, weight, call, *needs)
    function(*args)
    launched = [entry[1:] for entry in log if entry[0] == "launch"]
    assert launched and len(launched) == len(log)
    log.clear()
    triton_backend.prepare(function, *args)
    assert [entry[0] for entry in log] == ["compile"] * len(launched)
    assert [entry[1:] for entry in log] == launched
    assert not getattr(triton_backend._COMPILE_ONLY, "active", False)  # launches run again after it


def test_precision_follows_cudnn_allow_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert triton_backend._dot_precision(torch.float32) == "tf32"
    assert triton_backend._dot_precision(torch.float64) == "ieee"
    with triton_backend._cublas_like_conv(torch.float32):
        assert torch.backends.cuda.matmul.allow_tf32
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert triton_backend._dot_precision(torch.float32) == "ieee"
    before = torch.backends.cuda.matmul.allow_tf32
    with triton_backend._cublas_like_conv(torch.float32):
        assert not torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.skipif(INTERPRETED, reason="under the interpreter the backend takes CPU tensors")
def test_never_chosen_for_cpu_tensors():
    geometry = get_geometry(3, "polar", "ring")
    args = (torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3), None, geometry, (1, 1), (1, 1), 1)
    assert not triton_backend.supports_triton(*args)
    assert resolve_backend("auto", *args).name != "triton"
    with pytest.raises(RuntimeError):
        sort_conv2d(torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3), padding=1, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA tensors")
def test_supports_on_cuda():
    x, weight = torch.randn(1, 2, 8, 8, device="cuda"), torch.randn(2, 2, 3, 3, device="cuda")
    assert triton_backend.supports_triton(x, weight, None, get_geometry(9, "polar", "ring"), (1, 1), (1, 1), 1)
    big = torch.randn(2, 2, 11, 11, device="cuda")
    assert not triton_backend.supports_triton(x, big, None, get_geometry(11, "polar", "ring"), (1, 1), (1, 1), 1)
    assert not triton_backend.supports_triton(x, weight.double(), None, get_geometry(3, "polar", "ring"), (1, 1),
                                              (1, 1), 1)


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_benchmark_cuda_options():
    bench = load_script(SCRIPTS / "bench_sortconv.py", "bench_sortconv")
    args = bench.parse_args(["--device", "cuda", "--shapes", "gpu,scnn_p_rs_7", "--kernel-sizes", "3,5,7",
                             "--precisions", "fp32,bf16,fp16", "--triton-paths", "auto,fused,columns,direct"])
    assert args.device == "cuda" and args.kernel_sizes == "3,5,7"
    assert [shape.kernel_size for shape in bench.SHAPE_SETS["gpu"][1]] == [7, 7, 3, 3, 3, 7, 7]
    assert [shape.groups for shape in bench.SHAPE_SETS["gpu"][1]][-2:] == [96, 384]  # depthwise
    for wrong in (["--precisions", "fp8"], ["--triton-paths", "fast"], ["--kernel-sizes", "4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cuda", *wrong])


@pytest.mark.skipif(not INTERPRETED, reason="the dry run's Triton kernels run in the interpreter's subprocess")
def test_benchmark_dry_run(capsys, monkeypatch):
    # The --device cuda code on tiny CPU tensors: every column of the layer table and the throughput table, and
    # (CPU tensors make no decisions, so one is injected) what backend="auto" decided.
    bench = load_script(SCRIPTS / "bench_sortconv.py", "bench_sortconv")
    decision = bench.tuning.Decision("k=7 polar-ring float32", bench.tuning.Candidate("reference", print),
                                     {"reference": 0.02, "columns": 0.03})
    decisions = [[], [decision]]  # the first main() run decides nothing, the second one decision
    monkeypatch.setattr(bench.tuning.TUNER, "decisions", lambda: decisions.pop(0))
    bench.main(["--device", "cuda", "--dry-run", "--shapes", "gpu", "--variants", "polar-ring,square-global",
                "--precisions", "fp32,bf16", "--triton-paths", "auto,columns"])
    bench.main(["--device", "cuda", "--dry-run", "--shapes", "none", "--throughput"])
    lines = capsys.readouterr().out.splitlines()
    headers = [line for line in lines if line.startswith("| shape |")]
    assert len(headers) == 2 and "| conv fp32 f+b | conv default fwd |" in headers[0]
    assert "| conv bf16 f+b |" in headers[1] and "| triton[columns]/conv f+b |" in headers[1]
    rows = [line.split(" | ") for line in lines if line.startswith("| B=2, C_in=4")]
    assert len(rows) == 4 and all(len(row) == len(headers[0].split(" | ")) for row in rows[:2])
    assert all(float(cell) > 0 for row in rows for cell in row[3:5])
    throughput = [line for line in lines if line.startswith("| scnn_p_rs_7 |") or line.startswith("| ri_")]
    assert len(throughput) == 3  # three models, one precision
    assert sum(line.startswith('### What backend="auto" decided') for line in lines) == 1
    assert "| k=7 polar-ring float32 | reference | reference 20.000 ms; columns 30.000 ms | - | - |" in lines


def ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            ptxas = get_ptxas(90)
        except TypeError:  # older Tritons (3.5 with torch 2.9) take no architecture
            ptxas = get_ptxas()
        return os.path.exists(ptxas.path)
    except Exception:  # no NVIDIA backend in this Triton build
        return False


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED or not ptxas_available(), reason="compiles with Triton's NVIDIA backend (ptxas)")
def test_kernels_compile_for_sm90(tmp_path):
    # The generated source through Triton's real compiler (the interpreter runs it as Python), for an H100,
    # with the launch settings the backend uses; the fused and gemm kernels' products are tensor-core
    # instructions.
    report = load_script(SCRIPTS / "triton_kernel_report.py", "triton_kernel_report")
    from timm_sortconv.ops.triton_backend.source import load_kernels

    geometry = get_geometry(3, "polar", "ring")
    cases = [(kernel, torch.float32) for kernel in triton_backend.KERNELS] + [("fused_forward_kernel", torch.float64)]
    for kernel, dtype in cases:
        meta = triton_backend.launch_settings(kernel, geometry, dtype, 1, 32, 32)
        cells = report.compile_kernel(load_kernels(geometry)[kernel], dtype, meta, 90, tmp_path)
        dot = triton_backend.KERNEL_PATHS[kernel] in ("fused", "gemm")
        assert cells["SASS"] > 0 and (cells["mma"] > 0) == dot, (kernel, cells)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED or not ptxas_available(), reason="compiles with Triton's NVIDIA backend (ptxas)")
def test_the_columns_fused_and_gemm_kernels_keep_their_windows_in_registers(tmp_path):
    # Compiled for an H100: the 7x7 layers' kernels of the columns path and every block size of the 3x3 fused and
    # gemm kernels for a wide group have no stack frame (a window kept in local memory made the columns path 70-100x
    # slower than its memory bound on an H200) and a short program.
    report = load_script(SCRIPTS / "triton_kernel_report.py", "triton_kernel_report")
    from timm_sortconv.ops.triton_backend.source import load_kernels

    cases = [(7, kernel, None, False) for kernel in ("columns_kernel", "record_kernel", "replay_kernel")]
    cases += [(3, "fused_forward_kernel", blocks, False) for blocks in config.fused_candidates(9, 128)]
    cases += [(3, kernel, blocks, False) for kernel in ("gemm_forward_kernel", "gemm_input_backward_kernel",
                                                        "gemm_weight_backward_kernel")
              for blocks in config.gemm_candidates(9, 128, backward=kernel != "gemm_forward_kernel")]
    # the input gradients added into place: reductions (no returned value) and no stores
    cases += [(7, "replay_kernel", None, True)]
    cases += [(3, "gemm_input_backward_kernel", blocks, True) for blocks in config.gemm_candidates(9, 128, True)]
    for k, kernel, blocks, scatter in cases:
        geometry = get_geometry(k, "polar", "ring")
        meta = triton_backend.launch_settings(kernel, geometry, torch.float32, 1, 128, 128, blocks=blocks,
                                              scatter=scatter)
        cells = report.compile_kernel(load_kernels(geometry)[kernel], torch.float32, meta, 90, tmp_path)
        assert int(cells["spill B"]) == 0 and int(cells["regs"]) <= (255 if blocks else 200), (kernel, cells)
        assert cells["SASS"] < 4000, (kernel, cells)
        if scatter:
            assert cells["atomics"] > 0 and cells["st.global"] == 0, (kernel, cells)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETED or not ptxas_available(), reason="compiles with Triton's NVIDIA backend (ptxas)")
def test_compile_threads_compiles_the_selected_kernels_alone_and_in_threads(capsys):
    # What auto's parallel compile relies on: Triton's compiler runs kernels in threads at once (the wall time
    # is the benchmark's; here that it compiles the jobs both ways and says so).
    report = load_script(SCRIPTS / "triton_kernel_report.py", "triton_kernel_report")
    args = report.parse_args(["--k", "3", "--variants", "polar-ring", "--kernels", "columns_kernel,direct_forward_kernel",
                              "--compile-threads", "2"])
    jobs = list(report.compile_jobs(args))
    assert [job[0][0] for job in jobs] == ["columns_kernel", "direct_forward_kernel"]
    assert report.compile_in_threads(args, jobs) == 0
    out = capsys.readouterr().out
    assert "2 kernels (columns_kernel, direct_forward_kernel), k [3]" in out and "one thread: " in out
    assert "2 threads: " in out


def test_roofline_counts_a_layers_products_and_the_bytes_each_design_moves():
    report = load_script(SCRIPTS / "triton_kernel_report.py", "triton_kernel_report")
    bench = load_script(SCRIPTS / "bench_sortconv.py", "bench_sortconv")
    shape = bench.LayerShape(100, 32, 32, 28, 28, 7)  # the SCNN's 7x7 layer
    geometry = get_geometry(7, "polar", "ring")
    cells = report.layer_roofline(shape, geometry, 4)
    assert cells["GFLOP fwd"] == pytest.approx(2 * 100 * 28 * 28 * 32 * 32 * 49 / 1e9)  # 7.87
    columns = 100 * 32 * 28 * 28 * 49 * 4 / 1e6  # 492 MB of sorted columns in float32
    assert cells["columns MB fwd"] == pytest.approx(cells["conv MB fwd"] + 2 * columns)
    assert cells["conv MB fwd"] < cells["gemm MB fwd"] + 1e-9 < cells["columns MB fwd"]
    assert cells["gemm MB f+b"] < cells["columns MB f+b"] / 3  # no columns and no column gradient in memory
    x = 100 * 32 * 28 * 28 * 4 / 1e6  # the scatter: no window values in memory, a zeroed buffer of x's size instead
    assert cells["gemm MB f+b"] - cells["scatter MB f+b"] == pytest.approx(2 * columns - x)
    half = report.layer_roofline(shape, geometry, 2)  # bfloat16 halves what the convolution moves
    assert half["conv MB fwd"] == pytest.approx(cells["conv MB fwd"] / 2)


@pytest.mark.skipif(triton_backend.triton is None, reason="needs Triton")
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_the_weight_layouts_are_one_gather_and_their_gradients_go_back(groups):
    """Each layout the kernels read is the weight's slots in the geometry's order, permuted ([group, out, in, slot]
    reordered as LAYOUTS says), made by one gather; a gradient in a layout goes back to (O, C/g, k, k)."""
    from timm_sortconv.ops.triton_backend import LAYOUTS, _Call, _weight_from, _weight_in

    geometry = get_geometry(5, "polar", "ring")
    weight = torch.randn(8, 8 // groups, 5, 5, dtype=torch.float64)
    call = _Call.of(torch.empty(2, 8, 9, 9), weight, geometry, (1, 1), (1, 1), groups, (2, 2, 2, 2))
    slots = weight.reshape(groups, 8 // groups, 8 // groups, 25)[..., geometry.slot_to_grid]
    for layout, axes in LAYOUTS.items():
        laid = _weight_in(layout, weight, call)
        assert laid.is_contiguous() and torch.equal(laid, slots.permute(*axes))
        assert torch.equal(_weight_from(layout, laid, call), weight)
