"""Mixed precision: a training step under autocast (bf16/fp16) keeps its generated kernels
and gives outputs and gradients as close to an fp64 run as eager's (DESIGN.md's rule).

On the CPU the kernels run through the IR interpreter; the GPU test runs the same steps
under CUDA autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from stitch_backend.backend import StitchBackend
from stitch_backend.correctness import compare
from tests.zoo import zoo


class ConvSoftmaxPool(nn.Module):
    """Conv3d, softmax over channels, two 3-D max poolings (KernelBench L2 6's shape):
    under bf16 its pooling indices tie where values round alike."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(3, 16, 3)

    def forward(self, x):
        y = torch.softmax(self.conv(x), dim=1)
        return F.max_pool3d(F.max_pool3d(y, 2), 2)


def _models():
    out = {name: zoo()[name] for name in ("mlp", "conv_bn_relu", "transformer_block")}
    out["conv_softmax_pool"] = (ConvSoftmaxPool, lambda b: [torch.rand(b, 3, 10, 18, 18)])
    return out


def _step(model, inputs, device_type, dtype):
    with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
        out = model(*inputs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    gen = torch.Generator().manual_seed(3)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64
                                         ).to(o.device)).sum()
               for o in outs if o.is_floating_point())
    loss.backward()
    return ([o.detach() for o in outs],
            [p.grad.detach().clone() for p in model.parameters() if p.grad is not None])


def _check(name, device, dtype, options):
    cls, make_inputs = _models()[name]
    torch.manual_seed(0)
    model = cls().train().to(device)
    inputs = [x.to(device) for x in make_inputs(4)]
    reference = _step(copy.deepcopy(model).double(),
                      [x.double() if x.is_floating_point() else x for x in inputs],
                      device, None)
    eager = _step(copy.deepcopy(model), inputs, device, dtype)
    compiled_model = copy.deepcopy(model)
    backend = StitchBackend(options={"cache": False, **options})
    compiled = torch.compile(compiled_model, backend=backend)
    for call in (1, 2):   # the first verifies (and returns ATen's), the second runs kernels
        for p in compiled_model.parameters():
            p.grad = None
        got = _step(compiled, inputs, device, dtype)
        for what, a, e, r in zip(("output", "gradients"), got, eager, reference):
            cmp = compare(a, e, r)
            assert cmp.ok_design, f"{name} call {call} {what}: {cmp.reason}"
    stages = {rec.stage for rec in backend.records}
    assert {"forward", "backward"} <= stages, stages
    for rec in backend.records:
        assert not any("end-to-end check failed" in n for n in rec.notes), backend.report()
    forward = [r for rec in backend.records if rec.stage == "forward" for r in rec.plan.regions]
    assert any(r.backend == "kernel" for r in forward), backend.report()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(_models()))
def test_autocast_training_step_on_the_interpreter(name, dtype):
    _check(name, "cpu", dtype, {"cpu_interpret": True, "require_speedup": False})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(_models()))
def test_autocast_training_step_on_the_gpu(name, dtype):
    # the guard could send a settled step back to eager; this checks the kernels
    _check(name, "cuda", dtype, {"require_speedup": False, "eager_guard": False})
