"""The generated few-input-channel convolution (a network's stem): proposed as an
alternative for a conv region whose convolution reads at most four channels into a
channels-last output, the same epilogue stages after it; its sources compile with nvcc,
its values are checked on the CPU through the interpreter (torch's conv2d), and its CUDA
path against eager on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from stitch_backend import toolchain
from stitch_backend.codegen.stem_conv import StemConvKernel, generate_stem_conv, stem_spec
from stitch_backend.kernels import InterpretedRunner, runner_for
from stitch_backend.regions import region_module
from tests.agents.test_depthwise_alternative import _conv_candidate

aten = torch.ops.aten
CL = torch.channels_last


class Stem(nn.Module):
    def __init__(self, cin=3, cout=8, kernel=3, stride=1, bias=False):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=bias)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _region_inputs(rec, region):
    vals = {n.name: n.meta.get("val") for n in rec.gm.graph.nodes}
    gen = torch.Generator().manual_seed(1)
    out = []
    for n in region.inputs:
        v = vals[n]
        if not v.is_floating_point():
            out.append(torch.zeros(v.shape, dtype=v.dtype))
            continue
        t = torch.randn(v.shape, generator=gen)
        out.append(torch.empty_strided(v.shape, v.stride()).copy_(t))
    return out


@pytest.mark.parametrize("cin,kernel,stride,bias", [(3, 3, 1, False), (3, 7, 2, True), (2, 3, 2, False)],
                         ids=["3x3", "7x7_stride2_bias", "2ch_stride2"])
def test_alternative_computes_the_region(cin, kernel, stride, bias):
    torch.manual_seed(0)
    model = Stem(cin, 8, kernel, stride, bias).train()
    x = torch.randn(2, cin, 13, 11).contiguous(memory_format=CL)
    rec, region, cand = _conv_candidate(model, x)
    (alt,) = [a for a in cand.alternatives if a.name.endswith("_sc")]
    head, *epilogue = alt.stages
    assert isinstance(head.kernel, StemConvKernel) and epilogue
    assert [s.kernel for s in epilogue] == [s.kernel for s in cand.stages[1:]]
    inputs = _region_inputs(rec, region)
    want = region_module(rec.gm, region)(*inputs)
    got = runner_for(alt, base=InterpretedRunner)(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_split_statistics_variants_follow_it():
    torch.manual_seed(0)
    model = Stem(3, 8, 3, 1, False).train()
    rec, region, cand = _conv_candidate(model, torch.randn(4, 3, 32, 32).contiguous(memory_format=CL))
    splits = [a for a in cand.alternatives if "_sc_split" in a.name]
    assert splits, [a.name for a in cand.alternatives]
    inputs = _region_inputs(rec, region)
    want = region_module(rec.gm, region)(*inputs)
    for alt in splits:
        assert isinstance(alt.stages[0].kernel, StemConvKernel)
        got = runner_for(alt, base=InterpretedRunner)(*inputs)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _node(fn, *args):
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return next(n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target))


def _conv(stride, padding, dilation):
    def conv(x, w, *b):
        return aten.convolution(x, w, b[0] if b else None, [stride] * 2, [padding] * 2,
                                [dilation] * 2, False, [0, 0], 1)
    return conv


def test_which_convolutions_it_takes():
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=CL)
    w = torch.randn(8, 3, 3, 3)
    assert stem_spec(_node(_conv(1, 1, 1), x, w)) is not None
    # the flagged form the layout pass writes: aten._convolution(..., allow_tf32=False)
    flagged = _node(lambda x, w: aten._convolution(x, w, None, [1, 1], [1, 1], [1, 1], False,
                                                   [0, 0], 1, False, False, True, False), x, w)
    assert stem_spec(flagged) is not None
    assert stem_spec(_node(_conv(1, 1, 1), x.contiguous(), w)) is None          # NCHW output
    assert stem_spec(_node(_conv(1, 1, 1), torch.randn(2, 5, 16, 16).contiguous(memory_format=CL),
                           torch.randn(8, 5, 3, 3))) is None                   # 5 channels
    assert stem_spec(_node(_conv(1, 1, 1), x, torch.randn(6, 3, 3, 3))) is None  # 6 outputs
    assert stem_spec(_node(_conv(1, 1, 1), x.half(), w.half())) is None         # fp16
    grouped = _node(lambda x, w: aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False,
                                                  [0, 0], 3), x, torch.randn(6, 1, 3, 3))
    assert stem_spec(grouped) is None


@pytest.mark.nvcc
def test_specs_and_sources_compile_for_sm90a():
    """Strides, padding, dilation, bias, two to four input channels, NCHW or NHWC input:
    every source compiles; the interpreter and the launch give a channels-last output."""
    configs = [(3, 64, 3, 1, 1, 1, False, CL), (3, 64, 7, 2, 3, 1, True, CL),
               (2, 8, 3, 2, 1, 2, False, CL), (4, 32, 5, 1, 2, 1, True, None)]
    sources = []
    for i, (ci, co, k, s, p, d, b, layout) in enumerate(configs):
        x = torch.randn(2, ci, 15, 17)
        if layout is not None:
            x = x.contiguous(memory_format=layout)
        args = [x, torch.randn(co, ci, k, k)] + ([torch.randn(co)] if b else [])
        fn = _conv(s, p, d)
        node = _node(fn, *args)
        if layout is None:     # an NCHW input whose convolution writes channels-last
            node.meta["val"] = node.meta["val"].contiguous(memory_format=CL)
        spec = stem_spec(node)
        assert spec is not None and spec.bias == b and spec.x_strides == tuple(x.stride())
        kern = generate_stem_conv(spec, f"sc_case{i}", list(range(len(args))))
        (out,) = kern.interpret(args)
        want = torch.nn.functional.conv2d(*args[:2], args[2] if b else None, s, p, d)
        torch.testing.assert_close(out, want)
        assert out.is_contiguous(memory_format=CL)
        plan = kern.prepare([a.to("meta") for a in args])
        (o,) = plan.outputs
        assert tuple(o.shape) == tuple(want.shape) and o.is_contiguous(memory_format=CL)
        sources.append(kern.source)
    (res,) = toolchain.compile_many([toolchain.CompileJob("\n".join(sources), "sc_cases", "sm_90a")])
    assert not isinstance(res, toolchain.CompileError), str(res)
    for i in range(len(configs)):
        assert f"sc_case{i}".encode() in res.cubin


def test_a_launch_with_other_strides_is_refused():
    x = torch.randn(2, 3, 16, 16).contiguous(memory_format=CL)
    w = torch.randn(8, 3, 3, 3)
    kern = generate_stem_conv(stem_spec(_node(_conv(1, 1, 1), x, w)), "sc_strides", [0, 1])
    with pytest.raises(ValueError, match="strides"):
        kern.prepare([torch.empty(2, 3, 16, 16, device="meta"), w.to("meta")])


@pytest.mark.gpu
@pytest.mark.parametrize("ci,co,kernel,stride,padding,dilation,bias", [
    (3, 64, 3, 1, 1, 1, False), (3, 64, 7, 2, 3, 1, True), (3, 32, 3, 2, 1, 1, False),
    (2, 16, 3, 1, 2, 2, True), (4, 8, 5, 1, 2, 1, False)])
def test_the_kernel_matches_eager_on_the_gpu(ci, co, kernel, stride, padding, dilation, bias):
    """Compiled and launched like any candidate's kernel (poisoned output); eager's fp32
    convolution (TF32 off) within fp32 rounding, odd sizes included."""
    from types import SimpleNamespace

    from stitch_backend.kernels import KernelRunner

    x = torch.randn(4, ci, 37, 29, device="cuda").contiguous(memory_format=CL)
    wt = torch.randn(co, ci, kernel, kernel, device="cuda")
    args = [x, wt] + ([torch.randn(co, device="cuda")] if bias else [])
    kern = generate_stem_conv(stem_spec(_node(_conv(stride, padding, dilation), *args)), "sc_gpu",
                              list(range(len(args))))
    (res,) = toolchain.compile_many([toolchain.CompileJob(kern.source, "sc_gpu", "sm_90a")])
    assert not isinstance(res, toolchain.CompileError), str(res)
    cand = SimpleNamespace(cubin=res.cubin, kernel=kern, name="sc_gpu")
    (got,) = KernelRunner(cand, poison=True)(*args)
    want = torch.nn.functional.conv2d(x.double(), wt.double(), args[2].double() if bias else None,
                                      stride, padding, dilation)
    assert got.is_contiguous(memory_format=CL)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
