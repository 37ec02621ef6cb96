"""The column- and staged-layout alternatives of a reduction that reads its rows
contiguously but writes along the rows (a softmax over the channels of a channels-last
value whose result goes back to NCHW): where they apply, that they are proposed beside
the template's kernel, compute the region's outputs (kernel IR interpreter on CPU) and
compile with nvcc."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.codegen.emit_reduction import emit_reduction, stores_across_rows
from stitch_backend.codegen.kernel_ir import Unsupported
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module

from .region_inputs import region_inputs


class DeconvSoftmax(nn.Module):
    """KernelBench L2 91's shape, smaller: a transposed convolution, a softmax over its
    channels, then a pointwise tail."""

    def __init__(self):
        super().__init__()
        self.conv = nn.ConvTranspose2d(8, 16, 4, stride=2, padding=1, output_padding=1)
        self.bias = nn.Parameter(torch.randn(16, 1, 1))

    def forward(self, x):
        x = torch.softmax(self.conv(x), dim=1)
        return torch.sigmoid((x + self.bias) * 2.0)


def _planned_region(make, pick, channels_last: bool = False):
    """(graph, region) of the one graph of the model ``make()`` gives with its input
    (seeded), planned on the CPU: the region ``pick`` selects. cpu_interpret turns on
    the channels-last pass (as on CUDA); codegen=False plans only."""
    backend = StitchBackend(options={"codegen": False, "cpu_interpret": channels_last,
                                     "channels_last": channels_last})
    torch.manual_seed(0)
    model, x = make()
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if pick(r)]
    return rec.gm, region


def _softmax_region(channels_last: bool):
    return _planned_region(lambda: (DeconvSoftmax(), torch.randn(2, 8, 16, 16)),
                           lambda r: "_softmax" in r.nodes, channels_last)


def test_channels_last_softmax_written_nchw_gets_a_column_alternative():
    gm, region = _softmax_region(channels_last=True)
    cand = TemplateCoder().propose(subtask_for(gm, region, "k"))
    assert cand.kernel.emitted.layout == "inner" and stores_across_rows(cand.kernel.ir)
    (col,) = [a for a in cand.alternatives if a.name.endswith("_col")]
    assert col.kernel.emitted.layout == "column"
    assert "column layout" in col.source and "column layout" not in cand.source
    (stg,) = [a for a in cand.alternatives if a.name.endswith("_stg")]
    assert stg.kernel.emitted.layout == "staged" and "staged layout" in stg.source
    assert "__shared__" in stg.source and "sfk_st0[" in stg.source
    inputs = region_inputs(gm, region)
    want = region_module(gm, region)(*inputs)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    for c in (cand, col, stg):
        got = runner_for(c, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            assert g.stride() == w.stride()
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


def test_rows_written_as_read_get_no_column_alternative():
    gm, region = _softmax_region(channels_last=False)
    cand = TemplateCoder().propose(subtask_for(gm, region, "k"))
    assert not stores_across_rows(cand.kernel.ir)
    assert not [a for a in cand.alternatives if a.name.endswith(("_col", "_stg"))]


def test_an_unknown_layout_is_refused():
    gm, region = _softmax_region(channels_last=True)
    cand = TemplateCoder().propose(subtask_for(gm, region, "k"))
    with pytest.raises(ValueError, match="unknown reduction layout"):
        emit_reduction(cand.kernel.ir, "diagonal")


def test_the_staged_layout_says_why_it_does_not_apply():
    """Rows written as read (NCHW in and out) are no case for it, and channels too many
    for a block's shared memory are refused with the reason."""
    from stitch_backend.codegen.emit_staged import STAGE_MAX_K, why_not_staged
    from stitch_backend.codegen.fused import generate
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    gm, region = _softmax_region(channels_last=False)
    cand = TemplateCoder().propose(subtask_for(gm, region, "k"))
    assert "not contiguous along the rows" in why_not_staged(cand.kernel.ir)
    wide = torch.randn(2, 3, 3, 2 * STAGE_MAX_K).permute(0, 3, 1, 2)   # NHWC, C > max
    traced = make_fx(lambda a: torch.softmax(a, 1).contiguous(),
                     decomposition_table=core_aten_decompositions(), tracing_mode="fake")(wide)
    kernel = generate(traced, "wide")
    assert stores_across_rows(kernel.ir)
    assert f"at most {STAGE_MAX_K}" in why_not_staged(kernel.ir)
    with pytest.raises(Unsupported, match="no staged layout"):
        generate(traced, "wide_stg", layout="staged")


