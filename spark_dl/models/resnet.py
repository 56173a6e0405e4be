"""ResNet-18 for small images (CIFAR-style): a 3×3 stem without max-pool, BatchNorm, four
stages of two BasicBlocks (``width``, 2×, 4×, 8× channels, strides 1, 2, 2, 2), global average
pooling and a linear head. ``width`` 64 is the usual net (11.2M parameters for 10 classes);
16 is one a small machine trains in minutes."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["BasicBlock", "ResNet18"]


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm, added to the input (projected by a 1×1 convolution
    where the stride or the channels change)."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """x (B, C, H, W), or (B, C·S·S) flat rows of square S×S images -> logits
    (B, num_classes); any image size of at least 8×8 (32×32 in the usual use)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64):
        super().__init__()
        for name, v in (("num_classes", num_classes), ("in_channels", in_channels),
                        ("width", width)):
            if int(v) != v or v < 1:
                raise ValueError(f"ResNet18's {name} must be a positive integer, got {v!r}")
        self.in_channels, self.width = int(in_channels), int(width)
        w = self.width
        self.stem = nn.Sequential(nn.Conv2d(self.in_channels, w, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(w), nn.ReLU(inplace=True))
        stages, cin = [], w
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = w * 2 ** i
            stages += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, int(num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.in_channels
        if x.dim() == 2 and x.shape[1] % c == 0 and math.isqrt(x.shape[1] // c) ** 2 \
                == x.shape[1] // c:
            side = math.isqrt(x.shape[1] // c)
            x = x.view(len(x), c, side, side)
        if x.dim() != 4 or x.shape[1] != c:
            raise ValueError(f"ResNet18 expects images (B, {c}, H, W) or flat rows of "
                             f"{c} square images (B, {c}·S·S), got {tuple(x.shape)}: give "
                             f"fit shape=({c}, H, W), or build it with in_channels= the "
                             f"images' channels")
        out = self.stages(self.stem(x))
        return self.head(out.mean((2, 3)))                     # global average pool
