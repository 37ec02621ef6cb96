"""The Program's straight-line function: after verification a Program runs as one
generated function (ATen regions inlined, each kernel one call), rebuilt when a step
changes, with the step loop as the fallback."""

from __future__ import annotations

import pytest
import torch

from stitch_backend import program as program_mod
from stitch_backend.backend import StitchBackend

OPTIONS = {"cpu_interpret": True, "require_speedup": False}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.norm(self.lin(x))) * 0.5 + x.sin()


def _compiled(options=OPTIONS):
    torch.manual_seed(0)
    model = Net()
    backend = StitchBackend(options=options)
    return model, torch.compile(model, backend=backend), backend


def test_runs_straight_after_verification_and_rebuilds_when_a_step_changes():
    model, compiled, backend = _compiled()
    x = torch.randn(4, 8)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(compiled(x), want)         # verification: step loop
        (rec,) = backend.records
        program = rec.program
        assert program.generated_steps() and program._straight_fn is None
        torch.testing.assert_close(compiled(x), want)
        first = program._straight_fn
        assert first is not None and program.straight_error is None
        code = first.__self__.code
        assert "region_" in code                    # a kernel step is one call
        torch.testing.assert_close(compiled(x), want)
        assert program._straight_fn is first        # not rebuilt while nothing changed
        program.use_aten("test: every region back on ATen")
        torch.testing.assert_close(compiled(x), want)
        assert program._straight_fn is not first
        assert "region_" not in program._straight_fn.__self__.code   # all inlined now


def test_inputs_are_released_by_the_call():
    _, compiled, backend = _compiled()
    x = torch.randn(4, 8)
    with torch.no_grad():
        compiled(x)
        compiled(x)
        program = backend.records[0].program
        placeholders = [n for n in program._gm.graph.nodes if n.op == "placeholder"]
        boxed = [torch.randn(n.meta["val"].shape) for n in placeholders]
        (out,) = program(boxed)
    assert program._straight_fn is not None
    assert boxed == []           # taken and cleared, so inputs can die early
    assert out.shape == (4, 8)


def test_a_straight_line_that_cannot_be_built_falls_back_to_the_step_loop(monkeypatch):
    def broken(gm, steps):
        raise RuntimeError("no straight line today")

    monkeypatch.setattr(program_mod, "_straight_line", broken)
    model, compiled, backend = _compiled()
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x))
    program = backend.records[0].program
    assert program._straight_fn is None
    assert program.straight_error == "RuntimeError: no straight line today"
    assert ("runs as a step loop: its straight-line function could not be built "
            "(RuntimeError: no straight line today)") in backend.records[0].notes


def test_training_graphs_run_straight_and_match_eager_gradients():
    model, compiled, backend = _compiled({"codegen": False})
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(3):
        model.zero_grad()
        compiled(x).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for g, want in zip(got, (p.grad for p in model.parameters())):
        torch.testing.assert_close(g, want)
    assert all(r.program._straight_fn is not None for r in backend.records)
    assert {r.stage for r in backend.records} == {"forward", "backward"}


def test_aten_ops_are_called_through_their_cpp_entry():
    """The straight-line function calls each ATen overload's C++ entry (``_op``), not
    ``OpOverload.__call__`` (a Python frame an op), and computes what the model does,
    in training too (forward and backward)."""
    model, compiled, backend = _compiled({"codegen": False})
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        out = compiled(x)
        out.sum().backward()
    want = model(x)
    torch.testing.assert_close(out, want)
    for rec in backend.records:
        fn = rec.program._straight()
        names = fn.__func__.__globals__ if hasattr(fn, "__func__") else fn.__globals__
        targets = [v for k, v in names.items() if k.startswith("stitch_backend_program_aten_")]
        assert targets, rec.stage
        assert all(type(t).__name__ == "builtin_function_or_method" for t in targets)
        assert not any(isinstance(v, torch._ops.OpOverload) for v in names.values())
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    want.sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, 2 * p.grad)   # two compiled steps accumulated


@pytest.mark.parametrize("straight", [True, False], ids=["straight_line", "step_loop"])
def test_a_staged_region_frees_an_input_after_the_last_stage_that_reads_it(monkeypatch,
                                                                           straight):
    """``h`` is read only by the convolution, the first stage of its region: by the time
    the epilogue kernel runs (and allocates the region's output), nothing holds ``h``
    (the straight-line function and the step loop pass the region its inputs in a box
    it empties)."""
    import weakref

    monkeypatch.setattr(program_mod, "STRAIGHT_LINE", straight)

    from stitch_backend.kernels import StagedRunner

    class ConvNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 6, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.conv(x * 2.0 + 1.0)) * 0.5

    torch.manual_seed(0)
    model = ConvNet()
    backend = StitchBackend(options={**OPTIONS, "cache": False})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x))
        program = backend.records[0].program
        (staged,) = [s.fn for s in program.steps if isinstance(s.fn, StagedRunner)]
        assert len(staged.steps) >= 2
        seen = {}
        (r0, first), (r1, second) = staged.steps[0], staged.steps[1]

        def conv_stage(*args):
            seen["h"] = weakref.ref(args[0])
            return first(*args)

        def epilogue_stage(*args):
            seen["h alive at the epilogue"] = seen["h"]() is not None
            return second(*args)

        staged.steps[0], staged.steps[1] = (r0, conv_stage), (r1, epilogue_stage)
        torch.testing.assert_close(compiled(x), model(x))
    assert seen["h alive at the epilogue"] is False
