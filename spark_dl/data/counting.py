"""Synthetic counting scenes (seed 002's flower counting, MCNN's crowd counting), made in the
executors: flowers of varied size and overlap on a textured field, their centres as point
annotations, and the ground-truth density map as a sum of Gaussian kernels whose spread
follows the geometry (MCNN's geometry-adaptive kernel: σ_i = β × the mean distance from
point i to its k nearest neighbours). Every kernel is normalised over the image, so a map
integrates to the number of objects exactly, objects at the border included.

Scene i depends only on (seed, i), never on the number of partitions:

    df = counting_scenes(spark, n=2000, size=64, partitions=4, seed=0)
    # features: binary (3 x size x size uint8, RGB planes), label: array<float> (the density
    # map at size / down), count: int
    x, density, points = scene(i, seed=0, size=64)          # one scene, on the driver
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from ..errors import DataError
from .mnist import images_to_arrow

__all__ = ["COUNTING_SCHEMA", "counting_scenes", "density_map", "scene", "scenes"]

COUNTING_SCHEMA = "features binary, label array<float>, count int"

_PETALS = np.array([[250, 220, 40], [245, 245, 240], [240, 120, 170], [200, 120, 230],
                    [250, 150, 40]], np.float32)


def density_map(points: np.ndarray, size: int, down: int = 1, beta: float = 0.3, k: int = 3,
                sigma_alone: float | None = None) -> np.ndarray:
    """The density map (size / down)² of ``points`` (n, 2) as (x, y) pixel coordinates of a
    size × size image: one Gaussian per point with σ = β × the mean distance to its ``k``
    nearest neighbours (``sigma_alone``, default size / 16, when it has none), each
    normalised to sum 1 over the image, then summed over down × down blocks: the map sums to
    the number of points whatever ``down``."""
    if size % down:
        raise DataError(f"the scene size {size} is not a multiple of down={down}: the "
                        f"density map must tile the image; pick size and down so that it is")
    points = np.asarray(points, np.float64).reshape(-1, 2)
    out = np.zeros((size, size), np.float64)
    if len(points) == 0:
        return out.reshape(size // down, down, size // down, down).sum((1, 3)).astype(np.float32)
    alone = sigma_alone or size / 16
    if len(points) > 1:
        d = np.sqrt(((points[:, None, :] - points[None, :, :]) ** 2).sum(-1))
        d.sort(axis=1)
        near = d[:, 1:min(k, len(points) - 1) + 1].mean(1)
        sigmas = np.clip(beta * near, 0.75, size / 4)
    else:
        sigmas = np.array([alone])
    grid = np.arange(size) + 0.5
    for (x, y), s in zip(points, sigmas):
        gx = np.exp(-((grid - x) ** 2) / (2 * s * s))
        gy = np.exp(-((grid - y) ** 2) / (2 * s * s))
        out += np.outer(gy / gy.sum(), gx / gx.sum())
    return out.reshape(size // down, down, size // down, down).sum((1, 3)).astype(np.float32)


def scene(i: int, seed: int = 0, size: int = 64, max_objects: int = 40, down: int = 4,
          empty_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scene ``i``: (image (3, size, size) uint8, density map (size/down)² float32, points
    (n, 2)). Flowers are larger towards the bottom (a field seen in perspective) and overlap;
    the field is a textured green with shading."""
    rng = np.random.default_rng([seed, i])
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    # the field: low-frequency shading plus grass texture
    field = np.zeros((size, size), np.float32)
    for _ in range(4):
        fx, fy, ph = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 2 * np.pi)
        field += np.sin(2 * np.pi * (fx * xx + fy * yy) / size + ph) / 4
    field += rng.normal(0, 0.25, (size, size)).astype(np.float32)
    base = np.array([60, 120, 40], np.float32) * rng.uniform(0.7, 1.2)
    img = base[:, None, None] * (1 + 0.25 * field)[None]
    n = 0 if rng.random() < empty_fraction else int(rng.integers(1, max_objects + 1))
    points = np.stack([rng.uniform(0, size, n), rng.uniform(0, size, n)], 1)
    for (x, y) in points:
        r = size / 40 * (1 + 2.5 * y / size) * rng.uniform(0.7, 1.3)
        color = _PETALS[rng.integers(len(_PETALS))] * rng.uniform(0.8, 1.05)
        d2 = (xx - x) ** 2 + (yy - y) ** 2
        petal = np.clip(1.5 - np.sqrt(d2) / r, 0, 1)[None]               # soft disc
        img = img * (1 - petal) + color[:, None, None] * petal
        heart = np.clip(1.5 - np.sqrt(d2) / (0.35 * r), 0, 1)[None]      # darker centre
        img = img * (1 - heart) + np.array([120, 80, 20], np.float32)[:, None, None] * heart
    img = np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)
    return img, density_map(points, size, down), points


def scenes(lo: int, hi: int, seed: int = 0, size: int = 64, max_objects: int = 40,
           down: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scenes lo..hi-1: images (n, 3, size, size) uint8, maps (n, (size/down)²), counts (n,)."""
    made = [scene(i, seed, size, max_objects, down) for i in range(lo, hi)]
    if not made:
        m = size // down
        return (np.zeros((0, 3, size, size), np.uint8), np.zeros((0, m * m), np.float32),
                np.zeros(0, np.int32))
    return (np.stack([m[0] for m in made]), np.stack([m[1].reshape(-1) for m in made]),
            np.array([len(m[2]) for m in made], np.int32))


def counting_scenes(spark, n: int, size: int = 64, partitions: int = 2, seed: int = 0,
                    max_objects: int = 40, down: int = 4, start: int = 0):
    """A DataFrame of ``n`` scenes (ids start..start+n-1) generated inside the executors,
    partition by partition (COUNTING_SCHEMA): nothing is read or downloaded."""
    if n < 0 or partitions < 1 or size < 8 or max_objects < 0:
        raise ValueError(f"need n >= 0, partitions >= 1, size >= 8 and max_objects >= 0; got "
                         f"n={n}, partitions={partitions}, size={size}, "
                         f"max_objects={max_objects}")
    if size % down:
        raise DataError(f"the scene size {size} is not a multiple of down={down}")

    def generate(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for b in batches:
            ids = b.column(0).to_numpy()              # spark.range: consecutive ids
            for lo in range(int(ids.min()), int(ids.max()) + 1, 64):   # 64 scenes a batch
                x, maps, counts = scenes(lo, min(lo + 64, int(ids.max()) + 1), seed, size,
                                         max_objects, down)
                yield images_to_arrow(x, maps, count=counts)

    return spark.range(start, start + n, 1, numPartitions=partitions).mapInArrow(
        generate, COUNTING_SCHEMA)
