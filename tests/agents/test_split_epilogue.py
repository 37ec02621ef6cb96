"""A pointwise region that reads only parts of a gemm's epilogue (attention's ``q * s``
and ``k * s``, each a third of the qkv projection) joins the gemm's epilogue kernel
(agents.epilogue_moves.absorb_split_epilogues): one launch less per attention layer.
Planned and run through the interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.agents.test_pool_epilogue import _compiled, _node_ops

MUL = "aten.mul."


class PackedAttention(nn.Module):
    """Attention as torch.nn.MultiheadAttention's packed projection and
    scaled_dot_product_attention's math path write it on the GPU: one projection made
    contiguous as (3, b, t, d), q and k each scaled by head_dim ** -0.25."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.in_proj = nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        x = x.transpose(0, 1)   # (t, b, d), as MultiheadAttention with batch_first
        qkv = self.in_proj(x).unflatten(-1, (3, d)).unsqueeze(0).transpose(0, -2)
        qkv = qkv.squeeze(-2).contiguous()
        q, k, v = (z.view(t, b * h, d // h).transpose(0, 1) for z in qkv)
        s = (d // h) ** -0.25
        att = torch.softmax((q * s) @ (k * s).transpose(-2, -1), dim=-1)
        return (att @ v).transpose(0, 1).reshape(t, b, d).transpose(0, 1)


def _eager_then_compiled(model, x, compile=_compiled):
    """The record and output of ``model`` compiled on ``x``, its values eager's."""
    with torch.no_grad():
        expected = model(x)
    rec, out = compile(model, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    return rec


def _scaling_host(rec):
    """The one region holding both scalings: a gemm region with the projection's copy."""
    ops = {r.id: _node_ops(rec, r) for r in rec.plan.regions}
    (host,) = [i for i, o in ops.items() if sum(MUL in op for op in o) == 2]
    assert "aten.mm.default" in ops[host] and "aten.clone.default" in ops[host]
    assert not [o for i, o in ops.items() if i != host and any(MUL in op for op in o)]
    region = rec.plan.regions[host]
    assert region.kind.value == "gemm"
    return region


def test_the_q_and_k_scaling_joins_the_projection_epilogue_and_values_are_eager():
    torch.manual_seed(0)
    rec = _eager_then_compiled(PackedAttention(), torch.randn(3, 5, 32))
    region = _scaling_host(rec)
    assert region.backend == "kernel", region.reason


@pytest.mark.gpu
def test_on_the_gpu_the_epilogue_kernel_scales_q_and_k():
    from stitch_backend.backend import StitchBackend

    def on_cuda(model, x):
        backend = StitchBackend(options={"cache": False})
        with torch.no_grad():
            out = torch.compile(model, backend=backend)(x)
        (rec,) = backend.records
        return rec, out

    torch.manual_seed(0)
    rec = _eager_then_compiled(PackedAttention(64, 4).cuda(), torch.randn(8, 16, 64, device="cuda"),
                               compile=on_cuda)
    region = _scaling_host(rec)
    # generated or ATen by the Verifier's timing; either way it was verified, or says why
    assert region.backend == "kernel" or region.reason, region


class _SplitAndWhole(nn.Module):
    """A projection whose whole (product-sized) value is returned beside a scaled part:
    the merged epilogue would hand on values of two sizes, so the scaling keeps its own
    region."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)

    def forward(self, x):
        y = self.lin(x).transpose(0, 1).contiguous()
        return y, y[..., :16] * 3.0


def test_parts_of_two_sizes_keep_their_own_region():
    torch.manual_seed(0)
    rec = _eager_then_compiled(_SplitAndWhole(), torch.randn(4, 6, 16))
    ops = {r.id: (r.kind.value, _node_ops(rec, r)) for r in rec.plan.regions}
    (owner,) = [k for k, o in ops.values() if any(MUL in op for op in o)]
    assert owner == "fused", ops


def training_step_matches(make, x):
    """One training step of ``make()`` compiled (the CPU interpreter) and of an eager copy
    with the same weights: the same gradients for ``x`` and every parameter. The backend."""
    from stitch_backend.backend import StitchBackend

    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    x = x.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False})
    torch.compile(model, backend=backend)(x).square().sum().backward()
    ref(x_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-4)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    return backend


def test_a_training_step_through_the_merged_epilogue_gives_eager_gradients():
    backend = training_step_matches(PackedAttention, torch.randn(3, 5, 32))
    (forward,) = [r for r in backend.records if r.stage == "forward"]
    assert _scaling_host(forward).backend == "kernel"
