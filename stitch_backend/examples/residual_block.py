"""A ResNet bottleneck block: 1x1 -> 3x3 -> 1x1 convolutions with batch norm, identity add."""

import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels: int, bottleneck: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, bottleneck, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(bottleneck)
        self.conv = nn.Conv2d(bottleneck, bottleneck, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(bottleneck)
        self.expand = nn.Conv2d(bottleneck, channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.reduce(x)))
        out = torch.relu(self.bn2(self.conv(out)))
        out = self.bn3(self.expand(out))
        return torch.relu(out + x)


batch, channels, bottleneck, size = 4, 128, 32, 28


def get_inputs():
    return [torch.randn(batch, channels, size, size)]


def get_init_inputs():
    return [channels, bottleneck]
