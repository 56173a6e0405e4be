"""Luminance (Y) images in [0, 1], bicubic resizing and patch extraction."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..data.images import decode_image

__all__ = ["bicubic", "load_y", "modcrop", "patches", "rgb_to_y"]


def rgb_to_y(rgb: np.ndarray) -> np.ndarray:
    """uint8 (H, W, 3) or (H, W) -> float32 Y in [0, 1] (ITU-R BT.601, the SR convention:
    Y = 16 + 65.481 R + 128.553 G + 24.966 B on 0-255, with R, G, B in [0, 1])."""
    if rgb.ndim == 2:
        return rgb.astype(np.float32) / 255.0
    r, g, b = (rgb[..., i].astype(np.float64) / 255.0 for i in range(3))
    y = 16.0 + 65.481 * r + 128.553 * g + 24.966 * b
    return (y / 255.0).astype(np.float32)


def load_y(path: str | Path) -> np.ndarray:
    return rgb_to_y(decode_image(Path(path).read_bytes(), str(path)))


def modcrop(img: np.ndarray, scale: int) -> np.ndarray:
    """Crop so that height and width are multiples of ``scale``."""
    h, w = img.shape[:2]
    return img[:h - h % scale, :w - w % scale]


def bicubic(img: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bicubic resize of a float image (H, W) to ``size`` = (height, width) (Pillow, mode F)."""
    from PIL import Image
    out = Image.fromarray(img.astype(np.float32), mode="F").resize((size[1], size[0]),
                                                                   Image.BICUBIC)
    return np.array(out, dtype=np.float32)          # a writable copy


def patches(img: np.ndarray, size: int, stride: int) -> np.ndarray:
    """All size×size patches of a 2-D image at the given stride -> (n, size, size)."""
    h, w = img.shape
    if h < size or w < size:
        return np.zeros((0, size, size), img.dtype)
    view = np.lib.stride_tricks.sliding_window_view(img, (size, size))[::stride, ::stride]
    return np.ascontiguousarray(view.reshape(-1, size, size))
