"""The cuBLASLt alternative for gemm regions: proposed where one library call can do the
product and its activation, built as a stage module calling ``stitch_backend.lt_ops``,
the rest of the epilogue as kernels; its values checked on CPU with a stand-in for the
library call (the call itself is GPU-tested in tests/csrc/test_gemm_lt.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stitch_backend import lt_ops
from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module

aten = torch.ops.aten


class Linear(nn.Module):
    def __init__(self, act, bias=True, tail=True, keep_pre=False):
        super().__init__()
        self.lin = nn.Linear(32, 48, bias=bias)
        self.act, self.tail, self.keep_pre = act, tail, keep_pre

    def forward(self, x):
        y = self.lin(x)
        z = self.act(y)
        if self.tail:
            z = z * 2.0 + 1.0
        return (z, y) if self.keep_pre else z


def new_gelu(y):
    """GPT-2's tanh-GELU written out (L3 MiniGPT's MLP)."""
    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


def new_gelu_wrong_constant(y):
    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.05 * torch.pow(y, 3.0))))


def _gemm_candidates(model, x):
    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    (rec,) = backend.records
    out = []
    for region in rec.plan.regions:
        if region.kind.value == "gemm":
            cand = TemplateCoder(library_on_cpu=True).propose(subtask_for(rec.gm, region, "k"))
            out.append((rec, region, cand))
    return out


def _reference_matmul(a, b, bias, epilogue):
    y = a @ b + (bias if bias is not None else 0)
    return torch.relu(y) if epilogue.startswith("RELU") else F.gelu(y, approximate="tanh")


@pytest.mark.parametrize("act,bias,tail,epilogue,shape", [
    (torch.relu, True, True, "RELU_BIAS", (16, 32)),
    (lambda y: F.gelu(y, approximate="tanh"), True, False, "GELU_BIAS", (16, 32)),
    (torch.relu, False, True, "RELU", (16, 32)),
    (lambda y: F.gelu(y, approximate="tanh"), True, True, "GELU_BIAS", (2, 8, 32)),
    (new_gelu, True, False, "GELU_BIAS", (16, 32)),
    (new_gelu, True, True, "GELU_BIAS", (2, 8, 32)),
    (new_gelu, False, False, "GELU", (2, 8, 32)),
], ids=["relu_bias_tail", "tanh_gelu_bias", "relu_no_bias", "tanh_gelu_3d_input",
        "new_gelu_bias", "new_gelu_3d_input_tail", "new_gelu_no_bias_3d"])
def test_alternative_computes_the_region(monkeypatch, act, bias, tail, epilogue, shape):
    calls = []

    def stand_in(a, b, bias_, epi):
        calls.append(epi)
        return _reference_matmul(a, b, bias_, epi)
    monkeypatch.setattr(lt_ops, "_matmul", stand_in)
    torch.manual_seed(0)
    ((rec, region, cand),) = _gemm_candidates(Linear(act, bias, tail), torch.randn(shape))
    (alt,) = [a for a in cand.alternatives if a.name.endswith("_lt")]
    assert alt.source.startswith("// k_lt: cuBLASLt") and epilogue in alt.source.splitlines()[0]
    assert not alt.library      # a fused epilogue, not a race of two library calls
    library, *rest = alt.stages
    assert library.kernel is None and library.module is not None
    assert len([s for s in rest if s.kernel is not None]) == (1 if tail else 0)
    vals = {ph.name: ph.meta["val"] for ph in rec.gm.graph.find_nodes(op="placeholder")}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(vals[n].shape, generator=gen) for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    got = runner_for(alt, base=InterpretedRunner)(*inputs)
    assert calls == [epilogue]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", [
    Linear(F.gelu),                               # exact GELU: cuBLASLt's is the tanh form
    Linear(torch.relu, keep_pre=True),            # the product itself is an output too
    Linear(torch.sigmoid),                        # no such epilogue
    Linear(new_gelu, keep_pre=True),              # written-out GELU, the product an output
    Linear(new_gelu_wrong_constant),              # not GELU: 0.05 for 0.044715
], ids=["exact_gelu", "pre_activation_used", "sigmoid", "new_gelu_pre_used", "not_gelu"])
def test_no_alternative_where_one_call_cannot_do_it(model):
    for _, _, cand in _gemm_candidates(model, torch.randn(16, 32)):
        assert not [a for a in cand.alternatives if a.name.endswith("_lt")]


def test_not_proposed_for_cpu_graphs_by_default():
    backend = StitchBackend(options={"codegen": False})
    model = Linear(torch.relu)
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(16, 32))
    (rec,) = backend.records
    region = next(r for r in rec.plan.regions if r.kind.value == "gemm")
    cand = TemplateCoder().propose(subtask_for(rec.gm, region, "k"))
    assert not [a for a in cand.alternatives if a.name.endswith("_lt")]


@pytest.mark.nvcc
def test_alternative_with_epilogue_kernels_compiles_for_sm90a():
    from stitch_backend.toolchain import CompileJob, compile_many, csrc_dir

    ((_, _, cand),) = _gemm_candidates(Linear(torch.relu), torch.randn(16, 32))
    (alt,) = [a for a in cand.alternatives if a.name.endswith("_lt")]
    (result,) = compile_many([CompileJob(source=alt.source, name=alt.name, arch="sm_90a",
                                         include_dirs=(csrc_dir(),))])
    assert not isinstance(result, Exception), result


def _raced_on_cuda(model, x):
    """Compile ``model`` on CUDA, check three calls against eager; the library
    candidates' verifications, each correct."""
    backend = StitchBackend(options={"cache": False})
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    verified = [a for t in backend.trajectories for a in t.attempts
                if a.action == "verify" and a.candidate.name.endswith("_lt")]
    assert verified and all(a.verdict.correct for a in verified), [a.verdict for a in verified]
    return verified


