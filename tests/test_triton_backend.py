"""The Triton backend (``backend="triton"``, CUDA only) against the reference path.

No GPU is needed: the kernels run on CPU tensors under Triton's interpreter, which executes the same
kernel code with NumPy. The interpreter must be switched on (``TRITON_INTERPRET=1``) before Triton is
imported, so ``test_kernels_in_the_interpreter`` runs this file again in a subprocess with it set;
there the kernel tests run, here they are skipped. The module is skipped where Triton is not
installed. On the CPU the backend must never be chosen.
"""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from timm_sortconv import sort_conv2d  # noqa: E402
from timm_sortconv.ops import triton_backend  # noqa: E402
from timm_sortconv.ops import backends  # noqa: E402
from timm_sortconv.ops.backends import resolve_backend  # noqa: E402
from timm_sortconv.ops.geometry import get_geometry  # noqa: E402
from timm_sortconv.ops.reference import sort_conv2d_reference  # noqa: E402

VARIANTS = [(s, o) for s in ("square", "polar") for o in ("ring", "global")]
VARIANT_IDS = [f"{s}-{o}" for s, o in VARIANTS]


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_in_the_interpreter's subprocess")


@pytest.mark.skipif(INTERPRETED, reason="this is that subprocess")
def test_kernels_in_the_interpreter():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "7 passed" in summary, summary  # every kernel test ran there, none was skipped


def randn(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def run(backend, x, weight, bias, *args):
    """A backend's output and (input, weight) gradients for a fixed output gradient, from its two kernels."""
    out = backend.forward(x, weight, bias, *args)
    grad_output = randn(*out.shape, seed=9, dtype=out.dtype)
    return (out, *backend.backward(grad_output, x, weight, *args, True, True))


@pytest.mark.parametrize("sampling,sorting", VARIANTS, ids=VARIANT_IDS)
@in_interpreter
def test_agrees_with_reference(sampling, sorting):
    # (k, stride, dilation, groups): every kernel size, both strides, dilations and group counts.
    for k, stride, dilation, groups in ((1, 1, 1, 1), (3, 2, 1, 2), (5, 1, 2, 1), (7, 1, 1, 2)):
        geometry = get_geometry(k, sampling, sorting)
        pad = k // 2 * dilation
        # An already padded input, as the backends receive it; blocks of 16 outputs span images.
        x = randn(2, 4, 5 + 2 * pad, 6 + 2 * pad)
        weight, bias = randn(6, 4 // groups, k, k, seed=1), randn(6, seed=2)
        args = (geometry, (stride, stride), (dilation, dilation), groups)
        fast = run(backends._BACKENDS["triton"], x, weight, bias, *args)
        reference = run(backends._BACKENDS["reference"], x, weight, bias, *args)
        for name, a, b in zip(("output", "grad input", "grad weight"), fast, reference):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}, k={k}: {m}")


@in_interpreter
def test_float32_forward():
    geometry = get_geometry(5, "polar", "ring")
    x, weight = randn(2, 3, 12, 12, dtype=torch.float32), randn(4, 3, 5, 5, seed=1, dtype=torch.float32)
    out = triton_backend.sort_conv2d_triton(x, weight, None, geometry, (1, 1), (1, 1), 1)
    reference = sort_conv2d_reference(x, weight, None, geometry, (1, 1), (1, 1), 1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@in_interpreter
def test_nan_stays_in_its_windows():
    geometry = get_geometry(3, "square", "global")
    x = randn(1, 1, 10, 10)
    x[0, 0, 4, 5] = float("nan")
    out = triton_backend.sort_conv2d_triton(x, randn(2, 1, 3, 3, seed=1), None, geometry, (1, 1), (1, 1), 1)
    nan_rows, nan_cols = torch.isnan(out[0, 0]).nonzero(as_tuple=True)
    # Output (i, j) reads input rows i..i+2 and columns j..j+2 of the (already padded) input.
    assert set(zip(nan_rows.tolist(), nan_cols.tolist())) == {(i, j) for i in (2, 3, 4) for j in (3, 4, 5)}


def test_never_chosen_for_cpu_tensors():
    geometry = get_geometry(3, "polar", "ring")
    args = (torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3), None, geometry, (1, 1), (1, 1), 1)
    assert not triton_backend.supports_triton(*args)
    assert resolve_backend("auto", *args).name != "triton"
    with pytest.raises(RuntimeError):
        sort_conv2d(torch.randn(1, 2, 8, 8), torch.randn(2, 2, 3, 3), padding=1, backend="triton")
