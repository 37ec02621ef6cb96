"""The generated depthwise convolution: proposed as an alternative for a conv region
whose convolution has one filter per channel (NCHW, static sizes), the same epilogue
stages after it; its source compiles with nvcc, its values are checked on the CPU
through the interpreter (torch's conv2d), and its CUDA path in tests/codegen/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend import toolchain
from stitch_backend.agents.coder import TemplateCoder
from stitch_backend.agents.state import subtask_for
from stitch_backend.backend import StitchBackend
from stitch_backend.codegen.depthwise import DepthwiseKernel, depthwise_spec, generate_depthwise
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module

aten = torch.ops.aten


class DepthwiseBlock(nn.Module):
    def __init__(self, channels=6, kernel=3, stride=1, bias=False):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel, stride, kernel // 2,
                              groups=channels, bias=bias)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _conv_candidate(model, x):
    backend = StitchBackend(options={"codegen": False})
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if r.kind.value == "conv"]
    return rec, region, TemplateCoder().propose(subtask_for(rec.gm, region, "k"))


@pytest.mark.parametrize("kernel,stride,bias", [(3, 1, False), (3, 2, True), (5, 2, False)],
                         ids=["3x3", "3x3_stride2_bias", "5x5_stride2"])
def test_alternative_computes_the_region(kernel, stride, bias):
    torch.manual_seed(0)
    model = DepthwiseBlock(6, kernel, stride, bias).train()
    rec, region, cand = _conv_candidate(model, torch.randn(2, 6, 9, 11))
    (alt,) = [a for a in cand.alternatives if a.name.endswith("_dw")]
    head, *epilogue = alt.stages
    assert isinstance(head.kernel, DepthwiseKernel) and epilogue
    assert [s.kernel for s in epilogue] == [s.kernel for s in cand.stages[1:]]
    vals = {ph.name: ph.meta["val"] for ph in rec.gm.graph.find_nodes(op="placeholder")}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(vals[n].shape, generator=gen) if vals[n].is_floating_point()
              else torch.zeros(vals[n].shape, dtype=vals[n].dtype) for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    got = runner_for(alt, base=InterpretedRunner)(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_not_proposed_for_other_convolutions():
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
    grouped = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1, groups=3), nn.BatchNorm2d(6), nn.ReLU())
    for model in (dense, grouped):
        _, _, cand = _conv_candidate(model.train(), torch.randn(2, 6, 9, 11))
        assert not [a for a in cand.alternatives if a.name.endswith("_dw")]


def _spec(channels, kernel, stride, padding, dilation, bias, dtype, layout=None):
    x = torch.randn(2, channels, 9, 11, dtype=dtype)
    if layout is not None:
        x = x.contiguous(memory_format=layout)
    args = [x, torch.randn(channels, 1, kernel, kernel, dtype=dtype)]
    if bias:
        args.append(torch.randn(channels, dtype=dtype))

    def conv(x, w, *b):
        return aten.convolution(x, w, b[0] if b else None, [stride] * 2, [padding] * 2,
                                [dilation] * 2, False, [0, 0], channels)
    gm = make_fx(conv, tracing_mode="fake")(*args)
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    return depthwise_spec(node), args


@pytest.mark.nvcc
def test_specs_and_sources_compile_for_sm90a():
    """fp32/fp16/bf16, strides, padding, dilation and bias: every source compiles; the
    launch covers the output; channels-last inputs are not taken."""
    configs = [(8, 3, 1, 1, 1, False, torch.float32), (6, 3, 2, 1, 1, True, torch.float32),
               (5, 5, 2, 2, 1, False, torch.float16), (4, 3, 1, 2, 2, True, torch.bfloat16)]
    sources = []
    for i, (c, k, s, p, d, b, dt) in enumerate(configs):
        spec, args = _spec(c, k, s, p, d, b, dt)
        assert spec is not None and spec.bias == b and spec.dtype == dt
        kern = generate_depthwise(spec, f"dw_case{i}", list(range(len(args))))
        out = kern.interpret(args)[0]
        want = torch.nn.functional.conv2d(args[0].float(), args[1].float(),
                                          args[2].float() if b else None, s, p, d, c)
        torch.testing.assert_close(out.float(), want.to(dt).float())
        plan = kern.prepare([a.to("meta") for a in args])
        (o,) = plan.outputs
        assert tuple(o.shape) == tuple(want.shape) and o.is_contiguous()
        assert plan.grid[0] * plan.block[0] >= 1
        sources.append(kern.source)
    spec, _ = _spec(8, 3, 1, 1, 1, False, torch.float32, torch.channels_last)
    assert spec is None
    (res,) = toolchain.compile_many([toolchain.CompileJob("\n".join(sources), "dw_cases", "sm_90a")])
    assert not isinstance(res, toolchain.CompileError), str(res)
    for i in range(len(configs)):
        assert f"dw_case{i}".encode() in res.cubin


def test_a_launch_with_other_sizes_is_refused():
    spec, args = _spec(8, 3, 1, 1, 1, False, torch.float32)
    kern = generate_depthwise(spec, "dw_sizes", [0, 1])
    with pytest.raises(ValueError, match="shape"):
        kern.prepare([torch.empty(2, 8, 9, 12, device="meta"), args[1].to("meta")])


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,stride,padding,dilation,bias,dtype", [
    (3, 1, 1, 1, False, torch.float32), (3, 2, 1, 1, True, torch.float32),
    (5, 2, 2, 1, False, torch.float32), (3, 1, 2, 2, True, torch.float16),
    (3, 2, 1, 1, False, torch.bfloat16)])
def test_the_kernel_matches_eager_on_the_gpu(kernel, stride, padding, dilation, bias, dtype):
    """Compiled and launched like any candidate's kernel; eager's depthwise convolution
    within its dtype's tolerance (MobileNet-like plane sizes, odd widths included)."""
    from types import SimpleNamespace

    from stitch_backend.kernels import KernelRunner

    c, h, w = 32, 29, 37
    x = torch.randn(4, c, h, w, dtype=dtype, device="cuda")
    wt = torch.randn(c, 1, kernel, kernel, dtype=dtype, device="cuda")
    b = torch.randn(c, dtype=dtype, device="cuda") if bias else None

    def conv(x, wt, *bb):
        return aten.convolution(x, wt, bb[0] if bb else None, [stride] * 2, [padding] * 2,
                                [dilation] * 2, False, [0, 0], c)
    args = [x, wt] + ([b] if bias else [])
    gm = make_fx(conv, tracing_mode="fake")(*args)
    spec = depthwise_spec(next(n for n in gm.graph.nodes if n.op == "call_function"))
    kern = generate_depthwise(spec, "dw_gpu", list(range(len(args))))
    (res,) = toolchain.compile_many([toolchain.CompileJob(kern.source, "dw_gpu", "sm_90a")])
    assert not isinstance(res, toolchain.CompileError), str(res)
    cand = SimpleNamespace(cubin=res.cubin, kernel=kern, name="dw_gpu")
    (got,) = KernelRunner(cand, poison=True)(*args)
    want = torch.nn.functional.conv2d(x.float(), wt.float(), None if b is None else b.float(),
                                      stride, padding, dilation, c)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_split_statistics_variants_follow_the_generated_convolution_too():
    """A BatchNorm over few channels gets split-statistics alternatives after ATen's
    convolution; with a depthwise convolution, also after the generated one (named
    ``_dw_split``/``_dw_split1p``, entries distinct from the others')."""
    torch.manual_seed(0)
    model = DepthwiseBlock(4, 3, 1, False).train()
    rec, region, cand = _conv_candidate(model, torch.randn(8, 4, 32, 32))
    names = [a.name for a in cand.alternatives]
    assert any(n.endswith("_dw_split1p") for n in names), names
    entries = [k.entry for c in [cand, *cand.alternatives] for k in c.kernels
               if not isinstance(k, DepthwiseKernel)]
    by_candidate = [[k.entry for k in c.kernels] for c in [cand, *cand.alternatives]]
    assert all(len(set(e)) == len(e) for e in by_candidate)
    assert entries
    vals = {ph.name: ph.meta["val"] for ph in rec.gm.graph.find_nodes(op="placeholder")}
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(vals[n].shape, generator=gen) if vals[n].is_floating_point()
              else torch.zeros(vals[n].shape, dtype=vals[n].dtype) for n in region.inputs]
    want = region_module(rec.gm, region)(*inputs)
    for alt in cand.alternatives:
        if "_dw_split" in alt.name:
            assert isinstance(alt.stages[0].kernel, DepthwiseKernel)
            got = runner_for(alt, base=InterpretedRunner)(*inputs)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