@pytest.mark.gpu
def test_on_cuda_the_pipeline_races_it_and_stays_correct():
    """The library call, verified like any candidate; the report says which won."""
    torch.manual_seed(0)
    _raced_on_cuda(Linear(torch.relu).cuda(), torch.randn(512, 32, device="cuda"))


def test_a_library_winner_is_cached_and_warm_starts(monkeypatch, tmp_path):
    """The whole pipeline on CPU (cpu_interpret), the library call by a stand-in: the
    library-only candidate, verified, wins its region (CPU runs are not timed, so the
    race is scripted: the last verified candidate wins), is stored without a cubin, and
    a second compile loads it from the cache."""
    import copy

    import torch._dynamo

    from stitch_backend.agents import acceptance

    monkeypatch.setattr(acceptance, "_faster", lambda a, b: True)
    monkeypatch.setattr(TemplateCoder, "library_on_cpu", True)
    monkeypatch.setattr(lt_ops, "_matmul", _reference_matmul)
    torch.manual_seed(0)
    model = Linear(torch.relu, tail=False)
    reference = copy.deepcopy(model)
    x = torch.randn(64, 32)
    first, second = compile_twice(model, reference, x, {
        "cpu_interpret": True, "cache_dir": str(tmp_path), "eager_guard": False})
    gemm = [r for r in first.plan.regions if r.kind.value == "gemm"]
    assert gemm and gemm[0].backend == "kernel" and gemm[0].kernel.endswith("_lt"), gemm
    assert not first.cached and second.cached, second.notes
    assert [r.kernel for r in second.plan.regions] == [r.kernel for r in first.plan.regions]


def compile_twice(model, reference, x, options) -> tuple:
    """The records of two compiles of ``model`` with ``options`` (a fresh Dynamo each
    time: the second finds the first's cache), each called twice on ``x`` with
    ``reference``'s values."""
    import torch._dynamo

    records = []
    for _ in range(2):
        torch._dynamo.reset()
        backend = StitchBackend(options=options)
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
        (rec,) = backend.records
        records.append(rec)
    return tuple(records)


def _plain_reference(a, b, bias, epilogue):
    assert epilogue in ("BIAS", "DEFAULT") and (bias is not None) == (epilogue == "BIAS")
    return a @ b + (bias if bias is not None else 0)


@pytest.mark.parametrize("bias,shape,epilogue", [
    (True, (16, 32), "BIAS"), (False, (16, 32), "DEFAULT"), (True, (2, 8, 32), "BIAS"),
], ids=["addmm", "mm", "addmm_3d_input"])
def test_a_gemm_with_no_epilogue_is_one_library_call(monkeypatch, bias, shape, epilogue):
    """A Linear with nothing after it (or only the view back to 3-D) is no longer left
    to ATen unraced: its candidate is the cuBLASLt call alone, compiling nothing."""
    calls = []

    def stand_in(a, b, bias_, epi):
        calls.append(epi)
        return _plain_reference(a, b, bias_, epi)
    monkeypatch.setattr(lt_ops, "_matmul", stand_in)
    torch.manual_seed(0)
    model = Linear(lambda y: y, bias=bias, tail=False)
    ((rec, region, cand),) = _gemm_candidates(model, torch.randn(shape))
    assert cand.name == "k_lt" and cand.kernels == [] and cand.kernel is None and cand.library
    assert cand.source.startswith("// k_lt: cuBLASLt") and epilogue in cand.source
    vals = {ph.name: ph.meta["val"] for ph in rec.gm.graph.find_nodes(op="placeholder")}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(vals[n].shape, generator=gen) for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    got = runner_for(cand, base=InterpretedRunner)(*inputs)
    assert calls == [epilogue]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_plain_gemm_on_cpu_inputs_stays_on_aten_by_default():
    from stitch_backend.agents.coder import NoCandidate

    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(Linear(lambda y: y, tail=False), backend=backend)(torch.randn(16, 32))
    (rec,) = backend.records
    region = next(r for r in rec.plan.regions if r.kind.value == "gemm")
    with pytest.raises(NoCandidate, match="no epilogue"):
        TemplateCoder().propose(subtask_for(rec.gm, region, "k"))


