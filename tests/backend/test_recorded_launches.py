"""Warm start from stored launches: a kernel's verified launch layouts survive the trip
through the manifest, a GPU warm start rebuilds every candidate (stages included) from
the entry alone, without the Coder, and a layout that was not recorded regenerates."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from torch.fx.interpreter import Interpreter

from stitch_backend import artifacts
from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.loop import implement
from stitch_backend.agents.state import Task
from stitch_backend.backend import StitchBackend
from stitch_backend.cache import Store
from stitch_backend.codegen import generate
from stitch_backend.recorded import RecordedKernel, kernel_record
from tests.zoo import zoo


def _same_launch(a, b):
    assert (a.grid, a.block, a.shared_mem) == (b.grid, b.block, b.shared_mem)
    assert len(a.args) == len(b.args)
    ints = lambda plan: [x for x in plan.args if isinstance(x, int) and x < 1 << 32]
    assert ints(a) == ints(b)  # size arguments and log2_tk (pointers are large)
    assert [(o.shape, o.stride(), o.dtype) for o in a.outputs] == [
        (o.shape, o.stride(), o.dtype) for o in b.outputs]
    assert [(t.shape, t.dtype) for t in a.scratch] == [(t.shape, t.dtype) for t in b.scratch]


def test_recorded_kernel_launches_as_the_generated_one():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: torch.softmax(x * 2, -1), tracing_mode="fake")(
        torch.randn(64, 48))
    kernel = generate(gm, "rec")
    x = torch.randn(64, 48)
    kernel.prepare([x])
    record = json.loads(json.dumps(kernel_record(kernel)))     # through the manifest
    calls = []
    recorded = RecordedKernel(record, lambda: calls.append(1) or kernel)
    assert (recorded.entry, recorded.signature) == (kernel.entry, kernel.signature)
    y = torch.randn(64, 48)
    _same_launch(recorded.prepare([y]), kernel.prepare([y]))
    assert not calls
    with pytest.raises(ValueError, match="strides"):    # not recorded: regenerated, checked
        recorded.prepare([torch.randn(48, 64).t()])
    assert calls == [1]
    # a launch flag the runner reads (a cluster kernel launched resident) is recorded too;
    # a record from before the flag launches as the kernels then did
    assert recorded.resident is False
    resident = json.loads(json.dumps(kernel_record(dataclasses.replace(kernel, resident=True))))
    assert RecordedKernel(resident, lambda: kernel).resident is True
    del resident["resident"]
    assert RecordedKernel(resident, lambda: kernel).resident is False


def test_recorded_kernel_refuses_a_kernel_regenerated_differently():
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x: x.relu(), tracing_mode="fake")(torch.randn(8))
    kernel = generate(gm, "one")
    kernel.prepare([torch.randn(8)])
    recorded = RecordedKernel(kernel_record(kernel), lambda: kernel.renamed("other"))
    with pytest.raises(ValueError, match="regenerated as other"):
        recorded.prepare([torch.randn(9)])


class _StubRunner:
    """Stands in for KernelRunner (no GPU): keeps what warm start hands it."""

    def __init__(self, candidate, kernel=None, module=None):
        self.candidate, self.kernel = candidate, kernel or candidate.kernel


def _graph(name):
    cls, make = zoo()[name]
    torch.manual_seed(0)
    model, inputs = cls().eval(), make(4)
    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(model, backend=backend)(*inputs)
    (rec,) = backend.records
    return rec


def _values(gm):
    gen = torch.Generator().manual_seed(0)
    env = {}

    class Recorder(Interpreter):
        def run_node(self, n):
            env[n.name] = super().run_node(n)
            return env[n.name]

    args = [torch.randn(ph.meta["val"].shape, generator=gen).to(ph.meta["val"].dtype)
            for ph in gm.graph.find_nodes(op="placeholder")]
    Recorder(gm).run(*args)
    return env


@pytest.mark.parametrize("name", ["transformer_block", "residual_block", "norm_zoo"])
def test_gpu_warm_start_needs_no_coder(tmp_path, monkeypatch, name):
    rec = _graph(name)
    impl = implement(Task("g", "k", "sm_90a", "cuda"), rec.gm, rec.plan, arch="sm_90a",
                     compile=False)
    assert impl.candidates
    env = _values(rec.gm)
    want = {}
    for rid, cand in impl.candidates.items():          # "verification": one launch each
        cand.cubin = b"\x7fELF stand-in"
        steps = cand.stages or [types.SimpleNamespace(region=rec.plan.regions[rid],
                                                      kernel=cand.kernel)]
        for st in steps:
            if st.kernel is not None:
                inputs = [env[n] for n in st.region.inputs]
                want[st.kernel.entry] = (inputs, st.kernel.prepare(inputs))
        rec.plan.regions[rid].backend = "kernel"
    program = types.SimpleNamespace(plan=rec.plan, step_of=lambda rid: types.SimpleNamespace(
        fn=types.SimpleNamespace(candidate=impl.candidates[rid])))
    manifest, blobs = artifacts.manifest_of(program, rec, impl.candidates)
    store = Store(tmp_path)
    entry = store.put("ab" * 32, json.loads(json.dumps(manifest)), blobs)

    monkeypatch.setattr(TemplateCoder, "propose", lambda *a: pytest.fail("the Coder ran"))
    warm = artifacts.warm_start(store.get(entry.key), rec.gm, rec.plan, task_graph="g",
                                sm_count=132, base=_StubRunner)
    assert warm is not None and set(warm.runners) == set(impl.candidates)
    seen = 0
    for rid, runner in warm.runners.items():
        cand, got = impl.candidates[rid], runner.candidate
        assert (got.name, got.cubin) == (cand.name, cand.cubin)
        assert (got.stages is None) == (cand.stages is None)
        steps = got.stages or [types.SimpleNamespace(kernel=got.kernel, region=None)]
        for i, st in enumerate(steps):
            if cand.stages is not None:
                assert (st.region.nodes, st.region.inputs, st.region.outputs) == (
                    cand.stages[i].region.nodes, cand.stages[i].region.inputs,
                    cand.stages[i].region.outputs)
                assert (st.kernel is None) == (cand.stages[i].kernel is None)
            if st.kernel is not None:
                inputs, plan = want[st.kernel.entry]
                _same_launch(st.kernel.prepare(inputs), plan)
                seen += 1
        assert got.region_outputs == cand.region_outputs
    assert seen == len(want)
