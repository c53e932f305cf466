"""The backend registry: what backend="auto" may pick, what a named backend must support, and the switch."""
import pytest
import torch

from timm_sortconv.ops import backends
from timm_sortconv.ops.backends import DISABLE_ENV, Backend, available_backends, register_backend, resolve_backend
from timm_sortconv.ops.functional import sort_conv2d
from timm_sortconv.ops.geometry import get_geometry


@pytest.fixture
def fake_backend():
    """A backend that claims every call and answers with ones, registered for one test only."""
    def register(auto):
        def forward(x, weight, bias, geometry, stride, dilation, groups, pad):
            return x.new_ones(x.shape[0], weight.shape[0], x.shape[2] - 2, x.shape[3] - 2)

        # first in auto's order: under TRITON_INTERPRET=1 the Triton backend takes CPU float16 too
        register_backend(Backend("fake", forward, lambda *args: (None, None), lambda *args: True, lambda: True,
                                 auto=auto), before=next(iter(backends._BACKENDS)))
    yield register
    backends._BACKENDS.pop("fake", None)


def _args():
    return torch.randn(1, 2, 8, 8), torch.randn(3, 2, 3, 3)


def test_auto_skips_a_backend_that_is_not_in_auto(fake_backend):
    fake_backend(auto=False)
    x, w = _args()
    # float16 on the CPU is taken by no real fast backend: "auto" would reach the fake one if it could.
    x, w = x.half(), w.half()
    out = sort_conv2d(x, w, padding=1, backend="auto")
    assert out.shape == (1, 3, 8, 8)
    torch.testing.assert_close(out, sort_conv2d(x, w, padding=1, backend="reference"))
    assert (sort_conv2d(x, w, padding=1, backend="fake") == 1).all()


def test_auto_takes_a_backend_that_is_in_auto(fake_backend):
    fake_backend(auto=True)
    x, w = _args()
    # float16 on the CPU is taken by no real fast backend, so "auto" reaches the fake one.
    x, w = x.half(), w.half()
    assert resolve_backend("auto", x, w, None, get_geometry(3), (1, 1), (1, 1), 1).name == "fake"
    assert (sort_conv2d(x, w, padding=1, backend="auto") == 1).all()


def test_the_disable_switch_turns_every_fast_backend_off(fake_backend, monkeypatch):
    fake_backend(auto=True)
    x, w = _args()
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert available_backends() == ["reference"]
    assert resolve_backend("auto", x, w, None, get_geometry(3), (1, 1), (1, 1), 1).name == "reference"
    with pytest.raises(RuntimeError, match=DISABLE_ENV):
        sort_conv2d(x, w, padding=1, backend="fake")
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert "fake" in available_backends()


def test_unknown_backend_names_the_accepted_ones():
    x, w = _args()
    with pytest.raises(ValueError, match="accepted: 'auto', 'reference'"):
        sort_conv2d(x, w, backend="fastest")


def test_the_environment_reader_answers_as_os_environ_get(monkeypatch):
    name = "TIMM_SORTCONV_TEST_READER"
    read = backends.environment_reader(name)
    monkeypatch.delenv(name, raising=False)
    assert read() is None
    for value in ("1", "", "avx2", "caf\u00e9"):
        monkeypatch.setenv(name, value)
        assert read() == value == __import__("os").environ.get(name)
    monkeypatch.delenv(name)
    assert read() is None


def test_the_disable_switch_set_after_a_call_takes_effect_at_the_next(fake_backend, monkeypatch):
    # (a kind of call's plan is looked up per call: the switch is part of its key)
    fake_backend(auto=True)
    x, w = (t.half() for t in _args())
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert (sort_conv2d(x, w, padding=1) == 1).all()
    monkeypatch.setenv(DISABLE_ENV, "1")
    torch.testing.assert_close(sort_conv2d(x, w, padding=1), sort_conv2d(x, w, padding=1, backend="reference"))
    monkeypatch.delenv(DISABLE_ENV)
    assert (sort_conv2d(x, w, padding=1) == 1).all()
