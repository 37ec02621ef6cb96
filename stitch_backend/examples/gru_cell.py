"""A GRU unrolled over a short sequence, gates written out (two GEMMs and a pointwise
chain per step); returns every step's hidden state and the last one."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.x2h = nn.Linear(input_size, 3 * hidden_size)
        self.h2h = nn.Linear(hidden_size, 3 * hidden_size)

    def forward(self, x: torch.Tensor, h: torch.Tensor):
        steps = []
        for t in range(x.shape[0]):
            xr, xz, xn = self.x2h(x[t]).chunk(3, dim=-1)
            hr, hz, hn = self.h2h(h).chunk(3, dim=-1)
            r = torch.sigmoid(xr + hr)
            z = torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            h = (1 - z) * n + z * h
            steps.append(h)
        return torch.stack(steps), h


seq_len, batch, input_size, hidden_size = 8, 32, 128, 256


def get_inputs():
    return [torch.randn(seq_len, batch, input_size), torch.randn(batch, hidden_size)]


def get_init_inputs():
    return [input_size, hidden_size]
