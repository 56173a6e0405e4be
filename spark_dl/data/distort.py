"""Random elastic + affine deformations of digits (Simard et al. 2003; "infinite MNIST").

Every sample index maps to one deformation: samples are generated in blocks of
``BLOCK`` indices, each block from its own generator seeded by ``(seed, block)``, so sample i is
the same whatever the number of partitions or the order in which executors run.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Distortion", "distort_range"]

BLOCK = 256


@dataclasses.dataclass(frozen=True)
class Distortion:
    """Deformation ranges; angles in degrees, translations and sigma in pixels."""

    rotation: float = 10.0          # uniform in [-rotation, rotation]
    scale: float = 0.1              # each axis scaled by uniform 1 ± scale
    shear: float = 0.15             # shear factor uniform in [-shear, shear]
    translation: float = 2.0        # uniform in [-translation, translation] pixels
    elastic_alpha: float = 2.0      # largest elastic displacement of a sample, pixels
    elastic_sigma: float = 4.0      # std of the Gaussian that smooths the displacement field

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"Distortion.{f.name} must be finite and >= 0, got {v!r}")
        if self.scale >= 1:
            raise ValueError(f"Distortion.scale must be < 1, got {self.scale}")


def _gaussian_kernel(sigma: float) -> torch.Tensor:
    radius = max(1, int(math.ceil(3 * sigma)))  # noqa: RUF046 - sigma may be a NumPy scalar
    t = torch.arange(-radius, radius + 1, dtype=torch.float32)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()


def _deform(images: torch.Tensor, gen: torch.Generator, d: Distortion) -> torch.Tensor:
    """images (B, 1, H, W) float in [0, 1] -> deformed (B, 1, H, W)."""
    B, _, H, W = images.shape
    u = lambda *shape: torch.rand(*shape, generator=gen) * 2 - 1  # noqa: E731  uniform(-1, 1)
    angle = u(B) * math.radians(d.rotation)
    sx, sy = 1 + u(B) * d.scale, 1 + u(B) * d.scale
    shear = u(B) * d.shear
    tx, ty = u(B) * d.translation * 2 / W, u(B) * d.translation * 2 / H   # normalised coords
    cos, sin = torch.cos(angle), torch.sin(angle)
    # inverse map output -> input: rotation @ shear @ scale
    a, b = cos * sx, (cos * shear - sin) * sy
    c, e = sin * sx, (sin * shear + cos) * sy
    theta = torch.stack([torch.stack([a, b, tx], 1), torch.stack([c, e, ty], 1)], 1)  # (B, 2, 3)
    grid = F.affine_grid(theta, (B, 1, H, W), align_corners=False)                    # (B, H, W, 2)
    if d.elastic_alpha > 0 and d.elastic_sigma > 0:
        field = u(B * 2, 1, H, W)
        k = _gaussian_kernel(d.elastic_sigma)
        r = len(k) // 2
        field = F.conv2d(F.pad(field, (r, r, 0, 0), mode="reflect" if r < W else "replicate"),
                         k.view(1, 1, 1, -1))
        field = F.conv2d(F.pad(field, (0, 0, r, r), mode="reflect" if r < H else "replicate"),
                         k.view(1, 1, -1, 1))
        field = field / field.flatten(1).abs().amax(1).clamp_min(1e-6).view(-1, 1, 1, 1)
        field = field.view(B, 2, H, W).permute(0, 2, 3, 1) * d.elastic_alpha
        grid = grid + field * torch.tensor([2 / W, 2 / H])
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def distort_range(source: np.ndarray, labels: np.ndarray, start: int, stop: int, seed: int,
                  distortion: Distortion = Distortion()) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``start..stop-1`` of the extended set built from ``source``.

    source: (N, H, W) uint8 digits, labels: (N,). Returns features (n, H*W) float32 in [0, 1]
    and labels (n,) int64. Pure function of its arguments (see module docstring).
    """
    if stop <= start:
        return np.zeros((0, source.shape[1] * source.shape[2]), np.float32), np.zeros(0, np.int64)
    H, W = source.shape[1:]
    xs, ys = [], []
    for block in range(start // BLOCK, (stop - 1) // BLOCK + 1):
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, block]).generate_state(1)[0]))
        pick = torch.randint(len(source), (BLOCK,), generator=gen).numpy()
        imgs = torch.from_numpy(source[pick].astype(np.float32) / 255.0).view(BLOCK, 1, H, W)
        out = _deform(imgs, gen, distortion).clamp_(0, 1).view(BLOCK, H * W).numpy()
        lo, hi = max(start, block * BLOCK) - block * BLOCK, min(stop, (block + 1) * BLOCK) - block * BLOCK
        xs.append(out[lo:hi])
        ys.append(labels[pick[lo:hi]])
    return np.concatenate(xs), np.concatenate(ys).astype(np.int64)
