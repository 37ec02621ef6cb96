"""A residual block's two branches (conv + BatchNorm on the main path, conv + BatchNorm
on the shortcut, their sum, relu) are planned as one region for the shortcut's
convolution and both BatchNorms, so split statistics normalise both branches in one last
pass (agents.planner._defer_norms, agents.split_stats). Planned, proposed and run
through the interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module
from tests.agents.test_pool_epilogue import _compiled, _node_ops
from tests.agents.test_stem_conv_alternative import _region_inputs
from tests.zoo import DownsampleBlock

BN = "aten._native_batch_norm_legit_functional.default"


def _fresh(model):
    twin = DownsampleBlock().train()
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("layout", [None, torch.channels_last], ids=["nchw", "nhwc"])
def test_the_main_branch_batchnorm_joins_the_shortcut_region(layout):
    torch.manual_seed(0)
    model = DownsampleBlock().train()
    ref = _fresh(model)
    x = torch.randn(4, 4, 16, 16)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    with torch.no_grad():
        expected = ref(x)
    rec, out = _compiled(model, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert out.stride() == expected.stride()
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(model.bn2, name), getattr(ref.bn2, name))
        torch.testing.assert_close(getattr(model.down[1], name), getattr(ref.down[1], name))
    convs = [r for r in rec.plan.regions if r.kind.value == "conv"]
    counts = [_node_ops(rec, r).count(BN) for r in convs]
    assert counts == [1, 0, 2], counts    # conv1+bn1; conv2 alone; shortcut + bn2 + bn_down


def test_split_statistics_normalise_both_branches_in_one_pass():
    torch.manual_seed(0)
    model = DownsampleBlock(4, 16).train()
    x = torch.randn(8, 4, 32, 32).contiguous(memory_format=torch.channels_last)
    rec, _ = _compiled(model, x)
    region = [r for r in rec.plan.regions if r.kind.value == "conv"][-1]
    cand = TemplateCoder().propose(subtask_for(rec.gm, region, "k"))
    splits = [a for a in cand.alternatives if "split" in a.name]
    assert splits, [a.name for a in cand.alternatives]
    nodes = {n.name: n for n in rec.gm.graph.nodes}
    raw = {nodes[n].args[0].name for n in region.nodes if str(nodes[n].target) == BN}
    assert len(raw) == 2
    for alt in splits:
        last = alt.stages[-1]
        # both normalisations, the sum and the relu in the last kernel, from the two
        # convolutions' outputs (no normalised tensor written in between)
        assert last.kernel is not None
        assert {"aten.sub.Tensor", "aten.add.Tensor", "aten.relu.default"} <= set(last.kernel.ops)
        assert raw <= set(last.region.inputs), last.region.inputs
    inputs = _region_inputs(rec, region)
    want = region_module(rec.gm, region)(*inputs)
    for alt in [cand, *cand.alternatives]:
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_batchnorm_read_elsewhere_too_stays():
    """The main branch's normalised value also returned: it is computed once where it
    is, not moved (the shortcut's region would then write it as well)."""

    class Both(DownsampleBlock):
        def forward(self, x):
            y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
            return F.relu(y + self.down(x)), y.sum(dim=(2, 3))

    torch.manual_seed(0)
    model = Both().train()
    rec, _ = _compiled(model, torch.randn(2, 4, 8, 8))
    convs = [r for r in rec.plan.regions if r.kind.value == "conv"]
    assert [_node_ops(rec, r).count(BN) for r in convs] == [1, 1, 1]


def test_a_batchnorm_the_next_convolution_reads_stays():
    """conv, BatchNorm, conv of the same shape, BatchNorm: the second convolution's
    region reads the first BatchNorm as its input, not in its epilogue, so it stays
    (moved, it would run before the library call, on ATen)."""

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False)
            self.b1, self.b2 = torch.nn.BatchNorm2d(8), torch.nn.BatchNorm2d(8)

        def forward(self, x):
            return self.b2(self.c2(self.b1(self.c1(x))))

    torch.manual_seed(0)
    rec, _ = _compiled(Chain().train(), torch.randn(2, 8, 8, 8))
    convs = [r for r in rec.plan.regions if r.kind.value == "conv"]
    assert [_node_ops(rec, r).count(BN) for r in convs] == [1, 1]
