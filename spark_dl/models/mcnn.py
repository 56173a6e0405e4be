"""MCNN (Zhang et al., 2016), the counting network of seed 002: three columns of
CONV-POOL-CONV-POOL-CONV-CONV with large (9×9), medium (7×7) and small (5×5) first filters,
their feature maps stacked and fused by a 1×1 convolution into a density map; the count is
the map's sum. The pools halve the resolution twice, so the map is 1/4 of the image's side;
``variant="deconv"`` is the seed's modification: two stride-2 transposed convolutions at the
end of every column restore the full resolution (the seed found it better)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["COLUMNS", "MCNN"]

# (kernel sizes, channels) per column: Zhang et al.'s large, medium and small columns
COLUMNS = {"large": ((9, 7, 7, 7), (16, 32, 16, 8)),
           "medium": ((7, 5, 5, 5), (20, 40, 20, 10)),
           "small": ((5, 3, 3, 3), (24, 48, 24, 12))}


def _column(in_channels: int, kernels, channels, deconv: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    c = in_channels
    for i, (k, out) in enumerate(zip(kernels, channels)):
        layers += [nn.Conv2d(c, out, k, padding=k // 2), nn.ReLU(inplace=True)]
        if i < 2:
            layers.append(nn.MaxPool2d(2))
        c = out
    if deconv:                          # back to the input's resolution, 2x at a time
        k = kernels[-1]
        for _ in range(2):
            layers += [nn.ConvTranspose2d(c, c, k, stride=2, padding=k // 2, output_padding=1),
                       nn.ReLU(inplace=True)]
    return nn.Sequential(*layers)


class MCNN(nn.Module):
    """(B, in_channels, H, W) -> density map (B, 1, H/4, W/4), or (B, 1, H, W) with
    ``variant="deconv"``; H and W multiples of 4."""

    def __init__(self, in_channels: int = 3, variant: str = "pool"):
        super().__init__()
        if variant not in ("pool", "deconv"):
            raise ValueError(f"variant must be 'pool' (the map at 1/4 resolution) or 'deconv' "
                             f"(full resolution), got {variant!r}")
        self.variant = variant
        self.columns = nn.ModuleList(_column(in_channels, k, c, variant == "deconv")
                                     for k, c in COLUMNS.values())
        self.fuse = nn.Conv2d(sum(c[-1] for _, c in COLUMNS.values()), 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 4 or x.shape[-2] % 4:
            raise ValueError(f"MCNN needs images whose sides are multiples of 4, got "
                             f"{tuple(x.shape[-2:])}")
        return self.fuse(torch.cat([col(x) for col in self.columns], 1))

    @staticmethod
    def count(density: torch.Tensor) -> torch.Tensor:
        """Objects per image: the sum of each density map."""
        return density.flatten(1).sum(1)
