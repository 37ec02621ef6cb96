"""Plain reductions over few long rows split across the GPU (``agents.split_reduce``):
where the alternative applies, its stages, that it computes the region's outputs (kernel
IR interpreter on CPU), and that its kernels compile."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from stitch_backend import toolchain
from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module

from .test_split_stats import _graph, _values


class Frobenius(nn.Module):
    """L1 37's shape, smaller: one row, then the value divided by it."""

    def forward(self, x):
        return x / torch.norm(x, p="fro")


class RowStats(nn.Module):
    """A mean and a maximum over the trailing dims of 4 rows, each read back by a
    pointwise op (two regions)."""

    def forward(self, x):
        return x - x.mean(dim=(1, 2), keepdim=True) + x.amax(dim=(1, 2), keepdim=True)


class L1Rows(nn.Module):
    def forward(self, x):
        return x / torch.linalg.vector_norm(x, ord=1, dim=-1, keepdim=True)


class MaxNormRows(nn.Module):
    def forward(self, x):
        return x / torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True)


class LeadingSum(nn.Module):
    def forward(self, x):
        return x * x.sum(0, keepdim=True)


def _alternatives(model, shape):
    rec = _graph(model, torch.randn(*shape))
    env = _values(rec.gm)
    found = []
    for region in rec.plan.regions:
        cand = TemplateCoder().propose(subtask_for(rec.gm, region, f"k{region.id}"))
        inputs = [env[n] for n in region.inputs]
        found.append((cand, inputs, region_module(rec.gm, region)(*inputs)))
    return found


def _split(cand):
    return [a for a in cand.alternatives if a.name.endswith("_split")]


@pytest.mark.parametrize("model,shape,n_regions", [
    (Frobenius(), (2, 64, 64, 64), 1), (RowStats(), (4, 64, 512), 2),
    (L1Rows(), (3, 65536), 1)], ids=["frobenius", "mean_amax", "l1_norm"])
def test_a_reduction_to_few_rows_gets_a_split_alternative_with_the_regions_values(
        model, shape, n_regions):
    found = _alternatives(model, shape)
    assert len(found) == n_regions
    for cand, inputs, want in found:
        (split,) = _split(cand)
        # no single-pass variant: it differs only where a norm splits
        assert not any(a.name.endswith("_split1p") for a in cand.alternatives)
        kernels = split.kernels
        # partial results over (rows, groups, L), each row's combination, the division
        assert len(kernels) == 3 == len(split.stages)
        assert [k.kind for k in kernels] == ["reduction", "reduction", "pointwise"]
        got = runner_for(split, base=InterpretedRunner)(*inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_the_partial_results_give_every_sm_work():
    """One row of 524288 elements: 512 partial results of 1024 (about four rows an SM on
    132 SMs), where the template's kernel has one block for the whole row."""
    ((cand, _, _),) = _alternatives(Frobenius(), (2, 64, 64, 64))
    (split,) = _split(cand)
    rows = [_rows(k) for k in split.kernels[:2]]
    assert rows == [512, 1]
    (template,) = cand.kernels
    assert template.kind == "reduction"
    assert _rows(template) == 1


def _rows(kernel) -> int:
    return math.prod(int(e) for e in kernel.ir.domain.row_extents)


@pytest.mark.parametrize("model,shape", [
    (MaxNormRows(), (3, 65536)),      # an order the split does not reproduce
    (LeadingSum(), (65536, 3)),       # reduced dims not trailing
    (RowStats(), (512, 8, 64))],      # rows enough for one kernel
    ids=["inf_norm", "leading_dims", "many_rows"])
def test_no_split_where_it_does_not_apply(model, shape):
    for cand, _, _ in _alternatives(model, shape):
        assert not _split(cand), [a.name for a in cand.alternatives]


@pytest.mark.nvcc
def test_the_split_kernels_compile_for_sm90a():
    units = []
    for model, shape in ((Frobenius(), (2, 64, 64, 64)), (RowStats(), (4, 64, 512)),
                         (L1Rows(), (3, 65536))):
        for cand, _, _ in _alternatives(model, shape):
            (split,) = _split(cand)
            units.append(split.kernels)
    jobs = [toolchain.CompileJob("\n".join(k.source for k in unit), f"split_reduce{i}", "sm_90a")
            for i, unit in enumerate(units)]
    for unit, res in zip(units, toolchain.compile_many(jobs, max_workers=2)):
        assert not isinstance(res, toolchain.CompileError), str(res)
        for k in unit:
            assert k.entry.encode() in res.cubin


@pytest.mark.gpu
def test_the_frobenius_split_verifies_and_runs_on_the_gpu():
    """L1 37's region at 8.4M elements: the split alternative passes the Verifier, runs in
    place of the template's one-block kernel (about 20x slower here), and the compiled
    model gives eager's result."""
    from stitch_backend.backend import StitchBackend

    torch.manual_seed(0)
    backend = StitchBackend(options={"cache": False})
    x = torch.randn(8, 64, 128, 128, device="cuda")
    with torch.no_grad():
        got = torch.compile(Frobenius(), backend=backend)(x)
    torch.testing.assert_close(got, Frobenius()(x), rtol=1e-4, atol=1e-6)
    verified = {a.candidate.name: a.verdict.ok for t in backend.trajectories
                for a in t.attempts if a.action == "verify" and "_split" in a.candidate.name}
    assert verified and all(verified.values()), verified
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if r.kind.value == "fused"]
    assert region.backend == "kernel" and region.kernel.endswith("_split"), \
        (region.backend, region.kernel, region.reason)
