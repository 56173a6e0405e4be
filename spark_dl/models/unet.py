"""Seed 000's U-Net for ship segmentation: an encoder of bottleneck blocks (1×1 conv from in
to out − in channels, 3×3, 1×1 to out − in, concatenated with the block's input: out
channels), max pooling between them, a decoder of transposed convolutions and skip
concatenations, and a sigmoid output (a per-pixel ship probability).

Its loss is the Airbus kernels' mixed loss the seed used: α × focal(γ) − log(dice), α = 10,
γ = 2 (the seed's "α = 10, β = 2"); ``segmentation`` scores the masks (IoU, Dice and the
Airbus challenge's object-level F2).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

__all__ = ["Bottleneck", "FocalDiceLoss", "UNet"]


NORMS = ("group", "batch")


def _norm(channels: int, kind: str = "group") -> nn.Module:
    """"group": group normalisation (one group), the same in training and evaluation, free of
    running statistics and of BatchNorm's batch dependence (micro-batch accumulation equals
    the big batch); "batch": BatchNorm, whose running statistics the parameter server
    averages over the workers (spark_dl.transport.ps.buffers)."""
    if kind not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {kind!r}")
    return nn.GroupNorm(1, channels) if kind == "group" else nn.BatchNorm2d(channels)


class Bottleneck(nn.Module):
    """in -> out channels, same size: [x, 1×1 -> 3×3 -> 1×1 (out − in channels)]."""

    def __init__(self, cin: int, cout: int, norm: str = "group"):
        super().__init__()
        if cout <= cin:
            raise ValueError(f"a bottleneck block widens: out ({cout}) must exceed in ({cin})")
        grow = cout - cin
        self.body = nn.Sequential(
            nn.Conv2d(cin, grow, 1), _norm(grow, norm), nn.ReLU(inplace=True),
            nn.Conv2d(grow, grow, 3, padding=1), _norm(grow, norm), nn.ReLU(inplace=True),
            nn.Conv2d(grow, grow, 1), _norm(grow, norm), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


class UNet(nn.Module):
    """(B, in_channels, H, W) -> (B, 1, H, W) ship probabilities; H, W multiples of
    2 ** (len(widths) - 1). ``norm``: "group" (default) or "batch" (BatchNorm)."""

    def __init__(self, in_channels: int = 3, widths: tuple = (16, 32, 64, 128),
                 norm: str = "group"):
        super().__init__()
        self.widths = tuple(widths)
        chans = (in_channels, *widths)
        self.down = nn.ModuleList(Bottleneck(a, b, norm) for a, b in itertools.pairwise(chans))
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i], widths[i - 1], 2, stride=2)
                                for i in range(len(widths) - 1, 0, -1))
        self.merge = nn.ModuleList(
            nn.Sequential(nn.Conv2d(2 * widths[i - 1], widths[i - 1], 3, padding=1),
                          _norm(widths[i - 1], norm), nn.ReLU(inplace=True))
            for i in range(len(widths) - 1, 0, -1))
        self.head = nn.Conv2d(widths[0], 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = 2 ** (len(self.widths) - 1)
        if x.shape[-1] % k or x.shape[-2] % k:
            raise ValueError(f"this U-Net needs image sides that are multiples of {k}, got "
                             f"{tuple(x.shape[-2:])}")
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        for up, merge, skip in zip(self.up, self.merge, reversed(skips[:-1])):
            x = merge(torch.cat([up(x), skip], 1))
        return torch.sigmoid(self.head(x))


class FocalDiceLoss:
    """α × focal loss (γ) − log(soft Dice) on probabilities ``p`` against masks ``y``:
    focal = mean(−(1 − p_t)^γ log p_t), p_t = p where y = 1 else 1 − p; dice = (2 Σ p y + 1) /
    (Σ p + Σ y + 1) over the whole batch."""

    def __init__(self, alpha: float = 10.0, gamma: float = 2.0, eps: float = 1e-6):
        self.alpha, self.gamma, self.eps = alpha, gamma, eps

    def __call__(self, p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if p.shape != y.shape:
            from ..errors import DataError
            raise DataError(f"the masks are {tuple(y.shape[1:])} but the model outputs "
                            f"{tuple(p.shape[1:])}: give one mask per image, as large as the "
                            f"image")
        dtype = torch.promote_types(p.dtype, torch.float32)   # bf16/fp16 round 1 - eps to 1
        p, y = p.to(dtype).clamp(self.eps, 1 - self.eps), y.to(dtype)
        pt = torch.where(y > 0.5, p, 1 - p)
        focal = (-(1 - pt) ** self.gamma * torch.log(pt)).mean()
        dice = (2 * (p * y).sum() + 1) / (p.sum() + y.sum() + 1)
        return self.alpha * focal - torch.log(dice)
