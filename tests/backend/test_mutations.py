"""Input mutations kept in inference graphs: taken out as writebacks, applied once a call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend.backend import StitchBackend
from stitch_backend.mutations import (UnsupportedMutation, Writeback, split_outputs,
                                      strip_input_mutations, write_back)

aten = torch.ops.aten


def _graph(fn, *inputs):
    return make_fx(fn)(*inputs)


def _counter_step(x, count, mean):
    """Shaped like AOTAutograd's functional graph with its mutations kept: new values
    computed first, copies into the inputs last."""
    new_count = aten.add.Tensor(count, 1)
    new_mean = aten.add.Tensor(aten.mul.Tensor(mean, 0.9), aten.mul.Tensor(x.mean(0), 0.1))
    out = aten.mul.Tensor(x, new_count)
    aten.copy_.default(count, new_count)
    aten.copy_.default(mean, new_mean)
    return (out,)


def test_trailing_copies_become_writebacks():
    x, count, mean = torch.randn(4, 3), torch.zeros(()), torch.randn(3)
    gm = _graph(_counter_step, x, count.clone(), mean.clone())
    functional, writebacks = strip_input_mutations(gm)
    assert writebacks == [Writeback(1, 1), Writeback(2, 2)]
    assert not [n for n in functional.graph.nodes if n.target is aten.copy_.default]
    assert [n for n in gm.graph.nodes if n.target is aten.copy_.default]  # gm untouched

    c1, m1 = count.clone(), mean.clone()
    expected = gm(x, c1, m1)                       # mutates c1, m1
    c2, m2 = count.clone(), mean.clone()
    outputs = functional(x, c2, m2)                # mutates nothing
    assert torch.equal(c2, count) and torch.equal(m2, mean)
    own, values = split_outputs(outputs, writebacks)
    assert isinstance(own, tuple) and len(own) == 1
    torch.testing.assert_close(own[0], expected[0], rtol=0, atol=0)
    write_back([c2, m2], values)
    assert torch.equal(c2, c1) and torch.equal(m2, m1)


def test_a_returned_copy_result_becomes_the_value_copied():
    """AOTAutograd returns ``copy_``'s result where the user's graph returns the mutated
    buffer (``self.steps += 1; return ..., self.steps``)."""
    def fn(x, steps):
        new = aten.add.Tensor(steps, 1)
        return (aten.mul.Tensor(x, 2), aten.copy_.default(steps, new))

    gm = _graph(fn, torch.randn(3), torch.zeros(()))
    functional, writebacks = strip_input_mutations(gm)
    steps = torch.zeros(())
    outputs = functional(torch.ones(3), steps)
    assert writebacks == [Writeback(1, 2)]
    assert len(outputs) == 3 and outputs[1].item() == 1.0 and outputs[2].item() == 1.0
    assert steps.item() == 0.0


def test_a_returned_overwritten_input_becomes_the_value_copied():
    """Training forward graphs return the mutated buffer itself after its copy."""
    graph = torch.fx.Graph()
    x, steps = graph.placeholder("x"), graph.placeholder("steps")
    new = graph.call_function(aten.add.Tensor, (steps, 1))
    graph.call_function(aten.copy_.default, (steps, new))
    graph.output((graph.call_function(aten.mul.Tensor, (x, 2)), steps))
    functional, writebacks = strip_input_mutations(torch.fx.GraphModule(torch.nn.Module(), graph))
    outputs = functional(torch.ones(3), torch.zeros(()))
    assert writebacks == [Writeback(1, 2)] and outputs[1].item() == 1.0


def test_a_graph_without_mutations_is_returned_as_is():
    gm = _graph(lambda x: (x * 2,), torch.randn(3))
    assert strip_input_mutations(gm) == (gm, [])


@pytest.mark.parametrize("fn, why", [
    (lambda x, y: (aten.copy_.default(aten.mul.Tensor(x, 2), y),), "not into a graph input"),
    (lambda x, y: (aten.mul.Tensor(aten.copy_.default(x, y), 2),), "is used"),
    (lambda x, y: (aten.add_.Tensor(x, y),), "in-graph mutation by aten.add_"),
])
def test_other_mutations_are_refused(fn, why):
    gm = _graph(fn, torch.randn(3), torch.randn(3))
    with pytest.raises(UnsupportedMutation, match=why):
        strip_input_mutations(gm)


def test_an_input_read_after_its_copy_is_refused():
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    graph.call_function(aten.copy_.default, (x, graph.call_function(aten.mul.Tensor, (y, 2))))
    graph.output((graph.call_function(aten.add.Tensor, (x, 1)),))
    with pytest.raises(UnsupportedMutation, match="input x is read by add.* after copy_.* overwrote it"):
        strip_input_mutations(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_write_back_keeps_copy_order_when_a_value_is_a_target():
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    write_back([a, b], [b, torch.tensor([5.0])])    # a takes b's old value, then b changes
    assert a.item() == 2.0 and b.item() == 5.0
    c = torch.zeros(2, dtype=torch.int64)
    write_back([c], [torch.tensor([1.5, 2.5])])      # copy_ semantics: cast
    assert c.tolist() == [1, 2]


def test_write_back_groups_by_dtype(monkeypatch):
    """One _foreach_copy_ per dtype: its fast path needs a single dtype."""
    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_",
                        lambda dst, src: (calls.append([t.dtype for t in dst]), real(dst, src)))
    mean, var, steps = torch.zeros(3), torch.ones(3), torch.zeros((), dtype=torch.int64)
    write_back([mean, steps, var],
               [torch.full((3,), 2.0), torch.tensor(7), torch.full((3,), 3.0)])
    assert sorted(calls, key=len) == [[torch.int64], [torch.float32, torch.float32]]
    assert mean.tolist() == [2.0] * 3 and var.tolist() == [3.0] * 3 and steps.item() == 7


def test_a_programs_write_back_plans_once_for_the_same_targets(monkeypatch):
    """``WriteBack`` groups the pairs on its first call and reuses that for the same
    target tensors (the same copies as ``write_back``); other targets are planned anew,
    and a value that is a target keeps the one-by-one order."""
    from stitch_backend import mutations

    plans = []
    real = mutations._groups
    monkeypatch.setattr(mutations, "_groups", lambda t, v: (plans.append(len(t)), real(t, v))[1])
    wb = mutations.WriteBack()
    mean, var, steps = torch.zeros(3), torch.ones(3), torch.zeros((), dtype=torch.int64)
    for k in range(3):
        wb([mean, steps, var], [torch.full((3,), 2.0 + k), torch.tensor(7 + k),
                                torch.full((3,), 3.0 + k)])
        assert mean.tolist() == [2.0 + k] * 3 and var.tolist() == [3.0 + k] * 3
        assert steps.item() == 7 + k
    assert plans == [3]
    a, b = torch.tensor([1.0]), torch.tensor([2.0])
    wb([a, b], [b, torch.tensor([5.0])])
    assert plans == [3, 2] and a.item() == 2.0 and b.item() == 5.0


class _Counting(torch.nn.Module):
    """A BatchNorm in training mode (running statistics, a step counter) and an in-place
    update of a user input."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x, acc):
        acc.add_(x.mean())
        return torch.relu(self.bn(self.conv(x))).sum((2, 3)) + acc


