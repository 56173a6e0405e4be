"""Whole images through patch models: the SSDA denoises fixed-size LR patches, so an image of any
size is cut into overlapping tiles, each tile is denoised, and the tiles are stitched back by
averaging where they overlap. The CNN is fully convolutional and takes the upscaled image whole.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .cascade import takes_noisy
from .images import bicubic
from .prepare import dihedral

__all__ = ["apply_tiled", "self_ensemble", "super_resolve", "tile_starts"]


def tile_starts(n: int, size: int, stride: int) -> list[int]:
    """Starts of tiles of ``size`` covering 0..n at ``stride``, the last one flush with the
    end (so that every pixel is covered and no tile leaves the image)."""
    if n < size:
        raise ValueError(f"the image side {n} is smaller than a tile ({size}); pad it or use "
                         f"a smaller tile")
    starts = list(range(0, n - size + 1, stride))
    if starts[-1] != n - size:
        starts.append(n - size)
    return starts


def apply_tiled(img: np.ndarray, fn: Callable[[np.ndarray], np.ndarray], size: int,
                stride: int, batch: int = 1024) -> np.ndarray:
    """fn maps (n, size, size) tiles to (n, size, size); returns the stitched (H, W) image,
    every pixel the mean of the tiles that cover it."""
    h, w = img.shape
    ys, xs = tile_starts(h, size, stride), tile_starts(w, size, stride)
    coords = [(y, x) for y in ys for x in xs]
    out = np.zeros((h, w), np.float64)
    weight = np.zeros((h, w), np.float64)
    for i in range(0, len(coords), batch):
        part = coords[i:i + batch]
        tiles = np.stack([img[y:y + size, x:x + size] for y, x in part])
        res = fn(tiles)
        for (y, x), t in zip(part, res):
            out[y:y + size, x:x + size] += t
            weight[y:y + size, x:x + size] += 1
    return (out / weight).astype(np.float32)


def self_ensemble(fn: Callable[[np.ndarray], np.ndarray], img: np.ndarray) -> np.ndarray:
    """The mean of fn over the 8 flips/rotations of ``img``, each output turned back
    (Timofte et al. 2016, "Seven ways to improve example-based single image super
    resolution"; EDSR's "+" models): fn must map an image to one of the same orientation."""
    outs = []
    for i, view in enumerate(dihedral(img)):            # view i: rot90 by i // 2, then flip i % 2
        out = fn(view)
        outs.append(np.rot90(out[:, ::-1] if i % 2 else out, -(i // 2)))
    return np.mean(outs, axis=0).astype(np.float32)


@torch.no_grad()
def super_resolve(lr: np.ndarray, scale: int, ssda=None, cnn=None, lr_patch: int = 16,
                  stride: int = 8, ensemble: bool = False) -> np.ndarray:
    """Noisy LR Y image (H, W) in [0, 1] -> (H*scale, W*scale): the SSDA (if given) denoises
    it tile by tile, bicubic upscales it, the CNN (if given) restores it; clipped to [0, 1].
    A CNN with two inputs also gets the noisy LR, upscaled (Cascade's noisy skip).
    ``ensemble``: the mean over the 8 flips/rotations of the input (see self_ensemble), 8 times
    the work."""
    if ensemble:
        return self_ensemble(lambda v: super_resolve(v, scale, ssda, cnn, lr_patch, stride), lr)
    x = noisy = lr.astype(np.float32)
    if ssda is not None:
        ssda.eval()

        def denoise(t: np.ndarray) -> np.ndarray:
            flat = torch.from_numpy(t.reshape(len(t), -1))
            return ssda(flat).reshape(t.shape).numpy()
        x = apply_tiled(x, denoise, lr_patch, stride)
    size = (x.shape[0] * scale, x.shape[1] * scale)
    up = bicubic(np.clip(x, 0, 1), size)
    if cnn is not None:
        cnn.eval()
        planes = [up] + ([bicubic(noisy, size)] if takes_noisy(cnn) else [])
        up = cnn(torch.from_numpy(np.stack(planes))[None])[0, 0].numpy()
    return np.clip(up, 0.0, 1.0)
