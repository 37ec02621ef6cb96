"""Concatenation is fused like any pointwise op (it was a fallback region of its own):
a ViT-style class token, and a DenseNet-style concatenation feeding a BatchNorm."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from stitch_backend.backend import StitchBackend


class ClassToken(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.proj = nn.Linear(8, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 7, d))
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        x = self.proj(x)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.norm(x)


class DenseConcat(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn(torch.cat([x, self.conv(x)], 1)))


def _run(model, x):
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    backend = StitchBackend(options={"cpu_interpret": True, "cache": False,
                                     "require_speedup": False, "layout_race": False})
    with torch.no_grad():
        got = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(got, reference(x), rtol=1e-4, atol=1e-4)
    (rec,) = backend.records
    (region,) = [r for r in rec.plan.regions if any(n.startswith("cat") for n in r.nodes)]
    return rec, region


def test_a_class_token_concatenation_is_fused_with_what_follows():
    rec, region = _run(ClassToken().eval(), torch.randn(3, 6, 8))
    assert region.kind.value != "fallback" and region.backend == "kernel", region.reason
    assert any(n.startswith("add") for n in region.nodes), region.nodes
    assert not [r for r in rec.plan.regions if r.kind.value == "fallback"]


def test_a_concatenation_feeding_a_batchnorm_runs_generated():
    rec, region = _run(DenseConcat().train(), torch.randn(2, 4, 6, 6))
    assert region.backend == "kernel", region.reason
    assert not [r for r in rec.plan.regions if r.kind.value == "fallback"]
