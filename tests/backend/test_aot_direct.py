"""An inference graph's Program called without AOTAutograd's runtime wrapper
(``stitch_backend.aot_direct``): only where nothing of the wrapper applies, with eager's
values, grad mode and autocast as the wrapper has them; every other graph keeps it, and
the report says which and why."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from stitch_backend import aot_direct
from stitch_backend.backend import StitchBackend

WITHOUT = "called without AOTAutograd's runtime wrapper"
THROUGH = "called through AOTAutograd's runtime wrapper"


def _compiled(fn, options=None):
    torch._dynamo.reset()
    backend = StitchBackend(options={"cache": False, **(options or {})})
    return backend, torch.compile(fn, backend=backend)


def _notes(backend) -> str:
    return "\n".join(n for rec in backend.records for n in rec.notes)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("options", [{}, {"cpu_interpret": True}], ids=["aten", "interpreted"])
def test_a_plain_inference_graph_is_called_directly(options, monkeypatch):
    calls = []
    real = aot_direct.DirectCall.__call__
    monkeypatch.setattr(aot_direct.DirectCall, "__call__",
                        lambda self, *a: calls.append(1) or real(self, *a))
    torch.manual_seed(0)
    model = Mlp().eval()
    backend, compiled = _compiled(model, options)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert WITHOUT in _notes(backend) and THROUGH not in _notes(backend)
    assert len(calls) == 3


def test_grad_mode_is_off_inside_a_direct_call():
    """An inference graph called with grad mode on (nothing requires grad): the
    Program runs with it off, as under the wrapper, and the result requires no grad."""
    seen = []

    def fn(x):
        return torch.sin(x) * 2

    backend, compiled = _compiled(fn)
    x = torch.randn(8)
    out = compiled(x)
    torch.testing.assert_close(out, fn(x))
    assert WITHOUT in _notes(backend) and not out.requires_grad
    direct = aot_direct.DirectCall(lambda args: seen.append(torch.is_grad_enabled()) or args)
    with torch.enable_grad():
        direct(x)
    assert seen == [False]


def test_autocast_is_off_inside_a_direct_call():
    seen = []
    direct = aot_direct.DirectCall(
        lambda args: seen.append(torch.is_autocast_enabled("cpu")) or args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct(torch.ones(2))
    direct(torch.ones(2))
    assert seen == [False, False]


def test_an_autocast_graph_gives_eagers_values_and_types():
    torch.manual_seed(0)
    model = Mlp().eval()
    backend, compiled = _compiled(model)
    x = torch.randn(4, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(x)
        got = compiled(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("what,wrapped", [
    ("returns_input_view", True), ("mutates_input", True),
    ("returns_input", False), ("same_tensor_twice", False)])
def test_graphs_that_need_the_wrapper_keep_it(what, wrapped):
    """An output that is a view of an input (the wrapper regenerates it from the input)
    and an input mutated (its copy back) keep the wrapper. An input returned as it is,
    and the same tensor passed twice, Dynamo handles itself (the graph returns only
    y * 2; it takes x once): those are called directly. Eager's values and aliasing in
    every case."""
    def fn(x, y):
        if what == "returns_input_view":
            return x.view(-1), y * 2
        if what == "returns_input":
            return x, y * 2
        if what == "mutates_input":
            x.add_(1)
            return y * 2
        return x * y + 1

    backend, compiled = _compiled(fn)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    args = (x, x) if what == "same_tensor_twice" else (x, y)
    reference = [a.clone() for a in args]
    with torch.no_grad():
        got = compiled(*args)
        want = fn(*reference) if what != "same_tensor_twice" else fn(reference[0], reference[0])
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w)
    if what == "mutates_input":
        torch.testing.assert_close(x, reference[0])
    if what == "returns_input_view":
        assert got[0]._base is x
    if what == "returns_input":
        assert got[0] is x
    notes = _notes(backend)
    assert (THROUGH in notes) == wrapped and (WITHOUT in notes) == (not wrapped), notes


def test_a_training_graph_keeps_the_wrapper():
    torch.manual_seed(0)
    model = Mlp().train()
    backend, compiled = _compiled(model)
    x = torch.randn(4, 16)
    compiled(x).sum().backward()
    assert model.a.weight.grad is not None
    notes = _notes(backend)
    assert WITHOUT not in notes and THROUGH not in notes


def test_a_graph_with_a_custom_op_keeps_the_wrapper():
    """The wrapper's first call checks that custom operators alias no input
    (``alias_check``): such a graph keeps it."""
    from tests.backend.test_alias_check import _twice

    backend, compiled = _compiled(lambda x: _twice(x).relu())
    x = torch.randn(8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), (x * 2).relu())
    notes = _notes(backend)
    assert THROUGH + ": custom operators" in notes and WITHOUT not in notes, notes