def test_the_library_only_candidate_compiles_nothing(monkeypatch):
    """The agent loop sends no source of a kernel-less candidate to nvcc."""
    from stitch_backend import toolchain
    from stitch_backend.agents.loop import implement
    from stitch_backend.agents.state import Task

    monkeypatch.setattr(TemplateCoder, "library_on_cpu", True)
    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(Linear(lambda y: y, tail=False), backend=backend)(torch.randn(16, 32))
    (rec,) = backend.records
    jobs = []
    monkeypatch.setattr(toolchain, "compile_many", lambda js, max_workers=None, on_done=None: jobs.extend(js) or [])
    impl = implement(Task(graph="g", key="k", arch="sm_90a", device="cuda"), rec.gm, rec.plan,
                     arch="sm_90a")
    assert jobs == []
    (cand,) = impl.candidates.values()
    assert cand.name.endswith("_lt") and cand.cubin is None


@pytest.mark.gpu
def test_on_cuda_a_plain_linear_races_the_library_call_with_a_timed_algorithm():
    torch.manual_seed(0)
    _raced_on_cuda(Linear(lambda y: y, tail=False).cuda(), torch.randn(20, 32, device="cuda"))
    chosen = [algo for key, algo in lt_ops._algos.items() if key[2] == (20, 32)]
    assert chosen and all(0 <= algo < lt_ops.TUNE_ALGOS for algo in chosen)


class TransposedLinear(nn.Module):
    """A Linear over a transposed 3-D input, as multi-head attention's input projection
    runs it: mm, view, add of the bias row (not addmm), then the rest."""

    def __init__(self, act=None):
        super().__init__()
        self.lin, self.act = nn.Linear(32, 48), act

    def forward(self, x):
        y = self.lin(x.transpose(0, 1))
        y = self.act(y) if self.act is not None else y
        return y.unflatten(-1, (3, 16)).transpose(0, -2).contiguous()


@pytest.mark.parametrize("act,epilogue", [(None, "BIAS"), (torch.relu, "RELU_BIAS")],
                         ids=["bias_add", "bias_add_relu"])
def test_an_mm_then_a_bias_add_is_one_library_call(monkeypatch, act, epilogue):
    calls = []

    def stand_in(a, b, bias_, epi):
        calls.append(epi)
        y = a @ b + bias_
        return torch.relu(y) if epi.startswith("RELU") else y
    monkeypatch.setattr(lt_ops, "_matmul", stand_in)
    torch.manual_seed(0)
    ((rec, region, cand),) = _gemm_candidates(TransposedLinear(act), torch.randn(2, 8, 32))
    nodes = {n.name: n for n in rec.gm.graph.nodes}
    assert aten.mm.default in [nodes[n].target for n in region.nodes]
    (alt,) = [a for a in cand.alternatives if a.name.endswith("_lt")]
    assert f"with epilogue {epilogue} " in alt.source.splitlines()[0]
    library, *rest = alt.stages
    assert library.kernel is None and [s.kernel is not None for s in rest] == [True]
    vals = {n.name: n.meta.get("val") for n in rec.gm.graph.nodes}   # an input: a view
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(vals[n].shape, generator=gen) for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    got = runner_for(alt, base=InterpretedRunner)(*inputs)
    assert calls == [epilogue]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("library, eager_ms, accepted", [
    (True, 1.01, False),    # a library call 1% ahead of ATen's: a tie, ATen keeps it
    (True, 1.05, True),     # 5% ahead: beyond the margin
    (False, 1.01, True),    # a generated kernel needs only to be faster
])
def test_a_library_call_alone_replaces_atens_only_beyond_the_margin(library, eager_ms, accepted):
    """A candidate that is one library call (cuBLASLt against ATen's cuBLAS) must be
    LIBRARY_MARGIN faster than ATen's call; other candidates only faster."""
    from types import SimpleNamespace

    from stitch_backend.agents import acceptance
    from stitch_backend.agents.state import Candidate, Verdict

    assert acceptance.LIBRARY_MARGIN == 0.03

    class Timed:                      # the Verifier's answer: correct, timed
        def check(self, *args, **kwargs):
            return Verdict(ok=True, reason="correct", correct=True, candidate_ms=1.0,
                           eager_ms=eager_ms, clock="cuda-graph")

    runner = SimpleNamespace(poisoning=lambda: None)
    cand = Candidate(region_id=0, origin="template", name="k_lt", source="", library=library)
    step = SimpleNamespace(aten=lambda *a: a, region=SimpleNamespace(id=0))
    got, verdict = acceptance._judge(cand, step, [], [], Timed(), lambda c: runner)
    assert got is runner and verdict.ok is accepted
    if not accepted:
        assert "library call must be 3% faster" in verdict.reason, verdict.reason



