"""Transformer-style MLP: Linear -> GELU (exact) -> Linear, residual, then LayerNorm."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.up = nn.Linear(d_model, d_hidden)
        self.down = nn.Linear(d_hidden, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        return self.norm(x + self.down(h))


batch, tokens, d_model, d_hidden = 8, 64, 256, 1024


def get_inputs():
    return [torch.randn(batch, tokens, d_model)]


def get_init_inputs():
    return [d_model, d_hidden]
