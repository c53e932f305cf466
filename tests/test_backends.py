"""The backend registry: what backend="auto" may pick, and what a named backend must support."""
import pytest
import torch

from timm_sortconv.ops import backends
from timm_sortconv.ops.backends import Backend, register_backend, resolve_backend
from timm_sortconv.ops.functional import sort_conv2d
from timm_sortconv.ops.geometry import get_geometry


@pytest.fixture
def fake_backend():
    """A backend that claims every call and answers with zeros, registered for one test only."""
    def register(auto):
        register_backend(Backend("fake", lambda x, w, *rest: torch.zeros(()), lambda *args: True, lambda: True,
                                 auto=auto))
    yield register
    backends._BACKENDS.pop("fake", None)


def _args():
    return torch.randn(1, 2, 8, 8), torch.randn(3, 2, 3, 3)


def test_auto_skips_a_backend_that_is_not_in_auto(fake_backend):
    fake_backend(auto=False)
    x, w = _args()
    # bfloat16 on the CPU is taken by no real fast backend: "auto" would reach the fake one if it could.
    x, w = x.bfloat16(), w.bfloat16()
    out = sort_conv2d(x, w, padding=1, backend="auto")
    assert out.shape == (1, 3, 8, 8)
    torch.testing.assert_close(out, sort_conv2d(x, w, padding=1, backend="reference"))
    assert sort_conv2d(x, w, padding=1, backend="fake").dim() == 0


def test_auto_takes_a_backend_that_is_in_auto(fake_backend):
    fake_backend(auto=True)
    x, w = _args()
    # bfloat16 on the CPU is taken by no real fast backend, so "auto" reaches the fake one.
    x, w = x.bfloat16(), w.bfloat16()
    assert resolve_backend("auto", x, w, None, get_geometry(3), (1, 1), (1, 1), 1).name == "fake"
    assert sort_conv2d(x, w, padding=1, backend="auto").dim() == 0


def test_triton_is_opt_in_for_auto(monkeypatch):
    monkeypatch.delenv("TIMM_SORTCONV_TRITON_AUTO", raising=False)
    if "triton" not in backends._BACKENDS:
        pytest.skip("the Triton backend is not registered (no triton package)")
    assert backends._BACKENDS["triton"].auto is False
