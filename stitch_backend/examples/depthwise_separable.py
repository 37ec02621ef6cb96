"""A MobileNet block: depthwise 3x3 conv -> BN -> ReLU6 -> pointwise 1x1 conv -> BN -> ReLU6."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.depthwise = nn.Conv2d(in_channels, in_channels, kernel_size=3, stride=stride,
                                   padding=1, groups=in_channels, bias=False)
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.pointwise = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.bn1(self.depthwise(x)))
        return F.relu6(self.bn2(self.pointwise(x)))


batch, in_channels, out_channels, size, stride = 8, 64, 128, 32, 2


def get_inputs():
    return [torch.randn(batch, in_channels, size, size)]


def get_init_inputs():
    return [in_channels, out_channels, stride]