class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _backward_record(model, x, backend):
    compiled = torch.compile(model, backend=backend)
    compiled(x).square().sum().backward()
    (rec,) = [r for r in backend.records if r.stage == "backward"]
    return rec


def test_a_linears_weight_and_bias_gradients_share_a_region_and_one_library_call(monkeypatch):
    """Backward reads the output gradient g for mm(t(g), x) and for sum(g, 0): the
    Planner puts the two in one gemm region (planner.bias_grad_pair), whose cuBLASLt
    alternative computes both in one BGRADB call; on the CPU with a stand-in for the
    library it matches the region as traced, and the step's gradients are eager's."""
    from stitch_backend.agents.planner import bias_grad_pair

    calls = []

    def stand_in(g, x):
        calls.append((tuple(g.shape), tuple(x.shape)))
        return g.t() @ x, g.sum(0)
    monkeypatch.setattr(lt_ops, "_bgrad", stand_in)
    torch.manual_seed(0)
    model, reference = TwoLinears(), TwoLinears()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(32, 8)
    rec = _backward_record(model, x, StitchBackend(options={"cpu_interpret": True,
                                                            "cache": False}))
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    nodes = {n.name: n for n in rec.gm.graph.nodes}
    paired = [r for r in rec.plan.regions
              if bias_grad_pair([nodes[n] for n in r.nodes]) is not None]
    assert len(paired) == 1 and paired[0].kind.value == "gemm", rec.plan.regions
    region = paired[0]
    cand = TemplateCoder(library_on_cpu=True).propose(subtask_for(rec.gm, region, "k"))
    (alt,) = [a for a in cand.alternatives if a.name == "k_bg"]
    assert alt.source.startswith("// k_bg: cuBLASLt mm with epilogue BGRADB") and not alt.kernels
    vals = {ph.name: ph.meta["val"] for ph in rec.gm.graph.find_nodes(op="placeholder")}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(vals[n].shape, generator=gen) for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    got = runner_for(alt, base=InterpretedRunner)(*inputs)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)
    assert calls and calls[-1] == ((32, 4), (32, 16))

    # at the ATen level: sum(g, 0) beside mm(t(g), x) pairs; a sum over dim 1, or of
    # another tensor, does not
    from torch.fx.experimental.proxy_tensor import make_fx

    g, x2 = torch.randn(32, 4), torch.randn(32, 16)
    for fn, pairs in ((lambda g, x: (torch.mm(g.t(), x), g.sum(0)), True),
                      (lambda g, x: (torch.mm(g.t(), x), g.sum(1)), False),
                      (lambda g, x: (torch.mm(g.t(), x), x.sum(0)), False),
                      (lambda g, x: (torch.mm(g.t(), x),
                                     torch.ops.aten.sum.dim_IntList(g, None)), False)):
        traced = make_fx(fn)(g, x2)
        ops = [n for n in traced.graph.nodes if n.op == "call_function"]
        assert (bias_grad_pair(ops) is not None) is pairs, traced.code


@pytest.mark.gpu
def test_on_cuda_a_training_step_races_the_bias_gradient_call_and_keeps_eagers_gradients():
    torch.manual_seed(0)
    model, reference = TwoLinears().cuda(), TwoLinears().cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(256, 8, device="cuda")
    backend = StitchBackend(options={"cache": False})
    _backward_record(model, x, backend)
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    verified = [a for t in backend.trajectories for a in t.attempts
                if a.action == "verify" and a.candidate.name.endswith("_bg")]
    assert verified and all(a.verdict.correct for a in verified), [a.verdict for a in verified]


def test_the_runtime_prebuild_looks_for_a_cublaslt_stage():
    """agents.loop starts the runtime's build beside the compiles only where a candidate
    (or an alternative) has a stage calling it."""
    import dataclasses

    from stitch_backend.agents.loop import _calls_cublaslt

    [(_, _, cand)] = _gemm_candidates(Linear(F.relu), torch.randn(8, 32))
    assert _calls_cublaslt(cand)
    assert not _calls_cublaslt(dataclasses.replace(cand, alternatives=[]))
