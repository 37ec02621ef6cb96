"""Three normalisations in a row: BatchNorm2d, GroupNorm, and an RMSNorm over channels
written with plain ops (as LLM code does), with a SiLU between."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, channels: int, groups: int, eps: float):
        super().__init__()
        self.bn = nn.BatchNorm2d(channels)
        self.gn = nn.GroupNorm(groups, channels)
        self.rms_weight = nn.Parameter(torch.ones(channels) + 0.1 * torch.randn(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.bn(x))
        x = self.gn(x)
        # RMS norm over channels: (b, c, h, w) -> (b, h, w, c) and back
        t = x.permute(0, 2, 3, 1)
        t = t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.rms_weight
        return t.permute(0, 3, 1, 2)


batch, channels, size, groups, eps = 8, 64, 32, 8, 1e-6


def get_inputs():
    return [torch.randn(batch, channels, size, size)]


def get_init_inputs():
    return [channels, groups, eps]
