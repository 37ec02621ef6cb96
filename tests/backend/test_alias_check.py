"""AOTAutograd's first-call aliasing mode is set aside while a Program verifies itself,
where the graph has no custom operator for it to check (stitch_backend.alias_check)."""

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from stitch_backend import alias_check
from stitch_backend.backend import StitchBackend

import torch._dynamo  # noqa: E402,F401  (runtime_wrappers imports circularly without it)
from torch._functorch._aot_autograd import runtime_wrappers  # noqa: E402

Mode = getattr(runtime_wrappers, alias_check.MODE_NAME, None)
if Mode is None:
    pytest.skip(f"this torch has no {alias_check.MODE_NAME}", allow_module_level=True)


@torch.library.custom_op("stitchtest::twice", mutates_args=())
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_twice.register_fake
def _(x):
    return torch.empty_like(x)


def _graph(fn, *args):
    return torch.fx.experimental.proxy_tensor.make_fx(fn)(*args)


def test_only_non_builtin_operators_count_as_custom():
    x = torch.randn(4)
    assert not alias_check.has_custom_ops(_graph(lambda t: torch.relu(t) + 1, x))
    assert alias_check.has_custom_ops(_graph(lambda t: _twice(t).relu(), x))


def test_the_mode_is_off_inside_the_block_and_back_after():
    with Mode() as mode:
        assert _get_current_dispatch_mode() is mode
        with alias_check.set_aside(True):
            assert _get_current_dispatch_mode() is None
            torch.ones(2).add(1)                          # no dispatch through it
        assert _get_current_dispatch_mode() is mode
        with alias_check.set_aside(False):                # a graph with a custom op
            assert _get_current_dispatch_mode() is mode


def test_another_innermost_mode_is_left_alone():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode(), Other() as other:
        with alias_check.set_aside(True):
            assert _get_current_dispatch_mode() is other


def _modes_seen_by_verification(monkeypatch, model, x):
    import stitch_backend.agents.verifier as verifier

    seen = []
    compare = verifier.compare

    def spy(*args, **kwargs):
        seen.append(type(_get_current_dispatch_mode()).__name__)
        return compare(*args, **kwargs)

    monkeypatch.setattr(verifier, "compare", spy)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False})
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    return seen


def test_a_first_call_verifies_without_the_mode(monkeypatch):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
    seen = _modes_seen_by_verification(monkeypatch, model, torch.randn(4, 16))
    assert seen and set(seen) == {"NoneType"}, seen


class _WithCustomOp(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.layer_norm(_twice(x).sigmoid() * 3.0, (16,))


def test_a_graph_with_a_custom_op_keeps_the_mode(monkeypatch):
    torch._dynamo.reset()
    seen = _modes_seen_by_verification(monkeypatch, _WithCustomOp(), torch.randn(4, 16))
    assert seen and set(seen) == {alias_check.MODE_NAME}, seen