@pytest.mark.parametrize("options", [{"cpu_interpret": True}, {"codegen": False}])
def test_compiled_model_applies_each_mutation_once_per_call(options):
    torch.manual_seed(0)
    model = _Counting().train()
    ref = copy.deepcopy(model)
    backend = StitchBackend(options=options)
    compiled = torch.compile(model, backend=backend)
    acc, ref_acc = torch.zeros(()), torch.zeros(())
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, 8, 8)
            torch.testing.assert_close(compiled(x, acc), ref(x, ref_acc), atol=1e-5, rtol=1e-5)
    assert int(model.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 3
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(model.bn.running_var, ref.bn.running_var)
    torch.testing.assert_close(acc, ref_acc)
    # the interpreter's graph is raced in both layouts ('auto': few BatchNorm positions)
    assert len(backend.records) == (2 if "cpu_interpret" in options else 1)
    for rec in backend.records:
        assert any("mutated input(s)" in n and "written back" in n for n in rec.notes), rec.notes


def test_a_graph_the_backend_cannot_compile_keeps_its_mutations(monkeypatch):
    """When compiling fails the graph runs as traced, its in-graph copies included."""
    def broken(*args, **kwargs):
        raise RuntimeError("planner bug")

    monkeypatch.setattr(StitchBackend, "_compile_graph", broken)
    model = torch.nn.BatchNorm1d(3).train()
    backend = StitchBackend()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(5, 3))
    assert int(model.num_batches_tracked) == 1
    assert model.running_mean.abs().sum() > 0
    assert backend.failures and "planner bug" in backend.failures[0]
