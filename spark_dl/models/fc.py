"""Fully-connected nets; the thesis net is 784-480-160-10 with sigmoid hidden units."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .activations import activation

__all__ = ["FCNet"]


class FCNet(nn.Module):
    """x (B, sizes[0]) -> logits (B, sizes[-1]); softmax lives in the loss (cross-entropy)."""

    def __init__(self, sizes: Sequence[int] = (784, 480, 160, 10), act: str = "sigmoid"):
        super().__init__()
        if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
            raise ValueError(f"sizes must list >= 2 positive layer widths, got {list(sizes)}")
        self.sizes = tuple(int(s) for s in sizes)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(self.sizes[:-1], self.sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(self.sizes) - 2:
                layers.append(activation(act))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(len(x), -1)                       # (B, ...) -> (B, in)
        if x.shape[1] != self.sizes[0]:
            raise ValueError(f"FCNet expects {self.sizes[0]} input features per sample, got "
                             f"{x.shape[1]}; set sizes[0] to the feature length")
        return self.net(x)