@pytest.mark.nvcc
def test_every_layout_compiles_for_sm90a():
    from stitch_backend.toolchain import CompileError, CompileJob, compile_many

    gm, region = _softmax_region(channels_last=True)
    cand = TemplateCoder().propose(subtask_for(gm, region, "k"))
    alts = [a for a in cand.alternatives if a.name.endswith(("_col", "_stg"))]
    assert len(alts) == 2
    results = compile_many([CompileJob(c.source, c.name, "sm_90a") for c in (cand, *alts)])
    assert not [r for r in results if isinstance(r, CompileError)], results
    assert all(r.cubin[:4] == b"\x7fELF" for r in results)


class ConvBatchNorm(nn.Module):
    """ResNet18 layer2's epilogue, smaller batch of positions: a 3x3 convolution to
    ``channels`` channels, a training BatchNorm, ReLU."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(8, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _bn_region(channels: int, channels_last: bool):
    return _planned_region(lambda: (ConvBatchNorm(channels), torch.randn(2, 8, 14, 14)),
                           lambda r: r.kind.value == "conv", channels_last)


def test_a_column_reduction_over_few_rows_gets_a_narrow_launch_alternative():
    """A channels-last BatchNorm over 128 channels reduces them as columns, eight a block:
    16 blocks for 132 SMs. The Coder offers the candidate again with that kernel
    launched ``narrow`` (one channel a block, 128 blocks; same source but its name), which
    computes the region's outputs; the Verifier keeps the faster."""
    gm, region = _bn_region(128, channels_last=True)
    cand = TemplateCoder().propose(subtask_for(gm, region, "bn_region"))
    (nrw,) = [a for a in cand.alternatives if a.name == "bn_region_nrw"]
    # the statistics and normalisation (a column kernel), then the conversion back to
    # NCHW at the graph's output (a tiled kernel, the same object in both)
    base = [s.kernel for s in cand.stages if s.kernel is not None]
    assert [k.emitted.layout for k in base] == ["column", "tiled"]
    assert not any(k.narrow for k in base)
    narrow = [s.kernel for s in nrw.stages if s.kernel is not None]
    assert narrow[1] is base[1] and narrow[0].narrow and narrow[0].entry.endswith("_nrw")
    positions = 2 * 14 * 14
    assert base[0].launch_shape(128, positions)[0] == 16
    blocks, threads, log2_tk = narrow[0].launch_shape(128, positions)
    assert blocks == 128 and threads >> log2_tk == 1
    assert narrow[0].source.replace(narrow[0].entry, "E") == base[0].source.replace(
        base[0].entry, "E")
    inputs = region_inputs(gm, region)
    want = region_module(gm, region)(*inputs)
    got = runner_for(nrw, base=InterpretedRunner)(*inputs)
    for g, w in zip(got, want):
        assert g.stride() == w.stride()
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_no_narrow_alternative_where_the_template_fills_the_gpu():
    """Channels enough for eight a block on every SM, or rows read contiguously (NCHW:
    the inner layout), leave the template's launch alone."""
    for channels, channels_last in ((1280, True), (128, False)):
        gm, region = _bn_region(channels, channels_last)
        cand = TemplateCoder().propose(subtask_for(gm, region, "k"))
        assert not [a for a in cand.alternatives if a.name.endswith("_nrw")], channels


