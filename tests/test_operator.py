"""SC as a registered PyTorch operator: its registrations, double backward, torch.compile with the fast
kernel, TorchScript, torch.export, autocast, and the backend reaching every layer of a model."""
import contextlib
import dataclasses
import warnings

import pytest
import timm
import torch
import torch.nn as nn

import timm_sortconv  # noqa: F401  (registers the models)
from timm_sortconv import SortConv2d, SortConv2dSame, sort_conv2d, sortify
from timm_sortconv.ops import backends
from timm_sortconv.ops.operator import sort_conv2d_op

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = [(s, o) for s in ("square", "polar") for o in ("ring", "global")]
VARIANT_IDS = [f"{s}-{o}" for s, o in VARIANTS]


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def fast_backend():
    """The name of the CPU kernel's backend where it can run here, else skip."""
    if "cpu" not in timm_sortconv.available_backends():
        pytest.skip("the fused CPU backend is not available here")
    return "cpu"


@pytest.fixture
def count_calls(monkeypatch):
    """Replaces a backend's kernels by counting wrappers; returns the counts by kernel."""
    def install(name):
        counts = {"forward": 0, "backward": 0}
        original = backends._BACKENDS[name]

        def counted(kind, kernel):
            def wrapper(*args, **kwargs):
                counts[kind] += 1
                return kernel(*args, **kwargs)
            return wrapper

        monkeypatch.setitem(backends._BACKENDS, name, dataclasses.replace(
            original, forward=counted("forward", original.forward), backward=counted("backward", original.backward)))
        return counts
    return install


@pytest.mark.slow
@pytest.mark.parametrize("backend,dtype", [("reference", torch.float64), ("cpu", torch.float32)])
def test_opcheck(backend, dtype):
    """torch.library's own checks: schema, fake (meta) kernel against the real one, autograd registration,
    and the operator inside AOTAutograd, with and without bias and padding."""
    if backend == "cpu":
        fast_backend()
    x = randn(2, 3, 9, 8, dtype=dtype).requires_grad_()
    weight = randn(4, 3, 5, 5, seed=1, dtype=dtype).requires_grad_()
    bias = randn(4, seed=2, dtype=dtype).requires_grad_()
    for args in ((x, weight, bias, [1, 1], [2, 2, 2, 2], [1, 1], 1, "polar", "ring", backend),
                 (x, weight, None, [2, 1], [0, 0, 0, 0], [1, 1], 1, "square", "global", backend)):
        torch.library.opcheck(sort_conv2d_op, args)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
def test_double_backward(sampling, sorting, backend):
    """Second derivatives (gradient penalties, Hessian-vector products) are right on every backend."""
    if backend == "cpu":
        fast_backend()
    layer = SortConv2d(2, 2, 3, padding=1, sampling=sampling, sorting=sorting, backend=backend).double()
    x = randn(1, 2, 4, 4).requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x, w, b: layer._conv_forward(x, w, b), (x, layer.weight, layer.bias),
                                        fast_mode=True)


def test_a_gradient_penalty_reaches_the_weights():
    """The gradient of an input-gradient penalty: what a silently detached input gradient would lose."""
    backend = fast_backend()
    grads = {}
    for name in ("reference", backend):
        torch.manual_seed(0)
        layer = SortConv2d(2, 3, 5, padding=2, backend=name).double()
        x = randn(2, 2, 8, 8).requires_grad_()
        (grad_x,) = torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
        assert grad_x.requires_grad
        grad_x.square().sum().backward()
        grads[name] = layer.weight.grad
    assert grads[backend].abs().sum() > 0
    torch.testing.assert_close(grads[backend], grads["reference"], rtol=1e-9, atol=1e-9)


def test_only_the_input_and_the_weight_are_kept_for_backward():
    x, weight = randn(2, 3, 8, 8).requires_grad_(), randn(4, 3, 5, 5, seed=1).requires_grad_()
    for backend in timm_sortconv.available_backends():
        saved = []
        sorting = "align" if backend == "harmonic" else "ring"  # the harmonic backend runs the aligned variants
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            sort_conv2d(x, weight, padding=2, sorting=sorting, backend=backend)
        assert {id(t) for t in saved} == {id(x), id(weight)}, backend


def small_model(backend="auto"):
    torch.manual_seed(0)
    return nn.Sequential(
        SortConv2d(2, 4, 5, padding=2, backend=backend),
        nn.ReLU(),
        SortConv2d(4, 3, 3, stride=2, padding=1, sorting="global", backend=backend),
    )


