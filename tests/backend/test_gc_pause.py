"""The garbage collector is paused while a graph compiles and while its first call
verifies, and left as it was after (also when compiling fails)."""

from __future__ import annotations

import gc

import pytest
import torch

from stitch_backend import gc_pause
from stitch_backend.backend import StitchBackend


def test_paused_restores_the_previous_state():
    assert gc.isenabled()
    with gc_pause.paused():
        assert not gc.isenabled()
        with gc_pause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()      # the inner block does not turn it back on early
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_pause.paused():
            pass
        assert not gc.isenabled()      # a user's own choice stays
    finally:
        gc.enable()


def test_paused_restores_after_an_exception():
    with pytest.raises(RuntimeError):
        with gc_pause.paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())


def test_compile_and_first_call_run_with_the_collector_paused(monkeypatch):
    seen: dict[str, bool] = {}
    original_compile = StitchBackend._compile_graph

    def compile_graph(self, *args, **kwargs):
        seen["compile"] = gc.isenabled()
        program = original_compile(self, *args, **kwargs)
        verify = program._verify

        def spy(prog, inputs):
            seen["verify"] = gc.isenabled()
            return verify(prog, inputs)

        program._verify = spy
        return program

    monkeypatch.setattr(StitchBackend, "_compile_graph", compile_graph)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False})
    model = _model()
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, model(x))
    assert seen == {"compile": False, "verify": False}
    assert gc.isenabled()


def test_a_failing_compile_leaves_the_collector_on(monkeypatch):
    def broken(self, *args, **kwargs):
        assert not gc.isenabled()
        raise RuntimeError("a backend bug")

    monkeypatch.setattr(StitchBackend, "_compile_graph", broken)
    backend = StitchBackend(options={"cache": False})
    model = _model()
    x = torch.randn(4, 8)
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(x)   # runs as traced, with a warning
        torch.testing.assert_close(out, model(x))
    assert backend.failures and gc.isenabled()