class GroupNormLogSumExp(nn.Module):
    """KernelBench L2 92's shape, smaller: a convolution, a group norm, tanh, hardswish, a
    residual add and a logsumexp over the 64 channels (a column reduction)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 3)
        self.norm = nn.GroupNorm(16, 64)

    def forward(self, x):
        y = self.conv(x)
        z = y + F.hardswish(torch.tanh(self.norm(y)))
        return torch.logsumexp(z, dim=1, keepdim=True)


def _lse_region():
    return _planned_region(lambda: (GroupNormLogSumExp(), torch.randn(2, 3, 14, 14)),
                           lambda r: "native_group_norm" in r.nodes)


def test_a_column_reduction_over_short_rows_gets_a_lean_launch_alternative(monkeypatch):
    """The logsumexp over 64 channels of 288 positions (NCHW: a column reduction; rows in
    plenty for a GPU of 8 SMs) launches 16 threads a row (4 values each); the Coder
    offers the same kernels launched ``lean`` (LEAN_CHUNKS values a thread: 4 threads a
    row) for the template and for the split-statistics alternative whose last stage it
    is. Only the launch and the names differ, and each computes the region's outputs."""
    from stitch_backend.codegen.fused import LEAN_CHUNKS, column_shape

    gm, region = _lse_region()
    cand = TemplateCoder(sm_count=8).propose(subtask_for(gm, region, "k"))
    by_name = {a.name: a for a in cand.alternatives}
    assert {"k_ln", "k_split1p_ln"} <= set(by_name)
    inputs = region_inputs(gm, region)
    want = region_module(gm, region)(*inputs)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    for base, lean in ((cand, by_name["k_ln"]), (by_name["k_split1p"], by_name["k_split1p_ln"])):
        old = [s.kernel for s in base.stages if s.kernel is not None]
        new = [s.kernel for s in lean.stages if s.kernel is not None]
        changed = [(o, n) for o, n in zip(old, new) if n is not o]
        assert changed and all(o.emitted.layout == "column" for o, _ in changed)
        for o, n in changed:
            assert n.lean and not o.lean and n.entry == f"{o.entry}_ln"
            assert n.source.replace(n.entry, "E") == o.source.replace(o.entry, "E")
            rows = 2 * 12 * 12
            assert o.launch_shape(rows, 64)[1:] == (512, 4)          # 32 rows x 16
            assert n.launch_shape(rows, 64)[1:] == (128, 2)          # 32 rows x 4
        got = runner_for(lean, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # the launch rule: 4 values a thread, or LEAN_CHUNKS; the same where the cap binds
    assert column_shape(100_000, 64, 132) == (32, 16)
    assert column_shape(100_000, 64, 132, lean=True) == (32, 64 // LEAN_CHUNKS)
    assert column_shape(100_000, 4096, 132) == column_shape(100_000, 4096, 132, lean=True)
    # rows too few for 32 a block on each of 132 SMs, or the option off: none
    for coder in (TemplateCoder(), TemplateCoder(sm_count=8)):
        if coder.sm_count == 8:
            monkeypatch.setattr(TemplateCoder, "lean_columns", False)
        cand = coder.propose(subtask_for(gm, region, "k"))
        assert not [a for a in cand.alternatives if a.name.endswith("_ln")]


def test_no_lean_alternative_without_a_column_reduction():
    """An NCHW BatchNorm reduces contiguous rows (the inner layout): nothing to launch lean."""
    gm, region = _bn_region(128, channels_last=False)
    cand = TemplateCoder().propose(subtask_for(gm, region, "k"))
    assert not any(s.kernel.emitted.layout == "column" for s in cand.stages or [cand]
                   if getattr(s, "kernel", None) is not None)
    assert not [a for a in cand.alternatives if a.name.endswith("_ln")]


@pytest.mark.nvcc
def test_the_lean_alternatives_compile_for_sm90a():
    from stitch_backend.toolchain import CompileError, CompileJob, compile_many

    gm, region = _lse_region()
    cand = TemplateCoder(sm_count=8).propose(subtask_for(gm, region, "k"))
    lean = [a for a in cand.alternatives if a.name.endswith("_ln")]
    assert len(lean) == 2
    results = compile_many([CompileJob(c.source, c.name, "sm_90a") for c in lean])
    assert not [r for r in results if isinstance(r, CompileError)], results