@pytest.mark.slow
def test_compile_runs_the_fast_kernel_without_graph_breaks_or_recompiling(count_calls):
    """fullgraph=True (no graph break), dynamic shapes (one graph for every batch size), and the CPU kernel
    called at run time, forward and backward."""
    backend = fast_backend()
    counts = count_calls(backend)
    model = small_model()
    torch._dynamo.reset()  # compiled modules share one code object: no entries left by other tests
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (3, 4, 6):  # none equal to another size of the call (dynamo would pair them)
            x = randn(batch, 2, 12, 12, dtype=torch.float32)
            out = compiled(x)
            expected = model(x)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
            out.sum().backward()
    assert counts["forward"] >= 2 * 3 * 2 and counts["backward"] >= 2 * 3


@pytest.mark.slow
def test_inductor_keeps_the_operator(count_calls):
    """Inductor compiles around the operator and calls the kernel; it does not decompose it."""
    backend = fast_backend()
    counts = count_calls(backend)
    layer = SortConv2d(2, 3, 3, padding=1)
    x = randn(2, 2, 8, 8, dtype=torch.float32)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    assert counts["forward"] == 2


@pytest.mark.parametrize("layer", [SortConv2d(3, 4, 5, padding=2, padding_mode="reflect"),
                                   SortConv2d(3, 4, 3, padding="same", sampling="square"),
                                   SortConv2dSame(3, 4, 3, stride=2)], ids=["reflect", "same", "dynamic-same"])
def test_torchscript_script_and_trace_call_the_operator(layer):
    x = randn(2, 3, 11, 11, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation notice
        scripted = torch.jit.script(layer)
        traced = torch.jit.trace(layer, x)
    expected = layer(x)
    # another batch and size; for dynamic-same, one whose padding is even on both sides, as 11's is: a trace
    # records the parity-dependent centring of the size it was traced at (scripting follows every size)
    other = randn(1, 3, 13, 15, dtype=torch.float32, seed=3)
    for module in (scripted, traced):
        torch.testing.assert_close(module(x), expected)
        torch.testing.assert_close(module(other), layer(other))
        assert "timm_sortconv::sort_conv2d" in str(module.inlined_graph)
    torch.testing.assert_close(scripted(x[0]), expected[0])  # unbatched input, as nn.Conv2d
    odd = randn(1, 3, 12, 14, dtype=torch.float32, seed=4)
    torch.testing.assert_close(scripted(odd), layer(odd))


@pytest.mark.slow
def test_export_keeps_the_operator():
    model = small_model().eval()
    x = randn(2, 2, 12, 12, dtype=torch.float32)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (x,), dynamic_shapes=({0: batch},))
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count("timm_sortconv.sort_conv2d.default") == 2, targets
    other = randn(5, 2, 12, 12, dtype=torch.float32, seed=4)
    torch.testing.assert_close(program.module()(other), model(other))


def test_autocast_on_the_cpu_runs_the_kernel_in_bfloat16_or_float32(count_calls):
    """Under bfloat16 autocast the kernel runs in bfloat16 where it multiplies in bfloat16 (the call is then
    the explicit bfloat16 call, bit for bit), else in float32 (only the output's rounding differs); either
    way the gradients reach the float32 parameters."""
    from timm_sortconv.ops.cpu_backend import bf16_products

    backend = fast_backend()
    counts = count_calls(backend)
    layer = SortConv2d(4, 6, 5, padding=2)
    x = randn(2, 4, 10, 10, dtype=torch.float32).requires_grad_()
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and counts["forward"] == 2
    if bf16_products():
        direct = sort_conv2d(x.bfloat16(), layer.weight.bfloat16(), layer.bias.bfloat16(), padding=2)
        assert torch.equal(out, direct)
        assert (out.float() - expected).abs().max() <= 2 ** -7 * expected.abs().max()
    else:
        torch.testing.assert_close(out.float(), expected.bfloat16().float())
    out.float().sum().backward()
    assert counts["backward"] == 1 and x.grad is not None
    grad_expected = torch.autograd.grad(expected.sum(), layer.weight)[0]
    assert layer.weight.grad.dtype == torch.float32
    assert (layer.weight.grad - grad_expected).abs().max() <= 2 ** -6 * grad_expected.abs().max()


