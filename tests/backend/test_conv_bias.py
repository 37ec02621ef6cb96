"""The convolution-bias pass: a cuDNN convolution's bias becomes an add the Planner fuses
into the epilogue; values stay eager's, grouped convolutions keep theirs."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from stitch_backend.backend import StitchBackend
from stitch_backend.conv_bias import split_conv_bias

aten = torch.ops.aten


class ConvBiasNet(nn.Module):
    """A biased conv -> BatchNorm -> ReLU, a biased conv -> ReLU, a biased depthwise conv."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 1)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv1(x)))
        return self.dw(torch.relu(self.conv2(y)))


def _run(model, x, **options):
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False, "layout_race": False,
                                     **options})
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    return backend


def _convs(gm):
    return [n for n in gm.graph.nodes if n.target is aten.convolution.default]


def test_biases_move_into_epilogues_with_eager_results():
    torch.manual_seed(0)
    backend = _run(ConvBiasNet().train(), torch.randn(2, 3, 16, 16))
    (rec,) = backend.records
    convs = _convs(rec.gm)
    assert [c.args[2] is None for c in convs] == [True, True, False]  # depthwise keeps it
    assert "2 convolution bias(es) added in the epilogue instead of ATen's separate pass " \
           "after cuDNN" in rec.notes
    for conv in convs[:2]:
        (add,) = conv.users
        assert add.target is aten.add.Tensor
        region = next(r for r in rec.plan.regions if conv.name in r.nodes)
        assert add.name in region.nodes, "the bias add joins its convolution's region"
    assert rec.plan.counts()["generated"] >= 2


def test_the_pass_keeps_values_and_leaves_the_input_module_alone():
    torch.manual_seed(0)
    backend = StitchBackend(options={"codegen": False})
    model = ConvBiasNet().eval()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(1, 3, 8, 8))
    gm = backend.records[0].gm
    before = str(gm.graph)
    new, moved = split_conv_bias(gm, "cpu")
    assert moved == 2 and str(gm.graph) == before and new is not gm
    gen = torch.Generator().manual_seed(1)
    args = [torch.rand(p.meta["val"].shape, generator=gen) + 0.5  # positive variances
            for p in gm.graph.find_nodes(op="placeholder")]
    for got, want in zip(new(*args), gm(*args)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    add = next(iter(_convs(new)[0].users))
    assert add.meta["val"].shape == _convs(gm)[0].meta["val"].shape


def test_no_bias_or_other_device_leaves_the_graph_as_it_is():
    backend = StitchBackend(options={"codegen": False})
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.ReLU()).eval()
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(1, 3, 8, 8))
    gm = backend.records[0].gm
    assert split_conv_bias(gm, "cpu") == (gm, 0)
    assert split_conv_bias(gm, "cuda") == (gm, 0)


def test_training_with_moved_biases_gives_eagers_gradients():
    """The forward graph's rewrite must keep what AOTAutograd saves for the backward."""
    torch.manual_seed(0)
    model = ConvBiasNet().train()
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False})
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 16, 16)
    compiled(x).square().mean().backward()
    reference(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    forward = next(r for r in backend.records if r.stage == "forward")
    assert any("convolution bias(es) added in the epilogue" in n for n in forward.notes)


def test_cpu_bf16_convolutions_keep_their_bias():
    """ATen's CPU convolution adds a bf16 bias inside the kernel (one rounding): split
    there, the product would round twice, unlike eager, so only fp32 ones move."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def fn(x, w, b):
        return aten.convolution.default(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)

    for dtype, moved in ((torch.float32, 1), (torch.bfloat16, 0), (torch.float16, 0)):
        args = [torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(4)]
        gm = make_fx(fn, tracing_mode="fake")(*[a.to(dtype) for a in args])
        assert split_conv_bias(gm, "cpu")[1] == moved, dtype
        assert split_conv_bias(gm, "cuda")[1] == 0      # values on the CPU are not cuDNN's
