"""The thesis CNN (§4.3): conv 5×5×6 → mean-pool 2 → conv 5×5×12 → mean-pool 2 →
conv 4×4×12 → FC softmax, on 28×28 inputs; ``widths`` gives wider variants."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .activations import activation

__all__ = ["ThesisCNN"]


class ThesisCNN(nn.Module):
    """x (B, 784) or (B, C, 28, 28) -> logits (B, num_classes). ``batch_norm``: a BatchNorm2d
    after every convolution (not in the thesis; what most CNNs users bring have)."""

    def __init__(self, widths: Sequence[int] = (6, 12, 12), num_classes: int = 10,
                 in_channels: int = 1, act: str = "relu", batch_norm: bool = False):
        super().__init__()
        if len(widths) != 3 or any(int(w) < 1 for w in widths):
            raise ValueError(f"widths must be 3 positive channel counts, got {list(widths)}")
        c1, c2, c3 = (int(w) for w in widths)
        self.in_channels = in_channels
        def conv(cin: int, cout: int, k: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, k)] + ([nn.BatchNorm2d(cout)] if batch_norm else [])
        self.features = nn.Sequential(
            *conv(in_channels, c1, 5), activation(act), nn.AvgPool2d(2),  # 28 -> 24 -> 12
            *conv(c1, c2, 5), activation(act), nn.AvgPool2d(2),           # 12 -> 8 -> 4
            *conv(c2, c3, 4), activation(act),                            # 4 -> 1
        )
        self.classifier = nn.Linear(c3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[1] == self.in_channels * 28 * 28:
            x = x.view(len(x), self.in_channels, 28, 28)
        if x.dim() != 4 or tuple(x.shape[1:]) != (self.in_channels, 28, 28):
            raise ValueError(f"ThesisCNN expects inputs (B, {self.in_channels}, 28, 28) or "
                             f"(B, {self.in_channels * 784}), got {tuple(x.shape)}")
        return self.classifier(self.features(x).flatten(1))    # (B, c3) -> (B, classes)