def test_autocast_keeps_float32_for_the_reference_backend_and_float64(count_calls):
    """A layer pinned to the reference path, and float64 tensors, are computed as before under bfloat16
    autocast: float32 (output rounded) and float64."""
    layer = SortConv2d(4, 6, 5, padding=2, backend="reference")
    x = randn(2, 4, 10, 10, dtype=torch.float32)
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        out64 = sort_conv2d(x.double(), layer.weight.double(), None, padding=2)
    torch.testing.assert_close(out.float(), expected.bfloat16().float())
    assert out64.dtype == torch.float64


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_the_operator_refuses_an_integer_input_and_the_wrong_channels_as_the_layers_do(dtype, autocast):
    """Called directly, the operator refuses what ``SortConv2d`` and ``sort_conv2d`` refuse at their entry, with
    the same errors: an integer or bool input beside float32 weights (a ``RuntimeError`` as from ``F.conv2d``, and
    a ``TypeError``; autocast casts floating-point tensors only) and an input with other channels than the weight
    expects (a ``ValueError``, and a ``RuntimeError``)."""
    op = torch.ops.timm_sortconv.sort_conv2d
    options = ([1, 1], [0, 0, 0, 0], [1, 1], 1, "polar", "ring", "auto")
    weight, bias = randn(4, 2, 3, 3, dtype=torch.float32), randn(4, seed=1, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with pytest.raises(RuntimeError, match=rf"floating-point tensors \(float16, bfloat16, float32, float64\): "
                                               rf"integer, bool and complex ones are not accepted; got input {dtype}, "
                                               rf"weight torch.float32, bias torch.float32$") as info:
            op(torch.ones(1, 2, 6, 6, dtype=dtype), weight, bias, *options)
        assert isinstance(info.value, TypeError)
        with pytest.raises(ValueError, match=r"input has 3 channels \(shape \[1, 3, 6, 6\]\) but the weight "
                                             r"\[4, 2, 3, 3\] with groups=1 expects 2$") as info:
            op(randn(1, 3, 6, 6, dtype=torch.float32), weight, bias, *options)
        assert isinstance(info.value, RuntimeError)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["scnn_p_rs_3", "ri_resnet18", "ri_vgg16", "ri_densenet40"])
def test_create_model_passes_the_backend_to_every_layer(name):
    model = timm.create_model(name, backend="reference")
    layers = [m for m in model.modules() if isinstance(m, SortConv2d)]
    assert layers and all(m.backend == "reference" for m in layers)
    with pytest.raises(ValueError, match="unknown backend"):
        timm.create_model(name, backend="fastest")


@pytest.mark.slow
def test_sortify_passes_the_backend_to_every_layer():
    model = sortify(timm.create_model("resnet18"), backend="reference")
    layers = [m for m in model.modules() if isinstance(m, SortConv2d)]
    assert len(layers) == 17 and all(m.backend == "reference" for m in layers)
    with pytest.raises(ValueError, match="unknown backend"):
        sortify(timm.create_model("resnet18"), backend="fastest")


def test_plain_eager_calls_skip_the_dispatcher_and_agree_with_the_operator_bit_for_bit(count_calls):
    """A plain eager call runs the backend's kernels without the dispatcher (the registered operator's custom-op
    layers cost several times a small layer's kernel); under a dispatch mode (what tracing and fake tensors use),
    the profiler or autocast, the operator is called. Both give the same output and gradients, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from timm_sortconv.ops import operator

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    counts = count_calls("reference")
    x, weight, bias = randn(2, 3, 9, 9), randn(4, 3, 5, 5, seed=1), randn(4, seed=2)
    results = []
    for mode in ("eager", "dispatch mode", "profiler"):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        seen = Seen()
        context = {"eager": contextlib.nullcontext(), "dispatch mode": seen,
                   "profiler": torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])}[mode]
        with context:
            assert operator.plain_eager(*leaves) is (mode == "eager")
            out = sort_conv2d(*leaves, padding=2, backend="reference")
            out.backward(torch.ones_like(out))
        assert ("timm_sortconv.sort_conv2d" in seen.ops) is (mode == "dispatch mode")
        results.append([out.detach()] + [t.grad for t in leaves])
    assert counts == {"forward": 3, "backward": 3}
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not operator.plain_eager(x, weight, bias)


def test_a_backward_called_under_autocast_runs_in_the_dtypes_of_the_forward():
    """autograd runs the formula under the autocast of the code calling backward(); the gradients of a float32
    forward are those computed without autocast, bit for bit."""
    x = randn(2, 3, 9, 9, dtype=torch.float32).requires_grad_()
    weight = randn(4, 3, 5, 5, seed=1, dtype=torch.float32).requires_grad_()
    out = sort_conv2d(x, weight, padding=2, backend="reference")  # products in torch operators, which autocast casts
    plain = torch.autograd.grad(out, (x, weight), torch.ones_like(out), retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = torch.autograd.grad(out, (x, weight), torch.ones_like(out))
    assert all(g.dtype == torch.float32 and torch.equal(g, h) for g, h in zip(under, plain))
