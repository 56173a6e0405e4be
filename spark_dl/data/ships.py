"""Synthetic satellite-like scenes for ship segmentation (seed 000, which used the Airbus ship
data): a sea with waves, sometimes a coastline and clouds, and 0..N ships as rotated elongated
hulls of varied size (many scenes hold none, as in the Airbus set), with their masks.

Scene i depends only on (seed, i), never on the number of partitions:

    df = ship_scenes(spark, n=2000, size=64, partitions=4, seed=0)
    # features: binary (3 x size x size uint8), label: array<float> (the size x size mask)
    image, mask, ships = ship_scene(i, seed=0, size=64)      # one scene, on the driver
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from .mnist import images_to_arrow

__all__ = ["SHIP_SCHEMA", "ship_batch", "ship_scene", "ship_scenes"]

SHIP_SCHEMA = "features binary, label array<float>, ships int"


def _smooth_noise(rng, size: int, scale: int) -> np.ndarray:
    """Value noise: a coarse random grid bilinearly upsampled to size x size, in [0, 1]."""
    n = max(2, size // scale + 2)
    coarse = rng.random((n, n)).astype(np.float32)
    t = np.linspace(0, n - 1.001, size, dtype=np.float32)
    i, f = t.astype(int), t - t.astype(int)
    rows = coarse[i] * (1 - f)[:, None] + coarse[i + 1] * f[:, None]
    return rows[:, i] * (1 - f)[None] + rows[:, i + 1] * f[None]


def _grown(m: np.ndarray) -> np.ndarray:
    """``m`` and its 8 neighbours."""
    p = np.pad(m, 1)
    h, w = m.shape
    return np.logical_or.reduce([p[dy:dy + h, dx:dx + w] for dy in range(3) for dx in range(3)])


def ship_scene(i: int, seed: int = 0, size: int = 64, max_ships: int = 4,
               empty_fraction: float = 0.5) -> tuple[np.ndarray, np.ndarray, int]:
    """Scene ``i``: (image (3, size, size) uint8, mask (size, size) float32 in {0, 1}, ships)."""
    rng = np.random.default_rng([seed, i])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    # the sea: deep blue, waves along a random direction, speckle
    angle = rng.uniform(0, np.pi)
    waves = np.sin((np.cos(angle) * xx + np.sin(angle) * yy) * rng.uniform(0.6, 1.4) +
                   3 * _smooth_noise(rng, size, 16))
    sea = np.array([20, 60, 95], np.float32) * rng.uniform(0.7, 1.3)
    img = sea[:, None, None] * (1 + 0.12 * waves + 0.08 * rng.normal(size=(size, size)))[None]
    land = np.zeros((size, size), bool)
    if rng.random() < 0.3:                        # a coastline: land beyond a wavy edge
        edge = size * rng.uniform(0.15, 0.4) + size * 0.15 * (_smooth_noise(rng, size, 12)[0]
                                                             - 0.5)
        side = rng.integers(4)
        coord = [xx, yy, size - xx, size - yy][side]
        along = [yy, xx, yy, xx][side].astype(int).clip(0, size - 1)
        land = coord < edge[along]
        ground = np.array([150, 140, 100], np.float32)[:, None, None] * \
            (0.8 + 0.4 * _smooth_noise(rng, size, 6))[None]
        img = np.where(land[None], ground, img)
    mask = np.zeros((size, size), np.float32)
    n = 0 if rng.random() < empty_fraction else int(rng.integers(1, max_ships + 1))
    placed = 0
    for _ in range(n * 4):                         # a few tries each to land on water
        if placed == n:
            break
        length = size * rng.uniform(0.08, 0.3)
        width = length * rng.uniform(0.18, 0.3)
        cx, cy, th = rng.uniform(0, size), rng.uniform(0, size), rng.uniform(0, np.pi)
        u = (xx - cx) * np.cos(th) + (yy - cy) * np.sin(th)          # along the hull
        v = -(xx - cx) * np.sin(th) + (yy - cy) * np.cos(th)
        taper = np.clip(1 - np.maximum(u / (length / 2) - 0.6, 0) / 0.4, 0, 1)  # pointed bow
        hull = (np.abs(u) <= length / 2) & (np.abs(v) <= width / 2 * taper)
        if not hull.any() or (hull & land).any() or (_grown(hull) & (mask > 0)).any():
            continue                               # ships never touch: one part, one ship
        shade = rng.uniform(150, 240)
        img = np.where(hull[None], np.array([shade, shade, shade * 0.95],
                                            np.float32)[:, None, None], img)
        mask[hull] = 1.0
        placed += 1
    if rng.random() < 0.3:                         # clouds over everything, masks unchanged
        cloud = np.clip((_smooth_noise(rng, size, 10) - 0.55) * 2.5, 0, 0.85)[None]
        img = img * (1 - cloud) + 235 * cloud
    img = np.clip(img, 0, 255).astype(np.uint8)
    return img, mask, placed


def ship_batch(lo: int, hi: int, seed: int = 0, size: int = 64, max_ships: int = 4
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scenes lo..hi-1: images (n, 3, size, size) uint8, masks (n, size, size), ship counts."""
    made = [ship_scene(i, seed, size, max_ships) for i in range(lo, hi)]
    if not made:
        return (np.zeros((0, 3, size, size), np.uint8), np.zeros((0, size, size), np.float32),
                np.zeros(0, np.int32))
    return (np.stack([m[0] for m in made]), np.stack([m[1] for m in made]),
            np.array([m[2] for m in made], np.int32))


def ship_scenes(spark, n: int, size: int = 64, partitions: int = 2, seed: int = 0,
                max_ships: int = 4, start: int = 0):
    """A DataFrame of ``n`` scenes (ids start..start+n-1) made inside the executors."""
    if n < 0 or partitions < 1 or size < 16 or max_ships < 0:
        raise ValueError(f"need n >= 0, partitions >= 1, size >= 16 and max_ships >= 0; got "
                         f"n={n}, partitions={partitions}, size={size}, max_ships={max_ships}")

    def generate(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            ids = b.column(0).to_numpy()              # spark.range: consecutive ids
            for lo in range(int(ids.min()), int(ids.max()) + 1, 64):   # 64 scenes a batch
                x, masks, ships = ship_batch(lo, min(lo + 64, int(ids.max()) + 1), seed, size,
                                             max_ships)
                yield images_to_arrow(x, masks, ships=ships)

    return spark.range(start, start + n, 1, numPartitions=partitions).mapInArrow(
        generate, SHIP_SCHEMA)
