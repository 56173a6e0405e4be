"""SRCNN (Dong et al. 2014), the thesis's deep CNN: 9×9×64 → ReLU → 5×5×32 → ReLU → 5×5×1."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["SRCNN"]


class SRCNN(nn.Module):
    """y (B, C, H, W) bicubic-upscaled image -> (B, C, H, W) restored; 'same' padding.

    ``residual=True`` (not in the thesis; VDSR's global skip) returns y + body(y) with the last
    layer starting at zero: the network starts as the identity on its bicubic input and learns
    the missing detail, which converges in far fewer steps than learning the whole image.

    ``inputs`` (default ``channels``): input planes; the first ``channels`` are the image it
    restores (and adds to, when residual), the others side information. The super-resolution
    cascade's noisy skip (superres.cascade) uses ``inputs=2``: the denoised image and, beside
    it, the noisy input it came from, both upscaled."""

    def __init__(self, channels: int = 1, widths: tuple[int, int] = (64, 32),
                 kernels: tuple[int, int, int] = (9, 5, 5), residual: bool = False,
                 inputs: int | None = None):
        super().__init__()
        if any(k % 2 == 0 for k in kernels):
            raise ValueError(f"SRCNN kernel sizes must be odd for same-size output, got {kernels}")
        inputs = channels if inputs is None else inputs
        if inputs < channels:
            raise ValueError(f"SRCNN inputs ({inputs}) must include the {channels} channels "
                             f"it restores")
        self.channels = channels
        k1, k2, k3 = kernels
        self.body = nn.Sequential(
            nn.Conv2d(inputs, widths[0], k1, padding=k1 // 2), nn.ReLU(inplace=True),
            nn.Conv2d(widths[0], widths[1], k2, padding=k2 // 2), nn.ReLU(inplace=True),
            nn.Conv2d(widths[1], channels, k3, padding=k3 // 2))
        self.residual = residual
        if residual:
            nn.init.zeros_(self.body[-1].weight)
            nn.init.zeros_(self.body[-1].bias)

    @property
    def inputs(self) -> int:
        """Input planes (models saved before ``inputs`` existed have ``channels``)."""
        return self.body[0].in_channels

    @torch.no_grad()
    def active_units(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """For each ReLU layer, (units that fire anywhere on the batch ``x``, units). A unit
        that never fires on real inputs is dead: no gradient reaches its weights again, and
        Adam at 1e-3 kills most of the second layer in its first steps (docs/design/0041-srcnn-learning-rate.md)."""
        self._check(x)
        out, h = [], x
        for layer in self.body:
            h = layer(h)
            if isinstance(layer, nn.ReLU):
                out.append((int((h > 0).flatten(2).any(2).any(0).sum()), h.shape[1]))
        return out

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.inputs:
            raise ValueError(f"SRCNN expects images (B, {self.inputs}, H, W), got "
                             f"{tuple(x.shape)}; use the Y channel or set channels / inputs")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        out = self.body(x)
        return x[:, :self.channels] + out if self.residual else out
