"""The project's own small models, shaped like the layers real networks are made of."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=32, hidden=64, d_out=16):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.gelu(self.fc2(x))
        return self.fc3(x)


class ConvBNReLU(nn.Module):
    def __init__(self, c_in=3, c_out=8):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class PooledStem(nn.Module):
    """A ResNet stem: 7x7/2 conv, BatchNorm, ReLU, 3x3/2 max pool (overlapping windows),
    then an average pool with padding and a pointwise op after it."""

    def __init__(self, c_out=8):
        super().__init__()
        self.conv = nn.Conv2d(3, c_out, 7, 2, 3, bias=False)
        self.bn = nn.BatchNorm2d(c_out)

    def forward(self, x):
        y = F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, 2, 1)
        # scaled down: the zoo's training test sums squares, and gradients in the
        # thousands carry fp32 rounding of the order of its absolute tolerance
        return F.avg_pool2d(y, 3, 1, 1, count_include_pad=False) * 0.25


class ResidualBlock(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + x)


class DownsampleBlock(nn.Module):
    """A ResNet basic block whose shortcut is a 1x1 convolution and a BatchNorm."""

    def __init__(self, cin=4, cout=8):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.down(x))


class DepthwiseSeparable(nn.Module):
    def __init__(self, c_in=8, c_out=16):
        super().__init__()
        self.dw = nn.Conv2d(c_in, c_in, 3, padding=1, groups=c_in, bias=False)
        self.bn1 = nn.BatchNorm2d(c_in)
        self.pw = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)

    def forward(self, x):
        x = F.relu6(self.bn1(self.dw(x)))
        return F.hardswish(self.bn2(self.pw(x)))


class TransformerBlock(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ManualAttention(nn.Module):
    """Attention written out (bmm, scale, softmax, bmm), as many models do."""

    def __init__(self, d=16):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        return att @ v


class GRUCellModel(nn.Module):
    def __init__(self, d_in=16, hidden=24):
        super().__init__()
        self.cell = nn.GRUCell(d_in, hidden)

    def forward(self, x, h):
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
        return h


class LSTMCellModel(nn.Module):
    def __init__(self, d_in=16, hidden=24):
        super().__init__()
        self.cell = nn.LSTMCell(d_in, hidden)

    def forward(self, x, h, c):
        for t in range(x.shape[0]):
            h, c = self.cell(x[t], (h, c))
        return h, c


class ViewsAndInplace(nn.Module):
    """Views, in-place ops and a buffer mutation, which functionalisation must handle."""

    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        y = self.fc(x)
        y.relu_()
        z = y.view(-1, 4, 4).permute(0, 2, 1).contiguous()
        z.mul_(2.0).add_(1.0)
        z[:, 0] = 0.0
        self.steps += 1
        return z.flatten(1).tanh(), y.sum(dim=0)


class NormZoo(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.gn = nn.GroupNorm(2, c)
        self.ln = nn.LayerNorm([c])
        self.scale = nn.Parameter(torch.ones(c))

    def forward(self, x):
        y = self.gn(x)
        y = y.permute(0, 2, 3, 1)
        y = self.ln(y)
        rms = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        return torch.log_softmax(rms, dim=-1).logsumexp(dim=(1, 2))


class DropoutModel(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        y = F.dropout(F.relu(self.fc(x)), p=0.3, training=self.training)
        return y + 0.1 * torch.rand_like(y)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convolutions with BatchNorm, and a projected shortcut when the
    shape changes (the block of the 50-layer residual network)."""

    def __init__(self, c_in, width, stride):
        super().__init__()
        c_out = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(c_in, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, c_out, 1, bias=False), nn.BatchNorm2d(c_out))
        self.short = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                    nn.BatchNorm2d(c_out))
                      if stride != 1 or c_in != c_out else nn.Identity())

    def forward(self, x):
        return F.relu(self.body(x) + self.short(x))


class ResNet50Like(nn.Module):
    """ResNet-50-sized (16 bottleneck blocks, about 25M parameters): the warm-start
    budget is stated for a model of this size. Not in ``zoo()``: too big for every test."""

    def __init__(self, classes=1000):
        super().__init__()
        layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                  nn.MaxPool2d(3, 2, 1)]
        c = 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(c, width, stride if i == 0 else 1))
                c = width * 4
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def zoo() -> dict[str, tuple[type, callable]]:
    """name -> (model class, input factory taking a batch size)."""
    return {
        "mlp": (MLP, lambda b: [torch.randn(b, 32)]),
        "conv_bn_relu": (ConvBNReLU, lambda b: [torch.randn(b, 3, 12, 12)]),
        "pooled_stem": (PooledStem, lambda b: [torch.randn(b, 3, 24, 24)]),
        "residual_block": (ResidualBlock, lambda b: [torch.randn(b, 8, 10, 10)]),
        "residual_downsample": (DownsampleBlock, lambda b: [torch.randn(b, 4, 10, 10)]),
        "depthwise_separable": (DepthwiseSeparable, lambda b: [torch.randn(b, 8, 10, 10)]),
        "transformer_block": (TransformerBlock, lambda b: [torch.randn(b, 8, 32)]),
        "manual_attention": (ManualAttention, lambda b: [torch.randn(b, 6, 16)]),
        "gru_cell": (GRUCellModel, lambda b: [torch.randn(3, b, 16), torch.randn(b, 24)]),
        "lstm_cell": (LSTMCellModel,
                      lambda b: [torch.randn(3, b, 16), torch.randn(b, 24), torch.randn(b, 24)]),
        "views_and_inplace": (ViewsAndInplace, lambda b: [torch.randn(b, 16)]),
        "norm_zoo": (NormZoo, lambda b: [torch.randn(b, 8, 6, 6)]),
    }
